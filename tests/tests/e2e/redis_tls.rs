//! `rediss://`: a throwaway `redis-server` that speaks TLS on one port (its plain port stays for
//! the test's own reads), with a CA and server certificate generated here. The store verifies
//! the server's chain and name: against the system's roots by default (so an unknown CA is
//! refused, and `SSL_CERT_FILE` names a private CA), or against the roots the app gives a
//! connection of its own (`redis::Client::build_with_tls`). `#insecure`, the redis crate's way
//! to turn verification off, is refused before connecting, as a setting.

use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::redis::RedisStore;
use idempotency_actix::store::{
    IdempotencyStore, ReserveOutcome, StoreError, StoredResponse, WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::faults::pay;
use idempotency_e2e::proc::{run_idem_cli_with_env, PaymentsApp};
use idempotency_e2e::raw_http::{free_port, send_once};
use idempotency_e2e::redis_server::{connection, RedisServer};

use super::redis_store::scope;
use super::tls_certs::{make_certs, Certs};

/// A server with TLS on its own port (clients need not show a certificate) next to its plain
/// port; returns it and the TLS port.
fn tls_server(certs: &Certs) -> (RedisServer, u16) {
    let (crt, key, ca) = (
        certs.path("server.crt"),
        certs.path("server.key"),
        certs.path("ca.crt"),
    );
    // Another TLS port per attempt: a port taken between `free_port` and the bind makes the
    // server exit, and `RedisServer` only picks its plain port anew.
    let mut failed = String::new();
    let (server, port) = (0..5)
        .find_map(|_| {
            let port = free_port();
            let tls_port = port.to_string();
            RedisServer::try_start_with(&[
                "--tls-port",
                &tls_port,
                "--tls-cert-file",
                &crt,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--tls-auth-clients",
                "no",
            ])
            .map_err(|why| failed = why)
            .ok()
            .map(|server| (server, port))
        })
        .unwrap_or_else(|| panic!("no TLS redis-server started: {failed}"));
    // The plain port answering does not mean the TLS one listens: wait for a TLS handshake.
    wait_for_tls(port, certs);
    (server, port)
}

/// Until a TLS connection trusting `ca.crt` answers PING on `port` (20 s at most).
fn wait_for_tls(port: u16, certs: &Certs) {
    let started = Instant::now();
    loop {
        let answered = trusting_client(port, certs)
            .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(1)))
            .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn));
        if answered.is_ok() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "redis-server's TLS port {port} did not answer: {answered:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A client for `rediss://127.0.0.1:<port>/` that trusts the test CA (and only it).
fn trusting_client(port: u16, certs: &Certs) -> redis::RedisResult<redis::Client> {
    redis::Client::build_with_tls(
        format!("rediss://127.0.0.1:{port}/"),
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(certs.read("ca.crt")),
        },
    )
}

/// A cycle over TLS: a miss reserves, `complete` applies, the retry replays, and the record
/// is really in Redis (read back over the plain port).
async fn cycle(store: &impl IdempotencyStore, plain_url: &str, key: &str) {
    let scope = scope("tls", key);
    let fp = Fingerprint([7; 32]);
    let lease = Duration::from_secs(60);
    let ReserveOutcome::Reserved { token } = store.reserve(&scope, &fp, lease).await.unwrap()
    else {
        panic!("the first reserve over TLS did not reserve");
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![("x-raw".into(), Bytes::from_static(&[0xff, 0]))],
        body: Bytes::from_static(b"over tls"),
    };
    let ttl = Duration::from_secs(3600);
    let written = store.complete(&scope, &token, &response, ttl).await;
    assert_eq!(written.unwrap(), WriteOutcome::Applied);
    match store.reserve(&scope, &fp, lease).await.unwrap() {
        ReserveOutcome::Completed {
            response: stored, ..
        } => assert_eq!(stored, response),
        other => panic!("the retry over TLS: {other:?}"),
    }
    let mut plain = connection(plain_url).await;
    let pattern = format!("*{key}*");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(&pattern)
        .query_async(&mut plain)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "one record for {key} in Redis: {keys:?}");
}

/// The app's own TLS connection (the way to trust a private CA in code): the store runs its
/// whole cycle over it.
#[tokio::test]
async fn a_store_over_the_apps_tls_connection_runs_a_whole_cycle() {
    let certs = make_certs();
    let (redis, tls_port) = tls_server(&certs);
    let client = trusting_client(tls_port, &certs).unwrap();
    let conn = redis::aio::ConnectionManager::new(client).await.unwrap();
    let store = RedisStore::builder().with_connection(conn).await.unwrap();
    cycle(&store, &redis.url(), "k-app-tls").await;
}

