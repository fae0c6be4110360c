//! [`RedisStore`]: idempotency records in Redis, shared by every app instance that points at
//! the same server. Feature `redis`.
//!
//! For a team that keeps sessions and rate limits in Redis already and has no PostgreSQL: it
//! keeps the same contract as `PostgresStore` (the same conformance suite, C26) with no schema
//! and no purge job. `docs/redis.md` is the operator's guide (persistence, failover, eviction).
//!
//! # Layout
//! One Redis string per record, at the key
//! `<prefix><tenant>:<method>:<path>:<key>` (default prefix `idem:`), each part
//! percent-encoded ([`record_key`]): every byte outside `A-Z a-z 0-9 - . _ ~ /` becomes `%XX`,
//! so `:` only ever separates parts (no two scopes share a key; and as every prefix ends with
//! `:`, no two stores either, [`validate_key_prefix`]), and no key holds `{`/`}`
//! (Redis Cluster hash tags: a record is one key, so one slot) or a glob character (`*?[]\`,
//! so the CLI's `SCAN MATCH` patterns are exact). The request path never scans.
//!
//! The record's bytes (state, fingerprint, token, times, and the response of a completed
//! record, byte-exact) are [`record`]'s business, and only its.
//!
//! # Round trips, atomicity, time
//! Every call is atomic and, but for the second round trips named below (and the `WAIT` of
//! [`RedisStoreBuilder::wait_for_replicas`]), one round trip; the rules are PostgreSQL's
//! (`migrations/*_reserve_function/up.sql`, `store/postgres/sql.rs`):
//! - `reserve` sends `SET key <reservation> NX GET PX <lease + grace>` with `TIME` behind it
//!   (pipelined). Redis's own `SET` decides the race for an absent key: it writes the
//!   reservation and answers nil (reserved), or writes nothing and answers the record there
//!   (a completed one is a replay; `TIME` gives what is left of its TTL). Only when it finds
//!   a reservation does the store call the reserve script (a second round trip, for
//!   concurrent duplicates and takeovers alone), which reads and writes in one step: it takes
//!   the key over only if the reservation's lease ended *and* its fingerprint is the caller's.
//! - `complete` and `release` are one `EVALSHA` each, of a Lua script loaded once and called
//!   by its hash (the redis crate's [`Script`] reloads it on `NOSCRIPT`, e.g. after a restart
//!   or failover). Redis runs a script alone. They apply only while the caller's token holds
//!   an in-flight reservation, so a holder's late `complete` (after its lease) applies until a
//!   takeover; a second `complete` by the token that completed the record answers applied and
//!   changes nothing (so a retried completion, after a lost reply or an unacknowledged
//!   `WAIT`, is not taken for a takeover).
//! - `renew_lease` is one `EVALSHA` too, fenced the same way: it moves the key's expiry
//!   (`PEXPIRE`) to the new lease plus the grace, so the lease ends where `PTTL` less grace
//!   says, and leaves the record's bytes as they are. It never waits for replicas (why: at
//!   `renew_lease` below).
//!
//! Time is the Redis server's, so app instances with skewed clocks agree: a reservation's
//! lease ends where its key's remaining life (`PTTL`) falls to its grace, and a completed
//! record's times come from `TIME` in the complete script. (The one exception is a record's
//! "reserved at", written by the reserving instance with its `SET` and only ever shown by
//! `idem-cli`.) Expiry is Redis's own (`PX`): a completed record goes with its TTL; a
//! reservation lives for its lease plus [`RedisStoreBuilder::in_flight_grace`] (default 24 h,
//! like `idem-cli purge --grace`), so an ended reservation still refuses another body and
//! accepts its holder's late `complete` for that long. Nothing needs purging:
//! [`IdempotencyStore::purge_expired`] returns `Ok(0)` unless asked for a grace shorter than
//! the store's (then it scans; see there).
//!
//! # Connection
//! Multiplexed connections ([`ConnectionManager`]): every request's command is pipelined on
//! one, it reconnects by itself, and a call costs exactly its one round trip. A pool that pings
//! on every checkout (bb8-redis's default) would add a round trip per call (C26), and a pool
//! buys nothing here: Redis serves one connection's pipeline as fast as many. What counts is
//! the thread that serves a connection: `connect` gives each thread that calls the store a
//! connection made on its own runtime ([`RedisStoreBuilder::connection_per_thread`], module
//! `per_thread`), so an actix worker's commands do not cross to the thread that made the
//! store. [`RedisStore::from_connection`] takes any [`redis::aio::ConnectionLike`] that is
//! `Clone` (a `ConnectionManager`, a `MultiplexedConnection`, a cluster connection).
//!
//! # Redis Cluster
//! With the feature `redis-cluster`, `RedisStoreBuilder::connect_cluster` connects through the
//! redis crate's cluster client. The request path needs nothing more (each call names its one
//! key); `WAIT` is pipelined behind a `GETRANGE` of the record's head, so it reaches the
//! record's primary and the call fails unless that node holds the write; commands that name no
//! key (`SCAN`, `CONFIG GET`) go to every primary (`nodes.rs`, [`KeyScan`]), and fail unless
//! every primary that owns slots answered.
//!
//! # Faults
//! Redis unreachable, a timeout (default 2 s per call), `LOADING`, `BUSY`, `READONLY`, `OOM`,
//! `MISCONF`, `NOREPLICAS`, `MASTERDOWN`, `CLUSTERDOWN`, `TRYAGAIN`, a `NOSCRIPT` left after the
//! client's own reload: [`StoreError::Unavailable`] (503 before the
//! handler; `complete` is retried by the middleware until the lease ends). A connection that
//! gave no answer in time is replaced in the background (module `connections`), so the retries
//! of `complete` and the lease renewals do not all go down a dead connection while Redis
//! answers new ones. A reserve that failed without an answer may still have run on the server:
//! a release fenced by its token follows it on the same connection, and is tried again in the
//! background for two leases (`give_back_later`), so its key is not held by nobody for a lease,
//! also when the reservation comes back with a Redis restarted from its AOF.
//!
//! A full Redis (`OOM` under `noeviction`) refuses new keys only, like a full memory store
//! (C22). It refuses a reserve's `SET` before running it, even for a key it holds, so on `OOM`
//! the reserve asks the reserve script instead (a second round trip, only while Redis is
//! full): a script without flags runs under `OOM` and fails only when it writes. A completed
//! record still replays (or carries its fingerprint, for the 422), a reservation is still in
//! flight (409); a new key or a takeover needs a write and fails with `OOM` (503). The same
//! holds while Redis refuses writes for another reason: `MISCONF` (it cannot persist),
//! `NOREPLICAS` (`min-replicas-to-write` not met) and `READONLY` (the node was demoted to a
//! replica by a failover and still serves reads; with `fail_open` an `Unavailable` here would
//! have run a completed payment's handler again). `complete` is flagged `allow-oom`: the
//! response of a request Redis admitted is stored even when Redis filled up while its handler
//! ran (memory may then pass `maxmemory` by the responses of the requests in flight), because
//! a refused completion leaves the reservation to end, and the retry after it would run the
//! handler a second time. Under `MISCONF` and `NOREPLICAS` no flag lets it write: such an
//! outage longer than the lease is C16's known window (`docs/reliability.md`).
//!
//! # Eviction
//! A `maxmemory-policy` that may evict keys with a TTL (every `volatile-*` and `allkeys-*`
//! policy) can silently drop live records (C22). [`RedisStoreBuilder::connect`] checks it with
//! `CONFIG GET` and warns, or refuses with [`EvictionCheck::Refuse`]; where `CONFIG` is
//! disabled (managed Redis) it warns that it could not check. Use `noeviction`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
pub use redis;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script, Value};

mod connections;
mod nodes;
mod per_thread;
pub mod record;
pub use nodes::{cluster_enabled, KeyScan};

use connections::{Connections, Origin, Picked};

use super::release_later;
use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};

/// Default [`RedisStoreBuilder::key_prefix`].
pub const DEFAULT_PREFIX: &str = "idem:";
/// Default [`RedisStoreBuilder::in_flight_grace`]: as long as `idem-cli purge --grace`.
pub const DEFAULT_IN_FLIGHT_GRACE: Duration = Duration::from_secs(24 * 3600);
/// Connections [`RedisStoreBuilder::connect`] opens when [`RedisStoreBuilder::wait_for_replicas`]
/// is on and [`RedisStoreBuilder::connections`] was not set: each `WAIT` holds its connection
/// until the replicas answer, so with one connection every write waited for the one before it
/// (misses fell to 0.32x on a local replica, `docs/redis.md`); eight let eight overlap.
pub const DEFAULT_WAIT_CONNECTIONS: usize = 8;
/// Default [`RedisStoreBuilder::connection_timeout`].
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);
/// Default [`RedisStoreBuilder::response_timeout`].
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The shortest connection and response timeout a [`RedisStoreBuilder`] accepts: 1 ms. Shorter
/// (zero, in practice) fails every call at its first poll, whatever Redis does.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Longest duration sent to the scripts (about 100 years, in microseconds): Lua numbers are
/// doubles, exact up to 2^53, and `now + duration` must stay well inside that.
const MAX_DURATION_US: u64 = 100 * 365 * 24 * 3600 * 1_000_000;

/// Bytes kept as they are in a key part; everything else is `%XX`. `:` (the part separator),
/// `%`, `{`, `}`, `*`, `?`, `[`, `]`, `\`, spaces, controls and non-ASCII are all encoded.
const KEY_PART: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

/// What [`RedisStoreBuilder::connect`] does when the server's `maxmemory-policy` may evict
/// records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionCheck {
    /// Log a warning and go on (default).
    #[default]
    Warn,
    /// Fail with [`StoreError::Backend`]. Where `CONFIG GET` is refused, warn instead.
    /// [`RedisStore::check`] asks again, so a readiness probe built on it fails too.
    Refuse,
    /// Do not ask.
    Skip,
}

