//! The store conformance suite: the rules of the [module docs](super) as executable checks.
//!
//! Every store in this crate runs it, and so can yours (feature `test-suite`):
//!
//! ```ignore
//! #[tokio::test]
//! async fn my_store_conforms() {
//!     let store = MyStore::connect("...").await.unwrap();
//!     idempotency_actix::store::conformance::run_all(&store).await;
//! }
//! ```
//!
//! Each check works in its own random tenant, so the suite can share a store (a database) with
//! other tests and with itself. A violated rule panics with a message naming the rule.

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;

use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoredResponse,
    WriteOutcome,
};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
/// Short enough to keep the suite quick, long enough for a database round trip to finish
/// well inside it.
const SHORT: Duration = Duration::from_millis(300);

/// Run every check in sequence.
pub async fn run_all<S: IdempotencyStore>(store: &S) {
    first_reserve_wins_and_duplicates_see_in_flight(store).await;
    complete_then_replay_returns_the_exact_response(store).await;
    fenced_writes_reject_foreign_tokens(store).await;
    release_frees_the_key(store).await;
    expired_lease_is_taken_over_and_stale_holder_is_fenced(store).await;
    expired_lease_with_other_fingerprint_is_not_taken_over(store).await;
    expired_completed_record_is_absent(store).await;
    concurrent_reservations_have_exactly_one_winner(store).await;
    concurrent_takeovers_have_exactly_one_winner(store).await;
    scopes_are_isolated_without_delimiter_collisions(store).await;
    a_scope_at_the_declared_limit_is_recorded(store).await;
    purge_deletes_only_expired_records(store).await;
    purge_keeps_ended_reservations_within_grace(store).await;
    if store.renews_leases() {
        renewed_lease_is_not_taken_over(store).await;
        renewal_is_fenced_by_the_token(store).await;
        renewal_after_the_lease_applies_until_a_takeover(store).await;
    }
}

fn scope_in(tenant: &str, key: &str) -> Scope {
    Scope {
        tenant: tenant.to_owned(),
        method: "POST".into(),
        path: "/conformance".into(),
        key: key.to_owned(),
    }
}

fn fresh_scope() -> Scope {
    scope_in(&unique(), "key-1")
}

fn unique() -> String {
    format!("conformance-{:?}", ReservationToken::random().as_uuid())
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/octet-stream"),
            ),
            (
                "x-binary".into(),
                Bytes::from_static(&[0x80, 0xff, b' ', b'a']),
            ),
            ("x-repeated".into(), Bytes::from_static(b"1")),
            ("x-repeated".into(), Bytes::from_static(b"2")),
        ],
        body: Bytes::from_static(body),
    }
}

const FP_A: Fingerprint = Fingerprint([0xAA; 32]);
const FP_B: Fingerprint = Fingerprint([0xBB; 32]);

async fn reserve<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    fp: &Fingerprint,
    lease: Duration,
) -> ReserveOutcome {
    match store.reserve(scope, fp, lease).await {
        Ok(outcome) => outcome,
        Err(e) => panic!("reserve failed for {scope:?}: {e}"),
    }
}

async fn reserved<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    fp: &Fingerprint,
    lease: Duration,
) -> ReservationToken {
    match reserve(store, scope, fp, lease).await {
        ReserveOutcome::Reserved { token } => token,
        other => panic!("expected Reserved for {scope:?}, got {other:?}"),
    }
}

async fn complete<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    token: &ReservationToken,
    response: &StoredResponse,
    ttl: Duration,
) -> WriteOutcome {
    match store.complete(scope, token, response, ttl).await {
        Ok(outcome) => outcome,
        Err(e) => panic!("complete failed for {scope:?}: {e}"),
    }
}

async fn renew<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    token: &ReservationToken,
    lease: Duration,
) -> WriteOutcome {
    match store.renew_lease(scope, token, lease).await {
        Ok(outcome) => outcome,
        Err(e) => panic!("renew_lease failed for {scope:?}: {e}"),
    }
}

