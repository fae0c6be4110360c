//! `idem-cli --redis-url` end to end: the built binary against a throwaway `redis-server`
//! (one per test, on a free loopback port, killed on drop), over records written by the
//! `RedisStore` the middleware uses.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::{
    IdempotencyStore, RedisStore, ReserveOutcome, Scope, StoredResponse, WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::redis_server::{RedisCluster, RedisServer};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idem-cli");
const USAGE: i32 = 2;
const UNAVAILABLE: i32 = 3;
const NOT_FOUND_OR_REFUSED: i32 = 6;
const FP: Fingerprint = Fingerprint([7; 32]);
const LEASE: Duration = Duration::from_secs(60);

/// `idem-cli args...` with `REDIS_URL` set and no `DATABASE_URL`.
fn idem(redis_url: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("REDIS_URL", redis_url)
        .env_remove("DATABASE_URL")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {BIN}: {e}"))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

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

fn scope(tenant: &str, key: &str) -> Scope {
    Scope {
        tenant: tenant.into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

async fn reserve(store: &impl IdempotencyStore, s: &Scope, lease: Duration) -> ReserveOutcome {
    store.reserve(s, &FP, lease).await.expect("reserve")
}

/// Seeds: a completed record with a binary header and body (tenant acme), a live reservation
/// (acme), a reservation whose lease ended (globex), and a key that needs escaping.
async fn seed(store: &impl IdempotencyStore) {
    let ReserveOutcome::Reserved { token } = reserve(store, &scope("acme", "done"), LEASE).await
    else {
        panic!("fresh key")
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-raw".into(), Bytes::from_static(&[0xff, 0x00])),
        ],
        body: Bytes::from_static(br#"{"id":1}"#),
    };
    assert_eq!(
        store
            .complete(&scope("acme", "done"), &token, &response, LEASE)
            .await
            .ok(),
        Some(WriteOutcome::Applied)
    );
    reserve(store, &scope("acme", "running"), LEASE).await;
    reserve(store, &scope("globex", "stuck"), Duration::from_millis(50)).await;
    reserve(store, &scope("acme", "we:ird*{key}"), LEASE).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
}

/// The token `show KEY` prints.
fn shown_token(url: &str, key: &str) -> String {
    let out = idem(url, &["show", key, "--format", "json"]);
    expect_code(&out, 0);
    let token = json_lines(&out)[0]["token"].as_str().map(str::to_owned);
    token.unwrap_or_else(|| panic!("no token: {}", stdout(&out)))
}

/// `out` (a `release --format json`) released its record, and the store reserves `s` again.
async fn assert_released(out: &Output, store: &impl IdempotencyStore, s: &Scope) {
    expect_code(out, 0);
    assert_eq!(json_lines(out)[0]["released"], true);
    assert!(matches!(
        store.reserve(s, &Fingerprint([9; 32]), LEASE).await,
        Ok(ReserveOutcome::Reserved { .. })
    ));
}

#[tokio::test]
async fn list_show_stats_and_release_read_the_store() {
    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    seed(&store).await;

    let out = idem(&url, &["list", "--format", "json"]);
    expect_code(&out, 0);
    let rows = json_lines(&out);
    assert_eq!(rows.len(), 4, "{}", stdout(&out));
    let out = idem(
        &url,
        &[
            "list",
            "--tenant",
            "acme",
            "--state",
            "in-flight",
            "--format",
            "json",
        ],
    );
    expect_code(&out, 0);
    let mut keys: Vec<String> = json_lines(&out)
        .iter()
        .map(|r| r["key"].as_str().unwrap_or_default().to_owned())
        .collect();
    keys.sort();
    assert_eq!(keys, ["running", "we:ird*{key}"]);
    let out = idem(&url, &["list"]);
    expect_code(&out, 0);
    assert!(stdout(&out).contains("TENANT"), "{}", stdout(&out));

    let out = idem(&url, &["show", "done", "--format", "json"]);
    expect_code(&out, 0);
    let shown = &json_lines(&out)[0];
    assert_eq!(shown["tenant"], "acme");
    assert_eq!(shown["state"], "completed");
    assert_eq!(shown["fingerprint"], "07".repeat(32));
    assert_eq!(shown["response"]["status"], 201);
    assert_eq!(shown["response"]["body_json"]["id"], 1);
    assert_eq!(shown["response"]["headers"][1]["value_base64"], "/wA=");
    let out = idem(&url, &["show", "we:ird*{key}", "--tenant", "acme"]);
    expect_code(&out, 0);
    assert!(stdout(&out).contains("in_flight"), "{}", stdout(&out));
    expect_code(&idem(&url, &["show", "nothing"]), NOT_FOUND_OR_REFUSED);
    // A glob in the key is matched literally, not as a pattern.
    expect_code(&idem(&url, &["show", "*"]), NOT_FOUND_OR_REFUSED);

    let out = idem(&url, &["stats", "--format", "json"]);
    expect_code(&out, 0);
    let stats = &json_lines(&out)[0];
    assert_eq!(stats["total"], 4);
    assert_eq!(stats["in_flight"], 3);
    assert_eq!(stats["in_flight_lease_live"], 2);
    assert_eq!(stats["completed_live"], 1);
    assert_eq!(stats["oldest_in_flight"]["key"], "running");

    // Release: a live lease and a completed record are refused; the ended one goes, and the
    // store can reserve the key again.
    expect_code(
        &idem(&url, &["release", "running", "--tenant", "acme"]),
        NOT_FOUND_OR_REFUSED,
    );
    expect_code(&idem(&url, &["release", "done"]), NOT_FOUND_OR_REFUSED);
    let out = idem(&url, &["release", "stuck", "--format", "json"]);
    assert_released(&out, &store, &scope("globex", "stuck")).await;
    // --force with --token removes the record only while it holds the token `show` printed.
    let token = shown_token(&url, "running");
    let stale = "00000000-0000-4000-8000-000000000000";
    let force = [
        "release", "running", "--tenant", "acme", "--force", "--token",
    ];
    let out = idem(&url, &[&force[..], &[stale]].concat());
    expect_code(&out, NOT_FOUND_OR_REFUSED);
    assert!(
        stderr(&out).contains(&format!("holds token {token}, not {stale}")),
        "{}",
        stderr(&out)
    );
    assert!(matches!(
        reserve(&store, &scope("acme", "running"), LEASE).await,
        ReserveOutcome::InFlight { .. }
    ));
    let out = idem(&url, &[&force[..], &[token.as_str()]].concat());
    expect_code(&out, 0);
    // A completion keeps its reservation's token: --token refuses the completed record.
    let done = shown_token(&url, "done");
    let out = idem(&url, &["release", "done", "--force", "--token", &done]);
    expect_code(&out, NOT_FOUND_OR_REFUSED);
    assert!(
        stderr(&out).contains("is completed now"),
        "{}",
        stderr(&out)
    );
    expect_code(&idem(&url, &["show", "done"]), 0);
    // Named completed, as `show` printed it, it goes (with --force); --state needs --token.
    let completed = ["--state", "completed"];
    let unfenced = [&["release", "done", "--force"][..], &completed].concat();
    assert_eq!(idem(&url, &unfenced).status.code(), Some(2));
    let fenced = [
        &["release", "done", "--force", "--token", &done][..],
        &completed,
    ]
    .concat();
    expect_code(&idem(&url, &fenced), 0);
    expect_code(&idem(&url, &["show", "done"]), NOT_FOUND_OR_REFUSED);
    assert!(matches!(
        reserve(&store, &scope("acme", "running"), LEASE).await,
        ReserveOutcome::Reserved { .. }
    ));
}

/// On a Redis Cluster, whichever node the URL names: `stats` and `list` count the records of
/// every primary, `show` and `release` reach a record on any node.
/// Warnings on stderr are best effort: with stderr a pipe nobody reads any more (`2>&1 | head`
/// gone), `list`'s "showing the first N records" and `release`'s refusals must not panic
/// (`eprintln!` does, exit 101); the exit code still says what happened.
#[tokio::test]
async fn a_closed_stderr_does_not_panic() {
    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    seed(&store).await;

    for (args, code) in [
        (&["list", "--limit", "1"][..], 0),
        (
            &["release", "done", "running", "--tenant", "acme"],
            NOT_FOUND_OR_REFUSED,
        ),
    ] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let status = Command::new(BIN)
            .args(args)
            .env("REDIS_URL", &url)
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(writer)
            .status()
            .expect("run");
        assert_eq!(status.code(), Some(code), "{args:?}");
    }
}

/// A cluster of three primaries, their URLs, and a store on it holding 30 reservations of
/// tenant `bulk` (keys `k0`..`k29`), spread over the primaries.
async fn cluster_with_bulk_records() -> (RedisCluster, Vec<String>, impl IdempotencyStore) {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let store = RedisStore::builder()
        .connect_cluster(&[&urls[0]])
        .await
        .expect("connect_cluster");
    for i in 0..30 {
        reserve(&store, &scope("bulk", &format!("k{i}")), LEASE).await;
    }
    (cluster, urls, store)
}

#[tokio::test]
async fn on_a_cluster_every_primary_is_read() {
    let (_cluster, urls, store) = cluster_with_bulk_records().await;
    seed(&store).await;
    for url in &urls {
        let out = idem(url, &["stats", "--format", "json"]);
        expect_code(&out, 0);
        let stats = &json_lines(&out)[0];
        assert_eq!(stats["total"], 34, "from {url}: {stats}");
        assert_eq!(stats["in_flight_lease_live"], 32);
        let out = idem(url, &["list", "--tenant", "bulk", "--format", "json"]);
        expect_code(&out, 0);
        assert_eq!(json_lines(&out).len(), 30);
        let out = idem(url, &["show", "done", "--format", "json"]);
        expect_code(&out, 0);
        assert_eq!(json_lines(&out)[0]["response"]["body_json"]["id"], 1);
    }
    let out = idem(&urls[2], &["release", "stuck", "--format", "json"]);
    expect_code(&out, 0);
    assert_eq!(json_lines(&out)[0]["released"], true);
    assert!(matches!(
        reserve(&store, &scope("globex", "stuck"), LEASE).await,
        ReserveOutcome::Reserved { .. }
    ));
}

/// On a cluster, a user without `INFO` (an ACL that allows the keys and the data commands
/// only): idem-cli took `INFO`'s refusal for "a single server" and walked only the node in the
/// URL, so `stats` counted one shard's records with exit 0 (review, 2026-12-06). Now a
/// refused `INFO` is followed by a probe that needs no `INFO` (keys of other slots answer
/// `MOVED` from a cluster node), and every primary is read.
#[tokio::test]
async fn on_a_cluster_a_user_without_info_still_reads_every_primary() {
    let (cluster, _urls, _store) = cluster_with_bulk_records().await;
    let user_urls = cluster.user_urls("noinfo", &["-info"]);
    let out = idem(&user_urls[0], &["stats", "--format", "json"]);
    expect_code(&out, 0);
    assert_eq!(json_lines(&out)[0]["total"], 30, "{}", json_lines(&out)[0]);
}

/// C20 on a cluster: a primary that does not answer (killed; the others told
/// `cluster-require-full-coverage no`, so they keep serving their slots) makes every command
/// that reads the whole store fail with one line and exit 3. The redis crate leaves such a
/// primary out of a command sent to all primaries without an error: `stats` counted the
/// others' records and exited 0, and `show` of a key on the dead node said "no record".
#[tokio::test]
async fn on_a_cluster_a_primary_that_does_not_answer_is_unavailable() {
    use idempotency_actix::store::redis::redis;
    let (_cluster, urls, _store) = cluster_with_bulk_records().await;
    let mut on_dead = None;
    for (n, url) in urls.iter().enumerate() {
        let client = redis::Client::open(url.as_str()).expect("test URL parses");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("node accepts connections");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*bulk*")
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        assert!(!keys.is_empty(), "every primary holds records: node {n}");
        if n == 2 {
            on_dead = keys[0].rsplit(':').next().map(str::to_owned);
        }
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .query_async(&mut conn)
            .await
            .expect("CONFIG SET");
        if n == 2 {
            // Its connection drops with it: no reply to wait for.
            let _: Result<(), _> = redis::cmd("SHUTDOWN")
                .arg("NOSAVE")
                .query_async(&mut conn)
                .await;
        }
    }
    let on_dead = on_dead.expect("a key on node 2");
    tokio::time::sleep(Duration::from_millis(300)).await;
    for args in [
        vec!["stats", "--format", "json"],
        vec!["list", "--tenant", "bulk", "--format", "json"],
        vec!["show", on_dead.as_str(), "--format", "json"],
    ] {
        let out = idem(&urls[0], &args);
        expect_code(&out, UNAVAILABLE);
        let err = stderr(&out);
        assert!(err.contains("unavailable"), "{args:?}: {err}");
        assert!(err.contains("1 of 3"), "{args:?}: {err}");
        assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
    }
}

/// A user that may not run `INFO` is taken for a single server's user: the commands work.
#[tokio::test]
async fn a_user_without_info_can_read_the_store() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    seed(&store).await;
    let url = redis.user_url("limited", &["-info"]);
    let out = idem(&url, &["stats", "--format", "json"]);
    expect_code(&out, 0);
    assert_eq!(json_lines(&out)[0]["total"], 4);
}

/// `show` and `release` of a key whose whole scope is named (tenant, method, path) read its one
/// record key and never `SCAN` the keyspace: a user refused `SCAN` can use them, and they do
/// not walk millions of keys for one record. Without the whole scope they still scan.
#[tokio::test]
async fn an_exact_scope_is_read_without_a_scan() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    seed(&store).await;
    let url = redis.user_url("noscan", &["-scan"]);
    let exact = [
        "--tenant",
        "acme",
        "--method",
        "post",
        "--path",
        "/payments",
    ];

    let out = idem(
        &url,
        &[&["show", "done", "--format", "json"][..], &exact].concat(),
    );
    expect_code(&out, 0);
    let shown = json_lines(&out);
    assert_eq!(shown.len(), 1, "{}", stdout(&out));
    assert_eq!(shown[0]["tenant"], "acme");
    assert_eq!(shown[0]["response"]["body_json"]["id"], 1);
    // The key is encoded as the store encodes it: glob and hash-tag characters are literal.
    let out = idem(&url, &[&["show", "we:ird*{key}"][..], &exact].concat());
    expect_code(&out, 0);
    assert!(stdout(&out).contains("in_flight"), "{}", stdout(&out));
    // Another tenant's scope, or no record: not found, as with a scan.
    let other = [
        "--tenant",
        "globex",
        "--method",
        "POST",
        "--path",
        "/payments",
    ];
    expect_code(
        &idem(&url, &[&["show", "done"][..], &other].concat()),
        NOT_FOUND_OR_REFUSED,
    );

    // Release: the live lease is refused, the ended one (globex) goes.
    expect_code(
        &idem(&url, &[&["release", "running"][..], &exact].concat()),
        NOT_FOUND_OR_REFUSED,
    );
    let out = idem(
        &url,
        &[&["release", "stuck", "--format", "json"][..], &other].concat(),
    );
    assert_released(&out, &store, &scope("globex", "stuck")).await;

    // Without the path the key must be searched for, which this user may not do.
    let out = idem(&url, &["show", "done", "--tenant", "acme"]);
    assert_ne!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(stderr(&out).contains("scan"), "{}", stderr(&out));
}

