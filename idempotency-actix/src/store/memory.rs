//! [`MemoryStore`]: records in this process's memory.
//!
//! The defaults below are where the store's bounds and grace are set, each with its reason;
//! [`MemoryStore`] explains what is counted and what happens when the store is full.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hashbrown::HashTable;

use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};
use crate::log_text::LogText;

/// Default for [`MemoryStoreBuilder::max_entries`]: at about 460 bytes per small record
/// (`docs/benchmarks.md`) it is some 45 MiB. With the middleware's default 24 h TTL it holds
/// a sustained rate of about 1.2 new keys per second; above that the store fills and answers
/// 503 (or evicts, if opted in): raise it, shorten the TTL, or use `PostgresStore`.
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;

/// Default for [`MemoryStoreBuilder::max_bytes`]: 256 MiB, a quarter of a small (1 GiB)
/// server. It leaves about 200 MiB above a full default record bound of small records, which
/// is room for some 200 concurrent requests' response allowances (1 MiB each) or for larger
/// responses.
pub const DEFAULT_MAX_BYTES: usize = 256 * 1024 * 1024;

/// Default for [`MemoryStoreBuilder::response_allowance`]: 1 MiB, the middleware's default
/// `max_response_bytes`, so that with the defaults every storable response fits at `complete`.
pub const DEFAULT_RESPONSE_ALLOWANCE: usize = 1024 * 1024;

/// Default for [`MemoryStoreBuilder::reservation_grace`]: 24 h, the grace `idem-cli purge`
/// gives in-flight PostgreSQL rows, and the default TTL of a completed record: a request that
/// may have run (its handler outlived the lease) is protected as long as one that surely ran,
/// its late `complete` still counts, and another body cannot reuse its key meanwhile.
pub const DEFAULT_RESERVATION_GRACE: Duration = Duration::from_secs(24 * 60 * 60);

/// Default for [`MemoryStoreBuilder::sweep_interval`]: 30 s. The sweep walks every record
/// (one pass under the lock, without hashing: the slowest request of a 10 s run that met a
/// sweep at about 1.8 M records took 28 ms, `docs/benchmarks.md`), so it runs rarely; expired
/// completed records in expiry order are dropped on every `reserve` anyway, and a full store
/// sweeps as soon as something can expire.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// Bytes charged per record beyond its scope and response: the hash-table slot, the record,
/// the shared scope and response allocations and the completion queue entry. Measured: 544
/// bytes of resident memory per record for a 107-byte response and 20-byte keys, 457 since
/// the scope is packed in one allocation (`docs/benchmarks.md`). A review (2026-12-05, 50,000
/// records of three shapes, `tests/tests/e2e/exhaustion.rs`) found the resident memory 36-43
/// bytes per record above the charge at 384, so the charge is 432: the bound errs on its own
/// side. Since a completed record keeps its response in one allocation (`Compact`), the same
/// test measures about 100 bytes less per record in each shape (small: 482 resident against
/// 588 charged, was 580); the charge was not lowered with it, because a table just past a
/// doubling holds up to twice the slots per record that a table near full does.
pub const RECORD_OVERHEAD: usize = 432;

/// `now + d`, or a far-future instant when that is not representable (`Duration::MAX` is
/// "never"; `Instant + Duration::MAX` would panic).
fn later(now: Instant, d: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);
    now.checked_add(d)
        .or_else(|| now.checked_add(CENTURY))
        .or_else(|| now.checked_add(CENTURY / 100))
        .unwrap_or(now)
}

/// What a scope costs without its response.
fn scope_charge(scope: &Scope) -> usize {
    scope_parts(scope)
        .iter()
        .fold(RECORD_OVERHEAD, |charge, part| {
            charge.saturating_add(part.len())
        })
}

/// An in-process store: no setup, nothing shared between processes.
///
/// Use it for development, tests, and apps that run as exactly one process. Several instances
/// behind a load balancer each have their own memory, so a retry that lands on another instance
/// runs the handler again: use `PostgresStore` there.
///
/// # Bounds (C22)
///
/// The store is bounded twice: by records ([`MemoryStoreBuilder::max_entries`]) and by bytes
/// ([`MemoryStoreBuilder::max_bytes`]), because an unbounded cache of responses is a memory
/// leak with a delay, and a record bound alone does not bound memory (100,000 records of 1 MiB
/// responses are 100 GB). A record is charged for its scope (tenant, method, path, key), its
/// stored response (encoded headers and body) and 432 bytes of bookkeeping.
///
/// A *live* record (a completed record inside its TTL, or a reservation before the end of its
/// grace period) is never dropped to make room by default. When the store is full of live
/// records, `reserve` fails with [`StoreError::Capacity`] or [`StoreError::ByteCapacity`] and
/// the middleware answers 503 `STORAGE_UNAVAILABLE` without running the handler, exactly as
/// for a dead store (C15). Expired records are always dropped first. Apps that prefer a
/// cache-like store (a shorter replay window under load rather than 503s) opt in with
/// [`MemoryStoreBuilder::evict_live_completed_when_full`]; every such eviction is logged at
/// `warn` (target `idempotency_actix`) with its scope. Reservations are never evicted.
///
/// The defaults (100,000 records, 256 MiB) fit a small server. With the middleware's 24 h
/// TTL, 100,000 records hold a sustained rate of about 1.2 new keys per second: above that a
/// store with the defaults starts answering 503. Raise `max_entries` (at about 460 bytes per
/// small record), shorten the TTL, or use `PostgresStore`. The bound is one pool for all
/// tenants: one tenant sending many new keys fills the store for all (it is refused, but so
/// are the others); give tenants their own stores, or use `PostgresStore`, when that matters.
///
/// # Where a response's bytes are charged
///
/// A reservation is charged [`MemoryStoreBuilder::response_allowance`] bytes (default 1 MiB,
/// the middleware's default `max_response_bytes`) on top of its scope, at `reserve` time, and
/// `complete` trades that allowance for the response's real size. So the room for a response
/// is secured *before* the handler runs, when refusing is harmless (503, nothing happened), and
/// `complete` of any response within the allowance always fits: it cannot fail after the
/// handler's side effects happened, which would leave the key reserved and invite a second
/// execution once the lease ends. (The allowance is for the body, as the middleware's
/// `max_response_bytes` is; a response's headers come on top of it, and when the store is full
/// they may take the bound past `max_bytes` by their size, up to one more allowance for each
/// reservation completed so (a store full of running requests whose responses all carry
/// headers that large could reach about twice `max_bytes`), rather than fail the write; new
/// keys are refused until records expire.) The
/// price is that each running request holds its allowance of the byte bound. A response larger than the allowance (only when the middleware's
/// `max_response_bytes` is set above it) needs the difference from free space; without it,
/// `complete` fails with [`StoreError::ByteCapacity`], the reservation stays, and the
/// middleware keeps retrying until the lease ends (C16), after which a retry runs the handler
/// again. So the middleware refuses to be built with a `max_response_bytes` above the
/// allowance ([`IdempotencyStore::max_response_bytes`]).
///
/// # Ended reservations (C9)
///
/// A reservation whose lease ended is kept, like PostgreSQL keeps its row: a retry of the same
/// request takes it over, another body is refused, and a late `complete` by its holder (a
/// handler slower than its lease that nobody took over) still stores the response. Only after
/// [`MemoryStoreBuilder::reservation_grace`] (default 24 h) does the sweep delete it. Once its
/// lease ended it keeps charging its scope but no longer its response allowance, so abandoned
/// reservations cannot starve the byte bound; a late `complete` then needs room for its
/// response like any other growth.
///
/// [`renew_lease`](IdempotencyStore::renew_lease) by the holder moves the lease's end (and so
/// its grace) to `lease` from the renewal, even after the lease ended, as long as nobody took
/// the key over and its grace has not run out. A renewed reservation whose allowance was
/// already given back takes it again if there is free room (after a sweep; a renewal never
/// evicts a live record); if there is none, the renewal still applies, without it: a retry
/// that runs the handler a second time is worse than a `complete` that may have to wait for
/// room.
///
/// # Sweeping and time
///
/// Expired records are swept as a side effect of `reserve` (the oldest completed records on
/// every call, everything every [`MemoryStoreBuilder::sweep_interval`] and when the store is
/// full), so no background task is needed. Leases, TTLs and the grace are durations added to
/// [`Instant::now`] with saturating arithmetic: `Duration::MAX` means "never" and does not
/// panic. Cloning is cheap and clones share the records.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

