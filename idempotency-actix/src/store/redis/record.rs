//! The one-string record format of [`RedisStore`](super::RedisStore): the single place that
//! knows its bytes, shared by the store, its Lua scripts (which read fixed offsets, named in
//! their comments), `idem-cli` and the tests.
//!
//! # Why one string
//! A record in one string lets the request path use Redis's own commands instead of a script:
//! `SET key <reservation> NX GET PX <lease + grace>` reserves an absent key, or leaves the
//! record as it is and returns it (a replay), in one native command. With a hash per record
//! every reserve needed a script (four commands inside), which cost Redis about three times
//! what a hand-written endpoint's `GET` or `SET NX` does (`docs/redis.md`, "Benchmarks").
//!
//! # Layout
//! A fixed header of [`HEADER_LEN`] bytes, then, for a completed record, the response.
//! Numbers are zero-padded decimal ASCII, so a script reads them with `string.sub` and
//! `tonumber` (Lua numbers are doubles: 16 digits of microseconds is exact, and lasts until
//! the year 2286).
//!
//! | bytes (0-based) | in flight (`F`) | completed (`C`) |
//! |---|---|---|
//! | 0 | `F` | `C` |
//! | 1..33 | fingerprint, 32 raw bytes | the same |
//! | 33..69 | reservation token, hyphenated UUID | the same (kept: a retried `complete` by it is applied) |
//! | 69..85 | reserved at, µs, the reserving instance's clock (shown by `idem-cli`, never decided on) | the same |
//! | 85..101 | lease, µs, as reserved (a renewal leaves it: shown, never decided on) | completed at, µs, Redis's clock |
//! | 101..117 | grace, µs (the key lives lease + grace) | expires at, µs, Redis's clock |
//! | 117..120 | | status, 3 digits |
//! | 120..130 | | length of the encoded headers, 10 digits |
//! | 130.. | | headers ([`StoredResponse::encode_headers`]), then the body, byte-exact |
//!
//! A reservation's lease end is its key's expiry less its grace (`PTTL` less grace), so every
//! decision about time uses Redis's clock although the reservation is written by a plain `SET`
//! from the app; and a lease renewal (`renew.lua`) is a `PEXPIRE` of the key alone, the bytes
//! left as they are.

use std::io::Write;

use bytes::Bytes;

use crate::store::{Fingerprint, ReservationToken, StoredResponse};

/// Bytes before a completed record's response: state, fingerprint, token, three times.
pub const HEADER_LEN: usize = 117;
/// State byte of a reservation.
pub const IN_FLIGHT: u8 = b'F';
/// State byte of a completed record.
pub const COMPLETED: u8 = b'C';
/// The script `idem-cli release` runs: delete a record only if it is still what was inspected
/// (state byte, token) and, unless forced, a reservation whose lease ended by Redis's clock.
/// Here because it reads the record's bytes.
pub const RELEASE_INSPECTED: &str = include_str!("release_inspected.lua");

const FP: std::ops::Range<usize> = 1..33;
const TOKEN: std::ops::Range<usize> = 33..69;
const CREATED: std::ops::Range<usize> = 69..85;
const SECOND: std::ops::Range<usize> = 85..101;
const THIRD: std::ops::Range<usize> = 101..117;
const STATUS: std::ops::Range<usize> = 117..120;
const HEADERS_LEN: std::ops::Range<usize> = 120..130;
/// Digits of a time or duration field.
const DIGITS: usize = 16;
/// The largest number a field holds.
const MAX_FIELD: u64 = 9_999_999_999_999_999;

/// A record read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token of the reservation that made (or holds) the record.
    pub token: ReservationToken,
    /// Reserved at, microseconds since the Unix epoch, by the reserving instance's clock.
    pub created_us: u64,
    /// What the state adds.
    pub state: State,
}

/// The state of a [`Record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// A reservation.
    InFlight {
        /// Its lease as reserved, microseconds (a renewal moves the key's expiry, not this).
        lease_us: u64,
        /// How long its key outlives the lease, microseconds.
        grace_us: u64,
    },
    /// A completed record.
    Completed {
        /// Completed at, microseconds since the Unix epoch, Redis's clock.
        completed_us: u64,
        /// Expires at, microseconds since the Unix epoch, Redis's clock.
        expires_us: u64,
        /// The stored response; its headers and body are slices of the record's bytes.
        response: StoredResponse,
    },
}

