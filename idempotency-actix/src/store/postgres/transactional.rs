//! Transactional mode (C25): what the middleware does on the connection it lends to the
//! handler. The claim, the tenant setting and the claim-function probe are statements of the
//! `sql` module (the one home of the store's SQL); `BEGIN`, `COMMIT` and `ROLLBACK` go through
//! diesel-async's transaction manager.
//!
//! A transactional request runs, on one pooled connection:
//!
//! | round trip | statement | what |
//! |---|---|---|
//! | 1 | `BEGIN [ISOLATION LEVEL ..]; SET LOCAL idle_in_transaction_session_timeout = ..` | one simple query, through diesel-async's [`AnsiTransactionManager`] (so a handler's own `transaction()` becomes a savepoint) |
//! | 2 | `SELECT * FROM idempotency_tx_claim($1..$9)` | tenant setting for RLS, then reserve-or-fetch inside this transaction (keyed requests only) |
//! | - | the handler's statements | |
//! | 3 | the store's `complete` UPDATE, fenced by the token | the stored response, in the same transaction (keyed requests only) |
//! | 4 | `COMMIT` | the reservation, the handler's rows and the response become visible at once |
//!
//! A replay, a 409 and a 422 cost BEGIN, the claim and a ROLLBACK. The claim function and the
//! advisory lock that keeps it non-blocking are in the third migration; `docs/sql.md`
//! ("Transactional claim") has the race-freedom argument.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use diesel::connection::{
    get_default_instrumentation, Instrumentation, InstrumentationEvent, TransactionDepthChange,
    TransactionManagerStatus,
};
use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, SimpleAsyncConnection,
    TransactionManager,
};

use super::error::classify_error;
use super::lifetime;
use super::sql::{self, Completion, Reserve, SetTenant, TxClaim};
use super::store::{abandon, corrupt, decode_reserve_row, given_up, scope_binds, GIVEN_UP};
use super::{micros, PostgresStore};
use crate::store::{
    Fingerprint, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse, WriteOutcome,
};

/// A pooled connection owned by one request (not borrowing the pool), held with its turn in
/// a thread's pool when it came from one.
pub(crate) type TxConnection = super::pool::Checkout;

