//! [`CachedStore`]: answers replays of completed records from this process's memory.
//!
//! A completed record never changes until it expires: the response it holds is the one every
//! retry must get. So a copy of it is as good as the record, in any instance, for as long as
//! the record lives, and a replay served from the copy needs no round trip to the store. That
//! is what this wrapper does; everything else (reservations, completions, releases, purges)
//! goes to the wrapped store unchanged, so the atomicity and fencing rules are the wrapped
//! store's.
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
//!   (default 60 s). A store that does not report the time left gets no entries: the wrapper
//!   is then a pass-through.
//! - At most [`CachedStoreBuilder::max_entries`] entries (default 10,000) and only responses up
//!   to [`CachedStoreBuilder::max_response_bytes`] (default 64 KiB); the oldest entry is dropped
//!   first. The cache's memory is therefore bounded by about `max_entries` times
//!   `max_response_bytes` (640 MiB with the defaults in the worst case, a few MiB for typical
//!   responses of a few hundred bytes).
//!
//! # Operations that change completed records behind the cache's back
//! - `idem-cli purge` deletes only expired records, and a cache entry never outlives its
//!   record, so purging never makes the cache disagree with the database.
//! - `idem-cli release --force` on a **completed** record deletes it from the database, but
//!   every instance that cached it keeps replaying the old response until its entry ends:
//!   at most `max_ttl` (60 s by default). Only then does the key run a new request. Releasing
//!   an in-flight key is unaffected (in-flight records are never cached). If you rely on forced
//!   releases of completed records taking effect at once, keep `max_ttl` short or do not use
//!   the cache.
//! - Editing or deleting rows by hand: the same as a forced release.
//!
//! ```
//! use idempotency_actix::{store::{CachedStore, MemoryStore}, Idempotency};
//! # fn demo(store: MemoryStore) {
//! // In production, wrap the PostgresStore: `CachedStore::new(PostgresStore::connect(url).await?)`.
//! let middleware = Idempotency::new(CachedStore::new(store));
//! # let _ = middleware; }
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};

/// Default [`CachedStoreBuilder::max_entries`].
pub const DEFAULT_MAX_ENTRIES: usize = 10_000;
/// Default [`CachedStoreBuilder::max_ttl`].
pub const DEFAULT_MAX_TTL: Duration = Duration::from_secs(60);
/// Default [`CachedStoreBuilder::max_response_bytes`].
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// A store wrapper that serves replays of completed records from an in-process cache. See the
/// [module docs](self) for what is cached, for how long, and what a forced release means.
///
/// Cloning is cheap; clones share the cache and clone the wrapped store (the stores of this
/// crate share their state between clones).
pub struct CachedStore<S> {
    inner: S,
    cache: Arc<RwLock<Cache>>,
    limits: Limits,
}

impl<S: Clone> Clone for CachedStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            cache: Arc::clone(&self.cache),
            limits: self.limits,
        }
    }
}

impl<S> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("entries", &self.len())
            .field("max_entries", &self.limits.max_entries)
            .field("max_ttl", &self.limits.max_ttl)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    max_entries: usize,
    max_ttl: Duration,
    max_response_bytes: usize,
}

/// Configures a [`CachedStore`]: see [`CachedStore::builder`].
#[derive(Debug, Clone)]
pub struct CachedStoreBuilder<S> {
    inner: S,
    limits: Limits,
}

impl<S: IdempotencyStore> CachedStoreBuilder<S> {
    /// Most entries kept; the oldest is dropped to make room. Default 10,000. Zero disables
    /// caching.
    pub fn max_entries(mut self, max_entries: usize) -> Self {
        self.limits.max_entries = max_entries;
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
        CachedStore {
            inner: self.inner,
            cache: Arc::new(RwLock::new(Cache::default())),
            limits: self.limits,
        }
    }
}

impl<S: IdempotencyStore> CachedStore<S> {
    /// Wrap `inner` with the default limits (10,000 entries, 60 s, 64 KiB responses).
    pub fn new(inner: S) -> Self {
        Self::builder(inner).build()
    }

