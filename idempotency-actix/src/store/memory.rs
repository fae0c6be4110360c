//! [`MemoryStore`]: records in this process's memory.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};

/// Default for [`MemoryStoreBuilder::max_entries`].
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// How often `reserve` walks the whole map for expired entries that the cheap sweep misses
/// (abandoned reservations, records stored with a shorter TTL than their neighbours).
const FULL_SWEEP_EVERY: Duration = Duration::from_secs(30);

/// An in-process store: no setup, nothing shared between processes.
///
/// Use it for development, tests, and apps that run as exactly one process. Several instances
/// behind a load balancer each have their own memory, so a retry that lands on another instance
/// runs the handler again: use `PostgresStore` there.
///
/// The store is bounded ([`MemoryStoreBuilder::max_entries`], default 100,000 records) because
/// an unbounded cache of responses is a memory leak with a delay. When full, it first drops
/// expired records, then the completed records closest to expiry. It never evicts an in-flight
/// reservation (that would let a duplicate run while the first is still running): when the
/// store is full of them, `reserve` fails with [`StoreError::Capacity`] and the middleware
/// answers 503. Expired records are swept as a side effect of `reserve`, so no background task
/// is needed. Cloning is cheap and clones share the records.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
}

/// Builder for [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryStoreBuilder {
    max_entries: usize,
}

impl MemoryStoreBuilder {
    /// At most this many records (in flight and completed) are kept. Default 100,000.
    pub fn max_entries(mut self, max_entries: usize) -> Self {
        self.max_entries = max_entries.max(1);
        self
    }

    /// The store.
    pub fn build(self) -> MemoryStore {
        MemoryStore {
            inner: Arc::new(Mutex::new(Inner {
                records: HashMap::new(),
                completion_order: VecDeque::new(),
                max_entries: self.max_entries,
                next_generation: 0,
                last_full_sweep: Instant::now(),
                earliest_expiry: None,
            })),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("len", &self.len())
            .finish()
    }
}

impl MemoryStore {
    /// A store with the default capacity.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configure the store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_entries: DEFAULT_MAX_ENTRIES,
        }
    }

    /// Number of records held (including expired ones not yet swept).
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing inside the critical sections can panic halfway through an update, so a
        // poisoned lock still guards consistent data.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

struct Inner {
    records: HashMap<Arc<Scope>, Record>,
    /// Completed records in completion order, oldest first, with the generation they had then.
    /// With one TTL this is also expiry order, so sweeping and eviction pop from the front.
    /// Entries whose record changed since (generation differs) are skipped.
    completion_order: VecDeque<(Instant, Arc<Scope>, u64)>,
    max_entries: usize,
    next_generation: u64,
    last_full_sweep: Instant,
    /// No record expires before this (a lower bound: the record that set it may be gone);
    /// `None` when no record was added since the last full sweep found none. Lets a full
    /// store skip the full sweep, which could not drop anything before this instant.
    earliest_expiry: Option<Instant>,
}

/// A stored response as kept in memory: its headers encoded with
/// [`StoredResponse::encode_headers`], so a record costs two allocations instead of one per
/// header name and value.
struct Compact {
    status: u16,
    headers: Vec<u8>,
    body: bytes::Bytes,
}

impl Compact {
    fn new(response: &StoredResponse) -> Self {
        Self {
            status: response.status,
            headers: response.encode_headers(),
            body: response.body.clone(),
        }
    }

    fn expand(&self) -> Result<StoredResponse, StoreError> {
        Ok(StoredResponse {
            status: self.status,
            headers: StoredResponse::decode_headers(&self.headers)
                .map_err(|e| StoreError::Backend(Box::new(e)))?,
            body: self.body.clone(),
        })
    }
}

/// What `reserve` found for a scope, decided under the lock.
enum Found {
    Completed(Fingerprint, Arc<Compact>, Duration),
    InFlight(Fingerprint, Duration),
    TakeOver,
    Absent,
}

struct Record {
    fingerprint: Fingerprint,
    generation: u64,
    state: State,
}

enum State {
    InFlight {
        token: ReservationToken,
        lease_until: Instant,
    },
    Completed {
        /// The response in one allocation (status, encoded headers, body), shared so a replay
        /// decodes it after the lock is released.
        response: Arc<Compact>,
        expires_at: Instant,
    },
}

