//! The embedded schema migrations and the functions that apply them.
//!
//! diesel's migration harness is synchronous. Run naively on a runtime thread it either blocks
//! the executor or panics ("Cannot start a runtime from within a runtime", which is what
//! happens on actix's per-worker current-thread runtimes). So the harness runs on a dedicated
//! OS thread with its own small multi-thread tokio runtime: the connection is opened on that
//! runtime (so TLS URLs work exactly as for the pool), wrapped in diesel-async's
//! [`AsyncConnectionWrapper`], and the caller only awaits a channel. That works from any
//! context: an actix worker, `#[tokio::test]`'s current-thread runtime, or a plain
//! multi-thread runtime.
//!
//! Concurrent callers (several app instances starting with `--migrate`, or `idem-cli migrate`
//! next to them) are serialised by a session-level advisory lock, so exactly one applies each
//! migration and the others see nothing pending. Nothing here waits without limit: connecting
//! is bounded by 30 s, the wait for the lock by 2 minutes, each statement by the session's
//! `statement_timeout` (2 minutes) and each lock a migration takes by its `lock_timeout` (5 s:
//! migration 000005's `LOCK TABLE` waits for a transactional request, and every request queues
//! behind it meanwhile), and the whole call by [`MIGRATION_LIMIT`] (a server gone silent
//! mid-migration answers nothing, and the harness's statements carry no client-side bound;
//! review, 2026-12-06: such a call hung for good). Past a bound the call fails with
//! [`StoreError::Unavailable`] saying why (a start-up that would otherwise hang behind a stuck
//! migration fails visibly and can be retried; migrations that completed stay applied).

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::migration::MigrationSource;
use diesel::pg::Pg;
use diesel::sql_types::{BigInt, Bool, Text};
use diesel::{QueryableByName, RunQueryDsl};
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::AsyncPgConnection;
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};

use super::error::classify_connection_error;
use super::tls::ConnectTarget;
use crate::store::StoreError;

/// The schema, embedded from the workspace's `migrations/` folder (the single source of the
/// schema; `idem-cli migrate` applies the same list).
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../migrations");

/// Arbitrary constant identifying this crate's migration advisory lock ("idem" + "migr").
const MIGRATION_LOCK_KEY: i64 = 0x6964_656d_6d69_6772;

/// The longest [`run_migrations`] and friends wait to open their connection.
const MIGRATION_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The `statement_timeout` of a migration's session: far above what any embedded migration
/// takes (each replaces functions or provisions an empty table), and a bound on one that waits.
const MIGRATION_STATEMENT_TIMEOUT: Duration = Duration::from_secs(120);

/// The `lock_timeout` of a migration's session, as `idem-cli migrate`'s: a migration that
/// needs a table's lock while a request holds it gives up soon, rather than hold every
/// request queued behind its lock request.
const MIGRATION_DDL_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest [`run_migrations`] and friends take in all: connecting, the wait for the
/// migration lock, and two statement timeouts for the rest (a live server answers every
/// statement within one). A server that stops answering mid-migration fails the call here.
pub const MIGRATION_LIMIT: Duration = Duration::from_secs(
    MIGRATION_CONNECT_TIMEOUT.as_secs()
        + MIGRATION_LOCK_WAIT.as_secs()
        + 2 * MIGRATION_STATEMENT_TIMEOUT.as_secs(),
);

/// The database at `url` for a migration: each host of a failover list gets its share of
/// [`MIGRATION_CONNECT_TIMEOUT`], so a frozen first host leaves the next one its turn; the
/// session gets [`MIGRATION_STATEMENT_TIMEOUT`] and [`MIGRATION_DDL_LOCK_TIMEOUT`].
fn migration_target(url: &str) -> Result<ConnectTarget, StoreError> {
    let mut target = ConnectTarget::parse(url, Some(MIGRATION_STATEMENT_TIMEOUT))
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
    target.append_option(&format!(
        "-c lock_timeout={}",
        MIGRATION_DDL_LOCK_TIMEOUT.as_millis()
    ));
    target.bound_each_host(MIGRATION_CONNECT_TIMEOUT / target.host_count());
    Ok(target)
}

/// The longest [`run_migrations`] and friends wait for the migration lock another session
/// holds (another instance migrating, or `idem-cli migrate`). Long enough for any of the
/// embedded migrations to finish elsewhere; past it something is stuck and waiting on would
/// hang the application's start-up for good.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(120);

