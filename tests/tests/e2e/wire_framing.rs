//! Raw HTTP on the wire against the middleware (found by a review, 2026-12-05; each test but
//! the last failed on the code before its fix): framing the middleware must answer in its own
//! terms, and a streamed response declared empty. Raw HTTP over TCP to an actix server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use idempotency_actix::store::MemoryStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::raw_http::{Conn, Request};
use idempotency_e2e::server::ThreadServer;

const TIMEOUT: Duration = Duration::from_secs(10);

type Counter = web::Data<AtomicU64>;

async fn echo(n: Counter, req: HttpRequest, body: Bytes) -> HttpResponse {
    let run = n.fetch_add(1, Ordering::SeqCst) + 1;
    HttpResponse::Created()
        .content_type("application/json")
        .body(format!(
            r#"{{"run":{run},"method":"{}","len":{},"body":{:?}}}"#,
            req.method(),
            body.len(),
            String::from_utf8_lossy(&body)
        ))
}

/// A streamed body that declares 0 bytes (`Content-Length: 0`, a `SizedStream`) and ends
/// after some work, e.g. a handler that streams a receipt of computed length, here empty.
async fn empty_sized_stream(n: Counter) -> HttpResponse {
    n.fetch_add(1, Ordering::SeqCst);
    let stream = futures_util::stream::once(async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok::<_, std::io::Error>(Bytes::new())
    });
    HttpResponse::Created().no_chunking(0).streaming(stream)
}

fn start() -> (ThreadServer, Arc<AtomicU64>) {
    let executions = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&executions);
    let server = ThreadServer::start(move || async move {
        let store = MemoryStore::new();
        let counter = web::Data::from(counter);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(counter.clone())
                .wrap(Idempotency::builder(store.clone()).build())
                .route("/pay", web::post().to(echo))
                .route("/empty-stream", web::post().to(empty_sized_stream))
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    });
    (server, executions)
}

/// A chunked body with a chunk size that is not hex: the middleware's read of the body fails.
/// The client gets a problem document (`INVALID_BODY`, C13), not actix's plain-text payload
/// error, and nothing runs.
#[test]
fn wire_a_malformed_chunked_body_gets_a_problem_document() {
    let (server, runs) = start();
    let mut c = Conn::connect(server.addr, TIMEOUT).unwrap();
    c.send_raw(
        b"POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: bad-chunk\r\n\
          Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n\
          zz\r\n{}\r\n0\r\n\r\n",
    )
    .unwrap();
    let response = c.read_response("POST").unwrap();
    eprintln!(
        "{} {:?}",
        response.describe(),
        response.header("content-type")
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(response.status, 400);
    assert_eq!(
        response.problem_code().as_deref(),
        Some("INVALID_BODY"),
        "not a problem document: {:?} {}",
        response.header("content-type"),
        response.text()
    );
}

/// C24: "a client that read the whole response and retries at once gets the replay, never a
/// 409". A streamed body of declared length 0 is complete for actix as soon as its head is
/// written (it never polls a `Sized(0)` body), so the client had the whole response while the
/// task still read the handler's stream, and its immediate retry got 409 `CONFLICT`.
#[test]
fn wire_a_complete_empty_streamed_response_is_replayed_to_an_immediate_retry() {
    let (server, runs) = start();
    let mut c = Conn::connect(server.addr, TIMEOUT).unwrap();
    let started = std::time::Instant::now();
    let first = c
        .send(&Request::post("/empty-stream").key("empty").json("{}"))
        .unwrap();
    let got_it = started.elapsed();
    let retry = c
        .send(&Request::post("/empty-stream").key("empty").json("{}"))
        .unwrap();
    eprintln!(
        "first {} after {got_it:?}; immediate retry {} replay={}",
        first.describe(),
        retry.describe(),
        retry.is_replay()
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(
        retry.is_replay(),
        "the client had the whole 201 and its immediate retry got {}",
        retry.describe()
    );
}

/// Hostile paths on the PostgreSQL store, each sent twice with one key: never a 5xx, never two
/// runs (passed when written: a guard).
#[test]
fn sound_hostile_paths_on_postgres_never_run_twice_nor_5xx() {
    use idempotency_actix::store::postgres::PostgresStore;
    use idempotency_e2e::{block_on_fresh_thread, TestDb};
    let db = block_on_fresh_thread(TestDb::new()).expect("test database");
    let url = db.url.clone();
    let executions = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&executions);
    let server = ThreadServer::start(move || async move {
        let store = PostgresStore::connect(&url).await.expect("store");
        let counter = web::Data::from(counter);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(counter.clone())
                .wrap(Idempotency::builder(store.clone()).build())
                .route("/t/{tail:.*}", web::post().to(echo))
                .route("/s/{id}", web::post().to(echo))
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    });
    let paths = [
        "/t/%00",
        "/t/%0d%0a",
        "/t/%FF%FE",
        "/t/%C0%AF",
        "/t/%ED%A0%80",
        "/t/%25%32%35",
        "/t/%%%%",
        "/t/a;b=c",
        "/t/../../etc",
        "/t/./.",
        "/t/%2e%2e/x",
        "/t///",
        "/t/%2F%2F%2F",
        "/t/\u{1}".trim(),
        "/s/%00",
        "/s/%E2%80%AE",
        "/s/%F4%90%80%80",
        "/t/%u0041",
        "/t/%7F",
        "/t/%5C",
        "/t/%22%27",
    ];
    for (i, path) in paths.iter().enumerate() {
        let before = executions.load(Ordering::SeqCst);
        let mut statuses = Vec::new();
        for _ in 0..2 {
            let mut c = Conn::connect(server.addr, TIMEOUT).unwrap();
            match c.send(&Request::post(path).key(format!("hp-{i}")).json("{}")) {
                Ok(r) => statuses.push(format!(
                    "{}{}",
                    r.status,
                    if r.is_replay() { "r" } else { "" }
                )),
                Err(e) => statuses.push(format!("ERR {e}")),
            }
        }
        let runs = executions.load(Ordering::SeqCst) - before;
        eprintln!("{path:?}: {statuses:?} runs {runs}");
        assert!(runs <= 1, "{path}: {runs} runs");
        assert!(
            statuses.iter().all(|s| !s.starts_with('5')),
            "{path}: {statuses:?}"
        );
    }
}