/// `RedisStore::connect("rediss://...")` checks the chain against the system's roots, which do
/// not hold the test CA: refused, promptly, with an error that does not show the password;
/// `#insecure` is refused before connecting, as a setting. Nothing is written.
#[tokio::test]
async fn rediss_refuses_an_unknown_ca_and_the_insecure_fragment() {
    let certs = make_certs();
    let (redis, tls_port) = tls_server(&certs);
    for url in [
        format!("rediss://:s3cret-pw@127.0.0.1:{tls_port}/"),
        format!("rediss://:s3cret-pw@127.0.0.1:{tls_port}/#insecure"),
    ] {
        let started = Instant::now();
        let outcome = RedisStore::builder()
            .connection_timeout(Duration::from_secs(1))
            .connect(&url)
            .await;
        let Err(e) = outcome else {
            panic!("{url}: connected although nothing trusts the server's CA");
        };
        let said = e.to_string();
        assert!(
            !said.contains("s3cret"),
            "the error shows the password: {said}"
        );
        if url.ends_with("#insecure") {
            // Refused as a setting, saying why, not reported as an outage.
            assert!(
                matches!(e, StoreError::Backend(_)) && said.contains("#insecure"),
                "{url}: {e:?}"
            );
        }
        // Three connection attempts of 1 s at most, and the eviction check is never reached.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{url}: refused only after {:?}",
            started.elapsed()
        );
    }
    let mut plain = connection(&redis.url()).await;
    let size: u64 = redis::cmd("DBSIZE").query_async(&mut plain).await.unwrap();
    assert_eq!(size, 0);
}

/// The processes: the payments example with `REDIS_URL=rediss://...` and the CA trusted through
/// `SSL_CERT_FILE` runs a payment once and replays it; `idem-cli` reads that record over TLS,
/// with another CA trusted it fails with one line (exit 3), and `#insecure` is a usage error.
#[test]
fn the_example_and_idem_cli_over_rediss_with_a_private_ca() {
    let certs = make_certs();
    let (_redis, tls_port) = tls_server(&certs);
    let url = format!("rediss://127.0.0.1:{tls_port}/");
    let ca = certs.path("ca.crt");
    let app = PaymentsApp::start(&[("REDIS_URL", &url), ("SSL_CERT_FILE", &ca)]);
    assert!(app.log().contains("store: Redis"), "log:\n{}", app.log());
    let request = pay("acct-tls", "k-rediss", 700, None);
    let first = send_once(&app.addr, &request, Duration::from_secs(10)).unwrap();
    assert_eq!(first.status, 201, "{}", first.describe());
    assert!(!first.is_replay());
    let retry = send_once(&app.addr, &request, Duration::from_secs(10)).unwrap();
    assert_eq!(retry.status, 201, "{}", retry.describe());
    assert!(
        retry.is_replay(),
        "the retry over TLS: {}",
        retry.describe()
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(app.stats().total, 1);

    let shown = run_idem_cli_with_env(
        "REDIS_URL",
        &url,
        &[("SSL_CERT_FILE", &ca)],
        &["list", "--tenant", "acct-tls"],
    );
    let out = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.status.success() && out.contains("k-rediss"),
        "idem-cli list over TLS: {shown:?}"
    );

    // Trusting another CA in place of the system's roots.
    let other_ca = certs.path("other-ca.crt");
    let refused = run_idem_cli_with_env(
        "REDIS_URL",
        &url,
        &[("SSL_CERT_FILE", &other_ca)],
        &["list"],
    );
    let err = String::from_utf8_lossy(&refused.stderr);
    // Exit 3: the server refused us (docs/cli.md's exit codes), as for a database.
    assert_eq!(refused.status.code(), Some(3), "{refused:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains("certificate"), "names the cause: {err}");

    // `#insecure` is a usage error (exit 2) that says what to do instead.
    let insecure = run_idem_cli_with_env("REDIS_URL", &format!("{url}#insecure"), &[], &["list"]);
    let err = String::from_utf8_lossy(&insecure.stderr);
    assert_eq!(insecure.status.code(), Some(2), "{insecure:?}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains("SSL_CERT_FILE"), "{err}");
}