    /// Configure the cache around `inner`.
    pub fn builder(inner: S) -> CachedStoreBuilder<S> {
        CachedStoreBuilder {
            inner,
            limits: Limits {
                max_entries: DEFAULT_MAX_ENTRIES,
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

    /// Number of cached entries (including expired ones not yet dropped).
    pub fn len(&self) -> usize {
        self.read().entries.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drop every cached entry (e.g. after releasing completed records by hand).
    pub fn clear(&self) {
        let mut cache = self.write();
        cache.entries.clear();
        cache.order.clear();
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Cache> {
        // No critical section can panic halfway through an update.
        self.cache.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Cache> {
        self.cache.write().unwrap_or_else(|p| p.into_inner())
    }

    /// A live entry for `scope`, as the outcome `reserve` would have returned.
    fn lookup(&self, scope: &Scope, now: Instant) -> Option<ReserveOutcome> {
        let cache = self.read();
        let entry = cache.entries.get(scope)?;
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
    ) {
        let limits = self.limits;
        if limits.max_entries == 0 || response.size_bytes() > limits.max_response_bytes {
            return;
        }
        let until = start + remaining.min(limits.max_ttl);
        let now = Instant::now();
        if until <= now {
            return;
        }
        let mut cache = self.write();
        cache.drop_expired(now);
        while cache.entries.len() >= limits.max_entries {
            if !cache.drop_oldest() {
                break;
            }
        }
        cache.generation += 1;
        let generation = cache.generation;
        let key = Arc::new(scope.clone());
        cache.order.push_back((Arc::clone(&key), generation));
        cache.entries.insert(
            key,
            Entry {
                fingerprint,
                response: response.clone(),
                until,
                generation,
            },
        );
    }
}

#[derive(Default)]
struct Cache {
    entries: HashMap<Arc<Scope>, Entry>,
    /// Insertion order, oldest first, with the generation the entry had then; entries
    /// replaced since (generation differs) are skipped when popped.
    order: VecDeque<(Arc<Scope>, u64)>,
    generation: u64,
}

struct Entry {
    fingerprint: Fingerprint,
    response: StoredResponse,
    until: Instant,
    generation: u64,
}

impl Cache {
    /// Drop entries from the front of the insertion order while they are expired. Entries
    /// with a shorter life further back are dropped when they reach the front, or by eviction;
    /// `lookup` never serves them in the meantime.
    fn drop_expired(&mut self, now: Instant) {
        while let Some((scope, generation)) = self.order.front() {
            match self.entries.get(scope) {
                Some(entry) if entry.generation == *generation && entry.until > now => break,
                Some(entry) if entry.generation == *generation => {
                    self.entries.remove(scope);
                }
                _ => {}
            }
            self.order.pop_front();
        }
    }

    /// Drop the oldest entry; false when there is none.
    fn drop_oldest(&mut self) -> bool {
        while let Some((scope, generation)) = self.order.pop_front() {
            if self
                .entries
                .get(&scope)
                .is_some_and(|e| e.generation == generation)
            {
                self.entries.remove(&scope);
                return true;
            }
        }
        false
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
        if let Some(outcome) = self.lookup(scope, start) {
            // The entry ends before the record, so the record is live: the same answer the
            // wrapped store would give (including a fingerprint mismatch, which the middleware
            // turns into 422 as it would from the store's answer).
            return Ok(outcome);
        }
        let outcome = self.inner.reserve(scope, fingerprint, lease).await?;
        if let ReserveOutcome::Completed {
            fingerprint: stored,
            response,
            expires_in: Some(remaining),
        } = &outcome
        {
            self.insert(scope, *stored, response, start, *remaining);
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

    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.write().drop_expired(Instant::now());
        self.inner.purge_expired(grace).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;

    use super::*;
    use crate::store::MemoryStore;

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
        // Another request with the same key still sees the original fingerprint (422 upstream).
        match replay(&store, "a", &Fingerprint([8; 32])).await {
            ReserveOutcome::Completed { fingerprint, .. } => assert_eq!(fingerprint, FP),
            other => panic!("{other:?}"),
        }
        assert_eq!(counting.reserves.load(Ordering::SeqCst), before + 1);
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
        let store = CachedStore::builder(MemoryStore::new())
            .max_entries(2)
            .build();
        for key in ["a", "b", "c"] {
            stored(&store, key, Duration::from_secs(3600)).await;
            replay(&store, key, &FP).await;
        }
        assert_eq!(store.len(), 2);
        // In flight: never cached.
        assert!(matches!(
            replay(&store, "d", &FP).await,
            ReserveOutcome::Reserved { .. }
        ));
        assert!(matches!(
            replay(&store, "d", &FP).await,
            ReserveOutcome::InFlight { .. }
        ));
        assert_eq!(store.len(), 2);

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
}