/// How often a waiting caller retries the lock.
const LOCK_POLL: Duration = Duration::from_millis(100);

/// Apply every pending migration to the database at `url`. Returns the versions applied now
/// (empty when the schema was already current, so running it twice is harmless).
///
/// Safe to call from inside an actix-web or tokio runtime (see the module docs).
///
/// # Errors
/// [`StoreError::Unavailable`] when the database cannot be reached within 30 s, another
/// session held the migration lock for longer than 2 minutes, or the whole call took longer
/// than [`MIGRATION_LIMIT`] (a server that stopped answering); [`StoreError::Backend`] when a
/// migration fails (it is rolled back; nothing half-applied remains; a lock it waited 5 s for
/// is such a failure) or the URL is bad.
pub async fn run_migrations(url: &str) -> Result<Vec<String>, StoreError> {
    with_harness(url, None).await
}

/// The version of the migration that chooses the layout (`2026-12-01-000005_partitioned_layout`):
/// once it is applied the layout is fixed, so a request for the other layout can be refused
/// before anything is applied.
pub const LAYOUT_MIGRATION_VERSION: &str = "20261201000005";

/// The partition interval of the partitioned layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionInterval {
    /// One partition of `idempotency_responses` per hour of expiry.
    Hourly,
    /// One per day (UTC).
    Daily,
}

impl PartitionInterval {
    /// The value of `idempotency.partition_interval` migration 000005 reads.
    pub const fn as_str(self) -> &'static str {
        match self {
            PartitionInterval::Hourly => "hourly",
            PartitionInterval::Daily => "daily",
        }
    }
}

/// A layout other than the plain one, chosen when a database is provisioned. The migration that
/// makes it (000005, or 000016 for the rotated layout) does so when it runs, and refuses a
/// non-empty `idempotency_keys`; on a database where it already ran, the request changes
/// nothing. (So [`run_migrations_rotated`] still converts an empty plain database provisioned
/// before 000016 existed; `idem-cli migrate --rotated` refuses any database whose layout
/// migration, 000005, has run, as it does for `--partitioned`.) `docs/operations.md`, "Choosing the partitioned layout" and "Choosing the rotated
/// layout".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Claims in `idempotency_keys`, responses in `idempotency_responses` partitioned by expiry
    /// (migration 000005).
    Partitioned(PartitionInterval),
    /// The whole record in three generation tables used in turn, one emptied by `TRUNCATE` at
    /// each rotation, at most once per `period` (migration 000016). Records that outlive a
    /// period (a TTL longer than it) are carried into the new current table at each rotation,
    /// so the period bounds no TTL.
    Rotated {
        /// The least time between two rotations (at least [`MIN_ROTATION_PERIOD`]).
        period: Duration,
    },
}

/// The shortest rotation period of [`Layout::Rotated`] (migration 000016 refuses a shorter
/// one): a rotation waits for every transaction older than the last rotation, so a period far
/// longer than any transaction keeps rotations from waiting, and the tables from turning over
/// for nothing.
pub const MIN_ROTATION_PERIOD: Duration = Duration::from_secs(3600);

/// The rotation period `idem-cli migrate --rotated` provisions without `--rotation-period`:
/// two days, so that with the default TTL (24 h) and a day of purge grace for ended
/// reservations a rotation carries no record.
pub const DEFAULT_ROTATION_PERIOD: Duration = Duration::from_secs(2 * 24 * 3600);

impl Layout {
    /// The session settings the layout's migration reads when it runs.
    fn settings(self) -> String {
        match self {
            Layout::Partitioned(interval) => format!(
                "SET idempotency.layout = 'partitioned'; \
                 SET idempotency.partition_interval = '{}'",
                interval.as_str()
            ),
            Layout::Rotated { period } => format!(
                "SET idempotency.layout = 'rotated'; \
                 SET idempotency.rotation_period = '{} seconds'",
                period.as_secs()
            ),
        }
    }
}

/// As [`run_migrations`], asking migration 000005 for the time-partitioned layout (claims in
/// `idempotency_keys`, responses in `idempotency_responses` partitioned by expiry; see
/// `docs/operations.md`). The layout is chosen when that migration runs: on a database where
/// it already ran this applies nothing and the layout stays as it is (check it with
/// [`admin::partition_interval`](super::admin::partition_interval)). 000005 refuses a
/// non-empty `idempotency_keys`.
///
/// # Errors
/// As [`run_migrations`].
pub async fn run_migrations_partitioned(
    url: &str,
    interval: PartitionInterval,
) -> Result<Vec<String>, StoreError> {
    with_harness(url, Some(Layout::Partitioned(interval))).await
}

