//! Transactional mode (C25) under real faults: the `payments` example in transactional mode
//! (`PAYMENTS_TRANSACTIONAL=1`, rows in a real `payments` table) as a child process, SIGKILLed
//! between the handler's insert and COMMIT, and a private PostgreSQL cluster stopped and
//! started under load. The `payments` table is the truth about effects: a handler run that was
//! rolled back leaves nothing there.

use std::time::{Duration, Instant};

use idempotency_actix::store::postgres::schema::State;
use idempotency_e2e::faults::{self, classify_transactional, serial, Load, Seen, CLIENT_TIMEOUT};
use idempotency_e2e::proc::{start_cluster_again, PaymentsApp};
use idempotency_e2e::raw_http::{send_once, Request, Response};
use idempotency_e2e::records::{count, count_in_state, records_for_key};
use idempotency_e2e::{block_on_fresh_thread, migrate_in_test_layout, TempCluster, TestDb};

const TENANT: &str = "acct_tx_faults";

/// `POST /payments[?delay_ms=]` with the key, [`TENANT`] and a valid body.
fn pay(key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    faults::pay(TENANT, key, amount, delay_ms)
}

/// Every answer of these tests comes from transactional mode.
fn classify(response: &Response) -> Result<Seen, String> {
    classify_transactional(response)
}

fn rows_for(url: &str, key: &str) -> i64 {
    count(
        url,
        &format!("SELECT count(*) AS n FROM payments WHERE idempotency_key = '{key}'"),
    )
}

fn app_env(url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", url.to_owned()),
        ("PAYMENTS_TRANSACTIONAL", "1".to_owned()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "10000".to_owned()),
    ]
}

fn start(env: &[(&'static str, String)]) -> PaymentsApp {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    PaymentsApp::start(&env)
}

/// SIGKILL of the app after the handler's insert and before COMMIT: no `payments` row and no
/// record remain (PostgreSQL rolled the transaction back when the connection died), and a
/// retry on another instance runs once, at once (no lease to wait for), then replays.
#[test]
fn sigkill_before_commit_leaves_nothing_and_the_retry_runs_once() {
    let _serial = serial();
    let db = block_on_fresh_thread(TestDb::new()).expect("a test database");
    let env = app_env(&db.url);
    let mut first = start(&env);
    let second = start(&env);
    let in_flight = {
        let addr = first.addr.clone();
        std::thread::spawn(move || {
            send_once(&addr, &pay("kill-1", 700, Some(3000)), CLIENT_TIMEOUT)
        })
    };
    // The handler has run its insert once /stats counts it (the delay comes after the insert).
    let deadline = Instant::now() + Duration::from_secs(20);
    while first.stats().per_key.get("kill-1").copied().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "the handler never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    first.kill();
    assert!(
        in_flight.join().expect("client thread").is_err(),
        "no answer from a killed app"
    );

    // PostgreSQL notices the closed socket and rolls back; give it a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let retry = send_once(&second.addr, &pay("kill-1", 700, None), CLIENT_TIMEOUT)
            .expect("retry answered");
        match classify(&retry) {
            Ok(Seen::Created) => break,
            Ok(Seen::Conflict) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => panic!("retry after the crash: {other:?} {}", retry.describe()),
        }
    }
    assert_eq!(rows_for(&db.url, "kill-1"), 1, "exactly one payment");
    assert_eq!(second.stats().per_key.get("kill-1").copied(), Some(1));
    let records = records_for_key(&db.url, "kill-1");
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].state, State::Completed);
    let again = send_once(&second.addr, &pay("kill-1", 700, None), CLIENT_TIMEOUT).unwrap();
    assert_eq!(classify(&again), Ok(Seen::Replay));
    assert_eq!(rows_for(&db.url, "kill-1"), 1);
    println!("COUNTS sigkill_before_commit: payments rows=1 record=completed retry=fresh run, then replay");
}

