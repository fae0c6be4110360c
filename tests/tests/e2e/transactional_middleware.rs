//! Transactional mode (C25) against a real PostgreSQL: the reservation, the handler's rows in
//! `payments` and the stored response commit together or not at all.
//!
//! Each test makes its own database with a `payments` table; the handler inserts one row
//! through `IdempotentTx` and behaves as its query string says (`status`, `fail`, `sleep_ms`,
//! `big`, `savepoint`, `account`, `open_savepoint`, `stream_fail`).

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse};
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::schema::State;
use idempotency_actix::store::postgres::{IsolationLevel, PostgresStore};
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, ReserveOutcome, Scope, WriteOutcome,
};
use idempotency_actix::{Idempotency, IdempotentTx, Outcome};
use idempotency_e2e::records::{count, execute, records_for_key};
use idempotency_e2e::TestDb;
use serde::Deserialize;

const PAYMENTS: &str = "CREATE TABLE payments (
    id bigserial PRIMARY KEY,
    tenant_id text NOT NULL DEFAULT '',
    idempotency_key text,
    amount bigint NOT NULL
)";

#[derive(Deserialize, Default)]
struct Opts {
    status: Option<u16>,
    fail: Option<bool>,
    sleep_ms: Option<u64>,
    big: Option<usize>,
    savepoint: Option<bool>,
    account: Option<i64>,
    /// Leave a savepoint open (a `begin_transaction` without its end) when returning.
    open_savepoint: Option<bool>,
    /// Answer 201 with a streamed body whose second chunk fails.
    stream_fail: Option<bool>,
    /// Panic after the INSERT.
    panic: Option<bool>,
    /// End the request's transaction itself after the INSERT, through diesel: commit it.
    self_commit: Option<bool>,
    /// The same, rolling it back.
    self_rollback: Option<bool>,
    /// After the INSERT, run a statement that fails and carry on as if it had not (the
    /// transaction is then aborted: PostgreSQL answers its COMMIT with a ROLLBACK).
    swallow_error: Option<bool>,
    /// The same failing statement inside diesel's nested transaction (a savepoint, rolled
    /// back on the error): the request's transaction goes on.
    savepoint_error: Option<bool>,
    /// After the INSERT, start a statement that fails after 300 ms and give up waiting for it
    /// after 20 ms (its future dropped): it still runs, and aborts the transaction, with no
    /// answer the handler or the connection's instrumentation ever sees.
    abandon_failing: Option<bool>,
    /// After the INSERT, a row-returning statement (`get_result`) that fails while it runs (a
    /// duplicate primary key), ignored: diesel-async reports that error in the row stream,
    /// after the statement was recorded as finished without one.
    swallow_row_error: Option<bool>,
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Handler runs in this process.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn get(&self) -> usize {
        AtomicUsize::load(&self.0, Ordering::SeqCst)
    }
}

async fn pay(
    tx: IdempotentTx,
    runs: web::Data<Runs>,
    opts: web::Query<Opts>,
    req: actix_web::HttpRequest,
    body: web::Json<serde_json::Value>,
) -> actix_web::Result<HttpResponse> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let amount = body["amount"].as_i64().unwrap_or(1);
    let tenant = req
        .headers()
        .get("x-account-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    // Neither type shows anything of the transaction or the connection.
    assert_eq!(format!("{tx:?}"), "IdempotentTx { .. }");
    let mut conn = tx.conn();
    assert_eq!(format!("{conn:?}"), "TxConn { .. }");
    if opts.savepoint == Some(true) {
        // A failing inner transaction: rolled back to its savepoint, the outer one goes on.
        let inner: Result<(), diesel::result::Error> = conn
            .transaction::<(), diesel::result::Error, _>(async |c| {
                diesel::sql_query("INSERT INTO payments (tenant_id, amount) VALUES ('inner', -1)")
                    .execute(c)
                    .await?;
                Err(diesel::result::Error::RollbackTransaction)
            })
            .await;
        assert!(inner.is_err());
    }
    let id = diesel::sql_query(
        "INSERT INTO payments (tenant_id, idempotency_key, amount) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind::<Text, _>(&tenant)
    .bind::<Nullable<Text>, _>(&key)
    .bind::<BigInt, _>(amount)
    .get_result::<Id>(&mut *conn)
    .await
    .map_err(actix_web::error::ErrorInternalServerError)?
    .id;
    if let Some(account) = opts.account {
        diesel::sql_query("INSERT INTO payment_accounts (payment_id, account_id) VALUES ($1, $2)")
            .bind::<BigInt, _>(id)
            .bind::<BigInt, _>(account)
            .execute(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
    }
    if opts.savepoint_error == Some(true) {
        let failed = conn
            .transaction::<usize, diesel::result::Error, _>(async |c| {
                diesel::sql_query("SELECT 1 / 0").execute(c).await
            })
            .await;
        assert!(failed.is_err(), "division by zero fails");
    }
    if opts.abandon_failing == Some(true) {
        use diesel_async::SimpleAsyncConnection;
        let abandoned = tokio::time::timeout(
            Duration::from_millis(20),
            (*conn).batch_execute("SELECT pg_sleep(0.3); SELECT 1 / 0"),
        )
        .await;
        assert!(abandoned.is_err(), "given up before its answer");
    }
    if opts.swallow_row_error == Some(true) {
        let failed =
            diesel::sql_query("INSERT INTO payments (id, amount) VALUES ($1, 0) RETURNING id")
                .bind::<BigInt, _>(id)
                .get_result::<Id>(&mut *conn)
                .await;
        assert!(failed.is_err(), "a duplicate primary key fails");
    }
    if opts.swallow_error == Some(true) {
        let failed = diesel::sql_query("SELECT 1 / 0").execute(&mut *conn).await;
        assert!(failed.is_err(), "division by zero fails");
    }
    if opts.open_savepoint == Some(true) {
        use diesel_async::{AnsiTransactionManager, TransactionManager};
        AnsiTransactionManager::begin_transaction(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
    }
    if opts.self_commit == Some(true) || opts.self_rollback == Some(true) {
        use diesel_async::{AnsiTransactionManager, TransactionManager};
        let ended = if opts.self_commit == Some(true) {
            AnsiTransactionManager::commit_transaction(&mut *conn).await
        } else {
            AnsiTransactionManager::rollback_transaction(&mut *conn).await
        };
        ended.map_err(actix_web::error::ErrorInternalServerError)?;
    }
    drop(conn);
    assert!(opts.panic != Some(true), "the handler panicked on purpose");
    if opts.stream_fail == Some(true) {
        let chunks = futures_util::stream::iter([
            Ok(bytes::Bytes::from_static(b"{\"partial\":")),
            Err(actix_web::error::ErrorInternalServerError(
                "the body failed",
            )),
        ]);
        return Ok(HttpResponse::Created().streaming(chunks));
    }
    if let Some(ms) = opts.sleep_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if opts.fail == Some(true) {
        return Err(actix_web::error::ErrorInternalServerError("handler failed"));
    }
    let status = StatusCode::from_u16(opts.status.unwrap_or(201)).unwrap_or(StatusCode::CREATED);
    let nonce = idempotency_actix::store::ReservationToken::random().as_uuid();
    let mut body = serde_json::json!({ "id": id, "nonce": nonce.to_string() });
    if let Some(n) = opts.big {
        body["pad"] = serde_json::Value::String("x".repeat(n));
    }
    Ok(HttpResponse::build(status).json(body))
}

async fn setup() -> (TestDb, PostgresStore) {
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let store = PostgresStore::connect(&db.url).await.unwrap();
    (db, store)
}

fn post(key: Option<&str>, query: &str, body: serde_json::Value) -> test::TestRequest {
    let mut req = test::TestRequest::post()
        .uri(&format!("/payments{query}"))
        .insert_header(("x-account-id", "acct_1"))
        .set_json(body);
    if let Some(key) = key {
        req = req.insert_header(("idempotency-key", key));
    }
    req
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: bool,
    body: serde_json::Value,
}

async fn call<S, B>(app: &S, req: test::TestRequest) -> Answer
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    let response = match app.call(req.to_request()).await {
        Ok(response) => response.map_into_boxed_body(),
        Err(error) => {
            let response = error.error_response();
            let (head, body) = response.into_parts();
            let body = actix_web::body::to_bytes(body).await.unwrap_or_default();
            return Answer {
                status: head.status(),
                replayed: false,
                retry_after: false,
                body: serde_json::from_slice(&body).unwrap_or_else(|_| {
                    serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
                }),
            };
        }
    };
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let retry_after = response.headers().contains_key("retry-after");
    let body = test::read_body(response).await;
    Answer {
        status,
        replayed,
        retry_after,
        body: serde_json::from_slice(&body).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
        }),
    }
}

/// A keyed `POST /payments{query}` of `{"amount": amount}`.
async fn send<S, B>(app: &S, key: &str, query: &str, amount: i64) -> Answer
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    send_as(app, Some(key), query, amount).await
}

/// A `POST /payments{query}` of `{"amount": amount}`, keyed with `key` if there is one.
async fn send_as<S, B>(app: &S, key: Option<&str>, query: &str, amount: i64) -> Answer
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    call(
        app,
        post(key, query, serde_json::json!({ "amount": amount })),
    )
    .await
}

/// A problem answer of `code` (503 for both commit codes): never the handler's response.
#[track_caller]
fn assert_problem(answer: &Answer, code: &str, what: &str) {
    assert_code(answer, StatusCode::SERVICE_UNAVAILABLE, code, what);
}

/// A problem answer of `status` and `code`.
#[track_caller]
fn assert_code(answer: &Answer, status: StatusCode, code: &str, what: &str) {
    assert_eq!(answer.status, status, "{what}: {}", answer.body);
    assert_eq!(answer.body["code"], code, "{what}: {}", answer.body);
}

/// Nothing of a rolled-back request is left: `payments_left` rows in all, no record of `key`.
fn assert_nothing_kept(db: &TestDb, key: &str, payments_left: i64) {
    assert_eq!(
        payments(db),
        payments_left,
        "the handler's writes were rolled back"
    );
    assert!(
        records_for_key(&db.url, key).is_empty(),
        "no record of {key} is left"
    );
}

/// An app of the transactional middleware and one `/payments` route: `pay` (POST and GET, with
/// the run counter), or `post handler`, with or without the run counter.
macro_rules! app {
    ($middleware:expr, post $handler:expr) => {
        test::init_service(
            App::new().service(
                web::scope("")
                    .wrap($middleware)
                    .route("/payments", web::post().to($handler)),
            ),
        )
        .await
    };
    ($middleware:expr, $runs:expr, post $handler:expr) => {
        test::init_service(
            App::new().app_data(web::Data::new($runs.clone())).service(
                web::scope("")
                    .wrap($middleware)
                    .route("/payments", web::post().to($handler)),
            ),
        )
        .await
    };
    ($middleware:expr, $runs:expr) => {
        test::init_service(
            App::new().app_data(web::Data::new($runs.clone())).service(
                web::scope("")
                    .wrap($middleware)
                    .route("/payments", web::post().to(pay))
                    .route("/payments", web::get().to(pay)),
            ),
        )
        .await
    };
}

