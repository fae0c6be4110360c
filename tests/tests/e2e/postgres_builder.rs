//! `PostgresStoreBuilder` against a real PostgreSQL: every pool option is applied (to the bb8
//! pool, or to the server session through the startup packet) and leaves a store that works,
//! the TLS choices of the URL, and the errors of unusable options and URLs: a `StoreError`,
//! never a panic, never the password.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use diesel::sql_types::{Bool, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::{self, PostgresStore};
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};
use idempotency_e2e::proxy::{at_local_port, delaying_proxy, host_port, Hold, PgProxy};
use idempotency_e2e::records::records_table;
use idempotency_e2e::{eventually, TestDb};

const FP: Fingerprint = Fingerprint([9; 32]);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
/// The password of the URLs whose errors are checked: it must never appear in a message.
const PASSWORD: &str = "Pw-S3cret-42";

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "acct_1".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn response(key: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("location".into(), Bytes::from(format!("/payments/{key}")))],
        body: Bytes::from(format!("{{\"key\":\"{key}\"}}")),
    }
}

/// A whole request's life on `store`: reserve, a duplicate sees it in flight, complete, and
/// the retry replays the exact response.
async fn round_trip(store: &PostgresStore, key: &str) {
    let scope = scope(key);
    let token = match store.reserve(&scope, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("{key}: expected a reservation, got {other:?}"),
    };
    match store.reserve(&scope, &FP, LEASE).await {
        Ok(ReserveOutcome::InFlight { .. }) => {}
        other => panic!("{key}: expected in flight, got {other:?}"),
    }
    match store.complete(&scope, &token, &response(key), TTL).await {
        Ok(WriteOutcome::Applied) => {}
        other => panic!("{key}: complete gave {other:?}"),
    }
    // Twice: with the replay fast path on, the second one is the plain SELECT.
    for _ in 0..2 {
        match store.reserve(&scope, &FP, LEASE).await {
            Ok(ReserveOutcome::Completed {
                fingerprint,
                response: replayed,
                expires_in,
            }) => {
                assert_eq!(fingerprint, FP);
                assert_eq!(replayed, response(key));
                let left = expires_in.unwrap_or_default();
                assert!(
                    left > TTL - Duration::from_secs(60) && left <= TTL,
                    "{left:?}"
                );
            }
            other => panic!("{key}: expected a replay, got {other:?}"),
        }
    }
}

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    value: String,
}

#[derive(diesel::QueryableByName)]
struct Ssl {
    #[diesel(sql_type = Bool)]
    ssl: bool,
}

/// A server setting as a connection of `store`'s pool sees it.
async fn setting(store: &PostgresStore, name: &str) -> String {
    let mut conn = store.pool().get().await.expect("a pooled connection");
    diesel::sql_query("SELECT current_setting($1) AS value")
        .bind::<Text, _>(name)
        .get_result::<Setting>(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("reading {name}: {e}"))
        .value
}

/// A server setting as a plain connection to `url` (outside any store) sees it.
async fn server_setting(url: &str, name: &str) -> String {
    let mut conn = postgres::establish(url).await.expect("connect");
    diesel::sql_query("SELECT current_setting($1) AS value")
        .bind::<Text, _>(name)
        .get_result::<Setting>(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("reading {name}: {e}"))
        .value
}

/// Whether the pooled connections of `store` are encrypted.
async fn pooled_tls(store: &PostgresStore) -> Result<bool, StoreError> {
    let mut conn = store
        .pool()
        .get()
        .await
        .map_err(|e| StoreError::unavailable(e.to_string()))?;
    diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .get_result::<Ssl>(&mut *conn)
        .await
        .map(|row| row.ssl)
        .map_err(postgres::classify_error)
}

/// `url` with one more connection parameter, in its own syntax (URL query or `key=value`).
fn with_param(url: &str, key: &str, value: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let encoded: String = value
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'/' => {
                    char::from(b).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}{key}={encoded}")
    } else {
        let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
        format!("{url} {key}='{quoted}'")
    }
}

/// A file removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &[u8]) -> TempFile {
        let path = std::env::temp_dir().join(format!(
            "idem-builder-{}-{}-{name}",
            std::process::id(),
            ReservationToken::random().as_uuid()
        ));
        std::fs::write(&path, contents).expect("writing a temporary file");
        TempFile(path)
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The message of a `StoreError::Backend`, checked to be free of the password.
fn backend_message(result: Result<PostgresStore, StoreError>, url: &str) -> String {
    match result {
        Err(error @ StoreError::Backend(_)) => {
            let message = error.to_string();
            let debug = format!("{error:?}");
            assert!(
                !message.contains(PASSWORD) && !debug.contains(PASSWORD),
                "the password leaked for {url:?}: {message} / {debug}"
            );
            message
        }
        Err(other) => panic!("{url:?}: expected a Backend error, got {other:?}"),
        Ok(_) => panic!("{url:?} was accepted"),
    }
}

#[tokio::test]
async fn the_defaults_give_a_working_store() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .build()
        .await
        .unwrap();
    let config = store.pool().config();
    assert_eq!(config.max_size, postgres::DEFAULT_MAX_SIZE);
    assert_eq!(config.min_idle, None);
    assert_eq!(
        config.connection_timeout,
        postgres::DEFAULT_CONNECTION_TIMEOUT
    );
    // bb8's own defaults, set explicitly.
    assert_eq!(config.idle_timeout, Some(Duration::from_secs(600)));
    assert_eq!(config.max_lifetime, Some(Duration::from_secs(1800)));
    assert_eq!(
        store.pool().state().connections,
        0,
        "connections are opened lazily"
    );
    store.check().await.unwrap();
    round_trip(&store, "defaults").await;
    // The server's own settings are kept.
    assert_eq!(
        setting(&store, "synchronous_commit").await,
        server_setting(&db.url, "synchronous_commit").await
    );
    assert_eq!(
        setting(&store, "statement_timeout").await,
        server_setting(&db.url, "statement_timeout").await
    );
    let debug = format!("{store:?}");
    assert!(debug.contains("connection_timeout: 2s"), "{debug}");
}

