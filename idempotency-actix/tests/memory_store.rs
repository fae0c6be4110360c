//! The memory store's bounds and grace (C9, C22) through its public API and the real middleware.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::{to_bytes, MessageBody};
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::test::{call_service, init_service, TestRequest};
use actix_web::{web, App, HttpResponse};
use bytes::Bytes;
use idempotency_actix::store::{
    IdempotencyStore, MemoryStore, ReserveOutcome, StoreError, StoredResponse, WriteOutcome,
};
use idempotency_actix::Idempotency;

use common::{reserved, scope, small, FP_A, FP_B, MINUTE};
use serde_json::Value;

/// Counts handler executions; the handler answers 201 with a body of `?size=` bytes (default a
/// few) naming the execution.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

impl Counter {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

async fn create(counter: web::Data<Counter>, query: web::Query<Size>) -> HttpResponse {
    let n = counter.0.fetch_add(1, Ordering::SeqCst) + 1;
    let mut body = format!("execution {n}").into_bytes();
    body.resize(body.len().max(query.size), b'.');
    HttpResponse::Created().body(body)
}

#[derive(serde::Deserialize)]
struct Size {
    #[serde(default)]
    size: usize,
}

async fn app(
    store: MemoryStore,
    counter: &Counter,
) -> impl Service<
    actix_http::Request,
    Response = ServiceResponse<impl MessageBody>,
    Error = actix_web::Error,
> {
    // The store's response allowance bounds the middleware's `max_response_bytes`.
    let room = store.max_response_bytes().unwrap_or(usize::MAX);
    let middleware = Idempotency::builder(store)
        .tenant_header("x-tenant")
        .max_response_bytes(room)
        .build();
    init_service(
        App::new()
            .app_data(web::Data::new(counter.clone()))
            .wrap(middleware)
            .route("/pay", web::post().to(create)),
    )
    .await
}

/// What came back: status, whether it was a replay, the problem code if any, the body.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    replayed: bool,
    code: Option<String>,
    body: Bytes,
}

async fn send<S, B>(app: &S, tenant: &str, key: &str, size: usize) -> Reply
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let req = TestRequest::post()
        .uri(&format!("/pay?size={size}"))
        .insert_header(("idempotency-key", key))
        .insert_header(("x-tenant", tenant))
        .set_payload("{\"amount\":1}")
        .to_request();
    let res = call_service(app, req).await;
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let body = match to_bytes(res.into_body()).await {
        Ok(body) => body,
        Err(_) => panic!("the body could not be read"),
    };
    let code = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["code"].as_str().map(str::to_owned));
    Reply {
        status,
        replayed,
        code,
        body,
    }
}

fn assert_unavailable(reply: &Reply, what: &str) {
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{what}: {reply:?}"
    );
    assert_eq!(
        reply.code.as_deref(),
        Some("STORAGE_UNAVAILABLE"),
        "{what}: {reply:?}"
    );
}

/// Issue 9 item 2, the reproduction: with `max_entries(2)` and otherwise default settings,
/// keys k1, k2, k3 and a retry of k1 used to run the handler 4 times (k3 silently evicted k1's
/// live record). Guards C22: a full store answers 503 for the new key, the handler does not
/// run, and every retry is a replay or a 503, never a second execution. Also guards that one
/// tenant filling the shared bound cannot push out another tenant's record.
#[actix_rt::test]
async fn full_store_answers_503_and_never_runs_a_request_twice() {
    let counter = Counter::default();
    let app = app(MemoryStore::builder().max_entries(2).build(), &counter).await;
    for key in ["k1", "k2"] {
        let first = send(&app, "a", key, 0).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}: {first:?}");
        assert!(!first.replayed);
    }
    assert_unavailable(&send(&app, "a", "k3", 0).await, "k3 on a full store");
    assert_eq!(counter.get(), 2, "the handler must not run for k3");
    let retry = send(&app, "a", "k1", 0).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(
        retry.replayed,
        "the retry of k1 must be a replay: {retry:?}"
    );
    assert_eq!(&retry.body[..], b"execution 1");

    // Another tenant's flood of new keys gets 503s and pushes nothing out.
    for i in 0..10 {
        assert_unavailable(&send(&app, "b", &format!("flood-{i}"), 0).await, "flood");
    }
    // Every retry, of stored and refused keys alike, is a replay or a 503.
    for (tenant, key) in [("a", "k1"), ("a", "k2"), ("a", "k3"), ("b", "flood-3")] {
        let retry = send(&app, tenant, key, 0).await;
        assert!(
            retry.replayed || retry.status == StatusCode::SERVICE_UNAVAILABLE,
            "{tenant}/{key}: a retry must be a replay or a 503, got {retry:?}"
        );
    }
    assert_eq!(
        counter.get(),
        2,
        "no request may run twice, none refused may run"
    );
}

