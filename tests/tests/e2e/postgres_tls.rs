//! TLS: a throwaway cluster with `ssl=on` that refuses plain connections, and a CA plus server
//! certificate generated here with rcgen (no `openssl` binary needed, so the test always runs
//! where PostgreSQL's `initdb` is installed). `sslmode=require` connects (and runs a
//! whole reserve/complete cycle through the pool), `verify-full` with `sslrootcert` verifies
//! chain and host name, `verify-ca` only the chain, and wrong roots or names are refused.

use std::time::Duration;

use bytes::Bytes;
use diesel::sql_types::Bool;
use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres::{self, PostgresStore};
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, ReserveOutcome, Scope, StoreError, StoredResponse, WriteOutcome,
};
use idempotency_e2e::{ClusterError, TempCluster};

use super::tls_certs::{make_certs, Certs};

fn start_tls_cluster(certs: &Certs) -> Option<TempCluster> {
    let hba = b"local all all trust\n\
                hostssl all all 127.0.0.1/32 trust\n\
                hostnossl all all 127.0.0.1/32 reject\n";
    let key = certs.read("server.key");
    let crt = certs.read("server.crt");
    let files: [(&str, &[u8]); 3] = [
        ("server.key", &key),
        ("server.crt", &crt),
        ("pg_hba.conf", hba),
    ];
    match TempCluster::start(
        &[
            "ssl = on",
            "ssl_cert_file = 'server.crt'",
            "ssl_key_file = 'server.key'",
        ],
        &files,
    ) {
        Ok(cluster) => Some(cluster),
        Err(ClusterError::NotInstalled) => {
            idempotency_e2e::skip_without_binaries("the TLS cluster tests");
            None
        }
        Err(e) => panic!("starting the TLS cluster: {e}"),
    }
}

#[derive(diesel::QueryableByName)]
struct Ssl {
    #[diesel(sql_type = Bool)]
    ssl: bool,
}

async fn connected_with_tls(url: &str) -> Result<bool, StoreError> {
    let mut conn = postgres::establish(url).await?;
    let row = diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .get_result::<Ssl>(&mut conn)
        .await
        .map_err(postgres::classify_error)?;
    Ok(row.ssl)
}

#[tokio::test]
async fn tls_connections_per_sslmode() {
    let certs = make_certs();
    let Some(cluster) = start_tls_cluster(&certs) else {
        eprintln!("SKIPPED: initdb/pg_ctl are not installed");
        return;
    };
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port);
    let ca = certs.path("ca.crt");
    let other_ca = certs.path("other-ca.crt");

    // The server refuses plain connections, so success below means TLS.
    assert!(
        connected_with_tls(&base).await.is_err(),
        "plain must be refused"
    );
    assert!(connected_with_tls(&format!("{base}?sslmode=disable"))
        .await
        .is_err());

    assert!(connected_with_tls(&format!("{base}?sslmode=require"))
        .await
        .unwrap());
    assert!(connected_with_tls(&format!("{base}?sslmode=prefer"))
        .await
        .unwrap());
    let full = format!("{base}?sslmode=verify-full&sslrootcert={ca}");
    assert!(connected_with_tls(&full).await.unwrap());
    let by_name = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
        cluster.port
    );
    assert!(connected_with_tls(&by_name).await.unwrap());
    assert!(
        connected_with_tls(&format!("{base}?sslmode=verify-ca&sslrootcert={ca}"))
            .await
            .unwrap()
    );

    // Wrong roots: refused by every verifying mode (and by `require` given a root file,
    // which libpq treats as verify-ca).
    for mode in ["verify-full", "verify-ca", "require"] {
        let url = format!("{base}?sslmode={mode}&sslrootcert={other_ca}");
        assert!(
            connected_with_tls(&url).await.is_err(),
            "{mode} with a foreign CA"
        );
    }

    // Wrong name: the certificate is for localhost/127.0.0.1, we claim another host.
    let wrong_name = format!(
        "postgres://postgres@db.invalid:{}/postgres?hostaddr=127.0.0.1&sslrootcert={ca}",
        cluster.port
    );
    let err = connected_with_tls(&format!("{wrong_name}&sslmode=verify-full")).await;
    assert!(matches!(err, Err(StoreError::Unavailable(_))), "{err:?}");
    assert!(
        connected_with_tls(&format!("{wrong_name}&sslmode=verify-ca"))
            .await
            .unwrap()
    );

    // Migrations and a whole reserve/complete/replay cycle through the pool, over TLS.
    for url in [format!("{base}?sslmode=require"), full.clone()] {
        store_cycle(&url).await;
    }
    drop(cluster);
}

