//! [`PostgresStore`]: the store itself, its request-path operations and the
//! [`IdempotencyStore`] implementation. Every statement it runs is in the `sql` module.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use diesel::connection::TransactionManagerStatus;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};

use super::admin::PurgeFilter;
use super::error::{self, classify_query_error, not_provisioned, table_exists};
use super::per_thread::PoolPerThread;
use super::pool::Checkout;
use super::schema::State;
use super::sql::{self, Completion, ReplayRead, Reserve, ReserveRow, ScopeBinds};
use super::tls::ConnectTarget;
use super::transactional::is_serialization_failure;
use super::{micros, PgPool, PostgresStoreBuilder, DEFAULT_PURGE_BATCH, DEFAULT_QUERY_TIMEOUT};
use super::{DEFAULT_CONNECTION_TIMEOUT, DEFAULT_MAX_SIZE};
use crate::log_text::LogText;
use crate::store::release_later;
use crate::store::{
    Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};

/// How often `reserve` calls `idempotency_reserve` again when it answers `raced`. The function
/// already resolves races itself (it re-reads after each lost write, in a bounded loop), so
/// `raced` only means the key changed under every one of its attempts; this outer bound is
/// against such pathological churn, never a correctness device.
const RESERVE_ATTEMPTS: usize = 5;

/// Idempotency records in PostgreSQL (table `idempotency_keys`), for apps that run several
/// instances against one database.
///
/// Cloning is cheap; clones share the pool. All lease and TTL arithmetic uses the database's
/// clock, so instances with skewed clocks agree.
#[derive(Clone)]
pub struct PostgresStore {
    pub(super) pool: PgPool,
    /// Each thread's own pool, when built with `pool_per_thread`.
    pub(super) pool_per_thread: Option<Arc<PoolPerThread>>,
    pub(super) connection_timeout: Duration,
    pub(super) query_timeout: Option<Duration>,
    pub(super) last_connect_error: Arc<Mutex<Option<String>>>,
    pub(super) purge_batch: u32,
    pub(super) replay_fast_path: bool,
    /// How to reach the server for a cancel request (`None` for a store over an app's own
    /// pool, whose TLS settings the store does not know).
    pub(super) cancel_with: Option<Arc<ConnectTarget>>,
    /// Bounds on background releases ([`Self::release_later`]), shared by clones.
    pub(super) background: Arc<BackgroundReleases>,
    /// Whether the provisioning probe has passed once ([`Self::ensure_provisioned`]), shared
    /// by clones.
    pub(super) provisioned: Arc<AtomicBool>,
}

/// Bounds on a store's background releases ([`PostgresStore::release_later`]). Every reserve
/// whose outcome is unknown starts one: a task that tries a release about twenty times over two
/// leases. During a brownout, when every request times out, unbounded they would multiply the
/// load on the failing database and queue ahead of live requests for pool connections.
///
/// - Statements: at most a quarter of the pool's connections (at least one) carry a release at
///   once. A try that finds none free is skipped (its task tries again at its next turn), so
///   releases never take more than that share of the pool, however many tasks wait.
/// - Tasks: at most [`release_later::MAX_TASKS`] per store ([`release_later::Tasks`]).
pub(super) struct BackgroundReleases {
    tasks: release_later::Tasks,
    statements: Semaphore,
}

impl BackgroundReleases {
    /// The bounds for a store whose pool has `max_size` connections.
    pub(super) fn for_pool(max_size: u32) -> Arc<Self> {
        Self::new(max_size, release_later::MAX_TASKS)
    }

    fn new(max_size: u32, max_tasks: usize) -> Arc<Self> {
        let statements = usize::try_from(max_size / 4).unwrap_or(1).max(1);
        Arc::new(Self {
            tasks: release_later::Tasks::new(max_tasks),
            statements: Semaphore::new(statements.min(Semaphore::MAX_PERMITS)),
        })
    }