/// A reservation's bytes.
pub fn in_flight(
    fingerprint: &Fingerprint,
    token: &ReservationToken,
    created_us: u64,
    lease_us: u64,
    grace_us: u64,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN);
    out.push(IN_FLIGHT);
    out.extend_from_slice(fingerprint.as_bytes());
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    out.extend_from_slice(
        token
            .as_uuid()
            .hyphenated()
            .encode_lower(&mut text)
            .as_bytes(),
    );
    for n in [created_us, lease_us, grace_us] {
        push_number(&mut out, n);
    }
    out
}

/// What the complete script appends to the header it builds: status, headers, body.
pub fn response_tail(response: &StoredResponse) -> Vec<u8> {
    let headers = response.encode_headers();
    let mut out = Vec::with_capacity(13 + headers.len() + response.body.len());
    // A status outside 100..=999 never reaches a store (actix's StatusCode), but three digits
    // are all the format has room for. Writing to a Vec cannot fail.
    let _ = write!(out, "{:03}{:010}", response.status.min(999), headers.len());
    out.extend_from_slice(&headers);
    out.extend_from_slice(&response.body);
    out
}

/// The token as the record holds it (and the scripts compare it).
pub fn token_text(token: &ReservationToken) -> String {
    token.as_uuid().hyphenated().to_string()
}

/// The bytes [`decode_head`] needs: everything before a completed record's encoded headers.
/// `idem-cli list` and `stats` read this much of each record (`GETRANGE key 0
/// HEAD_READ_LEN-1`) and its length (`STRLEN`), not the stored response.
pub const HEAD_READ_LEN: usize = HEADERS_LEN.end;

/// What a record's fixed header says, without its response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token of the reservation that made (or holds) the record.
    pub token: ReservationToken,
    /// Reserved at, microseconds since the Unix epoch, by the reserving instance's clock.
    pub created_us: u64,
    /// What the state adds.
    pub state: HeadState,
}

/// The state of a [`Head`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadState {
    /// A reservation: see [`State::InFlight`].
    InFlight {
        /// Its lease as reserved, microseconds.
        lease_us: u64,
        /// How long its key outlives the lease, microseconds.
        grace_us: u64,
    },
    /// A completed record: see [`State::Completed`].
    Completed {
        /// Completed at, microseconds since the Unix epoch, Redis's clock.
        completed_us: u64,
        /// Expires at, microseconds since the Unix epoch, Redis's clock.
        expires_us: u64,
        /// The stored status.
        status: u16,
        /// Where the body starts: the encoded headers end there.
        body_start: usize,
        /// The body's length in bytes.
        body_len: usize,
    },
}

/// Decode a record's fixed header from its first bytes (`head`, at least [`HEAD_READ_LEN`] of
/// them when there are that many) and the record's whole length (`len`), checking everything
/// [`decode`] checks except the encoded headers themselves.
pub fn decode_head(head: &[u8], len: usize) -> Result<Head, &'static str> {
    if head.len() < HEADER_LEN || len < head.len() {
        return Err("shorter than a record's header");
    }
    let fingerprint = Fingerprint::from_slice(&head[FP]).ok_or("fingerprint is not 32 bytes")?;
    let token = std::str::from_utf8(&head[TOKEN])
        .ok()
        .and_then(|t| uuid::Uuid::parse_str(t).ok())
        .map(ReservationToken::from_uuid)
        .ok_or("token is not a UUID")?;
    let created_us = number(&head[CREATED]).ok_or("reserved-at is not a number")?;
    let second = number(&head[SECOND]).ok_or("a time field is not a number")?;
    let third = number(&head[THIRD]).ok_or("a time field is not a number")?;
    let state = match head[0] {
        IN_FLIGHT if len == HEADER_LEN => HeadState::InFlight {
            lease_us: second,
            grace_us: third,
        },
        COMPLETED if len >= HEADERS_LEN.end && head.len() >= HEADERS_LEN.end => {
            // Three digits, so at most 999; below 100 only by a foreign writer.
            let status = number(&head[STATUS])
                .and_then(|s| u16::try_from(s).ok())
                .filter(|s| *s >= 100)
                .ok_or("status is not an HTTP status")?;
            let headers_len = number(&head[HEADERS_LEN])
                .and_then(|n| usize::try_from(n).ok())
                .ok_or("headers length is not a number")?;
            let body_start = HEADERS_LEN
                .end
                .checked_add(headers_len)
                .filter(|end| *end <= len)
                .ok_or("headers run past the end")?;
            HeadState::Completed {
                completed_us: second,
                expires_us: third,
                status,
                body_start,
                body_len: len - body_start,
            }
        }
        IN_FLIGHT | COMPLETED => return Err("wrong length for its state"),
        _ => return Err("unknown state"),
    };
    Ok(Head {
        fingerprint,
        token,
        created_us,
        state,
    })
}

