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
//! is bounded by 30 s and the wait for the lock by 2 minutes, after
//! which the call fails with [`StoreError::Unavailable`] saying why (a start-up that would
//! otherwise hang behind a stuck migration fails visibly and can be retried).

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Bool};
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
/// `idem-cli migrate` takes the same key.
const MIGRATION_LOCK_KEY: i64 = 0x6964_656d_6d69_6772;

/// The longest [`run_migrations`] and friends wait to open their connection.
const MIGRATION_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

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
/// [`StoreError::Unavailable`] when the database cannot be reached within 30 s, or another
/// session held the migration lock for longer than 2 minutes; [`StoreError::Backend`] when a migration fails (it is rolled back; nothing half-applied remains) or the URL is bad.
pub async fn run_migrations(url: &str) -> Result<Vec<String>, StoreError> {
    with_harness(url, |harness| {
        harness
            .run_pending_migrations(MIGRATIONS)
            .map(|versions| versions.iter().map(|v| v.to_string()).collect())
    })
    .await
}

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
    let settings = format!(
        "SET idempotency.layout = 'partitioned'; SET idempotency.partition_interval = '{}'",
        interval.as_str()
    );
    with_harness(url, move |harness| {
        harness.batch_execute(&settings)?;
        harness
            .run_pending_migrations(MIGRATIONS)
            .map(|versions| versions.iter().map(|v| v.to_string()).collect())
    })
    .await
}

/// The versions of the embedded migrations not yet applied to the database at `url` (empty
/// when the schema is current). For deploy gates such as `idem-cli migrate --check`.
///
/// # Errors
/// As [`run_migrations`].
pub async fn pending_migrations(url: &str) -> Result<Vec<String>, StoreError> {
    with_harness(url, |harness| {
        harness.pending_migrations(MIGRATIONS).map(|pending| {
            pending
                .iter()
                .map(|m| m.name().version().to_string())
                .collect()
        })
    })
    .await
}

type Harness = AsyncConnectionWrapper<AsyncPgConnection>;
type HarnessError = Box<dyn std::error::Error + Send + Sync + 'static>;

async fn with_harness<F>(url: &str, work: F) -> Result<Vec<String>, StoreError>
where
    F: FnOnce(&mut Harness) -> Result<Vec<String>, HarnessError> + Send + 'static,
{
    let target = ConnectTarget::parse(url, None).map_err(|e| StoreError::Backend(Box::new(e)))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("idempotency-migrations".into())
        .spawn(move || {
            // The receiver only goes away when the caller stopped waiting; nothing to report.
            let _ = tx.send(migrate_on_this_thread(target, work));
        })
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
    rx.await
        .map_err(|_| StoreError::Backend("the migration thread panicked".into()))?
}

fn migrate_on_this_thread<F>(target: ConnectTarget, work: F) -> Result<Vec<String>, StoreError>
where
    F: FnOnce(&mut Harness) -> Result<Vec<String>, HarnessError>,
{
    // One worker thread drives the connection's socket while this thread blocks in the
    // harness; `AsyncConnectionWrapper` picks up this runtime's handle because we entered it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| StoreError::Backend(Box::new(e)))?;
    let conn = runtime
        .block_on(async { tokio::time::timeout(MIGRATION_CONNECT_TIMEOUT, target.connect()).await })
        .map_err(|_| {
            StoreError::unavailable(format!(
                "no database connection within {}s (migrations not run)",
                MIGRATION_CONNECT_TIMEOUT.as_secs()
            ))
        })?
        .map_err(classify_connection_error)?;
    let _entered = runtime.enter();
    let mut harness: Harness = AsyncConnectionWrapper::from(conn);
    take_lock(&mut harness)?;
    let result = work(&mut harness).map_err(StoreError::Backend);
    // Closing the connection would release the lock too; unlocking explicitly keeps the
    // session clean should the wrapper ever be pooled.
    let _ = harness.batch_execute(&format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"));
    drop(harness);
    result
}

#[derive(QueryableByName)]
struct Locked {
    #[diesel(sql_type = Bool)]
    locked: bool,
}

/// `pg_try_advisory_lock` until it succeeds or [`MIGRATION_LOCK_WAIT`] passed. A blocking
/// `pg_advisory_lock` would wait for as long as the holder lives (a hung deploy step, a
/// forgotten psql session), hanging whoever migrates next.
fn take_lock(harness: &mut Harness) -> Result<(), StoreError> {
    let deadline = Instant::now() + MIGRATION_LOCK_WAIT;
    loop {
        let row = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS locked")
            .bind::<BigInt, _>(MIGRATION_LOCK_KEY)
            .get_result::<Locked>(harness)
            .map_err(super::error::classify_error)?;
        if row.locked {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StoreError::unavailable(format!(
                "another migration holds the lock (advisory lock {MIGRATION_LOCK_KEY}) and did \
                 not finish within {}s; migrations not run",
                MIGRATION_LOCK_WAIT.as_secs()
            )));
        }
        std::thread::sleep(LOCK_POLL);
    }
}
