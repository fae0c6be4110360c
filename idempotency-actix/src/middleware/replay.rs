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

/// Headers that are never stored or replayed (C11): cookies belong to one response, the rest
/// describe one connection or one message framing. A `static`, not a `const`: a `const` array
/// is built and dropped again at every use, here once per header of every stored or replayed
/// response.
static NEVER_STORED: [HeaderName; 11] = [
    header::SET_COOKIE,
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

/// The headers of a response that may be stored and replayed (C11).
pub(super) fn storable_headers(headers: &HeaderMap, deny: &[HeaderName]) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| !NEVER_STORED.contains(name) && !deny.contains(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
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
