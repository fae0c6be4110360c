//! The Redis store when Redis is degraded: full (`OOM`), unable to persist (`MISCONF`), short of
//! replicas (`NOREPLICAS`), a replica lagging behind `WAIT`; concurrent duplicates on two
//! workers with a connection each; a demoted primary (`READONLY`), a connection that stops
//! answering while Redis does not, and a reserve's reply lost in a crash. From two reviews
//! (2026-12-04): the first three and the last three failed on the code before them (see each
//! test's docs).

use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::redis::{record, RedisStore, RedisStoreBuilder};
use idempotency_actix::store::{
    IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
    WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::proxy::FaultyProxy;
use idempotency_e2e::redis_server::{connection as conn, replica_of, RedisServer};

const FP: Fingerprint = Fingerprint([0xAA; 32]);
const TTL: Duration = Duration::from_secs(3600);

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "acct_1".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(b"paid"),
    }
}

/// The state byte of `key`'s record on the server at `url` (None: absent).
async fn state_on(url: &str, key: &str) -> Option<u8> {
    let mut c = conn(url).await;
    let value: Option<Vec<u8>> = redis::cmd("GET")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("GET");
    value.and_then(|v| v.first().copied())
}

/// `wait_for_replicas`: a completion whose `WAIT` was not acknowledged fails, and the
/// middleware retries it (C16) "until a replica has it". The retry finds the record completed
/// by its token and answers applied *without writing*, then sends `WAIT` on whichever of the
/// store's connections `pick` hands out. `WAIT` waits for the offset of that connection's own
/// last write: on another connection (round robin over 8 by default) that is an older write or
/// none, which the lagging replica acknowledged long ago, so `WAIT` returns at once and the
/// completion counts as replicated while no replica has it. A failover then brings the
/// reservation back and, after its lease, the retry runs the handler a second time.
///
/// Here the replica is frozen (SIGSTOP) after it acknowledged the reservation: the first
/// `complete` correctly fails; the retry answered `Applied`; the primary dies, the replica is
/// promoted and still holds the reservation, and a retry after the lease reserves the key again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_completion_is_not_acknowledged_by_a_wait_on_another_connection() {
    let mut primary = RedisServer::start();
    let replica = replica_of(&primary).await;
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_millis(1000))
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("false-ack");
    let key = store.key_of(&s);
    let lease = Duration::from_secs(1);
    let token = match store.reserve(&s, &FP, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    assert_eq!(
        state_on(&replica.url(), &key).await,
        Some(record::IN_FLIGHT),
        "the reservation was acknowledged by the replica"
    );

    // The replica stops acknowledging (frozen; a slow disk, a long fork, a network stall).
    replica.signal("STOP");
    let first = store.complete(&s, &token, &response(), TTL).await;
    assert!(
        matches!(first, Err(StoreError::Unavailable(_))),
        "no replica has the completion: {first:?}"
    );
    // The middleware's retry (`retry_complete`), as many times as it would try in a lease.
    let mut retried = Vec::new();
    for _ in 0..3 {
        let r = store.complete(&s, &token, &response(), TTL).await;
        retried.push(r.ok());
    }

    // Failover: the primary dies, the (only) replica is promoted.
    primary.kill();
    replica.signal("CONT");
    let mut promoted = conn(&replica.url()).await;
    let _: () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut promoted)
        .await
        .expect("REPLICAOF NO ONE");
    let on_replica = state_on(&replica.url(), &key).await;

    // A client retry after the lease, on the promoted replica.
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let after = RedisStore::builder()
        .connect(&replica.url())
        .await
        .expect("connect to the promoted replica");
    let second_run = matches!(
        after.reserve(&s, &FP, lease).await,
        Ok(ReserveOutcome::Reserved { .. })
    );

    assert!(
        !retried.contains(&Some(WriteOutcome::Applied)) || on_replica == Some(record::COMPLETED),
        "a retried complete answered {retried:?} (acknowledged by WAIT) while the replica \
         held state {:?} (F = still the reservation); after the failover a retry of the key \
         reserved it again: second run = {second_run}",
        on_replica.map(char::from)
    );
}

/// `CONFIG SET maxmemory <value>` on the server at `url`.
async fn set_maxmemory(url: &str, value: &str) {
    let mut c = conn(url).await;
    for (name, v) in [("maxmemory-policy", "noeviction"), ("maxmemory", value)] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(v)
            .query_async(&mut c)
            .await
            .expect("CONFIG SET");
    }
}

