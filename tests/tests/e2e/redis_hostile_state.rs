//! The Redis store and `idem-cli` against hostile or unusual server state (a review of
//! 2026-12-05): values of a foreign type or corrupt bytes under record keys, ACL users short of
//! a command, writes paused mid-request, a restart with and without an fsynced AOF, prefixes
//! that nest or resemble each other, a non-zero database in the URL, and a 1 MiB binary body
//! through the request path and `idem-cli show`. Every test starts its own `redis-server`.

use super::redis_store::scope;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::redis::RedisStore;
use idempotency_actix::store::{
    IdempotencyStore, ReserveOutcome, Scope, StoreError, StoredResponse, WriteOutcome,
};
use idempotency_actix::{Fingerprint, Idempotency};
use idempotency_e2e::proc::idem_cli_binary;
use idempotency_e2e::raw_http::{Conn, Request, Response};
use idempotency_e2e::redis_server::{connection as conn, RedisServer};
use idempotency_e2e::server::ThreadServer;

const FP: Fingerprint = Fingerprint([0x5A; 32]);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
const HTTP_TIMEOUT: Duration = Duration::from_secs(20);
const MIB: usize = 1 << 20;

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(body),
    }
}

// ---------------------------------------------------------------------------------------------
// idem-cli as a process (`proc::idem_cli_binary`).

/// `idem-cli args...` with `REDIS_URL=url` (and no `DATABASE_URL`), run on a blocking thread.
async fn idem(url: &str, args: &[&str]) -> Output {
    let bin = idem_cli_binary();
    let url = url.to_owned();
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(bin)
            .args(&args)
            .env("REDIS_URL", url)
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .output()
            .expect("run idem-cli")
    })
    .await
    .expect("join")
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
fn describe(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        out(o),
        err(o)
    )
}
fn stats_total(o: &Output) -> u64 {
    let v: serde_json::Value = serde_json::from_str(out(o).trim()).unwrap_or_else(|e| {
        panic!("stats JSON ({e}): {}", describe(o));
    });
    v["total"].as_u64().expect("total")
}

async fn set_raw(url: &str, key: &str, value: &[u8]) {
    let mut c = conn(url).await;
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query_async(&mut c)
        .await
        .expect("SET");
}

async fn get_raw(url: &str, key: &str) -> Option<Vec<u8>> {
    let mut c = conn(url).await;
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("GET")
}

async fn exists(url: &str, key: &str) -> bool {
    let mut c = conn(url).await;
    let n: i64 = redis::cmd("EXISTS")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("EXISTS");
    n == 1
}

async fn key_type(url: &str, key: &str) -> String {
    let mut c = conn(url).await;
    redis::cmd("TYPE")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("TYPE")
}

async fn all_keys(url: &str) -> Vec<String> {
    let mut c = conn(url).await;
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut c)
        .await
        .expect("KEYS");
    keys.sort();
    keys
}

/// A completed record written by the store at `s`; returns its raw bytes.
async fn completed(store: &RedisStore, url: &str, s: &Scope, body: &'static [u8]) -> Vec<u8> {
    let ReserveOutcome::Reserved { token } = store.reserve(s, &FP, LEASE).await.expect("reserve")
    else {
        panic!("{s:?}: not a fresh key")
    };
    assert_eq!(
        store.complete(s, &token, &response(body), TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    get_raw(url, &store.key_of(s)).await.expect("record")
}

// ---------------------------------------------------------------------------------------------
// An app over the store: POST /pay counts its runs and answers "paid <n>" (an `x-sleep-ms`
// header makes it sleep first); POST /big answers a 1 MiB binary body.

struct App1 {
    server: ThreadServer,
    runs: Arc<AtomicU64>,
}

fn big_body() -> Vec<u8> {
    (0..MIB)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
        .collect()
}

fn app(url: &str, response_timeout: Duration, lease: Duration) -> App1 {
    let runs = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&runs);
    let url = url.to_owned();
    let server = ThreadServer::start(move || async move {
        let store = RedisStore::builder()
            .response_timeout(response_timeout)
            .connect(&url)
            .await
            .expect("store connects");
        let counter = web::Data::from(counter);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(counter.clone())
                .wrap(
                    Idempotency::builder(store.clone())
                        .lock_timeout(lease)
                        .build(),
                )
                .route("/pay", web::post().to(pay))
                .route("/big", web::post().to(big))
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    });
    App1 { server, runs }
}

async fn pay(req: HttpRequest, runs: web::Data<AtomicU64>) -> HttpResponse {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let sleep = req
        .headers()
        .get("x-sleep-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    if sleep > 0 {
        tokio::time::sleep(Duration::from_millis(sleep)).await;
    }
    HttpResponse::Created()
        .content_type("text/plain")
        .body(format!("paid {n}"))
}

async fn big(runs: web::Data<AtomicU64>) -> HttpResponse {
    runs.fetch_add(1, Ordering::SeqCst);
    HttpResponse::Ok()
        .content_type("application/octet-stream")
        .insert_header(("x-raw", "bin"))
        .body(big_body())
}

impl App1 {
    async fn send(&self, request: Request) -> Response {
        let addr = self.server.addr;
        tokio::task::spawn_blocking(move || {
            Conn::connect(addr, HTTP_TIMEOUT)
                .and_then(|mut c| c.send(&request))
                .expect("HTTP")
        })
        .await
        .expect("join")
    }

    async fn post(&self, key: &str, body: &str) -> Response {
        self.send(Request::post("/pay").key(key).json(body)).await
    }

    fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }
}

