//! Where idempotency records live: the [`IdempotencyStore`] trait and its implementations.
//!
//! A store keeps one record per [`Scope`] (tenant, method, path, key). A record is either a
//! *reservation* (a handler is running; it carries a lease and a fencing token) or a *completed*
//! record (the response to replay). The middleware needs exactly three operations on the request
//! path, and each must be atomic on its own:
//!
//! 1. [`reserve`](IdempotencyStore::reserve): reserve-or-fetch in one step. Of any number of
//!    concurrent callers with the same scope, exactly one gets [`ReserveOutcome::Reserved`]; the
//!    others see the record as it is ([`ReserveOutcome::InFlight`] or
//!    [`ReserveOutcome::Completed`]). An expired completed record counts as absent; an in-flight
//!    record whose lease ended may be taken over by a caller with the *same* fingerprint (it is a
//!    retry of the same request whose first holder crashed or hung).
//! 2. [`complete`](IdempotencyStore::complete): store the response, but only if the caller still
//!    holds the reservation (its token matches). A holder whose lease was taken over gets
//!    [`WriteOutcome::Stale`] and must not overwrite the new holder's record. A completed
//!    record never changes: a second `complete` by the token that completed it may answer
//!    `Applied` (the PostgreSQL and Redis stores do, so a retry after a reply lost in transit,
//!    or after an unacknowledged `WAIT`, is not mistaken for a takeover) or `Stale`, and
//!    leaves it as it is.
//! 3. [`release`](IdempotencyStore::release): drop the reservation (the response is not to be
//!    stored, e.g. a 5xx), fenced by the token in the same way.
//!
//! A fourth, [`renew_lease`](IdempotencyStore::renew_lease), keeps a slow handler's
//! reservation from being taken over while it runs; it is fenced like `complete`. It has a
//! default (no renewal), so a store without it still works, with the lease it was given.
//!
//! [`purge_expired`](IdempotencyStore::purge_expired) deletes what no request can use any more.
//!
//! Time is the store's business: leases and TTLs are passed as durations and the store measures
//! them with its own clock (the database's `now()` for PostgreSQL), so app instances with skewed
//! clocks still agree.
//!
//! # Stores in this crate
//! - [`MemoryStore`]: one process, no setup; for development, tests and single-instance apps.
//! - `PostgresStore` (feature `postgres`): several instances sharing one database.
//! - `RedisStore` (feature `redis`): several instances sharing one Redis, no schema, no purge.
//! - `CachedStore` (feature `cached`, on by default): wraps another store and answers replays
//!   of completed records from an in-process cache, without a round trip.
//!
//! # Writing a store
//! Implement the four methods; `async fn` in the impl is fine as long as the futures are `Send`.
//! The shape below is a complete (if not very useful) store that keeps one record; a real one
//! keeps a map and must make `reserve` atomic with whatever its backend offers (a mutex, a
//! conditional write, a transaction, a Lua script). Do not use it as it is: a request with a
//! second key replaces the first key's record, live or not, so a retry of the first runs its
//! handler again (the conformance suite fails it for that).
//!
//! ```
//! use std::sync::Mutex;
//! use std::time::{Duration, Instant};
//! use idempotency_actix::store::{
//!     IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
//!     WriteOutcome,
//! };
//! use idempotency_actix::Fingerprint;
//!
//! /// `now + d`, saturating: the middleware passes `Duration::MAX` for "for ever", and
//! /// `Instant + Duration::MAX` panics.
//! fn later(now: Instant, d: Duration) -> Instant {
//!     let century = Duration::from_secs(100 * 365 * 24 * 3600);
//!     now.checked_add(d).or_else(|| now.checked_add(century)).unwrap_or(now)
//! }
//!
//! enum Slot {
//!     InFlight { fingerprint: Fingerprint, token: ReservationToken, until: Instant },
//!     Done { fingerprint: Fingerprint, response: StoredResponse, until: Instant },
//! }
//!
//! /// Remembers a single scope. Enough to show the contract, not for production.
//! #[derive(Default)]
//! struct OneSlotStore(Mutex<Option<(Scope, Slot)>>);
//!
//! impl IdempotencyStore for OneSlotStore {
//!     async fn reserve(
//!         &self, scope: &Scope, fingerprint: &Fingerprint, lease: Duration,
//!     ) -> Result<ReserveOutcome, StoreError> {
//!         let mut slot = self.0.lock().map_err(|_| StoreError::unavailable("poisoned"))?;
//!         let now = Instant::now();
//!         if let Some((held, record)) = slot.as_ref().filter(|(s, _)| s == scope) {
//!             let _ = held;
//!             match record {
//!                 Slot::Done { fingerprint: f, response, until } if *until > now => {
//!                     return Ok(ReserveOutcome::Completed {
//!                         fingerprint: *f, response: response.clone(),
//!                         expires_in: Some(until.saturating_duration_since(now)),
//!                     })
//!                 }
//!                 Slot::InFlight { fingerprint: f, until, .. } if *until > now || f != fingerprint => {
//!                     return Ok(ReserveOutcome::InFlight {
//!                         fingerprint: *f, lease_remaining: until.saturating_duration_since(now),
//!                     })
//!                 }
//!                 _ => {} // expired: treat as absent / take over
//!             }
//!         }
//!         let token = ReservationToken::random();
//!         *slot = Some((scope.clone(), Slot::InFlight {
//!             fingerprint: *fingerprint, token, until: later(now, lease),
//!         }));
//!         Ok(ReserveOutcome::Reserved { token })
//!     }
//!
//!     async fn complete(
//!         &self, scope: &Scope, token: &ReservationToken, response: &StoredResponse, ttl: Duration,
//!     ) -> Result<WriteOutcome, StoreError> {
//!         let mut slot = self.0.lock().map_err(|_| StoreError::unavailable("poisoned"))?;
//!         match slot.as_ref() {
//!             Some((s, Slot::InFlight { fingerprint, token: t, .. })) if s == scope && t == token => {
//!                 let fingerprint = *fingerprint;
//!                 *slot = Some((scope.clone(), Slot::Done {
//!                     fingerprint, response: response.clone(), until: later(Instant::now(), ttl),
//!                 }));
//!                 Ok(WriteOutcome::Applied)
//!             }
//!             _ => Ok(WriteOutcome::Stale),
//!         }
//!     }
//!
//!     async fn release(
//!         &self, scope: &Scope, token: &ReservationToken,
//!     ) -> Result<WriteOutcome, StoreError> {
//!         let mut slot = self.0.lock().map_err(|_| StoreError::unavailable("poisoned"))?;
//!         match slot.as_ref() {
//!             Some((s, Slot::InFlight { token: t, .. })) if s == scope && t == token => {
//!                 *slot = None;
//!                 Ok(WriteOutcome::Applied)
//!             }
//!             _ => Ok(WriteOutcome::Stale),
//!         }
//!     }
//!
//!     async fn purge_expired(&self, _grace: Duration) -> Result<u64, StoreError> {
//!         Ok(0)
//!     }
//! }
//! ```
//!
//! With the `test-suite` feature, `idempotency_actix::store::conformance` runs the same rules
//! against your store that ours pass.
//!
//! ## What the middleware relies on
//! Besides the atomicity above, each of these is something a store can get wrong while looking
//! right, and each costs a second run of a handler or a response replayed to the wrong request:
//! - **Scopes compare byte for byte.** Not case-insensitively, not ignoring trailing spaces,
//!   not folding accents or normalizing Unicode (a database's default collation may do any of
//!   these: use a binary one), never truncated, and never joined into one string without
//!   length prefixes or escaping. The fingerprint does not cover the tenant: two tenants whose
//!   scopes a store confused would get each other's responses.
//! - **A reservation over an old record is a new record**: after a takeover, over an expired
//!   record, after a release, it carries the new fingerprint, the new token and a whole new
//!   lease. A takeover that did not move the lease would be taken over again by the next
//!   retry.
//! - **`complete`, `release` and `renew_lease` are conditional on the token**, in one atomic
//!   step like `reserve` (a conditional write, a compare-and-set, a script), never a read and
//!   then a write.
//! - **An ended reservation is kept** for the `grace` of
//!   [`purge_expired`](IdempotencyStore::purge_expired) (24 h by default: `MemoryStore`'s
//!   `reservation_grace`, `RedisStore`'s `in_flight_grace`, `idem-cli purge --grace`), not
//!   deleted when its lease ends: meanwhile it refuses another body and accepts its holder's
//!   late `complete`. A backend TTL that ends with the lease loses both.
//! - **Every call answers within a bound**, well under a third of the lease. The middleware
//!   does not time store calls out (the request waits with them: a `complete` that never
//!   answers holds the client's response), and it does not drop a call midway, except when
//!   the process stops; give your client a timeout and answer
//!   [`StoreError::Unavailable`] when it fires.
//! - **A write that fails after the backend may have applied it** (a timeout, a connection lost
//!   after sending) is retried or undone by the middleware for `complete` and `release`. For
//!   `reserve` it cannot be: the request gets 503 and the reservation, if it was made, holds
//!   the key for a lease. The built-in stores release such a reservation in the background,
//!   fenced by its token; do the same if your backend can time out after applying a write.
//! - **Errors say whose fault they are.** `Unavailable` is the backend being unreachable,
//!   slow or overloaded, which [`fail_open`](crate::IdempotencyBuilder::fail_open) may run past;
//!   anything a request's content can cause (a value too long for a column) is
//!   [`StoreError::Backend`] ([`StoreError::backend`]), which it never runs past, so a client
//!   cannot choose to go unprotected.
//! - **Declare your limits**: the longest scope
//!   ([`max_scope_bytes`](IdempotencyStore::max_scope_bytes)) and the largest response body your backend always
//!   has room for ([`max_response_bytes`](IdempotencyStore::max_response_bytes): an item size
//!   limit counts, and leave room for the headers: the middleware bounds the body only), so
//!   the middleware refuses what you cannot store before a handler runs, not after.
//! - **Without [`renew_lease`](IdempotencyStore::renew_lease)** (`renews_leases() == false`)
//!   a handler that runs longer than its lease is taken over by a retry and runs twice: size
//!   `lock_timeout` for your slowest handler, or implement it.
//! - **`purge_expired` is yours to schedule**: the middleware never calls it, and `idem-cli`
//!   purges only the built-in stores.

