//! [`PostgresStore`]: idempotency records in PostgreSQL, shared by every app instance that
//! points at the same database. Feature `postgres` (on by default).
//!
//! Built on diesel-async over a bb8 pool. The schema lives in the workspace's `migrations/`
//! folder and is embedded here ([`MIGRATIONS`]); apply it with `idem-cli migrate` or
//! [`run_migrations`] before serving traffic. Until then every request gets 503 with a hint to
//! do exactly that ([`StoreError::NotProvisioned`]).
//!
//! # Round trips
//! Each store operation is one SQL statement and, once the connection has prepared it, one
//! round trip:
//! - `reserve`: reserve-or-fetch, a call of the PL/pgSQL function `idempotency_reserve` (second
//!   migration): it reads first, so the replay path is a plain index read returning the stored
//!   response with no write; only a miss inserts and an expired record is taken over, all in
//!   the same call.
//! - `complete`: one UPDATE fenced by the reservation token.
//! - `release`: one DELETE fenced by the token.
//!
//! The statements and why they are race-free are in `docs/sql.md` (and in the comments of the private `sql` module).
//!
//! # Connecting
//! ```no_run
//! # async fn demo() -> Result<(), idempotency_actix::store::StoreError> {
//! use idempotency_actix::store::postgres::{run_migrations, PostgresStore};
//! let url = "postgres://app@db.internal/app?sslmode=verify-full";
//! run_migrations(url).await?; // or `idem-cli migrate` in the deploy pipeline
//! let store = PostgresStore::connect(url).await?;
//! # let _ = store; Ok(()) }
//! ```
//! TLS follows libpq's `sslmode` (`require`, `verify-ca`, `verify-full`, with `sslrootcert`);
//! see [`establish`] for the table. The URL is read by the driver's (tokio-postgres's) rules:
//! the credentials end at the first `@`, so a password may hold raw `/`, `?`, `#` or `:`, but
//! an `@` in a password must be percent-encoded (`%40`). The SSL options are taken from the
//! query the driver reads, never from after the first `?` of the string; a URL where a
//! standard URL parser would find another SSL option is refused as ambiguous.
//!
//! # Passwords
//! No message, error or `Debug` output of this module contains the connection string; they
//! use [`redact`], which rebuilds it from the driver's parse with the password as `***` and
//! shows nothing of a string it cannot parse.
//!
//! # Faults
//! Every failure is a [`StoreError`], which the middleware answers with 503 (fail closed):
//! - table or reserve function missing: [`StoreError::NotProvisioned`] with [`MIGRATE_HINT`]
//!   ("run `idem-cli migrate`"), recognised with `to_regclass`/`to_regprocedure` rather than an
//!   error message (diesel-async does not expose SQLSTATE 42P01/42883); the store recovers once
//!   the schema exists;
//! - no connection within the pool's connection timeout (default 2 s, not bb8's 30 s):
//!   [`StoreError::Unavailable`], with the last connection error in the message;
//! - a statement not answered within the query timeout (default 5 s):
//!   [`StoreError::Unavailable`].
//!
//! [`PostgresStore::check`] is a readiness probe for the same conditions. The building blocks
//! the CLI shares ([`establish`], [`classify_query_error`], [`run_migrations`],
//! [`pending_migrations`]) are public.

mod error;
mod migrate;
pub(crate) mod sql;
mod tls;
// Transactional mode's statements (C25), all in one module.
pub(crate) mod transactional;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{
    AsyncDieselConnectionManager, ManagerConfig, PoolError, PoolableConnection, RecyclingMethod,
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::FutureExt;

pub use error::{
    classify_connection_error, classify_error, classify_query_error, not_provisioned, table_exists,
    MIGRATE_HINT,
};
pub use migrate::{pending_migrations, run_migrations, MIGRATIONS};
pub use transactional::{IsolationLevel, TX_MIGRATE_HINT};

use super::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};
use sql::{Complete, PurgeBatch, Release, ReplayRead, Reserve, ReserveRow, ScopeBinds};
use tls::ConnectTarget;

/// The pool type [`PostgresStore::new`] takes.
pub type PgPool = Pool<AsyncPgConnection>;

