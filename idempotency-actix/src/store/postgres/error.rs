//! Turning diesel, connection and pool errors into [`StoreError`].
//!
//! The middleware answers every [`StoreError`] with 503 (fail closed), so the split matters for
//! operators, not for clients: `Unavailable` says "the database could not be reached in time",
//! `NotProvisioned` says "run `idem-cli migrate`", `Backend` is everything else.
//!
//! A missing table is SQLSTATE 42P01, but diesel-async maps every SQLSTATE it has no
//! [`DatabaseErrorKind`] for to `Unknown` and does not expose the code. Matching the English
//! message would break under `lc_messages` in another language, so [`classify_query_error`]
//! asks the database instead: on an `Unknown` error it runs
//! `SELECT to_regclass('idempotency_keys') IS NOT NULL AND to_regprocedure(...) IS NOT NULL`
//! on the same connection (the same `search_path` the failed statement used), which also
//! catches a database that lacks the second migration's `idempotency_reserve` function
//! (SQLSTATE 42883), and a connection that died with the error (a terminated session, a
//! server shutting down: `Unavailable`). Only errors cost that extra round trip.

use std::time::Duration;

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel::ConnectionError;
use diesel_async::pooled_connection::PoolError;
use diesel_async::AsyncPgConnection;

use super::sql::TableExists;
use crate::store::StoreError;

/// The hint carried by [`StoreError::NotProvisioned`] when `idempotency_keys`, or a function
/// the store calls, is missing.
pub const MIGRATE_HINT: &str = "the table `idempotency_keys` (or a function the store \
     calls, such as `idempotency_reserve`) does not exist in this database; run `idem-cli migrate` (or call \
     `idempotency_actix::store::postgres::run_migrations`) to create it";

/// Classify a failed query without asking the database anything.
///
/// Connection-level failures (closed connection, broken socket, read-only replica after a
/// failover) become [`StoreError::Unavailable`]; everything else [`StoreError::Backend`]. This
/// cannot recognise a missing table (see the module docs); use [`classify_query_error`] when
/// the connection is still at hand.
pub fn classify_error(error: DieselError) -> StoreError {
    match &error {
        DieselError::DatabaseError(
            DatabaseErrorKind::UnableToSendCommand
            | DatabaseErrorKind::ClosedConnection
            | DatabaseErrorKind::ReadOnlyTransaction,
            _,
        )
        | DieselError::BrokenTransactionManager => StoreError::Unavailable(Box::new(error)),
        _ => StoreError::Backend(Box::new(error)),
    }
}

/// Classify a failed query, asking `conn` whether the table exists when the error's kind is
/// `Unknown` (which is how diesel-async reports SQLSTATE 42P01, undefined table).
///
/// Returns [`StoreError::NotProvisioned`] with [`MIGRATE_HINT`] when `idempotency_keys` is
/// missing, otherwise what [`classify_error`] says. The CLI uses it for the same one-line
/// diagnosis the middleware gives.
pub async fn classify_query_error(conn: &mut AsyncPgConnection, error: DieselError) -> StoreError {
    if matches!(
        error,
        DieselError::DatabaseError(DatabaseErrorKind::Unknown, _)
    ) {
        match table_exists(conn).await {
            Ok(false) => return not_provisioned(),
            // The connection died with the error: an administrator terminated the session
            // (57P01), the server is shutting down (57P02, 57P03) or crashed. Those codes are
            // `Unknown` too, and the database is unavailable, not broken: retry later. Such an
            // error can come after the statement committed (a fatal error sent in place of its
            // answer), so its outcome is unknown, as for a connection lost without a word.
            Err(StoreError::Unavailable(_)) => {
                return StoreError::Unavailable(Box::new(SessionLost(error)))
            }
            Ok(true) | Err(_) => {}
        }
    }
    classify_error(error)
}

/// A statement's error after which its session was gone (a `FATAL` error, a crash): whether
/// the statement took effect first is unknown. Shown as the error itself.
#[derive(Debug)]
pub(crate) struct SessionLost(pub(crate) DieselError);

impl std::fmt::Display for SessionLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SessionLost {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Whether `idempotency_keys` is visible on `conn`'s `search_path`. One round trip.
pub async fn table_exists(conn: &mut AsyncPgConnection) -> Result<bool, StoreError> {
    use diesel_async::RunQueryDsl;
    TableExists
        .get_result::<super::sql::ExistsRow>(conn)
        .await
        .map(|row| row.present)
        .map_err(classify_error)
}

/// [`StoreError::NotProvisioned`] with [`MIGRATE_HINT`].
pub fn not_provisioned() -> StoreError {
    StoreError::NotProvisioned {
        hint: MIGRATE_HINT.to_owned(),
    }
}

/// Classify a failure to open a connection: a bad URL is [`StoreError::Backend`] (a
/// configuration mistake that retrying will not fix); refused, timed out, authentication or
/// unknown database are [`StoreError::Unavailable`].
pub fn classify_connection_error(error: ConnectionError) -> StoreError {
    match error {
        ConnectionError::InvalidConnectionUrl(_) => StoreError::Backend(Box::new(error)),
        other => StoreError::Unavailable(Box::new(other)),
    }
}

/// Classify an error from the bb8 pool. bb8 reports a database that cannot be reached only as
/// "timed out"; `last_connect_error` (collected by the store's error sink) says why, and
/// `timeout` is the pool's connection timeout, for the message.
pub(crate) fn classify_pool_error(
    error: bb8::RunError<PoolError>,
    timeout: Duration,
    last_connect_error: Option<String>,
) -> StoreError {
    match error {
        bb8::RunError::User(PoolError::ConnectionError(e)) => classify_connection_error(e),
        bb8::RunError::User(PoolError::QueryError(e)) => classify_error(e),
        bb8::RunError::TimedOut => {
            let why = last_connect_error
                .map(|e| format!("; last connection error: {e}"))
                .unwrap_or_default();
            StoreError::unavailable(format!(
                "no database connection within {} ms (pool exhausted or database unreachable){why}",
                timeout.as_millis()
            ))
        }
    }
}
