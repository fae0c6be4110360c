//! Stopping the app (`idempotency_actix::shutdown`, as the `payments` example does) in every
//! mode, and the checks Redis `connect` makes: from a review of the graceful-stop fix, the Redis
//! permission probe and the C4 content-type rule (2026-12-05). Real processes (the `payments`
//! example), real PostgreSQL and redis-server, raw HTTP over loopback. The two tests that found
//! bugs in that fix: `a_second_signal_stops_promptly_even_with_a_connected_client` (actix's
//! graceful stop after a second signal held the process 30 s) and
//! `redis_a_give_back_after_a_redis_restart_does_not_hold_the_stop` (a store's background
//! give-back, counted, held every stop for the full limit).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpResponse, HttpServer};
use idempotency_actix::store::MemoryStore;
use idempotency_actix::Idempotency;
use idempotency_e2e::faults::{self, classify, shared, wait_until, Seen, CLIENT_TIMEOUT};
use idempotency_e2e::proc::PaymentsApp;
use idempotency_e2e::raw_http::{send_once, Body, Conn, Request};
use idempotency_e2e::records::{count, records_for_key};
use idempotency_e2e::redis_server::RedisServer;
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::{block_on_fresh_thread, TestDb};

const TENANT: &str = "acct_rev2";

fn pay(key: &str, amount: u64, delay_ms: Option<u64>) -> Request {
    faults::pay(TENANT, key, amount, delay_ms)
}

fn new_db() -> TestDb {
    block_on_fresh_thread(TestDb::new()).expect("creating a test database")
}

fn exit_within(app: &mut PaymentsApp, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    app.wait_for_exit(within).map(|_| started.elapsed())
}

// ---------------------------------------------------------------------------------------------
// (1) Graceful stop.

/// SIGTERM and SIGINT with nothing in flight: the process exits at once, with status 0.
#[test]
fn an_idle_stop_exits_promptly_on_term_and_int() {
    let _turn = shared();
    for signal in ["TERM", "INT"] {
        let mut app = PaymentsApp::start(&[]);
        // One served request first (its connection closed), so the app has done some work.
        let r = send_once(&app.addr, &pay("idle-warm", 100, None), CLIENT_TIMEOUT).expect("warm");
        assert_eq!(classify(&r), Ok(Seen::Created), "{}", r.describe());
        app.signal(signal);
        let started = Instant::now();
        let status = app.wait_for_exit(Duration::from_secs(5));
        assert!(
            status.is_some(),
            "SIG{signal} with no work in flight: still running after 5 s; log:\n{}",
            app.log()
        );
        assert!(
            status.is_some_and(|s| s.success()),
            "SIG{signal}: exit status {status:?}; log:\n{}",
            app.log()
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "SIG{signal}: took {:?}",
            started.elapsed()
        );
        assert!(
            !app.log().contains("still in flight"),
            "an idle stop warned about work in flight; log:\n{}",
            app.log()
        );
    }
}

/// A request in flight whose client stays connected gets its response during the stop, and
/// the process then exits.
#[test]
fn a_connected_client_gets_its_response_during_a_stop() {
    let _turn = shared();
    let mut app = PaymentsApp::start(&[]);
    let pending = {
        let addr = app.addr.clone();
        std::thread::spawn(move || {
            send_once(
                &addr,
                &pay("stop-connected", 700, Some(2000)),
                CLIENT_TIMEOUT,
            )
        })
    };
    wait_until(Duration::from_secs(10), "the handler to start", || {
        app.stats()
            .per_key
            .get("stop-connected")
            .copied()
            .unwrap_or(0)
            == 1
    });
    app.signal("TERM");
    let response = pending.join().expect("client thread");
    let response = response
        .unwrap_or_else(|e| panic!("no response during the stop: {e}; log:\n{}", app.log()));
    assert_eq!(
        classify(&response),
        Ok(Seen::Created),
        "{}",
        response.describe()
    );
    let took = exit_within(&mut app, Duration::from_secs(15));
    assert!(
        took.is_some(),
        "still running 15 s after SIGTERM; log:\n{}",
        app.log()
    );
}