#[tokio::test]
async fn migrate_and_purge_say_redis_needs_neither() {
    let redis = RedisServer::start();
    for command in ["migrate", "purge"] {
        let out = idem(&redis.url(), &[command]);
        expect_code(&out, 0);
        assert!(stdout(&out).contains("Redis needs no"), "{}", stdout(&out));
    }
    // Asking only whether there is work is answered; the global flags apply as anywhere.
    for args in [
        &["migrate", "--check"][..],
        &["purge", "--dry-run"],
        &["--format", "json", "purge"],
        &["purge", "--format", "json"],
        // Tuning only, as in a cron line shared with a PostgreSQL deployment.
        &["purge", "--batch-size", "1000", "--pause", "50ms"],
    ] {
        let out = idem(&redis.url(), args);
        expect_code(&out, 0);
        assert!(
            stdout(&out).contains("Redis needs no"),
            "{args:?}: {}",
            stdout(&out)
        );
    }
}

/// A refused `--redis-prefix` is not repeated: a connection string split at a space in its
/// password (`redis://u:<first half>`) lands there, and the error quoted it (review,
/// 2026-12-06).
#[test]
fn a_refused_redis_prefix_is_not_repeated() {
    let redis = RedisServer::start();
    for prefix in ["redis://u:HUNTERALPHA", "idem-HUNTERALPHA"] {
        let out = idem(&redis.url(), &["--redis-prefix", prefix, "list"]);
        expect_code(&out, USAGE);
        let err = stderr(&out);
        assert!(err.contains("--redis-prefix"), "{prefix}: {err}");
        assert!(!err.contains("HUNTERALPHA"), "{prefix}: {err}");
        assert_eq!(err.lines().count(), 1, "{prefix}: {err}");
    }
}

