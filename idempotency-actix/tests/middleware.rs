//! The contract (C1-C14, C17) through real requests to an actix service on the memory store.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::body::{to_bytes, MessageBody};
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpRequest, HttpResponse, Route};
use bytes::Bytes;
use futures_util::future::join_all;
use futures_util::StreamExt;
use idempotency_actix::outcome::OutcomeEvent;
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, MemoryStore, ReservationToken, ReserveOutcome, Scope,
    StoreError, StoredResponse, WriteOutcome,
};
use idempotency_actix::{Idempotency, IdempotencyBuilder, IdempotencyKey, Outcome};
use serde_json::{json, Value};

/// Counts handler executions (or an endless stream's polls); the handler echoes the body and
/// the execution number.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

impl Counter {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }

    /// Count one more run; its number.
    fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

async fn echo(counter: web::Data<Counter>, body: Bytes) -> HttpResponse {
    let n = counter.bump();
    HttpResponse::Created()
        .insert_header(("x-execution", n.to_string()))
        .insert_header(("set-cookie", "session=secret"))
        .insert_header(("date", "Mon, 07 Dec 2026 00:00:00 GMT"))
        .insert_header(("x-secret", "do-not-store"))
        .content_type("application/octet-stream")
        .body(body)
}

async fn slow(counter: web::Data<Counter>) -> HttpResponse {
    let n = counter.bump();
    tokio::time::sleep(Duration::from_millis(300)).await;
    HttpResponse::Ok().body(format!("execution {n}"))
}

/// The first execution takes `first_ms`; later ones are quick.
async fn first_run_takes(counter: web::Data<Counter>, first_ms: u64) -> HttpResponse {
    let n = counter.bump();
    if n == 1 {
        tokio::time::sleep(Duration::from_millis(first_ms)).await;
    }
    HttpResponse::Ok().body(format!("execution {n}"))
}

/// The first execution outlives its lease; later ones are quick.
async fn lease_outliving(counter: web::Data<Counter>) -> HttpResponse {
    first_run_takes(counter, 700).await
}

/// The first execution runs 1.5 s, far past the short leases of the renewal tests, so that a
/// loaded machine delaying a renewal or a retry by a few hundred milliseconds changes nothing.
async fn long_first_run(counter: web::Data<Counter>) -> HttpResponse {
    first_run_takes(counter, 1500).await
}

/// The first execution answers at once with a streamed body that takes 1.5 s to produce
/// (a report generated as it is sent); later ones stream it at once.
async fn long_first_stream(counter: web::Data<Counter>) -> HttpResponse {
    let n = counter.bump();
    let pause = if n == 1 { 1500 } else { 0 };
    let chunks = futures_util::stream::iter([0u64, pause]).then(move |wait| async move {
        tokio::time::sleep(Duration::from_millis(wait)).await;
        Ok::<_, std::io::Error>(Bytes::from(format!("execution {n};")))
    });
    HttpResponse::Ok().streaming(chunks)
}

/// Answers at once with a 40 KiB body streamed in 1 KiB chunks, all ready (a receipt): more
/// chunks than a slow client's channel holds.
async fn receipt_stream(counter: web::Data<Counter>) -> HttpResponse {
    let n = counter.bump();
    let digit = b'0' + u8::try_from(n % 10).unwrap_or(0);
    let chunks = (0..40).map(move |_| Ok::<_, std::io::Error>(Bytes::from(vec![digit; 1024])));
    HttpResponse::Ok().streaming(futures_util::stream::iter(chunks))
}

async fn status_from_query(counter: web::Data<Counter>, req: HttpRequest) -> HttpResponse {
    counter.bump();
    let status = req.query_string().parse::<u16>().unwrap_or(200);
    HttpResponse::build(StatusCode::from_u16(status).unwrap()).body("status")
}

async fn json_status(counter: web::Data<Counter>, body: web::Json<Value>) -> HttpResponse {
    counter.bump();
    HttpResponse::Ok().json(json!({ "status": body["want"] }))
}

async fn big_stream(counter: web::Data<Counter>) -> HttpResponse {
    counter.bump();
    let chunks = (0..64).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 1024])));
    HttpResponse::Ok().streaming(futures_util::stream::iter(chunks))
}

async fn key_echo(key: Option<IdempotencyKey>) -> HttpResponse {
    HttpResponse::Ok().body(key.map(IdempotencyKey::into_string).unwrap_or_default())
}

/// A payment that takes `ms`: "charge {run}".
async fn charge_after(counter: web::Data<Counter>, ms: u64) -> HttpResponse {
    let n = counter.bump();
    tokio::time::sleep(Duration::from_millis(ms)).await;
    HttpResponse::Created().body(format!("charge {n}"))
}

/// A payment whose provider fails the first run after `first_ms` (a 502: not stored, key
/// released); later runs charge at once.
async fn provider_down_first(counter: web::Data<Counter>, first_ms: u64) -> HttpResponse {
    let n = counter.bump();
    if n == 1 {
        tokio::time::sleep(Duration::from_millis(first_ms)).await;
        return HttpResponse::BadGateway().body("provider down");
    }
    HttpResponse::Created().body(format!("charge {n}"))
}

type Configure = fn(IdempotencyBuilder<MemoryStore>) -> IdempotencyBuilder<MemoryStore>;

fn default_config(b: IdempotencyBuilder<MemoryStore>) -> IdempotencyBuilder<MemoryStore> {
    b
}

/// A 200 ms lease renewed up to 600 ms after the reservation: what the tests of the renewal
/// limit and of abandoned streams wait out.
fn short_renewal(b: IdempotencyBuilder<MemoryStore>) -> IdempotencyBuilder<MemoryStore> {
    b.lock_timeout(Duration::from_millis(200))
        .renew_lease_up_to(Duration::from_millis(600))
}

async fn app_with(
    counter: &Counter,
    configure: Configure,
) -> impl Service<
    actix_http::Request,
    Response = ServiceResponse<impl MessageBody>,
    Error = actix_web::Error,
> {
    let middleware = configure(Idempotency::builder(MemoryStore::new())).build();
    init_service(
        App::new()
            .app_data(web::Data::new(counter.clone()))
            .wrap(middleware)
            .route("/echo", web::post().to(echo))
            .route("/echo", web::get().to(echo))
            .route("/slow", web::post().to(slow))
            .route("/lease", web::post().to(lease_outliving))
            .route("/long", web::post().to(long_first_run))
            .route("/long-stream", web::post().to(long_first_stream))
            .route("/receipt", web::post().to(receipt_stream))
            .route("/status", web::post().to(status_from_query))
            .route("/json-status", web::post().to(json_status))
            .route("/big", web::post().to(big_stream))
            .route("/key", web::post().to(key_echo)),
    )
    .await
}

/// An app of one route behind `middleware`, its handler given `data` as `web::Data`.
async fn one_route<S: IdempotencyStore, D: 'static>(
    data: D,
    middleware: Idempotency<S>,
    path: &str,
    route: Route,
) -> impl Service<
    actix_http::Request,
    Response = ServiceResponse<impl MessageBody>,
    Error = actix_web::Error,
> {
    init_service(
        App::new()
            .app_data(web::Data::new(data))
            .wrap(middleware)
            .route(path, route),
    )
    .await
}

fn post(path: &str, key: &str) -> TestRequest {
    TestRequest::post()
        .uri(path)
        .insert_header(("idempotency-key", key))
}

/// A keyed POST with the body `x`.
fn post_x(path: &str, key: &str) -> TestRequest {
    post(path, key).set_payload("x")
}

/// A keyed POST to /echo from `tenant` (its `x-tenant` header), with the body `a`.
fn as_tenant(tenant: &str, key: &str) -> TestRequest {
    post("/echo", key)
        .insert_header(("x-tenant", tenant))
        .set_payload("a")
}

#[derive(Debug)]
struct Reply {
    status: StatusCode,
    headers: actix_web::http::header::HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn assert_problem(&self, status: u16, code: &str) {
        assert_eq!(self.status.as_u16(), status, "body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let json = self.json();
        assert_eq!(json["code"], code);
        assert_eq!(json["status"], status);
        assert!(json["type"]
            .as_str()
            .is_some_and(|t| t.starts_with("https://")));
        assert!(json["title"].is_string() && json["detail"].is_string());
    }
}

async fn send<S, B>(app: &S, req: TestRequest) -> Reply
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    send_raw(app, req.to_request()).await
}

/// `first`, and `second` sent `after_ms` later (while the first may still run).
async fn overlapping<S, B>(
    app: &S,
    first: TestRequest,
    second: TestRequest,
    after_ms: u64,
) -> (Reply, Reply)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    tokio::join!(send(app, first), async {
        tokio::time::sleep(Duration::from_millis(after_ms)).await;
        send(app, second).await
    })
}

/// `post_x(path, key)`, and the same request `after_ms` later from a client that gives up
/// after `gives_up_ms` (its own timeout: the request's future is dropped). The first's reply,
/// and what `at_drop` says right after the drop.
async fn with_an_abandoned_duplicate<S, B, T>(
    app: &S,
    (path, key): (&str, &str),
    after_ms: u64,
    gives_up_ms: u64,
    at_drop: impl FnOnce() -> T,
) -> (Reply, T)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let first = send(app, post_x(path, key));
    let abandoned = async {
        tokio::time::sleep(Duration::from_millis(after_ms)).await;
        let gave_up = tokio::time::timeout(
            Duration::from_millis(gives_up_ms),
            call_service(app, post_x(path, key).to_request()),
        )
        .await;
        assert!(gave_up.is_err(), "the waiter answered early");
        at_drop()
    };
    tokio::join!(first, abandoned)
}

/// The request with its body replaced by a stream of chunks and no Content-Length.
fn chunked(req: TestRequest, chunks: Vec<Bytes>) -> actix_http::Request {
    let stream = futures_util::stream::iter(chunks.into_iter().map(Ok));
    let boxed: actix_http::BoxedPayloadStream = Box::pin(stream);
    let (mut req, _) = req
        .to_request()
        .replace_payload(actix_http::Payload::from(boxed));
    req.headers_mut().remove("content-length");
    req.headers_mut().insert(
        actix_web::http::header::TRANSFER_ENCODING,
        HeaderValue::from_static("chunked"),
    );
    req
}

async fn send_raw<S, B>(app: &S, req: actix_http::Request) -> Reply
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let response = call_service(app, req).await;
    let status = response.status();
    let headers = response.headers().clone();
    let body = to_bytes(response.into_body()).await.unwrap_or_default();
    Reply {
        status,
        headers,
        body,
    }
}

/// What an outcome hook saw, in order.
type Seen<T> = Arc<Mutex<Vec<T>>>;

/// A hook that records `what` of every outcome into `seen`.
fn recording<T: Send + 'static>(
    seen: &Seen<T>,
    what: impl Fn(&OutcomeEvent<'_>) -> T + Send + Sync + 'static,
) -> impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static {
    let seen = Arc::clone(seen);
    move |event| {
        if let Ok(mut seen) = seen.lock() {
            seen.push(what(event));
        }
    }
}

fn outcome_and_status(event: &OutcomeEvent<'_>) -> (Outcome, u16) {
    (event.outcome, event.status.as_u16())
}

/// A copy of what the hook saw so far.
fn seen_so_far<T: Clone>(seen: &Seen<T>) -> Vec<T> {
    seen.lock().map(|s| s.clone()).unwrap_or_default()
}

/// A memory store with the faults the flow must survive. It counts its reserves and fails the
/// `fail_reserve`-th one (from 0) as unavailable; the `slow_reserve.0`-th one takes
/// `slow_reserve.1` before it is applied (a loaded database: PostgresStore's defaults allow
/// 2 s + 5 s per call); with `panic_on_complete` it panics in `complete` (the request's task
/// ends there, as when its worker stops). With `renews` it renews leases (without, it answers
/// like a store written before renewal existed), counting them, and with
/// `first_renewal_fails` its first renewal is slow and fails (a store blip).
#[derive(Clone, Default)]
struct Faulty {
    inner: MemoryStore,
    reserves: Arc<AtomicUsize>,
    fail_reserve: Option<usize>,
    slow_reserve: Option<(usize, Duration)>,
    /// The `.0`-th reserve is applied at once and answered `.1` later (a database that
    /// stalled after starting the lease, a slow network back).
    slow_answer: Option<(usize, Duration)>,
    /// Every reserve from the `.0`-th on is applied at once and answered `.1` later.
    slow_answers_from: Option<(usize, Duration)>,
    /// The `.0`-th renewal is applied at once and answered `.1` later.
    slow_renewal_answer: Option<(usize, Duration)>,
    panic_on_complete: bool,
    renews: bool,
    renewals: Arc<AtomicUsize>,
    first_renewal_fails: bool,
    /// The backend is down: every call fails. The one place a real part cannot be had in this
    /// crate.
    down: bool,
    /// The longest scope it declares it can record (PostgreSQL's is its index's limit).
    max_scope: Option<usize>,
    /// Completed records come back with this status (a damaged record).
    replay_status: Option<u16>,
    /// A reservation is gone by the time it is answered (a store that lost it).
    forgets: bool,
    /// The first `complete` fails (a blip), counting every call in `completes`.
    first_complete_fails: bool,
    completes: Arc<AtomicUsize>,
    /// While set, every `complete` fails (renewals still work: a responses table locked).
    completes_failing: Arc<AtomicBool>,
    /// How long each of those failing calls takes to fail (a statement stuck until the
    /// store's own timeout, on one half-dead pooled connection).
    failing_complete_takes: Duration,
}

