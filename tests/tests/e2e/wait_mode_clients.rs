//! Wait mode (C8) and clients that give up while their request waits, over real HTTP/1.1 on
//! loopback (memory store; PostgreSQL for transactional mode). A review (2026-12-05) found that
//! a waiter whose client closed normally (a FIN) still ran the handler for nobody once the first
//! request's key was released: actix-web keeps serving a half-closed connection's request by
//! default, so the middleware never learns that the client left. The remedy is the server's
//! `h1_allow_half_closed(false)`, documented on `wait_for_in_flight`; these tests hold it and
//! the reset case, which needs nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::MemoryStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::raw_http::{Conn, Request};
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::{block_on_fresh_thread, TestDb};

const TIMEOUT: Duration = Duration::from_secs(10);

/// How a client that gives up on its request leaves.
#[derive(Clone, Copy, Debug)]
enum Leave {
    /// A normal close (FIN): what most client libraries do when their own timeout fires.
    Close,
    /// A TCP reset (RST, `SO_LINGER` 0).
    Reset,
}

/// The `/pay` handler: its first keyed run fails after 800 ms (502: not stored, the key is
/// released, or in transactional mode rolled back); later keyed runs charge. Keyless requests
/// (the warm-up) are answered at once and not counted.
#[allow(clippy::type_complexity)]
fn pay(
    executions: &Arc<AtomicU64>,
) -> impl Fn(
    actix_web::HttpRequest,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = HttpResponse>>>
       + Clone
       + 'static {
    let executions = Arc::clone(executions);
    move |req: actix_web::HttpRequest| {
        let executions = Arc::clone(&executions);
        Box::pin(async move {
            if !req.headers().contains_key("idempotency-key") {
                return HttpResponse::Ok().body("warm");
            }
            let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                tokio::time::sleep(Duration::from_millis(800)).await;
                return HttpResponse::BadGateway().body("provider down");
            }
            HttpResponse::Created().body(format!("charge {n}"))
        })
    }
}

const WAIT: Duration = Duration::from_secs(30);

/// A server in wait mode on a memory store (see [`pay`]). `half_closed` is actix's
/// `h1_allow_half_closed` (default `true`).
fn wait_mode_server(executions: &Arc<AtomicU64>, half_closed: bool) -> ThreadServer {
    let handler = pay(executions);
    let store = MemoryStore::new();
    ThreadServer::start(move || async move {
        let server = HttpServer::new(move || {
            App::new()
                .wrap(
                    Idempotency::builder(store.clone())
                        .wait_for_in_flight(WAIT)
                        .build(),
                )
                .route("/pay", web::post().to(handler.clone()))
        })
        .workers(1)
        .disable_signals()
        .h1_allow_half_closed(half_closed)
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    })
}

/// The same in transactional mode (C25) on the PostgreSQL database at `url`.
fn transactional_wait_mode_server(
    executions: &Arc<AtomicU64>,
    url: String,
    half_closed: bool,
) -> ThreadServer {
    let handler = pay(executions);
    ThreadServer::start(move || async move {
        let store = PostgresStore::connect(&url).await.expect("connect");
        let server = HttpServer::new(move || {
            App::new()
                .wrap(
                    Idempotency::builder(store.clone())
                        .wait_for_in_flight(WAIT)
                        .transactional()
                        .build(),
                )
                .route("/pay", web::post().to(handler.clone()))
        })
        .workers(1)
        .disable_signals()
        .h1_allow_half_closed(half_closed)
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    })
}

/// C8 wait mode: a duplicate waits for the first request; its client gives up and leaves.
/// When the first request then fails (key released), the waiter must not take the key and run
/// the handler for nobody (`Flow::reserve`: "run later, for nobody, it would be a second charge
/// when the client retried with a new key meanwhile"). How many runs that leaves.
fn runs_after_a_waiter_leaves(leave: Leave, half_closed: bool) -> u64 {
    let executions = Arc::new(AtomicU64::new(0));
    let server = wait_mode_server(&executions, half_closed);
    runs_after_a_waiter_leaves_on(&server, &executions, leave)
}

fn runs_after_a_waiter_leaves_on(
    server: &ThreadServer,
    executions: &Arc<AtomicU64>,
    leave: Leave,
) -> u64 {
    let request = Request::post("/pay").key("k").json("{}");
    let addr = server.addr;
    // Warm-up (a keyless request): the pool's first connection is made now, so the first keyed
    // request is reserved well before its duplicate arrives.
    let warm = Conn::connect(addr, TIMEOUT)
        .expect("connect")
        .send(&Request::post("/pay").json("{}"))
        .expect("the warm-up's answer");
    assert_eq!(warm.status, 200, "{}", warm.describe());
    let first = {
        let request = request.clone();
        std::thread::spawn(move || {
            let mut conn = Conn::connect(addr, TIMEOUT).expect("connect");
            conn.send(&request).expect("the first answer").status
        })
    };
    std::thread::sleep(Duration::from_millis(150));
    // The duplicate: sent, waited on for a while, then given up.
    let mut waiter = Conn::connect(addr, TIMEOUT).expect("connect");
    waiter.send_raw(&request.to_bytes()).expect("send");
    std::thread::sleep(Duration::from_millis(200));
    match leave {
        Leave::Close => drop(waiter),
        Leave::Reset => waiter.reset().expect("reset"),
    }
    assert_eq!(first.join().expect("first"), 502);
    // Long enough for a waiter still polling (every 200 ms at most) to take the key and run.
    std::thread::sleep(Duration::from_millis(1000));
    executions.load(Ordering::SeqCst)
}

/// The documented setting: with `h1_allow_half_closed(false)` a FIN ends the request's
/// handling, so the waiter sees its client leave and runs nothing.
#[test]
fn a_waiter_whose_client_closed_runs_nothing_without_half_close() {
    assert_eq!(runs_after_a_waiter_leaves(Leave::Close, false), 1);
}

/// A reset (RST) needs no setting: actix drops the request's future, the waiter stops.
#[test]
fn a_waiter_whose_client_reset_runs_nothing() {
    assert_eq!(runs_after_a_waiter_leaves(Leave::Reset, true), 1);
}

/// Transactional mode's own wait loop, with the documented setting: a waiter whose client
/// closed normally claims nothing once the first request rolled back.
#[test]
fn a_transactional_waiter_whose_client_closed_runs_nothing_without_half_close() {
    let db = block_on_fresh_thread(TestDb::new()).expect("a test database");
    let executions = Arc::new(AtomicU64::new(0));
    let server = transactional_wait_mode_server(&executions, db.url.clone(), false);
    let runs = runs_after_a_waiter_leaves_on(&server, &executions, Leave::Close);
    drop(server);
    assert_eq!(runs, 1);
}

/// Transactional mode, a reset: the waiter stops.
#[test]
fn a_transactional_waiter_whose_client_reset_runs_nothing() {
    let db = block_on_fresh_thread(TestDb::new()).expect("a test database");
    let executions = Arc::new(AtomicU64::new(0));
    let server = transactional_wait_mode_server(&executions, db.url.clone(), true);
    let runs = runs_after_a_waiter_leaves_on(&server, &executions, Leave::Reset);
    drop(server);
    assert_eq!(runs, 1);
}
