//! Review R1 (the HTTP wire, as real clients send it): what curl, HTTP/1.0 clients, pipelining
//! clients and odd-but-legal framings do, over real loopback sockets to a real actix server
//! with the middleware, on the memory store and on PostgreSQL. Each test says the rule it
//! checks; a keyed request must run its handler once, replay byte for byte, and answer the
//! middleware's own refusals as problem documents.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::Method;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotency_actix::store::{IdempotencyStore, MemoryStore};
use idempotency_actix::{Idempotency, IdempotencyBuilder};
use idempotency_e2e::raw_http::{Body, Conn, Request, Response};
use idempotency_e2e::server::ThreadServer;

const TIMEOUT: Duration = Duration::from_secs(20);
/// The body limit of the test servers (small, so a body over it is cheap to send).
const MAX_BODY: usize = 4096;

type Counter = web::Data<AtomicU64>;

fn run_no(n: &Counter) -> u64 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

async fn echo(n: Counter, req: HttpRequest, body: Bytes) -> HttpResponse {
    let run = run_no(&n);
    HttpResponse::Created()
        .content_type("application/json")
        .insert_header(("x-run", run.to_string()))
        .body(format!(
            r#"{{"run":{run},"method":"{}","len":{},"body":{:?}}}"#,
            req.method(),
            body.len(),
            String::from_utf8_lossy(&body)
        ))
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
            r#"{{"run":{run},"len":{},"body":{:?}}}"#,
            body.len(),
            String::from_utf8_lossy(&body)
        ))
}

/// A chunked stream of 5 chunks, 30 ms apart.
async fn stream(n: Counter) -> HttpResponse {
    let run = run_no(&n);
    let stream = futures_util::stream::iter(0..5).then(move |i| async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok::<_, std::io::Error>(Bytes::from(format!("chunk{i}-run{run};")))
    });
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(stream)
}

/// A sized stream (`Content-Length`, no chunking) of 5 chunks of 10 bytes, 30 ms apart.
async fn sized_stream(n: Counter) -> HttpResponse {
    let run = run_no(&n);
    let stream = futures_util::stream::iter(0..5u8).then(move |i| async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let mut chunk = format!("{i}run{run:<6}");
        chunk.truncate(9);
        chunk.push(';');
        Ok::<_, std::io::Error>(Bytes::from(chunk))
    });
    HttpResponse::Ok()
        .content_type("text/plain")
        .no_chunking(50)
        .streaming(stream)
}

/// A server with the test app behind the middleware `make` builds, and its run counter.
struct Srv {
    server: ThreadServer,
    runs: Arc<AtomicU64>,
    /// Keeps a PostgreSQL test database alive for the server's life.
    _db: Option<idempotency_e2e::TestDb>,
}

impl Srv {
    fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }

    fn conn(&self) -> Conn {
        Conn::connect(self.server.addr, TIMEOUT).expect("connect")
    }

    fn send(&self, request: &Request) -> Response {
        self.conn().send(request).expect("response")
    }
}

type Make<S> = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = Idempotency<S>>>> + Send>;

fn serve<S>(make: Make<S>, db: Option<idempotency_e2e::TestDb>) -> Srv
where
    S: IdempotencyStore + Send + Sync + 'static,
{
    let runs = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&runs);
    let server = ThreadServer::start(move || async move {
        let middleware = make().await;
        let counter = web::Data::from(counter);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(counter.clone())
                .wrap(middleware.clone())
                .route("/pay", web::post().to(echo))
                .route("/any", web::route().to(echo))
                .route("/slow", web::post().to(slow))
                .route("/stream", web::route().to(stream))
                .route("/sized-stream", web::route().to(sized_stream))
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    });
    Srv {
        server,
        runs,
        _db: db,
    }
}

type Configure<S> = fn(IdempotencyBuilder<S>) -> IdempotencyBuilder<S>;

fn memory_with(configure: Configure<MemoryStore>) -> Srv {
    serve::<MemoryStore>(
        Box::new(move || {
            Box::pin(async move {
                configure(Idempotency::builder(MemoryStore::new()).max_body_bytes(MAX_BODY)).build()
            })
        }),
        None,
    )
}

fn memory() -> Srv {
    memory_with(|b| b)
}

fn postgres() -> Srv {
    use idempotency_actix::store::postgres::PostgresStore;
    let db = idempotency_e2e::block_on_fresh_thread(idempotency_e2e::TestDb::new())
        .expect("test database");
    let url = db.url.clone();
    serve::<PostgresStore>(
        Box::new(move || {
            Box::pin(async move {
                let store = PostgresStore::connect(&url).await.expect("store");
                Idempotency::builder(store).max_body_bytes(MAX_BODY).build()
            })
        }),
        Some(db),
    )
}

fn both() -> Vec<(&'static str, Srv)> {
    vec![("memory", memory()), ("postgres", postgres())]
}

fn assert_problem(r: &Response, status: u16, code: &str, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.describe());
    assert_eq!(
        r.problem_code().as_deref(),
        Some(code),
        "{what}: not the problem document {code}: content-type {:?}, {}",
        r.header("content-type"),
        r.describe()
    );
}