async fn release<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    token: &ReservationToken,
) -> WriteOutcome {
    match store.release(scope, token).await {
        Ok(outcome) => outcome,
        Err(e) => panic!("release failed for {scope:?}: {e}"),
    }
}

/// A reservation just made by `fp` for `LEASE` (perhaps over an old record: a takeover, an
/// expired record, a released key) holds like a first one: a duplicate sees it in flight with
/// `fp` and about a whole lease left, and its completion is replayed as `fp`'s. A store that
/// took a key over without moving the lease would let every later retry take it over again;
/// one that kept the old record's fingerprint would replay this response to the old request.
async fn holds_as_a_new_reservation<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    token: &ReservationToken,
    fp: &Fingerprint,
    what: &str,
) {
    match reserve(store, scope, fp, LEASE).await {
        ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining,
        } => {
            assert_eq!(
                fingerprint, *fp,
                "{what}: InFlight must report the new holder's fingerprint"
            );
            assert!(
                lease_remaining > Duration::from_secs(50),
                "{what}: the new reservation must hold its whole lease, {lease_remaining:?} left"
            );
        }
        other => {
            panic!("{what}: a duplicate of the new reservation must see InFlight, got {other:?}")
        }
    }
    let stored = response(b"the new holder's response");
    assert_eq!(
        complete(store, scope, token, &stored, TTL).await,
        WriteOutcome::Applied,
        "{what}: the new holder completes"
    );
    match reserve(store, scope, fp, LEASE).await {
        ReserveOutcome::Completed {
            fingerprint,
            response,
            ..
        } => {
            assert_eq!(
                fingerprint, *fp,
                "{what}: Completed must report the new fingerprint"
            );
            assert_eq!(response, stored, "{what}");
        }
        other => panic!("{what}: expected the new holder's response, got {other:?}"),
    }
}

/// C5, C8: one reservation; a duplicate (same or other fingerprint) sees it in flight.
pub async fn first_reserve_wins_and_duplicates_see_in_flight<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    reserved(store, &scope, &FP_A, LEASE).await;
    for fp in [FP_A, FP_B] {
        match reserve(store, &scope, &fp, LEASE).await {
            ReserveOutcome::InFlight {
                fingerprint,
                lease_remaining,
            } => {
                assert_eq!(
                    fingerprint, FP_A,
                    "InFlight must report the holder's fingerprint"
                );
                assert!(
                    lease_remaining > Duration::from_secs(50) && lease_remaining <= LEASE,
                    "lease_remaining {lease_remaining:?} should be close to the 60 s lease"
                );
            }
            other => panic!("C8: a duplicate while in flight must see InFlight, got {other:?}"),
        }
    }
}

/// C6: the completed response comes back exactly (status, repeated and binary headers, body).
pub async fn complete_then_replay_returns_the_exact_response<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, LEASE).await;
    let stored = response(&[0, 159, 146, 150, 0xff, b'\n', 0]);
    assert_eq!(
        complete(store, &scope, &token, &stored, TTL).await,
        WriteOutcome::Applied
    );
    for fp in [FP_A, FP_B] {
        match reserve(store, &scope, &fp, LEASE).await {
            ReserveOutcome::Completed {
                fingerprint,
                response,
                expires_in,
            } => {
                assert_eq!(
                    fingerprint, FP_A,
                    "Completed must report the original fingerprint"
                );
                assert_eq!(response, stored, "C6: the replay must be byte for byte");
                if let Some(left) = expires_in {
                    assert!(
                        left <= TTL,
                        "expires_in {left:?} cannot exceed what is left of the {TTL:?} TTL"
                    );
                }
            }
            other => panic!("C6: expected Completed, got {other:?}"),
        }
    }
}

