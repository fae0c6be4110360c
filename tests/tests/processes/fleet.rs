//! Several `payments` instances sharing one store, and the operator's `idem-cli`
//! running while traffic flows. Real processes, real PostgreSQL / Redis, real HTTP.
//!
//! Executions are counted from each instance's `GET /stats` and summed per key.

use std::collections::HashMap;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use idempotency_e2e::faults::{
    self, classify, classify_transactional, serial, shared, wait_until, Seen, Tally, CLIENT_TIMEOUT,
};
use idempotency_e2e::proc::{run_idem_cli, PaymentsApp};
use idempotency_e2e::raw_http::{send_once, Request, Response};
use idempotency_e2e::records::{execute, records_for_key, State};
use idempotency_e2e::redis_server::RedisServer;
use idempotency_e2e::{block_on_fresh_thread, server_url, TestDb};

const TENANT: &str = "acct_fleet";
/// The app's variable for its lease, in milliseconds.
const LEASE_MS: &str = "IDEMPOTENCY_LOCK_TIMEOUT_MS";
/// The example in transactional mode.
const TRANSACTIONAL: (&str, &str) = ("PAYMENTS_TRANSACTIONAL", "1");

/// One `#[test]` per `name => body;`: each takes the `shared()` lock, then runs `body`.
macro_rules! shared_tests {
    ($($name:ident => $body:expr;)+) => {
        $(
            #[test]
            fn $name() {
                let _s = shared();
                $body;
            }
        )+
    };
}

fn new_db() -> TestDb {
    block_on_fresh_thread(TestDb::new()).expect("creating a test database")
}

fn pay(key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    faults::pay(TENANT, key, amount, delay_ms)
}

/// The store the instances share: a fresh PostgreSQL database or a private redis-server.
enum Store {
    Postgres(TestDb),
    /// The server (killed when dropped) and its URL.
    Redis {
        _server: RedisServer,
        url: String,
    },
}

impl Store {
    /// A fresh test database.
    fn postgres() -> Store {
        Store::Postgres(new_db())
    }

    /// A private redis-server, with its URL.
    fn redis() -> Store {
        let redis = RedisServer::start();
        let url = redis.url();
        Store::Redis {
            _server: redis,
            url,
        }
    }

    /// The variable that names this store (for the app and `idem-cli`), and its URL.
    fn var(&self) -> (&'static str, &str) {
        match self {
            Store::Postgres(db) => ("DATABASE_URL", &db.url),
            Store::Redis { url, .. } => ("REDIS_URL", url),
        }
    }

    /// The database URL (to read the table directly) on PostgreSQL; `None` on Redis.
    fn pg_url(&self) -> Option<&str> {
        match self {
            Store::Postgres(db) => Some(&db.url),
            Store::Redis { .. } => None,
        }
    }

    /// An app's environment: the store's variable, then `extra`.
    fn env<'a>(&'a self, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut env = vec![self.var()];
        env.extend_from_slice(extra);
        env
    }

    /// Runs `idem-cli args...` against this store.
    fn cli(&self, args: &[&str]) -> Output {
        let (var, url) = self.var();
        run_idem_cli(var, url, args)
    }
}

/// Executions per key summed over every instance.
fn executions(apps: &[PaymentsApp]) -> HashMap<String, u64> {
    let mut per_key: HashMap<String, u64> = HashMap::new();
    for app in apps {
        for (k, n) in app.stats().per_key {
            *per_key.entry(k).or_default() += n;
        }
    }
    per_key
}

/// Executions of `key` on each instance, in order.
fn executions_of(apps: &[&PaymentsApp], key: &str) -> Vec<u64> {
    apps.iter()
        .map(|a| a.stats().per_key.get(key).copied().unwrap_or(0))
        .collect()
}

/// Rows in the example's `payments` table for `key`.
fn payment_rows(url: &str, key: &str) -> i64 {
    idempotency_e2e::records::count(
        url,
        &format!("SELECT count(*) AS n FROM payments WHERE idempotency_key = '{key}'"),
    )
}