/// C22 and C5/C6 with `noeviction`: Redis reaches `maxmemory` while a payment handler runs
/// (other keys' records, a burst of large responses). The handler charged and the client got
/// its 201, but the completion is a `SET` inside `complete.lua`, a script without the
/// `allow-oom` flag, so Redis refuses it with `OOM`; the middleware retries it until the lease
/// ends, all refused while Redis stays full. The reservation stays in flight for its grace;
/// once memory is freed (the operator raises `maxmemory`, old records expire), the client's
/// retry of the same request takes the ended reservation over and the handler runs a second
/// time: a double charge for every request that was in flight when Redis filled up. The
/// memory store reserves room for the response at reserve time for exactly this reason
/// (reliability.md, bug 6, "A full memory store ran a handler twice"); the module docs say a
/// full Redis "refuses new keys only, like a full memory store".
#[actix_web::test]
async fn a_redis_that_fills_up_while_the_handler_runs_does_not_run_it_twice() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use actix_web::test::{call_service, init_service, read_body, TestRequest};
    use actix_web::{web, App, HttpResponse};
    use idempotency_actix::Idempotency;

    let redis = RedisServer::start();
    let url = redis.url();
    let store = RedisStore::connect(&url).await.expect("connect");
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler_url = url.clone();
    let lease = Duration::from_secs(1);
    let app = init_service(
        App::new()
            .wrap(Idempotency::builder(store).lock_timeout(lease).build())
            .route(
                "/payments",
                web::post().to(move || {
                    let runs = Arc::clone(&counted);
                    let url = handler_url.clone();
                    async move {
                        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        // While the payment is being made, Redis fills up.
                        if n == 1 {
                            set_maxmemory(&url, "1").await;
                        }
                        HttpResponse::Created().body(format!("charge {n}"))
                    }
                }),
            ),
    )
    .await;
    let pay = || {
        TestRequest::post()
            .uri("/payments")
            .insert_header(("idempotency-key", "pay-1"))
            .set_payload("{\"amount\":100}")
            .to_request()
    };
    let first = call_service(&app, pay()).await;
    assert_eq!(first.status().as_u16(), 201);
    let first_body = read_body(first).await;
    // The middleware retries the completion until the lease ends; Redis stays full meanwhile.
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    // The operator frees memory.
    set_maxmemory(&url, "0").await;
    let retry = call_service(&app, pay()).await;
    let status = retry.status().as_u16();
    let body = read_body(retry).await;
    assert_eq!(
        (runs.load(Ordering::SeqCst), status, body.clone()),
        (1, 201, first_body.clone()),
        "the retry of a payment that was charged and answered 201 ({first_body:?}) must replay \
         it; handler runs, retry status and body: {} {status} {body:?}",
        runs.load(Ordering::SeqCst)
    );
}

