//! [`PostgresStoreBuilder`] and [`connection_manager`]: from a URL to a bb8 pool of
//! TLS-aware connections.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, PoolableConnection, RecyclingMethod,
};
use diesel_async::AsyncPgConnection;
use futures_util::FutureExt;

use super::lifetime::{self, Retired};
use super::per_thread::PoolPerThread;
use super::pool::LastErrorSink;
use super::store::BackgroundReleases;
use super::tls::ConnectTarget;
use super::{redact, PostgresStore, MAX_STATEMENT_TIMEOUT, MIN_QUERY_TIMEOUT};
use crate::store::StoreError;

/// Configures a [`PostgresStore`]: see [`PostgresStore::builder`]. Its `Debug` output shows
/// the URL through [`redact`].
#[derive(Clone)]
pub struct PostgresStoreBuilder {
    pub(super) url: String,
    pub(super) max_size: u32,
    pub(super) min_idle: Option<u32>,
    pub(super) connection_timeout: Duration,
    pub(super) query_timeout: Option<Duration>,
    pub(super) statement_timeout: Option<Duration>,
    pub(super) idle_timeout: Option<Duration>,
    pub(super) max_lifetime: Option<Duration>,
    pub(super) purge_batch: u32,
    pub(super) synchronous_commit: bool,
    pub(super) replay_fast_path: bool,
    pub(super) pool_per_thread: Option<u32>,
}

impl std::fmt::Debug for PostgresStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStoreBuilder")
            .field("url", &redact(&self.url))
            .field("max_size", &self.max_size)
            .field("min_idle", &self.min_idle)
            .field("connection_timeout", &self.connection_timeout)
            .field("query_timeout", &self.query_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_lifetime", &self.max_lifetime)
            .field("purge_batch", &self.purge_batch)
            .field("synchronous_commit", &self.synchronous_commit)
            .field("replay_fast_path", &self.replay_fast_path)
            .field("pool_per_thread", &self.pool_per_thread)
            .finish()
    }
}

impl PostgresStoreBuilder {
    /// Most connections the pool opens. Default 10. Each request holds one only for the
    /// duration of one statement (not while the handler runs), so this can be far below the
    /// number of concurrent requests.
    pub fn max_size(mut self, max_size: u32) -> Self {
        self.max_size = max_size.max(1);
        self
    }

    /// Connections kept open while idle. Default: none kept beyond `max_size` usage. More
    /// than `max_size` is clamped to `max_size` when the store is built (bb8 would panic).
    pub fn min_idle(mut self, min_idle: Option<u32>) -> Self {
        self.min_idle = min_idle;
        self
    }