/// `stop_on_signal`'s doc: "a second signal during the wait stops without waiting further".
/// With the handler's client still connected, a second SIGTERM (or a second Ctrl-C) should end
/// the process promptly (actix itself stopped at once on SIGINT before this change).
#[test]
fn a_second_signal_stops_promptly_even_with_a_connected_client() {
    let _turn = shared();
    let mut app = PaymentsApp::start(&[]);
    let mut conn = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    conn.send_raw(&pay("stop-twice-connected", 800, Some(60_000)).to_bytes())
        .expect("send");
    wait_until(Duration::from_secs(10), "the handler to start", || {
        app.stats()
            .per_key
            .get("stop-twice-connected")
            .copied()
            .unwrap_or(0)
            == 1
    });
    app.signal("INT");
    assert!(
        app.wait_for_exit(Duration::from_millis(1500)).is_none(),
        "exited at once although a handler was running"
    );
    app.signal("INT");
    let took = exit_within(&mut app, Duration::from_secs(40));
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(5)),
        "a second SIGINT did not stop the process promptly: exited after {took:?} \
         (None = still running after 40 s); log:\n{}",
        app.log()
    );
    drop(conn);
}

/// A keep-alive connection opened before the stop sends a new request during the wait: it is
/// served (201), and the process waits for it before it exits.
#[test]
fn a_keep_alive_request_during_the_wait_is_served() {
    let _turn = shared();
    let mut app = PaymentsApp::start(&[]);
    let mut keep = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    let first = keep
        .send(&pay("ka-1", 100, None))
        .expect("first on keep-alive");
    assert_eq!(classify(&first), Ok(Seen::Created), "{}", first.describe());
    // Work that keeps the stop waiting: a handler whose client left.
    let mut gone = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    gone.send_raw(&pay("ka-gone", 200, Some(2500)).to_bytes())
        .expect("send");
    wait_until(Duration::from_secs(10), "the handler to start", || {
        app.stats().per_key.get("ka-gone").copied().unwrap_or(0) == 1
    });
    gone.reset().expect("reset");
    app.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    let during = keep.send(&pay("ka-2", 300, Some(1000)));
    let during = during.unwrap_or_else(|e| {
        panic!(
            "keep-alive request during the wait failed: {e}; log:\n{}",
            app.log()
        )
    });
    assert_eq!(
        classify(&during),
        Ok(Seen::Created),
        "{}",
        during.describe()
    );
    drop(keep);
    let took = exit_within(&mut app, Duration::from_secs(20));
    assert!(
        took.is_some(),
        "still running 20 s after SIGTERM; log:\n{}",
        app.log()
    );
    assert!(
        !app.log().contains("still in flight"),
        "work was cut; log:\n{}",
        app.log()
    );
}

/// A new connection after SIGTERM, while the stop waits for a detached handler: whatever it
/// gets (refused, reset, or served), nothing runs twice: a retry on the next instance replays
/// if the stopped one answered 201, and runs once otherwise.
#[test]
fn a_request_on_a_new_connection_after_sigterm_never_runs_twice() {
    let _turn = shared();
    let db = new_db();
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "3000"),
    ];
    let mut app = PaymentsApp::start(&env);
    let mut gone = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    gone.send_raw(&pay("new-conn-hold", 200, Some(2500)).to_bytes())
        .expect("send");
    wait_until(Duration::from_secs(10), "the reservation", || {
        !records_for_key(&db.url, "new-conn-hold").is_empty()
    });
    gone.reset().expect("reset");
    app.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    let late = send_once(
        &app.addr,
        &pay("new-conn-late", 500, None),
        Duration::from_secs(8),
    );
    let took = exit_within(&mut app, Duration::from_secs(20));
    assert!(
        took.is_some(),
        "still running 20 s after SIGTERM; log:\n{}",
        app.log()
    );
    let served_created = matches!(&late, Ok(r) if classify(r) == Ok(Seen::Created));
    std::thread::sleep(Duration::from_millis(3300));
    let next = PaymentsApp::start(&env);
    let retry =
        send_once(&next.addr, &pay("new-conn-late", 500, None), CLIENT_TIMEOUT).expect("retry");
    let again = next
        .stats()
        .per_key
        .get("new-conn-late")
        .copied()
        .unwrap_or(0);
    assert!(
        !(served_created && again > 0),
        "ran twice: 201 from the stopping instance, then {again} run(s) on the next: {}",
        retry.describe()
    );
    assert!(
        served_created == retry.is_replay(),
        "late request got {:?}; retry on next instance: {}",
        late.as_ref().map(|r| r.describe()),
        retry.describe()
    );
    // The held key was finished by the stopping process: replayed, not run again.
    let held = send_once(
        &next.addr,
        &pay("new-conn-hold", 200, Some(2500)),
        CLIENT_TIMEOUT,
    )
    .expect("retry");
    assert!(held.is_replay(), "{}", held.describe());
}

