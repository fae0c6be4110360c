//! The current middleware on a database with a half schema (an older migration
//! whose functions the store needs are not all there yet).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{test, web, App, HttpResponse};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::database::migrate_by_hand;
use idempotency_e2e::TestDb;

/// A new app instance that starts before `idem-cli migrate` ran, on a database provisioned by
/// a build from before migration 000004 (the table and `idempotency_reserve` exist, the
/// `idempotency_complete` the store calls does not). docs/operations.md promises a 503 before
/// the handler for an unprovisioned database (C15), and `PostgresStore::check` calls this
/// schema "not provisioned"; the request path, though, reserves, runs the handler, and only
/// then fails to store the response. The key stays in flight, and once its lease ends a retry
/// takes it over and runs the handler a second time.
#[actix_web::test]
async fn a_half_schema_never_runs_a_handler_twice() {
    for upto in [2usize, 3] {
        let db = TestDb::new_unmigrated().await;
        migrate_by_hand(&db.url, upto).await;
        let store = PostgresStore::connect(&db.url).await.unwrap();
        let check = store.check().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let app = test::init_service(
            App::new()
                .wrap(
                    Idempotency::builder(store.clone())
                        .lock_timeout(Duration::from_millis(500))
                        .build(),
                )
                .route(
                    "/payments",
                    web::post().to(move || {
                        let counted = counted.clone();
                        async move {
                            counted.fetch_add(1, Ordering::SeqCst);
                            HttpResponse::Created().body("charged")
                        }
                    }),
                ),
        )
        .await;
        let mut statuses = Vec::new();
        for _ in 0..2 {
            let req = test::TestRequest::post()
                .uri("/payments")
                .insert_header(("idempotency-key", "k-1"))
                .insert_header(("content-type", "application/json"))
                .set_payload(r#"{"amount":100}"#)
                .to_request();
            let resp = test::call_service(&app, req).await;
            statuses.push(resp.status().as_u16());
            actix_web::rt::time::sleep(Duration::from_millis(2500)).await;
        }
        assert!(check.is_err(), "check() on a database at {upto}: {check:?}");
        assert!(
            runs.load(Ordering::SeqCst) <= 1,
            "database at migration {upto} (check(): {check:?}): the handler ran {} times \
             for one key; statuses {statuses:?}",
            runs.load(Ordering::SeqCst)
        );
    }
}
