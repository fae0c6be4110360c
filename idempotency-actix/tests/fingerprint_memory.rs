//! The memory a request's fingerprint takes, for hostile JSON bodies (review, 2026-12-06). The
//! canonical form of a JSON body used to be built as a tree of values first: 32 bytes a node
//! and a `Vec` per array, so a 1 MiB body of tiny nested arrays (` [[[0]]],[[[0]]],...`, any
//! body that is not already canonical) took 55-67 MB for a moment, on the worker's thread. Now
//! arrays are written as they are read, and only an object's members are kept, for the sort.
//!
//! A test binary of its own: dhat is its global allocator, and it measures the peak heap.

use idempotency_actix::Fingerprint;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

/// The peak heap (bytes) while `body` is fingerprinted as JSON, beyond what was live before.
fn peak_while_fingerprinting(body: &[u8]) -> usize {
    let _profiler = dhat::Profiler::builder().testing().build();
    let before = dhat::HeapStats::get().curr_bytes;
    let fingerprint = Fingerprint::of_request("POST", "/payments", "", true, body);
    std::hint::black_box(fingerprint);
    dhat::HeapStats::get().max_bytes.saturating_sub(before)
}

#[test]
fn hostile_json_costs_a_small_multiple_of_its_size() {
    const SIZE: usize = 1 << 20;
    let repeated = |unit: &str, inner: &str| {
        // One leading space: not canonical as written, so the full canonicalisation runs.
        let mut body = String::from(" [");
        while body.len() < SIZE {
            body.push_str(unit);
            body.push(',');
        }
        body.push_str(inner);
        body.push(']');
        body
    };
    let nested = format!("{}0{}", "[".repeat(60), "]".repeat(60));
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
    ];
    for (what, body) in bodies {
        let peak = peak_while_fingerprinting(body.as_bytes());
        assert!(
            peak <= 4 * body.len(),
            "{what}: {peak} bytes at peak for a body of {} ({}x)",
            body.len(),
            peak / body.len()
        );
    }
}
