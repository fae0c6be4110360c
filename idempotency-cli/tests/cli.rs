//! `idem-cli` end to end: the built binary run as a process against real PostgreSQL databases
//! from the e2e harness (one fresh database per test).
//!
//! What is asserted is what cron jobs, deploy gates and operators rely on: exit codes, the one
//! summary line, JSON output that parses, exact purge counts, and that a released key can be
//! reserved again through the store the middleware uses.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use diesel::sql_types::{BigInt, Bool};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::{
    postgres, IdempotencyStore, PostgresStore, ReservationToken, ReserveOutcome, Scope,
    StoredResponse, WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::records::{self, State};
use idempotency_e2e::{with_database, TestDb};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idem-cli");

/// Exit codes, as documented in `idem-cli --help` and docs/operations.md.
const USAGE: i32 = 2;
const UNAVAILABLE: i32 = 3;
const NOT_PROVISIONED: i32 = 4;
const PENDING: i32 = 5;
const NOT_FOUND_OR_REFUSED: i32 = 6;

/// The purge advisory lock key of the table the session finds: "idempurg", its low 32 bits
/// XORed with the table's oid.
const PURGE_LOCK: &str =
    "(x'6964656d70757267'::bigint # 'idempotency_keys'::regclass::oid::bigint)";

/// Run `idem-cli args...` against `url` (passed through `DATABASE_URL`, the way cron and deploy
/// jobs pass it). The test process's own `DATABASE_URL` never leaks in.
fn idem(url: &str, args: &[&str]) -> Output {
    command(url, args)
        .output()
        .unwrap_or_else(|e| panic!("running {BIN}: {e}"))
}

fn command(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env("DATABASE_URL", url)
        .env_remove("REDIS_URL")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null());
    cmd
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Assert the exit code and, for failures, the promise: exactly one line on stderr, no panic,
/// no backtrace.
#[track_caller]
fn expect_code(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "exit code\nstdout: {}\nstderr: {}",
        stdout(out),
        stderr(out)
    );
    let err = stderr(out);
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(!err.contains("backtrace"), "backtrace: {err}");
    if code != 0 {
        assert_eq!(err.lines().count(), 1, "one stderr line expected: {err:?}");
        assert!(err.starts_with("idem-cli: "), "{err}");
    }
}

