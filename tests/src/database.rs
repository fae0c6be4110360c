//! Per-test databases on the server the tests use ([`server_url`]): created fresh, migrated,
//! dropped afterwards.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres;
use idempotency_actix::store::StoreError;

use crate::block_on_fresh_thread;
use crate::cluster::{ClusterError, TempCluster};
use crate::urls::{redact, with_database};

/// The default local server tried when `DATABASE_URL` is not set.
pub const LOCAL_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// A database created for one test, on the server of [`server_url`]. Dropping it drops the
/// database (terminating any connection still open to it).
pub struct TestDb {
    /// Connection URL of this database (same server, user and options as [`server_url`]).
    pub url: String,
    /// The database name (`idem_test_{pid}_{counter}_{random}`).
    pub name: String,
    admin_url: String,
}

impl std::fmt::Debug for TestDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDb").field("name", &self.name).finish()
    }
}

impl TestDb {
    /// A fresh database with the embedded migrations applied
    /// (`idempotency_actix::store::postgres::run_migrations`). With
    /// `IDEM_TEST_LAYOUT=partitioned` in the environment it gets the time-partitioned layout
    /// instead (hourly), with `IDEM_TEST_LAYOUT=rotated` the rotated one (the default period),
    /// so any suite can be run against either layout unchanged.
    pub async fn new() -> TestDb {
        let db = Self::new_unmigrated().await;
        if let Err(e) = migrate_in_test_layout(&db.url).await {
            panic!("migrating test database {}: {e}", db.name);
        }
        db
    }

    /// A fresh database provisioned with the rotated layout
    /// (`idempotency_actix::store::postgres::run_migrations_rotated`).
    pub async fn new_rotated(period: Duration) -> TestDb {
        let db = Self::new_unmigrated().await;
        if let Err(e) = postgres::run_migrations_rotated(&db.url, period).await {
            panic!("migrating test database {} (rotated): {e}", db.name);
        }
        db
    }

    /// A fresh database provisioned with the time-partitioned layout
    /// (`idempotency_actix::store::postgres::run_migrations_partitioned`).
    pub async fn new_partitioned(interval: postgres::PartitionInterval) -> TestDb {
        let db = Self::new_unmigrated().await;
        if let Err(e) = postgres::run_migrations_partitioned(&db.url, interval).await {
            panic!("migrating test database {} (partitioned): {e}", db.name);
        }
        db
    }

    /// A fresh, empty database (no `idempotency_keys` table).
    pub async fn new_unmigrated() -> TestDb {
        let admin_url = server_url();
        let name = unique_name();
        let sql = format!("CREATE DATABASE \"{name}\"");
        let result = admin_statement(&admin_url, &sql).await;
        if let Err(e) = result {
            panic!(
                "creating test database {name} on {}: {e}",
                redact(&admin_url)
            );
        }
        TestDb {
            url: with_database(&admin_url, &name),
            name,
            admin_url,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        // Its own thread and runtime: works whether the test runs on tokio, actix or no
        // runtime at all, and even while the test's runtime is shutting down.
        let result = block_on_fresh_thread(async move { admin_statement(&admin_url, &sql).await });
        match result {
            Some(Ok(())) => {}
            Some(Err(e)) => eprintln!("warning: could not drop test database {}: {e}", self.name),
            None => eprintln!("warning: could not drop test database {}", self.name),
        }
    }
}

/// The server the tests use (see the crate docs for the order of preference), as a URL of its
/// maintenance database. Resolved once per process.
///
/// # Panics
/// When no server is configured or reachable and no PostgreSQL binaries are installed.
pub fn server_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(resolve_server_url).clone()
}

fn resolve_server_url() -> String {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        if !url.trim().is_empty() {
            return url;
        }
    }
    // IDEM_E2E_SKIP_LOCAL=1 forces the throwaway cluster (used to test that path).
    let skip_local = std::env::var("IDEM_E2E_SKIP_LOCAL").is_ok_and(|v| v == "1");
    if !skip_local && can_connect(LOCAL_SERVER_URL) {
        return LOCAL_SERVER_URL.to_owned();
    }
    match TempCluster::start(&[], &[]) {
        Ok(cluster) => {
            let url = cluster.url();
            // Lives for the whole process; the watchdog stops it after the process exits.
            std::mem::forget(cluster);
            url
        }
        Err(ClusterError::NotInstalled) => panic!(
            "no PostgreSQL for the tests: DATABASE_URL is not set, nothing answers at \
             127.0.0.1:5432, and initdb/pg_ctl are not on PATH or under \
             /usr/lib/postgresql/*/bin. Install the PostgreSQL server (e.g. `apt-get install \
             postgresql`) or set DATABASE_URL to a server where the user may CREATE DATABASE."
        ),
        Err(ClusterError::Failed(why)) => {
            panic!("no PostgreSQL for the tests: starting a throwaway cluster failed: {why}")
        }
    }
}