/// Words a problem body shown to a client must not carry (Redis's or Lua's own error text).
const LEAKS: &[&str] = &[
    "WRONGTYPE",
    "wrongtype",
    "Redis",
    "redis",
    "Lua",
    "lua",
    "corrupt",
    "NOPERM",
    "ERR ",
    "127.0.0.1",
    "script",
];

#[track_caller]
fn assert_no_leak(r: &Response, what: &str) {
    let text = r.text();
    for word in LEAKS {
        assert!(
            !text.contains(word),
            "{what}: the client sees {word:?}: {}",
            r.describe()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (1) Foreign values under record keys: the request path.

/// A record key holding a list, a hash, a set, a garbage string, a completed record cut inside
/// its head, a completed record whose response is cut short (head intact), an in-flight record
/// cut short, and a completed record with a non-numeric expiry field. Each retry of the key is
/// answered 5xx with a problem that names nothing of Redis, the handler never runs again, the
/// value is left as it was, and nothing panics (the next fresh key still works).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_values_under_a_record_key_are_refused_over_http_without_a_run() {
    let redis = RedisServer::start();
    let url = redis.url();
    let app = app(&url, Duration::from_secs(2), LEASE);
    type Spoil = fn(&[u8]) -> Option<Vec<u8>>;
    let cases: Vec<(&str, Spoil)> = vec![
        ("list", |_| None),
        ("hash", |_| None),
        ("set", |_| None),
        ("garbage", |_| Some(b"\x00\xffnot a record at all".to_vec())),
        ("cut-in-head", |r| Some(r[..50].to_vec())),
        ("inflight-cut", |r| {
            let mut v = r[..80].to_vec();
            v[0] = b'F';
            Some(v)
        }),
        ("bad-expiry", |r| {
            let mut v = r.to_vec();
            v[101..117].copy_from_slice(b"notanumber......");
            Some(v)
        }),
        // A status outside HTTP's range: refused, never replayed as 200 (review, 2026-12-06).
        ("bad-status", |r| {
            let mut v = r.to_vec();
            v[117..120].copy_from_slice(b"042");
            Some(v)
        }),
        ("inflight-bad-lease", |r| {
            let mut v = r[..117].to_vec();
            v[0] = b'F';
            v[85..117].copy_from_slice(b"xxxxxxxxxxxxxxxxyyyyyyyyyyyyyyyy");
            Some(v)
        }),
    ];
    let mut c = conn(&url).await;
    for (name, spoil) in cases {
        let key = format!("hostile-{name}");
        let first = app.post(&key, r#"{"amount":1}"#).await;
        assert_eq!(first.status, 201, "{name}: {}", first.describe());
        let runs = app.runs();
        let mut keys: Vec<String> = all_keys(&url).await;
        keys.retain(|k| k.ends_with(&format!(":{key}")));
        assert_eq!(keys.len(), 1, "{name}: {keys:?}");
        let rkey = keys.remove(0);
        let record = get_raw(&url, &rkey).await.expect("record");
        let _: () = redis::cmd("DEL")
            .arg(&rkey)
            .query_async(&mut c)
            .await
            .expect("DEL");
        match (name, spoil(&record)) {
            ("list", _) => {
                let _: () = redis::cmd("RPUSH")
                    .arg(&rkey)
                    .arg("a")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            ("hash", _) => {
                let _: () = redis::cmd("HSET")
                    .arg(&rkey)
                    .arg("st")
                    .arg("C")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            ("set", _) => {
                let _: () = redis::cmd("SADD")
                    .arg(&rkey)
                    .arg("x")
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            (_, Some(v)) => set_raw(&url, &rkey, &v).await,
            (_, None) => unreachable!(),
        }
        let before_type = key_type(&url, &rkey).await;
        let before = if before_type == "string" {
            get_raw(&url, &rkey).await
        } else {
            None
        };
        for attempt in 0..2 {
            let retry = app.post(&key, r#"{"amount":1}"#).await;
            assert!(
                retry.status >= 500,
                "{name} attempt {attempt}: expected a 5xx, got {}",
                retry.describe()
            );
            assert_eq!(
                retry.problem_code().as_deref(),
                Some("STORAGE_UNAVAILABLE"),
                "{name}: {}",
                retry.describe()
            );
            assert_no_leak(&retry, name);
            // Another body: the same answer, never a 422 decided from garbage, never a run.
            let other = app.post(&key, r#"{"amount":2}"#).await;
            assert!(
                other.status >= 500,
                "{name} other body: {}",
                other.describe()
            );
        }
        assert_eq!(app.runs(), runs, "{name}: the handler ran again");
        assert_eq!(
            key_type(&url, &rkey).await,
            before_type,
            "{name}: type changed"
        );
        if before_type == "string" {
            assert_eq!(get_raw(&url, &rkey).await, before, "{name}: value changed");
        }
    }
    // The app still serves a fresh key.
    let fresh = app.post("fresh-after", "{}").await;
    assert_eq!(fresh.status, 201, "{}", fresh.describe());
}

/// Seeds one good completed record and, at record keys of the same prefix, a hash, a garbage
/// string, a completed record cut inside its head and one whose response is cut short.
async fn seed_foreign(url: &str) -> RedisStore {
    let store = RedisStore::connect(url).await.expect("connect");
    let good = completed(&store, url, &scope("acme", "good"), b"ok").await;
    let mut c = conn(url).await;
    let _: () = redis::cmd("HSET")
        .arg(store.key_of(&scope("acme", "ahash")))
        .arg("st")
        .arg("C")
        .query_async(&mut c)
        .await
        .unwrap();
    set_raw(url, &store.key_of(&scope("acme", "garbage")), b"hello").await;
    set_raw(url, &store.key_of(&scope("acme", "cuthead")), &good[..60]).await;
    set_raw(
        url,
        &store.key_of(&scope("acme", "cutbody")),
        &good[..good.len() - 1],
    )
    .await;
    store
}

/// The three values [`seed_foreign`] puts where records belong, and what `idem-cli` must call
/// each. (Its fourth, a record whose response lost its last byte, still decodes: a record
/// carries no body length, and records are trusted, docs/redis.md "Who may write".)
const UNREADABLE: [(&str, &str); 3] = [
    ("ahash", "a value of type hash"),
    ("garbage", "a string of 5 bytes"),
    ("cuthead", "a string of 60 bytes"),
];

/// `idem-cli stats` and `list` over a keyspace with unreadable values at record keys of the
/// store's prefix (every request with those keys gets 503). Found by review: `stats` counted
/// around them and `list` left them out, exit 0 and nothing on stderr. Now `stats` counts
/// them (`unreadable`) and both name each one on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_stats_and_list_name_unreadable_records() {
    let redis = RedisServer::start();
    let url = redis.url();
    seed_foreign(&url).await;
    let stats = idem(&url, &["--format", "json", "stats"]).await;
    assert_eq!(stats.status.code(), Some(0), "{}", describe(&stats));
    let json: serde_json::Value = serde_json::from_str(out(&stats).trim()).expect("stats JSON");
    assert_eq!(
        (json["total"].as_u64(), json["unreadable"].as_u64()),
        (Some(2), Some(3)),
        "{}",
        describe(&stats)
    );
    let text = idem(&url, &["stats"]).await;
    assert!(
        out(&text).contains("unreadable           3"),
        "{}",
        describe(&text)
    );
    let list = idem(&url, &["list"]).await;
    assert_eq!(list.status.code(), Some(0), "{}", describe(&list));
    for o in [&stats, &list] {
        for (key, what) in UNREADABLE {
            assert!(
                err(o).lines().any(|l| l.contains(&format!("key={key:?}"))
                    && l.contains(what)
                    && l.contains("holds no readable record")),
                "{key} ({what}) not named:\n{}",
                describe(o)
            );
        }
    }
    // A tenant filter keeps to its tenant.
    let other = idem(&url, &["list", "--tenant", "other"]).await;
    assert!(
        !err(&other).contains("holds no readable record"),
        "{}",
        describe(&other)
    );
}

/// `idem-cli show KEY` and `release --force KEY` for a key whose value is not a record: found
/// by review, both said "no record with key", sending the operator elsewhere while the key
/// answered 503. Now both name what is there and how to remove it; `release`, even forced,
/// deletes nothing it cannot read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_show_and_release_of_an_unreadable_record_say_what_is_there() {
    let redis = RedisServer::start();
    let url = redis.url();
    let store = seed_foreign(&url).await;
    for (key, what) in UNREADABLE {
        let redis_key = store.key_of(&scope("acme", key));
        let show = idem(&url, &["show", key, "--tenant", "acme"]).await;
        let release = idem(&url, &["release", key, "--tenant", "acme", "--force"]).await;
        for (command, o) in [("show", &show), ("release --force", &release)] {
            assert_eq!(o.status.code(), Some(6), "{command} {key}: {}", describe(o));
            assert!(
                err(o).contains("holds no readable record")
                    && err(o).contains(what)
                    && err(o).contains(&redis_key)
                    && !err(o).contains("no record with key"),
                "{command} {key}: {}",
                describe(o)
            );
        }
        assert!(exists(&url, &redis_key).await, "release deleted {key}");
    }
    // The record whose response lost a byte reads as a record, in `list` and in `show` alike.
    let list = idem(&url, &["--format", "json", "list"]).await;
    assert!(out(&list).contains("cutbody"), "{}", describe(&list));
    let show = idem(&url, &["show", "cutbody", "--tenant", "acme"]).await;
    assert_eq!(show.status.code(), Some(0), "{}", describe(&show));
}

/// `release KEY --force` without a scope, where one tenant's record with that key reads and
/// another tenant's does not: found by review (2026-12-06), the readable one was released as
/// if it were the only match, the unreadable one not even mentioned (an operator clearing the
/// 503s of one tenant deleted another tenant's completed payment, whose retry then ran again).
/// Now it is refused as ambiguous, naming both, and nothing is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_release_counts_an_unreadable_match_as_a_match() {
    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    completed(&store, &url, &scope("acme", "k"), b"paid").await;
    let mut c = conn(&url).await;
    let broken = store.key_of(&scope("globex", "k"));
    let _: () = redis::cmd("HSET")
        .arg(&broken)
        .arg("st")
        .arg("C")
        .query_async(&mut c)
        .await
        .unwrap();
    let release = idem(&url, &["release", "k", "--force"]).await;
    assert_eq!(release.status.code(), Some(6), "{}", describe(&release));
    assert!(
        err(&release).contains("matches 2 records")
            && err(&release).contains("tenant=\"acme\"")
            && err(&release).contains("tenant=\"globex\" POST /payments key=\"k\" (unreadable)"),
        "{}",
        describe(&release)
    );
    assert!(
        exists(&url, &store.key_of(&scope("acme", "k"))).await,
        "the readable record was released"
    );
    assert!(exists(&url, &broken).await);
}

/// A completed record whose key lost its expiry (`PERSIST`, `RESTORE key 0`): the store replays
/// it for as long as the key lives, but idem-cli read its stored expiry and called it expired
/// (`stats` counted it `completed_expired`, `release` said the next request runs again and that
/// `purge` removes it: neither is true on Redis; review, 2026-12-06). It is now live and never
/// expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_reads_a_completed_record_without_expiry_as_live() {
    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let s = scope("acme", "kept");
    let ReserveOutcome::Reserved { token } = store.reserve(&s, &FP, LEASE).await.expect("reserve")
    else {
        panic!("not a fresh key")
    };
    let ttl = Duration::from_millis(1500);
    let stored = store.complete(&s, &token, &response(b"paid"), ttl).await;
    assert_eq!(stored.ok(), Some(WriteOutcome::Applied));
    let mut c = conn(&url).await;
    let key = store.key_of(&s);
    let persisted: i64 = redis::cmd("PERSIST")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(persisted, 1);
    // Past the expiry stored in the record: the key lives on, and the store replays it.
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    assert!(matches!(
        store.reserve(&s, &FP, LEASE).await,
        Ok(ReserveOutcome::Completed { .. })
    ));
    let stats = idem(&url, &["--format", "json", "stats"]).await;
    let json: serde_json::Value = serde_json::from_str(out(&stats).trim()).expect("stats JSON");
    assert_eq!(
        (
            json["completed_live"].as_u64(),
            json["completed_expired"].as_u64()
        ),
        (Some(1), Some(0)),
        "{}",
        describe(&stats)
    );
    let show = idem(&url, &["show", "kept", "--tenant", "acme"]).await;
    assert!(out(&show).contains("never expires"), "{}", describe(&show));
    let release = idem(&url, &["release", "kept", "--tenant", "acme"]).await;
    assert_eq!(release.status.code(), Some(6), "{}", describe(&release));
    assert!(
        err(&release).contains("never expires") && !err(&release).contains("purge"),
        "{}",
        describe(&release)
    );
    assert!(exists(&url, &key).await);
}

// ---------------------------------------------------------------------------------------------
// (3) ACL users short of a command.

/// A user without `EVALSHA` (or `TIME`): `SET` alone would reserve, so handlers would run whose
/// responses could never be stored (every `complete` is a script), the key held for lease +
/// `in_flight_grace` and then run again. Found by review: `connect` accepted such a user. It is
/// refused now, naming the command and no password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_evalsha_or_time_is_refused_at_connect() {
    let redis = RedisServer::start();
    for (user, denied, named) in [
        (
            "noscript",
            &["-evalsha", "-eval", "-evalsha_ro", "-eval_ro"][..],
            "EVALSHA",
        ),
        ("noload", &["-script|load", "-eval"][..], "SCRIPT LOAD"),
        ("notime", &["-time"][..], "TIME"),
        // Commands only the scripts run: on a key that holds no record a script need not
        // reach them, so the release probe alone accepted such users, whose every non-2xx
        // left its key stuck (review, 2026-12-06).
        ("nodel", &["-del"][..], "DEL"),
        ("nopexpire", &["-pexpire"][..], "PEXPIRE"),
        ("nogetrange", &["-getrange"][..], "GETRANGE"),
    ] {
        let url = redis.user_url(user, denied);
        match RedisStore::connect(&url).await {
            Ok(_) => panic!("connect accepted user {user} ({denied:?})"),
            Err(e) => {
                let text = e.to_string();
                assert!(!text.contains("pw@"), "password in {text}");
                assert!(
                    text.contains(named) && text.contains("may not run"),
                    "{user}: {text}"
                );
            }
        }
    }
}

/// A Redis without a command the store needs (renamed away with `rename-command`, as some
/// hardened setups do) fails `connect`, naming it: every request would fail on it. The probe
/// of the first version took any refusal but `NOPERM` for permission (review, 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_without_a_command_the_store_needs_is_refused_at_connect() {
    let redis = RedisServer::start_with(&["--rename-command", "GETRANGE", ""]);
    match RedisStore::connect(&redis.url()).await {
        Ok(_) => panic!("connect accepted a Redis without GETRANGE"),
        Err(e) => assert!(e.to_string().contains("GETRANGE"), "{e}"),
    }
}

/// A user without `SCRIPT LOAD` on a server whose script cache another instance filled: the
/// scripts run by hash until Redis restarts or fails over, and then none can load again, and
/// every `complete` and `release` fails. `connect` loads every script itself, so it refuses
/// such a user now, naming the command; it passed before, its `EVALSHA` answered from the
/// cache (review, 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_script_load_is_refused_though_the_scripts_are_loaded() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    // Another instance's traffic: every script in the cache.
    let s = scope("t", "warm");
    if let Ok(ReserveOutcome::Reserved { token }) =
        store.reserve(&s, &FP, Duration::from_secs(60)).await
    {
        let _ = store.renew_lease(&s, &token, Duration::from_secs(60)).await;
        let _ = store.release(&s, &token).await;
    }
    let url = redis.user_url("noload", &["-script|load"]);
    match RedisStore::connect(&url).await {
        Ok(_) => panic!("connect accepted a user that may not run SCRIPT LOAD"),
        Err(e) => {
            let text = e.to_string();
            assert!(!text.contains("pw@"), "password in {text}");
            assert!(text.contains("SCRIPT LOAD"), "{text}");
        }
    }
}

/// A user refused `TIME` after connect (an ACL changed under a running app): the reserve's
/// pipelined `SET ... NX` runs, its `TIME` is refused. The request gets an error without a run,
/// and the key is not left reserved by nobody: found by review, the reservation stayed for
/// lease + 24 h grace (a fixed user's retry told 409, a corrected body 422). The reserve now
/// gives a `NOPERM` reservation back, fenced by its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_refused_time_after_connect_leaves_no_reservation_behind() {
    let redis = RedisServer::start();
    let url = redis.user_url("latetime", &[]);
    let store = RedisStore::connect(&url).await.expect("connect");
    redis.user_url("latetime", &["-time"]);
    let s = scope("t", "notime");
    let result = store.reserve(&s, &FP, LEASE).await;
    assert!(
        !matches!(result, Ok(ReserveOutcome::Reserved { .. })),
        "reserved without TIME: {result:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let left = loop {
        let left = get_raw(&redis.url(), &store.key_of(&s)).await;
        if left.is_none() || Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        left.is_none(),
        "reserve answered {result:?} but left the key reserved ({} bytes, state {:?}); \
         PTTL-long (lease + grace) lock held by nobody",
        left.as_ref().map_or(0, Vec::len),
        left.as_ref()
            .and_then(|v| v.first())
            .map(|b| char::from(*b))
    );
}