/// As [`run_migrations`], asking migration 000016 for the rotated layout ([`Layout::Rotated`]:
/// three generation tables, purged by `TRUNCATE` at most once per `period`). The layout is
/// chosen when that migration runs, as for [`run_migrations_partitioned`].
///
/// # Errors
/// As [`run_migrations`]; a `period` under [`MIN_ROTATION_PERIOD`] fails the migration.
pub async fn run_migrations_rotated(
    url: &str,
    period: Duration,
) -> Result<Vec<String>, StoreError> {
    with_harness(url, Some(Layout::Rotated { period })).await
}

/// The versions of the embedded migrations not yet applied to the database at `url` (empty
/// when the schema is current). For deploy gates such as `idem-cli migrate --check`. Reads
/// only: see [`pending_migrations_on`].
///
/// # Errors
/// As [`run_migrations`].
pub async fn pending_migrations(url: &str) -> Result<Vec<String>, StoreError> {
    let target = migration_target(url)?;
    let mut conn = tokio::time::timeout(MIGRATION_CONNECT_TIMEOUT, target.connect())
        .await
        .map_err(|_| no_connection())?
        .map_err(classify_connection_error)?;
    // Two statements, each answered by a live server within its statement timeout.
    tokio::time::timeout(
        2 * MIGRATION_STATEMENT_TIMEOUT,
        pending_migrations_on(&mut conn),
    )
    .await
    .map_err(|_| {
        StoreError::unavailable(format!(
            "the database did not answer within {}s (pending migrations not read)",
            (2 * MIGRATION_STATEMENT_TIMEOUT).as_secs()
        ))
    })?
}

/// The embedded migrations' versions not applied on `conn` yet, oldest first. Reads only, with
/// a plain `SELECT`: diesel's own `pending_migrations` first runs `CREATE TABLE IF NOT EXISTS`
/// on its bookkeeping table, which PostgreSQL refuses to a role without `CREATE` on the schema
/// even when the table exists, and a deploy gate must work with `SELECT` alone.
///
/// # Errors
/// As [`run_migrations`].
pub async fn pending_migrations_on(
    conn: &mut AsyncPgConnection,
) -> Result<Vec<String>, StoreError> {
    let present = diesel::sql_query(BOOKKEEPING_PRESENT);
    let present = match diesel_async::RunQueryDsl::get_result::<Flag>(present, conn).await {
        Ok(present) => present,
        // A session terminated meanwhile is "unavailable", not a broken database.
        Err(e) => return Err(super::error::classify_query_error(conn, e).await),
    };
    let applied: Vec<String> = if present.flag {
        let versions = diesel::sql_query(APPLIED_VERSIONS);
        match diesel_async::RunQueryDsl::load::<Version>(versions, conn).await {
            Ok(rows) => rows.into_iter().map(|row| row.version).collect(),
            Err(e) => return Err(super::error::classify_query_error(conn, e).await),
        }
    } else {
        Vec::new()
    };
    not_applied(&applied)
}

/// Whether diesel's bookkeeping table exists (a plain `SELECT`, see [`pending_migrations_on`]).
const BOOKKEEPING_PRESENT: &str =
    "SELECT to_regclass('__diesel_schema_migrations') IS NOT NULL AS flag";

/// The versions recorded as applied in diesel's bookkeeping table.
const APPLIED_VERSIONS: &str = "SELECT version::text AS version FROM __diesel_schema_migrations";

/// The embedded migrations' versions not in `applied`, oldest first.
fn not_applied(applied: &[String]) -> Result<Vec<String>, StoreError> {
    let mut pending: Vec<String> = MigrationSource::<Pg>::migrations(&MIGRATIONS)
        .map_err(StoreError::Backend)?
        .iter()
        .map(|m| m.name().version().to_string())
        .filter(|version| !applied.contains(version))
        .collect();
    pending.sort();
    Ok(pending)
}

/// The connection diesel's (synchronous) migration harness runs on.
pub type Harness = AsyncConnectionWrapper<AsyncPgConnection>;

