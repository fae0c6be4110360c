//! [`CachedStore`]: answers replays of completed records from this process's memory.
//!
//! A completed record never changes until it expires: the response it holds is the one every
//! retry must get. So a copy of it is as good as the record, in any instance, for as long as
//! the record lives, and a replay served from the copy needs no round trip to the store. That
//! is what this wrapper does; everything else (reservations, completions, releases, lease
//! renewals, purges) goes to the wrapped store unchanged, so the atomicity and fencing rules
//! are the wrapped store's, and so is whether leases can be renewed.
//!
//! # What is cached, and for how long
//! - A completed record, the first time the wrapped store returns it from `reserve` (the
//!   first replay of a key in this instance, wherever the original ran). Later replays of that
//!   key in this instance are answered from memory. Records that are never retried (most of
//!   them) cost the cache nothing, and the miss path is the wrapped store's, untouched.
//!   Reservations and in-flight records are never cached.
//! - An entry lives at most until the record expires: the time left that the wrapped store
//!   reports with the record (`expires_in` of [`ReserveOutcome::Completed`]; the PostgreSQL store
//!   computes it with the database's clock in the same statement), counted from *before* the
//!   call, so the entry always ends first. And at most [`CachedStoreBuilder::max_ttl`]
//!   (default 60 s). The entry's end is measured on this process's monotonic clock, which on
//!   Linux stops while the machine is suspended (a laptop's sleep, a paused VM): after a
//!   suspend of S, an entry may replay up to S past its record's expiry. Servers that are not
//!   suspended are not affected; a paused VM that resumes can clear the cache
//!   ([`CachedStore::clear`]). A store that does not report the time left gets no entries: the wrapper
//!   is then a pass-through.
//! - At most [`CachedStoreBuilder::max_bytes`] bytes in all (default 64 MiB), each entry
//!   weighed by the heap its scope, headers and body hold, allocations and bookkeeping
//!   included (moka's weigher), and only responses up to
//!   [`CachedStoreBuilder::max_response_bytes`] (default 64 KiB). The bound is real bytes, not a
//!   worst case of entries times size (measured: `tests/cached_store_bytes.rs`); when it is
//!   reached moka's TinyLFU policy decides which entries stay (the frequently replayed ones).
//!   moka applies it when its maintenance runs, so a burst of new entries can pass it by some
//!   hundreds of entries for a moment.
//!
//! # Operations that change completed records behind the cache's back
//! - `idem-cli purge` deletes only expired records, and a cache entry never outlives its
//!   record, so purging never makes the cache disagree with the database.
//! - `idem-cli release --force` on a **completed** record deletes it from the database, but
//!   every instance that cached it keeps replaying the old response to retries of the old
//!   request until its entry ends: at most `max_ttl` (60 s by default). Only then does such a
//!   retry run again. A request with another body (the key reused for a new request) is never
//!   answered from an entry of another fingerprint: the wrapped store is asked, so it runs, or
//!   is replayed its own response, rather than being refused with 422. Releasing an in-flight
//!   key is unaffected (in-flight records are never cached). If you rely on forced releases of
//!   completed records taking effect at once, keep `max_ttl` short or do not use the cache.
//! - Editing or deleting rows by hand: the same as a forced release.
//!
//! ```
//! use idempotency_actix::{store::{CachedStore, MemoryStore}, Idempotency};
//! # fn demo(store: MemoryStore) {
//! // In production, wrap the PostgresStore: `CachedStore::new(PostgresStore::connect(url).await?)`.
//! let middleware = Idempotency::new(CachedStore::new(store));
//! # let _ = middleware; }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::sync::Cache;

use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};

/// Default [`CachedStoreBuilder::max_bytes`]: small next to any server's memory, room for
/// about 40,000 replays of typical responses (a few hundred bytes of body and a handful of
/// headers: some 1.7 KB of heap each, bookkeeping included).
pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Default [`CachedStoreBuilder::max_ttl`].
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(60);
/// Default [`CachedStoreBuilder::max_response_bytes`].
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// Bytes charged per entry on top of its scope and response: moka's bookkeeping (its node,
/// the key's hash, the expiry timer, its share of moka's tables), the entry itself and its
/// `Arc`. Measured with dhat (`tests/cached_store_bytes.rs`: about 630 bytes an entry beyond
/// what the other charges count, for a typical response), rounded up.
const ENTRY_OVERHEAD_BYTES: usize = 704;

/// What a heap allocation costs beyond the bytes asked for (the allocator's header and
/// rounding), charged once per allocation the cache holds.
const ALLOCATION_OVERHEAD_BYTES: usize = 16;