    /// How long a request waits for a connection (a free one, or a new one being opened)
    /// before the store reports [`StoreError::Unavailable`] and the middleware answers 503.
    ///
    /// Default 2 s. bb8's own default is 30 s, during which a request to an app whose database
    /// is down just hangs; a payment client would time out and retry into the same hang.
    /// Failing within seconds gives it a 503 with `Retry-After` instead. Raise it only if
    /// opening a connection legitimately takes longer (a TLS handshake across regions, or a
    /// pool that is routinely exhausted).
    ///
    /// It also bounds each attempt to open a connection (never below 5 s, so a short timeout
    /// does not keep a slow link from ever connecting): bb8 waits for one without a deadline
    /// and keeps a pool slot for it meanwhile, so an attempt stalled by a silent server would
    /// keep the slot for minutes, past the database's return. With several hosts in the URL
    /// (a failover list) the bound is per host, tried in turn, so a frozen first host leaves
    /// the next one its turn (each new connection then waits out its bound first). A URL's
    /// `connect_timeout` bounds each TCP connect only (tokio-postgres's meaning).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long one statement may take, measured here, before the operation fails with
    /// [`StoreError::Unavailable`] (503). Default 5 s; `None` waits forever; at least
    /// [`MIN_QUERY_TIMEOUT`](super::MIN_QUERY_TIMEOUT).
    ///
    /// This bounds the case the connection timeout cannot see: a database that accepts
    /// connections but does not answer (overloaded, stuck on a lock, a half-dead network
    /// path). The connection it ran on is closed rather than lent to another request, which
    /// would otherwise wait behind it, and the server is sent a cancel request for the
    /// statement (over a new connection, TLS as configured). If the statement finishes before
    /// the cancel arrives (or the server cannot be reached), it takes effect after we gave up:
    /// for `reserve` that leaves a reservation whose lease has to run out before a retry can
    /// take it over (a retry meanwhile gets 409, never a second execution). Behind a
    /// transaction-pooling proxy that forwards a cancel to whatever server connection the
    /// session last used (PgBouncer before 1.18), a late cancel may instead end another
    /// client's statement: an error there, never a second run here.
    pub fn query_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.query_timeout = timeout;
        self
    }

    /// Server-side `statement_timeout` for the store's connections, sent as a startup
    /// `options` parameter (no extra round trip). Default `None` (the server's setting). At
    /// least [`MIN_QUERY_TIMEOUT`](super::MIN_QUERY_TIMEOUT), at most
    /// [`MAX_STATEMENT_TIMEOUT`](super::MAX_STATEMENT_TIMEOUT), PostgreSQL's own limit.
    ///
    /// Off by default because connection poolers such as PgBouncer reject unknown startup
    /// parameters unless configured to ignore them; [`query_timeout`](Self::query_timeout)
    /// already bounds the wait on our side. Set it when you connect directly and want the
    /// server to abandon the work too.
    pub fn statement_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Close connections idle this long. Default: bb8's (10 minutes). Zero is taken as 1 ms
    /// (close idle connections at the pool's next check; bb8 refuses zero with a panic).
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout.map(|t| t.max(Duration::from_millis(1)));
        self
    }

    /// Close connections after this age. Default: bb8's (30 minutes). Zero is taken as 1 ms
    /// (bb8 refuses zero with a panic).
    ///
    /// Each connection closes at its own age, drawn at random from the last tenth of this
    /// lifetime (27 to 30 minutes by default), when it is next checked out past it. bb8 (0.9)
    /// alone applies one age to all, so connections opened together (the pool's `min_idle` at
    /// start, or a burst) would close together, and requests would wait while the whole pool
    /// reconnects, once per lifetime, for as long as a connection takes to open (a TLS
    /// handshake to a remote database). Measured with a 1 s connection setup and a 60 s
    /// lifetime (`docs/benchmarks.md`, "Connections closed together"): p99.9 53 ms against
    /// 942-952 ms with bb8's lifetime alone. bb8's lifetime stays set to the full value, as a
    /// bound for connections not checked out in their last tenth. `None` is the default (30
    /// minutes), not "never". A pool built from [`connection_manager`] keeps bb8's behaviour,
    /// as does a connection whose diesel instrumentation the app replaces (the deadline rides on
    /// it; diesel's default instrumentation is kept and still sees every event).
    pub fn max_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.max_lifetime = lifetime.map(|t| t.max(Duration::from_millis(1)));
        self
    }

    /// Rows deleted per statement by [`IdempotencyStore::purge_expired`](crate::store::IdempotencyStore::purge_expired). Default 1000.
    pub fn purge_batch(mut self, rows: u32) -> Self {
        self.purge_batch = rows.max(1);
        self
    }

    /// Whether the store's writes wait for their commit record to be flushed to disk (the
    /// server's `synchronous_commit`). Default `true` (the server's own setting is kept).
    ///
    /// "Kept" means a server (or database, or role) configured with `synchronous_commit =
    /// off` gives the store the trade-off described below even with `true`: check
    /// `SHOW synchronous_commit` as the store's role. The store does not force it on (a
    /// startup option PgBouncer would refuse, or a `SET` that transaction pooling would not
    /// keep). The project's own crash tests lost a stored response this way (a review,
    /// 2026-12-04): a server killed right after a commit acknowledged asynchronously came back
    /// with the reservation but not the response, and the retry ran the handler again.
    ///
    /// `false` sets `synchronous_commit = off` for the store's connections, in the startup
    /// packet (no extra round trip). Every statement of the store then returns before its WAL
    /// is flushed, which takes the flush (a disk sync, often the largest part of a write's
    /// latency) off the request path, for the reservation and for the stored response alike:
    /// PostgreSQL has no per-statement form of this outside a transaction, and wrapping each
    /// statement in a transaction would cost round trips. The trade-off, for a crash of the
    /// *database server* (not of the app) within about `3 x wal_writer_delay` (600 ms by
    /// default) of a commit: the last commits are lost. A lost reservation lets a retry run the
    /// handler again while the first run may still be in progress or done; a lost stored
    /// response lets a retry run it again after the fact. Data is never corrupted, and other
    /// tables' transactions are unaffected (the setting is per connection). Use it when the
    /// handler's effects are themselves idempotent downstream, or when a database crash is
    /// rare enough that a possible second execution in that window is acceptable.
    pub fn synchronous_commit(mut self, synchronous_commit: bool) -> Self {
        self.synchronous_commit = synchronous_commit;
        self
    }

    /// Whether `reserve` first runs a plain prepared `SELECT` of a live completed record and
    /// calls the reserve function only when it finds none. Default `false`.
    ///
    /// `true` makes a replay cost what a primary-key `SELECT` costs (the function's PL/pgSQL
    /// call costs the database more, `docs/benchmarks.md`) and adds one round trip, on the same
    /// pooled connection, to every other `reserve` (misses, in-flight keys, mismatches read from
    /// an in-flight row). Turn it on for replay-heavy traffic (clients that retry a lot, or a
    /// gateway that replays on purpose); `docs/benchmarks.md` has both paths measured both
    /// ways. Either way the outcome of every `reserve` is the same: a completed record never
    /// changes until it expires, and everything else is still decided by the function.
    pub fn replay_fast_path(mut self, on: bool) -> Self {
        self.replay_fast_path = on;
        self
    }

    /// Give every thread that calls the store its own pool of up to `connections`
    /// connections, opened on that thread's runtime. Default `None`: one pool shared by all
    /// threads.
    ///
    /// A connection is driven by a task of the runtime it was opened on. An actix-web app
    /// builds its store in `main`, so the shared pool's connections are all driven on the main
    /// thread, and every statement of a worker crosses threads twice (two wake-ups, usually two
    /// context switches). With a pool per thread each worker's statements stay on its thread:
    /// `docs/benchmarks.md` ("Where the connections are driven") has it at 1.06x the misses,
    /// 1.25x the replays and 1.20x the transactional misses of the shared pool (paired rounds,
    /// the same number of connections in all).
    ///
    /// **Tail latency:** under saturating load on two cores, on one machine the slowest
    /// replays were slower with a pool per thread than with the shared pool (maximum 120 ms to
    /// 2 s against 54-170 ms, a few requests past 2 s in some 8-10 s runs; `docs/benchmarks.md`,
    /// "Current reference"), for a cause not yet found; on a second machine the same binary
    /// showed no such tail (maximum 31-163 ms against 78-106 ms; "A second machine"). A
    /// thread's requests are served in the order they ask for a connection, so none is passed
    /// over; measure your own p99 before choosing this.
    ///
    /// **Connections:** up to `connections` per thread that serves requests (actix-web
    /// starts one worker per CPU core by default), so split your budget:
    /// `max_size / workers`. The shared pool (`max_size`) stays for calls made off such a
    /// thread ([`PostgresStore::pool`], admin calls, a multi-threaded Tokio runtime, where a
    /// pool per thread would bring nothing) and keeps no idle connections open in this mode.
    /// [`min_idle`](Self::min_idle) applies to each thread's pool. A thread builds its pool on
    /// its first call; a thread that exits closes its pool. A thread's requests wait for its
    /// own pool only, not for another thread's idle connections: in transactional mode, where a
    /// request holds its connection while the handler runs, size `connections` for one
    /// worker's concurrent transactional requests. Not for calls from Tokio's blocking pool
    /// (`spawn_blocking` or actix-web's `web::block` running `Handle::block_on(store...)`):
    /// such a thread sees its worker's current-thread runtime and builds a pool of its own, so
    /// up to `connections` per blocking thread, beyond `max_size` (a known limit, found by a
    /// review; call the store from async code, as the middleware does).
    pub fn pool_per_thread(mut self, connections: Option<u32>) -> Self {
        self.pool_per_thread = connections.map(|n| n.max(1));
        self
    }

    /// Build the pool and the store. Connections are opened lazily (apart from `min_idle`), so
    /// this succeeds while the database is down; requests then get 503 until it is back.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the URL cannot be parsed or its TLS settings cannot be
    /// honoured (unreadable `sslrootcert`, unknown `sslmode`), or a timeout is out of range
    /// (`query_timeout` or `statement_timeout` under [`MIN_QUERY_TIMEOUT`], `statement_timeout`
    /// over [`MAX_STATEMENT_TIMEOUT`]).
    pub async fn build(self) -> Result<PostgresStore, StoreError> {
        self.validate_timeouts()?;
        let mut target = ConnectTarget::parse(&self.url, self.statement_timeout)
            .map_err(|e| StoreError::Backend(Box::new(e)))?;
        if !self.synchronous_commit {
            target.append_option("-c synchronous_commit=off");
        }
        let last_connect_error = Arc::new(Mutex::new(None));
        let pool_per_thread = self.pool_per_thread.map(|size| {
            let (settings, target, url) = (self.clone(), target.clone(), redact(&self.url));
            let sink = Arc::clone(&last_connect_error);
            let make = move || {
                settings
                    .pool_builder(size, settings.min_idle, &sink)
                    .build_unchecked(manager_for(
                        target.clone(),
                        &url,
                        settings.connect_attempt_limit(),
                        Some(settings.lifetime()),
                    ))
            };
            Arc::new(PoolPerThread::new(size, Box::new(make)))
        });
        // With a pool per thread the shared one serves only calls made off such a thread
        // (admin calls, a multi-threaded runtime): it keeps no idle connections open.
        let min_idle = self.min_idle.filter(|_| pool_per_thread.is_none());
        let cancel_with = Some(Arc::new(target.clone()));
        let pool = self
            .pool_builder(self.max_size, min_idle, &last_connect_error)
            .build_unchecked(manager_for(
                target,
                &self.url,
                self.connect_attempt_limit(),
                Some(self.lifetime()),
            ));
        Ok(PostgresStore {
            pool,
            pool_per_thread,
            connection_timeout: self.connection_timeout,
            query_timeout: self.query_timeout,
            last_connect_error,
            purge_batch: self.purge_batch,
            replay_fast_path: self.replay_fast_path,
            cancel_with,
            // A release runs on its caller's pool: with a pool per thread, a worker's own.
            background: BackgroundReleases::for_pool(self.pool_per_thread.unwrap_or(self.max_size)),
            provisioned: Default::default(),
        })
    }
}