/// A completed record (`done`, with the token that completed it) and a live reservation
/// (`busy`) under keys starting with `prefix`.
async fn a_completed_and_a_running_record(
    store: &RedisStore,
    prefix: &str,
) -> (Scope, ReservationToken, Scope) {
    let (done, busy) = (
        scope(&format!("{prefix}-done")),
        scope(&format!("{prefix}-busy")),
    );
    let token = match store.reserve(&done, &FP, TTL).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    assert_eq!(
        store.complete(&done, &token, &response(), TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    assert!(matches!(
        store.reserve(&busy, &FP, TTL).await,
        Ok(ReserveOutcome::Reserved { .. })
    ));
    (done, token, busy)
}

/// `min-replicas-to-write 1` on a Redis without replicas: it refuses every write with
/// `NOREPLICAS` from now on.
async fn require_a_replica(url: &str) {
    let mut c = conn(url).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg("1")
        .query_async(&mut c)
        .await
        .expect("CONFIG SET");
    assert_writes_refused(&mut c, "NOREPLICAS").await;
}

/// Redis refuses a plain `SET` with `code`.
async fn assert_writes_refused(c: &mut redis::aio::MultiplexedConnection, code: &str) {
    let probe = redis::cmd("SET")
        .arg("probe")
        .arg("x")
        .query_async::<()>(c)
        .await;
    assert!(
        probe.as_ref().is_err_and(|e| e.code() == Some(code)),
        "Redis must refuse writes with {code} for this test: {probe:?}"
    );
}

/// While Redis refuses writes but answers reads, a retry of `done` replays and a duplicate of
/// `busy` is in flight (409), never a 503.
async fn assert_still_answered(store: &RedisStore, done: &Scope, busy: &Scope) {
    let replay = store.reserve(done, &FP, TTL).await;
    let in_flight = store.reserve(busy, &FP, TTL).await;
    assert!(
        matches!(&replay, Ok(ReserveOutcome::Completed { response: r, .. }) if r.body == response().body)
            && matches!(in_flight, Ok(ReserveOutcome::InFlight { .. })),
        "Redis still holds both records and answers reads; a retry of the completed payment \
         got {replay:?}, a duplicate of the running one got {in_flight:?}"
    );
}

/// A Redis that cannot persist (its disk full or gone: a failed `BGSAVE` with
/// `stop-writes-on-bgsave-error yes`, Redis's default, or an AOF write error) refuses every
/// command that may write with `MISCONF`, and, as under `OOM`, refuses the reserve's
/// `SET ... NX GET` before running it, even for a key it holds. Reads still work (a script
/// that only reads runs). So while the disk is full every retry of a completed payment gets
/// 503 instead of its replay, and a request in flight gets 503 instead of 409: the class of
/// bug fixed for `OOM` on 2026-12-03 (reliability.md, bug 4, "A full Redis answered 503 to
/// replays"), left for `MISCONF`, which is also classified as `Backend` rather than
/// `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_cannot_persist_still_replays_completed_records() {
    let dir = std::env::temp_dir().join(format!("idem-review-d-misconf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let redis = RedisServer::start_with(&["--dir", dir.to_str().expect("utf-8 temp dir")]);
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    let (done, _, busy) = a_completed_and_a_running_record(&store, "misconf").await;

    // The disk goes away: the next snapshot fails and Redis stops taking writes.
    let mut c = conn(&redis.url()).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("save")
        .arg("3600 1")
        .query_async(&mut c)
        .await
        .expect("CONFIG SET save");
    std::fs::remove_dir_all(&dir).expect("rm the data dir");
    let _: String = redis::cmd("BGSAVE")
        .query_async(&mut c)
        .await
        .expect("BGSAVE");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let probe = redis::cmd("SET")
            .arg("probe")
            .arg("x")
            .query_async::<()>(&mut c)
            .await;
        if probe.as_ref().is_err_and(|e| e.code() == Some("MISCONF")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis never refused writes: {probe:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_still_answered(&store, &done, &busy).await;
}

/// The same with `min-replicas-to-write` (a setting a payments team turns on to bound what a
/// failover can lose): while fewer replicas are connected, Redis refuses every write with
/// `NOREPLICAS`, the reserve's `SET ... NX GET` included, even for a key it holds, so every
/// retry of a completed payment gets 503 instead of its replay, and a duplicate of a running
/// one 503 instead of 409. A script that only reads still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_short_of_replicas_still_replays_completed_records() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    let (done, _, busy) = a_completed_and_a_running_record(&store, "noreplicas").await;
    // The replica goes away (here: there is none, and one is now required).
    require_a_replica(&redis.url()).await;
    assert_still_answered(&store, &done, &busy).await;
}

/// Concurrent duplicates through the middleware on two workers, each with its own Redis
/// connection (`connection_per_thread`, on by default) besides the shared one: 40 keys, six
/// identical requests per key sent at once, then a retry of each. Every key runs once, every
/// answer is its key's own response (201 or its replay) or a 409, and every retry replays.
/// (A guard: it held when it was written.)
#[actix_web::test]
async fn concurrent_duplicates_on_two_workers_run_each_key_once() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
    use idempotency_actix::Idempotency;
    use idempotency_e2e::raw_http::{Conn, Request};

    const KEYS: usize = 40;
    const DUPLICATES: usize = 6;
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let data = web::Data::new(Arc::clone(&runs));
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .wrap(Idempotency::new(store.clone()))
            .route(
                "/payments",
                web::post().to(
                    |req: HttpRequest, runs: web::Data<Arc<Mutex<HashMap<String, usize>>>>| async move {
                        let key = req
                            .headers()
                            .get("idempotency-key")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        let n = {
                            let mut runs = runs.lock().expect("lock");
                            let n = runs.entry(key.clone()).or_default();
                            *n += 1;
                            *n
                        };
                        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
                        HttpResponse::Created().body(format!("{key} run {n}"))
                    },
                ),
            )
    })
    .workers(2)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .expect("bind");
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    actix_web::rt::spawn(server);

    let answers = tokio::task::spawn_blocking(move || {
        let send = move |key: String| {
            let mut conn = Conn::connect(addr, Duration::from_secs(10)).expect("connect");
            let response = conn
                .send(&Request::post("/payments").key(&key).json("{\"amount\":1}"))
                .expect("response");
            (key, response.status, response.body)
        };
        let mut answers = Vec::new();
        for round in 0..2 {
            let threads: Vec<_> = (0..KEYS)
                .flat_map(|k| {
                    let copies = if round == 0 { DUPLICATES } else { 1 };
                    (0..copies).map(move |_| format!("k{k}"))
                })
                .map(|key| std::thread::spawn(move || send(key)))
                .collect();
            for t in threads {
                answers.push((round, t.join().expect("client")));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        answers
    })
    .await
    .expect("clients");
    handle.stop(true).await;

    let runs = runs.lock().expect("lock").clone();
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    let wrong: Vec<_> = answers
        .iter()
        .filter(|(round, (key, status, body))| match status {
            201 => body != format!("{key} run 1").as_bytes(),
            409 => *round == 1,
            _ => true,
        })
        .collect();
    assert!(
        twice.is_empty() && wrong.is_empty() && runs.len() == KEYS,
        "keys run other than once: {twice:?}; wrong answers: {wrong:?}"
    );
}

/// Found by review (2026-12-04): `complete.lua` now starts with `#!lua flags=allow-oom`. A script
/// with flags and without `no-writes` is a write command to Redis 7.0, checked before it runs:
/// under `MISCONF` or `NOREPLICAS` it is refused without running, even when it would only
/// read. Before, it ran, found the record completed by this very token and answered 1 without
/// writing, which is what the store's contract says the Redis store does ("a second `complete`
/// by the token that completed it may answer `Applied` (the PostgreSQL and Redis stores do,
/// so a retry after a reply lost in transit, or after an unacknowledged `WAIT`, is not
/// mistaken...)"). Now that retry (the middleware's `retry_complete` after a lost reply) gets
/// `Unavailable` for as long as Redis refuses writes, and, past the lease, the middleware
/// reports `complete_retry{given_up}` and logs "gave up storing the response ... a retry will
/// run the handler again" for a response that is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_completion_of_a_stored_response_is_applied_while_redis_refuses_writes() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    // Completed, and imagine its reply lost (a response timeout): the middleware retries it.
    let (done, token, _) = a_completed_and_a_running_record(&store, "retried-complete").await;
    require_a_replica(&redis.url()).await;
    let retried = store.complete(&done, &token, &response(), TTL).await;
    assert!(
        matches!(retried, Ok(WriteOutcome::Applied)),
        "the record is completed by this token (a replay still works), but the retried \
         complete got {retried:?}"
    );
}

/// The node the store talks to became a replica (a failover demoted it; Sentinel or a managed
/// Redis moves the address only later): it still holds every record and serves reads, but
/// refuses writes with `READONLY`, and Redis refuses the reserve's `SET ... NX GET` before
/// looking at the key. Before the fix a retry of a completed payment got 503 instead of its
/// replay and a duplicate of a running one 503 instead of 409; and with `fail_open` (an
/// `Unavailable` error) the middleware ran the completed payment's handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_primary_still_replays_completed_records() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    let (done, _, busy) = a_completed_and_a_running_record(&store, "readonly").await;
    demote_to_nowhere(&redis.url()).await;
    assert_still_answered(&store, &done, &busy).await;
    // A new key needs a write: refused (503, closed), never reserved.
    let new = store.reserve(&scope("readonly-new"), &FP, TTL).await;
    assert!(matches!(new, Err(StoreError::Unavailable(_))), "{new:?}");
}

/// Make the server at `url` a replica of a primary it cannot reach: it keeps its data and
/// answers reads, and refuses writes with `READONLY`, as a demoted primary does until its new
/// primary's data replaces its own.
async fn demote_to_nowhere(url: &str) {
    let mut c = conn(url).await;
    let unreachable = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = unreachable.local_addr().expect("addr").port();
    drop(unreachable);
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(port)
        .query_async(&mut c)
        .await
        .expect("REPLICAOF");
    assert_writes_refused(&mut c, "READONLY").await;
}

/// A server demoted at the store's own address (no new primary to move to) is reconnected to
/// at most once a second per connection, not at every call. With a connection per thread (the
/// default), each replacement started with no memory of the last, so the first `READONLY` on
/// the new connection replaced it again at once: a reconnection per few calls (review of the
/// per-connection throttle, 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_demoted_at_the_same_address_is_not_reconnected_to_at_every_call() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    // This thread's own connection, made in the background after its first call.
    let _ = store.reserve(&scope("warm-up"), &FP, TTL).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    demote_to_nowhere(&redis.url()).await;
    let mut c = conn(&redis.url()).await;
    let before = connections_received(&mut c).await;
    let started = Instant::now();
    let mut calls = 0;
    while started.elapsed() < Duration::from_secs(2) {
        let refused = store
            .reserve(&scope(&format!("new-{calls}")), &FP, TTL)
            .await;
        assert!(
            matches!(refused, Err(StoreError::Unavailable(_))),
            "{refused:?}"
        );
        calls += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let made = connections_received(&mut c).await - before;
    // Two workers' connections and the shared one, each at most once a second, over 2 s.
    assert!(
        made <= 10,
        "{made} connections made to a demoted server in 2 s ({calls} calls)"
    );
}

/// A store that connects while Redis refuses writes (here: no replica for
/// `min-replicas-to-write`; also a full disk, `OOM`, a replica) comes up and serves replays
/// and 409s, as it did before `connect` probed the write commands: those probes are answered
/// `NOREPLICAS`, which only a user allowed to run them gets (Redis checks the ACL first). They
/// failed `connect`, so an instance restarted during the outage could not start (review,
/// 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_connects_while_redis_refuses_writes() {
    let redis = RedisServer::start();
    let first = RedisStore::connect(&redis.url()).await.expect("connect");
    let (done, _, busy) = a_completed_and_a_running_record(&first, "refusing").await;
    require_a_replica(&redis.url()).await;
    let store = RedisStore::connect(&redis.url())
        .await
        .expect("connect while Redis refuses writes");
    assert_still_answered(&store, &done, &busy).await;
}

