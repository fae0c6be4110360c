//! Resource leaks after faults, in a long-running app (the `payments` example as a real
//! process, in each mode: memory, PostgreSQL default, PostgreSQL transactional, Redis), from a
//! review (2026-12-05) that found none.
//!
//! After a storm of one fault and a quiet period the process must come back to its baseline,
//! measured from outside: open file descriptors (`/proc/<pid>/fd`), threads and RSS
//! (`/proc/<pid>/status`), the app's PostgreSQL backends (`pg_stat_activity`, and none left
//! `idle in transaction`), Redis clients (`CLIENT LIST`). Every storm's keys are then checked:
//! no key ran twice, and a retry gets a correct answer. And a graceful stop (SIGTERM) with work
//! in flight must end the process within the example's bound (20 s of wait for the middleware's
//! work, then actix's `shutdown_timeout` of 8 s), never hang.
//!
//! The storms and the slow stops are soak tests, `#[ignore]`d so that CI stays short; run them
//! with `cargo test -p idempotency-e2e --test processes -- --ignored leaks::`
//! (about ten minutes). Each prints a `LEAKS` line: baseline, after the first storm, after the
//! second.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_e2e::faults::{self, classify, classify_transactional, serial, Rng};
use idempotency_e2e::proc::{crash_cluster, start_cluster_again, PaymentsApp};
use idempotency_e2e::proxy::{Cut, CutProxy};
use idempotency_e2e::raw_http::{send_once, Conn, Request};
use idempotency_e2e::records::count;
use idempotency_e2e::redis_server::RedisServer;
use idempotency_e2e::{block_on_fresh_thread, TempCluster, TestDb};

const TENANT: &str = "acct_leaks";
/// The example's bound on a stop: `STOP_WAIT` (20 s) plus actix's `shutdown_timeout` (8 s).
const STOP_LIMIT: Duration = Duration::from_secs(28);
/// The example's default pool size (`PostgresStoreBuilder::max_size`).
const POOL_MAX: i64 = 10;
/// Client threads of a storm.
const THREADS: usize = 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Memory,
    Postgres,
    Transactional,
    Redis,
}

/// A running example and what it talks to.
struct Running {
    mode: Mode,
    app: PaymentsApp,
    /// The database the app uses, seen directly (not through any proxy): for `pg_stat_activity`.
    pg_url: Option<String>,
    redis_port: Option<u16>,
    _db: Option<TestDb>,
    _redis: Option<RedisServer>,
}

fn new_db() -> TestDb {
    block_on_fresh_thread(TestDb::new()).expect("creating a test database")
}

fn env_for(mode: Mode, url: &str) -> Vec<(&'static str, String)> {
    let mut env = vec![("IDEMPOTENCY_LOCK_TIMEOUT_MS", "10000".to_owned())];
    match mode {
        Mode::Memory => {}
        Mode::Postgres => env.push(("DATABASE_URL", url.to_owned())),
        Mode::Transactional => {
            env.push(("DATABASE_URL", url.to_owned()));
            env.push(("PAYMENTS_TRANSACTIONAL", "1".to_owned()));
        }
        Mode::Redis => env.push(("REDIS_URL", url.to_owned())),
    }
    env
}

fn start_app(env: &[(&'static str, String)]) -> PaymentsApp {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    PaymentsApp::start(&env)
}

fn start(mode: Mode) -> Running {
    match mode {
        Mode::Memory => Running {
            mode,
            app: start_app(&env_for(mode, "")),
            pg_url: None,
            redis_port: None,
            _db: None,
            _redis: None,
        },
        Mode::Postgres | Mode::Transactional => {
            let db = new_db();
            let app = start_app(&env_for(mode, &db.url));
            Running {
                mode,
                app,
                pg_url: Some(db.url.clone()),
                redis_port: None,
                _db: Some(db),
                _redis: None,
            }
        }
        Mode::Redis => {
            let redis = RedisServer::start();
            let app = start_app(&env_for(mode, &redis.url()));
            Running {
                mode,
                app,
                pg_url: None,
                redis_port: Some(redis.port()),
                _db: None,
                _redis: Some(redis),
            }
        }
    }
}

// --- measuring from outside ------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Default)]
struct Snap {
    fds: i64,
    threads: i64,
    rss_kb: i64,
    /// The app's backends (-1: not PostgreSQL).
    pg: i64,
    pg_idle_tx: i64,
    /// Redis clients other than the one asking (-1: not Redis).
    redis: i64,
}

impl std::fmt::Display for Snap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fds={} threads={} rss={}KB pg={} pg_idle_in_tx={} redis_clients={}",
            self.fds, self.threads, self.rss_kb, self.pg, self.pg_idle_tx, self.redis
        )
    }
}

