//! The current middleware on a database with a half schema (an older migration
//! whose functions the store needs are not all there yet).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{test, web, App, HttpResponse};
use diesel_async::SimpleAsyncConnection;
use idempotency_actix::store::postgres::{self, PostgresStore};
use idempotency_actix::Idempotency;
use idempotency_e2e::TestDb;

fn migrations_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations")
}

async fn migrate_by_hand(url: &str, upto: usize) {
    let mut conn = postgres::establish(url).await.unwrap();
    let mut names: Vec<String> = std::fs::read_dir(migrations_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    conn.batch_execute(
        "CREATE TABLE __diesel_schema_migrations (version VARCHAR(50) PRIMARY KEY NOT NULL, \
         run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .await
    .unwrap();
    for name in names.iter().take(upto) {
        let sql = std::fs::read_to_string(migrations_dir().join(name).join("up.sql")).unwrap();
        conn.batch_execute(&format!("BEGIN; {sql}; COMMIT;"))
            .await
            .unwrap();
        let version = name.split('_').next().unwrap().replace('-', "");
        conn.batch_execute(&format!(
            "INSERT INTO __diesel_schema_migrations (version) VALUES ('{version}')"
        ))
        .await
        .unwrap();
    }
}

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
