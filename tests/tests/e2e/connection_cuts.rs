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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpRequest, HttpResponse, Route};
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::{Idempotency, IdempotencyBuilder, IdempotentTx};
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
    B: MessageBody + 'static,
{
    let (status, replayed, body) = match app.call(req.to_request()).await {
        Ok(response) => (
            response.status(),
            response.headers().contains_key("idempotent-replayed"),
            test::read_body(response).await,
        ),
        Err(error) => {
            let response = error.error_response();
            let status = response.status();
            let body = actix_web::body::to_bytes(response.into_body()).await;
            (status, false, body.unwrap_or_default())
        }
    };
    let body = serde_json::from_slice(&body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&body).into_owned()));
    Answer {
        status,
        replayed,
        body,
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

/// A request with `key` (amount 1) that must get 201.
async fn created<S, B>(app: &S, key: Option<&str>, what: &str) -> Answer
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody + 'static,
{
    let a = call(app, post(key, 1)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{what}: {a:?}");
    a
}

/// A 503 problem with `code`.
fn assert_problem(a: &Answer, code: &str, what: &str) {
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{what}: {a:?}");
    assert_eq!(a.code(), code, "{what}: {a:?}");
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
    sleep_next_ms: Arc<AtomicU64>,
}

fn bump(counts: &Mutex<HashMap<String, usize>>, key: &str) {
    *counts.lock().unwrap().entry(key.to_owned()).or_default() += 1;
}

fn get(counts: &Mutex<HashMap<String, usize>>, key: &str) -> usize {
    counts.lock().unwrap().get(key).copied().unwrap_or(0)
}

impl State {
    fn runs(&self, key: &str) -> usize {
        get(&self.runs, key)
    }
    fn effects(&self, key: &str) -> usize {
        get(&self.effects, key)
    }
    /// Sleeps if asked (`sleep_next_ms`), then whether this run fails (`fail_next`); both once.
    async fn pause_then_fail(&self) -> bool {
        let sleep = self.sleep_next_ms.swap(0, Ordering::SeqCst);
        if sleep > 0 {
            tokio::time::sleep(Duration::from_millis(sleep)).await;
        }
        self.fail_next.swap(false, Ordering::SeqCst)
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
    bump(&state.runs, &key);
    if state.pause_then_fail().await {
        return HttpResponse::InternalServerError().json(serde_json::json!({"failed": true}));
    }
    bump(&state.effects, &key);
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
    bump(&state.runs, key.as_deref().unwrap_or_default());
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
    if state.pause_then_fail().await {
        // The row must be rolled back.
        return Ok(HttpResponse::InternalServerError().json(serde_json::json!({"failed": id})));
    }
    Ok(HttpResponse::Created().json(serde_json::json!({ "id": id, "key": key })))
}

/// The handler of `mode`.
fn handler(mode: Mode) -> Route {
    match mode {
        Mode::Default => web::post().to(pay_default),
        Mode::Transactional => web::post().to(pay_tx),
    }
}

const PAYMENTS: &str = "CREATE TABLE payments (
    id bigserial PRIMARY KEY,
    idempotency_key text,
    amount bigint NOT NULL
)";

// ------------------------------------------------------------------------------------------
// One test's database (with `payments` in the transactional mode), its cut proxy, a store
// through the proxy, and the handlers' state.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Default,
    Transactional,
}

struct Rig {
    // Dropped in this order: the database last.
    state: State,
    store: PostgresStore,
    proxy: CutProxy,
    db: TestDb,
}

impl Rig {
    async fn new(mode: Mode) -> Rig {
        Rig::with_store(mode, false, None).await
    }

    /// With the replay fast path or not, and a pool per thread of that size.
    async fn with_store(mode: Mode, fast_path: bool, pool_per_thread: Option<u32>) -> Rig {
        let _ = panics();
        let db = TestDb::new().await;
        if mode == Mode::Transactional {
            execute(&db.url, PAYMENTS);
        }
        let proxy = CutProxy::for_url(&db.url).await;
        let store = PostgresStore::builder(proxy.url_through(&db.url))
            .pool_per_thread(pool_per_thread)
            .replay_fast_path(fast_path)
            .max_size(3)
            .connection_timeout(Duration::from_secs(2))
            .build()
            .await
            .expect("store");
        Rig {
            state: State::default(),
            store,
            proxy,
            db,
        }
    }

    fn builder(&self) -> IdempotencyBuilder<PostgresStore> {
        Idempotency::builder(self.store.clone())
    }

    /// The middleware of most tests: tenants by `x-account-id`, the short lease, and
    /// transactional in that mode.
    fn middleware(&self, mode: Mode) -> IdempotencyBuilder<PostgresStore> {
        let builder = self
            .builder()
            .tenant_header("x-account-id")
            .lock_timeout(LEASE);
        match mode {
            Mode::Default => builder,
            Mode::Transactional => builder.transactional(),
        }
    }

    /// `route` at `/payments`, behind `middleware`, with the state.
    async fn app(
        &self,
        middleware: IdempotencyBuilder<PostgresStore>,
        route: Route,
    ) -> impl Service<
        actix_http::Request,
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
    > {
        test::init_service(
            App::new()
                .app_data(web::Data::new(self.state.clone()))
                .service(
                    web::scope("")
                        .wrap(middleware.build())
                        .route("/payments", route),
                ),
        )
        .await
    }

    /// The app of most tests: `handler(mode)` behind `middleware(mode)`.
    async fn mode_app(
        &self,
        mode: Mode,
    ) -> impl Service<
        actix_http::Request,
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
    > {
        self.app(self.middleware(mode), handler(mode)).await
    }

    /// Rows in `payments`.
    fn rows(&self) -> i64 {
        count(&self.db.url, "SELECT count(*) AS n FROM payments")
    }

    fn rows_for(&self, key: &str) -> i64 {
        count(
            &self.db.url,
            &format!("SELECT count(*) AS n FROM payments WHERE idempotency_key = '{key}'"),
        )
    }

    fn row_exists(&self, id: i64) -> bool {
        count(
            &self.db.url,
            &format!("SELECT count(*) AS n FROM payments WHERE id = {id}"),
        ) == 1
    }

    /// `answer` (a 2xx of the transactional mode) names a committed row.
    fn assert_committed(&self, answer: &Answer, what: &str) {
        let id = answer.body["id"]
            .as_i64()
            .unwrap_or_else(|| panic!("{what}: no id in {answer:?}"));
        assert!(
            self.row_exists(id),
            "{what}: 2xx names row {id}, not committed: {answer:?}"
        );
    }

    /// The handler's effect for `key` exists exactly once (its 2xx runs in the default mode,
    /// its rows in `payments` in the transactional mode).
    fn assert_effect_once(&self, mode: Mode, key: &str, what: &str) {
        match mode {
            Mode::Default => {
                assert_eq!(self.state.effects(key), 1, "{what}: handler effect count");
            }
            Mode::Transactional => {
                assert_eq!(self.rows_for(key), 1, "{what}: payments rows for the key");
            }
        }
    }
}

/// One `#[actix_web::test]` a row, `name: scenario;`, awaiting the scenario.
macro_rules! cut_tests {
    ($($(#[$attr:meta])* $name:ident: $scenario:expr;)*) => {
        $(
            $(#[$attr])*
            #[actix_web::test]
            async fn $name() {
                $scenario.await;
            }
        )*
    };
}

// ------------------------------------------------------------------------------------------
// The scenario.

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

const UNAVAILABLE: Expect = Expect::Problem("STORAGE_UNAVAILABLE");
const COMMIT_FAILED: Expect = Expect::Problem("COMMIT_FAILED");
const OUTCOME_UNKNOWN: Expect = Expect::Problem("COMMIT_OUTCOME_UNKNOWN");

/// One cut at `needle` (`cut`) during a keyed miss, then retries; see the module docs. The
/// options are off unless a test turns them on.
#[derive(Clone, Copy, Debug)]
struct Keyed {
    mode: Mode,
    needle: &'static str,
    cut: Cut,
    expect: Expect,
    /// The first run of the handler answers 500.
    fail_first: bool,
    /// More cuts armed at once (each fires once, in the background tasks that follow the
    /// first cut, say).
    extra: &'static [(&'static str, Cut)],
    /// The replay fast path.
    fast_path: bool,
    /// A cut armed for the first replay of the key after its success.
    then: Option<(&'static str, Cut)>,
    pool_per_thread: Option<u32>,
}

fn keyed(mode: Mode, needle: &'static str, cut: Cut, expect: Expect) -> Keyed {
    Keyed {
        mode,
        needle,
        cut,
        expect,
        fail_first: false,
        extra: &[],
        fast_path: false,
        then: None,
        pool_per_thread: None,
    }
}

impl Keyed {
    fn failing_first(self) -> Keyed {
        Keyed {
            fail_first: true,
            ..self
        }
    }

    fn also_cut(self, extra: &'static [(&'static str, Cut)]) -> Keyed {
        Keyed { extra, ..self }
    }

    fn fast_path(self) -> Keyed {
        Keyed {
            fast_path: true,
            ..self
        }
    }

    fn then_on_replay(self, needle: &'static str, cut: Cut) -> Keyed {
        Keyed {
            then: Some((needle, cut)),
            ..self
        }
    }

    fn pool_per_thread(self, size: u32) -> Keyed {
        Keyed {
            pool_per_thread: Some(size),
            ..self
        }
    }

    async fn run(self) {
        let Keyed {
            mode,
            needle,
            cut,
            expect,
            fail_first,
            extra,
            fast_path,
            then,
            pool_per_thread,
        } = self;
        let rig = Rig::with_store(mode, fast_path, pool_per_thread).await;
        let (proxy, state) = (&rig.proxy, &rig.state);
        let app = rig.mode_app(mode).await;
        let what = format!("{mode:?} cut {cut:?} at {needle:?}");
        // Warm: connections open and statements prepared.
        for warm in ["warm-1", "warm-2"] {
            created(&app, Some(warm), &format!("{what}: warm-up")).await;
        }

        let key = "k1";
        state.fail_next.store(fail_first, Ordering::SeqCst);
        proxy.arm(needle, cut);
        for (n, c) in extra {
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
            Expect::Problem(code) => assert_problem(&first, code, &what),
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
            rig.assert_committed(&first, &what);
        }

        // A different body right away, when the key is known to be held or completed (the
        // first got a 2xx, or its COMMIT reached the server): never a run, never a 2xx.
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

        // The effect exists exactly once, and the success is either the replay of the first
        // 2xx or a fresh run.
        rig.assert_effect_once(mode, key, &what);
        if mode == Mode::Transactional {
            rig.assert_committed(&success, &what);
        }
        if first.status.is_success() {
            assert!(
                success.replayed,
                "{what}: the retry must replay: {success:?}"
            );
            if mode == Mode::Default {
                assert_eq!(
                    success.body, first.body,
                    "{what}: replay of the first answer"
                );
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
        rig.assert_effect_once(mode, key, &what);
        // The pool works afterwards.
        created(&app, Some("after"), &format!("{what}: after")).await;
        assert_no_foreign_panic();
    }
}

// ---- default mode -------------------------------------------------------------------------

const RESERVE: &str = "idempotency_reserve(";
const COMPLETE: &str = "idempotency_complete(";
const RELEASE: &str = "idempotency_release(";
const COMPLETED_BY: &str = "idempotency_completed_by(";
const RENEW_LEASE: &str = "idempotency_renew_lease(";

cut_tests! {
    default_reserve_cut_before:
        keyed(Mode::Default, RESERVE, Cut::BeforeSend, UNAVAILABLE).run();
    default_reserve_cut_after:
        keyed(Mode::Default, RESERVE, Cut::AfterSend, UNAVAILABLE).run();
    default_complete_cut_before:
        keyed(Mode::Default, COMPLETE, Cut::BeforeSend, Expect::Handler(201)).run();
    default_complete_cut_after:
        keyed(Mode::Default, COMPLETE, Cut::AfterSend, Expect::Handler(201)).run();
    default_release_cut_before:
        keyed(Mode::Default, RELEASE, Cut::BeforeSend, Expect::Handler(500))
            .failing_first()
            .run();
    default_release_cut_after:
        keyed(Mode::Default, RELEASE, Cut::AfterSend, Expect::Handler(500))
            .failing_first()
            .run();
}

// ---- transactional mode -------------------------------------------------------------------

const BEGIN: &str = "idle_in_transaction_session_timeout";
const CLAIM: &str = "idempotency_tx_claim(";
const INSERT: &str = "INSERT INTO payments";

cut_tests! {
    tx_begin_cut_before:
        keyed(Mode::Transactional, BEGIN, Cut::BeforeSend, UNAVAILABLE).run();
    tx_begin_cut_after:
        keyed(Mode::Transactional, BEGIN, Cut::AfterSend, UNAVAILABLE).run();
    tx_claim_cut_before:
        keyed(Mode::Transactional, CLAIM, Cut::BeforeSend, UNAVAILABLE).run();
    tx_claim_cut_after:
        keyed(Mode::Transactional, CLAIM, Cut::AfterSend, UNAVAILABLE).run();
    tx_handler_insert_cut_before:
        keyed(Mode::Transactional, INSERT, Cut::BeforeSend, Expect::HandlerError).run();
    tx_handler_insert_cut_after:
        keyed(Mode::Transactional, INSERT, Cut::AfterSend, Expect::HandlerError).run();
    tx_complete_cut_before:
        keyed(Mode::Transactional, COMPLETE, Cut::BeforeSend, COMMIT_FAILED).run();
    tx_complete_cut_after:
        keyed(Mode::Transactional, COMPLETE, Cut::AfterSend, COMMIT_FAILED).run();
    tx_commit_cut_before:
        keyed(Mode::Transactional, "COMMIT", Cut::BeforeSend, OUTCOME_UNKNOWN).run();
    tx_commit_cut_after:
        keyed(Mode::Transactional, "COMMIT", Cut::AfterSend, OUTCOME_UNKNOWN).run();
}

// ---- transactional, keyless ---------------------------------------------------------------

async fn keyless_cut(needle: &str, cut: Cut, expect_code: &str, rows_after: i64) {
    let rig = Rig::new(Mode::Transactional).await;
    let app = rig.mode_app(Mode::Transactional).await;
    let what = format!("keyless cut {cut:?} at {needle:?}");
    created(&app, None, &what).await;
    assert_eq!(rig.rows(), 1);
    rig.proxy.arm(needle, cut);
    let first = call(&app, post(None, 5)).await;
    assert_eq!(rig.proxy.fired(), 1, "{what}: {first:?}");
    eprintln!("{what}: {first:?}");
    assert_problem(&first, expect_code, &what);
    assert_eq!(
        rig.rows(),
        1 + rows_after,
        "{what}: rows committed by the cut request"
    );
    let after = created(&app, None, &what).await;
    rig.assert_committed(&after, &what);
    assert_no_foreign_panic();
}

/// Without a tenant source nor a short lease; the handler's own statement is cut.
async fn keyless_cut_handler_error(needle: &str, cut: Cut) {
    let rig = Rig::new(Mode::Transactional).await;
    let app = rig
        .app(rig.builder().transactional(), handler(Mode::Transactional))
        .await;
    let what = format!("keyless, handler's statement cut {cut:?} at {needle:?}");
    created(&app, None, &what).await;
    rig.proxy.arm(needle, cut);
    let first = call(&app, post(None, 5)).await;
    assert_eq!(rig.proxy.fired(), 1, "{what}: {first:?}");
    assert!(!first.status.is_success(), "{what}: {first:?}");
    assert_eq!(rig.rows(), 1, "{what}: rows");
    created(&app, None, &what).await;
    assert_no_foreign_panic();
}

cut_tests! {
    tx_keyless_commit_cut_before:
        keyless_cut("SELECT 1; COMMIT", Cut::BeforeSend, "COMMIT_OUTCOME_UNKNOWN", 0);
    tx_keyless_commit_cut_after:
        keyless_cut("SELECT 1; COMMIT", Cut::AfterSend, "COMMIT_OUTCOME_UNKNOWN", 1);
    tx_keyless_insert_cut_after:
        keyless_cut_handler_error(INSERT, Cut::AfterSend);
    tx_keyless_begin_cut_after:
        keyless_cut(BEGIN, Cut::AfterSend, "STORAGE_UNAVAILABLE", 0);
}

// ---- more: rollbacks, replays, the fast path -----------------------------------------------

cut_tests! {
    tx_rollback_of_a_500_cut_before:
        keyed(Mode::Transactional, "ROLLBACK", Cut::BeforeSend, Expect::Handler(500))
            .failing_first()
            .run();
    tx_rollback_of_a_500_cut_after:
        keyed(Mode::Transactional, "ROLLBACK", Cut::AfterSend, Expect::Handler(500))
            .failing_first()
            .run();
    tx_replay_rollback_cut_before:
        keyed(Mode::Transactional, CLAIM, Cut::BeforeSend, UNAVAILABLE)
            .then_on_replay("ROLLBACK", Cut::BeforeSend)
            .run();
    tx_replay_rollback_cut_after:
        keyed(Mode::Transactional, CLAIM, Cut::BeforeSend, UNAVAILABLE)
            .then_on_replay("ROLLBACK", Cut::AfterSend)
            .run();
    default_fast_path_replay_read_cut_before:
        keyed(Mode::Default, "idempotency_replay(", Cut::BeforeSend, UNAVAILABLE)
            .fast_path()
            .run();
    default_fast_path_reserve_cut_after:
        keyed(Mode::Default, RESERVE, Cut::AfterSend, UNAVAILABLE).fast_path().run();
    default_fast_path_complete_cut_after:
        keyed(Mode::Default, COMPLETE, Cut::AfterSend, Expect::Handler(201)).fast_path().run();
}

// ---- concurrent duplicates waiting (wait_for_in_flight) while the first is cut ------------

async fn waiting_duplicate(mode: Mode, needle: &str, cut: Cut, expect_replay: bool) {
    let rig = Rig::new(mode).await;
    let middleware = rig
        .middleware(mode)
        .wait_for_in_flight(Duration::from_secs(5));
    let app = rig.app(middleware, handler(mode)).await;
    let what = format!("waiting duplicate, {mode:?} cut {cut:?} at {needle:?}");
    created(&app, Some("warm"), &what).await;
    rig.state.sleep_next_ms.store(300, Ordering::SeqCst);
    rig.proxy.arm(needle, cut);
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
    assert_eq!(rig.proxy.fired(), 1, "{what}");
    assert!(
        second.status.is_success(),
        "{what}: the waiter gets a 2xx: {second:?}"
    );
    assert_eq!(second.replayed, expect_replay, "{what}: {second:?}");
    rig.assert_effect_once(mode, key, &what);
    if mode == Mode::Transactional {
        rig.assert_committed(&second, &what);
    }
    if first.status.is_success() {
        assert_eq!(first.body, second.body, "{what}");
    }
    assert_no_foreign_panic();
}

cut_tests! {
    wait_tx_commit_cut_after:
        waiting_duplicate(Mode::Transactional, "COMMIT", Cut::AfterSend, true);
    wait_tx_commit_cut_before:
        waiting_duplicate(Mode::Transactional, "COMMIT", Cut::BeforeSend, false);
    wait_default_complete_cut_before:
        waiting_duplicate(Mode::Default, COMPLETE, Cut::BeforeSend, true);
    wait_default_complete_cut_after:
        waiting_duplicate(Mode::Default, COMPLETE, Cut::AfterSend, true);
}

// ---- keyless tenant setting; lease renewal ------------------------------------------------

cut_tests! {
    tx_keyless_set_tenant_cut_before:
        keyless_cut("set_config(", Cut::BeforeSend, "STORAGE_UNAVAILABLE", 0);
    tx_keyless_set_tenant_cut_after:
        keyless_cut("set_config(", Cut::AfterSend, "STORAGE_UNAVAILABLE", 0);
}

/// A handler running 4 leases; its first renewal's connection is cut. Duplicates during the
/// run (8, 250 ms apart: about 2 s, so a slow machine's round trips through the proxy still
/// fit) get 409, never a second run; after it, a replay.
async fn renewal_cut(cut: Cut) {
    let rig = Rig::new(Mode::Default).await;
    let app = rig
        .app(rig.builder().lock_timeout(LEASE), handler(Mode::Default))
        .await;
    created(&app, Some("warm"), &format!("renewal cut {cut:?}: warm-up")).await;
    rig.state.sleep_next_ms.store(4000, Ordering::SeqCst);
    rig.proxy.arm(RENEW_LEASE, cut);
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
    assert_eq!(rig.proxy.fired(), 1, "the renewal was cut");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let what = format!("renewal cut {cut:?}: one run; duplicates {seen:?}");
    rig.assert_effect_once(Mode::Default, key, &what);
    assert!(seen.iter().all(|s| *s == 409), "{seen:?}");
    let again = call(&app, post(Some(key), 7)).await;
    assert!(again.replayed, "{again:?}");
    assert_no_foreign_panic();
}

cut_tests! {
    default_renewal_cut_before:
        renewal_cut(Cut::BeforeSend);
    default_renewal_cut_after:
        renewal_cut(Cut::AfterSend);
}

// ---- two cuts: the background retry of a write cut too -------------------------------------

cut_tests! {
    default_reserve_cut_after_and_its_release_cut:
        keyed(Mode::Default, RESERVE, Cut::AfterSend, UNAVAILABLE)
            .also_cut(&[(RELEASE, Cut::BeforeSend)])
            .run();
    default_reserve_cut_after_and_its_release_cut_after:
        keyed(Mode::Default, RESERVE, Cut::AfterSend, UNAVAILABLE)
            .also_cut(&[(RELEASE, Cut::AfterSend)])
            .run();
    default_complete_cut_twice:
        keyed(Mode::Default, COMPLETE, Cut::BeforeSend, Expect::Handler(201))
            .also_cut(&[(COMPLETE, Cut::BeforeSend)])
            .run();
    default_complete_cut_after_twice:
        keyed(Mode::Default, COMPLETE, Cut::AfterSend, Expect::Handler(201))
            .also_cut(&[(COMPLETE, Cut::AfterSend)])
            .run();
    default_complete_cut_after_then_completed_by_cut:
        keyed(Mode::Default, COMPLETE, Cut::AfterSend, Expect::Handler(201))
            .also_cut(&[(COMPLETE, Cut::BeforeSend), (COMPLETED_BY, Cut::BeforeSend)])
            .run();
    default_release_cut_twice:
        keyed(Mode::Default, RELEASE, Cut::BeforeSend, Expect::Handler(500))
            .also_cut(&[(RELEASE, Cut::AfterSend)])
            .failing_first()
            .run();
}

// ---- a pool per thread ---------------------------------------------------------------------

cut_tests! {
    per_thread_default_reserve_cut_after:
        keyed(Mode::Default, RESERVE, Cut::AfterSend, UNAVAILABLE).pool_per_thread(2).run();
    per_thread_default_complete_cut_before:
        keyed(Mode::Default, COMPLETE, Cut::BeforeSend, Expect::Handler(201))
            .pool_per_thread(2)
            .run();
    per_thread_tx_commit_cut_after:
        keyed(Mode::Transactional, "COMMIT", Cut::AfterSend, OUTCOME_UNKNOWN)
            .pool_per_thread(2)
            .run();
    per_thread_tx_claim_cut_after:
        keyed(Mode::Transactional, CLAIM, Cut::AfterSend, UNAVAILABLE).pool_per_thread(2).run();
}

// ---- many cuts on one app: every statement of a miss, both ways, keys one after another ----

#[actix_web::test]
async fn tx_many_cuts_on_one_pool() {
    let rig = Rig::new(Mode::Transactional).await;
    let app = rig.mode_app(Mode::Transactional).await;
    let needles = [BEGIN, CLAIM, INSERT, COMPLETE, "COMMIT"];
    let mut n = 0;
    for round in 0..3 {
        for needle in needles {
            for cut in [Cut::BeforeSend, Cut::AfterSend] {
                n += 1;
                let key = format!("m{round}-{n}");
                let what = format!("{key} {needle} {cut:?}");
                rig.proxy.arm(needle, cut);
                let first = call(&app, post(Some(&key), n)).await;
                assert!(!first.status.is_success(), "{what}: {first:?}");
                let started = Instant::now();
                let ok = loop {
                    let a = call(&app, post(Some(&key), n)).await;
                    if a.status.is_success() {
                        break a;
                    }
                    assert_eq!(a.status, StatusCode::CONFLICT, "{what}: {a:?}");
                    assert!(started.elapsed() < LEASE + SLACK, "{key} stuck");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                rig.assert_committed(&ok, &what);
                rig.assert_effect_once(Mode::Transactional, &key, &what);
            }
        }
    }
    assert_eq!(rig.proxy.fired(), n as u64);
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
    let rig = Rig::new(Mode::Transactional).await;
    let middleware = rig.builder().lock_timeout(LEASE).transactional();
    let app = rig.app(middleware, web::post().to(pay_tx_careless)).await;
    let what = format!("careless {key:?} {cut:?}");
    created(&app, Some("warm"), &what).await;
    created(&app, None, &what).await;
    rig.proxy.arm(INSERT, cut);
    let first = call(&app, post(key, 1)).await;
    eprintln!("{what}: {first:?}");
    assert_eq!(rig.proxy.fired(), 1, "{what}");
    assert_eq!(rig.rows(), 2, "{what}: nothing committed");
    assert!(
        !first.status.is_success(),
        "{what}: a 2xx for work that did not commit: {first:?}"
    );
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what}: {first:?}"
    );
    if let Some(key) = key {
        // The cut transaction (its claim and the key's advisory lock) ends when the server
        // notices its connection is gone; a retry before that is rightly told the first is
        // still in flight (409, seen in CI under load), one after it runs. Up to the lease.
        let started = Instant::now();
        let mut conflicts = 0;
        let retry = loop {
            let a = call(&app, post(Some(key), 1)).await;
            if a.status != StatusCode::CONFLICT || started.elapsed() > LEASE + SLACK {
                break a;
            }
            conflicts += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(
            retry.status,
            StatusCode::CREATED,
            "{what}: retry after {conflicts} conflicts: {retry:?}"
        );
        rig.assert_effect_once(Mode::Transactional, key, &what);
    }
    assert_no_foreign_panic();
}

cut_tests! {
    careless_keyed_insert_cut_before:
        careless(Some("c1"), Cut::BeforeSend);
    careless_keyed_insert_cut_after:
        careless(Some("c1"), Cut::AfterSend);
    careless_keyless_insert_cut_before:
        careless(None, Cut::BeforeSend);
    careless_keyless_insert_cut_after:
        careless(None, Cut::AfterSend);
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