/// Configure and connect a [`RedisStore`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect`, `connect_cluster` or `with_connection` is called"]
pub struct RedisStoreBuilder {
    prefix: String,
    in_flight_grace: Duration,
    connection_timeout: Duration,
    response_timeout: Duration,
    eviction_check: EvictionCheck,
    wait: Option<(u32, Duration)>,
    connections: Option<usize>,
    per_thread: bool,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            in_flight_grace: DEFAULT_IN_FLIGHT_GRACE,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            eviction_check: EvictionCheck::Warn,
            wait: None,
            connections: None,
            per_thread: true,
        }
    }
}

impl RedisStoreBuilder {
    /// Prefix of every record key (default `idem:`). Non-empty, printable ASCII, without
    /// `{`, `}`, `*`, `?`, `[`, `]` or `\` (so keys stay Cluster- and SCAN-safe), and ending
    /// with `:` (so no two prefixes share a key, [`validate_key_prefix`]); checked when the store
    /// is built. Give each app its own prefix when several share a server.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long Redis keeps a reservation after its lease ended (default 24 h). Until then it
    /// refuses another body (422) and accepts its holder's late `complete`; then it expires.
    /// Keep it longer than any handler may run past its lease (a hung one past
    /// `renew_lease_up_to`): with a short grace, a request with another body reserves the key
    /// while the first may still run (C7 wants 422), and the first one's response is then
    /// refused as stale. `Duration::ZERO` means the key ends with its lease.
    pub fn in_flight_grace(mut self, grace: Duration) -> Self {
        self.in_flight_grace = grace;
        self
    }

    /// Give up a connection attempt after this long (default 2 s; at least [`MIN_TIMEOUT`]).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// Give up waiting for a reply after this long (default 2 s; at least [`MIN_TIMEOUT`]):
    /// the call fails with [`StoreError::Unavailable`].
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// What to do when `maxmemory-policy` may evict records (default: warn).
    pub fn eviction_check(mut self, check: EvictionCheck) -> Self {
        self.eviction_check = check;
        self
    }

    /// After a reservation and after a completion, send `WAIT replicas timeout` (a second round
    /// trip) so the write is on `replicas` replicas before the handler runs and before the
    /// middleware moves on. (Not after a lease renewal: losing one in a failover only brings back
    /// the lease as it was, see `renew_lease`.) A reservation not acknowledged in time is released
    /// and the call fails (503, the handler does not run). A completion not acknowledged fails too,
    /// after it was stored: the client gets its response all the same, and the middleware retries
    /// the completion until the lease ends (a retry by the same token is applied again, so it is
    /// acknowledged once a replica is back or has taken over). `WAIT` holds its connection while it
    /// waits, so with this on `connect` and `connect_cluster` open [`DEFAULT_WAIT_CONNECTIONS`]
    /// connections by default, taken in turn ([`connections`](Self::connections) chooses), and no
    /// connection per thread ([`connection_per_thread`](Self::connection_per_thread)); keep
    /// `timeout` short. Off by default.
    ///
    /// `timeout` may exceed `response_timeout`: the connection that `connect` and
    /// `connect_cluster` open waits for `WAIT` as long as it needs (the other calls keep
    /// `response_timeout`).
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        // Beyond about 100 years (MAX_DURATION_US) Redis refuses the WAIT timeout and the
        // store's own deadlines would overflow: "forever" is taken as 100 years.
        let timeout = Duration::from_micros(micros(timeout));
        self.wait = (replicas > 0).then_some((replicas, timeout));
        self
    }

    /// How many connections `connect` and `connect_cluster` open (default 1, or
    /// [`DEFAULT_WAIT_CONNECTIONS`] with [`wait_for_replicas`](Self::wait_for_replicas); at
    /// least 1). Calls take them in turn. One multiplexed connection carries any load without
    /// `WAIT`, which is why it is the default (besides the per-thread ones of
    /// [`connection_per_thread`](Self::connection_per_thread)); a `WAIT` holds its connection
    /// until the replicas answer, so more connections let more of them overlap. A store over a
    /// connection of the app's own (`with_connection`, `from_connection`) uses that one.
    pub fn connections(mut self, n: usize) -> Self {
        self.connections = Some(n.max(1));
        self
    }

    /// Give every thread that calls the store a connection of its own, made on that thread's
    /// runtime (default on; stores made by [`connect`](Self::connect) without
    /// [`wait_for_replicas`](Self::wait_for_replicas) only). A connection is served by a task
    /// of the runtime it was made on: with one connection made in `main`, every command of an
    /// actix worker crosses to the main thread and back. A thread's first call starts making
    /// its connection and goes on over the shared one, so no request waits for it (module
    /// `per_thread` has the details). Costs one connection to Redis per worker thread and app
    /// instance, besides the shared one: turn it off where Redis limits clients tightly.
    pub fn connection_per_thread(mut self, on: bool) -> Self {
        self.per_thread = on;
        self
    }

    /// The prefix ([`validate_key_prefix`]) and the timeouts: a zero timeout fails every call
    /// (or every connection attempt) at its first poll, as if Redis were down, so it is refused
    /// here with the setting's name rather than answered with 503s.
    fn validate(&self) -> Result<(), StoreError> {
        validate_key_prefix(&self.prefix)?;
        for (setting, value) in [
            ("connection_timeout", self.connection_timeout),
            ("response_timeout", self.response_timeout),
        ] {
            if value < MIN_TIMEOUT {
                return Err(StoreError::Backend(
                    format!(
                        "invalid RedisStore setting `{setting}`: {value:?} is shorter than \
                         {MIN_TIMEOUT:?}; every call would time out as if Redis were down"
                    )
                    .into(),
                ));
            }
        }
        Ok(())
    }

    /// Connect to `url` (`redis://[user:password@]host[:port][/db]`, or `rediss://` for TLS
    /// checked against the system's roots), check the eviction policy, and build the store.
    ///
    /// # Errors
    /// [`StoreError::Backend`] for a bad URL or prefix (or a refused eviction policy);
    /// [`StoreError::Unavailable`] when the server cannot be reached in time.
    pub async fn connect(self, url: &str) -> Result<RedisStore, StoreError> {
        self.validate()?;
        if skips_tls_verification(url) {
            return Err(StoreError::Backend(UNVERIFIED_TLS_REFUSED.into()));
        }
        let client = redis::Client::open(url).map_err(invalid_url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(self.connection_timeout)
            .set_response_timeout(self.connection_response_timeout())
            .set_number_of_retries(1)
            .set_max_delay(1000);
        let mut conns = Vec::new();
        for _ in 0..self.connection_count() {
            let conn = tokio::time::timeout(
                self.connection_timeout.saturating_mul(3),
                ConnectionManager::new_with_config(client.clone(), config.clone()),
            )
            .await
            .map_err(|_| StoreError::unavailable("Redis did not accept a connection in time"))?
            .map_err(classify)?;
            if conns.is_empty() {
                refuse_cluster_node(&mut conn.clone(), self.response_timeout).await?;
            }
            conns.push(conn);
        }
        // Not with `WAIT`: its connections are there to be waited on side by side.
        let attempt = self.connection_timeout.saturating_mul(3);
        let per_thread = (self.per_thread && self.wait.is_none())
            .then(|| per_thread::PerThread::new(client.clone(), config.clone(), attempt));
        let remake = connections::Remake::new(client, config, attempt);
        self.with_connections(Connections::new(conns, per_thread, remake))
            .await
    }

    /// Connect to a Redis Cluster (feature `redis-cluster`) through the redis crate's cluster
    /// client: `urls` name one or more of its nodes (`redis://` or `rediss://`), from which it
    /// learns the rest. Every request-path call names one record key, so it goes to that
    /// key's primary in its one round trip; `MOVED`/`ASK` during a resharding are followed by
    /// the client. The eviction policy is checked on every primary.
    ///
    /// # Errors
    /// As [`RedisStoreBuilder::connect`].
    #[cfg(feature = "redis-cluster")]
    pub async fn connect_cluster(
        self,
        urls: &[&str],
    ) -> Result<RedisStore<redis::cluster_async::ClusterConnection>, StoreError> {
        self.validate()?;
        if urls.iter().any(|url| skips_tls_verification(url)) {
            return Err(StoreError::Backend(UNVERIFIED_TLS_REFUSED.into()));
        }
        let client = redis::cluster::ClusterClientBuilder::new(urls.iter().copied())
            .connection_timeout(self.connection_timeout)
            .response_timeout(self.connection_response_timeout())
            .build()
            .map_err(invalid_url)?;
        let mut conns = Vec::new();
        for _ in 0..self.connection_count() {
            let conn = tokio::time::timeout(
                self.connection_timeout.saturating_mul(3),
                client.get_async_connection(),
            )
            .await
            .map_err(|_| {
                StoreError::unavailable("Redis Cluster did not accept a connection in time")
            })?
            .map_err(classify)?;
            conns.push(conn);
        }
        self.with_connections(Connections::new(conns, None, None))
            .await
    }

    /// Build the store over a connection the app already has, after the eviction check.
    ///
    /// With [`wait_for_replicas`](Self::wait_for_replicas), give that connection a response
    /// timeout above the `WAIT` timeout plus this builder's `response_timeout`: a connection
    /// that cuts the `WAIT` short fails the reservation (503) even when Redis would have
    /// answered in time.
    pub async fn with_connection<C>(self, conn: C) -> Result<RedisStore<C>, StoreError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        self.with_connections(Connections::new(vec![conn], None, None))
            .await
    }

    /// [`with_connection`](Self::with_connection) over `conns`, which calls take in turn;
    /// empty is refused.
    async fn with_connections<C>(self, conns: Connections<C>) -> Result<RedisStore<C>, StoreError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        self.validate()?;
        let mut probe = conns.first();
        check_version(&mut probe, self.response_timeout).await?;
        let readable =
            check_eviction(&mut probe, self.eviction_check, self.response_timeout).await?;
        // Asked again by `check` only where the policy could be read: on a managed Redis that
        // refuses `CONFIG`, every readiness probe would log the same warning.
        let recheck =
            (readable && self.eviction_check != EvictionCheck::Skip).then_some(self.eviction_check);
        let mut store = self.build_unchecked(conns);
        if let Some(inner) = Arc::get_mut(&mut store.inner) {
            inner.eviction_recheck = recheck;
        }
        store.check_permissions(&mut probe).await?;
        Ok(store)
    }

    /// How many connections `connect` opens (see [`connections`](Self::connections)).
    fn connection_count(&self) -> usize {
        self.connections.unwrap_or(if self.wait.is_some() {
            DEFAULT_WAIT_CONNECTIONS
        } else {
            1
        })
    }

    /// The response timeout of a connection this builder opens: the store's own
    /// `response_timeout`, plus the `WAIT` timeout when there is one. The store times every
    /// other call itself (`RedisStore::timed`); were the connection's timeout the shorter, it
    /// would cut a `WAIT` for a slow replica before Redis answers it, and the reservation
    /// would be neither acknowledged nor given back.
    fn connection_response_timeout(&self) -> Duration {
        let wait = self.wait.map_or(Duration::ZERO, |(_, timeout)| timeout);
        self.response_timeout.saturating_add(wait)
    }

    /// The store over `conns`.
    fn build_unchecked<C>(self, conns: Connections<C>) -> RedisStore<C> {
        RedisStore {
            conns: Arc::new(conns),
            inner: Arc::new(Inner {
                prefix: self.prefix,
                grace_us: micros(self.in_flight_grace),
                timeout: self.response_timeout,
                wait: self.wait,
                give_backs: release_later::Tasks::new(release_later::MAX_TASKS),
                eviction_recheck: None,
                reserve: Script::new(include_str!("redis/reserve.lua")),
                complete: Script::new(include_str!("redis/complete.lua")),
                release: Script::new(include_str!("redis/release.lua")),
                renew: Script::new(include_str!("redis/renew.lua")),
                purge: Script::new(include_str!("redis/purge.lua")),
            }),
        }
    }
}

