//! The metrics the middleware records (docs/operations.md), read back from an in-process
//! recorder: outcome counters by route, store-call histograms, the held-reservations gauge.

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpResponse};
use idempotency_actix::store::MemoryStore;
use idempotency_actix::Idempotency;
use metrics::{Label, SharedString, Unit};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};

/// Every metric recorded since the last read. One read per check: the debugging recorder
/// hands out each value once (a snapshot resets what it reads to zero).
type Metrics = Vec<(CompositeKey, Option<Unit>, Option<SharedString>, DebugValue)>;

fn read(snapshotter: &Snapshotter) -> Metrics {
    snapshotter.snapshot().into_vec()
}

/// The value of the metric `name` whose labels include every pair in `labels`.
fn value<'m>(
    metrics: &'m Metrics,
    kind: MetricKind,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<&'m DebugValue> {
    metrics
        .iter()
        .find(|(key, _, _, _)| {
            key.kind() == kind
                && key.key().name() == name
                && labels.iter().all(|(k, v)| {
                    key.key()
                        .labels()
                        .any(|label: &Label| label.key() == *k && label.value() == *v)
                })
        })
        .map(|(_, _, _, value)| value)
}

fn counter(metrics: &Metrics, labels: &[(&str, &str)]) -> u64 {
    match value(
        metrics,
        MetricKind::Counter,
        "idempotency_requests_total",
        labels,
    ) {
        Some(DebugValue::Counter(n)) => *n,
        None => 0,
        Some(other) => panic!("not a counter: {other:?}"),
    }
}

fn keyed(path: &str, key: &str, body: &'static str) -> TestRequest {
    TestRequest::post()
        .uri(path)
        .insert_header(("idempotency-key", key))
        .insert_header(("content-type", "application/json"))
        .set_payload(body)
}

#[actix_rt::test]
async fn outcomes_are_counted_per_route_and_store_calls_timed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Thread-local: the test service runs on this thread, and the middleware resolves its
    // handles on the first keyed request, after this line.
    let _guard = metrics::set_default_local_recorder(&recorder);

    let app = init_service(
        App::new()
            .wrap(Idempotency::new(MemoryStore::new()))
            .route(
                "/payments",
                web::post().to(|| async { HttpResponse::Created().body("ok") }),
            )
            .route(
                "/payments/{id}/refunds",
                web::post().to(|| async { HttpResponse::Created().body("refund") }),
            ),
    )
    .await;

    for (path, key, body, status) in [
        ("/payments", "k1", r#"{"a":1}"#, StatusCode::CREATED),
        ("/payments", "k1", r#"{"a":1}"#, StatusCode::CREATED),
        (
            "/payments",
            "k1",
            r#"{"a":2}"#,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            "/payments/7/refunds",
            "k1",
            r#"{"a":1}"#,
            StatusCode::CREATED,
        ),
        (
            "/payments/8/refunds",
            "k2",
            r#"{"a":1}"#,
            StatusCode::CREATED,
        ),
        ("/payments", "bad key", r#"{}"#, StatusCode::BAD_REQUEST),
    ] {
        let response = call_service(&app, keyed(path, key, body).to_request()).await;
        assert_eq!(response.status(), status, "{path} {key} {body}");
    }

    let metrics = read(&snapshotter);
    let route = |r: &'static str, outcome: &'static str| {
        counter(
            &metrics,
            &[
                ("route", r),
                ("outcome", outcome),
                ("method", "POST"),
                ("store", "memory"),
            ],
        )
    };
    assert_eq!(route("/payments", "stored"), 1);
    assert_eq!(route("/payments", "replay"), 1);
    assert_eq!(route("/payments", "mismatch"), 1);
    assert_eq!(route("/payments", "invalid_key"), 1);
    // Two paths, one route pattern: one label value, never the raw path.
    assert_eq!(route("/payments/{id}/refunds", "stored"), 2);
    assert_eq!(counter(&metrics, &[("route", "/payments/7/refunds")]), 0);

    let histogram = |op: &str| match value(
        &metrics,
        MetricKind::Histogram,
        "idempotency_store_call_seconds",
        &[("op", op), ("store", "memory")],
    ) {
        Some(DebugValue::Histogram(samples)) => samples.len(),
        other => panic!("no {op} histogram: {other:?}"),
    };
    // Five requests reached the store (the invalid key did not); three were misses.
    assert_eq!(histogram("reserve"), 5);
    assert_eq!(histogram("complete"), 3);

    match value(
        &metrics,
        MetricKind::Gauge,
        "idempotency_reservations_held",
        &[("store", "memory")],
    ) {
        Some(DebugValue::Gauge(held)) => assert_eq!(held.into_inner(), 0.0),
        other => panic!("no held gauge: {other:?}"),
    }
}

#[actix_rt::test]
async fn the_held_gauge_counts_a_running_handler_and_drops_back() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let entered = std::sync::Mutex::new(Some(entered_tx));
    let entered = web::Data::new(entered);
    let app = init_service(
        App::new()
            .app_data(entered)
            .wrap(Idempotency::new(MemoryStore::new()))
            .route(
                "/slow",
                web::post().to(
                    |entered: web::Data<
                        std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
                    >| async move {
                        if let Some(tx) = entered.lock().ok().and_then(|mut t| t.take()) {
                            let _ = tx.send(());
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        HttpResponse::Ok().body("done")
                    },
                ),
            ),
    )
    .await;
    let held = || match value(
        &read(&snapshotter),
        MetricKind::Gauge,
        "idempotency_reservations_held",
        &[],
    ) {
        Some(DebugValue::Gauge(held)) => held.into_inner(),
        _ => 0.0,
    };
    let request = call_service(&app, keyed("/slow", "k", "{}").to_request());
    let check = async {
        entered_rx.await.expect("the handler ran");
        held()
    };
    let (response, during) = tokio::join!(request, check);
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(during, 1.0, "one reservation held while the handler runs");
    // The snapshot took the 1 it read, so the guard's decrement shows as -1: back to zero.
    assert_eq!(during + held(), 0.0, "the guard gave it back");
}

/// A keyed request whose body fails while it is read (a client that reset mid-upload, a broken
/// chunked encoding) is counted once (`request_body_error`) and reported to the hook: every
/// keyed request has one outcome. Before, the read's error left the flow before any outcome.
#[actix_rt::test]
async fn a_keyed_request_whose_body_fails_is_counted_and_reported() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use actix_web::error::PayloadError;
    use bytes::Bytes;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let hooked = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&hooked);
    let app = init_service(
        App::new()
            .wrap(
                Idempotency::builder(MemoryStore::new())
                    .on_outcome(move |_| {
                        seen.fetch_add(1, Ordering::SeqCst);
                    })
                    .build(),
            )
            .route(
                "/payments",
                web::post().to(|| async { HttpResponse::Created().body("ok") }),
            ),
    )
    .await;
    let req = TestRequest::post()
        .uri("/payments")
        .insert_header(("idempotency-key", "reset-1"))
        .insert_header(("content-length", "100"))
        .to_request();
    let chunks: Vec<Result<Bytes, PayloadError>> = vec![
        Ok(Bytes::from_static(b"{\"amount\":")),
        Err(PayloadError::Incomplete(None)),
    ];
    let stream: actix_http::BoxedPayloadStream = Box::pin(futures_util::stream::iter(chunks));
    let (req, _) = req.replace_payload(actix_http::Payload::Stream { payload: stream });
    // The answer (an error for the broken body) is not the point: what was recorded is.
    let _ = actix_web::dev::Service::call(&app, req).await;
    let metrics = read(&snapshotter);
    let counted: u64 = metrics
        .iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_requests_total")
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => *n,
            _ => 0,
        })
        .sum();
    assert_eq!(
        (counted, hooked.load(Ordering::SeqCst)),
        (1, 1),
        "a keyed request whose body failed: counted {counted} times in \
         idempotency_requests_total, reported {} times to on_outcome (one outcome each is \
         documented)",
        hooked.load(Ordering::SeqCst)
    );
}

