//! Real processes for the fault tests: the `payments` example as a child process (killed on
//! drop), and restarting a throwaway PostgreSQL cluster ([`crate::TempCluster`]) in place.
//!
//! ```no_run
//! use idempotency_e2e::proc::PaymentsApp;
//! let db = idempotency_e2e::block_on_fresh_thread(idempotency_e2e::TestDb::new()).unwrap();
//! let app = PaymentsApp::start(&[("DATABASE_URL", db.url.as_str())]);
//! let stats = app.stats();
//! assert_eq!(stats.total, 0);
//! ```

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use crate::raw_http::{free_port, send_once, Request};
use crate::TempCluster;

/// How long the example may take to start answering.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// How many free ports [`PaymentsApp::start`] tries: a port can be taken between
/// [`free_port`] and the example's bind (another test's server got it first).
const START_ATTEMPTS: usize = 5;

/// The process's peak resident memory so far, in KiB (`VmHWM` in /proc: Linux):
/// what the CLI tests that a command streams read while it waits on their reader.
pub fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc status")
}

/// `idem-cli`, built next to the test binary (`target/<profile>/idem-cli`); built with
/// `cargo build -p idempotency-cli` first when it is not there (a test run alone with
/// `--test`).
pub fn idem_cli_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary inside target/<profile>/deps")
            .join("idem-cli");
        if !bin.is_file() {
            let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .expect("workspace root");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let _ = Command::new(cargo)
                .current_dir(workspace)
                .args(["build", "-p", "idempotency-cli"])
                .stdin(Stdio::null())
                .status();
        }
        assert!(
            bin.is_file(),
            "{} missing: cargo build -p idempotency-cli",
            bin.display()
        );
        bin
    })
    .clone()
}

/// Runs `idem-cli args...` as a process with `var` (`DATABASE_URL` or `REDIS_URL`) = `url` and
/// neither from the test's own environment; kills it and fails the test after 60 s.
pub fn run_idem_cli(var: &str, url: &str, args: &[&str]) -> Output {
    run_idem_cli_with_env(var, url, &[], args)
}

/// [`run_idem_cli`] with `env` set besides (e.g. `SSL_CERT_FILE`).
pub fn run_idem_cli_with_env(var: &str, url: &str, env: &[(&str, &str)], args: &[&str]) -> Output {
    let child = Command::new(idem_cli_binary())
        .env_remove("DATABASE_URL")
        .env_remove("REDIS_URL")
        .env(var, url)
        .envs(env.iter().copied())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idem-cli");
    // Read the output on another thread (a full pipe would block the CLI), with a deadline.
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out.expect("idem-cli output"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("idem-cli {args:?} hung (killed after 60 s)");
        }
    }
}

/// The `payments` example binary, built if it is missing or older than its sources.
///
/// `cargo test --workspace` builds examples before it runs any test, so normally this only
/// finds it next to the test binary (`target/<profile>/examples/payments`). `IDEM_PAYMENTS_BIN`
/// names another one: `scripts/coverage.sh` builds an instrumented example outside the test
/// harness's target directory and points the fault tests at it.
pub fn payments_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(bin) = std::env::var_os("IDEM_PAYMENTS_BIN") {
            let bin = PathBuf::from(bin);
            assert!(bin.is_file(), "IDEM_PAYMENTS_BIN={} missing", bin.display());
            return bin;
        }
        let exe = std::env::current_exe().expect("the test binary's path");
        // target/<profile>/deps/<test> -> target/<profile>/examples/payments
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("test binary inside target/<profile>/deps");
        let bin = profile_dir.join("examples").join("payments");
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("workspace root");
        let library = workspace.join("idempotency-actix");
        let newest_source = [library.join("src"), library.join("examples")]
            .iter()
            .map(|dir| newest_mtime(dir))
            .chain([mtime(&library.join("Cargo.toml"))])
            .max()
            .flatten();
        let built = mtime(&bin);
        let fresh = matches!((built, newest_source), (Some(b), Some(s)) if b >= s);
        if !fresh {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .current_dir(workspace)
                .args([
                    "build",
                    "-p",
                    "idempotency-actix",
                    "--example",
                    "payments",
                    "--features",
                    "test-suite redis redis-cluster",
                ])
                .stdin(Stdio::null())
                .status();
            if !matches!(status, Ok(s) if s.success()) && !bin.is_file() {
                panic!("building the payments example failed: {status:?}");
            }
        }
        assert!(bin.is_file(), "{} missing", bin.display());
        bin
    })
    .clone()
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn newest_mtime(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let m = if path.is_dir() {
            newest_mtime(&path)
        } else {
            mtime(&path)
        };
        newest = newest.max(m);
    }
    newest
}