fn json_lines(out: &Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn json_one(out: &Output) -> Value {
    let mut lines = json_lines(out);
    assert_eq!(lines.len(), 1, "one JSON line expected: {}", stdout(out));
    lines.remove(0)
}

/// Run `idem-cli args...` against `url` ([`idem`]) and assert its exit code ([`expect_code`]).
#[track_caller]
fn idem_code(url: &str, args: &[&str], code: i32) -> Output {
    let out = idem(url, args);
    expect_code(&out, code);
    out
}

/// Run `idem-cli args...` against `url`, expecting exit 0 and one JSON line: that line.
#[track_caller]
fn idem_json(url: &str, args: &[&str]) -> Value {
    json_one(&idem_code(url, args, 0))
}

/// Run `idem-cli args...` with no `DATABASE_URL` at all (none passed, the test's own removed).
fn idem_without_url(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run")
}

/// Assert that `out`'s stdout contains `needle`.
#[track_caller]
fn assert_stdout_has(out: &Output, needle: &str) {
    let text = stdout(out);
    assert!(text.contains(needle), "stdout lacks {needle:?}: {text}");
}

/// Assert that `out`'s stderr contains `needle`.
#[track_caller]
fn assert_stderr_has(out: &Output, needle: &str) {
    let text = stderr(out);
    assert!(text.contains(needle), "stderr lacks {needle:?}: {text}");
}

/// Run each of `commands` on `url`: each exits 4 and says to run `idem-cli migrate`.
#[track_caller]
fn assert_each_not_provisioned(url: &str, commands: &[&[&str]]) {
    for args in commands {
        let out = idem_code(url, args, NOT_PROVISIONED);
        assert!(
            stderr(&out).contains("idem-cli migrate"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

/// `idem-cli migrate --partitioned --interval <interval>` on `url`, expecting exit 0.
#[track_caller]
fn migrate_partitioned(url: &str, interval: &str) -> Output {
    idem_code(
        url,
        &["migrate", "--partitioned", "--interval", interval],
        0,
    )
}

/// A port on 127.0.0.1 that nothing listens on: one we just had and closed.
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

async fn connect(db: &TestDb) -> AsyncPgConnection {
    postgres::establish(&db.url)
        .await
        .expect("connect to test db")
}

/// Counts the partitions that hold the instant now + 36 h (the default `--horizon`): exactly
/// one once purge created it.
const COVERING_THE_HORIZON: &str = "SELECT count(*) AS n FROM idempotency_partitions() \
     WHERE NOT is_default AND lower_bound <= now() + interval '36 hours' \
     AND upper_bound > now() + interval '36 hours'";

/// A database migrated to the hourly partitioned layout, with [`add_past_partition`].
async fn hourly_partitioned_with_a_past_partition() -> (TestDb, AsyncPgConnection) {
    let db = TestDb::new_unmigrated().await;
    migrate_partitioned(&db.url, "hourly");
    let mut conn = connect(&db).await;
    add_past_partition(&mut conn).await;
    (db, conn)
}

/// A partition of the responses table for an hour 5 hours ago: only expired rows fit in it,
/// so purge may drop it.
async fn add_past_partition(conn: &mut AsyncPgConnection) {
    conn.batch_execute(
        "CREATE TABLE idempotency_responses_past PARTITION OF idempotency_responses \
         FOR VALUES FROM (date_trunc('hour', now()) - interval '5 hours') \
         TO (date_trunc('hour', now()) - interval '4 hours')",
    )
    .await
    .unwrap();
}

const MINUTE: i64 = 60;
const HOUR: i64 = 60 * MINUTE;
const DAY: i64 = 24 * HOUR;

async fn keys(conn: &mut AsyncPgConnection) -> Vec<String> {
    records::keys(conn).await.expect("select keys")
}

/// Insert a record as it is (the harness's [`records::seed`]): its state and times (seconds
/// from the database's clock, negative in the past) decide what purge and list make of it.
async fn seed(
    conn: &mut AsyncPgConnection,
    tenant: &str,
    key: &str,
    state: State,
    created: i64,
    expires: i64,
) {
    let row = records::Seed {
        tenant,
        key,
        state,
        created,
        expires,
    };
    records::seed(conn, &row).await.expect("seed row");
}

fn scope(tenant: &str, key: &str) -> Scope {
    Scope {
        tenant: tenant.into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::of_request("POST", "/payments", "", true, body.as_bytes())
}

/// `store.reserve` with a lease of `lease_secs`; the store must answer.
async fn reserve(
    store: &PostgresStore,
    scope: &Scope,
    fingerprint: &Fingerprint,
    lease_secs: u64,
) -> ReserveOutcome {
    store
        .reserve(scope, fingerprint, Duration::from_secs(lease_secs))
        .await
        .expect("reserve")
}

/// Reserve a key that must be free and return the reservation's token (`what` says which
/// reservation failed).
async fn reserve_token(
    store: &PostgresStore,
    scope: &Scope,
    fingerprint: &Fingerprint,
    lease_secs: u64,
    what: &str,
) -> ReservationToken {
    match reserve(store, scope, fingerprint, lease_secs).await {
        ReserveOutcome::Reserved { token } => token,
        other => panic!("{what}: {other:?}"),
    }
}

/// `store.complete` with a TTL of `ttl_secs`; the store must answer.
async fn complete(
    store: &PostgresStore,
    scope: &Scope,
    token: &ReservationToken,
    response: &StoredResponse,
    ttl_secs: u64,
) -> WriteOutcome {
    store
        .complete(scope, token, response, Duration::from_secs(ttl_secs))
        .await
        .expect("complete")
}

/// A response with `status`, no headers and `body`.
fn stored(status: u16, body: impl Into<Bytes>) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![],
        body: body.into(),
    }
}

/// `show KEY` streams its records (docs/operations.md): 100 records of 1 MiB under one key,
/// and the CLI's peak memory, read while it waits on a reader that has taken one line, stays
/// far below the 100 MiB they hold. Before, every matching record was loaded with its response
/// before the first line was printed (a peak of 357 MB for 300 such records).
#[tokio::test]
async fn show_streams_its_records() {
    use std::io::BufRead;
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let body = Bytes::from(vec![b'x'; 1 << 20]);
    for t in 0..100 {
        let scope = scope(&format!("t{t:03}"), "same-key");
        let token = reserve_token(&store, &scope, &fingerprint("{}"), 60, "seed").await;
        let done = complete(&store, &scope, &token, &stored(201, body.clone()), 3600).await;
        assert_eq!(done, WriteOutcome::Applied);
    }
    let mut child = command(&db.url, &["show", "same-key", "--format", "json"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn show");
    let mut reader = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("first record");
    // A record's line is over 1 MiB and a pipe holds 64 KiB: the CLI now waits on this reader.
    std::thread::sleep(Duration::from_millis(300));
    let peak = idempotency_e2e::proc::peak_rss_kib(child.id());
    let mut records = 1;
    for rest in reader.lines() {
        rest.expect("a record");
        records += 1;
    }
    let status = child.wait().expect("show exits");
    assert!(status.success(), "{status:?}");
    assert_eq!(records, 100);
    assert!(
        peak < 64 * 1024,
        "show held {peak} KiB at its peak while 100 MiB of records matched"
    );
}

#[tokio::test]
async fn migrate_twice_and_check_gates_deploys() {
    let db = TestDb::new_unmigrated().await;

    let out = idem_code(&db.url, &["migrate", "--check"], PENDING);
    assert_stdout_has(&out, "pending 2026-11-30-000001_create_idempotency_keys");
    assert_stdout_has(&out, "pending 2026-11-30-000002_reserve_function");
    assert_stderr_has(&out, "pending");

    let out = idem_code(
        &db.url,
        &["migrate", "--check", "--format", "json"],
        PENDING,
    );
    assert_eq!(json_one(&out)["up_to_date"], Value::Bool(false));

    // --check applied nothing: every other command still says "not provisioned".
    assert_each_not_provisioned(
        &db.url,
        &[
            &["list"],
            &["stats"],
            &["purge"],
            &["purge", "--dry-run"],
            &["show", "k"],
            &["release", "k"],
        ],
    );

    let out = idem_code(&db.url, &["migrate"], 0);
    assert_eq!(
        stdout(&out),
        "applied 2026-11-30-000001_create_idempotency_keys\n\
         applied 2026-11-30-000002_reserve_function\n\
         applied 2026-12-01-000003_transactional_claim\n\
         applied 2026-12-01-000004_layout_functions\n\
         applied 2026-12-01-000005_partitioned_layout\n\
         applied 2026-12-02-000006_inlinable_lock_key\n\
         applied 2026-12-02-000007_partitioned_generic_plans\n\
         applied 2026-12-03-000008_partition_create_without_moving\n\
         applied 2026-12-04-000009_default_partition_older_than\n\
         applied 2026-12-04-000010_serializable_claim_inserts_first\n\
         applied 2026-12-04-000011_complete_after_a_partition_attach\n\
         applied 2026-12-05-000012_partition_drop_waits_once\n\
         applied 2026-12-06-000013_reserve_after_a_response_purge\n\
         applied 2026-12-06-000014_partition_drop_lists_under_the_lock\n\
         applied 2026-12-07-000015_scope_statements_as_functions\n\
         applied 2026-12-07-000016_rotated_layout\n\
         applied 2026-12-07-000017_partition_drop_waits_for_the_default\n\
         applied 2026-12-07-000018_request_functions_plan_no_sequential_scan\n\
         layout: plain\n"
    );

    let out = idem_code(&db.url, &["migrate"], 0);
    assert_stdout_has(&out, "nothing to apply");

    let out = idem_code(&db.url, &["migrate", "--check"], 0);
    assert_stdout_has(&out, "up to date");

    let v = idem_json(&db.url, &["--format", "json", "migrate", "--check"]);
    assert_eq!(v["up_to_date"], Value::Bool(true));
    assert_eq!(v["pending"], Value::Array(vec![]));

    let stats = idem_json(&db.url, &["stats", "--format", "json"]);
    assert_eq!(stats["total"], 0);
}

/// A table or function dropped by hand under a provisioned database: the other commands say
/// "run `idem-cli migrate`", so `migrate` and the deploy gate must not answer "up to date"
/// (exit 0) while the bookkeeping says every migration ran. Both refuse with exit 4 and say
/// what is missing and where the recovery is documented.
#[tokio::test]
async fn migrate_does_not_call_a_schema_dropped_by_hand_up_to_date() {
    for drop in [
        "DROP TABLE idempotency_keys",
        "DROP FUNCTION idempotency_reserve(text, text, text, text, bytea, uuid, bigint)",
    ] {
        let db = TestDb::new().await;
        let mut conn = connect(&db).await;
        conn.batch_execute(drop).await.expect("drop");
        for args in [
            &["migrate", "--check"][..],
            &["migrate"],
            &["--format", "json", "migrate", "--check"],
        ] {
            let out = idem_code(&db.url, args, NOT_PROVISIONED);
            let err = stderr(&out);
            for needle in ["recorded as applied", "docs/operations.md"] {
                assert!(err.contains(needle), "{drop}, {args:?}: {err}");
            }
            assert!(
                !stdout(&out).contains("up to date"),
                "{drop}, {args:?}: {}",
                stdout(&out)
            );
        }
    }
}

/// The purge fixture: what is expired, live and in flight, in two tenants.
async fn purge_fixture(conn: &mut AsyncPgConnection) {
    let two_days = -2 * DAY;
    let five_days = -5 * DAY;
    let rows = [
        // Expired completed records: 3 in tenant a (one created 5 days ago), 2 in tenant b.
        ("a", "exp-a1", State::Completed, two_days, -HOUR),
        ("a", "exp-a2", State::Completed, two_days, -1),
        ("a", "exp-a3", State::Completed, five_days, -4 * DAY),
        ("b", "exp-b1", State::Completed, two_days, -DAY),
        ("b", "exp-b2", State::Completed, two_days, -DAY),
        // Live completed records: never purged.
        ("a", "live-a1", State::Completed, 0, DAY),
        ("b", "live-b1", State::Completed, 0, DAY),
        ("b", "live-b2", State::Completed, two_days, MINUTE),
        // Reservations: lease ended 2 days ago (beyond the default 24h grace), 10 minutes ago
        // (within it), and one still running.
        ("a", "stuck-old", State::InFlight, five_days, -2 * DAY),
        ("b", "stuck-old-b", State::InFlight, five_days, -2 * DAY),
        (
            "a",
            "stuck-new",
            State::InFlight,
            -11 * MINUTE,
            -10 * MINUTE,
        ),
        ("a", "running", State::InFlight, 0, MINUTE),
    ];
    for (tenant, key, state, created, expires) in rows {
        seed(conn, tenant, key, state, created, expires).await;
    }
}

#[tokio::test]
async fn purge_counts_and_deletes_exactly_the_expired_records() {
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    purge_fixture(&mut conn).await;
    let all = keys(&mut conn).await;
    assert_eq!(all.len(), 12);

    let dry = |args: &[&str]| {
        let mut full = vec!["purge", "--dry-run", "--format", "json"];
        full.extend_from_slice(args);
        let v = idem_json(&db.url, &full);
        assert_eq!(v["dry_run"], Value::Bool(true));
        assert_eq!(v["purged"], 0);
        (
            v["would_purge"].as_u64().expect("would_purge"),
            v["completed"].as_u64().expect("completed"),
            v["in_flight"].as_u64().expect("in_flight"),
        )
    };
    assert_eq!(dry(&[]), (7, 5, 2));
    assert_eq!(dry(&["--grace", "5m"]), (8, 5, 3));
    assert_eq!(dry(&["--grace", "0"]), (8, 5, 3));
    assert_eq!(dry(&["--tenant", "a"]), (4, 3, 1));
    assert_eq!(dry(&["--tenant", "nobody"]), (0, 0, 0));
    assert_eq!(dry(&["--older-than", "3d"]), (3, 1, 2));
    assert_eq!(dry(&["--older-than", "3d", "--tenant", "b"]), (1, 0, 1));

    // Text dry run: one line, and nothing deleted.
    let out = idem_code(&db.url, &["purge", "--dry-run"], 0);
    assert_eq!(
        stdout(&out).lines().count(),
        1,
        "one summary line: {}",
        stdout(&out)
    );
    assert!(stdout(&out).starts_with("dry run: would purge 7 records"));
    assert_eq!(keys(&mut conn).await, all, "dry run deleted something");

    // Tenant b only, in batches of one.
    let v = idem_json(
        &db.url,
        &[
            "purge",
            "--tenant",
            "b",
            "--batch-size",
            "1",
            "--format",
            "json",
        ],
    );
    assert_eq!(v["purged"], 3);
    assert_eq!(v["dry_run"], Value::Bool(false));
    assert_eq!(v["batches"], 4, "3 full batches of 1, then an empty one");

    // The rest, in batches of two: one summary line in the documented form.
    let out = idem_code(&db.url, &["purge", "--batch-size", "2"], 0);
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.starts_with("purged 4 records in "),
        "summary line: {text}"
    );
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));

    // Exactly the live records and the reservations within their grace period remain.
    assert_eq!(
        keys(&mut conn).await,
        ["live-a1", "live-b1", "live-b2", "running", "stuck-new"]
    );

    assert_eq!(
        idem_json(&db.url, &["purge", "--format", "json"])["purged"],
        0
    );

    // A shorter grace lets the recently stuck reservation go too; the running one stays.
    let out = idem_code(&db.url, &["purge", "--grace", "1m"], 0);
    assert!(
        stdout(&out).starts_with("purged 1 records in "),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        keys(&mut conn).await,
        ["live-a1", "live-b1", "live-b2", "running"]
    );
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    flag: bool,
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn purge_lock_visible(conn: &mut AsyncPgConnection) -> bool {
    diesel::sql_query(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND classid = 1768187245 AND objsubid = 1 AND granted \
         AND objid = (1886745191 # 'idempotency_keys'::regclass::oid::bigint)::oid",
    )
    .get_result::<Count>(conn)
    .await
    .map(|c| c.n > 0)
    .unwrap_or_else(|e| panic!("reading pg_locks: {e}"))
}

/// `SELECT function(PURGE_LOCK)` (`pg_try_advisory_lock`, `pg_advisory_unlock`) on `conn`:
/// the boolean it answers.
async fn call_on_purge_lock(conn: &mut AsyncPgConnection, function: &str) -> bool {
    let answer: Flag = diesel::sql_query(format!("SELECT {function}({PURGE_LOCK}) AS flag"))
        .get_result(conn)
        .await
        .unwrap_or_else(|e| panic!("{function}: {e}"));
    answer.flag
}

/// Seed a completed record `key` of tenant `t`, created 2 days ago and expired a day ago.
async fn seed_expired(conn: &mut AsyncPgConnection, key: &str) {
    seed(conn, "t", key, State::Completed, -2 * DAY, -DAY).await;
}

/// A purge whose host vanished (power, network: no FIN reaches the server) kept its session,
/// and so the purge lock, until the server's TCP keepalive gave up (about 2 h 11 min by
/// default): every cron run meanwhile said "skipped" and exited 0 (review, 2026-12-06). The
/// session now ends itself once idle longer than the purge ever pauses (`--pause` + 20 s,
/// PostgreSQL 14's `idle_session_timeout`). The vanished host is a
/// proxy that black-holes the purge's connection between two batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_purge_does_not_hold_the_lock_for_long() {
    use idempotency_e2e::proxy::{at_local_port, host_port, FaultyProxy};
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    for key in ["exp-1", "exp-2", "exp-3"] {
        seed_expired(&mut conn, key).await;
    }
    let proxy = FaultyProxy::start(host_port(&db.url)).await;
    let through = at_local_port(&db.url, proxy.port());
    let mut vanishing = spawn_idem(&through, &["purge", "--batch-size", "1", "--pause", "1s"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while keys(&mut conn).await.len() == 3 {
        assert!(Instant::now() < deadline, "the first batch never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.cut_open_connections();
    assert!(
        purge_lock_visible(&mut conn).await,
        "the purge holds its lock"
    );

    let started = Instant::now();
    loop {
        let out = idem_json(&db.url, &["--format", "json", "purge"]);
        if out["skipped"] != Value::Bool(true) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(45),
            "the lock of a purge nobody hears from any more is still held"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(keys(&mut conn).await.is_empty());
    let _ = vanishing.kill();
    let _ = vanishing.wait();
}

/// A purge that finds another one running skips, exit 0: a normal end, which must leave the
/// session as it found it, as a finished purge does. It had set its `idle_session_timeout`
/// (`--pause` + 20 s) before trying the lock and returned without resetting it, so behind a
/// session pooler that does not reset sessions the app's next use of that server connection
/// was cut after 20 idle seconds, at every cron tick that overlapped (review, 2026-12-06).
/// Seen on the wire: the reset statement reaches the server. (Two worker threads: the proxy
/// runs on them while this thread waits for the process.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_purge_resets_its_idle_limit() {
    use idempotency_e2e::proxy::{Cut, CutProxy};
    let db = TestDb::new().await;
    let mut holder = connect(&db).await;
    assert!(call_on_purge_lock(&mut holder, "pg_try_advisory_lock").await);
    let proxy = CutProxy::for_url(&db.url).await;
    // The reset reads the setting's `reset_val`; nothing else the purge sends does.
    proxy.arm("reset_val", Cut::AfterSend);
    let out = idem_code(&proxy.url_through(&db.url), &["purge"], 0);
    assert_stdout_has(&out, "another purge is running");
    assert_eq!(
        proxy.fired(),
        1,
        "the skipped purge never reset its idle limit"
    );
    assert!(call_on_purge_lock(&mut holder, "pg_advisory_unlock").await);
}

/// Keys and tenants are escaped wherever they appear (docs/operations.md), on stdout too:
/// Rust's `Debug`, which quoted them, leaves invisible fillers such as U+3164 as they are, so
/// `release`, `show` and `stats` printed a key ending in one as a key ending in a blank
/// (review, 2026-12-06).
#[tokio::test]
async fn invisible_characters_in_keys_are_escaped_on_stdout() {
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    let (tenant, key) = ("t\u{3164}", "k\u{3164}");
    seed(&mut conn, tenant, key, State::InFlight, -DAY, -HOUR).await;
    for args in [
        vec!["show", key],
        vec!["stats"],
        vec!["release", key, "--force"],
    ] {
        let out = idem_code(&db.url, &args, 0);
        let text = stdout(&out);
        assert!(
            text.contains("k\\u{3164}"),
            "{args:?}: the key is not escaped: {text}"
        );
        assert!(
            text.contains("t\\u{3164}"),
            "{args:?}: the tenant is not escaped: {text}"
        );
        assert!(
            !text.contains('\u{3164}'),
            "{args:?}: a raw filler on stdout: {text}"
        );
    }
}

#[tokio::test]
async fn overlapping_purges_do_not_both_work() {
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    for i in 0..6 {
        seed_expired(&mut conn, &format!("exp-{i}")).await;
    }

    // 1. The lock is held elsewhere (a purge on another host): skip, say so, exit 0.
    let mut holder = connect(&db).await;
    assert!(call_on_purge_lock(&mut holder, "pg_try_advisory_lock").await);
    let out = idem_code(&db.url, &["purge"], 0);
    assert_stdout_has(&out, "another purge is running");
    let v = idem_json(&db.url, &["purge", "--format", "json"]);
    assert_eq!(v["skipped"], Value::Bool(true));
    assert_eq!(v["purged"], 0);
    assert_eq!(
        keys(&mut conn).await.len(),
        6,
        "a skipped purge deleted rows"
    );
    // Unlock explicitly: a dropped connection's session (and its lock) ends asynchronously, and
    // the next step must see only the first purge's lock.
    assert!(call_on_purge_lock(&mut holder, "pg_advisory_unlock").await);
    assert!(!purge_lock_visible(&mut conn).await);
    drop(holder);

    // 2. Two real purges at once: the first is slowed down (batches of one, pauses) and the
    // second starts while the first visibly holds the lock.
    let first = spawn_idem(
        &db.url,
        &[
            "purge",
            "--batch-size",
            "1",
            "--pause",
            "300ms",
            "--format",
            "json",
        ],
    );
    let started = Instant::now();
    while !purge_lock_visible(&mut conn).await {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "first purge never took the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let second = idem(&db.url, &["purge", "--format", "json"]);
    let first = first.wait_with_output().expect("first purge");
    expect_code(&first, 0);
    expect_code(&second, 0);
    let (first, second) = (json_one(&first), json_one(&second));
    assert_eq!(second["skipped"], Value::Bool(true), "{second}");
    assert_eq!(first["purged"], 6, "{first}");
    assert!(keys(&mut conn).await.is_empty());

    // The lock was released: the next run works normally.
    let v = idem_json(&db.url, &["purge", "--format", "json"]);
    assert_eq!(v.get("skipped"), None);
}

#[tokio::test]
async fn list_show_and_stats_in_json() {
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.expect("store");

    // A completed record written by the store itself, with a JSON body and headers.
    let body = r#"{"id":"pay_1","amount":100,"currency":"EUR"}"#;
    let paid = scope("acme", "order-1");
    let token = reserve_token(&store, &paid, &fingerprint(body), 60, "acme/order-1").await;
    let response = StoredResponse {
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-raw".into(), Bytes::from_static(&[0xff, 0x00])),
        ],
        ..stored(201, body)
    };
    let written = complete(&store, &paid, &token, &response, 86_400).await;
    assert_eq!(written, WriteOutcome::Applied);

    // A completed record with a binary body, in another tenant.
    let binary = scope("globex", "order-1");
    let token = reserve_token(&store, &binary, &fingerprint("x"), 60, "globex/order-1").await;
    let bin_body: Vec<u8> = (0u8..=255).cycle().take(600).collect();
    complete(&store, &binary, &token, &stored(200, bin_body), 86_400).await;

    // A running reservation, an old stuck one and an expired completed record.
    reserve(&store, &scope("acme", "order-2"), &fingerprint("y"), 60).await;
    let mut conn = connect(&db).await;
    for (key, state, created, expires) in [
        ("stuck-1", State::InFlight, -3 * HOUR, -2 * HOUR),
        ("old-1", State::Completed, -3 * DAY, -2 * DAY),
    ] {
        seed(&mut conn, "acme", key, state, created, expires).await;
    }

    // list: every record, oldest first, one JSON object per line.
    let out = idem_code(&db.url, &["list", "--format", "json"], 0);
    let all = json_lines(&out);
    assert_eq!(all.len(), 5);
    assert_eq!(all[0]["key"], "old-1");
    assert_eq!(all[1]["key"], "stuck-1");
    let keys_of = |args: &[&str]| -> Vec<String> {
        let mut full = vec!["list", "--format", "json"];
        full.extend_from_slice(args);
        let out = idem_code(&db.url, &full, 0);
        let mut keys: Vec<String> = json_lines(&out)
            .iter()
            .map(|v| {
                format!(
                    "{}/{}",
                    v["tenant"].as_str().unwrap_or("?"),
                    v["key"].as_str().unwrap_or("?")
                )
            })
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(keys_of(&["--tenant", "globex"]), ["globex/order-1"]);
    assert_eq!(
        keys_of(&["--state", "in-flight"]),
        ["acme/order-2", "acme/stuck-1"]
    );
    assert_eq!(
        keys_of(&["--state", "completed"]),
        ["acme/order-1", "globex/order-1"]
    );
    assert_eq!(keys_of(&["--state", "expired"]), ["acme/old-1"]);
    assert_eq!(keys_of(&["--key-prefix", "order-"]).len(), 3);
    assert_eq!(
        keys_of(&["--older-than", "1h"]),
        ["acme/old-1", "acme/stuck-1"]
    );
    assert_eq!(
        keys_of(&["--older-than", "1h", "--state", "in-flight"]),
        ["acme/stuck-1"]
    );
    assert_eq!(keys_of(&["--limit", "2"]), ["acme/old-1", "acme/stuck-1"]);
    let stuck = &all[1];
    assert_eq!(stuck["state"], "in_flight");
    assert_eq!(stuck["lease_live"], Value::Bool(false));
    assert_eq!(stuck["expired"], Value::Bool(true));

    // The table form: a header and one row per record.
    let table = stdout(&idem_code(&db.url, &["list"], 0));
    assert!(table.starts_with("TENANT"), "{table}");
    assert_eq!(table.lines().count(), 6, "{table}");
    let out = idem_code(&db.url, &["list", "--limit", "1"], 0);
    assert!(
        stderr(&out).contains("--limit"),
        "truncation is said on stderr"
    );

    // show: the whole record with its decoded headers and parsed body.
    let v = idem_json(
        &db.url,
        &["show", "order-1", "--tenant", "acme", "--format", "json"],
    );
    assert_eq!(v["tenant"], "acme");
    assert_eq!(v["state"], "completed");
    assert_eq!(v["fingerprint"], fingerprint(body).to_hex());
    assert_eq!(v["response"]["status"], 201);
    assert_eq!(
        v["response"]["headers"][0],
        serde_json::json!({"name": "content-type", "value": "application/json"})
    );
    assert_eq!(v["response"]["headers"][1]["value_base64"], "/wA=");
    assert_eq!(
        v["response"]["body_json"],
        serde_json::json!({"id": "pay_1", "amount": 100, "currency": "EUR"})
    );

    // Without --tenant the key matches in both tenants: both are shown.
    let out = idem_code(&db.url, &["show", "order-1", "--format", "json"], 0);
    assert_eq!(json_lines(&out).len(), 2);

    // Text: JSON bodies pretty-printed in their stored key order; binary bodies as hex.
    let text = stdout(&idem_code(
        &db.url,
        &["show", "order-1", "--tenant", "acme", "--method", "post"],
        0,
    ));
    assert!(
        text.contains("  {\n    \"id\": \"pay_1\",\n    \"amount\": 100,"),
        "{text}"
    );
    assert!(text.contains("content-type: application/json"), "{text}");
    let text = stdout(&idem_code(
        &db.url,
        &[
            "show",
            "order-1",
            "--tenant",
            "globex",
            "--path",
            "/payments",
        ],
        0,
    ));
    assert!(text.contains("600 bytes"), "{text}");
    assert!(text.contains("00000000  00 01 02 03"), "{text}");
    assert!(text.contains("344 more bytes"), "{text}");
    let v = idem_json(
        &db.url,
        &["show", "order-1", "--tenant", "globex", "--format", "json"],
    );
    assert_eq!(v["response"]["body_bytes"], 600);
    assert_eq!(v["response"]["body_json"], Value::Null);
    assert!(v["response"]["body_base64"]
        .as_str()
        .is_some_and(|b| b.starts_with("AAECAwQF")));

    // An in-flight record has no response yet.
    let v = idem_json(&db.url, &["show", "order-2", "--format", "json"]);
    assert_eq!(v["state"], "in_flight");
    assert_eq!(v["lease_live"], Value::Bool(true));
    assert_eq!(v.get("response"), None);

    // No such record: exit 6, one line.
    let out = idem_code(
        &db.url,
        &["show", "order-1", "--tenant", "initech"],
        NOT_FOUND_OR_REFUSED,
    );
    assert_stderr_has(&out, "no record");

    // stats: counts by state, expired-but-not-purged, oldest in-flight, sizes.
    let s = idem_json(&db.url, &["stats", "--format", "json"]);
    assert_eq!(s["total"], 5);
    assert_eq!(s["in_flight"], 2);
    assert_eq!(s["in_flight_lease_live"], 1);
    assert_eq!(s["in_flight_lease_ended"], 1);
    assert_eq!(s["completed"], 3);
    assert_eq!(s["completed_live"], 2);
    assert_eq!(s["completed_expired"], 1);
    assert_eq!(s["expired_not_purged"], 2);
    assert_eq!(s["oldest_in_flight"]["key"], "stuck-1");
    assert!(s["oldest_in_flight_age_seconds"]
        .as_f64()
        .is_some_and(|a| a > 3.0 * 3600.0 - 60.0));
    assert!(s["table_bytes"].as_i64().is_some_and(|b| b > 0));
    assert!(s["index_bytes"].as_i64().is_some_and(|b| b > 0));
    assert_stdout_has(&idem_code(&db.url, &["stats"], 0), "stuck-1");
}

/// From review R2 (2026-12-05): an expired completed record was refused with "removing it
/// makes the next request with this key execute again", which is already true of an expired
/// record; the refusal now says so and points at `purge`.
#[tokio::test]
async fn release_of_an_expired_completed_record_says_it_is_expired() {
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.expect("store");
    let key = scope("acme", "charge-9");
    let new_key = "a new key was not reserved";
    let token = reserve_token(&store, &key, &fingerprint("{}"), 60, new_key).await;
    complete(&store, &key, &token, &stored(201, "{}"), 1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let release = ["release", "charge-9", "--tenant", "acme"];
    let out = idem_code(&db.url, &release, NOT_FOUND_OR_REFUSED);
    let err = stderr(&out);
    assert!(err.contains("expired"), "{err}");
    assert!(err.contains("runs again whether or not"), "{err}");
    assert!(err.contains("idem-cli purge"), "{err}");
    assert!(!err.contains("removing it makes"), "{err}");
}

/// A database error part way through a `release` of several keys still reports the keys
/// refused before it, so the operator knows which to look at (review, 2026-12-06: only the
/// error was printed, and the earlier refusals were lost).
#[tokio::test]
async fn release_that_fails_part_way_still_reports_the_refusals_before() {
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.expect("store");
    reserve_token(
        &store,
        &scope("acme", "live"),
        &fingerprint("{}"),
        60,
        "live",
    )
    .await;
    reserve_token(
        &store,
        &scope("acme", "locked"),
        &fingerprint("{}"),
        1,
        "locked",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut holder = connect(&db).await;
    let lock = "SELECT 1 FROM idempotency_keys WHERE idempotency_key = 'locked' FOR UPDATE";
    hold_in_transaction(&mut holder, lock).await;
    let args = [
        "--statement-timeout",
        "1s",
        "release",
        "live",
        "locked",
        "--tenant",
        "acme",
    ];
    let out = idem(&db.url, &args);
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_ne!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_stderr_has(&out, "statement timeout");
    assert_stderr_has(&out, "key=\"live\"");
    assert_stderr_has(&out, "its request may still be running");
}

/// Several keys in one `release`: each released key is reported, each refused one gives its
/// reason on stderr, and the exit says how many were not released (exit 6); in JSON every
/// key gets its object, `"released": false` with the reason for a refused one.
#[tokio::test]
async fn release_of_several_keys_reports_each_and_counts_the_refused() {
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.expect("store");
    for key in ["r-1", "r-2"] {
        reserve_token(&store, &scope("acme", key), &fingerprint("{}"), 1, key).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let text = ["release", "r-1", "missing-1", "--tenant", "acme"];
    // Not `idem_code`: its "one stderr line" is for one error; here each refusal has its line.
    let out = idem(&db.url, &text);
    assert_eq!(
        out.status.code(),
        Some(NOT_FOUND_OR_REFUSED),
        "{}",
        stderr(&out)
    );
    assert!(
        stdout(&out).starts_with("released in_flight "),
        "{}",
        stdout(&out)
    );
    assert_stderr_has(&out, "no record with key \"missing-1\"");
    assert_stderr_has(&out, "1 of 2 keys not released (see above)");

    let json = [
        "--format",
        "json",
        "release",
        "missing-2",
        "r-2",
        "--tenant",
        "acme",
    ];
    let out = idem(&db.url, &json);
    assert_eq!(
        out.status.code(),
        Some(NOT_FOUND_OR_REFUSED),
        "{}",
        stderr(&out)
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["key"], "missing-2");
    assert_eq!(lines[0]["released"], false);
    assert!(
        lines[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no record")),
        "{lines:?}"
    );
    assert_eq!(lines[1]["released"], true);
    assert_eq!(lines[1]["state"], "in_flight");
    assert_stderr_has(&out, "1 of 2 keys not released (see above)");
}

/// Run `idem-cli args...` with its stdout a pipe nobody reads any more (a log shipper that
/// died, `| head -c0`): writes fail with EPIPE. The read end is closed as soon as the process
/// is started, before it has connected, let alone written.
fn idem_into_a_closed_pipe(url: &str, args: &[&str]) -> Output {
    let mut child = command(url, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {BIN}: {e}"));
    drop(child.stdout.take());
    child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for {BIN}: {e}"))
}

/// A reader that stopped reading ends a listing quietly (exit 0), but it must not hide a
/// command's failure: `migrate --check` with migrations pending, or a `release` with a key
/// refused, exited 0 once their output could not be written (review, 2026-12-06; before: 0).
#[tokio::test]
async fn a_closed_stdout_does_not_hide_a_failure() {
    let db = TestDb::new_unmigrated().await;
    let out = idem_into_a_closed_pipe(&db.url, &["migrate", "--check"]);
    expect_code(&out, PENDING);
    assert_stderr_has(&out, "pending");
    idem_code(&db.url, &["migrate"], 0);

    let store = PostgresStore::connect(&db.url).await.expect("store");
    for key in ["r-text", "r-json"] {
        reserve_token(&store, &scope("acme", key), &fingerprint("{}"), 1, key).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    for format in ["text", "json"] {
        let key = format!("r-{format}");
        let args = [
            "--format",
            format,
            "release",
            &key,
            "missing-1",
            "--tenant",
            "acme",
        ];
        let out = idem_into_a_closed_pipe(&db.url, &args);
        assert_eq!(
            out.status.code(),
            Some(NOT_FOUND_OR_REFUSED),
            "{format}: {}",
            stderr(&out)
        );
        assert_stderr_has(&out, "1 of 2 keys not released");
        assert!(
            records::records_for_key(&db.url, &key).is_empty(),
            "{format}: the ended reservation was released all the same"
        );
    }
}

#[tokio::test]
async fn release_unsticks_a_key_for_the_store() {
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.expect("store");
    let key = scope("acme", "charge-7");
    let original = fingerprint(r#"{"amount":100}"#);
    let changed = fingerprint(r#"{"amount":200}"#);
    let release = ["release", "charge-7", "--tenant", "acme"];
    let force = ["release", "charge-7", "--tenant", "acme", "--force"];

    // A request holds the key (its process then "hangs"): the key is blocked.
    let reserved = reserve(&store, &key, &original, 60).await;
    assert!(matches!(reserved, ReserveOutcome::Reserved { .. }));
    let blocked = reserve(&store, &key, &changed, 60).await;
    assert!(matches!(blocked, ReserveOutcome::InFlight { .. }));

    // Its lease is still running: release refuses without --force (exit 6), nothing removed.
    let out = idem_code(&db.url, &release, NOT_FOUND_OR_REFUSED);
    assert_stderr_has(&out, "--force");
    let blocked = reserve(&store, &key, &changed, 60).await;
    assert!(matches!(blocked, ReserveOutcome::InFlight { .. }));

    // --force removes it and says what it removed; the key can be reserved again at once.
    let text = stdout(&idem_code(&db.url, &force, 0));
    assert!(
        text.starts_with("released in_flight tenant=\"acme\" POST /payments key=\"charge-7\""),
        "{text}"
    );
    let again = reserve(&store, &key, &changed, 1).await;
    assert!(matches!(again, ReserveOutcome::Reserved { .. }));

    // A reservation whose lease ended is released without --force (JSON output).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let v = idem_json(
        &db.url,
        &[
            "release",
            "charge-7",
            "--tenant",
            "acme",
            "--method",
            "POST",
            "--path",
            "/payments",
            "--format",
            "json",
        ],
    );
    assert_eq!(v["released"], Value::Bool(true));
    assert_eq!(v["state"], "in_flight");
    let not_again = "the released key was not accepted again";
    let token = reserve_token(&store, &key, &original, 60, not_again).await;

    // A completed record is refused without --force, released with it.
    complete(&store, &key, &token, &stored(201, "{}"), 3600).await;
    let out = idem_code(&db.url, &release, NOT_FOUND_OR_REFUSED);
    assert_stderr_has(&out, "completed");
    let replayed = reserve(&store, &key, &original, 60).await;
    assert!(matches!(replayed, ReserveOutcome::Completed { .. }));
    // The completion kept the reservation's token: --token with it (what `show` printed while
    // the request ran) refuses the completed record, even with --force.
    let held = token.as_uuid().to_string();
    let out = idem_code(
        &db.url,
        &[&force[..], &["--token", &held]].concat(),
        NOT_FOUND_OR_REFUSED,
    );
    assert_stderr_has(&out, "is completed now");
    // Named completed, the record of another token is still refused.
    let stale = uuid::Uuid::new_v4().to_string();
    let other = ["--token", &stale, "--state", "completed"];
    let out = idem_code(
        &db.url,
        &[&force[..], &other].concat(),
        NOT_FOUND_OR_REFUSED,
    );
    assert_stderr_has(&out, &format!("holds token {held}, not {stale}"));
    let replayed = reserve(&store, &key, &original, 60).await;
    assert!(matches!(replayed, ReserveOutcome::Completed { .. }));
    // Named completed, with its own token, the completed record goes.
    let as_shown = ["--token", &held, "--state", "completed", "--format", "json"];
    let v = idem_json(&db.url, &[&force[..], &as_shown].concat());
    assert_eq!(
        (v["released"].as_bool(), v["state"].as_str()),
        (Some(true), Some("completed"))
    );
    let again = reserve(&store, &key, &original, 60).await;
    assert!(matches!(again, ReserveOutcome::Reserved { .. }));

    // --token fences the release to the record the operator inspected: after a takeover (here
    // a new reservation of the released key) the old token matches nothing, even with --force.
    let shown = idem_json(
        &db.url,
        &["show", "charge-7", "--tenant", "acme", "--format", "json"],
    );
    let current = shown["token"].as_str().expect("a token").to_owned();
    let stale = uuid::Uuid::new_v4().to_string();
    fn fenced<'a>(force: &[&'a str], token: &'a str) -> Vec<&'a str> {
        [force, &["--token", token]].concat()
    }
    let out = idem_code(&db.url, &fenced(&force, &stale), NOT_FOUND_OR_REFUSED);
    assert_stderr_has(&out, &format!("holds token {current}, not {stale}"));
    let still = reserve(&store, &key, &changed, 60).await;
    assert!(
        matches!(still, ReserveOutcome::InFlight { .. }),
        "{still:?}"
    );
    // `show`'s spelling of the state is accepted.
    let in_flight = [&fenced(&force, &current)[..], &["--state", "in_flight"]].concat();
    let out = idem_code(&db.url, &in_flight, 0);
    assert_stdout_has(&out, &format!("token {current}"));
    let again = reserve(&store, &key, &original, 60).await;
    assert!(matches!(again, ReserveOutcome::Reserved { .. }));
    // One key per token; a token that is not a UUID is a usage error.
    let two = [
        "release", "charge-7", "other", "--force", "--token", &current,
    ];
    assert_stderr_has(&idem_code(&db.url, &two, USAGE), "one KEY");
    idem_code(&db.url, &["release", "charge-7", "--token", "nope"], USAGE);
    let still = reserve(&store, &key, &changed, 60).await;
    assert!(
        matches!(still, ReserveOutcome::InFlight { .. }),
        "{still:?}"
    );

    // Unknown keys and ambiguous keys are refused; several keys are handled one by one.
    let out = idem_code(&db.url, &["release", "no-such-key"], NOT_FOUND_OR_REFUSED);
    assert_stderr_has(&out, "no record");
    reserve(&store, &scope("globex", "charge-7"), &original, 60).await;
    let out = idem_code(
        &db.url,
        &["release", "charge-7", "--force"],
        NOT_FOUND_OR_REFUSED,
    );
    assert_stderr_has(&out, "matches 2 records");

    let mut conn = connect(&db).await;
    for dead in ["dead-1", "dead-2"] {
        seed(&mut conn, "", dead, State::InFlight, -HOUR, -50 * MINUTE).await;
    }
    let out = idem_code(&db.url, &["release", "dead-1", "dead-2", "--tenant", ""], 0);
    assert_eq!(stdout(&out).lines().count(), 2, "{}", stdout(&out));
    assert_stdout_has(&out, "tenant=(global)");
    assert_eq!(keys(&mut conn).await, ["charge-7", "charge-7"]);
}

#[tokio::test]
async fn failures_have_one_line_and_distinct_exit_codes() {
    // Nothing listens on a port we just had and closed.
    let port = closed_port();
    let closed = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    for args in [
        &["list"][..],
        &["stats"],
        &["purge"],
        &["migrate"],
        &["migrate", "--check"],
    ] {
        let out = idem_code(&closed, args, UNAVAILABLE);
        assert!(
            stderr(&out).contains("cannot connect"),
            "{args:?}: {}",
            stderr(&out)
        );
    }

    // A database that does not exist, and a role that does not exist (the server refuses the
    // login, which is what wrong credentials look like under trust authentication).
    let db = TestDb::new().await;
    let missing_db = idempotency_e2e::with_database(&db.url, "idem_cli_no_such_database");
    idem_code(&missing_db, &["stats"], UNAVAILABLE);
    let bad_role = with_user(&db.url, "idem_cli_no_such_role", Some("wrong-password"));
    let out = idem_code(&bad_role, &["list"], UNAVAILABLE);
    assert!(
        !stderr(&out).contains("wrong-password"),
        "password printed: {}",
        stderr(&out)
    );

    // The table is missing (dropped under a provisioned database).
    let mut conn = connect(&db).await;
    conn.batch_execute("DROP TABLE idempotency_keys")
        .await
        .expect("drop");
    assert_each_not_provisioned(
        &db.url,
        &[
            &["list"],
            &["stats"],
            &["purge"],
            &["show", "k"],
            &["release", "k"],
        ],
    );

    // Bad arguments: exit 2 before any connection is attempted.
    for args in [
        &["purge", "--older-than", "7x"][..],
        &["purge", "--older-than", "7"],
        &["purge", "--grace", ""],
        &["purge", "--batch-size", "0"],
        &["purge", "--batch-size", "lots"],
        &["list", "--state", "sleeping"],
        &["list", "--limit", "-1"],
        &["release"],
        &["show"],
        &["frobnicate"],
        &["--format", "yaml", "stats"],
        &[],
    ] {
        idem_code(&closed, args, USAGE);
    }
    idem_code("mysql://localhost/db", &["stats"], USAGE);
    let out = idem_code(&format!("{}?sslmode=bogus", db.url), &["stats"], USAGE);
    assert_stderr_has(&out, "sslmode");
    let out = idem_without_url(&["stats"]);
    expect_code(&out, USAGE);
    assert_stderr_has(&out, "DATABASE_URL");
    // A bare `idem-cli` (no arguments at all, no environment) is one line too, not a page of help.
    let out = idem_without_url(&[]);
    expect_code(&out, USAGE);
    assert_stderr_has(&out, "no command given");
    assert_stderr_has(&idem(&closed, &["show"]), "<KEY>");
}

/// A zero `--connect-timeout` can never be met: it is a usage error (exit 2, one line), as a
/// zero `--statement-timeout` is, not "unavailable" (exit 3) against a healthy database. With
/// `--redis-url` it bounds every reply too, so it is refused there as well.
#[tokio::test]
async fn zero_timeouts_are_usage_errors() {
    let db = TestDb::new().await;
    for (flag, value) in [
        ("--connect-timeout", "0"),
        ("--statement-timeout", "0"),
        // Past PostgreSQL's limit (i32::MAX ms): every command would fail at connect.
        ("--statement-timeout", "30d"),
    ] {
        for command in ["stats", "migrate"] {
            let out = idem_code(&db.url, &[flag, value, command], USAGE);
            assert!(
                stderr(&out).contains(flag),
                "{flag} {value} {command}: {}",
                stderr(&out)
            );
        }
    }
    let out = Command::new(BIN)
        .args(["--connect-timeout", "0s", "stats"])
        .env_remove("DATABASE_URL")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    expect_code(&out, USAGE);
    assert_stderr_has(&out, "--connect-timeout");
}

#[test]
fn help_and_version_read_well() {
    assert_eq!(
        idem_succeeds(&["--version"]).trim(),
        format!("idem-cli {}", env!("CARGO_PKG_VERSION"))
    );

    let help = idem_succeeds(&["--help"]);
    for needle in [
        "Examples:",
        "Exit codes:",
        "DATABASE_URL",
        "migrate",
        "purge",
        "release",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}: {help}");
    }
    for sub in ["migrate", "purge", "list", "show", "stats", "release"] {
        let help = idem_succeeds(&[sub, "--help"]);
        assert!(
            help.contains("Examples:"),
            "{sub} --help has no example: {help}"
        );
        assert!(help.contains(&format!("idem-cli {sub}")), "{sub}: {help}");
    }
}

/// Run `idem-cli args...` in the test's own environment, expecting exit 0: its stdout.
#[track_caller]
fn idem_succeeds(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().expect("run");
    assert_eq!(out.status.code(), Some(0), "{args:?}");
    stdout(&out)
}

/// `url` with its user (and password) replaced.
fn with_user(url: &str, user: &str, password: Option<&str>) -> String {
    let (scheme, rest) = url.split_once("://").expect("URL form");
    let host_and_rest = rest.split_once('@').map_or(rest, |(_, h)| h);
    let userinfo = match password {
        Some(p) => format!("{user}:{p}"),
        None => user.to_owned(),
    };
    format!("{scheme}://{userinfo}@{host_and_rest}")
}

#[tokio::test]
async fn purge_skips_rows_a_request_holds_instead_of_waiting() {
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    for key in ["exp-1", "exp-2", "exp-3"] {
        seed_expired(&mut conn, key).await;
    }
    // Another session (a request taking the key over) holds a row lock on exp-2.
    let mut request = connect(&db).await;
    request.batch_execute("BEGIN").await.expect("begin");
    let locked = records::lock_key(&mut request, "exp-2")
        .await
        .expect("lock a row");
    assert_eq!(locked, 1);

    let started = Instant::now();
    let out = idem_code(&db.url, &["purge", "--format", "json"], 0);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "purge waited for the row lock"
    );
    assert_eq!(json_one(&out)["purged"], 2);
    assert_eq!(keys(&mut conn).await, ["exp-2"]);

    // Once the request is done, the next run gets it.
    request.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(
        idem_json(&db.url, &["purge", "--format", "json"])["purged"],
        1
    );
    assert!(keys(&mut conn).await.is_empty());
}

/// The two halves of every test password below: neither may appear in any output.
const SECRET_HALVES: [&str; 2] = ["HUNTERALPHA", "HUNTERBRAVO"];

#[track_caller]
fn assert_no_secret(out: &Output, what: &str) {
    for half in SECRET_HALVES {
        for (stream, text) in [("stdout", stdout(out)), ("stderr", stderr(out))] {
            assert!(
                !text.contains(half),
                "{what}: {stream} shows password text {half}: {text}"
            );
        }
    }
}

/// Guards issue 9 item 5: the CLI printed the database password. The old redaction cut the
/// URL at the first `/` or `?`, while the driver ends the credentials at the first `@`, so a
/// password holding `/`, `?` or `#` was printed (in part or whole); `check_url` echoed
/// everything before `://` (password text in a key=value string), and the TLS layer named
/// query "keys" that were password text. Every output of every failure path is checked, for
/// URLs (raw and percent-encoded specials), key=value strings and strings nobody can parse.
#[test]
fn passwords_never_appear_in_any_output() {
    let port = closed_port();
    let [a, b] = SECRET_HALVES;
    let host = format!("127.0.0.1:{port}");
    let cases = [
        // Parsable URLs, nothing listening: "cannot connect to <redacted>".
        format!("postgres://postgres:{a}/{b}@{host}/db"),
        format!("postgres://postgres:{a}?{b}@{host}/db"),
        format!("postgres://postgres:{a}#{b}@{host}/db"),
        format!("postgres://postgres:{a}?{b}@{host}/db?sslmode=disable"),
        format!("postgresql://postgres:{a}%2F{b}%3F%40%23@{host}/db?application_name=x"),
        format!("postgres://postgres:{a}:{b}@{host}/db"),
        // An `@` and a `/` left raw in the password: the driver reads `{b}` as the host (review,
        // 2026-12-04: it was shown, and looked up in DNS). Now refused as ambiguous.
        format!("postgres://postgres:{a}@{b}/x@{host}/db"),
        format!("postgres://{host}/db?user=postgres&password={a}@{b}"),
        format!("postgres://{host}/db?password={a}@{b}&user=postgres"),
        format!("postgres://postgres@{host}/db?password={a}%3F{b}"),
        format!("postgres://postgres@{host}/db?password={a}?{b}"),
        format!("host=127.0.0.1 port={port} user=postgres password='{a} {b}' dbname=db"),
        format!("host=127.0.0.1 port={port} user=postgres password={a}\\ {b}"),
        format!("host=127.0.0.1 port={port} password={a}://{b}"),
        // Unparsable or unusable: the message says so and shows no part of the string.
        format!("postgres://postgres:{a}?{b}@127.0.0.1:notaport/db"),
        format!("postgres://postgres:{a}?{b}=%zz@{host}/db"),
        format!("postgres://postgres:{a}?{b}=1@{host}/db?sslmode=require&sslrootcert=/nonexistent"),
        format!("host=127.0.0.1 password={a} {b}=x"),
        format!("host=127.0.0.1 password='{a} {b}"),
        format!("mysql://root:{a}?{b}@{host}/db"),
        format!("{a}://{b}"),
    ];
    for url in &cases {
        for args in [&["stats"][..], &["migrate", "--check"]] {
            let out = idem(url, args);
            assert!(
                matches!(out.status.code(), Some(USAGE | UNAVAILABLE)),
                "{url} {args:?}: {out:?}"
            );
            assert_no_secret(&out, &format!("DATABASE_URL {args:?}"));
            assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
        }
        // The same through the flag, as operators type it.
        let out = idem_without_url(&["--database-url", url, "list"]);
        assert!(matches!(out.status.code(), Some(USAGE | UNAVAILABLE)));
        assert_no_secret(&out, "--database-url");
    }
    // The redacted form still names the target, so the message stays useful.
    let out = idem(
        &format!("postgres://postgres:{a}?{b}@{host}/db"),
        &["stats"],
    );
    assert!(
        stderr(&out).contains(&format!("postgres://postgres:***@{host}/db")),
        "{}",
        stderr(&out)
    );
}

/// A connection string in the wrong place (unquoted in a crontab, so split at its spaces; a
/// URL after the command; a misspelt flag with the URL after `=`) is a usage error, and the
/// word clap could not place is not repeated: it may be the password (review, 2026-12-06:
/// "unrecognized subcommand 'password=...'" went to stderr, and so to cron mail). A flag's
/// name is still shown, and a misspelt command still gets its suggestion.
#[test]
fn a_stray_word_is_not_repeated_in_a_usage_error() {
    let [a, b] = SECRET_HALVES;
    let cases: Vec<Vec<String>> = vec![
        vec![
            "--database-url".into(),
            "host=db".into(),
            format!("password={a}{b}"),
            "user=app".into(),
            "purge".into(),
        ],
        vec!["purge".into(), format!("postgres://app:{a}{b}@db/pay")],
        vec!["show".into(), "k".into(), format!("password={a}{b}")],
        vec![
            format!("--dburl=postgres://app:{a}{b}@db/pay"),
            "stats".into(),
        ],
        vec![
            "stats".into(),
            format!("--url=postgres://app:{a}{b}@db/pay"),
        ],
        vec![format!("{a}{b}")],
        // A password with a space, unquoted: the word after the space starts with `--` but
        // is no flag's name (it was echoed as "unexpected argument '--HUNTERBRAVO@db/pay'").
        vec![
            "purge".into(),
            "--database-url".into(),
            format!("postgres://app:{a}"),
            format!("--{b}@db/pay"),
        ],
    ];
    for args in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = idem_without_url(&args);
        expect_code(&out, USAGE);
        assert_no_secret(&out, &format!("{args:?}"));
        assert_eq!(stderr(&out).lines().count(), 1, "{}", stderr(&out));
    }
    let out = idem_without_url(&["stats", "--dburl=postgres://x"]);
    assert!(stderr(&out).contains("'--dburl'"), "{}", stderr(&out));
    let out = idem_without_url(&["purg"]);
    assert!(stderr(&out).contains("'purge'"), "{}", stderr(&out));
}

/// A connection string typed where a KEY goes (`release k1 postgres://..`, a crontab line
/// split at its spaces into `password=..`) is refused as a usage error without repeating it:
/// `release` and `show` take any word there as a key and said "no record with key
/// \"postgres://app:<password>@db/pay\"" on stderr, or put it in their JSON on stdout
/// (review, 2026-12-06).
#[tokio::test]
async fn a_key_that_looks_like_a_connection_string_is_not_repeated() {
    let db = TestDb::new().await;
    let [a, b] = SECRET_HALVES;
    let url = format!("postgres://app:{a}{b}@db/pay");
    let keyvalue = format!("password={a}{b}");
    let cases: Vec<Vec<&str>> = vec![
        vec!["release", "k1", &url],
        vec!["--format", "json", "release", &url, "k1"],
        vec!["release", "k1", &keyvalue, "--force"],
        vec!["show", &url],
        vec!["--format", "json", "show", &keyvalue],
        // The scope flags' values are repeated in "no record with key .. in tenant ..", a
        // refused --redis-prefix in its error (review, 2026-12-06).
        vec!["show", "k1", "--tenant", &url],
        vec!["release", "k1", "--path", &keyvalue],
        vec!["--format", "json", "release", "k1", "--method", &url],
        vec!["--redis-prefix", &url, "show", "k1"],
        vec!["--format", "json", "purge", "--dry-run", "--tenant", &url],
        vec!["--format", "json", "list", "--key-prefix", &keyvalue],
    ];
    for args in &cases {
        let out = idem(&db.url, args);
        expect_code(&out, USAGE);
        assert_no_secret(&out, &format!("{args:?}"));
        assert_stderr_has(&out, "connection string");
    }
    // A refused key among several is named escaped, as a single one is: a Hangul filler
    // (which Rust's `Debug` leaves as it is) shows as `\u{3164}`, not as a blank.
    let out = idem(&db.url, &["release", "k\u{3164}", "k2"]);
    assert_eq!(
        out.status.code(),
        Some(NOT_FOUND_OR_REFUSED),
        "{}",
        stderr(&out)
    );
    assert_stderr_has(&out, "k\\u{3164}");
    // A key that is a URL without credentials is a key like any other.
    let out = idem(&db.url, &["release", "https://example.com/orders/1"]);
    expect_code(&out, NOT_FOUND_OR_REFUSED);
    assert_stderr_has(&out, "https://example.com/orders/1");
}

/// Guards issue 9 item 6 from the CLI's side: a `?` inside the password hid `sslmode=require`
/// from the old splitter, and the CLI connected in plaintext. Against a server without TLS the
/// connection must now fail (exit 3) instead of falling back; on the old code it connected and
/// reported the missing table (exit 4).
#[test]
fn sslmode_require_with_a_question_mark_in_the_password_never_falls_back() {
    let cluster = match idempotency_e2e::TempCluster::start(&[], &[]) {
        Ok(cluster) => cluster,
        Err(idempotency_e2e::ClusterError::NotInstalled) => {
            idempotency_e2e::skip_without_binaries(
                "sslmode_require_with_a_question_mark_in_the_password_never_falls_back",
            );
            return;
        }
        Err(e) => panic!("starting a cluster: {e}"),
    };
    let [a, b] = SECRET_HALVES;
    // Trust authentication: the password is not checked, only the TLS decision matters.
    let base = format!(
        "postgres://postgres:{a}?{b}@127.0.0.1:{}/postgres",
        cluster.port
    );
    let out = idem_code(&format!("{base}?sslmode=require"), &["stats"], UNAVAILABLE);
    assert_no_secret(&out, "sslmode=require without TLS");
    idem_code(
        &format!("{base}?sslmode=disable"),
        &["stats"],
        NOT_PROVISIONED,
    );
}

/// Open a transaction on `conn` that takes `lock` (a `LOCK TABLE` statement) and keeps it.
async fn hold_in_transaction(conn: &mut AsyncPgConnection, lock: &str) {
    conn.batch_execute(&format!("BEGIN; {lock}"))
        .await
        .unwrap_or_else(|e| panic!("{lock}: {e}"));
}

/// Assert what a purge whose drop step failed says on stderr (`err`: the drop step, each of
/// `also`, the partitions the create step still made) and that they cover the horizon.
fn assert_drop_failed_but_created(url: &str, err: &str, also: &[&str]) {
    assert!(
        err.contains("dropping past partitions") && also.iter().all(|a| err.contains(a)),
        "{err}"
    );
    assert!(
        err.contains("idempotency_responses_p"),
        "the created partitions are reported: {err}"
    );
    assert_eq!(
        records::count(url, COVERING_THE_HORIZON),
        1,
        "create step skipped"
    );
}

/// `idem-cli --format json purge extra...` on `url`, expecting exit 0 and the past partition
/// ([`add_past_partition`]) dropped: the JSON summary.
#[track_caller]
fn purge_drops_the_past_partition(url: &str, extra: &[&str]) -> Value {
    let summary = idem_json(url, &[&["--format", "json", "purge"][..], extra].concat());
    assert_eq!(
        summary["partitions_dropped"],
        serde_json::json!(["idempotency_responses_past"])
    );
    summary
}

/// Review of issue 15, finding 2: a drop step that fails (its lock timeout, while a reader
/// holds the response table) does not skip the create step, or the partitions ahead would run
/// out. And without `--partitions-ahead`, the partitions ahead cover the default `--horizon`
/// (36 h: the default 24 h TTL plus margin), so a 24 h response never lands in the default
/// partition. A partition held by something that is not a request (a query on that partition
/// alone) is not waited for: it is left for the next run.
#[tokio::test]
async fn partitioned_purge_creates_ahead_even_when_the_drop_fails() {
    let (db, _setup) = hourly_partitioned_with_a_past_partition().await;
    assert_eq!(records::count(&db.url, COVERING_THE_HORIZON), 0);

    // A reader of the past partition alone: the drop leaves it, and fails nothing.
    let mut reader = connect(&db).await;
    let past_alone = "LOCK TABLE idempotency_responses_past IN ACCESS SHARE MODE";
    hold_in_transaction(&mut reader, past_alone).await;
    let v = idem_json(
        &db.url,
        &[
            "--format",
            "json",
            "purge",
            "--lock-timeout",
            "5s",
            "--partitions-ahead",
            "1",
        ],
    );
    assert_eq!(v["partitions_dropped"], serde_json::json!([]));
    assert_eq!(
        v["partitions_left"],
        serde_json::json!(["idempotency_responses_past"])
    );
    reader.batch_execute("ROLLBACK").await.unwrap();

    // A reader of the response table (what a request holds), in an open transaction: the drop
    // waits for it and times out.
    let as_a_request = "LOCK TABLE ONLY idempotency_responses IN ACCESS SHARE MODE";
    hold_in_transaction(&mut reader, as_a_request).await;
    let out = idem_code(&db.url, &["purge", "--lock-timeout", "200ms"], 1);
    assert_drop_failed_but_created(&db.url, &stderr(&out), &[]);

    reader.batch_execute("ROLLBACK").await.unwrap();
    purge_drops_the_past_partition(&db.url, &[]);

    let too_short = ["purge", "--horizon", "2h", "--partitions-ahead", "2"];
    idem_code(&db.url, &too_short, USAGE);

    // C19: one summary line per run, the partition work included (cron logs read a run as one
    // line).
    let text = stdout(&idem_code(&db.url, &["purge"], 0));
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.starts_with("purged ") && text.contains("; partitions: dropped "),
        "{text}"
    );
}

/// A claims purge that fails with an answer (here a trigger refusing the DELETE; in life a
/// permission, or a batch too large for the statement timeout) does not skip the partition
/// steps: failing run after run, it let the partitions ahead run out (review, 2026-12-06: the
/// run returned before them). The run still exits non-zero with the claims' failure first,
/// then what the partition steps did.
#[tokio::test]
async fn a_failing_claims_purge_does_not_skip_the_partition_steps() {
    let (db, mut conn) = hourly_partitioned_with_a_past_partition().await;
    seed(&mut conn, "t", "old", State::InFlight, -10 * DAY, -9 * DAY).await;
    conn.batch_execute(
        "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'deletes refused here'; END $$; \
         CREATE TRIGGER refuse_delete BEFORE DELETE ON idempotency_keys \
         FOR EACH ROW EXECUTE FUNCTION refuse_delete();",
    )
    .await
    .unwrap();
    assert_eq!(records::count(&db.url, COVERING_THE_HORIZON), 0);
    let out = idem_code(&db.url, &["purge"], 1);
    let err = stderr(&out);
    assert!(
        err.starts_with("idem-cli: purge stopped after deleting 0 records"),
        "{err}"
    );
    assert!(
        err.contains("partitions dropped [idempotency_responses_past]"),
        "the drop ran and is reported: {err}"
    );
    assert_eq!(
        records::count(&db.url, COVERING_THE_HORIZON),
        1,
        "create step skipped: {err}"
    );
    assert_eq!(keys(&mut conn).await, ["old"]);
}

/// Every DROP of a partition also locks the default partition, which the drop step takes with
/// NOWAIT (requests never hold it alone; autovacuum after the default partition's purge does).
/// Held, the drop step did nothing, and the run said "dropped 0 []" with exit 0, every run for
/// as long as the vacuum lasted, while past partitions piled up (review, 2026-12-06). The run
/// now says which expired partitions it left, on stdout and in a warning on stderr, and drops
/// them once the default partition is free.
#[tokio::test]
async fn a_partition_drop_left_undone_is_reported() {
    let (db, _setup) = hourly_partitioned_with_a_past_partition().await;
    let mut vacuum = connect(&db).await;
    let like_autovacuum = "LOCK TABLE idempotency_responses_default IN SHARE UPDATE EXCLUSIVE MODE";
    hold_in_transaction(&mut vacuum, like_autovacuum).await;
    // The partition ahead exists already, so nothing is created: creating one waits for the
    // default partition (a wait autovacuum, unlike this session, gives way to).
    let purge = ["purge", "--partitions-ahead", "1"];
    let out = idem_code(&db.url, &[&["--format", "json"][..], &purge].concat(), 0);
    let v = json_one(&out);
    assert_eq!(v["partitions_dropped"], serde_json::json!([]));
    assert_eq!(
        v["partitions_left"],
        serde_json::json!(["idempotency_responses_past"])
    );
    assert_stderr_has(&out, "idempotency_responses_past");
    let text = idem_code(&db.url, &purge, 0);
    assert_stdout_has(
        &text,
        "left for the next run 1 [idempotency_responses_past]",
    );
    assert_eq!(stderr(&text).lines().count(), 1, "{}", stderr(&text));

    vacuum.batch_execute("ROLLBACK").await.unwrap();
    let v = purge_drops_the_past_partition(&db.url, &[]);
    assert_eq!(v["partitions_left"], serde_json::json!([]));
}

/// Run `idem-cli args...` (a purge) on `url`, expecting it to end within 60 s with exit 1 and
/// no password text (`what` names the case): its stderr and how long it ran.
fn purge_fails_within_a_minute(url: &str, args: &[&str], what: &str) -> (String, Duration) {
    let started = Instant::now();
    let out = idem_within(url, args, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("{what}: the purge still ran after 60s"));
    let took = started.elapsed();
    expect_code(&out, 1);
    assert_no_secret(&out, what);
    (stderr(&out), took)
}

/// The partitioned layout's drop and create steps are bounded by `--statement-timeout`, like
/// every other round trip, even with a `--lock-timeout` longer than any test: a session holding
/// what a step needs makes that step fail within the statement timeout (exit 1, one line
/// naming the step and the timeout, never the password), the other steps still run, and once
/// the lock is gone the next purge does the work.
#[tokio::test]
async fn partitioned_purge_steps_are_bounded_by_the_statement_timeout() {
    let (db, _setup) = hourly_partitioned_with_a_past_partition().await;
    // Trust authentication: the password is not checked; it must just never be shown.
    let [a, b] = SECRET_HALVES;
    let url = with_user(&db.url, "postgres", Some(&format!("{a}?{b}")));
    let bounded = ["--statement-timeout", "1s", "purge", "--lock-timeout", "1h"];
    assert_eq!(records::count(&db.url, COVERING_THE_HORIZON), 0);
    let mut holder = connect(&db).await;

    // 1. The whole table (LOCK TABLE takes every partition too): each partition step waits,
    // and the statement timeout ends each one.
    let whole_table = "LOCK TABLE idempotency_responses IN ACCESS EXCLUSIVE MODE";
    hold_in_transaction(&mut holder, whole_table).await;
    let (err, took) = purge_fails_within_a_minute(&url, &bounded, "purge behind a table lock");
    assert!(err.contains("dropping past partitions"), "{err}");
    assert!(err.contains("statement timeout"), "{err}");
    assert!(took < Duration::from_secs(15), "purge took {took:?}");
    // Three statements, each cancelled after 1s (the server cannot cancel sooner): the drop,
    // the default partition's purge and the create step. The failed drop skipped nothing.
    assert!(
        took >= Duration::from_secs(3),
        "a step was skipped: {took:?}"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        records::count(&db.url, COVERING_THE_HORIZON),
        0,
        "created under the lock"
    );

    // 2. The response table alone, as a request holds it: the drop times out, the create step
    // (which takes the table in a mode readers do not block) still runs.
    let as_a_request = "LOCK TABLE ONLY idempotency_responses IN ACCESS SHARE MODE";
    hold_in_transaction(&mut holder, as_a_request).await;
    let (err, _) = purge_fails_within_a_minute(&url, &bounded, "purge behind a partition lock");
    assert_drop_failed_but_created(&db.url, &err, &["statement timeout"]);
    holder.batch_execute("ROLLBACK").await.unwrap();

    // Released: the next purge drops the past partition.
    purge_drops_the_past_partition(&url, &[]);

    // 3. The default partition, which ATTACH takes ACCESS EXCLUSIVE on: the create step times
    // out (more partitions ahead than the horizon made, so there is one to attach).
    let default = "LOCK TABLE idempotency_responses_default IN ACCESS SHARE MODE";
    hold_in_transaction(&mut holder, default).await;
    let ahead = [&bounded[..], &["--partitions-ahead", "40"]].concat();
    let what = "purge behind the default partition's lock";
    let (err, took) = purge_fails_within_a_minute(&url, &ahead, what);
    assert!(
        err.contains("creating partitions ahead") && err.contains("statement timeout"),
        "{err}"
    );
    assert!(
        !err.contains("dropping past partitions"),
        "the drop step had nothing to wait for: {err}"
    );
    assert!(took < Duration::from_secs(15), "purge took {took:?}");
    holder.batch_execute("ROLLBACK").await.unwrap();

    let v = idem_json(
        &url,
        &["--format", "json", "purge", "--partitions-ahead", "40"],
    );
    let created = v["partitions_created"].clone();
    assert!(
        created.as_array().is_some_and(|c| !c.is_empty()),
        "{created}"
    );
}

/// Issue 15: `migrate --partitioned` provisions the partitioned layout, `migrate --check` and
/// `stats` report it, `show` reads a response from its partition, `purge` drops a past
/// partition and creates the ones ahead without touching a live record, and `--partitioned`
/// on a database that already has the plain layout fails instead of pretending.
#[tokio::test]
async fn partitioned_layout_migrate_check_stats_show_and_purge() {
    let db = TestDb::new_unmigrated().await;
    let out = migrate_partitioned(&db.url, "hourly");
    assert_stdout_has(&out, "layout: partitioned (hourly)");
    let v = idem_json(&db.url, &["--format", "json", "migrate", "--check"]);
    assert_eq!(v["layout"], "partitioned (hourly)");

    let store = PostgresStore::connect(&db.url).await.unwrap();
    let live = scope("acme", "live-1");
    let token = reserve_token(&store, &live, &fingerprint("a"), 60, "reserve").await;
    let written = complete(&store, &live, &token, &stored(201, "charged"), 1800).await;
    assert_eq!(written, WriteOutcome::Applied);
    let mut conn = connect(&db).await;
    add_past_partition(&mut conn).await;

    let stats = idem_json(&db.url, &["--format", "json", "stats"]);
    assert_eq!(stats["layout"], "partitioned");
    assert_eq!(stats["partition_interval"], "hourly");
    assert_eq!(stats["completed_live"], 1);
    // The four made by the migration, the past one, the default.
    assert_eq!(stats["partitions"].as_array().map(Vec::len), Some(6));

    let show = ["--format", "json", "show", "live-1", "--tenant", "acme"];
    assert_stdout_has(&idem_code(&db.url, &show, 0), "charged");

    // A dry run names the partition the run will drop, and drops nothing.
    let dry = idem_json(&db.url, &["--format", "json", "purge", "--dry-run"]);
    assert_eq!(
        dry["would_drop_partitions"],
        serde_json::json!(["idempotency_responses_past"])
    );
    assert_eq!(dry["partitions_dropped"], Value::Null);
    let out = idem_code(&db.url, &["purge", "--dry-run"], 0);
    assert_stdout_has(
        &out,
        "partitions: would drop 1 [idempotency_responses_past]",
    );
    let stats = idem_json(&db.url, &["--format", "json", "stats"]);
    assert_eq!(stats["partitions"].as_array().map(Vec::len), Some(6));

    let purge = purge_drops_the_past_partition(&db.url, &["--partitions-ahead", "5"]);
    assert_eq!(
        purge["partitions_created"].as_array().map(Vec::len),
        Some(2)
    );
    match reserve(&store, &live, &fingerprint("a"), 60).await {
        ReserveOutcome::Completed { response, .. } => assert_eq!(&response.body[..], b"charged"),
        other => panic!("the live record did not survive purge: {other:?}"),
    }

    let plain = TestDb::new().await;
    let out = idem_code(&plain.url, &["migrate", "--partitioned"], 1);
    assert_stderr_has(&out, "plain layout");
}

/// The interval is chosen when the layout is provisioned, like the layout: `migrate
/// --partitioned --interval hourly` on a daily database fails (exit 1, one line naming both)
/// instead of "nothing to apply"; without `--interval` it asks for no particular one.
#[tokio::test]
async fn migrate_refuses_another_partition_interval() {
    let db = TestDb::new_unmigrated().await;
    migrate_partitioned(&db.url, "daily");

    let out = idem_code(
        &db.url,
        &["migrate", "--partitioned", "--interval", "hourly"],
        1,
    );
    let err = stderr(&out);
    assert!(
        err.contains("daily") && err.contains("hourly"),
        "names both intervals: {err}"
    );

    for args in [
        &["migrate", "--partitioned", "--interval", "daily"][..],
        &["migrate", "--partitioned"],
        &["migrate"],
    ] {
        let out = idem_code(&db.url, args, 0);
        assert!(
            stdout(&out).contains("layout: partitioned (daily)"),
            "{args:?}: {}",
            stdout(&out)
        );
    }

    // And the other way round: no --interval on an hourly database is not a request for daily.
    let hourly = TestDb::new_unmigrated().await;
    migrate_partitioned(&hourly.url, "hourly");
    let out = idem_code(&hourly.url, &["migrate", "--partitioned"], 0);
    assert_stdout_has(&out, "layout: partitioned (hourly)");
}

/// `migrate --rotated` provisions the rotated layout that `migrate --check` and `stats` then
/// name; its period is chosen once, like the partition interval. A period under the least one
/// is refused before anything is applied (it used to apply 000001-000015, fail on 000016 and
/// leave a plain database that `migrate --rotated` then refused).
#[tokio::test]
async fn migrate_rotated_provisions_it_once_with_its_period() {
    let db = TestDb::new_unmigrated().await;
    let out = idem_code(
        &db.url,
        &["migrate", "--rotated", "--rotation-period", "30m"],
        2,
    );
    assert_stderr_has(&out, "at least 1h");
    assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    let check = idem_code(&db.url, &["migrate", "--check"], 5);
    assert_stdout_has(&check, "pending 2026-11-30-000001_create_idempotency_keys");

    let out = idem_code(
        &db.url,
        &["migrate", "--rotated", "--rotation-period", "3h"],
        0,
    );
    assert_stdout_has(&out, "applied 2026-12-07-000016_rotated_layout");
    assert_stdout_has(&out, "layout: rotated");
    let check = idem_code(&db.url, &["migrate", "--check"], 0);
    assert_stdout_has(&check, "schema is up to date (layout: rotated)");
    let stats = idem_code(&db.url, &["stats"], 0);
    assert_stdout_has(&stats, "layout               rotated");

    let out = idem_code(
        &db.url,
        &["migrate", "--rotated", "--rotation-period", "4h"],
        1,
    );
    let err = stderr(&out);
    assert!(
        err.contains("3h") && err.contains("4h"),
        "names both: {err}"
    );
    let out = idem_code(&db.url, &["migrate", "--partitioned"], 1);
    assert_stderr_has(&out, "rotated layout");
    for args in [
        &["migrate", "--rotated", "--rotation-period", "3h"][..],
        &["migrate", "--rotated"],
        &["migrate"],
    ] {
        let out = idem_code(&db.url, args, 0);
        assert_stdout_has(&out, "layout: rotated");
    }

    let plain = TestDb::new().await;
    let out = idem_code(&plain.url, &["migrate", "--rotated"], 1);
    assert_stderr_has(&out, "plain layout");
}

/// The migration advisory lock key ("idemmigr"), as the library and the CLI take it.
const MIGRATION_LOCK: &str = "x'6964656d6d696772'::bigint";

/// `SELECT function(MIGRATION_LOCK)` on `conn`: `pg_advisory_lock` holds the migration lock,
/// `pg_advisory_unlock` releases it.
async fn call_on_migration_lock(conn: &mut AsyncPgConnection, function: &str) {
    conn.batch_execute(&format!("SELECT {function}({MIGRATION_LOCK})"))
        .await
        .unwrap_or_else(|e| panic!("{function} on the migration lock: {e}"));
}

/// Run `idem-cli args...` against `url`, killing it if it is still running after `limit`
/// (`None` then), so a hang fails the test instead of stalling the suite.
fn idem_within(url: &str, args: &[&str], limit: Duration) -> Option<Output> {
    wait_within(spawn_idem(url, args), limit)
}

/// Start `idem-cli args...` against `url` with its output captured, for a test that acts on
/// the database while it runs.
fn spawn_idem(url: &str, args: &[&str]) -> Child {
    command(url, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {BIN}: {e}"))
}

/// The output of `child` once it exited, or `None` (and the child killed) if it still runs
/// after `limit`.
fn wait_within(mut child: Child, limit: Duration) -> Option<Output> {
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return Some(child.wait_with_output().expect("collect output")),
            Ok(None) if started.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Review item 1: `migrate --check` and `migrate` waited without limit on the migration lock
/// held by another session. The check reads only and takes no lock; `migrate` gives up after
/// the CLI's lock timeout (5s) with exit 3 and one line saying why, and applies nothing.
#[tokio::test]
async fn migrate_never_waits_long_for_the_migration_lock() {
    let db = TestDb::new_unmigrated().await;
    let mut holder = connect(&db).await;
    call_on_migration_lock(&mut holder, "pg_advisory_lock").await;

    let started = Instant::now();
    let out = idem_within(&db.url, &["migrate", "--check"], Duration::from_secs(20))
        .expect("migrate --check waited on the migration lock");
    expect_code(&out, PENDING);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "--check took {:?}",
        started.elapsed()
    );

    let started = Instant::now();
    let out = idem_within(&db.url, &["migrate"], Duration::from_secs(30))
        .expect("migrate waited on the migration lock past 30s");
    let waited = started.elapsed();
    expect_code(&out, UNAVAILABLE);
    assert_stderr_has(&out, "another migration holds the lock");
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(15),
        "gave up after {waited:?}"
    );
    idem_code(&db.url, &["migrate", "--check"], PENDING);

    call_on_migration_lock(&mut holder, "pg_advisory_unlock").await;
    let out = idem_code(&db.url, &["migrate"], 0);
    assert_stdout_has(&out, "layout: plain");
}

/// Terminate the backend of the `idem-cli` connected to `conn`'s database that matches
/// `condition` (SQL over `pg_stat_activity`), polling until it shows up (at most 20 s).
async fn terminate_cli_backend(conn: &mut AsyncPgConnection, condition: &str) {
    let terminate = format!(
        "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'idem-cli' AND {condition}"
    );
    let started = Instant::now();
    loop {
        let terminated: Count = diesel::sql_query(&terminate)
            .get_result(conn)
            .await
            .expect("terminate idem-cli's backend");
        if terminated.n > 0 {
            assert_eq!(terminated.n, 1, "one idem-cli backend with {condition}");
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no idem-cli backend with {condition} within 20s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Start `idem-cli args...` (a `migrate`) on `url`, end its backend once one matches
/// `condition` ([`terminate_cli_backend`]) and expect "database unavailable" (exit 3).
async fn migrate_cut_off(url: &str, admin: &mut AsyncPgConnection, args: &[&str], condition: &str) {
    let child = spawn_idem(url, args);
    terminate_cli_backend(admin, condition).await;
    let out = wait_within(child, Duration::from_secs(30)).expect("migrate hung");
    expect_code(&out, UNAVAILABLE);
    assert!(
        stderr(&out).starts_with("idem-cli: database unavailable: "),
        "{condition}: {}",
        stderr(&out)
    );
}

/// `migrate` whose connection is lost mid-migration (an administrator or a failover ended the
/// session) exits 3, "unavailable" (retry later), with one line, not 1 as if a migration were
/// broken: while it waits for the migration lock, while diesel's harness reads which
/// migrations ran (outside any migration's transaction: this exited 1, "database error:
/// terminating connection due to administrator command", before the CLI asked the connection
/// whether it was still there), and while a migration's statement waits for a lock inside
/// the migration's transaction. The migration it was in is rolled back (still pending,
/// nothing half-applied) and the next `migrate` applies it.
#[tokio::test]
async fn migrate_that_loses_its_connection_is_unavailable() {
    let db = TestDb::new_unmigrated().await;
    let mut admin = connect(&db).await;
    let mut holder = connect(&db).await;

    // 1. Waiting for the migration lock another session holds (`migrate` polls it and gives up
    // after 5s; the termination comes well before).
    call_on_migration_lock(&mut holder, "pg_advisory_lock").await;
    let waiting = "query LIKE '%pg_try_advisory_lock%'";
    migrate_cut_off(&db.url, &mut admin, &["migrate"], waiting).await;
    call_on_migration_lock(&mut holder, "pg_advisory_unlock").await;
    let out = idem_code(&db.url, &["migrate"], 0);
    assert_stdout_has(&out, "layout: plain");

    // Make 000005 and the later ones pending again (on the plain layout they changed nothing,
    // and each can run again): `migrate --partitioned` then has work to do.
    admin
        .batch_execute("DELETE FROM __diesel_schema_migrations WHERE version >= '20261201000005'")
        .await
        .expect("forget migrations 000005 and later");

    // 2. Reading the applied versions: another session holds diesel's bookkeeping table. Each
    // wait for a lock is bounded by the CLI's lock_timeout (5s): terminate well before.
    let partitioned = ["migrate", "--partitioned", "--interval", "hourly"];
    let bookkeeping = "LOCK TABLE __diesel_schema_migrations IN ACCESS EXCLUSIVE MODE";
    hold_in_transaction(&mut holder, bookkeeping).await;
    migrate_cut_off(
        &db.url,
        &mut admin,
        &partitioned,
        "wait_event_type = 'Lock'",
    )
    .await;
    holder.batch_execute("ROLLBACK").await.expect("unlock");

    // 3. Inside a migration: 000005, asked for the partitioned layout, reads and alters
    // idempotency_keys, which another session holds.
    let keys_table = "LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE";
    hold_in_transaction(&mut holder, keys_table).await;
    let waiting = "wait_event_type = 'Lock' AND query LIKE '%idempotency_keys%'";
    migrate_cut_off(&db.url, &mut admin, &partitioned, waiting).await;
    holder.batch_execute("ROLLBACK").await.expect("unlock");

    // Rolled back: 000005 is still pending and the layout still plain.
    let out = idem_code(&db.url, &["migrate", "--check"], PENDING);
    assert_stdout_has(&out, "pending 2026-12-01-000005_partitioned_layout");
    let responses = "SELECT count(*) AS n FROM pg_class WHERE relname = 'idempotency_responses'";
    assert_eq!(records::count(&db.url, responses), 0, "000005 half-applied");
    let out = migrate_partitioned(&db.url, "hourly");
    assert_stdout_has(&out, "applied 2026-12-01-000005_partitioned_layout");
    assert_stdout_has(&out, "layout: partitioned (hourly)");
}

/// Review item 2: after the first `migrate`, `SELECT` is enough for `migrate --check` (docs/
/// operations.md), even where the role may not create anything in the schema: the check runs
/// no DDL. A pending migration still closes the gate.
#[tokio::test]
async fn migrate_check_needs_only_select() {
    let db = TestDb::new().await;
    let role = format!("idem_ro_{}", db.name.trim_start_matches("idem_test_"));
    let mut conn = connect(&db).await;
    conn.batch_execute(&format!(
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
         CREATE ROLE \"{role}\" LOGIN; \
         GRANT SELECT ON ALL TABLES IN SCHEMA public TO \"{role}\""
    ))
    .await
    .expect("a SELECT-only role");
    let url = with_user(&db.url, &role, None);

    let out = idem(&url, &["migrate", "--check"]);
    let up_to_date = out.status.code();
    let up_to_date_out = stdout(&out);
    let up_to_date_err = stderr(&out);

    // One migration pending again: the gate closes (exit 5), still without DDL.
    conn.batch_execute(
        "DELETE FROM __diesel_schema_migrations \
         WHERE version = (SELECT max(version) FROM __diesel_schema_migrations)",
    )
    .await
    .expect("forget the last migration");
    let pending = idem(&url, &["migrate", "--check"]);

    conn.batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .await
        .expect("drop the role");

    assert_eq!(
        up_to_date,
        Some(0),
        "stdout: {up_to_date_out} stderr: {up_to_date_err}"
    );
    assert!(up_to_date_out.contains("up to date"), "{up_to_date_out}");
    expect_code(&pending, PENDING);
    assert_stdout_has(
        &pending,
        "pending 2026-12-07-000018_request_functions_plan_no_sequential_scan",
    );
}

/// Run idem-cli with `args` on `db` through a [`freezing_proxy`] that goes silent once the
/// CLI sends `marker`: its output (`None` if it still ran after `limit`) and how long it ran.
async fn idem_frozen_at(
    db: &TestDb,
    marker: &'static [u8],
    args: &'static [&'static str],
    limit: Duration,
) -> (Option<Output>, Duration) {
    let upstream = idempotency_e2e::proxy::host_port(&db.url);
    let url = with_port(&db.url, freezing_proxy(upstream, marker).await);
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || idem_within(&url, args, limit))
        .await
        .expect("runner");
    (out, started.elapsed())
}

/// [`idem_frozen_at`], expecting the run to end in time (`what` says which one hung) with
/// exit 3: its stderr and how long it ran.
async fn unavailable_when_frozen_at(
    db: &TestDb,
    marker: &'static [u8],
    args: &'static [&'static str],
    limit: Duration,
    what: &str,
) -> (String, Duration) {
    let (out, took) = idem_frozen_at(db, marker, args, limit).await;
    let out = out.unwrap_or_else(|| panic!("{what} ({took:?})"));
    expect_code(&out, UNAVAILABLE);
    (stderr(&out), took)
}

/// A TCP proxy to `upstream` that forwards both ways until the client sends bytes containing
/// `marker`; from then on it swallows what the client sends and keeps every socket open: a
/// server (or network) gone silent mid-session, which neither side's TCP stack notices.
async fn freezing_proxy(upstream: String, marker: &'static [u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let port = listener.local_addr().expect("its address").port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                continue;
            };
            let upstream_marker = marker;
            tokio::spawn(async move {
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let up = async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut frozen = false;
                    loop {
                        let n = match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        frozen = frozen
                            || buf[..n]
                                .windows(upstream_marker.len())
                                .any(|w| w == upstream_marker);
                        if !frozen && server_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    // Hold the server side open: a frozen peer never closes.
                    std::future::pending::<()>().await;
                    drop(server_write);
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
                };
                tokio::select! {
                    () = up => {}
                    _ = down => {}
                }
            });
        }
    });
    port
}

/// Review item 3: a server that goes silent after login hung the CLI forever (only
/// establishing the connection was bounded). Now the session setup counts as connecting
/// (`--connect-timeout`) and every later answer is waited for at most `--statement-timeout`
/// plus a margin: exit 3 and one line, in bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_silent_after_login_is_unavailable() {
    let db = TestDb::new().await;

    // Silent from the CLI's session settings on (the first statement after login).
    let (err, took) = unavailable_when_frozen_at(
        &db,
        b"application_name",
        &["--connect-timeout", "2s", "stats"],
        Duration::from_secs(40),
        "stats hung on a server silent after login",
    )
    .await;
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert!(err.contains("no answer within 2s"), "{err}");

    // Silent from the first query on the table on.
    let (err, took) = unavailable_when_frozen_at(
        &db,
        b"idempotency_keys",
        &[
            "--connect-timeout",
            "2s",
            "--statement-timeout",
            "1s",
            "stats",
        ],
        Duration::from_secs(40),
        "stats hung on a server silent mid-session",
    )
    .await;
    assert!(err.contains("no answer"), "{err}");
    assert!(took < Duration::from_secs(20), "{took:?}");
}

/// A failover list whose first host takes the login and never answers (a frozen primary):
/// the CLI gives each host its share of `--connect-timeout` and reaches the next one, where
/// it used to wait on the first host until the whole timeout was gone (exit 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_first_host_leaves_the_next_one_its_turn() {
    let db = TestDb::new().await;
    let live = idempotency_e2e::proxy::host_port(&db.url);
    // The startup message names the user: silent from the login on.
    let frozen = freezing_proxy(live.clone(), b"user").await;
    let url = with_port(&db.url, frozen).replacen(
        &format!("127.0.0.1:{frozen}"),
        &format!("127.0.0.1:{frozen},{live}"),
        1,
    );
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        idem_within(
            &url,
            &["--connect-timeout", "6s", "stats"],
            Duration::from_secs(40),
        )
    })
    .await
    .expect("runner")
    .expect("stats hung on a frozen first host");
    expect_code(&out, 0);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}

/// The partitioned layout's drop and create steps are bounded by the CLI itself, not only by
/// the server's timeouts: a server that goes silent during a step (where `statement_timeout`
/// and `lock_timeout` cannot help) ends the purge with exit 3 and one line naming the step,
/// once `--statement-timeout` plus 5s passed. Once: a silent drop step used to be followed
/// by the default partition's purge and the create step on the same silent connection, each
/// waiting as long again (18s here, 15 minutes with the default 5m).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_silent_during_a_partition_step_is_unavailable() {
    let db = TestDb::new_unmigrated().await;
    migrate_partitioned(&db.url, "hourly");
    let mut admin = connect(&db).await;
    for (marker, step) in [
        (
            &b"idempotency_partitions_create"[..],
            "creating partitions ahead",
        ),
        (
            &b"idempotency_partitions_drop"[..],
            "dropping past partitions",
        ),
    ] {
        let (err, took) = unavailable_when_frozen_at(
            &db,
            marker,
            &["--statement-timeout", "1s", "purge"],
            Duration::from_secs(60),
            &format!("purge hung on a server silent while {step}"),
        )
        .await;
        assert!(err.contains(step), "{err}");
        assert!(err.contains("no answer within 6s"), "{err}");
        assert!(
            took >= Duration::from_secs(6) && took < Duration::from_secs(11),
            "{step}: gave up after {took:?}"
        );
        // The server still sees the frozen run's session, idle and holding the purge lock
        // (a frozen peer never closes): end it, or the next run skips.
        terminate_cli_backend(&mut admin, "state = 'idle'").await;
    }
}

/// `url` (a `postgres://` URL) pointed at 127.0.0.1:`port`.
fn with_port(url: &str, port: u16) -> String {
    let (scheme, rest) = url.split_once("://").expect("URL form");
    let (userinfo, after) = match rest.split_once('@') {
        Some((user, after)) => (format!("{user}@"), after),
        None => (String::new(), rest),
    };
    let end = after.find(['/', '?']).unwrap_or(after.len());
    format!("{scheme}://{userinfo}127.0.0.1:{port}{}", &after[end..])
}

/// `purge --partitions-ahead 1000` stops at the partition budget and says so in its one line:
/// each replay locks every response partition, and 1,001 of them made concurrent replays fail
/// with "out of shared memory" (found by review, 2026-12-04).
#[tokio::test]
async fn purge_stops_creating_partitions_at_the_lock_budget() {
    let db = TestDb::new_unmigrated().await;
    migrate_partitioned(&db.url, "hourly");
    let summary = idem_json(
        &db.url,
        &["--format", "json", "purge", "--partitions-ahead", "1000"],
    );
    let capped = summary["partitions_capped_at"].as_u64();
    assert!(capped.is_some_and(|n| n < 1000), "{summary}");
    let leaves = records::count(
        &db.url,
        "SELECT count(*) AS n FROM pg_inherits \
         WHERE inhparent = 'idempotency_responses'::regclass",
    );
    assert_eq!(Some(leaves as u64), capped, "{summary}");
    let out = idem_code(&db.url, &["purge", "--partitions-ahead", "1000"], 0);
    assert_stdout_has(&out, "max_locks_per_transaction");
}

/// `purge --older-than` keeps the default partition's responses as it keeps the range
/// partitions: a record purge kept (created less than 7 days ago, expired an hour ago) kept
/// its response too; it used to lose it, and `show` printed a completed record with no stored
/// response (found by review, 2026-12-04; migration 000009).
#[tokio::test]
async fn older_than_keeps_the_response_of_a_kept_record() {
    let db = TestDb::new_unmigrated().await;
    migrate_partitioned(&db.url, "hourly");
    records::seed_partitioned_completed(&db.url, "kept-", 1, "now() - interval '1 hour'");
    let in_default = "SELECT count(*) AS n FROM idempotency_responses_default";
    assert_eq!(records::count(&db.url, in_default), 1);
    let out = idem_code(&db.url, &["purge", "--older-than", "7d"], 0);
    assert_eq!(
        records::count(&db.url, "SELECT count(*) AS n FROM idempotency_keys"),
        1,
        "the claim is kept: created less than 7d ago"
    );
    assert_eq!(
        records::count(&db.url, in_default),
        1,
        "its response was deleted anyway: {}",
        stdout(&out)
    );
    // Without --older-than both go.
    let out = idem_code(&db.url, &["purge"], 0);
    assert_eq!(records::count(&db.url, in_default), 0, "{}", stdout(&out));
}

// ---------------------------------------------------------------------------------------------
// From a review (2026-12-04, night): each test failed on the code before its fix.

/// `purge --horizon` too long for the layout is a usage error (exit 2: "bad arguments"), but it
/// was only validated after the claims loop had deleted every expired record: the run deleted
/// and then reported nothing but "bad arguments" (no summary, partitions neither dropped nor
/// created), while `--dry-run` with the same arguments succeeded. Bad arguments must be refused
/// before anything is deleted, and a dry run must refuse what the run refuses.
#[tokio::test]
async fn purge_rejects_a_bad_horizon_before_deleting_anything() {
    let db = TestDb::new_unmigrated().await;
    migrate_partitioned(&db.url, "daily");
    records::seed_partitioned_completed(&db.url, "old-", 3, "now() - interval '1 hour'");
    let claims = "SELECT count(*) AS n FROM idempotency_keys";
    assert_eq!(records::count(&db.url, claims), 3);

    let dry = idem(&db.url, &["purge", "--dry-run", "--horizon", "1100d"]);
    let run = idem(&db.url, &["purge", "--horizon", "1100d"]);
    let left = records::count(&db.url, claims);
    assert_eq!(
        left,
        3,
        "exit {:?} (bad arguments) after deleting {} records: {}",
        run.status.code(),
        3 - left,
        stderr(&run)
    );
    expect_code(&run, USAGE);
    assert_eq!(
        dry.status.code(),
        run.status.code(),
        "dry run and run disagree\ndry: {} {}\nrun: {} {}",
        stdout(&dry),
        stderr(&dry),
        stdout(&run),
        stderr(&run)
    );
}

/// SQL inserting a completed record `key` of tenant `t` into the plain layout, with `status`,
/// `body` (an SQL expression) and `times` (created, completed and expiry, in SQL).
fn insert_completed(key: &str, status: u16, body: &str, times: &str) -> String {
    format!(
        "INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint, \
             state, token, response_status, response_headers, response_body, created_at, \
             completed_at, expires_at) \
         VALUES ('t', 'POST', '/payments', '{key}', decode(repeat('ab', 32), 'hex'), \
             'completed', gen_random_uuid(), {status}, '\\x0100000000', {body}, {times})"
    )
}

/// The purge lock was one advisory lock key for the whole database, not per table: a purge of
/// the table in one schema made the purge of another schema's table (docs/operations.md,
/// "Moving an existing deployment": a new schema via `search_path` in the URL) skip, exit 0,
/// having deleted nothing. Two cron lines started at the same minute then leave one table
/// unpurged for as long as they keep colliding (on the partitioned layout: no partitions
/// created ahead either).
#[tokio::test]
async fn purge_of_one_schema_does_not_skip_the_purge_of_another() {
    let db = TestDb::new_unmigrated().await;
    let mut conn = connect(&db).await;
    conn.batch_execute("CREATE SCHEMA old_layout; CREATE SCHEMA new_layout")
        .await
        .unwrap();
    let sep = if db.url.contains('?') { '&' } else { '?' };
    let in_schema = |schema: &str| format!("{}{sep}options=-c%20search_path%3D{schema}", db.url);
    for schema in ["old_layout", "new_layout"] {
        idem_code(&in_schema(schema), &["migrate"], 0);
    }
    let expired = insert_completed(
        "expired",
        201,
        "'{}'",
        "now() - interval '2 days', now() - interval '2 days', now() - interval '1 day'",
    );
    conn.batch_execute(&format!(
        "SET search_path = new_layout; {expired}; RESET search_path"
    ))
    .await
    .unwrap();
    // A purge of the old schema's table is running (its session holds the purge lock).
    let mut old_purge = postgres::establish(&in_schema("old_layout")).await.unwrap();
    old_purge
        .batch_execute(&format!("SELECT pg_advisory_lock({PURGE_LOCK})"))
        .await
        .unwrap();

    let summary = idem_json(&in_schema("new_layout"), &["purge", "--format", "json"]);
    assert_ne!(
        summary["skipped"],
        Value::Bool(true),
        "the purge of new_layout skipped because old_layout's purge runs: {summary}"
    );
    assert_eq!(summary["purged"], 1, "{summary}");
}

/// `migrate` (without `--check`) on a server that goes silent after login hung for good: every
/// other command's round trips are bounded by `--statement-timeout` plus 5 s (exit 3), but the
/// migration harness runs on a blocking thread whose statements nothing bounds on the client
/// side, and `migrate` awaited that thread without a limit (and the runtime's shutdown waited
/// for it too). A deploy step then hung instead of failing as "unavailable".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_a_server_silent_mid_migration_is_unavailable() {
    // Migrated already: nothing pending, so the run's bound is the lock wait and four answer
    // limits (5 s + 4 x 6 s); the harness still takes the migration lock first.
    let db = TestDb::new().await;
    // Silent from the migration lock's statement on (the first statement of the harness).
    let (err, took) = unavailable_when_frozen_at(
        &db,
        b"pg_try_advisory_lock",
        &[
            "--connect-timeout",
            "2s",
            "--statement-timeout",
            "1s",
            "migrate",
        ],
        Duration::from_secs(40),
        "migrate hung on a silent server",
    )
    .await;
    assert!(err.contains("did not finish"), "{err}");
    assert!(took < Duration::from_secs(36), "{took:?}");
}

/// `show` caps a text body at 64 KiB ("use --format json for all of them"), but a JSON body was
/// pretty-printed whole, and its indentation grows with the nesting: a 100 KB body 120 levels
/// deep printed about 12 MB (two spaces per level on every element's line). A stored response
/// of a few MB turns `show` into gigabytes on an operator's terminal.
#[tokio::test]
async fn show_text_output_of_a_json_body_is_bounded() {
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    let deep = insert_completed(
        "deep",
        200,
        "convert_to(repeat('[', 120) || repeat('1,', 50000) || '1' || repeat(']', 120), 'UTF8')",
        "now(), now(), now() + interval '1 day'",
    );
    conn.batch_execute(&deep).await.unwrap();
    let body_len = 120 + 2 * 50000 + 1 + 120;
    let out = idem_code(&db.url, &["show", "deep"], 0);
    assert!(
        out.stdout.len() < 4 * body_len + 64 * 1024,
        "a {body_len}-byte body printed as {} bytes",
        out.stdout.len()
    );
}

/// The partitioned layout's response table dropped by hand (`DROP TABLE idempotency_responses
/// CASCADE`) is a schema dropped by hand too: the first version of the probe checked
/// `idempotency_keys` and two functions only, so `migrate --check` answered exit 0 "up to
/// date (layout: plain)" while every `complete` failed (a review of the fix found it).
#[tokio::test]
async fn migrate_does_not_call_a_partitioned_schema_missing_its_response_table_up_to_date() {
    let (db, mut conn) = hourly_partitioned_with_a_past_partition().await;
    conn.batch_execute("DROP TABLE idempotency_responses CASCADE")
        .await
        .expect("drop");
    let out = idem(&db.url, &["migrate", "--check"]);
    assert_eq!(
        out.status.code(),
        Some(NOT_PROVISIONED),
        "stdout: {}\nstderr: {}",
        stdout(&out),
        stderr(&out)
    );
}

/// A row whose times lie past year 9999 or are infinite (a hand edit, another writer: the store
/// caps its own at about 100 years) is shown clamped, and every command still works, for that
/// row and for the others. Review, 2026-12-06: decoding went through a date type that stops at
/// 9999, so one such row failed `stats`, `list`, `show` and `release` for the whole table
/// ("Tried to deserialize a timestamp that is too large").
#[tokio::test]
async fn times_past_year_9999_or_infinite_do_not_break_any_command() {
    let db = TestDb::new().await;
    let mut conn = connect(&db).await;
    for (key, times) in [
        ("far", "'20000-01-01', '20000-01-01', '20000-01-01'"),
        ("infinite", "'-infinity', 'infinity', 'infinity'"),
        ("ordinary", "now(), now(), now() + interval '1 day'"),
    ] {
        conn.batch_execute(&insert_completed(key, 201, "'{}'", times))
            .await
            .unwrap();
    }
    let stats = idem_json(&db.url, &["--format", "json", "stats"]);
    assert_eq!(stats["completed"], Value::from(3), "{stats}");
    let listed = json_lines(&idem_code(&db.url, &["--format", "json", "list"], 0));
    assert_eq!(listed.len(), 3, "{listed:?}");
    let far = idem_json(&db.url, &["--format", "json", "show", "far"]);
    assert!(
        far["expires_at"]
            .as_str()
            .is_some_and(|t| t.starts_with("9999-12-31")),
        "{far}"
    );
    // Expiring at `infinity`: a record that never expires, as a Redis key without an expiry.
    let infinite = idem_json(&db.url, &["--format", "json", "show", "infinite"]);
    assert!(
        infinite["expires_at"].is_null() && infinite["expired"] == false,
        "{infinite}"
    );
    assert_stdout_has(
        &idem_code(&db.url, &["show", "infinite"], 0),
        "never expires",
    );
    idem_code(&db.url, &["release", "--force", "infinite"], 0);
    assert_eq!(keys(&mut conn).await, ["far", "ordinary"]);
}

/// Review, 2026-12-06: what an operator or a server puts in a message reaches the terminal
/// escaped (a method with an escape sequence, a database name the server repeats), and a URL
/// that names no host is a usage error (exit 2, fix the URL), not "unavailable" (exit 3, which
/// a cron wrapper retries for ever).
#[tokio::test]
async fn messages_are_terminal_safe_and_a_url_without_a_host_is_a_usage_error() {
    let db = TestDb::new().await;
    let out = idem_code(
        &db.url,
        &["show", "k-none", "--method", "\u{1b}[31mpost"],
        NOT_FOUND_OR_REFUSED,
    );
    assert!(!stderr(&out).contains('\u{1b}'), "{:?}", stderr(&out));
    let unknown_db = with_database(&db.url, "x\u{1b}[31mRED\u{1b}[0m");
    let out = idem(&unknown_db, &["stats"]);
    assert!(
        out.status.code().is_some_and(|c| c != 0),
        "{:?}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains('\u{1b}'), "{:?}", stderr(&out));
    for url in [
        "postgres://review:SECRETX@/db",
        "postgres://",
        "postgres://u:SECRETX@",
    ] {
        let out = idem(url, &["stats"]);
        expect_code(&out, USAGE);
        assert!(stderr(&out).contains("host"), "{url}: {}", stderr(&out));
        assert!(!stderr(&out).contains("SECRETX"), "{}", stderr(&out));
    }
}

/// Help that cannot be written is a failure like any other output (review, 2026-12-06:
/// `idem-cli --help > /dev/full` exited 0, the text lost).
#[test]
fn help_that_cannot_be_written_fails() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("skipped: no /dev/full here");
        return;
    };
    let out = Command::new(BIN)
        .arg("--help")
        .stdout(full)
        .stderr(Stdio::piped())
        .output()
        .expect("run idem-cli");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot write output"),
        "{}",
        stderr(&out)
    );
}
