//! Fault tests of the Redis store with the app as real processes (the `payments` example in
//! its Redis mode, `REDIS_URL`), as `fault_processes.rs` does for PostgreSQL: Redis killed and
//! restarted under keyed load, two instances x 10,000 requests, SIGKILL mid-handler. Each test
//! starts its own `redis-server` on a free loopback port.
//!
//! Each prints a `COUNTS` line (run with `--nocapture` to see it).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use idempotency_actix::store::redis::{parse_record_key, redis, DEFAULT_PREFIX};
use idempotency_e2e::proc::PaymentsApp;
use idempotency_e2e::raw_http::{send_once, Conn, Request, Response};
use idempotency_e2e::redis_server::RedisServer;

/// Per-request client timeout: longer than any answer the app should need (Redis timeouts
/// 2 s, handler delays below 3 s).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `POST /payments[?delay_ms=]` with the key, a tenant and a valid body.
fn pay(key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    let target = match delay_ms {
        Some(ms) => format!("/payments?delay_ms={ms}"),
        None => "/payments".to_owned(),
    };
    Request::post(&target)
        .key(key)
        .header("X-Account-Id", "acct-1")
        .json(format!(r#"{{"amount":{amount},"currency":"EUR"}}"#))
}

/// How the client saw one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Seen {
    Created,
    Replay,
    Conflict,
    Unavailable,
}

/// Classify a response, or explain why it breaks the contract.
fn classify(response: &Response) -> Result<Seen, String> {
    let retry_after = response.header("retry-after").is_some();
    match (response.status, response.problem_code().as_deref()) {
        (201, None) if response.is_replay() => Ok(Seen::Replay),
        (201, None) => Ok(Seen::Created),
        (409, Some("CONFLICT")) if retry_after => Ok(Seen::Conflict),
        (503, Some("STORAGE_UNAVAILABLE")) if retry_after => Ok(Seen::Unavailable),
        _ => Err(format!("unexpected answer: {}", response.describe())),
    }
}

fn wait_until(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Tally of outcomes, printed as the `COUNTS` line.
#[derive(Debug, Default)]
struct Tally(HashMap<String, u64>);

impl Tally {
    fn add(&mut self, what: impl Into<String>) {
        *self.0.entry(what.into()).or_default() += 1;
    }
    fn get(&self, what: &str) -> u64 {
        self.0.get(what).copied().unwrap_or(0)
    }
    fn line(&self) -> String {
        let mut parts: Vec<_> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        parts.sort();
        parts.join(" ")
    }
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Keys the app logged as "handler ran, but the response could not be stored" (C16).
fn keys_logged_unstored(log: &str) -> HashSet<String> {
    strip_ansi(log)
        .lines()
        .filter(|l| l.contains("could not store the response"))
        .filter_map(|l| {
            let start = l.find(" key=")? + 5;
            let rest = &l[start..];
            Some(rest.split(' ').next()?.to_owned())
        })
        .collect()
}

/// The example in its Redis mode. The target directory is shared (other builds of the
/// example may replace the binary), so the test checks the app really uses Redis: a memory
/// store per instance would make every exactly-once count meaningless.
fn start_app(env: &[(&str, &str)]) -> PaymentsApp {
    let app = PaymentsApp::start(env);
    assert!(
        app.log().contains("store: Redis"),
        "the payments example is not in its Redis mode; log:\n{}",
        app.log()
    );
    app
}

/// One record as the tests read it from Redis.
#[derive(Debug, Clone)]
struct Rec {
    state: String,
    token: Option<String>,
    body: Option<Vec<u8>>,
}

/// Every record under the store's prefix, by Idempotency-Key (SCAN + HGETALL).
fn records(url: &str) -> Vec<(String, Rec)> {
    let url = url.to_owned();
    idempotency_e2e::block_on_fresh_thread(async move {
        let client = redis::Client::open(url).expect("URL");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test Redis");
        let mut out = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{DEFAULT_PREFIX}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            for key in keys {
                let Some(scope) = parse_record_key(DEFAULT_PREFIX, &key) else {
                    continue;
                };
                let mut hash: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .expect("HGETALL");
                let text = |v: Option<Vec<u8>>| v.map(|b| String::from_utf8_lossy(&b).into_owned());
                let state = match text(hash.remove("st")).as_deref() {
                    Some("f") => "in_flight",
                    Some("c") => "completed",
                    _ => continue,
                };
                out.push((
                    scope.key,
                    Rec {
                        state: state.to_owned(),
                        token: text(hash.remove("tok")),
                        body: hash.remove("b"),
                    },
                ));
            }
            if next == 0 {
                return out;
            }
            cursor = next;
        }
    })
    .expect("reading records")
}

fn records_for_key(url: &str, key: &str) -> Vec<Rec> {
    records(url)
        .into_iter()
        .filter(|(k, _)| k == key)
        .map(|(_, r)| r)
        .collect()
}

fn count_state(url: &str, state: &str) -> usize {
    records(url)
        .iter()
        .filter(|(_, r)| r.state == state)
        .count()
}

// ---------------------------------------------------------------------------------------------

#[test]
fn redis_restart_under_load() {
    let _serial = serial();
    // Persistence on (AOF, fsync before every reply), as docs/redis.md asks of production: a
    // restart must not lose a completed record, or a retry would run its handler again.
    let dir = std::env::temp_dir().join(format!("idem-redis-aof-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("AOF directory");
    let dir_arg = dir.display().to_string();
    let mut server = RedisServer::start_with(&[
        "--appendonly",
        "yes",
        "--appendfsync",
        "always",
        "--dir",
        &dir_arg,
    ]);
    let url = server.url();
    // The lease (10 s) outlasts the outage (about 3 s): a response whose storing failed while
    // Redis was down is stored once it is back, before any retry could take over.
    let app = start_app(&[
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "10000"),
    ]);

    const CLIENTS: usize = 6;
    let stop = Arc::new(AtomicBool::new(false));
    let next_key = Arc::new(AtomicUsize::new(0));
    // (key, what the client saw, in order)
    let log: Arc<Mutex<Vec<(usize, Seen)>>> = Arc::default();
    let started = Instant::now();
    let clients: Vec<JoinHandle<Result<(), String>>> = (0..CLIENTS)
        .map(|_| {
            let (stop, next_key, log, addr) = (
                Arc::clone(&stop),
                Arc::clone(&next_key),
                Arc::clone(&log),
                app.addr.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let k = next_key.fetch_add(1, Ordering::SeqCst);
                    let sends = if k % 3 == 0 { 2 } else { 1 };
                    for _ in 0..sends {
                        let response = send_once(
                            &addr,
                            &pay(&format!("r-{k}"), 100 + k as u64, None),
                            CLIENT_TIMEOUT,
                        )
                        .map_err(|e| format!("key r-{k}: no answer: {e}"))?;
                        let seen = classify(&response).map_err(|e| format!("key r-{k}: {e}"))?;
                        log.lock().unwrap().push((k, seen));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Ok(())
            })
        })
        .collect();

    std::thread::sleep(Duration::from_millis(2500));
    let stopped_at = started.elapsed();
    server.kill();
    std::thread::sleep(Duration::from_secs(3));
    server.restart();
    let restarted_at = started.elapsed();
    std::thread::sleep(Duration::from_millis(3500));
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client
            .join()
            .expect("client thread")
            .expect("contract held");
    }
    let during_load = log.lock().unwrap().clone();
    let keys_sent = next_key.load(Ordering::SeqCst);

    // After recovery, every key resolves: a replay, or a fresh run for keys never executed.
    let mut after = Tally::default();
    let mut seen_by_key: HashMap<usize, Vec<Seen>> = HashMap::new();
    for (k, seen) in &during_load {
        seen_by_key.entry(*k).or_default().push(*seen);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for k in 0..keys_sent {
        loop {
            let response = send_once(
                &app.addr,
                &pay(&format!("r-{k}"), 100 + k as u64, None),
                CLIENT_TIMEOUT,
            )
            .unwrap_or_else(|e| panic!("key r-{k} after recovery: {e}"));
            let seen = classify(&response).unwrap_or_else(|e| panic!("key r-{k}: {e}"));
            seen_by_key.entry(k).or_default().push(seen);
            after.add(format!("{seen:?}"));
            if matches!(seen, Seen::Created | Seen::Replay) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "key r-{k} did not resolve after recovery"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    let stats = app.stats();
    let log = strip_ansi(&app.log());
    let unstored = keys_logged_unstored(&log);
    let stored_late = log
        .lines()
        .filter(|l| l.contains("response stored after the store recovered"))
        .count();
    let mut during = Tally::default();
    for (_, seen) in &during_load {
        during.add(format!("{seen:?}"));
    }
    for k in 0..keys_sent {
        let key = format!("r-{k}");
        let executions = stats.per_key.get(&key).copied().unwrap_or(0);
        let seen = &seen_by_key[&k];
        let fresh = seen.iter().filter(|s| **s == Seen::Created).count() as u64;
        // Exactly once per key, and every execution's response reached the client: including
        // the keys whose response could not be stored while the database was down.
        assert_eq!(
            executions, 1,
            "key {key}: {executions} executions ({seen:?})"
        );
        assert_eq!(fresh, 1, "key {key}: {fresh} fresh responses ({seen:?})");
    }
    assert!(
        during.get("Unavailable") > 0,
        "the outage was not seen by any request; the test proved nothing"
    );
    let in_flight = count_state(&url, "in_flight");
    assert_eq!(in_flight, 0, "reservations left behind");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "COUNTS redis_restart_under_load: stopped at {:.1}s, restarted at {:.1}s; keys={keys_sent} \
         requests_during_load={} [{}] resolve_requests={} [{}] executions={} keys_whose_response_was_stored_late={} (store failed after the handler: {})",
        stopped_at.as_secs_f64(),
        restarted_at.as_secs_f64(),
        during_load.len(),
        during.line(),
        after.0.values().sum::<u64>(),
        after.line(),
        stats.total,
        stored_late,
        unstored.len(),
    );
}

#[test]
fn sigkill_while_the_handler_runs_redis() {
    let _serial = serial();
    let server = RedisServer::start();
    let url = server.url();
    let env = [
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "4000"),
    ];
    let mut first = start_app(&env);
    // The instance the client retries against, started before the crash so the retry can
    // follow it at once (well inside the lease even on a slow machine).
    let second = start_app(&env);
    let request = pay("crash-1", 700, Some(2000));
    let in_flight = {
        let (addr, request) = (first.addr.clone(), request.clone());
        std::thread::spawn(move || send_once(&addr, &request, CLIENT_TIMEOUT))
    };
    wait_until(Duration::from_secs(10), "the reservation", || {
        records_for_key(&url, "crash-1")
            .iter()
            .any(|r| r.state == "in_flight")
    });
    let reserved_at = Instant::now();
    let dead = records_for_key(&url, "crash-1").remove(0);
    assert_eq!(
        first.stats().per_key.get("crash-1"),
        Some(&1),
        "the handler is running"
    );
    first.kill();
    let lost = in_flight.join().expect("client thread");
    assert!(lost.is_err(), "the killed process answered: {lost:?}");

    let mut tally = Tally::default();
    let early = send_once(&second.addr, &request, CLIENT_TIMEOUT).expect("retry");
    assert!(
        reserved_at.elapsed() < Duration::from_millis(3500),
        "the retry came too late to be inside the lease; the machine is too slow for this test"
    );
    assert_eq!(classify(&early), Ok(Seen::Conflict), "{}", early.describe());
    tally.add("409_inside_lease");
    assert_eq!(second.stats().per_key.get("crash-1"), None);

    // After the lease: one retry takes over and runs the handler once.
    let deadline = Instant::now() + Duration::from_secs(20);
    let completed = loop {
        let response = send_once(&second.addr, &request, CLIENT_TIMEOUT).expect("retry");
        match classify(&response) {
            Ok(Seen::Conflict) => tally.add("409_until_lease_end"),
            Ok(Seen::Created) => break response,
            other => panic!("retry: {other:?} {}", response.describe()),
        }
        assert!(Instant::now() < deadline, "the key was never taken over");
        std::thread::sleep(Duration::from_millis(200));
    };
    tally.add("201_after_lease");
    let taken_over_after = reserved_at.elapsed();
    assert!(
        taken_over_after >= Duration::from_millis(3900),
        "taken over after {taken_over_after:?}, before the 4 s lease ended"
    );
    assert_eq!(second.stats().per_key.get("crash-1"), Some(&1));
    let replay = send_once(&second.addr, &request, CLIENT_TIMEOUT).expect("replay");
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.body, completed.body);
    tally.add("replay");

    // The dead reservation never completes: its token is gone from the row for good.
    std::thread::sleep(Duration::from_millis(500));
    let rows = records_for_key(&url, "crash-1");
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].state, "completed");
    assert_ne!(
        rows[0].token, dead.token,
        "the dead holder's token completed the record"
    );
    assert_eq!(rows[0].body.as_deref(), Some(&completed.body[..]));
    println!(
        "COUNTS sigkill_while_the_handler_runs_redis: requests={} executions_dead_process=1 executions_new_process={} retry_completed_after={:.1}s [{}]",
        tally.0.values().sum::<u64>() + 1,
        second.stats().total,
        taken_over_after.as_secs_f64(),
        tally.line()
    );
}