/// C9: complete and release need the reservation's own token.
pub async fn fenced_writes_reject_foreign_tokens<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, LEASE).await;
    let foreign = ReservationToken::random();
    assert_eq!(
        complete(store, &scope, &foreign, &response(b"x"), TTL).await,
        WriteOutcome::Stale,
        "C9: complete with a foreign token must not apply"
    );
    assert_eq!(release(store, &scope, &foreign).await, WriteOutcome::Stale);
    assert!(matches!(
        reserve(store, &scope, &FP_A, LEASE).await,
        ReserveOutcome::InFlight { .. }
    ));
    // Writes on a scope that has no record at all are stale, not errors.
    let nothing = fresh_scope();
    assert_eq!(release(store, &nothing, &token).await, WriteOutcome::Stale);
    assert_eq!(
        complete(store, &nothing, &token, &response(b"x"), TTL).await,
        WriteOutcome::Stale
    );
    // Once completed, the token cannot release (or re-complete) the record.
    assert_eq!(
        complete(store, &scope, &token, &response(b"x"), TTL).await,
        WriteOutcome::Applied
    );
    assert_eq!(release(store, &scope, &token).await, WriteOutcome::Stale);
    // A second complete by the same token may say Applied (idempotent) or Stale, and changes
    // nothing either way; a foreign token is stale.
    let _ = complete(store, &scope, &token, &response(b"y"), TTL).await;
    assert_eq!(
        complete(store, &scope, &foreign, &response(b"z"), TTL).await,
        WriteOutcome::Stale
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response, .. } => {
            assert_eq!(&response.body[..], b"x", "a completed record is immutable")
        }
        other => panic!("C6: expected Completed, got {other:?}"),
    }
}

/// C10: a released key can be reserved again, even with another fingerprint.
pub async fn release_frees_the_key<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, LEASE).await;
    assert_eq!(release(store, &scope, &token).await, WriteOutcome::Applied);
    let token = reserved(store, &scope, &FP_B, LEASE).await;
    holds_as_a_new_reservation(store, &scope, &token, &FP_B, "after a release").await;
}

/// C9: after the lease ends a retry of the same request takes over; the old holder is fenced.
pub async fn expired_lease_is_taken_over_and_stale_holder_is_fenced<S: IdempotencyStore>(
    store: &S,
) {
    let scope = fresh_scope();
    let old = reserved(store, &scope, &FP_A, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    let new = reserved(store, &scope, &FP_A, LEASE).await;
    assert_ne!(old, new, "a takeover must issue a new token");
    assert_eq!(
        complete(store, &scope, &old, &response(b"stale"), TTL).await,
        WriteOutcome::Stale,
        "C9: the stale holder must not complete"
    );
    assert_eq!(release(store, &scope, &old).await, WriteOutcome::Stale);
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::InFlight {
            lease_remaining, ..
        } => assert!(
            lease_remaining > Duration::from_secs(50),
            "C9: a takeover must start a whole new lease, {lease_remaining:?} left: a retry \
             now would take the key over again and run the handler a third time"
        ),
        other => panic!("C9: a retry after the takeover must see InFlight, got {other:?}"),
    }
    let fresh = response(b"second execution");
    assert_eq!(
        complete(store, &scope, &new, &fresh, TTL).await,
        WriteOutcome::Applied
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response, .. } => assert_eq!(response, fresh),
        other => panic!("expected the new holder's response, got {other:?}"),
    }
}

