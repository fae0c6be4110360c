//! A release that fails (after a response that is not stored, C10) is tried again in the
//! background until the lease ends, as a failed `complete` is (C16): the client was told to fix
//! the cause and retry with the same key, so the key must not stay held by nobody for a whole
//! lease once the store is back. Shown on `PostgresStore`, with a role that may not DELETE for
//! a moment; the retry is the middleware's, the same for every store.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::database::server_url;
use idempotency_e2e::raw_http::post_json;
use idempotency_e2e::records::{
    execute, grant_store_tables, records_for_key, records_table, State, TempRole,
};
use idempotency_e2e::TestDb;

const LEASE: Duration = Duration::from_secs(20);

fn start(store: PostgresStore, runs: Arc<AtomicUsize>) -> (SocketAddr, ServerHandle) {
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
                web::post().to(|runs: web::Data<Arc<AtomicUsize>>| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    actix_web::rt::time::sleep(Duration::from_millis(800)).await;
                    // The payment provider said "try again later": not stored, key released.
                    HttpResponse::ServiceUnavailable().body("provider busy, retry")
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

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// The release after a non-stored answer fails once (the store refuses the DELETE for a
/// moment); the store is fine again 0.3 s later. The client's retry with the same key should
/// run the handler (the key was to be released), not get 409 for the rest of a 20 s lease.
#[actix_web::test]
async fn a_release_that_failed_once_does_not_hold_the_key_for_a_lease() {
    let role = TempRole::create(&server_url(), "idem_rel");
    let db = TestDb::new().await;
    let grant = grant_store_tables(&role.name);
    let revoke = format!(
        "REVOKE DELETE ON {} FROM \"{}\"",
        records_table(),
        role.name
    );
    {
        let (url, grant) = (db.url.clone(), grant.clone());
        blocking(move || execute(&url, &grant)).await;
    }
    let store = PostgresStore::builder(role.url_for(&db.url))
        .build()
        .await
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (addr, handle) = start(store, Arc::clone(&runs));

    let first = actix_web::rt::spawn(post_json(addr, "/pay", "rel-1", r#"{"amount":1}"#));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let url = db.url.clone();
        let rows = blocking(move || records_for_key(&url, "rel-1")).await;
        if rows.iter().any(|r| r.state == State::InFlight) {
            break;
        }
        assert!(Instant::now() < deadline, "no reservation");
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
    {
        let (url, revoke) = (db.url.clone(), revoke.clone());
        blocking(move || execute(&url, &revoke)).await;
    }
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, 503, "{}", first.describe());
    assert_eq!(first.problem_code(), None, "the handler's own 503");
    // The fault is over.
    {
        let (url, grant) = (db.url.clone(), grant.clone());
        blocking(move || execute(&url, &grant)).await;
    }
    let released_at = Instant::now();
    // A client that retries a few times over the next 3 s (a lease is 20 s).
    let mut answers = Vec::new();
    let retried = loop {
        actix_web::rt::time::sleep(Duration::from_millis(500)).await;
        let retry = post_json(addr, "/pay", "rel-1", r#"{"amount":1}"#)
            .await
            .unwrap();
        answers.push(
            retry
                .problem_code()
                .unwrap_or_else(|| retry.status.to_string()),
        );
        if retry.problem_code().as_deref() != Some("CONFLICT")
            || released_at.elapsed() > Duration::from_secs(3)
        {
            break retry;
        }
    };
    handle.stop(false).await;
    println!(
        "answers to the retries: {answers:?}, handler runs {}",
        runs.load(Ordering::SeqCst)
    );
    assert_ne!(
        retried.problem_code().as_deref(),
        Some("CONFLICT"),
        "the key whose handler answered a non-stored 503 is still held 3 s after the store \
         recovered (answers {answers:?}); it stays held until its 20 s lease ends"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    drop(db);
    drop(role);
}