impl Record {
    fn in_flight(
        fingerprint: Fingerprint,
        generation: u64,
        token: ReservationToken,
        lease_until: Instant,
    ) -> Self {
        Self {
            fingerprint,
            generation,
            state: State::InFlight { token, lease_until },
        }
    }

    fn expires_at(&self) -> Instant {
        match self.state {
            State::InFlight { lease_until, .. } => lease_until,
            State::Completed { expires_at, .. } => expires_at,
        }
    }

    fn holds(&self, token: &ReservationToken) -> bool {
        matches!(&self.state, State::InFlight { token: held, .. } if held == token)
    }
}

impl Inner {
    /// A record was added or changed and expires at `at`.
    fn note_expiry(&mut self, at: Instant) {
        self.earliest_expiry = Some(self.earliest_expiry.map_or(at, |e| e.min(at)));
    }

    fn generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    /// Drop completed records from the front of the completion queue while they are expired.
    fn sweep_front(&mut self, now: Instant) {
        while let Some((expires_at, scope, generation)) = self.completion_order.front() {
            if *expires_at > now {
                break;
            }
            if self
                .records
                .get(scope)
                .is_some_and(|r| r.generation == *generation && r.expires_at() <= now)
            {
                self.records.remove(scope);
            }
            self.completion_order.pop_front();
        }
        if now.duration_since(self.last_full_sweep) >= FULL_SWEEP_EVERY {
            self.sweep_all(now, Duration::ZERO);
        }
    }

    fn sweep_all(&mut self, now: Instant, in_flight_grace: Duration) -> u64 {
        let before = self.records.len();
        self.records.retain(|_, r| match r.state {
            State::InFlight { lease_until, .. } => lease_until + in_flight_grace > now,
            State::Completed { expires_at, .. } => expires_at > now,
        });
        let records = &self.records;
        self.completion_order.retain(|(_, scope, generation)| {
            records
                .get(scope)
                .is_some_and(|r| r.generation == *generation)
        });
        self.last_full_sweep = now;
        self.earliest_expiry = self.records.values().map(Record::expires_at).min();
        (before - self.records.len()) as u64
    }

    /// Make room for one new record, or fail if only reservations are left. Evicted records
    /// go to `evicted`, so the caller can free them after releasing the lock.
    fn make_room(
        &mut self,
        now: Instant,
        evicted: &mut Vec<(Arc<Scope>, Record)>,
    ) -> Result<(), StoreError> {
        if self.records.len() < self.max_entries {
            return Ok(());
        }
        // The full sweep is O(records); skip it while it provably has nothing to drop, so a
        // full store does not pay it on every new record.
        if self.earliest_expiry.is_some_and(|at| at <= now) {
            self.sweep_all(now, Duration::ZERO);
        }
        while self.records.len() >= self.max_entries {
            let Some((_, scope, generation)) = self.completion_order.pop_front() else {
                return Err(StoreError::Capacity(self.max_entries));
            };
            if let Entry::Occupied(entry) = self.records.entry(scope) {
                if entry.get().generation == generation {
                    evicted.push(entry.remove_entry());
                }
            }
        }
        Ok(())
    }
}