    /// Room for one more task, held until the task ends; `None` (and a warning naming `key`)
    /// when all are taken.
    fn start(&self, key: &str) -> Option<OwnedSemaphorePermit> {
        self.tasks.start(key)
    }

    /// Room for one release statement now, held while it runs; `None`: skip this try.
    fn statement(&self) -> Option<SemaphorePermit<'_>> {
        self.statements.try_acquire().ok()
    }
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

impl PostgresStore {
    /// The longest scope this store records ([`Scope::byte_len`]: tenant, method, path and
    /// key, added), answered by [`IdempotencyStore::max_scope_bytes`].
    ///
    /// The four parts are the table's primary key, and a B-tree entry holds at most 2,704
    /// bytes: the parts plus an 8-byte entry header and, per part, a varlena header and
    /// alignment (4 and up to 3 bytes when a part is over 126 bytes, no alignment after the
    /// last), 2,671 bytes of parts in the worst case. PostgreSQL compresses a long entry first, so a repetitive scope can be
    /// longer, but what fits must not depend on what a client's bytes compress to: 2,600, with
    /// room to spare, for every scope. (Measured on PostgreSQL 15: random parts stop fitting at
    /// 2,679 to 2,687 bytes, depending on how they are split.) Bytes as UTF-8, which is what
    /// the database holds when its encoding is UTF-8 (PostgreSQL's default on a UTF-8
    /// locale): in a database of another encoding some characters take more bytes (a 2-byte
    /// `é` is 3 in `EUC_JP`), so such a scope near the limit can still fail (503), and a
    /// character the encoding lacks always does.
    pub const MAX_SCOPE_BYTES: usize = 2_600;

    /// A store over an existing pool (its settings are used as they are; see
    /// [`PostgresStoreBuilder::connection_timeout`] for why a short connection timeout
    /// matters). Build the pool's manager with [`connection_manager`](super::connection_manager) to get TLS per the URL's
    /// `sslmode`; diesel-async's plain `AsyncDieselConnectionManager::new` never uses TLS.
    ///
    /// Such a store cannot ask the server to cancel a statement that hit the query timeout
    /// (it does not know how the pool's connections reach the server, TLS included): the
    /// statement may still take effect later (see
    /// [`PostgresStoreBuilder::query_timeout`]). Set `statement_timeout` on the pool's
    /// connections so the server gives up too.
    pub fn new(pool: PgPool) -> Self {
        Self {
            connection_timeout: pool.config().connection_timeout,
            query_timeout: Some(DEFAULT_QUERY_TIMEOUT),
            background: BackgroundReleases::for_pool(pool.config().max_size),
            pool,
            pool_per_thread: None,
            last_connect_error: Arc::new(Mutex::new(None)),
            purge_batch: DEFAULT_PURGE_BATCH,
            replay_fast_path: false,
            cancel_with: None,
            provisioned: Arc::new(AtomicBool::new(false)),
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
            pool_per_thread: None,
        }
    }

