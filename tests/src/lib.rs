//! Test harness for the end-to-end tests: a PostgreSQL server to test against, and a fresh
//! database per test that is dropped afterwards.
//!
//! Where the server comes from, in order ([`server_url`]):
//! 1. `DATABASE_URL`, when set (any database on the server; test databases are created next to
//!    it, so the role needs `CREATEDB`).
//! 2. `postgres://postgres@127.0.0.1:5432/postgres`, when something answers there.
//! 3. A throwaway cluster: `initdb` + `pg_ctl` from `PATH` or `/usr/lib/postgresql/*/bin`, in a
//!    temporary directory, on a free port, stopped and deleted when the test process exits.
//! 4. Otherwise a panic naming what to install.
//!
//! `IDEM_E2E_SKIP_LOCAL=1` skips step 2 (to exercise the throwaway cluster on a machine that
//! has a local server).
//!
//! ```no_run
//! # async fn demo() {
//! let db = idempotency_e2e::TestDb::new().await; // created and migrated
//! let store = idempotency_actix::store::PostgresStore::connect(&db.url).await.unwrap();
//! # let _ = store;
//! } // dropped here: DROP DATABASE ... WITH (FORCE)
//! ```

use std::future::Future;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres;

pub mod http;
pub mod proc;
pub mod proxy;
pub mod raw_http;
pub mod records;
pub mod redis_server;
pub mod server;

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
    /// (`idempotency_actix::store::postgres::run_migrations`).
    pub async fn new() -> TestDb {
        let db = Self::new_unmigrated().await;
        if let Err(e) = postgres::run_migrations(&db.url).await {
            panic!("migrating test database {}: {e}", db.name);
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

/// `url` with its database replaced by `database` (URL or `key=value` form), where the driver
/// reads it (the library's `with_dbname`), so passwords holding `/`, `?` or `#` survive.
pub fn with_database(url: &str, database: &str) -> String {
    postgres::with_dbname(url, database)
}

/// The connection string for messages, password hidden: the library's one redaction.
fn redact(url: &str) -> String {
    postgres::redact(url)
}

fn unique_name() -> String {
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

/// Run `future` to completion on a new thread with its own current-thread runtime, so it works
/// from any context (inside a runtime, in `Drop`, without a runtime). `None` if it panicked.
pub fn block_on_fresh_thread<F>(future: F) -> Option<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()
            .map(|rt| rt.block_on(future))
    })
    .join()
    .ok()
    .flatten()
}

// ---------------------------------------------------------------------------------------------
// Throwaway clusters

/// Why a throwaway cluster could not be started.
#[derive(Debug)]
pub enum ClusterError {
    /// `initdb`/`pg_ctl` were not found.
    NotInstalled,
    /// They were found, but something failed (the message includes the server log).
    Failed(String),
}

impl std::fmt::Display for ClusterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterError::NotInstalled => f.write_str("initdb/pg_ctl not found"),
            ClusterError::Failed(why) => f.write_str(why),
        }
    }
}

/// A PostgreSQL cluster in a temporary directory on a free port (trust authentication, user
/// `postgres`, listening on 127.0.0.1 only). Stopped and deleted on drop, and by a watchdog
/// process if this process dies without dropping it.
pub struct TempCluster {
    /// The TCP port it listens on (127.0.0.1).
    pub port: u16,
    /// Its data directory (`postgresql.conf`, the log `server.log`, extra files).
    pub data_dir: PathBuf,
    root: PathBuf,
    bin_dir: PathBuf,
    run_as: Option<String>,
}

impl std::fmt::Debug for TempCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TempCluster")
            .field("port", &self.port)
            .field("data_dir", &self.data_dir)
            .finish()
    }
}

impl TempCluster {
    /// Start a cluster. `conf` lines are appended to `postgresql.conf`; `files` are written
    /// into the data directory first (mode 0600, owned by the server's user), e.g. a TLS key
    /// and certificate referenced from `conf` as `ssl_key_file = 'server.key'`.
    pub fn start(conf: &[&str], files: &[(&str, &[u8])]) -> Result<TempCluster, ClusterError> {
        let bin_dir = find_bin_dir().ok_or(ClusterError::NotInstalled)?;
        let run_as = unprivileged_user()?;
        let mut last_error = String::new();
        // A free port can be taken between probing and binding; try a few.
        for _ in 0..3 {
            match Self::try_start(&bin_dir, run_as.clone(), conf, files) {
                Ok(cluster) => return Ok(cluster),
                Err(e) => last_error = e,
            }
        }
        Err(ClusterError::Failed(last_error))
    }