impl Faulty {
    /// A store whose backend is down.
    fn down() -> Self {
        Self {
            down: true,
            ..Self::default()
        }
    }

    fn check_up(&self) -> Result<(), StoreError> {
        if self.down {
            return Err(StoreError::unavailable("connection refused"));
        }
        Ok(())
    }
}

impl IdempotencyStore for Faulty {
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        self.check_up()?;
        let n = self.reserves.fetch_add(1, Ordering::SeqCst);
        if self.fail_reserve == Some(n) {
            return Err(StoreError::unavailable("one blip"));
        }
        if let Some((slow, delay)) = self.slow_reserve {
            if n == slow {
                tokio::time::sleep(delay).await;
            }
        }
        let outcome = self.inner.reserve(scope, fingerprint, lease).await;
        if let (true, Ok(ReserveOutcome::Reserved { token })) = (self.forgets, &outcome) {
            self.inner.release(scope, token).await?;
        }
        if let Some((slow, delay)) = self.slow_answer {
            if n == slow {
                tokio::time::sleep(delay).await;
            }
        }
        if let Some((from, delay)) = self.slow_answers_from {
            if n >= from {
                tokio::time::sleep(delay).await;
            }
        }
        match (outcome, self.replay_status) {
            (
                Ok(ReserveOutcome::Completed {
                    mut response,
                    fingerprint,
                    expires_in,
                }),
                Some(status),
            ) => {
                response.status = status;
                Ok(ReserveOutcome::Completed {
                    response,
                    fingerprint,
                    expires_in,
                })
            }
            (outcome, _) => outcome,
        }
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.check_up()?;
        if self.panic_on_complete {
            panic!("complete panicked (this test's own panic)");
        }
        let n = self.completes.fetch_add(1, Ordering::SeqCst);
        if n == 0 && self.first_complete_fails {
            return Err(StoreError::unavailable("one blip"));
        }
        if self.completes_failing.load(Ordering::SeqCst) {
            tokio::time::sleep(self.failing_complete_takes).await;
            return Err(StoreError::unavailable("timed out"));
        }
        self.inner.complete(scope, token, response, ttl).await
    }
    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.check_up()?;
        self.inner.release(scope, token).await
    }
    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        if !self.renews {
            return Ok(WriteOutcome::Stale); // the trait's default
        }
        let n = self.renewals.fetch_add(1, Ordering::SeqCst);
        if n == 0 && self.first_renewal_fails {
            tokio::time::sleep(Duration::from_millis(800)).await;
            return Err(StoreError::unavailable("timed out"));
        }
        let outcome = self.inner.renew_lease(scope, token, lease).await;
        if let Some((slow, delay)) = self.slow_renewal_answer {
            if n == slow {
                tokio::time::sleep(delay).await;
            }
        }
        outcome
    }
    fn renews_leases(&self) -> bool {
        self.renews
    }
    fn max_scope_bytes(&self) -> Option<usize> {
        self.max_scope
    }
    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.check_up()?;
        self.inner.purge_expired(grace).await
    }
}

#[actix_web::test]
async fn first_request_runs_and_retry_replays_byte_for_byte() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    let binary: Vec<u8> = (0..=255u8).rev().chain([0, 0xff, 0xfe]).collect();
    let first = send(&app, post("/echo", "k1").set_payload(binary.clone())).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(
        first.header("set-cookie"),
        Some("session=secret"),
        "the first response is untouched"
    );

    let retry = send(&app, post("/echo", "k1").set_payload(binary.clone())).await;
    assert_eq!(counter.get(), 1, "C6: the handler must not run again");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed(),
        "C6: replays carry Idempotent-Replayed: true"
    );
    assert_eq!(
        retry.body,
        Bytes::from(binary),
        "C6: binary bodies replay byte for byte"
    );
    assert_eq!(retry.header("x-execution"), Some("1"));
    assert_eq!(
        retry.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(
        retry.header("set-cookie"),
        None,
        "C11: Set-Cookie is never replayed"
    );
    assert_eq!(
        retry.header("date"),
        None,
        "C11: a Date the handler set is not replayed (the server dates each response itself)"
    );
}

#[actix_web::test]
async fn deny_listed_headers_are_not_replayed() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.deny_headers([HeaderName::from_static("x-secret")])
    })
    .await;
    let first = send(&app, post("/echo", "k").set_payload("a")).await;
    assert_eq!(first.header("x-secret"), Some("do-not-store"));
    let retry = send(&app, post("/echo", "k").set_payload("a")).await;
    assert!(retry.replayed());
    assert_eq!(retry.header("x-secret"), None);
    assert_eq!(retry.header("x-execution"), Some("1"));
}

#[actix_web::test]
async fn same_key_other_request_is_422_and_changes_nothing() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    send(&app, post("/echo", "k").set_payload("amount=10")).await;
    for req in [
        post("/echo", "k").set_payload("amount=11"),
        post("/echo?x=1", "k").set_payload("amount=10"),
    ] {
        send(&app, req)
            .await
            .assert_problem(422, "FINGERPRINT_MISMATCH");
    }
    // A different path is another scope, not a mismatch.
    assert_eq!(send(&app, post("/key", "k")).await.status, StatusCode::OK);
    let retry = send(&app, post("/echo", "k").set_payload("amount=10")).await;
    assert!(
        retry.replayed() && retry.body == "amount=10",
        "the original record is intact"
    );
    assert_eq!(counter.get(), 1);
}

#[actix_web::test]
async fn same_json_in_another_key_order_replays() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    let a = post("/echo", "j")
        .insert_header(("content-type", "application/json"))
        .set_payload(r#"{"amount":100,"currency":"EUR","meta":{"a":1,"b":[1,2]}}"#);
    let b = post("/echo", "j")
        .insert_header(("content-type", "application/json; charset=utf-8"))
        .set_payload(
            "{ \"meta\": {\"b\": [1, 2], \"a\": 1},\n \"currency\": \"EUR\", \"amount\": 100 }",
        );
    send(&app, a).await;
    let retry = send(&app, b).await;
    assert!(
        retry.replayed(),
        "C4: key order and whitespace do not make another request"
    );
    let reordered_array = post("/echo", "j")
        .insert_header(("content-type", "application/json"))
        .set_payload(r#"{"amount":100,"currency":"EUR","meta":{"a":1,"b":[2,1]}}"#);
    send(&app, reordered_array)
        .await
        .assert_problem(422, "FINGERPRINT_MISMATCH");
    assert_eq!(counter.get(), 1);
}

#[actix_web::test]
async fn concurrent_duplicates_run_the_handler_once_and_get_409() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    let replies = join_all((0..32).map(|_| send(&app, post_x("/slow", "same")))).await;
    assert_eq!(counter.get(), 1, "C5: exactly one execution");
    let ok: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::OK)
        .collect();
    assert_eq!(ok.len(), 1);
    assert_eq!(ok[0].body, "execution 1");
    for reply in replies.iter().filter(|r| r.status != StatusCode::OK) {
        reply.assert_problem(409, "CONFLICT");
        assert_eq!(
            reply.header("retry-after"),
            Some("1"),
            "C8: 409 carries Retry-After"
        );
    }
    // A different body while in flight is a mismatch, not a conflict (C7).
    let (running, mismatch) = overlapping(
        &app,
        post_x("/slow", "other"),
        post("/slow", "other").set_payload("y"),
        50,
    )
    .await;
    assert_eq!(running.status, StatusCode::OK);
    mismatch.assert_problem(422, "FINGERPRINT_MISMATCH");
}

#[actix_web::test]
async fn wait_mode_replays_to_concurrent_duplicates() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.wait_for_in_flight(Duration::from_secs(5))).await;
    let replies = join_all((0..32).map(|_| send(&app, post_x("/slow", "same")))).await;
    assert_eq!(counter.get(), 1, "C5: exactly one execution");
    assert!(replies
        .iter()
        .all(|r| r.status == StatusCode::OK && r.body == "execution 1"));
    assert_eq!(replies.iter().filter(|r| r.replayed()).count(), 31);
}

#[actix_web::test]
async fn wait_mode_gives_up_with_409_after_the_wait() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.wait_for_in_flight(Duration::from_millis(100))
    })
    .await;
    let (first, second) = overlapping(&app, post_x("/slow", "w"), post_x("/slow", "w"), 20).await;
    assert_eq!(first.status, StatusCode::OK);
    second.assert_problem(409, "CONFLICT");
}

/// C9 without renewal (turned off): a handler still running when its lease ends is taken
/// over by a retry, and its own completion is discarded.
#[actix_web::test]
async fn expired_lease_is_taken_over_and_the_stale_completion_is_discarded() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.lock_timeout(Duration::from_millis(200))
            .renew_lease_up_to(Duration::ZERO)
    })
    .await;
    let (first, second) =
        overlapping(&app, post_x("/lease", "l"), post_x("/lease", "l"), 400).await;
    assert_eq!(
        counter.get(),
        2,
        "the retry after the lease took over and ran"
    );
    assert_eq!(second.body, "execution 2");
    assert_eq!(
        first.body, "execution 1",
        "the stale holder's client still gets its response"
    );
    let replay = send(&app, post_x("/lease", "l")).await;
    assert!(replay.replayed());
    assert_eq!(
        replay.body, "execution 2",
        "C9: the stale holder's completion was rejected"
    );
    assert_eq!(counter.get(), 2);
}

/// A first run on `path` (keyed `key`) that answers `body` long after its 600 ms lease, and a
/// retry 800 ms in: the retry gets 409, never a second run, and the first response is stored
/// (else `not_stored`) and replayed.
async fn keeps_its_key_past_the_lease(path: &str, key: &str, body: &str, not_stored: &str) {
    let counter = Counter::default();
    // Renewals every 200 ms; the retry comes after the first lease ended.
    let app = app_with(&counter, |b| b.lock_timeout(Duration::from_millis(600))).await;
    let (first, second) = overlapping(&app, post_x(path, key), post_x(path, key), 800).await;
    second.assert_problem(409, "CONFLICT");
    assert_eq!(first.body, body);
    assert_eq!(counter.get(), 1, "the retry ran the handler a second time");
    let replay = send(&app, post_x(path, key)).await;
    assert!(replay.replayed(), "{not_stored}");
    assert_eq!(replay.body, body);
    assert_eq!(counter.get(), 1);
}

/// C9: a handler that runs past its lease in a live process keeps its key, because the
/// middleware renews the lease while it runs: the retry gets 409, never a second run, and
/// the first response is stored and replayed.
#[actix_web::test]
async fn a_running_handler_keeps_its_key_past_the_lease() {
    keeps_its_key_past_the_lease(
        "/long",
        "r",
        "execution 1",
        "the renewed holder's response was not stored",
    )
    .await;
}

/// C9, C24: a handler that returns at once with a body it produces for longer than the lease
/// keeps its key until the body has ended and the response is stored. The heartbeat used to
/// stop when the handler returned, so the retry took the key over mid-stream and ran the
/// handler a second time.
#[actix_web::test]
async fn a_streamed_body_keeps_its_key_past_the_lease() {
    keeps_its_key_past_the_lease(
        "/long-stream",
        "s",
        "execution 1;execution 1;",
        "the streamed response was not stored",
    )
    .await;
}

/// C9, C24: a client that stops reading a streamed response does not hold up its record. The
/// body used to reach the record only as fast as the client read it, so a stalled client kept
/// the key until renewal gave up, and then the retry ran the handler a second time.
#[actix_web::test]
async fn a_client_that_stops_reading_does_not_hold_up_the_record() {
    let counter = Counter::default();
    let app = app_with(&counter, short_renewal).await;
    // The first client gets the head and reads nothing of the body.
    let stalled = call_service(&app, post_x("/receipt", "c").to_request()).await;
    assert_eq!(stalled.status(), StatusCode::OK);
    // Past the last lease renewal would give the key.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let retry = send(&app, post_x("/receipt", "c")).await;
    assert_eq!(counter.get(), 1, "the retry ran the handler a second time");
    assert!(retry.replayed(), "not a replay: {:?}", retry.status);
    assert_eq!(retry.body, Bytes::from(vec![b'1'; 40 * 1024]));
    // The stalled client still gets its whole body, the same bytes.
    let body = to_bytes(stalled.into_body()).await.ok();
    assert_eq!(body, Some(retry.body));
}

