//! Micro benchmarks of the request path, one part at a time (key parsing, fingerprinting, the
//! store's reserve for a miss and for a replay, building the replayed response) and whole: one
//! in-process request through the middleware (memory store, miss and replay) next to the same
//! request on a bare `App`. A regression shows here in nanoseconds before it shows in the load
//! benchmark's throughput. Run with `cargo bench -p idempotency-actix --bench hot_path`; the load
//! benchmark over real sockets is `bash bench/load.sh` (see `docs/benchmarks.md`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use actix_web::http::{header, Method, StatusCode};
use actix_web::{test, web, App, HttpResponse};
use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use idempotency_actix::internals::{parse_key, replay_response};
use idempotency_actix::store::{
    CachedStore, IdempotencyStore, MemoryStore, ReservationToken, ReserveOutcome, Scope,
    StoredResponse,
};
use idempotency_actix::{Fingerprint, Idempotency};

/// A JSON document of about `target` bytes: an order with line items, compact and with its keys
/// in order (serde_json's map is sorted), so it is its own canonical form and the fingerprint
/// hashes it as it is. See [`json_variants`] for the bodies that must be canonicalised.
fn json_body(target: usize) -> Vec<u8> {
    let doc = |items: usize| {
        let items: Vec<_> = (0..items)
            .map(|i| {
                serde_json::json!({
                    "sku": format!("SKU-{i:06}"), "qty": i % 7 + 1, "price": 1999,
                    "name": "A reasonably named product", "tags": ["a", "b"],
                })
            })
            .collect();
        let doc = serde_json::json!({
            "merchant": "m_4242", "currency": "EUR", "amount": 1000,
            "metadata": {"order": "o-1893", "channel": "web"},
            "items": items,
        });
        serde_json::to_vec(&doc).unwrap_or_default()
    };
    let empty = doc(0).len();
    let per_item = doc(1).len() - empty;
    doc(target.saturating_sub(empty) / per_item)
}

/// `len` pseudo-random bytes (xorshift; no dependency needed).
fn binary_body(len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("key");
    let token = b"3f8e2b7c-5a1d-4e8f-9b2a-6c4d1e0f7a93";
    let sf = b"\"3f8e2b7c-5a1d-4e8f-9b2a-6c4d1e0f7a93\"";
    group.bench_function("parse_token_36B", |b| {
        b.iter(|| parse_key(black_box(token), 255))
    });
    group.bench_function("parse_sf_string_36B", |b| {
        b.iter(|| parse_key(black_box(sf), 255))
    });
    group.finish();
}

fn tokens(c: &mut Criterion) {
    let mut group = c.benchmark_group("store");
    group.bench_function("reservation_token", |b| b.iter(ReservationToken::random));
    group.finish();
}

fn scope(key: String) -> Scope {
    Scope {
        tenant: String::new(),
        method: "POST".into(),
        path: "/payments".into(),
        key,
    }
}

fn stored() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("location".into(), Bytes::from_static(b"/payments/1")),
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
        ],
        body: Bytes::from_static(
            br#"{"id":1,"amount":1000,"currency":"EUR","status":"succeeded"}"#,
        ),
    }
}

/// The memory store's own work per request, without the middleware: reserve a new key and
/// complete it (a miss), and reserve a completed key (a replay).
fn store_calls(c: &mut Criterion) {
    let rt = match actix_rt::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => panic!("actix runtime: {e}"),
    };
    let mut group = c.benchmark_group("store");
    let fingerprint = Fingerprint([7; 32]);
    let lease = Duration::from_secs(60);
    let ttl = Duration::from_secs(86_400);
    let response = stored();
    let store = MemoryStore::builder()
        .max_entries(10_000_000)
        .max_bytes(usize::MAX)
        .build();
    let mut n = 0u64;
    group.bench_function("memory_reserve_complete_miss", |b| {
        b.iter(|| {
            n += 1;
            let scope = scope(format!("miss-{n}"));
            rt.block_on(async {
                match store.reserve(&scope, &fingerprint, lease).await {
                    Ok(ReserveOutcome::Reserved { token }) => {
                        black_box(store.complete(&scope, &token, &response, ttl).await.is_ok())
                    }
                    other => panic!("expected a reservation: {other:?}"),
                }
            })
        })
    });
    let replayed = scope("replayed".into());
    rt.block_on(async {
        if let Ok(ReserveOutcome::Reserved { token }) =
            store.reserve(&replayed, &fingerprint, lease).await
        {
            let _ = store.complete(&replayed, &token, &response, ttl).await;
        }
    });
    group.bench_function("memory_reserve_replay", |b| {
        b.iter(|| {
            rt.block_on(async {
                match store
                    .reserve(black_box(&replayed), &fingerprint, lease)
                    .await
                {
                    Ok(outcome @ ReserveOutcome::Completed { .. }) => black_box(outcome),
                    other => panic!("expected a replay: {other:?}"),
                }
            })
        })
    });
    group.finish();

    // Building the replayed response from a stored one (headers decoded, marked as a replay).
    let mut group = c.benchmark_group("replay");
    let req = test::TestRequest::default()
        .method(Method::POST)
        .uri("/payments")
        .to_http_request();
    group.bench_function("build_response", |b| {
        b.iter(
            || match replay_response(black_box(response.clone()), &req, &[]) {
                Ok(response) => black_box(response),
                Err(problem) => panic!("replay refused: {problem:?}"),
            },
        )
    });
    group.finish();
}

