//! Errors of the middleware as RFC 9457 problem details (contract C13).
//!
//! Every response the middleware makes itself is `application/problem+json`:
//!
//! ```json
//! {
//!   "type": "https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#conflict",
//!   "title": "A request with this Idempotency-Key is still being processed",
//!   "status": 409,
//!   "detail": "retry after the first request finishes",
//!   "code": "CONFLICT"
//! }
//! ```
//!
//! `code` is stable and meant for machines; `title` and `detail` are for people. The `type` URI
//! is `{base}{slug}`, where the slug is the code in lower case with dashes and the base is this
//! page by default, so every `type` links to its own heading below. Point it at your own API
//! docs with [`IdempotencyBuilder::problem_type_base`](crate::IdempotencyBuilder::problem_type_base),
//! or replace the whole rendering with
//! [`IdempotencyBuilder::problem_renderer`](crate::IdempotencyBuilder::problem_renderer); the
//! status and the `Retry-After` header are re-applied after a custom renderer, so they cannot be
//! lost.
//!
//! # The codes
//!
//! ### missing-key
//! `MISSING_KEY`, 400: the middleware is `required` and the request has no Idempotency-Key.
//!
//! ### invalid-key
//! `INVALID_KEY`, 400: the key is empty, malformed, has control or non-ASCII characters, or the
//! header was sent twice.
//!
//! ### key-too-long
//! `KEY_TOO_LONG`, 400: the key is longer than `max_key_len` (255 bytes by default).
//!
//! ### payload-too-large
//! `PAYLOAD_TOO_LARGE`, 413: the body is larger than `max_body_bytes` (1 MiB by default), so it
//! cannot be fingerprinted.
//!
//! ### fingerprint-mismatch
//! `FINGERPRINT_MISMATCH`, 422: the key was already used for a different request (method, path,
//! query or body differ). Nothing was changed. Use a new key for a new request.
//!
//! ### conflict
//! `CONFLICT`, 409 with `Retry-After`: the first request with this key is still running.
//!
//! ### storage-unavailable
//! `STORAGE_UNAVAILABLE`, 503 with `Retry-After`: the store could not be reached (or is not
//! provisioned: run `idem-cli migrate`, or is full of live records), so the request was not run.
//!
//! ### missing-tenant
//! `MISSING_TENANT`, 400: a tenant source is configured (`tenant_header` or `tenant`) and this
//! keyed request has none (a missing or empty header, or an auth layer that has not run yet).
//! The request was not run: without a tenant its record would be shared with every other
//! customer without one (C23).
//!
//! ### replay-not-acceptable
//! `REPLAY_NOT_ACCEPTABLE`, 406: the stored response carries a `Content-Encoding` (a compression
//! middleware sits *inside* `Idempotency`) that this retry's `Accept-Encoding` does not accept.
//! Nothing was run; retry accepting that encoding. Operators avoid this entirely by wrapping
//! `Compress` *outside* `Idempotency`, so responses are stored unencoded and each replay is
//! encoded for its own client.
//!
//! ### response-too-large
//! `RESPONSE_TOO_LARGE`, 500 (transactional mode): the handler's response was storable but
//! larger than `max_response_bytes`. In transactional mode nothing may reach the client before
//! COMMIT and an unstored response cannot be committed, so the transaction was rolled back:
//! nothing was done, and a retry with the same key is safe. Raise `max_response_bytes` for
//! such routes.
//!
//! ### commit-failed
//! `COMMIT_FAILED`, 503 with `Retry-After` (transactional mode): the request ran, but its
//! transaction could not be committed (a deferred constraint, a serialization failure); its
//! changes were rolled back, nothing was done, and a retry with the same key is safe.
//!
//! ### commit-outcome-unknown
//! `COMMIT_OUTCOME_UNKNOWN`, 503 with `Retry-After` (transactional mode): the connection to the
//! database was lost during COMMIT, so whether the request took effect is unknown. A retry with
//! the same key is safe: it replays the response if the commit happened, and runs the request
//! once if it did not.

use std::fmt;
use std::time::Duration;

use actix_web::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

/// The default base of `type` URIs: the headings of this module's documentation.
pub const DEFAULT_TYPE_BASE: &str =
    "https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#";

/// The stable machine-readable problem codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[non_exhaustive]
pub enum ProblemCode {
    /// 400: no key and the middleware is `required`.
    MissingKey,
    /// 400: the key is malformed, empty, or sent twice.
    InvalidKey,
    /// 400: the key is longer than allowed.
    KeyTooLong,
    /// 413: the body is too large to fingerprint.
    PayloadTooLarge,
    /// 422: the key was used for a different request.
    FingerprintMismatch,
    /// 409: the first request with the key is still running.
    Conflict,
    /// 503: the store is unavailable; the request did not run.
    StorageUnavailable,
    /// 400: a tenant source is configured and the keyed request has no tenant.
    MissingTenant,
    /// 406: the stored response's encoding is not acceptable to this retry.
    ReplayNotAcceptable,
    /// 500 (transactional mode): a storable response over `max_response_bytes`; rolled back.
    ResponseTooLarge,
    /// 503 (transactional mode): COMMIT failed; nothing was done, a retry is safe.
    CommitFailed,
    /// 503 (transactional mode): the connection was lost during COMMIT; outcome unknown, a
    /// retry with the same key is safe.
    CommitOutcomeUnknown,
}