/// Issue 9 item 2, the byte bound through the middleware: a few big bodies fill
/// `max_bytes`, then new keys get 503 (handler not run) while the big records still replay.
/// Guards C22's "memory bounds count bytes, not only records".
#[actix_rt::test]
async fn big_bodies_fill_the_byte_bound_and_then_503() {
    let counter = Counter::default();
    let store = MemoryStore::builder()
        .max_bytes(2 * 1024 * 1024)
        .response_allowance(512 * 1024)
        .build();
    let app = app(store.clone(), &counter).await;
    let big = 400 * 1024;
    let mut stored = Vec::new();
    for i in 0..10 {
        let key = format!("big-{i}");
        let reply = send(&app, "a", &key, big).await;
        if reply.status == StatusCode::CREATED {
            assert_eq!(reply.body.len(), big);
            stored.push(key);
        } else {
            assert_unavailable(&reply, "a new key on a store full of bytes");
        }
        assert!(store.bytes_used() <= 2 * 1024 * 1024, "the bound holds");
    }
    assert!(
        (2..=4).contains(&stored.len()),
        "a 2 MiB bound holds 2 to 4 responses of 400 KiB, stored {}",
        stored.len()
    );
    assert_eq!(counter.get(), stored.len(), "refused keys never ran");
    for key in &stored {
        let retry = send(&app, "a", key, big).await;
        assert!(retry.replayed, "{key} must still replay: {retry:?}");
        assert_eq!(retry.body.len(), big);
    }
    assert_eq!(counter.get(), stored.len());
}

/// The byte bound with the default settings, through the store API: 300 completed records of
/// 1 MiB each (one shared buffer, so the test itself stays small) cannot all be kept in a
/// store that counted only records (100,000). Guards C22: the store refuses once the default
/// byte bound is reached, instead of growing without limit or dropping what it holds.
#[tokio::test]
async fn default_byte_bound_refuses_instead_of_growing() {
    let store = MemoryStore::new();
    let body = Bytes::from(vec![b'x'; 1024 * 1024 - 256]);
    let response = StoredResponse {
        status: 200,
        headers: vec![],
        body,
    };
    let mut kept = 0;
    let mut refused = false;
    for i in 0..300 {
        let key = format!("mib-{i}");
        let token = match store.reserve(&scope(&key), &FP_A, MINUTE).await {
            Ok(ReserveOutcome::Reserved { token }) => token,
            Ok(other) => panic!("{key}: unexpected {other:?}"),
            Err(_) => {
                refused = true;
                break;
            }
        };
        let outcome = store
            .complete(&scope(&key), &token, &response, MINUTE)
            .await;
        assert!(
            matches!(outcome, Ok(WriteOutcome::Applied)),
            "a response within the allowance always fits at complete: {outcome:?}"
        );
        kept += 1;
    }
    assert!(
        refused,
        "a 300 MiB working set must hit the default byte bound"
    );
    assert!(
        kept >= 200,
        "a small server's default keeps 200+ MiB, kept {kept}"
    );
    for i in 0..kept {
        let key = format!("mib-{i}");
        assert!(
            matches!(
                store.reserve(&scope(&key), &FP_A, MINUTE).await,
                Ok(ReserveOutcome::Completed { .. })
            ),
            "{key} is live and must still be there"
        );
    }
}