/// The killed instance's transaction must be gone before anything else: checked right after
/// the kill, before any retry, no row and no record exist.
#[test]
fn sigkill_before_commit_nothing_is_visible() {
    let _serial = serial();
    let db = block_on_fresh_thread(TestDb::new()).expect("a test database");
    let env = app_env(&db.url);
    let mut app = start(&env);
    let in_flight = {
        let addr = app.addr.clone();
        std::thread::spawn(move || {
            send_once(&addr, &pay("kill-2", 700, Some(3000)), CLIENT_TIMEOUT)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while app.stats().per_key.get("kill-2").copied().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "the handler never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    app.kill();
    let _ = in_flight.join();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(count(&db.url, "SELECT count(*) AS n FROM payments"), 0);
    assert!(records_for_key(&db.url, "kill-2").is_empty());
}

/// PostgreSQL stopped for three seconds and started again under transactional load (a third
/// of the keys sent twice at once): zero double executions (at most one `payments` row per
/// key, and exactly one once resolved), zero lost commits (every key a client saw created
/// has its row and a completed record), and nothing left in flight.
#[test]
fn database_restart_under_transactional_load() {
    let _serial = serial();
    let cluster = TempCluster::start(&[], &[]).expect("a private PostgreSQL cluster");
    let url = cluster.url();
    {
        let url = url.clone();
        block_on_fresh_thread(async move { migrate_in_test_layout(&url).await })
            .expect("migrate")
            .expect("migrate");
    }
    let app = start(&app_env(&url));

    let load = Load {
        clients: 6,
        prefix: "t",
        tenant: TENANT,
        classify,
    };
    let load_log = load.run(&app.addr, || {
        std::thread::sleep(Duration::from_millis(2500));
        cluster.stop();
        std::thread::sleep(Duration::from_secs(3));
        start_cluster_again(&cluster);
        std::thread::sleep(Duration::from_millis(3500));
    });
    let keys_sent = load_log.keys_sent;
    let mut seen_by_key = load_log.seen_by_key();
    // Zero lost commits: every key a client saw created (before any resolving retry) has
    // its row and its completed record.
    let mut lost = 0;
    for (k, seen) in &seen_by_key {
        if seen.contains(&Seen::Created) && rows_for(&url, &load.key(*k)) != 1 {
            lost += 1;
        }
    }
    // Resolve every key: a replay, or a first run for keys that never committed.
    load.resolve(
        &app.addr,
        keys_sent,
        &mut seen_by_key,
        Duration::from_secs(60),
    );
    let tally = load_log.tally();
    let tally_line = tally.line();
    let rows = count(&url, "SELECT count(*) AS n FROM payments");
    let distinct = count(
        &url,
        "SELECT count(DISTINCT idempotency_key) AS n FROM payments",
    );
    let completed = count_in_state(&url, State::Completed);
    let in_flight = count_in_state(&url, State::InFlight);
    let stats = app.stats();
    println!(
        "COUNTS database_restart_under_transactional_load: keys={keys_sent} requests_during_load={} [{tally_line}] \
         payments_rows={rows} distinct_keys={distinct} completed_records={completed} handler_runs={} lost_commits={lost}",
        load_log.during.len(),
        stats.total,
    );
    assert!(
        [
            Seen::Unavailable,
            Seen::CommitFailed,
            Seen::CommitUnknown,
            Seen::HandlerError
        ]
        .iter()
        .map(|seen| tally.get(&format!("{seen:?}")))
        .sum::<u64>()
            > 0,
        "the outage was not seen by any request; the test proved nothing"
    );
    assert_eq!(lost, 0, "lost commits");
    assert_eq!(
        rows, keys_sent as i64,
        "one payment per key, no double execution"
    );
    assert_eq!(distinct, keys_sent as i64);
    assert_eq!(completed, keys_sent);
    assert_eq!(in_flight, 0, "nothing left in flight");
    for k in 0..keys_sent {
        let seen = &seen_by_key[&k];
        let fresh = seen.iter().filter(|s| **s == Seen::Created).count();
        // One fresh 201 per key; or none when the commit's outcome was reported unknown and
        // it had in fact committed (the retry then replays it).
        assert!(
            fresh == 1 || (fresh == 0 && seen.contains(&Seen::CommitUnknown)),
            "key t-{k}: {seen:?}"
        );
    }
}

/// The example's transactional handler reads the account it books the payment for. A keyless
/// request passes the middleware with `X-Account-Id` sent twice (the tenant check is for
/// keyed requests), and the handler booked it for the first value: a gateway that appends the
/// caller's own header let it pay from another account (review, 2026-12-06). A repeated or
/// non-UTF-8 account is now a 400, and nothing is booked.
#[test]
fn the_example_refuses_an_account_sent_twice() {
    let _serial = serial();
    let db = block_on_fresh_thread(TestDb::new()).expect("a test database");
    let app = start(&app_env(&db.url));
    let body = r#"{"amount":500,"currency":"EUR"}"#;
    let twice = Request::post("/payments")
        .header("x-account-id", "victim")
        .header("x-account-id", "attacker")
        .json(body);
    let not_text = Request::post("/payments")
        .header("x-account-id", b"acct\xff")
        .json(body);
    for request in [twice, not_text] {
        let response = send_once(&app.addr, &request, CLIENT_TIMEOUT).expect("an answer");
        assert_eq!(response.status, 400, "{}", response.describe());
    }
    assert_eq!(
        count(&db.url, "SELECT count(*) AS n FROM payments"),
        0,
        "a payment was booked for an account given twice"
    );
    let once = Request::post("/payments")
        .header("x-account-id", "acct_1")
        .json(body);
    let response = send_once(&app.addr, &once, CLIENT_TIMEOUT).expect("an answer");
    assert_eq!(response.status, 201, "{}", response.describe());
}