/// The same document in two forms that need canonicalising: pretty-printed (the canonical-form
/// check fails at its second byte) and compact with one key out of order at its very end (the
/// check reads the whole body before it fails: the worst case of the shortcut).
fn json_variants(body: &[u8]) -> [(&'static str, Vec<u8>); 2] {
    let pretty = serde_json::from_slice::<serde_json::Value>(body)
        .and_then(|doc| serde_json::to_vec_pretty(&doc))
        .unwrap_or_default();
    let mut late = body[..body.len().saturating_sub(1)].to_vec();
    late.extend_from_slice(br#","a":0}"#);
    [("json_pretty", pretty), ("json_late_unsorted", late)]
}

fn fingerprints(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    for (label, size) in [("200B", 200), ("4KiB", 4096), ("64KiB", 65536)] {
        let json = json_body(size);
        group.throughput(Throughput::Bytes(json.len() as u64));
        group.bench_with_input(BenchmarkId::new("json", label), &json, |b, body| {
            b.iter(|| Fingerprint::of_request("POST", "/payments", "", true, black_box(body)))
        });
        for (name, variant) in json_variants(&json) {
            group.throughput(Throughput::Bytes(variant.len() as u64));
            group.bench_with_input(BenchmarkId::new(name, label), &variant, |b, body| {
                b.iter(|| Fingerprint::of_request("POST", "/payments", "", true, black_box(body)))
            });
        }
        let binary = binary_body(size);
        group.throughput(Throughput::Bytes(binary.len() as u64));
        group.bench_with_input(BenchmarkId::new("binary", label), &binary, |b, body| {
            b.iter(|| Fingerprint::of_request("POST", "/payments", "", false, black_box(body)))
        });
    }
    group.finish();
}

const PAYMENT: &[u8] = br#"{"amount":1000,"currency":"EUR","customer":"cus_42"}"#;

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
        .set_payload(PAYMENT)
        .to_request()
}

/// Times `iters` requests inside one runtime entry, so the runtime's own cost per `block_on`
/// is not part of the number. `key(i)` gives the key of request `i`.
fn timed<S, B>(
    rt: &actix_rt::Runtime,
    app: &S,
    iters: u64,
    offset: u64,
    key: impl Fn(u64) -> String,
) -> Duration
where
    S: actix_web::dev::Service<
        actix_http::Request,
        Response = actix_web::dev::ServiceResponse<B>,
        Error = actix_web::Error,
    >,
    B: actix_web::body::MessageBody,
{
    rt.block_on(async {
        let start = Instant::now();
        for i in 0..iters {
            let response = test::call_service(app, request(&key(offset + i))).await;
            if response.status() != StatusCode::CREATED {
                panic!("unexpected status {}", response.status());
            }
            black_box(response);
        }
        start.elapsed()
    })
}

fn requests(c: &mut Criterion) {
    let rt = match actix_rt::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => panic!("actix runtime: {e}"),
    };
    let mut group = c.benchmark_group("request");
    group.throughput(Throughput::Elements(1));

    let bare = rt.block_on(test::init_service(
        App::new().route("/payments", web::post().to(create_payment)),
    ));
    let mut n = 0u64;
    group.bench_function("bare", |b| {
        b.iter_custom(|iters| {
            n += iters;
            timed(&rt, &bare, iters, n, |i| format!("bare-{i}"))
        })
    });

    // Miss: every request a new key. The store is sized so that eviction never runs here
    // (the memory store's capacity path is measured by the load benchmark).
    let store = MemoryStore::builder()
        .max_entries(10_000_000)
        .max_bytes(usize::MAX)
        .build();
    let with_memory = rt.block_on(test::init_service(
        App::new()
            .wrap(Idempotency::new(store))
            .route("/payments", web::post().to(create_payment)),
    ));
    let mut n = 0u64;
    group.bench_function("memory_miss", |b| {
        b.iter_custom(|iters| {
            n += iters;
            timed(&rt, &with_memory, iters, n, |i| format!("miss-{i}"))
        })
    });

    // Replay: 1,000 keys stored first, then replayed round-robin.
    timed(&rt, &with_memory, 1000, 0, |i| format!("replay-{i}"));
    group.bench_function("memory_replay", |b| {
        b.iter_custom(|iters| {
            timed(&rt, &with_memory, iters, 0, |i| {
                format!("replay-{}", i % 1000)
            })
        })
    });

    // The same replay with the in-process cache of completed records in front.
    let cached = CachedStore::new(MemoryStore::new());
    let with_cache = rt.block_on(test::init_service(
        App::new()
            .wrap(Idempotency::new(cached))
            .route("/payments", web::post().to(create_payment)),
    ));
    timed(&rt, &with_cache, 1000, 0, |i| format!("replay-{i}"));
    group.bench_function("cached_memory_replay", |b| {
        b.iter_custom(|iters| {
            timed(&rt, &with_cache, iters, 0, |i| {
                format!("replay-{}", i % 1000)
            })
        })
    });
    group.finish();
}

// The macro generates an undocumented `pub fn benches`.
#[allow(missing_docs)]
mod group {
    use super::*;

    criterion_group! {
        name = benches;
        config = Criterion::default()
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        targets = keys, tokens, store_calls, fingerprints, requests
    }
}
criterion_main!(group::benches);
