//! Background retries (C16) over a store whose calls never return, in a test binary of its
//! own: it waits for the process's `shutdown::work_finished`, which counts every background
//! retry, so its tests take turns.
//!
//! A retry waits for each try's answer. A custom store that never answers (a call stuck on a
//! lock it waits for without a timeout, a bug) kept the retry, its response and its place
//! under `MAX_BACKGROUND_RETRIES` for the life of the process, and a graceful stop waited the
//! whole of its limit for it. A try still unanswered ten leases (at least 1 s, at most 60 s)
//! after the lease it holds ended is now dropped and given up: the key is anyone's by then,
//! which is what giving up says.

use std::future::pending;
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

/// One test at a time: `work_finished` counts the whole process's retries.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A memory store whose first `complete` (or `release`) fails and whose later ones never
/// return; with `hung_renewals`, its renewals never return either.
#[derive(Clone, Default)]
struct Hangs {
    inner: MemoryStore,
    completes: Arc<AtomicUsize>,
    releases: Arc<AtomicUsize>,
    hung_renewals: bool,
}

/// The first call fails, the later ones never return.
async fn fails_then_hangs(calls: &AtomicUsize) -> StoreError {
    if calls.fetch_add(1, Ordering::SeqCst) > 0 {
        pending::<()>().await;
    }
    StoreError::unavailable("timed out")
}

impl IdempotencyStore for Hangs {
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        self.inner.reserve(scope, fingerprint, lease).await
    }
    async fn complete(
        &self,
        _: &Scope,
        _: &ReservationToken,
        _: &StoredResponse,
        _: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        Err(fails_then_hangs(&self.completes).await)
    }
    async fn release(&self, _: &Scope, _: &ReservationToken) -> Result<WriteOutcome, StoreError> {
        Err(fails_then_hangs(&self.releases).await)
    }
    async fn renew_lease(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        lease: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        if self.hung_renewals {
            pending::<()>().await;
        }
        self.inner.renew_lease(scope, token, lease).await
    }
    fn renews_leases(&self) -> bool {
        true
    }
    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.inner.purge_expired(grace).await
    }
}

const LEASE: Duration = Duration::from_millis(300);
const RENEW_UP_TO: Duration = Duration::from_millis(900);

/// One keyed request to a handler answering `status` over `store`; then whether every
/// background retry ended within `within`, and how many `complete` and `release` calls the
/// store saw.
async fn retries_end_within(store: Hangs, status: u16, within: Duration) -> (bool, usize, usize) {
    let _turn = ONE_AT_A_TIME.lock().await;
    let (completes, releases) = (Arc::clone(&store.completes), Arc::clone(&store.releases));
    let app = init_service(
        App::new()
            .wrap(
                Idempotency::builder(store)
                    .lock_timeout(LEASE)
                    .renew_lease_up_to(RENEW_UP_TO)
                    .build(),
            )
            .route(
                "/pay",
                web::post().to(move || async move {
                    HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap())
                        .body("x")
                }),
            ),
    )
    .await;
    let request = TestRequest::post()
        .uri("/pay")
        .insert_header(("idempotency-key", "k"))
        .set_payload("x")
        .to_request();
    let response = call_service(&app, request).await;
    assert_eq!(response.status().as_u16(), status);
    let ended = shutdown::work_finished(within).await;
    (
        ended,
        completes.load(Ordering::SeqCst),
        releases.load(Ordering::SeqCst),
    )
}

/// Renewed up to 900 ms after the reservation, a lease of 300 ms ends by about 1.2 s, and a
/// try unanswered ten leases (3 s) later is given up: all ended within 10 s (before: never).
#[actix_web::test]
async fn a_complete_retry_whose_store_never_answers_ends() {
    let (ended, completes, _) =
        retries_end_within(Hangs::default(), 201, Duration::from_secs(10)).await;
    assert!(
        completes >= 2,
        "the scenario: a retry tried again ({completes} calls)"
    );
    assert!(
        ended,
        "the retry of a complete that never answers is still running"
    );
}

/// The same with renewals that never answer either: they are dropped as the try is, so they
/// do not hold the retry.
#[actix_web::test]
async fn a_complete_retry_whose_renewals_never_answer_ends() {
    let store = Hangs {
        hung_renewals: true,
        ..Hangs::default()
    };
    let (ended, completes, _) = retries_end_within(store, 201, Duration::from_secs(10)).await;
    assert!(
        completes >= 2,
        "the scenario: a retry tried again ({completes} calls)"
    );
    assert!(
        ended,
        "the retry of a complete that never answers is still running"
    );
}

/// A 500 is not stored: the key is released, the release fails and is retried, and its retry
/// never answers. The lease ends at 300 ms; the try is given up 3 s later (before: never).
#[actix_web::test]
async fn a_release_retry_whose_store_never_answers_ends() {
    let (ended, _, releases) =
        retries_end_within(Hangs::default(), 500, Duration::from_secs(10)).await;
    assert!(
        releases >= 2,
        "the scenario: a retry tried again ({releases} calls)"
    );
    assert!(
        ended,
        "the retry of a release that never answers is still running"
    );
}
