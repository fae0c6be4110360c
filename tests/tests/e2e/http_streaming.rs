//! The response side of the contract over real HTTP/1.1 connections (memory store): streamed
//! bodies are never held back (C24), a client that hangs up mid-stream changes nothing (C21),
//! a failing body leaks nothing, compression and replays agree (C6), and a keyed request
//! without a tenant never runs (C23).
//!
//! No wall-clock thresholds: a handler that would be held back waits on a gate the test opens
//! only after it has seen what must come first, so a regression hangs into the client's
//! timeout and fails, whatever the machine's speed.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::middleware::{Compress, Condition};
use actix_web::{web, App, HttpResponse, HttpServer};
use bytes::Bytes;
use idempotency_actix::store::MemoryStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::raw_http::{send_once, Conn, Request, Response};
use idempotency_e2e::server::ThreadServer;
use tokio::sync::Semaphore;

const TIMEOUT: Duration = Duration::from_secs(10);

/// What the handlers share with the test: an execution counter and the gate a stream waits on.
#[derive(Clone)]
struct Shared {
    executions: Arc<AtomicU64>,
    gate: Arc<Semaphore>,
}

impl Shared {
    fn new() -> Self {
        Self {
            executions: Arc::new(AtomicU64::new(0)),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn executions(&self) -> u64 {
        self.executions.load(Ordering::SeqCst)
    }

    /// Let one waiting stream go on.
    fn open_gate(&self) {
        self.gate.add_permits(1);
    }
}

/// `event: started`, then (once the test opens the gate) `event: done`.
async fn events(shared: web::Data<Shared>) -> HttpResponse {
    shared.executions.fetch_add(1, Ordering::SeqCst);
    let gate = Arc::clone(&shared.gate);
    let stream = futures_util::stream::unfold(0u8, move |step| {
        let gate = Arc::clone(&gate);
        async move {
            match step {
                0 => Some((
                    Ok::<_, std::io::Error>(Bytes::from("event: started\n\n")),
                    1,
                )),
                1 => {
                    gate.acquire().await.ok()?.forget();
                    Some((Ok(Bytes::from("event: done\n\n")), 2))
                }
                _ => None,
            }
        }
    });
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .streaming(stream)
}

/// A first chunk, then an error whose text must never reach a client.
async fn failing(shared: web::Data<Shared>) -> HttpResponse {
    shared.executions.fetch_add(1, Ordering::SeqCst);
    let chunks = vec![
        Ok(Bytes::from("partial ")),
        Err(std::io::Error::other(
            "SECRET-internal-detail: db password hunter2",
        )),
    ];
    HttpResponse::Ok().streaming(futures_util::stream::iter(chunks))
}

/// A JSON body large enough to be worth compressing.
async fn document(shared: web::Data<Shared>) -> HttpResponse {
    let run = shared.executions.fetch_add(1, Ordering::SeqCst) + 1;
    let items: Vec<String> = (0..200).map(|i| format!("item-{i}")).collect();
    HttpResponse::Created().json(serde_json::json!({ "run": run, "items": items }))
}

fn start(shared: &Shared, compress: Compression) -> ThreadServer {
    let shared = shared.clone();
    let store = MemoryStore::new();
    ThreadServer::start(move || async move {
        let data = web::Data::new(shared);
        let server = HttpServer::new(move || {
            let idempotency = Idempotency::builder(store.clone())
                .tenant_header("X-Account-Id")
                .build();
            let routes = |scope: actix_web::Scope| {
                scope
                    .route("/events", web::post().to(events))
                    .route("/failing", web::post().to(failing))
                    .route("/document", web::post().to(document))
            };
            // actix applies the last `wrap` outermost.
            let inside = matches!(compress, Compression::Inside);
            let outside = matches!(compress, Compression::Outside);
            let api = routes(web::scope("/api"))
                .wrap(Condition::new(inside, Compress::default()))
                .wrap(idempotency)
                .wrap(Condition::new(outside, Compress::default()));
            App::new().app_data(data.clone()).service(api)
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    })
}

#[derive(Clone, Copy)]
enum Compression {
    None,
    Outside,
    Inside,
}

fn keyed(path: &str, key: &str) -> Request {
    Request::post(path)
        .key(key)
        .header("x-account-id", "acct_1")
        .json("{}")
}

fn send(server: &ThreadServer, request: &Request) -> Response {
    send_once(&server.addr.to_string(), request, TIMEOUT).expect("a response")
}

/// Guards C24: the head and first event of a keyed streamed response reach the client while
/// the handler still waits (before the fix the middleware buffered the whole stream, so the
/// head came only after the last event: here, never, and the read timed out). The record is
/// stored when the stream ends, and a retry replays the whole stream.
#[test]
fn streamed_responses_are_forwarded_as_they_come_and_then_replayed() {
    let shared = Shared::new();
    let server = start(&shared, Compression::None);
    let request = keyed("/api/events", "sse-1");
    let mut conn = Conn::connect(server.addr, TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    let (status, headers) = conn
        .read_head()
        .expect("the head arrives while the handler still waits");
    assert_eq!(status, 200);
    assert!(headers
        .iter()
        .any(|(name, value)| name == "content-type" && value == b"text/event-stream"));
    conn.read_until_contains(b"event: started")
        .expect("the first event arrives while the handler still waits");
    shared.open_gate();
    let rest = String::from_utf8_lossy(&conn.read_rest(TIMEOUT)).into_owned();
    assert!(rest.contains("event: done"), "rest: {rest:?}");
    let replay = send(&server, &request);
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.text(), "event: started\n\nevent: done\n\n");
    assert_eq!(shared.executions(), 1);
}

/// Guards C21 with C24: the client resets its connection after the first event; the task
/// still drives the stream to its end and stores it, so the retry is a replay of the whole
/// stream and the handler ran once.
#[test]
fn a_client_gone_mid_stream_still_gets_the_replay() {
    let shared = Shared::new();
    let server = start(&shared, Compression::None);
    let request = keyed("/api/events", "sse-gone");
    let mut conn = Conn::connect(server.addr, TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    conn.read_head().expect("head");
    conn.reset().expect("reset");
    shared.open_gate();
    let deadline = Instant::now() + TIMEOUT;
    let replay = loop {
        let response = send(&server, &request);
        if response.status != 409 {
            break response;
        }
        assert!(Instant::now() < deadline, "the stream never ended");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.text(), "event: started\n\nevent: done\n\n");
    assert_eq!(shared.executions(), 1);
}

/// Guards review item 10: a response body that fails never puts its error text in front of a
/// client (it used to answer a 500 whose body was the error's text). The head was sent, so the
/// connection is aborted; the detail is in the log only. The handler ran, so the key stays
/// reserved (a retry gets 409), never a second execution.
#[test]
fn a_failing_body_leaks_nothing_and_keeps_the_key() {
    let shared = Shared::new();
    let server = start(&shared, Compression::None);
    let request = keyed("/api/failing", "fail-1");
    let mut conn = Conn::connect(server.addr, TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    let seen = String::from_utf8_lossy(&conn.read_rest(TIMEOUT)).into_owned();
    assert!(!seen.contains("SECRET"), "leaked: {seen:?}");
    assert!(!seen.contains("hunter2"), "leaked: {seen:?}");
    let retry = send(&server, &request);
    assert_eq!(retry.status, 409, "{}", retry.describe());
    assert_eq!(shared.executions(), 1);
}

/// Guards C23 over the wire: a keyed request without the tenant header is refused with 400
/// `MISSING_TENANT` and the handler does not run.
#[test]
fn a_keyed_request_without_a_tenant_never_runs() {
    let shared = Shared::new();
    let server = start(&shared, Compression::None);
    let response = send(
        &server,
        &Request::post("/api/document").key("t-1").json("{}"),
    );
    assert_eq!(response.status, 400, "{}", response.describe());
    assert_eq!(response.problem_code().as_deref(), Some("MISSING_TENANT"));
    assert_eq!(shared.executions(), 0);
}

fn gunzip(body: &[u8]) -> String {
    let mut text = String::new();
    flate2::read::GzDecoder::new(body)
        .read_to_string(&mut text)
        .expect("a gzip body");
    text
}

/// Guards review item 8, the recommended order: with `Compress` outside `Idempotency` the
/// record is stored unencoded and each replay is encoded for its own retry's
/// `Accept-Encoding`.
#[test]
fn compress_outside_encodes_each_replay_for_its_own_client() {
    let shared = Shared::new();
    let server = start(&shared, Compression::Outside);
    let gzip = keyed("/api/document", "z-1").header("accept-encoding", "gzip");
    let plain = keyed("/api/document", "z-1");
    let first = send(&server, &gzip);
    assert_eq!(first.status, 201);
    assert_eq!(first.header("content-encoding").as_deref(), Some("gzip"));
    let original = gunzip(&first.body);
    let replay = send(&server, &plain);
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.header("content-encoding"), None);
    assert_eq!(replay.text(), original);
    let replay_gzip = send(&server, &gzip);
    assert!(replay_gzip.is_replay());
    assert_eq!(gunzip(&replay_gzip.body), original);
    assert_eq!(shared.executions(), 1);
}

/// Guards review item 8, the wrong order: with `Compress` inside `Idempotency` the record holds
/// gzip bytes; a retry that does not accept gzip gets 406 `REPLAY_NOT_ACCEPTABLE` (before the
/// fix: the gzip bytes it cannot decode), a retry that accepts gzip gets the replay, and the
/// handler never runs again.
#[test]
fn compress_inside_never_replays_an_encoding_the_retry_refused() {
    let shared = Shared::new();
    let server = start(&shared, Compression::Inside);
    let gzip = keyed("/api/document", "z-2").header("accept-encoding", "gzip");
    let first = send(&server, &gzip);
    assert_eq!(first.header("content-encoding").as_deref(), Some("gzip"));
    let original = gunzip(&first.body);
    for refusing in [
        keyed("/api/document", "z-2"),
        keyed("/api/document", "z-2").header("accept-encoding", "br"),
        keyed("/api/document", "z-2").header("accept-encoding", "gzip;q=0, identity"),
    ] {
        let answer = send(&server, &refusing);
        assert_eq!(answer.status, 406, "{}", answer.describe());
        assert_eq!(
            answer.problem_code().as_deref(),
            Some("REPLAY_NOT_ACCEPTABLE")
        );
        assert_eq!(answer.header("content-encoding"), None);
    }
    let replay = send(&server, &gzip);
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(gunzip(&replay.body), original);
    assert_eq!(shared.executions(), 1);
}
