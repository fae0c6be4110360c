//! The bound on background retries of a failed `complete` (C16), in a test binary of its own:
//! it counts every background retry the process's `shutdown::unfinished_work` sees.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpResponse};
use idempotency_actix::store::{
    IdempotencyStore, MemoryStore, ReservationToken, ReserveOutcome, Scope, StoreError,
    StoredResponse, WriteOutcome,
};
use idempotency_actix::{shutdown, Fingerprint, Idempotency};

/// A memory store whose every `complete` fails, while it reserves and renews (a responses
/// table locked, completions timing out).
#[derive(Clone)]
struct CompletesFail(MemoryStore);

impl IdempotencyStore for CompletesFail {
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        self.0.reserve(scope, fingerprint, lease).await
    }
    async fn complete(
        &self,
        _: &Scope,
        _: &ReservationToken,
        _: &StoredResponse,
        _: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        Err(StoreError::unavailable("timed out"))
    }
    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.0.release(scope, token).await
    }
    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.0.renew_lease(scope, token, lease).await
    }
    fn renews_leases(&self) -> bool {
        true
    }
    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.0.purge_expired(grace).await
    }
}

/// During a brownout in which every `complete` fails, each failure started a background retry
/// that lives a lease (and, renewing it, up to `renew_lease_up_to`), each holding its response:
/// at hundreds of requests a second, tens of thousands of tasks and their bodies, with nothing
/// to bound them (review, 2026-12-06). A middleware now keeps at most
/// `MAX_BACKGROUND_RETRIES`; past that a failure is not retried (its key is held until its
/// lease ends), and says so.
#[actix_web::test]
async fn background_retries_of_failed_completes_are_bounded() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let app = init_service(
        App::new()
            .wrap(
                Idempotency::builder(CompletesFail(
                    // Room for every reservation of the run, each with a small allowance.
                    MemoryStore::builder().response_allowance(2048).build(),
                ))
                .lock_timeout(Duration::from_secs(5))
                .build(),
            )
            .route(
                "/pay",
                web::post().to(move || {
                    counted.fetch_add(1, Ordering::SeqCst);
                    async { HttpResponse::Created().body(vec![b'x'; 1024]) }
                }),
            ),
    )
    .await;
    let bound = idempotency_actix::middleware::MAX_BACKGROUND_RETRIES;
    let mut most = 0;
    for i in 0..bound + 200 {
        let request = TestRequest::post()
            .uri("/pay")
            .insert_header(("idempotency-key", format!("k-{i}")))
            .set_payload("x")
            .to_request();
        let response = call_service(&app, request).await;
        assert_eq!(response.status().as_u16(), 201);
        most = most.max(shutdown::unfinished_work());
    }
    assert_eq!(runs.load(Ordering::SeqCst), bound + 200);
    assert!(
        most <= bound + 1,
        "{most} background retries at once, over the bound of {bound}"
    );
}
