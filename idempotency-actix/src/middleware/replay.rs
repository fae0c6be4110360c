//! What is stored of a response (C11) and how it is replayed (C6).

use actix_web::body::BoxBody;
use actix_web::http::header::{
    self, AcceptEncoding, Encoding, Header, HeaderMap, HeaderName, HeaderValue,
};
use actix_web::http::StatusCode;
use actix_web::{HttpMessage, HttpResponse};
use bytes::Bytes;

use crate::problem::{Problem, ProblemCode};
use crate::store::StoredResponse;

/// The response header added to replays.
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Headers that are never stored or replayed (C11): cookies belong to one response, `Date` is
/// when one message was made (actix dates a replay afresh; a stored one would be up to a TTL
/// old, which breaks clients that check clock skew or sign requests), the rest describe one
/// connection or one message framing. A `static`, not a `const`: a `const` array is built and
/// dropped again at every use, here once per header of every stored or replayed response.
static NEVER_STORED: [HeaderName; 12] = [
    header::SET_COOKIE,
    header::DATE,
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::CONTENT_LENGTH,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    REPLAYED_HEADER,
];

/// The headers of a response that may be stored and replayed (C11). Besides the fixed list,
/// the ones its own `Connection` header names (`Connection: close, X-Upstream-Session`): they
/// are hop-by-hop for that one connection (RFC 9110, 7.6.1), as a proxied upstream's may be.
pub(super) fn storable_headers(headers: &HeaderMap, deny: &[HeaderName]) -> Vec<(String, Bytes)> {
    let connection_only = connection_listed(headers);
    headers
        .iter()
        .filter(|(name, _)| {
            !NEVER_STORED.contains(name) && !deny.contains(name) && !connection_only.contains(name)
        })
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// The header names listed in `headers`' `Connection` values (none, without one: no
/// allocation on the common path). Tokens that are no header name (`close`, `keep-alive` are
/// names too, harmlessly) or not text are skipped.
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect()
}

/// The stored response, byte for byte, marked as a replay (C6); or 406 when it is encoded in a
/// way this retry does not accept.
///
/// A stored `Content-Encoding` means a compression middleware sits *inside* `Idempotency`: the
/// bytes are encoded for the first client. Decoding them here would need every codec; sending
/// them to a client that cannot decode them would corrupt its answer. So an encoded record is
/// replayed only to a retry whose `Accept-Encoding` explicitly accepts that coding (a missing
/// header accepts none here, stricter than RFC 9110, because clients that send none, like plain
/// `curl`, cannot decode), and any other retry gets `406 REPLAY_NOT_ACCEPTABLE`. Wrapping
/// `Compress` outside `Idempotency` avoids the question: records are stored unencoded.
///
/// `deny` is the configured deny list, applied again here (C11: never stored *or replayed*):
/// a record stored before a header was denied (an earlier deploy, another instance on the
/// same store) still holds it.
pub fn replay(
    stored: StoredResponse,
    request: &impl HttpMessage,
    deny: &[HeaderName],
) -> Result<HttpResponse, Problem> {
    if let Some(coding) = stored_encoding(&stored) {
        if !accepts(request, &coding) {
            return Err(Problem::new(
                ProblemCode::ReplayNotAcceptable,
                format!(
                    "the stored response is {coding}-encoded and this request does not accept \
                     {coding} (Accept-Encoding); retry accepting it"
                ),
            ));
        }
    }
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut response = HttpResponse::with_body(status, BoxBody::new(stored.body));
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        // A record written by this crate always decodes; skip anything a foreign writer made
        // unrepresentable rather than fail the replay.
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::from_maybe_shared(value),
        ) {
            if !NEVER_STORED.contains(&name) && !deny.contains(&name) {
                headers.append(name, value);
            }
        }
    }
    // An outer `Compress` leaves a response that already has a `Content-Encoding` alone.
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    Ok(response)
}

/// The content coding of a stored response, if it has one other than `identity`.
fn stored_encoding(stored: &StoredResponse) -> Option<String> {
    stored
        .headers
        .iter()
        .filter(|(name, _)| name.eq_ignore_ascii_case(header::CONTENT_ENCODING.as_str()))
        .map(|(_, value)| String::from_utf8_lossy(value).trim().to_ascii_lowercase())
        .find(|coding| !coding.is_empty() && coding != "identity")
}

/// Whether the request's `Accept-Encoding` explicitly accepts `coding`.
fn accepts(request: &impl HttpMessage, coding: &str) -> bool {
    let (Ok(accept), Ok(wanted)) = (AcceptEncoding::parse(request), coding.parse::<Encoding>())
    else {
        return false;
    };
    !accept.0.is_empty() && accept.negotiate(std::iter::once(&wanted)) == Some(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// C11: a header the response's own `Connection` header names is hop-by-hop and is not
    /// stored (review, 2026-12-06: `Connection: close, X-Upstream-Session` stored and replayed
    /// `X-Upstream-Session`). Names match whatever their case or spacing; the others stay.
    #[test]
    fn headers_named_by_connection_are_not_stored() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("close,  X-Upstream-Session ,,x-hop"),
        );
        headers.append(
            header::CONNECTION,
            HeaderValue::from_static("X-Second-Line"),
        );
        for name in ["x-upstream-session", "x-hop", "x-second-line", "x-kept"] {
            headers.insert(HeaderName::from_static(name), HeaderValue::from_static("v"));
        }
        let stored = storable_headers(&headers, &[]);
        let names: Vec<&str> = stored.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, ["x-kept"]);
    }
}