/// The transactional middleware of these tests: tenant from `x-account-id`.
fn tx_builder(store: &PostgresStore) -> idempotency_actix::IdempotencyBuilder<PostgresStore> {
    Idempotency::builder(store.clone())
        .tenant_header("x-account-id")
        .transactional()
}

fn tx_middleware(store: &PostgresStore) -> Idempotency<PostgresStore> {
    tx_builder(store).build()
}

fn payments(db: &TestDb) -> i64 {
    count(&db.url, "SELECT count(*) AS n FROM payments")
}

/// The number of idempotency records in `db`.
fn idempotency_keys(db: &TestDb) -> i64 {
    count(&db.url, "SELECT count(*) AS n FROM idempotency_keys")
}

/// The number of sessions on `db` left idle inside a transaction.
fn idle_in_transaction(db: &TestDb) -> i64 {
    count(
        &db.url,
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
    )
}

/// Makes SERIALIZABLE the default transaction isolation of `db`.
fn serializable_by_default(db: &TestDb) {
    execute(
        &db.url,
        &format!(
            "ALTER DATABASE {} SET default_transaction_isolation = 'serializable'",
            db.name
        ),
    );
}

/// The transactional middleware of these tests, SERIALIZABLE.
fn serializable(store: &PostgresStore) -> idempotency_actix::IdempotencyBuilder<PostgresStore> {
    tx_builder(store).isolation_level(IsolationLevel::Serializable)
}

/// A run counter, and the `pay` app (POST and GET) on `middleware` with that counter.
async fn pay_app(
    middleware: Idempotency<PostgresStore>,
) -> (
    Runs,
    impl Service<
        actix_http::Request,
        Response = ServiceResponse<impl actix_web::body::MessageBody>,
        Error = actix_web::Error,
    >,
) {
    let runs = Runs::default();
    let app = app!(middleware, runs);
    (runs, app)
}

/// `setup`, then `pay_app` on the middleware `build` makes of the store: the database, the
/// store, the run counter and the app.
async fn setup_pay(
    build: impl FnOnce(&PostgresStore) -> Idempotency<PostgresStore>,
) -> (
    TestDb,
    PostgresStore,
    Runs,
    impl Service<
        actix_http::Request,
        Response = ServiceResponse<impl actix_web::body::MessageBody>,
        Error = actix_web::Error,
    >,
) {
    let (db, store) = setup().await;
    let (runs, app) = pay_app(build(&store)).await;
    (db, store, runs, app)
}

/// `second` started `ms` milliseconds from now.
async fn after<T>(ms: u64, second: impl Future<Output = T>) -> T {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    second.await
}

/// A keyed `POST` of amount 1 for `key_a` and, 50 ms into it, one of amount 2 for `key_b`.
async fn two_keys_50ms_apart<S, B>(app: &S, key_a: &str, key_b: &str) -> (Answer, Answer)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    futures_util::future::join(send(app, key_a, "", 1), after(50, send(app, key_b, "", 2))).await
}

/// A connection of its own to `db` (outside the app's pool) that has run `sql`.
async fn outside_transaction(db: &TestDb, sql: &str) -> diesel_async::AsyncPgConnection {
    let mut conn = idempotency_actix::store::postgres::establish(&db.url)
        .await
        .unwrap();
    conn.batch_execute(sql).await.unwrap();
    conn
}

/// The answer is the handler's 201.
#[track_caller]
fn assert_created(answer: &Answer) {
    assert_eq!(answer.status, StatusCode::CREATED, "{}", answer.body);
}

/// `what` ran the handler afresh: a 201 that is not a replay.
#[track_caller]
fn assert_ran(answer: &Answer, what: &str) {
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "{what}: {}",
        answer.body
    );
    assert!(!answer.replayed, "{what}: {}", answer.body);
}

/// `what` is a replay of `first`: marked replayed, with the stored body.
#[track_caller]
fn assert_replays(answer: &Answer, first: &Answer, what: &str) {
    assert!(answer.replayed, "{what}: {} {}", answer.status, answer.body);
    assert_eq!(answer.body, first.body, "{what}: not the stored response");
}

/// The handler ran `handler_runs` times and `payments_left` payments are in the table.
#[track_caller]
fn assert_counts(db: &TestDb, runs: &Runs, handler_runs: usize, payments_left: i64) {
    assert_eq!(runs.get(), handler_runs, "handler runs");
    assert_eq!(payments(db), payments_left, "payments");
}

/// The record of `key` is the completed one.
#[track_caller]
fn assert_completed(db: &TestDb, key: &str) {
    assert_eq!(
        records_for_key(&db.url, key)[0].state,
        State::Completed,
        "{key}"
    );
}

/// A miss commits the row and the record together; the retry replays byte for byte without
/// running the handler or adding a row; another body gets 422.
#[actix_web::test]
async fn miss_commits_row_and_record_together_then_replays() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;

    let first = send(&app, "k1", "", 10).await;
    assert_created(&first);
    assert_eq!(payments(&db), 1);
    let records = records_for_key(&db.url, "k1");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].state, State::Completed);

    let retry = send(&app, "k1", "", 10).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_replays(&retry, &first, "the replay is the stored response");
    assert_counts(&db, &runs, 1, 1);

    let other = send(&app, "k1", "", 11).await;
    assert_code(
        &other,
        StatusCode::UNPROCESSABLE_ENTITY,
        "FINGERPRINT_MISMATCH",
        "another body",
    );
    assert_eq!(payments(&db), 1);
}

/// A 4xx and a handler error roll the handler's row back with the reservation: nothing is
/// left, and the retry runs the handler again (from a clean slate).
#[actix_web::test]
async fn non_storable_response_and_handler_error_roll_back_the_handlers_writes() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;

    for (query, status) in [
        ("?status=400", StatusCode::BAD_REQUEST),
        ("?fail=true", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        let answer = send(&app, "k4", query, 1).await;
        assert_eq!(answer.status, status, "{query}");
        assert_nothing_kept(&db, "k4", 0);
    }

    let ok = send(&app, "k4", "", 1).await;
    assert_ran(&ok, "the retry");
    assert_counts(&db, &runs, 3, 1);
}

/// The handler's own `transaction()` is a savepoint inside the request's transaction: its
/// rollback undoes only its part, and it never commits the outer transaction.
#[actix_web::test]
async fn handler_transaction_is_a_savepoint() {
    let (db, _store, _runs, app) = setup_pay(tx_middleware).await;

    let ok = send(&app, "s1", "?savepoint=true", 5).await;
    assert_created(&ok);
    assert_eq!(
        count(
            &db.url,
            "SELECT count(*) AS n FROM payments WHERE tenant_id = 'inner'"
        ),
        0
    );
    assert_eq!(payments(&db), 1);

    // Had the inner transaction committed the outer one, this 4xx could not undo its row.
    let rejected = send(&app, "s2", "?savepoint=true&status=409", 5).await;
    assert_eq!(rejected.status, StatusCode::CONFLICT);
    assert_nothing_kept(&db, "s2", 1);
}

/// A duplicate while the first transaction is open gets 409 with Retry-After at once (a
/// different body too: the first fingerprint is not visible yet), and today's-mode reserve on
/// the same table is not blocked either; after the commit the duplicate replays.
#[actix_web::test]
async fn duplicate_while_open_gets_409_at_once_then_replays() {
    let (db, store, runs, app) = setup_pay(tx_middleware).await;

    let first = send(&app, "d1", "?sleep_ms=1500", 7);
    let probes = after(300, async {
        let started = Instant::now();
        let same = send(&app, "d1", "?sleep_ms=1500", 7).await;
        let other = send(&app, "d1", "?sleep_ms=1500", 8).await;
        // Default mode's reserve function on the same scope: must not wait on the open row.
        let scope = Scope {
            tenant: "acct_1".into(),
            method: "POST".into(),
            path: "/payments".into(),
            key: "d1".into(),
        };
        let plain = store
            .reserve(&scope, &Fingerprint([1; 32]), Duration::from_secs(60))
            .await
            .unwrap();
        (same, other, plain, started.elapsed())
    });
    let (first, (same, other, plain, took)) = futures_util::future::join(first, probes).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(same.status, StatusCode::CONFLICT);
    assert!(same.retry_after);
    assert_eq!(
        other.status,
        StatusCode::CONFLICT,
        "another body: 409 until the first commits"
    );
    assert!(
        matches!(plain, ReserveOutcome::InFlight { .. }),
        "{plain:?}"
    );
    assert!(
        took < Duration::from_millis(700),
        "not blocked behind the open transaction: {took:?}"
    );

    let later = send(&app, "d1", "?sleep_ms=1500", 7).await;
    assert_replays(&later, &first, "after the commit");
    let mismatch = send(&app, "d1", "", 8).await;
    assert_eq!(
        mismatch.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "422 once committed"
    );
    assert_counts(&db, &runs, 1, 1);
}

/// Both modes on one table, the one case that waits (docs/transactional.md, "Sharing one table
/// with the default mode"): a default-mode holder whose lease ended while its handler ran,
/// whose key a transactional request then took over, completes while that transaction is
/// still open. Its `complete` waits on the uncommitted row, but no longer than its store's
/// `query_timeout` (1 s here, against a transaction held 4 s), and never applies: after the
/// commit the transactional response is the record, the holder's write is stale, and a retry
/// replays.
#[actix_web::test]
async fn a_stale_default_mode_holder_waits_on_a_takeover_no_longer_than_its_query_timeout() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;
    let holder = PostgresStore::builder(&db.url)
        .query_timeout(Some(Duration::from_secs(1)))
        .build()
        .await
        .unwrap();
    let scope = Scope {
        tenant: "acct_1".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: "mix1".into(),
    };
    // The fingerprint the middleware computes for the request `send` makes below.
    let query = "sleep_ms=4000";
    let fp = Fingerprint::of_request("POST", "/payments", query, true, br#"{"amount":7}"#);
    let lease = Duration::from_millis(300);
    let ReserveOutcome::Reserved { token } = holder.reserve(&scope, &fp, lease).await.unwrap()
    else {
        panic!("the default-mode holder did not reserve");
    };
    tokio::time::sleep(Duration::from_millis(600)).await; // its lease is over
    let response = idempotency_actix::store::StoredResponse {
        status: 201,
        headers: vec![],
        body: bytes::Bytes::from_static(b"the default-mode holder's"),
    };
    let ttl = Duration::from_secs(3600);
    let target = format!("?{query}");
    let taker = send(&app, "mix1", &target, 7);
    let late_holder = after(1000, async {
        let started = Instant::now();
        let completed = holder.complete(&scope, &token, &response, ttl).await;
        (completed, started.elapsed())
    });
    let (taken, (completed, took)) = futures_util::future::join(taker, late_holder).await;
    assert_eq!(
        taken.status,
        StatusCode::CREATED,
        "the takeover: {}",
        taken.body
    );
    assert!(
        took < Duration::from_millis(2500),
        "the holder's complete waited {took:?} on the open transaction (query_timeout 1 s)"
    );
    assert!(
        !matches!(completed, Ok(WriteOutcome::Applied)),
        "the holder's complete applied over the takeover: {completed:?}"
    );
    let again = holder.complete(&scope, &token, &response, ttl).await;
    assert_eq!(again.unwrap(), WriteOutcome::Stale, "after the commit");
    let retry = send(&app, "mix1", &target, 7).await;
    assert_replays(&retry, &taken, "after the takeover committed");
    assert_counts(&db, &runs, 1, 1);
}