/// Issue 9 item 3: the periodic sweep used to delete a reservation as soon as its lease ended.
/// Then a slow handler's late `complete` got `Stale` (its response lost, a retry ran it again)
/// and another body could reserve the key. Guards C9/C22 for the memory store's own sweep:
/// within the grace both are still right; after the grace the sweep deletes the reservation.
#[tokio::test]
async fn periodic_sweep_keeps_ended_reservations_for_the_grace() {
    let store = MemoryStore::builder()
        .sweep_interval(Duration::from_millis(1))
        .reservation_grace(Duration::from_secs(3600))
        .build();
    let lease = Duration::from_millis(100);
    let slow = reserved(&store, "slow", &FP_A, lease).await;
    tokio::time::sleep(lease * 3).await;
    // Any reservation runs the (now due) periodic sweep.
    reserved(&store, "other", &FP_A, MINUTE).await;
    assert_eq!(store.len(), 2, "the ended reservation is still there");
    match store.reserve(&scope("slow"), &FP_B, MINUTE).await {
        Ok(ReserveOutcome::InFlight { fingerprint, .. }) => assert_eq!(fingerprint, FP_A),
        other => panic!("another body must not reserve the key, got {other:?}"),
    }
    let late = small(b"late");
    assert!(matches!(
        store.complete(&scope("slow"), &slow, &late, MINUTE).await,
        Ok(WriteOutcome::Applied)
    ));
    match store.reserve(&scope("slow"), &FP_A, MINUTE).await {
        Ok(ReserveOutcome::Completed { response, .. }) => assert_eq!(response, late),
        other => panic!("the late response must be replayed, got {other:?}"),
    }

    // With a short grace, the sweep deletes the ended reservation once the grace is over.
    let store = MemoryStore::builder()
        .sweep_interval(Duration::from_millis(1))
        .reservation_grace(Duration::from_millis(100))
        .build();
    reserved(&store, "dead", &FP_A, lease).await;
    tokio::time::sleep(lease * 3).await;
    reserved(&store, "other", &FP_A, MINUTE).await;
    assert_eq!(
        store.len(),
        1,
        "the sweep deleted the reservation after its grace"
    );
    reserved(&store, "dead", &FP_B, MINUTE).await;
}

/// An ended reservation no longer holds its response allowance, so abandoned reservations
/// cannot fill the byte bound; its holder's late `complete` needs room for the response and,
/// given it, still applies. Guards the accounting of item 3 against item 2's bound.
#[tokio::test]
async fn ended_reservations_give_back_their_allowance() {
    let store = MemoryStore::builder()
        .response_allowance(100_000)
        .sweep_interval(Duration::from_millis(1))
        .build();
    let lease = Duration::from_millis(50);
    let token = reserved(&store, "slow", &FP_A, lease).await;
    let running = store.bytes_used();
    assert!(
        running > 100_000,
        "a running reservation holds its allowance"
    );
    tokio::time::sleep(lease * 3).await;
    reserved(&store, "other", &FP_A, MINUTE).await;
    assert!(
        store.bytes_used() < running + 1_000,
        "the ended reservation gave its allowance back: {} vs {running}",
        store.bytes_used()
    );
    assert!(matches!(
        store
            .complete(&scope("slow"), &token, &small(b"late"), MINUTE)
            .await,
        Ok(WriteOutcome::Applied)
    ));
}

/// `Instant + Duration::MAX` panics; the old store did exactly that for a huge lease or TTL.
/// Guards that `Duration::MAX` (and other huge values) for a lease, a TTL and a purge grace
/// mean "practically never" and never panic.
#[tokio::test]
async fn huge_durations_never_panic() {
    let store = MemoryStore::new();
    let huge = [
        Duration::MAX,
        Duration::from_secs(u64::MAX / 2),
        Duration::from_secs(1 << 40),
    ];
    for (i, lease) in huge.into_iter().enumerate() {
        let key = format!("huge-{i}");
        let token = reserved(&store, &key, &FP_A, lease).await;
        match store.reserve(&scope(&key), &FP_A, MINUTE).await {
            Ok(ReserveOutcome::InFlight {
                lease_remaining, ..
            }) => assert!(lease_remaining > Duration::from_secs(365 * 24 * 3600)),
            other => panic!("a huge lease is still running, got {other:?}"),
        }
        assert!(matches!(
            store
                .complete(&scope(&key), &token, &small(b"forever"), lease)
                .await,
            Ok(WriteOutcome::Applied)
        ));
        match store.reserve(&scope(&key), &FP_A, MINUTE).await {
            Ok(ReserveOutcome::Completed { expires_in, .. }) => {
                assert!(expires_in.is_some_and(|left| left > Duration::from_secs(365 * 24 * 3600)))
            }
            other => panic!("a huge TTL keeps the record, got {other:?}"),
        }
    }
    for grace in [Duration::MAX, Duration::ZERO] {
        assert!(store.purge_expired(grace).await.is_ok());
    }
    assert_eq!(store.len(), 3, "nothing with a huge lifetime was purged");
}

