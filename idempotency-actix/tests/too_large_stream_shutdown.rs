//! A streamed response too large to store is no longer counted for a graceful stop while its
//! client reads slowly, in a test binary of its own: it reads the process's
//! `shutdown::unfinished_work`. Found by review (2026-12-07): once the copy went over
//! `max_response_bytes` and the key was released, the rest of the body was forwarded at the
//! client's pace on the counted task, so a client that stopped reading held `stop_gracefully`
//! for its whole limit, though nothing was left to store.

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

/// 64 chunks of 1 KiB: over the 4 KiB limit below, and more than the client's channel holds.
async fn streamed() -> HttpResponse {
    RUNS.fetch_add(1, Ordering::SeqCst);
    let chunks = (0..CHUNKS).map(|i| Ok::<_, actix_web::Error>(Bytes::from(vec![i as u8; CHUNK])));
    HttpResponse::Created().streaming(futures_util::stream::iter(chunks))
}

fn the_body() -> Vec<u8> {
    (0..CHUNKS).flat_map(|i| vec![i as u8; CHUNK]).collect()
}

#[actix_web::test]
async fn a_stream_too_large_to_store_paced_by_its_client_is_not_counted_for_a_stop() {
    let middleware = Idempotency::builder(MemoryStore::new())
        .max_response_bytes(4 * CHUNK)
        .build();
    let app = init_service(
        App::new()
            .wrap(middleware)
            .route("/export", web::post().to(streamed)),
    )
    .await;
    let request = || {
        TestRequest::post()
            .uri("/export")
            .insert_header(("idempotency-key", "export-1"))
            .to_request()
    };

    // The client has the head and reads nothing yet.
    let slow = call_service(&app, request()).await;
    assert_eq!(slow.status().as_u16(), 201);
    let deadline = Instant::now() + Duration::from_secs(5);
    while shutdown::unfinished_work() > 0 {
        assert!(
            Instant::now() < deadline,
            "a response too large to store, waiting for its client, still counts as unfinished work"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(shutdown::work_finished(Duration::from_millis(100)).await);

    // The slow client still gets the whole body; the key was released, so a retry runs again.
    let body = to_bytes(slow.into_body()).await.ok().map(|b| b.to_vec());
    assert_eq!(body.as_deref(), Some(&the_body()[..]));
    let retry = call_service(&app, request()).await;
    assert_eq!(retry.status().as_u16(), 201);
    let again = to_bytes(retry.into_body()).await.ok().map(|b| b.to_vec());
    assert_eq!(again.as_deref(), Some(&the_body()[..]));
    assert_eq!(RUNS.load(Ordering::SeqCst), 2, "not stored: run again");
}