#[tokio::test]
async fn every_pool_option_is_applied_and_the_store_works() {
    let db = TestDb::new().await;
    let builder = PostgresStore::builder(db.url.clone())
        .max_size(3)
        .min_idle(Some(2))
        .connection_timeout(Duration::from_millis(1500))
        .query_timeout(None)
        .statement_timeout(Some(Duration::from_millis(250)))
        .idle_timeout(Some(Duration::from_secs(120)))
        .max_lifetime(Some(Duration::from_secs(900)))
        .purge_batch(2)
        .synchronous_commit(false)
        .replay_fast_path(true);
    let debug = format!("{builder:?}");
    for part in [
        "max_size: 3",
        "min_idle: Some(2)",
        "connection_timeout: 1.5s",
        "query_timeout: None",
        "statement_timeout: Some(250ms)",
        "idle_timeout: Some(120s)",
        "max_lifetime: Some(900s)",
        "purge_batch: 2",
        "synchronous_commit: false",
        "replay_fast_path: true",
    ] {
        assert!(debug.contains(part), "{part:?} not in {debug}");
    }
    let store = builder.build().await.unwrap();
    let config = store.pool().config();
    assert_eq!(config.max_size, 3);
    assert_eq!(config.min_idle, Some(2));
    assert_eq!(config.connection_timeout, Duration::from_millis(1500));
    assert_eq!(config.idle_timeout, Some(Duration::from_secs(120)));
    assert_eq!(config.max_lifetime, Some(Duration::from_secs(900)));
    // min_idle: the pool opens its idle connections by itself.
    let pool = store.pool().clone();
    assert!(
        eventually(Duration::from_secs(10), || {
            let pool = pool.clone();
            async move { pool.state().idle_connections >= 2 }
        })
        .await,
        "{:?}",
        store.pool().state()
    );
    round_trip(&store, "all-options").await;
    // The session settings sent in the startup packet.
    assert_eq!(setting(&store, "synchronous_commit").await, "off");
    assert_eq!(setting(&store, "statement_timeout").await, "250ms");
    // ... and the server enforces the statement timeout.
    let mut conn = store.pool().get().await.unwrap();
    let error = conn.batch_execute("SELECT pg_sleep(2)").await.unwrap_err();
    assert!(error.to_string().contains("statement timeout"), "{error}");
    drop(conn);
    // max_size: never more than 3 connections, however many requests.
    let keys: Vec<String> = (0..12).map(|i| format!("parallel-{i}")).collect();
    let calls = keys.iter().map(|key| round_trip(&store, key));
    futures_util::future::join_all(calls).await;
    assert!(store.pool().state().connections <= 3);
}

#[tokio::test]
async fn startup_options_of_the_url_are_kept_next_to_the_builders() {
    let db = TestDb::new().await;
    let url = with_param(&db.url, "options", "-c work_mem=8MB");
    let store = PostgresStore::builder(url)
        .synchronous_commit(false)
        .statement_timeout(Some(Duration::from_secs(3)))
        .build()
        .await
        .unwrap();
    round_trip(&store, "options").await;
    assert_eq!(setting(&store, "work_mem").await, "8MB");
    assert_eq!(setting(&store, "synchronous_commit").await, "off");
    assert_eq!(setting(&store, "statement_timeout").await, "3s");
}

/// `max_size(0)` is one connection (bb8 itself panics on zero), and a request that cannot
/// get one within the connection timeout is a quick 503, not a hang.
#[tokio::test]
async fn max_size_zero_is_one_connection_and_exhaustion_is_unavailable() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(0)
        .connection_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    assert_eq!(store.pool().config().max_size, 1);
    round_trip(&store, "single").await;
    let held = store.pool().get().await.unwrap();
    let started = Instant::now();
    match store.reserve(&scope("starved"), &FP, LEASE).await {
        Err(StoreError::Unavailable(e)) => assert!(
            e.to_string()
                .starts_with("no database connection within 300 ms"),
            "{e}"
        ),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    drop(held);
    round_trip(&store, "starved").await;
}

