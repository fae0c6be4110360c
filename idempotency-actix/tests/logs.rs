//! What the middleware and the memory store write to the log, read back through a capturing
//! subscriber.
//!
//! These tests live in their own binary on purpose. `tracing` decides once per call site, for
//! the whole process, whether that call site is enabled, and asks the subscriber of whichever
//! thread reaches it first. A test in the same binary that runs the middleware with no
//! subscriber could reach the request span or an event first and switch it off for every
//! thread, this test's included (it failed that way in CI twice: a line without its span, then
//! with its span fields missing). Here every test sets the same capturing subscriber before it
//! does anything, so whichever test reaches a call site first, the answer is the same.

#[allow(dead_code)]
#[path = "support/captured.rs"]
mod captured;
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use actix_web::body::to_bytes;
use actix_web::http::StatusCode;
use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpResponse};
use bytes::Bytes;
use idempotency_actix::store::{
    IdempotencyStore, MemoryStore, ReserveOutcome, StoreError, WriteOutcome,
};
use idempotency_actix::Idempotency;

use captured::Captured;
use common::{reserved, scope, small, FP_A, FP_B, MINUTE};

/// This thread's log events from here on (info and above, no colours), until the guard drops.
/// Every test here uses this one filter, so no test can leave a call site switched off for
/// another (see the module docs).
fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    // A call site first reached while no test had a subscriber (the harness, a helper thread)
    // was decided against nobody; decide every known call site again, against this one.
    tracing::callsite::rebuild_interest_cache();
    (logs, guard)
}

/// The opt-in (`evict_live_completed_when_full(true)`): a full store evicts its oldest live
/// completed record to make room, and logs it at warn with the scope; reservations are still
/// never evicted. Guards that the cache-like mode works and is never silent.
#[tokio::test]
async fn opted_in_eviction_evicts_the_oldest_and_logs_it_at_warn() {
    let (logs, _guard) = capture_logs();

    let store = MemoryStore::builder()
        .max_entries(2)
        .evict_live_completed_when_full(true)
        .build();
    for key in ["k1", "k2"] {
        let token = reserved(&store, key, &FP_A, MINUTE).await;
        let outcome = store
            .complete(&scope(key), &token, &small(b"ok"), MINUTE)
            .await;
        assert!(matches!(outcome, Ok(WriteOutcome::Applied)));
    }
    assert!(
        logs.text().is_empty(),
        "nothing evicted yet: {}",
        logs.text()
    );
    let running = reserved(&store, "k3", &FP_A, MINUTE).await;
    let text = logs.text();
    assert!(text.contains("WARN"), "{text}");
    assert!(text.contains("idempotency_actix"), "{text}");
    assert!(text.contains("evicted"), "{text}");
    assert!(
        text.contains("key=k1") && text.contains("tenant=t"),
        "{text}"
    );
    assert!(!text.contains("key=k2"), "only k1 was evicted: {text}");
    // k1 is gone (a retry would run again), k2 is kept.
    assert!(matches!(
        store.reserve(&scope("k2"), &FP_A, MINUTE).await,
        Ok(ReserveOutcome::Completed { .. })
    ));
    // k4 evicts k2; then only reservations are left (k3, k4) and nothing more is evicted.
    reserved(&store, "k4", &FP_A, MINUTE).await;
    assert!(logs.text().contains("key=k2"));
    assert!(matches!(
        store.reserve(&scope("k5"), &FP_A, MINUTE).await,
        Err(StoreError::Capacity(2))
    ));
    assert!(matches!(
        store.reserve(&scope("k3"), &FP_B, MINUTE).await,
        Ok(ReserveOutcome::InFlight { .. })
    ));
    let outcome = store
        .complete(&scope("k3"), &running, &small(b"3"), MINUTE)
        .await;
    assert!(matches!(outcome, Ok(WriteOutcome::Applied)));
}

/// The router decodes `%0A` and `%1B` in the path, and a quoted key may hold spaces and `=`:
/// written as they are into a text log, they would forge lines, drive the reader's terminal
/// or pass for another field. Every client-controlled field is quoted and escaped instead.
#[actix_web::test]
async fn hostile_scope_text_cannot_forge_log_lines() {
    let (logs, _guard) = capture_logs();
    let app = init_service(
        App::new()
            .wrap(Idempotency::new(MemoryStore::new()))
            .route("/known", web::post().to(HttpResponse::Created)),
    )
    .await;
    // No route matches: 404, not stored, logged at info inside the request's span.
    let reply = call_service(
        &app,
        TestRequest::post()
            .uri("/x%0A2026-01-01T00:00:00Z%20ERROR%20forged%1B[2J")
            .insert_header(("idempotency-key", "\"a tenant=victim\""))
            .to_request(),
    )
    .await;
    assert_eq!(reply.status(), StatusCode::NOT_FOUND);
    let text = logs.text();
    assert!(text.contains("not stored"), "the event was logged: {text}");
    assert!(
        !text
            .lines()
            .any(|line| line.starts_with("2026-01-01T00:00:00Z")),
        "a forged line: {text}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "an escape character reached the log: {text:?}"
    );
    assert!(text.contains("key=\"a tenant=victim\""), "{text}");
}

