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

fn plain_pg(url: &str, ttl: Duration) -> Make<PostgresStore> {
    let url = url.to_owned();
    Box::new(move || {
        Box::pin(async move {
            let store = PostgresStore::connect(&url).await.expect("store");
            Idempotency::builder(store)
                .tenant_header(TENANT_HEADER)
                .ttl(ttl)
                .lock_timeout(Duration::from_secs(3))
                .build()
        })
    })
}

fn transactional_pg(url: &str) -> Make<PostgresStore> {
    let url = url.to_owned();
    Box::new(move || {
        Box::pin(async move {
            let store = PostgresStore::connect(&url).await.expect("store");
            Idempotency::builder(store)
                .tenant_header(TENANT_HEADER)
                .lock_timeout(Duration::from_secs(3))
                .transactional()
                .build()
        })
    })
}

fn cached_pg(url: &str, ttl: Duration, max_ttl: Duration) -> Make<CachedStore<PostgresStore>> {
    let url = url.to_owned();
    Box::new(move || {
        Box::pin(async move {
            let store = PostgresStore::connect(&url).await.expect("store");
            Idempotency::builder(CachedStore::builder(store).max_ttl(max_ttl).build())
                .tenant_header(TENANT_HEADER)
                .ttl(ttl)
                .lock_timeout(Duration::from_secs(3))
                .build()
        })
    })
}

