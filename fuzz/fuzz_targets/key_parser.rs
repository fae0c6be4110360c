//! `Idempotency-Key` header values: `parse_key` never panics, and whatever it accepts obeys
//! contract C2 and survives a round trip through `to_sf_string`.
#![no_main]

use idempotency_actix::internals::{parse_key, to_sf_string, KeyError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the length limit, so the limit's edges are fuzzed too.
    let (max_len, raw) = match data.split_first() {
        Some((first, rest)) => (usize::from(*first) + 1, rest),
        None => (255, data),
    };
    match parse_key(raw, max_len) {
        Ok(key) => {
            assert!(!key.is_empty(), "empty key accepted");
            assert!(key.len() <= max_len, "key over the limit accepted");
            assert!(
                key.bytes().all(|b| (0x20..=0x7e).contains(&b)),
                "non-printable key accepted: {key:?}"
            );
            let serialised = to_sf_string(&key).expect("an accepted key is serialisable");
            assert_eq!(parse_key(serialised.as_bytes(), max_len), Ok(key));
        }
        Err(KeyError::TooLong { max }) => assert_eq!(max, max_len),
        Err(_) => {}
    }
});
