//! A claims audit (review of 2026-12-05): precise promises of `docs/contract.md`, the README,
//! `docs/security.md` and the rustdoc, each checked over real HTTP (raw HTTP/1.1 over loopback
//! to an actix server with the middleware). Each test names the doc line it checks.

use std::future::Future;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use actix_web::dev::Server;
use actix_web::http::{Method, StatusCode};
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::redis::RedisStore;
use idempotency_actix::store::{CachedStore, IdempotencyStore, MemoryStore};
use idempotency_actix::Idempotency;
use idempotency_e2e::raw_http::{Body, Conn, Request, Response};
use idempotency_e2e::redis_server::RedisServer;
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::{block_on_fresh_thread, TestDb};

const TIMEOUT: Duration = Duration::from_secs(20);

type Counter = web::Data<AtomicU64>;

type Builder<S> = idempotency_actix::IdempotencyBuilder<S>;

/// A running test server and its handler-run counter.
struct Srv {
    server: ThreadServer,
    runs: Arc<AtomicU64>,
}

impl Srv {
    fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }

    /// Waits (up to 10 s) until the handler has started `n` runs: a request sent in the
    /// background holds its key from then on. A fixed pause instead would race the first
    /// request's connect and reserve on a loaded machine (a store's first connection).
    fn until_runs(&self, n: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.runs() < n {
            assert!(
                Instant::now() < deadline,
                "the handler did not start run {n}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn send(&self, request: &Request) -> Response {
        let mut c = Conn::connect(self.server.addr, TIMEOUT).expect("connect");
        c.send(request).expect("response")
    }

    /// Sends `request` twice, each on a new connection: the first and the second response.
    fn send_twice(&self, request: &Request) -> (Response, Response) {
        (self.send(request), self.send(request))
    }

    /// Sends `request` on a new connection from another thread.
    fn send_in_background(&self, request: &Request) -> JoinHandle<io::Result<Response>> {
        send_in_background(self.server.addr, request.clone())
    }
}

/// Sends `request` to `addr` on a new connection from another thread.
fn send_in_background<A>(addr: A, request: Request) -> JoinHandle<io::Result<Response>>
where
    A: ToSocketAddrs + Send + 'static,
{
    std::thread::spawn(move || Conn::connect(addr, TIMEOUT).unwrap().send(&request))
}

/// `HttpServer::new($factory)`, one worker, no signals, on a loopback port: (address, server).
macro_rules! one_worker {
    ($factory:expr) => {{
        let server = HttpServer::new($factory)
            .workers(1)
            .disable_signals()
            .bind(("127.0.0.1", 0))
            .expect("bind");
        (server.addrs()[0], server.run())
    }};
}

/// Starts the server `bind` binds (on its own thread), handing it the handler-run counter.
fn start<F, Fut>(bind: F) -> Srv
where
    F: FnOnce(Counter) -> Fut + Send + 'static,
    Fut: Future<Output = (SocketAddr, Server)>,
{
    let runs = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&runs);
    let server = ThreadServer::start(move || bind(web::Data::from(counter)));
    Srv { server, runs }
}

/// The audit app behind the middleware `configure` sets up over the store `connect` makes
/// (`connect` runs on the server's thread, so a store may connect there).
fn serve<S, F, Fut, C>(connect: F, configure: C) -> Srv
where
    S: IdempotencyStore + Send + Sync + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = S>,
    C: FnOnce(Builder<S>) -> Builder<S> + Send + 'static,
{
    start(move |counter| async move {
        let middleware = configure(Idempotency::builder(connect().await)).build();
        one_worker!(move || {
            App::new()
                .app_data(counter.clone())
                .wrap(middleware.clone())
                .route("/echo", web::route().to(echo))
                .route("/pay/{id}", web::post().to(echo))
                .route("/status/{code}", web::post().to(status))
                .route("/headers", web::post().to(many_headers))
                .route("/no-content", web::post().to(no_content))
                .route("/slow", web::post().to(slow))
                .route("/big/{n}", web::post().to(big))
                .route("/stream", web::post().to(stream))
                .route("/partial", web::post().to(partial))
                .route("/panic", web::post().to(panics))
                .route("/err", web::post().to(fails))
                .route("/bigstream/{n}", web::post().to(big_stream))
                .route("/key", web::post().to(key_echo))
                .route("/slowstream", web::post().to(slow_stream))
        })
    })
}

/// The audit app over a new `MemoryStore`, the middleware configured by `configure`.
fn memory(
    configure: impl FnOnce(Builder<MemoryStore>) -> Builder<MemoryStore> + Send + 'static,
) -> Srv {
    serve(|| async { MemoryStore::new() }, configure)
}

fn defaults() -> Srv {
    memory(|b| b)
}

/// A new PostgreSQL test database.
fn test_db() -> TestDb {
    block_on_fresh_thread(TestDb::new()).expect("test database")
}

/// Connects a PostgreSQL store to `url`.
async fn postgres_store(url: String) -> PostgresStore {
    PostgresStore::connect(&url).await.expect("store")
}

/// The audit app over a PostgreSQL store on `db`, the middleware configured by `configure`.
fn postgres_srv(
    db: &TestDb,
    configure: fn(Builder<PostgresStore>) -> Builder<PostgresStore>,
) -> Srv {
    let url = db.url.clone();
    serve(move || postgres_store(url), configure)
}

/// The audit app over a `CachedStore` over PostgreSQL on `db`, configured by `configure`.
fn cached_postgres_srv(
    db: &TestDb,
    configure: fn(Builder<CachedStore<PostgresStore>>) -> Builder<CachedStore<PostgresStore>>,
) -> Srv {
    let url = db.url.clone();
    serve(
        move || async move { CachedStore::new(postgres_store(url).await) },
        configure,
    )
}

/// The audit app over a Redis store on `redis`, the middleware configured by `configure`.
fn redis_srv(
    redis: &RedisServer,
    configure: fn(Builder<RedisStore>) -> Builder<RedisStore>,
) -> Srv {
    let url = redis.url();
    serve(
        move || async move { RedisStore::connect(&url).await.expect("store") },
        configure,
    )
}

/// `POST target` with `Idempotency-Key: key` and the JSON body `{}`.
fn keyed_post(target: &str, key: impl AsRef<[u8]>) -> Request {
    Request::post(target).key(key).json("{}")
}

/// `POST target` with `Idempotency-Key: key`, an `x-account-id` header per tenant and `body`.
fn tenant_post(target: &str, key: &str, tenants: &[&str], body: &str) -> Request {
    let mut request = Request::post(target).key(key);
    for tenant in tenants {
        request = request.header("x-account-id", tenant);
    }
    request.json(body)
}

fn run_no(n: &Counter) -> u64 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

async fn echo(n: Counter, req: HttpRequest, body: Bytes) -> HttpResponse {
    let run = run_no(&n);
    HttpResponse::Created()
        .content_type("application/json")
        .body(format!(
            r#"{{"run":{run},"method":"{}","path":"{}","body":{:?}}}"#,
            req.method(),
            req.path(),
            String::from_utf8_lossy(&body)
        ))
}