/// Idempotency records in Redis, for apps that run several instances and keep Redis rather
/// than PostgreSQL. See the [module docs](self) for the layout and guarantees.
///
/// Cloning is cheap; clones share the connections.
#[derive(Clone)]
pub struct RedisStore<C = ConnectionManager> {
    /// Taken in turn ([`RedisStoreBuilder::connections`]), or the calling thread's own.
    conns: Arc<Connections<C>>,
    inner: Arc<Inner>,
}

struct Inner {
    prefix: String,
    grace_us: u64,
    timeout: Duration,
    wait: Option<(u32, Duration)>,
    /// Bound on background releases ([`RedisStore::give_back_later`]).
    give_backs: release_later::Tasks,
    /// What [`RedisStore::check`] does about the eviction policy (`None`: not asked).
    eviction_recheck: Option<EvictionCheck>,
    reserve: Script,
    complete: Script,
    release: Script,
    renew: Script,
    purge: Script,
}

impl<C> std::fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("in_flight_grace_us", &self.inner.grace_us)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connect with the defaults (prefix `idem:`, 24 h grace, 2 s timeouts, eviction warning).
    /// `redis://` or `rediss://` (TLS).
    pub async fn connect(url: &str) -> Result<RedisStore, StoreError> {
        Self::builder().connect(url).await
    }

    /// Configure the store.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }
}