/// C7, C9: a dead holder's lease is only taken over by the same request, never by another body.
pub async fn expired_lease_with_other_fingerprint_is_not_taken_over<S: IdempotencyStore>(
    store: &S,
) {
    let scope = fresh_scope();
    reserved(store, &scope, &FP_A, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    match reserve(store, &scope, &FP_B, LEASE).await {
        ReserveOutcome::InFlight { fingerprint, .. } => assert_eq!(fingerprint, FP_A),
        other => panic!("another fingerprint must not take over, got {other:?}"),
    }
}

/// C12: an expired completed record is treated as absent; before that, `expires_in` is what
/// is left of its TTL, not the TTL (`CachedStore` keeps a replay no longer than that).
pub async fn expired_completed_record_is_absent<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, LEASE).await;
    assert_eq!(
        complete(store, &scope, &token, &response(b"old"), SHORT * 2).await,
        WriteOutcome::Applied
    );
    tokio::time::sleep(SHORT).await;
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed {
            expires_in: Some(left),
            ..
        } => {
            // At least SHORT of the 2 x SHORT has passed; a little more for clock rounding.
            let most = SHORT + Duration::from_millis(50);
            assert!(
                left <= most,
                "expires_in {left:?} after half the TTL (at most {most:?})"
            );
        }
        ReserveOutcome::Completed {
            expires_in: None, ..
        } => {}
        other => panic!("C6: expected Completed halfway through the TTL, got {other:?}"),
    }
    tokio::time::sleep(SHORT * 2).await;
    let token = reserved(store, &scope, &FP_B, LEASE).await;
    holds_as_a_new_reservation(store, &scope, &token, &FP_B, "over an expired record").await;
}

/// C5: of 32 concurrent reservations exactly one wins; all others see it in flight.
pub async fn concurrent_reservations_have_exactly_one_winner<S: IdempotencyStore>(store: &S) {
    one_winner_of_32(store, &fresh_scope(), "C5: a fresh key").await;
}

/// C5, C9: of 32 concurrent retries after a lease ended, exactly one takes the key over (a
/// takeover written as a read, then a write, lets several win after a crash).
pub async fn concurrent_takeovers_have_exactly_one_winner<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    reserved(store, &scope, &FP_A, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    one_winner_of_32(store, &scope, "C5, C9: a takeover").await;
}

/// 32 concurrent reserves of `scope` by one fingerprint: exactly one wins, the others see it in
/// flight.
async fn one_winner_of_32<S: IdempotencyStore>(store: &S, scope: &Scope, what: &str) {
    let outcomes = join_all((0..32).map(|_| store.reserve(scope, &FP_A, LEASE))).await;
    let mut winners = 0;
    for outcome in outcomes {
        match outcome {
            Ok(ReserveOutcome::Reserved { .. }) => winners += 1,
            Ok(ReserveOutcome::InFlight { fingerprint, .. }) => assert_eq!(fingerprint, FP_A),
            Ok(other) => panic!("{what}: unexpected outcome under concurrency: {other:?}"),
            Err(e) => panic!("{what}: reserve failed under concurrency: {e}"),
        }
    }
    assert_eq!(
        winners, 1,
        "{what}: exactly one concurrent reservation may win"
    );
}