/// A zero connection timeout is clamped to 1 ms (bb8 panics on zero): the store builds, and
/// a database that is not there is reported at once.
#[tokio::test]
async fn a_zero_connection_timeout_is_clamped_not_a_panic() {
    let url = format!("postgres://app:{PASSWORD}@127.0.0.1:1/app");
    let store = PostgresStore::builder(url.as_str())
        .connection_timeout(Duration::ZERO)
        .build()
        .await
        .unwrap();
    assert_eq!(
        store.pool().config().connection_timeout,
        Duration::from_millis(1)
    );
    let started = Instant::now();
    match store.reserve(&scope("k"), &FP, LEASE).await {
        Err(error @ StoreError::Unavailable(_)) => {
            assert!(!error.to_string().contains(PASSWORD), "{error}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// The database being down is not a build error: the pool connects lazily, and requests get
/// `Unavailable` with the reason, never the password.
#[tokio::test]
async fn an_unreachable_database_builds_and_requests_are_unavailable() {
    let url = format!("postgres://app:{PASSWORD}@127.0.0.1:1/app");
    let builder =
        PostgresStore::builder(url.as_str()).connection_timeout(Duration::from_millis(400));
    let debug = format!("{builder:?}");
    assert!(
        debug.contains("postgres://app:***@127.0.0.1:1/app") && !debug.contains(PASSWORD),
        "{debug}"
    );
    let store = builder.build().await.unwrap();
    for attempt in 0..2 {
        let started = Instant::now();
        let error = match store.reserve(&scope("down"), &FP, LEASE).await {
            Err(error @ StoreError::Unavailable(_)) => error,
            other => panic!("expected Unavailable, got {other:?}"),
        };
        let message = error.to_string();
        assert!(!message.contains(PASSWORD), "{message}");
        assert!(
            message.starts_with("idempotency store unavailable: "),
            "{message}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "attempt {attempt}"
        );
    }
    match store.check().await {
        Err(StoreError::Unavailable(e)) => assert!(!e.to_string().contains(PASSWORD)),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(!format!("{store:?}").contains(PASSWORD));
}

/// An expired reservation of `key` whose row another session holds locked, so the next
/// reserve has to wait for that lock to take it over. Returns the blocking session.
async fn blocked_takeover(
    store: &PostgresStore,
    url: &str,
    key: &str,
) -> diesel_async::AsyncPgConnection {
    store
        .reserve(&scope(key), &FP, Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut blocker = postgres::establish(url).await.unwrap();
    blocker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM {} WHERE idempotency_key = '{key}' FOR UPDATE",
            records_table()
        ))
        .await
        .unwrap();
    blocker
}

/// Statements of the database at `url` waiting for a lock, once none are or after 2 s: a
/// statement abandoned by a timeout must have been cancelled on the server.
async fn waiting_on_locks(url: &str) -> i64 {
    let waiting = "SELECT count(*) AS n FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let mut still_waiting = idempotency_e2e::records::count(url, waiting);
    for _ in 0..100 {
        if still_waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        still_waiting = idempotency_e2e::records::count(url, waiting);
    }
    still_waiting
}

/// The query timeout bounds a statement the database does not answer; `None` waits.
#[tokio::test]
async fn the_query_timeout_bounds_a_blocked_statement_and_none_waits() {
    let db = TestDb::new().await;
    let unbounded = PostgresStore::builder(db.url.as_str())
        .query_timeout(None)
        .build()
        .await
        .unwrap();
    let mut blocker = blocked_takeover(&unbounded, &db.url, "waits").await;
    let waiting = tokio::spawn({
        let unbounded = unbounded.clone();
        async move { unbounded.reserve(&scope("waits"), &FP, LEASE).await }
    });
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!waiting.is_finished(), "no query timeout: still waiting");
    blocker.batch_execute("COMMIT").await.unwrap();
    match waiting.await.unwrap() {
        Ok(ReserveOutcome::Reserved { .. }) => {}
        other => panic!("the waiting takeover gave {other:?}"),
    }

    let bounded = PostgresStore::builder(db.url.as_str())
        .query_timeout(Some(Duration::from_millis(200)))
        .build()
        .await
        .unwrap();
    let mut blocker = blocked_takeover(&bounded, &db.url, "bounded").await;
    let started = Instant::now();
    match bounded.reserve(&scope("bounded"), &FP, LEASE).await {
        Err(StoreError::Unavailable(e)) => {
            assert_eq!(e.to_string(), "the database did not answer within 200 ms")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    blocker.batch_execute("COMMIT").await.unwrap();
}

/// A statement cut by the query timeout may still run on the server; the connection it ran on
/// must not serve another key, whose statement would queue behind it, time out as well and
/// run later (a reservation nobody holds: 409s for a whole lease after a 503 that said "not
/// processed"). With one connection in the pool, a bystander key right after a timed-out
/// statement is served at once, and nothing of it is left behind when it fails.
#[tokio::test]
async fn a_timed_out_statement_does_not_hold_up_the_next_key() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(1)
        .query_timeout(Some(Duration::from_millis(200)))
        .build()
        .await
        .unwrap();
    let mut blocker = blocked_takeover(&store, &db.url, "locked").await;
    match store.reserve(&scope("locked"), &FP, LEASE).await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let bystander = store.reserve(&scope("bystander"), &FP, LEASE).await;
    let bystander_reserved = matches!(bystander, Ok(ReserveOutcome::Reserved { .. }));
    blocker.batch_execute("COMMIT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        bystander_reserved,
        "the next key waited behind the timed-out statement: {bystander:?}"
    );
}

/// A statement abandoned at the query timeout is cancelled on the server too, so it cannot
/// take effect later: here a takeover that waited for a row lock. Before, the connection was
/// only closed, which the server does not notice while a statement waits for a lock; once the
/// lock was released the abandoned takeover went through, and the key was held by a
/// reservation nobody had (409s for a whole lease after a 503 that said "not processed").
#[tokio::test]
async fn a_timed_out_statement_is_cancelled_on_the_server() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .query_timeout(Some(Duration::from_millis(200)))
        .build()
        .await
        .unwrap();
    let mut blocker = blocked_takeover(&store, &db.url, "cancelled").await;
    match store.reserve(&scope("cancelled"), &FP, LEASE).await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let still_waiting = waiting_on_locks(&db.url).await;
    blocker.batch_execute("COMMIT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        still_waiting, 0,
        "the abandoned statement still waited on the server 2 s after the timeout"
    );
    let held = idempotency_e2e::records::count(
        &db.url,
        "SELECT count(*) AS n FROM idempotency_keys \
         WHERE idempotency_key = 'cancelled' AND locked_until > now()",
    );
    assert_eq!(held, 0, "the abandoned takeover took effect after the 503");
}

/// A statement whose session an administrator terminates (SQLSTATE 57P01, which diesel-async
/// reports as an unknown error) or that a server shutdown ends is `Unavailable` (retry later),
/// not `Backend` (a bug): the connection is gone with it.
#[tokio::test]
async fn a_terminated_session_is_unavailable_not_a_bug() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .query_timeout(None)
        .build()
        .await
        .unwrap();
    let mut blocker = blocked_takeover(&store, &db.url, "killed").await;
    let waiting = tokio::spawn({
        let store = store.clone();
        async move { store.reserve(&scope("killed"), &FP, LEASE).await }
    });
    // Terminate the store's session once it waits for the blocker's row lock.
    let mut terminated = 0;
    for _ in 0..100 {
        terminated = idempotency_e2e::records::count(
            &db.url,
            "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        );
        if terminated > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        terminated, 1,
        "the waiting reserve was found and terminated"
    );
    match waiting.await.unwrap() {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    blocker.batch_execute("COMMIT").await.unwrap();
}

/// `purge_batch(0)` is one row per statement, and `purge_expired` goes on until every expired
/// record is gone.
#[tokio::test]
async fn purge_batch_zero_is_one_row_per_statement() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .purge_batch(0)
        .build()
        .await
        .unwrap();
    assert!(format!(
        "{:?}",
        PostgresStore::builder(db.url.as_str()).purge_batch(0)
    )
    .contains("purge_batch: 1"));
    for i in 0..3 {
        let key = scope(&format!("old-{i}"));
        let Ok(ReserveOutcome::Reserved { token }) = store.reserve(&key, &FP, LEASE).await else {
            panic!("reserve");
        };
        let done = store
            .complete(&key, &token, &response("old"), Duration::from_millis(1))
            .await;
        assert_eq!(done.ok(), Some(WriteOutcome::Applied));
    }
    round_trip(&store, "live").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(store.purge_expired(Duration::ZERO).await.unwrap(), 3);
    assert_eq!(store.purge_expired(Duration::ZERO).await.unwrap(), 0);
    assert!(matches!(
        store.reserve(&scope("live"), &FP, LEASE).await,
        Ok(ReserveOutcome::Completed { .. })
    ));
}

/// The TLS choice of the URL's `sslmode`, through the builder's pool: `disable` is plain,
/// `prefer` follows the server, `require` encrypts (when the server offers TLS).
#[tokio::test]
async fn sslmode_decides_whether_pooled_connections_are_encrypted() {
    let db = TestDb::new().await;
    let server_ssl = server_setting(&db.url, "ssl").await == "on";
    let store = |mode: &str| {
        let url = with_param(&db.url, "sslmode", mode);
        async move {
            PostgresStore::builder(url)
                .connection_timeout(Duration::from_secs(2))
                .build()
                .await
                .unwrap()
        }
    };
    let plain = store("disable").await;
    assert!(!pooled_tls(&plain).await.unwrap());
    round_trip(&plain, "disable").await;

    let prefer = store("prefer").await;
    assert_eq!(pooled_tls(&prefer).await.unwrap(), server_ssl);
    round_trip(&prefer, "prefer").await;

    let require = store("require").await;
    if server_ssl {
        assert!(pooled_tls(&require).await.unwrap());
        round_trip(&require, "require").await;
    } else {
        eprintln!("the test server has ssl=off: sslmode=require must fail to connect");
        assert!(matches!(
            require.reserve(&scope("require"), &FP, LEASE).await,
            Err(StoreError::Unavailable(_))
        ));
    }
}

/// `verify-full` against a server whose certificate is not signed by the given roots: the
/// handshake is refused, every request is `Unavailable`, nothing panics.
#[tokio::test]
async fn verify_full_with_foreign_roots_is_unavailable() {
    let db = TestDb::new().await;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "an unrelated CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let key = rcgen::KeyPair::generate().unwrap();
    let ca = params.self_signed(&key).unwrap();
    let roots = TempFile::new("ca.crt", ca.pem().as_bytes());
    let url = with_param(
        &with_param(&db.url, "sslmode", "verify-full"),
        "sslrootcert",
        &roots.path(),
    );
    let store = PostgresStore::builder(url.as_str())
        .connection_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let started = Instant::now();
    assert!(
        matches!(
            store.reserve(&scope("tls"), &FP, LEASE).await,
            Err(StoreError::Unavailable(_))
        ),
        "an unverified server was used"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    // The same URL through `connection_manager` builds too (TLS is checked at connect time).
    assert!(postgres::connection_manager(&url).is_ok());
}

/// Every URL or TLS option that cannot be used is a `StoreError::Backend` from `build` (and
/// from `connection_manager`), with a message that says what is wrong and never the password.
#[tokio::test]
async fn unusable_urls_are_backend_errors_without_the_password() {
    let not_pem = TempFile::new("not-a-cert.pem", b"this is not a certificate\n");
    let not_pem_path = not_pem.path();
    let cases: Vec<(String, String)> = vec![
        (
            format!("postgres://app:{PASSWORD}@db.internal:notaport/pay"),
            "invalid value for `port`".into(),
        ),
        (
            format!("postgres://app:{PASSWORD}@db.internal/pay?sslmode=bogus"),
            "unknown sslmode".into(),
        ),
        (
            format!("postgres://app:{PASSWORD}@db.internal/pay?sslcert=/c.pem&sslkey=/k.pem"),
            "client certificates (sslcert/sslkey) are not supported".into(),
        ),
        (
            format!(
                "postgres://app:{PASSWORD}@db.internal/pay?sslmode=verify-full&sslrootcert=/nonexistent/root.crt"
            ),
            "cannot read sslrootcert `/nonexistent/root.crt`".into(),
        ),
        (
            format!(
                "postgres://app:{PASSWORD}@db.internal/pay?sslmode=verify-ca&sslrootcert={not_pem_path}"
            ),
            format!("no certificate found in sslrootcert `{not_pem_path}`"),
        ),
        (
            format!("postgres://app:{PASSWORD}@db.internal/pay?application_name"),
            "has no `=`".into(),
        ),
        (
            format!("postgres://app:{PASSWORD}@db.internal/pay?frobnicate=1"),
            "is unknown".into(),
        ),
        (
            format!("host=db.internal password='{PASSWORD}"),
            "malformed".into(),
        ),
        (
            format!("mysql://root:{PASSWORD}@db.internal/pay"),
            "invalid database URL".into(),
        ),
    ];
    for (url, expected) in cases {
        let message = backend_message(
            PostgresStore::builder(url.as_str())
                .max_size(2)
                .build()
                .await,
            &url,
        );
        assert!(
            message.starts_with("idempotency store error: invalid database URL: "),
            "{url:?}: {message}"
        );
        assert!(message.contains(&expected), "{url:?}: {message}");
        // `connect` and `connection_manager` parse the same way.
        assert_eq!(
            backend_message(PostgresStore::connect(&url).await, &url),
            message
        );
        match postgres::connection_manager(&url) {
            Err(error @ StoreError::Backend(_)) => assert_eq!(error.to_string(), message),
            Err(other) => panic!("{url:?}: {other:?}"),
            Ok(_) => panic!("{url:?}: connection_manager accepted it"),
        }
        // The builder's Debug never shows the password either.
        let debug = format!("{:?}", PostgresStore::builder(url.as_str()));
        assert!(!debug.contains(PASSWORD), "{debug}");
    }
}

#[derive(diesel::QueryableByName)]
struct Pid {
    #[diesel(sql_type = diesel::sql_types::Integer)]
    pid: i32,
}

async fn pooled_pid(store: &PostgresStore) -> i32 {
    let mut conn = store.pool().get().await.expect("a pooled connection");
    diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(&mut *conn)
        .await
        .expect("pg_backend_pid")
        .pid
}

/// The pool's checkout check (no round trip) notices a connection the server closed while it
/// was idle, and replaces it: the next request works on a new connection.
#[tokio::test]
async fn a_connection_closed_while_idle_is_replaced_on_checkout() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(1)
        .build()
        .await
        .unwrap();
    round_trip(&store, "before").await;
    let first = pooled_pid(&store).await;
    assert_eq!(
        pooled_pid(&store).await,
        first,
        "one pooled connection, reused"
    );
    let mut admin = postgres::establish(&db.url).await.unwrap();
    admin
        .batch_execute(&format!("SELECT pg_terminate_backend({first})"))
        .await
        .unwrap();
    // Let the connection's task see the socket close.
    tokio::time::sleep(Duration::from_millis(300)).await;
    round_trip(&store, "after").await;
    let second = pooled_pid(&store).await;
    assert_ne!(second, first, "the closed connection was not reused");
    let statistics = store.pool().state().statistics;
    assert!(
        statistics.connections_closed_invalid + statistics.connections_closed_broken >= 1,
        "{statistics:?}"
    );
}

/// Found while writing these tests: bb8 asserts `min_idle <= max_size` and non-zero idle and
/// lifetime timeouts, and the builder passed these values through, so `build` panicked. It now
/// clamps them, as it does `max_size` and `connection_timeout`.
#[tokio::test]
async fn out_of_range_pool_options_do_not_panic() {
    let url = "postgres://app@127.0.0.1:1/app";
    let builders = [
        PostgresStore::builder(url).max_size(2).min_idle(Some(5)),
        PostgresStore::builder(url).idle_timeout(Some(Duration::ZERO)),
        PostgresStore::builder(url).max_lifetime(Some(Duration::ZERO)),
    ];
    let mut panics = Vec::new();
    for builder in builders {
        let shown = format!("{builder:?}");
        match tokio::spawn(builder.build()).await {
            Ok(Ok(_)) | Ok(Err(StoreError::Backend(_))) => {}
            Ok(Err(other)) => panic!("{shown}: {other:?}"),
            Err(panic) => panics.push(format!("{shown}: build panicked: {panic}")),
        }
    }
    assert!(panics.is_empty(), "{panics:#?}");
}

/// A `statement_timeout` past the server's range (an `int` of milliseconds, about 24.8 days)
/// is reported as a `StoreError` naming the setting, whether when building or when the pool
/// connects; never a panic. (Today the builder accepts it and every connection is refused by
/// the server, so every request is `Unavailable`.)
#[tokio::test]
async fn an_out_of_range_statement_timeout_is_a_clear_error() {
    let db = TestDb::new().await;
    for timeout in [Duration::from_secs(30 * 86_400), Duration::MAX] {
        let built = PostgresStore::builder(db.url.as_str())
            .statement_timeout(Some(timeout))
            .connection_timeout(Duration::from_millis(500))
            .build()
            .await;
        let message = match built {
            Err(error @ StoreError::Backend(_)) => error.to_string(),
            Err(other) => panic!("{timeout:?}: {other:?}"),
            Ok(store) => match store.reserve(&scope("st"), &FP, LEASE).await {
                Err(error @ StoreError::Unavailable(_)) => error.to_string(),
                other => panic!("{timeout:?}: a reserve gave {other:?}"),
            },
        };
        assert!(
            message.contains("statement_timeout"),
            "{timeout:?}: {message}"
        );
    }
}

/// The connections of this test's database, counted by the server.
async fn backends(db: &TestDb) -> i64 {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = postgres::establish(&db.url).await.unwrap();
    let rows: Vec<Count> = diesel::sql_query(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .load(&mut conn)
    .await
    .unwrap();
    rows[0].n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_pool_per_thread_each_thread_uses_its_own_connections() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(4)
        .min_idle(Some(4))
        .pool_per_thread(Some(1))
        .build()
        .await
        .unwrap();
    // Two threads at once, each holding its pool (the barrier keeps both alive until both
    // have made their round trip and the connections have been counted).
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(3));
    let threads: Vec<_> = (0..2)
        .map(|i| {
            let (store, barrier) = (store.clone(), barrier.clone());
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(round_trip(&store, &format!("thread-{i}")));
                barrier.wait();
                barrier.wait();
            })
        })
        .collect();
    tokio::task::spawn_blocking({
        let barrier = barrier.clone();
        move || barrier.wait()
    })
    .await
    .unwrap();
    // One connection per thread, none in the shared pool (which keeps no idle connections
    // in this mode, min_idle notwithstanding).
    assert_eq!(
        store.pool().state().connections,
        0,
        "the shared pool was used"
    );
    assert_eq!(backends(&db).await, 2, "one connection per thread");
    tokio::task::spawn_blocking(move || barrier.wait())
        .await
        .unwrap();
    for thread in threads {
        thread.join().unwrap();
    }
    // The threads are gone, and their pools with them.
    assert!(
        eventually(Duration::from_secs(5), || async {
            backends(&db).await == 0
        })
        .await,
        "the threads' connections outlived them"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thread_that_runs_a_new_runtime_gets_a_new_pool() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .pool_per_thread(Some(2))
        .build()
        .await
        .unwrap();
    // One thread, two runtimes one after the other: the first runtime's connections die with
    // it, and the second must be served all the same (by a new pool, see per_thread.rs; bb8
    // alone would also replace the dead connections, so this guards the outcome, not which of
    // the two mechanisms gave it).
    std::thread::spawn(move || {
        for name in ["first", "second"] {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(round_trip(&store, &format!("{name}-runtime")));
        }
    })
    .join()
    .unwrap();
}

/// A thread's pool serves waiting requests in the order they asked. bb8 alone does not: a
/// connection put back wakes one waiter, but a request that asks before that waiter runs
/// (on a worker's single thread: the request that just returned it, asking for its next
/// statement) takes the connection first, and the waiter queues again at the back. Under
/// load a request can be passed over again and again, up to the connection timeout.
///
/// One connection; request A holds it in a `complete` that waits on a row lock, W queues for
/// it, then the lock goes and A, in the same poll that returns the connection, asks for it
/// again. W must be served first.
#[tokio::test]
async fn a_threads_pool_serves_waiting_requests_in_order() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .pool_per_thread(Some(1))
        .build()
        .await
        .unwrap();
    let held = scope("held");
    let token = match store.reserve(&held, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected a reservation, got {other:?}"),
    };
    let mut blocker = postgres::establish(&db.url).await.unwrap();
    blocker.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        idempotency_e2e::records::lock_key(&mut blocker, "held")
            .await
            .unwrap(),
        1
    );

    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let a = tokio::spawn({
        let (store, order) = (store.clone(), order.clone());
        async move {
            let applied = store.complete(&held, &token, &response("held"), TTL).await;
            assert!(matches!(applied, Ok(WriteOutcome::Applied)), "{applied:?}");
            // No await between the connection's return and this request for it.
            let again = store.reserve(&scope("a-again"), &FP, LEASE).await;
            assert!(
                matches!(again, Ok(ReserveOutcome::Reserved { .. })),
                "{again:?}"
            );
            order.lock().unwrap().push("a-again");
        }
    });
    // A now holds the only connection, waiting for the row lock.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let w = tokio::spawn({
        let (store, order) = (store.clone(), order.clone());
        async move {
            let reserved = store.reserve(&scope("waiter"), &FP, LEASE).await;
            assert!(
                matches!(reserved, Ok(ReserveOutcome::Reserved { .. })),
                "{reserved:?}"
            );
            order.lock().unwrap().push("waiter");
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "nobody should have been served yet"
    );
    blocker.batch_execute("COMMIT").await.unwrap();
    a.await.unwrap();
    w.await.unwrap();
    assert_eq!(
        *order.lock().unwrap(),
        ["waiter", "a-again"],
        "the waiting request was overtaken by one that asked later"
    );
}