/// A flag that asks `purge` or `migrate` for PostgreSQL's work (`purge --grace 1h` to clear
/// ended reservations sooner) is refused, exit 2, naming the flag: it was ignored with exit 0
/// and "Redis needs no purge", dropping the operator's intent (review, 2026-12-06).
#[test]
fn postgres_only_flags_are_refused_on_redis() {
    let redis = RedisServer::start();
    for (args, flag) in [
        (&["purge", "--grace", "1h"][..], "--grace"),
        (&["purge", "--grace=1h"], "--grace"),
        (&["purge", "--dry-run", "--tenant", "acme"], "--tenant"),
        (&["purge", "--older-than", "7d"], "--older-than"),
        (&["migrate", "--partitioned"], "--partitioned"),
    ] {
        let out = idem(&redis.url(), args);
        expect_code(&out, USAGE);
        let err = stderr(&out);
        assert!(
            err.contains(flag) && err.contains("PostgreSQL only"),
            "{args:?}: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
    }
}

/// A Redis that wants a password the URL lacks is a credentials failure (exit 3, as a wrong
/// password is), for every command (review, 2026-12-06: `NOAUTH` from the first command after
/// connecting was "unexpected", exit 1, and `migrate` and `purge` exited 0).
#[test]
fn a_redis_that_wants_a_password_is_a_credentials_failure() {
    let redis = RedisServer::start();
    let set = Command::new("redis-cli")
        .args([
            "-p",
            &redis.port().to_string(),
            "CONFIG",
            "SET",
            "requirepass",
            "pw",
        ])
        .output()
        .expect("redis-cli");
    assert!(set.status.success(), "{set:?}");
    for args in [
        &["stats"][..],
        &["list"],
        &["migrate", "--check"],
        &["purge"],
    ] {
        let out = idem(&redis.url(), args);
        expect_code(&out, UNAVAILABLE);
        assert!(
            stderr(&out).contains("NOAUTH"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
}

/// `migrate --check` and `purge` against a Redis that is down, or a URL that is not a Redis
/// URL, fail like every other command: a deploy's `migrate --check || migrate` must not turn
/// green on a `REDIS_URL` exported for something else (review, 2026-12-06: both exited 0
/// without connecting).
#[test]
fn migrate_and_purge_check_the_redis_they_were_given() {
    let port = idempotency_e2e::raw_http::free_port();
    let down = format!("redis://:hunter2secret@127.0.0.1:{port}/");
    for args in [&["migrate", "--check"][..], &["migrate"], &["purge"]] {
        let out = idem(&down, &[args, &["--connect-timeout", "2s"]].concat());
        expect_code(&out, UNAVAILABLE);
        assert!(!stderr(&out).contains("hunter2secret"), "{}", stderr(&out));
        let out = idem("http://:hunter2secret@nowhere/", args);
        expect_code(&out, USAGE);
        assert!(!stderr(&out).contains("hunter2secret"), "{}", stderr(&out));
    }
}

#[test]
fn both_urls_are_refused_in_one_line() {
    let out = Command::new(BIN)
        .args(["list"])
        .env("REDIS_URL", "redis://127.0.0.1:1/")
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    expect_code(&out, USAGE);
    assert!(stderr(&out).contains("pick one"), "{}", stderr(&out));
}

#[test]
fn redis_down_is_unavailable_and_the_password_stays_secret() {
    // A port nothing listens on.
    let port = idempotency_e2e::raw_http::free_port();
    let url = format!("redis://:hunter2secret@127.0.0.1:{port}/");
    for command in ["list", "stats"] {
        let out = idem(&url, &[command, "--connect-timeout", "2s"]);
        expect_code(&out, UNAVAILABLE);
        assert!(!stderr(&out).contains("hunter2secret"), "{}", stderr(&out));
    }
    let out = idem("http://:hunter2secret@nowhere/", &["list"]);
    expect_code(&out, USAGE);
    assert!(!stderr(&out).contains("hunter2secret"), "{}", stderr(&out));
}

/// `SCAN` returns a key at least once, and twice when Redis shrinks its table during the walk:
/// `idem-cli stats` while most of the keyspace goes away (a wave of expiries, here deletes)
/// used to count some records twice (and `release KEY` could refuse one record as two). Redis
/// shrinks its table in its cron (`--hz 500`: within 2 ms) once less than a tenth of it is
/// used. Timing-dependent: with 30 rounds it failed in 5 of 6 runs before the fix (found by
/// review, 2026-12-04); 10 here, to keep it under 20 s once it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_counts_each_record_once_while_the_keyspace_shrinks() {
    use idempotency_actix::store::redis::redis;
    use idempotency_actix::store::redis::{record, record_key};
    use idempotency_actix::store::ReservationToken;
    const RECORDS: usize = 50_000;
    let server = RedisServer::start_with(&["--hz", "500"]);
    let url = server.url();
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    // Live reservations, written as the store writes them.
    for chunk in 0..RECORDS / 10_000 {
        let mut pipe = redis::pipe();
        for i in chunk * 10_000..(chunk + 1) * 10_000 {
            let bytes = record::in_flight(&FP, &ReservationToken::random(), 1, 3_600_000_000, 1);
            pipe.cmd("SET")
                .arg(record_key("idem:", &scope("t", &i.to_string())))
                .arg(bytes)
                .arg("PX")
                .arg(3_600_000)
                .ignore();
        }
        pipe.query_async::<()>(&mut conn).await.expect("seed");
    }
    let unlink = |from: usize, to: usize| {
        let mut pipe = redis::pipe();
        for i in from..to {
            pipe.cmd("UNLINK").arg(format!("other:{i}")).ignore();
        }
        pipe
    };
    async fn scans(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(conn)
            .await
            .expect("INFO");
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_scan:calls="))
            .and_then(|l| l.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }
    let mut counts = Vec::new();
    for _round in 0..10 {
        // Grow the table (470,000 keys: 524,288 buckets), then delete down to just over a
        // tenth of it (60,000 keys): no shrink yet.
        for chunk in 0..42 {
            let mut pipe = redis::pipe();
            for i in chunk * 10_000..(chunk + 1) * 10_000 {
                pipe.cmd("SET").arg(format!("other:{i}")).arg("x").ignore();
            }
            pipe.query_async::<()>(&mut conn).await.expect("seed");
        }
        for chunk in 1..42 {
            unlink(chunk * 10_000, (chunk + 1) * 10_000)
                .query_async::<()>(&mut conn)
                .await
                .expect("unlink");
        }
        let before = scans(&mut conn).await;
        let url2 = url.clone();
        let cli = std::thread::spawn(move || idem(&url2, &["stats", "--format", "json"]));
        // idem-cli is walking: the last 10,000 others go, and Redis shrinks the table.
        while scans(&mut conn).await < before + 5 {}
        unlink(0, 10_000)
            .query_async::<()>(&mut conn)
            .await
            .expect("unlink");
        let out = cli.join().expect("idem-cli");
        expect_code(&out, 0);
        let total = json_lines(&out)[0]["total"].as_u64().unwrap_or_default();
        counts.push(total);
        if total != RECORDS as u64 {
            break;
        }
    }
    assert!(
        counts.iter().all(|n| *n == RECORDS as u64),
        "idem-cli stats counted {counts:?} records; there are {RECORDS}"
    );
}

/// `list` and `stats` show no response, so they read each record's fixed head and length, not
/// the stored body: with 1 MiB responses (the default `max_response_bytes`) a batch of whole
/// records was a GiB in the CLI's memory and in the production Redis's output buffer for this
/// client, and a `stats` moved every stored byte over the network.
#[tokio::test]
async fn list_and_stats_do_not_pull_every_stored_body() {
    const RECORDS: usize = 40;
    const BODY: usize = 1024 * 1024;
    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let body = Bytes::from(vec![b'x'; BODY]);
    for i in 0..RECORDS {
        let s = scope("acme", &format!("big-{i}"));
        let ReserveOutcome::Reserved { token } = reserve(&store, &s, LEASE).await else {
            panic!("fresh key")
        };
        let response = StoredResponse {
            status: 200,
            headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
            body: body.clone(),
        };
        assert_eq!(
            store.complete(&s, &token, &response, LEASE).await.ok(),
            Some(WriteOutcome::Applied)
        );
    }
    let mut conn = idempotency_e2e::redis_server::connection(&url).await;
    async fn sent(
        conn: &mut idempotency_actix::store::redis::redis::aio::MultiplexedConnection,
    ) -> u64 {
        let info: String = idempotency_actix::store::redis::redis::cmd("INFO")
            .arg("stats")
            .query_async(conn)
            .await
            .expect("INFO");
        info.lines()
            .find_map(|l| l.trim().strip_prefix("total_net_output_bytes:"))
            .and_then(|n| n.parse().ok())
            .expect("total_net_output_bytes")
    }
    for command in [
        &["stats", "--format", "json"][..],
        &["list", "--format", "json"][..],
    ] {
        let before = sent(&mut conn).await;
        let out = idem(&url, command);
        expect_code(&out, 0);
        let moved = sent(&mut conn).await - before;
        assert!(
            moved < (BODY as u64) * 2,
            "`idem-cli {}` over {RECORDS} records made Redis send {moved} bytes ({} MiB): \
             every stored body, although it shows none",
            command[0],
            moved / (1024 * 1024)
        );
    }
}

/// `show KEY` streams its records on Redis as it does on PostgreSQL: 100 records of 1 MiB under
/// one key (one per tenant), and the CLI's peak memory, read while it waits on a reader that has
/// taken one line, stays far below the 100 MiB they hold. Before, every matching record was
/// read with its response before the first line was printed.
#[tokio::test]
async fn show_streams_its_records() {
    use std::io::BufRead;
    const RECORDS: usize = 100;
    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let body = Bytes::from(vec![b'x'; 1 << 20]);
    for t in 0..RECORDS {
        let s = scope(&format!("t{t:03}"), "same-key");
        let ReserveOutcome::Reserved { token } = reserve(&store, &s, LEASE).await else {
            panic!("fresh key")
        };
        let response = StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
            body: body.clone(),
        };
        assert_eq!(
            store.complete(&s, &token, &response, LEASE).await.ok(),
            Some(WriteOutcome::Applied)
        );
    }
    let mut child = Command::new(BIN)
        .args(["show", "same-key", "--format", "json"])
        .env("REDIS_URL", &url)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn show");
    let mut reader = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("first record");
    let first: Value = serde_json::from_str(&line).expect("a JSON record");
    assert_eq!(
        first["tenant"],
        "t000",
        "in scope order: {}",
        &line[..200.min(line.len())]
    );
    // A record's line is over 1 MiB and a pipe holds 64 KiB: the CLI now waits on this reader.
    std::thread::sleep(Duration::from_millis(300));
    let peak = idempotency_e2e::proc::peak_rss_kib(child.id());
    let mut tenants = vec![first["tenant"].as_str().map(str::to_owned)];
    for rest in reader.lines() {
        let record: Value = serde_json::from_str(&rest.expect("a record")).expect("JSON");
        tenants.push(record["tenant"].as_str().map(str::to_owned));
    }
    let status = child.wait().expect("show exits");
    assert!(status.success(), "{status:?}");
    let want: Vec<_> = (0..RECORDS).map(|t| Some(format!("t{t:03}"))).collect();
    assert_eq!(tenants, want, "every record once, in scope order");
    assert!(
        peak < 64 * 1024,
        "show held {peak} KiB at its peak while 100 MiB of records matched"
    );
}

/// A reservation key without expiry (PERSIST, RESTORE 0) is read as not ended by the store's
/// scripts; the CLI shows it the same way (a review found it counted as a lease that ended
/// `grace` ago, and `release` without `--force` then failing with a false "changed while
/// releasing").
#[tokio::test]
async fn a_reservation_without_expiry_is_reported_as_the_store_reads_it() {
    use idempotency_actix::store::redis::redis;
    let server = RedisServer::start();
    let redis = &server;
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let s = scope("acme", "persisted");
    reserve(&store, &s, LEASE).await;
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("conn");
    let mut keys: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    assert_eq!(keys.len(), 1);
    let persisted: i64 = redis::cmd("PERSIST")
        .arg(keys.remove(0))
        .query_async(&mut conn)
        .await
        .expect("PERSIST");
    assert_eq!(persisted, 1);
    // The store: in flight, not taken over.
    assert!(matches!(
        store.reserve(&s, &FP, LEASE).await,
        Ok(ReserveOutcome::InFlight { .. })
    ));
    let out = idem(&url, &["stats", "--format", "json"]);
    expect_code(&out, 0);
    let stats = &json_lines(&out)[0];
    let out_release = idem(&url, &["release", "persisted", "--tenant", "acme"]);
    assert_eq!(
        (
            stats["in_flight_lease_live"].as_u64(),
            stats["in_flight_lease_ended"].as_u64()
        ),
        (Some(1), Some(0)),
        "stats says the lease ended while reserve answers in flight and release refuses: {stats}\n\
         release without --force said: {}",
        stderr(&out_release)
    );
    // No made-up lease end, and no advice to wait for one (review, 2026-12-06: every run said
    // "lease ends in 1m", the server's now plus the lease, and `release` said to wait for it).
    let refused = stderr(&out_release);
    assert!(
        refused.contains("no lease end")
            && refused.contains("--force")
            && !refused.contains("wait"),
        "{refused}"
    );
    let shown = idem(&url, &["show", "persisted", "--tenant", "acme"]);
    expect_code(&shown, 0);
    assert!(
        stdout(&shown).contains("no lease end"),
        "{}",
        stdout(&shown)
    );
    assert!(!stdout(&shown).contains("ends in"), "{}", stdout(&shown));
    let shown = idem(
        &url,
        &["show", "persisted", "--tenant", "acme", "--format", "json"],
    );
    let shown = &json_lines(&shown)[0];
    assert_eq!(shown["locked_until"], serde_json::Value::Null, "{shown}");
    assert_eq!(
        shown["lease_live"],
        serde_json::Value::Bool(true),
        "{shown}"
    );
}

/// `rediss://` against a server without TLS: the handshake waits for the connect timeout, and
/// the message names the likely cause rather than only "timed out" (review, 2026-12-06).
#[test]
fn a_tls_url_against_a_plain_server_says_what_is_likely_wrong() {
    let server = RedisServer::start();
    let url = format!("rediss://127.0.0.1:{}", server.port());
    let out = idem(&url, &["stats", "--connect-timeout", "1s"]);
    expect_code(&out, 3);
    assert!(stderr(&out).contains("TLS"), "{}", stderr(&out));
}
