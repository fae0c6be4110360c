//! The `Idempotency-Key` header (contract C2) and the [`IdempotencyKey`] extractor (C17).
//!
//! The parser is home-made on purpose: a structured-field crate (`sfv`) parses whole items
//! with parameters and would accept `"k";a=1` as a key with a parameter, while this crate must
//! accept exactly one sf-string or one bare token, check the byte limit before unescaping
//! anything, and name the exact reason for a 400. It is 60 lines, property-tested and fuzzed.

use std::fmt;
use std::future::{ready, Ready};
use std::ops::Deref;

use actix_web::dev::Payload;
use actix_web::{FromRequest, HttpMessage, HttpRequest};

use crate::problem::{Problem, ProblemCode};

/// Why a key was rejected. Every variant is a 400 problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header is present but empty (or `""`).
    #[error("the key is empty")]
    Empty,
    /// Longer than the configured maximum, in bytes after unquoting.
    #[error("the key is longer than {max} bytes")]
    TooLong {
        /// The configured maximum.
        max: usize,
    },
    /// The header appeared more than once.
    #[error("the header was sent more than once")]
    Repeated,
    /// Neither a valid sf-string nor a bare token of visible ASCII.
    #[error("the key is malformed: {0}")]
    Malformed(&'static str),
}

impl KeyError {
    /// The problem code the middleware answers with.
    pub fn code(&self) -> ProblemCode {
        match self {
            KeyError::TooLong { .. } => ProblemCode::KeyTooLong,
            _ => ProblemCode::InvalidKey,
        }
    }
}