/// An endless stream (server-sent events): a tick every 20 ms, each poll counted.
async fn endless(polls: web::Data<Counter>) -> HttpResponse {
    let ticks = futures_util::stream::unfold(polls, |polls| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        polls.bump();
        Some((
            Ok::<_, std::io::Error>(Bytes::from_static(b"data: tick\n\n")),
            polls,
        ))
    });
    HttpResponse::Ok().streaming(ticks)
}

/// How often an endless stream behind `middleware`, whose client hangs up at once, has been
/// read `first_ms` after the request, and 500 ms after that.
async fn endless_stream_reads<S: IdempotencyStore>(
    middleware: Idempotency<S>,
    key: &str,
    first_ms: u64,
) -> (usize, usize) {
    let polls = Counter::default();
    let app = one_route(
        polls.clone(),
        middleware,
        "/events",
        web::post().to(endless),
    )
    .await;
    let gone = call_service(&app, post_x("/events", key).to_request()).await;
    drop(gone); // the client hangs up
    tokio::time::sleep(Duration::from_millis(first_ms)).await;
    let read = polls.get();
    tokio::time::sleep(Duration::from_millis(500)).await;
    (read, polls.get())
}

/// C24: an endless stream whose client left is read for the record no longer than its key is
/// held (`renew_lease_up_to`), then dropped. It used to be read until the copy passed
/// `max_response_bytes`, days for a slow stream: a task and up to a megabyte per abandoned
/// request.
#[actix_web::test]
async fn an_endless_stream_whose_client_left_is_dropped_with_its_key() {
    let middleware = short_renewal(Idempotency::builder(MemoryStore::new())).build();
    let (read, later) = endless_stream_reads(middleware, "e", 1200).await;
    assert!(read > 0, "the stream was never read for the record");
    assert_eq!(
        later, read,
        "the stream is still being read after its key's last lease"
    );
}

/// C24: a streamed response whose task ends before it finished the body (here a store whose
/// `complete` panics; a worker stopping does the same) fails the client's body. It used to end
/// cleanly, so the client took a cut response, never stored, for a whole one. (This test used
/// a panicking `store_if`, which is now caught.)
#[actix_web::test]
async fn a_stream_cut_before_its_record_is_stored_never_looks_whole() {
    let store = Faulty {
        panic_on_complete: true,
        ..Faulty::default()
    };
    let route = web::post().to(receipt_stream);
    let app = one_route(
        Counter::default(),
        Idempotency::new(store),
        "/receipt",
        route,
    )
    .await;
    let response = call_service(&app, post_x("/receipt", "cut").to_request()).await;
    assert_eq!(response.status(), StatusCode::OK);
    let body = to_bytes(response.into_body()).await;
    assert!(
        body.is_err(),
        "a cut body read as whole: {:?}",
        body.ok().map(|b| b.len())
    );
}

/// A handler body of its own making (not `HttpResponse::streaming`, whose `BodyStream` skips
/// empty chunks): "a", an empty chunk, "b".
struct WithAnEmptyChunk(std::collections::VecDeque<Bytes>);

impl MessageBody for WithAnEmptyChunk {
    type Error = std::io::Error;

    fn size(&self) -> actix_web::body::BodySize {
        actix_web::body::BodySize::Stream
    }

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Bytes, Self::Error>>> {
        std::task::Poll::Ready(self.get_mut().0.pop_front().map(Ok))
    }
}

async fn empty_chunk_inside() -> HttpResponse {
    let chunks = [&b"a"[..], b"", b"b"].map(Bytes::from_static);
    HttpResponse::Ok().body(WithAnEmptyChunk(chunks.into_iter().collect()))
}

/// C24: an empty chunk in a handler's body is not forwarded: actix-http's HTTP/1 encoder
/// writes a chunked body's terminator for one, so the client would see the end of its body
/// before the rest, and before the record is stored.
#[actix_web::test]
async fn an_empty_chunk_is_never_forwarded() {
    let middleware = Idempotency::new(MemoryStore::new());
    let app = one_route((), middleware, "/empty", web::post().to(empty_chunk_inside)).await;
    let response = call_service(&app, post_x("/empty", "e").to_request()).await;
    let mut body = std::pin::pin!(response.into_body());
    let mut chunks = Vec::new();
    while let Some(chunk) = std::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
        chunks.push(chunk.ok());
    }
    assert!(
        chunks
            .iter()
            .all(|c| c.as_ref().is_some_and(|c| !c.is_empty())),
        "{chunks:?}"
    );
    let all: Vec<u8> = chunks.into_iter().flatten().flatten().collect();
    assert_eq!(all, b"ab");
    let replay = send(&app, post_x("/empty", "e")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, "ab");
}

/// Set when the stream that holds it is dropped.
#[derive(Clone, Default)]
struct Dropped(Arc<std::sync::atomic::AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0 .0.store(true, Ordering::SeqCst);
    }
}

/// Held by a stream: sets its [`Dropped`] when the stream goes.
struct DropFlag(Dropped);

/// One event, then nothing for ever (a quiet event stream).
async fn one_event_then_quiet(dropped: web::Data<Dropped>) -> HttpResponse {
    let flag = DropFlag(dropped.get_ref().clone());
    let first = futures_util::stream::once(async {
        Ok::<_, std::io::Error>(Bytes::from_static(b"data: hello\n\n"))
    });
    let quiet = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
    let events = first.chain(quiet).map(move |event| {
        let _held = &flag;
        event
    });
    HttpResponse::Ok().streaming(events)
}

/// Whether a quiet event stream (one event, then nothing) whose client hangs up at once is
/// dropped within `within`, with the middleware as `configure` makes it.
async fn quiet_stream_dropped_within(configure: Configure, within: Duration) -> bool {
    let dropped = Dropped::default();
    let middleware = configure(Idempotency::builder(MemoryStore::new())).build();
    let route = web::post().to(one_event_then_quiet);
    let app = one_route(dropped.clone(), middleware, "/events", route).await;
    let gone = call_service(&app, post_x("/events", "q").to_request()).await;
    drop(gone); // the client hangs up
    tokio::time::sleep(within).await;
    dropped.0.load(Ordering::SeqCst)
}

/// C24: a client that leaves while its stream is quiet is noticed then, not at the next chunk
/// (which may never come), so the stream is dropped once its key's last lease ends. It was
/// kept (with its task and its copy) until the next chunk, or for ever.
#[actix_web::test]
async fn a_quiet_stream_whose_client_left_is_dropped_with_its_key() {
    assert!(
        quiet_stream_dropped_within(short_renewal, Duration::from_millis(1500)).await,
        "the quiet stream outlived its key's last lease"
    );
}

/// C24 with a store that cannot renew leases (the default of a user-written store, and of
/// any store when `lock_timeout` is under 30 ms): the key is held for one lease only, yet an
/// endless stream whose client left was read until `renew_lease_up_to` (10 minutes by
/// default), for a record its key no longer guards (found by review, 2026-12-04).
#[actix_web::test]
async fn an_endless_stream_is_dropped_with_its_key_when_the_store_cannot_renew() {
    let store = Faulty::default(); // `renews` off: `renews_leases()` is false
    assert!(!store.renews_leases());
    let middleware = Idempotency::builder(store)
        .lock_timeout(Duration::from_millis(200))
        .renew_lease_up_to(Duration::from_secs(4))
        .build();
    // The key's only lease ended 200 ms after the reservation; read at 1 s and at 1.5 s.
    let (read, later) = endless_stream_reads(middleware, "nr", 1000).await;
    assert!(read > 0, "the stream was never read for the record");
    assert_eq!(
        later,
        read,
        "the stream is still being read {} polls later, long after its key's only lease ended",
        later - read
    );
}

/// C24: a stream over `max_response_bytes` (its key released, nothing kept for the record)
/// whose client leaves while it is quiet is dropped at once: nobody is left to read it for.
/// It was kept until its next chunk or its key's last lease (10 minutes by default).
#[actix_web::test]
async fn a_stream_over_the_limit_whose_client_left_is_dropped_at_once() {
    let tiny_limit = |b: IdempotencyBuilder<MemoryStore>| b.max_response_bytes(5);
    assert!(
        quiet_stream_dropped_within(tiny_limit, Duration::from_millis(500)).await,
        "a stream nobody reads, kept for nothing"
    );
}

/// C9: renewal goes on until `renew_lease_up_to` after the reservation and stops there, so a
/// handler that hangs frees its key once its last lease ends, as a crashed one does.
#[actix_web::test]
async fn lease_renewal_stops_at_its_limit() {
    let counter = Counter::default();
    let app = app_with(&counter, short_renewal).await;
    // The first run lasts 1.5 s; its last lease ends 600 ms after the reservation. `before`
    // comes after the first lease (200 ms), so only a renewal holds the key, and 300 ms before
    // the limit, room for a slow machine.
    let (first, (before, after)) = tokio::join!(send(&app, post_x("/long", "h")), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = send(&app, post_x("/long", "h")).await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        let after = send(&app, post_x("/long", "h")).await;
        (before, after)
    });
    before.assert_problem(409, "CONFLICT");
    assert_eq!(after.body, "execution 2", "the key was held past the limit");
    assert_eq!(first.body, "execution 1");
    assert_eq!(counter.get(), 2);
}

/// C9: a failed renewal is tried again soon, not a whole interval later. Lease 1.5 s, so a
/// renewal every 0.5 s; the first one (at 0.5 s) fails after 0.8 s, at 1.3 s. Paced from its
/// end, the next came at 1.8 s, after the lease had ended at 1.5 s, and the retry sent at
/// 1.65 s took the key over while the handler still ran.
#[actix_web::test]
async fn a_failed_renewal_is_retried_before_the_lease_ends() {
    let counter = Counter::default();
    let store = Faulty {
        renews: true,
        first_renewal_fails: true,
        ..Faulty::default()
    };
    let middleware = Idempotency::builder(store.clone())
        .lock_timeout(Duration::from_millis(1500))
        .build();
    let route = web::post().to(|counter: web::Data<Counter>| first_run_takes(counter, 3000));
    let app = one_route(counter.clone(), middleware, "/slow-run", route).await;
    let (first, second) = overlapping(
        &app,
        post_x("/slow-run", "f"),
        post_x("/slow-run", "f"),
        1650,
    )
    .await;
    second.assert_problem(409, "CONFLICT");
    assert_eq!(first.body, "execution 1");
    assert_eq!(counter.get(), 1, "the retry ran the handler a second time");
    assert!(store.renewals.load(Ordering::SeqCst) >= 3);
}

#[actix_web::test]
async fn tenants_never_see_each_others_records() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.tenant_header("x-tenant")).await;
    let a = send(&app, as_tenant("A", "k")).await;
    assert_eq!(a.status, StatusCode::CREATED);
    // Same key and body from tenant B: its own execution, not A's replay.
    let b = send(&app, as_tenant("B", "k")).await;
    assert!(!b.replayed());
    assert_eq!(b.header("x-execution"), Some("2"));
    // Built to collide if tenant and key were joined with a delimiter.
    let c = send(&app, as_tenant("A", "B:k")).await;
    let d = send(&app, as_tenant("A:B", "k")).await;
    assert!(!c.replayed() && !d.replayed());
    assert_eq!(counter.get(), 4);
    let again = send(&app, as_tenant("B", "k")).await;
    assert!(again.replayed());
    assert_eq!(again.header("x-execution"), Some("2"));
}

/// Guards C23: with a tenant source configured, a keyed request without a tenant (no header,
/// or an empty one) is refused with 400 `MISSING_TENANT` and never runs; it used to fall back
/// to the global scope, where two customers without a tenant share records. Keyless requests
/// still pass through.
#[actix_web::test]
async fn keyed_requests_without_a_tenant_are_refused() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.tenant_header("X-Tenant")).await;
    let missing = send(&app, post("/echo", "k").set_payload("a")).await;
    missing.assert_problem(400, "MISSING_TENANT");
    let empty = send(&app, as_tenant("", "k")).await;
    empty.assert_problem(400, "MISSING_TENANT");
    assert_eq!(counter.get(), 0, "a request without a tenant ran");
    let keyless = send(&app, TestRequest::post().uri("/echo").set_payload("a")).await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_eq!(counter.get(), 1);
}

/// A tenant source that panics (an `unwrap` on a header the client left out) is the app's bug;
/// the client gets 400 `MISSING_TENANT` rather than a reset connection, and the request never
/// falls back to the global scope, even with the opt-in. It was called bare, and its panic
/// took the connection down (review, 2026-12-06).
#[actix_web::test]
async fn a_tenant_source_that_panics_is_a_missing_tenant() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.tenant(|req| {
            let header = req
                .headers()
                .get("x-org")
                .map(|v| v.to_str().map(str::to_owned));
            header.expect("the gateway always sets x-org").ok()
        })
        .missing_tenant_uses_global_scope(true)
    })
    .await;
    let refused = send(&app, post("/echo", "k").set_payload("a")).await;
    refused.assert_problem(400, "MISSING_TENANT");
    assert_eq!(counter.get(), 0, "the handler ran without a tenant");
    let scoped = send(
        &app,
        post("/echo", "k")
            .insert_header(("x-org", "o1"))
            .set_payload("a"),
    )
    .await;
    assert_eq!(scoped.status, StatusCode::CREATED);
}