/// Default [`PostgresStoreBuilder::max_size`].
pub const DEFAULT_MAX_SIZE: u32 = 10;
/// Default [`PostgresStoreBuilder::connection_timeout`].
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);
/// Default [`PostgresStoreBuilder::query_timeout`].
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Rows deleted per statement by [`PostgresStore::purge_batch`] when called through
/// [`IdempotencyStore::purge_expired`].
pub const DEFAULT_PURGE_BATCH: u32 = 1000;

/// How often `reserve` calls `idempotency_reserve` again when it answers `raced`. The function
/// already resolves races itself (it re-reads after each lost write, in a bounded loop), so
/// `raced` only means the key changed under every one of its attempts; this outer bound is
/// against such pathological churn, never a correctness device.
const RESERVE_ATTEMPTS: usize = 5;

/// Longest duration sent to the database, so `now() + lease` can never overflow a timestamp
/// (about 100 years).
const MAX_DURATION_US: i64 = 100 * 365 * 24 * 3600 * 1_000_000;

/// Idempotency records in PostgreSQL (table `idempotency_keys`), for apps that run several
/// instances against one database.
///
/// Cloning is cheap; clones share the pool. All lease and TTL arithmetic uses the database's
/// clock, so instances with skewed clocks agree.
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    connection_timeout: Duration,
    query_timeout: Option<Duration>,
    last_connect_error: Arc<Mutex<Option<String>>>,
    purge_batch: u32,
    replay_fast_path: bool,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.pool.state();
        f.debug_struct("PostgresStore")
            .field("connections", &state.connections)
            .field("idle", &state.idle_connections)
            .field("connection_timeout", &self.connection_timeout)
            .finish()
    }
}

/// Configures a [`PostgresStore`]: see [`PostgresStore::builder`]. Its `Debug` output shows
/// the URL through [`redact`].
#[derive(Clone)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct PostgresStoreBuilder {
    url: String,
    max_size: u32,
    min_idle: Option<u32>,
    connection_timeout: Duration,
    query_timeout: Option<Duration>,
    statement_timeout: Option<Duration>,
    idle_timeout: Option<Duration>,
    max_lifetime: Option<Duration>,
    purge_batch: u32,
    synchronous_commit: bool,
    replay_fast_path: bool,
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

    /// Connections kept open while idle. Default: none kept beyond `max_size` usage.
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
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// How long one statement may take, measured here, before the operation fails with
    /// [`StoreError::Unavailable`] (503). Default 5 s; `None` waits forever.
    ///
    /// This bounds the case the connection timeout cannot see: a database that accepts
    /// connections but does not answer (overloaded, stuck on a lock, a half-dead network
    /// path). The statement may still finish on the server after we gave up; for `reserve`
    /// that leaves a reservation whose lease has to run out before a retry can take it over
    /// (a retry meanwhile gets 409, never a second execution).
    pub fn query_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.query_timeout = timeout;
        self
    }

    /// Server-side `statement_timeout` for the store's connections, sent as a startup
    /// `options` parameter (no extra round trip). Default `None` (the server's setting).
    ///
    /// Off by default because connection poolers such as PgBouncer reject unknown startup
    /// parameters unless configured to ignore them; [`query_timeout`](Self::query_timeout)
    /// already bounds the wait on our side. Set it when you connect directly and want the
    /// server to abandon the work too.
    pub fn statement_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// Close connections idle this long. Default: bb8's (10 minutes).
    pub fn idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Close connections after this age. Default: bb8's (30 minutes).
    pub fn max_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.max_lifetime = lifetime;
        self
    }

    /// Rows deleted per statement by [`IdempotencyStore::purge_expired`]. Default 1000.
    pub fn purge_batch(mut self, rows: u32) -> Self {
        self.purge_batch = rows.max(1);
        self
    }

    /// Whether the store's writes wait for their commit record to be flushed to disk (the
    /// server's `synchronous_commit`). Default `true` (the server's own setting is kept).
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

    /// Build the pool and the store. Connections are opened lazily (apart from `min_idle`), so
    /// this succeeds while the database is down; requests then get 503 until it is back.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the URL cannot be parsed or its TLS settings cannot be
    /// honoured (unreadable `sslrootcert`, unknown `sslmode`).
    pub async fn build(self) -> Result<PostgresStore, StoreError> {
        let mut target = ConnectTarget::parse(&self.url, self.statement_timeout)
            .map_err(|e| StoreError::Backend(Box::new(e)))?;
        if !self.synchronous_commit {
            target.append_option("-c synchronous_commit=off");
        }
        let manager = manager_for(target, &self.url);
        let last_connect_error = Arc::new(Mutex::new(None));
        let mut builder = Pool::builder()
            .max_size(self.max_size)
            .min_idle(self.min_idle)
            .connection_timeout(self.connection_timeout)
            .error_sink(Box::new(LastErrorSink(Arc::clone(&last_connect_error))))
            .connection_customizer(Box::new(LastErrorSink(Arc::clone(&last_connect_error))));
        builder = builder
            .idle_timeout(self.idle_timeout.or(Some(Duration::from_secs(600))))
            .max_lifetime(self.max_lifetime.or(Some(Duration::from_secs(1800))));
        let pool = builder.build_unchecked(manager);
        Ok(PostgresStore {
            pool,
            connection_timeout: self.connection_timeout,
            query_timeout: self.query_timeout,
            last_connect_error,
            purge_batch: self.purge_batch,
            replay_fast_path: self.replay_fast_path,
        })
    }
}