/// The `payments` example running as a child process on a free loopback port. Killed (SIGKILL)
/// and reaped on drop; its stdout and stderr go to a log file that [`PaymentsApp::log`] reads.
pub struct PaymentsApp {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub addr: String,
    log_path: PathBuf,
}

impl std::fmt::Debug for PaymentsApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PaymentsApp")
            .field("pid", &self.child.id())
            .field("addr", &self.addr)
            .finish()
    }
}

/// What `GET /stats` reports.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// Handler executions in total.
    pub total: u64,
    /// Handler executions per key.
    pub per_key: HashMap<String, u64>,
}

impl PaymentsApp {
    /// Start the example with `env` (e.g. `DATABASE_URL`) and wait until it answers.
    pub fn start(env: &[(&str, &str)]) -> PaymentsApp {
        let mut failed = String::new();
        for _ in 0..START_ATTEMPTS {
            match Self::try_start_on(free_port(), env) {
                Ok(app) => return app,
                Err(why) => failed = why,
            }
        }
        panic!("{failed} ({START_ATTEMPTS} attempts)");
    }

    /// Start it on a given port (e.g. the port a killed instance used).
    pub fn start_on(port: u16, env: &[(&str, &str)]) -> PaymentsApp {
        Self::try_start_on(port, env).unwrap_or_else(|why| panic!("{why}"))
    }