fn cached_redis(url: &str, ttl: Duration, max_ttl: Duration) -> Make<CachedStore<RedisStore>> {
    let url = url.to_owned();
    Box::new(move || {
        Box::pin(async move {
            let store = RedisStore::connect(&url).await.expect("store");
            Idempotency::builder(CachedStore::builder(store).max_ttl(max_ttl).build())
                .tenant_header(TENANT_HEADER)
                .ttl(ttl)
                .lock_timeout(Duration::from_secs(3))
                .build()
        })
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

// ---------------------------------------------------------------------------------------------
// 1. release --force of a completed key, then the key reused with another body.

/// operations.md: "A new request with the reused key (another body) is not affected: an
/// instance asks the store whenever its cached record has another fingerprint." Two caching
/// instances both hold the old record; the new body runs exactly once fleet-wide, and from then
/// on every instance answers the new body with its replay and the old body with 422 (C7).
fn forced_release_then_new_body(
    fleet: &Fleet,
    a: &ThreadServer,
    b: &ThreadServer,
    c: &ThreadServer,
    release: impl FnOnce(),
) {
    let key = "force-new-body";
    let old = req("acme", key, r#"{"amount":100}"#);
    let new = req("acme", key, r#"{"amount":999}"#);
    let first = send(a, &old);
    assert_eq!(first.status, 201, "{}", first.describe());
    for srv in [b, c, b, c] {
        let r = send(srv, &old);
        assert!(r.is_replay(), "old replay before release: {}", r.describe());
        assert_eq!(r.body, first.body);
    }
    release();
    let runs_before = fleet.runs();
    let on_b = send(b, &new);
    assert_eq!(
        on_b.status,
        201,
        "new body on caching B: {}",
        on_b.describe()
    );
    assert!(
        !on_b.is_replay(),
        "new body on caching B replayed: {}",
        on_b.describe()
    );
    assert!(
        on_b.text().contains("999"),
        "new body on B answered with another request's response: {}",
        on_b.describe()
    );
    for (name, srv) in [("C", c), ("A", a), ("B", b), ("C", c)] {
        let r = send(srv, &new);
        assert!(
            r.is_replay() && r.body == on_b.body,
            "new body on {name}: expected the replay of B's run, got {}",
            r.describe()
        );
    }
    assert_eq!(
        fleet.runs(),
        runs_before + 1,
        "the new body ran more than once"
    );
    // The old request: C7, the key now holds another request's record. A caching instance
    // whose entry is the old record would replay the old response instead (documented for
    // retries of the old request until max_ttl: checked in `forced_release_old_body_...`).
    let a_old = send(a, &old);
    assert_eq!(
        a_old.problem_code().as_deref(),
        Some("FINGERPRINT_MISMATCH"),
        "old body on uncached A after the new request completed: {}",
        a_old.describe()
    );
}

#[test]
fn forced_release_of_completed_then_new_body_on_caching_instances_postgres() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(3600);
    let a = instance(&fleet, "A", plain_pg(&db.url, ttl));
    let b = instance(
        &fleet,
        "B",
        cached_pg(&db.url, ttl, Duration::from_secs(60)),
    );
    let c = instance(
        &fleet,
        "C",
        cached_pg(&db.url, ttl, Duration::from_secs(60)),
    );
    let url = db.url.clone();
    forced_release_then_new_body(&fleet, &a, &b, &c, || {
        let o = cli(&url, &["release", "force-new-body", "--tenant", "acme"]);
        assert_eq!(
            o.status.code(),
            Some(6),
            "release of completed without --force: {}",
            out_text(&o)
        );
        let o = cli(
            &url,
            &["release", "force-new-body", "--tenant", "acme", "--force"],
        );
        assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    });
}

#[test]
fn forced_release_of_completed_then_new_body_on_caching_instances_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(3600);
    let a = instance(
        &fleet,
        "A",
        cached_redis(&url, ttl, Duration::from_millis(1)),
    );
    let b = instance(
        &fleet,
        "B",
        cached_redis(&url, ttl, Duration::from_secs(60)),
    );
    let c = instance(
        &fleet,
        "C",
        cached_redis(&url, ttl, Duration::from_secs(60)),
    );
    let u = url.clone();
    forced_release_then_new_body(&fleet, &a, &b, &c, || {
        let o = run_idem_cli(
            "REDIS_URL",
            &u,
            &["release", "force-new-body", "--tenant", "acme", "--force"],
        );
        assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    });
}

/// The cached.rs bound: after a forced release of a completed record, a caching instance
/// replays the old response to the old request for at most `max_ttl`; after that the old
/// request runs again, once fleet-wide, and every instance whose entry ended replays the new run.
#[test]
fn forced_release_old_body_runs_again_after_max_ttl_postgres() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(3600);
    let max_ttl = Duration::from_secs(2);
    let a = instance(&fleet, "A", plain_pg(&db.url, ttl));
    let b = instance(&fleet, "B", cached_pg(&db.url, ttl, max_ttl));
    let c = instance(&fleet, "C", cached_pg(&db.url, ttl, max_ttl));
    let key = "force-same-body";
    let old = req("acme", key, r#"{"amount":5}"#);
    let first = send(&a, &old);
    assert_eq!(first.status, 201);
    assert!(send(&b, &old).is_replay());
    assert!(send(&c, &old).is_replay());
    let o = cli(&db.url, &["release", key, "--tenant", "acme", "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    std::thread::sleep(max_ttl + Duration::from_millis(700));
    let again = send(&b, &old);
    assert_eq!(again.status, 201, "{}", again.describe());
    assert!(
        !again.is_replay(),
        "B replayed a released record after max_ttl ({max_ttl:?}): {}",
        again.describe()
    );
    assert_eq!(run_of(&again), 2);
    for (name, srv) in [("A", &a), ("C", &c), ("B", &b)] {
        let r = send(srv, &old);
        assert!(
            r.is_replay() && r.body == again.body,
            "{name} after the re-run: {}",
            r.describe()
        );
    }
    assert_eq!(fleet.runs(), 2);
    let o = cli(
        &db.url,
        &["show", key, "--tenant", "acme", "--format", "json"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
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
    let ttl = Duration::from_secs(1);
    let long = Duration::from_secs(60);
    let a = instance(&fleet, "A", plain_pg(&db.url, ttl));
    let b = instance(&fleet, "B", cached_pg(&db.url, ttl, long));
    let c = instance(&fleet, "C", cached_pg(&db.url, ttl, long));
    let key = "expiry-reuse";
    let old = req("acme", key, r#"{"amount":1}"#);
    let new = req("acme", key, r#"{"amount":2}"#);
    let first = send(&a, &old);
    assert_eq!(first.status, 201);
    for srv in [&b, &c, &b, &c] {
        let r = send(srv, &old);
        assert!(r.is_replay(), "{}", r.describe());
    }
    std::thread::sleep(Duration::from_millis(1500));
    let on_b = send(&b, &new);
    assert_eq!(on_b.status, 201, "{}", on_b.describe());
    assert!(!on_b.is_replay(), "{}", on_b.describe());
    assert!(on_b.text().contains(r#"amount\":2"#), "{}", on_b.describe());
    let c_old = send(&c, &old);
    assert_eq!(
        c_old.problem_code().as_deref(),
        Some("FINGERPRINT_MISMATCH"),
        "old body on C after the key was reused: {}",
        c_old.describe()
    );
    let c_new = send(&c, &new);
    assert!(
        c_new.is_replay() && c_new.body == on_b.body,
        "{}",
        c_new.describe()
    );
    assert_eq!(fleet.runs(), 2);
}

/// Purge after expiry, then the same request sent to three instances at once: it runs exactly
/// once fleet-wide (C5), and the CLI's counts say what the instances do (C19/C20).
#[test]
fn purge_after_expiry_then_retry_at_once_on_three_instances_runs_once() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(1);
    let long = Duration::from_secs(60);
    let a = Arc::new(instance(&fleet, "A", plain_pg(&db.url, ttl)));
    let b = Arc::new(instance(&fleet, "B", cached_pg(&db.url, ttl, long)));
    let c = Arc::new(instance(&fleet, "C", cached_pg(&db.url, ttl, long)));
    let keys: Vec<String> = (0..5).map(|i| format!("purge-{i}")).collect();
    for key in &keys {
        let r = send(&a, &req("acme", key, "{}"));
        assert_eq!(r.status, 201);
        assert!(send(&b, &req("acme", key, "{}")).is_replay());
        assert!(send(&c, &req("acme", key, "{}")).is_replay());
    }
    assert_eq!(fleet.runs(), 5);
    std::thread::sleep(Duration::from_millis(1500));
    let o = cli(&db.url, &["list", "--state", "expired", "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    assert_eq!(
        stdout(&o).lines().count(),
        5,
        "list --state expired: {}",
        out_text(&o)
    );
    let o = cli(&db.url, &["purge"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    assert!(stdout(&o).contains("purged 5 records"), "{}", out_text(&o));
    let mut handles = Vec::new();
    for key in &keys {
        for srv in [&a, &b, &c] {
            let srv = Arc::clone(srv);
            let request = req("acme", key, "{}");
            handles.push(std::thread::spawn(move || send(&srv, &request)));
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
    let o = cli(&db.url, &["stats", "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    eprintln!("stats: {}", stdout(&o));
}

// ---------------------------------------------------------------------------------------------
// 3. Tenants (C3) across caching instances, and a forced release scoped to one tenant.

#[test]
fn two_tenants_same_key_across_caching_instances_and_a_scoped_forced_release() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(3600);
    let long = Duration::from_secs(60);
    let a = instance(&fleet, "A", cached_pg(&db.url, ttl, long));
    let b = instance(&fleet, "B", cached_pg(&db.url, ttl, long));
    let key = "shared-key";
    let body = r#"{"amount":7}"#;
    let x = send(&a, &req("tenant-x", key, body));
    let y = send(&b, &req("tenant-y", key, body));
    assert_eq!(x.status, 201);
    assert_eq!(
        y.status,
        201,
        "tenant-y blocked by tenant-x: {}",
        y.describe()
    );
    assert!(!y.is_replay(), "tenant-y got a replay: {}", y.describe());
    for _ in 0..2 {
        for srv in [&a, &b] {
            let rx = send(srv, &req("tenant-x", key, body));
            let ry = send(srv, &req("tenant-y", key, body));
            assert!(rx.is_replay() && rx.body == x.body, "{}", rx.describe());
            assert!(ry.is_replay() && ry.body == y.body, "{}", ry.describe());
        }
    }
    // Without --tenant the key is ambiguous: refused.
    let o = cli(&db.url, &["release", key, "--force"]);
    assert_eq!(o.status.code(), Some(6), "{}", out_text(&o));
    let o = cli(
        &db.url,
        &["release", key, "--tenant", "tenant-x", "--force"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    // tenant-y still replayed everywhere; tenant-x with a new body runs on B.
    let x2 = send(&b, &req("tenant-x", key, r#"{"amount":8}"#));
    assert_eq!(x2.status, 201, "{}", x2.describe());
    assert!(!x2.is_replay(), "{}", x2.describe());
    assert_eq!(x2.json()["tenant"], "tenant-x");
    for srv in [&a, &b] {
        let ry = send(srv, &req("tenant-y", key, body));
        assert!(ry.is_replay() && ry.body == y.body, "{}", ry.describe());
        let rx = send(srv, &req("tenant-x", key, r#"{"amount":8}"#));
        assert!(rx.is_replay() && rx.body == x2.body, "{}", rx.describe());
    }
    assert_eq!(fleet.runs(), 3);
}

// ---------------------------------------------------------------------------------------------
// 4. A transactional instance and a caching default-mode instance on one table (C25).

/// Instance T in transactional mode and instance B, default mode with a cache (entries up to
/// 60 s, records of an hour), on one table.
fn transactional_and_caching(fleet: &Fleet, url: &str) -> (Arc<ThreadServer>, ThreadServer) {
    let t = Arc::new(instance(fleet, "T", transactional_pg(url)));
    let b = instance(
        fleet,
        "B",
        cached_pg(url, Duration::from_secs(3600), Duration::from_secs(60)),
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

/// T's handler is slow and answers 500: its transaction rolls back. Meanwhile the same key on
/// caching B gets 409 (never a hang, never a replay); after the rollback B runs it, once.
#[test]
fn transactional_rollback_leaves_nothing_a_caching_instance_replays() {
    let db = new_db();
    let fleet = Fleet::default();
    let (t, b) = transactional_and_caching(&fleet, &db.url);
    let key = "tx-rollback";
    let failing = acme("/slow?ms=1500&status=500", key, "{}");
    let first = send_in_background(&t, &failing);
    std::thread::sleep(Duration::from_millis(500));
    let during = send(&b, &failing);
    assert_eq!(
        during.problem_code().as_deref(),
        Some("CONFLICT"),
        "B during T's open transaction: {}",
        during.describe()
    );
    let first = first.join().unwrap();
    assert_eq!(first.status, 500, "{}", first.describe());
    let o = cli(&db.url, &["show", key, "--tenant", "acme"]);
    assert_eq!(
        o.status.code(),
        Some(6),
        "record left after rollback: {}",
        out_text(&o)
    );
    let ok = acme("/slow?ms=0&status=201", key, "{}");
    // Another target (query) is another fingerprint but the same scope: it must run, the
    // rolled-back request left nothing.
    let after = send(&b, &ok);
    assert_eq!(after.status, 201, "{}", after.describe());
    assert!(!after.is_replay(), "{}", after.describe());
    let again = send(&t, &ok);
    assert!(
        again.is_replay() && again.body == after.body,
        "{}",
        again.describe()
    );
    let again = send(&b, &ok);
    assert!(
        again.is_replay() && again.body == after.body,
        "{}",
        again.describe()
    );
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
    let first = send_in_background(&t, &good);
    std::thread::sleep(Duration::from_millis(500));
    let during = send(&b, &other);
    assert_eq!(during.status, 409, "{}", during.describe());
    let first = first.join().unwrap();
    assert_eq!(first.status, 201, "{}", first.describe());
    for _ in 0..2 {
        let r = send(&b, &good);
        assert!(r.is_replay() && r.body == first.body, "{}", r.describe());
        let r = send(&b, &other);
        assert_eq!(
            r.problem_code().as_deref(),
            Some("FINGERPRINT_MISMATCH"),
            "{}",
            r.describe()
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
    let ttl = Duration::from_secs(3600);
    let a = instance(&fleet, "A", plain_pg(&db.url, ttl));
    let b = instance(
        &fleet,
        "B",
        cached_pg(&db.url, ttl, Duration::from_millis(500)),
    );
    let c = instance(
        &fleet,
        "C",
        cached_pg(&db.url, ttl, Duration::from_secs(60)),
    );
    forced_release_then_new_body(&fleet, &a, &b, &c, || {
        let o = cli(
            &db.url,
            &["release", "force-new-body", "--tenant", "acme", "--force"],
        );
        assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    });
    // The same body run again after a forced release (on uncached A, then B after its entry).
    let key = "force-same-part";
    let r1 = req("acme", key, r#"{"amount":3}"#);
    let first = send(&a, &r1);
    assert_eq!(first.status, 201);
    assert!(send(&b, &r1).is_replay());
    let o = cli(&db.url, &["release", key, "--tenant", "acme", "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    let runs = fleet.runs();
    let again = send(&a, &r1);
    assert_eq!(again.status, 201, "{}", again.describe());
    assert!(!again.is_replay(), "{}", again.describe());
    assert_eq!(fleet.runs(), runs + 1);
    std::thread::sleep(Duration::from_millis(700));
    for (name, srv) in [("A", &a), ("B", &b)] {
        let r = send(srv, &r1);
        assert!(
            r.is_replay() && r.body == again.body,
            "{name} after the re-run on the partitioned layout: {}",
            r.describe()
        );
    }
    let o = cli(
        &db.url,
        &["show", key, "--tenant", "acme", "--format", "json"],
    );
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    assert_eq!(stdout(&o).lines().count(), 1, "{}", out_text(&o));
    let o = cli(&db.url, &["purge"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    let r = send(&c, &r1);
    assert!(r.is_replay(), "after purge: {}", r.describe());
}

/// C19/C20: after the TTL, `stats`, `list --state expired` and the instances agree: the
/// records are counted as expired, no instance replays them (each runs again, once), and a
/// release without --force of such an expired completed record is refused or harmless.
#[test]
fn expired_records_cli_counts_agree_with_the_instances() {
    let db = new_db();
    let fleet = Fleet::default();
    let ttl = Duration::from_secs(1);
    let a = instance(&fleet, "A", plain_pg(&db.url, ttl));
    let b = instance(
        &fleet,
        "B",
        cached_pg(&db.url, ttl, Duration::from_secs(60)),
    );
    for i in 0..3 {
        let r = req("acme", &format!("exp-{i}"), "{}");
        assert_eq!(send(&a, &r).status, 201);
        assert!(send(&b, &r).is_replay());
    }
    std::thread::sleep(Duration::from_millis(1500));
    let o = cli(&db.url, &["stats", "--format", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    let stats: serde_json::Value = serde_json::from_str(stdout(&o).trim()).expect("stats json");
    eprintln!("stats: {stats}");
    assert_eq!(stats["expired_not_purged"], 3, "{stats}");
    let o = cli(
        &db.url,
        &["list", "--state", "completed", "--format", "json"],
    );
    assert_eq!(
        stdout(&o).lines().count(),
        0,
        "expired listed as completed: {}",
        out_text(&o)
    );
    let o = cli(&db.url, &["release", "exp-0", "--tenant", "acme"]);
    eprintln!("release of an expired completed record: {}", out_text(&o));
    for i in 0..3 {
        let r = send(&b, &req("acme", &format!("exp-{i}"), "{}"));
        assert!(
            !r.is_replay() && r.status == 201,
            "exp-{i}: {}",
            r.describe()
        );
    }
    assert_eq!(fleet.runs(), 6);
}