/// A transactional request whose `complete` gets no answer within the store's `query_timeout`
/// is answered (503 `COMMIT_FAILED`) after about that long, not three times that: its
/// connection is now given up as every statement of the default mode's is (a cancel, and the
/// pool closes it), where the ROLLBACK and then the session probe each waited out another
/// timeout behind the unanswered statement, the transaction holding the key's claim all along
/// (review, 2026-12-06). Nothing is committed either way.
#[actix_web::test]
async fn a_complete_without_an_answer_gives_its_connection_up() {
    use idempotency_e2e::proxy::{at_local_port, host_port, FaultyProxy};
    let (db, _) = setup().await;
    let proxy = Arc::new(FaultyProxy::start(host_port(&db.url)).await);
    let store = PostgresStore::builder(at_local_port(&db.url, proxy.port()))
        .query_timeout(Some(Duration::from_millis(800)))
        .build()
        .await
        .unwrap();
    let muted = Arc::clone(&proxy);
    let app = test::init_service(App::new().wrap(tx_middleware(&store)).route(
        "/payments",
        web::post().to(move |tx: IdempotentTx| {
            let muted = Arc::clone(&muted);
            async move {
                {
                    let mut conn = tx.conn();
                    diesel::sql_query("SELECT 1")
                        .execute(&mut *conn)
                        .await
                        .map_err(actix_web::error::ErrorInternalServerError)?;
                }
                // The network goes quiet between the handler and the middleware's statements.
                muted.mute_replies(true);
                Ok::<_, actix_web::Error>(HttpResponse::Created().finish())
            }
        }),
    ))
    .await;
    let started = Instant::now();
    let answer = send(&app, "mute1", "", 1).await;
    let took = started.elapsed();
    proxy.mute_replies(false);
    assert_problem(&answer, "COMMIT_FAILED", "complete not answered");
    assert!(
        took < Duration::from_millis(1600),
        "answered after {took:?} (query_timeout 800 ms)"
    );
    assert_eq!(payments(&db), 0);
}

/// A tenant source that panics (an `unwrap` on a header the client left out) on a keyless
/// transactional request: the request runs without a tenant setting, as one whose source finds
/// none does; a keyed one is refused with 400 `MISSING_TENANT`. The keyless path called the
/// source bare and its panic reset the connection (review, 2026-12-06).
#[actix_web::test]
async fn a_tenant_source_that_panics_refuses_keyed_and_passes_keyless_requests() {
    let (db, _store, runs, app) = setup_pay(|store| {
        tx_builder(store)
            .tenant(|req| {
                let org = req
                    .headers()
                    .get("x-org")
                    .expect("the gateway always sets x-org");
                org.to_str().ok().map(str::to_owned)
            })
            .build()
    })
    .await;
    let keyless = send_as(&app, None, "", 1).await;
    assert_created(&keyless);
    let keyed = send(&app, "tp1", "", 1).await;
    assert_code(&keyed, StatusCode::BAD_REQUEST, "MISSING_TENANT", "keyed");
    assert_eq!(runs.get(), 1);
    assert_eq!(payments(&db), 1);
}

/// With `wait_for_in_flight`, the duplicate waits for the first transaction and replays it.
#[actix_web::test]
async fn wait_mode_replays_after_the_first_commits() {
    let (db, _store, _runs, app) = setup_pay(|store| {
        Idempotency::builder(store.clone())
            .tenant_header("x-account-id")
            .wait_for_in_flight(Duration::from_secs(5))
            .transactional()
            .build()
    })
    .await;
    let (first, second) = futures_util::future::join(
        send(&app, "w1", "?sleep_ms=500", 7),
        after(100, send(&app, "w1", "?sleep_ms=500", 7)),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replays(&second, &first, "the waiting duplicate");
    assert_eq!(payments(&db), 1);
}

/// C9 in transactional mode: a handler that waits (on its payment provider, say) longer than
/// `lock_timeout` between two statements keeps its transaction, and so its key: the retry
/// gets 409, never a second run. The session's idle limit used to be `lock_timeout`, so
/// PostgreSQL ended the session, everything rolled back, and the retry ran the handler again.
#[actix_web::test]
async fn a_handler_idle_past_the_lease_keeps_its_transaction() {
    let (db, _store, runs, app) = setup_pay(|store| {
        tx_builder(store)
            .lock_timeout(Duration::from_millis(500))
            .build()
    })
    .await;
    let (first, retry) = futures_util::future::join(
        send(&app, "idle1", "?sleep_ms=1500", 3),
        after(1000, send(&app, "idle1", "?sleep_ms=1500", 3)),
    )
    .await;
    assert_created(&first);
    assert_eq!(retry.status, StatusCode::CONFLICT, "{}", retry.body);
    let replay = send(&app, "idle1", "?sleep_ms=1500", 3).await;
    assert_replays(&replay, &first, "after the commit");
    assert_counts(&db, &runs, 1, 1);
}

/// C12 in transactional mode: the stored response lives its TTL from its commit, not from the
/// transaction's start. `now()` in the complete function is the transaction's start, so a
/// handler that ran longer than the TTL committed a record that had already expired, and the
/// retry right after ran the handler again.
#[actix_web::test]
async fn a_stored_response_lives_its_ttl_from_the_commit() {
    let (db, _store, runs, app) =
        setup_pay(|store| tx_builder(store).ttl(Duration::from_secs(1)).build()).await;
    let first = send(&app, "ttl1", "?sleep_ms=1500", 4).await;
    assert_created(&first);
    let retry = send(&app, "ttl1", "?sleep_ms=1500", 4).await;
    assert_replays(&retry, &first, "the record had expired at its commit");
    assert_counts(&db, &runs, 1, 1);
}

/// A table whose foreign key is checked at COMMIT: a handler that inserts a row naming a
/// missing account (`pay` with `?account=`) runs fine and fails only when it commits.
const DEFERRED_FOREIGN_KEY: &str = "CREATE TABLE accounts (id bigint PRIMARY KEY);
     CREATE TABLE payment_accounts (
         payment_id bigint NOT NULL,
         account_id bigint NOT NULL REFERENCES accounts (id) DEFERRABLE INITIALLY DEFERRED
     )";

/// COMMIT fails on a deferred foreign key: the client gets COMMIT_FAILED (never the
/// handler's 201), no payment and no record remain, and the retry runs the handler.
#[actix_web::test]
async fn failed_commit_answers_a_problem_and_leaves_nothing() {
    let (db, store) = setup().await;
    execute(&db.url, DEFERRED_FOREIGN_KEY);
    let (runs, app) = pay_app(tx_middleware(&store)).await;

    let failed = send(&app, "c1", "?account=42", 3).await;
    assert_problem(&failed, "COMMIT_FAILED", "the failed commit");
    assert!(failed.retry_after);
    assert!(
        failed.body.get("id").is_none(),
        "never the handler's response"
    );
    assert_nothing_kept(&db, "c1", 0);

    execute(&db.url, "INSERT INTO accounts VALUES (42)");
    let retry = send(&app, "c1", "?account=42", 3).await;
    assert_ran(&retry, "the retry runs (nothing was committed before)");
    assert_counts(&db, &runs, 2, 1);
    assert_completed(&db, "c1");
}

/// A session that dies during COMMIT (a FATAL such as a terminated backend or a server
/// shutting down, which can come after the commit point with the commit's own answer still
/// unsent) leaves the outcome unknown: `COMMIT_OUTCOME_UNKNOWN`, never "nothing was done".
/// An ERROR at COMMIT (here a deferred trigger's exception) leaves the session alive and the
/// transaction rolled back: `COMMIT_FAILED`.
#[actix_web::test]
async fn a_session_that_dies_during_commit_is_an_unknown_outcome() {
    let (db, store) = setup().await;
    execute(
        &db.url,
        "CREATE FUNCTION at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.amount = 666 THEN
                 PERFORM pg_terminate_backend(pg_backend_pid());
                 PERFORM pg_sleep(5);
             ELSIF NEW.amount = 667 THEN
                 RAISE EXCEPTION 'refused at commit';
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON payments
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION at_commit()",
    );
    let (_runs, app) = pay_app(tx_middleware(&store)).await;
    for key in [Some("d1"), None] {
        let died = send_as(&app, key, "", 666).await;
        assert_problem(&died, "COMMIT_OUTCOME_UNKNOWN", &format!("{key:?}"));
        let refused = send_as(&app, key, "", 667).await;
        // (keyed: the first request's record went with its transaction, so this one ran)
        assert_problem(&refused, "COMMIT_FAILED", &format!("{key:?}"));
    }
    assert_nothing_kept(&db, "d1", 0);
    let ok = send_as(&app, None, "", 1).await;
    assert_eq!(
        ok.status,
        StatusCode::CREATED,
        "the dead connection was not reused: {}",
        ok.body
    );
    assert_eq!(payments(&db), 1);
}

/// A storable response over `max_response_bytes` cannot be sent without being stored: rolled
/// back, answered with RESPONSE_TOO_LARGE.
#[actix_web::test]
async fn storable_response_over_the_limit_is_rolled_back() {
    let (db, _store, _runs, app) = setup_pay(|store| {
        Idempotency::builder(store.clone())
            .tenant_header("x-account-id")
            .max_response_bytes(1024)
            .transactional()
            .build()
    })
    .await;
    let big = send(&app, "b1", "?big=4096", 3).await;
    let too_large = StatusCode::INTERNAL_SERVER_ERROR;
    assert_code(&big, too_large, "RESPONSE_TOO_LARGE", "keyed");
    assert_nothing_kept(&db, "b1", 0);
    // Without a key it is rolled back too (nothing may reach the client before COMMIT, and
    // the limit bounds that buffer), and the problem does not speak of a key it never had.
    let keyless = send_as(&app, None, "?big=4096", 3).await;
    assert_code(&keyless, too_large, "RESPONSE_TOO_LARGE", "keyless");
    let detail = keyless.body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("retrying is safe") && !detail.contains("key"),
        "{detail}"
    );
    assert_eq!(payments(&db), 0);
}

