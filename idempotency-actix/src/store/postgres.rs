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
//! - table or a function the store calls missing: [`StoreError::NotProvisioned`] with [`MIGRATE_HINT`]
//!   ("run `idem-cli migrate`"), recognised with `to_regclass`/`to_regprocedure` rather than an
//!   error message (diesel-async does not expose SQLSTATE 42P01/42883); the store recovers once
//!   the schema exists;
//! - no connection within the pool's connection timeout (default 2 s, not bb8's 30 s):
//!   [`StoreError::Unavailable`], with the last connection error in the message;
//! - a statement not answered within the query timeout (default 5 s):
//!   [`StoreError::Unavailable`].
//!
//! [`PostgresStore::check`] is a readiness probe for the same conditions. [`run_migrations`]
//! and [`pending_migrations`] provision the schema from the embedded migrations (what
//! `idem-cli migrate` runs). The building blocks `idem-cli` and the test harness share (opening
//! one connection, classifying errors) are public but hidden from these docs: see the `admin`
//! module's docs in the source.

#[doc(hidden)]
pub mod admin;
mod builder;
mod error;
mod lifetime;
mod migrate;
mod per_thread;
mod pool;
#[doc(hidden)]
pub mod schema;
mod sql;
mod store;
mod tls;
// Transactional mode's statements (C25), all in one module.
pub(crate) mod transactional;

use std::time::Duration;

use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::AsyncPgConnection;

pub use builder::{connection_manager, PostgresStoreBuilder};
pub use error::MIGRATE_HINT;
// Building blocks `idem-cli` and the test harness share; not part of the user-facing API (the
// admin module is their documented home).
#[doc(hidden)]
pub use error::{
    classify_connection_error, classify_error, classify_query_error, not_provisioned, table_exists,
};
/// For `idem-cli migrate`, which applies the migrations on its own connection.
#[doc(hidden)]
pub use migrate::{apply_pending_migrations, Harness};
pub use migrate::{
    pending_migrations, pending_migrations_on, run_migrations, run_migrations_partitioned,
    run_migrations_rotated, Layout, PartitionInterval, DEFAULT_ROTATION_PERIOD,
    LAYOUT_MIGRATION_VERSION, MIGRATIONS, MIGRATION_LIMIT, MIN_ROTATION_PERIOD,
};
pub use store::PostgresStore;
pub use transactional::{IsolationLevel, TX_MIGRATE_HINT};

use super::StoreError;
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
/// [`IdempotencyStore::purge_expired`](crate::store::IdempotencyStore::purge_expired).
pub const DEFAULT_PURGE_BATCH: u32 = 1000;

/// The longest [`PostgresStoreBuilder::statement_timeout`] accepted: PostgreSQL's own limit,
/// `i32::MAX` milliseconds (about 24.8 days). A longer one would make the server refuse every
/// connection, so `build` refuses it instead.
pub const MAX_STATEMENT_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// The shortest [`PostgresStoreBuilder::query_timeout`] accepted: 1 ms. Shorter (zero, in
/// practice) times every statement out at its first poll, so `build` refuses it.
pub const MIN_QUERY_TIMEOUT: Duration = Duration::from_millis(1);

/// Longest duration sent to the database, so `now() + lease` can never overflow a timestamp
/// (about 100 years).
const MAX_DURATION_US: i64 = 100 * 365 * 24 * 3600 * 1_000_000;

/// A duration in microseconds (the database's interval precision, so even a sub-millisecond
/// lease is not rounded to zero), capped at ~100 years so `now() + d` cannot overflow.
fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros())
        .unwrap_or(MAX_DURATION_US)
        .clamp(0, MAX_DURATION_US)
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
/// `system`. As in libpq 16, `sslrootcert=system` without `sslmode` means `verify-full`, and
/// with any weaker `sslmode` the URL is refused. Client certificates (`sslcert`/`sslkey`) are
/// rejected as unsupported. No statement timeout is set (a purge may legitimately run long).
///
/// # Errors
/// [`StoreError::Backend`] for a bad URL; [`StoreError::Unavailable`] when the server cannot
/// be reached, refuses the login or the TLS handshake fails.
///
/// The hosts of a failover list are tried in turn, each bounded by the URL's
/// `connect_timeout` (libpq's meaning: the whole connection to that host) if it sets one; see
/// [`establish_within`] for a bound without it.
#[doc(hidden)]
pub async fn establish(url: &str) -> Result<AsyncPgConnection, StoreError> {
    let target = ConnectTarget::parse(url, None).map_err(|e| StoreError::Backend(Box::new(e)))?;
    target.connect().await.map_err(classify_connection_error)
}

/// [`establish`] for a caller that gives up after `within`: each host of a failover list gets
/// its share of it (the URL's `connect_timeout` if shorter), so a host that accepts TCP and
/// then says nothing does not use it all up and keep the next host from its turn.
///
/// # Errors
/// As [`establish`].
#[doc(hidden)]
pub async fn establish_within(
    url: &str,
    within: Duration,
) -> Result<AsyncPgConnection, StoreError> {
    let mut target =
        ConnectTarget::parse(url, None).map_err(|e| StoreError::Backend(Box::new(e)))?;
    target.bound_each_host(within / target.host_count());
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