/// Stores whose prefixes nest (`x:` and `x:t:POST:/:`) never touch each other's records: the
/// connect-time probes of the second write nothing, on a key that no record of any prefix can
/// have. Its probe key was `x:t:POST:/:permission-probe`, a record key of the first store
/// (tenant `t`, `POST /`, key `permission-probe`), which `connect` deleted (review,
/// 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_never_touches_a_record_of_a_nesting_prefix() {
    let redis = RedisServer::start();
    let outer = RedisStore::builder()
        .key_prefix("x:")
        .connect(&redis.url())
        .await
        .expect("connect");
    let s = Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/".into(),
        key: "permission-probe".into(),
    };
    let token = match outer.reserve(&s, &FP, TTL).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    let stored = outer.complete(&s, &token, &response(), TTL).await;
    assert!(matches!(stored, Ok(WriteOutcome::Applied)), "{stored:?}");
    let _inner = RedisStore::builder()
        .key_prefix("x:t:POST:/:")
        .connect(&redis.url())
        .await
        .expect("connect");
    let replay = outer.reserve(&s, &FP, TTL).await;
    assert!(
        matches!(replay, Ok(ReserveOutcome::Completed { .. })),
        "the record is gone after another store connected: {replay:?}"
    );
}

/// A retried `complete` (its first reply lost) that reaches a demoted primary is not confirmed
/// from that node's data: a demoted primary serves its old dataset until it resyncs, and may
/// hold a completion the promoted replica never got. Answered `Applied`, the middleware stopped
/// retrying while the new primary still held the reservation, and after the lease a retry ran
/// the handler again (review, 2026-12-06). It is `Unavailable` now, so the middleware retries
/// until the connection reaches the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_completion_is_not_confirmed_by_a_replica() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url()).await.expect("connect");
    let (done, token, _) = a_completed_and_a_running_record(&store, "replica-confirm").await;
    demote_to_nowhere(&redis.url()).await;
    let retried = store.complete(&done, &token, &response(), TTL).await;
    assert!(
        matches!(retried, Err(StoreError::Unavailable(_))),
        "a replica's copy confirmed the completion: {retried:?}"
    );
}

