//! Fault tests with real processes and a real PostgreSQL on loopback (issue 6): the `payments`
//! example as a child process, a private PostgreSQL cluster that is stopped and started, a
//! SIGKILL while a handler runs, an exhausted pool, two instances sharing one database under
//! 10,000 requests, and a store that fails after the handler ran.
//!
//! The tests with a load or a bound on time take a process-wide lock and run alone
//! (`faults::serial()`); the others mostly wait, and run beside each other (`faults::shared()`). Each prints a `COUNTS` line; `docs/reliability.md` copies them.
//! Every socket has a timeout, every wait a deadline, and every process and database is
//! cleaned up by a drop guard.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::faults::{
    self, classify, keys_logged_unstored, serial, shared, strip_ansi, two_instances_exactly_once,
    wait_until, KeyRecord, Load, Seen, Tally, CLIENT_TIMEOUT, TWO_INSTANCE_DISTINCT,
};
use idempotency_e2e::proc::{crash_cluster, start_cluster_again, PaymentsApp};
use idempotency_e2e::raw_http::{send_once, Conn, Request, Response};
use idempotency_e2e::records::{
    count, count_in_state, execute, grant_store_tables, records_for_key, records_table, State,
    TempRole,
};
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::{
    block_on_fresh_thread, migrate_in_test_layout, server_url, TempCluster, TestDb,
};

fn new_db() -> TestDb {
    block_on_fresh_thread(TestDb::new()).expect("creating a test database")
}

/// The tenant every request to the payments example carries (it scopes keys by `x-account-id`
/// and refuses keyed requests without one, C23).
const TENANT: &str = "acct_faults";

/// `POST /payments[?delay_ms=]` with the key, [`TENANT`] and a valid body.
fn pay(key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    faults::pay(TENANT, key, amount, delay_ms)
}

// ---------------------------------------------------------------------------------------------

/// PostgreSQL (a private cluster) stopped for three seconds and started again while clients
/// send a steady stream of keyed requests, a third of them retried at once.
#[test]
fn database_restart_under_load() {
    database_restart_under_load_with(&[]);
}

/// The same with a pool per worker thread (`PostgresStoreBuilder::pool_per_thread`): every
/// worker's own pool sees the outage and recovers, and nothing runs twice.
#[test]
fn database_restart_under_load_with_a_pool_per_thread() {
    database_restart_under_load_with(&[("PAYMENTS_POOL_PER_THREAD", "4")]);
}