impl PostgresStoreBuilder {
    /// Refuse timeouts that would fail every request rather than answer them with 503s.
    fn validate_timeouts(&self) -> Result<(), StoreError> {
        let refuse = |setting: &str, why: String| {
            Err(StoreError::Backend(
                format!("invalid PostgresStore setting `{setting}`: {why}").into(),
            ))
        };
        if let Some(timeout) = self.query_timeout.filter(|t| *t < MIN_QUERY_TIMEOUT) {
            return refuse(
                "query_timeout",
                format!(
                    "{timeout:?} is shorter than {MIN_QUERY_TIMEOUT:?}; every statement would \
                     time out (use `None` for no timeout)"
                ),
            );
        }
        if let Some(timeout) = self.statement_timeout.filter(|t| *t < MIN_QUERY_TIMEOUT) {
            return refuse(
                "statement_timeout",
                format!(
                    "{timeout:?} is shorter than {MIN_QUERY_TIMEOUT:?}; every statement would \
                     be cancelled (use `None` for the server's setting)"
                ),
            );
        }
        if let Some(timeout) = self
            .statement_timeout
            .filter(|t| *t > MAX_STATEMENT_TIMEOUT)
        {
            return refuse(
                "statement_timeout",
                format!(
                    "{timeout:?} is longer than PostgreSQL's limit of {} ms (about 24.8 days); \
                     the server would refuse every connection",
                    MAX_STATEMENT_TIMEOUT.as_millis()
                ),
            );
        }
        Ok(())
    }