/// The isolation level of transactional requests. Default [`IsolationLevel::DatabaseDefault`]:
/// a plain `BEGIN`, so the database's (or role's) `default_transaction_isolation` applies
/// (`READ COMMITTED` unless an operator changed it; an operator who made it stricter to guard
/// invariants keeps that). Name a level to override it.
///
/// Under `RepeatableRead` and `Serializable`, PostgreSQL may abort a transaction with a
/// serialization failure (SQLSTATE 40001), at a statement or at COMMIT; see
/// [`IdempotencyBuilder::retry_serialization_failures`](crate::IdempotencyBuilder::retry_serialization_failures).
/// Under `Serializable`, the middleware's own statements insert first and update by address, so
/// requests with different keys do not fail each other through `idempotency_keys` (migration
/// `2026-12-04-000010`; `docs/transactional.md`, "Serialization failures").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum IsolationLevel {
    /// The database's `default_transaction_isolation` (a plain `BEGIN`).
    #[default]
    DatabaseDefault,
    /// `READ COMMITTED`, whatever the database's default.
    ReadCommitted,
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`.
    Serializable,
}

impl IsolationLevel {
    fn begin_sql(self) -> &'static str {
        match self {
            Self::DatabaseDefault => "BEGIN",
            Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// Why a COMMIT (or the statement before it) did not make the request's work durable.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// The database refused the commit (a deferred constraint, a serialization failure):
    /// everything was rolled back. `serialization` says whether a re-run may succeed.
    RolledBack {
        serialization: bool,
        error: DieselError,
    },
    /// The connection was lost (or did not answer in time, or the server ended the session)
    /// during COMMIT: the transaction may or may not have committed.
    Unknown(String),
}

/// Take a connection from the store's pool for the whole request (within the pool's
/// connection timeout: pool exhausted or database down is [`StoreError::Unavailable`]).
pub(crate) async fn checkout(store: &PostgresStore) -> Result<TxConnection, StoreError> {
    store.conn().await
}

/// `BEGIN` (with the isolation level) and the idle-in-transaction bound, in one simple-query
/// round trip, through diesel-async's transaction manager: the connection then knows it is in
/// a transaction, so a handler's `conn.transaction(..)` opens a savepoint.
///
/// `idle_limit` becomes `SET LOCAL idle_in_transaction_session_timeout`: if the app stops
/// talking to the database in the middle of the transaction (hung, stopped in a debugger,
/// partitioned away) for that long, PostgreSQL ends the session and rolls back, which frees
/// the claim. It is transaction-local, so the pooled connection keeps its own setting after.
pub(crate) async fn begin(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    isolation: IsolationLevel,
    idle_limit: Duration,
) -> Result<(), StoreError> {
    // 0 would disable the timeout: at least 1 ms; at most what the GUC accepts (i32 ms).
    let ms = idle_limit.as_millis().clamp(1, i32::MAX as u128);
    let sql = format!(
        "{}; SET LOCAL idle_in_transaction_session_timeout = {ms}",
        isolation.begin_sql()
    );
    let begun = store
        .timed(conn, async |conn| {
            AnsiTransactionManager::begin_transaction_sql(conn, &sql)
                .await
                .map_err(classify_error)
        })
        .await;
    if begun.is_err() {
        // BEGIN may have run and the SET after it failed (an operator's cancel landing in the
        // batch): the session is then in an aborted transaction block that diesel does not
        // know of, since it counts the transaction only on success, and the pool would lend
        // it again to fail every caller until its lifetime ends. Marked broken, the pool
        // closes it instead (review, 2026-12-06).
        abandon(conn);
    }
    begun
}

/// The claim of a keyed request, inside the open transaction: the tenant setting, then
/// reserve-or-fetch (see [`sql::TxClaim`]). `None` means the function answered `raced` (nothing
/// written; the caller may try again).
pub(crate) async fn claim(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    setting: Option<(&str, &str)>,
    scope: &Scope,
    fingerprint: &Fingerprint,
    lease: Duration,
) -> Result<Option<ReserveOutcome>, StoreError> {
    let query = TxClaim {
        setting: setting.map(|(name, _)| name),
        setting_value: setting.map(|(_, value)| value),
        reserve: Reserve {
            scope: scope_binds(scope),
            fingerprint: fingerprint.as_bytes(),
            token: ReservationToken::random().as_uuid(),
            lease_us: micros(lease).max(1),
        },
    };
    let rows = store
        .timed(conn, async |conn| {
            sql::tx_claim(conn, &query).await.map_err(classify_error)
        })
        .await?;
    let Some(row) = rows.into_iter().next() else {
        return Err(corrupt("idempotency_tx_claim returned no row"));
    };
    // A claim row has the reserve function's shape and vocabulary: one decoder for both.
    decode_reserve_row(row, query.reserve.token)
}

/// Only the tenant setting, for a keyless request (no record, so no claim). One round trip;
/// skipped when no tenant source is configured.
pub(crate) async fn set_tenant(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    name: &str,
    value: &str,
) -> Result<(), StoreError> {
    let query = SetTenant { name, value };
    store
        .timed(conn, async |conn| {
            sql::set_tenant(conn, &query).await.map_err(classify_error)
        })
        .await
}

/// Store the response inside the open transaction: the store's own `complete` statement,
/// fenced by the claim's token.
pub(crate) async fn complete(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    scope: &Scope,
    token: &ReservationToken,
    response: &StoredResponse,
    ttl: Duration,
) -> Result<WriteOutcome, DieselError> {
    let headers = response.encode_headers();
    let status = i16::try_from(response.status).unwrap_or(i16::MAX);
    let completion = Completion {
        token: token.as_uuid(),
        status,
        headers: &headers,
        body: &response.body,
        ttl_us: micros(ttl),
    };
    let binds = scope_binds(scope);
    let statement = sql::complete(conn, &binds, &completion);
    let executed = match store.query_timeout {
        None => statement.await,
        Some(limit) => match tokio::time::timeout(limit, statement).await {
            Ok(result) => result,
            Err(_) => {
                // As every statement of the default mode (`PostgresStore::timed`): without
                // it the ROLLBACK and the session probe queued behind the statement still
                // waiting, each for another timeout, while the transaction held the key's
                // claim (review, 2026-12-06). Nothing is committed either way.
                store.give_up(conn);
                Err(DieselError::DatabaseError(
                    DatabaseErrorKind::ClosedConnection,
                    Box::new(format!(
                        "the database did not answer within {} ms",
                        limit.as_millis()
                    )),
                ))
            }
        },
    };
    executed.map(|rows| {
        if rows == 0 {
            WriteOutcome::Stale
        } else {
            WriteOutcome::Applied
        }
    })
}

/// COMMIT through the transaction manager, under the store's query timeout. A timeout drops
/// the COMMIT mid-flight: diesel-async then marks the connection broken (the pool discards
/// it) and the outcome is unknown.
pub(crate) async fn commit(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
) -> Result<(), CommitError> {
    let committed = match store.query_timeout {
        None => Ok(AnsiTransactionManager::commit_transaction(conn).await),
        Some(limit) => {
            tokio::time::timeout(limit, AnsiTransactionManager::commit_transaction(conn)).await
        }
    };
    match committed {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(commit_error(store, conn, error).await),
        Err(_) => Err(CommitError::Unknown(format!(
            "COMMIT not answered within {} ms",
            store.query_timeout.map_or(0, |l| l.as_millis())
        ))),
    }
}

/// A keyless request's check and COMMIT in one round trip: `SELECT 1; COMMIT` as one simple
/// query. In a transaction an ignored failure aborted, the `SELECT 1` is refused (25P02) and
/// PostgreSQL skips the rest of the query string, so the COMMIT, which it would have turned
/// into a silent rollback, never runs; the transaction stays open, aborted, for the caller's
/// ROLLBACK. (A keyed request's `complete` is its check.)
///
/// The COMMIT bypasses diesel-async's transaction manager, so its depth is lowered here, with
/// the `ValidTransactionManagerStatus` API diesel exposes under the
/// `i-implement-a-third-party-backend-and-opt-into-breaking-changes` feature, which
/// diesel-async enables for its own transaction manager (so the two move together). A batch
/// dropped on timeout leaves the depth at 1: the pool sees a connection still in a transaction
/// and discards it, as diesel-async's own COMMIT marks a dropped one broken.
/// The query string of [`check_and_commit`].
const CHECK_AND_COMMIT: &str = "SELECT 1; COMMIT";

pub(crate) async fn check_and_commit(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
) -> Result<(), CommitError> {
    if let Ok(Some(depth)) =
        AnsiTransactionManager::transaction_manager_status_mut(conn).transaction_depth()
    {
        // What diesel-async's COMMIT reports. `instrumentation()` panics while another handle
        // on it lives (a row stream a handler leaked): the event is then left out.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            conn.instrumentation()
                .on_connection_event(InstrumentationEvent::commit_transaction(depth));
        }));
    }
    let committed = {
        let mut batch = std::pin::pin!(conn.batch_execute(CHECK_AND_COMMIT));
        // The first poll hands the query to the connection's task. An error then means it
        // never left: the session was already gone (PostgreSQL ended it while the handler was
        // idle, say at `idle_in_transaction_session_timeout`), and nothing can have committed.
        let first = std::future::poll_fn(|cx| Poll::Ready(batch.as_mut().poll(cx))).await;
        match first {
            Poll::Ready(Err(error)) => Err(error),
            Poll::Ready(Ok(())) => Ok(Ok(Ok(()))),
            Poll::Pending => Ok(match store.query_timeout {
                None => Ok(batch.await),
                Some(limit) => tokio::time::timeout(limit, batch).await,
            }),
        }
    };
    let committed = match committed {
        Ok(answered) => answered,
        Err(never_sent) => {
            rollback(store, conn).await;
            return Err(CommitError::RolledBack {
                serialization: false,
                error: never_sent,
            });
        }
    };
    match committed {
        Ok(Ok(())) => {
            if let TransactionManagerStatus::Valid(status) =
                AnsiTransactionManager::transaction_manager_status_mut(conn)
            {
                // Depth 1 (checked by the caller), so this ends the transaction.
                let _ = status.change_transaction_depth(TransactionDepthChange::DecreaseDepth);
            }
            Ok(())
        }
        // Either statement's error: the `SELECT 1` in an aborted transaction (still open), or
        // the COMMIT's (ended). A ROLLBACK ends the first and is a no-op after the second, and
        // must come before `commit_error`'s probe, which an aborted transaction would refuse
        // (a false "the session did not survive").
        Ok(Err(error)) => {
            rollback(store, conn).await;
            Err(commit_error(store, conn, error).await)
        }
        Err(_) => Err(CommitError::Unknown(format!(
            "COMMIT not answered within {} ms",
            store.query_timeout.map_or(0, |l| l.as_millis())
        ))),
    }
}

/// Serialization failures (SQLSTATE 40001) on any statement of a transactional request that
/// may be re-run (`retry_serialization_failures`), the handler's included, seen through the
/// connection's diesel instrumentation. (A row-returning statement's failure comes in its row
/// stream, not through the instrumentation: it stays the handler's error.)
#[derive(Debug, Default)]
pub(crate) struct SerializationWatch {
    seen: AtomicBool,
}

impl SerializationWatch {
    /// Note a finished statement's serialization failure.
    pub(super) fn on_event(&self, event: &InstrumentationEvent<'_>) {
        if let InstrumentationEvent::FinishQuery {
            error: Some(error), ..
        } = event
        {
            if is_serialization_failure(error) {
                self.seen.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Whether a statement failed with a serialization failure since the watch was set.
    pub(crate) fn serialization_failed(&self) -> bool {
        self.seen.load(Ordering::Relaxed)
    }
}

/// Watch the statements of the request that now holds `conn` for serialization failures. The
/// store's own connections carry the watch in their [`lifetime`] instrumentation, which keeps
/// their deadline and diesel's default instrumentation. A connection from a pool the app built
/// gets a [`WatchOnly`] the first time (it forwards to a new instance of diesel's default
/// instrumentation, as [`lifetime`] does; an instrumentation the app set on that connection
/// itself is replaced), which later requests point at their own watch.
pub(crate) fn watch_serialization_failures(
    conn: &mut AsyncPgConnection,
) -> Arc<SerializationWatch> {
    let watch = Arc::new(SerializationWatch::default());
    if lifetime::watch_serialization_failures(conn, Arc::clone(&watch)) {
        return watch;
    }
    // As in `lifetime`: no query future of this connection is alive here.
    let repointed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        match conn.instrumentation().downcast_mut::<WatchOnly>() {
            Some(only) => {
                only.watch = Arc::clone(&watch);
                true
            }
            None => false,
        }
    }))
    .unwrap_or(false);
    if !repointed {
        conn.set_instrumentation(WatchOnly {
            watch: Arc::clone(&watch),
            forward: get_default_instrumentation(),
        });
    }
    watch
}

/// The statement watch on a connection without a [`lifetime`] instrumentation.
struct WatchOnly {
    watch: Arc<SerializationWatch>,
    forward: Option<Box<dyn Instrumentation>>,
}

impl Instrumentation for WatchOnly {
    fn on_connection_event(&mut self, event: InstrumentationEvent<'_>) {
        self.watch.on_event(&event);
        if let Some(forward) = &mut self.forward {
            forward.on_connection_event(event);
        }
    }
}

/// Whether the session answers a `SELECT 1`, within the store's query timeout: after a COMMIT
/// the server refused, whether the session survived the refusal (see `commit_error`).
pub(crate) async fn select_one(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
) -> Result<(), String> {
    if given_up(conn) {
        // Its last statement may be unanswered: a `SELECT 1` would wait behind it.
        return Err(GIVEN_UP.to_owned());
    }
    let check = conn.batch_execute("SELECT 1");
    let checked = match store.query_timeout {
        None => Ok(check.await),
        Some(limit) => tokio::time::timeout(limit, check).await,
    };
    match checked {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => {
            // Not lent again with the `SELECT 1` still pending.
            store.give_up(conn);
            Err("SELECT 1 was not answered in time".to_owned())
        }
    }
}

/// Whether a statement error of this transaction was a serialization failure (40001).
pub(crate) fn is_serialization_failure(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(DatabaseErrorKind::SerializationFailure, _)
    )
}

/// Whether a claim failed with a serialization failure (40001): under REPEATABLE READ or
/// SERIALIZABLE its snapshot predates a row committed meanwhile.
pub(crate) fn is_serialization_store_error(error: &StoreError) -> bool {
    match error {
        StoreError::Backend(error) => error
            .downcast_ref::<DieselError>()
            .is_some_and(is_serialization_failure),
        _ => false,
    }
}

/// Whether an error means the connection is gone (the outcome of a COMMIT is then unknown).
pub(crate) fn is_connection_lost(error: &DieselError) -> bool {
    matches!(
        error,
        DieselError::DatabaseError(
            DatabaseErrorKind::ClosedConnection | DatabaseErrorKind::UnableToSendCommand,
            _
        ) | DieselError::BrokenTransactionManager
    )
}

/// What a COMMIT's error says about the transaction. A lost connection: unknown. An ERROR
/// (a deferred constraint, a serialization failure, a deferred trigger's exception): rolled
/// back, and the session lives on. But diesel-async does not say an error's severity, and a
/// FATAL (a terminated backend, a server shutting down) can be sent after the commit point,
/// with the COMMIT's own answer queued and never flushed: an error diesel cannot name (its
/// `Unknown` kind, where every FATAL lands) counts as rolled back only if the session still
/// answers afterwards.
async fn commit_error(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    error: DieselError,
) -> CommitError {
    let (commit_error, rollback_error) = match &error {
        DieselError::RollbackErrorOnCommit {
            commit_error,
            rollback_error,
        } => (&**commit_error, Some(&**rollback_error)),
        other => (other, None),
    };
    if is_connection_lost(commit_error) || rollback_error.is_some_and(is_connection_lost) {
        return CommitError::Unknown(error.to_string());
    }
    let unnamed = matches!(
        commit_error,
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, _)
    );
    if unnamed {
        if let Err(why) = select_one(store, conn).await {
            return CommitError::Unknown(format!(
                "{error}; the session did not survive it ({why})"
            ));
        }
    }
    CommitError::RolledBack {
        serialization: is_serialization_failure(&error),
        error,
    }
}

/// ROLLBACK, best effort: a connection that cannot roll back is left in a state the pool
/// recognises as broken (an open or failed transaction), so it is closed, not reused, and
/// PostgreSQL rolls the transaction back when the session ends.
pub(crate) async fn rollback(store: &PostgresStore, conn: &mut AsyncPgConnection) {
    if given_up(conn) {
        return; // closed by the pool; the server rolls back when the session ends
    }
    let rolled_back = match store.query_timeout {
        None => Ok(AnsiTransactionManager::rollback_transaction(conn).await),
        Some(limit) => {
            tokio::time::timeout(limit, AnsiTransactionManager::rollback_transaction(conn)).await
        }
    };
    match rolled_back {
        Ok(Ok(())) | Ok(Err(DieselError::NotInTransaction)) => {}
        Ok(Err(error)) => {
            tracing::warn!(target: "idempotency_actix", %error, "ROLLBACK failed; the connection is discarded (the server rolls back when it closes)");
        }
        Err(_) => {
            store.give_up(conn);
            tracing::warn!(target: "idempotency_actix", "ROLLBACK not answered in time; the connection is discarded");
        }
    }
}

/// After one of the middleware's own statements (the claim, the tenant setting, `complete`)
/// failed on `conn` with `failure` for a reason other than a serialization failure, and its
/// transaction was rolled back: close the connection when it goes back to the pool, instead of
/// lending it again, if a handler left state on it that fails every later statement; the pool
/// would otherwise lend it on, one 503 after another, for its whole lifetime. Two kinds:
/// - a prepared statement gone (`DEALLOCATE`, which no rollback undoes): diesel-async keeps
///   using the names tokio-postgres gave its cached statements, so the failure names one
///   (`prepared statement "s3" does not exist`; the quoted name is the same in every language
///   the server speaks);
/// - a session setting changed ([`sql::session_altered`], one round trip: a leaked `SET
///   search_path`, `SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY`).
///
/// Any other failure keeps the connection: an error a client can cause (a path too long for
/// the index) must not cost the database a new session per request. Whether it was discarded.
pub(crate) async fn discard_if_altered(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    failure: &dyn std::fmt::Display,
) -> bool {
    if given_up(conn) {
        // Already closed by the pool when it comes back, for a statement not answered in
        // time: not a session a handler altered (the caller reports its own error).
        return false;
    }
    let statement_gone = names_a_prepared_statement(&failure.to_string());
    let altered = statement_gone
        || store
            .timed(conn, async |c| Ok(sql::session_altered(c).await))
            .await
            .unwrap_or(true);
    if altered {
        abandon(conn);
    }
    altered
}

