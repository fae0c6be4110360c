//! Shared parts of the fault tests that drive the `payments` example as a process
//! (`fault_processes.rs`, `redis_faults.rs`, `transactional_faults.rs`): the request, how a
//! client saw an answer ([`Seen`], [`classify`]), the `COUNTS` tally, the keyed load that runs
//! while a test breaks something ([`Load`]), and reading the app's log.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::raw_http::{send_once, Request, Response};

/// Per-request client timeout: longer than any answer the app should need (connection and
/// Redis timeouts 2 s, statement timeout 5 s, handler delays below 3 s).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

/// The process-wide lock of the process tests, in two kinds. [`serial`]: a test alone in its
/// binary, for what must not share the machine (a load of thousands of requests, a stop whose
/// duration is asserted, the soak storms). [`shared`]: beside other `shared` tests, for tests
/// that mostly wait (for a lease to end, a frozen process, a signal), whose assertions are about
/// what happened, not how fast. Measured 2026-12-05 (`processes`, 33 tests): 159 s one at a time,
/// and the test binary with its app processes used 9 s of CPU in all.
static PROCESS_TESTS: RwLock<()> = RwLock::new(());

/// Run alone: no other [`serial`] or [`shared`] test of this binary runs meanwhile.
pub fn serial() -> RwLockWriteGuard<'static, ()> {
    PROCESS_TESTS.write().unwrap_or_else(|e| e.into_inner())
}

/// Run beside other [`shared`] tests (as many as the test harness runs at once:
/// `RUST_TEST_THREADS`), never beside a [`serial`] one.
pub fn shared() -> RwLockReadGuard<'static, ()> {
    PROCESS_TESTS.read().unwrap_or_else(|e| e.into_inner())
}

/// `POST /payments[?delay_ms=]` with the key, the tenant (`x-account-id`: the example scopes
/// keys by it and refuses keyed requests without one, C23) and a valid body.
pub fn pay(tenant: &str, key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    let target = match delay_ms {
        Some(ms) => format!("/payments?delay_ms={ms}"),
        None => "/payments".to_owned(),
    };
    Request::post(&target)
        .key(key)
        .header("x-account-id", tenant)
        .json(format!(r#"{{"amount":{amount},"currency":"EUR"}}"#))
}

/// How the client saw one answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Seen {
    /// 201, the handler ran for this request.
    Created,
    /// 201, replayed.
    Replay,
    /// 409 `CONFLICT` with `Retry-After`: the key is in flight.
    Conflict,
    /// 503 `STORAGE_UNAVAILABLE` with `Retry-After`.
    Unavailable,
    /// Transactional mode: 503 `COMMIT_FAILED` (everything rolled back).
    CommitFailed,
    /// Transactional mode: 503 `COMMIT_OUTCOME_UNKNOWN`.
    CommitUnknown,
    /// Transactional mode: the handler's own statement failed (the database went away
    /// mid-handler): its 500 `database error`, and everything rolled back.
    HandlerError,
}

/// Classify an answer of the default mode, or explain why it breaks the contract.
pub fn classify(response: &Response) -> Result<Seen, String> {
    let retry_after = response.header("retry-after").is_some();
    match (response.status, response.problem_code().as_deref()) {
        (201, None) if response.is_replay() => Ok(Seen::Replay),
        (201, None) => Ok(Seen::Created),
        (409, Some("CONFLICT")) if retry_after => Ok(Seen::Conflict),
        (503, Some("STORAGE_UNAVAILABLE")) if retry_after => Ok(Seen::Unavailable),
        _ => Err(format!("unexpected answer: {}", response.describe())),
    }
}

/// As [`classify`], plus the answers only transactional mode gives (C25).
pub fn classify_transactional(response: &Response) -> Result<Seen, String> {
    let retry_after = response.header("retry-after").is_some();
    match (response.status, response.problem_code().as_deref()) {
        (503, Some("COMMIT_FAILED")) if retry_after => Ok(Seen::CommitFailed),
        (503, Some("COMMIT_OUTCOME_UNKNOWN")) if retry_after => Ok(Seen::CommitUnknown),
        (500, None) if response.body == b"database error" => Ok(Seen::HandlerError),
        _ => classify(response),
    }
}

/// Poll `check` every 25 ms until it holds; panic naming `what` after `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Tally of outcomes, printed as the `COUNTS` line.
#[derive(Debug, Default)]
pub struct Tally(pub HashMap<String, u64>);

impl Tally {
    /// Count one `what`.
    pub fn add(&mut self, what: impl Into<String>) {
        *self.0.entry(what.into()).or_default() += 1;
    }

    /// How many `what` were counted.
    pub fn get(&self, what: &str) -> u64 {
        self.0.get(what).copied().unwrap_or(0)
    }

    /// Everything counted.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// `name=count` pairs, sorted.
    pub fn line(&self) -> String {
        let mut parts: Vec<_> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        parts.sort();
        parts.join(" ")
    }

    /// The tally of what clients saw (by [`Seen`]'s name).
    pub fn of_seen<'a>(seen: impl IntoIterator<Item = &'a Seen>) -> Tally {
        let mut tally = Tally::default();
        for s in seen {
            tally.add(format!("{s:?}"));
        }
        tally
    }
}