/// What the clones of one store share. Only `inner` is behind the lock: a call hashes its scope
/// and draws its token before taking it, so the critical section is the table work alone (with
/// two workers on one lock, every nanosecond held is a nanosecond the other may wait, and a
/// wait that ends in the kernel costs a futex call on both sides).
struct Shared {
    inner: Mutex<Inner>,
    /// Hashes scopes for the table: std's keyed SipHash, because the keys come from clients.
    hasher: RandomState,
    /// Fencing tokens of this store: see [`MemoryStore::next_token`].
    token_base: u64,
    tokens: AtomicU64,
    /// The longest scope a reservation can ever have room for (its scope, the response
    /// allowance and the bookkeeping within `max_bytes`): see `max_scope_bytes`.
    max_scope: Option<usize>,
    /// [`MemoryStoreBuilder::response_allowance`]: see `max_response_bytes`.
    response_allowance: usize,
}

/// Builder for [`MemoryStore`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct MemoryStoreBuilder {
    limits: Limits,
}

#[derive(Debug, Clone)]
struct Limits {
    max_entries: usize,
    max_bytes: usize,
    response_allowance: usize,
    evict_live_completed: bool,
    reservation_grace: Duration,
    sweep_interval: Duration,
}

impl MemoryStoreBuilder {
    /// At most this many records (in flight and completed) are kept. Default
    /// 100,000. At least 1.
    pub fn max_entries(mut self, max_entries: usize) -> Self {
        self.limits.max_entries = max_entries.max(1);
        self
    }

    /// At most this many bytes of records are kept: scopes, stored headers and bodies, the
    /// response allowance of running reservations and about 432 bytes of bookkeeping per
    /// record. Default 256 MiB. A new reservation needs its scope plus the response allowance
    /// and the bookkeeping free, so a bound with no room beside them refuses every keyed
    /// request (400 `SCOPE_TOO_LONG`: no scope fits, see `max_scope_bytes`).
    pub fn max_bytes(mut self, max_bytes: usize) -> Self {
        self.limits.max_bytes = max_bytes;
        self
    }

    /// Bytes a reservation holds for its response until it completes (or its lease ends), so
    /// that `complete` of a response up to this size never fails for lack of room. Default
    /// 1 MiB, the middleware's default `max_response_bytes`. Lower values admit more
    /// concurrent requests within [`max_bytes`](Self::max_bytes); lower the middleware's
    /// `max_response_bytes` with it (larger responses are then passed through, not stored),
    /// since the middleware refuses to be built with a `max_response_bytes` above the
    /// allowance: a larger response could find no room after its handler ran.
    pub fn response_allowance(mut self, bytes: usize) -> Self {
        self.limits.response_allowance = bytes;
        self
    }

    /// Opt into cache-like behaviour: when the store is full of live records, evict live
    /// completed records to make room, oldest completion first (with one TTL for all records,
    /// as with one `Idempotency` per store, that is the closest to expiry), instead of failing
    /// `reserve` (503). Default `false`.
    ///
    /// An evicted record is forgotten: a retry of its request runs the handler a second time.
    /// Each eviction is logged at `warn` (target `idempotency_actix`) with its scope. Under a
    /// sustained rate of new keys the real replay window shrinks to about
    /// `max_entries / rate`, and since the bound is shared, one tenant's traffic can push out
    /// another tenant's records. Reservations are never evicted.
    pub fn evict_live_completed_when_full(mut self, evict: bool) -> Self {
        self.limits.evict_live_completed = evict;
        self
    }

    /// How long a reservation whose lease ended is kept before the periodic sweep deletes it.
    /// Default 24 h. Meanwhile only the same request may take
    /// it over and a late `complete` by its holder still applies.
    pub fn reservation_grace(mut self, grace: Duration) -> Self {
        self.limits.reservation_grace = grace;
        self
    }

    /// How often `reserve` walks all records to delete what expired (records the cheap sweep
    /// misses: ended reservations past their grace, records with a shorter TTL than their
    /// neighbours). Default 30 s.
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.limits.sweep_interval = interval;
        self
    }

    /// The store.
    pub fn build(self) -> MemoryStore {
        // Zero when there is no room at all: every keyed request is then refused as too long
        // (never `None`, "no limit", which would leave each request to a `ByteCapacity` error
        // that `fail_open` runs unprotected).
        let room = self
            .limits
            .max_bytes
            .saturating_sub(RECORD_OVERHEAD.saturating_add(self.limits.response_allowance));
        if room == 0 {
            tracing::error!(target: "idempotency_actix", max_bytes = self.limits.max_bytes, response_allowance = self.limits.response_allowance, "MemoryStore: max_bytes leaves no room for a reservation beside its response allowance; every keyed request will be refused (400 SCOPE_TOO_LONG): raise max_bytes or lower response_allowance");
        }
        let max_scope = Some(room);
        let response_allowance = self.limits.response_allowance;
        MemoryStore {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    records: Records::default(),
                    completion_order: VecDeque::new(),
                    limits: self.limits,
                    bytes: 0,
                    completed: Completed::default(),
                    next_generation: 0,
                    last_full_sweep: Instant::now(),
                    next_event: None,
                }),
                hasher: RandomState::new(),
                token_base: ReservationToken::random().as_uuid().as_u64_pair().0,
                tokens: AtomicU64::new(0),
                max_scope,
                response_allowance,
            }),
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
        let inner = self.lock();
        f.debug_struct("MemoryStore")
            .field("len", &inner.records.len())
            .field("bytes", &inner.bytes)
            .field("limits", &inner.limits)
            .finish()
    }
}

impl MemoryStore {
    /// A store with the default bounds.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configure the store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            limits: Limits {
                max_entries: DEFAULT_MAX_ENTRIES,
                max_bytes: DEFAULT_MAX_BYTES,
                response_allowance: DEFAULT_RESPONSE_ALLOWANCE,
                evict_live_completed: false,
                reservation_grace: DEFAULT_RESERVATION_GRACE,
                sweep_interval: DEFAULT_SWEEP_INTERVAL,
            },
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

    /// Bytes charged against [`MemoryStoreBuilder::max_bytes`] now (see [`MemoryStore`] for
    /// what is counted).
    pub fn bytes_used(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing inside the critical sections can panic halfway through an update, so a
        // poisoned lock still guards consistent data.
        self.shared
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `scope` with its hash, computed before the lock is taken.
    fn probe<'a>(&self, scope: &'a Scope) -> Probe<'a> {
        Probe {
            hash: self.shared.hasher.hash_one(scope),
            scope,
        }
    }

    /// A fencing token for a new reservation: this store's random base and a counter.
    ///
    /// Why not [`ReservationToken::random`], as the stores that persist tokens use: a token of
    /// this store never leaves the process (the middleware hands it from `reserve` to
    /// `complete` or `release`), so the fence (C9) needs it distinct from every other token of
    /// this store, which the counter guarantees, and not unguessable. `random` costs a
    /// SHA-256 and a `getpid` system call per token (for fork safety across processes that
    /// share a database); under the store's lock that call was 3 % of a miss's CPU and made
    /// the other worker wait (`docs/benchmarks.md`). A forked child gets a copy of the store
    /// along with the counter: its tokens fence its own copy.
    fn next_token(&self) -> ReservationToken {
        let count = self.shared.tokens.fetch_add(1, Ordering::Relaxed);
        ReservationToken::from_uuid(uuid::Uuid::from_u64_pair(self.shared.token_base, count))
    }
}

/// A record's scope with its hash, computed once.
struct Key {
    hash: u64,
    scope: PackedScope,
}

/// A record's scope in one shared allocation: tenant, method, path and key, each prefixed with
/// its length (so no two scopes pack alike).
///
/// Why not an `Arc<Scope>`: that is five allocations (the `Arc` and four strings) made and
/// freed per record, and five pointers to follow when a lookup compares a record's scope,
/// each a likely cache miss under the store's lock. Packed, a record keeps one allocation
/// (built through one temporary buffer) and one `memcmp`-able run of bytes.
#[derive(PartialEq, Eq)]
struct PackedScope(Arc<[u8]>);

impl PackedScope {
    fn new(scope: &Scope) -> Self {
        let len = scope_parts(scope).iter().map(|part| 4 + part.len()).sum();
        let mut packed = Vec::with_capacity(len);
        for part in scope_parts(scope) {
            packed.extend_from_slice(&part_len(part).to_le_bytes());
            packed.extend_from_slice(part.as_bytes());
        }
        Self(packed.into())
    }