fn status_field(pid: u32, field: &str) -> i64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

/// Panic with the app's log when its process has ended (a zombie: not reaped yet).
fn assert_alive(run: &Running, when: &str) {
    let state = std::fs::read_to_string(format!("/proc/{}/status", run.app.pid()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("State:").map(|s| s.trim().to_owned()))
        .unwrap_or_default();
    if state.is_empty() || state.starts_with('Z') {
        // /proc/<pid>/stat's last field: the exit code as waitpid reports it (signal in the low
        // 7 bits, status << 8).
        let exit_code = std::fs::read_to_string(format!("/proc/{}/stat", run.app.pid()))
            .unwrap_or_default()
            .split_whitespace()
            .last()
            .unwrap_or_default()
            .to_owned();
        let log = run.app.log();
        let interesting: Vec<&str> = log.lines().filter(|l| !l.contains("DEBUG")).collect();
        let tail = &interesting[interesting.len().saturating_sub(40)..];
        panic!(
            "{:?}: the app process died during {when} (state {state:?}, wait status {exit_code}); last lines of its log:\n{}",
            run.mode,
            tail.join("\n")
        );
    }
}

fn fd_count(pid: u32) -> i64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as i64)
        .unwrap_or(-1)
}

fn pg_counts(url: &str) -> (i64, i64) {
    let all = count(
        url,
        "SELECT count(*)::bigint AS n FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
    );
    let idle_tx = count(
        url,
        "SELECT count(*)::bigint AS n FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND state LIKE 'idle in transaction%'",
    );
    (all, idle_tx)
}

fn redis_clients(port: u16) -> i64 {
    let out = Command::new("timeout")
        .args(["5", "redis-cli", "-p", &port.to_string(), "CLIENT", "LIST"])
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli");
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("addr="))
        .count() as i64;
    lines - 1
}

fn snap(run: &Running) -> Snap {
    let pid = run.app.pid();
    let (pg, pg_idle_tx) = run.pg_url.as_deref().map_or((-1, -1), pg_counts);
    Snap {
        fds: fd_count(pid),
        threads: status_field(pid, "Threads:"),
        rss_kb: status_field(pid, "VmRSS:"),
        pg,
        pg_idle_tx,
        redis: run.redis_port.map_or(-1, redis_clients),
    }
}

/// Whether `now` is back to `base`: descriptors other than store connections within 3, threads
/// within 2, backends within the pool, none idle in a transaction, Redis clients within 1.
fn back_to(base: &Snap, now: &Snap) -> Vec<String> {
    let mut bad = Vec::new();
    let store_fds = |s: &Snap| s.pg.max(0) + s.redis.max(0);
    let (other_base, other_now) = (base.fds - store_fds(base), now.fds - store_fds(now));
    if other_now > other_base + 3 {
        bad.push(format!(
            "descriptors other than store connections: {other_base} -> {other_now}"
        ));
    }
    if now.threads > base.threads + 2 {
        bad.push(format!("threads: {} -> {}", base.threads, now.threads));
    }
    if now.pg > POOL_MAX {
        bad.push(format!(
            "PostgreSQL backends {} > pool max {POOL_MAX}",
            now.pg
        ));
    }
    if now.pg_idle_tx > 0 {
        bad.push(format!("{} backends idle in transaction", now.pg_idle_tx));
    }
    if base.redis >= 0 && now.redis > base.redis + 1 {
        bad.push(format!("Redis clients: {} -> {}", base.redis, now.redis));
    }
    bad
}