/// A gateway that appends its tenant header after one the client sent (instead of replacing
/// it) leaves two values; the first is the client's. Taking it would let a client pick another
/// tenant's scope and replay its records (C3), so a repeated tenant header is no tenant.
#[actix_web::test]
async fn a_tenant_header_sent_twice_is_no_tenant() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.tenant_header("X-Tenant")).await;
    let victim = send(&app, as_tenant("victim", "k")).await;
    assert_eq!(victim.status, StatusCode::CREATED);
    let twice = send(
        &app,
        post("/echo", "k")
            .append_header(("x-tenant", "victim"))
            .append_header(("x-tenant", "attacker"))
            .set_payload("a"),
    )
    .await;
    twice.assert_problem(400, "MISSING_TENANT");
    assert!(!twice.replayed(), "another tenant's record was replayed");
    assert_eq!(counter.get(), 1);
}

/// Guards the explicit opt-in of C23: `missing_tenant_uses_global_scope(true)` puts keyed
/// requests without a tenant into the global scope (a retry replays), apart from every tenant.
#[actix_web::test]
async fn the_global_scope_for_missing_tenants_is_an_opt_in() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.tenant_header("x-tenant")
            .missing_tenant_uses_global_scope(true)
    })
    .await;
    let first = send(&app, post("/echo", "k").set_payload("a")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, post("/echo", "k").set_payload("a")).await;
    assert!(retry.replayed());
    let tenant = send(&app, as_tenant("A", "k")).await;
    assert!(!tenant.replayed());
    assert_eq!(counter.get(), 2);
}

/// Guards item 9 of the review: "forever" durations (`Duration::MAX`) must not overflow
/// `Instant` while serving (they used to panic in the memory store's `complete`, after the
/// handler ran, and in wait mode), and header names are accepted as people write them.
#[actix_web::test]
async fn forever_durations_and_mixed_case_header_names_serve_normally() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.ttl(Duration::MAX)
            .lock_timeout(Duration::MAX)
            .wait_for_in_flight(Duration::MAX)
            .retry_after(idempotency_actix::MAX_RETRY_AFTER)
            .header_name("Idempotency-Key")
            .tenant_header("X-Account-Id")
    })
    .await;
    let req = || {
        post("/echo", "forever")
            .insert_header(("x-account-id", "acct"))
            .set_payload("a")
    };
    let first = send(&app, req()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&app, req()).await;
    assert!(retry.replayed());
    assert_eq!(counter.get(), 1);
}

/// Guards item 9: an invalid header name is reported when the middleware is built, naming the
/// setting and the value, never at request time.
#[test]
fn invalid_header_names_fail_at_build_time() {
    let error = Idempotency::builder(MemoryStore::new())
        .tenant_header("X Account")
        .try_build()
        .err()
        .expect("an invalid header name is refused");
    let message = error.to_string();
    assert!(
        message.contains("tenant_header") && message.contains("X Account"),
        "{message}"
    );
    let panic = std::panic::catch_unwind(|| {
        Idempotency::builder(MemoryStore::new())
            .header_name("bad\nname")
            .build()
    });
    assert!(panic.is_err(), "build() must refuse an invalid header name");
}

/// A POST to /echo with `value` as its raw Idempotency-Key header.
fn raw_key(value: HeaderValue) -> TestRequest {
    TestRequest::post()
        .uri("/echo")
        .insert_header(("idempotency-key", value))
}

#[actix_web::test]
async fn keys_are_parsed_as_sf_strings_or_bare_tokens() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    let quoted = send(&app, post("/key", r#""a \"b\" c""#)).await;
    assert_eq!(
        quoted.body, r#"a "b" c"#,
        "C17: the handler sees the parsed key"
    );
    // The bare token k and the sf-string "k" are the same key.
    send(&app, post_x("/echo", "k")).await;
    assert!(send(&app, post_x("/echo", "\"k\"")).await.replayed());

    let long = "a".repeat(256);
    send(&app, post("/echo", &long))
        .await
        .assert_problem(400, "KEY_TOO_LONG");
    let multibyte = HeaderValue::from_bytes("é".repeat(200).as_bytes()).unwrap();
    send(&app, raw_key(multibyte))
        .await
        .assert_problem(400, "KEY_TOO_LONG");
    for bad in ["\"\"", "\"abc", r#""a\q""#, "a b", "\"a\"x"] {
        send(&app, post("/echo", bad))
            .await
            .assert_problem(400, "INVALID_KEY");
    }
    let control = HeaderValue::from_bytes(b"a\tb").unwrap(); // HTAB is the one control char HTTP lets through
    send(&app, raw_key(control))
        .await
        .assert_problem(400, "INVALID_KEY");
    let twice = TestRequest::post()
        .uri("/echo")
        .append_header(("idempotency-key", "a"))
        .append_header(("idempotency-key", "a"));
    send(&app, twice).await.assert_problem(400, "INVALID_KEY");
    assert_eq!(counter.get(), 1, "rejected keys never reach the handler");
}

#[actix_web::test]
async fn missing_key_passes_through_unless_required() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    for _ in 0..2 {
        let reply = send(&app, TestRequest::post().uri("/echo").set_payload("x")).await;
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
    }
    assert_eq!(counter.get(), 2);

    let required = app_with(&counter, |b| b.required(true)).await;
    send(&required, TestRequest::post().uri("/echo"))
        .await
        .assert_problem(400, "MISSING_KEY");
    // Methods that are not covered pass through untouched, key or not.
    let get = send(&required, TestRequest::get().uri("/echo")).await;
    assert_eq!(get.status, StatusCode::CREATED);
    let get = send(
        &required,
        TestRequest::get()
            .uri("/echo")
            .insert_header(("idempotency-key", "\"bad")),
    )
    .await;
    assert_eq!(get.status, StatusCode::CREATED, "C1: GET is not covered");
    assert_eq!(counter.get(), 4);
}

#[actix_web::test]
async fn non_2xx_is_released_so_the_key_can_be_retried() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    for _ in 0..2 {
        assert_eq!(
            send(&app, post("/status?500", "s")).await.status.as_u16(),
            500
        );
    }
    assert_eq!(counter.get(), 2, "C10: a 5xx is not stored");
    let ok = send(&app, post("/status?200", "s2")).await;
    assert!(!ok.replayed());
    assert!(send(&app, post("/status?200", "s2")).await.replayed());
    assert_eq!(counter.get(), 3);

    let lenient = app_with(&counter, |b| {
        b.store_statuses(|s| s.is_success() || s.is_client_error())
    })
    .await;
    send(&lenient, post("/status?404", "s3")).await;
    assert!(
        send(&lenient, post("/status?404", "s3")).await.replayed(),
        "configured statuses are stored"
    );
}

#[actix_web::test]
async fn store_if_keeps_partial_results_out_of_the_store() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.store_if(|r| {
            let json: Option<Value> = serde_json::from_slice(r.body).ok();
            let status = json.as_ref().and_then(|j| j["status"].as_str());
            !matches!(status, Some("partial" | "failed"))
        })
    })
    .await;
    let want = |key: &str, want: &'static str| {
        post("/json-status", key)
            .insert_header(("content-type", "application/json"))
            .set_payload(format!(r#"{{"want":"{want}"}}"#))
    };
    assert_eq!(
        send(&app, want("p", "partial")).await.json()["status"],
        "partial"
    );
    assert!(
        !send(&app, want("p", "partial")).await.replayed(),
        "a partial result is not stored"
    );
    assert_eq!(counter.get(), 2);
    send(&app, want("d", "succeeded")).await;
    assert!(send(&app, want("d", "succeeded")).await.replayed());
    assert_eq!(counter.get(), 3);
}

#[actix_web::test]
async fn bodies_over_the_limit_get_413_however_they_arrive() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.max_body_bytes(1024)).await;
    let big = vec![b'a'; 2048];
    // Declared too large.
    send(&app, post("/echo", "b1").set_payload(big.clone()))
        .await
        .assert_problem(413, "PAYLOAD_TOO_LARGE");
    // Content-Length lies (claims 10 bytes).
    let lying = post("/echo", "b2")
        .set_payload(big.clone())
        .insert_header(("content-length", "10"));
    send(&app, lying)
        .await
        .assert_problem(413, "PAYLOAD_TOO_LARGE");
    // No Content-Length at all: a chunked stream.
    let stream = chunked(post("/echo", "b3"), vec![Bytes::from(vec![b'c'; 300]); 8]);
    send_raw(&app, stream)
        .await
        .assert_problem(413, "PAYLOAD_TOO_LARGE");
    assert_eq!(counter.get(), 0);
    // At the limit is fine.
    let exact = send(&app, post("/echo", "b4").set_payload(vec![b'a'; 1024])).await;
    assert_eq!(exact.status, StatusCode::CREATED);
    assert_eq!(
        exact.body.len(),
        1024,
        "the handler got the whole buffered body"
    );
}

#[actix_web::test]
async fn large_streaming_responses_pass_through_and_release_the_key() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.max_response_bytes(8 * 1024)).await;
    let first = send(&app, post("/big", "big")).await;
    assert_eq!(
        first.body.len(),
        64 * 1024,
        "the whole stream reaches the client"
    );
    assert!(first.body.iter().all(|b| *b == b'x'));
    let second = send(&app, post("/big", "big")).await;
    assert!(!second.replayed(), "C10: too large to store, so released");
    assert_eq!(second.body.len(), 64 * 1024);
    assert_eq!(counter.get(), 2);
}

#[actix_web::test]
async fn problems_use_the_configured_type_base_and_renderer() {
    let counter = Counter::default();
    let app = app_with(&counter, |b| {
        b.problem_type_base("https://api.example.com/problems/")
    })
    .await;
    let reply = send(&app, post("/echo", "\"open")).await;
    assert_eq!(
        reply.json()["type"],
        "https://api.example.com/problems/invalid-key"
    );

    let custom = app_with(&counter, |b| {
        b.required(true)
            .problem_renderer(|p| HttpResponse::Ok().json(json!({ "error": p.code.as_str() })))
    })
    .await;
    let reply = send(&custom, TestRequest::post().uri("/echo")).await;
    assert_eq!(
        reply.status,
        StatusCode::BAD_REQUEST,
        "a renderer cannot lose the status"
    );
    assert_eq!(reply.json()["error"], "MISSING_KEY");
}

#[actix_web::test]
async fn store_down_fails_closed_with_503_or_open_when_asked() {
    for fail_open in [false, true] {
        let counter = Counter::default();
        let middleware = Idempotency::builder(Faulty::down())
            .fail_open(fail_open)
            .build();
        let app = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
        let reply = send(&app, post_x("/echo", "k")).await;
        if fail_open {
            assert_eq!(reply.status, StatusCode::CREATED);
            assert_eq!(counter.get(), 1);
        } else {
            reply.assert_problem(503, "STORAGE_UNAVAILABLE");
            assert_eq!(reply.header("retry-after"), Some("1"));
            assert_eq!(counter.get(), 0, "C15: the handler does not run");
        }
    }
}

#[actix_web::test]
async fn a_scope_longer_than_the_store_records_is_refused_before_the_store_is_called() {
    // C3: a store that declares a limit (PostgreSQL's primary-key index) is never asked to
    // record a longer scope. The client gets a final 400, not the 503 of a store error, which
    // every retry would meet again; and `fail_open` never runs such a request unprotected.
    for (down, fail_open) in [(false, false), (true, true)] {
        let counter = Counter::default();
        let seen = Seen::default();
        let store = Faulty {
            down,
            max_scope: Some(24),
            ..Faulty::default()
        };
        let reserves = Arc::clone(&store.reserves);
        let middleware = Idempotency::builder(store)
            .fail_open(fail_open)
            .on_outcome(recording(&seen, outcome_and_status))
            .build();
        let app = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
        // "POST" + "/echo" + a 15-byte key: 24 bytes, at the limit.
        let at_limit = send(&app, post_x("/echo", &"k".repeat(15))).await;
        assert_eq!(at_limit.status, StatusCode::CREATED, "down: {down}");
        let over = send(&app, post_x("/echo", &"k".repeat(16))).await;
        over.assert_problem(400, "SCOPE_TOO_LONG");
        assert_eq!(over.header("retry-after"), None);
        assert_eq!(
            counter.get(),
            1,
            "down: {down}: the handler ran for the first only"
        );
        let first_outcome = if down {
            Outcome::FailOpen
        } else {
            Outcome::Stored
        };
        assert_eq!(
            seen_so_far(&seen),
            [(first_outcome, 201), (Outcome::ScopeTooLong, 400)]
        );
        if !down {
            assert_eq!(
                reserves.load(Ordering::SeqCst),
                1,
                "the store saw only the first"
            );
        }
    }
}

