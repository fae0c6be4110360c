//! Review R2 (fleet, caches and the operator): several in-process instances on one PostgreSQL
//! database (or one Redis), some with `CachedStore` in front, and `idem-cli` run as a process
//! between their requests. Each test checks that the instances and the operator's tool agree
//! where `docs/contract.md`, `docs/operations.md` and the `CachedStore` rustdoc say they do.

use std::future::Future;
use std::pin::Pin;
use std::process::Output;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::redis::RedisStore;
use idempotency_actix::store::{CachedStore, IdempotencyStore};
use idempotency_actix::Idempotency;
use idempotency_e2e::proc::run_idem_cli;
use idempotency_e2e::raw_http::{Conn, Request, Response};
use idempotency_e2e::redis_server::RedisServer;
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::{block_on_fresh_thread, TestDb};

const TIMEOUT: Duration = Duration::from_secs(30);
const TENANT_HEADER: &str = "x-account-id";

type Make<S> = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = Idempotency<S>>>> + Send>;

/// The handler-run counter shared by every instance of one test (a fleet-wide count).
#[derive(Clone, Default)]
struct Fleet {
    runs: Arc<AtomicU64>,
}

impl Fleet {
    fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }
}

struct Ctx {
    runs: Arc<AtomicU64>,
    name: &'static str,
}

async fn pay(ctx: web::Data<Ctx>, req: HttpRequest, body: Bytes) -> HttpResponse {
    let run = ctx.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let tenant = req
        .headers()
        .get(TENANT_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    HttpResponse::Created()
        .content_type("application/json")
        .body(
            serde_json::json!({
                "run": run,
                "instance": ctx.name,
                "tenant": tenant,
                "body": String::from_utf8_lossy(&body),
            })
            .to_string(),
        )
}

/// Sleeps `?ms=` then answers with `?status=` (default 201).
async fn slow(ctx: web::Data<Ctx>, req: HttpRequest, body: Bytes) -> HttpResponse {
    let run = ctx.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let q: std::collections::HashMap<String, String> =
        web::Query::<std::collections::HashMap<String, String>>::from_query(req.query_string())
            .map(|q| q.into_inner())
            .unwrap_or_default();
    let ms: u64 = q.get("ms").and_then(|v| v.parse().ok()).unwrap_or(0);
    let status: u16 = q.get("status").and_then(|v| v.parse().ok()).unwrap_or(201);
    actix_web::rt::time::sleep(Duration::from_millis(ms)).await;
    HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap())
        .content_type("application/json")
        .body(
            serde_json::json!({
                "run": run,
                "instance": ctx.name,
                "body": String::from_utf8_lossy(&body),
            })
            .to_string(),
        )
}