/// Poll for up to `within` until the process is back to `base`; the last snapshot and what is
/// still off.
fn settle(run: &Running, base: &Snap, within: Duration) -> (Snap, Vec<String>) {
    let deadline = Instant::now() + within;
    loop {
        let now = snap(run);
        let bad = back_to(base, &now);
        if bad.is_empty() || Instant::now() > deadline {
            return (now, bad);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

// --- faults ----------------------------------------------------------------------------------

fn pay(key: &str, delay_ms: Option<u64>) -> Request {
    faults::pay(TENANT, key, 500, delay_ms)
}

/// Run `n` jobs over [`THREADS`] threads; `job(i)` for each.
fn fan_out(n: usize, job: impl Fn(usize) + Sync) {
    let next = AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst) as usize;
                if i >= n {
                    return;
                }
                job(i);
            });
        }
    });
}

/// Clients that send a keyed request whose handler is slow and reset the connection mid-handler.
fn storm_resets(addr: &str, prefix: &str, n: usize) {
    fan_out(n, |i| {
        let Ok(mut conn) = Conn::connect(addr, Duration::from_secs(5)) else {
            return;
        };
        let _ = conn.send_raw(&pay(&format!("{prefix}-{i}"), Some(150)).to_bytes());
        std::thread::sleep(Duration::from_millis(20));
        let _ = conn.reset();
    });
}

/// Clients that send the head and half the body of a keyed request, then vanish (FIN for even
/// `i`, RST for odd).
fn storm_half_bodies(addr: &str, prefix: &str, n: usize) {
    fan_out(n, |i| {
        let Ok(mut conn) = Conn::connect(addr, Duration::from_secs(5)) else {
            return;
        };
        let bytes = pay(&format!("{prefix}-{i}"), None).to_bytes();
        let _ = conn.send_raw(&bytes[..bytes.len() - 12]);
        std::thread::sleep(Duration::from_millis(2));
        if i % 2 == 0 {
            let _ = conn.shutdown_write();
            drop(conn);
        } else {
            let _ = conn.reset();
        }
    });
}

/// Statuses seen by a load, by "status code" (e.g. `201`, `503 STORAGE_UNAVAILABLE`).
type Tally = Arc<Mutex<BTreeMap<String, u64>>>;

fn tally_add(tally: &Tally, what: String) {
    *tally.lock().unwrap().entry(what).or_default() += 1;
}

/// Keyed requests (each key once, a third of the clients reset mid-handler) until `stop`.
/// Returns the number of keys used. Answers that break the contract are collected in `wrong`.
fn load_until(
    run: &Running,
    prefix: &str,
    stop: &AtomicBool,
    tally: &Tally,
    wrong: &Mutex<Vec<String>>,
) -> usize {
    let next = AtomicU64::new(0);
    let mode = run.mode;
    let addr = run.app.addr.as_str();
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let i = next.fetch_add(1, Ordering::SeqCst) as usize;
                    let key = format!("{prefix}-{i}");
                    let Ok(mut conn) = Conn::connect(addr, Duration::from_secs(15)) else {
                        tally_add(tally, "connect failed".into());
                        continue;
                    };
                    if i.is_multiple_of(3) {
                        let _ = conn.send_raw(&pay(&key, Some(100)).to_bytes());
                        std::thread::sleep(Duration::from_millis(10));
                        let _ = conn.reset();
                        tally_add(tally, "reset by client".into());
                        continue;
                    }
                    match conn.send(&pay(&key, Some(20))) {
                        Ok(r) => {
                            let seen = if mode == Mode::Transactional {
                                classify_transactional(&r)
                            } else {
                                classify(&r)
                            };
                            if let Err(why) = seen {
                                wrong.lock().unwrap().push(format!("{key}: {why}"));
                            }
                            tally_add(
                                tally,
                                format!("{} {}", r.status, r.problem_code().unwrap_or_default()),
                            );
                        }
                        Err(e) => tally_add(tally, format!("io error {:?}", e.kind())),
                    }
                }
            });
        }
    });
    next.load(Ordering::SeqCst) as usize
}