/// A memory store's byte bound leaves room for scopes up to a size (the bound less the
/// response allowance and the bookkeeping); a longer one could never be reserved, so it gets
/// the final 400, and `fail_open` does not run it unprotected on every retry (review,
/// 2026-12-06: the store's `ByteCapacity` was failed open, and each retry ran the handler).
#[actix_web::test]
async fn a_scope_the_memory_store_never_has_room_for_is_refused() {
    let counter = Counter::default();
    let allowance = 1 << 20;
    let store = MemoryStore::builder()
        .response_allowance(allowance)
        .max_bytes(allowance + 2048)
        .build();
    let middleware = Idempotency::builder(store).fail_open(true).build();
    let app = one_route(
        counter.clone(),
        middleware,
        "/items/{name}",
        web::post().to(echo),
    )
    .await;
    let long = format!("/items/{}", "x".repeat(4096));
    for _ in 0..2 {
        let reply = send(&app, post_x(&long, "k")).await;
        reply.assert_problem(400, "SCOPE_TOO_LONG");
    }
    assert_eq!(counter.get(), 0, "run unprotected");
    let short = send(&app, post_x("/items/a", "k")).await;
    assert_eq!(short.status, StatusCode::CREATED);
}

/// A byte bound with no room for any reservation beside its response allowance refuses every
/// keyed request, `fail_open` or not: its limit on scopes is zero, never "no limit" (review,
/// 2026-12-06: it declared none, and `fail_open` ran each request unprotected).
#[actix_web::test]
async fn a_memory_store_with_no_room_for_a_reservation_runs_nothing() {
    let counter = Counter::default();
    let store = MemoryStore::builder().max_bytes(512 * 1024).build();
    assert_eq!(store.max_scope_bytes(), Some(0));
    let middleware = Idempotency::builder(store).fail_open(true).build();
    let app = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
    for _ in 0..2 {
        let reply = send(&app, post_x("/echo", "k")).await;
        reply.assert_problem(400, "SCOPE_TOO_LONG");
    }
    assert_eq!(counter.get(), 0, "run unprotected");
}

/// A completed record whose status is no HTTP status (damaged by a foreign writer or a custom
/// store's bug) is refused like any unreadable record, 503 and nothing run, `fail_open` or not;
/// never replayed with another status (review, 2026-12-06: it went out as 200 OK).
#[actix_web::test]
async fn a_stored_status_that_is_no_http_status_is_not_replayed() {
    for fail_open in [false, true] {
        let counter = Counter::default();
        let store = Faulty {
            replay_status: Some(42),
            ..Faulty::default()
        };
        let middleware = Idempotency::builder(store).fail_open(fail_open).build();
        let app = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
        let first = send(&app, post_x("/echo", "k")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let retry = send(&app, post_x("/echo", "k")).await;
        retry.assert_problem(503, "STORAGE_UNAVAILABLE");
        assert_eq!(
            counter.get(),
            1,
            "fail_open {fail_open}: the handler ran again"
        );
    }
}

#[actix_web::test]
async fn streaming_request_bodies_reach_the_handler_intact() {
    let counter = Counter::default();
    let app = app_with(&counter, default_config).await;
    let parts = [&b"hello "[..], b"chunked ", b"world"]
        .map(Bytes::from_static)
        .to_vec();
    let reply = send_raw(&app, chunked(post("/echo", "s"), parts)).await;
    assert_eq!(reply.body, "hello chunked world");
    let replay = send(&app, post("/echo", "s").set_payload("hello chunked world")).await;
    assert!(
        replay.replayed(),
        "a chunked body fingerprints like the same bytes sent at once"
    );
}

/// Guards the outcome hook: it sees every outcome with its scope, status and time, and a
/// panicking hook never breaks the request (it is caught and logged).
#[actix_web::test]
async fn the_outcome_hook_sees_every_outcome_and_cannot_break_a_request() {
    let seen = Seen::default();
    let record = recording(&seen, |event| {
        let (outcome, status) = outcome_and_status(event);
        (outcome, status, event.scope.map(|s| s.key.clone()))
    });
    let counter = Counter::default();
    let middleware = Idempotency::builder(MemoryStore::new())
        .on_outcome(move |event| {
            record(event);
            if event.scope.is_some_and(|s| s.key == "boom") {
                panic!("a hook that panics");
            }
        })
        .build();
    let app = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
    let req = |key: &str, body: &'static str| post("/echo", key).set_payload(body);
    assert_eq!(send(&app, req("h1", "a")).await.status, StatusCode::CREATED);
    assert!(send(&app, req("h1", "a")).await.replayed());
    send(&app, req("h1", "b"))
        .await
        .assert_problem(422, "FINGERPRINT_MISMATCH");
    send(&app, req("\"bad", "a"))
        .await
        .assert_problem(400, "INVALID_KEY");
    let boom = send(&app, req("boom", "a")).await;
    assert_eq!(
        boom.status,
        StatusCode::CREATED,
        "a panicking hook broke the request"
    );
    assert!(send(&app, req("boom", "a")).await.replayed());
    assert_eq!(
        seen_so_far(&seen),
        vec![
            (Outcome::Stored, 201, Some("h1".to_owned())),
            (Outcome::Replay, 201, Some("h1".to_owned())),
            (Outcome::Mismatch, 422, Some("h1".to_owned())),
            (Outcome::InvalidKey, 400, None),
            (Outcome::Stored, 201, Some("boom".to_owned())),
            (Outcome::Replay, 201, Some("boom".to_owned())),
        ]
    );
    assert_eq!(counter.get(), 2);
}

/// A handler that waits for the test to open its gate, then answers 201.
async fn gated(counter: web::Data<Counter>, gate: web::Data<tokio::sync::Notify>) -> HttpResponse {
    counter.bump();
    gate.notified().await;
    HttpResponse::Created().body("through the gate")
}

async fn panicking() -> HttpResponse {
    panic!("a handler that panics");
}

async fn gated_app(
    counter: &Counter,
    gate: &web::Data<tokio::sync::Notify>,
) -> impl Service<
    actix_http::Request,
    Response = ServiceResponse<impl MessageBody>,
    Error = actix_web::Error,
> {
    init_service(
        App::new()
            .app_data(web::Data::new(counter.clone()))
            .app_data(gate.clone())
            .wrap(Idempotency::new(MemoryStore::new()))
            .route("/gated", web::post().to(gated))
            .route("/panics", web::post().to(panicking)),
    )
    .await
}

/// C21 on a store that never waits: the memory store reserves within the request's first poll,
/// so the handler starts right there, and the work moves to its own task only when the handler
/// waits. Dropping the request's future then (a client reset) must not strand the handler: it
/// is woken on its task when the gate opens, its response is stored, and the retry replays it.
/// Fails if the work is not handed to a task, or if only the dropped request's waker would be
/// woken.
#[actix_web::test]
async fn a_request_dropped_while_its_handler_waits_still_completes() {
    let counter = Counter::default();
    let gate = web::Data::new(tokio::sync::Notify::new());
    let app = gated_app(&counter, &gate).await;
    let first = app.call(post("/gated", "dropped").to_request());
    // Polled until the handler waits at its gate, then dropped: what actix does on a reset.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), first)
            .await
            .is_err(),
        "the handler must be waiting at its gate"
    );
    assert_eq!(counter.get(), 1, "the handler started before the drop");
    gate.notify_one();
    let mut retry = send(&app, post("/gated", "dropped")).await;
    for _ in 0..50 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        retry = send(&app, post("/gated", "dropped")).await;
    }
    assert_eq!(retry.status, StatusCode::CREATED, "body: {:?}", retry.body);
    assert!(
        retry.replayed(),
        "the retry must replay the stored response"
    );
    assert_eq!(retry.body, Bytes::from_static(b"through the gate"));
    assert_eq!(counter.get(), 1, "the handler ran once");
}

/// A handler that panics before its first `.await` (inside the request's own poll) gets the same
/// answer as one that panics on its task: an opaque 500, and the reservation left to its lease
/// (its effects may exist), so a retry inside the lease gets 409, never a second execution.
#[actix_web::test]
async fn a_panicking_handler_gets_an_opaque_500_and_keeps_the_key() {
    let counter = Counter::default();
    let gate = web::Data::new(tokio::sync::Notify::new());
    let app = gated_app(&counter, &gate).await;
    let error = match app.call(post("/panics", "p1").to_request()).await {
        Ok(response) => panic!("expected an error, got {}", response.status()),
        Err(error) => error,
    };
    let response = error.error_response();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let body = to_bytes(response.into_body()).await.unwrap_or_default();
    assert!(
        body.is_empty(),
        "nothing about the panic reaches the client: {body:?}"
    );
    send(&app, post("/panics", "p1"))
        .await
        .assert_problem(409, "CONFLICT");
}

#[actix_web::test]
async fn a_failed_open_request_still_gives_the_handler_its_key() {
    // With the store down and fail_open on, the handler runs unprotected; the key it forwards
    // to a payment provider is then the only protection left, so it must still see it (C17).
    let middleware = Idempotency::builder(Faulty::down()).fail_open(true).build();
    let app = one_route((), middleware, "/key", web::post().to(key_echo)).await;
    let reply = send(&app, post_x("/key", "pay-7")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, "pay-7");
}

#[actix_web::test]
async fn a_header_denied_after_it_was_stored_is_not_replayed() {
    // C11: deny-listed headers are never stored *or replayed*. A record stored before the
    // header was denied (an earlier deploy, or another instance on the same store) still
    // holds it; the replay must drop it.
    let store = MemoryStore::new();
    let counter = Counter::default();
    let middleware = Idempotency::new(store.clone());
    let before = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
    let first = send(&before, post("/echo", "k").set_payload("a")).await;
    assert_eq!(first.header("x-secret"), Some("do-not-store"));
    let middleware = Idempotency::builder(store)
        .deny_headers([HeaderName::from_static("x-secret")])
        .build();
    let after = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
    let retry = send(&after, post("/echo", "k").set_payload("a")).await;
    assert!(retry.replayed());
    assert_eq!(retry.header("x-execution"), Some("1"));
    assert_eq!(retry.header("x-secret"), None);
}

async fn name_echo(counter: web::Data<Counter>, name: web::Path<String>) -> HttpResponse {
    counter.bump();
    HttpResponse::Created().body(name.into_inner())
}

#[actix_web::test]
async fn escapes_the_router_keeps_are_one_scope_whatever_their_case() {
    // actix's router keeps `%2F`, `%2B` and `%25` as sent, and the path extractor decodes them,
    // so `a%2Fb` and `a%2fb` (the same URI, RFC 3986 6.2.2.1) reach the handler as the same
    // `a/b`, and so do `a+b` and `a%2Bb`. One key must not run the handler once per spelling:
    // the second spelling is the same record (422, its path as sent differs), never a second run.
    let counter = Counter::default();
    let middleware = Idempotency::new(MemoryStore::new());
    let route = web::post().to(name_echo);
    let app = one_route(counter.clone(), middleware, "/items/{name}", route).await;
    for (first, second) in [
        ("/items/a%2Fb", "/items/a%2fb"),
        ("/items/c%2bd", "/items/c%2Bd"),
        ("/items/e+f", "/items/e%2Bf"),
        ("/items/g%25h", "/items/g%25h"),
    ] {
        let key = format!("k-{first}");
        let reply = send(&app, post_x(first, &key)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{first}");
        let before = counter.get();
        let again = send(&app, post_x(second, &key)).await;
        assert_eq!(counter.get(), before, "{second} ran the handler again");
        if first == second {
            assert!(again.replayed());
        } else {
            again.assert_problem(422, "FINGERPRINT_MISMATCH");
        }
    }
    // Different names stay different records.
    let other = send(&app, post_x("/items/a%2Fc", "k-/items/a%2Fb")).await;
    assert_eq!(other.status, StatusCode::CREATED);
}

#[actix_web::test]
async fn a_huge_declared_length_is_not_reserved_ahead() {
    // With no practical body limit, a client's Content-Length near u64::MAX used to be
    // reserved whole when a second chunk arrived: an allocation failure aborts the process,
    // a capacity overflow panics. Only what is read may cost memory.
    let counter = Counter::default();
    let app = app_with(&counter, |b| b.max_body_bytes(usize::MAX)).await;
    for declared in [u64::MAX, 1 << 62] {
        let mut req = chunked(
            post("/key", &format!("k-{declared}")),
            vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")],
        );
        req.headers_mut()
            .remove(actix_web::http::header::TRANSFER_ENCODING);
        req.headers_mut().insert(
            actix_web::http::header::CONTENT_LENGTH,
            HeaderValue::from(declared),
        );
        // The handler (which reads no body) runs and answers; actix's own body extractors
        // would refuse the declared length themselves.
        let reply = send_raw(&app, req).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.body, format!("k-{declared}"));
    }
}