/// C3: tenant, method and path are part of the identity, and parts never run into each other.
pub async fn scopes_are_isolated_without_delimiter_collisions<S: IdempotencyStore>(store: &S) {
    let t = unique();
    let base = scope_in(&t, "k");
    let token = reserved(store, &base, &FP_A, LEASE).await;
    assert_eq!(
        complete(store, &base, &token, &response(b"tenant A"), TTL).await,
        WriteOutcome::Applied
    );
    let others = [
        scope_in(&format!("{t}-other"), "k"),
        Scope {
            method: "PATCH".into(),
            ..base.clone()
        },
        Scope {
            path: "/conformance/2".into(),
            ..base.clone()
        },
        // Built to collide if the store joined the parts with ':' or '/'.
        scope_in(&format!("{t}:POST:/conformance"), "k"),
        scope_in(&t, "POST:/conformance:k"),
        Scope {
            tenant: format!("{t}:POST"),
            method: "/conformance".into(),
            path: "k".into(),
            key: String::new(),
        },
        // Or with another delimiter.
        scope_in(&format!("{t}|POST|/conformance"), "k"),
        scope_in(&format!("{t}#POST#/conformance"), "k"),
        scope_in(&format!("{t}\u{1f}POST\u{1f}/conformance"), "k"),
        // Compared byte for byte: not case-insensitively, not ignoring trailing spaces, not
        // folding accents or Unicode normalization (a database collation might).
        scope_in(&t.to_uppercase(), "k"),
        scope_in(&t, "K"),
        scope_in(&t, "k "),
        Scope {
            path: "/Conformance".into(),
            ..base.clone()
        },
        Scope {
            path: "/conformance ".into(),
            ..base.clone()
        },
    ];
    for other in &others {
        reserved(store, other, &FP_A, LEASE).await;
    }
    // Accents and normalization, on a record of their own: `é` precomposed (NFC) and as `e`
    // plus a combining accent (NFD), and a plain `e`.
    let accented = scope_in(&t, "caf\u{e9}");
    let token = reserved(store, &accented, &FP_A, LEASE).await;
    complete(store, &accented, &token, &response(b"nfc"), TTL).await;
    reserved(store, &scope_in(&t, "cafe\u{301}"), &FP_A, LEASE).await;
    reserved(store, &scope_in(&t, "cafe"), &FP_A, LEASE).await;
    // And the records are still there, each its own.
    match reserve(store, &base, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response: r, .. } => assert_eq!(r, response(b"tenant A")),
        other => panic!("C3: the first record is gone after its neighbours: {other:?}"),
    }
    match reserve(store, &accented, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response: r, .. } => assert_eq!(r, response(b"nfc")),
        other => panic!("C3: the accented record is gone after its neighbours: {other:?}"),
    }
}

/// C3: a store that declares a limit on scopes ([`IdempotencyStore::max_scope_bytes`]) records
/// every scope of exactly that size, whatever its bytes: incompressible, spread over all four
/// parts, each part long and the first three followed by the most alignment (for PostgreSQL,
/// the B-tree entry's worst case: a 4-byte header per part and 3 bytes of padding after each of
/// the first three). The middleware refuses longer scopes before calling the store. A limit
/// under about 700 bytes is checked with the path taking the rest.
pub async fn a_scope_at_the_declared_limit_is_recorded<S: IdempotencyStore>(store: &S) {
    // A limit past a mebibyte (the memory store's, from its byte bound) is far beyond any
    // request head a server accepts; checked at a mebibyte.
    let Some(max) = store.max_scope_bytes().map(|max| max.min(1 << 20)) else {
        return;
    };
    // Random hex: no run a compressor could shorten.
    let mut noise = String::new();
    while noise.len() < max {
        noise.push_str(&ReservationToken::random().as_uuid().simple().to_string());
    }
    let tenant = unique();
    // `x` or less, one more than a multiple of four.
    let one_past_four = |x: usize| x - (x + 3) % 4;
    let quarter = one_past_four(max / 4);
    let scope = if quarter >= 128 + tenant.len() {
        // The worst case for a B-tree entry: every part over 126 bytes (a 4-byte header
        // each), and the first three one past a multiple of four (3 bytes of alignment after
        // each).
        let key = max - 3 * quarter;
        Scope {
            tenant: format!("{tenant}{}", &noise[..quarter - tenant.len()]),
            method: noise[..quarter].to_ascii_uppercase(),
            path: format!("/{}", &noise[..quarter - 1]),
            key: noise[..key].to_owned(),
        }
    } else if max > tenant.len() + "POST/k".len() {
        // A small limit: the rest in the path.
        Scope {
            path: format!("/{}", &noise[..max - tenant.len() - "POST/k".len()]),
            ..scope_in(&tenant, "k")
        }
    } else {
        return; // too small for this suite's own scopes
    };
    assert_eq!(
        scope.byte_len(),
        max,
        "the scope built is exactly at the limit"
    );
    let token = reserved(store, &scope, &FP_A, LEASE).await;
    let stored = response(b"at the limit");
    assert_eq!(
        complete(store, &scope, &token, &stored, TTL).await,
        WriteOutcome::Applied,
        "C3: a scope at the store's declared limit must be recorded"
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response, .. } => assert_eq!(response, stored),
        other => panic!("C3: a scope at the declared limit must replay, got {other:?}"),
    }
}

