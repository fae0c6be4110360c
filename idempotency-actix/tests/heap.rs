//! What the heap really holds, measured with dhat as this binary's global allocator (a test
//! binary of its own for that), where a bound is stated in bytes:
//! - the memory a request's fingerprint takes, for hostile JSON bodies (review, 2026-12-06).
//!   The canonical form of a JSON body used to be built as a tree of values first: 32 bytes a
//!   node and a `Vec` per array, so a 1 MiB body of tiny nested arrays (` [[[0]]],[[[0]]],...`,
//!   any body that is not already canonical) took 55-67 MB for a moment, on the worker's
//!   thread. Then each object member was kept in buffers of its own for the sort (22 times the
//!   body for one wide object of tiny members) and copied level by level (359 times the body
//!   allocated, 120 levels out of order). Now the canonical form is written once and an object
//!   out of order keeps only its members' positions;
//! - the memory a `MemoryStore` keeps beyond what it charges to its byte bound.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use idempotency_actix::store::{
    IdempotencyStore, MemoryStore, ReserveOutcome, Scope, StoredResponse,
};
use idempotency_actix::Fingerprint;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// The tests of this binary run one after the other, each whole: dhat counts the heap of the
/// process, so another test allocating meanwhile would count too (and one profiler at a time).
fn alone() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// While `body` is fingerprinted as JSON: the peak heap (bytes) beyond what was live before,
/// and the bytes allocated in all (what was copied from one buffer into another shows here).
fn heap_while_fingerprinting(body: &[u8]) -> (usize, u64) {
    let _profiler = dhat::Profiler::builder().testing().build();
    let before = dhat::HeapStats::get();
    let fingerprint = Fingerprint::of_request("POST", "/payments", "", true, body);
    std::hint::black_box(fingerprint);
    let after = dhat::HeapStats::get();
    (
        after.max_bytes.saturating_sub(before.curr_bytes),
        after.total_bytes - before.total_bytes,
    )
}

