//! Request bodies: the JSON canonicaliser never panics or overflows the stack, its output is a
//! fixed point (canonicalising it again changes nothing), what the fingerprint's shortcut takes
//! for canonical is (`is_canonical_json`), and the fingerprint is deterministic.
#![no_main]

use idempotency_actix::internals::{canonical_json, is_canonical_json};
use idempotency_actix::Fingerprint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(canonical) = canonical_json(data) {
        assert_eq!(
            canonical_json(&canonical).as_deref(),
            Some(&canonical[..]),
            "canonical form is not a fixed point"
        );
        assert!(canonical.len() <= data.len() * 6 + 2, "canonical form blew up");
    }
    if is_canonical_json(data) {
        assert_eq!(
            canonical_json(data).as_deref(),
            Some(data),
            "taken for canonical, but canonicalising changes it"
        );
    }
    let a = Fingerprint::of_request("POST", "/p", "q=1", true, data);
    let b = Fingerprint::of_request("POST", "/p", "q=1", true, data);
    assert_eq!(a, b);
});