/// The same for the builder's durations: a huge grace or sweep interval never panics, and a
/// reservation with a huge grace is kept by the sweep.
#[tokio::test]
async fn huge_grace_and_sweep_interval_never_panic() {
    for (grace, interval) in [
        (Duration::MAX, Duration::ZERO),
        (Duration::MAX, Duration::MAX),
        (Duration::ZERO, Duration::MAX),
    ] {
        let store = MemoryStore::builder()
            .reservation_grace(grace)
            .sweep_interval(interval)
            .build();
        reserved(&store, "a", &FP_A, Duration::from_millis(1)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        reserved(&store, "b", &FP_A, Duration::MAX).await;
        assert!(store.purge_expired(Duration::MAX).await.is_ok());
        assert_eq!(
            store.len(),
            2,
            "grace {grace:?}: a purge with a huge grace keeps both"
        );
    }
}

/// The response allowance secures room for any response the middleware may store. The
/// middleware bounds the body (`max_response_bytes`), the store charges the encoded headers
/// too: a body of exactly the allowance on a full store used to fail `complete`, and after the
/// lease a retry ran the handler a second time (found by review, 2026-12-04).
#[actix_rt::test]
async fn a_body_of_exactly_max_response_bytes_is_stored_on_a_full_store() {
    // Room for exactly one reservation of a two-letter key (allowance at its default, 1 MiB,
    // the middleware's default max_response_bytes).
    let probe = MemoryStore::new();
    reserved(&probe, "p1", &FP_A, MINUTE).await;
    let one_reservation = probe.bytes_used();
    let store = MemoryStore::builder().max_bytes(one_reservation).build();

    let counter = Counter::default();
    let middleware = Idempotency::builder(store.clone())
        .tenant_header("x-tenant")
        .lock_timeout(Duration::from_millis(300))
        .build();
    let app = init_service(
        App::new()
            .app_data(web::Data::new(counter.clone()))
            .wrap(middleware)
            .route("/pay", web::post().to(create)),
    )
    .await;
    let size = 1024 * 1024; // == max_response_bytes (default): storable
    let first = send(&app, "t", "k1", size).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(counter.get(), 1);
    // The lease ends; the middleware's complete retries have given up by then.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let retry = send(&app, "t", "k1", size).await;
    assert_eq!(
        counter.get(),
        1,
        "the handler ran twice for one key: retry got {} replayed={} body starts {:?}",
        retry.status,
        retry.replayed,
        String::from_utf8_lossy(&retry.body[..12])
    );
    assert!(retry.replayed, "{:?}", retry.status);
}

/// The same at the store API: a response whose body is within the allowance is stored on a
/// store with no free room, its headers taking the bound past `max_bytes` rather than failing.
#[tokio::test]
async fn a_response_within_the_allowance_fits_at_complete_on_a_full_store() {
    let allowance = 1_000;
    let probe = MemoryStore::builder().response_allowance(allowance).build();
    reserved(&probe, "p1", &FP_A, MINUTE).await;
    let store = MemoryStore::builder()
        .response_allowance(allowance)
        .max_bytes(probe.bytes_used())
        .build();
    let token = reserved(&store, "k1", &FP_A, MINUTE).await;
    let header = ("content-type".to_owned(), Bytes::from_static(b"text/plain"));
    let body = Bytes::from(vec![b'x'; allowance - header.0.len() - header.1.len()]);
    let response = StoredResponse {
        status: 201,
        headers: vec![header],
        body,
    };
    assert_eq!(response.size_bytes(), allowance, "exactly the allowance");
    let outcome = store
        .complete(&scope("k1"), &token, &response, MINUTE)
        .await;
    assert!(
        matches!(outcome, Ok(WriteOutcome::Applied)),
        "a response within the allowance must fit at complete: {outcome:?}"
    );
}

/// The byte bound bounds what records keep alive: a handler that answers with a small slice of
/// a buffer it read (a proxied upstream chunk, a cached blob) used to have the whole buffer
/// kept by the record while only the slice was charged (found by review, 2026-12-04).
#[actix_rt::test]
async fn the_byte_bound_holds_for_sliced_handler_bodies() {
    struct Tracked(Vec<u8>, Arc<AtomicUsize>);
    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Tracked {
        fn drop(&mut self) {
            self.1.fetch_sub(self.0.len(), Ordering::SeqCst);
        }
    }
    let retained = Arc::new(AtomicUsize::new(0));
    let max_bytes = 4 * 1024 * 1024;
    let store = MemoryStore::builder()
        .max_bytes(max_bytes)
        .response_allowance(64 * 1024)
        .build();
    let counter = retained.clone();
    let app = init_service(
        App::new()
            .wrap(
                Idempotency::builder(store.clone())
                    .tenant_header("x-tenant")
                    .max_response_bytes(64 * 1024)
                    .build(),
            )
            .route(
                "/pay",
                web::post().to(move || {
                    let counter = counter.clone();
                    async move {
                        let upstream = vec![b'x'; 1024 * 1024];
                        counter.fetch_add(upstream.len(), Ordering::SeqCst);
                        let read = Bytes::from_owner(Tracked(upstream, counter));
                        HttpResponse::Created().body(read.slice(..16))
                    }
                }),
            ),
    )
    .await;
    for i in 0..32 {
        let reply = send(&app, "t", &format!("p{i}"), 0).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let kept = retained.load(Ordering::SeqCst);
    assert!(
        kept <= max_bytes,
        "32 stored 16-byte responses keep {kept} bytes alive under a {max_bytes}-byte bound \
         (charged {})",
        store.bytes_used()
    );
}

fn with_header(value_len: usize, body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("x-echo".to_owned(), Bytes::from(vec![b'h'; value_len]))],
        body: Bytes::from_static(body),
    }
}