async fn store_cycle(url: &str) {
    postgres::run_migrations(url).await.unwrap();
    let store = PostgresStore::builder(url)
        .connection_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let scope = Scope {
        tenant: "tls".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: format!("{:?}", idempotency_actix::store::ReservationToken::random()),
    };
    let fp = Fingerprint([9; 32]);
    let ReserveOutcome::Reserved { token } = store
        .reserve(&scope, &fp, Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("reserve over TLS");
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(b"over tls"),
    };
    assert_eq!(
        store
            .complete(&scope, &token, &response, Duration::from_secs(60))
            .await
            .unwrap(),
        WriteOutcome::Applied
    );
    match store
        .reserve(&scope, &fp, Duration::from_secs(60))
        .await
        .unwrap()
    {
        ReserveOutcome::Completed {
            response: stored, ..
        } => assert_eq!(stored, response),
        other => panic!("{other:?}"),
    }
}

/// Passwords as they appear in the URL, and as the server knows them. Raw `?`, `/`, `#`, `&`
/// and `:` are accepted by the driver (it ends the credentials at the first `@`); `@` itself
/// must be percent-encoded.
const PASSWORDS: [(&str, &str, &str); 6] = [
    ("pw_question", "pa?ss", "pa?ss"),
    ("pw_slash", "se/cret", "se/cret"),
    ("pw_hash", "pa#ss", "pa#ss"),
    ("pw_at", "p%40ss", "p@ss"),
    ("pw_digits", "12?34", "12?34"),
    (
        "pw_mixed",
        "a%2Fb?c/d#e&sslmode=disable:f",
        "a/b?c/d#e&sslmode=disable:f",
    ),
];

