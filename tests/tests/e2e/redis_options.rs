//! `RedisStore`'s builder options against real `redis-server` processes (one per test, plus a
//! real replica where `WAIT` needs one): `wait_for_replicas` with and without a replica that
//! acknowledges, lease renewals that wait for none, a custom prefix, connect failures that
//! name no password, and the timeouts.

use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::redis::{record, RedisStore};
use idempotency_actix::store::{
    IdempotencyStore, ReserveOutcome, Scope, StoreError, StoredResponse, WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::redis_server::{command_calls, connection as conn, replica_of, RedisServer};

const FP: Fingerprint = Fingerprint([0xAA; 32]);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "acct_1".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(b"paid"),
    }
}

async fn exists(url: &str, key: &str) -> bool {
    let mut conn = conn(url).await;
    let n: i64 = redis::cmd("EXISTS")
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("EXISTS");
    n == 1
}

/// With a replica that acknowledges, `WAIT` succeeds after the reservation and the completion:
/// the record is on the replica before the handler runs and before the response is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_with_a_replica() {
    let primary = RedisServer::start();
    let replica = replica_of(&primary).await;
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_secs(5))
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("wait-ok");
    let token = match store.reserve(&s, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    // WAIT returned, so the replica has the reservation already.
    assert!(exists(&replica.url(), &store.key_of(&s)).await);
    assert_eq!(
        store.complete(&s, &token, &response(), TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    let mut replica_conn = conn(&replica.url()).await;
    let value: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.key_of(&s))
        .query_async(&mut replica_conn)
        .await
        .expect("GET on the replica");
    let body = match value.map(|v| record::decode(v.into())) {
        Some(Ok(record::Record {
            state: record::State::Completed { response, .. },
            ..
        })) => Some(response.body.to_vec()),
        _ => None,
    };
    assert_eq!(body, Some(b"paid".to_vec()), "completed on the replica");
}

/// Without a replica, `WAIT` times out: the reservation is given back and the call fails as
/// unavailable (503 before the handler), so no handler runs on a record a failover could lose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_without_a_replica_refuses_the_reservation() {
    let primary = RedisServer::start();
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_millis(100))
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("wait-missing");
    match store.reserve(&s, &FP, LEASE).await {
        Err(StoreError::Unavailable(e)) => {
            assert!(e.to_string().contains("1 Redis replica"), "{e}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        !exists(&primary.url(), &store.key_of(&s)).await,
        "the unacknowledged reservation was released"
    );
    // Zero replicas turns the option off again: the same key reserves at once.
    let plain = RedisStore::builder()
        .wait_for_replicas(0, Duration::from_millis(100))
        .connect(&primary.url())
        .await
        .expect("connect");
    assert!(matches!(
        plain.reserve(&s, &FP, LEASE).await,
        Ok(ReserveOutcome::Reserved { .. })
    ));
}

/// A primary demoted while a `WAIT` blocks answers it `-UNBLOCKED`: a failover in progress, so
/// the store is unavailable (503, the reservation given back), not broken (review, 2026-12-06:
/// it was a `Backend` error, mislabelled in logs and metrics).
#[tokio::test]
async fn a_wait_cut_short_by_a_demotion_is_unavailable() {
    let primary = RedisServer::start();
    let other = RedisServer::start();
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_secs(10))
        .connect(&primary.url())
        .await
        .expect("connect");
    let demote = {
        let (port, other) = (primary.port().to_string(), other.port().to_string());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let out = tokio::process::Command::new("redis-cli")
                .args(["-p", &port, "REPLICAOF", "127.0.0.1", &other])
                .output()
                .await
                .expect("redis-cli");
            assert!(out.status.success(), "{out:?}");
        })
    };
    let answered = store.reserve(&scope("demoted"), &FP, LEASE).await;
    demote.await.expect("demoted");
    match answered {
        Err(StoreError::Unavailable(e)) => assert!(e.to_string().contains("UNBLOCKED"), "{e}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// A lease renewal sends no `WAIT`, even with `wait_for_replicas`: losing one in a failover
/// only brings back the lease as it was before it. So with no replica up it still applies at
/// once, where a reservation or a completion would wait out the timeout and fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_waits_for_no_replica() {
    let primary = RedisServer::start();
    let plain = RedisStore::connect(&primary.url()).await.expect("connect");
    let waiting = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_secs(5))
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("renew-no-wait");
    let token = match plain.reserve(&s, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    let mut stats = conn(&primary.url()).await;
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut stats)
        .await
        .expect("RESETSTAT");
    let started = Instant::now();
    assert_eq!(
        waiting.renew_lease(&s, &token, LEASE).await.ok(),
        Some(WriteOutcome::Applied)
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the renewal waited {:?}",
        started.elapsed()
    );
    assert_eq!(command_calls(&mut stats, "wait").await, 0, "no WAIT");
}

