//! CachedStore against records that change behind its back (found by review, 2026-12-04).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::{
    CachedStore, Fingerprint, IdempotencyStore, MemoryStore, ReservationToken, ReserveOutcome,
    Scope, StoreError, StoredResponse, WriteOutcome,
};
use tokio::sync::Notify;

const MINUTE: Duration = Duration::from_secs(60);
const DAY: Duration = Duration::from_secs(24 * 3600);
const FP: Fingerprint = Fingerprint([0x11; 32]);

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/pay".into(),
        key: key.into(),
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(b"payment 1"),
    }
}

/// Two signals: the store has answered; let the answer through.
type Hold = Option<(Arc<Notify>, Arc<Notify>)>;

/// A store whose records an operator can delete behind the app's back (what
/// `idem-cli release --force` does to a completed PostgreSQL row), and whose next `reserve`
/// answer can be held on its way back to the caller (a slow network, a busy worker).
#[derive(Clone, Default)]
struct Operated {
    records: Arc<Mutex<MemoryStore>>,
    hold: Arc<Mutex<Hold>>,
}

impl Operated {
    fn store(&self) -> MemoryStore {
        self.records.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// `idem-cli release --force` of every record.
    fn release_everything_by_hand(&self) {
        if let Ok(mut records) = self.records.lock() {
            *records = MemoryStore::new();
        }
    }
}

impl IdempotencyStore for Operated {
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<ReserveOutcome, StoreError> {
        let store = self.store();
        let outcome = store.reserve(scope, fingerprint, lease).await;
        let hold = self.hold.lock().ok().and_then(|mut h| h.take());
        if let Some((answered, resume)) = hold {
            answered.notify_one();
            resume.notified().await;
        }
        outcome
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: &ReservationToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<WriteOutcome, StoreError> {
        self.store().complete(scope, token, response, ttl).await
    }

    async fn release(
        &self,
        scope: &Scope,
        token: &ReservationToken,
    ) -> Result<WriteOutcome, StoreError> {
        self.store().release(scope, token).await
    }

    async fn purge_expired(&self, grace: Duration) -> Result<u64, StoreError> {
        self.store().purge_expired(grace).await
    }
}

/// `CachedStore::clear` is documented as the way to make a hand release of completed records
/// take effect at once ("Drop every cached entry (e.g. after releasing completed records by
/// hand)"). A replay that read the record from the store before the release, and whose answer
/// arrives after `clear`, puts the released record back into the cache: for up to `max_ttl`
/// (60 s) every retry of the key is answered with the old response although the store holds
/// no record and would run the request.
#[tokio::test]
async fn clear_after_a_release_by_hand_is_not_undone_by_a_replay_in_flight() {
    let operated = Operated::default();
    let cached = CachedStore::new(operated.clone());
    let k = scope("pay-1");

    // The payment runs and its response is stored.
    let Ok(ReserveOutcome::Reserved { token }) = cached.reserve(&k, &FP, MINUTE).await else {
        panic!("not reserved");
    };
    let stored = cached.complete(&k, &token, &response(), DAY).await;
    assert_eq!(stored.ok(), Some(WriteOutcome::Applied));

    // A retry is on its way: the store has answered with the record, the answer not yet back.
    let answered = Arc::new(Notify::new());
    let resume = Arc::new(Notify::new());
    if let Ok(mut hold) = operated.hold.lock() {
        *hold = Some((Arc::clone(&answered), Arc::clone(&resume)));
    }
    let retry = tokio::spawn({
        let cached = cached.clone();
        let k = k.clone();
        async move { cached.reserve(&k, &FP, MINUTE).await }
    });
    answered.notified().await;

    // Meanwhile the operator releases the record by hand and clears the cache, as documented.
    operated.release_everything_by_hand();
    cached.clear();
    assert!(cached.is_empty());
    resume.notify_one();

    // The retry that was already in flight answers with what it read (fine: it read first).
    let in_flight = retry.await.expect("retry task");
    assert!(
        matches!(in_flight, Ok(ReserveOutcome::Completed { .. })),
        "{in_flight:?}"
    );

    // The store holds nothing for the key now: the next request must be run (Reserved), not
    // answered with the released record from a cache that was cleared after the release.
    let next = cached.reserve(&k, &FP, MINUTE).await;
    assert!(
        matches!(next, Ok(ReserveOutcome::Reserved { .. })),
        "after release + clear(), the cache still replays the released record \
         (entries: {}): {next:?}",
        cached.len()
    );
}

/// Review, 2026-12-04: after a forced release of a completed record, the client's new request
/// with the same key (another body) ran on another instance and was stored; its retry on an
/// instance that had cached the old record was answered from that entry: 422
/// `FINGERPRINT_MISMATCH`, its key "used for another request", although the store would
/// replay its own response. A cached entry of another fingerprint now defers to the store.
#[tokio::test]
async fn a_key_reused_after_a_forced_release_is_not_refused_by_an_old_entry() {
    const NEW: Fingerprint = Fingerprint([0x22; 32]);
    let operated = Operated::default();
    let a = CachedStore::new(operated.clone());
    let b = CachedStore::new(operated.clone());
    let k = scope("pay-2");

    let Ok(ReserveOutcome::Reserved { token }) = a.reserve(&k, &FP, MINUTE).await else {
        panic!("not reserved");
    };
    let stored = a.complete(&k, &token, &response(), DAY).await;
    assert_eq!(stored.ok(), Some(WriteOutcome::Applied));
    let replay = a.reserve(&k, &FP, MINUTE).await;
    assert!(matches!(replay, Ok(ReserveOutcome::Completed { .. })));
    assert_eq!(a.len(), 1, "instance A cached the record");

    // The operator releases it; the client's new request (another body) runs on B.
    operated.release_everything_by_hand();
    let Ok(ReserveOutcome::Reserved { token }) = b.reserve(&k, &NEW, MINUTE).await else {
        panic!("the new request was not reserved");
    };
    let second = StoredResponse {
        body: Bytes::from_static(b"payment 2"),
        ..response()
    };
    let stored = b.complete(&k, &token, &second, DAY).await;
    assert_eq!(stored.ok(), Some(WriteOutcome::Applied));

    // Its retry lands on A: the store's answer (its own response), not A's old entry.
    match a.reserve(&k, &NEW, MINUTE).await {
        Ok(ReserveOutcome::Completed {
            fingerprint,
            response,
            ..
        }) => {
            assert_eq!(
                fingerprint, NEW,
                "answered from the released record's entry"
            );
            assert_eq!(&response.body[..], b"payment 2");
        }
        other => panic!("{other:?}"),
    }
    // And A now holds the record the store holds: the old request's retry gets a 422.
    match a.reserve(&k, &FP, MINUTE).await {
        Ok(ReserveOutcome::Completed { fingerprint, .. }) => assert_eq!(fingerprint, NEW),
        other => panic!("{other:?}"),
    }
}