    /// The pool, e.g. to share it with the rest of the app or to inspect its state.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Readiness check: a connection can be had within the connection timeout, and the table
    /// and the functions the store calls exist (a database behind this version's migrations
    /// fails it). One round trip (`to_regclass`, `to_regprocedure`). Use
    /// it in a health endpoint or before taking traffic; the store itself never needs it.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when no connection could be made,
    /// [`StoreError::NotProvisioned`] (with [`MIGRATE_HINT`](super::MIGRATE_HINT)) when the table or function is
    /// missing.
    pub async fn check(&self) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        match self
            .timed(&mut conn, async |c| table_exists(c).await)
            .await?
        {
            true => {
                self.provisioned.store(true, Ordering::Relaxed);
                Ok(())
            }
            false => Err(not_provisioned()),
        }
    }

    /// Refuse to reserve (so the handler never runs) until the schema has been seen whole
    /// once: the provisioning probe on the first reservation, then never again. A database
    /// provisioned by an older release and not yet migrated can have `idempotency_reserve`
    /// without `idempotency_complete` (before the fourth migration): reserving there would run
    /// the handler, fail to store its response, and let a retry after the lease run it again.
    /// C15 promises a 503 before the handler instead. The probe (prepared on its first use, so
    /// two round trips then) runs once per store, again after each failure until `idem-cli
    /// migrate` has run, and again after any statement found the schema missing. Transactional
    /// mode runs it before its claim, for the same reason: at migration 000003 the claim exists
    /// and `complete` does not, so the handler would run (call its payment provider) and be
    /// rolled back, every time.
    pub(crate) async fn ensure_provisioned(
        &self,
        conn: &mut AsyncPgConnection,
    ) -> Result<(), StoreError> {
        if self.provisioned.load(Ordering::Relaxed) {
            return Ok(());
        }
        if self.timed(conn, async |c| table_exists(c).await).await? {
            self.provisioned.store(true, Ordering::Relaxed);
            Ok(())
        } else {
            Err(not_provisioned())
        }
    }

    /// Delete up to `limit` expired records (completed past their TTL, reservations whose
    /// lease ended more than `grace` ago) in one short statement; returns how many. Rows
    /// locked by a concurrent purge or request are skipped, not waited for, so overlapping
    /// runs never block each other. Call it until it returns less than `limit`.
    ///
    /// On the partitioned layout this deletes expired claims only, as
    /// [`purge_expired`](IdempotencyStore::purge_expired) does: see there why `idem-cli purge`
    /// is then required.
    ///
    /// # Errors
    /// As `reserve`.
    pub async fn purge_batch(&self, grace: Duration, limit: u32) -> Result<u64, StoreError> {
        let filter = PurgeFilter {
            grace,
            ..PurgeFilter::default()
        };
        let mut conn = self.conn().await?;
        self.timed(&mut conn, async |conn| {
            match sql::purge(conn, &filter, limit).await {
                Ok(purged) => Ok(purged.total()),
                Err(e) => Err(classify_query_error(conn, e).await),
            }
        })
        .await
    }

    /// A connection for one operation: from this thread's pool (`pool_per_thread`) or the
    /// shared one.
    pub(super) async fn conn(&self) -> Result<Checkout, StoreError> {
        let checkout = match self.pool_per_thread.as_ref().and_then(|p| p.get()) {
            Some(own) => own.get(self.connection_timeout).await,
            None => self.pool.get_owned().await.map(|c| Checkout::new(c, None)),
        };
        checkout.map_err(|e| {
            // Cloned, not taken: every request timing out during an outage gets the reason.
            let last = self.last_connect_error.lock().ok().and_then(|l| l.clone());
            error::classify_pool_error(e, self.connection_timeout, last)
        })
    }

    /// Run one statement on `conn` under the query timeout.
    ///
    /// A statement cut short by the timeout may still run on the server (waiting for a lock,
    /// say), and its reply would come ahead of the next statement's on this connection: the
    /// next request to check the connection out would wait behind it, time out too, and have
    /// its own statement run later (for a reserve, a reservation nobody holds: 409s for a whole
    /// lease after a 503 that said "not processed"). So a connection whose statement timed
    /// out is marked broken, and the pool closes it instead of lending it again. Closing it
    /// does not stop the statement (the server notices a closed connection only when it next
    /// talks to it, which a statement waiting for a lock never does), so the server is also
    /// asked to cancel it ([`Self::cancel`]).
    pub(super) async fn timed<T>(
        &self,
        conn: &mut AsyncPgConnection,
        statement: impl AsyncFnOnce(&mut AsyncPgConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if given_up(conn) {
            return Err(StoreError::unavailable(GIVEN_UP));
        }
        let result = match self.query_timeout {
            None => statement(conn).await,
            Some(limit) => tokio::time::timeout(limit, statement(&mut *conn))
                .await
                .unwrap_or_else(|_| {
                    self.give_up(conn);
                    Err(StoreError::Unavailable(Box::new(TimedOut(limit))))
                }),
        };
        if let Err(StoreError::NotProvisioned { .. }) = result {
            // The schema changed under a running store (dropped, restored from an older
            // backup, re-provisioned at an older release): probe it again before the next
            // reservation, as before the first ([`Self::ensure_provisioned`]).
            self.provisioned.store(false, Ordering::Relaxed);
        }
        result
    }

    /// After a statement on `conn` timed out: ask the server to cancel it, and mark the
    /// connection broken so that the pool closes it (whatever it still runs, its session's
    /// transaction and locks end with it) instead of queueing the next statement behind it.
    pub(super) fn give_up(&self, conn: &mut AsyncPgConnection) {
        self.cancel(conn);
        abandon(conn);
    }

    /// Ask the server to cancel what `conn` still runs: a cancel request on a task of its
    /// own (the caller answers at once), bounded by the connection timeout, best effort. Safe
    /// however late it arrives: the connection is never lent again, so the only statement a
    /// cancel can reach is the abandoned one, and a server finds nothing to cancel on an idle
    /// session.
    fn cancel(&self, conn: &AsyncPgConnection) {
        let Some(target) = self.cancel_with.clone() else {
            return;
        };
        let token = conn.cancel_token();
        let limit = self.connection_timeout;
        tokio::spawn(async move {
            match tokio::time::timeout(limit, target.cancel(token)).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, "could not ask the database to cancel a timed-out statement; it may still take effect");
                }
                Err(_) => {
                    tracing::warn!("the database did not take the cancel request of a timed-out statement in time; it may still take effect");
                }
            }
        });
    }

    /// Release, in the background, a reservation a failed reserve may have made anyway (see
    /// `reserve`), on [`release_later::keep_trying`]'s schedule: the statement can still commit
    /// after the first tries (one that waited on a lock runs on until it gets it, and one held
    /// up on its way to the server, by the network or a stalled runtime, starts late, so the
    /// cancel found nothing to cancel). Only reserves whose outcome is unknown (no answer in
    /// time, the connection lost) come here.
    ///
    /// Bounded by [`BackgroundReleases`]: a try is skipped while a quarter of the pool already
    /// carries releases.
    fn release_later(&self, scope: &Scope, token: ReservationToken, lease: Duration) {
        let Some(task) = self.background.start(&scope.key) else {
            return;
        };
        let store = self.clone();
        let scope = scope.clone();
        tokio::spawn(async move {
            let _task = task;
            let (store, scope, token) = (&store, &scope, &token);
            release_later::keep_trying(lease, &scope.key, move || async move {
                let Some(_statement) = store.background.statement() else {
                    return false;
                };
                matches!(store.release(scope, token).await, Ok(WriteOutcome::Applied))
            })
            .await;
        });
    }

    async fn reserve_once(
        &self,
        conn: &mut AsyncPgConnection,
        query: &Reserve<'_>,
    ) -> Result<Option<ReserveOutcome>, StoreError> {
        let rows = match sql::reserve(conn, query).await {
            Ok(rows) => rows,
            // Under REPEATABLE READ or SERIALIZABLE (a database or role default, which
            // transactional mode supports as the handler's guard) the function's statements
            // share one snapshot, so a row committed after it fails the INSERT with 40001
            // instead of being read. The statement wrote nothing: run it again, as after a
            // lost race (docs/sql.md, "Isolation"). Review, 2026-12-06: such duplicates were
            // answered 503 instead of 409.
            Err(e) if is_serialization_failure(&e) => return Ok(None),
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
        let rows = match sql::replay_read(conn, &query).await {
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
pub(super) fn decode_reserve_row(
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
    match row.state {
        Some(State::Completed) => {
            // Only `complete` writes it, from an HTTP status; anything else is a hand edit or
            // a foreign writer, and replaying it as some other status would be a wrong answer.
            let status = row
                .response_status
                .and_then(|s| u16::try_from(s).ok())
                .filter(|s| (100..1000).contains(s))
                .ok_or_else(|| corrupt("response_status missing or not an HTTP status"))?;
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
        Some(State::InFlight) => Ok(Some(ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining: remaining,
        })),
        None => Err(corrupt("existing row without a state")),
    }
}

/// Mark `conn` broken, so the pool closes it when it comes back instead of lending it again:
/// its transaction manager's status in error is what the pool's `has_broken` check (and our
/// checkout check) read, whatever the connection was doing.
pub(super) fn abandon(conn: &mut AsyncPgConnection) {
    <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
        .set_in_error();
}

/// Why nothing is sent on a connection [`given_up`] says is broken.
pub(super) const GIVEN_UP: &str = "the connection was marked broken; nothing more is sent on it";

/// Whether `conn` was marked broken ([`abandon`]): nothing more is sent on it, since a
/// statement would queue behind the one it gave up on (and a pending cancel could reach it).
pub(super) fn given_up(conn: &mut AsyncPgConnection) -> bool {
    matches!(
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn),
        TransactionManagerStatus::InError
    )
}

pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::Backend(format!("corrupt idempotency_keys row: {what}").into())
}

pub(super) fn scope_binds(scope: &Scope) -> ScopeBinds<'_> {
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

    fn max_scope_bytes(&self) -> Option<usize> {
        Some(Self::MAX_SCOPE_BYTES)
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
        self.ensure_provisioned(&mut conn).await?;
        if self.replay_fast_path {
            let read = self.timed(&mut conn, async |c| self.replay_read(c, scope).await);
            if let Some(replay) = read.await? {
                return Ok(replay);
            }
        }
        for attempt in 1..=RESERVE_ATTEMPTS {
            let once = self.timed(&mut conn, async |c| self.reserve_once(c, &query).await);
            let once = match once.await {
                Ok(once) => once,
                Err(error) => {
                    // The statement may still have run on the server (its answer lost or late,
                    // the cancel too late to stop it): the caller answers "not processed", so
                    // such a reservation would be held by nobody for a whole lease. Released
                    // by its token, which nobody else can hold. Only when the outcome is
                    // unknown: an error the server answered wrote nothing.
                    if outcome_unknown(&error) {
                        self.release_later(scope, ReservationToken::from_uuid(query.token), lease);
                    }
                    return Err(error);
                }
            };
            if let Some(outcome) = once {
                return Ok(outcome);
            }
            tracing::debug!(attempt, key = %LogText(&scope.key), "idempotency reserve raced; re-running");
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
        let completion = Completion {
            token: token.as_uuid(),
            status,
            headers: &headers,
            body: &response.body,
            ttl_us: micros(ttl),
        };
        let scope = scope_binds(scope);
        let mut conn = self.conn().await?;
        self.timed(&mut conn, async |conn| {
            match sql::complete(conn, &scope, &completion).await {
                // Not ours to complete any more: already completed by this very token (a
                // retry after a lost reply), or taken over.
                Ok(0) => match sql::completed_by(conn, &scope, completion.token).await {
                    Ok(true) => Ok(WriteOutcome::Applied),
                    Ok(false) => Ok(WriteOutcome::Stale),
                    Err(e) => Err(classify_query_error(conn, e).await),
                },
                Ok(_) => Ok(WriteOutcome::Applied),
                Err(e) => Err(classify_query_error(conn, e).await),
            }
        })
        .await
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        let scope = scope_binds(scope);
        let mut conn = self.conn().await?;
        self.timed(&mut conn, async |conn| {
            match sql::release(conn, &scope, token.as_uuid()).await {
                Ok(0) => Ok(WriteOutcome::Stale),
                Ok(_) => Ok(WriteOutcome::Applied),
                Err(e) => Err(classify_query_error(conn, e).await),
            }
        })
        .await
    }

    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        let scope = scope_binds(scope);
        let lease_us = micros(lease).max(1);
        let mut conn = self.conn().await?;
        self.timed(&mut conn, async |conn| {
            match sql::renew_lease(conn, &scope, token.as_uuid(), lease_us).await {
                Ok(0) => Ok(WriteOutcome::Stale),
                Ok(_) => Ok(WriteOutcome::Applied),
                Err(e) => Err(classify_query_error(conn, e).await),
            }
        })
        .await
    }

    fn renews_leases(&self) -> bool {
        true
    }

    /// Deletes expired records in batches of the builder's `purge_batch` size.
    ///
    /// **Partitioned layout: the claims only.** It never drops or creates the partitions of
    /// `idempotency_responses` nor purges its default partition, so there `idem-cli purge`
    /// (cron, as the role that ran the migrations) is required: without it the responses are
    /// never deleted, and once the partitions ahead run out every response lands in the
    /// default partition. Deliberately not done here: partition maintenance is DDL that needs
    /// ownership of the response table, which a payments application's role should not have,
    /// and its locks belong to one scheduled job serialised by purge's advisory lock rather
    /// than to every application instance (docs/operations.md, "Choosing the partitioned
    /// layout").
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

/// A statement the database did not answer within `query_timeout` ([`PostgresStore::timed`]):
/// its outcome is unknown, unlike an error the server answered.
#[derive(Debug)]
struct TimedOut(Duration);

impl std::fmt::Display for TimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the database did not answer within {} ms",
            self.0.as_millis()
        )
    }
}