/// Send unkeyed payments so this instance's payment ids differ from the others' (the example
/// numbers payments per process from 1): bodies then tell instances apart.
fn bump_ids(app: &PaymentsApp, n: usize) {
    for _ in 0..n {
        let r = send_once(
            &app.addr,
            &Request::post("/payments").json(r#"{"amount":1,"currency":"EUR"}"#),
            CLIENT_TIMEOUT,
        )
        .expect("unkeyed payment");
        assert_eq!(r.status, 201, "{}", r.describe());
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// A response still to come, from a request sent on its own thread.
type Pending = JoinHandle<std::io::Result<Response>>;

/// Sends `request` on its own thread.
fn send_bg(addr: &str, request: &Request) -> Pending {
    let (addr, request) = (addr.to_owned(), request.clone());
    std::thread::spawn(move || send_once(&addr, &request, Duration::from_secs(30)))
}

/// Sends `request` to `app` on its own thread and waits until `app` (`name`: "A", "B") runs
/// the handler for `key`.
fn send_bg_until_running(app: &PaymentsApp, name: &str, key: &str, request: &Request) -> Pending {
    let handle = send_bg(&app.addr, request);
    wait_until(
        Duration::from_secs(10),
        &format!("{name} runs the handler"),
        || app.stats().per_key.contains_key(key),
    );
    handle
}

/// The response a [`send_bg`] thread got; panics with `what` if it got none.
fn answer(handle: Pending, what: &str) -> Response {
    handle.join().expect("client").expect(what)
}

// --------------------------------------------------------------------------------------------
// idem-cli as a process

fn cli(url: &str, args: &[&str]) -> Output {
    run_idem_cli("DATABASE_URL", url, args)
}

fn out_text(o: &Output) -> String {
    format!(
        "exit={:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

// --------------------------------------------------------------------------------------------
// 1. The same key sent at the same moment to three instances.

/// Starts three instances with the same environment.
fn three_apps(env: &[(&str, &str)]) -> [PaymentsApp; 3] {
    [
        PaymentsApp::start(env),
        PaymentsApp::start(env),
        PaymentsApp::start(env),
    ]
}

/// Sends each of 120 keys `{name}-{k}` to the three instances at once, then checks that every
/// key resolves to its one fresh response and ran exactly once.
fn same_key_to_three_instances(
    name: &str,
    apps: &[PaymentsApp; 3],
    classify: fn(&Response) -> Result<Seen, String>,
) {
    const KEYS: usize = 120;
    const BATCH: usize = 10;
    let addrs: Vec<String> = apps.iter().map(|a| a.addr.clone()).collect();
    // Every fifth key has a slow handler, so the others arrive while it runs.
    let request = |k: usize| {
        pay(
            &format!("{name}-{k}"),
            100 + k as u64,
            k.is_multiple_of(5).then_some(300),
        )
    };
    let mut created_bodies: HashMap<usize, Vec<u8>> = HashMap::new();
    let mut seen_all: HashMap<String, u64> = HashMap::new();
    for batch in 0..KEYS / BATCH {
        let barrier = Arc::new(Barrier::new(BATCH * 3));
        let mut threads = Vec::new();
        for i in 0..BATCH {
            let k = batch * BATCH + i;
            for addr in &addrs {
                let (barrier, addr) = (Arc::clone(&barrier), addr.clone());
                let request = request(k);
                threads.push(std::thread::spawn(move || {
                    barrier.wait();
                    (k, send_once(&addr, &request, CLIENT_TIMEOUT))
                }));
            }
        }
        for t in threads {
            let (k, r) = t.join().expect("client");
            let r = r.unwrap_or_else(|e| panic!("key {k}: no answer: {e}"));
            let seen = classify(&r).unwrap_or_else(|e| panic!("key {k}: {e}"));
            *seen_all.entry(format!("{seen:?}")).or_default() += 1;
            if seen == Seen::Created {
                assert!(
                    created_bodies.insert(k, r.body.clone()).is_none(),
                    "key {name}-{k}: two fresh 201s for one key"
                );
            }
        }
    }
    // Afterwards every key resolves: a replay of the one fresh response (or a first run when
    // every concurrent request got 409/503 and nothing ran).
    for k in 0..KEYS {
        let key = format!("{name}-{k}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let r = send_once(&addrs[k % 3], &request(k), CLIENT_TIMEOUT).expect("resolve");
            match classify(&r) {
                Ok(Seen::Replay) => {
                    let first = created_bodies
                        .get(&k)
                        .unwrap_or_else(|| panic!("{key}: a replay but no fresh 201 was seen"));
                    assert_eq!(
                        &r.body, first,
                        "{key}: replay differs from the fresh response"
                    );
                    break;
                }
                Ok(Seen::Created) => {
                    assert!(
                        created_bodies.insert(k, r.body.clone()).is_none(),
                        "{key}: a second fresh 201 after the first completed"
                    );
                }
                Ok(_) => {}
                Err(e) => panic!("{key}: {e}"),
            }
            assert!(Instant::now() < deadline, "{key} never resolved");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let per_key = executions(apps);
    let wrong: Vec<_> = (0..KEYS)
        .map(|k| format!("{name}-{k}"))
        .filter(|k| per_key.get(k).copied().unwrap_or(0) != 1)
        .map(|k| (k.clone(), per_key.get(&k).copied().unwrap_or(0)))
        .collect();
    assert!(
        wrong.is_empty(),
        "{name}: keys not run exactly once: {wrong:?}"
    );
    let mut seen: Vec<_> = seen_all.into_iter().collect();
    seen.sort();
    println!("COUNTS {name}: keys={KEYS} x3 instances at once: {seen:?}");
}

shared_tests! {
    same_key_at_once_on_three_instances_postgres =>
        same_key_to_three_instances("pg3", &three_apps(&Store::postgres().env(&[])), classify);
    same_key_at_once_on_three_instances_redis =>
        same_key_to_three_instances("rd3", &three_apps(&Store::redis().env(&[])), classify);
}

#[test]
fn same_key_at_once_on_three_instances_postgres_transactional() {
    let _s = shared();
    let db = new_db();
    let apps = three_apps(&[("DATABASE_URL", db.url.as_str()), TRANSACTIONAL]);
    same_key_to_three_instances("tx3", &apps, classify_transactional);
    // The table is the truth about effects: one payment row per key.
    let dup = idempotency_e2e::records::count(
        &db.url,
        "SELECT count(*) AS n FROM (SELECT idempotency_key FROM payments \
         GROUP BY idempotency_key HAVING count(*) <> 1) d",
    );
    assert_eq!(dup, 0, "keys with other than one payments row");
}

// --------------------------------------------------------------------------------------------
// 2. A slow handler on A (longer than its lease: renewals must keep it) while B gets retries.

/// A's handler takes 3.5 s with a 1.2 s lease; retries on B get 409 until B replays A's
/// response, and the handler runs once.
fn slow_on_a_retries_on_b(store: &Store) {
    let env = store.env(&[(LEASE_MS, "1200")]);
    let a = PaymentsApp::start(&env);
    let b = PaymentsApp::start(&env);
    bump_ids(&b, 3);
    let request = pay("slow-1", 555, Some(3500));
    let first = send_bg_until_running(&a, "A", "slow-1", &request);
    let mut conflicts = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    let replay = loop {
        let r = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("retry on B");
        match classify(&r) {
            Ok(Seen::Conflict) => conflicts += 1,
            Ok(Seen::Replay) => break r,
            other => panic!(
                "retry on B while A's slow handler runs (lease 1.2 s, handler 3.5 s): {other:?} {}",
                r.describe()
            ),
        }
        assert!(Instant::now() < deadline, "never replayed");
        std::thread::sleep(Duration::from_millis(150));
    };
    let original = answer(first, "A answered");
    assert_eq!(original.status, 201, "{}", original.describe());
    assert_eq!(replay.body, original.body, "B replays A's response");
    assert!(conflicts > 5, "B saw only {conflicts} 409s");
    assert_eq!(executions_of(&[&a, &b], "slow-1"), vec![1, 0]);
    println!("COUNTS slow_on_a: conflicts_on_b={conflicts} then replay");
}

shared_tests! {
    slow_handler_past_its_lease_on_a_retries_on_b_get_409_then_replay_postgres =>
        slow_on_a_retries_on_b(&Store::postgres());
    slow_handler_past_its_lease_on_a_retries_on_b_get_409_then_replay_redis =>
        slow_on_a_retries_on_b(&Store::redis());
}

// --------------------------------------------------------------------------------------------
// 3. SIGSTOP of A past its lease; B takes over; A wakes up.

/// `b_completes_first`: A is woken only after B's takeover completed; otherwise A is woken
/// while B's handler still runs. The lease is 2 s; on PostgreSQL the table's tokens are
/// checked too.
fn frozen_instance(store: &Store, b_completes_first: bool) {
    let env = store.env(&[(LEASE_MS, "2000")]);
    let pg_url = store.pg_url();
    let a = PaymentsApp::start(&env);
    let b = PaymentsApp::start(&env);
    bump_ids(&b, 5);
    let key = "frozen-1";
    let request = pay(key, 4242, Some(1500));
    let first = send_bg_until_running(&a, "A", key, &request);
    let a_token = pg_url.map(|u| records_for_key(u, key)[0].token);
    signal(a.pid(), "-STOP");
    let stopped = Instant::now();
    // Lease 2 s: retries on B get 409 until it ends, then one takes over.
    let mut conflicts = 0;
    loop {
        // B's handler takes 1.5 s too; send it in the background and look at what comes back.
        let r = send_once(&b.addr, &request, Duration::from_millis(300));
        match r {
            Ok(r) => match classify(&r) {
                Ok(Seen::Conflict) => conflicts += 1,
                other => panic!("B while A is frozen: {other:?} {}", r.describe()),
            },
            Err(_) => {
                // Timed out: B is running the handler (taken over). Wait for it below.
                break;
            }
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(15),
            "B never took over"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        b.stats().per_key.get(key),
        Some(&1),
        "B runs the handler after A's lease ended"
    );
    assert!(
        stopped.elapsed() >= Duration::from_millis(1500),
        "B took over {:?} after A froze, inside the lease",
        stopped.elapsed()
    );
    let b_token = pg_url.map(|u| records_for_key(u, key)[0].token);
    if let (Some(at), Some(bt)) = (&a_token, &b_token) {
        assert_ne!(at, bt, "B holds a new token");
    }
    if b_completes_first {
        wait_until(Duration::from_secs(10), "B's response stored", || {
            send_once(&b.addr, &request, CLIENT_TIMEOUT).is_ok_and(|r| r.is_replay())
        });
    }
    let b_body = if b_completes_first {
        Some(
            send_once(&b.addr, &request, CLIENT_TIMEOUT)
                .expect("replay")
                .body,
        )
    } else {
        None
    };
    signal(a.pid(), "-CONT");
    let a_response = answer(first, "A answers after SIGCONT");
    assert_eq!(a_response.status, 201, "{}", a_response.describe());
    assert!(!a_response.is_replay());
    if !b_completes_first {
        // While B still runs (its 1.5 s), A woke up: its renewal and complete are fenced.
        if let (Some(u), Some(bt)) = (pg_url, &b_token) {
            let rows = records_for_key(u, key);
            assert_eq!(rows.len(), 1);
            assert_eq!(&rows[0].token, bt, "A's wake-up replaced B's reservation");
        }
    }
    // Let every background task of A and B finish (renewals, stale completes).
    std::thread::sleep(Duration::from_millis(3000));
    let replay_a = send_once(&a.addr, &request, CLIENT_TIMEOUT).expect("replay on A");
    let replay_b = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("replay on B");
    assert!(replay_a.is_replay(), "{}", replay_a.describe());
    assert!(replay_b.is_replay(), "{}", replay_b.describe());
    assert_eq!(replay_a.body, replay_b.body);
    assert_ne!(
        replay_a.body,
        a_response.body,
        "the frozen holder's response was stored over the takeover: {}",
        replay_a.text()
    );
    if let Some(bb) = b_body {
        assert_eq!(
            replay_a.body, bb,
            "the stored response changed after B stored it"
        );
    }
    if let (Some(u), Some(bt)) = (pg_url, &b_token) {
        let rows = records_for_key(u, key);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].state, State::Completed);
        assert_eq!(&rows[0].token, bt);
    }
    // One run each: A's lease ended while it was frozen (C9: "hung past that limit").
    assert_eq!(executions_of(&[&a, &b], key), vec![1, 1]);
    let log = faults::strip_ansi(&a.log());
    println!(
        "COUNTS frozen_instance b_completes_first={b_completes_first}: conflicts_on_b={conflicts}; A log lines about stale/lost: {}",
        log.lines()
            .filter(|l| l.contains("stale") || l.contains("lost") || l.contains("taken over"))
            .count()
    );
}

shared_tests! {
    sigstop_past_the_lease_woken_while_b_runs_postgres =>
        frozen_instance(&Store::postgres(), false);
    sigstop_past_the_lease_woken_after_b_completed_postgres =>
        frozen_instance(&Store::postgres(), true);
    sigstop_past_the_lease_woken_while_b_runs_redis => frozen_instance(&Store::redis(), false);
    sigstop_past_the_lease_woken_after_b_completed_redis => frozen_instance(&Store::redis(), true);
}

/// Starts transactional instances A and B on `db` (lease 2 s) and sends `request` (for `key`)
/// to A until its handler runs; returns A, B and A's pending answer.
fn transactional_a_and_b(
    db: &TestDb,
    key: &str,
    request: &Request,
) -> (PaymentsApp, PaymentsApp, Pending) {
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        TRANSACTIONAL,
        (LEASE_MS, "2000"),
    ];
    let a = PaymentsApp::start(&env);
    let b = PaymentsApp::start(&env);
    let first = send_bg_until_running(&a, "A", key, request);
    (a, b, first)
}

/// SIGSTOP in transactional mode: A's transaction (with its claim and payments row) is open
/// while A is frozen past its lease. transactional.md: "nothing else can take an open
/// transaction's claim" and a hung app holds it until `idle_in_transaction_session_timeout`.
/// So B must get only 409 (never a second run) while A is frozen, and A's commit after
/// SIGCONT is the one response: B replays it. Exactly one payments row.
#[test]
fn sigstop_past_the_lease_transactional_one_payment_row() {
    let _s = shared();
    let db = new_db();
    let key = "frozen-tx";
    let request = pay(key, 777, Some(1500));
    let (a, b, first) = transactional_a_and_b(&db, key, &request);
    signal(a.pid(), "-STOP");
    let stopped = Instant::now();
    let mut seen = Vec::new();
    // Twice the lease.
    while stopped.elapsed() < Duration::from_secs(4) {
        let r = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("B answers");
        let s = classify_transactional(&r).unwrap_or_else(|e| panic!("{e}"));
        seen.push((stopped.elapsed().as_millis(), s));
        std::thread::sleep(Duration::from_millis(200));
    }
    signal(a.pid(), "-CONT");
    let a_resp = answer(first, "A answers after SIGCONT");
    let deadline = Instant::now() + Duration::from_secs(15);
    let b_final = loop {
        let r = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("B answers");
        let s = classify_transactional(&r).unwrap_or_else(|e| panic!("{e}"));
        if matches!(s, Seen::Created | Seen::Replay) {
            break r;
        }
        assert!(Instant::now() < deadline, "B never resolved after A woke");
        std::thread::sleep(Duration::from_millis(200));
    };
    let rows = payment_rows(&db.url, key);
    let ex = executions_of(&[&a, &b], key);
    println!(
        "COUNTS frozen_tx: B saw while A frozen {:?}; A answered {}; payments rows={rows}; executions={ex:?}",
        Tally::of_seen(seen.iter().map(|(_, s)| s)).line(),
        a_resp.status,
    );
    assert!(
        seen.iter().all(|(_, s)| *s == Seen::Conflict),
        "while A's transaction is open, B must only get 409: {seen:?}"
    );
    assert_eq!(a_resp.status, 201, "{}", a_resp.describe());
    assert!(b_final.is_replay(), "{}", b_final.describe());
    assert_eq!(b_final.body, a_resp.body);
    assert_eq!(rows, 1, "payments rows for the key");
    assert_eq!(ex, vec![1, 0]);
}

// --------------------------------------------------------------------------------------------
// 4. idem-cli release of an in-flight key while its handler runs on A.

/// A's handler (4 s, lease 1.5 s) runs; `idem-cli release` is refused while A renews its lease
/// and succeeds with --force; A's renewals must not bring the record back. A retry on B then
/// runs the handler a second time (documented in operations.md) and B's response is stored.
/// On PostgreSQL the table is checked between the steps too.
fn release_of_a_running_key(store: &Store, key: &str, amount: u64) {
    let env = store.env(&[(LEASE_MS, "1500")]);
    let pg_url = store.pg_url();
    let a = PaymentsApp::start(&env);
    let b = PaymentsApp::start(&env);
    bump_ids(&b, 7);
    let request = pay(key, amount, Some(4000));
    let first = send_bg_until_running(&a, "A", key, &request);
    // Without --force: refused, exit 6, record untouched.
    let o = store.cli(&["release", key, "--tenant", TENANT]);
    assert_eq!(o.status.code(), Some(6), "{}", out_text(&o));
    if let Some(u) = pg_url {
        assert_eq!(records_for_key(u, key).len(), 1);
    }
    // After A's own lease would have ended without renewal (1.5 s): still refused (renewed).
    std::thread::sleep(Duration::from_millis(2000));
    let o = store.cli(&["release", key, "--tenant", TENANT]);
    assert_eq!(
        o.status.code(),
        Some(6),
        "{key}: a renewed lease must still be refused: {}",
        out_text(&o)
    );
    // --force: released.
    let o = store.cli(&["release", key, "--tenant", TENANT, "--force"]);
    assert_eq!(o.status.code(), Some(0), "{}", out_text(&o));
    // A's renewals (every 0.5 s) keep running until its handler returns: they must not bring
    // the record back.
    for _ in 0..8 {
        if let Some(u) = pg_url {
            assert!(
                records_for_key(u, key).is_empty(),
                "the released reservation came back (renewal resurrected it)"
            );
            std::thread::sleep(Duration::from_millis(150));
        } else {
            let o = store.cli(&["show", key, "--tenant", TENANT, "--format", "json"]);
            assert_eq!(
                o.status.code(),
                Some(6),
                "the released reservation came back: {}",
                out_text(&o)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // A retry on B runs the handler a second time (documented in operations.md).
    let second = send_bg_until_running(&b, "B", key, &request);
    let b_token = pg_url.map(|u| records_for_key(u, key)[0].token);
    let a_resp = answer(first, "A answered");
    assert_eq!(a_resp.status, 201);
    if let (Some(u), Some(bt)) = (pg_url, b_token) {
        std::thread::sleep(Duration::from_millis(300));
        let rows = records_for_key(u, key);
        assert_eq!(rows.len(), 1);
        assert_eq!(
            rows[0].state,
            State::InFlight,
            "A's response stored after the release"
        );
        assert_eq!(rows[0].token, bt);
    }
    let b_resp = answer(second, "B answered");
    assert_eq!(b_resp.status, 201);
    std::thread::sleep(Duration::from_millis(300));
    let replay = send_once(&a.addr, &request, CLIENT_TIMEOUT).expect("replay");
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(
        replay.body, b_resp.body,
        "{key}: the stored response is B's, not A's"
    );
    assert_eq!(executions_of(&[&a, &b], key), vec![1, 1]);
}

shared_tests! {
    cli_release_of_a_running_key_refused_then_forced_postgres =>
        release_of_a_running_key(&Store::postgres(), "rel-1", 900);
    cli_release_forced_of_a_running_key_redis =>
        release_of_a_running_key(&Store::redis(), "rel-r", 901);
}

/// A holder (instance A, lease 1.5 s) frozen with SIGSTOP mid-handler until its lease has
/// ended; meanwhile the operator runs `idem-cli args`, and `check` judges its output (right
/// after A is woken). A's client still gets its 201; `what` the operator did must stay done:
/// A, awake, neither stores nor renews the record back into existence (PostgreSQL: no row for
/// the key; Redis: `idem-cli show` finds none).
fn operator_acts_while_the_holder_is_frozen(
    store: &Store,
    key: &str,
    amount: u64,
    args: &[&str],
    what: &str,
    check: impl FnOnce(&Output),
) {
    let env = store.env(&[(LEASE_MS, "1500")]);
    let a = PaymentsApp::start(&env);
    let request = pay(key, amount, Some(800));
    let first = send_bg_until_running(&a, "A", key, &request);
    signal(a.pid(), "-STOP");
    std::thread::sleep(Duration::from_millis(2500));
    let o = store.cli(args);
    signal(a.pid(), "-CONT");
    check(&o);
    let a_resp = answer(first, "A answered");
    assert_eq!(a_resp.status, 201);
    std::thread::sleep(Duration::from_millis(1500));
    if let Some(u) = store.pg_url() {
        let rows = records_for_key(u, key);
        assert!(
            rows.is_empty(),
            "after {what}, the woken holder wrote the record back: {:?}",
            rows.iter().map(|r| (r.state, r.token)).collect::<Vec<_>>()
        );
    } else {
        let o = store.cli(&["show", key, "--tenant", TENANT]);
        assert_eq!(
            o.status.code(),
            Some(6),
            "after {what}, the woken holder wrote the record back: {}",
            out_text(&o)
        );
    }
}

/// A frozen A whose lease ended: `release` without --force is allowed (lease ended). When A
/// wakes it must neither store nor renew the released record back into existence.
#[test]
fn cli_release_of_a_frozen_holders_key_then_wake_up_postgres() {
    let _s = shared();
    operator_acts_while_the_holder_is_frozen(
        &Store::postgres(),
        "rel-frozen",
        902,
        &["release", "rel-frozen", "--tenant", TENANT],
        "release",
        |o| {
            assert!(
                o.status.code() == Some(0),
                "release after the lease ended: {}",
                out_text(o)
            )
        },
    );
}

// --------------------------------------------------------------------------------------------
// 5. The operator's commands while traffic runs on two instances.

/// The request for key `op-{k}`; every fourth has a slow handler.
fn op_request(k: usize) -> Request {
    pay(
        &format!("op-{k}"),
        10 + k as u64,
        k.is_multiple_of(4).then_some(400),
    )
}

#[test]
fn cli_purge_list_show_stats_while_traffic_runs_never_lose_a_live_record() {
    let _s = serial();
    let db = new_db();
    let env = [("DATABASE_URL", db.url.as_str()), (LEASE_MS, "5000")];
    let apps = [PaymentsApp::start(&env), PaymentsApp::start(&env)];
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..6 {
        let addrs = [apps[0].addr.clone(), apps[1].addr.clone()];
        let (stop, next) = (Arc::clone(&stop), Arc::clone(&next));
        clients.push(std::thread::spawn(move || -> Result<Vec<usize>, String> {
            let mut mine = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let k = next.fetch_add(1, Ordering::SeqCst);
                mine.push(k);
                let req = op_request(k);
                // The original and two retries, on alternating instances.
                for attempt in 0..3 {
                    let r = send_once(&addrs[(c + attempt) % 2], &req, CLIENT_TIMEOUT)
                        .map_err(|e| format!("op-{k}: {e}"))?;
                    classify(&r).map_err(|e| format!("op-{k}: {e}"))?;
                }
            }
            Ok(mine)
        }));
    }
    // The operator, meanwhile.
    let started = Instant::now();
    let mut runs = 0;
    while started.elapsed() < Duration::from_secs(8) {
        for args in [
            &["purge", "--grace", "0s"][..],
            &["purge", "--grace", "0s", "--batch-size", "1"][..],
            &["list", "--state", "in-flight"][..],
            &["list", "--format", "json", "--limit", "0"][..],
            &["stats", "--format", "json"][..],
            &["show", "op-1", "--tenant", TENANT][..],
        ] {
            let o = cli(&db.url, args);
            assert_eq!(o.status.code(), Some(0), "{args:?}: {}", out_text(&o));
            if args[0] == "purge" {
                let text = String::from_utf8_lossy(&o.stdout).to_string();
                assert!(
                    text.contains("purged 0 records") || text.contains("purge skipped"),
                    "purge deleted live records: {text}"
                );
            }
            runs += 1;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let mut sent = Vec::new();
    for c in clients {
        sent.extend(c.join().expect("client").expect("contract held"));
    }
    // Everything still there: one replay per key, one run per key.
    for &k in &sent {
        let key = format!("op-{k}");
        let r = send_once(&apps[k % 2].addr, &op_request(k), CLIENT_TIMEOUT).expect("replay");
        assert!(
            r.is_replay(),
            "{key}: record lost during the operator's commands: {}",
            r.describe()
        );
    }
    let per_key = executions(&apps);
    let wrong: Vec<_> = per_key.iter().filter(|(_, n)| **n != 1).collect();
    assert!(wrong.is_empty(), "keys run more than once: {wrong:?}");
    assert_eq!(per_key.len(), sent.len());
    println!(
        "COUNTS operator_under_traffic: keys={} cli_runs={runs}",
        sent.len()
    );
}

// --------------------------------------------------------------------------------------------
// 6. The password of a protected role is never printed.

const PASSWORD: &str = "s3/cr#t@x:y?z";
const PASSWORD_ENCODED: &str = "s3%2Fcr%23t%40x%3Ay%3Fz";
/// The same with raw `/`, `#`, `:`, `?` (operations.md says they work raw) and `@` encoded.
const PASSWORD_RAW_URL: &str = "s3/cr#t%40x:y?z";

/// A login role for one test, dropped at the end: its privileges in the test's database
/// first (`DROP OWNED` acts on the connected database only, and a role with privileges left
/// cannot be dropped), then the role itself from the server.
struct Role {
    name: String,
    server_url: String,
    db_url: String,
}

impl Role {
    /// A name no other run reuses: a role outlives its test run if its drop fails, and the
    /// process id alone came round again on a later run ("role already exists").
    fn name() -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        format!("idem_pw_{}_{nanos}", std::process::id())
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let dropped = block_on_fresh_thread({
            let name = self.name.clone();
            let (server, db) = (self.server_url.clone(), self.db_url.clone());
            async move {
                use diesel_async::SimpleAsyncConnection;
                let drop_owned = format!("DROP OWNED BY \"{name}\" CASCADE");
                let mut c = idempotency_actix::store::postgres::admin::establish(&db)
                    .await
                    .ok()?;
                c.batch_execute(&drop_owned).await.ok()?;
                let mut c = idempotency_actix::store::postgres::admin::establish(&server)
                    .await
                    .ok()?;
                c.batch_execute(&format!("{drop_owned}; DROP ROLE IF EXISTS \"{name}\""))
                    .await
                    .ok()
            }
        });
        if !matches!(dropped, Some(Some(()))) {
            eprintln!("warning: could not drop role {}", self.name);
        }
    }
}

fn leaks(text: &str) -> Vec<&'static str> {
    [
        PASSWORD,
        PASSWORD_ENCODED,
        PASSWORD_RAW_URL,
        "s3/cr",
        "s3%2F",
        "cr#t",
        "cr%23t",
        "x:y?z",
    ]
    .into_iter()
    .filter(|p| text.contains(p))
    .collect()
}

#[test]
fn operator_output_and_app_never_print_the_password() {
    let _s = shared();
    let db = new_db();
    let name = Role::name();
    let role = Role {
        name: name.clone(),
        server_url: server_url(),
        db_url: db.url.clone(),
    };
    execute(
        &server_url(),
        &format!("CREATE ROLE \"{name}\" LOGIN NOSUPERUSER PASSWORD '{PASSWORD}'"),
    );
    execute(
        &db.url,
        &format!(
            "GRANT USAGE ON SCHEMA public TO \"{name}\"; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO \"{name}\"; \
             GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO \"{name}\""
        ),
    );
    let hostpart = db
        .url
        .rsplit_once('@')
        .map(|(_, h)| h.to_owned())
        .expect("host");
    let urls = [
        format!("postgres://{name}:{PASSWORD_ENCODED}@{hostpart}"),
        format!("postgres://{name}:{PASSWORD_RAW_URL}@{hostpart}"),
    ];
    let bad_db = format!(
        "postgres://{name}:{PASSWORD_ENCODED}@{}/no_such_db_here",
        hostpart.split('/').next().unwrap_or("127.0.0.1:5432")
    );
    let dead_port = format!(
        "postgres://{name}:{PASSWORD_ENCODED}@127.0.0.1:1/{}",
        db.name
    );
    let (kv_host, kv_port) = idempotency_e2e::proxy::host_port(&db.url)
        .rsplit_once(':')
        .map(|(h, p)| (h.to_owned(), p.to_owned()))
        .expect("host:port");
    let kv = format!(
        "host={kv_host} port={kv_port} user={name} password='{PASSWORD}' dbname={} \
         connect_timeout=2",
        db.name
    );
    let app = PaymentsApp::start(&[("DATABASE_URL", urls[0].as_str()), (LEASE_MS, "3000")]);
    // Some completed and one in-flight key.
    for k in 0..3 {
        let r =
            send_once(&app.addr, &pay(&format!("pw-{k}"), 5, None), CLIENT_TIMEOUT).expect("pay");
        assert_eq!(r.status, 201, "{}", r.describe());
    }
    let running = send_bg(&app.addr, &pay("pw-run", 6, Some(3000)));
    wait_until(Duration::from_secs(10), "in flight", || {
        app.stats().per_key.contains_key("pw-run")
    });
    let mut outputs = Vec::new();
    for url in urls.iter().chain([&bad_db, &dead_port, &kv]) {
        for args in [
            &["list"][..],
            &["list", "--format", "json"][..],
            &["show", "pw-1", "--tenant", TENANT][..],
            &["show", "pw-run", "--format", "json"][..],
            &["show", "nope"][..],
            &["stats"][..],
            &["stats", "--format", "json"][..],
            &["release", "pw-run"][..],
            &["release", "pw-0"][..],
            &["purge", "--dry-run"][..],
            &["purge"][..],
            &["migrate", "--check"][..],
            &["migrate"][..],
            &["--connect-timeout", "1ms", "stats"][..],
            &["--database-url", url.as_str(), "--bogus-flag"][..],
            &["--database-url", url.as_str(), "list", "--older-than", "7x"][..],
        ] {
            let o = cli(url, args);
            outputs.push((url.clone(), args.join(" "), out_text(&o)));
        }
    }
    let _ = running.join();
    let mut leaked = Vec::new();
    for (url, args, text) in &outputs {
        let l = leaks(text);
        if !l.is_empty() {
            leaked.push(format!(
                "url#{} `{args}` leaks {l:?}:\n{text}",
                [&urls[0], &urls[1], &bad_db, &dead_port, &kv]
                    .iter()
                    .position(|u| *u == url)
                    .unwrap_or(99)
            ));
        }
    }
    let app_log = app.log();
    let l = leaks(&app_log);
    if !l.is_empty() {
        leaked.push(format!("the payments app's log leaks {l:?}"));
    }
    // Sanity: the CLI worked with the password URL at all.
    assert!(
        outputs
            .iter()
            .any(|(u, a, t)| u == &urls[0] && a == "stats" && t.contains("exit=Some(0)")),
        "stats with the role's URL failed: {:?}",
        outputs
            .iter()
            .find(|(u, a, _)| u == &urls[0] && a == "stats")
    );
    drop(role);
    assert!(
        leaked.is_empty(),
        "password printed:\n{}",
        leaked.join("\n---\n")
    );
}

// --------------------------------------------------------------------------------------------
// 7. SIGKILL of A mid-handler, retries on B and C: the C16/C9 rule, on three instances.

#[test]
fn sigkill_mid_handler_retries_on_two_others_run_once_after_the_lease() {
    let _s = shared();
    let db = new_db();
    let env = [("DATABASE_URL", db.url.as_str()), (LEASE_MS, "3000")];
    let mut a = PaymentsApp::start(&env);
    let b = PaymentsApp::start(&env);
    let c = PaymentsApp::start(&env);
    let request = pay("kill-3", 333, Some(2000));
    let sent = Instant::now();
    let first = send_bg_until_running(&a, "A", "kill-3", &request);
    a.kill();
    let _ = first.join();
    // B and C hammer concurrently: 409 until the lease ends, then exactly one takes over, and
    // the other gets 409 (in flight) then the replay.
    let mut threads = Vec::new();
    for app in [&b, &c] {
        let (addr, request) = (app.addr.clone(), request.clone());
        threads.push(std::thread::spawn(move || {
            let mut seen = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let r = send_once(&addr, &request, CLIENT_TIMEOUT).expect("answer");
                let s = classify(&r).unwrap_or_else(|e| panic!("{e}"));
                seen.push((sent.elapsed(), s));
                if matches!(s, Seen::Created | Seen::Replay) {
                    return (seen, r.body);
                }
                assert!(Instant::now() < deadline, "never resolved: {seen:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }));
    }
    let results: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("client"))
        .collect();
    let created: Vec<_> = results
        .iter()
        .flat_map(|(s, _)| s.iter().filter(|(_, x)| *x == Seen::Created))
        .collect();
    assert_eq!(created.len(), 1, "takeovers: {results:?}");
    assert!(
        created[0].0 >= Duration::from_millis(2900),
        "taken over {:?} after the request, inside the 3 s lease",
        created[0].0
    );
    assert_eq!(results[0].1, results[1].1, "both see the same response");
    assert_eq!(
        executions_of(&[&b, &c], "kill-3").iter().sum::<u64>(),
        1,
        "after the dead holder, one run"
    );
}

// --------------------------------------------------------------------------------------------
// 8. More operator-versus-holder races.

/// A frozen holder whose lease ended; `purge --grace 0s` deletes its reservation (documented:
/// in-flight reservations whose lease ended more than --grace ago). When it wakes up it must not
/// write the record back.
#[test]
fn purge_of_a_frozen_holders_reservation_then_wake_up_postgres() {
    let _s = shared();
    operator_acts_while_the_holder_is_frozen(
        &Store::postgres(),
        "purge-frozen",
        903,
        &["purge", "--grace", "0s"],
        "purge",
        |o| {
            assert_eq!(o.status.code(), Some(0), "{}", out_text(o));
            let purged = String::from_utf8_lossy(&o.stdout).to_string();
            assert!(purged.contains("1 in-flight"), "{purged}");
        },
    );
}

/// `idem-cli release` (with and without --force) of a key whose transactional claim is open on
/// A: it must answer within its bounds (no hang), and never make a second run possible while
/// A's transaction is open.
#[test]
fn cli_release_of_an_open_transactional_claim() {
    let _s = shared();
    let db = new_db();
    let key = "rel-tx";
    let request = pay(key, 904, Some(6000));
    let (a, b, first) = transactional_a_and_b(&db, key, &request);
    let mut log = Vec::new();
    for args in [
        &["release", key, "--tenant", TENANT][..],
        &["release", key, "--tenant", TENANT, "--force"][..],
        &["show", key, "--tenant", TENANT][..],
    ] {
        let t = Instant::now();
        let o = cli(&db.url, args);
        log.push(format!("{args:?} in {:?}: {}", t.elapsed(), out_text(&o)));
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "{args:?} took {:?}",
            t.elapsed()
        );
        // The open claim is an uncommitted row: invisible to the operator, so "no record"
        // (exit 6) for each, and nothing removed.
        assert_eq!(o.status.code(), Some(6), "{args:?}: {}", out_text(&o));
    }
    // B, meanwhile: only 409, never a run.
    let r = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("B");
    let s = classify_transactional(&r).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s,
        Seen::Conflict,
        "B during A's open claim after release: {}",
        r.describe()
    );
    let a_resp = answer(first, "A answered");
    println!(
        "COUNTS release_open_tx_claim:\n{}\nA: {}",
        log.join("\n"),
        a_resp.status
    );
    assert_eq!(a_resp.status, 201, "{}", a_resp.describe());
    let r = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("B");
    assert!(r.is_replay(), "{}", r.describe());
    assert_eq!(executions_of(&[&a, &b], key), vec![1, 0]);
}

/// Mixed modes on one database: a default-mode holder A frozen past its lease, a
/// transactional instance B takes the key over; A wakes while B's transaction is open
/// (transactional.md: A's complete waits, then finds the token changed and does nothing).
#[test]
fn mixed_modes_frozen_default_holder_taken_over_by_transactional_instance() {
    let _s = shared();
    let db = new_db();
    let a = PaymentsApp::start(&[("DATABASE_URL", db.url.as_str()), (LEASE_MS, "1500")]);
    let b = PaymentsApp::start(&[
        ("DATABASE_URL", db.url.as_str()),
        TRANSACTIONAL,
        (LEASE_MS, "1500"),
    ]);
    let key = "mixed-1";
    let request = pay(key, 905, Some(1000));
    let first = send_bg_until_running(&a, "A", key, &request);
    signal(a.pid(), "-STOP");
    std::thread::sleep(Duration::from_millis(2500));
    let second = send_bg_until_running(&b, "B", key, &request);
    signal(a.pid(), "-CONT");
    let a_resp = answer(first, "A answered");
    let b_resp = answer(second, "B answered");
    std::thread::sleep(Duration::from_millis(1500));
    let ra = send_once(&a.addr, &request, CLIENT_TIMEOUT).expect("replay A");
    let rb = send_once(&b.addr, &request, CLIENT_TIMEOUT).expect("replay B");
    let rows = payment_rows(&db.url, key);
    println!(
        "COUNTS mixed: A {} B {} payments rows {rows} executions {:?}",
        a_resp.status,
        b_resp.status,
        executions_of(&[&a, &b], key)
    );
    // A's handler ran to its end once the process woke: its client gets that answer (its
    // complete found the token changed and stored nothing); B ran once, for the takeover.
    assert_eq!(a_resp.status, 201, "{}", a_resp.describe());
    assert_eq!(b_resp.status, 201, "{}", b_resp.describe());
    assert_eq!(executions_of(&[&a, &b], key), vec![1, 1]);
    assert!(
        ra.is_replay() && rb.is_replay(),
        "{} / {}",
        ra.describe(),
        rb.describe()
    );
    assert_eq!(ra.body, rb.body);
    assert_eq!(
        rb.body, b_resp.body,
        "the stored response is B's (the takeover's)"
    );
    assert_eq!(rows, 1);
}

/// Redis: a frozen holder whose lease ended; `idem-cli release` (no --force: the lease ended)
/// removes it; when the holder wakes, neither its renewal nor its complete writes it back.
#[test]
fn cli_release_of_a_frozen_holders_key_then_wake_up_redis() {
    let _s = shared();
    operator_acts_while_the_holder_is_frozen(
        &Store::redis(),
        "rel-frozen-r",
        906,
        &["release", "rel-frozen-r", "--tenant", TENANT],
        "release",
        |o| assert_eq!(o.status.code(), Some(0), "{}", out_text(o)),
    );
}
