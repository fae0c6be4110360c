//! The payments example exposes the middleware's metrics at `/metrics` (Prometheus text format):
//! after a miss, a replay and a conflict, each outcome's counter is there with bounded labels.

use std::time::{Duration, Instant};

use idempotency_e2e::proc::PaymentsApp;
use idempotency_e2e::raw_http::{send_once, Conn, Request};

const TIMEOUT: Duration = Duration::from_secs(15);

fn pay(key: &str, delay_ms: Option<u64>) -> Request {
    let target = match delay_ms {
        Some(ms) => format!("/payments?delay_ms={ms}"),
        None => "/payments".to_owned(),
    };
    Request::post(&target)
        .key(key)
        .header("x-account-id", "acct_metrics")
        .json(r#"{"amount":10,"currency":"EUR"}"#)
}

/// The value of the sample whose line starts with `name{` and holds every `label="value"`.
fn sample(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    exposition
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .find(|line| {
            labels
                .iter()
                .all(|(k, v)| line.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

/// Guards the metrics contract of docs/operations.md: outcome counters by route pattern and
/// store (never by key or tenant), store-call histograms, and the held-reservations gauge back
/// at zero once nothing runs.
#[test]
fn outcomes_are_counted_and_exposed() {
    let app = PaymentsApp::start(&[]);
    let miss = send_once(&app.addr, &pay("m-1", None), TIMEOUT).expect("miss");
    assert_eq!(miss.status, 201);
    let replay = send_once(&app.addr, &pay("m-1", None), TIMEOUT).expect("replay");
    assert!(replay.is_replay());
    // A conflict: a slow first request, and a duplicate while it runs.
    let mut slow = Conn::connect(app.addr.as_str(), TIMEOUT).expect("connect");
    slow.send_raw(&pay("m-2", Some(1500)).to_bytes())
        .expect("send");
    // The handler counts itself when it starts: from then on the key is reserved.
    let deadline = Instant::now() + TIMEOUT;
    while !app.stats().per_key.contains_key("m-2") {
        assert!(Instant::now() < deadline, "the slow request never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let conflict = send_once(&app.addr, &pay("m-2", Some(1500)), TIMEOUT).expect("dup");
    assert_eq!(conflict.status, 409, "{}", conflict.describe());
    assert_eq!(conflict.problem_code().as_deref(), Some("CONFLICT"));
    let first = slow.read_response("POST").expect("the slow one");
    assert_eq!(first.status, 201);

    let exposition = app.metrics();
    let route = ("route", "/payments");
    let store = ("store", "memory");
    for outcome in ["stored", "replay", "conflict"] {
        let value = sample(
            &exposition,
            "idempotency_requests_total",
            &[("outcome", outcome), ("method", "POST"), route, store],
        );
        assert!(
            value.is_some_and(|v| v >= 1.0),
            "{outcome}: {value:?} in\n{exposition}"
        );
    }
    assert!(
        !exposition.contains("m-1") && !exposition.contains("acct_metrics"),
        "keys and tenants never become labels:\n{exposition}"
    );
    assert!(
        exposition.contains("idempotency_store_call_seconds")
            && exposition.contains("op=\"reserve\"")
            && exposition.contains("op=\"complete\""),
        "{exposition}"
    );
    assert_eq!(
        sample(&exposition, "idempotency_reservations_held", &[store]),
        Some(0.0),
        "{exposition}"
    );
}