    /// The four parts, in [`scope_parts`] order.
    fn parts(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest: &[u8] = &self.0;
        std::iter::from_fn(move || {
            let (len, tail) = rest.split_first_chunk::<4>()?;
            let (part, tail) = tail.split_at_checked(u32::from_le_bytes(*len) as usize)?;
            rest = tail;
            Some(part)
        })
    }

    /// Whether this is `scope`, compared part by part without unpacking.
    fn is(&self, scope: &Scope) -> bool {
        let mut parts = self.parts();
        scope_parts(scope)
            .into_iter()
            .all(|expected| parts.next() == Some(expected.as_bytes()))
            && parts.next().is_none()
    }

    /// The parts as text, for the eviction log (formatted only if the event is).
    fn texts(&self) -> [Text<'_>; 4] {
        let mut parts = self.parts();
        std::array::from_fn(|_| Text(parts.next().unwrap_or_default()))
    }
}

/// A packed part as text: the parts were `String`s, so this is never lossy in practice.
/// Client-controlled, so written as a [`LogText`].
struct Text<'a>(&'a [u8]);

impl std::fmt::Display for Text<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        LogText(&String::from_utf8_lossy(self.0)).fmt(f)
    }
}

fn scope_parts(scope: &Scope) -> [&str; 4] {
    [&scope.tenant, &scope.method, &scope.path, &scope.key]
}

/// A part's length as packed. The middleware bounds keys, paths and tenants far below 4 GiB;
/// a longer part would pack a wrong length and so match nothing, never another scope's record
/// (its hash still finds the slot, the comparison fails).
fn part_len(part: &str) -> u32 {
    u32::try_from(part.len()).unwrap_or(u32::MAX)
}

/// A scope to look up, with its hash: each store call hashes its scope once.
#[derive(Clone, Copy)]
struct Probe<'a> {
    hash: u64,
    scope: &'a Scope,
}

impl Probe<'_> {
    /// Whether `key` is this scope. The full hashes first: the table matched seven bits of
    /// them, and comparing the rest costs nothing next to reading the scope.
    fn finds(&self, key: &Key) -> bool {
        key.hash == self.hash && key.scope.is(self.scope)
    }
}

/// The records by scope, each stored with its scope's hash.
///
/// Why not a `HashMap<Arc<Scope>, Record>`: a map hashes the scope's four strings again at
/// every lookup (a `reserve` or `complete` looks its scope up three or four times), and when it
/// grows it rehashes every record, following each record's pointer to its strings: a pause of
/// 0.66 s when it grew past 0.9 M records (`docs/benchmarks.md`), under the lock every request
/// takes.
/// Here a call hashes its scope once (before taking the lock: [`MemoryStore::probe`]), and
/// growing reads the stored hashes, so it only moves memory. `hashbrown::HashTable` is the
/// table behind std's `HashMap`, with the hash left to the caller.
///
/// The records are spread over [`TABLES`] tables by their hash, because a table grows by
/// doubling, all at once, under the lock: one table of 1.8 M records paused every request for
/// 0.25 s while it moved (`docs/benchmarks.md`), and the pause grows with the store. Each of
/// the tables doubles on its own, so a doubling moves a sixty-fourth of the records. A lookup
/// costs the same (one more shift of the hash); an empty table allocates nothing.
struct Records {
    tables: Box<[Table; TABLES]>,
    /// Records in all tables (the bound is checked on every new record).
    len: usize,
}

type Table = HashTable<(Key, Record)>;

/// Picks the record of `generation` among the entries of `hash` ([`Records::of_generation`]).
fn of_generation(hash: u64, generation: u64) -> impl Fn(&(Key, Record)) -> bool {
    move |(key, record)| key.hash == hash && record.generation == generation
}

/// See [`Records`]. A power of two, so the modulo is a mask.
const TABLES: usize = 64;

impl Default for Records {
    fn default() -> Self {
        Self {
            tables: Box::new(std::array::from_fn(|_| Table::new())),
            len: 0,
        }
    }
}

impl Records {
    /// The table of a hash. Bits 32 and up: hashbrown takes a slot's position from the low
    /// bits and its tag from the top seven, so the choice of table stays independent of both.
    fn table(&self, hash: u64) -> &Table {
        &self.tables[(hash >> 32) as usize % TABLES]
    }

    fn table_mut(&mut self, hash: u64) -> &mut Table {
        &mut self.tables[(hash >> 32) as usize % TABLES]
    }

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, probe: Probe<'_>) -> Option<&Record> {
        self.table(probe.hash)
            .find(probe.hash, |(key, _)| probe.finds(key))
            .map(|(_, record)| record)
    }

    fn get_key_value_mut(&mut self, probe: Probe<'_>) -> Option<(&Key, &mut Record)> {
        self.table_mut(probe.hash)
            .find_mut(probe.hash, |(key, _)| probe.finds(key))
            .map(|(key, record)| (&*key, record))
    }

    fn get_mut(&mut self, probe: Probe<'_>) -> Option<&mut Record> {
        self.get_key_value_mut(probe).map(|(_, record)| record)
    }

    fn remove(&mut self, probe: Probe<'_>) -> Option<(Key, Record)> {
        self.remove_where(probe.hash, |(key, _)| probe.finds(key))
    }

    /// The record of `generation` among those whose scope hashes to `hash`. A generation is
    /// given once in the store's life (`Inner::generation`), so it names one record without
    /// its scope: what lets the completion queue hold no scope.
    fn of_generation(&self, hash: u64, generation: u64) -> Option<&Record> {
        self.table(hash)
            .find(hash, of_generation(hash, generation))
            .map(|(_, record)| record)
    }

    /// Remove the record of `generation` (see [`Records::of_generation`]).
    fn remove_generation(&mut self, hash: u64, generation: u64) -> Option<(Key, Record)> {
        self.remove_where(hash, of_generation(hash, generation))
    }

    /// Remove the entry of `hash` that `is` picks.
    fn remove_where(
        &mut self,
        hash: u64,
        is: impl FnMut(&(Key, Record)) -> bool,
    ) -> Option<(Key, Record)> {
        let (removed, _) = self.table_mut(hash).find_entry(hash, is).ok()?.remove();
        self.len = self.len.saturating_sub(1);
        Some(removed)
    }

    /// Add the record of a scope that has none.
    fn insert(&mut self, key: Key, record: Record) {
        self.table_mut(key.hash)
            .insert_unique(key.hash, (key, record), |(key, _)| key.hash);
        self.len = self.len.saturating_add(1);
    }

    fn retain(&mut self, mut keep: impl FnMut(&mut Record) -> bool) {
        for table in self.tables.iter_mut() {
            table.retain(|(_, record)| keep(record));
        }
        self.len = self.tables.iter().map(Table::len).sum();
    }
}

struct Inner {
    records: Records,
    /// Completed records in completion order, oldest first: expiry, scope hash, and the
    /// generation they had then. With one TTL this is also expiry order, so sweeping and
    /// eviction pop from the front. Entries whose record changed since (generation differs)
    /// or is gone are skipped. No scope: an entry of a record deleted behind a longer-lived
    /// one (mixed TTLs) may wait here long after the record, and a scope (up to the request
    /// line's length) kept alive by each would be memory outside the byte bound (review,
    /// 2026-12-06).
    completion_order: VecDeque<(Instant, u64, u64)>,
    limits: Limits,
    /// The sum of the records' charges: at most `limits.max_bytes`, except for the headers of
    /// responses completed while the store was full (at most one allowance per reservation,
    /// see `complete`), which new reservations then wait for.
    bytes: usize,
    /// How many of the records are completed, and the sum of their charges: what evicting
    /// every one of them could free. `make_room` refuses at once when even that is not enough
    /// (the rest are reservations) instead of walking the completion queue to find out: with
    /// `evict_live_completed_when_full` on and reservations holding the bound, each refused
    /// reserve walked every completed record under the lock, and every request queued behind
    /// it (review, 2026-12-07).
    completed: Completed,
    next_generation: u64,
    last_full_sweep: Instant,
    /// A full sweep changes nothing before this instant: no record expires, no lease ends and
    /// no grace runs out earlier (a lower bound: the record that set it may be gone). `None`
    /// when no record was added since the last full sweep found none. Lets a full store skip
    /// the full sweep, which could not free anything before this instant.
    next_event: Option<Instant>,
}