impl std::error::Error for TimedOut {}

/// Whether a failed statement may still have taken effect: no answer in time, or the
/// connection lost with it (silently, or after a `FATAL` error in place of the answer). An
/// error the server answered on a session that lived on (a read-only database, a constraint)
/// wrote nothing.
fn outcome_unknown(error: &StoreError) -> bool {
    let StoreError::Unavailable(inner) = error else {
        return false;
    };
    inner.is::<TimedOut>()
        || inner.is::<super::error::SessionLost>()
        || inner
            .downcast_ref::<diesel::result::Error>()
            .is_some_and(super::transactional::is_connection_lost)
}

#[cfg(test)]
mod tests {
    use super::BackgroundReleases;

    #[test]
    fn background_release_tasks_are_bounded_and_their_room_comes_back() {
        let bounds = BackgroundReleases::new(10, 3);
        let held: Vec<_> = (0..3).filter_map(|_| bounds.start("k")).collect();
        assert_eq!(held.len(), 3);
        assert!(
            bounds.start("k").is_none(),
            "a fourth task past a bound of three"
        );
        drop(held);
        assert!(
            bounds.start("k").is_some(),
            "the room of ended tasks comes back"
        );
    }

    #[test]
    fn a_quarter_of_the_pool_carries_releases_and_never_less_than_one_connection() {
        for (max_size, statements) in [(1, 1), (3, 1), (8, 2), (10, 2), (16, 4)] {
            let bounds = BackgroundReleases::new(max_size, 1);
            let held: Vec<_> = std::iter::from_fn(|| bounds.statement())
                .take(100)
                .collect();
            assert_eq!(held.len(), statements, "pool of {max_size}");
        }
    }

    /// With a pool per thread, a release runs on the calling thread's own pool: a quarter of
    /// that pool, not of the shared one (review, 2026-12-06: 16 shared connections let 4
    /// releases take all 4 of a worker's connections, and its live requests waited).
    #[tokio::test]
    async fn with_a_pool_per_thread_releases_take_a_quarter_of_a_threads_pool() {
        let store = super::PostgresStore::builder("postgres://u@127.0.0.1:1/db")
            .max_size(16)
            .pool_per_thread(Some(4))
            .build()
            .await
            .expect("built without connecting");
        let held: Vec<_> = std::iter::from_fn(|| store.background.statement())
            .take(100)
            .collect();
        assert_eq!(held.len(), 1);
    }
}