/// A store wrapper that serves replays of completed records from an in-process cache. See the
/// [module docs](self) for what is cached, for how long, and what a forced release means.
///
/// Cloning is cheap; clones share the cache and clone the wrapped store (the stores of this
/// crate share their state between clones).
pub struct CachedStore<S> {
    inner: S,
    cache: Cache<Scope, Arc<Entry>>,
    limits: Limits,
    /// Bumped by [`CachedStore::clear`]: a record read from the store before a `clear` is
    /// not cached after it (it may be one the operator just released by hand).
    epoch: Arc<AtomicU64>,
}

impl<S: Clone> Clone for CachedStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            cache: self.cache.clone(),
            limits: self.limits,
            epoch: Arc::clone(&self.epoch),
        }
    }
}

impl<S> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("entries", &self.cache.entry_count())
            .field("bytes", &self.cache.weighted_size())
            .field("max_bytes", &self.limits.max_bytes)
            .field("max_ttl", &self.limits.max_ttl)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    max_bytes: u64,
    max_ttl: Duration,
    max_response_bytes: usize,
}

/// Configures a [`CachedStore`]: see [`CachedStore::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct CachedStoreBuilder<S> {
    inner: S,
    limits: Limits,
}

impl<S: IdempotencyStore> CachedStoreBuilder<S> {
    /// Most bytes the cache holds (scopes, headers and bodies, plus a fixed overhead per entry).
    /// Default 64 MiB. Zero disables caching.
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.limits.max_bytes = max_bytes;
        self
    }

    /// Longest an entry is kept, whatever the record's own expiry. Default 60 s. This is also
    /// the longest a forced release of a completed record (`idem-cli release --force`) can go
    /// unnoticed by this instance.
    pub fn max_ttl(mut self, max_ttl: Duration) -> Self {
        self.limits.max_ttl = max_ttl;
        self
    }

    /// Responses whose body and headers are larger than this are not cached (they are still
    /// stored and replayed by the wrapped store). Default 64 KiB.
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.limits.max_response_bytes = max;
        self
    }

    /// The store.
    pub fn build(self) -> CachedStore<S> {
        let cache = Cache::builder()
            .max_capacity(self.limits.max_bytes)
            .weigher(|scope: &Scope, entry: &Arc<Entry>| {
                u32::try_from(entry.bytes + scope_bytes(scope)).unwrap_or(u32::MAX)
            })
            .expire_after(UntilRecordEnds)
            .build();
        CachedStore {
            inner: self.inner,
            cache,
            limits: self.limits,
            epoch: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl<S: IdempotencyStore> CachedStore<S> {
    /// Wrap `inner` with the default limits (64 MiB, 60 s, 64 KiB responses).
    pub fn new(inner: S) -> Self {
        Self::builder(inner).build()
    }

    /// Configure the cache around `inner`.
    pub fn builder(inner: S) -> CachedStoreBuilder<S> {
        CachedStoreBuilder {
            inner,
            limits: Limits {
                max_bytes: DEFAULT_MAX_BYTES,
                max_ttl: DEFAULT_MAX_TTL,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            },
        }
    }
}

impl<S> CachedStore<S> {
    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Number of cached entries (after moka's pending maintenance has run).
    pub fn len(&self) -> usize {
        self.cache.run_pending_tasks();
        usize::try_from(self.cache.entry_count()).unwrap_or(usize::MAX)
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held by the cache, as weighed against [`CachedStoreBuilder::max_bytes`].
    pub fn bytes(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.weighted_size()
    }

    /// Drop every cached entry (e.g. after releasing completed records by hand). A record
    /// read from the wrapped store before this call is not cached after it, even when that
    /// read answers later. Other processes' caches are their own: clear each instance.
    pub fn clear(&self) {
        // First the epoch, then the entries: an insert that read its record before this call
        // either sees the new epoch and drops its entry, or was made before `invalidate_all`.
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.cache.invalidate_all();
        self.cache.run_pending_tasks();
    }

    /// A live entry for `scope`, as the outcome `reserve` would have returned.
    fn lookup(&self, scope: &Scope, now: Instant) -> Option<ReserveOutcome> {
        let entry = self.cache.get(scope)?;
        // moka expires entries on its own schedule; never serve one past its record's end.
        (entry.until > now).then(|| ReserveOutcome::Completed {
            fingerprint: entry.fingerprint,
            response: entry.response.clone(),
            expires_in: Some(entry.until - now),
        })
    }

    /// Cache a completed record known to live at least `remaining` from `start`.
    fn insert(
        &self,
        scope: &Scope,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        start: Instant,
        remaining: Duration,
        epoch: u64,
    ) {
        let limits = self.limits;
        let size = response.size_bytes();
        if limits.max_bytes == 0 || size > limits.max_response_bytes {
            return;
        }
        let Some(until) = start.checked_add(remaining.min(limits.max_ttl)) else {
            return;
        };
        if until <= Instant::now() {
            return;
        }
        let entry = Entry {
            fingerprint,
            response: response.clone(),
            until,
            bytes: response_heap(response) + ENTRY_OVERHEAD_BYTES,
        };
        if self.epoch.load(Ordering::SeqCst) != epoch {
            return;
        }
        self.cache.insert(scope.clone(), Arc::new(entry));
        if self.epoch.load(Ordering::SeqCst) != epoch {
            // Cleared meanwhile: the record read before `clear` must not outlive it.
            self.cache.invalidate(scope);
        }
    }
}

/// One cached completed record.
struct Entry {
    fingerprint: Fingerprint,
    response: StoredResponse,
    /// When the entry ends: never after its record (see the module docs).
    until: Instant,
    /// The response's heap plus the per-entry overhead (the scope is weighed separately).
    bytes: usize,
}

/// The heap a cached scope holds: its four strings, each its own allocation.
fn scope_bytes(scope: &Scope) -> usize {
    [&scope.tenant, &scope.method, &scope.path, &scope.key]
        .iter()
        .map(|part| part.len() + ALLOCATION_OVERHEAD_BYTES)
        .sum()
}

/// The heap a cached response holds, as the stores hand it out (PostgreSQL's: every header
/// name and value an allocation of its own): the body, and per header its slot in the list
/// (`(String, Bytes)`), its name and its value. A response whose values share one buffer
/// (`MemoryStore`'s) is charged a little more than it holds; never less. Review, 2026-12-04:
/// with only the lengths counted, the cache held 2.2 times `max_bytes` for a typical response
/// and 14 times for one with a thousand small headers.
fn response_heap(response: &StoredResponse) -> usize {
    let allocation = |len: usize| {
        if len == 0 {
            0
        } else {
            len + ALLOCATION_OVERHEAD_BYTES
        }
    };
    let slot = std::mem::size_of::<(String, bytes::Bytes)>();
    response
        .headers
        .iter()
        .map(|(name, value)| slot + allocation(name.len()) + allocation(value.len()))
        .sum::<usize>()
        .saturating_add(allocation(response.body.len()))
}

/// moka's per-entry expiry: each entry ends when its record would, or at `max_ttl`.
struct UntilRecordEnds;

impl moka::Expiry<Scope, Arc<Entry>> for UntilRecordEnds {
    fn expire_after_create(
        &self,
        _scope: &Scope,
        entry: &Arc<Entry>,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(entry.until.saturating_duration_since(created_at))
    }

    /// An entry replaced (two misses of one scope cached one after the other) ends when its
    /// new record would: moka's default keeps the old entry's end (review, 2026-12-06).
    fn expire_after_update(
        &self,
        _scope: &Scope,
        entry: &Arc<Entry>,
        updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(entry.until.saturating_duration_since(updated_at))
    }
}

impl<S: IdempotencyStore> IdempotencyStore for CachedStore<S> {
    fn name(&self) -> &'static str {
        "cached"
    }

    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        let start = Instant::now();
        let epoch = self.epoch.load(Ordering::SeqCst);
        match self.lookup(scope, start) {
            // The entry ends before the record, so the record is live: the same answer the
            // wrapped store would give.
            Some(ReserveOutcome::Completed {
                fingerprint: cached,
                ..
            }) if cached != *fingerprint => {
                // Another request's record: a 422 if the store agrees. Asked, because the
                // record may be gone (a forced release, an eviction) and the key reused by the
                // request asking now, whose own stored response the store replays. Mismatches
                // are rare, so the round trip is cheap; the entry goes, and comes back with
                // the store's answer if that is still the record.
                self.cache.invalidate(scope);
            }
            Some(outcome) => return Ok(outcome),
            None => {}
        }
        let outcome = self.inner.reserve(scope, fingerprint, lease).await?;
        if let ReserveOutcome::Completed {
            fingerprint: stored,
            response,
            expires_in: Some(remaining),
        } = &outcome
        {
            self.insert(scope, *stored, response, start, *remaining, epoch);
        }
        Ok(outcome)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.inner.complete(scope, token, response, ttl).await
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.inner.release(scope, token).await
    }

    // Reservations are never cached, so a renewal has no entry to touch.
    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.inner.renew_lease(scope, token, lease).await
    }

    // The wrapped store's answer: a wrapper around a store that cannot renew cannot either.
    fn renews_leases(&self) -> bool {
        self.inner.renews_leases()
    }

    // The wrapped store's limit: every record is written there.
    fn max_scope_bytes(&self) -> Option<usize> {
        self.inner.max_scope_bytes()
    }

    fn max_response_bytes(&self) -> Option<usize> {
        self.inner.max_response_bytes()
    }

    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.cache.run_pending_tasks();
        self.inner.purge_expired(grace).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;

    use bytes::Bytes;

    use super::*;
    use crate::store::MemoryStore;

    /// A replaced entry ends when its own record would, not when the entry it replaced would
    /// have (moka's default for an update).
    #[test]
    fn a_replaced_entry_ends_with_its_own_record() {
        use moka::Expiry;
        let now = Instant::now();
        let entry = Arc::new(Entry {
            fingerprint: Fingerprint([1; 32]),
            response: StoredResponse {
                status: 200,
                headers: vec![],
                body: Bytes::new(),
            },
            until: now + Duration::from_secs(10),
            bytes: 0,
        });
        let scope = Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/p".into(),
            key: "k".into(),
        };
        let old_end = Some(Duration::from_millis(50));
        assert_eq!(
            UntilRecordEnds.expire_after_update(&scope, &entry, now, old_end),
            Some(Duration::from_secs(10))
        );
    }

    /// Counts the `reserve` calls that reach the wrapped store (round trips, for a database).
    #[derive(Clone, Default)]
    struct Counting {
        inner: MemoryStore,
        reserves: Arc<AtomicUsize>,
    }

    impl IdempotencyStore for Counting {
        async fn reserve(
            &self,
            scope: &Scope,
            fingerprint: &Fingerprint,
            lease: Duration,
        ) -> Result<ReserveOutcome, StoreError> {
            self.reserves.fetch_add(1, Ordering::SeqCst);
            self.inner.reserve(scope, fingerprint, lease).await
        }

        async fn complete(
            &self,
            scope: &Scope,
            token: &ReservationToken,
            response: &StoredResponse,
            ttl: Duration,
        ) -> Result<WriteOutcome, StoreError> {
            self.inner.complete(scope, token, response, ttl).await
        }

        async fn release(
            &self,
            scope: &Scope,
            token: &ReservationToken,
        ) -> Result<WriteOutcome, StoreError> {
            self.inner.release(scope, token).await
        }

        async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
            self.inner.purge_expired(grace).await
        }
    }

    const FP: Fingerprint = Fingerprint([7; 32]);
    const LEASE: Duration = Duration::from_secs(60);

    fn scope(key: &str) -> Scope {
        Scope {
            tenant: "t".into(),
            method: "POST".into(),
            path: "/p".into(),
            key: key.into(),
        }
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("x-a".into(), Bytes::from_static(b"1"))],
            body: Bytes::from_static(b"{\"id\":1}"),
        }
    }

    async fn stored<S: IdempotencyStore>(store: &S, key: &str, ttl: Duration) {
        let Ok(ReserveOutcome::Reserved { token }) = store.reserve(&scope(key), &FP, LEASE).await
        else {
            panic!("expected a reservation");
        };
        let outcome = store.complete(&scope(key), &token, &response(), ttl).await;
        assert_eq!(outcome.ok(), Some(WriteOutcome::Applied));
    }

    async fn replay<S: IdempotencyStore>(store: &S, key: &str, fp: &Fingerprint) -> ReserveOutcome {
        match store.reserve(&scope(key), fp, LEASE).await {
            Ok(outcome) => outcome,
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn cached_store_conforms() {
        let store = CachedStore::new(MemoryStore::new());
        crate::store::conformance::run_all(&store).await;
    }

    /// Renewal is the wrapped store's: the wrapper claims it only when its store has it, so the
    /// middleware never counts on renewals that answer `Stale` without looking.
    #[tokio::test]
    async fn renewal_is_the_wrapped_stores() {
        let renewing = CachedStore::new(MemoryStore::new());
        assert!(renewing.renews_leases());
        let ReserveOutcome::Reserved { token } = replay(&renewing, "a", &FP).await else {
            panic!("expected a reservation");
        };
        let renewed = renewing
            .renew_lease(&scope("a"), &token, Duration::from_secs(3600))
            .await;
        assert_eq!(renewed.ok(), Some(WriteOutcome::Applied));
        match replay(&renewing, "a", &FP).await {
            ReserveOutcome::InFlight {
                lease_remaining, ..
            } => assert!(lease_remaining > LEASE, "{lease_remaining:?}: not renewed"),
            other => panic!("{other:?}"),
        }

        // `Counting` keeps the trait's defaults: no renewal.
        let plain = CachedStore::new(Counting::default());
        assert!(!plain.renews_leases());
        let ReserveOutcome::Reserved { token } = replay(&plain, "a", &FP).await else {
            panic!("expected a reservation");
        };
        let renewed = plain.renew_lease(&scope("a"), &token, LEASE).await;
        assert_eq!(renewed.ok(), Some(WriteOutcome::Stale));
    }

    #[tokio::test]
    async fn second_replay_is_served_without_the_store() {
        let counting = Counting::default();
        let store = CachedStore::new(counting.clone());
        stored(&store, "a", Duration::from_secs(3600)).await;
        let before = counting.reserves.load(Ordering::SeqCst);
        for _ in 0..3 {
            match replay(&store, "a", &FP).await {
                ReserveOutcome::Completed {
                    fingerprint,
                    response: r,
                    ..
                } => {
                    assert_eq!(fingerprint, FP);
                    assert_eq!(r, response());
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(counting.reserves.load(Ordering::SeqCst), before + 1);
        assert_eq!(store.len(), 1);
        // Another request with the same key still sees the original fingerprint (422
        // upstream), from the store: an entry answers only its own fingerprint (the record may
        // have been released and the key reused by this request).
        match replay(&store, "a", &Fingerprint([8; 32])).await {
            ReserveOutcome::Completed { fingerprint, .. } => assert_eq!(fingerprint, FP),
            other => panic!("{other:?}"),
        }
        assert_eq!(counting.reserves.load(Ordering::SeqCst), before + 2);
        // And the store's answer is cached again for the record's own retries.
        assert!(matches!(
            replay(&store, "a", &FP).await,
            ReserveOutcome::Completed { .. }
        ));
        assert_eq!(counting.reserves.load(Ordering::SeqCst), before + 2);
    }

    #[tokio::test]
    async fn an_entry_never_outlives_its_record() {
        let store = CachedStore::new(MemoryStore::new());
        stored(&store, "short", Duration::from_millis(150)).await;
        assert!(matches!(
            replay(&store, "short", &FP).await,
            ReserveOutcome::Completed { .. }
        ));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            matches!(
                replay(&store, "short", &FP).await,
                ReserveOutcome::Reserved { .. }
            ),
            "an expired record is absent, even though it was cached"
        );
    }

    #[tokio::test]
    async fn max_ttl_bounds_an_entry() {
        let counting = Counting::default();
        let store = CachedStore::builder(counting.clone())
            .max_ttl(Duration::from_millis(50))
            .build();
        stored(&store, "a", Duration::from_secs(3600)).await;
        replay(&store, "a", &FP).await; // fills
        let before = counting.reserves.load(Ordering::SeqCst);
        replay(&store, "a", &FP).await; // cached
        assert_eq!(counting.reserves.load(Ordering::SeqCst), before);
        tokio::time::sleep(Duration::from_millis(80)).await;
        replay(&store, "a", &FP).await; // entry ended: asks the store again
        assert_eq!(counting.reserves.load(Ordering::SeqCst), before + 1);
    }

    #[tokio::test]
    async fn the_cache_is_bounded_and_skips_large_or_in_flight_records() {
        // Room for two entries by weight: scope ("t", "POST", "/p", one-letter key) + response.
        let one = weight("a");
        let two = 2 * one;
        let store = CachedStore::builder(MemoryStore::new())
            .max_bytes(two)
            .build();
        for key in ["a", "b", "c"] {
            stored(&store, key, Duration::from_secs(3600)).await;
            replay(&store, key, &FP).await;
        }
        assert!(store.len() <= 2, "{} entries", store.len());
        assert!(store.bytes() <= two, "{} bytes", store.bytes());
        let entries = store.len();
        // In flight: never cached.
        assert!(matches!(
            replay(&store, "d", &FP).await,
            ReserveOutcome::Reserved { .. }
        ));
        assert!(matches!(
            replay(&store, "d", &FP).await,
            ReserveOutcome::InFlight { .. }
        ));
        assert_eq!(store.len(), entries);

        let small = CachedStore::builder(MemoryStore::new())
            .max_response_bytes(4)
            .build();
        stored(&small, "big", Duration::from_secs(3600)).await;
        replay(&small, "big", &FP).await;
        assert!(small.is_empty());
    }

    #[tokio::test]
    async fn a_store_without_expiry_reports_is_passed_through() {
        struct NoExpiry(MemoryStore);
        impl IdempotencyStore for NoExpiry {
            async fn reserve(
                &self,
                scope: &Scope,
                fingerprint: &Fingerprint,
                lease: Duration,
            ) -> Result<ReserveOutcome, StoreError> {
                Ok(match self.0.reserve(scope, fingerprint, lease).await? {
                    ReserveOutcome::Completed {
                        fingerprint,
                        response,
                        ..
                    } => ReserveOutcome::Completed {
                        fingerprint,
                        response,
                        expires_in: None,
                    },
                    other => other,
                })
            }
            async fn complete(
                &self,
                scope: &Scope,
                token: &ReservationToken,
                response: &StoredResponse,
                ttl: Duration,
            ) -> Result<WriteOutcome, StoreError> {
                self.0.complete(scope, token, response, ttl).await
            }
            async fn release(
                &self,
                scope: &Scope,
                token: &ReservationToken,
            ) -> Result<WriteOutcome, StoreError> {
                self.0.release(scope, token).await
            }
            async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
                self.0.purge_expired(grace).await
            }
        }
        let store = CachedStore::new(NoExpiry(MemoryStore::new()));
        stored(&store, "a", Duration::from_secs(3600)).await;
        assert!(matches!(
            replay(&store, "a", &FP).await,
            ReserveOutcome::Completed { .. }
        ));
        assert!(store.is_empty());
    }

    /// A store that can be taken down, and whose reported time left can be replaced: the
    /// branches of the wrapper that a healthy memory store never takes.
    #[derive(Clone, Default)]
    struct Faulty {
        inner: Counting,
        down: Arc<AtomicBool>,
        /// When set, replaces the `expires_in` of a completed record.
        expires_in: Arc<Mutex<Option<Option<Duration>>>>,
    }

    impl Faulty {
        fn check(&self) -> Result<(), StoreError> {
            if self.down.load(Ordering::SeqCst) {
                Err(StoreError::unavailable("the database is down"))
            } else {
                Ok(())
            }
        }

        fn report_expires_in(&self, expires_in: Option<Duration>) {
            if let Ok(mut slot) = self.expires_in.lock() {
                *slot = Some(expires_in);
            }
        }
    }

    impl IdempotencyStore for Faulty {
        async fn reserve(
            &self,
            scope: &Scope,
            fingerprint: &Fingerprint,
            lease: Duration,
        ) -> Result<ReserveOutcome, StoreError> {
            self.check()?;
            let replaced = self.expires_in.lock().ok().and_then(|slot| *slot);
            Ok(match self.inner.reserve(scope, fingerprint, lease).await? {
                ReserveOutcome::Completed {
                    fingerprint,
                    response,
                    expires_in,
                } => ReserveOutcome::Completed {
                    fingerprint,
                    response,
                    expires_in: replaced.unwrap_or(expires_in),
                },
                other => other,
            })
        }

        async fn complete(
            &self,
            scope: &Scope,
            token: &ReservationToken,
            response: &StoredResponse,
            ttl: Duration,
        ) -> Result<WriteOutcome, StoreError> {
            self.check()?;
            self.inner.complete(scope, token, response, ttl).await
        }

        async fn release(
            &self,
            scope: &Scope,
            token: &ReservationToken,
        ) -> Result<WriteOutcome, StoreError> {
            self.check()?;
            self.inner.release(scope, token).await
        }

        async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
            self.check()?;
            self.inner.purge_expired(grace).await
        }
    }

    /// The weight of one cached entry of `response()` under `scope(key)`.
    fn weight(key: &str) -> u64 {
        let scope = scope(key);
        (scope_bytes(&scope) + response_heap(&response()) + ENTRY_OVERHEAD_BYTES) as u64
    }

    fn reserves(counting: &Counting) -> usize {
        counting.reserves.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn debug_accessors_and_clones_share_one_cache() {
        let counting = Counting::default();
        let store = CachedStore::builder(counting.clone())
            .max_bytes(123_456)
            .max_ttl(Duration::from_secs(5))
            .build();
        assert_eq!(store.name(), "cached");
        assert!(Arc::ptr_eq(&store.inner().reserves, &counting.reserves));
        assert!(store.is_empty());
        assert_eq!(store.bytes(), 0);
        stored(&store, "a", Duration::from_secs(3600)).await;
        replay(&store, "a", &FP).await;
        // `Debug` shows moka's counts as they are: let its pending maintenance run first.
        assert_eq!(store.len(), 1);
        let debug = format!("{store:?}");
        for part in [
            "CachedStore",
            "entries: 1",
            &format!("bytes: {}", weight("a")),
            "max_bytes: 123456",
            "max_ttl: 5s",
        ] {
            assert!(debug.contains(part), "{part:?} not in {debug}");
        }
        let builder_debug = format!(
            "{:?}",
            CachedStore::builder(MemoryStore::new()).max_ttl(Duration::from_secs(9))
        );
        assert!(builder_debug.contains("max_ttl: 9s"), "{builder_debug}");

        let clone = store.clone();
        assert_eq!(clone.len(), 1, "a clone sees the entries");
        let before = reserves(&counting);
        replay(&clone, "a", &FP).await;
        assert_eq!(reserves(&counting), before, "served from the shared cache");
        clone.clear();
        assert!(store.is_empty(), "clearing a clone clears the cache");
        assert_eq!(store.bytes(), 0);
        replay(&store, "a", &FP).await;
        assert_eq!(
            reserves(&counting),
            before + 1,
            "asked the store again after clear"
        );
    }

    #[tokio::test]
    async fn an_entry_weighs_its_scope_response_and_overhead() {
        let store = CachedStore::new(MemoryStore::new());
        let long_key = "k".repeat(200);
        for key in ["a", long_key.as_str()] {
            stored(&store, key, Duration::from_secs(3600)).await;
            replay(&store, key, &FP).await;
        }
        assert_eq!(store.len(), 2);
        assert_eq!(store.bytes(), weight("a") + weight(&long_key));
        assert_eq!(weight(&long_key) - weight("a"), 199, "the key is weighed");
    }

    #[tokio::test]
    async fn eviction_keeps_the_cache_within_its_bytes() {
        // Room for exactly three entries of one-letter keys.
        let max = 3 * weight("a");
        let store = CachedStore::builder(MemoryStore::new())
            .max_bytes(max)
            .build();
        for i in 0..20 {
            let key = format!("{}", char::from(b'a' + i));
            stored(&store, &key, Duration::from_secs(3600)).await;
            replay(&store, &key, &FP).await;
            assert!(store.bytes() <= max, "{} bytes after {key}", store.bytes());
        }
        let entries = store.len();
        assert!((1..=3).contains(&entries), "{entries} entries");
        assert_eq!(store.bytes(), entries as u64 * weight("a"));
        // Whatever was evicted is still replayed by the wrapped store.
        for i in 0..20 {
            let key = format!("{}", char::from(b'a' + i));
            match replay(&store, &key, &FP).await {
                ReserveOutcome::Completed { response: r, .. } => assert_eq!(r, response()),
                other => panic!("{key}: {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn an_entry_heavier_than_the_whole_cache_is_never_kept() {
        let counting = Counting::default();
        let store = CachedStore::builder(counting.clone())
            .max_bytes(weight("a") - 1)
            .build();
        stored(&store, "a", Duration::from_secs(3600)).await;
        for _ in 0..3 {
            assert!(matches!(
                replay(&store, "a", &FP).await,
                ReserveOutcome::Completed { .. }
            ));
            // After moka's maintenance (which `is_empty` runs), the entry is gone.
            assert!(store.is_empty());
        }
        assert_eq!(store.bytes(), 0);
        // Every replay went to the store: 1 reservation + 3 replays.
        assert_eq!(reserves(&counting), 4);
    }

    #[tokio::test]
    async fn zero_max_bytes_disables_caching() {
        let counting = Counting::default();
        let store = CachedStore::builder(counting.clone()).max_bytes(0).build();
        stored(&store, "a", Duration::from_secs(3600)).await;
        for _ in 0..3 {
            match replay(&store, "a", &FP).await {
                ReserveOutcome::Completed { response: r, .. } => assert_eq!(r, response()),
                other => panic!("{other:?}"),
            }
        }
        assert!(store.is_empty());
        assert_eq!(reserves(&counting), 4, "a pass-through");
    }

    #[tokio::test]
    async fn max_response_bytes_is_inclusive() {
        let size = response().size_bytes();
        let fits = CachedStore::builder(MemoryStore::new())
            .max_response_bytes(size)
            .build();
        stored(&fits, "a", Duration::from_secs(3600)).await;
        replay(&fits, "a", &FP).await;
        assert_eq!(fits.len(), 1, "a response of exactly the limit is cached");
        let too_big = CachedStore::builder(MemoryStore::new())
            .max_response_bytes(size - 1)
            .build();
        stored(&too_big, "a", Duration::from_secs(3600)).await;
        replay(&too_big, "a", &FP).await;
        assert!(too_big.is_empty());
    }

    #[tokio::test]
    async fn store_errors_pass_through_and_nothing_is_cached_from_them() {
        let faulty = Faulty::default();
        let store = CachedStore::new(faulty.clone());
        let ReserveOutcome::Reserved { token } = replay(&store, "a", &FP).await else {
            panic!("expected a reservation");
        };
        faulty.down.store(true, Ordering::SeqCst);
        let unavailable = |result: Result<String, StoreError>| match result {
            Err(StoreError::Unavailable(e)) => assert_eq!(e.to_string(), "the database is down"),
            other => panic!("{other:?}"),
        };
        unavailable(
            store
                .reserve(&scope("b"), &FP, LEASE)
                .await
                .map(|o| format!("{o:?}")),
        );
        unavailable(
            store
                .complete(&scope("a"), &token, &response(), Duration::from_secs(3600))
                .await
                .map(|o| format!("{o:?}")),
        );
        unavailable(
            store
                .release(&scope("a"), &token)
                .await
                .map(|o| format!("{o:?}")),
        );
        unavailable(
            store
                .purge_expired(Duration::ZERO)
                .await
                .map(|n| n.to_string()),
        );
        assert!(store.is_empty());
        // Back up: the reservation held across the outage, and completes.
        faulty.down.store(false, Ordering::SeqCst);
        let outcome = store
            .complete(&scope("a"), &token, &response(), Duration::from_secs(3600))
            .await;
        assert_eq!(outcome.ok(), Some(WriteOutcome::Applied));
    }

    #[tokio::test]
    async fn a_cached_replay_is_served_while_the_store_is_down() {
        let faulty = Faulty::default();
        let store = CachedStore::new(faulty.clone());
        stored(&store, "a", Duration::from_secs(3600)).await;
        replay(&store, "a", &FP).await; // fills the cache
        faulty.down.store(true, Ordering::SeqCst);
        match store.reserve(&scope("a"), &FP, LEASE).await {
            Ok(ReserveOutcome::Completed {
                fingerprint,
                response: r,
                expires_in,
            }) => {
                assert_eq!(fingerprint, FP);
                assert_eq!(r, response());
                let left = expires_in.unwrap_or_default();
                assert!(
                    left > Duration::ZERO && left <= DEFAULT_MAX_TTL,
                    "{left:?}: bounded by max_ttl"
                );
            }
            other => panic!("{other:?}"),
        }
        // A key that is not cached still needs the store.
        assert!(matches!(
            store.reserve(&scope("b"), &FP, LEASE).await,
            Err(StoreError::Unavailable(_))
        ));
    }

    #[tokio::test]
    async fn records_reported_as_ending_now_are_not_cached() {
        let faulty = Faulty::default();
        let store = CachedStore::new(faulty.clone());
        stored(&store, "a", Duration::from_secs(3600)).await;
        faulty.report_expires_in(Some(Duration::ZERO));
        for _ in 0..2 {
            assert!(matches!(
                replay(&store, "a", &FP).await,
                ReserveOutcome::Completed { .. }
            ));
        }
        assert!(store.is_empty());
        assert_eq!(reserves(&faulty.inner), 3);
    }

    #[tokio::test]
    async fn an_unbounded_time_left_does_not_panic() {
        // max_ttl and the record's time left both unbounded: no instant can hold the end,
        // so the record is passed through uncached rather than overflowing the clock.
        let faulty = Faulty::default();
        let store = CachedStore::builder(faulty.clone())
            .max_ttl(Duration::MAX)
            .build();
        stored(&store, "a", Duration::from_secs(3600)).await;
        faulty.report_expires_in(Some(Duration::MAX));
        match replay(&store, "a", &FP).await {
            ReserveOutcome::Completed {
                response: r,
                expires_in,
                ..
            } => {
                assert_eq!(r, response());
                assert_eq!(
                    expires_in,
                    Some(Duration::MAX),
                    "the store's answer, unchanged"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(store.is_empty());

        // An unbounded max_ttl still ends an entry with its record.
        faulty.report_expires_in(Some(Duration::from_secs(30)));
        replay(&store, "a", &FP).await;
        assert_eq!(store.len(), 1);
        match replay(&store, "a", &FP).await {
            ReserveOutcome::Completed { expires_in, .. } => {
                let left = expires_in.unwrap_or_default();
                assert!(
                    left <= Duration::from_secs(30) && left > Duration::from_secs(25),
                    "{left:?}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn writes_and_purges_go_to_the_wrapped_store() {
        let store = CachedStore::new(MemoryStore::new());
        // release frees the key
        let ReserveOutcome::Reserved { token } = replay(&store, "r", &FP).await else {
            panic!("expected a reservation");
        };
        assert_eq!(
            store.release(&scope("r"), &token).await.ok(),
            Some(WriteOutcome::Applied)
        );
        assert_eq!(
            store.release(&scope("r"), &token).await.ok(),
            Some(WriteOutcome::Stale),
            "a second release is stale"
        );
        assert!(matches!(
            replay(&store, "r", &FP).await,
            ReserveOutcome::Reserved { .. }
        ));
        // complete with a token that does not hold the key is stale, and nothing is cached
        let stale = store
            .complete(
                &scope("r"),
                &ReservationToken::random(),
                &response(),
                Duration::from_secs(3600),
            )
            .await;
        assert_eq!(stale.ok(), Some(WriteOutcome::Stale));
        assert!(store.is_empty());
        // purge removes expired records of the wrapped store and reports how many
        stored(&store, "p1", Duration::from_millis(1)).await;
        stored(&store, "p2", Duration::from_millis(1)).await;
        stored(&store, "live", Duration::from_secs(3600)).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(store.purge_expired(Duration::ZERO).await.ok(), Some(2));
        assert_eq!(store.purge_expired(Duration::ZERO).await.ok(), Some(0));
        assert!(matches!(
            replay(&store, "live", &FP).await,
            ReserveOutcome::Completed { .. }
        ));
    }
}