/// A `WAIT` longer than the response timeout runs to its end: the connection's own timeout
/// used to cut it first, and the reservation was then neither acknowledged nor released (the key
/// stayed held for its lease: 409 on every retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_the_response_timeout_runs_to_its_end() {
    let primary = RedisServer::start();
    let store = RedisStore::builder()
        .response_timeout(Duration::from_millis(300))
        .wait_for_replicas(1, Duration::from_millis(900))
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("wait-long");
    let started = Instant::now();
    match store.reserve(&s, &FP, LEASE).await {
        Err(StoreError::Unavailable(e)) => {
            assert!(e.to_string().contains("1 Redis replica"), "{e}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "WAIT was cut after {:?}",
        started.elapsed()
    );
    assert!(
        !exists(&primary.url(), &store.key_of(&s)).await,
        "the unacknowledged reservation was released"
    );
    // Ordinary calls keep the short response timeout.
    assert!(store.check().await.is_ok());
}

/// Over a connection of the app's own whose response timeout cuts the `WAIT` short, the
/// reservation fails (503) and is still given back: Redis runs the release after the `WAIT`,
/// so the key is free for a retry instead of held for its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_cut_by_the_connection_still_releases_the_reservation() {
    let primary = RedisServer::start();
    let client = redis::Client::open(primary.url()).expect("test URL parses");
    // 500 ms, not less: the store's start-up checks (INFO, CONFIG GET) go over this
    // connection too, and with 200 ms one run failed there on a loaded machine (a build
    // alongside).
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Duration::from_millis(500));
    let short = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connect");
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_millis(1500))
        .with_connection(short)
        .await
        .expect("store");
    let s = scope("wait-cut");
    // Load the release script first: on a fresh server its NOSCRIPT reply would come behind
    // the WAIT too, be cut by the same timeout, and the release never sent again.
    let token = idempotency_actix::store::ReservationToken::random();
    assert_eq!(
        store.release(&scope("never-reserved"), &token).await.ok(),
        Some(WriteOutcome::Stale)
    );
    assert!(matches!(
        store.reserve(&s, &FP, LEASE).await,
        Err(StoreError::Unavailable(_))
    ));
    // The release went out behind the WAIT; Redis answers both once the WAIT times out.
    let deadline = Instant::now() + Duration::from_secs(5);
    while exists(&primary.url(), &store.key_of(&s)).await {
        assert!(
            Instant::now() < deadline,
            "the reservation was never given back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// No timeout makes a call panic or fail: `Duration::MAX` (an "as long as it takes" setting)
/// as the `WAIT` timeout used to overflow when the store added its response timeout to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_timeout_of_any_size_is_served() {
    let primary = RedisServer::start();
    let _replica = replica_of(&primary).await;
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::MAX)
        .response_timeout(Duration::MAX)
        .connection_timeout(Duration::MAX)
        .in_flight_grace(Duration::MAX)
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("wait-forever");
    let token = match store.reserve(&s, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    assert_eq!(
        store.complete(&s, &token, &response(), TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
}

/// Each `WAIT` holds its connection until it is answered (Redis answers a connection's
/// commands in order), so over one connection four reservations waiting for a missing replica
/// take four timeouts; over four connections (`connections(4)`; eight by default with
/// `wait_for_replicas`) they overlap and take about one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_overlap_over_several_connections() {
    let primary = RedisServer::start();
    const WAIT: Duration = Duration::from_millis(500);
    for (connections, at_least, below) in
        [(1, WAIT * 4, Duration::from_secs(60)), (4, WAIT, WAIT * 3)]
    {
        let store = RedisStore::builder()
            .connections(connections)
            .wait_for_replicas(1, WAIT)
            .connect(&primary.url())
            .await
            .expect("connect");
        let started = Instant::now();
        let calls = (0..4).map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let s = scope(&format!("overlap-{connections}-{i}"));
                matches!(
                    store.reserve(&s, &FP, LEASE).await,
                    Err(StoreError::Unavailable(_))
                )
            })
        });
        for call in futures_util::future::join_all(calls).await {
            assert!(
                call.expect("task"),
                "no replica: each reservation is refused"
            );
        }
        let took = started.elapsed();
        assert!(
            took >= at_least && took < below,
            "{connections} connection(s): four WAITs took {took:?}"
        );
    }
}