/// A store whose first `complete` fails (a blip) and whose later ones panic (a bug in a
/// custom store, or in a driver it calls).
#[derive(Clone, Default)]
struct PanicsOnRetry {
    inner: MemoryStore,
    completes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl idempotency_actix::store::IdempotencyStore for PanicsOnRetry {
    async fn reserve(
        &self,
        scope: &idempotency_actix::store::Scope,
        fingerprint: &idempotency_actix::store::Fingerprint,
        lease: Duration,
    ) -> Result<idempotency_actix::store::ReserveOutcome, idempotency_actix::store::StoreError>
    {
        self.inner.reserve(scope, fingerprint, lease).await
    }

    async fn complete(
        &self,
        scope: &idempotency_actix::store::Scope,
        token: &idempotency_actix::store::ReservationToken,
        response: &idempotency_actix::store::StoredResponse,
        ttl: Duration,
    ) -> Result<idempotency_actix::store::WriteOutcome, idempotency_actix::store::StoreError> {
        use std::sync::atomic::Ordering;
        if self.completes.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(idempotency_actix::store::StoreError::unavailable(
                "one blip",
            ));
        }
        let _ = (scope, token, response, ttl);
        panic!("complete panicked (this test's own panic)");
    }

    async fn release(
        &self,
        scope: &idempotency_actix::store::Scope,
        token: &idempotency_actix::store::ReservationToken,
    ) -> Result<idempotency_actix::store::WriteOutcome, idempotency_actix::store::StoreError> {
        self.inner.release(scope, token).await
    }

    async fn purge_expired(
        &self,
        grace: Duration,
    ) -> Result<u64, idempotency_actix::store::StoreError> {
        self.inner.purge_expired(grace).await
    }
}

/// A background retry of `complete` that panics (C16) is counted (`panicked`), as every other
/// end of a retry is: the response it was storing is lost and a retry after the lease runs the
/// handler again, which the "responses lost" alert is for. Before, the task's panic ended it
/// with `started` counted and nothing else.
#[actix_rt::test]
async fn a_background_retry_that_panics_is_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let store = PanicsOnRetry::default();
    let app = init_service(App::new().wrap(Idempotency::new(store.clone())).route(
        "/payments",
        web::post().to(|| async { HttpResponse::Created().body("ok") }),
    ))
    .await;
    let response = call_service(&app, keyed("/payments", "retry-panics", "{}").to_request()).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    // The retry's first pause is 100 ms; give it time to try and panic.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while store.completes.load(std::sync::atomic::Ordering::SeqCst) < 2 {
        assert!(std::time::Instant::now() < deadline, "no retry came");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let metrics = read(&snapshotter);
    let retries = |result: &str| match value(
        &metrics,
        MetricKind::Counter,
        "idempotency_complete_retries_total",
        &[("result", result)],
    ) {
        Some(DebugValue::Counter(n)) => *n,
        _ => 0,
    };
    assert_eq!(retries("started"), 1);
    assert_eq!(retries("panicked"), 1, "the panic was counted nowhere");
}