/// `text` without ANSI escape sequences (the app logs in colour).
pub fn strip_ansi(text: &str) -> String {
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
pub fn keys_logged_unstored(log: &str) -> HashSet<String> {
    strip_ansi(log)
        .lines()
        .filter(|l| l.contains("could not store the response"))
        .filter_map(|l| {
            // The key comes in the request's span, `idempotency{key=... `, or as a field.
            let start = l.find("{key=").or_else(|| l.find(" key="))? + 5;
            let rest = &l[start..];
            Some(rest.split([' ', '}']).next()?.to_owned())
        })
        .collect()
}

/// A steady stream of keyed requests from several client threads while a test breaks
/// something: key `k` is `{prefix}-{k}` with amount `100 + k`, and every third key is sent
/// twice at once. Every answer must classify; the first that does not fails the test.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Client threads.
    pub clients: usize,
    /// Key prefix.
    pub prefix: &'static str,
    /// The `x-account-id` of every request.
    pub tenant: &'static str,
    /// How answers are classified ([`classify`] or [`classify_transactional`]).
    pub classify: fn(&Response) -> Result<Seen, String>,
}

/// What a [`Load`] saw.
#[derive(Debug, Default)]
pub struct LoadLog {
    /// (key number, what the client saw), in order of arrival.
    pub during: Vec<(usize, Seen)>,
    /// Keys `0..keys_sent` were sent.
    pub keys_sent: usize,
}

impl LoadLog {
    /// What each key saw during the load.
    pub fn seen_by_key(&self) -> HashMap<usize, Vec<Seen>> {
        let mut by_key: HashMap<usize, Vec<Seen>> = HashMap::new();
        for (k, seen) in &self.during {
            by_key.entry(*k).or_default().push(*seen);
        }
        by_key
    }

    /// The tally of what clients saw during the load.
    pub fn tally(&self) -> Tally {
        Tally::of_seen(self.during.iter().map(|(_, s)| s))
    }
}

impl Load {
    /// The key of number `k`.
    pub fn key(&self, k: usize) -> String {
        format!("{}-{k}", self.prefix)
    }

    /// The request for key number `k`.
    pub fn request(&self, k: usize) -> Request {
        pay(self.tenant, &self.key(k), 100 + k as u64, None)
    }