#[cfg(feature = "cached")]
pub mod cached;
mod memory;
mod response;

#[cfg(feature = "postgres")]
pub mod postgres;

#[cfg(feature = "redis")]
pub mod redis;

#[cfg(any(feature = "postgres", feature = "redis"))]
mod release_later;

#[cfg(any(test, feature = "test-suite"))]
pub mod conformance;

use std::fmt;
use std::future::Future;
use std::time::Duration;

#[cfg(feature = "redis")]
pub use self::redis::RedisStore;
pub use crate::fingerprint::Fingerprint;
#[cfg(feature = "cached")]
pub use cached::{CachedStore, CachedStoreBuilder};
pub use memory::{MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;
pub use response::{HeaderDecodeError, StoredResponse};

/// The identity of a record: the same key in another tenant, method or path is another record.
///
/// The parts are kept apart (never joined into one string), so no choice of tenant or key can
/// make two different scopes collide.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The tenant, or the empty string for the global scope.
    pub tenant: String,
    /// The HTTP method, upper case (`POST`).
    pub method: String,
    /// The request path, without the query string.
    pub path: String,
    /// The Idempotency-Key as parsed (sf-string escapes removed).
    pub key: String,
}

impl Scope {
    /// The scope's size as [`IdempotencyStore::max_scope_bytes`] counts it: the UTF-8 lengths
    /// of its four parts, added.
    pub fn byte_len(&self) -> usize {
        self.tenant.len() + self.method.len() + self.path.len() + self.key.len()
    }
}