/// When each client connection to this database (other than the caller's) was opened, in
/// milliseconds since the epoch, by backend pid. Client backends only: an autovacuum worker
/// started on the database meanwhile is not a pooled connection.
async fn births(conn: &mut diesel_async::AsyncPgConnection) -> Vec<(i32, f64)> {
    #[derive(diesel::QueryableByName)]
    struct Birth {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
        #[diesel(sql_type = diesel::sql_types::Double)]
        ms: f64,
    }
    let rows: Vec<Birth> = diesel::sql_query(
        "SELECT pid, extract(epoch FROM backend_start)::float8 * 1000 AS ms FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
           AND backend_type = 'client backend'",
    )
    .load(conn)
    .await
    .unwrap();
    rows.into_iter().map(|b| (b.pid, b.ms)).collect()
}

/// bb8 closes a connection at a fixed age, so connections opened together (here the pool's
/// `min_idle`, all opened at start) would be closed together, and requests would wait while
/// all their replacements connect: a latency spike once per lifetime. Each connection gets its
/// own lifetime instead, in the last tenth of `max_lifetime`, so under load their replacements
/// are opened apart. Before that change, all eight replacements of this test were opened within
/// a few milliseconds of each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_opened_together_are_not_closed_together() {
    const POOL: usize = 8;
    let lifetime = Duration::from_secs(6);
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(POOL as u32)
        .min_idle(Some(POOL as u32))
        .max_lifetime(Some(lifetime))
        .build()
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            backends(&db).await == POOL as i64
        })
        .await,
        "the pool did not open its min_idle connections"
    );
    // Every connection busy all the time, so each is checked out (and put back) often.
    let until = Instant::now() + lifetime.mul_f64(1.4);
    let load: Vec<_> = (0..POOL)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut n = 0;
                while Instant::now() < until {
                    round_trip(&store, &format!("load-{i}-{n}")).await;
                    n += 1;
                }
            })
        })
        .collect();
    let mut observer = postgres::establish(&db.url).await.unwrap();
    let mut seen = std::collections::HashMap::new();
    while Instant::now() < until {
        seen.extend(births(&mut observer).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for task in load {
        task.await.unwrap();
    }
    let mut births: Vec<f64> = seen.into_values().collect();
    births.sort_by(f64::total_cmp);
    let first = births[0];
    let replacements: Vec<f64> = births
        .iter()
        .copied()
        .filter(|ms| *ms > first + 1000.0)
        .collect();
    assert!(
        replacements.len() >= POOL,
        "every connection should have been replaced once: {} of {} births after the first \
         second ({births:?})",
        replacements.len(),
        births.len()
    );
    // The most replacements opened within any 50 ms.
    let crowd = replacements
        .iter()
        .map(|start| {
            replacements
                .iter()
                .filter(|ms| **ms >= *start && **ms < *start + 50.0)
                .count()
        })
        .max()
        .unwrap_or(0);
    let offsets: Vec<i64> = replacements.iter().map(|ms| (ms - first) as i64).collect();
    assert!(
        crowd <= POOL - 2,
        "{crowd} of the {POOL} connections were replaced within 50 ms (ms after the first \
         birth: {offsets:?})"
    );
}

/// A store of one connection with a 200 ms query timeout, reaching `db` through a proxy that,
/// once the returned flag is set, holds back the next answer of a reserve that made a
/// reservation for 700 ms (it commits; its answer comes too late). Warmed (statements
/// prepared).
async fn store_whose_reserve_answers_late(db: &TestDb) -> (PostgresStore, Arc<AtomicBool>) {
    let (port, armed) = delaying_proxy(
        host_port(&db.url),
        Hold::Answer,
        b"reserved",
        Duration::from_millis(700),
    )
    .await;
    let store = PostgresStore::builder(at_local_port(&db.url, port))
        .max_size(1)
        .query_timeout(Some(Duration::from_millis(200)))
        .build()
        .await
        .unwrap();
    store.reserve(&scope("warm"), &FP, LEASE).await.unwrap();
    (store, armed)
}

/// Found by review (2026-12-04): a reserve whose reply arrives after `query_timeout` has run on
/// the server. The store answers `Unavailable` (the middleware: 503 "the request was not
/// processed, retry later") and sends a cancel, which finds nothing left to cancel: the
/// reservation is committed with a token nobody holds, so every retry gets 409 "still being
/// processed" for a whole lease, for a key whose handler never ran. The Redis store releases
/// such a reservation by its token (`give_back_later`, fixed in review 6); PostgreSQL does not.
#[tokio::test]
async fn a_reserve_answered_after_the_timeout_does_not_leave_the_key_held_by_nobody() {
    let db = TestDb::new().await;
    let (store, armed) = store_whose_reserve_answers_late(&db).await;
    // Hold back the next reserve's answer.
    AtomicBool::store(&armed, true, Ordering::SeqCst);
    match store.reserve(&scope("late"), &FP, LEASE).await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable (the answer came too late), got {other:?}"),
    }
    // The late answer and the cancel have long arrived.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let retry = store.reserve(&scope("late"), &FP, LEASE).await;
    let held = idempotency_e2e::records::count(
        &db.url,
        "SELECT count(*) AS n FROM idempotency_keys \
         WHERE idempotency_key = 'late' AND state = 'in_flight' AND locked_until > now()",
    );
    assert!(
        matches!(retry, Ok(ReserveOutcome::Reserved { .. })),
        "the retry of a reserve that failed with Unavailable found the key held by nobody \
         ({held} in-flight row(s) with a live lease, no holder): {retry:?}"
    );
}