/// The completed records' count and charges ([`Inner::completed`]).
#[derive(Default, Clone, Copy)]
struct Completed {
    records: usize,
    bytes: usize,
}

impl Completed {
    /// A reservation was completed; its record is now charged `charge`.
    fn add(&mut self, charge: usize) {
        self.records = self.records.saturating_add(1);
        self.bytes = self.bytes.saturating_add(charge);
    }

    /// `record` is gone: if it was completed, it leaves the count.
    fn remove(&mut self, record: &Record) {
        if matches!(record.state, State::Completed { .. }) {
            self.records = self.records.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub(record.charge);
        }
    }
}

/// A stored response as kept in memory, inside its record: its headers encoded with
/// [`StoredResponse::encode_headers`] and followed by the body in one buffer, so a record's
/// response is one allocation (not one per header name and value), and the record owns exactly
/// the bytes it is charged for.
///
/// Why held in the record rather than behind an `Arc`, as it was: the `Arc` and the two
/// `Bytes` it held were three allocations per completed record (the buffer, `Bytes`' shared
/// header once sliced, the `Arc`); inline, the record's table slot grows by 16 bytes and the
/// buffer is the only allocation until a replay shares it, about 100 bytes less resident
/// memory per record (`docs/benchmarks.md`, "A completed record in one allocation"). A replay
/// clones the `Bytes` under the lock (a reference count, as the `Arc` was) and slices it after.
#[derive(Clone)]
struct Compact {
    /// The encoded headers, then the body. Built from a `Vec` without spare capacity, which
    /// `Bytes` keeps without another allocation until its first clone.
    buf: bytes::Bytes,
    /// Where the body starts in `buf`.
    headers_len: u32,
    status: u16,
}

impl Compact {
    /// The encoded headers and a copy of the body in one allocation. A copy, not a reference
    /// to the handler's body: that may be a slice of a larger buffer (a chunk of a read
    /// buffer, a `Vec` with spare capacity), which a shared `Bytes` would keep alive whole
    /// while only its length is charged against the bound.
    ///
    /// Encoded headers of 4 GiB or more are refused as larger than any bound.
    fn new(response: &StoredResponse) -> Result<Self, StoreError> {
        let headers_len = response.encoded_headers_len();
        let headers_len_u32 =
            u32::try_from(headers_len).map_err(|_| StoreError::ByteCapacity(headers_len))?;
        let mut buf = Vec::with_capacity(headers_len.saturating_add(response.body.len()));
        response.encode_headers_into(&mut buf);
        buf.extend_from_slice(&response.body);
        Ok(Self {
            buf: bytes::Bytes::from(buf),
            headers_len: headers_len_u32,
            status: response.status,
        })
    }

    /// The bytes charged for the response.
    fn size(&self) -> usize {
        self.buf.len()
    }

    fn body_len(&self) -> usize {
        self.buf.len().saturating_sub(self.headers_len as usize)
    }

    /// The response, its header values and body slices of the shared buffer.
    fn expand(self) -> Result<StoredResponse, StoreError> {
        let split = (self.headers_len as usize).min(self.buf.len());
        Ok(StoredResponse {
            status: self.status,
            headers: StoredResponse::decode_headers_shared(&self.buf.slice(..split))
                .map_err(|e| StoreError::Backend(Box::new(e)))?,
            body: self.buf.slice(split..),
        })
    }
}

/// What `reserve` found for a scope, decided under the lock.
enum Found {
    Completed(Fingerprint, Compact, Duration),
    InFlight(Fingerprint, Duration),
    /// A reservation of the same request whose lease ended: a retry takes it over.
    TakeOver,
    Absent,
}

struct Record {
    fingerprint: Fingerprint,
    generation: u64,
    /// Bytes charged against the bound: the scope, the response or the allowance, overhead.
    charge: usize,
    state: State,
}

enum State {
    InFlight {
        token: ReservationToken,
        lease_until: Instant,
        /// The part of `charge` held for the response; zero once the lease ended.
        allowance: usize,
    },
    Completed {
        /// The response in one allocation (status, encoded headers, body), shared so a replay
        /// decodes it after the lock is released.
        response: Compact,
        expires_at: Instant,
    },
}

impl Record {
    /// Whether no request can use the record any more: an expired completed record, or a
    /// reservation whose lease ended more than `grace` ago.
    fn is_dead(&self, now: Instant, grace: Duration) -> bool {
        match self.state {
            State::InFlight { lease_until, .. } => later(lease_until, grace) <= now,
            State::Completed { expires_at, .. } => expires_at <= now,
        }
    }

    /// When a full sweep next has something to do with this record.
    fn next_event(&self, grace: Duration) -> Instant {
        match self.state {
            State::InFlight {
                lease_until,
                allowance,
                ..
            } if allowance > 0 => lease_until,
            State::InFlight { lease_until, .. } => later(lease_until, grace),
            State::Completed { expires_at, .. } => expires_at,
        }
    }

    /// Once the lease ended, stop holding the response allowance; returns the bytes freed.
    fn end_allowance(&mut self, now: Instant) -> usize {
        match &mut self.state {
            State::InFlight {
                lease_until,
                allowance,
                ..
            } if *lease_until <= now && *allowance > 0 => {
                let freed = std::mem::take(allowance);
                self.charge = self.charge.saturating_sub(freed);
                freed
            }
            _ => 0,
        }
    }

    /// The bytes this reservation holds for its response: zero once its lease ended, and for
    /// a completed record.
    fn allowance_held(&self) -> usize {
        match self.state {
            State::InFlight { allowance, .. } => allowance,
            State::Completed { .. } => 0,
        }
    }

    fn holds(&self, token: &ReservationToken) -> bool {
        matches!(&self.state, State::InFlight { token: held, .. } if held == token)
    }
}

impl Inner {
    /// A record was added or changed; a full sweep has something to do with it at `at`.
    fn note_event(&mut self, at: Instant) {
        self.next_event = Some(self.next_event.map_or(at, |e| e.min(at)));
    }

    fn generation(&mut self) -> u64 {
        self.next_generation += 1;
        self.next_generation
    }

    fn remove(&mut self, probe: Probe<'_>) -> Option<(PackedScope, Record)> {
        let removed = self.records.remove(probe);
        self.uncharge(removed)
    }

    /// Remove the record of `generation` (a completion-queue entry's), if it is still there.
    fn remove_generation(&mut self, hash: u64, generation: u64) -> Option<(PackedScope, Record)> {
        let removed = self.records.remove_generation(hash, generation);
        self.uncharge(removed)
    }

    /// Give a removed record's bytes back to the bound.
    fn uncharge(&mut self, removed: Option<(Key, Record)>) -> Option<(PackedScope, Record)> {
        let (key, record) = removed?;
        self.bytes = self.bytes.saturating_sub(record.charge);
        self.completed.remove(&record);
        Some((key.scope, record))
    }

    /// Bring the record of `scope` up to date at `now`: delete it if it is dead, drop the
    /// allowance of an ended reservation. Afterwards a sweep at `now` would not change it.
    fn settle(&mut self, probe: Probe<'_>, now: Instant) {
        let grace = self.limits.reservation_grace;
        let Some(record) = self.records.get_mut(probe) else {
            return;
        };
        if record.is_dead(now, grace) {
            self.remove(probe);
        } else {
            let freed = record.end_allowance(now);
            self.bytes = self.bytes.saturating_sub(freed);
        }
    }

    /// Drop completed records from the front of the completion queue while they are expired,
    /// and run the full sweep when it is due.
    fn sweep_front(&mut self, now: Instant) {
        while let Some((expires_at, _, _)) = self.completion_order.front() {
            if *expires_at > now {
                break;
            }
            let Some((_, hash, generation)) = self.completion_order.pop_front() else {
                break;
            };
            if self
                .records
                .of_generation(hash, generation)
                .is_some_and(|r| r.is_dead(now, Duration::ZERO))
            {
                self.remove_generation(hash, generation);
            }
        }
        if now.saturating_duration_since(self.last_full_sweep) >= self.limits.sweep_interval {
            self.sweep_all(now, self.limits.reservation_grace);
        }
    }