/// A bb8 connection manager for `url` with the same TLS handling as [`PostgresStore::connect`]
/// (see [`establish`] for `sslmode`) and a checkout check that costs no round trip. For apps
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
    Ok(manager_for(target, url))
}

fn manager_for(
    target: ConnectTarget,
    url: &str,
) -> AsyncDieselConnectionManager<AsyncPgConnection> {
    let target = Arc::new(target);
    let mut config = ManagerConfig::<AsyncPgConnection>::default();
    config.custom_setup = Box::new(move |_url| {
        let target = Arc::clone(&target);
        async move { target.connect().await }.boxed()
    });
    // bb8 checks a connection on checkout. diesel-async's default check is `SELECT 1`: a
    // round trip on every request. This check is local: the connection task has not seen
    // the socket close and no transaction is left open. A connection that dies between
    // the check and the statement fails that one request with 503.
    config.recycling_method = RecyclingMethod::CustomFunction(Box::new(|conn| {
        let broken = PoolableConnection::is_broken(conn);
        async move {
            if broken {
                Err(diesel::result::Error::BrokenTransactionManager)
            } else {
                Ok(())
            }
        }
        .boxed()
    }));
    // The manager keeps this string only to hand it to `custom_setup`, which ignores it (the
    // parsed target holds what is needed): the redacted form, so no copy of the password lives
    // in the manager.
    AsyncDieselConnectionManager::new_with_config(redact(url), config)
}

/// Remembers the last connection error, because bb8 only reports "timed out" to the waiter.
#[derive(Debug, Clone)]
struct LastErrorSink(Arc<Mutex<Option<String>>>);

impl bb8::ErrorSink<PoolError> for LastErrorSink {
    fn sink(&self, error: PoolError) {
        tracing::debug!(%error, "idempotency store: database connection failed");
        if let Ok(mut last) = self.0.lock() {
            *last = Some(error.to_string());
        }
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<PoolError>> {
        Box::new(self.clone())
    }
}

/// A new connection succeeded: the last error no longer explains anything, so a later timeout
/// (say, pool exhaustion) is not blamed on an outage that is over.
impl bb8::CustomizeConnection<AsyncPgConnection, PoolError> for LastErrorSink {
    fn on_acquire<'a>(
        &'a self,
        _connection: &'a mut AsyncPgConnection,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), PoolError>> + Send + 'a>>
    {
        if let Ok(mut last) = self.0.lock() {
            *last = None;
        }
        Box::pin(async { Ok(()) })
    }
}

impl PostgresStore {
    /// A store over an existing pool (its settings are used as they are; see
    /// [`PostgresStoreBuilder::connection_timeout`] for why a short connection timeout
    /// matters). Build the pool's manager with [`connection_manager`] to get TLS per the URL's
    /// `sslmode`; diesel-async's plain `AsyncDieselConnectionManager::new` never uses TLS.
    pub fn new(pool: PgPool) -> Self {
        Self {
            connection_timeout: pool.config().connection_timeout,
            query_timeout: Some(DEFAULT_QUERY_TIMEOUT),
            pool,
            last_connect_error: Arc::new(Mutex::new(None)),
            purge_batch: DEFAULT_PURGE_BATCH,
            replay_fast_path: false,
        }
    }