/// Apply every pending migration on `harness` (for `layout` when one is given and the
/// migration that makes it is still pending), serialised with every other migrator by
/// the migration lock, waited for at most `lock_wait`. The one implementation behind
/// [`run_migrations`] and `idem-cli migrate` (which brings its own connection, with its
/// timeouts and session settings). Blocking: call it where blocking is allowed, inside a
/// tokio runtime's context (`spawn_blocking`, or a thread that entered one).
///
/// # Errors
/// [`StoreError::Unavailable`] when another session held the lock for `lock_wait`, or the
/// session was lost (terminated, the server shutting down: the running migration was rolled
/// back with it); [`StoreError::Backend`] when a migration fails (rolled back, nothing
/// half-applied).
pub fn apply_pending_migrations(
    harness: &mut Harness,
    layout: Option<Layout>,
    lock_wait: Duration,
) -> Result<Vec<String>, StoreError> {
    let result = take_lock(harness, lock_wait).and_then(|()| {
        let result = apply_locked(harness, layout);
        // Closing the connection would release the lock too; the caller may use it again.
        let _ = harness.batch_execute(&format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"));
        result
    });
    result.map_err(|error| unavailable_if_gone(harness, error))
}

/// A failure whose session is gone is "try again later", not a broken migration. An
/// administrator's `pg_terminate_backend` or a server shutting down (SQLSTATE 57P01-57P03)
/// reaches diesel-async as an unknown error, which the classification by error alone takes
/// for a bug; so, as the store does after an unknown error, the connection is asked with one
/// trivial statement. The server just answered (with the error), so it does not hang here.
fn unavailable_if_gone(harness: &mut Harness, error: StoreError) -> StoreError {
    match error {
        StoreError::Backend(source) if harness.batch_execute("SELECT 1").is_err() => {
            StoreError::Unavailable(source)
        }
        other => other,
    }
}

/// [`pending_migrations_on`] on the blocking harness, with the same two plain `SELECT`s.
fn pending_on_harness(harness: &mut Harness) -> Result<Vec<String>, StoreError> {
    let classify = super::error::classify_error;
    let present = diesel::sql_query(BOOKKEEPING_PRESENT)
        .get_result::<Flag>(harness)
        .map_err(classify)?;
    let applied: Vec<String> = if present.flag {
        diesel::sql_query(APPLIED_VERSIONS)
            .load::<Version>(harness)
            .map_err(classify)?
            .into_iter()
            .map(|row| row.version)
            .collect()
    } else {
        Vec::new()
    };
    not_applied(&applied)
}

fn apply_locked(harness: &mut Harness, layout: Option<Layout>) -> Result<Vec<String>, StoreError> {
    // Nothing pending: done, without diesel's harness, whose first statement is `CREATE TABLE
    // IF NOT EXISTS __diesel_schema_migrations`. PostgreSQL refuses that to a role without
    // `CREATE` on the schema even when the table exists, so an app started with
    // `run_migrations` under a least-privileged role (only the grants the request path needs)
    // failed at start-up on a schema that was already current.
    if pending_on_harness(harness)?.is_empty() {
        return Ok(Vec::new());
    }
    if let Some(layout) = layout {
        // Read by the migration that makes the layout, when it runs.
        harness
            .batch_execute(&layout.settings())
            .map_err(super::error::classify_error)?;
    }
    harness
        .run_pending_migrations(MIGRATIONS)
        .map(|versions| versions.iter().map(|v| v.to_string()).collect())
        .map_err(|error| match error.downcast::<diesel::result::Error>() {
            // A lost connection is "try again later", not a broken migration.
            Ok(error) => super::error::classify_error(*error),
            Err(error) => StoreError::Backend(error),
        })
}

fn no_connection() -> StoreError {
    StoreError::unavailable(format!(
        "no database connection within {}s (migrations not run)",
        MIGRATION_CONNECT_TIMEOUT.as_secs()
    ))
}

async fn with_harness(url: &str, layout: Option<Layout>) -> Result<Vec<String>, StoreError> {
    with_harness_within(migration_target(url)?, layout, MIGRATION_LIMIT).await
}

/// [`with_harness`] on `target`, failing with [`StoreError::Unavailable`] after `limit`. The
/// migration thread is then left to its end: blocked on a silent server, it ends with the
/// process or when the connection does; what it applies meanwhile stays applied.
async fn with_harness_within(
    target: ConnectTarget,
    layout: Option<Layout>,
    limit: Duration,
) -> Result<Vec<String>, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("idempotency-migrations".into())
        .spawn(move || {
            // The receiver only goes away when the caller stopped waiting; nothing to report.
            let _ = tx.send(migrate_on_this_thread(target, layout));
        })
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
    tokio::time::timeout(limit, rx)
        .await
        .map_err(|_| {
            StoreError::unavailable(format!(
                "the migrations did not finish within {}s (the database stopped answering, or \
                 a migration waits for it): those that completed stay applied; run them again",
                limit.as_secs()
            ))
        })?
        .map_err(|_| StoreError::Backend("the migration thread panicked".into()))?
}