impl<C> RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store with the defaults over a connection the app already has, without the start-up
    /// checks (the server's version, 7.0 or newer, and its eviction policy; use
    /// [`RedisStoreBuilder::with_connection`] for those). Its own response timeout still bounds
    /// every call.
    pub fn from_connection(conn: C) -> Self {
        RedisStore::builder().build_unchecked(Connections::new(vec![conn], None, None))
    }

    /// The (first) connection, a clone, e.g. for a readiness probe.
    pub fn connection(&self) -> C {
        self.conns.first()
    }

    /// The connection for the next call: the thread's own, or each shared one in turn. A write
    /// and its `WAIT` must share one (`WAIT` counts the replicas that have that connection's
    /// writes), so a call that needs both takes it once.
    fn pick(&self) -> Picked<C> {
        self.conns.pick()
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The Redis key of `scope`'s record.
    pub fn key_of(&self, scope: &Scope) -> String {
        record_key(&self.inner.prefix, scope)
    }

    /// At connect: run what the request path runs, on nothing, so that a user the server's ACL
    /// does not allow it fails here with the reason. Found by review (2026-12-05): a user
    /// without `EVALSHA` could reserve (native `SET`), so handlers ran, and then no response
    /// could ever be stored (its retries were told 503 for the lease and grace); a user without
    /// `TIME` left a reservation behind each refused reserve. Checked: `TIME`; `SCRIPT LOAD` of
    /// every script, explicitly (a server that already holds them, loaded by another instance,
    /// would not ask for it until its next restart or failover, and then every `complete` would
    /// fail: review, 2026-12-06); the commands the scripts and the reserve run, each on a key
    /// under the prefix that no record can have (no `:` after the prefix), so that nothing is
    /// read or written; and the release script (`EVALSHA`) fenced by a fresh token.
    ///
    /// On `conn`, the first shared connection: a store that opens a connection per calling
    /// thread must not open one for the thread that connects.
    async fn check_permissions(&self, conn: &mut C) -> Result<(), StoreError> {
        let refused = |command: &str, error: RedisError| {
            if error.code() == Some("NOPERM") {
                not_permitted(command, &error)
            } else {
                classify(error)
            }
        };
        let time = tokio::time::timeout(
            self.inner.timeout,
            redis::cmd("TIME").query_async::<(u64, u64)>(conn),
        )
        .await
        .map_err(|_| StoreError::unavailable("Redis did not answer TIME in time"))?;
        time.map_err(|e| refused("TIME", e))?;
        let inner = &self.inner;
        for script in [
            &inner.reserve,
            &inner.complete,
            &inner.release,
            &inner.renew,
            &inner.purge,
        ] {
            let loaded = tokio::time::timeout(inner.timeout, script.load_async(conn))
                .await
                .map_err(|_| StoreError::unavailable("Redis did not answer SCRIPT LOAD in time"))?;
            permitted("SCRIPT LOAD", loaded)?;
        }
        // No record of any prefix ends in `!`, which `record_key` always encodes: not this
        // store's, nor one of a store whose prefix nests in this one's (`x:` and `x:t:POST:/:`).
        let nowhere = format!("{}permission-probe!", inner.prefix);
        let mut probes = vec![
            ("GET", redis::cmd("GET").arg(&nowhere).clone()),
            (
                "GETRANGE",
                redis::cmd("GETRANGE").arg(&nowhere).arg(0).arg(0).clone(),
            ),
            // `XX`: only if the key exists, which it does not; `GET`: as the reserve's.
            (
                "SET",
                redis::cmd("SET")
                    .arg(&nowhere)
                    .arg("")
                    .arg("XX")
                    .arg("GET")
                    .clone(),
            ),
            ("DEL", redis::cmd("DEL").arg(&nowhere).clone()),
            ("PTTL", redis::cmd("PTTL").arg(&nowhere).clone()),
            (
                "PEXPIRE",
                redis::cmd("PEXPIRE").arg(&nowhere).arg(1).clone(),
            ),
            ("TYPE", redis::cmd("TYPE").arg(&nowhere).clone()),
        ];
        if inner.wait.is_some() {
            // No replica needed, so it answers at once.
            probes.push(("WAIT", redis::cmd("WAIT").arg(0).arg(1).clone()));
        }
        for (command, probe) in probes {
            let answer =
                tokio::time::timeout(inner.timeout, probe.query_async::<redis::Value>(conn))
                    .await
                    .map_err(|_| {
                        StoreError::unavailable(format!("Redis did not answer {command} in time"))
                    })?;
            permitted(command, answer)?;
        }
        let probe = Scope {
            tenant: String::new(),
            method: "POST".into(),
            path: "/".into(),
            key: "idempotency-actix permission probe".into(),
        };
        let key = self.key_of(&probe);
        let release = tokio::time::timeout(
            self.inner.timeout,
            self.inner
                .release
                .key(&key)
                .arg(record::token_text(&ReservationToken::random()))
                .invoke_async::<i64>(conn),
        )
        .await
        .map_err(|_| StoreError::unavailable("Redis did not answer EVALSHA in time"))?;
        release.map_err(|e| refused("EVALSHA", e))?;
        Ok(())
    }

    /// A readiness probe: `PING` within the response timeout, then the eviction policy
    /// again, as the builder's [`EvictionCheck`] says (on every primary of a Cluster): a policy
    /// changed while the app runs (by an operator, or a failover to a replica configured
    /// otherwise) fails the probe under [`EvictionCheck::Refuse`] and logs a warning under
    /// `Warn`. Not asked where `CONFIG GET` was refused at connect, nor with `Skip`.
    pub async fn check(&self) -> Result<(), StoreError> {
        let mut picked = self.pick();
        self.timed(
            &picked.origin,
            redis::cmd("PING").query_async::<()>(&mut picked.conn),
        )
        .await?;
        if let Some(check) = self.inner.eviction_recheck {
            check_eviction(&mut picked.conn, check, self.inner.timeout).await?;
        }
        Ok(())
    }

    /// Redis's answer to `call` over `origin`'s connection, classified.
    async fn timed<T>(
        &self,
        origin: &Origin,
        call: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> Result<T, StoreError> {
        self.answer(origin, call).await?.map_err(classify)
    }

    /// Redis's answer to `call` over `origin`'s connection, its errors unclassified (for a
    /// caller that handles one of them itself); no answer within the response timeout is
    /// [`StoreError::Unavailable`]. A connection that gave no answer in time is replaced
    /// (module `connections` says why).
    async fn answer<T>(
        &self,
        origin: &Origin,
        call: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> Result<Result<T, RedisError>, StoreError> {
        match tokio::time::timeout(self.inner.timeout, call).await {
            Ok(Err(e)) if e.is_timeout() => {
                self.conns.went_silent(origin);
                Ok(Err(e))
            }
            // A replica answered (`READONLY`, or `MASTERDOWN` from one that lost its
            // primary): a failover demoted the server this connection reaches and left it up,
            // with its clients, while the store's address may now name the new primary (a
            // managed Redis's DNS name). The redis crate keeps a connection that answers, so
            // every write would fail until the process restarted: replace it, which
            // reconnects to the address (at most once a second per connection).
            Ok(Err(e)) if matches!(e.code(), Some("READONLY" | "MASTERDOWN")) => {
                self.conns.reached_a_replica(origin);
                Ok(Err(e))
            }
            Ok(answer) => Ok(answer),
            Err(_) => {
                self.conns.went_silent(origin);
                Err(StoreError::unavailable(format!(
                    "Redis did not answer within {} ms",
                    self.inner.timeout.as_millis()
                )))
            }
        }
    }

    /// The native half of `reserve`: `SET key <reservation> NX GET PX <life>` and `TIME`,
    /// pipelined (`TIME` names no key, so on a cluster it goes with the `SET` to the record's
    /// node, the clock that wrote the record's times).
    async fn set_or_get(
        &self,
        picked: &mut Picked<C>,
        key: &str,
        reservation: &[u8],
        life_ms: u64,
    ) -> Result<SetOrGet, StoreError> {
        // The record that was there (nil: reserved), and `TIME` (seconds, microseconds).
        type Reply = (Option<Vec<u8>>, (u64, u64));
        let answer: Result<Reply, RedisError> = self
            .answer(
                &picked.origin,
                redis::pipe()
                    .cmd("SET")
                    .arg(key)
                    .arg(reservation)
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(life_ms)
                    .cmd("TIME")
                    .query_async(&mut picked.conn),
            )
            .await?;
        match answer {
            Ok((None, _)) => Ok(SetOrGet::Reserved),
            Ok((Some(record), (secs, micros))) => Ok(SetOrGet::Found(
                Bytes::from(record),
                secs.saturating_mul(1_000_000).saturating_add(micros),
            )),
            // Redis refuses a `SET` before running it while it refuses writes: under `OOM` (it
            // is flagged as a command that may grow memory), `MISCONF` (it cannot persist: a
            // failed `BGSAVE` under `stop-writes-on-bgsave-error`, an AOF write error),
            // `NOREPLICAS` (`min-replicas-to-write` not met) and `READONLY` (a primary demoted
            // to a replica by a failover, still holding every record), even when the key exists
            // and `NX` would write nothing.
            Err(e)
                if matches!(
                    e.code(),
                    Some("OOM" | "MISCONF" | "NOREPLICAS" | "READONLY")
                ) =>
            {
                Ok(SetOrGet::WritesRefused)
            }
            Err(e) => Err(classify(e)),
        }
    }

    /// The release script on `conn`: after a reservation's `WAIT` failed, on the connection
    /// that waited (free again at that moment, where another might still be held by a `WAIT`).
    /// One reserve's decision: the native `SET ... NX GET`, then the reserve script when it
    /// found a record that is not a completed one.
    async fn decide(
        &self,
        picked: &mut Picked<C>,
        key: &str,
        fingerprint: &Fingerprint,
        reservation: &[u8],
        life_ms: u64,
        token: ReservationToken,
    ) -> Result<ReserveOutcome, Undecided> {
        let outcome = match self.set_or_get(picked, key, reservation, life_ms).await? {
            SetOrGet::Reserved => ReserveOutcome::Reserved { token },
            SetOrGet::Found(bytes, now_us) if bytes.first() == Some(&record::COMPLETED) => {
                completed(record::decode(bytes).map_err(corrupt)?, |expires_us| {
                    Duration::from_micros(expires_us.saturating_sub(now_us))
                })?
            }
            // Our own reservation: the cluster client sent the `SET` again after an I/O error
            // that came after Redis had applied it. It is ours (the token is this call's).
            SetOrGet::Found(bytes, _)
                if bytes
                    .get(..=record::WRITE_HEAD_LAST)
                    .is_some_and(|head| record::holds_write(head, record::IN_FLIGHT, &token)) =>
            {
                ReserveOutcome::Reserved { token }
            }
            // A reservation: whether it may be taken over is the script's to decide, on
            // Redis's clock and in the same step as the write.
            //
            // Redis full (`OOM`, `noeviction`): the `SET` was refused unread, but a key that
            // is there must still answer (a replay, 409, 422), as a full memory store's does
            // (C22: a full store refuses new keys only). The script answers: a script without
            // flags runs under `OOM` and fails only at a write (Redis 7.0), and it writes only
            // for an absent key or a takeover, which then fail with `OOM`, i.e. 503, closed.
            found @ (SetOrGet::Found(..) | SetOrGet::WritesRefused) => {
                let reply: Result<Value, StoreError> = self
                    .timed(
                        &picked.origin,
                        self.inner
                            .reserve
                            .key(key)
                            .arg(fingerprint.as_bytes())
                            .arg(reservation)
                            .arg(life_ms)
                            .invoke_async(&mut picked.conn),
                    )
                    .await;
                match reply {
                    Ok(reply) => decode_reserve(reply, token)?,
                    // The `SET` read another request's reservation: say so with the error,
                    // so the request is not run unprotected (`fail_open`) beside it.
                    Err(error) => {
                        let seen_in_flight = match found {
                            SetOrGet::Found(bytes, _) => {
                                record::decode(bytes).ok().map(|r| r.fingerprint)
                            }
                            _ => None,
                        };
                        return Err(Undecided {
                            error,
                            seen_in_flight,
                        });
                    }
                }
            }
        };
        Ok(outcome)
    }

    /// After a failed reserve, give back the reservation it may have made anyway, in the
    /// background (module `release_later` says why). A reply that timed out (Redis slow or
    /// frozen, a network pause) or a connection lost after sending leaves the `SET` (or the
    /// script) sent and perhaps applied, or applied later; with AOF, applied just before a
    /// crash and found again after the restart. The first release goes on the same
    /// connection, behind the write it undoes. If that does not release it (Redis gone, the
    /// connection silent), it is tried again on [`release_later::keep_trying`]'s schedule, so a
    /// reservation that comes back with a restarted Redis is freed soon after, not at the end
    /// of its lease. Only for a reservation that may exist: a reserve whose outcome is unknown
    /// ([`outcome_unknown`]; one refused by an error Redis answered, `OOM` or `READONLY`, wrote
    /// nothing, and releases for those would only use up the bound on these tasks and load a
    /// Redis already refusing), or one known to exist. Fenced by this call's token: a no-op if
    /// the write never happened or someone else holds the key now.
    fn give_back_later(
        &self,
        mut picked: Picked<C>,
        scope: &Scope,
        token: ReservationToken,
        lease: Duration,
    ) {
        let Some(task) = self.inner.give_backs.start(&scope.key) else {
            return;
        };
        let store = self.clone();
        let scope = scope.clone();
        tokio::spawn(async move {
            let _task = task;
            let released = store.release_on(&mut picked, &scope, &token).await;
            if matches!(released, Ok(WriteOutcome::Applied)) {
                return;
            }
            drop(picked);
            let (store, scope, token) = (&store, &scope, &token);
            release_later::keep_trying(lease, &scope.key, move || async move {
                matches!(store.release(scope, token).await, Ok(WriteOutcome::Applied))
            })
            .await;
        });
    }

    async fn release_on(
        &self,
        picked: &mut Picked<C>,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        let key = self.key_of(scope);
        let released: i64 = self
            .timed(
                &picked.origin,
                self.inner
                    .release
                    .key(&key)
                    .arg(record::token_text(token))
                    .invoke_async(&mut picked.conn),
            )
            .await?;
        Ok(fenced(released))
    }

    /// Whether `key` holds a record completed by `token` (one `GETRANGE` of its head, a read
    /// Redis answers while it refuses writes).
    async fn completed_by(
        &self,
        picked: &mut Picked<C>,
        key: &str,
        token: &ReservationToken,
    ) -> Result<bool, StoreError> {
        let head: Vec<u8> = self
            .timed(
                &picked.origin,
                redis::cmd("GETRANGE")
                    .arg(key)
                    .arg(0)
                    .arg(record::WRITE_HEAD_LAST)
                    .query_async(&mut picked.conn),
            )
            .await?;
        Ok(record::holds_write(&head, record::COMPLETED, token))
    }

    /// `WAIT replicas timeout` on `conn`, the connection that wrote `key`'s record, on the node
    /// that holds it; whether enough replicas acknowledged. `Unavailable` if the node that
    /// answers does not hold the write (`state`, by `token`).
    ///
    /// `WAIT` names no key, and a cluster connection would send it to every primary (and
    /// answer with the least count). Pipelined behind a `GETRANGE` of the record's head, it
    /// goes where the record's write went. The `GETRANGE` is also the check: if the primary
    /// dies while `WAIT` blocks, the cluster client resends the whole pipeline, after the
    /// failover to the promoted replica, which may lack the write (the key absent, or still the
    /// reservation a complete replaced); its `WAIT` then counts replicas of a node that never
    /// saw the write, so it proves nothing. Same pipeline, so the same node answers both.
    ///
    /// Known limit (review, 2026-12-06, from the Redis source): since Redis 7.2, and in
    /// Valkey, `WAIT` counts only up to its connection's last *propagated* write, and a call
    /// that wrote nothing (a retried `complete` that finds the record already completed by its
    /// token, a resent reserve that finds its own reservation) leaves that where it was, so
    /// `WAIT` on another connection than the write's may answer at once. Redis 7.0, which
    /// this project tests against, moves it after every command. A write that changes nothing
    /// sent before `WAIT` would close it, but needs more ACL permissions and is refused up
    /// front by a Redis that refuses writes (`MISCONF`, `NOREPLICAS`), which the read-only
    /// fallbacks rely on: not done until it can be tested on such a server (docs/redis.md).
    async fn wait_replicas(
        &self,
        picked: &mut Picked<C>,
        key: &str,
        (state, token): (u8, &ReservationToken),
        replicas: u32,
        timeout: Duration,
    ) -> Result<Replicated, StoreError> {
        // At least 1 ms: `WAIT n 0` would block for ever.
        let timeout_ms = (micros(timeout) / 1000).max(1);
        let (head, acked): (Vec<u8>, i64) = tokio::time::timeout(
            timeout.saturating_add(self.inner.timeout),
            redis::pipe()
                .cmd("GETRANGE")
                .arg(key)
                .arg(0)
                .arg(record::WRITE_HEAD_LAST)
                .cmd("WAIT")
                .arg(replicas)
                .arg(timeout_ms)
                .query_async(&mut picked.conn),
        )
        .await
        .map_err(|_| {
            // Silent past WAIT's own timeout: the connection, not the replicas.
            self.conns.went_silent(&picked.origin);
            StoreError::unavailable("Redis did not answer WAIT in time")
        })?
        .map_err(classify)?;
        if let Some(fingerprint) = record::held_by_another(&head, token) {
            return Ok(Replicated::HeldByAnother(fingerprint));
        }
        if !record::holds_write(&head, state, token) {
            return Err(StoreError::unavailable(
                "the Redis node that answered WAIT does not hold the write (a failover \
                 lost it, or it has not reached this node)",
            ));
        }
        Ok(if acked >= i64::from(replicas) {
            Replicated::Enough
        } else {
            Replicated::TooFew
        })
    }
}

/// What [`RedisStore::wait_replicas`] found.
enum Replicated {
    /// The write reached enough replicas.
    Enough,
    /// It did not, in time.
    TooFew,
    /// The node that answered holds another request's record (with its fingerprint) where the
    /// write should be: a failover lost the write, and another request wrote the key since.
    HeldByAnother(Fingerprint),
}

/// A reserve that failed ([`RedisStore::decide`]), with the fingerprint of another request's
/// reservation its `SET` had read first, if it had.
struct Undecided {
    error: StoreError,
    seen_in_flight: Option<Fingerprint>,
}

impl From<StoreError> for Undecided {
    fn from(error: StoreError) -> Self {
        Undecided {
            error,
            seen_in_flight: None,
        }
    }
}

/// What the native `SET ... NX GET` of a reserve found.
enum SetOrGet {
    /// The key was absent and now holds the caller's reservation.
    Reserved,
    /// The record that was there, untouched, and Redis's clock in microseconds.
    Found(Bytes, u64),
    /// Redis refuses writes (`OOM`, `MISCONF`, `NOREPLICAS`, `READONLY`) and refused the `SET` without
    /// looking at the key.
    WritesRefused,
}

/// The Redis key of `scope`'s record under `prefix`: `<prefix><tenant>:<method>:<path>:<key>`,
/// each part percent-encoded (see the [module docs](self)).
pub fn record_key(prefix: &str, scope: &Scope) -> String {
    let mut key = String::with_capacity(
        prefix.len()
            + scope.tenant.len()
            + scope.method.len()
            + scope.path.len()
            + 3
            + scope.key.len(),
    );
    key.push_str(prefix);
    for (i, part) in [&scope.tenant, &scope.method, &scope.path, &scope.key]
        .into_iter()
        .enumerate()
    {
        if i > 0 {
            key.push(':');
        }
        key.extend(utf8_percent_encode(part, KEY_PART));
    }
    key
}

/// The scope of a record key written by [`record_key`], or `None` if `key` is not one (another
/// prefix, not four parts, a bad escape, not UTF-8, or an escape [`record_key`] never writes:
/// `%61` for `a`, `%2f` for `/`). The last matters because the store reads a scope at its one
/// key: a hand-written `...:%61` is not the record of key `a`, and taken for it `idem-cli` showed
/// two records of one scope and refused `release` as ambiguous.
pub fn parse_record_key(prefix: &str, key: &[u8]) -> Option<Scope> {
    let rest = std::str::from_utf8(key).ok()?.strip_prefix(prefix)?;
    let mut parts = rest.split(':').map(|p| {
        if p.bytes().all(|b| b == b'%' || kept_in_key(b)) {
            let part = percent_decode_str(p).decode_utf8().ok()?;
            (encode_key_part(&part) == p).then(|| part.into_owned())
        } else {
            None
        }
    });
    let scope = Scope {
        tenant: parts.next()??,
        method: parts.next()??,
        path: parts.next()??,
        key: parts.next()??,
    };
    parts.next().is_none().then_some(scope)
}

/// Whether [`record_key`] keeps byte `b` as it is (see [`KEY_PART`]).
fn kept_in_key(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~/".contains(&b)
}

/// One key part percent-encoded as [`record_key`] does, e.g. for a `SCAN MATCH` pattern of one
/// tenant (`<prefix><encoded tenant>:*`). Never contains a glob character.
pub fn encode_key_part(part: &str) -> String {
    utf8_percent_encode(part, KEY_PART).to_string()
}

/// Why a `rediss://` URL with the redis crate's `#insecure` fragment (TLS that does not check
/// the server's certificate, so anyone on the path can read and answer for Redis) is refused,
/// by [`RedisStoreBuilder::connect`] and by `idem-cli`. This build lacks the crate's
/// `tls-rustls-insecure` feature, so such a URL never connected; but the crate said so only
/// when connecting, as an "unavailable" error, which reads like an outage.
pub const UNVERIFIED_TLS_REFUSED: &str = "a rediss:// URL with #insecure (TLS without checking \
     the server's certificate) is refused: trust the server's CA instead (SSL_CERT_FILE, or \
     redis::Client::build_with_tls and RedisStoreBuilder::with_connection)";

/// Whether `url` asks for TLS without checking the server's certificate (`#insecure`); `false`
/// for a URL that does not parse (its error is reported where it is opened).
pub fn skips_tls_verification(url: &str) -> bool {
    matches!(
        redis::IntoConnectionInfo::into_connection_info(url).map(|info| info.addr),
        Ok(redis::ConnectionAddr::TcpTls { insecure: true, .. })
    )
}

/// A URL the redis crate refused. The error never echoes the URL (it may hold a password).
fn invalid_url(e: RedisError) -> StoreError {
    StoreError::Backend(
        format!(
            "invalid Redis URL ({}): expected redis:// or rediss://host[:port][/db]",
            e.category()
        )
        .into(),
    )
}

/// One start-up check's command: its answer, or `None` when Redis refused the command (an ACL
/// user or a managed Redis may refuse `INFO` and `CONFIG`: not a reason to refuse to start, so
/// `refused` is logged as a warning). No answer within `timeout`, or a broken connection, is
/// an error.
async fn start_check<T>(
    timeout: Duration,
    command: &str,
    refused: &str,
    call: impl std::future::Future<Output = Result<T, RedisError>>,
) -> Result<Option<T>, StoreError> {
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(StoreError::unavailable(format!(
            "Redis did not answer {command} in time"
        ))),
        Ok(Ok(answer)) => Ok(Some(answer)),
        Ok(Err(e)) if e.is_io_error() || e.is_connection_dropped() => Err(classify(e)),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "{refused}");
            Ok(None)
        }
    }
}