    /// A store for `url` with the default pool settings (10 connections, 2 s connection
    /// timeout, 5 s query timeout). TLS per the URL's `sslmode`.
    ///
    /// # Errors
    /// As [`PostgresStoreBuilder::build`]: only a bad URL fails here; a database that is down
    /// is reported by requests (503) until it is back.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::builder(url).build().await
    }

    /// Configure the pool before connecting.
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.into(),
            max_size: DEFAULT_MAX_SIZE,
            min_idle: None,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            query_timeout: Some(DEFAULT_QUERY_TIMEOUT),
            statement_timeout: None,
            idle_timeout: None,
            max_lifetime: None,
            purge_batch: DEFAULT_PURGE_BATCH,
            synchronous_commit: true,
            replay_fast_path: false,
        }
    }

    /// The pool, e.g. to share it with the rest of the app or to inspect its state.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Readiness check: a connection can be had within the connection timeout, and the table
    /// and the reserve function exist. One round trip (`to_regclass`, `to_regprocedure`). Use
    /// it in a health endpoint or before taking traffic; the store itself never needs it.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when no connection could be made,
    /// [`StoreError::NotProvisioned`] (with [`MIGRATE_HINT`]) when the table or function is
    /// missing.
    pub async fn check(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        match self.timed(table_exists(&mut conn)).await? {
            true => Ok(()),
            false => Err(not_provisioned()),
        }
    }

    /// Delete up to `limit` expired records (completed past their TTL, reservations whose
    /// lease ended more than `grace` ago) in one short statement; returns how many. Rows
    /// locked by a concurrent purge or request are skipped, not waited for, so overlapping
    /// runs never block each other. Call it until it returns less than `limit`.
    ///
    /// # Errors
    /// As `reserve`.
    pub async fn purge_batch(&self, grace: Duration, limit: u32) -> Result<u64, StoreError> {
        let query = PurgeBatch {
            grace_us: micros(grace),
            limit: i64::from(limit),
        };
        let mut conn = self.conn().await?;
        self.timed(async {
            match query.execute(&mut conn).await {
                Ok(n) => Ok(n as u64),
                Err(e) => Err(classify_query_error(&mut conn, e).await),
            }
        })
        .await
    }

    async fn conn(
        &self,
    ) -> Result<
        diesel_async::pooled_connection::bb8::PooledConnection<'_, AsyncPgConnection>,
        StoreError,
    > {
        self.pool.get().await.map_err(|e| {
            // Cloned, not taken: every request timing out during an outage gets the reason.
            let last = self.last_connect_error.lock().ok().and_then(|l| l.clone());
            error::classify_pool_error(e, self.connection_timeout, last)
        })
    }

    /// Run one statement under the query timeout.
    async fn timed<T>(
        &self,
        statement: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match self.query_timeout {
            None => statement.await,
            Some(limit) => tokio::time::timeout(limit, statement)
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::unavailable(format!(
                        "the database did not answer within {} ms",
                        limit.as_millis()
                    )))
                }),
        }
    }

    async fn reserve_once(
        &self,
        conn: &mut AsyncPgConnection,
        query: &Reserve<'_>,
    ) -> Result<Option<ReserveOutcome>, StoreError> {
        let rows: Vec<ReserveRow> = match query.load(conn).await {
            Ok(rows) => rows,
            Err(e) => return Err(classify_query_error(conn, e).await),
        };
        let Some(row) = rows.into_iter().next() else {
            return Err(corrupt("idempotency_reserve returned no row"));
        };
        decode_reserve_row(row, query.token)
    }

    /// The replay fast path: the live completed record, if there is one.
    async fn replay_read(
        &self,
        conn: &mut AsyncPgConnection,
        scope: &Scope,
    ) -> Result<Option<ReserveOutcome>, StoreError> {
        let query = ReplayRead {
            scope: scope_binds(scope),
        };
        let rows: Vec<ReserveRow> = match query.load(conn).await {
            Ok(rows) => rows,
            Err(e) => return Err(classify_query_error(conn, e).await),
        };
        match rows.into_iter().next() {
            // The token is never used: the row's outcome is `existing`.
            Some(row) => decode_reserve_row(row, uuid::Uuid::nil()),
            None => Ok(None),
        }
    }
}