/// Transactional mode: a client that resets mid-handler, then SIGTERM: the transaction is
/// committed once, and the retry after a restart replays.
#[test]
fn transactional_reset_then_sigterm_commits_once_and_replays() {
    let _turn = shared();
    let db = new_db();
    let env = [
        ("DATABASE_URL", db.url.as_str()),
        ("PAYMENTS_TRANSACTIONAL", "1"),
        ("IDEMPOTENCY_LOCK_TIMEOUT_MS", "3000"),
    ];
    let mut app = PaymentsApp::start(&env);
    let key = "tx-stop-reset";
    let request = pay(key, 4545, Some(1500));
    let mut conn = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    wait_until(Duration::from_secs(10), "the handler to start", || {
        app.stats().per_key.get(key).copied().unwrap_or(0) == 1
    });
    conn.reset().expect("reset");
    std::thread::sleep(Duration::from_millis(200));
    app.signal("TERM");
    let took = exit_within(&mut app, Duration::from_secs(20));
    assert!(
        took.is_some(),
        "still running 20 s after SIGTERM; log:\n{}",
        app.log()
    );
    let rows = || {
        count(
            &db.url,
            &format!("SELECT count(*) AS n FROM payments WHERE idempotency_key = '{key}'"),
        )
    };
    assert_eq!(
        rows(),
        1,
        "payments rows after the stop; log:\n{}",
        app.log()
    );
    std::thread::sleep(Duration::from_millis(3300));
    let next = PaymentsApp::start(&env);
    let retry = send_once(&next.addr, &request, CLIENT_TIMEOUT).expect("retry");
    assert!(retry.is_replay(), "{}", retry.describe());
    assert_eq!(rows(), 1, "payments rows after the retry");
}

