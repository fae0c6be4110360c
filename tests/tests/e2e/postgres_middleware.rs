//! The middleware over `PostgresStore`, end to end over HTTP: exactly-once across two app
//! instances sharing one database, and the fault answers of C15 (503 before the handler runs).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use diesel::sql_types::{BigInt, Text};
use diesel_async::RunQueryDsl;
use futures_util::future::join_all;
use futures_util::StreamExt;
use idempotency_actix::store::postgres::{self, PostgresStore};
use idempotency_actix::Idempotency;
use idempotency_e2e::proxy::PgProxy;
use idempotency_e2e::raw_http::{post_json, Response};
use idempotency_e2e::TestDb;

/// What the handler of one app instance knows.
#[derive(Clone)]
struct Instance {
    name: &'static str,
    store: PostgresStore,
    /// Handler runs seen by this process (the database table is the real count).
    runs: Arc<AtomicUsize>,
}

/// Records the execution in the shared database, then answers with a body unique to this
/// execution (a nonce), so a replay can be told from a second execution.
async fn pay(req: HttpRequest, body: web::Bytes, instance: web::Data<Instance>) -> HttpResponse {
    instance.runs.fetch_add(1, Ordering::SeqCst);
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    // Long enough that duplicates arrive while the first execution is still running.
    actix_web::rt::time::sleep(Duration::from_millis(100)).await;
    let mut conn = instance.store.pool().get().await.unwrap();
    diesel::sql_query("INSERT INTO executions (idempotency_key, instance) VALUES ($1, $2)")
        .bind::<Text, _>(&key)
        .bind::<Text, _>(instance.name)
        .execute(&mut conn)
        .await
        .unwrap();
    let nonce = idempotency_actix::store::ReservationToken::random().as_uuid();
    HttpResponse::Created().json(serde_json::json!({
        "key": key,
        "instance": instance.name,
        "nonce": nonce.to_string(),
        "request_bytes": body.len(),
    }))
}

/// [`pay`] after a wait far longer than the lease the slow-handler test gives it.
async fn slow_pay(
    req: HttpRequest,
    body: web::Bytes,
    instance: web::Data<Instance>,
) -> HttpResponse {
    actix_web::rt::time::sleep(SLOW_HANDLER).await;
    pay(req, body, instance).await
}

/// [`pay`], answered at once with a streamed body whose last chunk comes [`SLOW_HANDLER`]
/// later (a receipt rendered as it is sent).
async fn streamed_pay(
    req: HttpRequest,
    body: web::Bytes,
    instance: web::Data<Instance>,
) -> HttpResponse {
    let paid = pay(req, body, instance).await;
    let status = paid.status();
    let first = actix_web::body::to_bytes(paid.into_body())
        .await
        .unwrap_or_default();
    let last = web::Bytes::from_static(b"\n");
    let chunks = futures_util::stream::iter([(first, Duration::ZERO), (last, SLOW_HANDLER)]).then(
        |(chunk, wait)| async move {
            actix_web::rt::time::sleep(wait).await;
            Ok::<_, std::io::Error>(chunk)
        },
    );
    HttpResponse::build(status)
        .content_type("application/json")
        .streaming(chunks)
}

/// How long [`slow_pay`] waits: five leases of [`SHORT_LEASE`].
const SLOW_HANDLER: Duration = Duration::from_secs(5);
/// Renewed every third of it; long enough that a renewal delayed by a busy machine (a test
/// beside this one filling the database) is still in time: it may come up to 2/3 s late.
const SHORT_LEASE: Duration = Duration::from_secs(1);

/// Start one app instance with its own store (its own pool) on a free port.
fn start_instance(instance: Instance) -> (SocketAddr, ServerHandle) {
    start_instance_with(instance, None)
}

/// [`start_instance`], with `lease` as `lock_timeout` if given; `/slow-payments` is
/// [`slow_pay`], `/streamed-payments` [`streamed_pay`].
fn start_instance_with(instance: Instance, lease: Option<Duration>) -> (SocketAddr, ServerHandle) {
    let store = instance.store.clone();
    let data = web::Data::new(instance);
    let server = HttpServer::new(move || {
        let builder = Idempotency::builder(store.clone());
        let middleware = match lease {
            Some(lease) => builder.lock_timeout(lease).build(),
            None => builder.build(),
        };
        App::new()
            .app_data(data.clone())
            .wrap(middleware)
            .route("/payments", web::post().to(pay))
            .route("/slow-payments", web::post().to(slow_pay))
            .route("/streamed-payments", web::post().to(streamed_pay))
    })
    .workers(2)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .unwrap();
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    (addr, handle)
}