#[actix_web::test]
async fn a_panicking_problem_renderer_still_answers_the_problem_once() {
    // A renderer bug is the user's, like a hook's: the client still gets the status, the
    // problem document and Retry-After, and the request counts once, not as a handler panic.
    let seen = Seen::default();
    let counter = Counter::default();
    let middleware = Idempotency::builder(MemoryStore::new())
        .problem_renderer(|_| panic!("a renderer bug"))
        .on_outcome(recording(&seen, outcome_and_status))
        .build();
    let app = one_route(counter.clone(), middleware, "/slow", web::post().to(slow)).await;
    // Refused before the request's task (an invalid key), and on it (a concurrent duplicate).
    let invalid = send(&app, post("/slow", "\"unterminated")).await;
    invalid.assert_problem(400, "INVALID_KEY");
    let (first, second) = futures_util::future::join(
        send(&app, post("/slow", "k")),
        send(&app, post("/slow", "k")),
    )
    .await;
    let conflict = if first.status == StatusCode::CONFLICT {
        first
    } else {
        second
    };
    conflict.assert_problem(409, "CONFLICT");
    assert_eq!(conflict.header("retry-after"), Some("1"));
    let seen = seen_so_far(&seen);
    assert_eq!(seen.len(), 3, "one outcome per request: {seen:?}");
    assert!(
        !seen.iter().any(|(o, _)| *o == Outcome::HandlerPanic),
        "{seen:?}"
    );
    assert_eq!(counter.get(), 1);
}

async fn panicking_stream() -> HttpResponse {
    let mut sent = 0;
    let chunks = futures_util::stream::poll_fn(move |_| {
        sent += 1;
        if sent > 1 {
            panic!("the body panics on its second chunk");
        }
        std::task::Poll::Ready(Some(Ok::<_, std::io::Error>(Bytes::from_static(b"part"))))
    });
    HttpResponse::Ok().streaming(chunks)
}

#[actix_web::test]
async fn a_body_that_panics_aborts_the_response_and_is_counted() {
    // Without the middleware actix drops the connection; through it, the client's chunked
    // body must fail too, never end cleanly as if "part" were the whole response.
    let seen = Seen::default();
    let middleware = Idempotency::builder(MemoryStore::new())
        .on_outcome(recording(&seen, outcome_and_status))
        .build();
    let route = web::post().to(panicking_stream);
    let app = one_route((), middleware, "/stream", route).await;
    let response = call_service(&app, post("/stream", "p").to_request()).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        to_bytes(response.into_body()).await.is_err(),
        "a truncated body read as complete"
    );
    assert_eq!(seen_so_far(&seen), vec![(Outcome::BodyError, 200)]);
}

/// Found by a review of the request flow (2026-12-04); each test failed before its fix.
mod request_flow {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex, PoisonError};
    use std::time::Duration;

    use actix_web::http::StatusCode;
    use actix_web::{web, HttpResponse};
    use idempotency_actix::store::MemoryStore;
    use idempotency_actix::{Idempotency, Outcome};

    use super::{
        charge_after, one_route, outcome_and_status, overlapping, post_x, provider_down_first,
        recording, seen_so_far, send, with_an_abandoned_duplicate, Counter, Faulty, Seen,
    };

    /// Counts a handler's runs and keeps the path value each run got.
    #[derive(Clone, Default)]
    struct ValueLog {
        counter: Counter,
        seen: Arc<Mutex<Vec<String>>>,
    }

    async fn charge_value(log: web::Data<ValueLog>, value: web::Path<String>) -> HttpResponse {
        let n = log.counter.bump();
        log.seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(value.clone());
        HttpResponse::Created().body(format!("charged {} (run {n})", *value))
    }

    /// A lone `%` and `%25` reach the handler as the same path parameter, but were two scopes:
    /// the same key ran the handler twice (C3).
    #[actix_web::test]
    async fn a_lone_percent_and_its_escape_are_one_scope() {
        let log = ValueLog::default();
        let middleware = Idempotency::new(MemoryStore::new());
        let route = web::post().to(charge_value);
        let app = one_route(log.clone(), middleware, "/items/{name}", route).await;
        let first = send(&app, post_x("/items/100%", "k")).await.status;
        let second = send(&app, post_x("/items/100%25", "k")).await;
        assert_eq!(first, StatusCode::CREATED);
        let seen = log.seen.lock().unwrap().clone();
        assert_eq!(
            log.counter.get(),
            1,
            "the same key and the same handler value ({seen:?}) ran twice; second answer {} {:?}",
            second.status,
            second.body
        );
    }

    /// With `fail_open` and wait mode, the store said "in flight, same fingerprint"; one failed
    /// poll during the wait then let the duplicate run while the first still ran.
    #[actix_web::test]
    async fn a_store_blip_while_waiting_does_not_run_a_known_in_flight_duplicate() {
        let counter = Counter::default();
        let store = Faulty {
            fail_reserve: Some(2),
            ..Faulty::default()
        };
        let middleware = Idempotency::builder(store)
            .fail_open(true)
            .wait_for_in_flight(Duration::from_secs(2))
            .build();
        let route = web::post().to(|counter: web::Data<Counter>| charge_after(counter, 400));
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        let (first, second) = overlapping(&app, post_x("/pay", "k"), post_x("/pay", "k"), 50).await;
        assert_eq!(first.body, "charge 1");
        assert_eq!(
            counter.get(),
            1,
            "a duplicate the store reported in flight ran concurrently: {second:?}"
        );
    }

    /// A waiter whose client left kept polling, and later ran the handler for nobody.
    #[actix_web::test]
    async fn a_waiter_whose_client_left_stops_waiting() {
        let counter = Counter::default();
        let store = Faulty::default();
        let middleware = Idempotency::builder(store.clone())
            .wait_for_in_flight(Duration::from_secs(30))
            .build();
        // The provider fails after a while: not stored, key released.
        let route = web::post().to(|counter: web::Data<Counter>| provider_down_first(counter, 600));
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        // The client gives up after 100 ms (its own timeout): the request's future is dropped.
        let (first, polls_at_drop) =
            with_an_abandoned_duplicate(&app, ("/pay", "k"), 50, 100, || {
                store.reserves.load(Ordering::SeqCst)
            })
            .await;
        assert_eq!(first.status, StatusCode::BAD_GATEWAY);
        tokio::time::sleep(Duration::from_millis(800)).await;
        let polls_later = store.reserves.load(Ordering::SeqCst);
        assert_eq!(
            (counter.get(), polls_later),
            (1, polls_at_drop),
            "after its client left, the waiter polled the store {} more times and ran the handler \
             {} time(s) for nobody",
            polls_later - polls_at_drop,
            counter.get() - 1
        );
    }

    /// A waiter that wins the key with a slow answer confirms it with a renewal; a client that
    /// leaves during that renewal is still gone when it is answered: nothing runs for nobody
    /// (C8; review, 2026-12-06: the client was checked before the renewal only, and the
    /// handler ran for a client that had left).
    #[actix_web::test]
    async fn a_waiter_whose_client_left_during_the_confirmation_runs_nothing() {
        let counter = Counter::default();
        let store = Faulty {
            renews: true,
            // The first's reserve is fast; every later one (the waiter's polls) takes 120 ms,
            // so the waiter's winning reservation is confirmed; its renewal takes 300 ms.
            slow_answers_from: Some((1, Duration::from_millis(120))),
            slow_renewal_answer: Some((0, Duration::from_millis(300))),
            ..Faulty::default()
        };
        let middleware = Idempotency::builder(store.clone())
            .wait_for_in_flight(Duration::from_secs(30))
            .lock_timeout(Duration::from_millis(300))
            .build();
        // The first fails after 60 ms (too soon for a renewal of its own): not stored, key
        // released. The waiter polls at 50 (answered 170), wins the key at 180 (answered 300)
        // and confirms it (answered 600). Its client leaves at 500.
        let route = web::post().to(|counter: web::Data<Counter>| provider_down_first(counter, 60));
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        let (first, renewals_at_drop) =
            with_an_abandoned_duplicate(&app, ("/pay", "k"), 50, 450, || {
                store.renewals.load(Ordering::SeqCst)
            })
            .await;
        assert_eq!(first.status, StatusCode::BAD_GATEWAY);
        assert_eq!(
            renewals_at_drop, 1,
            "the scenario: the client left during the confirmation"
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(
            counter.get(),
            1,
            "the handler ran for a client that had left"
        );
    }

    /// A panicking `store_if` after the handler succeeded: the client got an opaque 500 for a
    /// payment that was made, the key was stuck for a lease, and the retry after the lease ran
    /// the payment again. Caught now, like renderer and hook panics.
    #[actix_web::test]
    async fn a_panicking_store_if_neither_hides_nor_repeats_a_completed_payment() {
        let counter = Counter::default();
        let middleware = Idempotency::builder(MemoryStore::new())
            .lock_timeout(Duration::from_millis(300))
            .store_if(|response| {
                let json: serde_json::Value =
                    serde_json::from_slice(response.body).expect("handlers answer JSON");
                json["status"] != "partial"
            })
            .build();
        let route = web::post().to(|counter: web::Data<Counter>| async move {
            let n = counter.bump();
            HttpResponse::Created().body(format!("receipt {n} (not JSON)"))
        });
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        let first_status = send(&app, post_x("/pay", "k")).await.status;
        let retry = send(&app, post_x("/pay", "k")).await.status;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let after_lease = send(&app, post_x("/pay", "k")).await;
        assert_eq!(
            (first_status, counter.get()),
            (StatusCode::CREATED, 1),
            "first {first_status}, retry {retry}, after the lease {} {:?}: the payment \
             ran {} times",
            after_lease.status,
            after_lease.body,
            counter.get()
        );
    }

    /// Escapes the router left behind are decoded by the path extractor: `/items/%%34%31`
    /// reaches the handler as `A`, like `/items/A`, and a tail parameter gets `a/b` from both
    /// `/files/a/b` and `/files/a%2Fb`. They were separate scopes, and one key ran twice
    /// (found by review of the fix above, 2026-12-04).
    #[actix_web::test]
    async fn an_escape_the_router_left_behind_is_one_scope_with_its_decoded_value() {
        for (route, plain, crafted) in [
            ("/items/{name}", "/items/A", "/items/%%34%31"),
            ("/items/{name}", "/items/%C3%A9", "/items/%%43%33%%41%39"),
            ("/items/{name}", "/items/%FF", "/items/%%46%46"),
            ("/files/{path:.*}", "/files/a/b", "/files/a%2Fb"),
        ] {
            let log = ValueLog::default();
            let middleware = Idempotency::new(MemoryStore::new());
            let app = one_route(log.clone(), middleware, route, web::post().to(charge_value)).await;
            let mut statuses = Vec::new();
            for path in [plain, crafted] {
                statuses.push(send(&app, post_x(path, "k")).await.status);
            }
            let seen = seen_so_far(&log.seen);
            if let [a, b] = seen.as_slice() {
                assert_eq!(a, b, "premise: one value for the handler");
            }
            assert_eq!(
                log.counter.get(),
                1,
                "{plain} and {crafted}: one value ({seen:?}), one key, two runs ({statuses:?})"
            );
        }
    }

    /// A waiter whose client left reports its outcome (`abandoned`, 499) like every other
    /// keyed request (found by review, 2026-12-04: the hook heard nothing).
    #[actix_web::test]
    async fn an_abandoned_waiter_reports_an_outcome() {
        let seen = Seen::default();
        let middleware = Idempotency::builder(MemoryStore::new())
            .wait_for_in_flight(Duration::from_secs(30))
            .on_outcome(recording(&seen, outcome_and_status))
            .build();
        let route = web::post().to(|| async {
            tokio::time::sleep(Duration::from_millis(400)).await;
            HttpResponse::Created().body("charged")
        });
        let app = one_route((), middleware, "/pay", route).await;
        let (first, ()) = with_an_abandoned_duplicate(&app, ("/pay", "k"), 50, 100, || ()).await;
        assert_eq!(first.status, StatusCode::CREATED);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            seen_so_far(&seen),
            vec![(Outcome::Abandoned, 499), (Outcome::Stored, 201)],
            "two keyed requests, two outcomes"
        );
    }
}

/// The `on_outcome` hook gets the scope of a request whose handler panicked (`None` is only
/// for requests that never got one): the handler ran, its effects may exist and the key is
/// held until its lease ends, so an audit hook must be able to tell which key and tenant.
#[actix_web::test]
async fn the_hook_sees_the_scope_of_a_request_whose_handler_panicked() {
    let seen = Seen::default();
    let middleware = Idempotency::builder(MemoryStore::new())
        .on_outcome(recording(&seen, |event| {
            let (outcome, status) = outcome_and_status(event);
            let scope = event.scope.map(|s| (s.path.clone(), s.key.clone()));
            (outcome, status, scope)
        }))
        .build();
    let app = one_route((), middleware, "/panics", web::post().to(panicking)).await;
    assert!(app.call(post("/panics", "p1").to_request()).await.is_err());
    assert_eq!(
        seen_so_far(&seen),
        vec![(
            Outcome::HandlerPanic,
            500,
            Some(("/panics".to_owned(), "p1".to_owned()))
        )]
    );
}

/// Found by the review of the request flow under timing (2026-12-05): each test failed on the
/// code before its fix.
mod flow_timing_review {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use actix_web::http::StatusCode;
    use actix_web::web;
    use idempotency_actix::store::MemoryStore;
    use idempotency_actix::Idempotency;

