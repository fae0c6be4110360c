//! Heap allocations per request, counted by a counting global allocator (dhat's, in its
//! testing mode: it counts every allocation of the process). Run with
//! `cargo bench -p idempotency-actix --bench allocations`; it prints one table and exits
//! non-zero when a count is over its target (the targets are in `docs/benchmarks.md`).
//!
//! Each case runs the same in-process request (`test::call_service`, as in `hot_path`) many
//! times and divides the allocations by the requests. The bare `App` is counted too, and the
//! middleware's own count is the difference: the test request and actix's own work are the
//! bare case's.

use actix_web::http::{header, Method, StatusCode};
use actix_web::{test, web, App, HttpResponse};
use idempotency_actix::store::{CachedStore, MemoryStore};
use idempotency_actix::Idempotency;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// Requests per counted case (after a warm-up of the same size).
const REQUESTS: u64 = 2_000;

/// Targets: allocations per request that the middleware may add over the bare `App`.
const TARGET_MISS: f64 = 40.0;
const TARGET_REPLAY: f64 = 20.0;
/// Bytes allocated per request over the bare `App`'s. Guards the size of the request's futures:
/// a state machine built inside another `async` body takes room in both, and it is allocated
/// (and copied) on every request (7,082 bytes over bare per replay before that was fixed,
/// 2,834 after; `docs/benchmarks.md`, "Futures by the kilobyte").
const TARGET_MISS_BYTES: f64 = 5_000.0;
const TARGET_REPLAY_BYTES: f64 = 4_000.0;

async fn create_payment() -> HttpResponse {
    HttpResponse::Created()
        .insert_header((header::LOCATION, "/payments/1"))
        .content_type("application/json")
        .body(r#"{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}"#)
}

fn request(key: &str) -> actix_http::Request {
    test::TestRequest::default()
        .method(Method::POST)
        .uri("/payments")
        .insert_header((header::CONTENT_TYPE, "application/json"))
        .insert_header(("idempotency-key", key))
        .set_payload(&br#"{"amount":1000,"currency":"EUR","customer":"cus_42"}"#[..])
        .to_request()
}

/// Allocations (blocks, bytes) per request over `REQUESTS` requests with keys `key(i)`.
async fn count<S, B>(app: &S, key: impl Fn(u64) -> String) -> (f64, f64)
where
    S: actix_web::dev::Service<
        actix_http::Request,
        Response = actix_web::dev::ServiceResponse<B>,
        Error = actix_web::Error,
    >,
    B: actix_web::body::MessageBody,
{
    let before = dhat::HeapStats::get();
    for i in 0..REQUESTS {
        let response = test::call_service(app, request(&key(i))).await;
        assert_eq!(response.status(), StatusCode::CREATED);
        // The body is read as a server would send it.
        let _ = test::read_body(response).await;
    }
    let after = dhat::HeapStats::get();
    let n = REQUESTS as f64;
    (
        (after.total_blocks - before.total_blocks) as f64 / n,
        (after.total_bytes - before.total_bytes) as f64 / n,
    )
}

fn main() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let rt = match actix_rt::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => panic!("actix runtime: {e}"),
    };
    let results = rt.block_on(async {
        let bare =
            test::init_service(App::new().route("/payments", web::post().to(create_payment))).await;
        count(&bare, |i| format!("bare-{i}")).await; // warm-up
        let bare_miss = count(&bare, |i| format!("bare-{i}")).await;

        let store = MemoryStore::builder()
            .max_entries(10_000_000)
            .max_bytes(usize::MAX)
            .build();
        let memory = test::init_service(
            App::new()
                .wrap(Idempotency::new(store))
                .route("/payments", web::post().to(create_payment)),
        )
        .await;
        count(&memory, |i| format!("warm-{i}")).await;
        let miss = count(&memory, |i| format!("miss-{i}")).await;
        // Replays of the keys the miss case stored (the keys have the same length).
        let replay = count(&memory, |i| format!("miss-{i}")).await;

        let cached = test::init_service(
            App::new()
                .wrap(Idempotency::new(CachedStore::new(MemoryStore::new())))
                .route("/payments", web::post().to(create_payment)),
        )
        .await;
        count(&cached, |i| format!("miss-{i}")).await;
        count(&cached, |i| format!("miss-{i}")).await; // first replays fill the cache
        let cached_replay = count(&cached, |i| format!("miss-{i}")).await;
        (bare_miss, miss, replay, cached_replay)
    });
    let (bare, miss, replay, cached_replay) = results;
    println!("allocations per request ({REQUESTS} requests each, in-process)");
    println!(
        "{:<32} {:>8} {:>10} {:>12} {:>8} {:>16} {:>8}",
        "case", "allocs", "bytes", "over bare", "target", "bytes over bare", "target"
    );
    let mut failed = false;
    let mut verdict = |over: f64, target: Option<f64>| match target {
        Some(t) if over > t => {
            failed = true;
            format!("<= {t} MISSED")
        }
        Some(t) => format!("<= {t}"),
        None => "-".into(),
    };
    for (name, (blocks, bytes), targets) in [
        ("bare App", bare, None),
        (
            "memory store, miss",
            miss,
            Some((TARGET_MISS, TARGET_MISS_BYTES)),
        ),
        (
            "memory store, replay",
            replay,
            Some((TARGET_REPLAY, TARGET_REPLAY_BYTES)),
        ),
        (
            "CachedStore<Memory>, replay",
            cached_replay,
            Some((TARGET_REPLAY, TARGET_REPLAY_BYTES)),
        ),
    ] {
        let (over, over_bytes) = (blocks - bare.0, bytes - bare.1);
        let count_verdict = verdict(over, targets.map(|t| t.0));
        let bytes_verdict = verdict(over_bytes, targets.map(|t| t.1));
        println!(
            "{name:<32} {blocks:>8.1} {bytes:>10.0} {over:>12.1} {count_verdict:>8} \
             {over_bytes:>16.0} {bytes_verdict:>8}"
        );
    }
    if failed {
        std::process::exit(1);
    }
}
