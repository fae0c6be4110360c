//! A streamed response whose record is stored is no longer counted for a graceful stop while
//! its client reads slowly, in a test binary of its own: it reads the process's
//! `shutdown::unfinished_work`. Found by review (2026-12-06): the task that paced a client
//! which had stopped reading held the count, so `stop_gracefully` waited out its whole limit
//! and warned of "idempotent work still in flight" for a response already stored.

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

#[actix_web::test]
async fn a_stored_stream_paced_by_its_client_is_not_counted_for_a_stop() {
    let app = init_service(
        App::new()
            .wrap(Idempotency::new(MemoryStore::new()))
            .route("/events", web::post().to(streamed)),
    )
    .await;
    let request = || {
        TestRequest::post()
            .uri("/events")
            .insert_header(("idempotency-key", "stream-1"))
            .to_request()
    };

    // The client has the head and reads nothing yet.
    let slow = call_service(&app, request()).await;
    assert_eq!(slow.status().as_u16(), 201);
    let deadline = Instant::now() + Duration::from_secs(5);
    while shutdown::unfinished_work() > 0 {
        assert!(
            Instant::now() < deadline,
            "a stored response waiting for its client still counts as unfinished work"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(shutdown::work_finished(Duration::from_millis(100)).await);

    // The slow client still gets the whole body, and a retry the same one, replayed.
    let body = to_bytes(slow.into_body()).await.ok().map(|b| b.to_vec());
    assert_eq!(body.as_deref(), Some(&the_body()[..]));
    let retry = call_service(&app, request()).await;
    assert_eq!(retry.status().as_u16(), 201);
    let replayed = to_bytes(retry.into_body()).await.ok().map(|b| b.to_vec());
    assert_eq!(replayed.as_deref(), Some(&the_body()[..]));
    assert_eq!(RUNS.load(Ordering::SeqCst), 1, "replayed, not run again");
}
