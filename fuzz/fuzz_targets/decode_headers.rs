//! Stored response headers read back from the database: the decoder never panics or
//! over-allocates on corrupt bytes, and whatever it accepts re-encodes to the same bytes.
#![no_main]

use idempotency_actix::store::StoredResponse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(headers) = StoredResponse::decode_headers(data) {
        let response = StoredResponse {
            status: 200,
            headers,
            body: Default::default(),
        };
        assert_eq!(response.encode_headers(), data, "decode/encode is not a bijection");
    }
});