fn redis_app(url: &str, lease_ms: Option<&str>) -> PaymentsApp {
    let mut env = vec![("REDIS_URL", url)];
    if let Some(l) = lease_ms {
        env.push(("IDEMPOTENCY_LOCK_TIMEOUT_MS", l));
    }
    let app = PaymentsApp::start(&env);
    assert!(
        app.log().contains("store: Redis"),
        "not in Redis mode; log:\n{}",
        app.log()
    );
    app
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Redis mode: a client that resets mid-handler, then SIGTERM: the next instance replays.
#[test]
fn redis_reset_then_sigterm_next_instance_replays() {
    let _turn = shared();
    let redis = RedisServer::start();
    let url = redis.url();
    let mut app = redis_app(&url, Some("3000"));
    let key = "redis-stop-reset";
    let request = pay(key, 4646, Some(1500));
    let mut conn = Conn::connect(app.addr.as_str(), CLIENT_TIMEOUT).expect("connect");
    conn.send_raw(&request.to_bytes()).expect("send");
    wait_until(Duration::from_secs(10), "the handler to start", || {
        app.stats().per_key.get(key).copied().unwrap_or(0) == 1
    });
    conn.reset().expect("reset");
    std::thread::sleep(Duration::from_millis(200));
    app.signal("TERM");
    let took = exit_within(&mut app, Duration::from_secs(20));
    assert!(
        took.is_some(),
        "still running 20 s after SIGTERM; log:\n{}",
        app.log()
    );
    std::thread::sleep(Duration::from_millis(3300));
    let next = redis_app(&url, Some("3000"));
    let retry = send_once(&next.addr, &request, CLIENT_TIMEOUT).expect("retry");
    let again = next.stats().per_key.get(key).copied().unwrap_or(0);
    assert!(
        retry.is_replay() && again == 0,
        "ran again ({again}): {}",
        retry.describe()
    );
}

/// A reserve whose answer did not come in time (Redis stalled, SIGSTOP) leaves a background
/// give-back (`give_back_later`), which `keep_trying` runs for two leases even after the key
/// was released (a fenced release of a key no longer there answers "stale", never "applied").
/// That task is now counted by `shutdown`: once Redis is back and the key is free, a SIGTERM
/// has nothing to finish, but waits anyway. Expected: exit within a few seconds, no "work
/// still in flight" warning (no reservation is left).
#[test]
fn redis_a_finished_give_back_does_not_hold_the_stop() {
    let _turn = shared();
    let redis = RedisServer::start();
    let url = redis.url();
    let mut app = redis_app(&url, None); // default lease: 60 s
    let warm = send_once(&app.addr, &pay("gb-warm", 100, None), CLIENT_TIMEOUT).expect("warm");
    assert_eq!(classify(&warm), Ok(Seen::Created), "{}", warm.describe());
    redis.signal("STOP");
    let r = send_once(
        &app.addr,
        &pay("gb-stalled", 200, None),
        Duration::from_secs(20),
    );
    redis.signal("CONT");
    let r = r.expect("an answer while Redis was stopped");
    assert_eq!(classify(&r), Ok(Seen::Unavailable), "{}", r.describe());
    assert_eq!(
        app.stats().per_key.get("gb-stalled").copied().unwrap_or(0),
        0
    );
    // Redis is back: the queued SET ran, then the queued release freed the key.
    wait_until(
        Duration::from_secs(10),
        "the stalled key to be freed",
        || redis_cli(redis.port(), &["DBSIZE"]) == "1",
    );
    // And the key works again.
    let ok = send_once(&app.addr, &pay("gb-stalled", 200, None), CLIENT_TIMEOUT).expect("retry");
    assert_eq!(classify(&ok), Ok(Seen::Created), "{}", ok.describe());
    app.signal("TERM");
    let took = exit_within(&mut app, Duration::from_secs(45));
    let log = app.log();
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(5)),
        "SIGTERM with no reservation left took {took:?} (None: > 45 s); \
         warned: {}; log tail:\n{}",
        log.contains("still in flight"),
        log.lines().rev().take(8).collect::<Vec<_>>().join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// (2) Redis permission check at connect.

/// A user limited to the store's keys (`~idem:*`) and to the commands it needs: connect
/// accepts it, a request runs once and replays, and the connect probe left no key behind.
#[test]
fn redis_a_user_limited_to_the_prefix_connects_and_works() {
    let _turn = shared();
    let redis = RedisServer::start();
    let prefix = idempotency_actix::store::redis::DEFAULT_PREFIX;
    let out = redis_cli(
        redis.port(),
        &[
            "ACL",
            "SETUSER",
            "scoped",
            "on",
            ">pw",
            "resetkeys",
            &format!("~{prefix}*"),
            "+@all",
        ],
    );
    assert_eq!(out, "OK");
    let url = format!("redis://scoped:pw@127.0.0.1:{}/", redis.port());
    let mut app = redis_app(&url, None);
    assert_eq!(
        redis_cli(redis.port(), &["DBSIZE"]),
        "0",
        "the connect probe left a key"
    );
    let a = send_once(&app.addr, &pay("scoped-1", 100, None), CLIENT_TIMEOUT).expect("first");
    let b = send_once(&app.addr, &pay("scoped-1", 100, None), CLIENT_TIMEOUT).expect("second");
    assert_eq!(classify(&a), Ok(Seen::Created), "{}", a.describe());
    assert_eq!(classify(&b), Ok(Seen::Replay), "{}", b.describe());
    app.signal("TERM");
    assert!(app.wait_for_exit(Duration::from_secs(5)).is_some());
}

// ---------------------------------------------------------------------------------------------
// (3) C4: whether Content-Type names JSON.

struct C4App {
    server: ThreadServer,
    runs: Arc<AtomicU64>,
}

fn c4_app() -> C4App {
    let runs = Arc::new(AtomicU64::new(0));
    let counter = runs.clone();
    let server = ThreadServer::start(move || async move {
        let store = MemoryStore::new();
        let counter = web::Data::from(counter);
        let server = HttpServer::new(move || {
            App::new()
                .app_data(counter.clone())
                .wrap(Idempotency::new(store.clone()))
                .route(
                    "/any",
                    web::post().to(|n: web::Data<AtomicU64>, body: web::Bytes| async move {
                        n.fetch_add(1, Ordering::SeqCst);
                        HttpResponse::Created().body(body)
                    }),
                )
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    });
    C4App { server, runs }
}

fn post_any(
    addr: &str,
    key: &str,
    content_type: Option<&str>,
    body: &str,
) -> idempotency_e2e::raw_http::Response {
    let mut r = Request::post("/any").key(key);
    if let Some(ct) = content_type {
        r = r.header("Content-Type", ct);
    }
    send_once(
        addr,
        &r.body(Body::Sized(body.as_bytes().to_vec())),
        CLIENT_TIMEOUT,
    )
    .expect("send")
}

/// The rule as docs/contract.md states it: JSON is `application/json` or `application/*+json`,
/// parameters ignored, case-insensitive; anything else (incl. no header) is bytes.
#[test]
fn c4_content_type_rule_matches_the_contract() {
    let app = c4_app();
    let addr = app.server.addr.to_string();
    let json = r#"{"a":1,"b":2}"#;
    let reordered = r#"{ "b": 2, "a": 1 }"#;
    // (second content type, second body, expected: true = replay, false = 422)
    let cases: &[(&str, Option<&str>, &str, bool)] = &[
        (
            "charset",
            Some("application/json; charset=utf-8"),
            reordered,
            true,
        ),
        ("upper", Some("APPLICATION/JSON"), reordered, true),
        ("problem", Some("application/problem+json"), reordered, true),
        (
            "spaces",
            Some("  application/json  ;charset=utf-8"),
            reordered,
            true,
        ),
        ("json-seq", Some("application/json-seq"), json, false),
        ("text-json", Some("text/json"), json, false),
        ("missing", None, json, false),
        ("empty", Some(""), json, false),
    ];
    let mut failures = Vec::new();
    for (name, ct, body, replay) in cases {
        let key = format!("c4-{name}");
        let first = post_any(&addr, &key, Some("application/json"), json);
        assert_eq!(first.status, 201, "{}", first.describe());
        let second = post_any(&addr, &key, *ct, body);
        let got_replay = second.status == 201 && second.is_replay();
        let got_422 = second.status == 422;
        if (*replay && !got_replay) || (!*replay && !got_422) {
            failures.push(format!(
                "{name} ({ct:?}): expected {}, got {}",
                if *replay { "replay" } else { "422" },
                second.describe()
            ));
        }
    }
    // Missing and empty Content-Type are both "not JSON": the same bytes are one request.
    let first = post_any(&addr, "c4-missing-empty", None, json);
    assert_eq!(first.status, 201);
    let second = post_any(&addr, "c4-missing-empty", Some(""), json);
    if !(second.status == 201 && second.is_replay()) {
        failures.push(format!(
            "missing then empty content type: {}",
            second.describe()
        ));
    }
    let second = post_any(&addr, "c4-missing-empty", Some("text/plain"), json);
    if !(second.status == 201 && second.is_replay()) {
        failures.push(format!("missing then text/plain: {}", second.describe()));
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(app.runs.load(Ordering::SeqCst), 9);
}

/// As above, but Redis is restarted (empty, no persistence) while a reserve's answer is
/// outstanding: the give-back's fenced release then answers "stale" forever (the key is gone),
/// and `keep_trying` retries it for two leases (120 s with the example's 60 s lease), counted
/// by `shutdown`. A SIGTERM after Redis is back, with no request in flight and no key held,
/// should exit promptly; a stop that waits the full limit and warns that "reservations
/// are left to their leases" waits for nothing (and, under Kubernetes, eats the whole grace
/// period on every deploy within two minutes of any Redis restart).
#[test]
fn redis_a_give_back_after_a_redis_restart_does_not_hold_the_stop() {
    let _turn = shared();
    let mut redis = RedisServer::start();
    let url = redis.url();
    let mut app = redis_app(&url, None); // default lease: 60 s
    let warm = send_once(&app.addr, &pay("gbr-warm", 100, None), CLIENT_TIMEOUT).expect("warm");
    assert_eq!(classify(&warm), Ok(Seen::Created), "{}", warm.describe());
    redis.signal("STOP");
    let r = send_once(
        &app.addr,
        &pay("gbr-stalled", 200, None),
        Duration::from_secs(20),
    );
    redis.signal("CONT");
    redis.restart();
    let r = r.expect("an answer while Redis was stopped");
    assert_eq!(classify(&r), Ok(Seen::Unavailable), "{}", r.describe());
    // Redis is back (empty) and the app works again.
    wait_until(
        Duration::from_secs(20),
        "the app to use Redis again",
        || {
            send_once(&app.addr, &pay("gbr-after", 300, None), CLIENT_TIMEOUT)
                .is_ok_and(|r| classify(&r) == Ok(Seen::Created) || r.is_replay())
        },
    );
    assert_eq!(
        app.stats().per_key.get("gbr-stalled").copied().unwrap_or(0),
        0
    );
    std::thread::sleep(Duration::from_millis(500));
    app.signal("TERM");
    let took = exit_within(&mut app, Duration::from_secs(45));
    let log = app.log();
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(5)),
        "SIGTERM with no request in flight and no key held took {took:?} (None: > 45 s); \
         warned: {}; log tail:\n{}",
        log.contains("still in flight"),
        log.lines().rev().take(8).collect::<Vec<_>>().join("\n")
    );
}