/// A reserve whose statement reaches the server late (held up on its way, so the cancel
/// found an idle session) and commits after the store gave up on it is still released in the
/// background, before the lease it made ends. The first version of that release (the test
/// above) stopped a quarter lease early, doubling its pauses: with a 2 s lease it tried at 0.1,
/// 0.3, 0.7 and 1.5 s and never again, and this reservation was held by nobody, the client's
/// retry after the 503 told 409 (found by review, 2026-12-04).
#[tokio::test]
async fn a_reserve_that_commits_late_is_released_in_the_background() {
    const SHORT_LEASE: Duration = Duration::from_secs(2);
    let db = TestDb::new().await;
    let upstream = idempotency_e2e::proxy::host_port(&db.url);
    // The statement reaches the server 1.95 s after it was sent: 1.75 s after the 200 ms
    // timeout, i.e. after the last background try (1.5 s after the failure) and before the
    // lease the store meant to cover (2 s after the failure) has ended.
    let (port, armed) = delaying_proxy(
        upstream,
        Hold::Statement,
        b"late-inbound",
        Duration::from_millis(1950),
    )
    .await;
    let url = at_local_port(&db.url, port);
    let store = PostgresStore::builder(url.as_str())
        .max_size(1)
        .query_timeout(Some(Duration::from_millis(200)))
        .build()
        .await
        .unwrap();
    // Warm the connection (prepared statements), then hold back the next reserve's statement.
    store
        .reserve(&scope("warm"), &FP, SHORT_LEASE)
        .await
        .unwrap();
    AtomicBool::store(&armed, true, Ordering::SeqCst);
    let sent = Instant::now();
    match store
        .reserve(&scope("late-inbound"), &FP, SHORT_LEASE)
        .await
    {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected Unavailable (no answer within the timeout), got {other:?}"),
    }
    // The statement has reached the server and committed, the background release has given up
    // (its lease window ended 2.2 s after `sent`); the reservation it made runs to about 3.95 s.
    tokio::time::sleep_until((sent + Duration::from_millis(2600)).into()).await;
    let held = idempotency_e2e::records::count(
        &db.url,
        "SELECT count(*) AS n FROM idempotency_keys \
         WHERE idempotency_key = 'late-inbound' AND state = 'in_flight' AND locked_until > now()",
    );
    let retry = store
        .reserve(&scope("late-inbound"), &FP, SHORT_LEASE)
        .await;
    assert!(
        matches!(retry, Ok(ReserveOutcome::Reserved { .. })),
        "the retry of a reserve that failed with Unavailable found the key held by nobody \
         ({held} in-flight row(s) with a live lease, no holder, nothing left to release it): \
         {retry:?}"
    );
}