#[test]
fn hostile_json_costs_a_small_multiple_of_its_size() {
    let _alone = alone();
    const SIZE: usize = 1 << 20;
    // `open`, then `unit,` until the body has SIZE bytes, then `last` and `close`. One leading
    // space: not canonical as written, so the full canonicalisation runs.
    let filled = |open: &str, unit: &str, last: &str, close: &str| {
        let mut body = format!(" {open}");
        while body.len() < SIZE {
            body.push_str(unit);
            body.push(',');
        }
        body.push_str(last);
        body.push_str(close);
        body
    };
    let repeated = |unit: &str, last: &str| filled("[", unit, last, "]");
    let wide = |unit: &str, last: &str| filled("{", unit, last, "}");
    let nested = format!("{}0{}", "[".repeat(60), "]".repeat(60));
    // `{"b":{"b":...{"b":[0,0,...],"a":0}...,"a":0},"a":0}`: every level out of order, so
    // every level is sorted, with the whole array inside.
    let deep_unsorted = {
        const LEVELS: usize = 120;
        let mut body = String::from(" ");
        body.push_str(&r#"{"b":"#.repeat(LEVELS));
        body.push('[');
        while body.len() < SIZE {
            body.push_str("0,");
        }
        body.push_str("0]");
        body.push_str(&r#","a":0}"#.repeat(LEVELS));
        body
    };
    let larger = format!(r#"{{"b":"{}","a":0}}"#, "x".repeat(130));
    let bodies = [
        ("flat array", repeated("0", "0")),
        ("arrays of one", repeated("[0]", "[0]")),
        ("arrays three deep", repeated("[[[0]]]", "[[[0]]]")),
        ("arrays 60 deep", repeated(&nested, &nested)),
        ("objects of one", repeated(r#"{"a":0}"#, r#"{"a":0}"#)),
        (
            "objects in objects",
            repeated(r#"{"b":{"a":[0]}}"#, r#"{"b":{"a":[0]}}"#),
        ),
        // Review, 2026-12-06: each member was kept for the sort as a key and a buffer of its
        // own, some 50 bytes for these 5: 14-20 times the body.
        (
            "one wide object of tiny members",
            wide(r#""":0"#, r#""":0"#),
        ),
        (
            "one wide object, keys out of order",
            wide(r#""b":0,"a":0"#, r#""a":0"#),
        ),
        // The smallest members for which every position is kept twice (review of the fix).
        ("one wide object of tiny members, the first out of order", {
            let mut body = wide(r#""":0"#, r#""":0"#);
            body.replace_range(..2, r#" {"a":0,"#);
            body
        }),
        // Review, 2026-12-06: each level's members were written to buffers of their own and
        // copied into the level above, so the array was copied 120 times.
        ("objects 120 deep, each out of order", deep_unsorted),
        // Review of the fix: a record for each of these took 5 times the body.
        (
            "objects of two, keys out of order",
            repeated(r#"{"a":0,"":0}"#, r#"{"a":0,"":0}"#),
        ),
        // Just over the size sorted in place: one record each.
        (
            "larger objects, keys out of order",
            repeated(&larger, &larger),
        ),
    ];
    let mut over = Vec::new();
    for (what, body) in bodies {
        let (peak, allocated) = heap_while_fingerprinting(body.as_bytes());
        let size = body.len();
        if peak > 4 * size || allocated > 8 * size as u64 {
            over.push(format!(
                "{what}: {peak} bytes at peak ({}x), {allocated} allocated ({}x), for a body of {size}",
                peak / size,
                allocated / size as u64
            ));
        }
    }
    assert!(over.is_empty(), "{over:#?}");
}

/// Records deleted behind a longer-lived one (mixed TTLs on one store: routes with their own
/// `ttl`) left their entries in the completion queue until it was compacted, which happens
/// only once the entries outnumber twice the records; each entry held its record's scope, a
/// path as long as the request line allows, outside the byte bound. With a few hundred small
/// long-lived records, 200 expired records with 32 KiB paths kept some 6.5 MB alive under a
/// bound that charged 0.2 MB (review, 2026-12-06). The queue now holds no scope.
#[test]
fn a_memory_store_keeps_no_deleted_records_scope() {
    let _alone = alone();
    // Made before the profiler starts: its own allocations are not the store's.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(deleted_records_scopes());
}

async fn deleted_records_scopes() {
    let _profiler = dhat::Profiler::builder().testing().build();
    let store = MemoryStore::new();
    let scope = |path: String, key: &str| Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path,
        key: key.into(),
    };
    let fp = Fingerprint([1; 32]);
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: bytes::Bytes::from_static(b"ok"),
    };
    let complete = |s: Scope, ttl: Duration| {
        let (store, response) = (&store, &response);
        async move {
            let Ok(ReserveOutcome::Reserved { token }) =
                store.reserve(&s, &fp, Duration::from_secs(60)).await
            else {
                panic!("not reserved");
            };
            store
                .complete(&s, &token, response, ttl)
                .await
                .expect("complete");
        }
    };
    for i in 0..300 {
        complete(
            scope("/a".into(), &format!("long-{i}")),
            Duration::from_secs(3600),
        )
        .await;
    }
    let long_path = format!("/b/{}", "x".repeat(32 * 1024));
    for i in 0..200 {
        complete(
            scope(long_path.clone(), &format!("short-{i}")),
            Duration::from_millis(1),
        )
        .await;
    }
    drop(long_path);
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        store.purge_expired(Duration::ZERO).await.expect("purge"),
        200
    );
    let charged = store.bytes_used();
    let live = dhat::HeapStats::get().curr_bytes;
    assert!(
        live < charged + 2 * 1024 * 1024,
        "{live} bytes live for {charged} charged: deleted records' scopes are still held"
    );
}