    /// A bb8 pool builder with this builder's settings, `size` connections at most.
    fn pool_builder(
        &self,
        size: u32,
        min_idle: Option<u32>,
        last_connect_error: &Arc<Mutex<Option<String>>>,
    ) -> bb8::Builder<AsyncDieselConnectionManager<AsyncPgConnection>> {
        Pool::builder()
            .max_size(size)
            .min_idle(min_idle.map(|n| n.min(size)))
            .connection_timeout(self.connection_timeout)
            .error_sink(Box::new(LastErrorSink(Arc::clone(last_connect_error))))
            .connection_customizer(Box::new(LastErrorSink(Arc::clone(last_connect_error))))
            .idle_timeout(self.idle_timeout.or(Some(Duration::from_secs(600))))
            .max_lifetime(self.lifetime())
    }

    /// How long one attempt to open a connection may take: the connection timeout, but never
    /// less than [`MIN_CONNECT_ATTEMPT`], so that a short timeout (set for quick 503s while
    /// the pool is exhausted) does not keep a slow but healthy connection from ever opening
    /// (bb8 lets an attempt run on after the request that started it gave up).
    fn connect_attempt_limit(&self) -> Duration {
        self.connection_timeout.max(MIN_CONNECT_ATTEMPT)
    }

    /// The connections' lifetime: the one set, or bb8's default (30 minutes), which the
    /// jittered deadlines (`lifetime.rs`) are drawn from.
    fn lifetime(&self) -> Duration {
        self.max_lifetime.unwrap_or(Duration::from_secs(1800))
    }
}