impl IdempotencyStore for MemoryStore {
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        let mut evicted = Vec::new();
        let now = Instant::now();
        let mut inner = self.lock();
        inner.sweep_front(now);
        let found = match inner.records.get(scope) {
            Some(record) => match &record.state {
                State::Completed {
                    response,
                    expires_at,
                } if *expires_at > now => {
                    Found::Completed(record.fingerprint, Arc::clone(response), *expires_at - now)
                }
                State::InFlight { lease_until, .. }
                    if *lease_until > now || record.fingerprint != *fingerprint =>
                {
                    Found::InFlight(
                        record.fingerprint,
                        lease_until.saturating_duration_since(now),
                    )
                }
                // Expired completed record (absent), or a dead holder's lease on the same
                // request.
                _ => Found::TakeOver,
            },
            None => Found::Absent,
        };
        match found {
            Found::Completed(fingerprint, response, remaining) => {
                drop(inner);
                let completed = ReserveOutcome::Completed {
                    fingerprint,
                    response: response.expand()?,
                    expires_in: Some(remaining),
                };
                return Ok(completed);
            }
            Found::InFlight(fingerprint, lease_remaining) => {
                let in_flight = ReserveOutcome::InFlight {
                    fingerprint,
                    lease_remaining,
                };
                return Ok(in_flight);
            }
            Found::TakeOver | Found::Absent => {}
        }
        let token = ReservationToken::random();
        let generation = inner.generation();
        let record = Record::in_flight(*fingerprint, generation, token, now + lease);
        if let Found::Absent = found {
            inner.make_room(now, &mut evicted)?;
            inner.records.insert(Arc::new(scope.clone()), record);
        } else if let Some(existing) = inner.records.get_mut(scope) {
            *existing = record;
        }
        inner.note_expiry(now + lease);
        drop(inner);
        drop(evicted);
        Ok(ReserveOutcome::Reserved { token })
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        // Copied before taking the lock (wasted only when the write turns out stale).
        let response = Arc::new(Compact::new(response));
        let now = Instant::now();
        let mut inner = self.lock();
        let generation = inner.generation();
        let Some((key, record)) = inner.records.get_key_value(scope) else {
            return Ok(WriteOutcome::Stale);
        };
        if !record.holds(token) {
            return Ok(WriteOutcome::Stale);
        }
        let key = Arc::clone(key);
        let expires_at = now + ttl;
        if let Some(record) = inner.records.get_mut(scope) {
            record.generation = generation;
            record.state = State::Completed {
                response,
                expires_at,
            };
        }
        inner.note_expiry(expires_at);
        inner
            .completion_order
            .push_back((expires_at, key, generation));
        Ok(WriteOutcome::Applied)
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        let mut inner = self.lock();
        if inner.records.get(scope).is_some_and(|r| r.holds(token)) {
            inner.records.remove(scope);
            Ok(WriteOutcome::Applied)
        } else {
            Ok(WriteOutcome::Stale)
        }
    }

    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        Ok(self.lock().sweep_all(Instant::now(), grace))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn scope(key: &str) -> Scope {
        Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/p".into(),
            key: key.into(),
        }
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![],
            body: Bytes::from_static(b"ok"),
        }
    }

    async fn reserve_and_complete(store: &MemoryStore, key: &str) {
        let fp = Fingerprint([1; 32]);
        let ReserveOutcome::Reserved { token } = store
            .reserve(&scope(key), &fp, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("expected a reservation for {key}");
        };
        let outcome = store
            .complete(&scope(key), &token, &response(), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(outcome, WriteOutcome::Applied);
    }

    #[tokio::test]
    async fn full_store_evicts_oldest_completed_record() {
        let store = MemoryStore::builder().max_entries(2).build();
        reserve_and_complete(&store, "a").await;
        reserve_and_complete(&store, "b").await;
        reserve_and_complete(&store, "c").await;
        assert_eq!(store.len(), 2);
        let fp = Fingerprint([1; 32]);
        // "a" was evicted: reserving it again succeeds; "c" is still there.
        assert!(matches!(
            store
                .reserve(&scope("c"), &fp, Duration::from_secs(1))
                .await
                .unwrap(),
            ReserveOutcome::Completed { .. }
        ));
    }

    #[tokio::test]
    async fn full_store_never_evicts_in_flight_reservations() {
        let store = MemoryStore::builder().max_entries(2).build();
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        for key in ["a", "b"] {
            assert!(matches!(
                store.reserve(&scope(key), &fp, lease).await.unwrap(),
                ReserveOutcome::Reserved { .. }
            ));
        }
        assert!(matches!(
            store.reserve(&scope("c"), &fp, lease).await,
            Err(StoreError::Capacity(2))
        ));
        for key in ["a", "b"] {
            assert!(matches!(
                store.reserve(&scope(key), &fp, lease).await.unwrap(),
                ReserveOutcome::InFlight { .. }
            ));
        }
    }

    #[tokio::test]
    async fn expired_records_are_swept_by_later_reservations() {
        let store = MemoryStore::new();
        let fp = Fingerprint([1; 32]);
        let ReserveOutcome::Reserved { token } = store
            .reserve(&scope("a"), &fp, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("expected a reservation");
        };
        store
            .complete(&scope("a"), &token, &response(), Duration::from_millis(1))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
        store
            .reserve(&scope("b"), &fp, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(store.len(), 1, "the expired record of a is gone");
    }
}