/// [`RedisStoreBuilder::connect`] opens a connection to one server. A Redis Cluster node would
/// answer `MOVED` for every key another primary holds, i.e. 503 for most requests: refuse it
/// at start, pointing at `connect_cluster`.
async fn refuse_cluster_node(
    conn: &mut ConnectionManager,
    timeout: Duration,
) -> Result<(), StoreError> {
    let enabled = start_check(
        timeout,
        "INFO",
        "could not check whether Redis runs in cluster mode (INFO refused)",
        cluster_enabled(conn),
    )
    .await?;
    if enabled == Some(true) {
        return Err(StoreError::Backend(
            "this Redis runs in cluster mode: connect with RedisStoreBuilder::connect_cluster \
             (feature `redis-cluster`), or every key held by another node would fail"
                .into(),
        ));
    }
    Ok(())
}

/// Check a key prefix as [`RedisStoreBuilder`] does before it connects (idem-cli checks its
/// `--redis-prefix` with it too): printable ASCII without `{`, `}` (Cluster hash tags), `*`,
/// `?`, `[`, `]`, `\` (glob characters of `SCAN MATCH`), ending with `:`.
///
/// # Why the trailing `:`
/// It makes every key belong to one store. The encoded parts never hold a raw `:`
/// ([`record_key`] encodes it), so a record key is its prefix followed by exactly three `:`.
/// Take keys `P1 + E1` and `P2 + E2` of two different prefixes that both end with `:`, `P1`
/// the shorter (or as long):
/// - if `P1` is not a prefix of `P2`, the keys differ within `P1`;
/// - if it is, `P2 = P1 + X` with `X` non-empty and ending with `:`, so after `P1` the second
///   key holds `X`'s colons (at least one) and `E2`'s three: four or more, where the first
///   key holds three. They differ, and the second is not a record key under `P1`
///   ([`parse_record_key`] refuses it), so a `SCAN` of `P1*` can tell it from its own.
///
/// Without the colon, `idem:a` + tenant `b` and `idem:` + tenant `ab` were one key, and a
/// purge by `idem:` took `idem:x:...` keys for its own.
///
/// # Errors
/// [`StoreError::Backend`] naming what is wrong.
pub fn validate_key_prefix(prefix: &str) -> Result<(), StoreError> {
    let unsafe_byte = prefix
        .bytes()
        .any(|b| !b.is_ascii_graphic() || b"{}*?[]\\".contains(&b));
    if prefix.is_empty() || unsafe_byte {
        return Err(StoreError::Backend(
            format!(
                "invalid Redis key prefix {prefix:?}: it must be non-empty printable ASCII \
                 without {{ }} * ? [ ] \\, ending with `:`"
            )
            .into(),
        ));
    }
    if !prefix.ends_with(':') {
        return Err(StoreError::Backend(
            format!(
                "invalid Redis key prefix {prefix:?}: it must end with `:` (e.g. \"{prefix}:\"), \
                 or its keys could be another prefix's"
            )
            .into(),
        ));
    }
    Ok(())
}