/// The fencing token of one reservation. Only its holder may complete or release the record.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReservationToken(uuid::Uuid);

impl ReservationToken {
    /// A fresh, unpredictable token in UUID v4 form (122 bits).
    ///
    /// The bits are SHA-256 of a 256-bit process secret (drawn once from the operating
    /// system's random source) and a per-process counter: distinct for every call, and
    /// unguessable without the secret, like OS randomness, but without a `getrandom(2)` system
    /// call per token (which cost more than the rest of a memory-store reservation).
    ///
    /// Kept home-made on purpose: the crates that are as fast (rand's thread-local generator,
    /// and uuid's `fast-rng`, which uses it) dropped fork protection in rand 0.9 (rand PR 1379:
    /// callers must reseed after `fork` themselves), so a forked worker would repeat its
    /// parent's next tokens, and a repeated fencing token lets a stale holder complete a record
    /// it no longer holds. Hashing in the process id keeps parent and child apart with no hook.
    pub fn random() -> Self {
        use sha2::{Digest, Sha256};
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::OnceLock;

        static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let secret = SECRET.get_or_init(|| {
            let mut secret = [0u8; 32];
            secret[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
            secret[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
            secret
        });
        let count = COUNTER.fetch_add(1, Ordering::Relaxed);
        // The process id keeps a forked child (which inherits secret and counter) from
        // repeating its parent's tokens.
        let digest = Sha256::new()
            .chain_update(secret)
            .chain_update(std::process::id().to_le_bytes())
            .chain_update(count.to_le_bytes())
            .finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        Self(uuid::Builder::from_random_bytes(bytes).into_uuid())
    }

    /// The token as a UUID, for stores that persist it.
    pub fn as_uuid(&self) -> uuid::Uuid {
        self.0
    }

    /// A token read back from storage.
    pub fn from_uuid(uuid: uuid::Uuid) -> Self {
        Self(uuid)
    }
}

impl fmt::Debug for ReservationToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReservationToken({})", self.0)
    }
}