/// C12: after a purge, expired completed records and dead reservations are gone and live
/// records remain. Store-neutral: it does not count what `purge_expired` returns, since a store
/// may drop expired records by itself (a TTL in the backend) before the purge sees them.
pub async fn purge_deletes_only_expired_records<S: IdempotencyStore>(store: &S) {
    let t = unique();
    let expired = scope_in(&t, "expired");
    let dead = scope_in(&t, "dead");
    let live = scope_in(&t, "live");
    let running = scope_in(&t, "running");
    // Completed within a lease that has ended by the purge: its TTL, not its lease, counts.
    let short_lived = scope_in(&t, "completed-after-a-short-lease");
    let token = reserved(store, &short_lived, &FP_A, SHORT).await;
    complete(store, &short_lived, &token, &response(b"s"), TTL).await;
    let token = reserved(store, &expired, &FP_A, LEASE).await;
    complete(store, &expired, &token, &response(b"e"), SHORT).await;
    reserved(store, &dead, &FP_A, SHORT).await;
    let token = reserved(store, &live, &FP_A, LEASE).await;
    complete(store, &live, &token, &response(b"l"), TTL).await;
    reserved(store, &running, &FP_A, LEASE).await;
    tokio::time::sleep(SHORT * 2).await;
    if let Err(e) = store.purge_expired(Duration::ZERO).await {
        panic!("purge failed: {e}");
    }
    match reserve(store, &live, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response: r, .. } => assert_eq!(r, response(b"l")),
        other => panic!("C12: purge must keep a live completed record, got {other:?}"),
    }
    match reserve(store, &short_lived, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response: r, .. } => assert_eq!(r, response(b"s")),
        other => panic!(
            "C12: purge must keep a completed record within its TTL whose lease has ended, \
             got {other:?}"
        ),
    }
    assert!(
        matches!(
            reserve(store, &running, &FP_A, LEASE).await,
            ReserveOutcome::InFlight { .. }
        ),
        "C12: purge must keep a running reservation"
    );
    // The dead reservation and the expired record are gone, so even another fingerprint may
    // now reserve their keys.
    reserved(store, &dead, &FP_B, LEASE).await;
    reserved(store, &expired, &FP_B, LEASE).await;
}

/// C9, C22: a reservation whose lease ended is kept until its grace is over. A purge with a
/// grace longer than the time since the lease ended keeps it: another body is still refused,
/// and a late `complete` by its holder (a slow handler nobody took over) still applies.
pub async fn purge_keeps_ended_reservations_within_grace<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    if let Err(e) = store.purge_expired(Duration::from_secs(3600)).await {
        panic!("purge failed: {e}");
    }
    match reserve(store, &scope, &FP_B, LEASE).await {
        ReserveOutcome::InFlight { fingerprint, .. } => assert_eq!(
            fingerprint, FP_A,
            "InFlight must report the ended reservation's fingerprint"
        ),
        other => panic!(
            "C7, C9: another body must not reserve a key whose reservation is within its \
             grace, got {other:?}"
        ),
    }
    let late = response(b"late but complete");
    assert_eq!(
        complete(store, &scope, &token, &late, TTL).await,
        WriteOutcome::Applied,
        "C9: the holder's late complete must apply while nobody took the key over"
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response, .. } => assert_eq!(response, late),
        other => panic!("the late response must be replayed, got {other:?}"),
    }
}