/// Decode a record; `Err` names what is wrong with bytes that are not one.
pub fn decode(bytes: Bytes) -> Result<Record, &'static str> {
    let head = decode_head(&bytes, bytes.len())?;
    let state = match head.state {
        HeadState::InFlight { lease_us, grace_us } => State::InFlight { lease_us, grace_us },
        HeadState::Completed {
            completed_us,
            expires_us,
            status,
            body_start,
            body_len: _,
        } => {
            let headers_bytes = bytes.slice(HEADERS_LEN.end..body_start);
            let headers = StoredResponse::decode_headers_shared(&headers_bytes)
                .map_err(|_| "headers do not decode")?;
            State::Completed {
                completed_us,
                expires_us,
                response: StoredResponse {
                    status,
                    headers,
                    body: bytes.slice(body_start..),
                },
            }
        }
    };
    Ok(Record {
        fingerprint: head.fingerprint,
        token: head.token,
        created_us: head.created_us,
        state,
    })
}

/// The last byte (inclusive, as `GETRANGE` counts) of a record's head that
/// [`holds_write`] judges: state, fingerprint, token.
pub const WRITE_HEAD_LAST: usize = TOKEN.end - 1;

/// Whether `head`, the reply to `GETRANGE key 0 WRITE_HEAD_LAST` on the node that is about to
/// answer a `WAIT`, shows the write that `WAIT` is meant to cover: a record in `state`
/// ([`IN_FLIGHT`] after a reserve, [`COMPLETED`] after a complete) made by `token`.
///
/// `WAIT` counts the replicas of whatever node the pipeline reaches. After a failover that is
/// the promoted replica, which may lack the write (the key absent: an empty reply; or the
/// reservation a complete replaced): its `WAIT` would acknowledge a write it never saw.
pub fn holds_write(head: &[u8], state: u8, token: &ReservationToken) -> bool {
    head.len() == TOKEN.end && head[0] == state && &head[TOKEN] == token_bytes(token).as_slice()
}

/// The fingerprint of the request whose record `head` (read as for [`holds_write`]) shows,
/// when it is a record (a reservation or a completed one) another token than `token` made.
pub fn held_by_another(head: &[u8], token: &ReservationToken) -> Option<Fingerprint> {
    let is_record = head.len() == TOKEN.end && matches!(head[0], IN_FLIGHT | COMPLETED);
    if !is_record || &head[TOKEN] == token_bytes(token).as_slice() {
        return None;
    }
    Fingerprint::from_slice(&head[FP])
}

/// `token` as a record holds it: hyphenated, lower case.
fn token_bytes(token: &ReservationToken) -> [u8; uuid::fmt::Hyphenated::LENGTH] {
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    token.as_uuid().hyphenated().encode_lower(&mut text);
    text
}

fn push_number(out: &mut Vec<u8>, n: u64) {
    // Writing to a Vec cannot fail.
    let _ = write!(out, "{:0width$}", n.min(MAX_FIELD), width = DIGITS);
}

