//! Configuration values at their extremes (a review of 2026-12-05). Every value a builder ACCEPTS must
//! leave a middleware/store that serves: no 503 forever, no panic, no absurd `Retry-After`,
//! no second run of a handler.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpResponse};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, MemoryStore, ReserveOutcome, Scope, StoreError,
};
use idempotency_actix::Idempotency;
use idempotency_e2e::TestDb;

const FP: Fingerprint = Fingerprint([7; 32]);

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "acct_1".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

/// A store the builder accepted must serve a reserve; refusing the value in `build` is the
/// other acceptable answer.
async fn accepted_store_serves(built: Result<PostgresStore, StoreError>, what: &str) {
    let store = match built {
        Err(refused) => {
            eprintln!("{what}: refused at build time: {refused}");
            return;
        }
        Ok(store) => store,
    };
    let mut answers = Vec::new();
    for i in 0..3 {
        let outcome = store
            .reserve(&scope(&format!("k-{i}")), &FP, Duration::from_secs(60))
            .await;
        answers.push(format!("{outcome:?}"));
        if matches!(outcome, Ok(ReserveOutcome::Reserved { .. })) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "{what}: accepted by PostgresStoreBuilder::build, but every reserve fails: {answers:#?}"
    );
}

/// `statement_timeout` past PostgreSQL's range (i32::MAX ms, ~24.8 days; `idem-cli` refuses
/// the same value for its own `--statement-timeout`): the builder accepts it, connections are
/// lazy so `build` succeeds, and then every connection is refused by the server: 503 forever.
#[tokio::test]
async fn cfg_statement_timeout_past_postgres_range_is_refused_or_works() {
    let db = TestDb::new().await;
    for timeout in [Duration::from_secs(30 * 24 * 3600), Duration::MAX] {
        let built = PostgresStore::builder(db.url.clone())
            .statement_timeout(Some(timeout))
            .build()
            .await;
        accepted_store_serves(built, &format!("statement_timeout(Some({timeout:?}))")).await;
    }
}

/// `query_timeout(Some(0))` (or 1 ns): accepted, and every statement "times out" on its first
/// poll: 503 forever (and each reserve may still commit on the server, leaving a key held
/// by nobody until the background release).
#[tokio::test]
async fn cfg_zero_query_timeout_is_refused_or_works() {
    let db = TestDb::new().await;
    for timeout in [Duration::ZERO, Duration::from_nanos(1)] {
        let built = PostgresStore::builder(db.url.clone())
            .query_timeout(Some(timeout))
            .build()
            .await;
        accepted_store_serves(built, &format!("query_timeout(Some({timeout:?}))")).await;
    }
}

/// `retry_after(Duration::MAX)` is accepted and sent as `Retry-After: 18446744073709551615`
/// (584 billion years): a client honouring it never retries.
#[actix_web::test]
async fn cfg_retry_after_is_refused_or_sane() {
    let built = Idempotency::builder(MemoryStore::new())
        .retry_after(Duration::MAX)
        .try_build();
    let Ok(middleware) = built else {
        return;
    };
    let app = init_service(App::new().wrap(middleware).route(
        "/slow",
        web::post().to(|| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            HttpResponse::Created().body("ok")
        }),
    ))
    .await;
    let first = call_service(
        &app,
        TestRequest::post()
            .uri("/slow")
            .insert_header(("idempotency-key", "ra-1"))
            .set_payload("x")
            .to_request(),
    );
    let second = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        call_service(
            &app,
            TestRequest::post()
                .uri("/slow")
                .insert_header(("idempotency-key", "ra-1"))
                .set_payload("x")
                .to_request(),
        )
        .await
    };
    let (_first, second) = tokio::join!(first, second);
    assert_eq!(second.status(), 409);
    let retry_after: u64 = second
        .headers()
        .get("retry-after")
        .expect("a Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        retry_after <= 24 * 3600,
        "retry_after(Duration::MAX) was accepted and answered Retry-After: {retry_after}"
    );
}