fn database_restart_under_load_with(extra_env: &[(&str, &str)]) {
    let _serial = serial();
    let cluster = TempCluster::start(&[], &[]).expect("a private PostgreSQL cluster");
    let url = cluster.url();
    {
        let url = url.clone();
        block_on_fresh_thread(async move { migrate_in_test_layout(&url).await })
            .expect("migrate")
            .expect("migrate");
    }
    // The lease (10 s) outlasts the outage (about 3 s): a response whose storing failed when
    // the database went away is stored once it is back, before any retry could take over.
    let mut env = vec![
        ("DATABASE_URL", url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "10000"),
    ];
    env.extend_from_slice(extra_env);
    let app = PaymentsApp::start(&env);

    let load = Load {
        clients: 6,
        prefix: "r",
        tenant: TENANT,
        classify,
    };
    let started = Instant::now();
    let (mut stopped_at, mut restarted_at) = (Duration::ZERO, Duration::ZERO);
    let load_log = load.run(&app.addr, || {
        std::thread::sleep(Duration::from_millis(2500));
        stopped_at = started.elapsed();
        cluster.stop();
        std::thread::sleep(Duration::from_secs(3));
        start_cluster_again(&cluster);
        restarted_at = started.elapsed();
        std::thread::sleep(Duration::from_millis(3500));
    });
    let keys_sent = load_log.keys_sent;

    // After recovery, every key resolves: a replay, or a fresh run for keys never executed.
    let mut seen_by_key = load_log.seen_by_key();
    let after = load.resolve(
        &app.addr,
        keys_sent,
        &mut seen_by_key,
        Duration::from_secs(30),
    );

    let stats = app.stats();
    let log = strip_ansi(&app.log());
    let unstored = keys_logged_unstored(&log);
    let stored_late = log
        .lines()
        .filter(|l| l.contains("response stored after the store recovered"))
        .count();
    // How the server went down and came back: a clean shutdown ("shut down at") or a crash
    // ("interrupted", "redo starts"): a crash loses what asynchronous commits left in memory.
    let server_log =
        std::fs::read_to_string(cluster.data_dir.join("server.log")).unwrap_or_default();
    let server_lines = server_log
        .lines()
        .filter(|l| {
            [
                "database system was",
                "redo ",
                "terminated by signal",
                "PANIC",
                "shutdown",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let during = load_log.tally();
    for k in 0..keys_sent {
        let key = format!("r-{k}");
        let executions = stats.per_key.get(&key).copied().unwrap_or(0);
        let seen = &seen_by_key[&k];
        let fresh = seen.iter().filter(|s| **s == Seen::Created).count() as u64;
        // Exactly once per key, and every execution's response reached the client: including
        // the keys whose response could not be stored while the database was down.
        assert_eq!(
            executions,
            1,
            "key {key}: {executions} executions ({seen:?}); the app's lines for it:\n{}\nthe server's:\n{server_lines}",
            lines_about(&log, &key)
        );
        assert_eq!(fresh, 1, "key {key}: {fresh} fresh responses ({seen:?})");
    }
    assert!(
        during.get("Unavailable") > 0,
        "the outage was not seen by any request; the test proved nothing"
    );
    let in_flight = count_in_state(&url, State::InFlight) as i64;
    assert_eq!(in_flight, 0, "reservations left behind");
    println!(
        "COUNTS database_restart_under_load {extra_env:?}: stopped at {:.1}s, restarted at {:.1}s; keys={keys_sent} \
         requests_during_load={} [{}] resolve_requests={} [{}] executions={} keys_whose_response_was_stored_late={} (store failed after the handler: {})",
        stopped_at.as_secs_f64(),
        restarted_at.as_secs_f64(),
        load_log.during.len(),
        during.line(),
        after.total(),
        after.line(),
        stats.total,
        stored_late,
        unstored.len(),
    );
}

/// The app's log lines that carry `key=<key>` (every keyed request's span does), so a failure
/// says what the app did for the key in question.
fn lines_about(log: &str, key: &str) -> String {
    let field = format!("key={key}");
    log.lines()
        .filter(|l| {
            l.split(|c: char| c.is_whitespace() || c == '{' || c == '}' || c == ':')
                .any(|word| word == field)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// SIGKILL while a handler runs: a retry inside the lease gets 409; after the lease one retry
/// runs the handler and completes; the dead reservation never completes.
#[test]
fn sigkill_while_the_handler_runs() {
    let _turn = shared();
    let db = new_db();
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", faults::SIGKILL_LEASE_MS),
    ];
    let first = PaymentsApp::start(&env);
    // The instance the client retries against, started before the crash so the retry can
    // follow it at once (well inside the lease even on a slow machine).
    let second = PaymentsApp::start(&env);
    faults::sigkill_while_the_handler_runs(
        "sigkill_while_the_handler_runs",
        first,
        &second,
        &pay("crash-1", 700, Some(2000)),
        || {
            records_for_key(&db.url, "crash-1")
                .into_iter()
                .map(|r| KeyRecord {
                    state: r.state,
                    token: r.token.map(|t| t.hyphenated().to_string()),
                    body: r.response_body,
                })
                .collect()
        },
    );
}

/// The example's handler, in-process, behind a store whose pool has two connections.
struct InProcessApp {
    addr: SocketAddr,
    _server: ThreadServer,
    executions: Arc<AtomicU64>,
}

impl InProcessApp {
    fn start(url: &str, max_size: u32, connection_timeout: Duration) -> InProcessApp {
        let executions = Arc::new(AtomicU64::new(0));
        let url = url.to_owned();
        let counter = Arc::clone(&executions);
        let server = ThreadServer::start(move || async move {
            let store = PostgresStore::builder(url)
                .max_size(max_size)
                .connection_timeout(connection_timeout)
                .build()
                .await
                .expect("store");
            let counter = web::Data::from(counter);
            let server = HttpServer::new(move || {
                App::new()
                    .app_data(counter.clone())
                    .wrap(Idempotency::new(store.clone()))
                    .route(
                        "/slow",
                        web::post().to(|n: web::Data<AtomicU64>| async move {
                            n.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(1000)).await;
                            HttpResponse::Created().body("done")
                        }),
                    )
            })
            .workers(2)
            .backlog(256)
            .max_connections(1024)
            .disable_signals()
            .bind(("127.0.0.1", 0))
            .expect("bind");
            (server.addrs()[0], server.run())
        });
        InProcessApp {
            addr: server.addr,
            _server: server,
            executions,
        }
    }
}

/// Fire `n` concurrent POSTs to `/slow` with distinct keys; (answers, slowest answer).
fn fire(addr: SocketAddr, prefix: &str, n: usize) -> (Vec<Result<Seen, String>>, Duration) {
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let key = format!("{prefix}-{i}");
            std::thread::spawn(move || {
                let started = Instant::now();
                let request = Request::post("/slow")
                    .key(&key)
                    .body(idempotency_e2e::raw_http::Body::Sized(Vec::new()));
                let answer = send_once(&addr.to_string(), &request, CLIENT_TIMEOUT)
                    .map_err(|e| format!("{key}: no answer: {e}"))
                    .and_then(|r| classify(&r).map_err(|e| format!("{key}: {e}")));
                (answer, started.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::new();
    let mut slowest = Duration::ZERO;
    for t in threads {
        let (answer, took) = t.join().expect("client thread");
        answers.push(answer);
        slowest = slowest.max(took);
    }
    (answers, slowest)
}

/// A pool of two, 50 concurrent keyed requests to a slow handler: first with the pool merely
/// busy, then with both connections stuck behind a table lock. Every request gets an answer
/// within the timeouts (503 + Retry-After when no connection came), and the app recovers.
#[test]
fn pool_exhaustion_answers_503_in_bounded_time_and_recovers() {
    let _serial = serial();
    let db = new_db();
    let connection_timeout = Duration::from_millis(500);
    let app = InProcessApp::start(&db.url, 2, connection_timeout);

    // A connection is held for one statement, not for the handler: 50 one-second handlers
    // share two connections without a single 503.
    let (busy, busy_slowest) = fire(app.addr, "busy", 50);
    let mut busy_tally = Tally::default();
    for answer in &busy {
        let seen = answer.clone().expect("contract held");
        busy_tally.add(format!("{seen:?}"));
    }
    assert_eq!(busy_tally.get("Created"), 50, "{}", busy_tally.line());

    // Now hold an exclusive lock on the table: the two pooled connections block inside their
    // statements and every other request waits for a connection.
    let locker = {
        let url = db.url.clone();
        std::thread::spawn(move || {
            execute(
                &url,
                "BEGIN; LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE; \
                 SELECT pg_sleep(2.5); COMMIT;",
            )
        })
    };
    wait_until(Duration::from_secs(10), "the table lock", || {
        count(
            &db.url,
            "SELECT count(*) AS n FROM pg_locks WHERE relation = 'idempotency_keys'::regclass \
             AND mode = 'AccessExclusiveLock' AND granted",
        ) == 1
    });
    let before = app.executions.load(Ordering::SeqCst);
    let (stuck, stuck_slowest) = fire(app.addr, "stuck", 50);
    locker.join().expect("lock holder");
    let mut stuck_tally = Tally::default();
    for answer in &stuck {
        let seen = answer.clone().expect("contract held");
        stuck_tally.add(format!("{seen:?}"));
    }
    let ran = app.executions.load(Ordering::SeqCst) - before;
    assert!(
        stuck_tally.get("Unavailable") >= 40,
        "expected most requests to find no connection: {}",
        stuck_tally.line()
    );
    assert_eq!(
        stuck_tally.get("Created"),
        ran,
        "a handler ran for a request that got 503, or vice versa: {}",
        stuck_tally.line()
    );
    // Lock (2.5 s) + handler (1 s) + slack; nothing waits for the 15 s client timeout.
    assert!(stuck_slowest < Duration::from_secs(8), "{stuck_slowest:?}");

    // And it serves normally afterwards.
    let (after, _) = fire(app.addr, "after", 5);
    assert!(after.iter().all(|a| a == &Ok(Seen::Created)), "{after:?}");
    let in_flight = count_in_state(&db.url, State::InFlight) as i64;
    assert_eq!(in_flight, 0);
    println!(
        "COUNTS pool_exhaustion: pool=2 connection_timeout=500ms; busy phase: requests=50 [{}] slowest={:.2}s; \
         locked phase: requests=50 [{}] executions={ran} slowest={:.2}s; after: requests=5 all Created",
        busy_tally.line(),
        busy_slowest.as_secs_f64(),
        stuck_tally.line(),
        stuck_slowest.as_secs_f64()
    );
}

/// Two app processes, one database, 10,000 keyed requests with 30% duplicates fired
/// concurrently at both: handler executions equal the distinct keys, exactly.
#[test]
fn two_instances_ten_thousand_requests_exactly_once() {
    let _serial = serial();
    let db = new_db();
    let env = [("DATABASE_URL", db.url.as_str())];
    let apps = [PaymentsApp::start(&env), PaymentsApp::start(&env)];

    let run = two_instances_exactly_once(&apps);
    assert_eq!(
        count_in_state(&db.url, State::Completed),
        TWO_INSTANCE_DISTINCT
    );
    assert_eq!(count_in_state(&db.url, State::InFlight), 0);
    println!("{}", run.counts_line("two_instances"));
}

/// The store fails after the handler ran (the app's role loses UPDATE and DELETE on the table
/// while the handler runs): the client still gets the handler's response, the failure is
/// logged with the key, and retries inside the lease never run the handler again.
#[test]
fn store_failure_after_the_handler() {
    let _turn = shared();
    // The role outlives the database (dropped after it: reverse declaration order).
    let role = TempRole::create(&server_url(), "idem_app");
    let db = new_db();
    execute(&db.url, &grant_store_tables(&role.name));
    let app_url = role.url_for(&db.url);
    let app = PaymentsApp::start(&[("DATABASE_URL", app_url.as_str())]);
    let mut tally = Tally::default();

    // Sanity: the role can do everything before the fault.
    let ok = send_once(&app.addr, &pay("before", 5, None), CLIENT_TIMEOUT).expect("before");
    assert_eq!(classify(&ok), Ok(Seen::Created), "{}", ok.describe());
    tally.add("Created");

    let request = pay("sf-1", 1234, Some(1500));
    let pending = {
        let (addr, request) = (app.addr.clone(), request.clone());
        std::thread::spawn(move || send_once(&addr, &request, CLIENT_TIMEOUT))
    };
    wait_until(Duration::from_secs(10), "the reservation", || {
        records_for_key(&db.url, "sf-1")
            .iter()
            .any(|r| r.state == State::InFlight)
    });
    execute(
        &db.url,
        &format!(
            "REVOKE UPDATE, DELETE ON {} FROM \"{}\"",
            records_table(),
            role.name
        ),
    );
    let response = pending
        .join()
        .expect("client thread")
        .expect("the handler's response");
    assert_eq!(
        classify(&response),
        Ok(Seen::Created),
        "{}",
        response.describe()
    );
    tally.add("Created");
    let body: serde_json::Value = serde_json::from_slice(&response.body).expect("payment JSON");
    assert_eq!(body["idempotency_key"], "sf-1");
    assert_eq!(body["amount"], 1234);

    let log = strip_ansi(&app.log());
    let line = log
        .lines()
        .find(|l| l.contains("could not store the response") && l.contains("key=sf-1"))
        .unwrap_or_else(|| panic!("no store error logged with the key; log:\n{log}"));
    assert!(line.contains("ERROR"), "{line}");
    let rows = records_for_key(&db.url, "sf-1");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].state,
        State::InFlight,
        "the reservation stays until its lease ends"
    );

    // While the privilege is still missing, a retry cannot even reserve: 503, handler not run.
    let during = send_once(&app.addr, &request, CLIENT_TIMEOUT).expect("retry during the fault");
    let during_seen = classify(&during).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(during_seen, Seen::Unavailable | Seen::Conflict),
        "{}",
        during.describe()
    );
    tally.add(format!("{during_seen:?}"));

    // The fault ends. Inside the 60 s lease a retry gets 409 until the middleware's background
    // retry has stored the response, then the replay of what the client got: never a second
    // execution.
    execute(
        &db.url,
        &format!(
            "GRANT UPDATE, DELETE ON {} TO \"{}\"",
            records_table(),
            role.name
        ),
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let retry = send_once(&app.addr, &request, CLIENT_TIMEOUT).expect("retry");
        match classify(&retry) {
            Ok(Seen::Conflict) => tally.add("Conflict"),
            Ok(Seen::Replay) => {
                assert_eq!(
                    retry.body, response.body,
                    "the replay is what the client got"
                );
                tally.add("Replay");
                break;
            }
            other => panic!("retry inside the lease: {other:?} {}", retry.describe()),
        }
        assert!(Instant::now() < deadline, "the response was never stored");
        std::thread::sleep(Duration::from_millis(100));
    }
    let stats = app.stats();
    assert_eq!(stats.per_key.get("sf-1"), Some(&1));
    println!(
        "COUNTS store_failure_after_the_handler: requests={} executions={} (sf-1: 1) [{}] retry_during_fault={during_seen:?}",
        tally.0.values().sum::<u64>(),
        stats.total,
        tally.line()
    );
}

/// The store fails after the handler ran and recovers inside the lease: the response that
/// was delivered is stored once the store is back, so a retry after the lease replays it
/// instead of running the handler a second time (issue 6: one execution per key whose first
/// response was delivered).
#[test]
fn store_recovering_inside_the_lease_stores_the_delivered_response() {
    let _turn = shared();
    let role = TempRole::create(&server_url(), "idem_app");
    let db = new_db();
    let grant = grant_store_tables(&role.name);
    execute(&db.url, &grant);
    let app_url = role.url_for(&db.url);
    let app = PaymentsApp::start(&[
        ("DATABASE_URL", app_url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "3000"),
    ]);
    let request = pay("sf-2", 4321, Some(1000));
    let pending = {
        let (addr, request) = (app.addr.clone(), request.clone());
        std::thread::spawn(move || send_once(&addr, &request, CLIENT_TIMEOUT))
    };
    wait_until(Duration::from_secs(10), "the reservation", || {
        records_for_key(&db.url, "sf-2")
            .iter()
            .any(|r| r.state == State::InFlight)
    });
    let reserved_at = Instant::now();
    execute(
        &db.url,
        &format!(
            "REVOKE UPDATE, DELETE ON {} FROM \"{}\"",
            records_table(),
            role.name
        ),
    );
    let delivered = pending
        .join()
        .expect("client thread")
        .expect("the handler's response");
    assert_eq!(
        classify(&delivered),
        Ok(Seen::Created),
        "{}",
        delivered.describe()
    );
    // The fault ends well inside the 3 s lease.
    execute(&db.url, &grant);
    std::thread::sleep(Duration::from_millis(3500).saturating_sub(reserved_at.elapsed()));

    let mut tally = Tally::default();
    let deadline = Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let retry = send_once(&app.addr, &request, CLIENT_TIMEOUT).expect("retry");
        let seen = classify(&retry).unwrap_or_else(|e| panic!("{e}"));
        tally.add(format!("{seen:?}"));
        if seen != Seen::Conflict || Instant::now() > deadline {
            break retry;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        retry.is_replay(),
        "after the lease the retry was not a replay: {}",
        retry.describe()
    );
    assert_eq!(
        retry.body, delivered.body,
        "the delivered response is the one replayed"
    );
    assert_eq!(
        app.stats().per_key.get("sf-2"),
        Some(&1),
        "the handler ran twice"
    );
    let rows = records_for_key(&db.url, "sf-2");
    assert_eq!(rows[0].state, State::Completed);
    println!(
        "COUNTS store_recovering_inside_the_lease: requests={} executions={} [Created=1 {}]",
        tally.0.values().sum::<u64>() + 1,
        app.stats().total,
        tally.line()
    );
}

/// How the client hangs up.
#[derive(Debug, Clone, Copy)]
enum HangUp {
    /// A normal close (FIN).
    Fin,
    /// A TCP reset (`SO_LINGER` 0): actix drops the request's future at once.
    Reset,
}

/// Guards C21: a client that hangs up mid-handler, with a FIN or a TCP reset, changes nothing.
/// The handler runs to its end on its own task, its response is stored, and a retry (inside
/// the lease or after it) gets the replay: exactly one execution. Before the fix a reset
/// dropped the handler at its next `.await`, nothing was stored, and the retry after the lease
/// ran it a second time.
fn disconnect_mid_handler(how: HangUp) {
    let _turn = shared();
    let db = new_db();
    let app = PaymentsApp::start(&[
        ("DATABASE_URL", db.url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "2000"),
    ]);
    let key = format!("gone-{how:?}");
    let request = pay(&key, 77, Some(1500));
    let mut conn = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    wait_until(Duration::from_secs(10), "the reservation", || {
        !records_for_key(&db.url, &key).is_empty()
    });
    std::thread::sleep(Duration::from_millis(300));
    match how {
        HangUp::Fin => drop(conn),
        HangUp::Reset => conn.reset().expect("reset"),
    }
    let mut tally = Tally::default();
    // Past the lease (2 s) and the handler (1.5 s): before the fix, a takeover ran here.
    std::thread::sleep(Duration::from_millis(2500));
    let deadline = Instant::now() + Duration::from_secs(15);
    let seen = loop {
        let retry = send_once(&app.addr, &request, CLIENT_TIMEOUT).expect("retry");
        let seen = classify(&retry).unwrap_or_else(|e| panic!("{e}"));
        tally.add(format!("{seen:?}"));
        if seen != Seen::Conflict {
            break seen;
        }
        assert!(Instant::now() < deadline, "never resolved");
        std::thread::sleep(Duration::from_millis(200));
    };
    let executions = app.stats().per_key.get(&key).copied().unwrap_or(0);
    assert_eq!(
        (seen, executions),
        (Seen::Replay, 1),
        "after a {how:?} the retry must replay the one execution [{}]",
        tally.line()
    );
    println!(
        "COUNTS client_disconnect_mid_handler_{how:?}: requests={} executions={executions} [{}]",
        tally.0.values().sum::<u64>() + 1,
        tally.line()
    );
}

#[test]
fn client_fin_mid_handler_runs_once_and_replays() {
    disconnect_mid_handler(HangUp::Fin);
}

#[test]
fn client_reset_mid_handler_runs_once_and_replays() {
    disconnect_mid_handler(HangUp::Reset);
}

/// A server crash (`pg_ctl -m immediate`) right after a response was stored and delivered
/// keeps it: the retry after recovery is a replay, never a second execution. The WAL writer is
/// slowed (`wal_writer_delay = 10s`) so that anything an asynchronous commit left in the
/// server's memory is still there at the crash: with `synchronous_commit = off` (the throwaway
/// cluster's setting until now) the completion is lost while the reservation, flushed by the
/// checkpoint taken while the handler runs, survives: 409 until the lease ends, then a second
/// execution (the sequence of the r-2016 failure of `database_restart_under_load`, which
/// stops the server with `-m fast`; a fast shutdown flushes the WAL and loses nothing).
#[test]
fn a_crash_after_the_response_was_stored_keeps_it() {
    let _turn = shared();
    let cluster = TempCluster::start(&["wal_writer_delay = '10s'"], &[])
        .expect("a private PostgreSQL cluster");
    let url = cluster.url();
    {
        let url = url.clone();
        block_on_fresh_thread(async move { migrate_in_test_layout(&url).await })
            .expect("migrate")
            .expect("migrate");
    }
    let app = PaymentsApp::start(&[
        ("DATABASE_URL", url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "3000"),
    ]);
    let request = pay("crash-after-store", 777, Some(700));
    let pending = {
        let (addr, request) = (app.addr.clone(), request.clone());
        std::thread::spawn(move || send_once(&addr, &request, CLIENT_TIMEOUT))
    };
    wait_until(Duration::from_secs(10), "the reservation", || {
        records_for_key(&url, "crash-after-store")
            .iter()
            .any(|r| r.state == State::InFlight)
    });
    // The reservation (and everything before it) reaches the WAL files; the completion that
    // follows is the only write the crash can take.
    execute(&url, "CHECKPOINT");
    let delivered = pending
        .join()
        .expect("client thread")
        .expect("the response");
    assert_eq!(
        classify(&delivered),
        Ok(Seen::Created),
        "{}",
        delivered.describe()
    );
    crash_cluster(&cluster);
    start_cluster_again(&cluster);

    let mut seen = vec![Seen::Created];
    let deadline = Instant::now() + Duration::from_secs(15);
    let retry = loop {
        let retry = send_once(&app.addr, &request, CLIENT_TIMEOUT).expect("retry");
        let s = classify(&retry).unwrap_or_else(|e| panic!("{e}"));
        seen.push(s);
        if matches!(s, Seen::Created | Seen::Replay) || Instant::now() > deadline {
            break retry;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let executions = app
        .stats()
        .per_key
        .get("crash-after-store")
        .copied()
        .unwrap_or(0);
    assert_eq!(
        executions, 1,
        "{executions} executions ({seen:?}): the stored response was lost in the crash"
    );
    assert!(retry.is_replay(), "{}", retry.describe());
    assert_eq!(
        retry.body, delivered.body,
        "the delivered response is the one replayed"
    );
}

/// The lease of the graceful-stop tests, and how long after it a retry comes.
const STOP_LEASE_MS: u64 = 3000;

/// After a graceful stop of `stopped`: a new instance on the same database, past the lease,
/// must replay `request` and run nothing (the stopped process finished the key's work).
/// `stopped` was sent SIGTERM: it must exit within 20 s (the example waits up to 20 s for work in
/// flight, which here ends sooner).
fn the_next_instance_replays(db: &TestDb, stopped: &mut PaymentsApp, key: &str, request: &Request) {
    let exited = stopped.wait_for_exit(Duration::from_secs(20));
    assert!(
        exited.is_some(),
        "still running 20 s after SIGTERM; log:\n{}",
        stopped.log()
    );
    let rows = records_for_key(&db.url, key);
    let states: Vec<State> = rows.iter().map(|r| r.state).collect();
    // Past the lease: an unfinished reservation is taken over here, and the handler runs again.
    std::thread::sleep(Duration::from_millis(STOP_LEASE_MS + 300));
    let next = PaymentsApp::start(&[
        ("DATABASE_URL", db.url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", &STOP_LEASE_MS.to_string()),
    ]);
    let retry = send_once(&next.addr, request, CLIENT_TIMEOUT).expect("retry");
    let executions = next.stats().per_key.get(key).copied().unwrap_or(0);
    assert!(
        retry.is_replay() && executions == 0,
        "the retry on the next instance ran the handler again ({executions} executions there, \
         records {states:?} when the stopped process exited): {}\nstopped instance's log:\n{}",
        retry.describe(),
        lines_about(&stopped.log(), key)
    );
    assert_eq!(states, vec![State::Completed]);
}

/// A graceful stop (SIGTERM) while a handler whose client has gone still runs: the process
/// waits for it, stores its response, then exits, and the client's retry on the next instance
/// replays. Before the fix actix stopped the worker at once (it waits for open connections
/// only, and this request's had gone), dropping the handler's task mid-run: the reservation
/// stayed, and the retry after the lease ran the handler a second time.
#[test]
fn a_graceful_stop_finishes_a_handler_whose_client_left() {
    let _turn = shared();
    let db = new_db();
    let mut app = PaymentsApp::start(&[
        ("DATABASE_URL", db.url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", &STOP_LEASE_MS.to_string()),
    ]);
    let key = "stop-mid-handler";
    let request = pay(key, 4242, Some(1500));
    let mut conn = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    wait_until(Duration::from_secs(10), "the reservation", || {
        !records_for_key(&db.url, key).is_empty()
    });
    conn.reset().expect("reset");
    std::thread::sleep(Duration::from_millis(200));
    app.signal("TERM");
    the_next_instance_replays(&db, &mut app, key, &request);
}

/// A graceful stop while a background retry of C16 waits for the store: the payments app,
/// connected as a role of its own, is sent `request` (key `key`); once its reservation exists
/// the role loses `revoked` on the table, so the store write after the handler fails; the
/// client gets its answer, the app SIGTERM, and 700 ms later (inside the lease, after the stop
/// began) the store comes back. Fields drop in order: the app, then the database, then the role.
struct StoppedWhileStoreRefused {
    app: PaymentsApp,
    db: TestDb,
    _role: TempRole,
    delivered: Response,
}

fn stop_while_the_store_refuses(
    role_prefix: &str,
    key: &str,
    request: &Request,
    revoked: &str,
) -> StoppedWhileStoreRefused {
    let role = TempRole::create(&server_url(), role_prefix);
    let db = new_db();
    let grant = grant_store_tables(&role.name);
    execute(&db.url, &grant);
    let app_url = role.url_for(&db.url);
    let app = PaymentsApp::start(&[
        ("DATABASE_URL", app_url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", &STOP_LEASE_MS.to_string()),
    ]);
    let pending = {
        let (addr, request) = (app.addr.clone(), request.clone());
        std::thread::spawn(move || send_once(&addr, &request, CLIENT_TIMEOUT))
    };
    wait_until(Duration::from_secs(10), "the reservation", || {
        records_for_key(&db.url, key)
            .iter()
            .any(|r| r.state == State::InFlight)
    });
    execute(
        &db.url,
        &format!(
            "REVOKE {revoked} ON {} FROM \"{}\"",
            records_table(),
            role.name
        ),
    );
    let delivered = pending
        .join()
        .expect("client thread")
        .expect("the handler's response");
    app.signal("TERM");
    std::thread::sleep(Duration::from_millis(700));
    execute(&db.url, &grant);
    StoppedWhileStoreRefused {
        app,
        db,
        _role: role,
        delivered,
    }
}

/// A graceful stop while the response of a delivered request waits to be stored (the store
/// failed after the handler, C16's background retry): the process keeps retrying until the
/// store is back, then exits, and the retry on the next instance replays. Before the fix the
/// stop dropped the retry with the worker: the key stayed reserved and, after the lease, the
/// retry ran the handler again.
#[test]
fn a_graceful_stop_finishes_storing_a_delivered_response() {
    let _turn = shared();
    let key = "stop-while-storing";
    let request = pay(key, 4343, Some(800));
    let mut stopped = stop_while_the_store_refuses("idem_stop", key, &request, "UPDATE, DELETE");
    assert_eq!(
        classify(&stopped.delivered),
        Ok(Seen::Created),
        "{}",
        stopped.delivered.describe()
    );
    the_next_instance_replays(&stopped.db, &mut stopped.app, key, &request);
}

/// A graceful stop while the release of a response that was not stored waits to be retried (a
/// 400, whose release failed: C16's background retry of a release): the process keeps retrying
/// until the store is back, then exits with the key released, so the client's corrected retry
/// runs at once rather than meeting 409 until the lease ends. Before the fix (review,
/// 2026-12-06) the stop did not count release retries, although C21 names C16's retries, and
/// the process exited at once with the reservation still held.
#[test]
fn a_graceful_stop_finishes_releasing_a_response_not_stored() {
    let _turn = shared();
    let key = "stop-while-releasing";
    // Amount 0: the handler answers 400, which is not stored, so the key is released.
    let request = pay(key, 0, Some(800));
    let mut stopped = stop_while_the_store_refuses("idem_stop_rel", key, &request, "DELETE");
    let delivered = &stopped.delivered;
    assert_eq!(delivered.status, 400, "{}", delivered.describe());
    let exited = stopped.app.wait_for_exit(Duration::from_secs(20));
    assert!(
        exited.is_some(),
        "still running 20 s after SIGTERM; log:\n{}",
        stopped.app.log()
    );
    let left = records_for_key(&stopped.db.url, key);
    assert!(
        left.is_empty(),
        "the key is still held after the stop ({left:?}): the client's retry meets 409 until \
         the lease ends\nlog:\n{}",
        lines_about(&stopped.app.log(), key)
    );
}

/// The stop's wait has an end: a handler that outlasts it does not hold the process, and a
/// second SIGTERM skips the rest of the wait (the example waits up to 20 s).
#[test]
fn a_second_signal_ends_the_wait_for_unfinished_work() {
    let _turn = shared();
    let db = new_db();
    let mut app = PaymentsApp::start(&[("DATABASE_URL", db.url.as_str())]);
    let key = "stop-twice";
    let request = pay(key, 4444, Some(60_000));
    let mut conn = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    wait_until(Duration::from_secs(10), "the reservation", || {
        !records_for_key(&db.url, key).is_empty()
    });
    conn.reset().expect("reset");
    std::thread::sleep(Duration::from_millis(200));
    app.signal("TERM");
    assert!(
        app.wait_for_exit(Duration::from_millis(1500)).is_none(),
        "exited at once although a handler was running; log:\n{}",
        app.log()
    );
    app.signal("TERM");
    assert!(
        app.wait_for_exit(Duration::from_secs(10)).is_some(),
        "a second SIGTERM did not end the wait; log:\n{}",
        app.log()
    );
    let log = app.log();
    assert!(
        log.contains("stopping with idempotent work still in flight"),
        "the cut work is not reported; log:\n{log}"
    );
    // Cut as by a crash: the reservation stays until its lease ends (C16), never a record.
    let states: Vec<State> = records_for_key(&db.url, key)
        .iter()
        .map(|r| r.state)
        .collect();
    assert_eq!(states, vec![State::InFlight]);
}