/// A cluster where everyone but `postgres` logs in with a SCRAM password, over TLS or not
/// (`ssl_on` decides whether the server offers TLS), with one role per [`PASSWORDS`] entry.
async fn password_cluster(certs: &Certs, ssl_on: bool) -> Option<TempCluster> {
    let hba = b"local all all trust\n\
                host all postgres 127.0.0.1/32 trust\n\
                host all all 127.0.0.1/32 scram-sha-256\n";
    let key = certs.read("server.key");
    let crt = certs.read("server.crt");
    let files: [(&str, &[u8]); 3] = [
        ("server.key", &key),
        ("server.crt", &crt),
        ("pg_hba.conf", hba),
    ];
    let ssl = if ssl_on { "ssl = on" } else { "ssl = off" };
    let cluster = match TempCluster::start(
        &[
            ssl,
            "ssl_cert_file = 'server.crt'",
            "ssl_key_file = 'server.key'",
        ],
        &files,
    ) {
        Ok(cluster) => cluster,
        Err(ClusterError::NotInstalled) => {
            idempotency_e2e::skip_without_binaries("the password cluster tests");
            return None;
        }
        Err(e) => panic!("starting the cluster: {e}"),
    };
    let mut admin = postgres::establish(&cluster.url()).await.unwrap();
    for (role, _, password) in PASSWORDS {
        diesel::sql_query(format!("CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
            .execute(&mut admin)
            .await
            .unwrap();
    }
    Some(cluster)
}

/// Guards issue 9 item 6: `sslmode` (and `sslrootcert`) were looked for after the URL's first
/// `?`, so a `?` in the password hid them, the mode counted as absent and the connection was
/// made in plaintext (`pg_stat_ssl.ssl = false`). Here every password with `?`, `/`, `#` or a
/// percent-encoded `@` logs in (SCRAM: the password really is parsed right) over TLS with
/// `require` and `verify-full`, and `require` against a server without TLS fails instead of
/// falling back. The old code connected in plaintext for the `?` passwords.
#[tokio::test]
async fn sslmode_is_read_from_the_real_query_whatever_the_password_holds() {
    let certs = make_certs();
    let Some(tls) = password_cluster(&certs, true).await else {
        eprintln!("SKIPPED: initdb/pg_ctl are not installed");
        return;
    };
    let ca = certs.path("ca.crt");
    for (role, in_url, _) in PASSWORDS {
        let base = format!("postgres://{role}:{in_url}@127.0.0.1:{}/postgres", tls.port);
        let plain = connected_with_tls(&format!("{base}?sslmode=disable")).await;
        assert!(matches!(plain, Ok(false)), "{role} disable: {plain:?}");
        let required = connected_with_tls(&format!("{base}?sslmode=require")).await;
        assert!(matches!(required, Ok(true)), "{role} require: {required:?}");
        let verified =
            connected_with_tls(&format!("{base}?sslmode=verify-full&sslrootcert={ca}")).await;
        assert!(
            matches!(verified, Ok(true)),
            "{role} verify-full: {verified:?}"
        );
        // A foreign CA: the certificate options are read too, so this is refused.
        let other = certs.path("other-ca.crt");
        let foreign =
            connected_with_tls(&format!("{base}?sslmode=verify-full&sslrootcert={other}")).await;
        assert!(foreign.is_err(), "{role} foreign CA: {foreign:?}");
    }
    drop(tls);

    let Some(plain_server) = password_cluster(&certs, false).await else {
        return;
    };
    for (role, in_url, _) in PASSWORDS {
        let base = format!(
            "postgres://{role}:{in_url}@127.0.0.1:{}/postgres",
            plain_server.port
        );
        let plain = connected_with_tls(&format!("{base}?sslmode=disable")).await;
        assert!(matches!(plain, Ok(false)), "{role} disable: {plain:?}");
        let required = connected_with_tls(&format!("{base}?sslmode=require")).await;
        assert!(
            matches!(required, Err(StoreError::Unavailable(_))),
            "{role}: require against a server without TLS must fail: {required:?}"
        );
    }
}

/// Guards the `sslrootcert=system` downgrade (review finding): libpq 16 reads it as "check the
/// server against the system trust store", verify-full by default, any weaker mode an error.
/// Here it connected in plaintext without an sslmode (`Ok(false)` against this server, which
/// takes both) and with `require` or `prefer` accepted any certificate (`Ok(true)` with this
/// one, which no system root signed). Now the certificate is checked, and refused; a weaker
/// mode is refused before any connection is made.
#[tokio::test]
async fn sslrootcert_system_verifies_against_the_system_roots() {
    let certs = make_certs();
    let Some(cluster) = password_cluster(&certs, true).await else {
        eprintln!("SKIPPED: initdb/pg_ctl are not installed");
        return;
    };
    let base = format!("postgres://postgres@127.0.0.1:{}/postgres", cluster.port);
    for query in [
        "sslrootcert=system",
        "sslmode=verify-full&sslrootcert=system",
    ] {
        let result = connected_with_tls(&format!("{base}?{query}")).await;
        assert!(
            matches!(result, Err(StoreError::Unavailable(_))),
            "{query}: a certificate no system root signed must be refused: {result:?}"
        );
    }
    for mode in ["disable", "allow", "prefer", "require", "verify-ca"] {
        let result = connected_with_tls(&format!("{base}?sslmode={mode}&sslrootcert=system")).await;
        match result {
            Err(StoreError::Backend(e)) => {
                let e = e.to_string();
                assert!(e.contains("sslrootcert=system"), "{mode}: {e}");
            }
            other => panic!("{mode} with sslrootcert=system must be refused: {other:?}"),
        }
    }
    // The same server with its own CA: the test above fails for the right reason.
    let own = connected_with_tls(&format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        certs.path("ca.crt")
    ))
    .await;
    assert!(matches!(own, Ok(true)), "{own:?}");
}