/// A user without `SCAN`: idem-cli `list` and `stats` fail in one clear line (not "no matching
/// records"), naming no password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_for_a_user_without_scan_fails_clearly() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    completed(&store, &redis.url(), &scope("t", "k"), b"ok").await;
    let url = redis.user_url("noscan", &["-scan"]);
    for args in [&["list"][..], &["stats"][..], &["show", "k"][..]] {
        let o = idem(&url, args).await;
        assert_ne!(o.status.code(), Some(0), "{args:?}: {}", describe(&o));
        assert!(!err(&o).contains("panicked"), "{}", describe(&o));
        assert!(
            !err(&o).contains(":pw@") && !err(&o).contains("pw@"),
            "{}",
            describe(&o)
        );
        assert!(
            err(&o).to_lowercase().contains("perm") || err(&o).contains("scan"),
            "{args:?}: {}",
            describe(&o)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// (4) Writes paused mid-request.

async fn pause_writes(url: &str, ms: u64) {
    let mut c = conn(url).await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("WRITE")
        .query_async(&mut c)
        .await
        .expect("CLIENT PAUSE");
}

/// `CLIENT PAUSE 2000 WRITE` before a request: its reserve times out (500 ms) and it gets 503
/// without a run; the queued `SET` runs when the pause ends, behind it the store's fenced
/// release: once the pause is over the key is free, the retry runs once and then replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_pause_during_the_reserve_is_503_and_leaves_no_stuck_key() {
    let redis = RedisServer::start();
    let url = redis.url();
    let app = app(&url, Duration::from_millis(500), Duration::from_secs(5));
    assert_eq!(app.post("warm", "{}").await.status, 201);
    let runs = app.runs();
    pause_writes(&url, 2000).await;
    let started = Instant::now();
    let paused = app.post("paused", "{}").await;
    assert_eq!(paused.status, 503, "{}", paused.describe());
    assert_no_leak(&paused, "paused");
    assert!(
        started.elapsed() < Duration::from_millis(1900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(app.runs(), runs);
    tokio::time::sleep(Duration::from_millis(2600).saturating_sub(started.elapsed())).await;
    let retry = app.post("paused", "{}").await;
    assert_eq!(
        retry.status,
        201,
        "after the pause the key should be free, got {}",
        retry.describe()
    );
    assert_eq!(app.runs(), runs + 1);
    let replay = app.post("paused", "{}").await;
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.body, retry.body);
    assert_eq!(app.runs(), runs + 1);
}

/// `CLIENT PAUSE 1500 WRITE` while the handler runs: the completion times out (500 ms) and is
/// retried; a retry during the pause is 503 or 409, never a run; after it, a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_pause_during_the_completion_does_not_run_twice() {
    let redis = RedisServer::start();
    let url = redis.url();
    let app = Arc::new(app(
        &url,
        Duration::from_millis(500),
        Duration::from_secs(3),
    ));
    assert_eq!(app.post("warm", "{}").await.status, 201);
    let runs = app.runs();
    let first = {
        let app = Arc::clone(&app);
        tokio::spawn(async move {
            app.send(
                Request::post("/pay")
                    .key("pause-complete")
                    .header("x-sleep-ms", "300")
                    .json("{}"),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    pause_writes(&url, 1500).await;
    let first = first.await.expect("join");
    assert_eq!(first.status, 201, "{}", first.describe());
    let during = app.post("pause-complete", "{}").await;
    assert!(
        during.status == 409 || during.status == 503,
        "{}",
        during.describe()
    );
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let after = app.post("pause-complete", "{}").await;
    assert!(after.is_replay(), "{}", after.describe());
    assert_eq!(after.body, first.body);
    assert_eq!(app.runs(), runs + 1, "the handler ran twice");
}

/// `DEBUG SLEEP 1.5` (the whole server stalls) while the handler runs: as the pause above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stall_during_the_completion_does_not_run_twice() {
    let redis = RedisServer::start_with(&["--enable-debug-command", "yes"]);
    let url = redis.url();
    let app = Arc::new(app(
        &url,
        Duration::from_millis(500),
        Duration::from_secs(3),
    ));
    assert_eq!(app.post("warm", "{}").await.status, 201);
    let runs = app.runs();
    let first = {
        let app = Arc::clone(&app);
        tokio::spawn(async move {
            app.send(
                Request::post("/pay")
                    .key("stall")
                    .header("x-sleep-ms", "300")
                    .json("{}"),
            )
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let sleeper = {
        let url = url.clone();
        tokio::spawn(async move {
            let mut c = conn(&url).await;
            let _: Result<(), _> = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg("1.5")
                .query_async(&mut c)
                .await;
        })
    };
    let first = first.await.expect("join");
    assert_eq!(first.status, 201, "{}", first.describe());
    sleeper.await.expect("join");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = app.post("stall", "{}").await;
    assert!(after.is_replay(), "{}", after.describe());
    assert_eq!(after.body, first.body);
    assert_eq!(app.runs(), runs + 1, "the handler ran twice");
}

// ---------------------------------------------------------------------------------------------
// (5) Restarts.

/// With `appendonly yes` + `appendfsync always`, a SIGKILL and restart keep a completed record
/// (a retry replays byte-exact, same expiry) and a live reservation (409, not a second run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fsynced_aof_keeps_records_across_a_kill() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let done = scope("t", "done");
    let raw = completed(&store, &url, &done, b"\x00binary\xff").await;
    let running = scope("t", "running");
    assert!(matches!(
        store.reserve(&running, &FP, LEASE).await,
        Ok(ReserveOutcome::Reserved { .. })
    ));
    redis.restart();
    let store = RedisStore::connect(&url).await.expect("reconnect");
    assert_eq!(
        get_raw(&url, &store.key_of(&done)).await.as_deref(),
        Some(&raw[..])
    );
    match store.reserve(&done, &FP, LEASE).await {
        Ok(ReserveOutcome::Completed { response: r, .. }) => {
            assert_eq!(&r.body[..], b"\x00binary\xff")
        }
        other => panic!("after the restart: {other:?}"),
    }
    assert!(
        matches!(
            store.reserve(&running, &FP, LEASE).await,
            Ok(ReserveOutcome::InFlight { .. })
        ),
        "the reservation survived"
    );
}

/// Without persistence (the helper's default), a restart forgets every record: documented in
/// docs/redis.md ("No persistence ... a restart forgets everything"); held here so the doc
/// stays true.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_persistence_a_restart_forgets_records_as_documented() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let s = scope("t", "gone");
    completed(&store, &url, &s, b"x").await;
    redis.restart();
    let store = RedisStore::connect(&url).await.expect("reconnect");
    assert!(matches!(
        store.reserve(&s, &FP, LEASE).await,
        Ok(ReserveOutcome::Reserved { .. })
    ));
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/redis.md"),
    )
    .expect("docs/redis.md");
    assert!(doc.contains("a restart forgets everything"));
}

// ---------------------------------------------------------------------------------------------
// (6) Prefixes.

/// idem-cli refuses every prefix the store refuses, with exit 2, before connecting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_refuses_unsafe_prefixes() {
    let redis = RedisServer::start();
    for prefix in [
        "", "idem", "a*:", "a?:", "[a]:", "a\\:", "{a}:", "a b:", "idem:x",
    ] {
        for args in [
            &["stats"][..],
            &["release", "k", "--force"][..],
            &["list"][..],
        ] {
            let mut all = vec!["--redis-prefix", prefix];
            all.extend_from_slice(args);
            let o = idem(&redis.url(), &all).await;
            assert_eq!(
                o.status.code(),
                Some(2),
                "prefix {prefix:?} {args:?}: {}",
                describe(&o)
            );
            assert!(err(&o).contains("prefix"), "{}", describe(&o));
        }
    }
}

/// Stores at `idem:`, `idem:x:` and `idem2:` in one database, plus another app's plain keys
/// shaped like record keys (`idem:session:a:b:k`) and a key equal to a prefix. idem-cli with
/// each prefix counts, lists and releases exactly that store's records: `release --force k`
/// under `idem:` removes the outer store's `x`/`k` only, never `idem:x:`'s `t`/`k`, the other
/// app's `idem:session:a:b:k`, or `idem2:`'s. Without `--tenant` it refuses: the other app's
/// key is a match it cannot read (review, 2026-12-06: an unreadable match was ignored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_cli_keeps_to_its_own_prefix() {
    let redis = RedisServer::start();
    let url = redis.url();
    let connect = |prefix: &'static str| {
        let url = url.clone();
        async move {
            RedisStore::builder()
                .key_prefix(prefix)
                .connect(&url)
                .await
                .expect("connect")
        }
    };
    let outer = connect("idem:").await;
    let inner = connect("idem:x:").await;
    let sibling = connect("idem2:").await;
    completed(&outer, &url, &scope("x", "k"), b"outer").await;
    completed(&inner, &url, &scope("t", "k"), b"inner").await;
    completed(&sibling, &url, &scope("t", "k"), b"sibling").await;
    completed(&sibling, &url, &scope("t", "k2"), b"sibling").await;
    set_raw(&url, "idem:session:a:b:k", b"Cother app's data").await;
    set_raw(&url, "idem:", b"a key equal to the prefix").await;
    set_raw(&url, "idem:x:t:POST:/payments", b"short").await;

    for (prefix, want) in [("idem:", 1), ("idem:x:", 1), ("idem2:", 2)] {
        let o = idem(
            &url,
            &["--redis-prefix", prefix, "--format", "json", "stats"],
        )
        .await;
        assert_eq!(
            stats_total(&o),
            want,
            "stats under {prefix}: {}",
            describe(&o)
        );
        let l = idem(
            &url,
            &["--redis-prefix", prefix, "--format", "json", "list"],
        )
        .await;
        assert_eq!(
            out(&l).lines().count(),
            want as usize,
            "list under {prefix}: {}",
            describe(&l)
        );
    }
    // show k under idem: finds one record, the outer's.
    let show = idem(
        &url,
        &["--redis-prefix", "idem:", "--format", "json", "show", "k"],
    )
    .await;
    assert_eq!(show.status.code(), Some(0), "{}", describe(&show));
    assert_eq!(out(&show).lines().count(), 1, "{}", describe(&show));
    assert!(out(&show).contains("\"x\""), "{}", describe(&show));

    let unscoped = idem(
        &url,
        &["--redis-prefix", "idem:", "release", "k", "--force"],
    )
    .await;
    assert_eq!(unscoped.status.code(), Some(6), "{}", describe(&unscoped));
    assert!(
        err(&unscoped).contains("matches 2 records"),
        "{}",
        describe(&unscoped)
    );
    let before = all_keys(&url).await;
    let rel = idem(
        &url,
        &[
            "--redis-prefix",
            "idem:",
            "release",
            "k",
            "--force",
            "--tenant",
            "x",
        ],
    )
    .await;
    assert_eq!(rel.status.code(), Some(0), "{}", describe(&rel));
    let after = all_keys(&url).await;
    let removed: Vec<&String> = before.iter().filter(|k| !after.contains(k)).collect();
    assert_eq!(
        removed,
        vec![&outer.key_of(&scope("x", "k"))],
        "release removed {removed:?}"
    );
    // Nothing left under idem: itself: release of the other app's key shape is refused.
    let rel = idem(
        &url,
        &["--redis-prefix", "idem:", "release", "k", "--force"],
    )
    .await;
    assert_eq!(rel.status.code(), Some(6), "{}", describe(&rel));
    assert!(exists(&url, "idem:session:a:b:k").await);
    assert!(exists(&url, &inner.key_of(&scope("t", "k"))).await);
    assert!(exists(&url, &sibling.key_of(&scope("t", "k"))).await);
}

// ---------------------------------------------------------------------------------------------
// (7) A non-zero database.

/// A store on `/3` writes to database 3 only; idem-cli with `/3` sees its record and with `/0`
/// (or no database) sees none; release on `/0` cannot remove it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_in_the_url_is_the_one_store_and_idem_cli_use() {
    let redis = RedisServer::start();
    let db3 = format!("redis://127.0.0.1:{}/3", redis.port());
    let store = RedisStore::connect(&db3).await.expect("connect /3");
    let s = scope("t", "db3");
    completed(&store, &db3, &s, b"three").await;
    let ReserveOutcome::Reserved { .. } = store
        .reserve(&scope("t", "db3-inflight"), &FP, LEASE)
        .await
        .unwrap()
    else {
        panic!()
    };
    assert!(all_keys(&redis.url()).await.is_empty(), "db 0 holds keys");
    assert_eq!(all_keys(&db3).await.len(), 2);
    let o = idem(&db3, &["--format", "json", "stats"]).await;
    assert_eq!(stats_total(&o), 2, "{}", describe(&o));
    let o = idem(&redis.url(), &["--format", "json", "stats"]).await;
    assert_eq!(stats_total(&o), 0, "{}", describe(&o));
    let show = idem(&db3, &["--format", "json", "show", "db3"]).await;
    assert_eq!(show.status.code(), Some(0), "{}", describe(&show));
    let rel = idem(&redis.url(), &["release", "db3-inflight", "--force"]).await;
    assert_eq!(rel.status.code(), Some(6), "{}", describe(&rel));
    let rel = idem(&db3, &["release", "db3-inflight", "--force"]).await;
    assert_eq!(rel.status.code(), Some(0), "{}", describe(&rel));
    assert_eq!(all_keys(&db3).await.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// (8) A 1 MiB binary body.

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c) << (18 - 6 * i);
        }
        out.push((n >> 16) as u8);
        if chunk.len() > 2 {
            out.push((n >> 8) as u8);
        }
        if chunk.len() > 3 {
            out.push(n as u8);
        }
    }
    out
}

