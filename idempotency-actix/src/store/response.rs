//! The stored form of a response, and the binary encoding of its headers.

use bytes::Bytes;

/// A response as it is stored and replayed: status, the headers that may be replayed (see
/// contract C11), and the body byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// HTTP status code.
    pub status: u16,
    /// Header names (lower case) and raw values, in response order. Values are bytes because
    /// HTTP allows non-UTF-8 (obs-text) header values.
    pub headers: Vec<(String, Bytes)>,
    /// The body as sent.
    pub body: Bytes,
}

/// Why stored header bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored response headers are corrupt: {0}")]
pub struct HeaderDecodeError(&'static str);

const FORMAT_V1: u8 = 1;

impl StoredResponse {
    /// Approximate heap size of the record, for capacity accounting.
    pub fn size_bytes(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(n, v)| n.len() + v.len())
                .sum::<usize>()
    }

    /// Encode the headers for a byte column: a version byte, a u32 count, then for each header
    /// a u32 name length, the name, a u32 value length and the value (big-endian lengths).
    /// Length prefixes instead of separators, so any byte may appear in a value.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_headers_len());
        self.encode_headers_into(&mut out);
        out
    }

    /// The length of [`encode_headers`](Self::encode_headers)' output.
    pub fn encoded_headers_len(&self) -> usize {
        5 + self
            .headers
            .iter()
            .map(|(n, v)| 8 + n.len() + v.len())
            .sum::<usize>()
    }

    /// [`encode_headers`](Self::encode_headers), appended to `out`.
    pub fn encode_headers_into(&self, out: &mut Vec<u8>) {
        out.push(FORMAT_V1);
        out.extend_from_slice(&len_u32(self.headers.len()).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&len_u32(name.len()).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&len_u32(value.len()).to_be_bytes());
            out.extend_from_slice(value);
        }
    }

    /// Decode what [`encode_headers`](Self::encode_headers) wrote. Never panics on arbitrary
    /// input; anything truncated, oversized or with a non-UTF-8 name is an error.
    pub fn decode_headers(bytes: &[u8]) -> Result<Vec<(String, Bytes)>, HeaderDecodeError> {
        decode(bytes, Bytes::copy_from_slice)
    }

    /// [`decode_headers`](Self::decode_headers) of bytes already held in a [`Bytes`]: each
    /// value is a slice of it, not a copy, so decoding allocates nothing per value (a replay
    /// from [`MemoryStore`](crate::store::MemoryStore) copies no header value).
    pub fn decode_headers_shared(bytes: &Bytes) -> Result<Vec<(String, Bytes)>, HeaderDecodeError> {
        decode(bytes, |value| bytes.slice_ref(value))
    }
}

/// The decoder behind both `decode_headers` functions; `value` turns a value's bytes (a
/// subslice of `bytes`) into its `Bytes`.
fn decode<'a>(
    bytes: &'a [u8],
    value: impl Fn(&'a [u8]) -> Bytes,
) -> Result<Vec<(String, Bytes)>, HeaderDecodeError> {
    let mut reader = Reader(bytes);
    if reader.take(1)? != [FORMAT_V1] {
        return Err(HeaderDecodeError("unknown format version"));
    }
    let count = reader.u32()? as usize;
    // Every header needs at least 8 bytes, so a count larger than that is a lie; checking
    // it first keeps a corrupt count from reserving gigabytes.
    if count > reader.0.len() / 8 {
        return Err(HeaderDecodeError("header count exceeds the data"));
    }
    let mut headers = Vec::with_capacity(count);
    for _ in 0..count {
        let name_len = reader.u32()? as usize;
        let name = std::str::from_utf8(reader.take(name_len)?)
            .map_err(|_| HeaderDecodeError("header name is not UTF-8"))?
            .to_owned();
        let value_len = reader.u32()? as usize;
        headers.push((name, value(reader.take(value_len)?)));
    }
    if !reader.0.is_empty() {
        return Err(HeaderDecodeError("trailing bytes"));
    }
    Ok(headers)
}

fn len_u32(len: usize) -> u32 {
    // Header blocks are bounded by the HTTP server long before 4 GiB; saturate rather than wrap.
    u32::try_from(len).unwrap_or(u32::MAX)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], HeaderDecodeError> {
        if n > self.0.len() {
            return Err(HeaderDecodeError("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, HeaderDecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                (
                    "content-type".into(),
                    Bytes::from_static(b"application/json"),
                ),
                (
                    "x-raw".into(),
                    Bytes::from_static(&[0xff, 0x00, b'\n', 0x80]),
                ),
                ("x-empty".into(), Bytes::new()),
            ],
            body: Bytes::from_static(b"{}"),
        }
    }

    #[test]
    fn headers_round_trip_any_bytes() {
        let r = sample();
        let decoded = StoredResponse::decode_headers(&r.encode_headers()).unwrap();
        assert_eq!(decoded, r.headers);
    }

    #[test]
    fn shared_decoding_gives_the_same_headers_as_slices_of_the_encoding() {
        let r = sample();
        let encoded = Bytes::from(r.encode_headers());
        let decoded = StoredResponse::decode_headers_shared(&encoded).unwrap();
        assert_eq!(decoded, r.headers);
        let within = encoded.as_ptr_range();
        for (_, value) in decoded.iter().filter(|(_, v)| !v.is_empty()) {
            assert!(within.contains(&value.as_ptr()), "a value was copied");
        }
        for cut in 0..encoded.len() {
            assert!(StoredResponse::decode_headers_shared(&encoded.slice(..cut)).is_err());
        }
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let encoded = sample().encode_headers();
        for cut in 0..encoded.len() {
            assert!(
                StoredResponse::decode_headers(&encoded[..cut]).is_err(),
                "cut {cut}"
            );
        }
        let mut extra = encoded.clone();
        extra.push(0);
        assert!(StoredResponse::decode_headers(&extra).is_err());
    }

    #[test]
    fn absurd_count_is_rejected_without_allocating() {
        let bytes = [FORMAT_V1, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            StoredResponse::decode_headers(&bytes),
            Err(HeaderDecodeError("header count exceeds the data"))
        );
    }
}