/// What [`IdempotencyStore::reserve`] found.
#[derive(Debug, Clone)]
pub enum ReserveOutcome {
    /// The caller now holds the reservation and should run the handler.
    Reserved {
        /// Present it to `complete` or `release`.
        token: ReservationToken,
    },
    /// Another reservation holds the key (or held it and its lease ended, but the fingerprint
    /// differs so it cannot be taken over).
    InFlight {
        /// The fingerprint of the request that holds it.
        fingerprint: Fingerprint,
        /// Time left on its lease (zero when it ended).
        lease_remaining: Duration,
    },
    /// A live completed record.
    Completed {
        /// The fingerprint of the request that produced it.
        fingerprint: Fingerprint,
        /// The response to replay.
        response: StoredResponse,
        /// A time the record is sure to stay live for (at most what is left of its TTL), if
        /// the store learns it in the same call; `None` otherwise. `CachedStore` uses it so
        /// that it never keeps a record longer than the store does.
        expires_in: Option<Duration>,
    },
}

/// Whether a fenced write (`complete`, `release`) took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The token held the reservation; the write took effect.
    Applied,
    /// The token no longer holds the reservation (its lease was taken over, or the record was
    /// released or purged). Nothing was changed.
    Stale,
}

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a store could not answer. Every variant makes the middleware fail closed (503) before the
/// handler runs; `fail_open` lets the request run unprotected instead, except after a
/// [`StoreError::Backend`] (which may be about the request itself), once the key was seen in
/// flight, while confirming a reservation that was answered slowly (the key is held then), and
/// in transactional mode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend cannot be reached, timed out, or has no free connection.
    #[error("idempotency store unavailable: {0}")]
    Unavailable(#[source] BoxError),
    /// The backend is reachable but not provisioned (PostgreSQL: the table does not exist).
    #[error("idempotency store is not provisioned: {hint}")]
    NotProvisioned {
        /// What the operator should do, e.g. "run `idem-cli migrate`".
        hint: String,
    },
    /// The store holds as many records as it may, and none of them may be dropped (live
    /// records, C22: reservations, and completed records unless the store was told it may
    /// evict them).
    #[error("idempotency store is at capacity ({0} records)")]
    Capacity(usize),
    /// The store holds as many bytes as it may (a memory bound, C22), and none of its records
    /// may be dropped, or the record to store is larger than the whole bound.
    #[error("idempotency store is at capacity ({0} bytes)")]
    ByteCapacity(usize),
    /// Any other backend failure.
    #[error("idempotency store error: {0}")]
    Backend(#[source] BoxError),
}

impl StoreError {
    /// An [`StoreError::Unavailable`] from a message.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::Unavailable(message.into().into())
    }

    /// A [`StoreError::Backend`] from a message: for a failure the request itself may cause (a
    /// value the backend cannot record), which `fail_open` never runs past.
    pub fn backend(message: impl Into<String>) -> Self {
        Self::Backend(message.into().into())
    }
}