/// One row of the reserve function (or of the replay fast path, which has its shape):
/// `None` when the function answered `raced`.
fn decode_reserve_row(
    row: ReserveRow,
    token: uuid::Uuid,
) -> Result<Option<ReserveOutcome>, StoreError> {
    match row.outcome.as_str() {
        "reserved" => {
            let token = ReservationToken::from_uuid(token);
            return Ok(Some(ReserveOutcome::Reserved { token }));
        }
        // The key changed under every one of the function's own attempts; nothing was
        // written. The caller calls again.
        "raced" => return Ok(None),
        "existing" => {}
        other => return Err(corrupt(&format!("unknown reserve outcome {other:?}"))),
    }
    let fingerprint = row
        .fingerprint
        .as_deref()
        .and_then(Fingerprint::from_slice)
        .ok_or_else(|| corrupt("fingerprint is not 32 bytes"))?;
    let live = row.live.unwrap_or(false);
    let eligible = row.eligible.unwrap_or(false);
    // Time left on the lease (in flight) or before expiry (completed), by the database's clock.
    let remaining =
        Duration::from_micros(u64::try_from(row.lease_remaining_us.unwrap_or(0)).unwrap_or(0));
    if !live && eligible {
        // The function takes such a row over (or re-reads it) instead of returning it.
        return Err(corrupt("ended, eligible row returned as existing"));
    }
    match row.state.as_deref() {
        Some("completed") => {
            let status = row
                .response_status
                .and_then(|s| u16::try_from(s).ok())
                .ok_or_else(|| corrupt("response_status missing or negative"))?;
            let headers =
                StoredResponse::decode_headers(row.response_headers.as_deref().unwrap_or_default())
                    .map_err(|e| StoreError::Backend(Box::new(e)))?;
            let completed = ReserveOutcome::Completed {
                fingerprint,
                response: StoredResponse {
                    status,
                    headers,
                    body: Bytes::from(row.response_body.unwrap_or_default()),
                },
                expires_in: Some(remaining),
            };
            Ok(Some(completed))
        }
        Some("in_flight") => Ok(Some(ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining: remaining,
        })),
        other => Err(corrupt(&format!("unknown state {other:?}"))),
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Backend(format!("corrupt idempotency_keys row: {what}").into())
}

/// A duration in microseconds (the database's interval precision, so even a sub-millisecond
/// lease is not rounded to zero), capped at ~100 years so `now() + d` cannot overflow.
fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros())
        .unwrap_or(MAX_DURATION_US)
        .clamp(0, MAX_DURATION_US)
}

fn scope_binds(scope: &Scope) -> ScopeBinds<'_> {
    ScopeBinds {
        tenant: &scope.tenant,
        method: &scope.method,
        path: &scope.path,
        key: &scope.key,
    }
}

