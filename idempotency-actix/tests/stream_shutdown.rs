//! A streamed response whose client reads slowly is not counted for a graceful stop once nothing
//! idempotent is left to do: its record is stored, or it is too large to store and its key was
//! released. In a test binary of its own, one test running both cases in turn: it reads the
//! process's `shutdown::unfinished_work`. Found by review: the task that paced a client which
//! had stopped reading held the count, so `stop_gracefully` waited out its whole limit and
//! warned of "idempotent work still in flight" (2026-12-06 for a stored response, 2026-12-07
//! for one too large to store).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use actix_web::body::to_bytes;
use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpResponse};
use bytes::Bytes;
use idempotency_actix::store::MemoryStore;
use idempotency_actix::{shutdown, Idempotency};

const CHUNKS: usize = 64;
const CHUNK: usize = 1024;

/// How many times the handler ran.
static RUNS: AtomicUsize = AtomicUsize::new(0);

/// 64 chunks of 1 KiB, more than the client's channel holds: the rest waits for the client.
async fn streamed() -> HttpResponse {
    RUNS.fetch_add(1, Ordering::SeqCst);
    let chunks = (0..CHUNKS).map(|i| Ok::<_, actix_web::Error>(Bytes::from(vec![i as u8; CHUNK])));
    HttpResponse::Created().streaming(futures_util::stream::iter(chunks))
}

fn the_body() -> Vec<u8> {
    (0..CHUNKS).flat_map(|i| vec![i as u8; CHUNK]).collect()
}

/// A client that has the head and reads nothing yet leaves no unfinished work behind within
/// 5 s; it then gets the whole body, and so does a retry: replayed when `stored`, else run
/// again (the handler's runs go from `runs_before` by one or two).
async fn paced_by_its_client(max_response_bytes: usize, key: &str, stored: bool) {
    let middleware = Idempotency::builder(MemoryStore::new())
        .max_response_bytes(max_response_bytes)
        .build();
    let app = init_service(
        App::new()
            .wrap(middleware)
            .route("/events", web::post().to(streamed)),
    )
    .await;
    let request = || {
        TestRequest::post()
            .uri("/events")
            .insert_header(("idempotency-key", key))
            .to_request()
    };
    let runs_before = RUNS.load(Ordering::SeqCst);

    let slow = call_service(&app, request()).await;
    assert_eq!(slow.status().as_u16(), 201);
    let deadline = Instant::now() + Duration::from_secs(5);
    while shutdown::unfinished_work() > 0 {
        assert!(
            Instant::now() < deadline,
            "a response {} waiting for its client still counts as unfinished work",
            if stored {
                "stored"
            } else {
                "too large to store"
            }
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(shutdown::work_finished(Duration::from_millis(100)).await);

    let body = to_bytes(slow.into_body()).await.ok().map(|b| b.to_vec());
    assert_eq!(body.as_deref(), Some(&the_body()[..]));
    let retry = call_service(&app, request()).await;
    assert_eq!(retry.status().as_u16(), 201);
    let again = to_bytes(retry.into_body()).await.ok().map(|b| b.to_vec());
    assert_eq!(again.as_deref(), Some(&the_body()[..]));
    let runs = RUNS.load(Ordering::SeqCst) - runs_before;
    assert_eq!(
        runs,
        if stored { 1 } else { 2 },
        "stored: replayed; else run again"
    );
}

#[actix_web::test]
async fn a_stream_paced_by_its_client_is_not_counted_once_stored_or_too_large() {
    paced_by_its_client(1 << 20, "stream-stored", true).await;
    paced_by_its_client(4 * CHUNK, "stream-too-large", false).await;
}