/// A bb8 connection manager for `url` with the same TLS handling as [`PostgresStore::connect`]
/// (see [`PostgresStore::connect`] for `sslmode`) and a checkout check that costs no round trip
/// (without the builder's per-connection lifetimes: see [`PostgresStoreBuilder::max_lifetime`]).
/// Each connection attempt gives up after 30 s, bb8's default connection timeout (the
/// builder's pools use their [`connection_timeout`](PostgresStoreBuilder::connection_timeout),
/// at least 5 s): bb8 itself waits for an attempt without a deadline, keeping a pool slot for
/// it. For apps
/// that build their own pool (to share it, or to tune bb8 beyond the builder) and then call
/// [`PostgresStore::new`]:
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use idempotency_actix::store::postgres::{connection_manager, PgPool, PostgresStore};
/// let manager = connection_manager("postgres://app@db/app?sslmode=verify-full")?;
/// let pool: PgPool = PgPool::builder()
///     .max_size(20)
///     .connection_timeout(std::time::Duration::from_secs(2))
///     .build_unchecked(manager);
/// let store = PostgresStore::new(pool);
/// # let _ = store; Ok(()) }
/// ```
///
/// # Errors
/// [`StoreError::Backend`] for a bad URL or unusable TLS settings.
pub fn connection_manager(
    url: &str,
) -> Result<AsyncDieselConnectionManager<AsyncPgConnection>, StoreError> {
    let target = ConnectTarget::parse(url, None).map_err(|e| StoreError::Backend(Box::new(e)))?;
    Ok(manager_for(
        target,
        url,
        SHARED_MANAGER_CONNECT_TIMEOUT,
        None,
    ))
}

/// The least time a connection attempt of the builder's pools is given: enough for TCP, TLS,
/// authentication and session setup across a long link (about seven round trips).
const MIN_CONNECT_ATTEMPT: Duration = Duration::from_secs(5);

/// How long one connection attempt of a [`connection_manager`] may take: bb8's default
/// `connection_timeout`, since the pool it will serve (and its own timeout) is the app's.
const SHARED_MANAGER_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The manager of [`connection_manager`]; with `max_lifetime`, each connection also gets its
/// own deadline within it (`lifetime.rs`), for a pool whose bb8 `max_lifetime` is the same.
///
/// Each host of the URL gets `connect_within` to give a connection (TCP, TLS, startup,
/// diesel-async's session setup), and an attempt no more than that per host: bb8 awaits a new
/// connection without a deadline of its own and keeps a pool slot for it meanwhile, so an
/// attempt that stalls (a server that accepted TCP and went silent, packets dropped during a
/// failover) would keep its slot for as long as the kernel's TCP timeouts allow, many minutes,
/// and a small pool would answer 503 all along, even after the database is back. Bounded per
/// host, so that a frozen first host of a failover list leaves the next one its turn.
fn manager_for(
    target: ConnectTarget,
    url: &str,
    connect_within: Duration,
    max_lifetime: Option<Duration>,
) -> AsyncDieselConnectionManager<AsyncPgConnection> {
    let mut target = target;
    target.bound_each_host(connect_within);
    let connect_within = connect_within.saturating_mul(target.host_count());
    let target = Arc::new(target);
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    config.custom_setup = Box::new(move |_url| {
        let target = Arc::clone(&target);
        async move {
            let mut conn = tokio::time::timeout(connect_within, target.connect())
                .await
                .map_err(|_| {
                    diesel::ConnectionError::BadConnection(format!(
                        "connecting took longer than {} ms",
                        connect_within.as_millis()
                    ))
                })??;
            if let Some(max_lifetime) = max_lifetime {
                lifetime::give(&mut conn, max_lifetime);
            }
            Ok(conn)
        }
        .boxed()
    });
    // bb8 checks a connection on checkout. diesel-async's default check is `SELECT 1`: a
    // round trip on every request. This check is local: the connection task has not seen
    // the socket close, no transaction is left open, and the connection is not past its own
    // deadline. A connection that dies between the check and the statement fails that one
    // request with 503.
    config.recycling_method = RecyclingMethod::CustomFunction(Box::new(|conn| {
        let verdict = if PoolableConnection::is_broken(conn) {
            Err(diesel::result::Error::BrokenTransactionManager)
        } else if lifetime::is_over(conn, std::time::Instant::now()) {
            tracing::debug!(
                "idempotency store: a database connection reached its lifetime; closing it"
            );
            Err(diesel::result::Error::QueryBuilderError(Box::new(Retired)))
        } else {
            Ok(())
        };
        async move { verdict }.boxed()
    }));
    // The manager keeps this string only to hand it to `custom_setup`, which ignores it (the
    // parsed target holds what is needed): the redacted form, so no copy of the password lives
    // in the manager.
    AsyncDieselConnectionManager::new_with_config(redact(url), config)
}