async fn status(n: Counter, code: web::Path<u16>) -> HttpResponse {
    let run = run_no(&n);
    HttpResponse::build(StatusCode::from_u16(code.into_inner()).unwrap())
        .content_type("application/json")
        .body(format!(r#"{{"run":{run}}}"#))
}

/// Every header C11 names as never stored, a denied one, a multi-valued one, and a binary body
/// holding every byte value.
async fn many_headers(n: Counter) -> HttpResponse {
    let run = run_no(&n);
    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend_from_slice(format!("run={run}").as_bytes());
    HttpResponse::Created()
        .content_type("application/octet-stream")
        .append_header(("x-multi", "first"))
        .append_header(("x-multi", "second"))
        .append_header(("x-multi", "third"))
        .append_header(("location", "/pay/42"))
        .append_header(("set-cookie", "session=secret; HttpOnly"))
        .append_header(("set-cookie", "other=secret2"))
        .append_header(("x-internal-token", "tok-secret"))
        .append_header(("keep-alive", "timeout=5"))
        .append_header(("proxy-connection", "keep-alive"))
        .append_header(("te", "trailers"))
        .append_header(("trailer", "x-checksum"))
        .append_header(("upgrade", "h2c"))
        .append_header(("proxy-authenticate", "Basic realm=\"x\""))
        .append_header(("idempotent-replayed", "false"))
        .body(body)
}

async fn no_content(n: Counter) -> HttpResponse {
    run_no(&n);
    HttpResponse::NoContent()
        .append_header(("x-run", "1"))
        .finish()
}

#[derive(serde::Deserialize)]
struct SlowQuery {
    ms: u64,
}

async fn slow(n: Counter, q: web::Query<SlowQuery>, body: Bytes) -> HttpResponse {
    let run = run_no(&n);
    tokio::time::sleep(Duration::from_millis(q.ms)).await;
    HttpResponse::Created()
        .content_type("application/json")
        .body(format!(
            r#"{{"run":{run},"body":{:?}}}"#,
            String::from_utf8_lossy(&body)
        ))
}

async fn big(n: Counter, len: web::Path<usize>) -> HttpResponse {
    let run = run_no(&n);
    let mut body = vec![b'a'; len.into_inner()];
    if let Some(first) = body.first_mut() {
        *first = b'0' + (run % 10) as u8;
    }
    HttpResponse::Ok().body(body)
}

async fn stream(n: Counter) -> HttpResponse {
    let run = run_no(&n);
    let chunks =
        (0..5).map(move |i| Ok::<_, std::io::Error>(Bytes::from(format!("chunk{i}-run{run};"))));
    let stream = futures_util::stream::iter(chunks).then(|chunk| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        chunk
    });
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(stream)
}

async fn partial(n: Counter) -> HttpResponse {
    let run = run_no(&n);
    HttpResponse::Ok()
        .content_type("application/json")
        .body(format!(r#"{{"status":"partial","run":{run}}}"#))
}

async fn panics(n: Counter) -> HttpResponse {
    run_no(&n);
    panic!("handler panic with secret-state-42");
}

async fn fails(n: Counter) -> actix_web::Result<HttpResponse> {
    run_no(&n);
    Err(actix_web::error::ErrorInternalServerError("db exploded"))
}

/// A streamed body of `n` bytes in chunks of 100.
async fn big_stream(n: Counter, len: web::Path<usize>) -> HttpResponse {
    let run = run_no(&n);
    let len = len.into_inner();
    let chunks = (0..len.div_ceil(100)).map(move |i| {
        let size = (len - i * 100).min(100);
        Ok::<_, std::io::Error>(Bytes::from(vec![b'0' + (run % 10) as u8; size]))
    });
    HttpResponse::Ok().streaming(futures_util::stream::iter(chunks))
}

/// A chunked stream of 10 chunks, `ms` apart.
async fn slow_stream(n: Counter, q: web::Query<SlowQuery>) -> HttpResponse {
    let run = run_no(&n);
    let ms = q.ms;
    let stream = futures_util::stream::iter(0..10).then(move |i| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, std::io::Error>(Bytes::from(format!("c{i}-run{run};")))
    });
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(stream)
}

async fn key_echo(n: Counter, key: idempotency_actix::IdempotencyKey) -> HttpResponse {
    run_no(&n);
    HttpResponse::Created().body(key.to_string())
}

/// Headers of a response except those a replay may legitimately change.
fn comparable_headers(r: &Response) -> Vec<(String, Vec<u8>)> {
    r.headers
        .iter()
        .filter(|(n, _)| n != "date" && n != "idempotent-replayed")
        .cloned()
        .collect()
}

fn problem(r: &Response) -> serde_json::Value {
    serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null)
}

fn assert_problem(r: &Response, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", r.describe());
    assert_eq!(r.problem_code().as_deref(), Some(code), "{}", r.describe());
    let p = problem(r);
    for field in ["type", "title", "status", "detail", "code"] {
        assert!(
            p.get(field).is_some(),
            "problem without {field}: {}",
            r.text()
        );
    }
    assert_eq!(p["status"], status, "{}", r.text());
}

// ---------------------------------------------------------------------------------------------
// C6 / C11: what a replay contains and omits.

/// The headers `/headers` sends that are never replayed (C11) besides the hop-by-hop framing.
const NEVER_REPLAYED: [&str; 8] = [
    "set-cookie",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
    "x-internal-token",
];

/// Denies `X-Internal-Token`, the handler's secret header.
fn deny_internal<S>(b: Builder<S>) -> Builder<S> {
    b.deny_headers(["X-Internal-Token"])
}

/// C6 (docs/contract.md:55): "the stored response byte for byte (status, headers, body, binary
/// bodies intact) plus `Idempotent-Replayed: true`"; C11 (docs/contract.md:75) and
/// docs/security.md:88: `Set-Cookie`, `Date`, `Connection`, `Keep-Alive`, `Proxy-Connection`,
/// `Transfer-Encoding`, `TE`, `Trailer`, `Upgrade`, `Proxy-Authenticate` and denied headers are
/// never replayed; `Content-Length` recomputed.
fn check_replay_is_byte_for_byte(srv: &Srv) {
    let (first, replay) =
        srv.send_twice(&Request::post("/headers").key("hdr-1").json(r#"{"a":1}"#));
    eprintln!("first  {:?}", first.headers);
    eprintln!("replay {:?}", replay.headers);
    assert_eq!(srv.runs(), 1, "the handler ran again");
    assert_eq!(first.status, 201);
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(
        replay.header_all("idempotent-replayed"),
        vec![b"true".to_vec()]
    );
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body, "replayed body differs");
    assert_eq!(
        replay.header("content-length"),
        Some(first.body.len().to_string()),
        "Content-Length of the replay"
    );
    assert_eq!(
        replay.header_all("x-multi"),
        vec![b"first".to_vec(), b"second".to_vec(), b"third".to_vec()],
        "multi-valued header not replayed in order"
    );
    assert_eq!(replay.header("location").as_deref(), Some("/pay/42"));
    assert_eq!(
        replay.header("content-type").as_deref(),
        Some("application/octet-stream")
    );
    for never in NEVER_REPLAYED.into_iter().chain(["transfer-encoding"]) {
        assert!(
            replay.header(never).is_none(),
            "{never} was replayed: {:?}",
            replay.header(never)
        );
    }
    // Every header of the first response that is storable comes back, and nothing else.
    let storable: Vec<_> = comparable_headers(&first)
        .into_iter()
        .filter(|(n, _)| !NEVER_REPLAYED.contains(&n.as_str()) && n != "connection")
        .collect();
    let mut got = comparable_headers(&replay);
    got.retain(|(n, _)| n != "connection");
    let mut want = storable;
    got.sort();
    want.sort();
    assert_eq!(
        got, want,
        "replayed headers differ from the storable original ones"
    );
}

#[test]
fn claims_c6_c11_replay_is_byte_for_byte_minus_never_stored_headers_memory() {
    check_replay_is_byte_for_byte(&memory(deny_internal));
}

#[test]
fn claims_c6_c11_replay_is_byte_for_byte_minus_never_stored_headers_postgres() {
    let db = test_db();
    check_replay_is_byte_for_byte(&postgres_srv(&db, deny_internal));
}

#[test]
fn claims_c6_c11_replay_is_byte_for_byte_minus_never_stored_headers_redis() {
    let redis = RedisServer::start();
    check_replay_is_byte_for_byte(&redis_srv(&redis, deny_internal));
}

/// C6 for a 204: the replay is a 204 with no body and the handler's headers.
#[test]
fn claims_c6_a_204_is_replayed_as_a_204_without_body() {
    let srv = defaults();
    let (first, replay) = srv.send_twice(&keyed_post("/no-content", "nc-1"));
    eprintln!("first {:?} / replay {:?}", first.headers, replay.headers);
    assert_eq!(srv.runs(), 1);
    assert_eq!(first.status, 204);
    assert_eq!(replay.status, 204);
    assert!(replay.is_replay());
    assert!(replay.body.is_empty());
    assert_eq!(replay.header("x-run").as_deref(), Some("1"));
    assert_eq!(
        replay.header("content-length"),
        first.header("content-length")
    );
}

/// C24 (docs/contract.md:157) and README ("streamed response ... stored when it ends within
/// max_response_bytes"): a streamed body is replayed whole, with a Content-Length.
#[test]
fn claims_c24_a_streamed_response_is_replayed_whole() {
    let srv = defaults();
    let (first, replay) = srv.send_twice(&keyed_post("/stream", "st-1"));
    assert_eq!(
        srv.runs(),
        1,
        "the streamed handler ran again: {}",
        replay.describe()
    );
    assert!(replay.is_replay());
    assert_eq!(first.text(), replay.text());
    assert_eq!(
        replay.header("content-length"),
        Some(first.body.len().to_string())
    );
    assert_eq!(replay.header("content-type").as_deref(), Some("text/plain"));
}

// ---------------------------------------------------------------------------------------------
// C1: which methods.

/// C1 (docs/contract.md:19): "POST and PATCH, unless configured otherwise. Every other method
/// passes through as if the middleware were not there."
#[test]
fn claims_c1_default_methods_post_patch_covered_others_pass_through() {
    let srv = defaults();
    // `method` on /echo twice with one key: both responses and how many runs they made.
    let twice = |method: &str| {
        let before = srv.runs();
        let request = Request::new(method, "/echo")
            .key(format!("m-{method}"))
            .json("{}");
        let (a, b) = srv.send_twice(&request);
        (a, b, srv.runs() - before)
    };
    for method in ["PUT", "DELETE", "GET", "OPTIONS"] {
        let (a, b, ran) = twice(method);
        assert_eq!(ran, 2, "{method} was not passed through");
        assert!(!a.is_replay() && !b.is_replay(), "{method} replayed");
    }
    // A malformed key on an uncovered method is not the middleware's business either.
    let get = srv.send(&Request::get("/echo").key("bad key\u{1}"));
    assert!(
        get.status != 400 || get.problem_code().is_none(),
        "{}",
        get.describe()
    );
    for method in ["POST", "PATCH"] {
        let (a, b, ran) = twice(method);
        assert_eq!(ran, 1, "{method} ran twice");
        assert!(
            !a.is_replay() && b.is_replay(),
            "{method}: {}",
            b.describe()
        );
    }
}

/// C1 / config.rs:284: `methods` replaces the covered set.
#[test]
fn claims_c1_configured_methods_replace_the_default() {
    let srv = memory(|b| b.methods([Method::PUT, Method::DELETE]));
    let (_, again) = srv.send_twice(&Request::new("PUT", "/echo").key("cm-1").json("{}"));
    assert_eq!(srv.runs(), 1);
    assert!(again.is_replay());
    let (_, again) = srv.send_twice(&keyed_post("/echo", "cm-2"));
    assert_eq!(
        srv.runs(),
        3,
        "POST should pass through once not configured"
    );
    assert!(!again.is_replay());
    // DELETE without a body is covered too.
    let (a, b) = srv.send_twice(&Request::new("DELETE", "/echo").key("cm-3"));
    assert_eq!(srv.runs(), 4, "{} / {}", a.describe(), b.describe());
    assert!(b.is_replay());
}

/// README table: "same key, other method or other route: another record: it runs".
#[test]
fn claims_same_key_other_method_or_route_is_another_record() {
    let srv = defaults();
    let a = srv.send(&keyed_post("/pay/1", "shared"));
    let b = srv.send(&keyed_post("/pay/2", "shared"));
    let c = srv.send(&Request::new("PATCH", "/echo").key("shared").json("{}"));
    let d = srv.send(&keyed_post("/echo", "shared"));
    for r in [&a, &b, &c, &d] {
        assert_eq!(r.status, 201, "{}", r.describe());
        assert!(!r.is_replay());
    }
    assert_eq!(srv.runs(), 4);
}

// ---------------------------------------------------------------------------------------------
// C2: the key.

/// C2 (docs/contract.md:22-25), security.md:197 ("255 bytes after unquoting, printable ASCII
/// only, one header only"), problem.rs:29-34.
#[test]
fn claims_c2_key_limits_and_spellings() {
    let srv = defaults();
    let k255 = "k".repeat(255);
    let ok = srv.send(&keyed_post("/echo", &k255));
    assert_eq!(ok.status, 201, "255-byte key: {}", ok.describe());
    let long = srv.send(&keyed_post("/echo", "k".repeat(256)));
    assert_problem(&long, 400, "KEY_TOO_LONG");
    // 255 bytes after unquoting: 257 bytes on the wire as an sf-string.
    let quoted = format!("\"{}\"", "q".repeat(255));
    let ok = srv.send(&keyed_post("/echo", &quoted));
    assert_eq!(ok.status, 201, "quoted 255-byte key: {}", ok.describe());
    let quoted_long = format!("\"{}\"", "q".repeat(256));
    let long = srv.send(&keyed_post("/echo", &quoted_long));
    assert_problem(&long, 400, "KEY_TOO_LONG");
    // Escapes: 255 unescaped bytes from 510 escaped ones.
    let escaped = format!("\"{}\"", "\\\\".repeat(255));
    let ok = srv.send(&keyed_post("/echo", &escaped));
    assert_eq!(ok.status, 201, "escaped 255-byte key: {}", ok.describe());
    // The two spellings of one key are one key.
    let runs = srv.runs();
    let bare = srv.send(&keyed_post("/echo", "spell-1"));
    let sf = srv.send(&keyed_post("/echo", "\"spell-1\""));
    assert_eq!(bare.status, 201);
    assert!(
        sf.is_replay(),
        "\"spell-1\" is not the key spell-1: {}",
        sf.describe()
    );
    assert_eq!(srv.runs(), runs + 1);
    // Invalid: empty, "", sent twice, a space in a bare token, non-ASCII, bad escape.
    let runs = srv.runs();
    for (what, request) in [
        ("empty", keyed_post("/echo", "")),
        ("empty sf-string", keyed_post("/echo", "\"\"")),
        ("twice", Request::post("/echo").key("a").key("a").json("{}")),
        ("space", keyed_post("/echo", "a b")),
        ("non-ascii", keyed_post("/echo", "caf\u{e9}")),
        ("bad escape", keyed_post("/echo", "\"a\\n\"")),
        ("unterminated", keyed_post("/echo", "\"abc")),
        ("parameter", keyed_post("/echo", "\"k\";a=1")),
    ] {
        let r = srv.send(&request);
        eprintln!("{what}: {}", r.describe());
        assert_problem(&r, 400, "INVALID_KEY");
    }
    assert_eq!(srv.runs(), runs, "an invalid key ran the handler");
}

/// config.rs:275 `header_name`; config.rs:290 `required`; C2 "gets 400 MISSING_KEY when keys
/// are required"; C1: an uncovered method without a key still passes.
#[test]
fn claims_c2_custom_header_name_and_required() {
    let srv = memory(|b| b.header_name("X-Request-Key").required(true));
    let missing = srv.send(&Request::post("/echo").json("{}"));
    assert_problem(&missing, 400, "MISSING_KEY");
    // The default header name is no longer the key.
    let other = srv.send(&keyed_post("/echo", "k"));
    assert_problem(&other, 400, "MISSING_KEY");
    let request = Request::post("/echo")
        .header("x-request-key", "ck-1")
        .json("{}");
    let (_, replay) = srv.send_twice(&request);
    assert!(replay.is_replay(), "{}", replay.describe());
    let get = srv.send(&Request::get("/echo"));
    assert_eq!(get.status, 201, "GET without a key: {}", get.describe());
    assert_eq!(srv.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// C3 / C23: tenants.

/// C3 (docs/contract.md:30): "No tenant can ever read, replay or block another tenant's record".
/// Two tenants, one key, one path, same and different bodies, also while the first runs.
#[test]
fn claims_c3_tenants_never_share_a_record() {
    let srv = memory(|b| b.tenant_header("X-Account-Id"));
    let a = srv.send(&tenant_post("/echo", "t-1", &["acct_a"], r#"{"amount":1}"#));
    let b = srv.send(&tenant_post("/echo", "t-1", &["acct_b"], r#"{"amount":1}"#));
    let c = srv.send(&tenant_post(
        "/echo",
        "t-1",
        &["acct_c"],
        r#"{"amount":999}"#,
    ));
    for r in [&a, &b, &c] {
        assert_eq!(r.status, 201, "{}", r.describe());
        assert!(!r.is_replay(), "cross-tenant replay: {}", r.describe());
    }
    assert_eq!(srv.runs(), 3);
    // In flight: tenant A's slow request does not block tenant B.
    let slow = srv.send_in_background(&tenant_post("/slow?ms=1500", "t-2", &["acct_a"], "{}"));
    std::thread::sleep(Duration::from_millis(300));
    let other = srv.send(&tenant_post("/slow?ms=10", "t-2", &["acct_b"], "{}"));
    assert_eq!(
        other.status,
        201,
        "tenant B blocked by A: {}",
        other.describe()
    );
    assert_eq!(slow.join().unwrap().unwrap().status, 201);
}

/// C23 (docs/contract.md:150): a configured tenant source without a tenant (missing, empty, or
/// the header sent twice) is 400 MISSING_TENANT and nothing runs; keyless requests pass.
#[test]
fn claims_c23_no_tenant_no_run() {
    let srv = memory(|b| b.tenant_header("X-Account-Id"));
    for (what, tenants) in [
        ("missing", &[][..]),
        ("empty", &[""]),
        ("twice", &["acct_a", "acct_b"]),
        ("twice, same value", &["acct_a", "acct_a"]),
    ] {
        let r = srv.send(&tenant_post("/echo", "nt-1", tenants, "{}"));
        eprintln!("{what}: {}", r.describe());
        assert_problem(&r, 400, "MISSING_TENANT");
    }
    assert_eq!(srv.runs(), 0);
    let keyless = srv.send(&Request::post("/echo").json("{}"));
    assert_eq!(keyless.status, 201);
    assert_eq!(srv.runs(), 1);
}

// ---------------------------------------------------------------------------------------------
// C4 / C7: fingerprint and mismatch.

/// C4: no header is part of the fingerprint but whether `Content-Type` names JSON: two JSON
/// media types are one request, JSON and `text/plain` (or none) are two, and the 422 says the
/// content type may be what differs.
#[test]
fn claims_c4_only_whether_the_body_is_json_counts_among_the_headers() {
    let srv = defaults();
    let body = r#"{"amount":1000,"currency":"EUR"}"#;
    let first = srv.send(&Request::post("/echo").key("mt-1").json(body));
    assert_eq!(first.status, 201);
    let mut outcomes = Vec::new();
    // Another JSON media type is the same request; a non-JSON one (or none) is compared as
    // bytes, so it is another request (C4, corrected 2026-12-05 after this test found the rule
    // said no header counted).
    for (content_type, replayed) in [
        (Some("application/merge-patch+json"), true),
        (Some("text/plain"), false),
        (Some("application/x-www-form-urlencoded"), false),
        (None, false),
    ] {
        let mut request = Request::post("/echo").key("mt-1");
        if let Some(ct) = content_type {
            request = request.header("Content-Type", ct);
        }
        let r = srv.send(&request.body(Body::Sized(body.as_bytes().to_vec())));
        let ok = if replayed {
            r.status == 201 && r.is_replay()
        } else {
            r.status == 422
                && r.problem_code().as_deref() == Some("FINGERPRINT_MISMATCH")
                && r.text().contains("content type")
        };
        outcomes.push((ok, format!("{content_type:?}: {}", r.describe())));
    }
    assert_eq!(srv.runs(), 1);
    assert!(
        outcomes.iter().all(|(ok, _)| *ok),
        "C4's media-type rule does not hold: {outcomes:#?}"
    );
}

/// C4: numbers kept exactly as written, query and path as sent: each difference is 422, never
/// a replay of another request's response (README: "other body or query (or another spelling
/// of the path) -> 422").
#[test]
fn claims_c4_c7_differences_that_must_be_422() {
    let srv = defaults();
    let cases: [(&str, &str, &str, &str); 5] = [
        ("/echo", r#"{"amount":1}"#, "/echo", r#"{"amount":1.0}"#),
        ("/echo", r#"{"amount":1000}"#, "/echo", r#"{"amount":1e3}"#),
        ("/echo?a=1", "{}", "/echo?a=2", "{}"),
        ("/echo?a=1&b=2", "{}", "/echo?b=2&a=1", "{}"),
        ("/pay/7", "{}", "/pay/7/", "{}"),
    ];
    for (i, (p1, b1, p2, b2)) in cases.iter().enumerate() {
        let key = format!("fp-{i}");
        let first = srv.send(&Request::post(p1).key(&key).json(b1));
        let runs = srv.runs();
        let second = srv.send(&Request::post(p2).key(&key).json(b2));
        eprintln!(
            "{p1} {b1} / {p2} {b2}: {} then {}",
            first.describe(),
            second.describe()
        );
        assert_eq!(srv.runs(), runs, "case {i}: ran again");
        assert_problem(&second, 422, "FINGERPRINT_MISMATCH");
        // C7: "the store is not changed": the original still replays.
        let again = srv.send(&Request::post(p1).key(&key).json(b1));
        assert!(again.is_replay(), "case {i}: {}", again.describe());
        assert_eq!(again.body, first.body);
    }
    // JSON key order and whitespace do not matter.
    srv.send(
        &Request::post("/echo")
            .key("fp-order")
            .json(r#"{"a":1,"b":[1,2]}"#),
    );
    let r = srv.send(
        &Request::post("/echo")
            .key("fp-order")
            .json("{ \"b\" : [1, 2],\n \"a\":1 }"),
    );
    assert!(r.is_replay(), "{}", r.describe());
}

/// C7 (docs/contract.md:59): 422 "whether the first request completed or still runs"; C8: the
/// same request while it runs gets 409 CONFLICT with `Retry-After` (config.rs:531: the
/// configured value in whole seconds); problem.rs:16 `type` is `{base}{slug}`.
#[test]
fn claims_c7_c8_in_flight_mismatch_is_422_duplicate_is_409_with_retry_after() {
    let srv = memory(|b| {
        b.retry_after(Duration::from_secs(7))
            .problem_type_base("https://api.example.com/problems/")
    });
    let request = Request::post("/slow?ms=1500")
        .key("if-1")
        .json(r#"{"n":1}"#);
    let first = srv.send_in_background(&request);
    std::thread::sleep(Duration::from_millis(400));
    let dup = srv.send(&request);
    let other = srv.send(
        &Request::post("/slow?ms=1500")
            .key("if-1")
            .json(r#"{"n":2}"#),
    );
    let first = first.join().unwrap().unwrap();
    eprintln!(
        "dup {} / other {} / first {}",
        dup.describe(),
        other.describe(),
        first.describe()
    );
    assert_problem(&dup, 409, "CONFLICT");
    assert_eq!(dup.header("retry-after").as_deref(), Some("7"));
    assert_eq!(
        problem(&dup)["type"],
        "https://api.example.com/problems/conflict"
    );
    assert_problem(&other, 422, "FINGERPRINT_MISMATCH");
    assert_eq!(
        problem(&other)["type"],
        "https://api.example.com/problems/fingerprint-mismatch"
    );
    assert_eq!(srv.runs(), 1);
    assert_eq!(first.status, 201);
    let replay = srv.send(&request);
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
}

/// C8 / config.rs:488: wait mode replays the first response to a waiting duplicate; a wait
/// shorter than the handler ends in 409 about when the wait ends.
#[test]
fn claims_c8_wait_for_in_flight_replays_and_times_out() {
    let srv = memory(|b| b.wait_for_in_flight(Duration::from_millis(700)));
    let request = keyed_post("/slow?ms=300", "w-1");
    let first = srv.send_in_background(&request);
    srv.until_runs(1);
    let waited = srv.send(&request);
    let first = first.join().unwrap().unwrap();
    assert_eq!(srv.runs(), 1);
    assert!(waited.is_replay(), "{}", waited.describe());
    assert_eq!(waited.body, first.body);

    let request = keyed_post("/slow?ms=3000", "w-2");
    let first = srv.send_in_background(&request);
    srv.until_runs(2);
    let started = Instant::now();
    let gave_up = srv.send(&request);
    let took = started.elapsed();
    eprintln!("gave up after {took:?}: {}", gave_up.describe());
    assert_problem(&gave_up, 409, "CONFLICT");
    assert_eq!(gave_up.header("retry-after").as_deref(), Some("1"));
    assert!(
        took >= Duration::from_millis(650) && took < Duration::from_millis(1500),
        "waited {took:?} for a 700 ms wait"
    );
    assert_eq!(first.join().unwrap().unwrap().status, 201);
    assert_eq!(srv.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// C10: what is stored.

/// C10 (docs/contract.md:84): "2xx responses, by default. Anything else releases the key".
#[test]
fn claims_c10_only_2xx_is_stored_by_default() {
    let srv = defaults();
    // `/status/{code}` twice with one key: both responses and how many runs they made.
    let twice = |code: u16| {
        let runs = srv.runs();
        let (a, b) = srv.send_twice(&keyed_post(&format!("/status/{code}"), format!("s-{code}")));
        (a, b, srv.runs() - runs)
    };
    for code in [200u16, 201, 202, 299] {
        let (_, again, ran) = twice(code);
        assert_eq!(ran, 1, "{code} was not stored");
        assert_eq!(again.status, code);
        assert!(again.is_replay());
    }
    for code in [301u16, 302, 400, 404, 409, 422, 429, 500, 502, 503] {
        let (a, b, ran) = twice(code);
        assert_eq!(a.status, code);
        assert_eq!(ran, 2, "{code} was stored: {}", b.describe());
        assert!(!b.is_replay(), "{code} replayed");
    }
}

/// config.rs:445 `store_statuses` and config.rs:462 `store_if`: "both it and the status filter
/// must agree"; a refused response releases the key.
#[test]
fn claims_c10_store_if_and_store_statuses() {
    let srv = memory(|b| {
        b.store_statuses(|s| s.is_success() || s == StatusCode::CONFLICT)
            .store_if(|response| !String::from_utf8_lossy(response.body).contains("\"partial\""))
    });
    let (_, again) = srv.send_twice(&keyed_post("/partial", "si-1"));
    assert_eq!(srv.runs(), 2, "a store_if refusal was stored");
    assert!(!again.is_replay());
    let (_, again) = srv.send_twice(&keyed_post("/status/409", "si-2"));
    assert_eq!(srv.runs(), 3, "store_statuses(409) not stored");
    assert!(again.is_replay());
    assert_eq!(again.status, 409);
}

/// `target` (1001 bytes, one over a 1000 limit) twice with `key`: both run, neither is stored.
fn check_one_byte_over_the_limit_is_not_stored(srv: &Srv, target: &str, key: &str) {
    let (a, b) = srv.send_twice(&keyed_post(target, key));
    assert_eq!(a.body.len(), 1001, "{target}");
    assert_eq!(b.body.len(), 1001, "{target}");
    assert!(!b.is_replay(), "{target}");
    assert_eq!(srv.runs(), 3, "{target}: an over-limit response was stored");
}

/// config.rs:383 "Largest response that is stored; larger ones are passed through unbuffered
/// and the key is released": exactly the limit is stored, one byte more is not.
#[test]
fn claims_c10_max_response_bytes_boundary() {
    let srv = memory(|b| b.max_response_bytes(1000));
    let (a, b) = srv.send_twice(&keyed_post("/big/1000", "rb-1"));
    assert_eq!(a.body.len(), 1000);
    assert!(
        b.is_replay(),
        "a response of exactly the limit was not stored"
    );
    assert_eq!(srv.runs(), 1);
    check_one_byte_over_the_limit_is_not_stored(&srv, "/big/1001", "rb-2");
}

// ---------------------------------------------------------------------------------------------
// C12 / C14: retention and the body limit.

/// C12 (docs/contract.md:78-81): a record expires after its TTL (at least 1 s; a shorter one
/// refused when built); an expired record is absent.
#[test]
fn claims_c12_ttl_minimum_and_expiry() {
    assert!(
        Idempotency::builder(MemoryStore::new())
            .ttl(Duration::from_millis(999))
            .try_build()
            .is_err(),
        "a TTL under 1 s was accepted"
    );
    let srv = memory(|b| b.ttl(Duration::from_secs(1)));
    let request = keyed_post("/echo", "ttl-1");
    let (_, replay) = srv.send_twice(&request);
    assert!(replay.is_replay());
    std::thread::sleep(Duration::from_millis(1300));
    let after = srv.send(&request);
    assert!(
        !after.is_replay(),
        "replayed after its TTL: {}",
        after.describe()
    );
    assert_eq!(srv.runs(), 2);
}

/// `POST /echo` with `key` and `body` as `application/octet-stream`.
fn octet_post(key: &str, body: Body) -> Request {
    Request::post("/echo")
        .key(key)
        .header("content-type", "application/octet-stream")
        .body(body)
}

/// C14 (docs/contract.md:104): 413 PAYLOAD_TOO_LARGE over the limit, from Content-Length
/// first and from the bytes read when chunked; exactly the limit is accepted; nothing runs.
#[test]
fn claims_c14_body_limit_boundary() {
    let srv = memory(|b| b.max_body_bytes(1024));
    let at = srv.send(&octet_post("bl-1", Body::Sized(vec![b'x'; 1024])));
    assert_eq!(at.status, 201, "{}", at.describe());
    let over = srv.send(&octet_post("bl-2", Body::Sized(vec![b'x'; 1025])));
    assert_problem(&over, 413, "PAYLOAD_TOO_LARGE");
    let chunked = srv.send(&octet_post("bl-3", Body::Chunked(vec![b'x'; 1025], 100)));
    assert_problem(&chunked, 413, "PAYLOAD_TOO_LARGE");
    let chunked_at = srv.send(&octet_post("bl-4", Body::Chunked(vec![b'x'; 1024], 100)));
    assert_eq!(chunked_at.status, 201, "{}", chunked_at.describe());
    assert_eq!(srv.runs(), 2);
    // The refused keys are not held: the same key with a body within the limit runs.
    let retry = srv.send(&keyed_post("/echo", "bl-2"));
    assert_eq!(retry.status, 201, "{}", retry.describe());
    assert!(!retry.is_replay());
}

// ---------------------------------------------------------------------------------------------
// C15 / C22: store down or full.

/// C15 (docs/contract.md:109): the store cannot answer: 503 STORAGE_UNAVAILABLE with
/// Retry-After (the configured one), the handler not run; `fail_open` runs it.
#[test]
fn claims_c15_store_down_is_503_with_retry_after_and_fail_open_runs() {
    let port = idempotency_e2e::raw_http::free_port();
    for fail_open in [false, true] {
        let url = format!("postgres://postgres@127.0.0.1:{port}/nothing");
        let srv = serve(
            move || async move {
                PostgresStore::builder(url)
                    .connection_timeout(Duration::from_secs(1))
                    .build()
                    .await
                    .expect("a lazy pool builds without a server")
            },
            move |b| b.retry_after(Duration::from_secs(5)).fail_open(fail_open),
        );
        let started = Instant::now();
        let r = srv.send(&keyed_post("/echo", "down-1"));
        eprintln!(
            "fail_open={fail_open}: {} after {:?}",
            r.describe(),
            started.elapsed()
        );
        if fail_open {
            assert_eq!(r.status, 201, "{}", r.describe());
            assert_eq!(srv.runs(), 1);
        } else {
            assert_problem(&r, 503, "STORAGE_UNAVAILABLE");
            assert_eq!(r.header("retry-after").as_deref(), Some("5"));
            assert_eq!(srv.runs(), 0);
            assert!(!r.text().contains("postgres://"), "{}", r.text());
        }
        // Keyless requests are not the store's business.
        let keyless = srv.send(&Request::post("/echo").json("{}"));
        assert_eq!(keyless.status, 201);
    }
}

/// C22 (docs/contract.md:138) and README: "memory store full of live records: the same 503,
/// handler not run; no live record is ever dropped".
#[test]
fn claims_c22_full_memory_store_answers_503_and_keeps_records() {
    let srv = serve(
        || async { MemoryStore::builder().max_entries(2).build() },
        |b| b,
    );
    let a = keyed_post("/echo", "full-a");
    let b = keyed_post("/echo", "full-b");
    srv.send(&a);
    srv.send(&b);
    let c = srv.send(&keyed_post("/echo", "full-c"));
    assert_problem(&c, 503, "STORAGE_UNAVAILABLE");
    assert!(c.header("retry-after").is_some());
    assert_eq!(srv.runs(), 2);
    assert!(srv.send(&a).is_replay());
    assert!(srv.send(&b).is_replay());
    assert_eq!(srv.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// C13: problem documents.

/// C13 (docs/contract.md:90): every error the middleware makes is problem+json with type,
/// title, status, detail and code, and `type` is the default base + slug (problem.rs:16).
#[test]
fn claims_c13_default_problem_type_is_base_plus_slug() {
    let srv = defaults();
    let r = srv.send(&keyed_post("/echo", "a b"));
    assert_problem(&r, 400, "INVALID_KEY");
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/problem+json")
    );
    assert_eq!(
        problem(&r)["type"],
        "https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#invalid-key"
    );
}

// ---------------------------------------------------------------------------------------------
// C9 / C13: panics, leases, fencing.

/// C13 (docs/contract.md:96-98): "a handler that panicked ... gets an empty 500, so nothing of
/// its state leaks"; middleware/mod.rs: its reservation stays until the lease ends, so a retry
/// inside the lease gets 409 and never a second run; after the lease it takes over.
#[test]
fn claims_c13_panic_is_an_empty_500_and_keeps_the_key_for_its_lease() {
    // The lease is long because the panic hook runs inside it: with RUST_BACKTRACE set (as CI
    // sets it), symbolizing the backtrace of this large test binary on a loaded machine took
    // longer than a 900 ms lease once, and the retry then rightly took the key over.
    const LEASE: Duration = Duration::from_secs(4);
    let srv = memory(|b| b.lock_timeout(LEASE));
    let request = keyed_post("/panic", "pn-1");
    let sent = Instant::now();
    let first = srv.send(&request);
    eprintln!("panic: {} {:?}", first.describe(), first.headers);
    assert_eq!(first.status, 500);
    assert!(
        first.body.is_empty(),
        "panic 500 has a body: {}",
        first.text()
    );
    let retry = srv.send(&request);
    eprintln!("retry in the lease: {}", retry.describe());
    assert!(
        sent.elapsed() < LEASE,
        "the machine was too slow for this test: the retry came after the lease"
    );
    assert_problem(&retry, 409, "CONFLICT");
    assert_eq!(srv.runs(), 1, "ran again inside the lease");
    std::thread::sleep(LEASE.saturating_sub(sent.elapsed()) + Duration::from_millis(300));
    let after = srv.send(&request);
    assert_eq!(after.status, 500, "{}", after.describe());
    assert_eq!(srv.runs(), 2, "the key was not taken over after the lease");
}

/// C10 / README ("handler answers non-2xx: not stored; the key is released"): a handler that
/// returns `Err` releases its key at once, and the error text is actix's, not stored.
#[test]
fn claims_c10_a_handler_error_releases_the_key() {
    let srv = defaults();
    let (a, b) = srv.send_twice(&keyed_post("/err", "er-1"));
    eprintln!("{} / {}", a.describe(), b.describe());
    assert_eq!(a.status, 500);
    assert_eq!(b.status, 500);
    assert!(!b.is_replay());
    assert_eq!(srv.runs(), 2, "an Err response held or replayed the key");
}

/// Sends `request` in the background and, once its handler runs, again `times` times `every`
/// apart: (first, retries).
fn retry_while_running(
    srv: &Srv,
    request: &Request,
    times: usize,
    every: Duration,
) -> (Response, Vec<String>) {
    let runs = srv.runs();
    let first = srv.send_in_background(request);
    srv.until_runs(runs + 1);
    let mut seen = Vec::new();
    for _ in 0..times {
        std::thread::sleep(every);
        seen.push(srv.send(request).describe());
    }
    let first = first.join().unwrap().unwrap();
    eprintln!("{seen:#?}");
    (first, seen)
}

/// C9 (docs/contract.md:66-72): while the handler runs its lease is renewed (every third), so
/// retries get 409 well past `lock_timeout`, never a second run.
#[test]
fn claims_c9_a_slow_handler_keeps_its_key_past_the_lease() {
    let srv = memory(|b| b.lock_timeout(Duration::from_millis(300)));
    // 5 retries 330 ms apart end at about 1.7 s: the handler's 3 s leave room for a slow one.
    let request = keyed_post("/slow?ms=3000", "ls-1");
    let (first, seen) = retry_while_running(&srv, &request, 5, Duration::from_millis(330));
    assert_eq!(first.status, 201);
    assert_eq!(srv.runs(), 1, "taken over while running: {seen:#?}");
    assert!(seen.iter().all(|s| s.starts_with("409")), "{seen:#?}");
}

/// A 300 ms lease that is never renewed.
fn no_renewal<S>(b: Builder<S>) -> Builder<S> {
    b.lock_timeout(Duration::from_millis(300))
        .renew_lease_up_to(Duration::ZERO)
}

/// C9: "When the lease has run out ... a retry with the same fingerprint may take the key over;
/// from then on the old holder can neither complete, renew nor release it: only the current
/// token writes." With renewal off (`renew_lease_up_to(ZERO)`, config.rs:361), a handler
/// longer than its lease is taken over; the record then holds the SECOND run's response, and
/// the first holder's late completion must not overwrite it.
fn check_takeover_is_fenced(srv: &Srv) {
    let request = keyed_post("/slow?ms=1500", "fence-1");
    let first = srv.send_in_background(&request);
    srv.until_runs(1);
    std::thread::sleep(Duration::from_millis(500));
    // The first still runs (for about 1 s more); its 300 ms lease is long gone.
    let second = srv.send(&request);
    let first = first.join().unwrap().unwrap();
    eprintln!("first {} / second {}", first.describe(), second.describe());
    assert_eq!(srv.runs(), 2, "the documented takeover did not happen");
    std::thread::sleep(Duration::from_millis(200));
    let replay = srv.send(&request);
    eprintln!("replay {}", replay.describe());
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(
        replay.json()["run"],
        2,
        "the replay is the overtaken holder's response, not the current token's"
    );
    assert_eq!(srv.runs(), 2);
}

#[test]
fn claims_c9_takeover_is_fenced_memory() {
    check_takeover_is_fenced(&memory(no_renewal));
}

#[test]
fn claims_c9_takeover_is_fenced_postgres() {
    let db = test_db();
    check_takeover_is_fenced(&postgres_srv(&db, no_renewal));
}

/// config.rs:341-352: "Renewal ends `limit` after the reservation (the last lease ends then),
/// so a handler that hangs frees its key too". Before `limit` retries get 409; after
/// `limit` + one lease a retry takes over.
#[test]
fn claims_c9_renewal_stops_at_renew_lease_up_to() {
    // The limit is far from the requests on either side of it, so a slow machine cannot move
    // one across: `inside` comes about 900 ms after the handler started (three leases), `after`
    // at 2.3 s or later (the limit plus a lease), both well before the handler's 5 s end.
    let srv = memory(|b| {
        b.lock_timeout(Duration::from_millis(300))
            .renew_lease_up_to(Duration::from_millis(2000))
    });
    let request = keyed_post("/slow?ms=5000", "rl-1");
    let first = srv.send_in_background(&request);
    srv.until_runs(1);
    let started = Instant::now();
    // Three leases in: only renewals that go on hold the key now.
    std::thread::sleep(Duration::from_millis(900));
    // Another query is another fingerprint: 422 while the first still runs (C7), not run.
    let other = srv.send(&keyed_post("/slow?ms=10", "rl-1"));
    assert_problem(&other, 422, "FINGERPRINT_MISMATCH");
    let inside = srv.send(&request);
    eprintln!("inside: {}", inside.describe());
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "the machine was too slow for this test: {:?}",
        started.elapsed()
    );
    assert_problem(&inside, 409, "CONFLICT");
    std::thread::sleep(Duration::from_millis(2300).saturating_sub(started.elapsed()));
    let started = Instant::now();
    let after = srv.send(&request);
    eprintln!(
        "after the limit: {} in {:?}",
        after.describe(),
        started.elapsed()
    );
    let _ = first.join();
    assert_eq!(after.status, 201, "{}", after.describe());
    assert_eq!(srv.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// C8 in wait mode.

/// config.rs:488: a waiting duplicate of a request whose key is released (a response not
/// stored) runs itself; a waiting request with another body gets 422 at once, not after the wait.
#[test]
fn claims_c8_wait_mode_runs_after_a_release_and_refuses_mismatch_at_once() {
    let srv = memory(|b| b.wait_for_in_flight(Duration::from_secs(5)));
    let first = srv.send_in_background(
        &Request::post("/slow?ms=1500")
            .key("wr-1")
            .json(r#"{"a":1}"#),
    );
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let other = srv.send(
        &Request::post("/slow?ms=1500")
            .key("wr-1")
            .json(r#"{"a":2}"#),
    );
    let took = started.elapsed();
    eprintln!(
        "other body while waiting: {} after {took:?}",
        other.describe()
    );
    assert_problem(&other, 422, "FINGERPRINT_MISMATCH");
    assert!(took < Duration::from_millis(700), "422 came after {took:?}");
    let _ = first.join();

    // A first request whose response is released (its 201 is not stored: only 202 is, here),
    // then a waiting duplicate runs.
    let srv = memory(|b| {
        b.wait_for_in_flight(Duration::from_secs(5))
            .store_statuses(|s| s == StatusCode::ACCEPTED)
    });
    let request = keyed_post("/slow?ms=800", "wr-2");
    let first = srv.send_in_background(&request);
    std::thread::sleep(Duration::from_millis(200));
    let waiter = srv.send(&request);
    let first = first.join().unwrap().unwrap();
    eprintln!("first {} / waiter {}", first.describe(), waiter.describe());
    assert_eq!(first.status, 201);
    assert_eq!(waiter.status, 201);
    assert!(!waiter.is_replay(), "a released response was replayed");
    assert_eq!(srv.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// C24: streamed responses over the limit.

/// C24 / config.rs:383: a streamed response over `max_response_bytes` is forwarded whole and
/// not stored (released); exactly the limit is stored.
#[test]
fn claims_c24_streamed_response_limit_boundary() {
    let srv = memory(|b| b.max_response_bytes(1000));
    let (a, b) = srv.send_twice(&keyed_post("/bigstream/1000", "bs-1"));
    assert_eq!(a.body.len(), 1000);
    assert!(b.is_replay(), "{}", b.describe());
    assert_eq!(b.body, a.body);
    check_one_byte_over_the_limit_is_not_stored(&srv, "/bigstream/1001", "bs-2");
}

// ---------------------------------------------------------------------------------------------
// C2 / C17: configured key length and the extractor.

/// config.rs:369 `max_key_len`; C17: the handler reads the key, unquoted.
#[test]
fn claims_c2_c17_max_key_len_and_the_extractor_sees_the_unquoted_key() {
    let srv = memory(|b| b.max_key_len(10));
    let ok = srv.send(&keyed_post("/key", "0123456789"));
    assert_eq!(ok.status, 201);
    assert_eq!(ok.text(), "0123456789");
    let long = srv.send(&keyed_post("/key", "0123456789a"));
    assert_problem(&long, 400, "KEY_TOO_LONG");
    let quoted = srv.send(&keyed_post("/key", "\"a\\\"b\""));
    assert_eq!(quoted.text(), "a\"b", "{}", quoted.describe());
}

// ---------------------------------------------------------------------------------------------
// C12 on every store, and CachedStore.

/// A record replays until its 1 s TTL is over, then runs again (`what` names the store).
fn check_ttl_expiry(srv: &Srv, what: &str) {
    let request = keyed_post("/echo", format!("ttl-{}", what.replace(' ', "-")));
    let first = srv.send(&request);
    assert_eq!(first.status, 201, "{what}: {}", first.describe());
    assert!(!first.is_replay(), "{what}: {}", first.describe());
    for _ in 0..3 {
        let replay = srv.send(&request);
        assert!(replay.is_replay(), "{what}: {}", replay.describe());
    }
    std::thread::sleep(Duration::from_millis(1400));
    let after = srv.send(&request);
    eprintln!("{what}: after the TTL {}", after.describe());
    assert!(
        !after.is_replay(),
        "{what}: replayed after its 1 s TTL: {}",
        after.describe()
    );
    assert_eq!(srv.runs(), 2, "{what}");
}

/// A TTL of one second.
fn one_second_ttl<S>(b: Builder<S>) -> Builder<S> {
    b.ttl(Duration::from_secs(1))
}

/// C12 (docs/contract.md:78) on PostgreSQL, Redis and `CachedStore` over PostgreSQL (cached.rs:
/// "An entry lives at most until the record expires").
#[test]
fn claims_c12_ttl_expiry_postgres_redis_cached() {
    let db = test_db();
    let srv = postgres_srv(&db, one_second_ttl);
    check_ttl_expiry(&srv, "postgres");
    drop(srv);
    let srv = cached_postgres_srv(&db, one_second_ttl);
    check_ttl_expiry(&srv, "cached postgres");
    drop(srv);
    let redis = RedisServer::start();
    let srv = redis_srv(&redis, one_second_ttl);
    check_ttl_expiry(&srv, "redis");
}

/// C3 through `CachedStore`: a cached replay of tenant A is never served to tenant B.
#[test]
fn claims_c3_cached_store_keeps_tenants_apart() {
    let srv = serve(
        || async { CachedStore::new(MemoryStore::new()) },
        |b| b.tenant_header("x-account-id"),
    );
    let a = tenant_post("/echo", "cache-t", &["acct_a"], r#"{"amount":5}"#);
    srv.send(&a);
    assert!(srv.send(&a).is_replay());
    assert!(srv.send(&a).is_replay(), "cached replay");
    let b = srv.send(&tenant_post(
        "/echo",
        "cache-t",
        &["acct_b"],
        r#"{"amount":5}"#,
    ));
    assert!(
        !b.is_replay(),
        "tenant B got A's cached record: {}",
        b.describe()
    );
    assert_eq!(srv.runs(), 2);
}

/// C14 (docs/contract.md:104): "decided from `Content-Length` first": a declared length over
/// the limit is refused at once, without waiting for a body that never comes.
#[test]
fn claims_c14_declared_length_over_limit_is_refused_without_the_body() {
    let srv = memory(|b| b.max_body_bytes(1024));
    let mut c = Conn::connect(srv.server.addr, Duration::from_secs(3)).unwrap();
    c.send_raw(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nIdempotency-Key: cl-1\r\n\
          Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n{\"a\":",
    )
    .unwrap();
    let started = Instant::now();
    let r = c.read_response("POST");
    eprintln!(
        "{:?} after {:?}",
        r.as_ref().map(|r| r.describe()),
        started.elapsed()
    );
    let r = r.expect("an answer before the body");
    assert_problem(&r, 413, "PAYLOAD_TOO_LARGE");
    assert_eq!(srv.runs(), 0);
}

// ---------------------------------------------------------------------------------------------
// The README's demo session (README.md:27-80), against the real `payments` example.

/// README.md "A session with the demo": each answer as printed there (status, the headers
/// shown, the JSON bodies), and `/stats` at the end.
#[test]
fn claims_readme_demo_session_is_what_the_example_answers() {
    use idempotency_e2e::proc::PaymentsApp;
    let app = PaymentsApp::start(&[]);
    let send = |r: &Request| {
        Conn::connect(app.addr.as_str(), TIMEOUT)
            .unwrap()
            .send(r)
            .unwrap()
    };
    let pay_at = |target: &str, key: &str, body: &str| {
        Request::post(target)
            .key(key)
            .header("X-Account-Id", "acct_1")
            .json(body)
    };
    let pay = |key: &str, body: &str| pay_at("/payments", key, body);
    let json = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();

    let first = send(&pay("k1", r#"{"amount":1000,"currency":"EUR"}"#));
    assert_eq!(first.status, 201, "{}", first.describe());
    assert_eq!(first.header("location").as_deref(), Some("/payments/1"));
    assert_eq!(
        first.json(),
        json(
            r#"{"id":1,"amount":1000,"currency":"EUR","status":"succeeded","idempotency_key":"k1"}"#
        )
    );
    let replay = send(&pay("k1", r#"{"currency":"EUR", "amount":1000}"#));
    assert_eq!(replay.status, 201, "{}", replay.describe());
    assert!(replay.is_replay());
    assert_eq!(replay.header("location").as_deref(), Some("/payments/1"));
    assert_eq!(replay.body, first.body);

    let mismatch = send(&pay("k1", r#"{"amount":2000,"currency":"EUR"}"#));
    assert_eq!(mismatch.status, 422);
    assert_eq!(
        mismatch.header("content-type").as_deref(),
        Some("application/problem+json")
    );
    assert_eq!(
        mismatch.json(),
        json(
            r#"{"type":"https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#fingerprint-mismatch",
 "title":"This Idempotency-Key was already used for a different request","status":422,
 "detail":"this key was already used on this endpoint for a request with another body, content type (JSON or not), query or spelling of the path; use a new key for a new request",
 "code":"FINGERPRINT_MISMATCH"}"#
        )
    );

    let slow_payment = pay_at(
        "/payments?delay_ms=3000",
        "k2",
        r#"{"amount":5,"currency":"EUR"}"#,
    );
    let slow = send_in_background(app.addr.clone(), slow_payment.clone());
    std::thread::sleep(Duration::from_millis(500));
    let conflict = send(&slow_payment);
    assert_eq!(conflict.status, 409, "{}", conflict.describe());
    assert_eq!(conflict.header("retry-after").as_deref(), Some("1"));
    assert_eq!(
        conflict.json(),
        json(
            r#"{"type":"https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#conflict",
 "title":"A request with this Idempotency-Key is still being processed","status":409,
 "detail":"the first request with this key is still being processed; retry after it finishes",
 "code":"CONFLICT"}"#
        )
    );

    let no_tenant = send(
        &Request::post("/payments")
            .key("k3")
            .json(r#"{"amount":5,"currency":"EUR"}"#),
    );
    assert_eq!(no_tenant.status, 400);
    assert_eq!(
        no_tenant.json(),
        json(
            r#"{"type":"https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#missing-tenant",
 "title":"The request has no tenant","status":400,
 "detail":"the tenant of this request could not be determined, so its Idempotency-Key cannot be scoped; the request was not processed",
 "code":"MISSING_TENANT"}"#
        )
    );
    let stats = send(&Request::get("/stats"));
    eprintln!("stats right after: {}", stats.text());
    let _ = slow.join();
    let stats = send(&Request::get("/stats"));
    assert_eq!(
        stats.json(),
        json(r#"{"handler_executions":2,"per_key":{"k1":1,"k2":1}}"#),
        "{}",
        stats.text()
    );
}

// ---------------------------------------------------------------------------------------------
// "Durations saturate" (README.md:152, config.rs:23) on every store.

/// Every duration at `Duration::MAX`.
fn forever<S: IdempotencyStore>(b: Builder<S>) -> Builder<S> {
    b.ttl(Duration::MAX)
        .lock_timeout(Duration::MAX)
        .renew_lease_up_to(Duration::MAX)
        .wait_for_in_flight(Duration::MAX)
}

/// A duplicate that waits for a running request gets its replay (`what` names the store).
fn check_forever(srv: &Srv, what: &str) {
    let request = keyed_post("/slow?ms=600", "forever");
    let runs = srv.runs();
    let first = srv.send_in_background(&request);
    srv.until_runs(runs + 1);
    let waited = srv.send(&request);
    let first = first.join().unwrap().unwrap();
    eprintln!(
        "{what}: first {} / waited {}",
        first.describe(),
        waited.describe()
    );
    assert_eq!(first.status, 201, "{what}: {}", first.describe());
    assert!(waited.is_replay(), "{what}: {}", waited.describe());
    assert_eq!(waited.body, first.body, "{what}");
    assert_eq!(srv.runs(), 1, "{what}");
}

/// "`Duration::MAX` means as long as the store can keep it", never a failure while serving.
#[test]
fn claims_forever_durations_serve_on_every_store() {
    let srv = memory(forever);
    check_forever(&srv, "memory");
    let db = test_db();
    let srv = cached_postgres_srv(&db, forever);
    check_forever(&srv, "cached postgres");
    let redis = RedisServer::start();
    let srv = redis_srv(&redis, forever);
    check_forever(&srv, "redis");
}

// ---------------------------------------------------------------------------------------------
// A client that has the whole response and retries at once (C6, C24) on PostgreSQL.

/// C24 (docs/contract.md:157, middleware/mod.rs "The end of the body reaches the client only
/// after the record is stored ... a client that read the whole response and retries at once
/// gets the replay, never a 409"), for buffered, chunked-stream and sized responses, on the same
/// connection and on a new one.
#[test]
fn claims_c24_an_immediate_retry_after_the_whole_response_is_a_replay_postgres() {
    let db = test_db();
    let srv = postgres_srv(&db, |b| b.lock_timeout(Duration::from_millis(600)));
    let mut bad = Vec::new();
    for i in 0..15 {
        for target in ["/echo", "/slowstream?ms=1", "/stream", "/big/5000"] {
            let request = keyed_post(target, format!("imm-{i}"));
            let mut c = Conn::connect(srv.server.addr, TIMEOUT).unwrap();
            let first = c.send(&request).unwrap();
            let same_conn = c.send(&request).unwrap();
            let new_conn = srv.send(&request);
            for (how, r) in [
                ("same connection", &same_conn),
                ("new connection", &new_conn),
            ] {
                if !r.is_replay() || r.body != first.body {
                    bad.push(format!("{target} #{i} {how}: {}", r.describe()));
                }
            }
        }
    }
    eprintln!("{bad:#?}");
    assert!(bad.is_empty(), "{bad:#?}");
    assert_eq!(srv.runs(), 60);
}

/// README table: "handler is slow (... still streaming its body): its lease is renewed while it
/// runs and while its body is produced": a retry during a long stream gets 409, not a second
/// run (lease 300 ms, stream 2.5 s; the retries end at about 1.2 s).
#[test]
fn claims_c9_c24_lease_renewed_while_a_stream_is_produced() {
    let srv = memory(|b| b.lock_timeout(Duration::from_millis(300)));
    let request = keyed_post("/slowstream?ms=250", "ss-1");
    let (first, seen) = retry_while_running(&srv, &request, 4, Duration::from_millis(300));
    assert_eq!(first.status, 200);
    assert_eq!(srv.runs(), 1, "a second run during the stream: {seen:#?}");
    let replay = srv.send(&request);
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
}

// ---------------------------------------------------------------------------------------------
// A tenant from an auth layer's extension (docs/security.md:46-55).

#[derive(Clone)]
struct Principal(String);

/// docs/security.md: with `.tenant(|req| ...)` reading an authenticated principal, an auth
/// middleware registered outside `Idempotency` scopes records per principal; one registered
/// inside it has not run yet when the tenant is read, so the request gets 400 MISSING_TENANT
/// and does not run (never the global scope).
#[test]
fn claims_c23_tenant_from_an_auth_extension_outside_and_inside() {
    use actix_web::dev::Service as _;
    use actix_web::HttpMessage as _;
    for auth_outside in [true, false] {
        let srv = start(move |counter| async move {
            let store = MemoryStore::new();
            macro_rules! auth {
                () => {
                    |req: actix_web::dev::ServiceRequest, srv| {
                        let user = req
                            .headers()
                            .get("authorization")
                            .and_then(|v| v.to_str().ok())
                            .map(|v| v.trim_start_matches("Bearer ").to_owned());
                        if let Some(user) = user {
                            req.extensions_mut().insert(Principal(user));
                        }
                        srv.call(req)
                    }
                };
            }
            let middleware = move || {
                Idempotency::builder(store.clone())
                    .tenant(|req| req.extensions().get::<Principal>().map(|p| p.0.clone()))
                    .build()
            };
            if auth_outside {
                one_worker!(move || {
                    App::new()
                        .app_data(counter.clone())
                        .route("/echo", web::post().to(echo))
                        .wrap(middleware())
                        .wrap_fn(auth!())
                })
            } else {
                one_worker!(move || {
                    App::new()
                        .app_data(counter.clone())
                        .route("/echo", web::post().to(echo))
                        .wrap_fn(auth!())
                        .wrap(middleware())
                })
            }
        });
        let send = |user: &str| {
            srv.send(
                &Request::post("/echo")
                    .key("auth-1")
                    .header("authorization", format!("Bearer {user}"))
                    .json(r#"{"amount":1}"#),
            )
        };
        let alice = send("alice");
        let bob = send("bob");
        let alice_again = send("alice");
        eprintln!(
            "auth_outside={auth_outside}: {} / {} / {}",
            alice.describe(),
            bob.describe(),
            alice_again.describe()
        );
        if auth_outside {
            assert_eq!(alice.status, 201);
            assert!(!bob.is_replay(), "bob got alice's record");
            assert!(alice_again.is_replay());
            assert_eq!(srv.runs(), 2);
        } else {
            for r in [&alice, &bob, &alice_again] {
                assert_problem(r, 400, "MISSING_TENANT");
            }
            assert_eq!(srv.runs(), 0);
        }
    }
}

/// C4 (docs/contract.md:48-50): "the same bytes sent ... with and without a
/// `Content-Encoding`, are one request to the fingerprint": the retry is replayed, not 422.
#[test]
fn claims_c4_same_bytes_with_and_without_content_encoding_are_one_request() {
    use std::io::Write as _;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(br#"{"amount":7}"#).unwrap();
    let bytes = gz.finish().unwrap();
    let srv = defaults();
    let json_request = Request::post("/echo")
        .key("ce-1")
        .header("Content-Type", "application/json");
    let first = srv.send(
        &json_request
            .clone()
            .header("Content-Encoding", "gzip")
            .body(Body::Sized(bytes.clone())),
    );
    let second = srv.send(&json_request.body(Body::Sized(bytes)));
    eprintln!("{} / {}", first.describe(), second.describe());
    assert_eq!(first.status, 201);
    assert!(second.is_replay(), "{}", second.describe());
    assert_eq!(srv.runs(), 1);
}

/// C3 (docs/contract.md:31): the scope holds the path, wherever the middleware is wrapped: on a
/// `web::scope` with a dynamic segment (`/accounts/{acct}`), one key sent for two accounts is
/// two records (two runs), never account 2 replayed account 1's payment.
#[test]
fn claims_c3_wrapped_on_a_dynamic_scope_keeps_paths_apart() {
    let srv = start(move |counter| async move {
        let store = MemoryStore::new();
        one_worker!(move || {
            App::new().app_data(counter.clone()).service(
                web::scope("/accounts/{acct}")
                    .wrap(Idempotency::new(store.clone()))
                    .route("/payments", web::post().to(echo))
                    .service(web::scope("/cards/{card}").route("/charge", web::post().to(echo))),
            )
        })
    });
    let send = |path: &str| srv.send(&Request::post(path).key("scope-k").json(r#"{"amount":1}"#));
    let mut seen = Vec::new();
    for path in [
        "/accounts/1/payments",
        "/accounts/2/payments",
        "/accounts/1/cards/a/charge",
        "/accounts/1/cards/b/charge",
        "/accounts/2/cards/a/charge",
    ] {
        let r = send(path);
        seen.push(format!("{path}: {}", r.describe()));
        assert_eq!(r.status, 201, "{seen:#?}");
        assert!(!r.is_replay(), "{seen:#?}");
    }
    assert_eq!(srv.runs(), 5);
    let again = send("/accounts/2/cards/a/charge");
    assert!(again.is_replay());
    assert!(
        again.text().contains("/accounts/2/cards/a/charge"),
        "{}",
        again.text()
    );
}
