//! Fault tests of the Redis store with the app as real processes (the `payments` example in
//! its Redis mode, `REDIS_URL`), as `fault_processes.rs` does for PostgreSQL: Redis killed and
//! restarted under keyed load, two instances x 10,000 requests, SIGKILL mid-handler. Each test
//! starts its own `redis-server` on a free loopback port.
//!
//! Each prints a `COUNTS` line (run with `--nocapture` to see it).

use std::time::{Duration, Instant};

use idempotency_actix::store::redis::{parse_record_key, record, redis, DEFAULT_PREFIX};
use idempotency_e2e::faults::{
    self, classify, keys_logged_unstored, serial, strip_ansi, two_instances_exactly_once,
    KeyRecord, Load, Seen, TWO_INSTANCE_DISTINCT,
};
use idempotency_e2e::proc::PaymentsApp;
use idempotency_e2e::raw_http::Request;
use idempotency_e2e::records::State;
use idempotency_e2e::redis_server::{RedisCluster, RedisServer};

/// The tenant of every request.
const TENANT: &str = "acct-1";

/// `POST /payments[?delay_ms=]` with the key, [`TENANT`] and a valid body.
fn pay(key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    faults::pay(TENANT, key, amount, delay_ms)
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
    state: State,
    token: Option<String>,
    body: Option<Vec<u8>>,
}

/// Every record under the store's prefix, by Idempotency-Key (SCAN + GET).
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
                let value: Option<Vec<u8>> = redis::cmd("GET")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .expect("GET");
                let Some(stored) = value.and_then(|v| record::decode(v.into()).ok()) else {
                    continue;
                };
                let (state, body) = match stored.state {
                    record::State::InFlight { .. } => (State::InFlight, None),
                    record::State::Completed { response, .. } => {
                        (State::Completed, Some(response.body.to_vec()))
                    }
                };
                out.push((
                    scope.key,
                    Rec {
                        state,
                        token: Some(stored.token.as_uuid().hyphenated().to_string()),
                        body,
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

fn count_state(url: &str, state: State) -> usize {
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
        server.kill();
        std::thread::sleep(Duration::from_secs(3));
        server.restart();
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
    let during = load_log.tally();
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
    let in_flight = count_state(&url, State::InFlight);
    assert_eq!(in_flight, 0, "reservations left behind");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "COUNTS redis_restart_under_load: stopped at {:.1}s, restarted at {:.1}s; keys={keys_sent} \
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

#[test]
fn sigkill_while_the_handler_runs_redis() {
    let _serial = serial();
    let server = RedisServer::start();
    let url = server.url();
    let env = [
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", faults::SIGKILL_LEASE_MS),
    ];
    let first = start_app(&env);
    // The instance the client retries against, started before the crash so the retry can
    // follow it at once (well inside the lease even on a slow machine).
    let second = start_app(&env);
    faults::sigkill_while_the_handler_runs(
        "sigkill_while_the_handler_runs_redis",
        first,
        &second,
        &pay("crash-1", 700, Some(2000)),
        || {
            records_for_key(&url, "crash-1")
                .into_iter()
                .map(|r| KeyRecord {
                    state: r.state,
                    token: r.token,
                    body: r.body,
                })
                .collect()
        },
    );
}

#[test]
fn two_instances_ten_thousand_requests_exactly_once_redis() {
    let _serial = serial();
    let server = RedisServer::start();
    let url = server.url();
    let env = [("REDIS_URL", url.as_str())];
    let apps = [start_app(&env), start_app(&env)];

    let run = two_instances_exactly_once(&apps);
    assert_eq!(count_state(&url, State::Completed), TWO_INSTANCE_DISTINCT);
    assert_eq!(count_state(&url, State::InFlight), 0);
    println!("{}", run.counts_line("two_instances_redis"));
}

/// The same two instances x 10,000 requests on a three-primary Redis Cluster (the example's
/// `REDIS_CLUSTER=1` mode): exactly once, the records spread over every primary.
#[test]
fn two_instances_ten_thousand_requests_exactly_once_redis_cluster() {
    let _serial = serial();
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let env = [("REDIS_URL", urls[0].as_str()), ("REDIS_CLUSTER", "1")];
    let apps = [PaymentsApp::start(&env), PaymentsApp::start(&env)];
    for app in &apps {
        assert!(app.log().contains("store: Redis Cluster"), "{}", app.log());
    }

    let run = two_instances_exactly_once(&apps);
    let completed: Vec<usize> = urls
        .iter()
        .map(|url| count_state(url, State::Completed))
        .collect();
    assert!(completed.iter().all(|n| *n > 0), "spread: {completed:?}");
    assert_eq!(completed.iter().sum::<usize>(), TWO_INSTANCE_DISTINCT);
    let in_flight: usize = urls.iter().map(|u| count_state(u, State::InFlight)).sum();
    assert_eq!(in_flight, 0);
    println!("{}", run.counts_line("two_instances_redis_cluster"));
}