    /// Drop the completion-queue entries of records that are gone or changed, once they could
    /// outnumber the records. Called by the full sweep and after every completion: entries of
    /// short-lived records stuck behind a longer-lived one at the queue's front are otherwise
    /// only dropped by the full sweep, and with a long `sweep_interval` they would pile up,
    /// uncharged, while the same keys are used again. After a compaction the queue holds at
    /// most one entry per record, so the next one is at least as many completions away: O(1)
    /// per completion, amortised.
    fn compact_queue_if_stale(&mut self) {
        if self.completion_order.len() > self.records.len().saturating_mul(2) {
            let records = &self.records;
            self.completion_order.retain(|(_, hash, generation)| {
                records.of_generation(*hash, *generation).is_some()
            });
        }
    }

    /// Delete every dead record (reservations: lease ended more than `grace` ago) and drop
    /// the allowance of ended reservations; returns how many records were deleted.
    ///
    /// One pass over the records, without hashing: it runs under the lock, so its cost is a
    /// pause for every request (`docs/benchmarks.md`: looking every completion-queue entry up
    /// by scope as well made it about a second at 1.4 M records). Queue entries of records
    /// deleted here (completed records that expired behind a longer-lived one: mixed TTLs)
    /// stay until they reach the front, where `sweep_front` skips them like any entry whose
    /// record changed; only when such entries could outnumber the records is the queue
    /// compacted, so the lookups cost O(1) per completion, amortised, and the uncharged
    /// scopes they hold stay below the records' own.
    fn sweep_all(&mut self, now: Instant, grace: Duration) -> u64 {
        let before = self.records.len();
        let mut freed = 0usize;
        let mut completed = self.completed;
        let mut next_event: Option<Instant> = None;
        let event_grace = self.limits.reservation_grace;
        self.records.retain(|r| {
            if r.is_dead(now, grace) {
                freed = freed.saturating_add(r.charge);
                completed.remove(r);
                return false;
            }
            freed = freed.saturating_add(r.end_allowance(now));
            let at = r.next_event(event_grace);
            next_event = Some(next_event.map_or(at, |e| e.min(at)));
            true
        });
        self.bytes = self.bytes.saturating_sub(freed);
        self.completed = completed;
        self.compact_queue_if_stale();
        self.last_full_sweep = now;
        self.next_event = next_event;
        (before - self.records.len()) as u64
    }

    /// Whether `need` more bytes (and one more record, if `new_record`) fit once `records`
    /// records of `bytes` bytes are gone.
    fn fits(&self, new_record: bool, need: usize, records: usize, bytes: usize) -> bool {
        let count_ok =
            !new_record || self.records.len().saturating_sub(records) < self.limits.max_entries;
        let bytes_ok =
            (self.bytes.saturating_sub(bytes)).saturating_add(need) <= self.limits.max_bytes;
        count_ok && bytes_ok
    }

    fn full(&self, new_record: bool) -> StoreError {
        if new_record && self.records.len() >= self.limits.max_entries {
            StoreError::Capacity(self.limits.max_entries)
        } else {
            StoreError::ByteCapacity(self.limits.max_bytes)
        }
    }

    /// Whether `need` more bytes (and a record, if `new_record`) fit now, after sweeping what
    /// ended, without evicting any live record.
    fn room_without_evicting(&mut self, now: Instant, new_record: bool, need: usize) -> bool {
        if self.fits(new_record, need, 0, 0) {
            return true;
        }
        // The full sweep is O(records); skip it while it provably has nothing to free, so a
        // full store does not pay it on every new record.
        if self.next_event.is_some_and(|at| at <= now) {
            self.sweep_all(now, self.limits.reservation_grace);
            return self.fits(new_record, need, 0, 0);
        }
        false
    }

    /// Make room for `need` more bytes (and one more record, if `new_record`): drop dead
    /// records, then, only if the user opted in, evict live completed records closest to
    /// expiry. Fails, having evicted nothing, when that cannot make enough room. Evicted
    /// records go to `evicted`, so the caller can log and free them after releasing the lock.
    fn make_room(
        &mut self,
        now: Instant,
        new_record: bool,
        need: usize,
        evicted: &mut Vec<(PackedScope, Record)>,
    ) -> Result<(), StoreError> {
        if need > self.limits.max_bytes {
            return Err(StoreError::ByteCapacity(self.limits.max_bytes));
        }
        if self.room_without_evicting(now, new_record, need) {
            return Ok(());
        }
        if !self.limits.evict_live_completed
            || !self.fits(
                new_record,
                need,
                self.completed.records,
                self.completed.bytes,
            )
        {
            return Err(self.full(new_record));
        }
        // Plan first, so that nothing is evicted when even evicting every completed record
        // would not make room (the rest are reservations).
        let (mut records, mut bytes, mut take) = (0, 0, 0);
        for (i, (_, hash, generation)) in self.completion_order.iter().enumerate() {
            if let Some(r) = self.records.of_generation(*hash, *generation) {
                records += 1;
                bytes += r.charge;
            }
            if self.fits(new_record, need, records, bytes) {
                take = i + 1;
                break;
            }
        }
        if take == 0 {
            return Err(self.full(new_record));
        }
        for (_, hash, generation) in self.completion_order.drain(..take).collect::<Vec<_>>() {
            evicted.extend(self.remove_generation(hash, generation));
        }
        Ok(())
    }
}

/// Log the live records evicted to make room (only with `evict_live_completed_when_full`).
fn log_evictions(evicted: &[(PackedScope, Record)], now: Instant) {
    for (scope, record) in evicted {
        let [tenant, method, path, key] = scope.texts();
        let ttl_left = match record.state {
            State::Completed { expires_at, .. } => expires_at.saturating_duration_since(now),
            State::InFlight { .. } => Duration::ZERO,
        };
        tracing::warn!(
            target: "idempotency_actix",
            outcome = "evicted",
            %tenant,
            %method,
            %path,
            %key,
            ttl_left_secs = ttl_left.as_secs(),
            "memory store full: evicted a live completed record (evict_live_completed_when_full); a retry with this key will run the handler again"
        );
    }
}