    use super::{
        charge_after, one_route, overlapping, post_x, provider_down_first,
        with_an_abandoned_duplicate, Counter, Faulty,
    };

    /// A `lock_timeout` under what the heartbeat needs was accepted silently and renewal was
    /// then skipped: a concurrent duplicate took the key over and ran while the first still
    /// ran. Such a lease is refused at build time now, and the shortest one accepted keeps a
    /// 300 ms handler's key through a duplicate that arrives 50 ms in.
    #[actix_web::test]
    async fn a_tiny_lock_timeout_does_not_let_a_concurrent_duplicate_run() {
        assert!(Idempotency::builder(MemoryStore::new())
            .lock_timeout(Duration::from_millis(1))
            .try_build()
            .is_err());
        let counter = Counter::default();
        let middleware = Idempotency::builder(MemoryStore::new())
            .lock_timeout(idempotency_actix::MIN_LOCK_TIMEOUT)
            .build();
        let route = web::post().to(|counter: web::Data<Counter>| charge_after(counter, 300));
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        let (first, second) = overlapping(&app, post_x("/pay", "k"), post_x("/pay", "k"), 50).await;
        assert_eq!(
            counter.get(),
            1,
            "a concurrent duplicate ran while the first still ran: first {} {:?}, second {} {:?}",
            first.status,
            first.body,
            second.status,
            second.body
        );
    }

    /// Wait mode (C8): the waiter saw the first request in flight, then its client left while
    /// the waiter's next `reserve` was on its way to a slow store. Meanwhile the first request
    /// failed (502, key released), so that `reserve` reserved the key, and the waiter ran the
    /// handler for nobody: the client that gave up may already have retried with a new key.
    /// `Flow::reserve` checks for a client that left only before each call, never after the
    /// one that reserves.
    #[actix_web::test]
    async fn a_waiter_whose_client_left_during_its_last_reserve_runs_nothing() {
        let counter = Counter::default();
        // Calls: 0 the first request, 1 the waiter (in flight), 2 the waiter again (slow).
        let store = Faulty {
            renews: true,
            slow_reserve: Some((2, Duration::from_millis(500))),
            ..Faulty::default()
        };
        let middleware = Idempotency::builder(store.clone())
            .wait_for_in_flight(Duration::from_secs(30))
            .build();
        let route = web::post().to(|counter: web::Data<Counter>| provider_down_first(counter, 200));
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        // The client gives up after 200 ms, while the waiter's third reserve is on its way.
        let (first, ()) = with_an_abandoned_duplicate(&app, ("/pay", "k"), 20, 200, || ()).await;
        assert_eq!(first.status, StatusCode::BAD_GATEWAY);
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(
            store.reserves.load(Ordering::SeqCst),
            3,
            "the scenario: three reserves"
        );
        assert_eq!(
            counter.get(),
            1,
            "the waiter whose client had left ran the handler for nobody"
        );
    }
}

/// A stream declared empty that stays open (a long poll's keep-alive, a body whose sender a
/// background task keeps): actix writes its head at once and never polls it.
async fn declared_empty_open_stream() -> HttpResponse {
    HttpResponse::Ok()
        .no_chunking(0)
        .streaming(futures_util::stream::pending::<
            Result<Bytes, actix_web::Error>,
        >())
}

/// A stream declared empty that stays open is answered at once, as actix answers it without
/// the middleware (a review of 246f0d3 found its first fix reading such a stream to its end:
/// nothing for the client until `renew_lease_up_to`, 10 min by default, then a 500).
#[actix_web::test]
async fn a_declared_empty_stream_that_stays_open_is_answered_at_once() {
    let middleware = Idempotency::builder(MemoryStore::new())
        .lock_timeout(Duration::from_millis(300))
        .renew_lease_up_to(Duration::from_secs(5))
        .build();
    let route = web::post().to(declared_empty_open_stream);
    let app = one_route((), middleware, "/open", route).await;
    let started = std::time::Instant::now();
    let answered = tokio::time::timeout(
        Duration::from_secs(2),
        app.call(post_x("/open", "open-1").to_request()),
    )
    .await;
    assert!(
        matches!(&answered, Ok(Ok(r)) if r.status() == StatusCode::OK),
        "no 200 head within 2 s (before 246f0d3: at once); after {:?}: {:?}",
        started.elapsed(),
        answered.as_ref().map(|r| r.as_ref().map(|r| r.status()))
    );
}

/// A stream that declares 5 bytes and yields "hello", then does `after` (counted).
fn declared_then(
    counter: &Counter,
    after: impl futures_util::Stream<Item = Result<Bytes, actix_web::Error>> + 'static,
) -> HttpResponse {
    counter.bump();
    let body =
        futures_util::stream::once(async { Ok::<_, actix_web::Error>(Bytes::from("hello")) })
            .chain(after);
    HttpResponse::Ok().no_chunking(5).streaming(body)
}

/// "hello", then 50 ms of work, then `last` (nothing: the end; or an error).
fn after_work(
    last: Option<&'static str>,
) -> impl futures_util::Stream<Item = Result<Bytes, actix_web::Error>> {
    futures_util::stream::once(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        last.map(|why| Err(actix_web::error::ErrorInternalServerError(why)))
    })
    .filter_map(std::future::ready)
}

/// An app of three routes whose streams declare 5 bytes and yield "hello": `/open` then stays
/// open (a channel whose sender a background task keeps), `/commit` works 50 ms and ends,
/// `/fail` works 50 ms and fails.
async fn declared_streams(
    counter: &Counter,
) -> impl Service<
    actix_http::Request,
    Response = ServiceResponse<impl MessageBody>,
    Error = actix_web::Error,
> {
    let middleware = Idempotency::builder(MemoryStore::new())
        // Leases that outlast each test, so that a retry meets the first request's key.
        .lock_timeout(Duration::from_secs(10))
        .renew_lease_up_to(Duration::from_secs(20))
        .build();
    init_service(
        App::new()
            .app_data(web::Data::new(counter.clone()))
            .wrap(middleware)
            .route(
                "/open",
                web::post().to(|c: web::Data<Counter>| async move {
                    declared_then(&c, futures_util::stream::pending())
                }),
            )
            .route(
                "/commit",
                web::post()
                    .to(|c: web::Data<Counter>| async move { declared_then(&c, after_work(None)) }),
            )
            .route(
                "/fail",
                web::post().to(|c: web::Data<Counter>| async move {
                    declared_then(&c, after_work(Some("the commit failed")))
                }),
            ),
    )
    .await
}

/// The body of `response` as an HTTP client reads it: its declared 5 bytes, within 3 s; `Err`
/// when the body failed first.
async fn five_bytes(response: ServiceResponse<impl MessageBody>) -> Result<Vec<u8>, String> {
    let mut body = Box::pin(response.into_body());
    let mut read = Vec::new();
    let reading = async {
        while read.len() < 5 {
            match std::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
                Some(Ok(chunk)) => read.extend_from_slice(&chunk),
                Some(Err(_)) => return Err("the body failed".to_owned()),
                None => return Err("the body ended short".to_owned()),
            }
        }
        Ok(())
    };
    match tokio::time::timeout(Duration::from_secs(3), reading).await {
        Ok(Ok(())) => Ok(read),
        Ok(Err(why)) => Err(why),
        Err(_) => Err(format!("no 5 bytes within 3 s: {read:?}")),
    }
}

/// A stream that yields its declared bytes and then stays open: its client gets them within
/// the hold on a declared body's last bytes (1 s), as it would without the middleware; nothing
/// is stored while the stream is open, so a retry meanwhile is told the request is in flight.
/// (A review, 2026-12-07, found the last bytes held for the stream's end, which never came:
/// the client hung. A first fix stored the declared bytes as soon as they were read and
/// dropped the stream, which skipped whatever the stream did after them: `/fail` below.)
#[actix_web::test]
async fn a_declared_stream_that_stays_open_after_its_bytes_reaches_its_client() {
    let counter = Counter::default();
    let app = declared_streams(&counter).await;
    let first = app.call(post_x("/open", "open-2").to_request()).await;
    let first = first.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(five_bytes(first).await.as_deref(), Ok(&b"hello"[..]));
    let retry = send(&app, post_x("/open", "open-2")).await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(counter.get(), 1, "the handler ran once");
}

/// A stream that works after its last declared bytes and then ends is stored once it ends, and
/// replayed.
#[actix_web::test]
async fn a_declared_stream_that_works_after_its_bytes_is_stored_at_its_end() {
    let counter = Counter::default();
    let app = declared_streams(&counter).await;
    let first = app.call(post_x("/commit", "commit-1").to_request()).await;
    let first = first.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(five_bytes(first).await.as_deref(), Ok(&b"hello"[..]));
    let replay = send(&app, post_x("/commit", "commit-1")).await;
    assert_eq!(replay.body, "hello");
    assert!(replay.replayed(), "stored and replayed: {replay:?}");
    assert_eq!(counter.get(), 1, "the handler ran once");
}

/// A stream that fails after its last declared bytes (the work they announce did not happen)
/// is not stored: its client's body fails, and the key is left to its lease (C24), so a retry
/// meanwhile is told the request is in flight, never replayed a success.
#[actix_web::test]
async fn a_declared_stream_that_fails_after_its_bytes_is_not_stored() {
    let counter = Counter::default();
    let app = declared_streams(&counter).await;
    let first = app.call(post_x("/fail", "fail-1").to_request()).await;
    let first = first.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        five_bytes(first).await,
        Err("the body failed".to_owned()),
        "the client's connection is aborted before its last bytes"
    );
    let retry = send(&app, post_x("/fail", "fail-1")).await;
    assert!(!retry.replayed(), "a failed stream was replayed: {retry:?}");
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(counter.get(), 1, "the handler ran once");
}

/// A stream that fails after its last declared bytes, later (2 s) than they are held (1 s): its
/// client already has them, as it would without the middleware (a failure after a body's
/// declared length cannot be signalled on HTTP/1, nor to hyper's HTTP/2 clients), but nothing
/// is stored, so a retry is never replayed a success; the key is left to its lease (C24).
#[actix_web::test]
async fn a_declared_stream_that_fails_after_the_hold_is_not_stored() {
    let counter = Counter::default();
    let middleware = Idempotency::builder(MemoryStore::new())
        // A lease that outlasts the test, so that its retry meets the failed request's key.
        .lock_timeout(Duration::from_secs(10))
        .renew_lease_up_to(Duration::from_secs(20))
        .build();
    let route = web::post().to(|c: web::Data<Counter>| async move {
        let late = futures_util::stream::once(async {
            tokio::time::sleep(Duration::from_millis(2000)).await;
            Err::<Bytes, _>(actix_web::error::ErrorInternalServerError(
                "the commit failed",
            ))
        });
        declared_then(&c, late)
    });
    let app = one_route(counter.clone(), middleware, "/late", route).await;
    let first = app.call(post_x("/late", "late-1").to_request()).await;
    let first = first.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(five_bytes(first).await.as_deref(), Ok(&b"hello"[..]));
    tokio::time::sleep(Duration::from_millis(1500)).await; // past the failure
    let retry = send(&app, post_x("/late", "late-1")).await;
    assert!(!retry.replayed(), "a failed stream was replayed: {retry:?}");
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(counter.get(), 1, "the handler ran once");
}

/// A declared stream too large to store goes to its client whole, its last bytes not held
/// (nothing is stored), and a failure after them is still counted as a body error, by the task
/// that forwards the rest.
#[actix_web::test]
async fn a_too_large_declared_stream_that_fails_is_counted_as_a_body_error() {
    let counter = Counter::default();
    let seen: Seen<(Outcome, u16)> = Arc::default();
    let middleware = Idempotency::builder(MemoryStore::new())
        .max_response_bytes(3)
        .on_outcome(recording(&seen, outcome_and_status))
        .build();
    // A stream of unknown size with a stated length (a sized one over the limit is passed on
    // without a copy, and never reaches the streaming path).
    let route = web::post().to(|c: web::Data<Counter>| async move {
        c.bump();
        let body = futures_util::stream::once(async { Ok(Bytes::from("hello")) })
            .chain(after_work(Some("the commit failed")));
        HttpResponse::Ok()
            .no_chunking(5)
            .body(actix_web::body::BodyStream::new(body))
    });
    let app = one_route(counter.clone(), middleware, "/big", route).await;
    let first = app.call(post_x("/big", "big-1").to_request()).await;
    let first = first.unwrap_or_else(|e| panic!("{e}"));
    // Read to its end (a client that stays): the failure after the bytes fails the body.
    let read = tokio::time::timeout(Duration::from_secs(3), to_bytes(first.into_body())).await;
    assert!(matches!(read, Ok(Err(_))), "the body did not fail");
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while seen_so_far(&seen).is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(seen_so_far(&seen), [(Outcome::BodyError, 200)]);
}