async fn create_executions_table(url: &str) {
    let mut conn = postgres::establish(url).await.unwrap();
    diesel::sql_query(
        "CREATE TABLE executions (idempotency_key TEXT NOT NULL, instance TEXT NOT NULL, \
         at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
    )
    .execute(&mut conn)
    .await
    .unwrap();
}

#[derive(diesel::QueryableByName)]
struct KeyCount {
    #[diesel(sql_type = Text)]
    idempotency_key: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn executions(url: &str) -> HashMap<String, i64> {
    let mut conn = postgres::establish(url).await.unwrap();
    diesel::sql_query(
        "SELECT idempotency_key, count(*) AS n FROM executions GROUP BY idempotency_key",
    )
    .load::<KeyCount>(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .map(|r| (r.idempotency_key, r.n))
    .collect()
}

/// Two app instances on `db`, with separate pools, as two app processes would have:
/// instance-a with a pool per worker thread (`pool_per_thread`), instance-b with one shared
/// pool, so both ways of holding connections race for the same keys. `lease` as in
/// [`start_instance_with`].
async fn two_instances(
    db: &TestDb,
    runs: &Arc<AtomicUsize>,
    lease: Option<Duration>,
) -> (Vec<SocketAddr>, Vec<ServerHandle>) {
    let mut addrs = Vec::new();
    let mut handles = Vec::new();
    for name in ["instance-a", "instance-b"] {
        let store = PostgresStore::builder(db.url.as_str())
            .pool_per_thread((name == "instance-a").then_some(2))
            .build()
            .await
            .unwrap();
        let instance = Instance {
            name,
            store,
            runs: Arc::clone(runs),
        };
        let (addr, handle) = start_instance_with(instance, lease);
        addrs.push(addr);
        handles.push(handle);
    }
    (addrs, handles)
}

#[actix_web::test]
async fn exactly_once_across_two_instances_sharing_one_database() {
    let db = TestDb::new().await;
    create_executions_table(&db.url).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (addrs, handles) = two_instances(&db, &runs, None).await;

    const KEYS: usize = 20;
    const DUPLICATES: usize = 16;
    let body = |k: usize| format!("{{\"amount\": {}, \"currency\": \"EUR\"}}", 100 + k);
    let requests = (0..KEYS).flat_map(|k| (0..DUPLICATES).map(move |d| (k, d)));
    let responses: Vec<(usize, Response)> = join_all(requests.map(|(k, d)| {
        let addr = addrs[d % 2];
        let body = body(k);
        async move {
            let key = format!("key-{k}");
            (k, post_json(addr, "/payments", &key, &body).await.unwrap())
        }
    }))
    .await;

    // Every duplicate got either the one stored response or 409 while it was running.
    let mut first_bodies: HashMap<usize, Vec<u8>> = HashMap::new();
    let mut conflicts = Vec::new();
    for (k, response) in &responses {
        match response.status {
            201 => {
                let seen = first_bodies
                    .entry(*k)
                    .or_insert_with(|| response.body.clone());
                assert_eq!(seen, &response.body, "key {k}: two different 201 bodies");
            }
            409 => {
                assert!(
                    response.header("retry-after").is_some(),
                    "409 without Retry-After"
                );
                conflicts.push(*k);
            }
            other => panic!("key {k}: unexpected status {other}: {:?}", response),
        }
    }

    // Retry the conflicts once the first executions are surely done: all are replays.
    actix_web::rt::time::sleep(Duration::from_millis(300)).await;
    for k in conflicts {
        let response = post_json(addrs[k % 2], "/payments", &format!("key-{k}"), &body(k))
            .await
            .unwrap();
        assert_eq!(response.status, 201, "{response:?}");
        assert!(response.is_replay(), "{response:?}");
        let seen = first_bodies
            .entry(k)
            .or_insert_with(|| response.body.clone());
        assert_eq!(
            seen, &response.body,
            "key {k}: replay differs from the original"
        );
    }

    let counted = executions(&db.url).await;
    assert_eq!(counted.len(), KEYS, "every key executed: {counted:?}");
    assert!(
        counted.values().all(|n| *n == 1),
        "exactly once per key: {counted:?}"
    );
    assert_eq!(AtomicUsize::load(&runs, Ordering::SeqCst), KEYS);

    for handle in handles {
        handle.stop(false).await;
    }
}

/// C9 across instances: a handler that runs five leases long keeps its key, because its
/// instance renews the lease in the database while it runs. A retry sent to the other
/// instance after the first lease ended gets 409 instead of a second execution, and the retry
/// after the handler finished replays its response.
#[actix_web::test]
async fn a_slow_handler_keeps_its_key_across_instances() {
    keeps_its_key_across_instances("/slow-payments").await;
}

/// C9, C24 across instances: a handler that pays at once and streams its body for five leases
/// keeps its key until the body has ended and is stored (renewal used to stop when the
/// handler returned, so the retries ran it again).
#[actix_web::test]
async fn a_streamed_body_keeps_its_key_across_instances() {
    keeps_its_key_across_instances("/streamed-payments").await;
}

/// One request to `path` (on the first instance) that takes five leases, retries through the
/// other instance while it runs, and one after it.
async fn keeps_its_key_across_instances(path: &str) {
    let db = TestDb::new().await;
    create_executions_table(&db.url).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (addrs, handles) = two_instances(&db, &runs, Some(SHORT_LEASE)).await;
    let body = r#"{"amount": 500, "currency": "EUR"}"#;
    let first = post_json(addrs[0], path, "slow-1", body);
    let start = tokio::time::Instant::now();
    let retries = async {
        let mut answers = Vec::new();
        // Retries through the other instance at 1.2, 2.4 and 3.6 s: past the first lease,
        // well before the handler ends.
        for n in 1..=3 {
            let at = start + (SHORT_LEASE + Duration::from_millis(200)) * n;
            tokio::time::sleep_until(at).await;
            answers.push(post_json(addrs[1], path, "slow-1", body).await);
        }
        answers
    };
    let (first, retries) = tokio::join!(first, retries);
    let first = first.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    for retry in retries {
        let retry = retry.unwrap();
        assert_eq!(
            retry.status, 409,
            "a retry while the handler ran was not refused: {retry:?}"
        );
    }
    let replay = post_json(addrs[1], path, "slow-1", body).await.unwrap();
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(executions(&db.url).await.get("slow-1"), Some(&1));
    assert_eq!(AtomicUsize::load(&runs, Ordering::SeqCst), 1);
    for handle in handles {
        handle.stop(false).await;
    }
}

fn assert_storage_unavailable(response: &Response) -> serde_json::Value {
    assert_eq!(response.status, 503, "{response:?}");
    assert!(
        response
            .header("content-type")
            .is_some_and(|c| c.starts_with("application/problem+json")),
        "{response:?}"
    );
    assert!(response.header("retry-after").is_some(), "{response:?}");
    let problem = response.json();
    assert_eq!(problem["code"], "STORAGE_UNAVAILABLE", "{problem}");
    assert_eq!(problem["status"], 503, "{problem}");
    problem
}

#[actix_web::test]
async fn missing_table_answers_503_with_the_migrate_hint() {
    let db = TestDb::new_unmigrated().await;
    create_executions_table(&db.url).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let (addr, handle) = start_instance(Instance {
        name: "unprovisioned",
        store,
        runs: Arc::clone(&runs),
    });

    let response = post_json(addr, "/payments", "k1", "{}").await.unwrap();
    let problem = assert_storage_unavailable(&response);
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("idem-cli migrate"), "{problem}");
    assert_eq!(
        AtomicUsize::load(&runs, Ordering::SeqCst),
        0,
        "fail closed: the handler must not run"
    );

    // Provisioning fixes it without a restart.
    postgres::run_migrations(&db.url).await.unwrap();
    let response = post_json(addr, "/payments", "k1", "{}").await.unwrap();
    assert_eq!(response.status, 201, "{response:?}");
    assert_eq!(AtomicUsize::load(&runs, Ordering::SeqCst), 1);
    handle.stop(false).await;
}

#[actix_web::test]
async fn unreachable_database_answers_503_quickly_and_recovers() {
    unreachable_database_answers_503_quickly_and_recovers_with(None).await;
}

/// The same with a pool per worker thread: each worker's pool sees the outage and recovers.
#[actix_web::test]
async fn unreachable_database_answers_503_quickly_and_recovers_with_a_pool_per_thread() {
    unreachable_database_answers_503_quickly_and_recovers_with(Some(2)).await;
}

async fn unreachable_database_answers_503_quickly_and_recovers_with(pool_per_thread: Option<u32>) {
    let db = TestDb::new().await;
    create_executions_table(&db.url).await;
    let proxy = PgProxy::for_url(&db.url).await.unwrap();
    let timeout = Duration::from_millis(800);
    let store = PostgresStore::builder(proxy.url_through(&db.url))
        .connection_timeout(timeout)
        .pool_per_thread(pool_per_thread)
        .build()
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (addr, handle) = start_instance(Instance {
        name: "flaky",
        // The handler records its executions through the same pool (and proxy).
        store: store.clone(),
        runs: Arc::clone(&runs),
    });

    // Warm: the pool holds connections through the proxy.
    let ok = post_json(addr, "/payments", "before", "{}").await.unwrap();
    assert_eq!(ok.status, 201, "{ok:?}");
    let runs_before = AtomicUsize::load(&runs, Ordering::SeqCst);

    // The database goes away: open connections are cut and new ones refused.
    proxy.stop();
    for key in ["down-1", "down-2", "down-3"] {
        let started = Instant::now();
        let response = post_json(addr, "/payments", key, "{}").await.unwrap();
        let elapsed = started.elapsed();
        assert_storage_unavailable(&response);
        assert!(
            elapsed < timeout + Duration::from_millis(500),
            "503 took {elapsed:?}, timeout is {timeout:?}"
        );
    }
    assert_eq!(
        AtomicUsize::load(&runs, Ordering::SeqCst),
        runs_before,
        "handler must not run while down"
    );

    // It comes back: the next request succeeds.
    proxy.resume().await.unwrap();
    let response = post_json(addr, "/payments", "after", "{}").await.unwrap();
    assert_eq!(response.status, 201, "{response:?}");
    handle.stop(false).await;
}

/// A scope PostgreSQL cannot hold, chosen by the client: a `%00` in a path parameter (the
/// router decodes it to a NUL, which `text` refuses) used to get 503 every time, and with
/// `fail_open` ran the handler unprotected on every retry; a path too long for the index did
/// the second still without that fix. Now the NUL is escaped in the scope (one record, then a
/// replay), and an error about the request itself is never failed open (found by review,
/// 2026-12-04); since 2026-12-06 a path too long for the index is refused before the store
/// is called, with a final 400 `SCOPE_TOO_LONG` (it was a 503 every time).
#[actix_web::test]
async fn a_scope_the_client_chose_is_never_run_twice() {
    use actix_web::test::{call_service, init_service, TestRequest};
    let db = TestDb::new().await;
    // 6000 pseudo-random hex digits: too long for the primary-key index even compressed.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let long_path: String = (0..6000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b"0123456789abcdef"[(x & 15) as usize])
        })
        .collect();
    let long_path = format!("/items/{long_path}");
    let mut seen = Vec::new();
    for fail_open in [false, true] {
        let runs = Arc::new(AtomicUsize::new(0));
        let store = PostgresStore::connect(&db.url).await.expect("store");
        let counted = Arc::clone(&runs);
        let app = init_service(
            App::new()
                .wrap(Idempotency::builder(store).fail_open(fail_open).build())
                .route(
                    "/items/{name}",
                    web::post().to(move || {
                        let runs = Arc::clone(&counted);
                        async move {
                            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                            HttpResponse::Created().body(format!("charge {n}"))
                        }
                    }),
                ),
        )
        .await;
        for path in ["/items/a%00b".to_owned(), long_path.clone()] {
            runs.store(0, Ordering::SeqCst);
            let mut statuses = Vec::new();
            for _ in 0..2 {
                let request = TestRequest::post()
                    .uri(&path)
                    .insert_header(("idempotency-key", format!("k-{fail_open}")))
                    .set_payload("x")
                    .to_request();
                statuses.push(call_service(&app, request).await.status().as_u16());
            }
            let ran = AtomicUsize::load(&runs, Ordering::SeqCst);
            seen.push((fail_open, path.len(), statuses, ran));
        }
    }
    // (fail_open, path length, statuses, handler runs)
    let expected = |fail_open: bool, len: usize| {
        if len < 100 {
            (fail_open, len, vec![201, 201], 1)
        } else {
            (fail_open, len, vec![400, 400], 0)
        }
    };
    for got in &seen {
        assert_eq!(*got, expected(got.0, got.1), "{seen:?}");
    }
}