/// Every key of `prefix-0..n` ran at most once; a retry of a sample of them (every `step`th)
/// gets 201 (a replay, or a first run for a key whose handler never ran) within `within`.
fn check_keys(
    run: &Running,
    prefix: &str,
    n: usize,
    step: usize,
    within: Duration,
    delay_of: impl Fn(usize) -> Option<u64>,
) {
    assert_no_key_twice(run, prefix, n);
    let deadline = Instant::now() + within;
    for i in (0..n).step_by(step) {
        let key = format!("{prefix}-{i}");
        loop {
            let r = send_once(
                &run.app.addr,
                &pay(&key, delay_of(i)),
                Duration::from_secs(15),
            )
            .unwrap_or_else(|e| panic!("retry of {key}: {e}"));
            if r.status == 201 {
                break;
            }
            assert!(
                matches!(r.status, 409 | 503) && Instant::now() < deadline,
                "retry of {key} after the quiet period: {} (executions {:?})",
                r.describe(),
                run.app.stats().per_key.get(&key)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    assert_no_key_twice(run, prefix, n);
    let sample: Vec<String> = (0..n)
        .step_by(step)
        .map(|i| format!("{prefix}-{i}"))
        .collect();
    if run.mode == Mode::Transactional {
        // `/stats` counts runs, rolled-back ones too: the `payments` table is the truth.
        let url = run
            .pg_url
            .as_deref()
            .expect("transactional mode has a database");
        let list = sample
            .iter()
            .map(|k| format!("'{k}'"))
            .collect::<Vec<_>>()
            .join(",");
        let rows = count(
            url,
            &format!("SELECT count(DISTINCT idempotency_key)::bigint AS n FROM payments WHERE idempotency_key IN ({list})"),
        );
        assert_eq!(
            rows,
            sample.len() as i64,
            "keys retried to a 201 without a payment row"
        );
    } else {
        let stats = run.app.stats();
        for key in &sample {
            let runs = stats.per_key.get(key).copied().unwrap_or(0);
            assert_eq!(runs, 1, "key {key}: {runs} executions after its retry");
        }
    }
}

/// No key of `prefix-0..n` took effect twice: executions per key (default mode) or payment
/// rows per key (transactional mode).
fn assert_no_key_twice(run: &Running, prefix: &str, n: usize) {
    if run.mode == Mode::Transactional {
        let url = run
            .pg_url
            .as_deref()
            .expect("transactional mode has a database");
        let twice = count(
            url,
            &format!(
                "SELECT count(*)::bigint AS n FROM (SELECT idempotency_key FROM payments \
                 WHERE idempotency_key LIKE '{prefix}-%' GROUP BY idempotency_key HAVING count(*) > 1) t"
            ),
        );
        assert_eq!(
            twice, 0,
            "{twice} keys of {prefix} have more than one payment row"
        );
        return;
    }
    let stats = run.app.stats();
    let twice: Vec<_> = (0..n)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|k| stats.per_key.get(k).copied().unwrap_or(0) > 1)
        .collect();
    assert!(
        twice.is_empty(),
        "keys run more than once: {:?}",
        &twice[..twice.len().min(10)]
    );
}

/// Warm up, take a baseline, run `storm` twice with a quiet period after each, and assert the
/// process came back to the baseline (and RSS did not grow by storm). `storm(round)`.
fn storm_twice(name: &str, run: &Running, n: usize, mut storm: impl FnMut(usize)) {
    // Warm-up: normal traffic so pools, workers and allocator reach their working size.
    fan_out(200, |i| {
        let _ = send_once(
            &run.app.addr,
            &pay(&format!("warm-{name}-{i}"), Some(5)),
            Duration::from_secs(15),
        );
    });
    std::thread::sleep(Duration::from_secs(2));
    let base = snap(run);
    let mut after = Vec::new();
    for round in 0..2 {
        let started = Instant::now();
        storm(round);
        let took = started.elapsed();
        assert_alive(run, &format!("{name} round {round}"));
        std::thread::sleep(Duration::from_secs(3));
        let (now, bad) = settle(run, &base, Duration::from_secs(25));
        println!(
            "LEAKS {name} {:?} round {round} ({n} faulty requests, {:.1}s): baseline [{base}] after quiet [{now}] {bad:?}",
            run.mode,
            took.as_secs_f64()
        );
        after.push((now, bad));
    }
    let rss_growth = after[1].0.rss_kb - after[0].0.rss_kb;
    let summary = format!(
        "{name} {:?}: baseline [{base}]; after storm 1 [{}]; after storm 2 [{}]",
        run.mode, after[0].0, after[1].0
    );
    println!("LEAKS {summary}");
    assert!(
        after[1].1.is_empty(),
        "not back to baseline after the quiet period: {:?}; {summary}",
        after[1].1
    );
    // A leak proportional to the faulty requests shows as growth from storm to storm (the
    // first storm may raise the allocator's high-water mark; the second must not add as much
    // again). 16 MB of slack for noise; 2,000 requests leaking 8 KB each would exceed it.
    assert!(
        rss_growth < 16 * 1024,
        "RSS grew by {rss_growth} KB over the second storm of {n} faulty requests \
         ({} bytes each); {summary}",
        rss_growth * 1024 / n as i64
    );
}

// --- storms per mode ----------------------------------------------------------------------------

fn resets_mid_handler(mode: Mode) {
    let _serial = serial();
    let run = start(mode);
    let n = 2000;
    storm_twice("resets_mid_handler", &run, n, |round| {
        storm_resets(&run.app.addr, &format!("reset{round}"), n);
    });
    check_keys(&run, "reset0", n, 40, Duration::from_secs(30), |_| {
        Some(150)
    });
    check_keys(&run, "reset1", n, 40, Duration::from_secs(30), |_| {
        Some(150)
    });
}

#[test]
#[ignore = "soak: run by hand with --ignored"]
fn resets_mid_handler_memory() {
    resets_mid_handler(Mode::Memory);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn resets_mid_handler_postgres() {
    resets_mid_handler(Mode::Postgres);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn resets_mid_handler_transactional() {
    resets_mid_handler(Mode::Transactional);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn resets_mid_handler_redis() {
    resets_mid_handler(Mode::Redis);
}

fn half_bodies(mode: Mode) {
    let _serial = serial();
    let run = start(mode);
    let n = 3000;
    storm_twice("half_bodies", &run, n, |round| {
        storm_half_bodies(&run.app.addr, &format!("half{round}"), n);
    });
    // No key of a request whose body never arrived ran, or is held: its retry with the whole
    // body runs it now, once.
    let stats = run.app.stats();
    for round in 0..2 {
        for i in (0..n).step_by(50) {
            let key = format!("half{round}-{i}");
            assert_eq!(
                stats.per_key.get(&key).copied().unwrap_or(0),
                0,
                "{key}: the handler ran on half a body"
            );
            let r = send_once(&run.app.addr, &pay(&key, None), Duration::from_secs(15))
                .expect("retry with the whole body");
            assert!(
                r.status == 201 && !r.is_replay(),
                "{key}: retry with the whole body: {}",
                r.describe()
            );
        }
    }
}

#[test]
#[ignore = "soak: run by hand with --ignored"]
fn half_bodies_memory() {
    half_bodies(Mode::Memory);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn half_bodies_postgres() {
    half_bodies(Mode::Postgres);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn half_bodies_transactional() {
    half_bodies(Mode::Transactional);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn half_bodies_redis() {
    half_bodies(Mode::Redis);
}

// --- the store killed and restarted, cut, frozen ------------------------------------------------

/// `fault` runs while `load_until` sends traffic; then the load stops, and the usual checks.
fn storm_with_fault(
    name: &str,
    run: &Running,
    rounds: usize,
    fault: impl Fn(usize) + Sync,
) -> Vec<(String, usize)> {
    let mut prefixes = Vec::new();
    let wrong = Mutex::new(Vec::new());
    let tally: Tally = Arc::default();
    storm_twice(name, run, rounds * 1000, |round| {
        let prefix = format!("{name}{round}");
        let stop = AtomicBool::new(false);
        let n = std::thread::scope(|s| {
            let loader = s.spawn(|| load_until(run, &prefix, &stop, &tally, &wrong));
            fault(round);
            stop.store(true, Ordering::SeqCst);
            loader.join().expect("load")
        });
        prefixes.push((prefix, n));
    });
    println!(
        "LEAKS {name} {:?} answers: {:?}",
        run.mode,
        tally.lock().unwrap()
    );
    let wrong = wrong.into_inner().unwrap();
    assert!(
        wrong.is_empty(),
        "{} wrong answers, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(5)]
    );
    for (prefix, n) in &prefixes {
        check_keys(run, prefix, *n, 7, Duration::from_secs(40), |i| {
            Some(if i % 3 == 0 { 100 } else { 20 })
        });
    }
    prefixes
}

fn database_restarts(mode: Mode) {
    let _serial = serial();
    let cluster = TempCluster::start(&[], &[]).expect("a private PostgreSQL cluster");
    let url = cluster.url();
    {
        let url = url.clone();
        block_on_fresh_thread(async move {
            idempotency_actix::store::postgres::run_migrations(&url).await
        })
        .expect("migrate")
        .expect("migrate");
    }
    let run = Running {
        mode,
        app: start_app(&env_for(mode, &url)),
        pg_url: Some(url.clone()),
        redis_port: None,
        _db: None,
        _redis: None,
    };
    storm_with_fault("pgrestart", &run, 2, |_| {
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(1500));
            crash_cluster(&cluster);
            std::thread::sleep(Duration::from_secs(2));
            start_cluster_again(&cluster);
        }
        std::thread::sleep(Duration::from_millis(1500));
    });
}

#[test]
#[ignore = "soak: run by hand with --ignored"]
fn database_restarts_postgres() {
    database_restarts(Mode::Postgres);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn database_restarts_transactional() {
    database_restarts(Mode::Transactional);
}

fn random_cuts(mode: Mode) {
    let _serial = serial();
    let db = new_db();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let proxy = rt.block_on(CutProxy::for_url(&db.url));
    let run = Running {
        mode,
        app: start_app(&env_for(mode, &proxy.url_through(&db.url))),
        pg_url: Some(db.url.clone()),
        redis_port: None,
        _db: None,
        _redis: None,
    };
    let needles = [
        "idempotency_keys",
        "idempotency_release(",
        "idempotency_renew_lease(",
        "INSERT",
        "UPDATE",
        "DELETE",
        "SELECT",
        "COMMIT",
        "BEGIN",
        "payments",
    ];
    let before = proxy.fired();
    storm_with_fault("cuts", &run, 2, |round| {
        let mut rng = Rng(0x5eed + round as u64);
        let until = Instant::now() + Duration::from_secs(6);
        while Instant::now() < until {
            let needle = needles[rng.below(needles.len())];
            let cut = if rng.below(2) == 0 {
                Cut::BeforeSend
            } else {
                Cut::AfterSend
            };
            proxy.arm(needle, cut);
            std::thread::sleep(Duration::from_millis(40));
        }
        proxy.disarm();
    });
    println!(
        "LEAKS cuts {mode:?}: {} connections cut",
        proxy.fired() - before
    );
    assert!(
        proxy.fired() - before > 20,
        "too few cuts to prove anything"
    );
    drop(run);
    drop(proxy);
    drop(rt);
    drop(db);
}

#[test]
#[ignore = "soak: run by hand with --ignored"]
fn random_cuts_postgres() {
    random_cuts(Mode::Postgres);
}
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn random_cuts_transactional() {
    random_cuts(Mode::Transactional);
}

#[test]
#[ignore = "soak: run by hand with --ignored"]
fn redis_restarts() {
    let _serial = serial();
    // With AOF fsynced on every write: a restart keeps every record, so a retry after it must
    // replay (without persistence a restart forgets everything, docs/redis.md).
    let redis = Mutex::new(RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
    ]));
    let (url, port) = {
        let r = redis.lock().unwrap();
        (r.url(), r.port())
    };
    let run = Running {
        mode: Mode::Redis,
        app: start_app(&env_for(Mode::Redis, &url)),
        pg_url: None,
        redis_port: Some(port),
        _db: None,
        _redis: None,
    };
    storm_with_fault("redisrestart", &run, 2, |_| {
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(1500));
            redis.lock().unwrap().kill();
            std::thread::sleep(Duration::from_secs(2));
            redis.lock().unwrap().restart();
        }
        std::thread::sleep(Duration::from_millis(1500));
    });
    drop(run);
}

#[test]
#[ignore = "soak: run by hand with --ignored"]
fn redis_frozen() {
    let _serial = serial();
    let redis = RedisServer::start();
    let run = Running {
        mode: Mode::Redis,
        app: start_app(&env_for(Mode::Redis, &redis.url())),
        pg_url: None,
        redis_port: Some(redis.port()),
        _db: None,
        _redis: None,
    };
    storm_with_fault("redisfrozen", &run, 2, |_| {
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(1500));
            redis.signal("STOP");
            std::thread::sleep(Duration::from_secs(4));
            redis.signal("CONT");
        }
        std::thread::sleep(Duration::from_millis(1500));
    });
    drop(run);
}

// --- graceful stop -------------------------------------------------------------------------------

/// SIGTERM with work in flight: connected clients waiting for slow handlers, clients that left
/// mid-handler, idle keep-alive connections, a client that sent half a body. The process must
/// exit within the limit, and the connected clients get their 201.
fn stop_with_work_in_flight(mode: Mode, delay_ms: u64, freeze: bool, half_body: bool) -> Duration {
    let _serial = serial();
    let run = start(mode);
    let addr = run.app.addr.clone();
    let answers = Mutex::new(Vec::new());
    let mut idle = Vec::new();
    for _ in 0..2 {
        let mut c = Conn::connect(&addr, Duration::from_secs(90)).expect("connect");
        let r = c
            .send(&pay(&format!("idle-{}", idle.len()), None))
            .expect("idle");
        assert_eq!(r.status, 201);
        idle.push(c);
    }
    // A client that sent the head and half the body of a request and then stays silent (a
    // stalled upload, a slowloris).
    let half = half_body.then(|| {
        let mut half = Conn::connect(&addr, Duration::from_secs(90)).expect("connect");
        let bytes = pay("half-stop", None).to_bytes();
        half.send_raw(&bytes[..bytes.len() - 10]).expect("half");
        half
    });
    let elapsed = std::thread::scope(|s| {
        for i in 0..4 {
            let (addr, answers) = (&addr, &answers);
            s.spawn(move || {
                let r = Conn::connect(addr, Duration::from_secs(90))
                    .and_then(|mut c| c.send(&pay(&format!("stay-{i}"), Some(delay_ms))));
                answers
                    .lock()
                    .unwrap()
                    .push(r.map(|r| r.describe()).map_err(|e| e.to_string()));
            });
            s.spawn(move || {
                if let Ok(mut c) = Conn::connect(addr, Duration::from_secs(5)) {
                    let _ = c.send_raw(&pay(&format!("left-{i}"), Some(delay_ms)).to_bytes());
                    std::thread::sleep(Duration::from_millis(100));
                    let _ = c.reset();
                }
            });
        }
        std::thread::sleep(Duration::from_millis(700));
        if freeze {
            if let Some(r) = &run._redis {
                r.signal("STOP");
            }
        }
        let started = Instant::now();
        run.app.signal("TERM");
        let mut app = run.app;
        let exited = app.wait_for_exit(Duration::from_secs(75));
        let elapsed = started.elapsed();
        if freeze {
            if let Some(r) = &run._redis {
                r.signal("CONT");
            }
        }
        let log = app.log();
        let tail: Vec<&str> = if elapsed > STOP_LIMIT {
            log.lines()
                .filter(|l| !l.contains("DEBUG"))
                .rev()
                .take(40)
                .collect()
        } else {
            log.lines().rev().take(8).collect()
        };
        println!(
            "LEAKS stop {mode:?} delay={delay_ms}ms freeze={freeze} half_body={half_body}: exited {exited:?} after {:.1}s; log tail (newest first):\n{}",
            elapsed.as_secs_f64(),
            tail.join("\n")
        );
        assert!(
            exited.is_some(),
            "{mode:?}: still running 75 s after SIGTERM"
        );
        elapsed
    });
    drop(idle);
    drop(half);
    let answers = answers.into_inner().unwrap();
    println!("LEAKS stop {mode:?}: connected clients got {answers:?}");
    if delay_ms < STOP_LIMIT.as_millis() as u64 && !freeze {
        for a in &answers {
            assert!(
                a.as_ref().is_ok_and(|d| d.starts_with("201")),
                "{mode:?}: a connected client of a handler that ends inside the limit was not answered 201: {a:?}"
            );
        }
    }
    let _ = std::io::stdout().flush();
    elapsed
}

fn assert_within_limit(mode: Mode, elapsed: Duration, what: &str) {
    assert!(
        elapsed <= STOP_LIMIT + Duration::from_secs(3),
        "{mode:?}, {what}: the process exited {:.1}s after SIGTERM, past its {STOP_LIMIT:?} limit",
        elapsed.as_secs_f64()
    );
}

/// Handlers of 3 s in flight, clients connected and gone, idle keep-alive connections: the
/// process ends soon after the handlers, in every mode.
#[test]
fn sigterm_with_work_in_flight_every_mode() {
    for mode in [
        Mode::Memory,
        Mode::Postgres,
        Mode::Transactional,
        Mode::Redis,
    ] {
        let elapsed = stop_with_work_in_flight(mode, 3000, false, false);
        assert_within_limit(mode, elapsed, "handlers of 3 s in flight");
    }
}

/// Redis frozen (SIGSTOP) while the stop waits: responses cannot be stored; the wait ends at
/// the lease (10 s here) or the limit, never hangs.
#[test]
fn sigterm_with_redis_frozen() {
    let elapsed = stop_with_work_in_flight(Mode::Redis, 1000, true, false);
    assert_within_limit(Mode::Redis, elapsed, "Redis SIGSTOPped during the stop");
}

/// The same with one client that sent half a body and went silent: the stop waits for the
/// work (10 s, well inside the limit), then actix's own graceful stop waits for that
/// connection up to its `shutdown_timeout` (30 s by default): the process must still be gone
/// within the example's limit.
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn sigterm_with_a_silent_half_body_client() {
    for mode in [Mode::Memory, Mode::Redis] {
        let elapsed = stop_with_work_in_flight(mode, 10_000, false, true);
        assert_within_limit(
            mode,
            elapsed,
            "handlers of 10 s and one silent half-body client",
        );
    }
}

/// Handlers slower than the limit (the example allows `delay_ms` up to 60 s): the example
/// names its 30 s `STOP_WAIT` after Kubernetes' grace period, so the process must be gone by
/// then (or the orchestrator SIGKILLs it anyway).
#[test]
#[ignore = "soak: run by hand with --ignored"]
fn sigterm_with_handlers_longer_than_the_limit() {
    let elapsed = stop_with_work_in_flight(Mode::Memory, 50_000, false, false);
    assert_within_limit(Mode::Memory, elapsed, "handlers of 50 s in flight");
}