/// Parse one header value into a key of at most `max_len` bytes.
pub fn parse_key(raw: &[u8], max_len: usize) -> Result<String, KeyError> {
    let raw = trim_ows(raw);
    if raw.is_empty() {
        return Err(KeyError::Empty);
    }
    let key = match raw.strip_prefix(b"\"") {
        Some(quoted) => parse_sf_string_body(quoted, max_len)?,
        None => {
            if raw.len() > max_len {
                return Err(KeyError::TooLong { max: max_len });
            }
            if let Some(bad) = raw.iter().find(|b| !(0x21..=0x7e).contains(*b)) {
                return Err(KeyError::Malformed(if *bad < 0x20 || *bad == 0x7f {
                    "control characters are not allowed"
                } else if *bad == b' ' {
                    "spaces are only allowed inside a quoted sf-string"
                } else {
                    "only ASCII characters are allowed"
                }));
            }
            // Visible ASCII is valid UTF-8.
            String::from_utf8_lossy(raw).into_owned()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    Ok(key)
}

/// The part after the opening quote: characters up to the closing quote, then nothing.
fn parse_sf_string_body(quoted: &[u8], max_len: usize) -> Result<String, KeyError> {
    let mut key = String::with_capacity(quoted.len().min(max_len));
    let mut bytes = quoted.iter();
    loop {
        let Some(&b) = bytes.next() else {
            return Err(KeyError::Malformed(
                "unterminated sf-string (missing closing quote)",
            ));
        };
        match b {
            b'"' => break,
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => key.push(escaped as char),
                _ => {
                    return Err(KeyError::Malformed(
                        "sf-string escapes are only \\\" and \\\\",
                    ))
                }
            },
            0x20..=0x7e => key.push(b as char),
            0x00..=0x1f | 0x7f => {
                return Err(KeyError::Malformed("control characters are not allowed"))
            }
            _ => return Err(KeyError::Malformed("only ASCII characters are allowed")),
        }
        if key.len() > max_len {
            return Err(KeyError::TooLong { max: max_len });
        }
    }
    if bytes.next().is_some() {
        return Err(KeyError::Malformed("characters after the closing quote"));
    }
    Ok(key)
}

/// Serialise a key as an RFC 8941 sf-string, or `None` if it has characters an sf-string
/// cannot carry (outside printable ASCII).
pub fn to_sf_string(key: &str) -> Option<String> {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    out.push('"');
    Some(out)
}

fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// The request's Idempotency-Key, for handlers (contract C17).
///
/// Available on every request the middleware covered and that carried a valid key. Take
/// `Option<IdempotencyKey>` when the key is optional; taking `IdempotencyKey` on a request
/// without one answers 400 `MISSING_KEY`, rendered with the default type base and renderer
/// (an extractor cannot see the middleware's `problem_type_base` or `problem_renderer`; use
/// the middleware's `required(true)` for a `MISSING_KEY` in the configured rendering).
///
/// # Which keys are accepted
/// Two forms are accepted:
/// - an RFC 8941 sf-string, as the IETF draft specifies: `"8e03978e-40d5-43e8-bc93-6894a57f9324"`,
///   with `\"` and `\\` as its only escapes and printable ASCII inside;
/// - a bare token of visible ASCII (`8e03978e-40d5-...`), because many clients (and Stripe's
///   documentation) send the key unquoted.
///
/// Anything else is rejected rather than guessed at: an empty key, a key longer than the limit
/// (255 bytes by default, Stripe's limit), control characters, non-ASCII bytes, a malformed
/// sf-string, or the header sent twice.
///
/// Passing it on to a payment provider as the provider's own idempotency key makes the
/// downstream call idempotent too (the defence when a handler runs again after a store outage
/// longer than the lease, C16). **Scope it as the record is**: the same key from two tenants is
/// two requests here, but one provider account serving several tenants would take it for one,
/// and replay the first tenant's payment to the second (or refuse it). Forward the tenant with
/// the key in a form no two (tenant, key) pairs share, e.g.
/// `format!("{}:{tenant}:{key}", tenant.len())`: a bare `{tenant}:{key}` makes tenant `org:eu`
/// with key `k1` and tenant `org` with key `eu:k1` one key downstream. If the provider limits
/// the key's length (Stripe: 255 characters, this crate's default limit too), send a hex
/// SHA-256 of that string instead.
///
/// ```
/// use actix_web::{post, HttpResponse};
/// use idempotency_actix::IdempotencyKey;
///
/// #[post("/payments")]
/// async fn create(key: IdempotencyKey) -> HttpResponse {
///     // e.g. pass it on to the payment provider, prefixed with the tenant
///     HttpResponse::Created().body(format!("created under {}", key.as_str()))
/// }
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(pub(crate) String);

impl IdempotencyKey {
    /// The key as parsed (sf-string quotes and escapes removed).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl Deref for IdempotencyKey {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
}

impl FromRequest for IdempotencyKey {
    type Error = Problem;
    type Future = Ready<Result<Self, Problem>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            req.extensions()
                .get::<IdempotencyKey>()
                .cloned()
                .ok_or_else(|| {
                    Problem::new(
                        ProblemCode::MissingKey,
                        "this endpoint needs an Idempotency-Key header",
                    )
                }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_sf_strings_and_bare_tokens() {
        assert_eq!(parse_key(br#""abc-123""#, 255).unwrap(), "abc-123");
        assert_eq!(
            parse_key(br#""a \"q\" \\ b""#, 255).unwrap(),
            r#"a "q" \ b"#
        );
        assert_eq!(parse_key(b"  abc-123\t", 255).unwrap(), "abc-123");
        assert_eq!(parse_key(b"a,b;c=d", 255).unwrap(), "a,b;c=d");
    }

    #[test]
    fn rejects_bad_keys_with_the_right_error() {
        assert_eq!(parse_key(b"", 255), Err(KeyError::Empty));
        assert_eq!(parse_key(b"\"\"", 255), Err(KeyError::Empty));
        assert_eq!(
            parse_key(&[b'a'; 256], 255),
            Err(KeyError::TooLong { max: 255 })
        );
        assert!(parse_key(&[b'a'; 255], 255).is_ok());
        let quoted_long = format!("\"{}\"", "a".repeat(256));
        assert_eq!(
            parse_key(quoted_long.as_bytes(), 255),
            Err(KeyError::TooLong { max: 255 })
        );
        for bad in [
            &br#""abc"#[..],
            br#""a\q""#,
            br#""abc"x"#,
            b"a\x01b",
            b"a b",
            "ключ".as_bytes(),
            b"\"a\x7fb\"",
            b"a\x7f",
        ] {
            assert!(
                matches!(parse_key(bad, 255), Err(KeyError::Malformed(_))),
                "{:?} should be malformed",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn multibyte_over_the_limit_is_too_long() {
        let long = "é".repeat(200); // 400 bytes
        assert_eq!(
            parse_key(long.as_bytes(), 255),
            Err(KeyError::TooLong { max: 255 })
        );
    }

    #[test]
    fn sf_string_round_trips() {
        for key in ["plain", r#"with "quotes" and \ backslash"#, " spaced "] {
            let serialised = to_sf_string(key).unwrap();
            assert_eq!(parse_key(serialised.as_bytes(), 255).unwrap(), key);
        }
        assert_eq!(to_sf_string("é"), None);
    }
}