/// One connection of the store goes half-open while a handler runs (a NAT or firewall entry
/// lost); Redis stays reachable. The middleware retries `complete` until the lease ends (C16).
/// Before the fix every retry went down the same dead connection (the redis crate reconnects
/// after a reset, not after a response timeout), the response was never stored, and the
/// client's retry through another instance (or another worker, each with its own connection)
/// took the key over after the lease: the handler ran a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stops_answering_is_replaced_before_the_lease_ends() {
    the_store_recovers_from_a_silent_connection(false).await;
}

/// The same with a connection per thread (the default): the thread's connection and the
/// shared one, both open when the path breaks, are replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_threads_connection_that_stops_answering_is_replaced_before_the_lease_ends() {
    the_store_recovers_from_a_silent_connection(true).await;
}

async fn the_store_recovers_from_a_silent_connection(per_thread: bool) {
    let redis = RedisServer::start();
    let proxy = FaultyProxy::start(format!("127.0.0.1:{}", redis.port())).await;
    let url = format!("redis://127.0.0.1:{}/", proxy.port());
    let connect = || {
        RedisStore::builder()
            .response_timeout(Duration::from_millis(300))
            .connection_per_thread(per_thread)
            .connect(&url)
    };
    let store = connect().await.expect("connect");
    if per_thread {
        // This thread's own connection is made in the background after its first call.
        let _ = store.reserve(&scope("warm-up"), &FP, TTL).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let lease = Duration::from_secs(4);
    let s = scope("half-open");
    let token = match store.reserve(&s, &FP, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    // The handler runs; meanwhile the store's connection goes half-open.
    proxy.cut_open_connections();
    let other_instance = connect()
        .await
        .expect("a new connection to the same Redis works");
    // The middleware's retries of `complete` (every 250 ms here, more often than its own).
    let until = Instant::now() + lease;
    let mut failures = Vec::new();
    let mut stored = false;
    while !stored && Instant::now() + Duration::from_millis(400) < until {
        match store.complete(&s, &token, &response(), TTL).await {
            Ok(WriteOutcome::Applied) => stored = true,
            other => failures.push(format!("{other:?}")),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(until.saturating_duration_since(Instant::now()) + Duration::from_millis(50))
        .await;
    let retry = other_instance.reserve(&s, &FP, lease).await;
    assert!(
        stored && matches!(retry, Ok(ReserveOutcome::Completed { .. })),
        "the response was never stored although Redis answered new connections ({} failed \
         tries, last {:?}); the client's retry after the lease got {retry:?}",
        failures.len(),
        failures.last()
    );
}

/// Redis (AOF, `appendfsync always`, as docs/redis.md recommends for payments) applies a
/// reserve's `SET` and crashes before its reply reaches the app; it is back three seconds later
/// with the reservation. The reserve failed (503: the handler never ran). Before the fix the
/// store's one attempt to give the reservation back was made while Redis was down and never
/// again: every retry of a request that never ran got 409 for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_whose_reply_was_lost_in_a_crash_does_not_hold_the_key_for_a_lease() {
    let mut redis = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let proxy = FaultyProxy::start(format!("127.0.0.1:{}", redis.port())).await;
    let store = RedisStore::builder()
        .connection_per_thread(false)
        .connect(&format!("redis://127.0.0.1:{}/", proxy.port()))
        .await
        .expect("connect");
    let lease = Duration::from_secs(60);
    let s = scope("reply-lost");
    proxy.mute_replies(true);
    let pending = {
        let (store, s) = (store.clone(), s.clone());
        tokio::spawn(async move { store.reserve(&s, &FP, lease).await })
    };
    // The SET is applied and on disk; its reply is lost. Then Redis crashes.
    tokio::time::sleep(Duration::from_millis(300)).await;
    redis.kill();
    let first = pending.await.expect("reserve task");
    assert!(
        matches!(first, Err(StoreError::Unavailable(_))),
        "{first:?}"
    );
    proxy.mute_replies(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    redis.restart();
    // The reservation is back from the AOF (before the fix every retry here got `InFlight`
    // with most of the 60 s lease left): the background release frees it within seconds.
    if let Err(answers) = retries_get_the_key(&store, &s, Duration::from_secs(8)).await {
        panic!(
            "a request that never ran is refused for a whole lease after Redis came back: \
             {answers:#?}"
        );
    }
}

/// Redis's count of connections accepted since it started (`INFO stats`).
async fn connections_received(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(c)
        .await
        .expect("INFO stats");
    stats
        .lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_connections_received")
}

/// One shared connection goes half-open under steady traffic (a call every 10 ms). The calls
/// sent on it before its replacement was swapped in time out one after the other, and each of
/// those late timeouts replaced the slot's connection again in the first version of the
/// replacement, though the slot already held a new, answering one. One silence costs one new
/// connection, not one per stale call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_silent_connection_is_replaced_once_not_once_per_stale_call() {
    let redis = RedisServer::start();
    let proxy = FaultyProxy::start(format!("127.0.0.1:{}", redis.port())).await;
    let store = RedisStore::builder()
        .response_timeout(Duration::from_millis(300))
        .connection_per_thread(false)
        .connect(&format!("redis://127.0.0.1:{}/", proxy.port()))
        .await
        .expect("connect");
    let mut direct = conn(&redis.url()).await;
    let before = connections_received(&mut direct).await;
    proxy.cut_open_connections();
    let mut calls = Vec::new();
    for _ in 0..100 {
        let store = store.clone();
        calls.push(tokio::spawn(async move { store.check().await.is_ok() }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut failed = 0;
    for call in calls {
        if !call.await.expect("call task") {
            failed += 1;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let made = connections_received(&mut direct).await - before;
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut direct)
        .await
        .expect("INFO");
    let open = info
        .lines()
        .find(|l| l.starts_with("connected_clients:"))
        .unwrap_or("")
        .to_owned();
    assert!(
        made <= 2,
        "one half-open connection made the store open {made} new connections \
         ({failed} of 100 calls failed; now {open}, counting this test's own and the \
         black-holed one)"
    );
}

/// A reserve Redis *answered* with a refusal (here `OOM`: a full Redis under `noeviction`, a
/// documented state in which replays go on) wrote nothing. The first version of the background
/// release started one for it anyway, trying for two leases (PostgreSQL starts one only when
/// the outcome is unknown). 4,096 new keys tried while Redis is full fill the store's cap for two
/// leases (2 minutes at the default lease). Past the cap not even the one release on the same
/// connection, which the code before this change always sent, is sent: a reserve that then
/// times out on a stalled Redis (its `SET` applied when Redis resumes) holds its key for the
/// whole lease, and the retry of a request that never ran is told 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_refusals_do_not_use_up_the_background_releases() {
    let fill: usize = 4096;
    let redis = RedisServer::start();
    let store = RedisStore::builder()
        .response_timeout(Duration::from_millis(300))
        .connection_per_thread(false)
        .connect(&redis.url())
        .await
        .expect("connect");
    let lease = Duration::from_secs(60);
    // Load the scripts (reserve, release) before Redis is full.
    let warm = scope("warm");
    let token = match store.reserve(&warm, &FP, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    let _ = store.reserve(&warm, &FP, lease).await;
    let _ = store.release(&warm, &token).await;

    set_maxmemory(&redis.url(), "1").await;
    let mut direct = conn(&redis.url()).await;
    let mut refused = 0;
    for chunk in 0..fill.div_ceil(64) {
        let tries = (0..64.min(fill - chunk * 64)).map(|i| {
            let store = store.clone();
            async move {
                store
                    .reserve(&scope(&format!("full-{chunk}-{i}")), &FP, lease)
                    .await
            }
        });
        for r in futures_util::future::join_all(tries).await {
            assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
            refused += 1;
        }
    }
    set_maxmemory(&redis.url(), "0").await;
    let evals_then = redis_server_evalsha(&mut direct).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let evals_now = redis_server_evalsha(&mut direct).await;
    eprintln!(
        "{refused} reserves refused with an answer (nothing written); EVALSHA calls in the \
         next second, Redis no longer full: {}",
        evals_now - evals_then
    );
    drop(direct);

    // Redis stalls (a slow fork, a stalled disk) while a reserve is on its way: the reserve
    // times out (503, the handler never runs), and Redis applies its `SET` when it resumes.
    let s = scope("late-apply");
    redis.signal("STOP");
    let first = store.reserve(&s, &FP, lease).await;
    redis.signal("CONT");
    assert!(
        matches!(first, Err(StoreError::Unavailable(_))),
        "{first:?}"
    );
    if let Err(answers) = retries_get_the_key(&store, &s, Duration::from_secs(5)).await {
        panic!(
            "after {refused} reserves refused with an answer (OOM), a request that never ran is \
             refused for a whole lease ({} retries over 5 s): {:?}",
            answers.len(),
            answers.last()
        );
    }
}

async fn redis_server_evalsha(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    idempotency_e2e::redis_server::command_calls(c, "evalsha").await
}

/// The store is made on a runtime that ends before the app does (a runtime of its own in a
/// synchronous `main`, a first test's runtime with the store in a `static`). The redis crate's
/// `ConnectionManager` recovers from that by itself (its next connection is made on the runtime
/// of the call that finds the old one gone), so the store works on. In the first version of the
/// replacement a replacement was spawned on the store's first runtime, which runs nothing any
/// more: the slot's `remaking` flag stayed set for good and the half-open connection was never
/// replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_first_runtime_ended_still_replaces_a_silent_connection() {
    let redis = RedisServer::start();
    let proxy = FaultyProxy::start(format!("127.0.0.1:{}", redis.port())).await;
    let url = format!("redis://127.0.0.1:{}/", proxy.port());
    let store = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(
            RedisStore::builder()
                .response_timeout(Duration::from_millis(300))
                .connection_per_thread(false)
                .connect(&url),
        )
        .expect("connect")
    })
    .join()
    .expect("thread");
    // The first runtime is gone: the store works on (after one failed call, at most).
    let mut ready = false;
    for _ in 0..20 {
        if store.check().await.is_ok() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        ready,
        "the store does not work on after its first runtime ended"
    );
    proxy.cut_open_connections();
    let started = Instant::now();
    let mut failed = 0;
    while started.elapsed() < Duration::from_secs(4) {
        if store.check().await.is_ok() {
            return;
        }
        failed += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the half-open connection was never replaced: {failed} calls failed over 4 s");
}

/// The client's retries of a request that never ran, every 500 ms for `within`: `Ok` once one
/// is reserved, else what each got.
async fn retries_get_the_key(
    store: &RedisStore,
    s: &Scope,
    within: Duration,
) -> Result<(), Vec<String>> {
    let mut answers = Vec::new();
    let started = Instant::now();
    while started.elapsed() < within {
        let retry = store.reserve(s, &FP, Duration::from_secs(60)).await;
        if matches!(retry, Ok(ReserveOutcome::Reserved { .. })) {
            return Ok(());
        }
        answers.push(format!("{retry:?}"));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(answers)
}

/// A connection that passes everything through to Redis but fails every `EVALSHA` (the
/// store's scripts) with a connection reset while `fail_scripts` is on: a reply lost when
/// Redis restarts or a failover cuts its clients, between a reserve's `SET` and its script.
/// A mock only for the cut: a real Redis answers every other command.
#[derive(Clone)]
struct ScriptsCut {
    inner: redis::aio::MultiplexedConnection,
    fail_scripts: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl redis::aio::ConnectionLike for ScriptsCut {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        let script = matches!(
            cmd.args_iter().next(),
            Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"EVALSHA")
        );
        if script && self.fail_scripts.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(async {
                Err(redis::RedisError::from(std::io::Error::from(
                    std::io::ErrorKind::ConnectionReset,
                )))
            });
        }
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.inner.req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// With `fail_open`, a store error before the handler runs the request unprotected, but never
/// one the store already saw in flight (C15). A reserve that found another request's
/// reservation (its `SET ... NX GET`) and then lost its script's reply returned only the
/// error, so the duplicate of a payment still being made ran beside it (review, 2026-12-06;
/// before: 2 runs). It now answers from the reservation it read: 409 for the same body, 422
/// for another, and gives back what the script may have written.
#[actix_web::test]
async fn a_duplicate_whose_script_reply_was_lost_is_not_run_unprotected() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    use actix_web::test::{call_service, init_service, TestRequest};
    use actix_web::{web, App, HttpResponse};
    use idempotency_actix::Idempotency;

    let redis = RedisServer::start();
    let fail_scripts = Arc::new(AtomicBool::new(false));
    let store = RedisStore::from_connection(ScriptsCut {
        inner: conn(&redis.url()).await,
        fail_scripts: Arc::clone(&fail_scripts),
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let (counted, released) = (Arc::clone(&runs), Arc::clone(&release));
    let app = init_service(
        App::new()
            .wrap(
                Idempotency::builder(store)
                    .fail_open(true)
                    .lock_timeout(Duration::from_secs(10))
                    .build(),
            )
            .route(
                "/payments",
                web::post().to(move || {
                    let (runs, release) = (Arc::clone(&counted), Arc::clone(&released));
                    async move {
                        // The first run waits until the duplicates were answered.
                        if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                            release.notified().await;
                        }
                        HttpResponse::Created().body("charged")
                    }
                }),
            ),
    )
    .await;
    let pay = |body: &'static str| {
        TestRequest::post()
            .uri("/payments")
            .insert_header(("idempotency-key", "pay-1"))
            .set_payload(body)
            .to_request()
    };
    let first = call_service(&app, pay("{\"amount\":100}"));
    let duplicates = async {
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        fail_scripts.store(true, Ordering::SeqCst);
        let same = call_service(&app, pay("{\"amount\":100}")).await.status();
        let other = call_service(&app, pay("{\"amount\":999}")).await.status();
        fail_scripts.store(false, Ordering::SeqCst);
        release.notify_waiters();
        (same.as_u16(), other.as_u16())
    };
    let (first, (same, other)) = tokio::join!(first, duplicates);
    assert_eq!(first.status().as_u16(), 201);
    assert_eq!(
        (runs.load(Ordering::SeqCst), same, other),
        (1, 409, 422),
        "handler runs, and the answers to a duplicate and to another body under the running key"
    );
}

/// A failover that moves the store's address to the new primary and leaves the old one up as
/// a replica, with its clients (a managed Redis whose DNS name follows the primary): every
/// write on the old connection is refused with `READONLY`. The redis crate keeps a connection
/// that answers, and the store replaced only silent ones, so renewals and completions failed
/// until the process restarted, while the new primary was healthy; a retry through another
/// instance then took the key over and ran the handler again (review, 2026-12-06; before: the
/// completion still failed after 5 s). A `READONLY` (or `MASTERDOWN`) answer now replaces the
/// connection, which reconnects to the address, so the next try reaches the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_primary_was_demoted_follows_its_address_to_the_new_one() {
    let failover = Failover::reserved(RedisStore::builder()).await;
    let (store, s, token, key) = (
        &failover.store,
        &failover.scope,
        &failover.token,
        &failover.key,
    );
    failover.happens().await;
    let new = &failover.new;

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match store.complete(s, token, &response(), TTL).await {
            Ok(WriteOutcome::Applied) => break,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "the completion still fails on the demoted primary: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert_eq!(state_on(&new.url(), key).await, Some(record::COMPLETED));
}

/// A primary behind an address (`proxy`), its replica, and a store over the address holding a
/// reservation that has reached the replica.
struct Failover {
    old: RedisServer,
    new: RedisServer,
    proxy: FaultyProxy,
    store: RedisStore,
    scope: Scope,
    token: ReservationToken,
    key: String,
}

impl Failover {
    async fn reserved(builder: RedisStoreBuilder) -> Failover {
        let old = RedisServer::start();
        let new = replica_of(&old).await;
        let proxy = FaultyProxy::start(format!("127.0.0.1:{}", old.port())).await;
        let store = builder
            .connect(&format!("redis://127.0.0.1:{}/", proxy.port()))
            .await
            .expect("connect");
        let scope = scope("failover");
        let key = store.key_of(&scope);
        let token = match store.reserve(&scope, &FP, TTL).await {
            Ok(ReserveOutcome::Reserved { token }) => token,
            other => panic!("expected Reserved, got {other:?}"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while state_on(&new.url(), &key).await.is_none() {
            assert!(
                Instant::now() < deadline,
                "the reservation never reached the replica"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Failover {
            old,
            new,
            proxy,
            store,
            scope,
            token,
            key,
        }
    }

    /// The replica is promoted, the old primary follows it (up, with its clients), and the
    /// address moves to the new one.
    async fn happens(&self) {
        let _: () = redis::cmd("REPLICAOF")
            .arg("NO")
            .arg("ONE")
            .query_async(&mut conn(&self.new.url()).await)
            .await
            .expect("promote");
        let _: () = redis::cmd("REPLICAOF")
            .arg("127.0.0.1")
            .arg(self.new.port())
            .query_async(&mut conn(&self.old.url()).await)
            .await
            .expect("demote");
        self.proxy.repoint(format!("127.0.0.1:{}", self.new.port()));
    }
}

/// After the failover every connection of the store reaches the demoted node, and each is
/// replaced on its first `READONLY`: the store is whole again within about a second. It
/// replaced one connection a second for the whole store, so with 8 shared connections a
/// holder's renewals and completion kept failing for some 8 s, longer than many leases, after
/// which a retry took the key over and ran the handler again (review, 2026-12-06).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_of_a_demoted_primary_is_replaced_at_once() {
    let builder = RedisStore::builder()
        .connections(8)
        .connection_per_thread(false);
    let failover = Failover::reserved(builder).await;
    failover.happens().await;
    let started = Instant::now();
    let mut in_a_row = 0;
    while in_a_row < 16 {
        let renewed = failover
            .store
            .renew_lease(&failover.scope, &failover.token, TTL)
            .await;
        if matches!(renewed, Ok(WriteOutcome::Applied)) {
            in_a_row += 1;
        } else {
            in_a_row = 0;
            assert!(
                started.elapsed() < Duration::from_secs(3),
                "renewals still fail {:?} after the failover: {renewed:?}",
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