/// Found by review (2026-12-04): `reserve` starts `release_later` for every `Unavailable`, not
/// only for a statement whose answer never came. A reserve the server answered with an error
/// (here `cannot execute ... in a read-only transaction`, a failover onto a standby or a
/// database set read-only: classified `Unavailable`) certainly wrote nothing, yet each such
/// request leaves a task that keeps sending `DELETE`s for a whole lease (about ten of them in
/// the default 60 s): during an outage of a busy service, every request multiplies into ten
/// more statements and pool checkouts against the database that is already failing, and they
/// go on for a lease after it is back.
#[tokio::test]
async fn a_reserve_the_server_refused_starts_no_background_statements() {
    let db = TestDb::new().await;
    let mut admin = postgres::establish(&db.url).await.expect("connect");
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET default_transaction_read_only = on",
            db.name
        ))
        .await
        .unwrap();
    let proxy = PgProxy::for_url(&db.url).await.expect("proxy");
    let url = proxy.url_through(&db.url);
    let store = PostgresStore::builder(url.as_str())
        .max_size(2)
        .build()
        .await
        .unwrap();
    const REQUESTS: usize = 20;
    for i in 0..REQUESTS {
        match store.reserve(&scope(&format!("ro-{i}")), &FP, LEASE).await {
            Err(StoreError::Unavailable(_)) => {}
            other => panic!("expected Unavailable (a read-only database), got {other:?}"),
        }
    }
    // Nothing runs on the store's behalf any more: the requests were answered.
    let answered = proxy.counts();
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let background = proxy.counts().since(&answered).round_trips();
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{}\" RESET default_transaction_read_only",
            db.name
        ))
        .await
        .unwrap();
    assert_eq!(
        background, 0,
        "{REQUESTS} reserves the server refused (nothing written) made {background} more \
         round trips to the read-only database in the next 2 s, and go on for the lease ({LEASE:?})"
    );
}

/// Whether `store` reserves `key` within `limit`, trying again and again (a store whose pool
/// has to recover first).
async fn reserves_within(store: &PostgresStore, key: &str, limit: Duration) -> bool {
    eventually(limit, || async {
        matches!(
            store.reserve(&scope(key), &FP, LEASE).await,
            Ok(ReserveOutcome::Reserved { .. })
        )
    })
    .await
}

