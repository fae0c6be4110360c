//! Holes left by the first version of the fixes of 2026-12-05 (a review of them).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_http::Request;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::{test, web, App, HttpResponse, Route};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::{self, PostgresStore};
use idempotency_actix::{Idempotency, IdempotentTx};
use idempotency_e2e::database::{migrate_by_hand, migration_names, migrations_dir};
use idempotency_e2e::records::{count, execute};
use idempotency_e2e::TestDb;

const PAYMENTS: &str = "CREATE TABLE IF NOT EXISTS public.payments (
    id bigserial PRIMARY KEY,
    tag text NOT NULL DEFAULT '',
    amount bigint NOT NULL
)";

/// A payment handler in transactional mode: it calls the payment provider (counted), then
/// records the payment in the request's transaction.
async fn charge(
    tx: IdempotentTx,
    provider_calls: web::Data<Arc<AtomicUsize>>,
) -> actix_web::Result<HttpResponse> {
    provider_calls.fetch_add(1, Ordering::SeqCst);
    let mut conn = tx.conn();
    diesel::sql_query("INSERT INTO public.payments (tag, amount) VALUES ('charge', 100)")
        .execute(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created().body("charged"))
}

/// The status and body (as text) of a response.
async fn body_text(resp: ServiceResponse) -> (u16, String) {
    let status = resp.status().as_u16();
    let body = test::read_body(resp).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A store on `url` whose pool holds one connection.
async fn one_connection_store(url: &str) -> PostgresStore {
    PostgresStore::builder(url.to_owned())
        .max_size(1)
        .build()
        .await
        .unwrap()
}

/// An app serving `routes` in a scope behind the transactional middleware on `store`, with
/// `provider_calls` (if any) as app data.
async fn transactional_app<const N: usize>(
    store: &PostgresStore,
    lock_timeout: Duration,
    provider_calls: Option<&Arc<AtomicUsize>>,
    routes: [(&str, Route); N],
) -> impl Service<Request, Response = ServiceResponse, Error = actix_web::Error> {
    let mut app = App::new();
    if let Some(calls) = provider_calls {
        app = app.app_data(web::Data::new(calls.clone()));
    }
    let scope = web::scope("").wrap(
        Idempotency::builder(store.clone())
            .lock_timeout(lock_timeout)
            .transactional()
            .build(),
    );
    let scope = routes
        .into_iter()
        .fold(scope, |scope, (path, route)| scope.route(path, route));
    test::init_service(app.service(scope)).await
}

/// The transactional app with `charge` at POST /payments (500 ms lock timeout), counting into
/// `calls`.
async fn payments_app(
    store: &PostgresStore,
    calls: &Arc<AtomicUsize>,
) -> impl Service<Request, Response = ServiceResponse, Error = actix_web::Error> {
    transactional_app(
        store,
        Duration::from_millis(500),
        Some(calls),
        [("/payments", web::post().to(charge))],
    )
    .await
}

/// A JSON POST /payments of 100 under the Idempotency-Key `key`.
fn payment_request(key: &str) -> Request {
    test::TestRequest::post()
        .uri("/payments")
        .insert_header(("idempotency-key", key))
        .insert_header(("content-type", "application/json"))
        .set_payload(r#"{"amount":100}"#)
        .to_request()
}

/// Sends one keyless JSON POST /pay to `handler` (transactional, 2 s lock timeout, a
/// one-connection pool) and asserts that its payment row tagged `tag` is committed and the
/// answer does not say "nothing was done".
async fn assert_keyless_pay_not_answered_nothing_was_done(handler: Route, tag: &str) {
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let store = one_connection_store(&db.url).await;
    let app = transactional_app(&store, Duration::from_secs(2), None, [("/pay", handler)]).await;
    let req = test::TestRequest::post()
        .uri("/pay")
        .set_payload("{}")
        .insert_header(("content-type", "application/json"))
        .to_request();
    let (status, body) = body_text(test::call_service(&app, req).await).await;
    let rows = count(
        &db.url,
        &format!("SELECT count(*) AS n FROM public.payments WHERE tag = '{tag}'"),
    );
    // The premise first: the handler's row is committed (else the check below says nothing).
    assert_eq!(
        rows, 1,
        "tag {tag}: the handler's row is not committed; answered {status} {body}"
    );
    assert!(
        !body.contains("nothing was done"),
        "tag {tag}: answered {status} {body} while the handler's row is committed"
    );
}

/// Finding 1. The fix makes the default mode refuse (503 before the handler) on a database
/// at migration 000003 (`idempotency_reserve` and `idempotency_tx_claim`, no
/// `idempotency_complete`), but transactional mode never runs the provisioning probe: its
/// claim (`idempotency_tx_claim`, there since 000003) succeeds, the handler runs (calls the
/// payment provider: docs/transactional.md's "the handler waits (a payment provider)"), its
/// `complete` fails, everything is rolled back and the client is told `COMMIT_FAILED`,
/// "nothing was done; a retry with the same Idempotency-Key is safe". The retry runs the
/// handler again: one key, two provider charges (C15: a missing function is a 503 before the
/// handler).
#[actix_web::test]
async fn transactional_mode_on_a_half_schema_never_runs_a_handler_twice() {
    let db = TestDb::new_unmigrated().await;
    migrate_by_hand(&db.url, 3).await;
    execute(&db.url, PAYMENTS);
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let check = store.check().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let app = payments_app(&store, &calls).await;
    let mut answers = Vec::new();
    for _ in 0..2 {
        let resp = test::call_service(&app, payment_request("k-1")).await;
        answers.push(body_text(resp).await);
    }
    assert!(check.is_err(), "check() on a database at 000003: {check:?}");
    assert!(
        AtomicUsize::load(&calls, Ordering::SeqCst) <= 1,
        "transactional mode, database at migration 000003 (check(): {check:?}): the handler \
         (payment provider) ran {} times for one key; answers {answers:#?}",
        AtomicUsize::load(&calls, Ordering::SeqCst)
    );
}

/// Finding 2. `SAVEPOINT ..; COMMIT` is refused outside a transaction block, so a keyless
/// handler whose own raw `COMMIT` already committed its writes is now answered `503
/// COMMIT_FAILED` "the request's changes were rolled back, nothing was done", while its row is
/// committed (before the fix, `SELECT 1; COMMIT` passed and the 201 went out). A client that
/// believes "nothing was done" sends it again: a second payment. (Raw COMMIT is documented as
/// unsupported, but docs/transactional.md describes its effect as "the rest of the request
/// runs in autocommit", not as rolled back, and a keyed request with the same handler gets
/// its 201 and a stored response.)
#[actix_web::test]
async fn a_keyless_raw_commit_is_not_answered_nothing_was_done() {
    async fn commits_itself(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
        let mut conn = tx.conn();
        diesel::sql_query("INSERT INTO public.payments (tag, amount) VALUES ('raw-commit', 1)")
            .execute(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
        conn.batch_execute("COMMIT")
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
        Ok(HttpResponse::Created().body("done"))
    }
    assert_keyless_pay_not_answered_nothing_was_done(web::post().to(commits_itself), "raw-commit")
        .await;
}

/// Finding 3. `ClaimExists` now also answers true when `idempotency_tx_claim` exists in any
/// schema of the database. docs/operations.md's move to the partitioned layout provisions "a
/// new database (or schema, via `search_path` in the URL)": the old schema keeps its
/// functions. A deployment pointed at a schema that lacks the third migration then gets an
/// opaque "unavailable; retry later" instead of C15's "run `idem-cli migrate`" hint, which is
/// what a database whose only schema is at migration 000002 gets.
#[actix_web::test]
async fn a_claim_function_in_another_schema_does_not_hide_the_migrate_hint() {
    let db = TestDb::new_unmigrated().await;
    migrate_by_hand(&db.url, 2).await;
    // Another schema of the same database with the claim function (an older deployment, or
    // the other side of the documented move).
    execute(
        &db.url,
        "CREATE SCHEMA old_deployment; \
         CREATE FUNCTION old_deployment.idempotency_tx_claim(text, text, text, text, text, text, \
         bytea, uuid, bigint) RETURNS int LANGUAGE sql AS 'SELECT 1'",
    );
    execute(&db.url, PAYMENTS);
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let app = payments_app(&store, &calls).await;
    let (status, body) = body_text(test::call_service(&app, payment_request("k-1")).await).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(AtomicUsize::load(&calls, Ordering::SeqCst), 0);
    assert!(
        body.contains("idem-cli migrate"),
        "the search_path's schema lacks idempotency_tx_claim, yet the answer has no migrate \
         hint: {body}"
    );
}

/// Finding 4. The provisioning flag is never cleared: a schema rebuilt while an app instance
/// runs (restored from a backup taken before migration 000004, or provisioned again by an
/// older `idem-cli migrate`) is reserved on without a probe, and the half-schema double run
/// the fix closed for new stores is back for that store.
#[actix_web::test]
async fn a_schema_rebuilt_at_an_older_migration_after_the_first_request_never_runs_twice() {
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.unwrap();
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
    // A first request on the complete schema: the flag is set.
    let first = test::call_service(&app, payment_request("warm")).await;
    assert_eq!(first.status().as_u16(), 201);
    // The schema is rebuilt at migration 000003 (docs/operations.md, "A schema dropped by
    // hand": the down.sql of every migration, newest first, then the bookkeeping).
    {
        let mut conn = postgres::establish(&db.url).await.unwrap();
        let mut names = migration_names();
        names.reverse();
        for name in &names {
            let sql =
                std::fs::read_to_string(migrations_dir().join(name).join("down.sql")).unwrap();
            conn.batch_execute(&sql).await.unwrap();
        }
        conn.batch_execute("DROP TABLE __diesel_schema_migrations")
            .await
            .unwrap();
    }
    migrate_by_hand(&db.url, 3).await;
    runs.store(0, Ordering::SeqCst);
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let resp = test::call_service(&app, payment_request("k-1")).await;
        statuses.push(resp.status().as_u16());
        actix_web::rt::time::sleep(Duration::from_millis(2500)).await;
    }
    assert!(
        AtomicUsize::load(&runs, Ordering::SeqCst) <= 1,
        "schema rebuilt at 000003 under a running store: the handler ran {} times for one \
         key; statuses {statuses:?}",
        AtomicUsize::load(&runs, Ordering::SeqCst)
    );
}

/// Finding 2b. The docs line this commit added for a raw `ROLLBACK` ("its answer is
/// `COMMIT_FAILED` then, keyed or keyless: nothing of it was kept") is not what happens when
/// the handler goes on writing after it: those writes run in autocommit and are committed,
/// and the client is told "nothing was done".
#[actix_web::test]
async fn a_keyless_raw_rollback_then_a_write_is_not_answered_nothing_was_done() {
    async fn rolls_back_then_writes(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
        let mut conn = tx.conn();
        conn.batch_execute("ROLLBACK")
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
        diesel::sql_query("INSERT INTO public.payments (tag, amount) VALUES ('after-rb', 1)")
            .execute(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
        Ok(HttpResponse::Created().body("done"))
    }
    assert_keyless_pay_not_answered_nothing_was_done(
        web::post().to(rolls_back_then_writes),
        "after-rb",
    )
    .await;
}

#[derive(diesel::QueryableByName)]
struct Pid {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// A keyless POST /pid with an empty JSON object (no content type).
fn pid_request() -> Request {
    test::TestRequest::post()
        .uri("/pid")
        .set_payload("{}")
        .to_request()
}

/// Finding 5. `sql::discard` after any non-serialization claim failure includes failures a
/// client chooses: a path too long for the primary-key index (postgres_middleware.rs,
/// `a_scope_the_client_chose_is_never_run_twice`) is refused by PostgreSQL in the claim, and
/// transactional mode now closes the pooled connection for it. Every such request from any
/// client costs the database a new session (fork, authentication, TLS): the pool's only
/// connection is replaced once per hostile request. (Default mode keeps the connection.)
#[actix_web::test]
async fn a_client_chosen_claim_error_does_not_cost_a_new_database_session() {
    let db = TestDb::new().await;
    let store = one_connection_store(&db.url).await;
    async fn pid(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
        let mut conn = tx.conn();
        let p: Pid = diesel::sql_query("SELECT pg_backend_pid()::bigint AS n")
            .get_result(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
        Ok(HttpResponse::Ok().body(p.n.to_string()))
    }
    let app = transactional_app(
        &store,
        Duration::from_secs(2),
        None,
        [
            ("/pid", web::post().to(pid)),
            ("/items/{name}", web::post().to(pid)),
        ],
    )
    .await;
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
    // Control: without a hostile request in between, the pool's one connection is kept.
    let mut control = Vec::new();
    for _ in 0..3 {
        control.push(
            body_text(test::call_service(&app, pid_request()).await)
                .await
                .1,
        );
    }
    control.dedup();
    assert_eq!(control.len(), 1, "control: {control:?}");
    let mut pids = Vec::new();
    let mut statuses = Vec::new();
    for i in 0..5 {
        let (status, body) = body_text(test::call_service(&app, pid_request()).await).await;
        assert_eq!(status, 200, "{body}");
        pids.push(body);
        let req = test::TestRequest::post()
            .uri(&long_path)
            .insert_header(("idempotency-key", format!("k-{i}")))
            .set_payload("{}")
            .to_request();
        statuses.push(test::call_service(&app, req).await.status().as_u16());
    }
    let mut distinct = pids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        1,
        "the pool's one connection was replaced after each client-chosen claim error \
         (statuses {statuses:?}): backend pids {pids:?}"
    );
}
