//! Schema migrations and upgrades with live data (a review of 2026-12-05), through the built binary.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use diesel_async::SimpleAsyncConnection;
use idempotency_actix::store::postgres;
use idempotency_e2e::TestDb;

const BIN: &str = env!("CARGO_BIN_EXE_idem-cli");

fn idem(url: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run idem-cli")
}

fn show(out: &Output) -> String {
    format!(
        "code {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn migrations_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations")
}

fn migration_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(migrations_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// docs/operations.md, "A schema dropped by hand" (and "Choosing the partitioned layout",
/// which says to leave the partitioned layout by dropping its three tables by hand, then the
/// same steps): drop `idempotency_keys`, `idempotency_responses`, `idempotency_partitioning`;
/// run every `down.sql` newest first; delete this project's versions from the bookkeeping;
/// `idem-cli migrate`. The partitioned layout's maintenance functions are created by 000005
/// and dropped by no `down.sql`, so they survive, and then:
/// - `idem-cli migrate --partitioned` fails in 000005 ("function ... already exists");
/// - `idem-cli migrate` (plain) applies everything but the leftover
///   `idempotency_partitions_drop` makes the provisioning probe say "not provisioned": exit 4,
///   and the store's `check()` fails (every request 503 on a schema that is complete).
#[tokio::test]
async fn documented_reprovision_after_partitioned_layout_works_partitioned() {
    reprovision_after_partitioned(&["migrate", "--partitioned"]).await;
}

#[tokio::test]
async fn documented_reprovision_after_partitioned_layout_works_plain() {
    reprovision_after_partitioned(&["migrate"]).await;
}

async fn reprovision_after_partitioned(args: &[&str]) {
    {
        let db = TestDb::new_unmigrated().await;
        let out = idem(&db.url, &["migrate", "--partitioned"]);
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        let mut conn = postgres::establish(&db.url).await.unwrap();
        conn.batch_execute(
            "DROP TABLE idempotency_keys, idempotency_responses, idempotency_partitioning",
        )
        .await
        .unwrap();
        for name in migration_names().iter().rev() {
            let sql =
                std::fs::read_to_string(migrations_dir().join(name).join("down.sql")).unwrap();
            conn.batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("down of {name}: {e}"));
        }
        let versions: Vec<String> = migration_names()
            .iter()
            .map(|n| format!("'{}'", n.split('_').next().unwrap().replace('-', "")))
            .collect();
        conn.batch_execute(&format!(
            "DELETE FROM __diesel_schema_migrations WHERE version IN ({})",
            versions.join(",")
        ))
        .await
        .unwrap();
        let out = idem(&db.url, args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?} after the documented procedure: {}",
            show(&out)
        );
        let store = postgres::PostgresStore::connect(&db.url).await.unwrap();
        store
            .check()
            .await
            .unwrap_or_else(|e| panic!("{args:?}: store check after re-provisioning: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// Upgrade with live data: a database at an older migration, records written the way that
// version's statements wrote them, then the remaining migrations and the current store.

use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::{
    IdempotencyStore, PostgresStore, ReservationToken, ReserveOutcome, Scope, StoredResponse,
    WriteOutcome,
};
use idempotency_actix::Fingerprint;

fn hex(bytes: &[u8]) -> String {
    let mut s = String::from("'\\x");
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s.push_str("'::bytea");
    s
}

fn scope_of(key: &str) -> Scope {
    Scope {
        tenant: "acme".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of_request("POST", "/payments", "", true, body.as_bytes())
}

/// Apply the first `upto` migrations by hand (their up.sql, as diesel would, recorded in its
/// bookkeeping table), for the partitioned layout when `partitioned`.
async fn migrate_by_hand(
    conn: &mut diesel_async::AsyncPgConnection,
    upto: usize,
    partitioned: bool,
) {
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS __diesel_schema_migrations (\
         version VARCHAR(50) PRIMARY KEY NOT NULL, \
         run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .await
    .unwrap();
    if partitioned {
        conn.batch_execute(
            "SET idempotency.layout = 'partitioned'; SET idempotency.partition_interval = 'daily'",
        )
        .await
        .unwrap();
    }
    for name in migration_names().iter().take(upto) {
        let sql = std::fs::read_to_string(migrations_dir().join(name).join("up.sql")).unwrap();
        conn.batch_execute(&format!("BEGIN; {sql}; COMMIT;"))
            .await
            .unwrap_or_else(|e| panic!("up of {name}: {e}"));
        let version = name.split('_').next().unwrap().replace('-', "");
        conn.batch_execute(&format!(
            "INSERT INTO __diesel_schema_migrations (version) VALUES ('{version}')"
        ))
        .await
        .unwrap();
    }
}

/// What the old version's reserve sent.
async fn old_reserve(
    conn: &mut diesel_async::AsyncPgConnection,
    key: &str,
    fingerprint: &Fingerprint,
    token: uuid_text::Token,
    lease_us: i64,
) {
    conn.batch_execute(&format!(
        "SELECT * FROM idempotency_reserve('acme', 'POST', '/payments', '{key}', {}, '{}'::uuid, {lease_us})",
        hex(fingerprint.as_bytes()),
        token.0
    ))
    .await
    .unwrap();
}

mod uuid_text {
    #[derive(Clone)]
    pub struct Token(pub String);
}

/// What the old version's complete sent: before 000004 the UPDATE itself, from 000004 on the
/// function.
async fn old_complete(
    conn: &mut diesel_async::AsyncPgConnection,
    key: &str,
    token: &uuid_text::Token,
    response: &StoredResponse,
    with_function: bool,
) {
    let headers = hex(&response.encode_headers());
    let body = hex(&response.body);
    let sql = if with_function {
        format!(
            "SELECT idempotency_complete('acme', 'POST', '/payments', '{key}', '{}'::uuid, {}::smallint, {headers}, {body}, 3600000000)",
            token.0, response.status
        )
    } else {
        format!(
            "UPDATE idempotency_keys SET state = 'completed', response_status = {}, \
             response_headers = {headers}, response_body = {body}, completed_at = now(), \
             locked_until = NULL, expires_at = now() + interval '1 hour' \
             WHERE tenant = 'acme' AND method = 'POST' AND path = '/payments' \
             AND idempotency_key = '{key}' AND state = 'in_flight' AND token = '{}'::uuid",
            response.status, token.0
        )
    };
    conn.batch_execute(&sql).await.unwrap();
}

fn response(n: u8) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-odd".into(), Bytes::from(vec![0x80, 0xff, b' ', n])),
        ],
        body: Bytes::from(vec![0u8, 1, 2, 0xfe, 0xff, n, b'\n']),
    }
}

async fn upgrade_with_live_data(upto: usize, partitioned: bool) {
    let db = TestDb::new_unmigrated().await;
    let mut conn = postgres::establish(&db.url).await.unwrap();
    migrate_by_hand(&mut conn, upto, partitioned).await;
    let with_function = upto >= 4;
    let t = |_: u8| uuid_text::Token(ReservationToken::random().as_uuid().to_string());

    // completed, with bytes that are not text
    let done = t(1);
    old_reserve(&mut conn, "done", &fp("a"), done.clone(), 60_000_000).await;
    old_complete(&mut conn, "done", &done, &response(1), with_function).await;
    // live reservation (its holder still running on an old instance)
    let live = t(2);
    old_reserve(&mut conn, "live", &fp("b"), live.clone(), 60_000_000).await;
    // ended reservation
    let ended = t(3);
    old_reserve(&mut conn, "ended", &fp("c"), ended.clone(), 1_000).await;
    tokio::time::sleep(Duration::from_millis(50)).await;

    let applied = postgres::run_migrations(&db.url)
        .await
        .expect("the rest of the migrations");
    assert_eq!(applied.len(), migration_names().len() - upto, "{applied:?}");

    for fast in [false, true] {
        let store = PostgresStore::builder(db.url.clone())
            .replay_fast_path(fast)
            .build()
            .await
            .unwrap();
        store.check().await.expect("check after the upgrade");
        match store
            .reserve(&scope_of("done"), &fp("a"), Duration::from_secs(10))
            .await
        {
            Ok(ReserveOutcome::Completed {
                response: r,
                fingerprint,
                ..
            }) => {
                assert_eq!(fingerprint, fp("a"));
                assert_eq!(
                    r,
                    response(1),
                    "replay of a record stored before the upgrade"
                );
            }
            other => panic!("upto {upto} partitioned {partitioned} fast {fast}: done: {other:?}"),
        }
        match store
            .reserve(&scope_of("live"), &fp("b"), Duration::from_secs(10))
            .await
        {
            Ok(ReserveOutcome::InFlight { .. }) => {}
            other => panic!("upto {upto} partitioned {partitioned}: live: {other:?}"),
        }
        match store
            .reserve(&scope_of("ended"), &fp("x"), Duration::from_secs(10))
            .await
        {
            Ok(ReserveOutcome::InFlight { .. }) => {}
            other => panic!("upto {upto} partitioned {partitioned}: ended, other fp: {other:?}"),
        }
    }
    let store = PostgresStore::connect(&db.url).await.unwrap();
    // The live holder (an old instance) completes with its token through the new store.
    let token = ReservationToken::from_uuid(live.0.parse().unwrap());
    assert_eq!(
        store
            .complete(
                &scope_of("live"),
                &token,
                &response(2),
                Duration::from_secs(60)
            )
            .await
            .unwrap(),
        WriteOutcome::Applied
    );
    match store
        .reserve(&scope_of("live"), &fp("b"), Duration::from_secs(10))
        .await
    {
        Ok(ReserveOutcome::Completed { response: r, .. }) => assert_eq!(r, response(2)),
        other => panic!("live after complete: {other:?}"),
    }
    match store
        .reserve(&scope_of("ended"), &fp("c"), Duration::from_secs(10))
        .await
    {
        Ok(ReserveOutcome::Reserved { .. }) => {}
        other => panic!("ended, same fp: {other:?}"),
    }
    // The old holder of the ended reservation is fenced off.
    let old = ReservationToken::from_uuid(ended.0.parse().unwrap());
    assert_eq!(
        store
            .complete(
                &scope_of("ended"),
                &old,
                &response(3),
                Duration::from_secs(60)
            )
            .await
            .unwrap(),
        WriteOutcome::Stale
    );
}

#[tokio::test]
async fn upgrade_with_live_data_from_000002() {
    upgrade_with_live_data(2, false).await;
}

#[tokio::test]
async fn upgrade_with_live_data_from_000003() {
    upgrade_with_live_data(3, false).await;
}

#[tokio::test]
async fn upgrade_with_live_data_from_000004() {
    upgrade_with_live_data(4, false).await;
}

#[tokio::test]
async fn upgrade_with_live_data_from_000009() {
    upgrade_with_live_data(9, false).await;
}

#[tokio::test]
async fn upgrade_with_live_data_partitioned_from_000005() {
    upgrade_with_live_data(5, true).await;
}

#[tokio::test]
async fn upgrade_with_live_data_partitioned_from_000010() {
    upgrade_with_live_data(10, true).await;
}

// ---------------------------------------------------------------------------------------------
// A role without DDL rights (the grants docs/operations.md gives the application role).

/// The application role of docs/operations.md ("The application role needs SELECT, INSERT,
/// UPDATE, DELETE on idempotency_keys"), on a database whose migrations are all applied, calls
/// `run_migrations` at start-up (README: the payments example's `--migrate`). Nothing is
/// pending, so nothing needs DDL: `run_migrations` documents "empty when the schema was
/// already current, so running it twice is harmless", and `pending_migrations_on` was made to
/// avoid diesel's `CREATE TABLE IF NOT EXISTS __diesel_schema_migrations` for exactly this
/// role. `run_migrations` still sends that DDL (diesel's harness) and fails the start-up.
#[tokio::test]
async fn run_migrations_on_a_current_schema_needs_no_ddl() {
    let db = TestDb::new().await;
    let role = format!("idem_app_{}", db.name.trim_start_matches("idem_test_"));
    let mut conn = postgres::establish(&db.url).await.unwrap();
    conn.batch_execute(&format!(
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
         CREATE ROLE \"{role}\" LOGIN; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys TO \"{role}\"; \
         GRANT SELECT ON __diesel_schema_migrations TO \"{role}\""
    ))
    .await
    .unwrap();
    let url = db
        .url
        .replacen("postgres://postgres@", &format!("postgres://{role}@"), 1);
    assert_ne!(url, db.url, "url {}", db.url);
    let pending = postgres::pending_migrations(&url).await;
    let result = postgres::run_migrations(&url).await;
    // The store itself works for this role.
    let store = PostgresStore::connect(&url).await.unwrap();
    let served = store
        .reserve(&scope_of("k"), &fp("a"), Duration::from_secs(5))
        .await;
    drop(store);
    conn.batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .ok();
    assert!(matches!(pending, Ok(ref p) if p.is_empty()), "{pending:?}");
    assert!(
        matches!(served, Ok(ReserveOutcome::Reserved { .. })),
        "{served:?}"
    );
    assert!(
        matches!(result, Ok(ref applied) if applied.is_empty()),
        "run_migrations on an up-to-date schema as the application role: {result:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Migrating while requests are served, by two migrators at once.

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_migrators_under_traffic() {
    let db = TestDb::new_unmigrated().await;
    let mut conn = postgres::establish(&db.url).await.unwrap();
    migrate_by_hand(&mut conn, 4, false).await;
    // This version's store refuses a schema without the functions migration 000015 adds
    // (release, lease renewal, completed-by: they need only 000001's table). Created here
    // ahead of their migration, unrecorded, so the traffic runs through every migration from
    // 000005 on; 000015 then replaces them with themselves.
    conn.batch_execute(include_str!(
        "../../migrations/2026-12-07-000015_scope_statements_as_functions/up.sql"
    ))
    .await
    .unwrap();
    let store = std::sync::Arc::new(PostgresStore::connect(&db.url).await.unwrap());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let store = store.clone();
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let mut errors = Vec::new();
            let mut n = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                let key = scope_of(&format!("w{w}-{}", n / 2));
                match store.reserve(&key, &fp("a"), Duration::from_secs(10)).await {
                    Ok(ReserveOutcome::Reserved { token }) => {
                        match store
                            .complete(&key, &token, &response(1), Duration::from_secs(60))
                            .await
                        {
                            Ok(WriteOutcome::Applied) => {}
                            other => errors.push(format!("complete: {other:?}")),
                        }
                    }
                    Ok(ReserveOutcome::Completed { response: r, .. }) => {
                        if r != response(1) {
                            errors.push("replay differs".into());
                        }
                    }
                    other => errors.push(format!("reserve: {other:?}")),
                }
            }
            (n, errors)
        }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = db.url.clone();
    let cli = tokio::task::spawn_blocking(move || idem(&url, &["migrate"]));
    let (a, b) = tokio::join!(
        postgres::run_migrations(&db.url),
        postgres::run_migrations(&db.url)
    );
    let cli = cli.await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    let mut errors = Vec::new();
    for w in workers {
        let (n, e) = w.await.unwrap();
        total += n;
        errors.extend(e);
    }
    let a = a.expect("first migrator");
    let b = b.expect("second migrator");
    let cli_applied = String::from_utf8_lossy(&cli.stdout)
        .matches("applied ")
        .count();
    assert_eq!(cli.status.code(), Some(0), "{}", show(&cli));
    assert_eq!(
        a.len() + b.len() + cli_applied,
        migration_names().len() - 4,
        "{a:?} {b:?} {}",
        show(&cli)
    );
    assert!(total > 20, "{total}");
    assert!(
        errors.is_empty(),
        "{} errors of {total}: {:?}",
        errors.len(),
        &errors[..errors.len().min(5)]
    );
    let check = idem(&db.url, &["migrate", "--check"]);
    assert_eq!(check.status.code(), Some(0), "{}", show(&check));
}

/// docs/operations.md, "Choosing the partitioned layout": "`--partitioned` on a database that
/// already has the plain layout fails (exit 1) and changes nothing once the layout migration
/// (000005) has run there". On a plain database at 000006 it exits 1, but only after applying
/// every pending migration (000007..), which it does not report (the error path prints only
/// the error line).
#[tokio::test]
async fn migrate_partitioned_on_a_plain_database_changes_nothing() {
    let db = TestDb::new_unmigrated().await;
    let mut conn = postgres::establish(&db.url).await.unwrap();
    migrate_by_hand(&mut conn, 6, false).await;
    let before = postgres::pending_migrations(&db.url).await.unwrap();
    let out = idem(&db.url, &["migrate", "--partitioned"]);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let after = postgres::pending_migrations(&db.url).await.unwrap();
    assert_eq!(
        after,
        before,
        "exit 1 (\"changes nothing\") but migrations were applied; {}",
        show(&out)
    );
}