impl IdempotencyStore for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    // A reservation needs its scope, the response allowance and the bookkeeping within
    // `max_bytes`: a longer scope could never be reserved, whatever else the store held, so
    // it is the request's fault and gets a final 400, not the 503 of a full store (which
    // `fail_open` would run unprotected on every retry). A bound with no room for any scope
    // declares zero: every keyed request is refused, as documented on `max_bytes`.
    fn max_scope_bytes(&self) -> Option<usize> {
        self.shared.max_scope
    }

    fn max_response_bytes(&self) -> Option<usize> {
        Some(self.shared.response_allowance)
    }

    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        let mut evicted = Vec::new();
        let probe = self.probe(scope);
        let token = self.next_token();
        let now = Instant::now();
        let mut inner = self.lock();
        inner.sweep_front(now);
        inner.settle(probe, now);
        // After `settle` the record, if any, is live: a completed record inside its TTL or a
        // reservation before the end of its grace.
        let found = match inner.records.get(probe) {
            Some(record) => match &record.state {
                State::Completed {
                    response,
                    expires_at,
                } => Found::Completed(
                    record.fingerprint,
                    response.clone(),
                    expires_at.saturating_duration_since(now),
                ),
                State::InFlight { lease_until, .. }
                    if *lease_until > now || record.fingerprint != *fingerprint =>
                {
                    Found::InFlight(
                        record.fingerprint,
                        lease_until.saturating_duration_since(now),
                    )
                }
                // A dead holder's lease on the same request.
                State::InFlight { .. } => Found::TakeOver,
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
        let allowance = inner.limits.response_allowance;
        let charge = scope_charge(scope).saturating_add(allowance);
        let lease_until = later(now, lease);
        let generation = inner.generation();
        let record = Record {
            fingerprint: *fingerprint,
            generation,
            charge,
            state: State::InFlight {
                token,
                lease_until,
                allowance,
            },
        };
        if let Found::Absent = found {
            inner.make_room(now, true, charge, &mut evicted)?;
            let key = Key {
                hash: probe.hash,
                scope: PackedScope::new(scope),
            };
            inner.records.insert(key, record);
            inner.bytes = inner.bytes.saturating_add(charge);
        } else {
            // The ended reservation was settled: it charges its scope only.
            let old = inner.records.get(probe).map_or(0, |r| r.charge);
            inner.make_room(now, false, charge.saturating_sub(old), &mut evicted)?;
            if let Some(existing) = inner.records.get_mut(probe) {
                *existing = record;
            }
            inner.bytes = inner.bytes.saturating_sub(old).saturating_add(charge);
        }
        inner.note_event(lease_until);
        drop(inner);
        log_evictions(&evicted, now);
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
        let response = Compact::new(response)?;
        let charge = scope_charge(scope).saturating_add(response.size());
        let mut evicted = Vec::new();
        let probe = self.probe(scope);
        let now = Instant::now();
        let mut inner = self.lock();
        // A reservation past its grace is gone even if no sweep deleted it yet.
        inner.settle(probe, now);
        let (old, allowance) = match inner.records.get(probe) {
            Some(record) if record.holds(token) => (record.charge, record.allowance_held()),
            _ => return Ok(WriteOutcome::Stale),
        };
        if charge > old {
            // The room for this body was secured before its handler ran. Its headers are
            // outside the allowance (the middleware's `max_response_bytes` counts the body),
            // so they may take the bound past it, by at most one more allowance: refusing
            // here, after the handler's effects, would leave the key to a second run once the
            // lease ends, and evicting another key's live record for them (with
            // `evict_live_completed_when_full`) would run that key's handler again on its
            // retry. Not for a late complete (its allowance is gone, perhaps to another
            // request), nor for headers larger than that: those need room like any growth,
            // and failing leaves the reservation as it is; the middleware retries (C16).
            let secured =
                allowance > 0 && response.body_len() <= allowance && charge - old <= allowance;
            if secured {
                // Expired records are still swept to make the room; live ones are not evicted.
                let _ = inner.room_without_evicting(now, false, charge - old);
            } else {
                inner.make_room(now, false, charge - old, &mut evicted)?;
            }
        }
        let generation = inner.generation();
        let expires_at = later(now, ttl);
        let Some((key, record)) = inner.records.get_key_value_mut(probe) else {
            return Ok(WriteOutcome::Stale);
        };
        let hash = key.hash;
        let old = std::mem::replace(&mut record.charge, charge);
        record.generation = generation;
        record.state = State::Completed {
            response,
            expires_at,
        };
        inner.completed.add(charge);
        inner.bytes = inner.bytes.saturating_sub(old).saturating_add(charge);
        inner.note_event(expires_at);
        inner
            .completion_order
            .push_back((expires_at, hash, generation));
        inner.compact_queue_if_stale();
        drop(inner);
        log_evictions(&evicted, now);
        Ok(WriteOutcome::Applied)
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        let probe = self.probe(scope);
        let mut inner = self.lock();
        if inner.records.get(probe).is_some_and(|r| r.holds(token)) {
            let removed = inner.remove(probe);
            drop(inner);
            drop(removed);
            Ok(WriteOutcome::Applied)
        } else {
            Ok(WriteOutcome::Stale)
        }
    }

    // No queue orders reservations by their lease: the completion queue holds completed
    // records only (a reservation's generation matches none of its entries), and `next_event`
    // is a lower bound that a later lease end keeps valid. So a renewal that keeps its
    // allowance only moves the lease's end; one that takes its allowance back lowers
    // `next_event` to the new end, where a full sweep gives it back again (without that, a
    // full store would skip the sweep until the old grace ran out).
    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let probe = self.probe(scope);
        let now = Instant::now();
        let until = later(now, lease);
        let mut guard = self.lock();
        // Split borrows: the record is a field of the guarded data, the limits another.
        let inner = &mut *guard;
        let grace = inner.limits.reservation_grace;
        let Some(record) = inner.records.get_mut(probe) else {
            return Ok(WriteOutcome::Stale);
        };
        if record.is_dead(now, grace) {
            // Past its grace a reservation is gone even if no sweep deleted it yet, as for
            // `complete`: renewing it would revive a record the store has given up.
            let removed = inner.remove(probe);
            drop(guard);
            drop(removed);
            return Ok(WriteOutcome::Stale);
        }
        let State::InFlight {
            token: held,
            lease_until,
            allowance,
        } = &mut record.state
        else {
            return Ok(WriteOutcome::Stale);
        };
        if held != token {
            return Ok(WriteOutcome::Stale);
        }
        *lease_until = until;
        // An allowance given back when the lease ended (`end_allowance`) is taken again only
        // for a lease that runs: a zero lease would give it back at once.
        let wanted = inner.limits.response_allowance;
        let regain = *allowance == 0 && wanted > 0 && until > now;
        let mut event = record.next_event(grace);
        // From free room only: a renewal never evicts a live record, not even with
        // `evict_live_completed_when_full` (a late `complete` needs only its response's size).
        if regain && inner.room_without_evicting(now, false, wanted) {
            // The sweep drops dead records only; this record's lease runs, so it is still here.
            if let Some(record) = inner.records.get_mut(probe) {
                if let State::InFlight { allowance, .. } = &mut record.state {
                    *allowance = wanted;
                    record.charge = record.charge.saturating_add(wanted);
                    inner.bytes = inner.bytes.saturating_add(wanted);
                }
                event = record.next_event(grace);
            }
        }
        inner.note_event(event);
        Ok(WriteOutcome::Applied)
    }

    fn renews_leases(&self) -> bool {
        true
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

    #[tokio::test]
    async fn scopes_that_differ_only_in_where_parts_end_are_different_records() {
        let a = Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/ab".into(),
            key: "c".into(),
        };
        let b = Scope {
            path: "/a".into(),
            key: "bc".into(),
            ..a.clone()
        };
        let packed = PackedScope::new(&a);
        assert!(packed.is(&a));
        assert!(!packed.is(&b));
        assert!(PackedScope::new(&b) != packed);
        // As logged: an empty part quoted, so it shows (`LogText`).
        assert_eq!(
            packed.texts().map(|t| t.to_string()),
            ["\"\"", "POST", "/ab", "c"]
        );

        let store = MemoryStore::new();
        let fp = Fingerprint([1; 32]);
        for scope in [&a, &b] {
            let outcome = store.reserve(scope, &fp, Duration::from_secs(60)).await;
            assert!(
                matches!(outcome, Ok(ReserveOutcome::Reserved { .. })),
                "{outcome:?}"
            );
        }
        assert_eq!(store.len(), 2);
    }

    #[tokio::test]
    async fn records_spread_over_the_tables_are_all_found_counted_and_swept() {
        let roomy = || {
            MemoryStore::builder()
                .max_entries(10_000)
                .max_bytes(usize::MAX)
                .build()
        };
        let fp = Fingerprint([1; 32]);
        let keys: Vec<String> = (0..2_000).map(|i| format!("k{i}")).collect();
        // All reserved with `lease`, then each outcome of a second reserve checked.
        let reserve_all = |store: MemoryStore, lease: Duration| {
            let keys = keys.clone();
            async move {
                let mut outcomes = Vec::new();
                for key in &keys {
                    outcomes.push(store.reserve(&scope(key), &fp, lease).await);
                }
                outcomes
            }
        };
        let reserved = |o: &Result<ReserveOutcome, StoreError>| {
            matches!(o, Ok(ReserveOutcome::Reserved { .. }))
        };

        let store = roomy();
        let minute = Duration::from_secs(60);
        assert!(reserve_all(store.clone(), minute)
            .await
            .iter()
            .all(reserved));
        assert_eq!(store.len(), keys.len());
        let used = store
            .lock()
            .records
            .tables
            .iter()
            .filter(|t| !t.is_empty())
            .count();
        assert_eq!(used, TABLES, "2,000 records leave no table empty");
        let again = reserve_all(store.clone(), minute).await;
        assert!(again
            .iter()
            .all(|o| matches!(o, Ok(ReserveOutcome::InFlight { .. }))));
        // The sweep walks every table: with the leases running it deletes nothing...
        assert_eq!(store.purge_expired(Duration::ZERO).await.ok(), Some(0));
        assert_eq!(store.len(), keys.len());

        // ...and once they have ended (grace zero), everything, and counts it.
        let ended = roomy();
        let zero = Duration::ZERO;
        assert!(reserve_all(ended.clone(), zero).await.iter().all(reserved));
        tokio::time::sleep(Duration::from_millis(5)).await;
        let purged = ended.purge_expired(Duration::ZERO).await.ok();
        assert_eq!(purged, Some(keys.len() as u64));
        assert_eq!(ended.len(), 0);
    }

    async fn reserve_and_complete(store: &MemoryStore, key: &str) {
        complete_with_ttl(store, key, Duration::from_secs(60)).await;
    }

    async fn complete_with_ttl(store: &MemoryStore, key: &str, ttl: Duration) {
        let fp = Fingerprint([1; 32]);
        let ReserveOutcome::Reserved { token } = store
            .reserve(&scope(key), &fp, Duration::from_secs(60))
            .await
            .unwrap()
        else {
            panic!("expected a reservation for {key}");
        };
        let outcome = store
            .complete(&scope(key), &token, &response(), ttl)
            .await
            .unwrap();
        assert_eq!(outcome, WriteOutcome::Applied);
    }

    /// C22: by default a full store refuses a new key rather than drop a live record.
    #[tokio::test]
    async fn full_store_refuses_new_keys_by_default() {
        let store = MemoryStore::builder().max_entries(2).build();
        reserve_and_complete(&store, "a").await;
        reserve_and_complete(&store, "b").await;
        let fp = Fingerprint([1; 32]);
        assert!(matches!(
            store
                .reserve(&scope("c"), &fp, Duration::from_secs(60))
                .await,
            Err(StoreError::Capacity(2))
        ));
        for key in ["a", "b"] {
            assert!(matches!(
                store
                    .reserve(&scope(key), &fp, Duration::from_secs(1))
                    .await
                    .unwrap(),
                ReserveOutcome::Completed { .. }
            ));
        }
    }

    /// The opt-in: the oldest completed record makes room.
    #[tokio::test]
    async fn opted_in_full_store_evicts_oldest_completed_record() {
        let store = MemoryStore::builder()
            .max_entries(2)
            .evict_live_completed_when_full(true)
            .build();
        reserve_and_complete(&store, "a").await;
        reserve_and_complete(&store, "b").await;
        reserve_and_complete(&store, "c").await;
        assert_eq!(store.len(), 2);
        let fp = Fingerprint([1; 32]);
        assert!(matches!(
            store
                .reserve(&scope("c"), &fp, Duration::from_secs(1))
                .await
                .unwrap(),
            ReserveOutcome::Completed { .. }
        ));
        // "a" was evicted: reserving it again succeeds (and evicts "b").
        assert!(matches!(
            store
                .reserve(&scope("a"), &fp, Duration::from_secs(1))
                .await
                .unwrap(),
            ReserveOutcome::Reserved { .. }
        ));
    }

    /// With the opt-in, eviction is planned first: when evicting every completed record would
    /// still not make room (the rest are reservations), nothing is evicted.
    #[tokio::test]
    async fn eviction_that_cannot_make_room_evicts_nothing() {
        let base = scope_charge(&scope("a"));
        let store = MemoryStore::builder()
            .response_allowance(1000)
            .max_bytes(2 * base + 1100)
            .evict_live_completed_when_full(true)
            .build();
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        reserve_and_complete(&store, "b").await;
        assert!(matches!(
            store.reserve(&scope("a"), &fp, lease).await.unwrap(),
            ReserveOutcome::Reserved { .. }
        ));
        assert!(matches!(
            store.reserve(&scope("c"), &fp, lease).await,
            Err(StoreError::ByteCapacity(_))
        ));
        assert!(matches!(
            store.reserve(&scope("b"), &fp, lease).await.unwrap(),
            ReserveOutcome::Completed { .. }
        ));
    }

    /// The byte count follows every transition back to zero.
    #[tokio::test]
    async fn bytes_are_charged_and_given_back() {
        let store = MemoryStore::builder().response_allowance(1000).build();
        let fp = Fingerprint([1; 32]);
        let lease = Duration::from_secs(60);
        let ReserveOutcome::Reserved { token } =
            store.reserve(&scope("a"), &fp, lease).await.unwrap()
        else {
            panic!("expected a reservation");
        };
        let base = scope_charge(&scope("a"));
        assert_eq!(store.bytes_used(), base + 1000);
        assert_eq!(
            store.release(&scope("a"), &token).await.unwrap(),
            WriteOutcome::Applied
        );
        assert_eq!(store.bytes_used(), 0);
        reserve_and_complete(&store, "a").await;
        let size = Compact::new(&response()).unwrap().size();
        assert_eq!(store.bytes_used(), base + size);
        assert_eq!(store.purge_expired(Duration::ZERO).await.unwrap(), 0);
        assert_eq!(store.bytes_used(), base + size);
    }

    #[tokio::test]
    async fn full_store_never_evicts_in_flight_reservations() {
        let store = MemoryStore::builder()
            .max_entries(2)
            .evict_live_completed_when_full(true)
            .build();
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

    /// Keys used again and again behind a long-lived record, with no full sweep in sight: the
    /// completion queue stays in proportion to the records instead of growing with every
    /// completion (its entries hold scopes that are not charged against the bound).
    #[tokio::test]
    async fn the_completion_queue_stays_in_proportion_without_a_full_sweep() {
        let store = MemoryStore::builder().sweep_interval(Duration::MAX).build();
        complete_with_ttl(&store, "long", Duration::from_secs(3600)).await;
        for _ in 0..100 {
            complete_with_ttl(&store, "short", Duration::from_millis(1)).await;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(store.len(), 2);
        let queued = store.lock().completion_order.len();
        assert!(
            queued <= 2 * store.len() + 1,
            "{queued} queue entries for 2 records"
        );
    }

    /// Reserve `key` for the fingerprint `[1; 32]`, expecting a reservation.
    async fn reserved(store: &MemoryStore, key: &str, lease: Duration) -> ReservationToken {
        let fp = Fingerprint([1; 32]);
        match store.reserve(&scope(key), &fp, lease).await {
            Ok(ReserveOutcome::Reserved { token }) => token,
            other => panic!("expected a reservation for {key}, got {other:?}"),
        }
    }

    async fn renew(
        store: &MemoryStore,
        key: &str,
        token: &ReservationToken,
        lease: Duration,
    ) -> WriteOutcome {
        match store.renew_lease(&scope(key), token, lease).await {
            Ok(outcome) => outcome,
            Err(e) => panic!("renew_lease of {key} failed: {e}"),
        }
    }

    /// A renewed reservation is kept to its new lease end, not its first one: neither a purge
    /// with no grace nor a full store (whose `reserve` sweeps everything that ended) drops it
    /// once the lease it was reserved with has ended, and its holder still completes.
    #[tokio::test]
    async fn a_renewed_reservation_is_not_dropped_at_its_first_lease_end() {
        let store = MemoryStore::builder()
            .max_entries(1)
            .reservation_grace(Duration::ZERO)
            .build();
        let fp = Fingerprint([1; 32]);
        // Long enough that the renewal surely comes first: with no grace, a renewal after
        // this lease would find the reservation gone.
        let first = Duration::from_millis(150);
        let token = reserved(&store, "a", first).await;
        let bytes = store.bytes_used();
        let minute = Duration::from_secs(60);
        assert_eq!(
            renew(&store, "a", &token, minute).await,
            WriteOutcome::Applied
        );
        assert_eq!(
            store.bytes_used(),
            bytes,
            "a running lease keeps its charge"
        );
        tokio::time::sleep(first + Duration::from_millis(50)).await;

        assert_eq!(store.purge_expired(Duration::ZERO).await.ok(), Some(0));
        assert!(matches!(
            store.reserve(&scope("b"), &fp, minute).await,
            Err(StoreError::Capacity(1))
        ));
        assert_eq!(store.len(), 1);
        match store.reserve(&scope("a"), &fp, minute).await {
            Ok(ReserveOutcome::InFlight {
                lease_remaining, ..
            }) => assert!(
                lease_remaining > Duration::from_secs(50),
                "{lease_remaining:?}"
            ),
            other => panic!("the renewed reservation was dropped or taken over: {other:?}"),
        }
        let done = store
            .complete(&scope("a"), &token, &response(), minute)
            .await;
        assert_eq!(done.ok(), Some(WriteOutcome::Applied));
    }

    /// A reservation whose lease ended gave its response allowance back; renewed, it takes it
    /// back, and the next full sweep after the new lease end gives it back again: a full
    /// store then makes room for a new key instead of waiting for the old grace to run out.
    #[tokio::test]
    async fn a_late_renewal_takes_its_allowance_back_until_the_new_lease_ends() {
        let base = scope_charge(&scope("a"));
        let store = MemoryStore::builder()
            .response_allowance(1000)
            .max_bytes(2 * base + 1500)
            .build();
        let short = Duration::from_millis(20);
        let token = reserved(&store, "a", short).await;
        tokio::time::sleep(short * 2).await;
        // A sweep that deletes nothing but gives the ended lease's allowance back.
        assert_eq!(store.purge_expired(Duration::MAX).await.ok(), Some(0));
        assert_eq!(store.bytes_used(), base);

        assert_eq!(
            renew(&store, "a", &token, short).await,
            WriteOutcome::Applied
        );
        assert_eq!(store.bytes_used(), base + 1000, "the allowance is back");
        tokio::time::sleep(short * 2).await;
        // "b" fits only once the renewed lease's allowance is given back again.
        reserved(&store, "b", Duration::from_secs(60)).await;
        assert_eq!(store.bytes_used(), 2 * base + 1000);
    }

    /// Without room for its allowance a late renewal still applies: the key stays held.
    #[tokio::test]
    async fn a_late_renewal_without_room_for_its_allowance_still_applies() {
        let base = scope_charge(&scope("a"));
        let store = MemoryStore::builder()
            .response_allowance(1000)
            .max_bytes(2 * base + 1500)
            .build();
        let short = Duration::from_millis(20);
        let minute = Duration::from_secs(60);
        let token = reserved(&store, "a", short).await;
        tokio::time::sleep(short * 2).await;
        reserved(&store, "b", minute).await; // fits once "a" gave its allowance back
        assert_eq!(store.bytes_used(), 2 * base + 1000);
        assert_eq!(
            renew(&store, "a", &token, minute).await,
            WriteOutcome::Applied
        );
        assert_eq!(store.bytes_used(), 2 * base + 1000, "no room, no allowance");
        let fp = Fingerprint([1; 32]);
        assert!(matches!(
            store.reserve(&scope("a"), &fp, minute).await,
            Ok(ReserveOutcome::InFlight { .. })
        ));
    }

    /// `Duration::MAX` is "never", as for `reserve`: no overflow, and the lease runs.
    #[tokio::test]
    async fn renewing_for_duration_max_does_not_panic() {
        let store = MemoryStore::new();
        let token = reserved(&store, "a", Duration::from_secs(60)).await;
        assert_eq!(
            renew(&store, "a", &token, Duration::MAX).await,
            WriteOutcome::Applied
        );
        let fp = Fingerprint([1; 32]);
        match store.reserve(&scope("a"), &fp, Duration::MAX).await {
            Ok(ReserveOutcome::InFlight {
                lease_remaining, ..
            }) => assert!(
                lease_remaining > Duration::from_secs(365 * 24 * 60 * 60),
                "{lease_remaining:?}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(store.purge_expired(Duration::MAX).await.ok(), Some(0));
        assert_eq!(
            renew(&store, "a", &token, Duration::MAX).await,
            WriteOutcome::Applied,
            "renewed again from a far-future end"
        );
    }

    /// A reservation past its grace is gone even before a sweep deletes it: its holder's
    /// renewal is stale and does not revive it.
    #[tokio::test]
    async fn a_renewal_past_the_grace_is_stale() {
        let store = MemoryStore::builder()
            .reservation_grace(Duration::from_millis(10))
            .sweep_interval(Duration::MAX)
            .build();
        let token = reserved(&store, "a", Duration::from_millis(10)).await;
        tokio::time::sleep(Duration::from_millis(40)).await;
        let minute = Duration::from_secs(60);
        assert_eq!(
            renew(&store, "a", &token, minute).await,
            WriteOutcome::Stale
        );
        assert_eq!(store.len(), 0);
        assert_eq!(store.bytes_used(), 0);
        let other = Fingerprint([2; 32]);
        assert!(matches!(
            store.reserve(&scope("a"), &other, minute).await,
            Ok(ReserveOutcome::Reserved { .. })
        ));
    }

    /// Mixed TTLs: records that expire behind a longer-lived one are deleted by the full sweep
    /// (their bytes given back at once), and their completion-queue entries, which would hold
    /// their scopes uncharged, are compacted away once they outnumber the records.
    #[tokio::test]
    async fn records_expiring_behind_a_longer_ttl_are_swept_and_their_queue_entries_compacted() {
        let store = MemoryStore::new();
        let fp = Fingerprint([1; 32]);
        complete_with_ttl(&store, "long", Duration::from_secs(3600)).await;
        let one_record = store.bytes_used();
        for key in ["s1", "s2", "s3", "s4"] {
            complete_with_ttl(&store, key, Duration::from_millis(1)).await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(store.lock().completion_order.len(), 5);
        assert_eq!(store.purge_expired(Duration::ZERO).await.unwrap(), 4);
        assert_eq!(store.len(), 1, "only the long-lived record is left");
        assert_eq!(store.bytes_used(), one_record, "their bytes are given back");
        assert_eq!(
            store.lock().completion_order.len(),
            1,
            "the deleted records' queue entries outnumbered the records and were compacted"
        );
        assert!(matches!(
            store
                .reserve(&scope("long"), &fp, Duration::from_secs(60))
                .await
                .unwrap(),
            ReserveOutcome::Completed { .. }
        ));
    }

    /// After random interleavings, the running byte count equals the sum of the
    /// records' charges, each charge is its scope plus its held allowance or response, and
    /// the completion queue never holds a live entry for a reservation.
    #[tokio::test]
    async fn byte_count_matches_the_records_charges() {
        struct Rng(u64);
        impl Rng {
            fn below(&mut self, n: u64) -> u64 {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                self.0 % n
            }
        }
        fn check(store: &MemoryStore, what: &str) {
            let inner = store.lock();
            let mut sum = 0usize;
            for table in inner.records.tables.iter() {
                for (key, record) in table.iter() {
                    let scope_len: usize =
                        key.scope.parts().map(|p| p.len()).sum::<usize>() + RECORD_OVERHEAD;
                    let expected = match &record.state {
                        State::InFlight { allowance, .. } => scope_len + allowance,
                        State::Completed { response, .. } => scope_len + response.size(),
                    };
                    assert_eq!(record.charge, expected, "{what}: a record's charge");
                    sum += record.charge;
                }
            }
            assert_eq!(inner.bytes, sum, "{what}: bytes vs the sum of charges");
            let completed: Vec<_> = inner
                .records
                .tables
                .iter()
                .flat_map(|table| table.iter())
                .filter(|(_, r)| matches!(r.state, State::Completed { .. }))
                .map(|(_, r)| r.charge)
                .collect();
            assert_eq!(
                (inner.completed.records, inner.completed.bytes),
                (completed.len(), completed.iter().sum::<usize>()),
                "{what}: the completed records' count and charges"
            );
            for (_, hash, generation) in &inner.completion_order {
                if let Some(r) = inner.records.of_generation(*hash, *generation) {
                    assert!(matches!(r.state, State::Completed { .. }), "{what}");
                }
            }
        }
        for seed in 1..30u64 {
            let allowance = 2048;
            let store = MemoryStore::builder()
                .max_entries(12)
                .max_bytes(6 * (allowance + 500))
                .response_allowance(allowance)
                .reservation_grace(Duration::from_millis(2))
                .sweep_interval(Duration::from_millis(if seed % 3 == 0 { 0 } else { 50 }))
                .evict_live_completed_when_full(seed % 2 == 0)
                .build();
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let fp = Fingerprint([1; 32]);
            let mut tokens: std::collections::HashMap<u64, ReservationToken> = Default::default();
            for step in 0..3000 {
                let k = rng.below(16);
                let s = scope(&format!("k{k}"));
                let dur = Duration::from_millis(rng.below(4));
                match rng.below(6) {
                    0 | 1 => {
                        if let Ok(ReserveOutcome::Reserved { token }) =
                            store.reserve(&s, &fp, dur).await
                        {
                            tokens.insert(k, token);
                        }
                    }
                    2 => {
                        if let Some(t) = tokens.get(&k) {
                            let r = StoredResponse {
                                status: 200,
                                headers: vec![(
                                    "h".into(),
                                    Bytes::from(vec![b'v'; rng.below(600) as usize]),
                                )],
                                body: Bytes::from(vec![
                                    b'b';
                                    rng.below(2 * allowance as u64) as usize
                                ]),
                            };
                            let _ = store.complete(&s, t, &r, dur).await;
                        }
                    }
                    3 => {
                        if let Some(t) = tokens.get(&k) {
                            let _ = store.renew_lease(&s, t, dur).await;
                        }
                    }
                    4 => {
                        if let Some(t) = tokens.get(&k) {
                            let _ = store.release(&s, t).await;
                        }
                    }
                    _ => {
                        if rng.below(4) == 0 {
                            let _ = store
                                .purge_expired(Duration::from_millis(rng.below(3)))
                                .await;
                        } else {
                            std::thread::sleep(Duration::from_micros(300));
                        }
                    }
                }
                check(&store, &format!("seed {seed} step {step}"));
            }
        }
    }
}
