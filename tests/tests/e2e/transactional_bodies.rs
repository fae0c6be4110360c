//! Transactional mode and response bodies that are slow or never end (found by a review,
//! 2026-12-05): the body is buffered before COMMIT while the transaction sits idle, so a body
//! that never ends must not hold the request's pooled connection for ever.

use std::time::Duration;

use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse};
use bytes::Bytes;
use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::{Idempotency, IdempotentTx};
use idempotency_e2e::records::{count, execute};
use idempotency_e2e::TestDb;

const PAYMENTS: &str = "CREATE TABLE payments (id bigserial PRIMARY KEY, amount bigint NOT NULL)";

async fn insert(tx: &IdempotentTx) -> actix_web::Result<()> {
    let mut conn = tx.conn();
    diesel::sql_query("INSERT INTO payments (amount) VALUES (1)")
        .execute(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok(())
}

/// A payment whose 201 body comes from a stream that never ends (an upstream that hangs).
async fn stalls(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
    insert(&tx).await?;
    Ok(
        HttpResponse::Created().streaming(futures_util::stream::pending::<
            Result<Bytes, actix_web::Error>,
        >()),
    )
}

async fn pays(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
    insert(&tx).await?;
    Ok(HttpResponse::Created().body("paid"))
}

fn post(uri: &str, key: &str) -> test::TestRequest {
    test::TestRequest::post()
        .uri(uri)
        .insert_header(("idempotency-key", key))
        .set_payload("{}")
}

async fn status<S, B>(app: &S, req: test::TestRequest) -> (StatusCode, String)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    match app.call(req.to_request()).await {
        Ok(response) => {
            let status = response.status();
            let body = test::read_body(response.map_into_boxed_body()).await;
            (status, String::from_utf8_lossy(&body).into_owned())
        }
        Err(error) => (error.error_response().status(), error.to_string()),
    }
}

/// A slow body: it ends after 3 s, past the idle limit of [`after_a_stalled_body`].
async fn slow(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
    insert(&tx).await?;
    let body = futures_util::stream::once(async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        Ok::<_, actix_web::Error>(Bytes::from_static(b"late"))
    });
    Ok(HttpResponse::Created().streaming(body))
}

/// A transactional app with a pool of one and an idle limit of 1 s (a 1 s lease, no renewal):
/// a keyed POST to `path` whose client gives up after half a second, then, 4 s later (past
/// the idle limit: PostgreSQL has ended that session, and its claim is free), a payment with
/// another key. That payment's status and body, and the database.
async fn after_a_stalled_body(path: &str) -> (StatusCode, String, TestDb) {
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let store = PostgresStore::builder(db.url.clone())
        .max_size(1)
        // Long enough to open a connection on a loaded machine (the pool starts empty, and
        // the last payment needs a new one); a connection never given back still fails it.
        .connection_timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let middleware = Idempotency::builder(store.clone())
        .lock_timeout(Duration::from_secs(1))
        .renew_lease_up_to(Duration::ZERO) // idle limit: 1 s
        .transactional()
        .build();
    let app = test::init_service(
        App::new().service(
            web::scope("")
                .wrap(middleware)
                .route("/stall", web::post().to(stalls))
                .route("/slow", web::post().to(slow))
                .route("/pay", web::post().to(pays)),
        ),
    )
    .await;
    let gave_up =
        tokio::time::timeout(Duration::from_millis(500), status(&app, post(path, "s1"))).await;
    assert!(
        gave_up.is_err(),
        "the stalled request cannot have an answer"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (code, body) = status(&app, post("/pay", "p1")).await;
    (code, body, db)
}

/// The handler's response body never ends. The middleware buffers it whole while holding the
/// request's pooled connection; it gave no bound to that wait (not the idle limit, after which
/// PostgreSQL has ended the session and nothing can commit, nor the client leaving), so the
/// connection never came back and (pool of one here) every later request of the instance got
/// 503 for as long as the process lived. Now the wait ends at the idle limit.
#[actix_web::test]
async fn an_endless_response_body_does_not_hold_a_connection_forever() {
    let (code, body, db) = after_a_stalled_body("/stall").await;
    assert_eq!(
        count(
            &db.url,
            "SELECT count(*) AS n FROM pg_stat_activity \
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'"
        ),
        0,
        "PostgreSQL ended the stalled request's session at the idle limit: nothing of it can \
         commit any more"
    );
    assert_eq!(
        code,
        StatusCode::CREATED,
        "a later payment on this instance: {body}"
    );
    assert_eq!(count(&db.url, "SELECT count(*) AS n FROM payments"), 1);
}

/// Control for the test above: the same with a body that ends after 3 s. The connection comes
/// back (the session ended at the idle limit, so the request is answered COMMIT_FAILED), and
/// the later payment is served.
#[actix_web::test]
async fn control_a_slow_but_finite_response_body_gives_its_connection_back() {
    let (code, body, db) = after_a_stalled_body("/slow").await;
    assert_eq!(code, StatusCode::CREATED, "{body}");
    assert_eq!(count(&db.url, "SELECT count(*) AS n FROM payments"), 1);
}