/// The head of a POST with a key and a JSON body of `len` bytes, framing by `Content-Length`,
/// with `Expect: 100-continue` (what curl sends for bodies over 1 KiB).
fn expect_head(path: &str, key: &str, len: usize) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\n\
         Expect: 100-continue\r\n\r\n"
    )
    .into_bytes()
}

/// One request the way curl sends a large body: the head, wait for `100 Continue`, then the
/// body, then the final answer.
fn send_expecting(c: &mut Conn, path: &str, key: &str, body: &[u8]) -> Response {
    c.send_raw(&expect_head(path, key, body.len())).unwrap();
    let interim = c.read_response("POST").expect("an interim or final answer");
    if interim.status != 100 {
        // A final answer without 100 is allowed (the server refused before the body).
        return interim;
    }
    c.send_raw(body).unwrap();
    c.read_response("POST").expect("final answer")
}

// ---- Expect: 100-continue ------------------------------------------------------------------

/// C5-C8 with `Expect: 100-continue` (curl, for bodies over 1 KiB): first run, replay byte for
/// byte, 422 for another body, 409 for a duplicate while the first runs, over one keep-alive
/// connection each. Memory and PostgreSQL.
#[test]
fn wire_expect_100_continue_first_replay_mismatch_and_concurrent_duplicate() {
    for (store, srv) in both() {
        let body = format!(r#"{{"amount":1,"pad":"{}"}}"#, "x".repeat(1500));
        let mut c = srv.conn();
        let first = send_expecting(&mut c, "/pay", "exp-1", body.as_bytes());
        assert_eq!(first.status, 201, "{store}: first: {}", first.describe());
        assert!(!first.is_replay());
        // The retry on the same connection.
        let again = send_expecting(&mut c, "/pay", "exp-1", body.as_bytes());
        assert!(again.is_replay(), "{store}: retry: {}", again.describe());
        assert_eq!(again.status, 201, "{store}");
        assert_eq!(again.body, first.body, "{store}: replay body");
        assert_eq!(again.header("x-run"), first.header("x-run"), "{store}");
        let other = format!(r#"{{"amount":2,"pad":"{}"}}"#, "x".repeat(1500));
        let mismatch = send_expecting(&mut c, "/pay", "exp-1", other.as_bytes());
        assert_problem(&mismatch, 422, "FINGERPRINT_MISMATCH", store);
        assert_eq!(srv.runs(), 1, "{store}: runs after replay and mismatch");

        // A duplicate while the first still runs.
        let addr = srv.server.addr;
        let slow_body = body.clone();
        let slow = std::thread::spawn(move || {
            let mut c = Conn::connect(addr, TIMEOUT).unwrap();
            send_expecting(&mut c, "/slow?ms=1500", "exp-2", slow_body.as_bytes())
        });
        std::thread::sleep(Duration::from_millis(400));
        let mut d = srv.conn();
        let dup = send_expecting(&mut d, "/slow?ms=1500", "exp-2", body.as_bytes());
        assert_problem(&dup, 409, "CONFLICT", store);
        assert!(
            dup.header("retry-after").is_some(),
            "{store}: 409 without Retry-After"
        );
        let slow = slow.join().unwrap();
        assert_eq!(slow.status, 201, "{store}: slow first: {}", slow.describe());
        let replay = send_expecting(&mut d, "/slow?ms=1500", "exp-2", body.as_bytes());
        assert!(replay.is_replay(), "{store}: {}", replay.describe());
        assert_eq!(replay.body, slow.body, "{store}");
        assert_eq!(srv.runs(), 2, "{store}: runs");
    }
}

/// A curl-like client that got `100 Continue` and then sent half its body and vanished (a
/// reset, or a FIN): no handler ran, no key is held, the retry runs once. Memory and
/// PostgreSQL.
#[test]
fn wire_expect_100_continue_then_half_a_body_holds_no_key() {
    for (store, srv) in both() {
        let body = br#"{"amount":1,"currency":"EUR","note":"half then gone"}"#;
        for (i, fin) in [false, true].into_iter().enumerate() {
            let key = format!("half-{i}");
            let mut c = srv.conn();
            c.send_raw(&expect_head("/pay", &key, body.len())).unwrap();
            let interim = c.read_response("POST").unwrap();
            assert_eq!(interim.status, 100, "{store}: {}", interim.describe());
            c.send_raw(&body[..body.len() / 2]).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            if fin {
                c.shutdown_write().unwrap();
                // Whatever the server says to a body cut short, it is an error, not a run.
                if let Ok(r) = c.read_response("POST") {
                    assert!(r.status >= 400, "{store}: {}", r.describe());
                    assert!(
                        r.problem_code().is_some(),
                        "{store}: a keyed request's refusal that is not a problem document: {:?} {}",
                        r.header("content-type"),
                        r.describe()
                    );
                }
            } else {
                c.reset().unwrap();
            }
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(srv.runs(), i as u64, "{store}: a half body ran the handler");
            let retry = srv.send(&Request::post("/pay").key(&key).json(body));
            assert_eq!(
                retry.status,
                201,
                "{store}: the retry after a half body (fin={fin}): {}",
                retry.describe()
            );
            assert!(!retry.is_replay());
            assert_eq!(srv.runs(), i as u64 + 1, "{store}");
        }
    }
}

/// A refusal made before the body is read (413 from `Content-Length`, 400 `INVALID_KEY`,
/// 400 for the key header sent twice), to a client that then sends its body anyway (it got
/// `100 Continue` from actix, or never waited): the body is never taken for a request of its
/// own, even when it holds one (request smuggling through an unread body).
#[test]
fn wire_a_body_left_unread_by_a_refusal_is_never_run_as_a_request() {
    let srv = memory();
    let smuggled = "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: smuggled\r\n\
                    Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    // Over the limit: padded after the smuggled request.
    let mut big = smuggled.as_bytes().to_vec();
    big.resize(MAX_BODY + 10, b' ');
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "413 with Expect",
            {
                let mut raw = expect_head("/pay", "big", big.len());
                raw.extend_from_slice(&big);
                raw
            },
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        (
            "413 without Expect",
            {
                let mut raw = format!(
                    "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big2\r\n\
                     Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    big.len()
                )
                .into_bytes();
                raw.extend_from_slice(&big);
                raw
            },
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        (
            "INVALID_KEY",
            {
                let mut raw = format!(
                    "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"unterminated\r\n\
                     Content-Type: text/plain\r\nContent-Length: {}\r\n\r\n",
                    smuggled.len()
                )
                .into_bytes();
                raw.extend_from_slice(smuggled.as_bytes());
                raw
            },
            400,
            "INVALID_KEY",
        ),
        (
            "key twice, chunked body",
            {
                let mut raw = b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: a\r\n\
                     Idempotency-Key: a\r\nContent-Type: text/plain\r\n\
                     Transfer-Encoding: chunked\r\n\r\n"
                    .to_vec();
                raw.extend_from_slice(format!("{:x}\r\n", smuggled.len()).as_bytes());
                raw.extend_from_slice(smuggled.as_bytes());
                raw.extend_from_slice(b"\r\n0\r\n\r\n");
                raw
            },
            400,
            "INVALID_KEY",
        ),
    ];
    for (what, raw, status, code) in cases {
        let mut c = srv.conn();
        // The server may answer and close before reading everything: write errors are fine.
        let _ = c.send_raw(&raw);
        let answer = c.read_response("POST").expect("an answer");
        let answer = if answer.status == 100 {
            c.read_response("POST").expect("a final answer")
        } else {
            answer
        };
        assert_problem(&answer, status, code, what);
        // Anything more on this connection is a second response: to the smuggled request.
        let rest = c.read_rest(Duration::from_millis(700));
        let rest = String::from_utf8_lossy(&rest);
        assert!(
            !rest.contains("HTTP/1.1"),
            "{what}: a second response on the connection: {rest}"
        );
        assert_eq!(srv.runs(), 0, "{what}: the body ran as a request");
    }
    // And the smuggled key was never used.
    let fresh = srv.send(&Request::post("/pay").key("smuggled").json("{}"));
    assert_eq!(fresh.status, 201, "{}", fresh.describe());
    assert!(
        !fresh.is_replay(),
        "the smuggled request ran before: {}",
        fresh.describe()
    );
}

// ---- pipelining, Connection: close, HTTP/1.0 ------------------------------------------------

/// A client that pipelines a keyed request and its retry on one connection (both written
/// before any answer is read): the first runs, the second is its replay byte for byte, never a
/// 409 (design.md, C24: "a client that read everything and retries at once gets the replay,
/// never a 409") and never a second run. For a buffered, a chunked-streamed and a
/// sized-streamed response, and a slow handler. Memory and PostgreSQL.
#[test]
fn wire_a_pipelined_retry_on_one_connection_is_a_replay() {
    for (store, srv) in both() {
        for (i, path) in ["/pay", "/stream", "/sized-stream", "/slow?ms=300"]
            .into_iter()
            .enumerate()
        {
            let key = format!("pipe-{i}");
            let request = Request::post(path).key(&key).json(r#"{"amount":7}"#);
            let before = srv.runs();
            let mut c = srv.conn();
            let mut both = request.to_bytes();
            both.extend_from_slice(&request.to_bytes());
            c.send_raw(&both).unwrap();
            let first = c.read_response("POST").expect("first");
            let second = c.read_response("POST").expect("second");
            assert!(
                (200..300).contains(&first.status) && !first.is_replay(),
                "{store} {path}: first {}",
                first.describe()
            );
            assert!(
                second.is_replay(),
                "{store} {path}: the pipelined retry got {} (not a replay)",
                second.describe()
            );
            assert_eq!(second.status, first.status, "{store} {path}");
            assert_eq!(second.body, first.body, "{store} {path}: replay body");
            assert_eq!(srv.runs() - before, 1, "{store} {path}: runs");
        }
        // Pipelined: the same key with another body behind a slow first: 422 after it.
        let mut c = srv.conn();
        let mut raw = Request::post("/slow?ms=300")
            .key("pipe-mismatch")
            .json(r#"{"amount":1}"#)
            .to_bytes();
        raw.extend_from_slice(
            &Request::post("/slow?ms=300")
                .key("pipe-mismatch")
                .json(r#"{"amount":2}"#)
                .to_bytes(),
        );
        c.send_raw(&raw).unwrap();
        let first = c.read_response("POST").unwrap();
        assert_eq!(first.status, 201, "{store}: {}", first.describe());
        let second = c.read_response("POST").unwrap();
        assert_problem(&second, 422, "FINGERPRINT_MISMATCH", store);
    }
}

/// A first request with `Connection: close`, then the retry on a new connection: the replay
/// carries no `Connection: close` from the first exchange (C11) and is byte for byte the first
/// body. Then HTTP/1.0 clients (no `Host`, no keep-alive, close-delimited bodies): the first
/// run, a replay, and a streamed response read to EOF by an HTTP/1.0 client and retried at once
/// (a replay, never a 409 nor a second run), whose replay to an HTTP/1.1 client is the same
/// bytes. Memory and PostgreSQL.
#[test]
fn wire_connection_close_and_http_1_0_clients_get_replays() {
    for (store, srv) in both() {
        let request = Request::post("/pay")
            .key("close-1")
            .header("Connection", "close")
            .json(r#"{"amount":3}"#);
        let mut c = srv.conn();
        let first = c.send(&request).unwrap();
        assert_eq!(first.status, 201, "{store}");
        assert!(
            c.is_closed_by_peer(Duration::from_secs(2)),
            "{store}: not closed"
        );
        let again = srv.send(&Request::post("/pay").key("close-1").json(r#"{"amount":3}"#));
        assert!(again.is_replay(), "{store}: {}", again.describe());
        assert_eq!(again.body, first.body, "{store}");
        assert!(
            again
                .header("connection")
                .is_none_or(|v| !v.eq_ignore_ascii_case("close")),
            "{store}: the replay says Connection: close"
        );

        // HTTP/1.0, no Host.
        let body = r#"{"amount":4}"#;
        let raw10 = |path: &str, key: &str| {
            format!(
                "POST {path} HTTP/1.0\r\nIdempotency-Key: {key}\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes()
        };
        let send10 = |path: &str, key: &str| {
            let mut c = srv.conn();
            c.send_raw(&raw10(path, key)).unwrap();
            let r = c.read_response("POST").expect("HTTP/1.0 response");
            (r, c)
        };
        let runs = srv.runs();
        let (a, _) = send10("/pay", "h10");
        assert_eq!(a.status, 201, "{store}: HTTP/1.0: {}", a.describe());
        let (b, _) = send10("/pay", "h10");
        assert!(b.is_replay(), "{store}: HTTP/1.0 retry: {}", b.describe());
        assert_eq!(b.body, a.body, "{store}");
        assert_eq!(srv.runs() - runs, 1, "{store}");

        for path in ["/stream", "/sized-stream"] {
            let key = format!("h10{path}");
            let runs = srv.runs();
            let (s, _) = send10(path, &key);
            assert_eq!(s.status, 200, "{store} {path}: {}", s.describe());
            assert!(!s.body.is_empty(), "{store} {path}: empty streamed body");
            // Read to EOF (close-delimited) or to its length: the whole body; retry at once.
            let (t, _) = send10(path, &key);
            assert!(
                t.is_replay(),
                "{store} {path}: HTTP/1.0 client's immediate retry: {}",
                t.describe()
            );
            assert_eq!(t.body, s.body, "{store} {path}: replay to HTTP/1.0");
            let u = srv.send(&Request::post(path).key(&key).json(body));
            assert!(u.is_replay(), "{store} {path}: {}", u.describe());
            assert_eq!(u.body, s.body, "{store} {path}: replay to HTTP/1.1");
            assert_eq!(srv.runs() - runs, 1, "{store} {path}: runs");
        }
    }
}

// ---- request body framings ------------------------------------------------------------------

/// C4: the fingerprint is over the body bytes, whatever their framing: a chunked body with
/// chunk extensions and trailers is the same request as the same bytes with `Content-Length`
/// (a replay, one run), and the connection stays in step after the trailers (a request
/// behind it on the same connection gets its own answer).
#[test]
fn wire_chunk_extensions_and_trailers_are_the_same_request() {
    for (store, srv) in both() {
        let json = r#"{"amount":9,"currency":"EUR"}"#;
        let mut raw = b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: trailers\r\n\
              Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
              Trailer: X-Checksum\r\n\r\n"
            .to_vec();
        let (a, b) = json.split_at(10);
        raw.extend_from_slice(format!("{:x};name=value;flag\r\n{a}\r\n", a.len()).as_bytes());
        raw.extend_from_slice(format!("{:X} ; ext=\"quoted\"\r\n{b}\r\n", b.len()).as_bytes());
        raw.extend_from_slice(b"0;last=1\r\nX-Checksum: abc123\r\nX-Other: 1\r\n\r\n");
        // Behind it, on the same connection, a plain keyed request.
        raw.extend_from_slice(
            &Request::post("/pay")
                .key("behind-trailers")
                .json(r#"{"amount":10}"#)
                .to_bytes(),
        );
        let mut c = srv.conn();
        c.send_raw(&raw).unwrap();
        let first = c.read_response("POST").expect("first");
        assert_eq!(
            first.status,
            201,
            "{store}: chunked with trailers: {}",
            first.describe()
        );
        assert!(
            first.text().contains(r#"\"amount\":9,"#),
            "{store}: the handler saw another body: {}",
            first.text()
        );
        let behind = c
            .read_response("POST")
            .expect("the request behind the trailers");
        assert_eq!(behind.status, 201, "{store}: behind: {}", behind.describe());
        assert!(!behind.is_replay(), "{store}: {}", behind.describe());
        assert!(
            behind.text().contains(r#"\"amount\":10"#),
            "{store}: {}",
            behind.text()
        );
        let sized = srv.send(&Request::post("/pay").key("trailers").json(json));
        assert!(sized.is_replay(), "{store}: {}", sized.describe());
        assert_eq!(sized.body, first.body, "{store}");
        assert_eq!(srv.runs(), 2, "{store}: runs");
    }
}

/// C4: no body, `Content-Length: 0` and a chunked body of zero chunks all carry the empty
/// body: one request (the first runs, the others replay), with and without a JSON
/// `Content-Type`; and a body over the limit sent in tiny chunks gets 413 as a problem.
#[test]
fn wire_three_spellings_of_an_empty_body_are_one_request() {
    for (store, srv) in both() {
        for (i, json) in [false, true].into_iter().enumerate() {
            let key = format!("empty-{i}");
            let base = || {
                let r = Request::post("/pay").key(&key);
                if json {
                    r.header("Content-Type", "application/json")
                } else {
                    r
                }
            };
            let runs = srv.runs();
            let none = srv.send(&base());
            assert_eq!(none.status, 201, "{store} json={json}: {}", none.describe());
            let zero = srv.send(&base().body(Body::Sized(Vec::new())));
            assert!(
                zero.is_replay(),
                "{store} json={json}: CL 0: {}",
                zero.describe()
            );
            let chunked = srv.send(&base().body(Body::Chunked(Vec::new(), 1)));
            assert!(
                chunked.is_replay(),
                "{store} json={json}: chunked empty: {}",
                chunked.describe()
            );
            assert_eq!(zero.body, none.body);
            assert_eq!(chunked.body, none.body);
            assert_eq!(srv.runs() - runs, 1, "{store} json={json}: runs");
        }
        let big = Request::post("/pay")
            .key("tiny-chunks")
            .header("Content-Type", "application/json")
            .body(Body::Chunked(vec![b' '; MAX_BODY + 1], 7));
        let mut c = srv.conn();
        let _ = c.send_raw(&big.to_bytes());
        let r = c
            .read_response("POST")
            .expect("an answer to a chunked body over the limit");
        assert_problem(&r, 413, "PAYLOAD_TOO_LARGE", store);
    }
}

fn gzip(data: &[u8], mtime: u32, level: u32) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::GzBuilder::new()
        .mtime(mtime)
        .write(Vec::new(), flate2::Compression::new(level));
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

/// C4 with `Content-Encoding: gzip` request bodies (actix does not decode them here): the
/// fingerprint is over the bytes sent, so the same gzip bytes replay, and another gzip
/// encoding of the same JSON (another mtime in the gzip header) is another request: 422 (C4
/// says only "the same bytes with and without a Content-Encoding are one request"). Reports
/// what happens; the contract is silent on two encodings of one document.
#[test]
fn wire_gzip_request_bodies_are_fingerprinted_as_sent() {
    let srv = memory();
    let json = br#"{"amount":11,"currency":"EUR"}"#;
    let gz = |bytes: Vec<u8>| {
        Request::post("/pay")
            .key("gz")
            .header("Content-Type", "application/json")
            .header("Content-Encoding", "gzip")
            .body(Body::Sized(bytes))
    };
    let first = srv.send(&gz(gzip(json, 1, 6)));
    assert_eq!(first.status, 201, "{}", first.describe());
    let same = srv.send(&gz(gzip(json, 1, 6)));
    assert!(same.is_replay(), "same gzip bytes: {}", same.describe());
    let other = srv.send(&gz(gzip(json, 2, 6)));
    eprintln!(
        "another gzip encoding of the same JSON: {}",
        other.describe()
    );
    assert_problem(&other, 422, "FINGERPRINT_MISMATCH", "another gzip encoding");
    // C4: the same bytes without the Content-Encoding: one request.
    let plain = srv.send(
        &Request::post("/pay")
            .key("gz")
            .header("Content-Type", "application/json")
            .body(Body::Sized(gzip(json, 1, 6))),
    );
    assert!(plain.is_replay(), "{}", plain.describe());
    assert_eq!(srv.runs(), 1);
}

// ---- keys on the wire -----------------------------------------------------------------------

/// C2 on the wire: whitespace around a key is not part of it (HTTP field values are trimmed),
/// so the retry with other spacing replays; an empty `Idempotency-Key` beside a real one is
/// "the header sent twice" (400 `INVALID_KEY`, a problem, no run); an obs-folded key never
/// runs; a key split across two headers is refused.
#[test]
fn wire_key_spellings_on_the_wire() {
    let srv = memory();
    let body = r#"{"amount":12}"#;
    let raw_key = |key_line: &str| {
        format!(
            "POST /pay HTTP/1.1\r\nHost: x\r\n{key_line}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let send_raw = |raw: Vec<u8>| {
        let mut c = srv.conn();
        c.send_raw(&raw).unwrap();
        c.read_response("POST")
    };
    let first = send_raw(raw_key("Idempotency-Key: spaced")).unwrap();
    assert_eq!(first.status, 201, "{}", first.describe());
    for line in [
        "Idempotency-Key:    spaced   ",
        "Idempotency-Key:\tspaced\t",
        "idempotency-key:spaced",
        "IDEMPOTENCY-KEY: \"spaced\"",
    ] {
        let r = send_raw(raw_key(line)).unwrap();
        assert!(r.is_replay(), "{line:?}: {}", r.describe());
        assert_eq!(r.body, first.body, "{line:?}");
    }
    assert_eq!(srv.runs(), 1);
    for (what, lines) in [
        (
            "empty then real",
            "Idempotency-Key: \r\nIdempotency-Key: real-1",
        ),
        (
            "real then empty",
            "Idempotency-Key: real-2\r\nIdempotency-Key:",
        ),
        ("two halves", "Idempotency-Key: a\r\nIdempotency-Key: b"),
        ("comma list", "Idempotency-Key: a, b"),
    ] {
        let r = send_raw(raw_key(lines)).unwrap();
        assert_problem(&r, 400, "INVALID_KEY", what);
    }
    // obs-fold: refused by the HTTP parser or the key parser; never a run.
    match send_raw(raw_key("Idempotency-Key: folded\r\n  continued")) {
        Ok(r) => assert_eq!(r.status, 400, "obs-fold: {}", r.describe()),
        Err(e) => eprintln!("obs-fold: connection closed: {e}"),
    }
    assert_eq!(srv.runs(), 1, "a refused key ran the handler");
}

// ---- other methods --------------------------------------------------------------------------

/// C1: GET, HEAD, OPTIONS, PUT and DELETE with a key pass through under the default methods:
/// each runs, nothing is replayed.
#[test]
fn wire_keyed_requests_of_uncovered_methods_pass_through() {
    let srv = memory();
    for method in ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"] {
        let runs = srv.runs();
        for _ in 0..2 {
            let r = srv.send(&Request::new(method, "/any").key(format!("m-{method}")));
            assert_eq!(r.status, 201, "{method}: {}", r.describe());
            assert!(!r.is_replay(), "{method}: replayed");
        }
        assert_eq!(srv.runs() - runs, 2, "{method}: runs");
    }
}

/// C1 with HEAD (and GET) configured as covered methods: a keyed HEAD is stored and replayed
/// without a body on the wire (the next request on the same keep-alive connection gets its own
/// answer, so no replay wrote body bytes into the stream), and the HEAD and the GET of one key
/// are two records (the method is in the scope). Requests are sent one after the other, not
/// pipelined: actix-http frames a response by the method of the *last decoded* request (its
/// codec keeps one HEAD flag per connection), so a response pending while a pipelined HEAD is
/// decoded loses its body, and a HEAD's answer pending while a pipelined GET is decoded gets
/// one, with or without this middleware (a keyless slow POST followed by a pipelined HEAD
/// shows it).
/// Also a HEAD to a streaming handler: the client has the whole answer (a head) at once, so
/// its immediate retry must be the replay and never a second run (design.md, C24).
#[test]
fn wire_covered_head_is_replayed_without_a_body() {
    let srv = memory_with(|b| b.methods([Method::POST, Method::GET, Method::HEAD]));
    let head = Request::new("HEAD", "/any").key("head-1");
    let get = Request::new("GET", "/any").key("head-1");
    let mut c = srv.conn();
    let h1 = c.send(&head).expect("head 1");
    let h2 = c.send(&head).expect("head 2");
    let g1 = c.send(&get).expect("get 1");
    let g2 = c.send(&get).expect("get 2");
    eprintln!(
        "HEAD {} / {}; GET {} / {}",
        h1.describe(),
        h2.describe(),
        g1.describe(),
        g2.describe()
    );
    assert_eq!(h1.status, 201);
    assert!(h2.is_replay(), "HEAD retry: {}", h2.describe());
    assert_eq!(
        h2.header("content-length"),
        h1.header("content-length"),
        "the HEAD replay's length"
    );
    assert_eq!(g1.status, 201, "GET: {}", g1.describe());
    assert!(
        !g1.is_replay(),
        "GET replayed HEAD's record: {}",
        g1.describe()
    );
    assert!(g1.text().contains(r#""method":"GET""#), "{}", g1.text());
    assert!(g2.is_replay(), "GET retry: {}", g2.describe());
    assert_eq!(g2.body, g1.body);
    assert_eq!(srv.runs(), 2, "runs");

    // HEAD to a streaming handler, then an immediate retry on the same connection.
    for path in ["/stream", "/sized-stream"] {
        let runs = srv.runs();
        let key = format!("head{path}");
        let request = Request::new("HEAD", path).key(&key);
        let mut c = srv.conn();
        let first = c.send(&request).expect("HEAD");
        assert_eq!(first.status, 200, "{path}: {}", first.describe());
        let retry = c.send(&request).expect("HEAD retry");
        eprintln!(
            "{path}: HEAD {} then {}",
            first.describe(),
            retry.describe()
        );
        assert!(
            retry.is_replay(),
            "{path}: the client had the whole HEAD answer; its immediate retry got {}",
            retry.describe()
        );
        assert_eq!(srv.runs() - runs, 1, "{path}: runs");
        // The connection is still in step.
        let after = c.send(&Request::new("GET", "/any")).expect("GET after");
        assert_eq!(after.status, 201, "{path}: {}", after.describe());
    }
}

/// A chunked body over the limit (413 read part-way, C14) whose chunks after the limit hold a
/// whole keyed request, and a real keyed request pipelined behind the terminating chunk: the
/// smuggled one never runs; the pipelined one is answered in its own right or the connection
/// is closed, never answered with another request's response.
#[test]
fn wire_a_chunked_body_cut_at_the_limit_smuggles_nothing() {
    let srv = memory();
    let smuggled = "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: smuggled-2\r\n\
                    Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}";
    let mut raw = b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: over\r\n\
          Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        .to_vec();
    let pad = vec![b' '; MAX_BODY + 1];
    raw.extend_from_slice(format!("{:x}\r\n", pad.len()).as_bytes());
    raw.extend_from_slice(&pad);
    raw.extend_from_slice(
        format!("\r\n{:x}\r\n{smuggled}\r\n0\r\n\r\n", smuggled.len()).as_bytes(),
    );
    raw.extend_from_slice(
        &Request::post("/pay")
            .key("behind-413")
            .json(r#"{"amount":13}"#)
            .to_bytes(),
    );
    let mut c = srv.conn();
    let _ = c.send_raw(&raw);
    let first = c.read_response("POST").expect("413");
    assert_problem(&first, 413, "PAYLOAD_TOO_LARGE", "chunked over the limit");
    match c.read_response("POST") {
        Ok(behind) => {
            eprintln!("behind the 413: {}", behind.describe());
            assert_eq!(behind.status, 201, "{}", behind.describe());
            assert!(
                behind.text().contains(r#"\"amount\":13"#),
                "{}",
                behind.text()
            );
        }
        Err(e) => eprintln!("behind the 413: connection closed ({e})"),
    }
    std::thread::sleep(Duration::from_millis(300));
    let fresh = srv.send(&Request::post("/pay").key("smuggled-2").json("{}"));
    assert!(
        !fresh.is_replay(),
        "the smuggled request ran: {}",
        fresh.describe()
    );
    assert!(srv.runs() <= 2, "runs {}", srv.runs());
}

/// A keyed request and its retry pipelined, then the client half-closes (FIN after the last
/// byte, as `curl` piping a request file or a proxy might): both are answered, the second a
/// replay (actix allows half-closed connections by default).
#[test]
fn wire_pipelined_pair_then_half_close() {
    for (store, srv) in both() {
        let request = Request::post("/slow?ms=200")
            .key("half-close")
            .json(r#"{"amount":14}"#);
        let mut c = srv.conn();
        let mut raw = request.to_bytes();
        raw.extend_from_slice(&request.to_bytes());
        c.send_raw(&raw).unwrap();
        c.shutdown_write().unwrap();
        let first = c.read_response("POST").expect("first");
        assert_eq!(first.status, 201, "{store}: {}", first.describe());
        let second = c.read_response("POST").expect("second");
        assert!(second.is_replay(), "{store}: {}", second.describe());
        assert_eq!(second.body, first.body, "{store}");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(srv.runs(), 1, "{store}: runs");
    }
}

/// C5/C6 with a slow upload: a client whose body is still arriving holds no key (the key is
/// reserved after the body is read), so a duplicate with the whole body runs first; when the
/// slow body completes it gets that run's replay, never a second run. Memory and PostgreSQL.
#[test]
fn wire_a_slow_upload_racing_its_duplicate_runs_once() {
    for (store, srv) in both() {
        let body = br#"{"amount":15,"currency":"EUR","memo":"slow upload"}"#;
        let mut slow = srv.conn();
        let head = format!(
            "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: upload\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        slow.send_raw(head.as_bytes()).unwrap();
        slow.send_raw(&body[..20]).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let fast = srv.send(&Request::post("/pay").key("upload").json(body));
        assert_eq!(
            fast.status,
            201,
            "{store}: the duplicate: {}",
            fast.describe()
        );
        slow.send_raw(&body[20..]).unwrap();
        let late = slow
            .read_response("POST")
            .expect("the slow upload's answer");
        assert!(
            late.is_replay(),
            "{store}: the slow upload: {}",
            late.describe()
        );
        assert_eq!(late.body, fast.body, "{store}");
        assert_eq!(srv.runs(), 1, "{store}: runs");
    }
}

/// C4/C3: an absolute-form request target (`POST http://host/pay`, what a client sends through
/// a forward proxy) and the origin form (`POST /pay`) name one route and one path: the retry
/// in the other form is a replay, not a 422 nor a second run; another host in the absolute
/// form is, as documented, the same record (the host is not in the scope).
#[test]
fn wire_absolute_form_target_is_the_same_request() {
    let srv = memory();
    let json = r#"{"amount":16}"#;
    let absolute = format!("http://{}/pay", srv.server.addr);
    let first = srv.send(&Request::post(&absolute).key("abs").json(json));
    assert_eq!(first.status, 201, "{}", first.describe());
    let origin = srv.send(&Request::post("/pay").key("abs").json(json));
    eprintln!("absolute then origin form: {}", origin.describe());
    assert!(
        origin.is_replay(),
        "origin-form retry: {}",
        origin.describe()
    );
    assert_eq!(origin.body, first.body);
    let other_host = srv.send(
        &Request::post("http://other.example/pay")
            .key("abs")
            .json(json),
    );
    assert!(other_host.is_replay(), "{}", other_host.describe());
    assert_eq!(srv.runs(), 1);
}

/// Informational (an actix-http bug, not this crate's): a keyed POST with a HEAD pipelined
/// behind it. actix-http's codec keeps one HEAD flag per connection, set by the last request
/// it decoded; the middleware answers a keyed request from a detached task (pending at least
/// one poll), so the HEAD is decoded before the POST's response is encoded, and the POST's
/// `201` goes out with its `Content-Length` but without its body: the client reads the HEAD's
/// response as that body. The record itself is right (a retry replays it whole). A keyless
/// POST to any handler that awaits shows the same. Ignored: it fails on actix-http 3.20.
#[test]
#[ignore = "actix-http 3.20: per-connection HEAD flag misframes a pending response behind a pipelined HEAD"]
fn wire_a_keyed_post_with_a_head_pipelined_behind_it_keeps_its_body() {
    let srv = memory();
    let post = Request::post("/pay")
        .key("post-then-head")
        .json(r#"{"amount":17}"#);
    let mut raw = post.to_bytes();
    raw.extend_from_slice(&Request::new("HEAD", "/any").to_bytes());
    let mut c = srv.conn();
    c.send_raw(&raw).unwrap();
    let first = c.read_response("POST");
    let head = c.read_response("HEAD");
    eprintln!("POST: {first:?}\nHEAD: {head:?}");
    let first = first.expect("the POST's response");
    assert!(
        first.text().contains(r#""amount":17"#) || first.text().contains(r#"\"amount\":17"#),
        "the keyed POST's body was lost: {}",
        first.describe()
    );
    let head = head.expect("the HEAD's response");
    assert_eq!(head.status, 201, "{}", head.describe());
    let retry = srv.send(&post);
    assert!(retry.is_replay(), "{}", retry.describe());
    assert_eq!(srv.runs(), 2);
}

/// A keyed POST that also asks for an h2c upgrade (`Connection: Upgrade, HTTP2-Settings`,
/// `Upgrade: h2c`, what `curl --http2` sends on `http://`), to a server without h2c: it is
/// answered over HTTP/1.1 (run once), not left hanging, and its retry is the replay.
/// (`Upgrade: websocket` on a POST is not tested: actix takes the rest of the connection as
/// the body, so any handler that reads its body, or this middleware, waits for EOF.)
#[test]
fn wire_a_keyed_post_asking_for_an_h2c_upgrade_is_answered() {
    let srv = memory();
    let json = r#"{"amount":18}"#;
    let request = Request::post("/pay")
        .key("upgrade")
        .header("Connection", "Upgrade, HTTP2-Settings")
        .header("Upgrade", "h2c")
        .header("HTTP2-Settings", "AAMAAABkAAQCAAAAAAIAAAAA")
        .json(json);
    let mut c = Conn::connect(srv.server.addr, Duration::from_secs(5)).unwrap();
    let answer = c.send(&request).expect("an answer within 5 s, not a hang");
    assert_eq!(answer.status, 201, "{}", answer.describe());
    let retry = srv.send(&request);
    assert!(retry.is_replay(), "{}", retry.describe());
    assert_eq!(retry.body, answer.body);
    assert_eq!(srv.runs(), 1, "runs");
}
