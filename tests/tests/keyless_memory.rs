//! A keyless request in transactional mode reads its body before its transaction opens: within
//! about `max_body_bytes` of memory, however the client splits it (a larger body is refused). A binary of its own, because
//! it counts the heap with dhat's global allocator.

use actix_web::dev::Service;
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse};
use bytes::Bytes;
use futures_util::StreamExt;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::{Idempotency, IdempotentTx};
use idempotency_e2e::TestDb;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Reads the body as a stream and answers its length.
async fn count_body(tx: IdempotentTx, mut body: web::Payload) -> HttpResponse {
    drop(tx);
    let mut n = 0usize;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(chunk) => n += chunk.len(),
            Err(_) => return HttpResponse::BadRequest().finish(),
        }
    }
    HttpResponse::Created().body(n.to_string())
}

/// A 1 MiB body in 1-byte chunks (`Transfer-Encoding: chunked` allows it, 6 bytes a chunk on
/// the wire) used to peak at 33x `max_body_bytes`: each chunk was kept as its own `Bytes` in a
/// `Vec` (found by review, 2026-12-04).
#[actix_web::test]
async fn a_keyless_body_is_buffered_within_max_body_bytes_of_memory() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let db = TestDb::new().await;
    let store = PostgresStore::connect(&db.url).await.expect("store");
    let max = 1024 * 1024;
    let app = test::init_service(
        App::new().service(
            web::scope("")
                .wrap(
                    Idempotency::builder(store.clone())
                        .max_body_bytes(max)
                        .transactional()
                        .build(),
                )
                .route("/payments", web::post().to(count_body)),
        ),
    )
    .await;
    for size in [max, max + 1] {
        let chunks = futures_util::stream::iter(
            (0..size).map(|_| Ok::<_, actix_web::error::PayloadError>(Bytes::from_static(b"x"))),
        );
        let chunks: std::pin::Pin<
            Box<dyn futures_util::Stream<Item = Result<Bytes, actix_web::error::PayloadError>>>,
        > = Box::pin(chunks);
        let request = test::TestRequest::post().uri("/payments").to_request();
        let (request, _) = request.replace_payload(actix_http::Payload::from(chunks));
        let before = dhat::HeapStats::get();
        let response = app.call(request).await.expect("response");
        let after = dhat::HeapStats::get();
        if size <= max {
            assert_eq!(response.status(), StatusCode::CREATED);
            let body = test::read_body(response).await;
            assert_eq!(
                body,
                size.to_string().as_bytes(),
                "the handler got every byte"
            );
        } else {
            // Over the limit: refused before any connection is taken (transactional mode
            // reads a keyless body whole first).
            assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        }
        let peak = after.max_bytes.saturating_sub(before.curr_bytes);
        assert!(
            after.max_bytes <= before.max_bytes || peak <= 4 * max,
            "one keyless request with a {size}-byte body peaked at {peak} bytes of heap over \
             what was live before it ({}x max_body_bytes)",
            peak / max
        );
    }
}
