//! CachedStore over MemoryStore under real concurrency: a replay from the cache never
//! outlives the wrapped record, never answers another body, and `clear()` is never undone.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_actix::store::{
    CachedStore, Fingerprint, IdempotencyStore, MemoryStore, ReserveOutcome, Scope, StoredResponse,
    WriteOutcome,
};

fn scope(k: u64) -> Scope {
    Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/p".into(),
        key: format!("k{k}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cached_replays_never_outlive_or_cross_records() {
    let inner = MemoryStore::builder().max_bytes(usize::MAX).build();
    let cached = CachedStore::new(inner.clone());
    let serial = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..6u64 {
        let (cached, inner, serial, stop) =
            (cached.clone(), inner.clone(), serial.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut x = w + 1;
            let deadline = Instant::now() + Duration::from_secs(4);
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let k = x % 4;
                let fp = Fingerprint([(x >> 8) as u8 % 2; 32]);
                let s = scope(k);
                let call_start = Instant::now();
                match cached.reserve(&s, &fp, Duration::from_secs(5)).await {
                    Ok(ReserveOutcome::Reserved { token }) => {
                        let n = serial.fetch_add(1, Ordering::SeqCst);
                        let mut body = vec![fp.0[0]];
                        body.extend_from_slice(&n.to_le_bytes());
                        let r = StoredResponse {
                            status: 201,
                            headers: vec![],
                            body: Bytes::from(body),
                        };
                        let ttl = Duration::from_millis(1 + x % 15);
                        assert_eq!(
                            cached.complete(&s, &token, &r, ttl).await.ok(),
                            Some(WriteOutcome::Applied)
                        );
                    }
                    Ok(ReserveOutcome::Completed {
                        fingerprint,
                        response,
                        expires_in,
                    }) => {
                        assert_eq!(
                            response.body[0], fingerprint.0[0],
                            "response of another body"
                        );
                        // The record must still be in the wrapped store with this very response
                        // (unless its time is about up).
                        let left = expires_in.unwrap();
                        if left > Duration::from_millis(3) {
                            let got = inner
                                .reserve(&s, &fingerprint, Duration::from_secs(5))
                                .await;
                            // Only meaningful if the store's own clock reading was inside the
                            // promised window (a descheduled task may look too late).
                            if Instant::now() >= call_start + left {
                                continue;
                            }
                            match got {
                                Ok(ReserveOutcome::Completed { response: r2, .. }) => {
                                    assert_eq!(
                                        r2.body, response.body,
                                        "the cache answered a record the store replaced"
                                    );
                                }
                                other => {
                                    stop.store(true, Ordering::Relaxed);
                                    panic!("cache replayed {left:?} left, store says {other:?}")
                                }
                            }
                        }
                    }
                    Ok(ReserveOutcome::InFlight { .. }) => tokio::task::yield_now().await,
                    Err(e) => panic!("{e}"),
                }
                if x % 97 == 0 {
                    cached.clear();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}
