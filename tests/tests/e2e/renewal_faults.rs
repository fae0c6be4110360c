//! Lease renewal (C9) over PostgreSQL with the store's default timeouts, when one statement is
//! stuck on its connection (a half-dead path: the statement never reaches the server) while
//! the database answers every other connection at once. Found by review, 2026-12-04: the
//! heartbeat waited on the stuck renewal until `query_timeout` (5 s by default); with a 6 s
//! lease the lease ended meanwhile, and a retry through another instance ran the handler a
//! second time (`first: 201 retry: 201`, 2 runs). Renewals now run on tasks of their own, and
//! one that has not answered gets a companion.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::proxy::{at_local_port, delaying_proxy, host_port, Hold};
use idempotency_e2e::raw_http::post_json;
use idempotency_e2e::TestDb;

const LEASE: Duration = Duration::from_secs(6);

/// One app instance on `store`: a payment handler of `handler` that counts its runs, 6 s
/// leases.
fn start(
    store: PostgresStore,
    runs: Arc<AtomicUsize>,
    handler: Duration,
) -> (SocketAddr, ServerHandle) {
    let runs = web::Data::new(runs);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(runs.clone())
            .wrap(
                Idempotency::builder(store.clone())
                    .lock_timeout(LEASE)
                    .build(),
            )
            .route(
                "/pay",
                web::post().to(move |runs: web::Data<Arc<AtomicUsize>>| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    actix_web::rt::time::sleep(handler).await;
                    HttpResponse::Created().body("paid")
                }),
            )
    })
    .workers(1)
    .disable_signals()
    .bind(("127.0.0.1", 0))
    .unwrap();
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    actix_web::rt::spawn(server);
    (addr, handle)
}

/// A payment whose handler takes `handler`, sent to instance A, which reaches the database
/// through a proxy that holds back the first statement containing `stuck` for a minute (one
/// stuck connection; everything else flows); the client's retry goes to instance B (direct)
/// `retry_after` later. Both stores keep `PostgresStore`'s defaults (connection timeout 2 s,
/// query timeout 5 s). Asserts the first got 201, the retry 409, and one run.
async fn one_stuck_statement(stuck: &'static [u8], handler: Duration, retry_after: Duration) {
    let db = TestDb::new().await;
    let (port, armed) = delaying_proxy(
        host_port(&db.url),
        Hold::Statement,
        stuck,
        Duration::from_secs(60),
    )
    .await;
    let store_a = PostgresStore::builder(at_local_port(&db.url, port))
        .build()
        .await
        .unwrap();
    // The store's one-time schema probe names the functions too: let it pass before arming.
    store_a.check().await.unwrap();
    AtomicBool::store(&armed, true, Ordering::SeqCst);
    let store_b = PostgresStore::builder(db.url.as_str())
        .build()
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (addr_a, handle_a) = start(store_a, Arc::clone(&runs), handler);
    let (addr_b, handle_b) = start(store_b, Arc::clone(&runs), handler);
    let body = r#"{"amount": 500}"#;
    let first = actix_web::rt::spawn(async move { post_json(addr_a, "/pay", "k", body).await });
    actix_web::rt::time::sleep(retry_after).await;
    let retry = post_json(addr_b, "/pay", "k", body).await.unwrap();
    let first = first.await.unwrap().unwrap();
    let n = runs.load(Ordering::SeqCst);
    handle_a.stop(false).await;
    handle_b.stop(false).await;
    assert_eq!(first.status, 201);
    assert_eq!(
        n, 1,
        "the payment handler ran {n} times for one key (retry: {})",
        retry.status
    );
    assert_eq!(
        retry.status, 409,
        "the retry was not refused while the key was held"
    );
}

/// The renewal's UPDATE (its Parse names `locked_until`; nothing else A sends does) stuck:
/// the first renewal is due at 2 s and stuck until 7 s; the retry comes just after the first
/// lease would have ended without renewal (6.5 s), while the 9 s handler still runs.
#[actix_web::test]
async fn one_stuck_renewal_statement_does_not_let_a_retry_run_the_handler_again() {
    let retry_after = LEASE + Duration::from_millis(500);
    one_stuck_statement(b"locked_until", Duration::from_secs(9), retry_after).await;
}

/// The same at the end of the request: renewal used to stop before `complete`, so a
/// `complete` stuck on its connection (until `query_timeout`) ran on what was left of the
/// lease. Handler 3.9 s, lease 6 s: renewed at 2 s (lease to 8 s), `complete` sent at 3.9 s
/// and stuck until 8.9 s; a client that gave up on its first attempt retries at 8.3 s through
/// another instance (found by review, 2026-12-04: 2 runs). Renewal now goes on while the
/// response is stored.
#[actix_web::test]
async fn one_stuck_complete_statement_does_not_let_a_retry_run_the_handler_again() {
    let handler = Duration::from_millis(3900);
    one_stuck_statement(
        b"idempotency_complete",
        handler,
        Duration::from_millis(8300),
    )
    .await;
}