    fn try_start(
        bin_dir: &Path,
        run_as: Option<String>,
        conf: &[&str],
        files: &[(&str, &[u8])],
    ) -> Result<TempCluster, String> {
        let root = std::env::temp_dir().join(format!("idem-pg-{}", unique_name()));
        let data_dir = root.join("data");
        std::fs::create_dir_all(&root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
        if let Some(user) = &run_as {
            run(Command::new("chown").arg(user).arg(&root))?;
        }
        let port = free_port()?;
        let cluster = TempCluster {
            port,
            data_dir: data_dir.clone(),
            root: root.clone(),
            bin_dir: bin_dir.to_owned(),
            run_as,
        };
        cluster.spawn_watchdog();
        run(cluster.pg_command("initdb").arg("-D").arg(&data_dir).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ]))?;
        let mut extra = String::from(
            "\n# idempotency-e2e throwaway cluster\nfsync = off\nsynchronous_commit = off\n\
             full_page_writes = off\nmax_connections = 200\n",
        );
        for line in conf {
            extra.push_str(line);
            extra.push('\n');
        }
        append(&data_dir.join("postgresql.conf"), &extra)?;
        for (name, content) in files {
            let path = data_dir.join(name);
            std::fs::write(&path, content).map_err(|e| format!("write {}: {e}", path.display()))?;
            run(Command::new("chmod").arg("600").arg(&path))?;
            if let Some(user) = &cluster.run_as {
                run(Command::new("chown").arg(user).arg(&path))?;
            }
        }
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -k {}",
            data_dir.display()
        );
        let log = data_dir.join("server.log");
        let started = cluster
            .pg_command("pg_ctl")
            .arg("-D")
            .arg(&data_dir)
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "60", "-o", &options, "start"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        match started {
            Ok(status) if status.success() => Ok(cluster),
            other => {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                Err(format!("pg_ctl start: {other:?}; server log:\n{log}"))
            }
        }
    }

    /// URL of its `postgres` database as user `postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn pg_command(&self, program: &str) -> Command {
        let program = self.bin_dir.join(program);
        match &self.run_as {
            // initdb and the server refuse to run as root.
            Some(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(program);
                c
            }
            None => Command::new(program),
        }
    }

    /// A detached shell that waits for this process to exit, then stops the server and deletes
    /// the directory: cleanup even when the test process is killed or never drops the cluster.
    fn spawn_watchdog(&self) {
        let script = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 1; done; \
             if [ -f '{data}/postmaster.pid' ]; then \
               kill -INT \"$(head -n1 '{data}/postmaster.pid')\" 2>/dev/null; \
               for i in $(seq 1 30); do [ -f '{data}/postmaster.pid' ] || break; sleep 1; done; \
             fi; rm -rf '{root}'",
            pid = std::process::id(),
            data = self.data_dir.display(),
            root = self.root.display(),
        );
        let _ = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
    }

    /// Stop the server now (fast shutdown), keeping the directory. Returns when it is down.
    pub fn stop(&self) {
        let _ = self
            .pg_command("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-m", "fast", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn find_bin_dir() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if has_both(&dir) {
                return Some(dir);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// `None` when not root; otherwise the user to run the server as (`postgres`, else `nobody`).
fn unprivileged_user() -> Result<Option<String>, ClusterError> {
    let uid = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| ClusterError::Failed(format!("id -u: {e}")))?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return Ok(None);
    }
    for user in ["postgres", "nobody"] {
        let exists = Command::new("id")
            .arg("-u")
            .arg(user)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if exists {
            return Ok(Some(user.to_owned()));
        }
    }
    Err(ClusterError::Failed(
        "running as root and no unprivileged user (postgres, nobody) to run initdb as".into(),
    ))
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

fn run(command: &mut Command) -> Result<(), String> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{command:?}: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{command:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

fn append(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("append to {}: {e}", path.display()))
}

/// Wait until `check` returns true or `timeout` passes; returns the last result.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_in_urls() {
        assert_eq!(
            with_database("postgres://u:p@h:1/postgres?sslmode=require", "x"),
            "postgres://u:p@h:1/x?sslmode=require"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
        assert_eq!(
            with_database("postgres://u:p/w?d@h:1/postgres?sslmode=require", "x"),
            "postgres://u:p/w?d@h:1/x?sslmode=require"
        );
        assert_eq!(
            with_database("host=h user=u", "x"),
            "host=h user=u dbname='x'"
        );
    }

    /// Guards issue 9 item 5: the harness had a third redaction, with its own rules (it
    /// printed everything after the first `:` of a password holding an `@`-less `/`...).
    #[test]
    fn passwords_are_redacted() {
        for url in [
            "postgres://u:HUNTER/ALPHA@h/db",
            "postgres://u:HUNTER?ALPHA@h/db",
            "postgres://u:HUNTER#ALPHA@h/db",
            "host=h password='HUNTER ALPHA'",
            "postgres://u:HUNTER?ALPHA@h:x/db",
        ] {
            let shown = redact(url);
            assert!(
                !shown.contains("HUNTER") && !shown.contains("ALPHA"),
                "{shown}"
            );
        }
        assert_eq!(
            redact("postgres://u:secret@h/db"),
            "postgres://u:***@h:5432/db"
        );
    }
}
