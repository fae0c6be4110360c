//! The database connection cut between two statements of one request.
//!
//! A [`CutProxy`] in front of PostgreSQL cuts the connection that carries one chosen statement
//! of a keyed miss, either before the statement reaches the server (it never runs) or after
//! (it ran, the answer is lost). For the default mode (`PostgresStore`) and the transactional
//! mode, at each statement of a miss, both ways, then retries of the same key (same body, and
//! a different body at the end) during and after a 1 s lease. Asserted:
//! - the handler's effect exists at most once per key (a counter, or rows in `payments`);
//! - the cut client gets a problem with a sensible code, never a 2xx for work that did not
//!   commit (every 2xx of the transactional mode names a committed row);
//! - a retry eventually gets a replay of the committed response, or a fresh run when nothing
//!   committed, within the lease + a few seconds (no key stuck on 409);
//! - no panic outside the test code.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpRequest, HttpResponse};
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::{Idempotency, IdempotentTx};
use idempotency_e2e::proxy::{Cut, CutProxy};
use idempotency_e2e::records::{count, execute};
use idempotency_e2e::TestDb;

const LEASE: Duration = Duration::from_secs(1);
/// How long past the lease a key may answer 409 before it counts as stuck.
const SLACK: Duration = Duration::from_secs(4);

// ------------------------------------------------------------------------------------------
// Panics in the library's code (its tasks, its middleware). Only there: this module shares its
// test binary with others whose handlers panic on purpose.

fn panics() -> &'static Mutex<Vec<String>> {
    static PANICS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    PANICS.get_or_init(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let file = info
                .location()
                .map(|l| l.file().to_owned())
                .unwrap_or_default();
            if file.contains("idempotency-actix/src") {
                if let Ok(mut p) = panics().lock() {
                    p.push(format!("{info}"));
                }
            }
            default(info);
        }));
        Mutex::new(Vec::new())
    })
}

fn assert_no_foreign_panic() {
    let seen = panics().lock().unwrap().clone();
    assert!(seen.is_empty(), "panics in the library: {seen:#?}");
}

// ------------------------------------------------------------------------------------------
// Answers.

#[derive(Debug, Clone)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: serde_json::Value,
}

impl Answer {
    fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }
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
                body: serde_json::from_slice(&body).unwrap_or_else(|_| {
                    serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
                }),
            };
        }
    };
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = test::read_body(response).await;
    Answer {
        status,
        replayed,
        body: serde_json::from_slice(&body).unwrap_or_else(|_| {
            serde_json::Value::String(String::from_utf8_lossy(&body).into_owned())
        }),
    }
}

fn post(key: Option<&str>, amount: i64) -> test::TestRequest {
    let mut req = test::TestRequest::post()
        .uri("/payments")
        .insert_header(("x-account-id", "acct_1"))
        .set_json(serde_json::json!({ "amount": amount }));
    if let Some(key) = key {
        req = req.insert_header(("idempotency-key", key));
    }
    req
}

// ------------------------------------------------------------------------------------------
// Handlers.

/// Shared by the handlers: runs per key, and "fail the next run with a 500".
#[derive(Clone, Default)]
struct State {
    runs: Arc<Mutex<HashMap<String, usize>>>,
    /// 2xx answers given by the handler, per key (the default mode's "effect").
    effects: Arc<Mutex<HashMap<String, usize>>>,
    fail_next: Arc<AtomicBool>,
    /// Milliseconds the next run sleeps before answering.
    sleep_next_ms: Arc<std::sync::atomic::AtomicU64>,
}