fn can_connect(url: &str) -> bool {
    let url = url.to_owned();
    let attempt = block_on_fresh_thread(async move {
        tokio::time::timeout(Duration::from_secs(3), postgres::establish(&url))
            .await
            .is_ok_and(|r| r.is_ok())
    });
    attempt.unwrap_or(false)
}

pub(crate) fn unique_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    // RandomState is seeded randomly per process: a cheap source of entropy without a crate.
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u32(nanos);
    let random = h.finish() & 0xffff_ffff;
    format!("idem_test_{}_{n}_{random:08x}", std::process::id())
}

async fn admin_statement(admin_url: &str, sql: &str) -> Result<(), String> {
    let mut conn = postgres::establish(admin_url)
        .await
        .map_err(|e| e.to_string())?;
    diesel::sql_query(sql)
        .execute(&mut conn)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// This repository's `migrations/` folder.
pub fn migrations_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations")
}

/// The migrations of [`migrations_dir`], oldest first.
pub fn migration_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(migrations_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Apply the first `upto` migrations to the (empty) database at `url` by hand, each `up.sql` in
/// a transaction, with diesel's bookkeeping: the schema an older release left.
pub async fn migrate_by_hand(url: &str, upto: usize) {
    use diesel_async::SimpleAsyncConnection;
    let mut conn = postgres::establish(url).await.unwrap();
    conn.batch_execute(
        "CREATE TABLE __diesel_schema_migrations (version VARCHAR(50) PRIMARY KEY NOT NULL, \
         run_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    )
    .await
    .unwrap();
    for name in migration_names().iter().take(upto) {
        let sql = std::fs::read_to_string(migrations_dir().join(name).join("up.sql")).unwrap();
        conn.batch_execute(&format!("BEGIN; {sql}; COMMIT;"))
            .await
            .unwrap();
        let version = name.split('_').next().unwrap().replace('-', "");
        conn.batch_execute(&format!(
            "INSERT INTO __diesel_schema_migrations (version) VALUES ('{version}')"
        ))
        .await
        .unwrap();
    }
}

/// The layout the run asks for with `IDEM_TEST_LAYOUT` (`partitioned`: hourly partitions;
/// `rotated`: the default period), or `None` for the plain layout.
pub fn test_layout() -> Option<postgres::Layout> {
    match std::env::var("IDEM_TEST_LAYOUT").as_deref() {
        Ok("partitioned") => Some(postgres::Layout::Partitioned(
            postgres::PartitionInterval::Hourly,
        )),
        Ok("rotated") => Some(postgres::Layout::Rotated {
            period: postgres::DEFAULT_ROTATION_PERIOD,
        }),
        Ok("plain") | Ok("") | Err(_) => None,
        Ok(other) => panic!("IDEM_TEST_LAYOUT={other:?}: expected plain, partitioned or rotated"),
    }
}

/// Provision the database at `url` (a throwaway cluster's, say) in the layout the run asks for,
/// as [`TestDb::new`] does ([`test_layout`]).
pub async fn migrate_in_test_layout(url: &str) -> Result<Vec<String>, StoreError> {
    match test_layout() {
        None => postgres::run_migrations(url).await,
        Some(postgres::Layout::Partitioned(interval)) => {
            postgres::run_migrations_partitioned(url, interval).await
        }
        Some(postgres::Layout::Rotated { period }) => {
            postgres::run_migrations_rotated(url, period).await
        }
    }
}

/// For a test of the hourly partitioned layout, whose partitions are placed by the hour it runs
/// in ("the current hour + 3" made ahead, rows seeded hours ahead): returns once at least
/// `margin` is left before the next full hour, sleeping across the boundary when less is. The
/// hour must not change mid-test (a CI run crossed it at 08:00 UTC, 2026-12-06: one partition
/// more than expected). By this process's clock, which a server on this host shares.
pub async fn clear_of_the_hour(margin: Duration) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let into_hour = Duration::from_secs(now.as_secs() % 3600)
        + Duration::from_nanos(u64::from(now.subsec_nanos()));
    let left = Duration::from_secs(3600).saturating_sub(into_hour);
    if left < margin {
        tokio::time::sleep(left + Duration::from_secs(1)).await;
    }
}