/// Storage for idempotency records. See the [module docs](self) for the rules an implementation
/// must keep and a worked example.
pub trait IdempotencyStore: Send + Sync + 'static {
    /// Reserve `scope` for a request with `fingerprint`, or report the record that is there.
    /// Must be atomic: two concurrent callers can never both get `Reserved` for one scope.
    fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> impl Future<Output = Result<ReserveOutcome, StoreError>> + Send;

    /// Store `response` for `scope`, keep it for `ttl`, if `token` still holds the reservation.
    fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<WriteOutcome, StoreError>> + Send;

    /// Delete the reservation of `scope` if `token` still holds it, so the key can be used again.
    fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> impl Future<Output = Result<WriteOutcome, StoreError>> + Send;

    /// Renew the lease of `scope`'s reservation: if `token` still holds it (the record is a
    /// reservation with this token), its lease now ends `lease` from now, by the store's clock,
    /// and the answer is [`WriteOutcome::Applied`]. Otherwise (completed, released, purged or
    /// taken over) nothing changes and the answer is [`WriteOutcome::Stale`].
    ///
    /// The middleware calls it while a handler runs longer than a third of its lease (C9), so
    /// a slow handler is not taken over by a retry while its process is alive, and a crashed
    /// one still frees its key within one lease. Like a late `complete`, a renewal applies
    /// after the lease ended as long as nobody took the key over; afterwards the key is held
    /// again, and an ended reservation's grace (see `purge_expired`) counts from the new end.
    /// It must be fenced exactly like `complete`: a renewal by a stale holder must never
    /// extend the new holder's lease or revive a record.
    ///
    /// The default answers `Stale` and [`renews_leases`](Self::renews_leases) `false`, so a
    /// store written before renewal existed keeps working: the middleware then leaves every
    /// reservation to the lease it was given. One thing it cannot do without renewal: confirm
    /// a reservation answered a third of its lease late or more, so such a reservation is
    /// given back and the request answered 503 (with the default 60 s lease, a `reserve` that
    /// took 20 s).
    fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> impl Future<Output = Result<WriteOutcome, StoreError>> + Send {
        let _ = (scope, token, lease);
        std::future::ready(Ok(WriteOutcome::Stale))
    }

    /// Whether [`renew_lease`](Self::renew_lease) is implemented. Defaults to `false`; every
    /// store in this crate answers `true`.
    fn renews_leases(&self) -> bool {
        false
    }

    /// The longest scope this store can record, in bytes ([`Scope::byte_len`]), or `None`
    /// (the default) for no limit.
    ///
    /// The middleware answers a keyed request whose scope is longer with 400 `SCOPE_TOO_LONG`
    /// before calling the store, so a client's long URL (or an app's long tenant) is a clear,
    /// final refusal rather than a store error on every retry. Declare one when the backend
    /// cannot take every size: PostgreSQL's B-tree entry holds at most 2,704 bytes, so the
    /// four-column primary key cannot take every path. The conformance suite checks that a
    /// scope of exactly this size, incompressible and spread over all four parts, is recorded.
    fn max_scope_bytes(&self) -> Option<usize> {
        None
    }

    /// The largest response body that [`complete`](Self::complete) of a reservation this store
    /// granted is sure to find room for, or `None` (the default) for no such limit.
    ///
    /// [`IdempotencyBuilder::try_build`](crate::IdempotencyBuilder::try_build) refuses a
    /// `max_response_bytes` above it. A response the store cannot take is found only after its
    /// handler ran; the key then stays reserved until its lease ends and a retry runs the
    /// handler again (C16), so the mismatch is refused when the app is built instead. Declare
    /// it when room for responses is secured at `reserve` time, as `MemoryStore` does with its
    /// response allowance.
    fn max_response_bytes(&self) -> Option<usize> {
        None
    }

    /// A short, fixed name for metrics labels (`store="memory"`). Defaults to `"custom"`.
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Delete expired completed records and reservations whose lease ended more than `grace`
    /// ago. Returns how many records were deleted.
    fn purge_expired(
        &self,
        grace: Duration,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}
