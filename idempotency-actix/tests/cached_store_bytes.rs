//! `CachedStore`'s byte bound against the heap it really holds (found by review, 2026-12-04:
//! the weigher counted header and body lengths and a flat 256 bytes an entry, and the cache
//! held 2.2 times `max_bytes` for a typical response, 14 times for a thousand small headers).
//!
//! This measures the live heap the cache holds (dhat, testing mode: the bytes requested,
//! before any allocator rounding) against `max_bytes`, with the wrapped store copying the
//! response out as `PostgresStore` does (every record it returns is freshly decoded from the
//! row). A test binary of its own: dhat is its global allocator.

use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::{
    CachedStore, Fingerprint, IdempotencyStore, MemoryStore, ReservationToken, ReserveOutcome,
    Scope, StoreError, StoredResponse, WriteOutcome,
};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const FP: Fingerprint = Fingerprint([0x22; 32]);
const LEASE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// A store that hands out a fresh copy of every response, as `PostgresStore` does (it decodes
/// the row: `Bytes::from(Vec)` for the body, `Bytes::copy_from_slice` per header value).
#[derive(Clone, Default)]
struct Copying(MemoryStore);

fn deep_copy(r: &StoredResponse) -> StoredResponse {
    StoredResponse {
        status: r.status,
        headers: r
            .headers
            .iter()
            .map(|(n, v)| (n.clone(), Bytes::copy_from_slice(v)))
            .collect(),
        body: Bytes::from(r.body.to_vec()),
    }
}

impl IdempotencyStore for Copying {
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        Ok(match self.0.reserve(scope, fingerprint, lease).await? {
            ReserveOutcome::Completed {
                fingerprint,
                response,
                expires_in,
            } => ReserveOutcome::Completed {
                fingerprint,
                response: deep_copy(&response),
                expires_in,
            },
            other => other,
        })
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.0.complete(scope, token, response, ttl).await
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.0.release(scope, token).await
    }

    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.0.purge_expired(grace).await
    }
}

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "tenant-1".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn live_bytes() -> u64 {
    dhat::HeapStats::get().curr_bytes as u64
}

/// Fill a cache of `max_bytes` with replays of `response` and report
/// (entries, bytes as weighed, live heap the cache holds).
async fn fill(max_bytes: u64, response: &StoredResponse, records: usize) -> (usize, u64, u64) {
    // The records stay in `shared` when the cache is dropped (the store's clones share them).
    let shared = Copying::default();
    let store = CachedStore::builder(shared.clone())
        .max_bytes(max_bytes)
        .max_response_bytes(1 << 20)
        .build();
    for i in 0..records {
        let s = scope(&format!("key-{i:06}"));
        let Ok(ReserveOutcome::Reserved { token }) = store.reserve(&s, &FP, LEASE).await else {
            panic!("not reserved");
        };
        let done = store.complete(&s, &token, response, DAY).await;
        assert_eq!(done.ok(), Some(WriteOutcome::Applied));
    }
    assert!(store.is_empty());
    // Replay every record twice (the second one makes it "frequent" for TinyLFU admission).
    for _ in 0..2 {
        for i in 0..records {
            let s = scope(&format!("key-{i:06}"));
            let outcome = store.reserve(&s, &FP, LEASE).await;
            assert!(matches!(outcome, Ok(ReserveOutcome::Completed { .. })));
        }
    }
    let entries = store.len();
    let weighed = store.bytes();
    let held = live_bytes();
    // What dropping the cache frees is its heap: the entries (and moka's own tables, a few
    // kilobytes here); the records stay with `shared`.
    drop(store);
    let freed = held.saturating_sub(live_bytes());
    drop(shared);
    (entries, weighed, freed)
}

#[tokio::test(flavor = "current_thread")]
async fn the_byte_bound_is_the_heap_the_cache_holds() {
    let _profiler = dhat::Profiler::builder().testing().build();
    const MAX: u64 = 1 << 20; // 1 MiB

    // A typical payment response: a small JSON body and a handful of headers.
    let typical = StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            (
                "location".into(),
                Bytes::from_static(b"/payments/pay_8f14e45fceea167a"),
            ),
            (
                "x-request-id".into(),
                Bytes::from_static(b"6f1c2a9e-3b7d-4c1e-9a55-0d2f4b8e7c31"),
            ),
            ("cache-control".into(), Bytes::from_static(b"no-store")),
            ("vary".into(), Bytes::from_static(b"accept-encoding")),
            ("x-ratelimit-remaining".into(), Bytes::from_static(b"99")),
        ],
        body: Bytes::from(vec![b'x'; 200]),
    };
    // A response whose handler sets many small headers (e.g. one per line item / echoed field).
    let many_headers = StoredResponse {
        status: 200,
        headers: (0..1000).map(|i| (format!("x{i}"), Bytes::new())).collect(),
        body: Bytes::new(),
    };

    let mut report = Vec::new();
    let mut ratios = Vec::new();
    for (name, response, records) in [
        ("typical", &typical, 4000usize),
        ("many headers", &many_headers, 400usize),
    ] {
        let (entries, weighed, freed) = fill(MAX, response, records).await;
        assert!(entries > 0, "{name}: nothing was cached");
        assert!(
            weighed <= MAX,
            "{name}: weighed {weighed} over max_bytes {MAX}"
        );
        let ratio = freed as f64 / weighed as f64;
        ratios.push(ratio);
        report.push(format!(
            "{name}: {entries} entries, weighed {weighed} bytes (max_bytes {MAX}), \
             their heap (freed with the cache) {freed} bytes = {ratio:.2} x weighed"
        ));
    }
    let report = report.join("\n");
    println!("{report}");
    // The charges are the heap: never well under it (the bound would be passed), and not far
    // over it (the bound would hold far fewer entries than it says).
    for ratio in ratios {
        assert!(
            (0.6..=1.1).contains(&ratio),
            "the cache's charges are not its heap:\n{report}"
        );
    }
}