/// A completion the replica does not acknowledge (the replica died after the reservation) is
/// stored on the primary and still fails, so the middleware retries it (C16): the retry by the
/// same token is applied again, and once a replica is back its `WAIT` succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacknowledged_completion_fails_and_its_retry_succeeds_once_a_replica_is_back() {
    let primary = RedisServer::start();
    let mut replica = replica_of(&primary).await;
    let store = RedisStore::builder()
        // Long enough for a live replica to acknowledge on a loaded CI machine (200 ms was
        // not, once), and longer than the response timeout: the dead replica's WAIT must run
        // to its end, not be cut by the connection.
        .response_timeout(Duration::from_millis(500))
        .wait_for_replicas(1, Duration::from_secs(1))
        .connect(&primary.url())
        .await
        .expect("connect");
    let s = scope("wait-lost-replica");
    let token = match store.reserve(&s, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved, got {other:?}"),
    };
    replica.kill();
    match store.complete(&s, &token, &response(), TTL).await {
        Err(StoreError::Unavailable(e)) => {
            assert!(e.to_string().contains("stored, but did not reach 1"), "{e}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // Stored on the primary all the same: a retry of the request replays.
    match store.reserve(&s, &FP, LEASE).await {
        Ok(ReserveOutcome::Completed { response, .. }) => assert_eq!(&response.body[..], b"paid"),
        other => panic!("expected the stored response, got {other:?}"),
    }
    // The replica comes back (empty, it resyncs): the middleware's next retry is applied
    // again and acknowledged.
    replica.restart();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match store.complete(&s, &token, &response(), TTL).await {
            Ok(WriteOutcome::Applied) => break,
            Err(StoreError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("expected the retry to be acknowledged, got {other:?}"),
        }
    }
    assert!(exists(&replica.url(), &store.key_of(&s)).await);
}

/// A custom prefix is used for every record key, and an unsafe one is refused at connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_prefix_and_timeouts() {
    let redis = RedisServer::start();
    let store = RedisStore::builder()
        .key_prefix("shop-a:")
        .connection_timeout(Duration::from_secs(1))
        .response_timeout(Duration::from_secs(1))
        .in_flight_grace(Duration::from_secs(5))
        .connect(&redis.url())
        .await
        .expect("connect");
    assert_eq!(store.key_prefix(), "shop-a:");
    let s = scope("prefixed");
    assert!(store.key_of(&s).starts_with("shop-a:"));
    assert!(matches!(
        store.reserve(&s, &FP, LEASE).await,
        Ok(ReserveOutcome::Reserved { .. })
    ));
    assert!(exists(&redis.url(), &store.key_of(&s)).await);
    assert!(store.check().await.is_ok());
}

/// Connect failures are errors, never panics, and never show the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_name_no_password() {
    match RedisStore::connect("mysql://user:HUNTER2@host/1").await {
        Err(StoreError::Backend(e)) => {
            let shown = e.to_string();
            assert!(shown.contains("invalid Redis URL"), "{shown}");
            assert!(!shown.contains("HUNTER2"), "{shown}");
        }
        other => panic!("expected Backend, got {other:?}"),
    }
    // A port nobody listens on: unavailable, within the connection timeout.
    let port = idempotency_e2e::raw_http::free_port();
    let started = Instant::now();
    let result = RedisStore::builder()
        .connection_timeout(Duration::from_millis(300))
        .connect(&format!("redis://:HUNTER2@127.0.0.1:{port}/"))
        .await;
    match result {
        Err(StoreError::Unavailable(e)) => {
            assert!(!e.to_string().contains("HUNTER2"), "{e}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// `wait_for_replicas` after a failover (review, 2026-12-06): the cluster client resends the
/// reservation's `GETRANGE` + `WAIT` to the promoted replica, where another request has
/// reserved the key meanwhile. The reserve read that request's reservation, so it must answer
/// in flight (409, or 422 for another body), never a bare `Unavailable`, which `fail_open` may
/// run past (C15), beside a request that may be running. Here a proxy holds the `GETRANGE`
/// back while the key is overwritten with another request's reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_finds_another_requests_reservation_answers_in_flight() {
    use idempotency_actix::store::ReservationToken;
    use idempotency_e2e::proxy::{delaying_proxy, Hold};
    use std::sync::atomic::Ordering;

    let primary = RedisServer::start();
    let upstream = primary
        .url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    let (port, armed) = delaying_proxy(
        upstream,
        Hold::Statement,
        b"GETRANGE",
        Duration::from_millis(800),
    )
    .await;
    let store = RedisStore::builder()
        .wait_for_replicas(1, Duration::from_millis(100))
        .connect(&format!("redis://127.0.0.1:{port}"))
        .await
        .expect("connect");
    let s = scope("wait-elsewhere");
    armed.store(true, Ordering::SeqCst);
    let reserving = {
        let (store, s) = (store.clone(), s.clone());
        tokio::spawn(async move { store.reserve(&s, &FP, LEASE).await })
    };
    // The reservation is written; its `GETRANGE` + `WAIT` is held by the proxy. Another
    // request's reservation takes the key's place (as on a promoted replica).
    let key = store.key_of(&s);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !exists(&primary.url(), &key).await {
        assert!(
            Instant::now() < deadline,
            "the reservation was never written"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let other = Fingerprint([0xBB; 32]);
    let theirs = record::in_flight(&other, &ReservationToken::random(), 0, 60_000_000, 0);
    let mut side = conn(&primary.url()).await;
    let () = redis::cmd("SET")
        .arg(&key)
        .arg(theirs)
        .query_async(&mut side)
        .await
        .expect("SET");
    match reserving.await.expect("the reserve task") {
        Ok(ReserveOutcome::InFlight { fingerprint, .. }) => assert_eq!(fingerprint, other),
        other => panic!("a reserve that read another's reservation answered {other:?}"),
    }
    assert!(
        exists(&primary.url(), &key).await,
        "the other's reservation stays"
    );
}