/// C9: a holder that renews its lease keeps the key past the lease it reserved with: a purge
/// with no grace keeps it, a retry of the same request is not let in, and the lease left is
/// the renewed one.
pub async fn renewed_lease_is_not_taken_over<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, SHORT).await;
    assert_eq!(
        renew(store, &scope, &token, LEASE).await,
        WriteOutcome::Applied,
        "C9: the holder renews its own lease"
    );
    tokio::time::sleep(SHORT * 2).await; // past the first lease
    if let Err(e) = store.purge_expired(Duration::ZERO).await {
        panic!("purge failed: {e}");
    }
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining,
        } => {
            assert_eq!(fingerprint, FP_A);
            assert!(
                lease_remaining > LEASE - SHORT * 4 && lease_remaining <= LEASE,
                "lease_remaining {lease_remaining:?} is not the renewed lease"
            );
        }
        other => panic!("C9: a renewed reservation must not be taken over, got {other:?}"),
    }
    let done = response(b"slow but once");
    assert_eq!(
        complete(store, &scope, &token, &done, TTL).await,
        WriteOutcome::Applied,
        "the renewed holder completes"
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response, .. } => assert_eq!(response, done),
        other => panic!("expected the renewed holder's response, got {other:?}"),
    }
}

/// C9: only the current token renews. A foreign token, a released or completed record, and a
/// holder whose key was taken over all get `Stale`, and change nothing: the new holder's
/// lease is not extended (a retry after it ends takes over) and no record is revived.
pub async fn renewal_is_fenced_by_the_token<S: IdempotencyStore>(store: &S) {
    // A foreign token on a live reservation.
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, SHORT).await;
    let foreign = ReservationToken::random();
    assert_eq!(
        renew(store, &scope, &foreign, LEASE).await,
        WriteOutcome::Stale,
        "C9: a foreign token must not renew"
    );
    tokio::time::sleep(SHORT * 2).await;
    let new = reserved(store, &scope, &FP_A, SHORT).await;
    assert_ne!(new, token, "the foreign renewal extended the lease");

    // The old holder after the takeover: stale, and the new holder's lease is not extended.
    assert_eq!(
        renew(store, &scope, &token, LEASE).await,
        WriteOutcome::Stale,
        "C9: a holder whose key was taken over must not renew"
    );
    tokio::time::sleep(SHORT * 2).await;
    let third = reserved(store, &scope, &FP_A, LEASE).await;
    assert!(
        third != new && third != token,
        "a stale renewal extended the lease"
    );

    // A completed record: stale, and it stays completed with its response.
    let done = response(b"done");
    assert_eq!(
        complete(store, &scope, &third, &done, TTL).await,
        WriteOutcome::Applied
    );
    assert_eq!(
        renew(store, &scope, &third, LEASE).await,
        WriteOutcome::Stale,
        "a completed record has no lease to renew"
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::Completed { response, .. } => assert_eq!(response, done),
        other => panic!("a renewal changed a completed record: {other:?}"),
    }

    // A released record: stale, and not revived.
    let released = fresh_scope();
    let token = reserved(store, &released, &FP_A, LEASE).await;
    assert_eq!(
        release(store, &released, &token).await,
        WriteOutcome::Applied
    );
    assert_eq!(
        renew(store, &released, &token, LEASE).await,
        WriteOutcome::Stale,
        "a released reservation must not be revived"
    );
    reserved(store, &released, &FP_B, LEASE).await;
}

/// C9: like a late `complete`, a renewal after the lease ended applies while nobody took the
/// key over, and from then on the key is held again.
pub async fn renewal_after_the_lease_applies_until_a_takeover<S: IdempotencyStore>(store: &S) {
    let scope = fresh_scope();
    let token = reserved(store, &scope, &FP_A, SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    assert_eq!(
        renew(store, &scope, &token, LEASE).await,
        WriteOutcome::Applied,
        "C9: the holder's late renewal applies while nobody took the key over"
    );
    match reserve(store, &scope, &FP_A, LEASE).await {
        ReserveOutcome::InFlight { fingerprint, .. } => assert_eq!(fingerprint, FP_A),
        other => panic!("a renewed reservation must not be taken over, got {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn memory_store_conforms() {
        super::run_all(&crate::store::MemoryStore::new()).await;
    }
}