/// A 1 MiB binary response (exactly the default `max_response_bytes`): stored, replayed
/// byte-exact over HTTP, and `idem-cli show --format json` gives the same bytes in
/// `body_base64` (and `body_bytes` 1 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_binary_body_is_byte_exact_in_replay_and_idem_cli_show() {
    let redis = RedisServer::start();
    let url = redis.url();
    let app = app(&url, Duration::from_secs(2), LEASE);
    let want = big_body();
    let first = app
        .send(Request::post("/big").key("big-1").json("{}"))
        .await;
    assert_eq!(first.status, 200, "{}", first.describe());
    assert!(first.body == want, "first body differs");
    let replay = app
        .send(Request::post("/big").key("big-1").json("{}"))
        .await;
    assert!(replay.is_replay(), "{}", replay.describe());
    assert!(
        replay.body == want,
        "replayed body differs ({} bytes)",
        replay.body.len()
    );
    assert_eq!(app.runs(), 1);
    let show = idem(&url, &["--format", "json", "show", "big-1"]).await;
    assert_eq!(show.status.code(), Some(0), "{}", describe(&show));
    let v: serde_json::Value = serde_json::from_str(out(&show).trim()).expect("JSON");
    let response = &v["response"];
    assert_eq!(
        response["body_bytes"].as_u64(),
        Some(MIB as u64),
        "{response:.200}"
    );
    let body = base64_decode(response["body_base64"].as_str().expect("body_base64"));
    assert!(
        body == want,
        "idem-cli show's body differs ({} bytes)",
        body.len()
    );
    // Text show does not dump a megabyte of binary onto a terminal.
    let text = idem(&url, &["show", "big-1"]).await;
    assert_eq!(text.status.code(), Some(0), "{}", describe(&text));
    assert!(
        text.stdout.len() < 64 * 1024,
        "text show printed {} bytes",
        text.stdout.len()
    );
}

#[allow(dead_code)]
fn _unused(_: StoreError) {}