/// Without a key the extractor still works: a plain transaction, committed with a 2xx and
/// rolled back with a 4xx; no record either way.
#[actix_web::test]
async fn keyless_requests_get_a_plain_transaction() {
    let (db, _store, _runs, app) = setup_pay(tx_middleware).await;
    let ok = send_as(&app, None, "", 3).await;
    assert_created(&ok);
    let rejected = send_as(&app, None, "?status=400", 3).await;
    assert_eq!(rejected.status, StatusCode::BAD_REQUEST);
    assert_eq!(payments(&db), 1);
    assert_eq!(idempotency_keys(&db), 0);
}

/// Outside a transactional scope (a method the middleware does not cover, or no middleware
/// at all) the extractor answers 500 and the handler does not run.
#[actix_web::test]
async fn extractor_outside_a_transactional_scope_is_a_500() {
    let (db, store, runs, app) = setup_pay(tx_middleware).await;
    let get = call(
        &app,
        test::TestRequest::get()
            .uri("/payments")
            .set_json(serde_json::json!({"amount": 1})),
    )
    .await;
    assert_eq!(get.status, StatusCode::INTERNAL_SERVER_ERROR);

    let plain = app!(Idempotency::new(store.clone()), runs);
    let keyed = send(&plain, "x1", "", 1).await;
    assert_eq!(keyed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_counts(&db, &runs, 0, 0);
}

/// A store whose pool has one connection, given up on after 300 ms.
async fn one_connection_store(db: &TestDb) -> PostgresStore {
    PostgresStore::builder(db.url.clone())
        .max_size(1)
        .connection_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap()
}

/// `setup`, its store dropped for a `one_connection_store`.
async fn setup_one_connection() -> (TestDb, PostgresStore) {
    let (db, _) = setup().await;
    let store = one_connection_store(&db).await;
    (db, store)
}

/// Send `second` 200 ms into a keyed request that holds the pool's only connection for 1.2 s;
/// both answers, and how long `second` took.
async fn behind_the_only_connection<S, B>(
    app: &S,
    second: test::TestRequest,
) -> (Answer, Answer, Duration)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    let first = call(
        app,
        post(
            Some("holder"),
            "?sleep_ms=1200",
            serde_json::json!({"amount": 1}),
        ),
    );
    let second = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        let answer = call(app, second).await;
        (answer, started.elapsed())
    };
    let (first, (second, took)) = futures_util::future::join(first, second).await;
    (first, second, took)
}

/// A pool with one connection held by a running request: the next request gets 503 within
/// the connection timeout and its handler does not run.
#[actix_web::test]
async fn exhausted_pool_answers_503_without_running_the_handler() {
    let (db, store) = setup_one_connection().await;
    let (runs, app) = pay_app(tx_middleware(&store)).await;
    let keyed = post(Some("p2"), "", serde_json::json!({ "amount": 1 }));
    let (first, second, took) = behind_the_only_connection(&app, keyed).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_problem(&second, "STORAGE_UNAVAILABLE", "keyed, behind the holder");
    assert!(took < Duration::from_millis(1000), "{took:?}");
    assert_counts(&db, &runs, 1, 1);
}

