//! What the Redis store writes to the log at connect and in its readiness check, read back
//! through a capturing subscriber: C22's "warn" half (an evicting `maxmemory-policy` is
//! refused only when asked to; by default the store connects and must say why that is unsafe).
//!
//! A binary of its own, with one global subscriber set before anything logs: `tracing`
//! decides once per call site, for the whole process, whether it is enabled, against the
//! subscriber of whichever thread reaches it first, so a log-reading test that shares a binary
//! with tests that run the store without a subscriber can lose its lines
//! (`idempotency-actix/tests/logs.rs` has the story).

use std::sync::OnceLock;

use idempotency_actix::store::redis::redis;
use idempotency_actix::store::RedisStore;
use idempotency_e2e::redis_server::{connection, RedisServer};

// Shared with the library's own log tests (see the file's docs).
#[allow(dead_code)]
#[path = "../../idempotency-actix/tests/support/captured.rs"]
mod captured;
use captured::Captured;

/// Everything logged in this process (warn and above), from the first call on.
fn logs() -> &'static Captured {
    static LOGS: OnceLock<Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        logs
    })
}

/// The log lines written since `from` bytes.
fn since(from: usize) -> String {
    logs().text_from(from)
}

fn mark() -> usize {
    logs().written()
}

/// C22, default (`EvictionCheck::Warn`): an evicting policy connects, with one warning that
/// names the policy and the cure; `noeviction` connects silently; a policy changed to an
/// evicting one after connect is warned about by the readiness check.
#[tokio::test]
async fn an_evicting_policy_is_warned_about_at_connect_and_in_the_readiness_check() {
    let start = mark();
    let lru = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let store = RedisStore::connect(&lru.url()).await;
    assert!(store.is_ok(), "Warn connects: {:?}", store.err());
    let text = since(start);
    let warned: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("maxmemory-policy"))
        .collect();
    assert_eq!(warned.len(), 1, "{text}");
    for part in [
        "WARN",
        "\"allkeys-lru\"",
        "noeviction",
        "run its handler again",
    ] {
        assert!(warned[0].contains(part), "{part:?} not in {text}");
    }

    let start = mark();
    let safe = RedisServer::start();
    let store = RedisStore::connect(&safe.url())
        .await
        .expect("noeviction connects");
    assert!(store.check().await.is_ok());
    let quiet = since(start);
    assert!(!quiet.contains("maxmemory-policy"), "{quiet}");

    let start = mark();
    let mut admin = connection(&safe.url()).await;
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");
    assert!(store.check().await.is_ok(), "Warn only warns");
    let text = since(start);
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains("\"volatile-lru\"")),
        "{text}"
    );
}