impl ProblemCode {
    /// `MISSING_KEY`, `INVALID_KEY`, ...
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MissingKey => "MISSING_KEY",
            Self::InvalidKey => "INVALID_KEY",
            Self::KeyTooLong => "KEY_TOO_LONG",
            Self::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Self::FingerprintMismatch => "FINGERPRINT_MISMATCH",
            Self::Conflict => "CONFLICT",
            Self::StorageUnavailable => "STORAGE_UNAVAILABLE",
            Self::MissingTenant => "MISSING_TENANT",
            Self::ReplayNotAcceptable => "REPLAY_NOT_ACCEPTABLE",
            Self::ResponseTooLarge => "RESPONSE_TOO_LARGE",
            Self::CommitFailed => "COMMIT_FAILED",
            Self::CommitOutcomeUnknown => "COMMIT_OUTCOME_UNKNOWN",
        }
    }

    /// The slug used in `type` URIs: `missing-key`, ...
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-key",
            Self::InvalidKey => "invalid-key",
            Self::KeyTooLong => "key-too-long",
            Self::PayloadTooLarge => "payload-too-large",
            Self::FingerprintMismatch => "fingerprint-mismatch",
            Self::Conflict => "conflict",
            Self::StorageUnavailable => "storage-unavailable",
            Self::MissingTenant => "missing-tenant",
            Self::ReplayNotAcceptable => "replay-not-acceptable",
            Self::ResponseTooLarge => "response-too-large",
            Self::CommitFailed => "commit-failed",
            Self::CommitOutcomeUnknown => "commit-outcome-unknown",
        }
    }

    /// The HTTP status that goes with the code.
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::KeyTooLong | Self::MissingTenant => {
                StatusCode::BAD_REQUEST
            }
            Self::ReplayNotAcceptable => StatusCode::NOT_ACCEPTABLE,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::FingerprintMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Conflict => StatusCode::CONFLICT,
            Self::StorageUnavailable | Self::CommitFailed | Self::CommitOutcomeUnknown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::ResponseTooLarge => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short human summary, the same for every occurrence.
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "An Idempotency-Key header is required",
            Self::InvalidKey => "The Idempotency-Key header is invalid",
            Self::KeyTooLong => "The Idempotency-Key is too long",
            Self::PayloadTooLarge => "The request body is too large",
            Self::FingerprintMismatch => {
                "This Idempotency-Key was already used for a different request"
            }
            Self::Conflict => "A request with this Idempotency-Key is still being processed",
            Self::StorageUnavailable => "Idempotency storage is unavailable",
            Self::MissingTenant => "The request has no tenant",
            Self::ReplayNotAcceptable => {
                "The stored response is encoded in a way this request does not accept"
            }
            Self::ResponseTooLarge => "The response is too large to be committed",
            Self::CommitFailed => "The request could not be committed; nothing was done",
            Self::CommitOutcomeUnknown => "Whether the request was committed is unknown",
        }
    }
}

impl fmt::Display for ProblemCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One problem the middleware answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The stable code; it decides the status.
    pub code: ProblemCode,
    /// What happened in this occurrence, for people.
    pub detail: String,
    /// Sent as `Retry-After` (whole seconds, at least 1) when set.
    pub retry_after: Option<Duration>,
    /// Base of the `type` URI.
    pub type_base: std::borrow::Cow<'static, str>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    code: ProblemCode,
}

impl Problem {
    /// A problem with the default `type` base and no `Retry-After`.
    pub fn new(code: ProblemCode, detail: impl Into<String>) -> Self {
        Self {
            code,
            detail: detail.into(),
            retry_after: None,
            type_base: DEFAULT_TYPE_BASE.into(),
        }
    }

    /// Set `Retry-After`.
    pub fn with_retry_after(mut self, retry_after: Duration) -> Self {
        self.retry_after = Some(retry_after);
        self
    }

    /// The HTTP status of the code.
    pub fn status(&self) -> StatusCode {
        self.code.status()
    }

    /// The `type` URI.
    pub fn type_uri(&self) -> String {
        format!("{}{}", self.type_base, self.code.slug())
    }

    /// The RFC 9457 JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        let body = Body {
            type_uri: self.type_uri(),
            title: self.code.title(),
            status: self.status().as_u16(),
            detail: &self.detail,
            code: self.code,
        };
        // Serialising plain strings and integers cannot fail.
        serde_json::to_vec(&body).unwrap_or_default()
    }

    /// The default rendering: `application/problem+json` with the status and `Retry-After`.
    pub fn to_response(&self) -> HttpResponse {
        let mut response = HttpResponse::build(self.status())
            .insert_header((CONTENT_TYPE, "application/problem+json"))
            .body(self.to_json());
        self.enforce_on(&mut response);
        response
    }

    /// Put the status and `Retry-After` back onto a response from a custom renderer.
    pub(crate) fn enforce_on(&self, response: &mut HttpResponse) {
        *response.status_mut() = self.status();
        if let Some(retry_after) = self.retry_after {
            let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

impl ResponseError for Problem {
    fn status_code(&self) -> StatusCode {
        self.status()
    }

    fn error_response(&self) -> HttpResponse {
        self.to_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rfc9457_with_retry_after() {
        let p = Problem::new(ProblemCode::Conflict, "still running")
            .with_retry_after(Duration::from_millis(1500));
        let response = p.to_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers().get(RETRY_AFTER).unwrap(), "2");
        assert_eq!(
            response.headers().get(CONTENT_TYPE).unwrap(),
            "application/problem+json"
        );
        let json: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap();
        assert_eq!(json["code"], "CONFLICT");
        assert_eq!(json["status"], 409);
        assert_eq!(json["detail"], "still running");
        assert_eq!(json["type"], format!("{DEFAULT_TYPE_BASE}conflict"));
    }
}