/// `ttl(Duration::ZERO)` (and 1 ns) is accepted; a completed response is then never replayed,
/// so a client's plain sequential retry runs the handler a second time (a double charge) on
/// every store. Either `try_build` refuses it, or the retry must not run the handler.
#[actix_web::test]
async fn cfg_zero_ttl_is_refused_or_replays() {
    for ttl in [Duration::ZERO, Duration::from_nanos(1)] {
        let built = Idempotency::builder(MemoryStore::new())
            .ttl(ttl)
            .try_build();
        let Ok(middleware) = built else {
            continue;
        };
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&runs);
        let app = init_service(App::new().wrap(middleware).route(
            "/pay",
            web::post().to(move || {
                let counted = Arc::clone(&counted);
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    HttpResponse::Created().body("charged")
                }
            }),
        ))
        .await;
        for _ in 0..2 {
            let response = call_service(
                &app,
                TestRequest::post()
                    .uri("/pay")
                    .insert_header(("idempotency-key", "ttl-0"))
                    .set_payload("x")
                    .to_request(),
            )
            .await;
            assert_eq!(response.status(), 201);
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "ttl({ttl:?}) was accepted by try_build and a sequential retry ran the handler again"
        );
    }
}

/// Redis timeouts of zero: accepted by the builder; `connect` must either refuse them (with
/// an error naming the setting) or give a store that serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cfg_redis_zero_timeouts_are_refused_or_work() {
    use idempotency_actix::store::redis::RedisStore;
    let server = idempotency_e2e::redis_server::RedisServer::start();
    let mut failures = Vec::new();
    for (what, builder) in [
        (
            "response_timeout(0)",
            RedisStore::builder().response_timeout(Duration::ZERO),
        ),
        (
            "connection_timeout(0)",
            RedisStore::builder().connection_timeout(Duration::ZERO),
        ),
    ] {
        // The outcome is timing-dependent: try a few times (connect, then 20 reserves).
        for attempt in 0..5 {
            match builder.clone().connect(&server.url()).await {
                Err(refused) => {
                    if matches!(refused, StoreError::Unavailable(_)) {
                        failures.push(format!(
                            "{what} (attempt {attempt}): refused as if Redis were down: {refused:?}"
                        ));
                    }
                }
                Ok(store) => {
                    for i in 0..20 {
                        let key = format!("{what}-{attempt}-{i}");
                        match store.reserve(&scope(&key), &FP, Duration::from_secs(60)).await {
                            Ok(ReserveOutcome::Reserved { .. }) => {}
                            other => failures.push(format!(
                                "{what} (attempt {attempt}): accepted, then reserve {i} gave {other:?}"
                            )),
                        }
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn maximal<S>(
    b: idempotency_actix::IdempotencyBuilder<S>,
) -> idempotency_actix::IdempotencyBuilder<S> {
    b.ttl(Duration::MAX)
        .lock_timeout(Duration::MAX)
        .renew_lease_up_to(Duration::MAX)
        .wait_for_in_flight(Duration::MAX)
        .max_body_bytes(usize::MAX)
        .max_response_bytes(usize::MAX)
        .max_key_len(usize::MAX)
}

async fn serve_extremes<S: IdempotencyStore + Clone>(store: S, what: &str) {
    serve_extremes_with(maximal(Idempotency::builder(store)).build(), what).await;
}

async fn serve_extremes_with<S: IdempotencyStore>(middleware: Idempotency<S>, what: &str) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = init_service(
        App::new()
            .wrap(middleware)
            .route(
                "/pay",
                web::post().to(move || {
                    let counted = Arc::clone(&counted);
                    async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        HttpResponse::Created().body("charged")
                    }
                }),
            )
            .route(
                "/bad",
                web::post().to(|| async { HttpResponse::BadRequest().body("no") }),
            )
            .route(
                "/err",
                web::post().to(|| async {
                    Err::<HttpResponse, _>(actix_web::error::ErrorInternalServerError("boom"))
                }),
            ),
    )
    .await;
    let req = |path: &str, key: &str| {
        TestRequest::post()
            .uri(path)
            .insert_header(("idempotency-key", key.to_owned()))
            .set_payload("x")
            .to_request()
    };
    let (a, b) = tokio::join!(call_service(&app, req("/pay", "p1")), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        call_service(&app, req("/pay", "p1")).await
    });
    assert_eq!(
        (a.status().as_u16(), b.status().as_u16()),
        (201, 201),
        "{what}"
    );
    let c = call_service(&app, req("/pay", "p1")).await;
    assert_eq!(c.status(), 201, "{what}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{what}: runs");
    for _ in 0..2 {
        assert_eq!(
            call_service(&app, req("/bad", "b1")).await.status(),
            400,
            "{what}"
        );
        assert_eq!(
            call_service(&app, req("/err", "e1")).await.status(),
            500,
            "{what}"
        );
    }
}

/// The maxima of every middleware setting, on each store: miss, waiting duplicate, replay,
/// non-2xx and handler error all served.
#[actix_web::test]
async fn cfg_maximal_settings_serve_on_every_store() {
    // The memory store reserves room for each response up front, so `max_response_bytes` may
    // not exceed its allowance: both as large as the byte bound leaves room for.
    let memory = MemoryStore::builder()
        .max_bytes(usize::MAX)
        .response_allowance(usize::MAX / 2)
        .build();
    serve_extremes_with(
        maximal(Idempotency::builder(memory))
            .max_response_bytes(usize::MAX / 2)
            .build(),
        "memory",
    )
    .await;
    let db = TestDb::new().await;
    let pg = PostgresStore::connect(&db.url).await.unwrap();
    serve_extremes(pg, "postgres").await;
    let server = idempotency_e2e::redis_server::RedisServer::start();
    let redis = idempotency_actix::store::redis::RedisStore::connect(&server.url())
        .await
        .unwrap();
    serve_extremes(redis, "redis").await;
}

#[actix_web::test]
async fn cfg_maximal_settings_serve_transactional() {
    let db = TestDb::new().await;
    let pg = PostgresStore::connect(&db.url).await.unwrap();
    serve_extremes_with(
        maximal(Idempotency::builder(pg)).transactional().build(),
        "transactional",
    )
    .await;
}

/// `apply_pending_migrations(.., lock_wait)` is public and takes any `Duration`: "forever"
/// (`Duration::MAX`) must not panic (`Instant::now() + wait` in `take_lock`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cfg_migration_lock_wait_duration_max_does_not_panic() {
    use diesel_async::AsyncConnection;
    use idempotency_actix::store::postgres;
    let db = TestDb::new_unmigrated().await;
    let conn = diesel_async::AsyncPgConnection::establish(&db.url)
        .await
        .unwrap();
    let applied = tokio::task::spawn_blocking(move || {
        let mut harness = postgres::Harness::from(conn);
        postgres::apply_pending_migrations(&mut harness, None, Duration::MAX).map(|v| v.len())
    })
    .await;
    match applied {
        Ok(Ok(n)) => assert!(n > 0),
        Ok(Err(error)) => panic!("migrations failed: {error}"),
        Err(panicked) => panic!("apply_pending_migrations(.., Duration::MAX) panicked: {panicked}"),
    }
}

/// `establish_within(url, Duration::MAX)` (public, used by tools): no panic, a connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cfg_establish_within_duration_max_connects() {
    let db = TestDb::new().await;
    let conn = idempotency_actix::store::postgres::establish_within(&db.url, Duration::MAX).await;
    assert!(conn.is_ok(), "{:?}", conn.err());
    // The server the harness chose, listed twice (not 5432: a fresh CI uses a throwaway
    // cluster on another port, where replacing "127.0.0.1:5432" changed nothing).
    let host_port = idempotency_e2e::proxy::host_port(&db.url);
    let two_hosts = db
        .url
        .replacen(&host_port, &format!("{host_port},{host_port}"), 1);
    assert_ne!(two_hosts, db.url, "no host list made of {}", db.url);
    let conn =
        idempotency_actix::store::postgres::establish_within(&two_hosts, Duration::MAX).await;
    assert!(conn.is_ok(), "{two_hosts}: {:?}", conn.err());
}
