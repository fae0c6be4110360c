//! Helpers shared by the memory store's test binaries (`memory_store.rs`, `logs.rs`): a scope,
//! two fingerprints, and a reservation and a response made in one line.

use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, MemoryStore, ReservationToken, ReserveOutcome, Scope,
    StoredResponse,
};

/// The scope of `key` (tenant `t`, `POST /pay`).
pub fn scope(key: &str) -> Scope {
    Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/pay".into(),
        key: key.into(),
    }
}

pub const FP_A: Fingerprint = Fingerprint([0xAA; 32]);
pub const FP_B: Fingerprint = Fingerprint([0xBB; 32]);
pub const MINUTE: Duration = Duration::from_secs(60);

/// Reserve `key`; panics unless the store answers `Reserved`.
pub async fn reserved(
    store: &MemoryStore,
    key: &str,
    fp: &Fingerprint,
    lease: Duration,
) -> ReservationToken {
    match store.reserve(&scope(key), fp, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved for {key}, got {other:?}"),
    }
}

/// A 201 `text/plain` response with `body`.
pub fn small(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(body),
    }
}
