//! Throwaway PostgreSQL clusters: `initdb` + `pg_ctl` in a temporary directory on a free port.
//!
//! Home-made on purpose: no crate starts a real PostgreSQL from the distribution's binaries
//! with the knobs the fault tests need (extra `postgresql.conf` lines and files such as TLS
//! keys, running as an unprivileged user when the tests run as root, a watchdog that cleans
//! up when the test process is killed); embedded-server crates download their own binaries,
//! which this machine and CI cannot.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::database::unique_name;

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

/// For a test that needs a throwaway cluster and found no `initdb`/`pg_ctl`: says it is
/// skipped, so the caller returns, unless `IDEM_E2E_REQUIRE_CLUSTER` is set. CI sets it (and
/// installs the server binaries): there a missing binary is a broken runner, and the TLS and
/// harness tests must fail rather than pass having run nothing.
pub fn skip_without_binaries(test: &str) {
    if std::env::var_os("IDEM_E2E_REQUIRE_CLUSTER").is_some() {
        panic!(
            "{test}: initdb/pg_ctl not found, and IDEM_E2E_REQUIRE_CLUSTER is set: install \
             PostgreSQL's server binaries (Debian: postgresql)"
        );
    }
    eprintln!("SKIPPED {test}: initdb/pg_ctl are not installed");
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
        // `synchronous_commit` stays on: with it off, a commit is acknowledged before its WAL
        // leaves the server's memory, so a server crash (`pg_ctl -m immediate`, a killed
        // backend) loses the last acknowledged writes, e.g. a stored response whose reservation
        // was flushed just before: the retry then gets 409 until the lease ends and runs the
        // handler again (test `a_crash_after_the_response_was_stored_keeps_it`). `fsync = off`
        // only matters if the machine itself goes down: WAL written to the kernel survives the
        // server's processes.
        let mut extra = String::from(
            "\n# idempotency-e2e throwaway cluster\nfsync = off\nsynchronous_commit = on\n\
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
        // The postmaster, read before the stop: if `pg_ctl stop` fails or runs out of time (a
        // loaded machine), the server would outlive its deleted data directory, and the
        // watchdog, which finds servers by that directory's `postmaster.pid`, would never stop
        // it (review of the test harness, 2026-12-06).
        let pid_file = self.data_dir.join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file).ok().and_then(|text| {
            text.lines()
                .next()
                .and_then(|line| line.trim().parse::<u32>().ok())
        });
        self.stop();
        if let Some(pid) = pid.filter(|_| pid_file.exists()) {
            let _ = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
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