/// xorshift64*: a deterministic shuffle without a crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn two_instances_ten_thousand_requests_exactly_once_redis() {
    let _serial = serial();
    let server = RedisServer::start();
    let url = server.url();
    let env = [("REDIS_URL", url.as_str())];
    let apps = [start_app(&env), start_app(&env)];

    const REQUESTS: usize = 10_000;
    const DISTINCT: usize = 7_000;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut work: Vec<usize> = (0..DISTINCT).collect();
    work.extend((0..REQUESTS - DISTINCT).map(|_| rng.below(DISTINCT)));
    // Shuffle, then pull some duplicates right next to their original so many arrive while
    // the original is still in flight (on the other instance).
    for i in (1..work.len()).rev() {
        let j = rng.below(i + 1);
        work.swap(i, j);
    }
    let work = Arc::new(work);

    const CLIENTS: usize = 32;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let threads: Vec<JoinHandle<Result<Tally, String>>> = (0..CLIENTS)
        .map(|c| {
            let (work, next) = (Arc::clone(&work), Arc::clone(&next));
            let addrs = [apps[0].addr.clone(), apps[1].addr.clone()];
            std::thread::spawn(move || {
                let mut tally = Tally::default();
                let mut conns: [Option<Conn>; 2] = [None, None];
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(&k) = work.get(i) else { break };
                    let instance = (c + i) % 2;
                    let request = Request::post("/payments")
                        .key(format!("two-{k}"))
                        .header("X-Account-Id", format!("acct-{}", k % 7))
                        .json(format!(
                            r#"{{"amount":{},"currency":"EUR"}}"#,
                            100 + k % 1000
                        ));
                    let mut attempts = 0;
                    loop {
                        attempts += 1;
                        if conns[instance].is_none() {
                            conns[instance] = Some(
                                Conn::connect(addrs[instance].as_str(), CLIENT_TIMEOUT)
                                    .map_err(|e| format!("connect: {e}"))?,
                            );
                        }
                        let conn = conns[instance].as_mut().expect("connected");
                        let response = match conn.send(&request) {
                            Ok(r) => r,
                            Err(e) if attempts < 3 => {
                                // A keep-alive connection the server closed; reconnect.
                                tally.add("reconnects");
                                conns[instance] = None;
                                let _ = e;
                                continue;
                            }
                            Err(e) => return Err(format!("two-{k}: no answer: {e}")),
                        };
                        let seen = classify(&response).map_err(|e| format!("two-{k}: {e}"))?;
                        tally.add(format!("{seen:?}"));
                        if seen == Seen::Unavailable && attempts < 20 {
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                        break;
                    }
                }
                Ok(tally)
            })
        })
        .collect();
    let mut tally = Tally::default();
    for t in threads {
        let part = t.join().expect("client thread").expect("contract held");
        for (k, v) in part.0 {
            *tally.0.entry(k).or_default() += v;
        }
    }
    let took = started.elapsed();

    let mut per_key: HashMap<String, u64> = HashMap::new();
    let mut totals = Vec::new();
    for app in &apps {
        let stats = app.stats();
        totals.push(stats.total);
        for (key, n) in stats.per_key {
            *per_key.entry(key).or_default() += n;
        }
    }
    let executions: u64 = totals.iter().sum();
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys not run exactly once: {twice:?}");
    assert_eq!(per_key.len(), DISTINCT, "every distinct key ran");
    assert_eq!(executions, DISTINCT as u64, "executions == distinct keys");
    assert_eq!(count_state(&url, "completed"), DISTINCT);
    assert_eq!(count_state(&url, "in_flight"), 0);
    let answers = tally.get("Created") + tally.get("Replay") + tally.get("Conflict");
    assert_eq!(
        answers,
        REQUESTS as u64,
        "every request got a final answer: {}",
        tally.line()
    );
    println!(
        "COUNTS two_instances_redis: requests={REQUESTS} distinct_keys={DISTINCT} executions={executions} \
         (instance A {}, B {}) [{}] in {:.1}s",
        totals[0],
        totals[1],
        tally.line(),
        took.as_secs_f64()
    );
}