impl State {
    fn runs(&self, key: &str) -> usize {
        self.runs.lock().unwrap().get(key).copied().unwrap_or(0)
    }
    fn effects(&self, key: &str) -> usize {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

fn key_of(req: &HttpRequest) -> Option<String> {
    req.headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Default mode: the effect is a counter; answers 201 with a nonce (500 when `fail_next`).
async fn pay_default(req: HttpRequest, state: web::Data<State>) -> HttpResponse {
    let key = key_of(&req).unwrap_or_default();
    *state.runs.lock().unwrap().entry(key.clone()).or_default() += 1;
    let sleep = state.sleep_next_ms.swap(0, Ordering::SeqCst);
    if sleep > 0 {
        tokio::time::sleep(Duration::from_millis(sleep)).await;
    }
    if state.fail_next.swap(false, Ordering::SeqCst) {
        return HttpResponse::InternalServerError().json(serde_json::json!({"failed": true}));
    }
    *state
        .effects
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default() += 1;
    let nonce = idempotency_actix::store::ReservationToken::random()
        .as_uuid()
        .to_string();
    HttpResponse::Created().json(serde_json::json!({ "key": key, "nonce": nonce }))
}

#[derive(diesel::QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// Transactional mode: one row in `payments` through the request's transaction; answers 201
/// with the row's id.
async fn pay_tx(
    tx: IdempotentTx,
    req: HttpRequest,
    state: web::Data<State>,
    body: web::Json<serde_json::Value>,
) -> actix_web::Result<HttpResponse> {
    let key = key_of(&req);
    *state
        .runs
        .lock()
        .unwrap()
        .entry(key.clone().unwrap_or_default())
        .or_default() += 1;
    let amount = body["amount"].as_i64().unwrap_or(1);
    let mut conn = tx.conn();
    let id = diesel::sql_query(
        "INSERT INTO payments (idempotency_key, amount) VALUES ($1, $2) RETURNING id",
    )
    .bind::<Nullable<Text>, _>(&key)
    .bind::<BigInt, _>(amount)
    .get_result::<Id>(&mut *conn)
    .await
    .map_err(actix_web::error::ErrorInternalServerError)?
    .id;
    let sleep = state.sleep_next_ms.swap(0, Ordering::SeqCst);
    if sleep > 0 {
        tokio::time::sleep(Duration::from_millis(sleep)).await;
    }
    if state.fail_next.swap(false, Ordering::SeqCst) {
        // The row must be rolled back.
        return Ok(HttpResponse::InternalServerError().json(serde_json::json!({"failed": id})));
    }
    Ok(HttpResponse::Created().json(serde_json::json!({ "id": id, "key": key })))
}

const PAYMENTS: &str = "CREATE TABLE payments (
    id bigserial PRIMARY KEY,
    idempotency_key text,
    amount bigint NOT NULL
)";

fn rows_for(db: &TestDb, key: &str) -> i64 {
    count(
        &db.url,
        &format!("SELECT count(*) AS n FROM payments WHERE idempotency_key = '{key}'"),
    )
}

fn row_exists(db: &TestDb, id: i64) -> bool {
    count(
        &db.url,
        &format!("SELECT count(*) AS n FROM payments WHERE id = {id}"),
    ) == 1
}

// ------------------------------------------------------------------------------------------
// The scenario.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Default,
    Transactional,
}

/// What the cut client may be answered.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// A 503 problem with this code.
    Problem(&'static str),
    /// The handler's own answer (the cut came after the handler answered, default mode).
    Handler(u16),
    /// The handler's 500 (its own statement failed, the transaction rolled back).
    HandlerError,
}

async fn build_store(proxy: &CutProxy, db: &TestDb) -> PostgresStore {
    build_store_with(proxy, db, false).await
}

async fn build_store_with(proxy: &CutProxy, db: &TestDb, fast_path: bool) -> PostgresStore {
    PostgresStore::builder(proxy.url_through(&db.url))
        .pool_per_thread(POOL_PER_THREAD.with(|p| *p.borrow()))
        .replay_fast_path(fast_path)
        .max_size(3)
        .connection_timeout(Duration::from_secs(2))
        .build()
        .await
        .expect("store")
}

/// One cut at `needle` (`cut`) during a keyed miss, then retries; see the module docs.
async fn keyed_cut(mode: Mode, needle: &str, cut: Cut, fail_first: bool, expect: Expect) {
    keyed_cut_with(mode, needle, cut, fail_first, expect, false, None).await;
}

/// [`keyed_cut`] with more cuts armed at once (each fires once, in the background tasks that
/// follow the first cut, say).
async fn keyed_cuts(
    mode: Mode,
    needle: &str,
    cut: Cut,
    extra: &[(&str, Cut)],
    fail_first: bool,
    expect: Expect,
) {
    EXTRA.with(|e| *e.borrow_mut() = extra.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect());
    keyed_cut_with(mode, needle, cut, fail_first, expect, false, None).await;
}

thread_local! {
    static POOL_PER_THREAD: std::cell::RefCell<Option<u32>> = const { std::cell::RefCell::new(None) };
    static EXTRA: std::cell::RefCell<Vec<(String, Cut)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`keyed_cut`] with the replay fast path, and optionally a cut (`then`) armed for the
/// first replay of the key after its success.
async fn keyed_cut_with(
    mode: Mode,
    needle: &str,
    cut: Cut,
    fail_first: bool,
    expect: Expect,
    fast_path: bool,
    then: Option<(&str, Cut)>,
) {
    let _ = panics();
    let db = TestDb::new().await;
    if mode == Mode::Transactional {
        execute(&db.url, PAYMENTS);
    }
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store_with(&proxy, &db, fast_path).await;
    let state = State::default();
    let mut builder = Idempotency::builder(store.clone())
        .tenant_header("x-account-id")
        .lock_timeout(LEASE);
    if mode == Mode::Transactional {
        builder = builder.transactional();
    }
    let app = match mode {
        Mode::Default => {
            test::init_service(
                App::new().app_data(web::Data::new(state.clone())).service(
                    web::scope("")
                        .wrap(builder.build())
                        .route("/payments", web::post().to(pay_default)),
                ),
            )
            .await
        }
        Mode::Transactional => {
            test::init_service(
                App::new().app_data(web::Data::new(state.clone())).service(
                    web::scope("")
                        .wrap(builder.build())
                        .route("/payments", web::post().to(pay_tx)),
                ),
            )
            .await
        }
    };
    let what = format!("{mode:?} cut {cut:?} at {needle:?}");
    // Warm: connections open and statements prepared.
    for warm in ["warm-1", "warm-2"] {
        let a = call(&app, post(Some(warm), 1)).await;
        assert_eq!(a.status, StatusCode::CREATED, "{what}: warm-up {a:?}");
    }

    let key = "k1";
    state.fail_next.store(fail_first, Ordering::SeqCst);
    proxy.arm(needle, cut);
    let extra = EXTRA.with(|e| e.borrow().clone());
    for (n, c) in &extra {
        proxy.arm(n, *c);
    }
    let what = format!("{what} then {extra:?}");
    let started = Instant::now();
    let first = call(&app, post(Some(key), 7)).await;
    assert!(
        proxy.fired() >= 1,
        "{what}: the cut happened (first: {first:?})"
    );
    eprintln!(
        "{what}: first answer after {:?}: {first:?}",
        started.elapsed()
    );

    match expect {
        Expect::Problem(code) => {
            assert_eq!(
                first.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{what}: {first:?}"
            );
            assert_eq!(first.code(), code, "{what}: {first:?}");
        }
        Expect::Handler(status) => {
            assert_eq!(first.status.as_u16(), status, "{what}: {first:?}");
        }
        Expect::HandlerError => {
            assert_eq!(
                first.status,
                StatusCode::INTERNAL_SERVER_ERROR,
                "{what}: {first:?}"
            );
            assert!(first.body.get("id").is_none(), "{what}: {first:?}");
        }
    }
    // Never a 2xx for work that did not commit.
    if first.status.is_success() && mode == Mode::Transactional {
        let id = first.body["id"].as_i64().expect("id");
        assert!(
            row_exists(&db, id),
            "{what}: 2xx names row {id}, not committed"
        );
    }

    // A different body right away, when the key is known to be held or completed (the first
    // got a 2xx, or its COMMIT reached the server): never a run, never a 2xx.
    let held = first.status.is_success()
        || (mode == Mode::Transactional
            && cut == Cut::AfterSend
            && first.code() == "COMMIT_OUTCOME_UNKNOWN");
    if held {
        let before = (state.effects(key), state.runs(key));
        let other = call(&app, post(Some(key), 9)).await;
        eprintln!("{what}: different body right after: {other:?}");
        assert!(
            other.status == StatusCode::CONFLICT
                || other.status == StatusCode::UNPROCESSABLE_ENTITY,
            "{what}: different body while held: {other:?}"
        );
        assert_eq!(
            before,
            (state.effects(key), state.runs(key)),
            "{what}: no run"
        );
    }
    // Same body, until a 2xx; 409 allowed only up to the lease + slack.
    let mut answers = Vec::new();
    let success = loop {
        let a = call(&app, post(Some(key), 7)).await;
        answers.push((started.elapsed(), a.status.as_u16(), a.code().to_owned()));
        if a.status.is_success() {
            break a;
        }
        assert!(
            a.status == StatusCode::CONFLICT
                || a.status == StatusCode::INTERNAL_SERVER_ERROR
                    && fail_first
                    && answers.len() == 1
                || a.status == StatusCode::SERVICE_UNAVAILABLE,
            "{what}: unexpected retry answer {a:?}; so far {answers:?}"
        );
        assert!(
            started.elapsed() < LEASE + SLACK,
            "{what}: key stuck: {answers:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "{what}: retries {answers:?} then {success:?}; runs {}",
        state.runs(key)
    );
    let unavailable = answers.iter().filter(|(_, s, _)| *s == 503).count();
    assert_eq!(
        unavailable, 0,
        "{what}: a retry got 503 after one cut: {answers:?}"
    );

    // The effect exists exactly once, and the success is either the replay of the first 2xx
    // or a fresh run.
    match mode {
        Mode::Default => {
            assert_eq!(state.effects(key), 1, "{what}: handler effect count");
            if first.status.is_success() {
                assert!(
                    success.replayed,
                    "{what}: the retry must replay: {success:?}"
                );
                assert_eq!(
                    success.body, first.body,
                    "{what}: replay of the first answer"
                );
            }
        }
        Mode::Transactional => {
            assert_eq!(rows_for(&db, key), 1, "{what}: payments rows for the key");
            let id = success.body["id"].as_i64().expect("id");
            assert!(
                row_exists(&db, id),
                "{what}: 2xx names row {id}, not committed"
            );
            if first.status.is_success() {
                assert!(
                    success.replayed,
                    "{what}: the retry must replay: {success:?}"
                );
            }
        }
    }

    if !extra.is_empty() {
        // Let the background retries (of a complete, of a release) run out their cuts.
        tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    }
    // Again: now a replay of that success (with a cut in it, if asked).
    if let Some((needle, cut)) = then {
        proxy.arm(needle, cut);
    }
    let again = call(&app, post(Some(key), 7)).await;
    assert_eq!(again.status, success.status, "{what}: {again:?}");
    assert!(again.replayed, "{what}: a replay: {again:?}");
    assert_eq!(again.body, success.body, "{what}: same body");
    if then.is_some() {
        assert_eq!(proxy.fired(), 2, "{what}: the cut in the replay happened");
    } else {
        assert_eq!(
            proxy.fired(),
            1 + extra.len() as u64,
            "{what}: every cut happened"
        );
    }
    // Another body: 422.
    let other = call(&app, post(Some(key), 8)).await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{what}: {other:?}"
    );
    match mode {
        Mode::Default => assert_eq!(state.effects(key), 1, "{what}"),
        Mode::Transactional => assert_eq!(rows_for(&db, key), 1, "{what}"),
    }
    // The pool works afterwards.
    let after = call(&app, post(Some("after"), 1)).await;
    assert_eq!(
        after.status,
        StatusCode::CREATED,
        "{what}: after: {after:?}"
    );
    assert_no_foreign_panic();
}

// ---- default mode -------------------------------------------------------------------------

const RESERVE: &str = "idempotency_reserve(";
const COMPLETE: &str = "idempotency_complete(";
const RELEASE: &str = "DELETE FROM \"idempotency_keys\"";

#[actix_web::test]
async fn default_reserve_cut_before() {
    keyed_cut(
        Mode::Default,
        RESERVE,
        Cut::BeforeSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn default_reserve_cut_after() {
    keyed_cut(
        Mode::Default,
        RESERVE,
        Cut::AfterSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn default_complete_cut_before() {
    keyed_cut(
        Mode::Default,
        COMPLETE,
        Cut::BeforeSend,
        false,
        Expect::Handler(201),
    )
    .await;
}

#[actix_web::test]
async fn default_complete_cut_after() {
    keyed_cut(
        Mode::Default,
        COMPLETE,
        Cut::AfterSend,
        false,
        Expect::Handler(201),
    )
    .await;
}

#[actix_web::test]
async fn default_release_cut_before() {
    keyed_cut(
        Mode::Default,
        RELEASE,
        Cut::BeforeSend,
        true,
        Expect::Handler(500),
    )
    .await;
}

#[actix_web::test]
async fn default_release_cut_after() {
    keyed_cut(
        Mode::Default,
        RELEASE,
        Cut::AfterSend,
        true,
        Expect::Handler(500),
    )
    .await;
}

// ---- transactional mode -------------------------------------------------------------------

const BEGIN: &str = "idle_in_transaction_session_timeout";
const CLAIM: &str = "idempotency_tx_claim(";
const INSERT: &str = "INSERT INTO payments";

#[actix_web::test]
async fn tx_begin_cut_before() {
    keyed_cut(
        Mode::Transactional,
        BEGIN,
        Cut::BeforeSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn tx_begin_cut_after() {
    keyed_cut(
        Mode::Transactional,
        BEGIN,
        Cut::AfterSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn tx_claim_cut_before() {
    keyed_cut(
        Mode::Transactional,
        CLAIM,
        Cut::BeforeSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn tx_claim_cut_after() {
    keyed_cut(
        Mode::Transactional,
        CLAIM,
        Cut::AfterSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn tx_handler_insert_cut_before() {
    keyed_cut(
        Mode::Transactional,
        INSERT,
        Cut::BeforeSend,
        false,
        Expect::HandlerError,
    )
    .await;
}

#[actix_web::test]
async fn tx_handler_insert_cut_after() {
    keyed_cut(
        Mode::Transactional,
        INSERT,
        Cut::AfterSend,
        false,
        Expect::HandlerError,
    )
    .await;
}

#[actix_web::test]
async fn tx_complete_cut_before() {
    keyed_cut(
        Mode::Transactional,
        COMPLETE,
        Cut::BeforeSend,
        false,
        Expect::Problem("COMMIT_FAILED"),
    )
    .await;
}

#[actix_web::test]
async fn tx_complete_cut_after() {
    keyed_cut(
        Mode::Transactional,
        COMPLETE,
        Cut::AfterSend,
        false,
        Expect::Problem("COMMIT_FAILED"),
    )
    .await;
}

#[actix_web::test]
async fn tx_commit_cut_before() {
    keyed_cut(
        Mode::Transactional,
        "COMMIT",
        Cut::BeforeSend,
        false,
        Expect::Problem("COMMIT_OUTCOME_UNKNOWN"),
    )
    .await;
}

#[actix_web::test]
async fn tx_commit_cut_after() {
    keyed_cut(
        Mode::Transactional,
        "COMMIT",
        Cut::AfterSend,
        false,
        Expect::Problem("COMMIT_OUTCOME_UNKNOWN"),
    )
    .await;
}

// ---- transactional, keyless ---------------------------------------------------------------

async fn keyless_cut(needle: &str, cut: Cut, expect_code: &str, rows_after: i64) {
    let _ = panics();
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store(&proxy, &db).await;
    let state = State::default();
    let app = test::init_service(
        App::new().app_data(web::Data::new(state.clone())).service(
            web::scope("")
                .wrap(
                    Idempotency::builder(store.clone())
                        .tenant_header("x-account-id")
                        .lock_timeout(LEASE)
                        .transactional()
                        .build(),
                )
                .route("/payments", web::post().to(pay_tx)),
        ),
    )
    .await;
    let what = format!("keyless cut {cut:?} at {needle:?}");
    let warm = call(&app, post(None, 1)).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{what}: {warm:?}");
    let total = || count(&db.url, "SELECT count(*) AS n FROM payments");
    assert_eq!(total(), 1);
    proxy.arm(needle, cut);
    let first = call(&app, post(None, 5)).await;
    assert_eq!(proxy.fired(), 1, "{what}: {first:?}");
    eprintln!("{what}: {first:?}");
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what}: {first:?}"
    );
    assert_eq!(first.code(), expect_code, "{what}: {first:?}");
    assert_eq!(
        total(),
        1 + rows_after,
        "{what}: rows committed by the cut request"
    );
    let after = call(&app, post(None, 1)).await;
    assert_eq!(after.status, StatusCode::CREATED, "{what}: {after:?}");
    let id = after.body["id"].as_i64().unwrap();
    assert!(row_exists(&db, id));
    assert_no_foreign_panic();
}

#[actix_web::test]
async fn tx_keyless_commit_cut_before() {
    keyless_cut(
        "SELECT 1; COMMIT",
        Cut::BeforeSend,
        "COMMIT_OUTCOME_UNKNOWN",
        0,
    )
    .await;
}

#[actix_web::test]
async fn tx_keyless_commit_cut_after() {
    keyless_cut(
        "SELECT 1; COMMIT",
        Cut::AfterSend,
        "COMMIT_OUTCOME_UNKNOWN",
        1,
    )
    .await;
}

#[actix_web::test]
async fn tx_keyless_insert_cut_after() {
    keyless_cut_handler_error(INSERT, Cut::AfterSend).await;
}

#[actix_web::test]
async fn tx_keyless_begin_cut_after() {
    keyless_cut(BEGIN, Cut::AfterSend, "STORAGE_UNAVAILABLE", 0).await;
}

async fn keyless_cut_handler_error(needle: &str, cut: Cut) {
    let _ = panics();
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store(&proxy, &db).await;
    let state = State::default();
    let app = test::init_service(
        App::new().app_data(web::Data::new(state.clone())).service(
            web::scope("")
                .wrap(Idempotency::builder(store.clone()).transactional().build())
                .route("/payments", web::post().to(pay_tx)),
        ),
    )
    .await;
    let warm = call(&app, post(None, 1)).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{warm:?}");
    proxy.arm(needle, cut);
    let first = call(&app, post(None, 5)).await;
    assert_eq!(proxy.fired(), 1);
    assert!(!first.status.is_success(), "{first:?}");
    assert_eq!(count(&db.url, "SELECT count(*) AS n FROM payments"), 1);
    let after = call(&app, post(None, 1)).await;
    assert_eq!(after.status, StatusCode::CREATED, "{after:?}");
    assert_no_foreign_panic();
}

// ---- more: rollbacks, replays, the fast path -----------------------------------------------

#[actix_web::test]
async fn tx_rollback_of_a_500_cut_before() {
    keyed_cut(
        Mode::Transactional,
        "ROLLBACK",
        Cut::BeforeSend,
        true,
        Expect::Handler(500),
    )
    .await;
}

#[actix_web::test]
async fn tx_rollback_of_a_500_cut_after() {
    keyed_cut(
        Mode::Transactional,
        "ROLLBACK",
        Cut::AfterSend,
        true,
        Expect::Handler(500),
    )
    .await;
}

#[actix_web::test]
async fn tx_replay_rollback_cut_before() {
    keyed_cut_with(
        Mode::Transactional,
        CLAIM,
        Cut::BeforeSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
        false,
        Some(("ROLLBACK", Cut::BeforeSend)),
    )
    .await;
}

#[actix_web::test]
async fn tx_replay_rollback_cut_after() {
    keyed_cut_with(
        Mode::Transactional,
        CLAIM,
        Cut::BeforeSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
        false,
        Some(("ROLLBACK", Cut::AfterSend)),
    )
    .await;
}

#[actix_web::test]
async fn default_fast_path_replay_read_cut_before() {
    keyed_cut_with(
        Mode::Default,
        "idempotency_replay(",
        Cut::BeforeSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
        true,
        None,
    )
    .await;
}

#[actix_web::test]
async fn default_fast_path_reserve_cut_after() {
    keyed_cut_with(
        Mode::Default,
        RESERVE,
        Cut::AfterSend,
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
        true,
        None,
    )
    .await;
}

#[actix_web::test]
async fn default_fast_path_complete_cut_after() {
    keyed_cut_with(
        Mode::Default,
        COMPLETE,
        Cut::AfterSend,
        false,
        Expect::Handler(201),
        true,
        None,
    )
    .await;
}

// ---- concurrent duplicates waiting (wait_for_in_flight) while the first is cut ------------

async fn waiting_duplicate(mode: Mode, needle: &str, cut: Cut, expect_replay: bool) {
    let _ = panics();
    let db = TestDb::new().await;
    if mode == Mode::Transactional {
        execute(&db.url, PAYMENTS);
    }
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store(&proxy, &db).await;
    let state = State::default();
    let mut builder = Idempotency::builder(store.clone())
        .tenant_header("x-account-id")
        .lock_timeout(LEASE)
        .wait_for_in_flight(Duration::from_secs(5));
    if mode == Mode::Transactional {
        builder = builder.transactional();
    }
    let handler = match mode {
        Mode::Default => web::post().to(pay_default),
        Mode::Transactional => web::post().to(pay_tx),
    };
    let app = test::init_service(
        App::new().app_data(web::Data::new(state.clone())).service(
            web::scope("")
                .wrap(builder.build())
                .route("/payments", handler),
        ),
    )
    .await;
    let what = format!("waiting duplicate, {mode:?} cut {cut:?} at {needle:?}");
    let warm = call(&app, post(Some("warm"), 1)).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{what}: {warm:?}");
    state.sleep_next_ms.store(300, Ordering::SeqCst);
    proxy.arm(needle, cut);
    let key = "k1";
    let started = Instant::now();
    let first = call(&app, post(Some(key), 7));
    let second = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        call(&app, post(Some(key), 7)).await
    };
    let (first, second) = tokio::join!(first, second);
    eprintln!(
        "{what}: first {first:?}\nsecond after {:?}: {second:?}",
        started.elapsed()
    );
    assert_eq!(proxy.fired(), 1, "{what}");
    assert!(
        second.status.is_success(),
        "{what}: the waiter gets a 2xx: {second:?}"
    );
    assert_eq!(second.replayed, expect_replay, "{what}: {second:?}");
    match mode {
        Mode::Default => assert_eq!(state.effects(key), 1, "{what}"),
        Mode::Transactional => {
            assert_eq!(rows_for(&db, key), 1, "{what}");
            let id = second.body["id"].as_i64().unwrap();
            assert!(row_exists(&db, id), "{what}");
        }
    }
    if first.status.is_success() {
        assert_eq!(first.body, second.body, "{what}");
    }
    assert_no_foreign_panic();
}

#[actix_web::test]
async fn wait_tx_commit_cut_after() {
    waiting_duplicate(Mode::Transactional, "COMMIT", Cut::AfterSend, true).await;
}

#[actix_web::test]
async fn wait_tx_commit_cut_before() {
    waiting_duplicate(Mode::Transactional, "COMMIT", Cut::BeforeSend, false).await;
}

#[actix_web::test]
async fn wait_default_complete_cut_before() {
    waiting_duplicate(Mode::Default, COMPLETE, Cut::BeforeSend, true).await;
}

#[actix_web::test]
async fn wait_default_complete_cut_after() {
    waiting_duplicate(Mode::Default, COMPLETE, Cut::AfterSend, true).await;
}

// ---- keyless tenant setting; lease renewal ------------------------------------------------

#[actix_web::test]
async fn tx_keyless_set_tenant_cut_before() {
    keyless_cut("set_config(", Cut::BeforeSend, "STORAGE_UNAVAILABLE", 0).await;
}

#[actix_web::test]
async fn tx_keyless_set_tenant_cut_after() {
    keyless_cut("set_config(", Cut::AfterSend, "STORAGE_UNAVAILABLE", 0).await;
}

/// A handler running 2.5 leases; its first renewal's connection is cut. Duplicates during the
/// run get 409, never a second run; after it, a replay.
async fn renewal_cut(cut: Cut) {
    let _ = panics();
    let db = TestDb::new().await;
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store(&proxy, &db).await;
    let state = State::default();
    let app = test::init_service(
        App::new().app_data(web::Data::new(state.clone())).service(
            web::scope("")
                .wrap(
                    Idempotency::builder(store.clone())
                        .lock_timeout(LEASE)
                        .build(),
                )
                .route("/payments", web::post().to(pay_default)),
        ),
    )
    .await;
    let warm = call(&app, post(Some("warm"), 1)).await;
    assert_eq!(warm.status, StatusCode::CREATED);
    state.sleep_next_ms.store(2500, Ordering::SeqCst);
    proxy.arm("SET \"locked_until\"", cut);
    let key = "k1";
    let first = call(&app, post(Some(key), 7));
    let duplicates = async {
        let mut seen = Vec::new();
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            let a = call(&app, post(Some(key), 7)).await;
            seen.push(a.status.as_u16());
        }
        seen
    };
    let (first, seen) = tokio::join!(first, duplicates);
    eprintln!("renewal cut {cut:?}: first {first:?}, duplicates {seen:?}");
    assert_eq!(proxy.fired(), 1, "the renewal was cut");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(state.effects(key), 1, "one run; duplicates {seen:?}");
    assert!(seen.iter().all(|s| *s == 409), "{seen:?}");
    let again = call(&app, post(Some(key), 7)).await;
    assert!(again.replayed, "{again:?}");
    assert_no_foreign_panic();
}

#[actix_web::test]
async fn default_renewal_cut_before() {
    renewal_cut(Cut::BeforeSend).await;
}

#[actix_web::test]
async fn default_renewal_cut_after() {
    renewal_cut(Cut::AfterSend).await;
}

// ---- two cuts: the background retry of a write cut too -------------------------------------

#[actix_web::test]
async fn default_reserve_cut_after_and_its_release_cut() {
    keyed_cuts(
        Mode::Default,
        RESERVE,
        Cut::AfterSend,
        &[(RELEASE, Cut::BeforeSend)],
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn default_reserve_cut_after_and_its_release_cut_after() {
    keyed_cuts(
        Mode::Default,
        RESERVE,
        Cut::AfterSend,
        &[(RELEASE, Cut::AfterSend)],
        false,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn default_complete_cut_twice() {
    keyed_cuts(
        Mode::Default,
        COMPLETE,
        Cut::BeforeSend,
        &[(COMPLETE, Cut::BeforeSend)],
        false,
        Expect::Handler(201),
    )
    .await;
}

#[actix_web::test]
async fn default_complete_cut_after_twice() {
    keyed_cuts(
        Mode::Default,
        COMPLETE,
        Cut::AfterSend,
        &[(COMPLETE, Cut::AfterSend)],
        false,
        Expect::Handler(201),
    )
    .await;
}

#[actix_web::test]
async fn default_complete_cut_after_then_completed_by_cut() {
    keyed_cuts(
        Mode::Default,
        COMPLETE,
        Cut::AfterSend,
        &[(COMPLETE, Cut::BeforeSend), ("EXISTS", Cut::BeforeSend)],
        false,
        Expect::Handler(201),
    )
    .await;
}

#[actix_web::test]
async fn default_release_cut_twice() {
    keyed_cuts(
        Mode::Default,
        RELEASE,
        Cut::BeforeSend,
        &[(RELEASE, Cut::AfterSend)],
        true,
        Expect::Handler(500),
    )
    .await;
}

// ---- a pool per thread ---------------------------------------------------------------------

async fn per_thread(mode: Mode, needle: &str, cut: Cut, expect: Expect) {
    POOL_PER_THREAD.with(|p| *p.borrow_mut() = Some(2));
    keyed_cut(mode, needle, cut, false, expect).await;
}

#[actix_web::test]
async fn per_thread_default_reserve_cut_after() {
    per_thread(
        Mode::Default,
        RESERVE,
        Cut::AfterSend,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

#[actix_web::test]
async fn per_thread_default_complete_cut_before() {
    per_thread(
        Mode::Default,
        COMPLETE,
        Cut::BeforeSend,
        Expect::Handler(201),
    )
    .await;
}

#[actix_web::test]
async fn per_thread_tx_commit_cut_after() {
    per_thread(
        Mode::Transactional,
        "COMMIT",
        Cut::AfterSend,
        Expect::Problem("COMMIT_OUTCOME_UNKNOWN"),
    )
    .await;
}

#[actix_web::test]
async fn per_thread_tx_claim_cut_after() {
    per_thread(
        Mode::Transactional,
        CLAIM,
        Cut::AfterSend,
        Expect::Problem("STORAGE_UNAVAILABLE"),
    )
    .await;
}

// ---- many cuts on one app: every statement of a miss, both ways, keys one after another ----

#[actix_web::test]
async fn tx_many_cuts_on_one_pool() {
    let _ = panics();
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store(&proxy, &db).await;
    let state = State::default();
    let app = test::init_service(
        App::new().app_data(web::Data::new(state.clone())).service(
            web::scope("")
                .wrap(
                    Idempotency::builder(store.clone())
                        .tenant_header("x-account-id")
                        .lock_timeout(LEASE)
                        .transactional()
                        .build(),
                )
                .route("/payments", web::post().to(pay_tx)),
        ),
    )
    .await;
    let needles = [BEGIN, CLAIM, INSERT, COMPLETE, "COMMIT"];
    let mut n = 0;
    for round in 0..3 {
        for needle in needles {
            for cut in [Cut::BeforeSend, Cut::AfterSend] {
                n += 1;
                let key = format!("m{round}-{n}");
                proxy.arm(needle, cut);
                let first = call(&app, post(Some(&key), n)).await;
                assert!(
                    !first.status.is_success(),
                    "{key} {needle} {cut:?}: {first:?}"
                );
                let started = Instant::now();
                let ok = loop {
                    let a = call(&app, post(Some(&key), n)).await;
                    if a.status.is_success() {
                        break a;
                    }
                    assert_eq!(
                        a.status,
                        StatusCode::CONFLICT,
                        "{key} {needle} {cut:?}: {a:?}"
                    );
                    assert!(started.elapsed() < LEASE + SLACK, "{key} stuck");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                let id = ok.body["id"].as_i64().unwrap();
                assert!(row_exists(&db, id), "{key}: {ok:?}");
                assert_eq!(rows_for(&db, &key), 1, "{key} {needle} {cut:?}");
            }
        }
    }
    assert_eq!(proxy.fired(), n as u64);
    assert_no_foreign_panic();
}

// ---- a careless handler: ignores its statement's error and answers 201 ---------------------

async fn pay_tx_careless(tx: IdempotentTx, req: HttpRequest) -> HttpResponse {
    let key = key_of(&req);
    let mut conn = tx.conn();
    let inserted =
        diesel::sql_query("INSERT INTO payments (idempotency_key, amount) VALUES ($1, 1)")
            .bind::<Nullable<Text>, _>(&key)
            .execute(&mut *conn)
            .await;
    HttpResponse::Created().json(serde_json::json!({ "inserted": inserted.is_ok() }))
}

async fn careless(key: Option<&str>, cut: Cut) {
    let _ = panics();
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let proxy = CutProxy::for_url(&db.url).await;
    let store = build_store(&proxy, &db).await;
    let app = test::init_service(
        App::new().service(
            web::scope("")
                .wrap(
                    Idempotency::builder(store.clone())
                        .lock_timeout(LEASE)
                        .transactional()
                        .build(),
                )
                .route("/payments", web::post().to(pay_tx_careless)),
        ),
    )
    .await;
    let warm = call(&app, post(Some("warm"), 1)).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{warm:?}");
    let warm = call(&app, post(None, 1)).await;
    assert_eq!(warm.status, StatusCode::CREATED, "{warm:?}");
    proxy.arm(INSERT, cut);
    let first = call(&app, post(key, 1)).await;
    eprintln!("careless {key:?} {cut:?}: {first:?}");
    assert_eq!(proxy.fired(), 1);
    assert_eq!(
        count(&db.url, "SELECT count(*) AS n FROM payments"),
        2,
        "nothing committed"
    );
    assert!(
        !first.status.is_success(),
        "a 2xx for work that did not commit: {first:?}"
    );
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    if let Some(key) = key {
        let retry = call(&app, post(Some(key), 1)).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert_eq!(rows_for(&db, key), 1);
    }
    assert_no_foreign_panic();
}

#[actix_web::test]
async fn careless_keyed_insert_cut_before() {
    careless(Some("c1"), Cut::BeforeSend).await;
}

#[actix_web::test]
async fn careless_keyed_insert_cut_after() {
    careless(Some("c1"), Cut::AfterSend).await;
}

#[actix_web::test]
async fn careless_keyless_insert_cut_before() {
    careless(None, Cut::BeforeSend).await;
}

#[actix_web::test]
async fn careless_keyless_insert_cut_after() {
    careless(None, Cut::AfterSend).await;
}

// ---- the proxy itself ----------------------------------------------------------------------

/// `BeforeSend` keeps an autocommit statement from running, `AfterSend` lets it commit; for
/// both protocols (a prepared `Bind` and a simple `Query`).
#[tokio::test]
async fn cut_proxy_cuts_where_it_says() {
    use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
    let db = TestDb::new().await;
    execute(&db.url, "CREATE TABLE t (v int)");
    let proxy = CutProxy::for_url(&db.url).await;
    let url = proxy.url_through(&db.url);
    let rows = || count(&db.url, "SELECT count(*) AS n FROM t");
    for (cut, simple, expect) in [
        (Cut::BeforeSend, false, 0),
        (Cut::AfterSend, false, 1),
        (Cut::BeforeSend, true, 1),
        (Cut::AfterSend, true, 2),
    ] {
        let mut conn = AsyncPgConnection::establish(&url).await.unwrap();
        diesel::sql_query("SELECT 1")
            .execute(&mut conn)
            .await
            .unwrap();
        proxy.arm("INSERT INTO t", cut);
        let result = if simple {
            conn.batch_execute("INSERT INTO t VALUES (1)")
                .await
                .map(|_| 0)
        } else {
            diesel::sql_query("INSERT INTO t VALUES (1)")
                .execute(&mut conn)
                .await
        };
        assert!(
            result.is_err(),
            "{cut:?} simple={simple}: the client saw no answer"
        );
        assert_eq!(rows(), expect, "{cut:?} simple={simple}");
    }
    assert_eq!(proxy.fired(), 4);
}