/// A listener that holds every connection it accepts without a word while `hang` is set (a
/// database host that accepts TCP and then stalls: a frozen server, a half-failed-over
/// address), and forwards to `upstream` once it is cleared. Returns its port.
async fn stalling_listener(upstream: String, hang: Arc<AtomicBool>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut client, _)) = listener.accept().await {
            if AtomicBool::load(&hang, Ordering::SeqCst) {
                held.push(client);
                continue;
            }
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    port
}

/// bb8 waits for a new connection without a deadline of its own, and a pool slot stays taken
/// while it waits: a connection attempt that stalls (the server accepted TCP, then nothing)
/// must give up (after the connection timeout, at least 5 s), or a pool of one would answer
/// 503 for as long as the stalled attempt lasts (the kernel's TCP timeouts: many minutes),
/// even after the database is back.
#[tokio::test]
async fn a_stalled_connection_attempt_does_not_keep_its_pool_slot() {
    let db = TestDb::new().await;
    let hang = Arc::new(AtomicBool::new(true));
    let port = stalling_listener(host_port(&db.url), Arc::clone(&hang)).await;
    let store = PostgresStore::builder(at_local_port(&db.url, port))
        .max_size(1)
        .connection_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    match store.reserve(&scope("stalled"), &FP, LEASE).await {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("expected unavailable while the server stalls, got {other:?}"),
    }
    // The server is back; the stalled attempt never ends by itself.
    hang.store(false, Ordering::SeqCst);
    let started = Instant::now();
    let recovered = reserves_within(&store, "stalled", Duration::from_secs(20)).await;
    assert!(
        recovered,
        "the pool never recovered: its only slot stayed with the stalled attempt ({:?})",
        store.pool().state()
    );
    // The stalled attempt gives up 5 s after it started; the next one connects.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "recovery took {:?}",
        started.elapsed()
    );
}

/// Background releases take at most a quarter of the pool (two of eight connections). Every
/// reserve whose outcome is unknown starts one, a task of about twenty tries over two leases:
/// during a brownout, unbounded, they would hold the pool's connections (and queue ahead of
/// live requests for them) against the database that is already failing. Here ten reserves
/// time out at once behind a table lock, and their releases queue behind it too.
#[tokio::test]
async fn background_releases_take_at_most_a_quarter_of_the_pool() {
    let db = TestDb::new().await;
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(8)
        .query_timeout(Some(Duration::from_millis(200)))
        .build()
        .await
        .unwrap();
    store.reserve(&scope("warm"), &FP, LEASE).await.unwrap();
    let mut blocker = postgres::establish(&db.url).await.unwrap();
    blocker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
            records_table()
        ))
        .await
        .unwrap();
    let reserves = (0..10).map(|i| {
        let store = store.clone();
        async move {
            store
                .reserve(&scope(&format!("brownout-{i}")), &FP, LEASE)
                .await
        }
    });
    for answer in futures_util::future::join_all(reserves).await {
        assert!(
            matches!(answer, Err(StoreError::Unavailable(_))),
            "expected Unavailable behind the lock, got {answer:?}"
        );
    }
    // The releases' tries (0.1, 0.3, 0.7, 1.5 s after each failure) wait on the lock until
    // their own timeout: count them while they do. Only those that started less than 100 ms
    // ago: one that the store gave up on (200 ms) still waits on the server until its cancel
    // lands, and on a loaded machine the next try may start before that.
    let mut watcher = postgres::establish(&db.url).await.unwrap();
    let mut most = 0;
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let waiting: Count = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND query LIKE 'SELECT idempotency_release(%' \
             AND query_start > now() - interval '100 milliseconds'",
        )
        .get_result(&mut watcher)
        .await
        .unwrap();
        most = most.max(waiting.n);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    blocker.batch_execute("COMMIT").await.unwrap();
    assert!(
        most >= 1,
        "no background release was seen waiting: the test proved nothing"
    );
    assert!(
        most <= 2,
        "{most} background releases at once on a pool of eight (a quarter is two)"
    );
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// A proxy to `upstream` whose every connection's first answer from the server arrives
/// `delay` late (a long link: each connection takes that much longer to open). Returns its
/// port.
async fn slow_link(upstream: String, delay: Duration) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let mut first = true;
                loop {
                    let n = match server_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if std::mem::take(&mut first) {
                        tokio::time::sleep(delay).await;
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// The bound on a connection attempt is never below 5 s: a connection timeout set short (for
/// quick 503s while the pool is exhausted) must not keep a slower but healthy link from ever
/// connecting. The request that opened the connection gives up; the connection still opens
/// and serves the next one.
#[tokio::test]
async fn a_short_connection_timeout_still_lets_a_slow_link_connect() {
    let db = TestDb::new().await;
    let port = slow_link(host_port(&db.url), Duration::from_millis(400)).await;
    let store = PostgresStore::builder(at_local_port(&db.url, port))
        .max_size(1)
        .connection_timeout(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    let connected = reserves_within(&store, "slow-link", Duration::from_secs(10)).await;
    assert!(
        connected,
        "no connection ever opened over a link slower than the connection timeout ({:?})",
        store.pool().state()
    );
}

/// A port on 127.0.0.1 that drops connection attempts (no SYN-ACK: a dead host, a blackholed
/// address during a failover, an unreachable IPv6 route): a listener with a backlog of 0 whose
/// queue is filled and never accepted. Returns what must be kept alive, and the port.
async fn blackholed_port() -> (tokio::net::TcpListener, Vec<tokio::net::TcpStream>, u16) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut queued = Vec::new();
    for _ in 0..8 {
        let attempt = tokio::net::TcpStream::connect(("127.0.0.1", port));
        match tokio::time::timeout(Duration::from_millis(500), attempt).await {
            Ok(Ok(stream)) => queued.push(stream),
            Ok(Err(e)) => panic!("could not fill the accept queue: {e}"),
            Err(_) => return (listener, queued, port),
        }
    }
    panic!("the accept queue never filled");
}

/// A URL with several hosts (libpq's failover list; also what a name with several addresses
/// amounts to) whose first host drops connection attempts: the next host must still be
/// reached. The bound on a whole attempt (5 s here) is shorter than the kernel's SYN retries
/// (about 2 minutes), so without a bound per address the attempt never leaves the first host.
#[tokio::test]
async fn a_dead_first_host_does_not_keep_the_next_one_from_connecting() {
    let db = TestDb::new().await;
    let (_listener, _queued, dead) = blackholed_port().await;
    let url = failover_url(&db.url, dead, &host_port(&db.url));
    let why = "every attempt was cut short while still on the dead first host";
    assert_reaches_the_next_host(url, why, Duration::from_secs(10)).await;
}

/// A failover list whose first host accepts TCP and then says nothing (a frozen primary: the
/// kernel completes handshakes for a stopped or hung postmaster): the next host must still be
/// reached. tokio-postgres bounds only the TCP connect per address, not the startup that
/// follows, so without a bound per host every attempt waits on the first host until the bound
/// on the whole attempt cuts it, and the next host is never tried.
#[tokio::test]
async fn a_frozen_first_host_does_not_keep_the_next_one_from_connecting() {
    let db = TestDb::new().await;
    let live = host_port(&db.url);
    let frozen = stalling_listener(live.clone(), Arc::new(AtomicBool::new(true))).await;
    let url = failover_url(&db.url, frozen, &live);
    let why = "every attempt waited on the frozen first host";
    assert_reaches_the_next_host(url, why, Duration::from_secs(15)).await;
}

/// `url` (one local host) as a failover list: `127.0.0.1:first`, then `then` (`host:port`).
fn failover_url(url: &str, first: u16, then: &str) -> String {
    at_local_port(url, 1).replacen("127.0.0.1:1", &format!("127.0.0.1:{first},{then}"), 1)
}

/// A store of one connection on the failover list `url` reserves a key within `limit`
/// (retrying meanwhile, as clients do: the first requests may get 503 while the pool's
/// attempt is still on the first host). `why` says what it would mean if it never did.
async fn assert_reaches_the_next_host(url: String, why: &str, limit: Duration) {
    let store = PostgresStore::builder(url)
        .max_size(1)
        .build()
        .await
        .unwrap();
    let started = Instant::now();
    let connected = reserves_within(&store, "failover", limit * 2).await;
    assert!(
        connected,
        "never connected: {why} ({:?})",
        store.pool().state()
    );
    assert!(started.elapsed() < limit, "took {:?}", started.elapsed());
}

/// A URL's `connect_timeout` bounds each TCP connect (the driver's meaning), not the TLS
/// handshake and login after it: the builder's bound on a connection attempt (at least 5 s)
/// stays what lets a slow link connect, for one host and for each host of a list (review,
/// 2026-12-04: a first version bounded each host by the URL's value, so a link whose first
/// answer takes 2.5 s never connected with `connect_timeout=2`).
#[tokio::test]
async fn a_urls_connect_timeout_does_not_cut_a_slow_login() {
    let db = TestDb::new().await;
    let slow = slow_link(host_port(&db.url), Duration::from_millis(2500)).await;
    let with_timeout = |url: String| {
        if url.contains('?') {
            format!("{url}&connect_timeout=2")
        } else {
            format!("{url}?connect_timeout=2")
        }
    };
    let single = with_timeout(at_local_port(&db.url, slow));
    let frozen = stalling_listener(host_port(&db.url), Arc::new(AtomicBool::new(true))).await;
    let list = with_timeout(failover_url(&db.url, frozen, &format!("127.0.0.1:{slow}")));
    for (what, url) in [
        ("one host", single),
        ("a frozen host, then the slow one", list),
    ] {
        let store = PostgresStore::builder(url)
            .max_size(1)
            .build()
            .await
            .unwrap();
        let connected = reserves_within(&store, what, Duration::from_secs(30)).await;
        assert!(
            connected,
            "{what}: never connected ({:?})",
            store.pool().state()
        );
    }
}

/// A store dropped while a worker thread holds its pool: its connections close when the thread
/// next looks up a pool, even one of another store. From a review (2026-12-04, night): the
/// sweep ran only when a new pool was built, so a lookup that found its own store's pool left
/// the dropped store's connections open on every worker (for ever with `min_idle`, which bb8
/// keeps refilling).
#[tokio::test]
async fn a_dropped_stores_thread_pool_closes_when_the_thread_next_looks_up_a_pool() {
    let db = TestDb::new().await;
    let reserve = |store: PostgresStore, key: &'static str| async move {
        let reserved = store.reserve(&scope(key), &FP, LEASE).await;
        assert!(
            matches!(reserved, Ok(ReserveOutcome::Reserved { .. })),
            "{key}: {reserved:?}"
        );
    };
    let keep = PostgresStore::builder(db.url.as_str())
        .pool_per_thread(Some(1))
        .build()
        .await
        .unwrap();
    reserve(keep.clone(), "keep-1").await;
    let gone = PostgresStore::builder(db.url.as_str())
        .pool_per_thread(Some(2))
        .min_idle(Some(2))
        .build()
        .await
        .unwrap();
    reserve(gone.clone(), "gone").await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            backends(&db).await == 3
        })
        .await,
        "setup: 1 + 2 connections, got {}",
        backends(&db).await
    );
    drop(gone);
    reserve(keep.clone(), "keep-2").await;
    let closed = eventually(Duration::from_secs(5), || async {
        backends(&db).await == 1
    })
    .await;
    assert!(
        closed,
        "the dropped store's pool still holds {} connections after the thread looked up a pool",
        backends(&db).await - 1
    );
}