fn migrate_on_this_thread(
    target: ConnectTarget,
    layout: Option<Layout>,
) -> Result<Vec<String>, StoreError> {
    // One worker thread drives the connection's socket while this thread blocks in the
    // harness; `AsyncConnectionWrapper` picks up this runtime's handle because we entered it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
    let conn = runtime
        .block_on(async { tokio::time::timeout(MIGRATION_CONNECT_TIMEOUT, target.connect()).await })
        .map_err(|_| no_connection())?
        .map_err(classify_connection_error)?;
    let _entered = runtime.enter();
    let mut harness: Harness = AsyncConnectionWrapper::from(conn);
    apply_pending_migrations(&mut harness, layout, MIGRATION_LOCK_WAIT)
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    flag: bool,
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

/// `pg_try_advisory_lock` until it succeeds or `wait` passed. A blocking `pg_advisory_lock`
/// would wait for as long as the holder lives (a hung deploy step, a forgotten psql session),
/// hanging whoever migrates next; polling also tells "someone else holds it" apart from other
/// failures without reading the server's (localised) error text.
fn take_lock(harness: &mut Harness, wait: Duration) -> Result<(), StoreError> {
    let deadline = crate::config::saturating_deadline(Instant::now(), wait);
    loop {
        let row = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS flag")
            .bind::<BigInt, _>(MIGRATION_LOCK_KEY)
            .get_result::<Flag>(harness)
            .map_err(super::error::classify_error)?;
        if row.flag {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StoreError::unavailable(format!(
                "another migration holds the lock (advisory lock {MIGRATION_LOCK_KEY}: an \
                 application migrating at start-up, or another idem-cli migrate) and did not \
                 finish within {}s; migrations not run: run it again once that one finished",
                wait.as_secs()
            )));
        }
        std::thread::sleep(LOCK_POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts the connection and then says nothing (frozen, or a middlebox that
    /// stopped forwarding): the call fails within its limit instead of hanging (review,
    /// 2026-12-06). Here the connect bound is the longer one, so only the overall limit can
    /// end the call.
    #[tokio::test]
    async fn a_silent_server_fails_the_migrations_within_their_limit() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = std::thread::spawn(move || listener.accept().map(|(socket, _)| socket));
        let url = format!("postgres://u:s3cr3t@127.0.0.1:{port}/db?connect_timeout=60");
        let target = migration_target(&url).unwrap();
        let started = Instant::now();
        let result = with_harness_within(target, None, Duration::from_millis(1500)).await;
        let took = started.elapsed();
        match result {
            Err(StoreError::Unavailable(e)) => {
                assert!(e.to_string().contains("did not finish within"), "{e}");
                assert!(!e.to_string().contains("s3cr3t"), "{e}");
            }
            other => panic!("{other:?}"),
        }
        assert!(took < Duration::from_secs(10), "{took:?}");
        drop(held);
    }

    #[test]
    fn a_migration_session_has_statement_and_lock_timeouts() {
        let target = migration_target("postgres://u@localhost/db").unwrap();
        let options = target.options().unwrap_or_default();
        assert!(options.contains("statement_timeout=120000"), "{options}");
        assert!(options.contains("lock_timeout=5000"), "{options}");
    }

    #[test]
    fn the_layout_migration_is_the_partitioned_layout_one() {
        let migrations = MigrationSource::<Pg>::migrations(&MIGRATIONS).unwrap();
        let names: Vec<String> = migrations
            .iter()
            .filter(|m| m.name().version().to_string() == LAYOUT_MIGRATION_VERSION)
            .map(|m| m.name().to_string())
            .collect();
        assert_eq!(names, ["2026-12-01-000005_partitioned_layout"]);
    }
}