fn number(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What a `WAIT`'s `GETRANGE` may read: another request's reservation or completed record
    /// (its fingerprint), or nothing to say (our own record in either state, no record, a
    /// short or unknown head).
    #[test]
    fn another_holder_is_read_from_a_head_only_when_it_is_anothers_record() {
        let (ours, theirs) = (token(), token());
        let fp = Fingerprint([0xBB; 32]);
        let head = |state: u8, t: &ReservationToken| {
            let mut bytes = in_flight(&fp, t, 1, 2, 3);
            bytes[0] = state;
            bytes.truncate(WRITE_HEAD_LAST + 1);
            bytes
        };
        assert_eq!(held_by_another(&head(IN_FLIGHT, &theirs), &ours), Some(fp));
        assert_eq!(held_by_another(&head(COMPLETED, &theirs), &ours), Some(fp));
        assert_eq!(held_by_another(&head(IN_FLIGHT, &ours), &ours), None);
        assert_eq!(held_by_another(&head(COMPLETED, &ours), &ours), None);
        assert_eq!(held_by_another(b"", &ours), None);
        assert_eq!(held_by_another(&head(b'X', &theirs), &ours), None);
        let short = head(IN_FLIGHT, &theirs);
        assert_eq!(held_by_another(&short[..short.len() - 1], &ours), None);
        assert!(holds_write(&head(IN_FLIGHT, &ours), IN_FLIGHT, &ours));
        assert!(!holds_write(&head(IN_FLIGHT, &theirs), IN_FLIGHT, &ours));
    }

    fn token() -> ReservationToken {
        ReservationToken::random()
    }

    /// What the complete script builds from a reservation (`complete.lua`): its first 85 bytes,
    /// the two times, the tail.
    fn completed(reservation: &[u8], completed_us: u64, expires_us: u64, tail: &[u8]) -> Bytes {
        let mut out = vec![COMPLETED];
        out.extend_from_slice(&reservation[1..CREATED.end]);
        push_number(&mut out, completed_us);
        push_number(&mut out, expires_us);
        out.extend_from_slice(tail);
        out.into()
    }

    /// The check behind `WAIT` (`holds_write`): only this write's state and token pass; an
    /// absent key (empty reply), the older state, another token, a short reply do not.
    #[test]
    fn holds_write_accepts_only_this_write() {
        let (fp, tok, other) = (Fingerprint([3; 32]), token(), token());
        let head = |bytes: &[u8]| bytes[..=WRITE_HEAD_LAST].to_vec();
        let reservation = in_flight(&fp, &tok, 1, 30_000_000, 1_000_000);
        let done = completed(
            &reservation,
            2,
            3,
            &response_tail(&StoredResponse {
                status: 201,
                headers: vec![],
                body: Bytes::from_static(b"ok"),
            }),
        );
        assert_eq!(head(&reservation).len(), 69);
        assert!(holds_write(&head(&reservation), IN_FLIGHT, &tok));
        assert!(holds_write(&head(&done), COMPLETED, &tok));
        // The promoted replica lacks the write.
        assert!(!holds_write(b"", IN_FLIGHT, &tok));
        assert!(!holds_write(b"", COMPLETED, &tok));
        // It still holds the reservation a complete replaced.
        assert!(!holds_write(&head(&reservation), COMPLETED, &tok));
        assert!(!holds_write(&head(&done), IN_FLIGHT, &tok));
        // Another request's record.
        let theirs = in_flight(&fp, &other, 1, 30_000_000, 1_000_000);
        assert!(!holds_write(&head(&theirs), IN_FLIGHT, &tok));
        // Not a whole head (a foreign value, a truncated record).
        assert!(!holds_write(&head(&reservation)[..68], IN_FLIGHT, &tok));
    }

    #[test]
    fn a_reservation_reads_back() {
        let (fp, tok) = (Fingerprint([7; 32]), token());
        let bytes = in_flight(&fp, &tok, 1_764_000_000_000_000, 30_000_000, 86_400_000_000);
        assert_eq!(bytes.len(), HEADER_LEN);
        let record = decode(bytes.into()).expect("decodes");
        assert_eq!(record.fingerprint, fp);
        assert_eq!(record.token, tok);
        assert_eq!(record.created_us, 1_764_000_000_000_000);
        assert_eq!(
            record.state,
            State::InFlight {
                lease_us: 30_000_000,
                grace_us: 86_400_000_000
            }
        );
    }

    #[test]
    fn a_completed_record_reads_back_byte_exact() {
        let (fp, tok) = (Fingerprint([0xff; 32]), token());
        let response = StoredResponse {
            status: 201,
            headers: vec![
                ("location".into(), Bytes::from_static(b"/p/\xff\x00")),
                ("x-empty".into(), Bytes::new()),
            ],
            body: Bytes::from_static(b"\x00\xffbinary\r\n"),
        };
        let reservation = in_flight(&fp, &tok, 5, 6, 7);
        let bytes = completed(&reservation, 8, 9, &response_tail(&response));
        let record = decode(bytes).expect("decodes");
        assert_eq!(
            (record.fingerprint, record.token, record.created_us),
            (fp, tok, 5)
        );
        assert_eq!(
            record.state,
            State::Completed {
                completed_us: 8,
                expires_us: 9,
                response
            }
        );
    }

    #[test]
    fn what_is_not_a_record_is_refused_by_name() {
        let good = in_flight(&Fingerprint([1; 32]), &token(), 1, 2, 3);
        assert_eq!(decode(Bytes::new()), Err("shorter than a record's header"));
        let mut state = good.clone();
        state[0] = b'c';
        assert_eq!(decode(state.into()), Err("unknown state"));
        let mut digits = good.clone();
        digits[90] = b'x';
        assert_eq!(decode(digits.into()), Err("a time field is not a number"));
        let mut longer = good.clone();
        longer.push(b'!');
        assert_eq!(decode(longer.into()), Err("wrong length for its state"));
        let mut tail = good;
        tail[0] = COMPLETED;
        tail.extend_from_slice(b"2010000000099");
        assert_eq!(decode(tail.into()), Err("headers run past the end"));
    }

    proptest! {
        /// Whatever Redis hands back (a key some other program wrote, a truncated value),
        /// decoding answers and never panics.
        #[test]
        fn decoding_any_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode(bytes.into());
        }

        /// Whatever the first bytes and the length claim, reading a head answers.
        #[test]
        fn decoding_any_head_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            extra in 0usize..1000,
        ) {
            let _ = decode_head(&bytes, bytes.len() + extra);
            let _ = decode_head(&bytes, bytes.len().saturating_sub(extra));
        }

        /// Every response survives the trip, whatever its bytes; and what `idem-cli list` and
        /// `stats` read (the first `HEAD_READ_LEN` bytes and the length) says what the whole
        /// record says.
        #[test]
        fn every_response_round_trips(
            status in 100u16..1000,
            headers in proptest::collection::vec(("[a-z-]{1,12}", proptest::collection::vec(any::<u8>(), 0..20)), 0..4),
            body in proptest::collection::vec(any::<u8>(), 0..200),
            times in (0..=MAX_FIELD, 0..=MAX_FIELD, 0..=MAX_FIELD),
        ) {
            let response = StoredResponse {
                status,
                headers: headers.into_iter().map(|(n, v)| (n, Bytes::from(v))).collect(),
                body: body.into(),
            };
            let reservation = in_flight(&Fingerprint([3; 32]), &token(), times.0, 1, 1);
            let bytes = completed(&reservation, times.1, times.2, &response_tail(&response));
            let head = decode_head(&bytes[..HEAD_READ_LEN], bytes.len());
            let Ok(Head { state: HeadState::Completed { completed_us, expires_us, status: s, body_len, .. }, created_us, .. }) = head else {
                panic!("{head:?}");
            };
            prop_assert_eq!(
                (created_us, completed_us, expires_us, s, body_len),
                (times.0, times.1, times.2, status, response.body.len())
            );
            let in_flight_head = decode_head(&reservation, reservation.len());
            prop_assert_eq!(in_flight_head.map(|h| h.state), Ok(HeadState::InFlight { lease_us: 1, grace_us: 1 }));
            let record = decode(bytes);
            prop_assert_eq!(record.map(|r| r.state), Ok(State::Completed {
                completed_us: times.1,
                expires_us: times.2,
                response,
            }));
        }
    }
}