/// A duration in microseconds, capped so `now + d` stays exact in a Lua number.
fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(MAX_DURATION_US)
        .min(MAX_DURATION_US)
}

/// A connect-time probe's answer: whether `command` can run for this store. Redis checks the
/// ACL before the states that refuse a command for a while (`OOM`, `MISCONF`, `NOREPLICAS`,
/// `READONLY`, `LOADING`, ...), so one of those means the user may: a store connecting while
/// Redis refuses writes comes up, and serves replays and 409s meanwhile (the read-only
/// fallbacks), as it did before these probes. `NOPERM` refuses, as does anything Redis says
/// before the ACL check (`ERR unknown command`: a renamed command; `ERR syntax error`: a Redis
/// too old for `SET ... GET`), which the request path would meet too. No answer (a connection
/// error) is [`StoreError::Unavailable`].
fn permitted<T>(command: &str, answer: Result<T, RedisError>) -> Result<(), StoreError> {
    match answer {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some("NOPERM") => Err(not_permitted(command, &e)),
        Err(e) if e.code().is_some_and(|code| TRANSIENT.contains(&code)) => Ok(()),
        // No answer from Redis (a connection error, a cluster node not reachable): not now.
        Err(e) if e.code().is_none() => Err(StoreError::Unavailable(Box::new(e))),
        Err(e) => Err(StoreError::Backend(
            format!(
                "Redis refused {command}, which RedisStore needs on the request path \
                 (docs/redis.md, \"Permissions\"): {e}"
            )
            .into(),
        )),
    }
}

/// The connect-time refusal of a user that may not run `command`.
fn not_permitted(command: &str, error: &RedisError) -> StoreError {
    StoreError::Backend(
        format!(
            "the Redis user may not run {command}, which RedisStore needs on the request path \
             (docs/redis.md, \"Permissions\"): {error}"
        )
        .into(),
    )
}

/// The error codes that mean "not now": Redis refuses for a while (and, for the connect-time
/// probes, after its ACL check) or a cluster moves.
const TRANSIENT: &[&str] = &[
    "LOADING",
    "BUSY",
    "READONLY",
    "OOM",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
    "MISCONF",
    "MOVED",
    "ASK",
    // A blocked `WAIT` whose primary was demoted meanwhile: a failover under way.
    "UNBLOCKED",
    // The script cache emptied again between the client's reload and its retry (a
    // `SCRIPT FLUSH`, a restart, a failover to a replica that never loaded it): nothing
    // ran, and the next call loads it again.
    "NOSCRIPT",
];

/// Map a Redis error: everything that means "not now" is [`StoreError::Unavailable`].
fn classify(err: RedisError) -> StoreError {
    // `WAIT` sent to a node demoted since the write ("ERR WAIT cannot be used with replica
    // instances"): a failover under way, as `UNBLOCKED` is.
    let wait_on_a_replica = err.code() == Some("ERR")
        && err
            .detail()
            .is_some_and(|d| d.contains("WAIT cannot be used with replica"));
    if err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.code().is_some_and(|code| TRANSIENT.contains(&code))
        || wait_on_a_replica
    {
        StoreError::Unavailable(Box::new(err))
    } else {
        StoreError::Backend(Box::new(err))
    }
}

/// Whether a call that failed with `error` may still have been applied: no answer in time (the
/// store's own timeout), or the connection failed; not when Redis answered with an error, but
/// for `NOPERM`: the reserve's `SET` and `TIME` travel together, and a user allowed the first
/// and refused the second got an error for a `SET` that had reserved the key.
fn outcome_unknown(error: &StoreError) -> bool {
    if let StoreError::Backend(source) = error {
        return source
            .downcast_ref::<RedisError>()
            .is_some_and(|e| e.code() == Some("NOPERM"));
    }
    let StoreError::Unavailable(source) = error else {
        return false;
    };
    // The store's own timeout is a plain message, not a `RedisError`.
    source.downcast_ref::<RedisError>().is_none_or(|e| {
        e.is_timeout() || e.is_io_error() || e.is_connection_dropped() || e.is_unrecoverable_error()
    })
}

/// A fenced script's answer (`release.lua`, `renew.lua`): 1 applied, anything else stale.
fn fenced(applied: i64) -> WriteOutcome {
    if applied == 1 {
        WriteOutcome::Applied
    } else {
        WriteOutcome::Stale
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Backend(format!("corrupt Redis idempotency record: {what}").into())
}

/// The oldest Redis whose `SET` takes `NX` with `GET` (the reserve's one native command).
const MIN_VERSION: (u32, u32) = (7, 0);

/// Refuse a server older than [`MIN_VERSION`] (on a cluster, any primary that is): it would
/// answer every reserve with a syntax error. Where `INFO` is refused, warn and go on.
async fn check_version<C: ConnectionLike + Send + 'static>(
    conn: &mut C,
    timeout: Duration,
) -> Result<(), StoreError> {
    let replies = start_check(
        timeout,
        "INFO",
        "could not read the Redis version (INFO refused); RedisStore needs Redis 7.0 or newer",
        nodes::on_every_primary(conn, redis::cmd("INFO").arg("server")),
    )
    .await?;
    for (_, reply) in replies.into_iter().flatten() {
        let info: String = redis::from_owned_redis_value(reply).unwrap_or_default();
        if let Some(version) = too_old(&info) {
            return Err(StoreError::Backend(
                format!(
                    "Redis {version} is too old: RedisStore needs 7.0 or newer (SET with NX \
                     and GET)"
                )
                .into(),
            ));
        }
    }
    Ok(())
}

/// The `redis_version` of an `INFO server` reply when it is older than [`MIN_VERSION`].
fn too_old(info: &str) -> Option<&str> {
    let version = info
        .lines()
        .find_map(|line| line.trim().strip_prefix("redis_version:"))?;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let found = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (found < MIN_VERSION).then_some(version)
}

/// Policies that may evict a key with a TTL (all our records have one).
fn policy_evicts(policy: &str) -> bool {
    policy.starts_with("volatile-") || policy.starts_with("allkeys-")
}

/// Ask for the eviction policy and act on it as `check` says. `Ok(false)` when it was not
/// read (`Skip`, or `CONFIG GET` refused: warned about).
async fn check_eviction<C: ConnectionLike + Send + 'static>(
    conn: &mut C,
    check: EvictionCheck,
    timeout: Duration,
) -> Result<bool, StoreError> {
    if check == EvictionCheck::Skip {
        return Ok(false);
    }
    let Some(replies) = start_check(
        timeout,
        "CONFIG GET",
        "could not read Redis maxmemory-policy (CONFIG GET refused?); make sure it is \
         `noeviction`, or Redis may drop live idempotency records",
        nodes::on_every_primary(
            conn,
            redis::cmd("CONFIG").arg("GET").arg("maxmemory-policy"),
        ),
    )
    .await?
    else {
        return Ok(false);
    };
    // One reply per primary (one on a single server): the first policy that may evict decides.
    let policies = replies.into_iter().map(|(_, reply)| {
        redis::from_owned_redis_value::<HashMap<String, String>>(reply)
            .ok()
            .and_then(|mut map| map.remove("maxmemory-policy"))
    });
    let mut policy = None;
    for answer in policies {
        match answer {
            Some(p) if policy_evicts(&p) => {
                policy = Some(p);
                break;
            }
            Some(_) => {}
            None => {
                tracing::warn!(
                    "Redis did not report maxmemory-policy; make sure it is `noeviction`"
                );
            }
        }
    }
    let Some(policy) = policy else {
        return Ok(true);
    };
    let message = format!(
        "Redis maxmemory-policy is {policy:?}: when memory is full Redis may evict live \
         idempotency records and a retry would run its handler again; set it to `noeviction`"
    );
    match check {
        EvictionCheck::Refuse => Err(StoreError::Backend(message.into())),
        _ => {
            tracing::warn!("{message}");
            Ok(true)
        }
    }
}

/// A script reply as bytes.
fn bytes_of(value: Option<&Value>) -> Option<&[u8]> {
    match value? {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

fn int_of(value: Option<&Value>) -> Option<i64> {
    match value? {
        Value::Int(i) => Some(*i),
        other => std::str::from_utf8(bytes_of(Some(other))?)
            .ok()?
            .parse()
            .ok(),
    }
}

/// The reserve script's reply (see `redis/reserve.lua`).
fn decode_reserve(reply: Value, token: ReservationToken) -> Result<ReserveOutcome, StoreError> {
    let Value::Array(mut items) = reply else {
        return Err(corrupt("reserve did not return an array"));
    };
    match bytes_of(items.first()) {
        Some(b"r") => Ok(ReserveOutcome::Reserved { token }),
        Some(b"f") => {
            let fingerprint = bytes_of(items.get(1))
                .and_then(Fingerprint::from_slice)
                .ok_or_else(|| corrupt("fingerprint is not 32 bytes"))?;
            Ok(ReserveOutcome::InFlight {
                fingerprint,
                lease_remaining: remaining(items.get(2))?,
            })
        }
        Some(b"c") => {
            let left = remaining(items.get(2))?;
            let bytes = match items.get_mut(1).map(|v| std::mem::replace(v, Value::Nil)) {
                Some(Value::BulkString(bytes)) => Bytes::from(bytes),
                _ => return Err(corrupt("record missing")),
            };
            completed(record::decode(bytes).map_err(corrupt)?, |_| left)
        }
        _ => Err(corrupt("unknown reserve outcome")),
    }
}

/// A non-negative number of microseconds in a script reply.
fn remaining(value: Option<&Value>) -> Result<Duration, StoreError> {
    int_of(value)
        .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
        .ok_or_else(|| corrupt("remaining time missing"))
}

/// A record that must be a completed one, live for `expires_in(its expiry)` more.
fn completed(
    found: record::Record,
    expires_in: impl FnOnce(u64) -> Duration,
) -> Result<ReserveOutcome, StoreError> {
    match found.state {
        record::State::Completed {
            response,
            expires_us,
            ..
        } => Ok(ReserveOutcome::Completed {
            fingerprint: found.fingerprint,
            response,
            expires_in: Some(expires_in(expires_us)),
        }),
        record::State::InFlight { .. } => Err(corrupt("expected a completed record")),
    }
}

/// Microseconds since the Unix epoch by this instance's clock (a record's "reserved at", shown
/// by idem-cli and never decided on); 0 for a clock before 1970.
fn unix_micros_here() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, micros)
}