impl IdempotencyStore for PostgresStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        let query = Reserve {
            scope: scope_binds(scope),
            fingerprint: fingerprint.as_bytes(),
            token: ReservationToken::random().as_uuid(),
            lease_us: micros(lease).max(1),
        };
        let mut conn = self.conn().await?;
        if self.replay_fast_path {
            if let Some(replay) = self.timed(self.replay_read(&mut conn, scope)).await? {
                return Ok(replay);
            }
        }
        for attempt in 1..=RESERVE_ATTEMPTS {
            if let Some(outcome) = self.timed(self.reserve_once(&mut conn, &query)).await? {
                return Ok(outcome);
            }
            tracing::debug!(attempt, key = %scope.key, "idempotency reserve raced; re-running");
        }
        Err(StoreError::Backend(
            format!("reserve lost {RESERVE_ATTEMPTS} races in a row for one key").into(),
        ))
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let headers = response.encode_headers();
        let status = i16::try_from(response.status)
            .map_err(|_| StoreError::Backend("HTTP status out of range".into()))?;
        let query = Complete {
            scope: scope_binds(scope),
            token: token.as_uuid(),
            status,
            headers: &headers,
            body: &response.body,
            ttl_us: micros(ttl),
        };
        let mut conn = self.conn().await?;
        self.timed(async {
            match query.execute(&mut conn).await {
                Ok(0) => Ok(WriteOutcome::Stale),
                Ok(_) => Ok(WriteOutcome::Applied),
                Err(e) => Err(classify_query_error(&mut conn, e).await),
            }
        })
        .await
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        let query = Release {
            scope: scope_binds(scope),
            token: token.as_uuid(),
        };
        let mut conn = self.conn().await?;
        self.timed(async {
            match query.execute(&mut conn).await {
                Ok(0) => Ok(WriteOutcome::Stale),
                Ok(_) => Ok(WriteOutcome::Applied),
                Err(e) => Err(classify_query_error(&mut conn, e).await),
            }
        })
        .await
    }

    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = self.purge_batch(grace, self.purge_batch).await?;
            total += deleted;
            if deleted < u64::from(self.purge_batch) {
                return Ok(total);
            }
        }
    }
}

/// Open one connection to `url`, with TLS per its `sslmode`, outside any pool. For tools
/// (`idem-cli`) that run a few statements and exit.
///
/// | `sslmode`                 | encrypted            | certificate checked                   |
/// |---------------------------|----------------------|---------------------------------------|
/// | absent, `disable`, `allow`| no                   | -                                     |
/// | `prefer`                  | if the server offers | no (as libpq)                         |
/// | `require`                 | yes                  | no; with `sslrootcert`: chain (libpq) |
/// | `verify-ca`               | yes                  | chain against the roots, not the name |
/// | `verify-full`             | yes                  | chain and host name                   |
///
/// Roots come from `sslrootcert=<PEM file>`, or the system trust store when it is absent or
/// `system`. Client certificates (`sslcert`/`sslkey`) are rejected as unsupported. No
/// statement timeout is set (a purge may legitimately run long).
///
/// # Errors
/// [`StoreError::Backend`] for a bad URL; [`StoreError::Unavailable`] when the server cannot
/// be reached, refuses the login or the TLS handshake fails.
pub async fn establish(url: &str) -> Result<AsyncPgConnection, StoreError> {
    let target = ConnectTarget::parse(url, None).map_err(|e| StoreError::Backend(Box::new(e)))?;
    target.connect().await.map_err(classify_connection_error)
}

/// `conninfo` (a `postgres://` URL or a libpq `key=value` string) for logs and messages: rebuilt
/// from the driver's own parse, hosts, ports, user, database and `sslmode`, with the password
/// shown as `***`, e.g. `postgres://app:***@db.internal:5432/payments?sslmode=verify-full`.
///
/// A string that cannot be parsed is not shown at all (a fixed placeholder), since any part of
/// it may be the password. Host and database names containing `@` (the rest of a password
/// whose `@` was not percent-encoded) are shown as `(hidden)`.
///
/// ```
/// use idempotency_actix::store::postgres::redact;
/// assert_eq!(
///     redact("postgres://app:se/c?ret@db.internal/payments?sslmode=require"),
///     "postgres://app:***@db.internal:5432/payments?sslmode=require"
/// );
/// ```
pub fn redact(conninfo: &str) -> String {
    tls::redact(conninfo)
}

/// `conninfo` with its database replaced by `dbname` (a `dbname` parameter appended where the
/// driver reads it). For test harnesses and tools that derive URLs; not part of the stable API.
#[doc(hidden)]
pub fn with_dbname(conninfo: &str, dbname: &str) -> String {
    tls::with_dbname(conninfo, dbname)
}