/// Serialization retries re-run the handler after a serialization failure at COMMIT (a
/// write skew with a transaction outside the app that commits first), and the client gets the
/// one committed run's response. Guards the retry path (COMMIT error 40001 -> run again).
#[actix_web::test]
async fn serializable_conflicts_are_retried_when_enabled() {
    let (db, store) = setup().await;
    let runs = Runs::default();
    let middleware = serializable(&store).retry_serialization_failures(3);
    let app = app!(middleware.build(), runs, post skew);
    let request = send(&app, "z1", "", 1);
    let external = async {
        // Reads and writes the same table as the handler, and commits while the handler's
        // transaction is open: the handler's COMMIT then fails with 40001.
        let mut conn = idempotency_actix::store::postgres::establish(&db.url)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        conn.batch_execute(
            "BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT count(*) FROM payments; \
             INSERT INTO payments (amount) VALUES (100)",
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        conn.batch_execute("COMMIT").await.unwrap();
    };
    let (answer, ()) = futures_util::future::join(request, external).await;
    assert_created(&answer);
    assert_eq!(runs.get(), 2, "run once more after the failed COMMIT");
    assert_eq!(answer.body["seen"], 1, "the re-run saw the external row");
    assert_eq!(payments(&db), 2);
    assert_completed(&db, "z1");
}

/// A serialization failure of one of the handler's own statements (not the COMMIT) is seen
/// by the store's watch on the connection and the request is run again. The watch shares the
/// connection's instrumentation with its own lifetime (`lifetime.rs`), so this is the path that
/// keeps both.
#[actix_web::test]
async fn a_serialization_failure_inside_the_handler_is_retried() {
    let (db, store) = setup().await;
    let runs = Runs::default();
    let middleware = tx_builder(&store).retry_serialization_failures(2);
    let app = app!(middleware.build(), runs, post fails_first_run);
    for key in ["w1", "w2"] {
        let before = runs.get();
        let answer = send(&app, key, "", 1).await;
        assert_created(&answer);
        assert_eq!(
            runs.get(),
            before + 2,
            "{key}: run once more after the 40001"
        );
        assert_completed(&db, key);
    }
    assert_eq!(
        payments(&db),
        2,
        "only the second run of each request committed"
    );
}

/// Every odd run fails its first statement with SQLSTATE 40001; even runs insert a payment.
async fn fails_first_run(
    tx: IdempotentTx,
    runs: web::Data<Runs>,
) -> actix_web::Result<HttpResponse> {
    let run = runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    let mut conn = tx.conn();
    if run % 2 == 1 {
        diesel::sql_query("DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40001'; END $$")
            .execute(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
    }
    diesel::sql_query("INSERT INTO payments (amount) VALUES (1)")
        .execute(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created().json(serde_json::json!({ "run": run })))
}

/// A run that a serialization failure rolled back, whose re-run then finds the key taken (here
/// by a session advisory lock on the scope, held by another connection, as a concurrent request
/// that claimed the key in between would hold it): the client gets the 409 the claim gives, and
/// the outcome says the handler ran (`rolled_back`), not `conflict`, which would count a run
/// as none (review of the outcomes, 2026-12-06).
#[actix_web::test]
async fn a_rerun_that_finds_its_key_taken_is_reported_as_a_run() {
    let (db, store) = setup().await;
    let runs = Runs::default();
    let (seen, hook) = outcomes();
    let middleware = tx_builder(&store)
        .retry_serialization_failures(2)
        .on_outcome(hook);
    let holder = KeyHolder {
        url: db.url.clone(),
        conn: Arc::default(),
    };
    let app = test::init_service(
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .app_data(web::Data::new(holder.clone()))
            .service(
                web::scope("")
                    .wrap(middleware.build())
                    .route("/payments", web::post().to(takes_its_key_and_fails)),
            ),
    )
    .await;
    let answer = send(&app, "r1", "", 1).await;
    assert_eq!(answer.status, StatusCode::CONFLICT);
    assert_eq!(
        runs.get(),
        1,
        "run once; the re-run's claim found the key taken"
    );
    assert_nothing_kept(&db, "r1", 0);
    assert_eq!(
        *seen.lock().unwrap(),
        [(Outcome::RolledBack, 409)],
        "the handler ran and was rolled back; the client got 409"
    );
    assert!(Outcome::RolledBack.ran_handler());
    // The lock was granted at the rollback; its holder's task stores the connection when it
    // next runs.
    let granted = Instant::now();
    let other = loop {
        if let Some(conn) = holder.conn.lock().unwrap().take() {
            break conn;
        }
        assert!(
            granted.elapsed() < Duration::from_secs(20),
            "the other connection was never granted the key's lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    drop(other);
}

/// The outcomes and statuses an `on_outcome` hook saw, and the hook.
#[allow(clippy::type_complexity)] // a test's recording, read back as it is
fn outcomes() -> (
    Arc<std::sync::Mutex<Vec<(Outcome, u16)>>>,
    impl Fn(&idempotency_actix::OutcomeEvent<'_>) + Send + Sync + 'static,
) {
    let seen: Arc<std::sync::Mutex<Vec<(Outcome, u16)>>> = Arc::default();
    let recorded = Arc::clone(&seen);
    let hook = move |event: &idempotency_actix::OutcomeEvent<'_>| {
        recorded
            .lock()
            .unwrap()
            .push((event.outcome, event.status.as_u16()))
    };
    (seen, hook)
}

/// Where [`takes_its_key_and_fails`] keeps the connection holding its scope's advisory lock.
#[derive(Clone)]
struct KeyHolder {
    url: String,
    conn: Arc<std::sync::Mutex<Option<diesel_async::AsyncPgConnection>>>,
}

/// Asks for its scope's advisory lock on a connection of its own (a task kept in
/// [`KeyHolder`]), which waits behind this request's claim; once that request is seen waiting,
/// fails with SQLSTATE 40001. The middleware rolls back, which grants the waiting request the
/// lock before the middleware's next statement: its claim of the key again finds it taken.
async fn takes_its_key_and_fails(
    tx: IdempotentTx,
    runs: web::Data<Runs>,
    holder: web::Data<KeyHolder>,
) -> actix_web::Result<HttpResponse> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    let url = holder.url.clone();
    let kept = Arc::clone(&holder.conn);
    actix_web::rt::spawn(async move {
        let mut other = diesel_async::AsyncPgConnection::establish(&url)
            .await
            .unwrap();
        diesel::sql_query(
            "SELECT pg_advisory_lock(idempotency_lock_key('acct_1', 'POST', '/payments', 'r1'))",
        )
        .execute(&mut other)
        .await
        .unwrap();
        *kept.lock().unwrap() = Some(other);
    });
    let mut conn = tx.conn();
    let started = Instant::now();
    loop {
        let waiting = diesel::sql_query(
            "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .get_result::<N>(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
        if waiting.n == 1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "nobody waits for the key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    diesel::sql_query("DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40001'; END $$")
        .execute(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created().finish())
}

/// A request whose handler kept a copy of its `HttpRequest` (here on a spawned task) cannot be
/// routed again (actix needs the request unshared to route it): after a serialization failure
/// it is answered like a failed commit (everything rolled back, the key free), not with a
/// panic's opaque 500.
#[actix_web::test]
async fn a_request_its_handler_kept_is_not_run_again_and_the_key_stays_free() {
    let (db, store) = setup().await;
    let runs = Runs::default();
    let middleware = tx_builder(&store).retry_serialization_failures(2);
    let app = app!(middleware.build(), runs, post keeps_request_and_fails_first_run);
    let answer = send(&app, "h1", "", 1).await;
    assert_problem(&answer, "COMMIT_FAILED", "answer");
    assert!(answer.retry_after);
    assert_eq!(runs.get(), 1, "not run again");
    // Nothing committed, and the claim rolled back.
    assert_nothing_kept(&db, "h1", 0);
    // The key is free: a retry runs (an even run, which succeeds).
    let retry = send(&app, "h1", "", 1).await;
    assert_created(&retry);
    assert_eq!(payments(&db), 1);
}

/// Like `fails_first_run`, and keeps a copy of its request on a task for a second.
async fn keeps_request_and_fails_first_run(
    req: actix_web::HttpRequest,
    tx: IdempotentTx,
    runs: web::Data<Runs>,
) -> actix_web::Result<HttpResponse> {
    actix_web::rt::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(req);
    });
    fails_first_run(tx, runs).await
}

/// Without the retry option, the loser of a write skew fails and nothing of it remains.
#[actix_web::test]
async fn serializable_conflict_without_retries_is_commit_failed() {
    let (db, store) = setup().await;
    let runs = Runs::default();
    let app = app!(serializable(&store).build(), runs, post skew);
    let a = send(&app, "z1", "", 1);
    let b = send(&app, "z2", "", 2);
    let (a, b) = futures_util::future::join(a, b).await;
    // The loser fails at COMMIT (COMMIT_FAILED) or at its own INSERT (the handler's 500),
    // depending on timing; either way nothing of it remains.
    let (winner, loser) = if a.status == StatusCode::CREATED {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert_eq!(winner.status, StatusCode::CREATED);
    assert!(
        loser.body["code"] == "COMMIT_FAILED" || loser.status == StatusCode::INTERNAL_SERVER_ERROR,
        "{} {}",
        loser.status,
        loser.body
    );
    assert_eq!(payments(&db), 1);
    assert_eq!(idempotency_keys(&db), 1);
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn skew(tx: IdempotentTx, runs: web::Data<Runs>) -> actix_web::Result<HttpResponse> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    let n = {
        let mut conn = tx.conn();
        diesel::sql_query("SELECT count(*) AS n FROM payments")
            .get_result::<N>(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?
            .n
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut conn = tx.conn();
    diesel::sql_query("INSERT INTO payments (amount) VALUES ($1)")
        .bind::<BigInt, _>(n)
        .execute(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    drop(conn);
    // Both write before either commits: the conflict surfaces at COMMIT of the second.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(HttpResponse::Created().json(serde_json::json!({ "seen": n })))
}

/// A storable response that `store_if` refuses is sent as it is, and the transaction (the
/// handler's row and the reservation) is rolled back: the retry runs the handler again.
#[actix_web::test]
async fn store_if_refusal_rolls_back_and_sends_the_response() {
    let (db, _store, runs, app) = setup_pay(|store| {
        tx_builder(store)
            .store_if(|parts| parts.status != StatusCode::ACCEPTED)
            .build()
    })
    .await;
    let refused = send(&app, "si1", "?status=202", 1).await;
    assert_eq!(refused.status, StatusCode::ACCEPTED);
    assert!(refused.body["id"].is_i64(), "{}", refused.body);
    assert_nothing_kept(&db, "si1", 0);
    let again = send(&app, "si1", "?status=202", 1).await;
    assert_eq!(again.status, StatusCode::ACCEPTED);
    assert!(!again.replayed);
    assert_eq!(runs.get(), 2);
    assert_nothing_kept(&db, "si1", 0);
}

/// A storable response whose body fails while it is read for storing: 500 without the
/// handler's error text, and nothing is committed.
#[actix_web::test]
async fn failing_response_body_rolls_back() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;
    let failed = send(&app, "sf1", "?stream_fail=true", 1).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !failed.body.to_string().contains("the body failed"),
        "{}",
        failed.body
    );
    assert_nothing_kept(&db, "sf1", 0);
    let retry = send(&app, "sf1", "", 1).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_counts(&db, &runs, 2, 1);
}

/// A handler that leaves a savepoint open would turn our COMMIT into a savepoint release:
/// nothing is committed, the client gets 503 COMMIT_FAILED, and a retry is safe.
#[actix_web::test]
async fn an_open_savepoint_is_never_committed() {
    let (db, _store, _runs, app) = setup_pay(tx_middleware).await;
    let failed = send(&app, "os1", "?open_savepoint=true", 1).await;
    assert_problem(&failed, "COMMIT_FAILED", "open savepoint");
    assert!(failed.retry_after);
    assert_nothing_kept(&db, "os1", 0);
    let retry = send(&app, "os1", "", 1).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(payments(&db), 1);
}

/// A handler that commits the request's transaction itself (diesel's `commit_transaction`)
/// has committed its writes and the reservation, which nothing can undo: the request finishes
/// as in the default mode. A storable response is stored, so a retry replays it instead of
/// running the handler again after the lease (it was answered `COMMIT_FAILED`, "nothing was
/// done", and re-run); a non-storable one releases the key (C10), as the default mode does.
#[actix_web::test]
async fn a_handler_that_commits_itself_finishes_as_the_default_mode() {
    let (db, _store, runs, app) = setup_pay(|store| {
        tx_builder(store)
            .lock_timeout(Duration::from_millis(300))
            .build()
    })
    .await;
    let first = send(&app, "sc1", "?self_commit=true", 1).await;
    assert_created(&first);
    tokio::time::sleep(Duration::from_millis(400)).await; // past the lease
    let retry = send(&app, "sc1", "?self_commit=true", 1).await;
    assert_created(&retry);
    assert_replays(&retry, &first, "the retry ran the handler again");
    assert_eq!(runs.get(), 1);
    assert_completed(&db, "sc1");
    assert_eq!(payments(&db), 1);

    let refused = send(&app, "sc2", "?self_commit=true&status=409", 1).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{}", refused.body);
    assert!(records_for_key(&db.url, "sc2").is_empty(), "released (C10)");
    assert_eq!(payments(&db), 2, "its committed write stays");
}

/// After its own commit, the handler's key is held by the claim's lease alone until the
/// middleware stores its response. That lease counted `lock_timeout` from the transaction's
/// start while the open transaction could last `renew_lease_up_to`, so a handler that went on
/// past `lock_timeout` after committing had its key taken over by a retry and ran twice (review,
/// 2026-12-06). The claim's lease is now the transaction's own bound.
#[actix_web::test]
async fn a_handler_that_commits_itself_keeps_its_key_while_it_runs_on() {
    let (db, _store, runs, app) = setup_pay(|store| {
        tx_builder(store)
            .lock_timeout(Duration::from_millis(300))
            .build()
    })
    .await;
    let query = "?self_commit=true&sleep_ms=900";
    let (first, retry) = futures_util::future::join(
        send(&app, "sc3", query, 1),
        after(500, send(&app, "sc3", query, 1)),
    )
    .await;
    assert_created(&first);
    assert_eq!(
        runs.get(),
        1,
        "the retry ran the handler a second time: {}",
        retry.status
    );
    assert_eq!(retry.status, StatusCode::CONFLICT, "{}", retry.body);
    let later = send(&app, "sc3", query, 1).await;
    assert_replays(&later, &first, "after the first finished");
    assert_eq!(payments(&db), 1);
}

/// A handler that rolls the request's transaction back itself undid its writes and the
/// reservation: nothing is kept, its own answer goes out, and a retry runs it.
#[actix_web::test]
async fn a_handler_that_rolls_back_itself_leaves_nothing() {
    let (db, _store, _runs, app) = setup_pay(tx_middleware).await;
    let first = send(&app, "sr1", "?self_rollback=true", 1).await;
    assert_created(&first);
    assert_nothing_kept(&db, "sr1", 0);
    let retry = send(&app, "sr1", "", 1).await;
    assert_ran(&retry, "the retry");
    assert_eq!(payments(&db), 1);
}

/// A handler that ignores a failed statement of the request's transaction leaves it aborted:
/// PostgreSQL answers the COMMIT with a rollback, not an error. The handler's 201 must not go
/// out (nothing was done), with or without a key, and a retry runs it once. A failure rolled
/// back to a savepoint (diesel's nested transaction) leaves the transaction usable: committed.
#[actix_web::test]
async fn a_transaction_aborted_by_an_ignored_error_is_never_answered_as_done() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;
    let keyless = send_as(&app, None, "?swallow_error=true", 1).await;
    assert_problem(&keyless, "COMMIT_FAILED", "keyless");
    assert_eq!(payments(&db), 0);

    let keyed = send(&app, "ab1", "?swallow_error=true", 1).await;
    assert_problem(&keyed, "COMMIT_FAILED", "keyed");
    assert_nothing_kept(&db, "ab1", 0);
    let retry = send(&app, "ab1", "", 1).await;
    assert_ran(&retry, "the retry");
    assert_eq!(payments(&db), 1);
    assert_eq!(runs.get(), 3);

    for key in [None, Some("ab2")] {
        let recovered = send_as(&app, key, "?savepoint_error=true", 1).await;
        assert_created(&recovered);
    }
    assert_eq!(payments(&db), 3);
    assert_completed(&db, "ab2");

    // Failures no instrumentation event reports: a failing statement whose future the handler
    // dropped, and the error of a row-returning statement (it comes in the row stream).
    for query in ["?abandon_failing=true", "?swallow_row_error=true"] {
        let unseen = send_as(&app, None, query, 1).await;
        assert_problem(&unseen, "COMMIT_FAILED", query);
    }
    assert_eq!(payments(&db), 3);
}

/// The same on a pool the app built (`PostgresStore::new`: its connections have no
/// instrumentation of the store's), on its only connection, request after request: the check
/// before a keyless COMMIT does not depend on what the connection observed.
#[actix_web::test]
async fn an_ignored_error_is_seen_on_a_pool_the_app_built() {
    let (db, _) = setup().await;
    let manager = idempotency_actix::store::postgres::connection_manager(&db.url).unwrap();
    let pool = idempotency_actix::store::postgres::PgPool::builder()
        .max_size(1)
        .build(manager)
        .await
        .unwrap();
    let store = PostgresStore::new(pool);
    let (_runs, app) = pay_app(tx_middleware(&store)).await;
    let first = send_as(&app, None, "", 1).await;
    assert_created(&first);
    for query in ["?swallow_error=true", "?abandon_failing=true"] {
        let aborted = send_as(&app, None, query, 1).await;
        assert_problem(&aborted, "COMMIT_FAILED", query);
    }
    assert_eq!(payments(&db), 1);
}

/// An app's own per-request query log: counts the statements it sees.
#[derive(Default)]
struct RequestQueryLog(Arc<AtomicUsize>);

impl diesel::connection::Instrumentation for RequestQueryLog {
    fn on_connection_event(&mut self, event: diesel::connection::InstrumentationEvent<'_>) {
        if let diesel::connection::InstrumentationEvent::StartQuery { .. } = event {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A handler that attaches its own diesel instrumentation to the lent connection (a
/// per-request query log), inserts a payment, then runs a statement that fails and answers 201
/// anyway.
async fn pay_with_own_query_log(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
    let mut conn = tx.conn();
    conn.set_instrumentation(RequestQueryLog::default());
    diesel::sql_query("INSERT INTO payments (amount) VALUES (1)")
        .execute(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    let failed = diesel::sql_query("SELECT 1 / 0").execute(&mut *conn).await;
    assert!(failed.is_err(), "division by zero fails");
    Ok(HttpResponse::Created().json(serde_json::json!({ "paid": true })))
}

/// The check before a keyless COMMIT does not depend on the connection's instrumentation (a
/// review found it did: a handler that set its own replaced the statement watch, which then
/// counted nothing, and the 201 went out for a rolled-back payment). With a key, `complete`
/// is the check.
#[actix_web::test]
async fn a_handler_with_its_own_instrumentation_is_still_checked() {
    let (db, store) = setup().await;
    let app = app!(tx_middleware(&store), post pay_with_own_query_log);
    for key in [None, Some("oi1")] {
        let answer = call(&app, post(key, "", serde_json::json!({}))).await;
        assert_problem(&answer, "COMMIT_FAILED", &format!("{key:?}"));
    }
    assert_eq!(payments(&db), 0);
}

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = Nullable<Text>)]
    value: Option<String>,
}

/// Answers the transaction's tenant setting; with `?leak=1` it first sets it for the whole
/// session (what a handler must not do), which outlives the request on the pooled connection.
async fn tenant_seen(
    tx: IdempotentTx,
    req: actix_web::HttpRequest,
) -> actix_web::Result<HttpResponse> {
    let mut conn = tx.conn();
    if req.query_string() == "leak=1" {
        diesel::sql_query("SET app.tenant_id = 'leaked'")
            .execute(&mut *conn)
            .await
            .map_err(actix_web::error::ErrorInternalServerError)?;
    }
    let seen = diesel::sql_query("SELECT current_setting('app.tenant_id', true) AS value")
        .get_result::<Setting>(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok(HttpResponse::Created().json(seen.value))
}

/// With a tenant source configured, a keyless request without a tenant runs with the tenant
/// setting empty in its transaction, not with whatever an earlier request left on the pooled
/// connection (row-level security keyed on it then shows it nothing).
#[actix_web::test]
async fn a_keyless_request_without_a_tenant_never_sees_a_leaked_one() {
    let (_db, store) = setup_one_connection().await;
    let app = app!(tx_middleware(&store), post tenant_seen);
    let leaking = call(&app, post(Some("l1"), "?leak=1", serde_json::json!({}))).await;
    assert_eq!(leaking.status, StatusCode::CREATED);
    let keyless = test::TestRequest::post()
        .uri("/payments")
        .set_json(serde_json::json!({}));
    let answer = call(&app, keyless).await;
    assert_created(&answer);
    assert_eq!(
        answer.body,
        serde_json::json!(""),
        "the keyless request saw a leaked tenant"
    );
}

/// A keyless request on a covered method gets a plain transaction; when no connection can be
/// had in time it is a 503 and its handler does not run.
#[actix_web::test]
async fn keyless_request_on_an_exhausted_pool_is_503() {
    let (db, store) = setup_one_connection().await;
    let (runs, app) = pay_app(tx_middleware(&store)).await;
    let keyless = post(None, "", serde_json::json!({"amount": 2}));
    let (first, second, _) = behind_the_only_connection(&app, keyless).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_problem(&second, "STORAGE_UNAVAILABLE", "keyless, behind the holder");
    assert!(second.retry_after);
    assert_counts(&db, &runs, 1, 1);
}

/// REPEATABLE READ and a store without a query timeout (the statements are awaited without a
/// deadline): a miss commits once with that isolation, a retry replays, a keyless request runs.
#[actix_web::test]
async fn repeatable_read_without_a_query_timeout() {
    let (db, _) = setup().await;
    let store = PostgresStore::builder(db.url.clone())
        .query_timeout(None)
        .build()
        .await
        .unwrap();
    let middleware = tx_builder(&store)
        .isolation_level(IsolationLevel::RepeatableRead)
        .build();
    let (runs, app) = pay_app(middleware).await;
    let first = send(&app, "rr1", "", 3).await;
    assert_created(&first);
    let replay = send(&app, "rr1", "", 3).await;
    assert_replays(&replay, &first, "the retry");
    let keyless = send_as(&app, None, "", 4).await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_counts(&db, &runs, 2, 2);
}

/// A handler that panics on a keyless request: the request's task ends without an answer, the
/// client gets an opaque 500, the transaction is rolled back with its connection, and the app
/// keeps serving.
#[actix_web::test]
async fn a_panicking_keyless_handler_is_a_500_and_rolls_back() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;
    let panicked = send_as(&app, None, "?panic=true", 1).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !panicked.body.to_string().contains("on purpose"),
        "{}",
        panicked.body
    );
    let next = send_as(&app, None, "", 2).await;
    assert_eq!(next.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 2);
    let deadline = Instant::now() + Duration::from_secs(10);
    while payments(&db) != 1 {
        assert!(
            Instant::now() < deadline,
            "the panicked request's row was not rolled back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A database migrated without the claim function (an app on transactional mode deployed
/// before `idem-cli migrate` ran the third migration): 503 with the "run `idem-cli migrate`"
/// hint, the handler does not run and nothing is written.
#[actix_web::test]
async fn a_database_without_the_claim_function_is_not_provisioned() {
    let (db, store) = setup().await;
    execute(&db.url, "DROP FUNCTION idempotency_tx_claim");
    let (runs, app) = pay_app(tx_middleware(&store)).await;
    let refused = send(&app, "np1", "", 1).await;
    assert_problem(&refused, "STORAGE_UNAVAILABLE", "not provisioned");
    let detail = refused.body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(idempotency_actix::store::postgres::TX_MIGRATE_HINT),
        "{detail}"
    );
    assert_eq!(runs.get(), 0);
    assert_nothing_kept(&db, "np1", 0);
}

/// Takes the request's transaction and runs no statement in it; sleeps, answers 201.
async fn no_statement(tx: IdempotentTx) -> HttpResponse {
    drop(tx);
    tokio::time::sleep(Duration::from_millis(300)).await;
    HttpResponse::Created().json(serde_json::json!({ "ok": true }))
}

/// A keyless `POST /payments` with the tests' tenant.
fn keyless_post() -> test::TestRequest {
    test::TestRequest::post()
        .uri("/payments")
        .insert_header(("x-account-id", "acct_1"))
}

/// `request` with `chunks` streamed as its body.
fn streamed(
    request: test::TestRequest,
    chunks: impl futures_util::Stream<Item = Result<bytes::Bytes, actix_web::error::PayloadError>>
        + 'static,
) -> actix_http::Request {
    let chunks: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<bytes::Bytes, actix_web::error::PayloadError>>>,
    > = Box::pin(chunks);
    request
        .to_request()
        .replace_payload(actix_http::Payload::from(chunks))
        .0
}

/// A keyless JSON body that sends `head`, then `tail` 1.5 s later, and 200 ms into it a keyed
/// `POST` of amount 1 for `key`: the keyless request's status and the keyed answer.
async fn behind_a_slow_keyless_upload<S, B>(
    app: &S,
    head: &'static [u8],
    tail: &'static [u8],
    key: &str,
) -> (StatusCode, Answer)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    let slow_body = futures_util::stream::unfold(0u8, move |sent| async move {
        match sent {
            0 => Some((Ok(bytes::Bytes::from_static(head)), 1)),
            1 => {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                Some((Ok(bytes::Bytes::from_static(tail)), 2))
            }
            _ => None,
        }
    });
    let keyless = streamed(
        keyless_post().insert_header(("content-type", "application/json")),
        slow_body,
    );
    let first = async { app.call(keyless).await.unwrap().status() };
    futures_util::future::join(first, after(200, send(app, key, "", 1))).await
}

/// A keyless request whose client sends its body slowly (1.5 s here) used to hold the pool's
/// connection, in an open transaction, for the whole upload: a keyed request for another key
/// meanwhile got 503 STORAGE_UNAVAILABLE. Its body is now read before the transaction opens,
/// as a keyed request's is (found by review, 2026-12-04).
#[actix_web::test]
async fn a_slow_keyless_upload_does_not_hold_a_connection() {
    let (_db, store) = setup_one_connection().await;
    let (_runs, app) = pay_app(tx_middleware(&store)).await;
    let (first, second) =
        behind_a_slow_keyless_upload(&app, b"{\"amount\"", b": 5}", "other-key").await;
    assert_eq!(first, StatusCode::CREATED);
    assert_eq!(
        second.status,
        StatusCode::CREATED,
        "a keyed request waited for a keyless client's upload: {}",
        second.body
    );
}

/// Under REPEATABLE READ a claim that meets a concurrent change of the row raises a
/// serialization failure (here a purge deleting the expired record the claim takes over, held
/// open for 300 ms by an outside transaction). Nothing has run yet, so the claim is made again
/// in a new transaction, retries of the handler configured or not; it used to answer 503
/// (found by review, 2026-12-04).
#[actix_web::test]
async fn a_claim_serialization_failure_is_claimed_again() {
    let (db, store) = setup().await;
    // An expired completed record, in either layout (the partitioned one keeps no response
    // columns in idempotency_keys, and an expired record's response is never read).
    execute(
        &db.url,
        "DO $$ BEGIN
         IF to_regclass('idempotency_responses') IS NULL THEN
             INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint,
                 state, response_status, response_headers, response_body, completed_at,
                 created_at, expires_at)
             VALUES ('acct_1', 'POST', '/payments', 'rrp', decode(repeat('00', 32), 'hex'),
                 'completed', 201, ''::bytea, ''::bytea, now() - interval '2 days',
                 now() - interval '2 days', now() - interval '1 day');
         ELSE
             INSERT INTO idempotency_keys (tenant, method, path, idempotency_key, fingerprint,
                 state, response_status, completed_at, created_at, expires_at)
             VALUES ('acct_1', 'POST', '/payments', 'rrp', decode(repeat('00', 32), 'hex'),
                 'completed', 201, now() - interval '2 days', now() - interval '2 days',
                 now() - interval '1 day');
         END IF;
         END $$",
    );
    let middleware = tx_builder(&store)
        .isolation_level(IsolationLevel::RepeatableRead)
        .build();
    let (_runs, app) = pay_app(middleware).await;
    let mut purge = outside_transaction(
        &db,
        "BEGIN; DELETE FROM idempotency_keys WHERE idempotency_key = 'rrp'",
    )
    .await;
    let request = send(&app, "rrp", "", 1);
    let commit_purge = after(300, async {
        purge.batch_execute("COMMIT").await.unwrap();
    });
    let (answer, ()) = futures_util::future::join(request, commit_purge).await;
    assert_created(&answer);
    assert_eq!(payments(&db), 1);
}

/// The client leaves (actix drops the request's future) while the handler runs: the
/// transaction still commits (detached), and the retry replays.
#[actix_web::test]
async fn a_client_that_leaves_mid_handler_still_gets_one_commit() {
    let (db, _store, runs, app) = setup_pay(tx_middleware).await;
    // Keyed, then keyless too.
    for (key, amount) in [(Some("gone1"), 1), (None, 2)] {
        let cut = tokio::time::timeout(
            Duration::from_millis(150),
            send_as(&app, key, "?sleep_ms=600", amount),
        )
        .await;
        assert!(cut.is_err(), "{key:?}: the request should have been cut");
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(payments(&db), 2, "both detached runs committed");
    let retry = send(&app, "gone1", "?sleep_ms=600", 1).await;
    assert!(retry.replayed, "{} {}", retry.status, retry.body);
    assert_eq!(runs.get(), 2);
}

/// A handler that keeps its IdempotentTx on a spawned task that still holds the
/// connection when the handler returns: 500, nothing committed, and the key free once the
/// task is done.
async fn spawns_a_holder(tx: IdempotentTx) -> HttpResponse {
    actix_web::rt::spawn(async move {
        let mut conn = tx.conn();
        let _ = diesel::sql_query("INSERT INTO payments (amount) VALUES (7)")
            .execute(&mut *conn)
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = diesel::sql_query("INSERT INTO payments (amount) VALUES (8)")
            .execute(&mut *conn)
            .await;
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    HttpResponse::Created().finish()
}

#[actix_web::test]
async fn a_txconn_held_by_a_spawned_task_is_rolled_back_and_frees_the_key() {
    let (db, store) = setup().await;
    let app = app!(tx_middleware(&store), post spawns_a_holder);
    let first = send(&app, "held1", "", 1).await;
    assert_eq!(
        first.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        first.body
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_nothing_kept(&db, "held1", 0);
    assert_eq!(
        idle_in_transaction(&db),
        0,
        "a session is still in the request's transaction"
    );
}

/// A spawned task that still borrows the connection when the handler returns, then borrows it
/// again and commits it itself: once the handler has returned the transaction is nobody's
/// (the client got a 500), so a new borrow is refused (`Finished`) and the transaction ends
/// with the last borrow. Review, 2026-12-06: the second borrow succeeded, the task could keep
/// the claim (and a pool connection) for as long as it liked, and its COMMIT stored the
/// handler's rows with an in-flight reservation: after the lease a retry ran the handler again.
async fn borrows_again_after_returning(tx: IdempotentTx) -> HttpResponse {
    actix_web::rt::spawn(async move {
        {
            let mut conn = tx.conn();
            let _ = diesel::sql_query("INSERT INTO payments (amount) VALUES (9)")
                .execute(&mut *conn)
                .await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Ok(mut conn) = tx.try_conn() {
            let _ = diesel::sql_query("INSERT INTO payments (amount) VALUES (10)")
                .execute(&mut *conn)
                .await;
            let _ = <diesel_async::AnsiTransactionManager as diesel_async::TransactionManager<
                diesel_async::AsyncPgConnection,
            >>::commit_transaction(&mut *conn)
            .await;
        }
    });
    tokio::time::sleep(Duration::from_millis(10)).await;
    HttpResponse::Created().finish()
}

#[actix_web::test]
async fn a_txconn_borrowed_again_after_the_handler_returned_is_refused() {
    let (db, store) = setup().await;
    let (seen, hook) = outcomes();
    let app = app!(
        tx_builder(&store).on_outcome(hook).build(),
        post borrows_again_after_returning
    );
    let first = send(&app, "again1", "", 1).await;
    assert_eq!(
        first.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        first.body
    );
    // Rolled back, as logged; not `commit_failed`, whose client is told COMMIT_FAILED.
    assert_eq!(*seen.lock().unwrap(), [(Outcome::RolledBack, 500)]);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_nothing_kept(&db, "again1", 0);
    assert_eq!(
        idle_in_transaction(&db),
        0,
        "a session is still in the request's transaction"
    );
}

/// `IsolationLevel::ReadCommitted`, named, is READ COMMITTED whatever the database's default:
/// it used to send a plain `BEGIN`, so a database whose `default_transaction_isolation` is
/// `serializable` ran every request SERIALIZABLE, and two requests with different keys whose
/// handlers run no statement failed each other through the middleware's own rows (found by
/// review, 2026-12-04).
#[actix_web::test]
async fn a_named_read_committed_overrides_a_stricter_database_default() {
    let db = TestDb::new().await;
    serializable_by_default(&db);
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let middleware = tx_builder(&store)
        .isolation_level(IsolationLevel::ReadCommitted)
        .build();
    let app = app!(middleware, post no_statement);
    let (a, b) = two_keys_50ms_apart(&app, "di-a", "di-b").await;
    assert_eq!(a.status, StatusCode::CREATED, "a: {}", a.body);
    assert_eq!(b.status, StatusCode::CREATED, "b: {}", b.body);
}

/// Under `Serializable`, requests with different keys whose handlers only insert commit side
/// by side: the middleware's own rows never make them fail each other. The claim read the
/// primary-key index before inserting, and serializable snapshot isolation tracks a read that
/// finds nothing by index page, so every open request whose key sorted onto the same page
/// formed a read/write cycle with the others (7 of 8 failed at COMMIT before the fix).
#[actix_web::test]
async fn serializable_requests_with_different_keys_do_not_fail_each_other() {
    let (db, store) = setup().await;
    let runs = Runs::default();
    let app = app!(serializable(&store).build(), runs, post pay);
    // All eight transactions are open at once: each handler sleeps after its insert.
    let keys: Vec<String> = (0..8).map(|i| format!("ser-{i}")).collect();
    let answers = futures_util::future::join_all(
        (0..8).map(|i| send(&app, &keys[i], "?sleep_ms=300", i as i64)),
    )
    .await;
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "request {i}: {}",
            answer.body
        );
    }
    assert_eq!(runs.get(), 8, "each handler ran once");
    assert_eq!(payments(&db), 8);
    assert_eq!(
        count(
            &db.url,
            "SELECT count(*) AS n FROM idempotency_keys WHERE state = 'completed'"
        ),
        8
    );
}

/// Under `Serializable`, a retry of a completed key is a replay (C6) and another body a 422
/// (C7), even while another retry of the same key is between its claim and its ROLLBACK (a
/// replay on another instance, or on another connection of this one). Migration 000010's first
/// claim took the scope's advisory lock before it knew the row existed and answered "in flight"
/// when it could not: the retry got 409, and so did the other body (found by review,
/// 2026-12-04).
#[actix_web::test]
async fn a_serializable_replay_is_not_a_409_while_another_replay_of_the_key_runs() {
    let (db, _store, runs, app) = setup_pay(|store| serializable(store).build()).await;
    let first = send(&app, "held-replay", "", 10).await;
    assert_created(&first);
    // Another replay of the same request, exactly as the middleware sends it: BEGIN, the
    // claim (which answers the completed record), and its ROLLBACK still to come.
    let mut other = outside_transaction(
        &db,
        "BEGIN ISOLATION LEVEL SERIALIZABLE;
             SELECT * FROM idempotency_tx_claim('app.tenant_id', 'acct_1', 'acct_1', 'POST',
                 '/payments', 'held-replay',
                 (SELECT fingerprint FROM idempotency_keys WHERE idempotency_key = 'held-replay'),
                 gen_random_uuid(), 60000000)",
    )
    .await;
    let retry = send(&app, "held-replay", "", 10).await;
    let other_body = send(&app, "held-replay", "", 11).await;
    other.batch_execute("ROLLBACK").await.unwrap();
    let seen = (
        (retry.status.as_u16(), retry.replayed),
        other_body.status.as_u16(),
    );
    assert_eq!(
        seen,
        ((201, true), 422),
        "(retry of the completed payment, same key with another body): {} / {}",
        retry.body,
        other_body.body
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(runs.get(), 1);
}

/// The same without a helper connection: bursts of concurrent retries of a completed key (a
/// client that timed out and retries from several places) under `Serializable` are all
/// replays (26 to 30 of 40 got 409 with migration 000010's first claim).
#[actix_web::test]
async fn serializable_concurrent_replays_all_replay() {
    let (db, _store, runs, app) = setup_pay(|store| serializable(store).build()).await;
    let first = send(&app, "burst", "", 10).await;
    assert_created(&first);
    let mut conflicts = 0;
    let mut statuses = Vec::new();
    for _round in 0..5 {
        let answers =
            futures_util::future::join_all((0..8).map(|_| send(&app, "burst", "", 10))).await;
        for answer in answers {
            statuses.push(answer.status.as_u16());
            if answer.status != StatusCode::CREATED || !answer.replayed {
                conflicts += 1;
            }
        }
    }
    assert_counts(&db, &runs, 1, 1);
    assert_eq!(
        conflicts, 0,
        "40 concurrent retries of a completed key, not all replays: {statuses:?}"
    );
}

/// Under `Serializable`, misses open at once mixed with replays of other (completed) keys, a
/// mismatch and 409 duplicates of the open misses: every miss commits once, nothing fails at
/// COMMIT, and each of the others gets its own answer.
#[actix_web::test]
async fn serializable_mixed_flows_do_not_fail_each_other() {
    let (db, _store, runs, app) = setup_pay(|store| serializable(store).build()).await;
    let done: Vec<String> = (0..4).map(|i| format!("mix-done-{i}")).collect();
    for key in &done {
        assert_eq!(send(&app, key, "", 5).await.status, StatusCode::CREATED);
    }
    let misses: Vec<String> = (0..6).map(|i| format!("mix-miss-{i}")).collect();
    let miss_requests =
        futures_util::future::join_all(misses.iter().map(|k| send(&app, k, "?sleep_ms=400", 7)));
    let others = after(100, async {
        let replays = futures_util::future::join_all(done.iter().map(|k| send(&app, k, "", 5)));
        let duplicates =
            futures_util::future::join_all(misses.iter().map(|k| send(&app, k, "", 7)));
        let mismatch = send(&app, &done[0], "", 6);
        futures_util::future::join3(replays, duplicates, mismatch).await
    });
    let (miss_answers, (replays, duplicates, mismatch)) =
        futures_util::future::join(miss_requests, others).await;
    let statuses = |v: &[Answer]| v.iter().map(|a| a.status.as_u16()).collect::<Vec<_>>();
    assert_eq!(
        statuses(&miss_answers),
        vec![201; 6],
        "{:?}",
        miss_answers.iter().map(|a| &a.body).collect::<Vec<_>>()
    );
    assert_eq!(statuses(&replays), vec![201; 4]);
    assert!(replays.iter().all(|a| a.replayed));
    assert_eq!(statuses(&duplicates), vec![409; 6]);
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_counts(&db, &runs, 10, 10);
}

#[derive(diesel::QueryableByName)]
struct Total {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Pays only if no payment exists yet: an invariant SERIALIZABLE protects against write skew.
async fn at_most_one_payment(tx: IdempotentTx) -> HttpResponse {
    let total = {
        let mut conn = tx.conn();
        diesel::sql_query("SELECT count(*) AS n FROM payments")
            .get_result::<Total>(&mut *conn)
            .await
    };
    let Ok(total) = total else {
        return HttpResponse::InternalServerError().finish();
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    if total.n == 0 {
        let mut conn = tx.conn();
        if diesel::sql_query("INSERT INTO payments (amount) VALUES (1)")
            .execute(&mut *conn)
            .await
            .is_err()
        {
            return HttpResponse::InternalServerError().finish();
        }
    }
    HttpResponse::Created().finish()
}

/// By default the database's own `default_transaction_isolation` applies: an operator who made
/// it SERIALIZABLE to guard an invariant keeps it (a review of the fix above found two
/// check-then-insert payments committed when READ COMMITTED was forced, 2026-12-04).
#[actix_web::test]
async fn the_database_default_isolation_applies_unless_one_is_named() {
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    serializable_by_default(&db);
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let app = app!(tx_middleware(&store), post at_most_one_payment);
    let (a, b) = two_keys_50ms_apart(&app, "iso-a", "iso-b").await;
    assert_eq!(
        payments(&db),
        1,
        "the database's SERIALIZABLE default was overridden, or nothing was paid (a: {}, b: {})",
        a.status,
        b.status
    );
    // One of them paid (201); the other was rolled back by its serialization failure: a 500
    // from the handler's failed INSERT or a 503 `COMMIT_FAILED`, never a second 201.
    let created = [&a, &b]
        .iter()
        .filter(|answer| answer.status == StatusCode::CREATED)
        .count();
    assert_eq!(
        created, 1,
        "a: {} {}, b: {} {}",
        a.status, a.body, b.status, b.body
    );
    assert!(
        [&a, &b]
            .iter()
            .all(|answer| answer.status == StatusCode::CREATED || answer.status.is_server_error()),
        "a: {} {}, b: {} {}",
        a.status,
        a.body,
        b.status,
        b.body
    );
}

/// Keeps a copy of its request on a task for 5 s (an audit log, say), inserts, then panics.
async fn keeps_request_then_panics(req: actix_web::HttpRequest, tx: IdempotentTx) -> HttpResponse {
    actix_web::rt::spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        drop(req);
    });
    {
        let mut conn = tx.conn();
        let _ = diesel::sql_query("INSERT INTO payments (amount) VALUES (1)")
            .execute(&mut *conn)
            .await;
    }
    panic!("the handler panicked on purpose");
}

/// A keyed handler panics while a copy of its HttpRequest lives on (on a task): the request's
/// extensions hold the IdempotentTx, whose slot used to keep the connection, the open
/// transaction and its claim until that copy was dropped (the retry got 409 meanwhile). Now
/// the slot is emptied on unwind (found by review, 2026-12-04).
#[actix_web::test]
async fn a_panicking_handler_that_kept_its_request_does_not_hold_the_key() {
    let (db, store) = setup().await;
    let app = app!(tx_middleware(&store), post keeps_request_then_panics);
    let first = send(&app, "kp1", "", 1).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let open = idle_in_transaction(&db);
    let retry = send(&app, "kp1", "", 1).await;
    // Not 409 (the key held by the panicked request's open transaction): the retry ran the
    // handler again, which panicked again.
    assert_eq!(
        retry.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "({open} session(s) idle in transaction): {}",
        retry.body
    );
}

/// Echoes the body it was given, in its transaction.
async fn echo_body(tx: IdempotentTx, body: web::Bytes) -> HttpResponse {
    drop(tx);
    HttpResponse::Created().json(serde_json::json!({ "body": String::from_utf8_lossy(&body) }))
}

/// A keyless request's body in chunks, as a client sends it.
fn chunked_keyless(chunks: Vec<bytes::Bytes>) -> actix_http::Request {
    streamed(
        keyless_post(),
        futures_util::stream::iter(chunks.into_iter().map(Ok)),
    )
}

/// A keyless body within `max_body_bytes` reaches the handler whole and in order, read before
/// its transaction opens; one over it is refused with 413, like a keyed one, without running
/// the handler (read inside the transaction, the rest of it could hold the connection for as
/// long as its client liked: `a_slow_keyless_upload_over_the_limit_does_not_hold_a_connection`).
#[actix_web::test]
async fn a_keyless_body_is_read_whole_before_its_transaction_or_refused() {
    let (_db, store) = setup().await;
    let app = app!(tx_builder(&store).max_body_bytes(36).build(), post echo_body);
    let alphabet = ["0123456789", "abcdefghij", "klmnopqrst", "uvwxyz"]
        .map(|chunk| bytes::Bytes::from_static(chunk.as_bytes()));
    let response = app
        .call(chunked_keyless(alphabet.to_vec()))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CREATED);
    let body: serde_json::Value = test::read_body_json(response).await;
    assert_eq!(
        body["body"], "0123456789abcdefghijklmnopqrstuvwxyz",
        "{body}"
    );

    let mut over = alphabet.to_vec();
    over.push(bytes::Bytes::from_static(b"!"));
    let response = app.call(chunked_keyless(over)).await.expect("response");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body: serde_json::Value = test::read_body_json(response).await;
    assert_eq!(body["code"], "PAYLOAD_TOO_LARGE", "{body}");
}

/// A client whose keyless body is over `max_body_bytes` and arrives slowly (or never ends)
/// holds no pooled connection: a keyed request meanwhile is served. It used to get its
/// transaction at once, the rest of its body read inside it, so any anonymous client could take
/// the pool (found by review, 2026-12-04; the slow upload within the limit was fixed the same
/// morning, `a_slow_keyless_upload_does_not_hold_a_connection`).
#[actix_web::test]
async fn a_slow_keyless_upload_over_the_limit_does_not_hold_a_connection() {
    let (_db, store) = setup_one_connection().await;
    let (runs, app) = pay_app(tx_builder(&store).max_body_bytes(16).build()).await;
    // The keyless body is 20 bytes, over the 16-byte limit; the keyed one is small, within it.
    let (first, second) =
        behind_a_slow_keyless_upload(&app, b"{\"amount\": 5, \"pad\":", b" \"x\"}", "k").await;
    assert_eq!(first, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        second.status,
        StatusCode::CREATED,
        "a keyed request waited for a keyless client's upload over max_body_bytes: {}",
        second.body
    );
    assert_eq!(runs.get(), 1, "only the keyed request ran");
}

/// A session that PostgreSQL ended while the handler was idle (here its
/// `idle_in_transaction_session_timeout`, which the middleware sets itself; the same for a
/// terminated idle backend) is dead before the middleware sends anything: no COMMIT can have
/// reached it, nothing was committed. A keyed request says so (`COMMIT_FAILED`, from its
/// `complete`); a keyless one must too, not `COMMIT_OUTCOME_UNKNOWN` ("check before
/// retrying"). (Found by a review of the `SELECT 1; COMMIT` batch, which answered
/// `COMMIT_OUTCOME_UNKNOWN` here until the batch's first poll told "never sent" apart.)
#[actix_web::test]
async fn a_session_ended_while_idle_is_a_known_rollback_for_a_keyless_request() {
    // The idle limit is the larger of lock_timeout and renew_lease_up_to: 300 ms.
    let (db, _store, _runs, app) = setup_pay(|store| {
        tx_builder(store)
            .lock_timeout(Duration::from_millis(300))
            .renew_lease_up_to(Duration::ZERO)
            .build()
    })
    .await;

    let keyed = send(&app, "idle-keyed", "?sleep_ms=1200", 1).await;
    assert_problem(&keyed, "COMMIT_FAILED", "keyed");

    let keyless = send_as(&app, None, "?sleep_ms=1200", 1).await;
    assert_eq!(payments(&db), 0, "nothing was committed");
    assert_problem(
        &keyless,
        "COMMIT_FAILED",
        "keyless: the session was gone before COMMIT was sent",
    );
}

/// Every outcome of `check_and_commit` leaves the pool's
/// only connection usable and outside a transaction for the next request (depth lowered by
/// hand, ROLLBACK after a refused SELECT 1 or a refused COMMIT, `requires_rollback` set by a
/// 40001 at the bypassed COMMIT), and what each request answers matches what committed.
#[actix_web::test]
async fn check_and_commit_leaves_the_only_connection_clean() {
    let (db, _) = setup().await;
    execute(&db.url, DEFERRED_FOREIGN_KEY);
    let store = one_connection_store(&db).await;
    let (_runs, app) = pay_app(tx_middleware(&store)).await;
    let cases = [
        ("", "201"),
        ("?swallow_error=true", "COMMIT_FAILED"),
        ("?account=42", "COMMIT_FAILED"),
        ("?savepoint_error=true", "201"),
        ("?abandon_failing=true", "COMMIT_FAILED"),
        ("?swallow_row_error=true", "COMMIT_FAILED"),
        ("?open_savepoint=true", "COMMIT_FAILED"),
        ("?status=400", "400"),
        ("", "201"),
    ];
    let mut committed = 0;
    for (query, expected) in cases {
        let answer = send_as(&app, None, query, 1).await;
        let got = match answer.body.get("code") {
            Some(code) => code.as_str().unwrap().to_owned(),
            None => answer.status.as_u16().to_string(),
        };
        assert_eq!(got, expected, "{query}: {}", answer.body);
        if expected == "201" {
            committed += 1;
        }
        assert_eq!(payments(&db), committed, "{query}");
    }
    // The one connection is still idle, outside a transaction, in the server's view.
    assert_eq!(
        count(
            &db.url,
            "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() \
             AND state <> 'idle' AND pid <> pg_backend_pid()"
        ),
        0
    );
}