/// Whether `text` quotes a name tokio-postgres gives the statements it prepares (`"s3"`).
fn names_a_prepared_statement(text: &str) -> bool {
    text.split('"').skip(1).step_by(2).any(|quoted| {
        quoted
            .strip_prefix('s')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// After a failed claim (and its rollback): the store's own diagnosis, plus the third
/// migration's claim function, so a database migrated only to the second migration gets the
/// "run `idem-cli migrate`" hint instead of an opaque error. Bounded by the query timeout like
/// every statement of the request (review, 2026-12-06: a stalled connection held the request
/// here without limit).
pub(crate) async fn classify_claim_error(
    store: &PostgresStore,
    conn: &mut AsyncPgConnection,
    error: StoreError,
) -> StoreError {
    if !matches!(error, StoreError::Backend(_)) {
        return error;
    }
    let exists = store
        .timed(conn, async |c| Ok(sql::claim_exists(c).await))
        .await;
    match exists {
        Ok(Ok(false)) => StoreError::NotProvisioned {
            hint: TX_MIGRATE_HINT.to_owned(),
        },
        _ => error,
    }
}

/// The hint when the claim function is missing.
pub const TX_MIGRATE_HINT: &str = "the function `idempotency_tx_claim` (third migration, \
     needed by transactional mode) does not exist in this database; run `idem-cli migrate`";

#[cfg(test)]
mod tests {
    use super::names_a_prepared_statement;

    #[test]
    fn a_missing_prepared_statement_is_recognised_by_its_quoted_name() {
        assert!(names_a_prepared_statement(
            "prepared statement \"s3\" does not exist"
        ));
        assert!(names_a_prepared_statement(
            "la sentencia preparada \"s12\" no existe"
        ));
        for other in [
            "index row size 6048 exceeds btree version 4 maximum 2704 for index \"idempotency_keys_pkey\"",
            "relation \"s\" does not exist",
            "column \"s1x\" does not exist",
            "no quotes at all s3",
        ] {
            assert!(!names_a_prepared_statement(other), "{other}");
        }
    }
}