    /// As [`PaymentsApp::start_on`], once: `Err` (with its log) when the example exited before
    /// it answered, which is how a port taken by another process shows.
    fn try_start_on(port: u16, env: &[(&str, &str)]) -> Result<PaymentsApp, String> {
        let bin = payments_binary();
        let addr = format!("127.0.0.1:{port}");
        let log_path = std::env::temp_dir().join(format!(
            "idem-payments-{}-{port}-{}.log",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        let log = File::create(&log_path).expect("log file");
        let mut command = Command::new(bin);
        command
            .env_remove("DATABASE_URL")
            .env_remove("REDIS_URL")
            .env("PAYMENTS_ADDR", &addr)
            .env("RUST_LOG", "info,idempotency_actix=debug")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command.spawn().expect("spawning the payments example");
        let mut app = PaymentsApp {
            child,
            addr,
            log_path,
        };
        app.wait_ready()?;
        Ok(app)
    }

    /// Until this instance answers `GET /stats` with its own process id (`x-process-id`):
    /// anything else on its port (another test's instance that took the port first) is not it.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        let pid = self.child.id();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "the payments example on {} exited early ({status}); log:\n{}",
                    self.addr,
                    self.log()
                ));
            }
            let answered_pid = send_once(
                &self.addr,
                &Request::get("/stats"),
                Duration::from_millis(500),
            )
            .ok()
            .filter(|r| r.status == 200)
            .and_then(|r| r.header("x-process-id"))
            .and_then(|id| id.parse::<u32>().ok());
            if answered_pid == Some(pid) {
                return Ok(());
            }
            if Instant::now() > deadline {
                panic!(
                    "the payments example did not answer within {START_TIMEOUT:?}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("port")
    }

    /// SIGKILL it and reap it. Idempotent.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Send it a signal by name (`TERM`, `INT`, `STOP`, ...) with `kill(1)`.
    ///
    /// # Panics
    /// When `kill` fails (the process is gone).
    pub fn signal(&self, name: &str) {
        let sent = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .stdin(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(sent, "kill -{name} {} failed", self.child.id());
    }

    /// Wait up to `within` for it to exit; its exit status, or `None` if it is still running.
    pub fn wait_for_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything it printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `GET /stats`.
    pub fn stats(&self) -> Stats {
        let response = send_once(&self.addr, &Request::get("/stats"), Duration::from_secs(10))
            .expect("GET /stats");
        assert_eq!(response.status, 200, "{}", response.describe());
        let json: serde_json::Value = serde_json::from_slice(&response.body).expect("stats JSON");
        Stats {
            total: json["handler_executions"].as_u64().unwrap_or(0),
            per_key: json["per_key"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

impl PaymentsApp {
    /// `GET /metrics`: the Prometheus text exposition.
    pub fn metrics(&self) -> String {
        let response = send_once(
            &self.addr,
            &Request::get("/metrics"),
            Duration::from_secs(10),
        )
        .expect("GET /metrics");
        assert_eq!(response.status, 200, "{}", response.describe());
        response.text()
    }
}

/// How long a test's teardown waits for the example to exit on SIGINT under coverage.
const PROFILE_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

impl PaymentsApp {
    /// Teardown under coverage (`LLVM_PROFILE_FILE` set): SIGINT, so actix shuts down, `main`
    /// returns and the instrumented process writes its counters, then SIGKILL after
    /// [`PROFILE_FLUSH_TIMEOUT`]. Without coverage, teardown is the plain SIGKILL of
    /// [`PaymentsApp::kill`]; tests that kill on purpose call that themselves.
    fn stop_for_teardown(&mut self) {
        if std::env::var_os("LLVM_PROFILE_FILE").is_some() && self.is_running() {
            let interrupted = Command::new("kill")
                .args(["-INT", &self.child.id().to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            let deadline = Instant::now() + PROFILE_FLUSH_TIMEOUT;
            while interrupted && self.is_running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.kill();
    }
}

impl Drop for PaymentsApp {
    fn drop(&mut self) {
        self.stop_for_teardown();
        let _ = std::fs::remove_file(&self.log_path);
    }
}

/// Start a stopped [`TempCluster`] again on the same port and data directory (after
/// [`TempCluster::stop`]); returns once it accepts connections.
///
/// # Panics
/// When `pg_ctl start` fails.
pub fn start_cluster_again(cluster: &TempCluster) {
    let bin_dir = pg_bin_dir().expect("initdb/pg_ctl");
    let options = format!(
        "-p {} -c listen_addresses=127.0.0.1 -k {}",
        cluster.port,
        cluster.data_dir.display()
    );
    let mut command = pg_command(&bin_dir.join("pg_ctl"));
    let status = command
        .arg("-D")
        .arg(&cluster.data_dir)
        .arg("-l")
        .arg(cluster.data_dir.join("server.log"))
        .args(["-w", "-t", "60", "-o", &options, "start"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    assert!(
        matches!(status, Ok(s) if s.success()),
        "pg_ctl start: {status:?}; log:\n{}",
        std::fs::read_to_string(cluster.data_dir.join("server.log")).unwrap_or_default()
    );
}

/// Stop the cluster immediately (`pg_ctl -m immediate`: no checkpoint, connections cut, as a
/// crash would), returning once it is down.
pub fn crash_cluster(cluster: &TempCluster) {
    let bin_dir = pg_bin_dir().expect("initdb/pg_ctl");
    let _ = pg_command(&bin_dir.join("pg_ctl"))
        .arg("-D")
        .arg(&cluster.data_dir)
        .args(["-m", "immediate", "-w", "-t", "30", "stop"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn pg_bin_dir() -> Option<PathBuf> {
    let has_both = |dir: &Path| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file();
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(dir) = std::env::split_paths(&path).find(|d| has_both(d)) {
            return Some(dir);
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// As the harness does: the server refuses to run as root, so run it as `postgres` (or
/// `nobody`) then.
fn pg_command(program: &Path) -> Command {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !is_root {
        return Command::new(program);
    }
    let user = ["postgres", "nobody"]
        .into_iter()
        .find(|user| {
            Command::new("id")
                .arg("-u")
                .arg(user)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .expect("an unprivileged user to run PostgreSQL as");
    let mut command = Command::new("runuser");
    command.args(["-u", user, "--"]).arg(program);
    command
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// The failure this guards against: another process took the port between `free_port`
    /// and the example's bind, and answers `/stats` with 200 (another test's instance). A
    /// start that only looked for a 200 took it for ours; ours has exited on its failed bind.
    #[test]
    fn a_port_another_server_answers_on_is_not_taken_for_ours() {
        let impostor = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = impostor.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut stream in impostor.incoming().flatten() {
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request);
                let body = r#"{"handler_executions":0,"per_key":{}}"#;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nx-process-id: 1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let started = PaymentsApp::try_start_on(port, &[]);
        assert!(started.is_err(), "took another server's port for ours");
    }
}