fn instance<S>(fleet: &Fleet, name: &'static str, make: Make<S>) -> ThreadServer
where
    S: IdempotencyStore + Send + Sync + 'static,
{
    let runs = Arc::clone(&fleet.runs);
    ThreadServer::start(move || async move {
        let middleware = make().await;
        let ctx = web::Data::new(Ctx { runs, name });
        let server = HttpServer::new(move || {
            App::new()
                .app_data(ctx.clone())
                .wrap(middleware.clone())
                .route("/pay/{id}", web::post().to(pay))
                .route("/slow", web::post().to(slow))
        })
        .workers(2)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    })
}

/// Boxes the async `make` as a [`Make`].
fn boxed<S, F>(make: impl FnOnce() -> F + Send + 'static) -> Make<S>
where
    F: Future<Output = Idempotency<S>> + 'static,
{
    Box::new(move || Box::pin(make()))
}

/// The middleware over `store`: the fleet's tenant header, records of `ttl`, a 3 s lock timeout.
fn middleware<S: IdempotencyStore>(store: S, ttl: Duration) -> Idempotency<S> {
    Idempotency::builder(store)
        .tenant_header(TENANT_HEADER)
        .ttl(ttl)
        .lock_timeout(Duration::from_secs(3))
        .build()
}

fn plain_pg(url: &str, ttl: Duration) -> Make<PostgresStore> {
    let url = url.to_owned();
    boxed(move || async move {
        let store = PostgresStore::connect(&url).await.expect("store");
        middleware(store, ttl)
    })
}

fn transactional_pg(url: &str) -> Make<PostgresStore> {
    let url = url.to_owned();
    boxed(move || async move {
        let store = PostgresStore::connect(&url).await.expect("store");
        Idempotency::builder(store)
            .tenant_header(TENANT_HEADER)
            .lock_timeout(Duration::from_secs(3))
            .transactional()
            .build()
    })
}

fn cached_pg(url: &str, ttl: Duration, max_ttl: Duration) -> Make<CachedStore<PostgresStore>> {
    let url = url.to_owned();
    boxed(move || async move {
        let store = PostgresStore::connect(&url).await.expect("store");
        middleware(CachedStore::builder(store).max_ttl(max_ttl).build(), ttl)
    })
}

fn cached_redis(url: &str, ttl: Duration, max_ttl: Duration) -> Make<CachedStore<RedisStore>> {
    let url = url.to_owned();
    boxed(move || async move {
        let store = RedisStore::connect(&url).await.expect("store");
        middleware(CachedStore::builder(store).max_ttl(max_ttl).build(), ttl)
    })
}

fn new_db() -> TestDb {
    block_on_fresh_thread(TestDb::new()).expect("test database")
}

fn send(server: &ThreadServer, request: &Request) -> Response {
    let mut c = Conn::connect(server.addr, TIMEOUT).expect("connect");
    c.send(request).expect("response (hang detection: 30 s)")
}

fn req(tenant: &str, key: &str, body: &str) -> Request {
    Request::post("/pay/1")
        .header(TENANT_HEADER, tenant)
        .key(key)
        .json(body)
}

fn run_of(r: &Response) -> u64 {
    r.json()["run"].as_u64().unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// idem-cli as a process (`proc::run_idem_cli`)

fn cli(url: &str, args: &[&str]) -> Output {
    run_idem_cli("DATABASE_URL", url, args)
}

fn out_text(o: &Output) -> String {
    format!(
        "exit={:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts idem-cli's exit code `code`; `what` names the case.
fn assert_exit(o: &Output, code: i32, what: &str) {
    assert_eq!(o.status.code(), Some(code), "{what}: {}", out_text(o));
}

/// Runs idem-cli with `args` against the database at `url` and asserts exit 0.
fn cli_ok(url: &str, args: &[&str]) -> Output {
    let o = cli(url, args);
    assert_exit(&o, 0, &format!("idem-cli {args:?}"));
    o
}

/// Runs `idem-cli release KEY --tenant TENANT --force` against the store at `url` (`var` names
/// its environment variable) and asserts exit 0.
fn force_release(var: &str, url: &str, tenant: &str, key: &str) {
    let o = run_idem_cli(var, url, &["release", key, "--tenant", tenant, "--force"]);
    assert_exit(&o, 0, &format!("release {key} --tenant {tenant} --force"));
}

// ---------------------------------------------------------------------------------------------
// Instances and answers

/// Starts caching instance `name` on the table at `url`: records of `ttl`, entries up to `max_ttl`.
fn caching_pg(
    fleet: &Fleet,
    name: &'static str,
    url: &str,
    ttl: Duration,
    max_ttl: Duration,
) -> ThreadServer {
    instance(fleet, name, cached_pg(url, ttl, max_ttl))
}

/// Starts uncached A, then caching B and C (entries up to `max_ttl_b` / `max_ttl_c`), on the
/// table at `url`, all with records of `ttl`.
fn uncached_a_caching_b_c(
    fleet: &Fleet,
    url: &str,
    ttl: Duration,
    max_ttl_b: Duration,
    max_ttl_c: Duration,
) -> [ThreadServer; 3] {
    [
        instance(fleet, "A", plain_pg(url, ttl)),
        caching_pg(fleet, "B", url, ttl, max_ttl_b),
        caching_pg(fleet, "C", url, ttl, max_ttl_c),
    ]
}

/// Asserts `r` is a 201 that ran the handler (not a replay); `what` names the case.
fn assert_run(r: &Response, what: &str) {
    assert_eq!(r.status, 201, "{what}: {}", r.describe());
    assert!(!r.is_replay(), "{what}: replayed: {}", r.describe());
}

/// Asserts `r` is a replay; `what` names the case.
fn assert_replay(r: &Response, what: &str) {
    assert!(r.is_replay(), "{what}: not a replay: {}", r.describe());
}

/// Asserts `r` is a replay of `original`'s body; `what` names the case.
fn assert_replay_of(r: &Response, original: &Response, what: &str) {
    assert!(
        r.is_replay() && r.body == original.body,
        "{what}: expected the replay of {}, got {}",
        original.describe(),
        r.describe()
    );
}

/// Asserts `r` is the problem answer `code`; `what` names the case.
fn assert_problem(r: &Response, code: &str, what: &str) {
    assert_eq!(
        r.problem_code().as_deref(),
        Some(code),
        "{what}: {}",
        r.describe()
    );
}

/// Sends `request` to `first` (asserting a 201), then to each of the named `replaying`
/// instances in turn (asserting a replay); `first`'s answer.
fn run_then_replay(
    first: &ThreadServer,
    replaying: &[(&str, &ThreadServer)],
    request: &Request,
    what: &str,
) -> Response {
    let r = send(first, request);
    assert_eq!(r.status, 201, "{what}, first send: {}", r.describe());
    for (name, srv) in replaying {
        assert_replay(&send(srv, request), &format!("{what} on {name}"));
    }
    r
}

// ---------------------------------------------------------------------------------------------
// 1. release --force of a completed key, then the key reused with another body.

/// operations.md: "A new request with the reused key (another body) is not affected: an
/// instance asks the store whenever its cached record has another fingerprint." Two caching
/// instances both hold the old record; the new body runs exactly once fleet-wide, and from then
/// on every instance answers the new body with its replay and the old body with 422 (C7).
/// `release` is given the key to release.
fn forced_release_then_new_body(
    fleet: &Fleet,
    [a, b, c]: [&ThreadServer; 3],
    release: impl FnOnce(&str),
) {
    let key = "force-new-body";
    let old = req("acme", key, r#"{"amount":100}"#);
    let new = req("acme", key, r#"{"amount":999}"#);
    let first = send(a, &old);
    assert_eq!(first.status, 201, "{}", first.describe());
    for (name, srv) in [("B", b), ("C", c), ("B", b), ("C", c)] {
        let what = format!("old body on {name} before release");
        assert_replay_of(&send(srv, &old), &first, &what);
    }
    release(key);
    let runs_before = fleet.runs();
    let on_b = send(b, &new);
    assert_run(&on_b, "new body on caching B");
    assert!(
        on_b.text().contains("999"),
        "new body on B answered with another request's response: {}",
        on_b.describe()
    );
    for (name, srv) in [("C", c), ("A", a), ("B", b), ("C", c)] {
        assert_replay_of(&send(srv, &new), &on_b, &format!("new body on {name}"));
    }
    assert_eq!(
        fleet.runs(),
        runs_before + 1,
        "the new body ran more than once"
    );
    // The old request: C7, the key now holds another request's record. A caching instance
    // whose entry is the old record would replay the old response instead (documented for
    // retries of the old request until max_ttl: checked in `forced_release_old_body_...`).
    assert_problem(
        &send(a, &old),
        "FINGERPRINT_MISMATCH",
        "old body on uncached A after the new request completed",
    );
}

#[test]
fn forced_release_of_completed_then_new_body_on_caching_instances_postgres() {
    let db = new_db();
    let fleet = Fleet::default();
    let long = Duration::from_secs(60);
    let [a, b, c] = uncached_a_caching_b_c(&fleet, &db.url, Duration::from_secs(3600), long, long);
    forced_release_then_new_body(&fleet, [&a, &b, &c], |key| {
        let o = cli(&db.url, &["release", key, "--tenant", "acme"]);
        assert_exit(&o, 6, "release of completed without --force");
        force_release("DATABASE_URL", &db.url, "acme", key);
    });
}

#[test]
fn forced_release_of_completed_then_new_body_on_caching_instances_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(3600);
    let long = Duration::from_secs(60);
    let [a, b, c] = [("A", Duration::from_millis(1)), ("B", long), ("C", long)]
        .map(|(name, max_ttl)| instance(&fleet, name, cached_redis(&url, ttl, max_ttl)));
    forced_release_then_new_body(&fleet, [&a, &b, &c], |key| {
        force_release("REDIS_URL", &url, "acme", key);
    });
}

/// The cached.rs bound: after a forced release of a completed record, a caching instance
/// replays the old response to the old request for at most `max_ttl`; after that the old
/// request runs again, once fleet-wide, and every instance whose entry ended replays the new run.
#[test]
fn forced_release_old_body_runs_again_after_max_ttl_postgres() {
    let db = new_db();
    let fleet = Fleet::default();
    let max_ttl = Duration::from_secs(2);
    let [a, b, c] =
        uncached_a_caching_b_c(&fleet, &db.url, Duration::from_secs(3600), max_ttl, max_ttl);
    let key = "force-same-body";
    let old = req("acme", key, r#"{"amount":5}"#);
    run_then_replay(&a, &[("B", &b), ("C", &c)], &old, "old body");
    force_release("DATABASE_URL", &db.url, "acme", key);
    std::thread::sleep(max_ttl + Duration::from_millis(700));
    let again = send(&b, &old);
    assert_run(
        &again,
        &format!("B, a released record after max_ttl ({max_ttl:?})"),
    );
    assert_eq!(run_of(&again), 2);
    for (name, srv) in [("A", &a), ("C", &c), ("B", &b)] {
        assert_replay_of(
            &send(srv, &old),
            &again,
            &format!("{name} after the re-run"),
        );
    }
    assert_eq!(fleet.runs(), 2);
    let o = cli_ok(
        &db.url,
        &["show", key, "--tenant", "acme", "--format", "json"],
    );
    assert!(
        stdout(&o).contains(r#"\"run\":2"#) || stdout(&o).contains(r#""run":2"#),
        "show does not hold the re-run's response: {}",
        out_text(&o)
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Expiry across instances (C12), and purge.

/// C12: "An expired record is treated as absent: its key starts a new request." The record is
/// written by A with a 1 s TTL and replayed from B's and C's caches (max_ttl 60 s); once it has
/// expired, the key reused with another body on B runs (not 422, not the old replay), and C,
/// whose cache held the old record, answers the old body with 422 and the new one with B's run.
#[test]
fn expired_record_reused_with_another_body_across_caching_instances() {
    let db = new_db();
    let fleet = Fleet::default();
    let long = Duration::from_secs(60);
    let [a, b, c] = uncached_a_caching_b_c(&fleet, &db.url, Duration::from_secs(1), long, long);
    let key = "expiry-reuse";
    let old = req("acme", key, r#"{"amount":1}"#);
    let new = req("acme", key, r#"{"amount":2}"#);
    let replaying = [("B", &b), ("C", &c), ("B", &b), ("C", &c)];
    run_then_replay(&a, &replaying, &old, "old body");
    std::thread::sleep(Duration::from_millis(1500));
    let on_b = send(&b, &new);
    assert_run(&on_b, "new body on B after expiry");
    assert!(on_b.text().contains(r#"amount\":2"#), "{}", on_b.describe());
    assert_problem(
        &send(&c, &old),
        "FINGERPRINT_MISMATCH",
        "old body on C after the key was reused",
    );
    assert_replay_of(&send(&c, &new), &on_b, "new body on C");
    assert_eq!(fleet.runs(), 2);
}

/// Purge after expiry, then the same request sent to three instances at once: it runs exactly
/// once fleet-wide (C5), and the CLI's counts say what the instances do (C19/C20).
#[test]
fn purge_after_expiry_then_retry_at_once_on_three_instances_runs_once() {
    let db = new_db();
    let fleet = Fleet::default();
    let long = Duration::from_secs(60);
    let [a, b, c] =
        uncached_a_caching_b_c(&fleet, &db.url, Duration::from_secs(1), long, long).map(Arc::new);
    let keys: Vec<String> = (0..5).map(|i| format!("purge-{i}")).collect();
    for key in &keys {
        run_then_replay(&a, &[("B", &b), ("C", &c)], &req("acme", key, "{}"), key);
    }
    assert_eq!(fleet.runs(), 5);
    std::thread::sleep(Duration::from_millis(1500));
    let o = cli_ok(&db.url, &["list", "--state", "expired", "--format", "json"]);
    assert_eq!(
        stdout(&o).lines().count(),
        5,
        "list --state expired: {}",
        out_text(&o)
    );
    let o = cli_ok(&db.url, &["purge"]);
    // The rotated layout's purge rotates instead of deleting rows, at most once per period (2
    // days here): nothing is due, and the expired records are taken over in place below.
    let purged = match idempotency_e2e::database::test_layout() {
        Some(idempotency_actix::store::postgres::Layout::Rotated { .. }) => "no rotation due",
        _ => "purged 5 records",
    };
    assert!(stdout(&o).contains(purged), "{}", out_text(&o));
    let mut handles = Vec::new();
    for key in &keys {
        for srv in [&a, &b, &c] {
            handles.push(send_in_background(srv, &req("acme", key, "{}")));
        }
    }
    let answers: Vec<Response> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for r in &answers {
        assert!(
            r.status == 201 || r.status == 409,
            "after purge: {}",
            r.describe()
        );
    }
    assert_eq!(
        fleet.runs(),
        10,
        "after purge each key must run exactly once more; answers: {:?}",
        answers.iter().map(Response::describe).collect::<Vec<_>>()
    );
    for key in &keys {
        let r = send(&c, &req("acme", key, "{}"));
        assert!(
            r.is_replay() && run_of(&r) > 5,
            "{key} on C: {}",
            r.describe()
        );
    }
    // The CLI counts what the instances did: the purged records gone, one completed record
    // per key from the runs after the purge (live or past their 1 s TTL by now), none held.
    let o = cli_ok(&db.url, &["stats", "--format", "json"]);
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("stats json");
    assert_eq!(stats["total"], 5, "{stats}");
    assert_eq!(stats["completed"], 5, "{stats}");
    assert_eq!(stats["in_flight"], 0, "{stats}");
}

// ---------------------------------------------------------------------------------------------
// 3. Tenants (C3) across caching instances, and a forced release scoped to one tenant.

#[test]
fn two_tenants_same_key_across_caching_instances_and_a_scoped_forced_release() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(3600);
    let long = Duration::from_secs(60);
    let a = caching_pg(&fleet, "A", &db.url, ttl, long);
    let b = caching_pg(&fleet, "B", &db.url, ttl, long);
    let key = "shared-key";
    let body = r#"{"amount":7}"#;
    let x = send(&a, &req("tenant-x", key, body));
    let y = send(&b, &req("tenant-y", key, body));
    assert_eq!(x.status, 201);
    assert_run(&y, "tenant-y after tenant-x took the same key");
    for _ in 0..2 {
        for (name, srv) in [("A", &a), ("B", &b)] {
            let rx = send(srv, &req("tenant-x", key, body));
            let ry = send(srv, &req("tenant-y", key, body));
            assert_replay_of(&rx, &x, &format!("tenant-x on {name}"));
            assert_replay_of(&ry, &y, &format!("tenant-y on {name}"));
        }
    }
    // Without --tenant the key is ambiguous: refused.
    let o = cli(&db.url, &["release", key, "--force"]);
    assert_exit(&o, 6, "release of a key two tenants hold, without --tenant");
    force_release("DATABASE_URL", &db.url, "tenant-x", key);
    // tenant-y still replayed everywhere; tenant-x with a new body runs on B.
    let x2 = send(&b, &req("tenant-x", key, r#"{"amount":8}"#));
    assert_run(&x2, "tenant-x, new body on B after the release");
    assert_eq!(x2.json()["tenant"], "tenant-x");
    for (name, srv) in [("A", &a), ("B", &b)] {
        let ry = send(srv, &req("tenant-y", key, body));
        assert_replay_of(&ry, &y, &format!("tenant-y on {name} after the release"));
        let rx = send(srv, &req("tenant-x", key, r#"{"amount":8}"#));
        assert_replay_of(&rx, &x2, &format!("tenant-x on {name} after its re-run"));
    }
    assert_eq!(fleet.runs(), 3);
}

// ---------------------------------------------------------------------------------------------
// 4. A transactional instance and a caching default-mode instance on one table (C25).

/// Instance T in transactional mode and instance B, default mode with a cache (entries up to
/// 60 s, records of an hour), on one table.
fn transactional_and_caching(fleet: &Fleet, url: &str) -> (Arc<ThreadServer>, ThreadServer) {
    let t = Arc::new(instance(fleet, "T", transactional_pg(url)));
    let b = caching_pg(
        fleet,
        "B",
        url,
        Duration::from_secs(3600),
        Duration::from_secs(60),
    );
    (t, b)
}

/// A keyed POST of tenant `acme` to `target`.
fn acme(target: &str, key: &str, body: &str) -> Request {
    Request::post(target)
        .header(TENANT_HEADER, "acme")
        .key(key)
        .json(body)
}

/// `send` on a thread of its own: the answer when joined.
fn send_in_background(
    server: &Arc<ThreadServer>,
    request: &Request,
) -> std::thread::JoinHandle<Response> {
    let (server, request) = (Arc::clone(server), request.clone());
    std::thread::spawn(move || send(&server, &request))
}

/// Sends `first` to T in the background, and 500 ms later (T's handler still running) `second`
/// to B: T's answer to join, and B's answer.
fn send_during(
    t: &Arc<ThreadServer>,
    first: &Request,
    b: &ThreadServer,
    second: &Request,
) -> (std::thread::JoinHandle<Response>, Response) {
    let first = send_in_background(t, first);
    std::thread::sleep(Duration::from_millis(500));
    (first, send(b, second))
}

/// T's handler is slow and answers 500: its transaction rolls back. Meanwhile the same key on
/// caching B gets 409 (never a hang, never a replay); after the rollback B runs it, once.
#[test]
fn transactional_rollback_leaves_nothing_a_caching_instance_replays() {
    let db = new_db();
    let fleet = Fleet::default();
    let (t, b) = transactional_and_caching(&fleet, &db.url);
    let key = "tx-rollback";
    let failing = acme("/slow?ms=1500&status=500", key, "{}");
    let (first, during) = send_during(&t, &failing, &b, &failing);
    assert_problem(&during, "CONFLICT", "B during T's open transaction");
    let first = first.join().unwrap();
    assert_eq!(first.status, 500, "{}", first.describe());
    let o = cli(&db.url, &["show", key, "--tenant", "acme"]);
    assert_exit(&o, 6, "record left after rollback");
    let ok = acme("/slow?ms=0&status=201", key, "{}");
    // Another target (query) is another fingerprint but the same scope: it must run, the
    // rolled-back request left nothing.
    let after = send(&b, &ok);
    assert_run(&after, "B after the rollback");
    assert_replay_of(&send(&t, &ok), &after, "T after B's run");
    assert_replay_of(&send(&b, &ok), &after, "B after its run");
    assert_eq!(fleet.runs(), 2);
}

/// T commits a 201 while caching B is asked the same key with another body: 409 during the
/// open transaction (documented), 422 after the commit; the same body on B replays T's response.
#[test]
fn transactional_commit_then_caching_instance_agrees() {
    let db = new_db();
    let fleet = Fleet::default();
    let (t, b) = transactional_and_caching(&fleet, &db.url);
    let key = "tx-commit";
    let good = acme("/slow?ms=1500", key, r#"{"a":1}"#);
    let other = acme("/slow?ms=1500", key, r#"{"a":2}"#);
    let (first, during) = send_during(&t, &good, &b, &other);
    assert_eq!(during.status, 409, "{}", during.describe());
    let first = first.join().unwrap();
    assert_eq!(first.status, 201, "{}", first.describe());
    for _ in 0..2 {
        assert_replay_of(&send(&b, &good), &first, "same body on B after T's commit");
        assert_problem(
            &send(&b, &other),
            "FINGERPRINT_MISMATCH",
            "another body on B after T's commit",
        );
    }
    assert_eq!(fleet.runs(), 1);
}

// ---------------------------------------------------------------------------------------------
// 5. The partitioned layout: a forced release of a completed record (claim and response in two
// tables), then the key run again, with the same body and with another, across instances.

#[test]
fn forced_release_then_rerun_on_the_partitioned_layout() {
    use idempotency_actix::store::postgres::PartitionInterval;
    let db = block_on_fresh_thread(TestDb::new_partitioned(PartitionInterval::Daily))
        .expect("test database");
    let fleet = Fleet::default();
    let [a, b, c] = uncached_a_caching_b_c(
        &fleet,
        &db.url,
        Duration::from_secs(3600),
        Duration::from_millis(500),
        Duration::from_secs(60),
    );
    forced_release_then_new_body(&fleet, [&a, &b, &c], |key| {
        force_release("DATABASE_URL", &db.url, "acme", key);
    });
    // The same body run again after a forced release (on uncached A, then B after its entry).
    let key = "force-same-part";
    let r1 = req("acme", key, r#"{"amount":3}"#);
    run_then_replay(&a, &[("B", &b)], &r1, "before the release");
    force_release("DATABASE_URL", &db.url, "acme", key);
    let runs = fleet.runs();
    let again = send(&a, &r1);
    assert_run(&again, "A after the release on the partitioned layout");
    assert_eq!(fleet.runs(), runs + 1);
    std::thread::sleep(Duration::from_millis(700));
    for (name, srv) in [("A", &a), ("B", &b)] {
        let what = format!("{name} after the re-run on the partitioned layout");
        assert_replay_of(&send(srv, &r1), &again, &what);
    }
    let o = cli_ok(
        &db.url,
        &["show", key, "--tenant", "acme", "--format", "json"],
    );
    assert_eq!(stdout(&o).lines().count(), 1, "{}", out_text(&o));
    cli_ok(&db.url, &["purge"]);
    assert_replay(&send(&c, &r1), "C after purge");
}

/// C19/C20: after the TTL, `stats`, `list --state expired` and the instances agree: the
/// records are counted as expired, no instance replays them (each runs again, once), and a
/// release without --force of such an expired completed record is refused as expired.
#[test]
fn expired_records_cli_counts_agree_with_the_instances() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(1);
    let a = instance(&fleet, "A", plain_pg(&db.url, ttl));
    let b = caching_pg(&fleet, "B", &db.url, ttl, Duration::from_secs(60));
    for i in 0..3 {
        let key = format!("exp-{i}");
        run_then_replay(&a, &[("B", &b)], &req("acme", &key, "{}"), &key);
    }
    std::thread::sleep(Duration::from_millis(1500));
    let o = cli_ok(&db.url, &["stats", "--format", "json"]);
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("stats json");
    eprintln!("stats: {stats}");
    assert_eq!(stats["expired_not_purged"], 3, "{stats}");
    let o = cli_ok(
        &db.url,
        &["list", "--state", "completed", "--format", "json"],
    );
    assert_eq!(
        stdout(&o).lines().count(),
        0,
        "expired listed as completed: {}",
        out_text(&o)
    );
    // Refused (exit 6), saying the record is expired: it runs again either way.
    let o = cli(&db.url, &["release", "exp-0", "--tenant", "acme"]);
    assert_exit(
        &o,
        6,
        "release of an expired completed record without --force",
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("expired"),
        "{}",
        out_text(&o)
    );
    for i in 0..3 {
        let r = send(&b, &req("acme", &format!("exp-{i}"), "{}"));
        assert_run(&r, &format!("exp-{i} on B after expiry"));
    }
    assert_eq!(fleet.runs(), 6);
}