    /// Run the load against `addr` while `fault` runs on this thread, then stop the clients
    /// and return what they saw.
    pub fn run(&self, addr: &str, fault: impl FnOnce()) -> LoadLog {
        let stop = Arc::new(AtomicBool::new(false));
        let next_key = Arc::new(AtomicUsize::new(0));
        let log: Arc<Mutex<Vec<(usize, Seen)>>> = Arc::default();
        let clients: Vec<JoinHandle<Result<(), String>>> = (0..self.clients)
            .map(|_| {
                let (stop, next_key, log, addr, load) = (
                    Arc::clone(&stop),
                    Arc::clone(&next_key),
                    Arc::clone(&log),
                    addr.to_owned(),
                    *self,
                );
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let k = next_key.fetch_add(1, Ordering::SeqCst);
                        let sends = if k % 3 == 0 { 2 } else { 1 };
                        for _ in 0..sends {
                            let key = load.key(k);
                            let response = send_once(&addr, &load.request(k), CLIENT_TIMEOUT)
                                .map_err(|e| format!("key {key}: no answer: {e}"))?;
                            let seen = (load.classify)(&response)
                                .map_err(|e| format!("key {key}: {e}"))?;
                            log.lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((k, seen));
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Ok(())
                })
            })
            .collect();
        fault();
        stop.store(true, Ordering::SeqCst);
        for client in clients {
            client
                .join()
                .expect("client thread")
                .expect("contract held");
        }
        let during = std::mem::take(&mut *log.lock().unwrap_or_else(|e| e.into_inner()));
        LoadLog {
            during,
            keys_sent: next_key.load(Ordering::SeqCst),
        }
    }

    /// After the fault: send every key `0..keys_sent` again until it resolves (a replay, or a
    /// first run for a key that never ran), within `limit` for all of them. Appends what each
    /// key saw to `seen_by_key` and returns the tally of these requests.
    pub fn resolve(
        &self,
        addr: &str,
        keys_sent: usize,
        seen_by_key: &mut HashMap<usize, Vec<Seen>>,
        limit: Duration,
    ) -> Tally {
        let mut tally = Tally::default();
        let deadline = Instant::now() + limit;
        for k in 0..keys_sent {
            let key = self.key(k);
            loop {
                let response = send_once(addr, &self.request(k), CLIENT_TIMEOUT)
                    .unwrap_or_else(|e| panic!("key {key} after recovery: {e}"));
                let seen = (self.classify)(&response).unwrap_or_else(|e| panic!("key {key}: {e}"));
                seen_by_key.entry(k).or_default().push(seen);
                tally.add(format!("{seen:?}"));
                if matches!(seen, Seen::Created | Seen::Replay) {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "key {key} did not resolve after recovery"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        tally
    }
}

/// xorshift64*: a deterministic shuffle without a crate.
pub struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Requests of [`two_instances_exactly_once`].
pub const TWO_INSTANCE_REQUESTS: usize = 10_000;
/// Distinct keys among them (the rest are duplicates, 30 %).
pub const TWO_INSTANCE_DISTINCT: usize = 7_000;

/// What [`two_instances_exactly_once`] measured.
#[derive(Debug)]
pub struct TwoInstanceRun {
    /// What the clients saw (and how often they reconnected).
    pub tally: Tally,
    /// Handler executions per instance.
    pub totals: [u64; 2],
    /// Wall time of the requests.
    pub took: Duration,
}

impl TwoInstanceRun {
    /// The `COUNTS` line, named `name`.
    pub fn counts_line(&self, name: &str) -> String {
        format!(
            "COUNTS {name}: requests={TWO_INSTANCE_REQUESTS} distinct_keys={TWO_INSTANCE_DISTINCT} \
             executions={} (instance A {}, B {}) [{}] in {:.1}s",
            self.totals[0] + self.totals[1],
            self.totals[0],
            self.totals[1],
            self.tally.line(),
            self.took.as_secs_f64()
        )
    }
}

/// Two app processes sharing one store: [`TWO_INSTANCE_REQUESTS`] keyed requests with 30 %
/// duplicates fired from 32 keep-alive clients alternating between the instances (key
/// `two-{k}`, tenant `acct-{k % 7}`); a 503 is retried. Asserts that handler executions equal
/// the distinct keys, exactly, and that every request got a final answer.
pub fn two_instances_exactly_once(apps: &[crate::proc::PaymentsApp; 2]) -> TwoInstanceRun {
    const CLIENTS: usize = 32;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut work: Vec<usize> = (0..TWO_INSTANCE_DISTINCT).collect();
    work.extend(
        (0..TWO_INSTANCE_REQUESTS - TWO_INSTANCE_DISTINCT)
            .map(|_| rng.below(TWO_INSTANCE_DISTINCT)),
    );
    // Shuffle, so many duplicates arrive while the original is still in flight (on the other
    // instance).
    for i in (1..work.len()).rev() {
        let j = rng.below(i + 1);
        work.swap(i, j);
    }
    let work = Arc::new(work);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let threads: Vec<JoinHandle<Result<Tally, String>>> = (0..CLIENTS)
        .map(|c| {
            let (work, next) = (Arc::clone(&work), Arc::clone(&next));
            let addrs = [apps[0].addr.clone(), apps[1].addr.clone()];
            std::thread::spawn(move || {
                let mut tally = Tally::default();
                let mut conns: [Option<crate::raw_http::Conn>; 2] = [None, None];
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    let Some(&k) = work.get(i) else { break };
                    let instance = (c + i) % 2;
                    let request = pay(
                        &format!("acct-{}", k % 7),
                        &format!("two-{k}"),
                        100 + (k % 1000) as u64,
                        None,
                    );
                    let mut attempts = 0;
                    loop {
                        attempts += 1;
                        let conn = match &mut conns[instance] {
                            Some(conn) => conn,
                            slot => slot.insert(
                                crate::raw_http::Conn::connect(&addrs[instance], CLIENT_TIMEOUT)
                                    .map_err(|e| format!("connect: {e}"))?,
                            ),
                        };
                        let response = match conn.send(&request) {
                            Ok(r) => r,
                            Err(_) if attempts < 3 => {
                                // A keep-alive connection the server closed; reconnect.
                                tally.add("reconnects");
                                conns[instance] = None;
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
    let mut totals = [0; 2];
    for (app, total) in apps.iter().zip(&mut totals) {
        let stats = app.stats();
        *total = stats.total;
        for (key, n) in stats.per_key {
            *per_key.entry(key).or_default() += n;
        }
    }
    let twice: Vec<_> = per_key.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "keys not run exactly once: {twice:?}");
    assert_eq!(
        per_key.len(),
        TWO_INSTANCE_DISTINCT,
        "every distinct key ran"
    );
    assert_eq!(
        totals[0] + totals[1],
        TWO_INSTANCE_DISTINCT as u64,
        "executions == distinct keys"
    );
    let answers = tally.get("Created") + tally.get("Replay") + tally.get("Conflict");
    assert_eq!(
        answers,
        TWO_INSTANCE_REQUESTS as u64,
        "every request got a final answer: {}",
        tally.line()
    );
    TwoInstanceRun {
        tally,
        totals,
        took,
    }
}

/// The lease both apps of [`sigkill_while_the_handler_runs`] must run with
/// (`IDEMPOTENCY_LOCK_TIMEOUT_MS`): its timing checks are written against it.
pub const SIGKILL_LEASE_MS: &str = "4000";

/// A key's record as [`sigkill_while_the_handler_runs`] reads it, from whichever store holds it.
#[derive(Debug, Clone)]
pub struct KeyRecord {
    /// In flight or completed.
    pub state: crate::records::State,
    /// The reservation's fencing token, as text.
    pub token: Option<String>,
    /// The stored body of a completed record.
    pub body: Option<Vec<u8>>,
}

/// SIGKILL while a handler runs, on any store (the PostgreSQL and the Redis fault tests run
/// it): `first` starts the handler for key `crash-1` (it sleeps 2 s) and is killed; a retry on
/// `second` inside the lease gets 409; after the lease one retry runs the handler and
/// completes; a replay follows; the dead reservation never completes. Both apps run with
/// [`SIGKILL_LEASE_MS`]; `request` is the keyed request for `crash-1` with `delay_ms=2000`,
/// and `records` reads that key's records. Prints the `COUNTS` line under `name`.
pub fn sigkill_while_the_handler_runs(
    name: &str,
    mut first: crate::proc::PaymentsApp,
    second: &crate::proc::PaymentsApp,
    request: &Request,
    records: impl Fn() -> Vec<KeyRecord>,
) {
    use crate::records::State;
    // The reservation is made after this and before the test sees it (it polls the store,
    // which on a loaded machine can take a second or more): the lease ends no earlier than
    // 4 s after `sent`, and that is what the takeover is checked against.
    let sent = Instant::now();
    let in_flight = {
        let (addr, request) = (first.addr.clone(), request.clone());
        std::thread::spawn(move || send_once(&addr, &request, CLIENT_TIMEOUT))
    };
    wait_until(Duration::from_secs(10), "the reservation", || {
        records().iter().any(|r| r.state == State::InFlight)
    });
    let reserved_at = Instant::now();
    let dead = records().remove(0);
    assert_eq!(
        first.stats().per_key.get("crash-1"),
        Some(&1),
        "the handler is running"
    );
    first.kill();
    let lost = in_flight.join().expect("client thread");
    assert!(lost.is_err(), "the killed process answered: {lost:?}");

    let mut tally = Tally::default();
    let early = send_once(&second.addr, request, CLIENT_TIMEOUT).expect("retry");
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
        let response = send_once(&second.addr, request, CLIENT_TIMEOUT).expect("retry");
        match classify(&response) {
            Ok(Seen::Conflict) => tally.add("409_until_lease_end"),
            Ok(Seen::Created) => break response,
            other => panic!("retry: {other:?} {}", response.describe()),
        }
        assert!(Instant::now() < deadline, "the key was never taken over");
        std::thread::sleep(Duration::from_millis(200));
    };
    tally.add("201_after_lease");
    let taken_over_after = sent.elapsed();
    assert!(
        taken_over_after >= Duration::from_millis(3900),
        "taken over {taken_over_after:?} after the request was sent, before the 4 s lease ended"
    );
    assert_eq!(second.stats().per_key.get("crash-1"), Some(&1));
    let replay = send_once(&second.addr, request, CLIENT_TIMEOUT).expect("replay");
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.body, completed.body);
    tally.add("replay");

    // The dead reservation never completes: its token is gone from the record for good.
    std::thread::sleep(Duration::from_millis(500));
    let rows = records();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].state, State::Completed);
    assert_ne!(
        rows[0].token, dead.token,
        "the dead holder's token completed the record"
    );
    assert_eq!(rows[0].body.as_deref(), Some(&completed.body[..]));
    println!(
        "COUNTS {name}: requests={} executions_dead_process=1 executions_new_process={} retry_completed_after={:.1}s [{}]",
        tally.0.values().sum::<u64>() + 1,
        second.stats().total,
        taken_over_after.as_secs_f64(),
        tally.line()
    );
}