/// libpq ignores `sslmode` on a Unix socket, and a server named by its address alone
/// (`hostaddr`, no `host`) can still be asked for TLS: both failed every connection with
/// `prefer` or `require` here (the TLS connector was given no host name; review,
/// 2026-12-06). Over the socket, a whole cycle, and a statement timeout's cancel request.
#[tokio::test]
async fn unix_sockets_and_bare_addresses_connect_with_an_sslmode() {
    let db = TestDb::new().await;
    // The server the harness chose (the local one or a throwaway cluster): its address, port
    // and socket directory, never assumed.
    let host_port = idempotency_e2e::proxy::host_port(&db.url);
    let (host, port) = host_port.rsplit_once(':').expect("host:port");
    let bare = format!(
        "postgres://postgres@/{}?hostaddr={host}&port={port}&sslmode=prefer",
        db.name
    );
    let store = PostgresStore::connect(&bare)
        .await
        .unwrap_or_else(|e| panic!("hostaddr alone: {e}"));
    round_trip(&store, "bare-address").await;

    let sockets = server_setting(&db.url, "unix_socket_directories").await;
    let Some(dir) = sockets
        .split(',')
        .map(str::trim)
        .find(|d| d.starts_with('/'))
    else {
        eprintln!("SKIPPED the Unix socket part: the server listens on none ({sockets:?})");
        return;
    };
    let plain = format!(
        "host={dir} port={port} user=postgres dbname={} sslmode=disable",
        db.name
    );
    if let Err(e) = postgres::establish(&plain).await {
        // A packaged server's default `peer` authentication for local sockets refuses a
        // process that is not the `postgres` user; the throwaway clusters CI uses trust it.
        eprintln!("SKIPPED the Unix socket part: the socket refuses this user ({e})");
        return;
    }
    for mode in ["prefer", "require", "verify-full"] {
        let url = format!(
            "host={dir} port={port} user=postgres dbname={} sslmode={mode}",
            db.name
        );
        let store = PostgresStore::builder(url.as_str())
            .query_timeout(Some(Duration::from_millis(200)))
            .build()
            .await
            .unwrap_or_else(|e| panic!("{mode}: {e}"));
        round_trip(&store, &format!("socket-{mode}")).await;
        assert!(!pooled_tls(&store).await.unwrap(), "{mode}");
        let mut blocker = blocked_takeover(&store, &db.url, &format!("cancel-{mode}")).await;
        match store
            .reserve(&scope(&format!("cancel-{mode}")), &FP, LEASE)
            .await
        {
            Err(StoreError::Unavailable(_)) => {}
            other => panic!("{mode}: expected Unavailable, got {other:?}"),
        }
        // The cancel request went over the socket too: nothing is left waiting.
        let still_waiting = waiting_on_locks(&db.url).await;
        blocker.batch_execute("COMMIT").await.unwrap();
        assert_eq!(
            still_waiting, 0,
            "{mode}: the timed-out statement was not cancelled"
        );
    }
}