/// The headers a full store lets past its bound are bounded too: at most one more allowance
/// (found by review of the fix above, 2026-12-04: a 1.4 MB header block was stored under a
/// 1,395-byte bound).
#[tokio::test]
async fn a_header_block_larger_than_the_allowance_is_not_stored_past_the_bound() {
    let allowance = 1_000;
    let probe = MemoryStore::builder().response_allowance(allowance).build();
    reserved(&probe, "p1", &FP_A, MINUTE).await;
    let max_bytes = probe.bytes_used();
    let store = MemoryStore::builder()
        .response_allowance(allowance)
        .max_bytes(max_bytes)
        .build();
    let token = reserved(&store, "k1", &FP_A, MINUTE).await;
    let response = with_header(max_bytes * 1000, b"ok");
    let outcome = store
        .complete(&scope("k1"), &token, &response, MINUTE)
        .await;
    let used = store.bytes_used();
    assert!(
        matches!(outcome, Err(StoreError::ByteCapacity(_))),
        "complete answered {outcome:?}, {used} bytes charged under a max_bytes of {max_bytes}"
    );
    assert!(used <= max_bytes, "{used} bytes charged under {max_bytes}");
}

/// A late complete (its lease ended and its allowance went, here to another request) gets no
/// room past the bound (found by review, 2026-12-04).
#[tokio::test]
async fn a_late_complete_does_not_overshoot_the_bound() {
    let allowance = 1_000;
    let probe = MemoryStore::builder().response_allowance(allowance).build();
    reserved(&probe, "p1", &FP_A, MINUTE).await;
    let base = probe.bytes_used() - allowance;
    let max_bytes = 2 * base + allowance + 100;
    let store = MemoryStore::builder()
        .response_allowance(allowance)
        .max_bytes(max_bytes)
        .build();
    let token = reserved(&store, "k1", &FP_A, Duration::from_millis(50)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    reserved(&store, "k2", &FP_A, MINUTE).await; // takes k1's given-back allowance
    let response = with_header(64 * 1024, b"");
    let outcome = store
        .complete(&scope("k1"), &token, &response, MINUTE)
        .await;
    let used = store.bytes_used();
    assert!(
        used <= max_bytes && matches!(outcome, Err(StoreError::ByteCapacity(_))),
        "late complete answered {outcome:?}; {used} bytes charged under max_bytes {max_bytes}"
    );
}