/// A lease in microseconds as `reserve` and `renew_lease` write it: bounded like every
/// duration sent to Redis ([`micros`]: a `Duration::MAX` lease is about 100 years, exact in a
/// Lua number and far from overflowing `PX`), and never zero (a reservation whose lease ended
/// the moment it was made would be taken over at once).
fn lease_micros(lease: Duration) -> u64 {
    micros(lease).max(1)
}

/// How long Redis keeps a reservation's key: its lease plus the grace, in whole milliseconds
/// rounded up (so the lease, which ends `grace` before the key does, is never cut short).
fn key_life_ms(lease_us: u64, grace_us: u64) -> u64 {
    lease_us.saturating_add(grace_us).div_ceil(1000).max(1)
}

impl<C> IdempotencyStore for RedisStore<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// `redis` (the metrics' `store` label; it was the trait's `custom` until a review's test
    /// found it, 2026-12-05, so dashboards filtered on `store="redis"` saw nothing).
    fn name(&self) -> &'static str {
        "redis"
    }

    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        let key = self.key_of(scope);
        let token = ReservationToken::random();
        let lease_us = lease_micros(lease);
        let grace_us = self.inner.grace_us;
        let reservation =
            record::in_flight(fingerprint, &token, unix_micros_here(), lease_us, grace_us);
        let life_ms = key_life_ms(lease_us, grace_us);
        let mut picked = self.pick();
        let decided = self
            .decide(&mut picked, &key, fingerprint, &reservation, life_ms, token)
            .await;
        let outcome = match decided {
            Ok(outcome) => outcome,
            Err(Undecided {
                error,
                seen_in_flight,
            }) => {
                if outcome_unknown(&error) {
                    self.give_back_later(picked, scope, token, lease);
                }
                // Its `SET` found another request's reservation before the script failed: that
                // request may be running, so answer as for a reservation in flight (409, or
                // 422 for another body; C15: `fail_open` never runs a request the store saw in
                // flight). A takeover the script may have made is given back above.
                // Only for a reply that never came: an error Redis answered (`NOPERM`, a
                // script error) is fail-closed already, and a permanent one must show as such.
                if let (Some(fingerprint), StoreError::Unavailable(_)) = (seen_in_flight, &error) {
                    tracing::warn!(target: "idempotency_actix", %error, "the reserve script failed after finding a reservation in flight; answered as in flight");
                    return Ok(ReserveOutcome::InFlight {
                        fingerprint,
                        lease_remaining: Duration::ZERO,
                    });
                }
                return Err(error);
            }
        };
        if let (ReserveOutcome::Reserved { .. }, Some((replicas, timeout))) =
            (&outcome, self.inner.wait)
        {
            let acknowledged = self
                .wait_replicas(
                    &mut picked,
                    &key,
                    (record::IN_FLIGHT, &token),
                    replicas,
                    timeout,
                )
                .await;
            if !matches!(acknowledged, Ok(Replicated::Enough)) {
                // Not known to be durable enough to run the handler on: give the key back, at
                // once, or in the background if Redis does not answer now.
                if self.release_on(&mut picked, scope, &token).await.is_err() {
                    self.give_back_later(picked, scope, token, lease);
                }
                // Another request's record where ours should be: that request may be running,
                // so answer as in flight (C15: `fail_open` never runs past a request the
                // store saw), as `decide` does.
                if let Replicated::HeldByAnother(fingerprint) = acknowledged? {
                    tracing::warn!(target: "idempotency_actix", "the reservation's WAIT found another request's record (a failover lost the reservation); answered as in flight");
                    return Ok(ReserveOutcome::InFlight {
                        fingerprint,
                        lease_remaining: Duration::ZERO,
                    });
                }
                return Err(StoreError::unavailable(format!(
                    "the reservation did not reach {replicas} Redis replica(s) in time"
                )));
            }
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
        let key = self.key_of(scope);
        let mut picked = self.pick();
        let answer = self
            .answer(
                &picked.origin,
                self.inner
                    .complete
                    .key(&key)
                    .arg(record::token_text(token))
                    .arg(micros(ttl))
                    .arg(record::response_tail(response))
                    .invoke_async(&mut picked.conn),
            )
            .await?;
        let applied: i64 = match answer {
            Ok(applied) => applied,
            // While Redis refuses writes it refuses the script before running it (a script
            // with flags is a write), even when it would only find the record completed by
            // this token: a retry after a lost reply. That one is answered by reading it, on
            // a primary only: a replica's `READONLY` comes with data that may be stale or
            // diverged (a demoted primary serving its old dataset until it resyncs holds a
            // completion the new primary never got), so it proves nothing; `Unavailable`, and
            // the middleware's retry reaches the primary once the connection is replaced.
            Err(e) if matches!(e.code(), Some("MISCONF" | "NOREPLICAS")) => {
                if self.completed_by(&mut picked, &key, token).await? {
                    1
                } else {
                    return Err(classify(e));
                }
            }
            Err(e) => return Err(classify(e)),
        };
        if applied != 1 {
            return Ok(WriteOutcome::Stale);
        }
        if let Some((replicas, timeout)) = self.inner.wait {
            // `Unavailable` if the node that answered `WAIT` lacks the completion (a failover
            // between the script and `WAIT`): the middleware retries, as below.
            let replicated = self
                .wait_replicas(
                    &mut picked,
                    &key,
                    (record::COMPLETED, token),
                    replicas,
                    timeout,
                )
                .await?;
            if let Replicated::HeldByAnother(_) = replicated {
                // Retried by the middleware (C16), as when the node lacks the write: the
                // retry's script answers `Stale` if the key really was taken over.
                return Err(StoreError::unavailable(
                    "the Redis node that answered WAIT holds another request's record (a \
                     failover lost the completion)",
                ));
            }
            if let Replicated::TooFew = replicated {
                // Stored on the primary only: a failover now would bring back the reservation
                // and, after its lease, a second run. Failing the call makes the middleware
                // retry it until the lease ends (C16); the script answers a retry by the same
                // token as applied, and its `WAIT` then covers the record, on this primary or
                // on the replica that took over (which has the reservation: its own `WAIT`
                // held before the handler ran).
                return Err(StoreError::unavailable(format!(
                    "the response was stored, but did not reach {replicas} Redis replica(s) \
                     in time"
                )));
            }
        }
        Ok(WriteOutcome::Applied)
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.release_on(&mut self.pick(), scope, token).await
    }

    /// One `EVALSHA` (`renew.lua`): if `token` holds `scope`'s reservation (in flight with
    /// this token, its lease ended or not, as long as nobody took the key over), its key now
    /// lives `lease` plus the store's [grace](RedisStoreBuilder::in_flight_grace) from Redis's
    /// now, so the lease ends `lease` from now by Redis's clock; the record's bytes are left as
    /// they are. Otherwise nothing changes and the answer is `Stale`. A lease beyond about
    /// 100 years (`Duration::MAX`) is taken as 100 years, as by `reserve`.
    ///
    /// Never followed by `WAIT`, even with [`RedisStoreBuilder::wait_for_replicas`]: a renewal
    /// lost in a failover leaves the promoted replica with the lease as it was before it (the
    /// reservation itself was acknowledged before the handler ran), so at worst a retry takes
    /// the key over after that earlier lease, as it could without renewals.
    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let key = self.key_of(scope);
        // Bounded and rounded as `reserve` does. The grace is this store's, which is also the
        // record's grace field (the token is one this store's reserve wrote, with its grace),
        // so the lease end read back (`PTTL` less that field) is exactly the renewed one.
        // No `WAIT` (see above): it would hold a connection on every renewal to guard only
        // against a lease falling back to what it was.
        let life_ms = key_life_ms(lease_micros(lease), self.inner.grace_us);
        let mut picked = self.pick();
        let renewed: i64 = self
            .timed(
                &picked.origin,
                self.inner
                    .renew
                    .key(&key)
                    .arg(record::token_text(token))
                    .arg(life_ms)
                    .invoke_async(&mut picked.conn),
            )
            .await?;
        Ok(fenced(renewed))
    }

    fn renews_leases(&self) -> bool {
        true
    }

    /// Redis expires records itself (`PEXPIRE`): completed records at the end of their TTL,
    /// reservations at lease end plus the store's [grace](RedisStoreBuilder::in_flight_grace).
    /// So with a `grace` at least as long as the store's this is `Ok(0)` without a command.
    /// A shorter `grace` (an operator clearing dead reservations sooner) is honoured with a
    /// `SCAN` of the prefix and a fenced delete per ended reservation of this store (a key that
    /// is not one of its record keys, e.g. another store's under a longer prefix, is left
    /// alone); this is never on the request path. On Redis Cluster (a cluster connection,
    /// feature `redis-cluster`) it scans every primary ([`KeyScan`]).
    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        let grace_us = micros(grace);
        if grace_us >= self.inner.grace_us {
            return Ok(0);
        }
        let Picked { mut conn, origin } = self.pick();
        let mut scan = KeyScan::new(format!("{}*", self.inner.prefix));
        let mut deleted = 0u64;
        while let Some(keys) = self.timed(&origin, scan.next_batch(&mut conn)).await? {
            // `<prefix>*` also matches the keys of a store whose prefix starts with ours
            // (`idem:x:` under `idem:`): not ours to purge with our grace. Such a key has more
            // parts after our prefix than a record key, so it does not parse.
            let ours = keys
                .iter()
                .filter(|key| parse_record_key(&self.inner.prefix, key).is_some());
            // One call per key, all in flight at once: on one server they share the
            // multiplexed connection's pipeline; on a cluster each goes to its key's node (a
            // pipeline spanning slots would be refused there).
            let calls = ours.map(|key| {
                let mut conn = conn.clone();
                async move {
                    let mut call = self.inner.purge.key(key.as_slice());
                    call.arg(grace_us).invoke_async::<i64>(&mut conn).await
                }
            });
            let results = self
                .timed(&origin, futures_util::future::try_join_all(calls))
                .await?;
            deleted += results.iter().filter(|n| **n == 1).count() as u64;
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::{
        classify, outcome_unknown, parse_record_key, record_key, skips_tls_verification, too_old,
        validate_key_prefix, Scope,
    };
    use crate::store::StoreError;
    use proptest::prelude::*;
    use redis::{ErrorKind, RedisError};

    /// `#insecure` is recognised however the redis crate would read it, and nothing else is.
    #[test]
    fn only_a_tls_url_with_insecure_skips_verification() {
        for url in [
            "rediss://h/#insecure",
            "rediss://:pw@h:6380/2#insecure",
            "valkeys://h#insecure",
            "REDISS://h/#insecure",
        ] {
            assert!(skips_tls_verification(url), "{url}");
        }
        for url in [
            "rediss://h/",
            "redis://h/#insecure",
            "rediss://h/#secure",
            "redis+unix:///tmp/r.sock",
            "not a url",
            "",
        ] {
            assert!(!skips_tls_verification(url), "{url}");
        }
    }

    /// A reserve that got no answer may have been applied (its release is retried for two
    /// leases); one refused by Redis's own error reply wrote nothing (released once).
    #[test]
    fn only_a_reserve_without_an_answer_has_an_unknown_outcome() {
        let io = |kind| classify(RedisError::from(std::io::Error::new(kind, "x")));
        assert!(outcome_unknown(&StoreError::unavailable(
            "Redis did not answer within 2000 ms"
        )));
        assert!(outcome_unknown(&io(std::io::ErrorKind::TimedOut)));
        assert!(outcome_unknown(&io(std::io::ErrorKind::BrokenPipe)));
        assert!(outcome_unknown(&io(std::io::ErrorKind::ConnectionReset)));
        for refused in [ErrorKind::ReadOnly, ErrorKind::BusyLoadingError] {
            let error = classify(RedisError::from((refused, "refused")));
            assert!(matches!(error, StoreError::Unavailable(_)), "{error:?}");
            assert!(!outcome_unknown(&error), "{error:?}");
        }
        let oom = classify(RedisError::from((
            ErrorKind::ExtensionError,
            "OOM",
            "command not allowed when used memory > 'maxmemory'".to_string(),
        )));
        assert!(!outcome_unknown(&oom), "{oom:?}");
        assert!(!outcome_unknown(&StoreError::Backend("corrupt".into())));
        // The script cache emptied again after the client reloaded it: not now, nothing ran.
        let noscript = classify(RedisError::from((ErrorKind::NoScriptError, "NOSCRIPT")));
        assert!(
            matches!(noscript, StoreError::Unavailable(_)),
            "{noscript:?}"
        );
        assert!(!outcome_unknown(&noscript), "{noscript:?}");
    }

    fn scope(tenant: &str, method: &str, path: &str, key: &str) -> Scope {
        Scope {
            tenant: tenant.into(),
            method: method.into(),
            path: path.into(),
            key: key.into(),
        }
    }

    /// A prefix must end with `:`; one that does not could write another prefix's keys
    /// (`idem:a` + tenant `b` is `idem:` + tenant `ab`).
    #[test]
    fn a_prefix_without_a_trailing_colon_is_refused() {
        for bad in ["idem", "idem:a", "app-", "idem:x:y", "a"] {
            match validate_key_prefix(bad) {
                Err(StoreError::Backend(e)) => {
                    assert!(e.to_string().contains("end with `:`"), "{bad:?}: {e}")
                }
                other => panic!("prefix {bad:?} must be refused, got {other:?}"),
            }
        }
        for unsafe_ in ["", "{app}:", "app*:", "a b:", "é:"] {
            assert!(validate_key_prefix(unsafe_).is_err(), "{unsafe_:?}");
        }
        for good in ["idem:", "idem:a:", "payments:idem:", ":", "shop-a:"] {
            assert!(validate_key_prefix(good).is_ok(), "{good:?}");
        }
    }

    /// Crafted near-misses: scopes whose keys would touch under prefixes that nest or share a
    /// stem. Every valid (prefix, scope) pair has a key of its own, and only its own prefix
    /// parses it back.
    #[test]
    fn prefixes_ending_in_a_colon_never_share_a_key() {
        let pairs = [
            ("idem:", scope("ab", "POST", "/p", "k")),
            ("idem:a:", scope("b", "POST", "/p", "k")),
            ("idem:", scope("a:b", "POST", "/p", "k")),
            ("idem:", scope("a", "b:POST", "/p", "k")),
            ("idem:a:", scope("", "b", "POST", "/p:k")),
            ("idem:", scope("x", "POST", "/p", "k")),
            ("idem:x:", scope("POST", "/p", "k", "")),
            ("idem:x:", scope("x", "POST", "/p", "k")),
            ("idem:x:POST:", scope("/p", "k", "", "")),
            (":", scope("idem", "x", "POST", "/p:k")),
        ];
        let prefixes: Vec<&str> = pairs.iter().map(|(p, _)| *p).collect();
        let mut seen = std::collections::HashMap::new();
        for (prefix, s) in &pairs {
            assert!(validate_key_prefix(prefix).is_ok(), "{prefix:?}");
            let key = record_key(prefix, s);
            if let Some(earlier) = seen.insert(key.clone(), (prefix, s)) {
                panic!("{key:?} is both {earlier:?} and {:?}", (prefix, s));
            }
            for other in &prefixes {
                let parsed = parse_record_key(other, key.as_bytes());
                if other == prefix {
                    assert_eq!(parsed.as_ref(), Some(s), "{key:?}");
                } else {
                    assert_eq!(parsed, None, "{key:?} parsed under {other:?}");
                }
            }
        }
        // Only the spelling record_key writes is a record key.
        let canonical = record_key("idem:", &scope("t", "POST", "/p", "a b:c"));
        assert_eq!(canonical, "idem:t:POST:/p:a%20b%3Ac");
        assert!(parse_record_key("idem:", canonical.as_bytes()).is_some());
        for other in [
            "idem:t:POST:/p:a%20b%3ac",
            "idem:t:POST:%2Fp:a%20b%3Ac",
            "idem:t:POST:/p:%61%20b%3Ac",
            "idem:%74:POST:/p:a%20b%3Ac",
        ] {
            assert_eq!(parse_record_key("idem:", other.as_bytes()), None, "{other}");
        }
        // The collision a prefix without the colon allowed, for the record.
        assert_eq!(
            record_key("idem:", &scope("ab", "POST", "/p", "k")),
            record_key("idem:a", &scope("b", "POST", "/p", "k"))
        );
    }

    /// A valid prefix: printable segments without `:` or a glob or hash-tag character, each
    /// followed by `:`.
    fn prefix() -> impl Strategy<Value = String> {
        proptest::collection::vec("[a-z0-9%._-]{0,4}", 1..4)
            .prop_map(|segments| segments.iter().map(|s| format!("{s}:")).collect::<String>())
    }

    fn any_scope() -> impl Strategy<Value = Scope> {
        let part = || "[a:b%x/ ]{0,4}";
        (part(), part(), part(), part()).prop_map(|(t, m, p, k)| scope(&t, &m, &p, &k))
    }

    proptest! {
        /// Two different (prefix, scope) pairs never share a key, and a key parses only under
        /// its own prefix. Half the cases nest one prefix in the other (`p1` + more), the case
        /// a purge's `SCAN <p1>*` meets.
        #[test]
        fn no_two_prefixed_scopes_share_a_key(
            (p1, s1) in (prefix(), any_scope()),
            (p2, s2, nested) in (prefix(), any_scope(), any::<bool>()),
        ) {
            let p2 = if nested { format!("{p1}{p2}") } else { p2 };
            prop_assert!(validate_key_prefix(&p1).is_ok() && validate_key_prefix(&p2).is_ok());
            let (k1, k2) = (record_key(&p1, &s1), record_key(&p2, &s2));
            prop_assert_eq!(k1 == k2, (&p1, &s1) == (&p2, &s2));
            if p1 != p2 {
                prop_assert_eq!(parse_record_key(&p2, k1.as_bytes()), None);
                prop_assert_eq!(parse_record_key(&p1, k2.as_bytes()), None);
            }
        }
    }

    #[test]
    fn servers_older_than_7_0_are_named() {
        let info = |v: &str| format!("# Server\r\nredis_version:{v}\r\nredis_mode:standalone\r\n");
        assert_eq!(too_old(&info("6.2.14")), Some("6.2.14"));
        assert_eq!(too_old(&info("5.0.7")), Some("5.0.7"));
        assert_eq!(too_old(&info("7.0.15")), None);
        assert_eq!(too_old(&info("7.2.4")), None, "Valkey reports 7.2.4");
        assert_eq!(too_old(&info("8.4.0")), None);
        assert_eq!(
            too_old("# Server\r\n"),
            None,
            "no version: nothing to refuse"
        );
    }
}