/// A counted `/pay` behind `store` with a 300 ms lease: a request, and the same request
/// `after_ms` later. The handler's runs and both replies.
async fn pay_and_duplicate(store: Faulty, after_ms: u64) -> (usize, Reply, Reply) {
    let counter = Counter::default();
    let middleware = Idempotency::builder(store)
        .lock_timeout(Duration::from_millis(300))
        .build();
    let route = web::post().to(|counter: web::Data<Counter>| async move {
        counter.bump();
        HttpResponse::Created().finish()
    });
    let app = one_route(counter.clone(), middleware, "/pay", route).await;
    let (first, duplicate) =
        overlapping(&app, post_x("/pay", "k"), post_x("/pay", "k"), after_ms).await;
    (counter.get(), first, duplicate)
}

/// Two `Idempotency` middlewares around one handler (one on the `App`, a stricter one on a
/// scope), on one store: the inner one found the outer one's reservation of the same scope
/// and fingerprint and answered 409, every attempt, so the handler never ran (review,
/// 2026-12-06; before: 409 and 0 runs). The inner one now leaves a request whose key an outer
/// one holds to it.
#[actix_web::test]
async fn nested_middlewares_on_one_store_run_the_handler_once() {
    let store = MemoryStore::new();
    let inner = Idempotency::builder(store.clone())
        .lock_timeout(Duration::from_secs(5))
        .build();
    pay_twice_through_nested(Idempotency::new(store), inner).await;
}

/// An app with `outer` on the `App` and `inner` on the `/pay` scope around one payment
/// handler: a keyed payment and its retry must be answered 201, then its replay, the handler
/// run once.
async fn pay_twice_through_nested<O: IdempotencyStore, I: IdempotencyStore>(
    outer: Idempotency<O>,
    inner: Idempotency<I>,
) {
    let counter = Counter::default();
    let app = init_service(
        App::new()
            .app_data(web::Data::new(counter.clone()))
            .wrap(outer)
            .service(web::scope("/pay").wrap(inner).route(
                "",
                web::post().to(|counter: web::Data<Counter>| async move {
                    counter.bump();
                    HttpResponse::Created().body("paid")
                }),
            )),
    )
    .await;
    let first = send(&app, post_x("/pay", "k")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = send(&app, post_x("/pay", "k")).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(counter.get(), 1);
}

/// The same nesting when the outer one cannot protect: its store down and `fail_open`, it
/// passes the request through unprotected, with its key in the extensions. The inner one, on
/// a healthy store, took that for "held outside" and passed it through too, so the payment
/// ran on every retry (second review, 2026-12-06; before: 2 runs). The inner one protects it.
#[actix_web::test]
async fn an_inner_middleware_protects_what_a_failed_open_outer_one_did_not() {
    let outer = Idempotency::builder(Faulty::down()).fail_open(true).build();
    pay_twice_through_nested(outer, Idempotency::new(MemoryStore::new())).await;
}

/// A `complete` that fails once is retried in the background until the lease ends (C16), so
/// a retry after the lease replays instead of running again. The retries used to start with
/// a 100 ms pause and stop when the next pause would pass the lease's end: with the shortest
/// lease the builder accepts (100 ms) there was no retry at all, and one between 100 and
/// 300 ms got one (review, 2026-12-06; before: the handler ran twice).
#[actix_web::test]
async fn a_failed_complete_is_retried_within_the_shortest_lease() {
    for lease_ms in [100, 250] {
        let counter = Counter::default();
        let store = Faulty {
            renews: true,
            first_complete_fails: true,
            ..Faulty::default()
        };
        let completes = Arc::clone(&store.completes);
        let middleware = Idempotency::builder(store)
            .lock_timeout(Duration::from_millis(lease_ms))
            .build();
        let route = web::post().to(|counter: web::Data<Counter>| async move {
            counter.bump();
            HttpResponse::Created().finish()
        });
        let app = one_route(counter.clone(), middleware, "/pay", route).await;
        let first = send(&app, post_x("/pay", "k")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        tokio::time::sleep(Duration::from_millis(lease_ms + 50)).await;
        let retry = send(&app, post_x("/pay", "k")).await;
        assert_eq!(
            counter.get(),
            1,
            "a {lease_ms} ms lease: the failed complete must be retried before the lease ends"
        );
        assert!(retry.replayed(), "a {lease_ms} ms lease: {retry:?}");
        assert!(completes.load(Ordering::SeqCst) >= 2);
    }
}

/// A `complete` that keeps failing while the store still renews leases (its responses table
/// locked, say): the background retry held the key only until the lease it had ended, then a
/// retry took it over and ran the handler again, though the store would have renewed the lease
/// all along (review, 2026-12-06; before: 2 runs). The retry now renews the lease while it
/// tries, up to `renew_lease_up_to`, so duplicates get 409 until the response is stored, then
/// its replay.
#[actix_web::test]
async fn a_complete_that_keeps_failing_keeps_its_lease_while_the_store_renews() {
    let (app, counter, failing) = paid_while_completes_fail(
        Duration::from_millis(300),
        Duration::from_secs(5),
        Duration::ZERO,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(450)).await;
    let during = send(&app, post_x("/pay", "k")).await;
    assert_eq!(during.status, StatusCode::CONFLICT, "{during:?}");
    failing.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(700)).await;
    let after = send(&app, post_x("/pay", "k")).await;
    assert!(after.replayed(), "{after:?}");
    assert_eq!(counter.get(), 1);
}

/// The same retry when each try hangs until the store's timeout, longer than the lease: the
/// retry renewed the lease only after a try had failed, so the lease ran out during the try
/// and a duplicate took the key over and ran the handler again (review, 2026-12-06; before: 2
/// runs). The lease is now renewed while each try is in flight, as the heartbeat renewed it
/// while the first `complete` was.
#[actix_web::test]
async fn a_complete_retry_that_hangs_keeps_its_lease() {
    // Answered once its first `complete` failed, a second after it was sent.
    let (app, counter, failing) = paid_while_completes_fail(
        Duration::from_millis(300),
        Duration::from_secs(20),
        Duration::from_millis(1000),
    )
    .await;
    // The background retry's first try hangs from about 100 ms to 1.1 s from now: two leases
    // and more without an answer.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let during = send(&app, post_x("/pay", "k")).await;
    assert_eq!(during.status, StatusCode::CONFLICT, "{during:?}");
    assert_eq!(counter.get(), 1, "the handler ran again");
    failing.store(false, Ordering::SeqCst);
    // The next try (pauses of at most 2 s here) stores the response.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let after = send(&app, post_x("/pay", "k")).await;
    assert!(after.replayed(), "{after:?}");
    assert_eq!(counter.get(), 1);
}

/// The same retry with `renew_lease_up_to` shorter than the lease ("no renewal"): a renewal
/// from the retry must not shorten the lease it holds (a first version granted what was left
/// of the bound, 50 ms where 500 were left, and a duplicate at 300 ms ran; second review,
/// 2026-12-06). The key stays held for its lease.
#[actix_web::test]
async fn a_complete_retry_never_shortens_the_lease() {
    let (app, counter, _failing) = paid_while_completes_fail(
        Duration::from_millis(600),
        Duration::from_millis(150),
        Duration::ZERO,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = send(&app, post_x("/pay", "k")).await;
    assert_eq!(during.status, StatusCode::CONFLICT, "{during:?}");
    assert_eq!(counter.get(), 1);
}

/// An app over a store that renews leases but whose every `complete` fails, each after
/// `failing_takes` (until the flag returned is cleared), after a first `POST /pay` with key `k`
/// answered 201: the app, its run counter and the flag.
async fn paid_while_completes_fail(
    lease: Duration,
    renew_up_to: Duration,
    failing_takes: Duration,
) -> (
    impl Service<
        actix_http::Request,
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
    >,
    Counter,
    Arc<AtomicBool>,
) {
    let counter = Counter::default();
    let store = Faulty {
        renews: true,
        failing_complete_takes: failing_takes,
        ..Faulty::default()
    };
    let failing = Arc::clone(&store.completes_failing);
    failing.store(true, Ordering::SeqCst);
    let middleware = Idempotency::builder(store)
        .lock_timeout(lease)
        .renew_lease_up_to(renew_up_to)
        .build();
    let route = web::post().to(|counter: web::Data<Counter>| async move {
        counter.bump();
        HttpResponse::Created().finish()
    });
    let app = one_route(counter.clone(), middleware, "/pay", route).await;
    let first = send(&app, post_x("/pay", "k")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    (app, counter, failing)
}

/// A reserve answered after its lease ended (the store applied the lease, then a stalled
/// database or a slow network held the answer back: the lease counts from when the store
/// applied it) must not run the handler on a key another request may have taken over
/// meanwhile. Here the first reserve answers 400 ms after the store applied its 300 ms lease;
/// a duplicate at 350 ms takes the ended reservation over and runs. The first request confirms
/// its reservation before running (a renewal, fenced by its token), finds it gone and is
/// answered as the key stands (here the duplicate's replay): one run (time audit, 2026-12-06;
/// before: both ran).
#[actix_web::test]
async fn a_reservation_answered_after_its_lease_is_confirmed_before_running() {
    let store = Faulty {
        renews: true,
        slow_answer: Some((0, Duration::from_millis(400))),
        ..Faulty::default()
    };
    let (runs, first, duplicate) = pay_and_duplicate(store, 350).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CREATED,
        "the scenario: the duplicate took the ended reservation over"
    );
    assert_eq!(runs, 1, "the handler ran twice");
    // The first is answered as the key stands once it finds it gone: the duplicate's replay
    // (it finished at once), or 409 had it still been running.
    assert!(
        first.replayed() || first.status == StatusCode::CONFLICT,
        "{:?}",
        first.status
    );
}

/// The renewal that confirms a slow reservation can itself be answered late: applied at once
/// (the lease now ends a lease after it), answered after that new lease ended, and taken over
/// by a duplicate meanwhile. It is checked like the reservation was: an answer that took a
/// third of the lease or more is confirmed again (review of the fix above, 2026-12-06; before:
/// the handler ran twice).
#[actix_web::test]
async fn a_confirmation_answered_after_its_lease_is_confirmed_again() {
    let store = Faulty {
        renews: true,
        slow_answer: Some((0, Duration::from_millis(150))),
        slow_renewal_answer: Some((0, Duration::from_millis(400))),
        ..Faulty::default()
    };
    // Reserved at 0, answered at 150; renewed at 150 (lease to 450), answered at 550; the
    // duplicate at 500 finds the lease ended.
    let (runs, first, duplicate) = pay_and_duplicate(store, 500).await;
    assert_eq!(
        duplicate.status,
        StatusCode::CREATED,
        "the scenario: the duplicate took the ended reservation over"
    );
    assert_eq!(runs, 1, "the handler ran twice");
    assert!(first.replayed(), "{:?}", first.status);
}

/// A store whose every reservation is answered late and found lost by its confirmation is
/// given up on (503, nothing run), not polled for ever (review, 2026-12-06).
#[actix_web::test]
async fn a_store_that_loses_every_slow_reservation_is_given_up_on() {
    let counter = Counter::default();
    let store = Faulty {
        renews: true,
        forgets: true,
        slow_answers_from: Some((0, Duration::from_millis(120))),
        ..Faulty::default()
    };
    let reserves = Arc::clone(&store.reserves);
    let middleware = Idempotency::builder(store)
        .lock_timeout(Duration::from_millis(300))
        .build();
    let app = one_route(counter.clone(), middleware, "/echo", web::post().to(echo)).await;
    let reply = tokio::time::timeout(Duration::from_secs(5), send(&app, post_x("/echo", "k")))
        .await
        .expect("answered");
    reply.assert_problem(503, "STORAGE_UNAVAILABLE");
    assert_eq!(counter.get(), 0);
    assert_eq!(
        reserves.load(Ordering::SeqCst),
        3,
        "three tries, then given up"
    );
}

/// A store that cannot renew cannot confirm a slow reservation, and a reservation answered a
/// third of its lease late leaves its handler less than the two thirds a fast answer leaves:
/// given back (503) rather than run into a takeover. Before (review, 2026-12-06): run whenever
/// any of the lease was left, and a retry just after it ended ran the handler again.
#[actix_web::test]
async fn a_slow_reservation_a_store_cannot_confirm_is_given_back() {
    let counter = Counter::default();
    let store = Faulty {
        slow_answer: Some((0, Duration::from_millis(280))),
        ..Faulty::default()
    };
    let middleware = Idempotency::builder(store.clone())
        .lock_timeout(Duration::from_millis(300))
        .build();
    let route = web::post().to(|counter: web::Data<Counter>| async move {
        counter.bump();
        tokio::time::sleep(Duration::from_millis(100)).await;
        HttpResponse::Created().finish()
    });
    let app = one_route(counter.clone(), middleware, "/pay", route).await;
    let (first, retry) = overlapping(&app, post_x("/pay", "k"), post_x("/pay", "k"), 310).await;
    assert_eq!(counter.get(), 1, "the handler ran twice");
    first.assert_problem(503, "STORAGE_UNAVAILABLE");
    assert_eq!(retry.status, StatusCode::CREATED);
}