/// docs/security.md, "Keys and tenants in logs": "`not_stored` at `info` (`warn` for a
/// response too large to store)", and the same page advises operators who must keep keys out
/// of their logs to "log the target at `warn`". So a buffered (non-streamed) response over
/// `max_response_bytes` must leave its line at warn, as a streamed one does (an audit,
/// 2026-12-05, found it at `info`).
#[actix_web::test]
async fn a_buffered_response_too_large_to_store_is_logged_at_warn() {
    let (logs, _guard) = capture_logs();
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = init_service(
        App::new()
            .wrap(
                Idempotency::builder(MemoryStore::new())
                    .max_response_bytes(16)
                    .build(),
            )
            .route(
                "/echo",
                web::post().to(move |body: Bytes| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async move { HttpResponse::Created().body(body) }
                }),
            ),
    )
    .await;
    let big = || {
        TestRequest::post()
            .uri("/echo")
            .insert_header(("idempotency-key", "big-1"))
            .set_payload(vec![b'x'; 64])
            .to_request()
    };
    let first = call_service(&app, big()).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let body = to_bytes(first.into_body()).await.unwrap_or_default();
    assert_eq!(body.len(), 64, "the client gets the whole response");
    let retry = call_service(&app, big()).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "not stored: the key was released (C10)"
    );
    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("not_stored")).collect();
    assert_eq!(lines.len(), 2, "one line per response: {text:?}");
    for line in lines {
        assert!(
            line.contains(" WARN ") && line.contains("max_response_bytes=16"),
            "a response too large to store was not logged at warn: {line:?}"
        );
        assert!(
            line.contains("key=big-1"),
            "inside the request's span: {line:?}"
        );
    }
}

/// A store that keeps records in a `MemoryStore` but has no `renew_lease` (the trait's
/// default): what a custom store that skipped it looks like.
#[derive(Clone, Default)]
struct NoRenewal(MemoryStore);

impl IdempotencyStore for NoRenewal {
    async fn reserve(
        &self,
        scope: &idempotency_actix::store::Scope,
        fingerprint: &idempotency_actix::Fingerprint,
        lease: std::time::Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        self.0.reserve(scope, fingerprint, lease).await
    }

    async fn complete(
        &self,
        scope: &idempotency_actix::store::Scope,
        token: &idempotency_actix::store::ReservationToken,
        response: &idempotency_actix::store::StoredResponse,
        ttl: std::time::Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.0.complete(scope, token, response, ttl).await
    }

    async fn release(
        &self,
        scope: &idempotency_actix::store::Scope,
        token: &idempotency_actix::store::ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.0.release(scope, token).await
    }

    async fn purge_expired(&self, grace: std::time::Duration) -> Result<u64, StoreError> {
        self.0.purge_expired(grace).await
    }
}

/// A store that cannot renew leases, under a middleware that would renew them (the default
/// `renew_lease_up_to` of 10 minutes past a 60 s lease): a handler slower than the lease is
/// taken over by a retry and runs twice, which the app's operator must learn when the app
/// starts, not from a double charge. Said once, at `warn`, when the middleware is built; not
/// when renewal is off (`renew_lease_up_to(ZERO)`: the lease is all there is, by choice), nor
/// for a store that renews.
#[test]
fn a_store_that_cannot_renew_leases_is_named_when_the_middleware_is_built() {
    let (logs, _guard) = capture_logs();
    let _ = Idempotency::new(NoRenewal::default());
    let text = logs.text();
    assert!(
        text.contains("WARN") && text.contains("cannot renew leases"),
        "nothing said: {text}"
    );
    let before = logs.text().len();
    let _ = Idempotency::builder(NoRenewal::default())
        .renew_lease_up_to(std::time::Duration::ZERO)
        .build();
    let _ = Idempotency::new(MemoryStore::new());
    assert_eq!(logs.text().len(), before, "{}", logs.text());
}
