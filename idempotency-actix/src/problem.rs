//! Errors of the middleware as RFC 9457 problem details (contract C13).
//!
//! Every response the middleware makes itself is `application/problem+json`:
//!
//! ```json
//! {
//!   "type": "https://docs.rs/idempotency-actix/latest/idempotency_actix/problem/#conflict",
//!   "title": "A request with this Idempotency-Key is still being processed",
//!   "status": 409,
//!   "detail": "the first request with this key is still being processed; retry after it finishes",
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
//! ### scope-too-long
//! `SCOPE_TOO_LONG`, 400: the request's scope (tenant, method, path and key, added) is longer
//! than the store can record (`PostgresStore`: 2,600 bytes; `MemoryStore`: what its byte bound
//! leaves beside one response allowance, about 255 MiB with the defaults; `CachedStore`: its
//! inner store's; `RedisStore`: no limit). Nothing was reserved or run, and a retry gets the same answer: use a shorter path
//! (or tenant, or key).
//!
//! ### payload-too-large
//! `PAYLOAD_TOO_LARGE`, 413: the body is larger than `max_body_bytes` (1 MiB by default), so it
//! cannot be fingerprinted.
//!
//! ### invalid-body
//! `INVALID_BODY`, 400: the body could not be read to its end (the connection ended before the
//! declared length, or its chunked encoding is malformed), so it cannot be fingerprinted.
//! Nothing was reserved or run; send the request again.
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
    /// 400: tenant, method, path and key together are longer than the store can record.
    ScopeTooLong,
    /// 413: the body is too large to fingerprint.
    PayloadTooLarge,
    /// 400: the body could not be read (the connection ended early, a malformed chunked
    /// encoding).
    InvalidBody,
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
            Self::ScopeTooLong => "SCOPE_TOO_LONG",
            Self::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Self::InvalidBody => "INVALID_BODY",
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
            Self::ScopeTooLong => "scope-too-long",
            Self::PayloadTooLarge => "payload-too-large",
            Self::InvalidBody => "invalid-body",
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
            Self::MissingKey
            | Self::InvalidKey
            | Self::KeyTooLong
            | Self::ScopeTooLong
            | Self::MissingTenant
            | Self::InvalidBody => StatusCode::BAD_REQUEST,
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
            Self::ScopeTooLong => "The request's path, tenant and key are too long to record",
            Self::PayloadTooLarge => "The request body is too large",
            Self::InvalidBody => "The request body could not be read",
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
    /// `422 FINGERPRINT_MISMATCH`: the key was used for another request (both modes say it with
    /// the same words).
    pub(crate) fn fingerprint_mismatch() -> Self {
        Self::new(
            ProblemCode::FingerprintMismatch,
            "this key was already used on this endpoint for a request with another body, \
             content type (JSON or not), query or spelling of the path; use a new key for a new \
             request",
        )
    }

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

    /// Every code, once. The match below fails to compile when a variant is added, so this
    /// list (and every test over it) cannot silently miss one.
    const ALL: [ProblemCode; 14] = [
        ProblemCode::MissingKey,
        ProblemCode::InvalidKey,
        ProblemCode::KeyTooLong,
        ProblemCode::ScopeTooLong,
        ProblemCode::InvalidBody,
        ProblemCode::PayloadTooLarge,
        ProblemCode::FingerprintMismatch,
        ProblemCode::Conflict,
        ProblemCode::StorageUnavailable,
        ProblemCode::MissingTenant,
        ProblemCode::ReplayNotAcceptable,
        ProblemCode::ResponseTooLarge,
        ProblemCode::CommitFailed,
        ProblemCode::CommitOutcomeUnknown,
    ];

    /// The contract of the module docs: code, status, slug (the doc heading) for every code.
    fn documented(code: ProblemCode) -> (&'static str, u16, &'static str) {
        match code {
            ProblemCode::MissingKey => ("MISSING_KEY", 400, "missing-key"),
            ProblemCode::InvalidKey => ("INVALID_KEY", 400, "invalid-key"),
            ProblemCode::KeyTooLong => ("KEY_TOO_LONG", 400, "key-too-long"),
            ProblemCode::ScopeTooLong => ("SCOPE_TOO_LONG", 400, "scope-too-long"),
            ProblemCode::PayloadTooLarge => ("PAYLOAD_TOO_LARGE", 413, "payload-too-large"),
            ProblemCode::InvalidBody => ("INVALID_BODY", 400, "invalid-body"),
            ProblemCode::FingerprintMismatch => {
                ("FINGERPRINT_MISMATCH", 422, "fingerprint-mismatch")
            }
            ProblemCode::Conflict => ("CONFLICT", 409, "conflict"),
            ProblemCode::StorageUnavailable => ("STORAGE_UNAVAILABLE", 503, "storage-unavailable"),
            ProblemCode::MissingTenant => ("MISSING_TENANT", 400, "missing-tenant"),
            ProblemCode::ReplayNotAcceptable => {
                ("REPLAY_NOT_ACCEPTABLE", 406, "replay-not-acceptable")
            }
            ProblemCode::ResponseTooLarge => ("RESPONSE_TOO_LARGE", 500, "response-too-large"),
            ProblemCode::CommitFailed => ("COMMIT_FAILED", 503, "commit-failed"),
            ProblemCode::CommitOutcomeUnknown => {
                ("COMMIT_OUTCOME_UNKNOWN", 503, "commit-outcome-unknown")
            }
        }
    }

    async fn body_json(response: HttpResponse) -> serde_json::Value {
        let bytes = actix_web::body::to_bytes(response.into_body())
            .await
            .unwrap_or_else(|_| panic!("the problem body could not be read"));
        serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("not JSON: {e}"))
    }

    #[test]
    fn every_code_has_its_documented_code_status_and_slug() {
        for code in ALL {
            let (name, status, slug) = documented(code);
            assert_eq!(code.as_str(), name);
            assert_eq!(code.to_string(), name, "Display is the machine code");
            assert_eq!(code.status().as_u16(), status, "{name}");
            assert_eq!(code.slug(), slug, "{name}");
            // The slug is the code in lower case with dashes (module docs).
            assert_eq!(code.slug(), name.to_ascii_lowercase().replace('_', "-"));
            // serde's rename matches `as_str`, so the JSON `code` is the documented one.
            assert_eq!(serde_json::to_value(code).ok(), Some(name.into()));
            // The title is for people: present, one line, never the machine code.
            let title = code.title();
            assert!(
                !title.is_empty() && !title.contains('\n'),
                "{name}: {title:?}"
            );
            assert_ne!(title, name);
        }
        let mut names: Vec<_> = ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len(), "two codes share a name");
        let mut titles: Vec<_> = ALL.iter().map(|c| c.title()).collect();
        titles.sort_unstable();
        titles.dedup();
        assert_eq!(titles.len(), ALL.len(), "two codes share a title");
    }

    #[test]
    fn the_module_docs_have_a_heading_for_every_slug() {
        let docs = include_str!("problem.rs");
        for code in ALL {
            let heading = format!(
                "//! ### {}\n//! `{}`, {}",
                code.slug(),
                code.as_str(),
                code.status().as_u16()
            );
            assert!(docs.contains(&heading), "no doc heading {heading:?}");
        }
    }

    #[actix_web::test]
    async fn every_code_renders_as_problem_json() {
        for code in ALL {
            let problem = Problem::new(code, format!("detail of {code}"));
            assert_eq!(problem.status(), code.status());
            assert_eq!(problem.retry_after, None);
            let response = problem.to_response();
            assert_eq!(response.status(), code.status(), "{code}");
            assert_eq!(
                response
                    .headers()
                    .get(CONTENT_TYPE)
                    .map(HeaderValue::as_bytes),
                Some(&b"application/problem+json"[..]),
                "{code}"
            );
            assert!(
                response.headers().get(RETRY_AFTER).is_none(),
                "{code}: no Retry-After unless set"
            );
            let json = body_json(response).await;
            let expected = serde_json::json!({
                "type": format!("{DEFAULT_TYPE_BASE}{}", code.slug()),
                "title": code.title(),
                "status": code.status().as_u16(),
                "detail": format!("detail of {}", code.as_str()),
                "code": code.as_str(),
            });
            assert_eq!(json, expected);
            // The body the response carries is `to_json`'s.
            let direct: serde_json::Value =
                serde_json::from_slice(&problem.to_json()).unwrap_or_default();
            assert_eq!(direct, expected);
        }
    }

    #[test]
    fn json_members_are_in_rfc_order_and_details_are_escaped() {
        let detail = "a \"quoted\" detail\nwith a newline and \\ and \u{e9}";
        let problem = Problem::new(ProblemCode::InvalidKey, detail);
        let raw = String::from_utf8(problem.to_json()).unwrap_or_default();
        let order: Vec<usize> = [
            "\"type\"",
            "\"title\"",
            "\"status\"",
            "\"detail\"",
            "\"code\"",
        ]
        .iter()
        .map(|member| raw.find(member).unwrap_or(usize::MAX))
        .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{raw}");
        assert!(!raw.contains('\n'), "a raw newline in the JSON: {raw}");
        let json: serde_json::Value = serde_json::from_str(&raw).unwrap_or_default();
        assert_eq!(json["detail"], detail);
    }

    #[test]
    fn a_custom_type_base_prefixes_the_slug() {
        let mut problem = Problem::new(ProblemCode::FingerprintMismatch, "x");
        assert_eq!(
            problem.type_uri(),
            format!("{DEFAULT_TYPE_BASE}fingerprint-mismatch")
        );
        problem.type_base = "https://api.example.com/problems/".into();
        assert_eq!(
            problem.type_uri(),
            "https://api.example.com/problems/fingerprint-mismatch"
        );
        let json: serde_json::Value =
            serde_json::from_slice(&problem.to_json()).unwrap_or_default();
        assert_eq!(
            json["type"],
            "https://api.example.com/problems/fingerprint-mismatch"
        );
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_at_least_one() {
        for (after, header) in [
            (Duration::ZERO, "1"),
            (Duration::from_millis(1), "1"),
            (Duration::from_millis(999), "1"),
            (Duration::from_secs(1), "1"),
            (Duration::from_millis(1001), "2"),
            (Duration::from_secs(30), "30"),
            (Duration::from_secs(86_400), "86400"),
            // Saturates instead of panicking or overflowing.
            (Duration::MAX, "18446744073709551615"),
        ] {
            let response = Problem::new(ProblemCode::StorageUnavailable, "down")
                .with_retry_after(after)
                .to_response();
            assert_eq!(
                response
                    .headers()
                    .get(RETRY_AFTER)
                    .map(HeaderValue::as_bytes),
                Some(header.as_bytes()),
                "{after:?}"
            );
        }
    }

    #[test]
    fn enforce_on_restores_the_status_and_retry_after_of_a_custom_rendering() {
        let problem =
            Problem::new(ProblemCode::Conflict, "busy").with_retry_after(Duration::from_secs(3));
        let mut response = HttpResponse::Ok()
            .insert_header((RETRY_AFTER, "999"))
            .insert_header((CONTENT_TYPE, "text/plain"))
            .body("custom");
        problem.enforce_on(&mut response);
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(
            response
                .headers()
                .get(RETRY_AFTER)
                .map(HeaderValue::as_bytes),
            Some(&b"3"[..])
        );
        // The renderer's own headers are kept.
        assert_eq!(
            response
                .headers()
                .get(CONTENT_TYPE)
                .map(HeaderValue::as_bytes),
            Some(&b"text/plain"[..])
        );

        // Without a Retry-After of its own, the problem leaves the renderer's header alone.
        let problem = Problem::new(ProblemCode::MissingKey, "none");
        let mut response = HttpResponse::Ok()
            .insert_header((RETRY_AFTER, "7"))
            .finish();
        problem.enforce_on(&mut response);
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            response
                .headers()
                .get(RETRY_AFTER)
                .map(HeaderValue::as_bytes),
            Some(&b"7"[..])
        );
    }

    #[test]
    fn display_is_code_then_detail() {
        let problem = Problem::new(ProblemCode::KeyTooLong, "the key has 300 bytes");
        assert_eq!(problem.to_string(), "KEY_TOO_LONG: the key has 300 bytes");
        assert_eq!(
            Problem::new(ProblemCode::CommitFailed, "").to_string(),
            "COMMIT_FAILED: "
        );
        let debug = format!("{problem:?}");
        assert!(
            debug.contains("KeyTooLong") && debug.contains("the key has 300 bytes"),
            "{debug}"
        );
    }

    #[actix_web::test]
    async fn as_a_response_error_it_renders_itself() {
        for code in ALL {
            let problem =
                Problem::new(code, "via ResponseError").with_retry_after(Duration::from_secs(2));
            assert_eq!(ResponseError::status_code(&problem), code.status());
            let response = ResponseError::error_response(&problem);
            assert_eq!(response.status(), code.status());
            assert_eq!(
                response
                    .headers()
                    .get(RETRY_AFTER)
                    .map(HeaderValue::as_bytes),
                Some(&b"2"[..])
            );
            assert_eq!(body_json(response).await["code"], code.as_str());

            // A handler returning `Err(problem)` goes through `actix_web::Error`.
            let error = actix_web::Error::from(problem.clone());
            assert_eq!(error.to_string(), problem.to_string());
            assert_eq!(error.as_response_error().status_code(), code.status());
            let response = error.error_response();
            assert_eq!(
                response
                    .headers()
                    .get(CONTENT_TYPE)
                    .map(HeaderValue::as_bytes),
                Some(&b"application/problem+json"[..])
            );
        }
    }

    #[test]
    fn builders_and_equality() {
        let a = Problem::new(ProblemCode::Conflict, "x");
        let b = a.clone().with_retry_after(Duration::from_secs(1));
        assert_ne!(a, b);
        assert_eq!(b.retry_after, Some(Duration::from_secs(1)));
        assert_eq!(b.clone(), b);
        assert_eq!(a.type_base, DEFAULT_TYPE_BASE);
        assert_eq!(Problem::new(ProblemCode::Conflict, String::from("x")), a);
    }
}
