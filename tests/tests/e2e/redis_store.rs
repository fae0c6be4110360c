//! `RedisStore` against a real `redis-server` (one per test, on a free loopback port, killed on
//! drop): the store conformance suite, Redis's own expiry instead of purge, key encoding,
//! one round trip per operation, script reloading, faults and the eviction-policy check.

use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::conformance;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::redis::{parse_record_key, record_key, EvictionCheck, RedisStore};
use idempotency_actix::store::{
    IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
    WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::redis_server::{command_calls, RedisServer};

const FP_A: Fingerprint = Fingerprint([0xAA; 32]);
const FP_B: Fingerprint = Fingerprint([0xBB; 32]);
const FP_Z: Fingerprint = Fingerprint([0xEE; 32]);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

/// `POST /payments` with `key` in `tenant` (the Redis modules of this binary share it).
pub(super) fn scope(tenant: &str, key: &str) -> Scope {
    Scope {
        tenant: tenant.into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("x-raw".into(), Bytes::from_static(&[0xff, 0, b'\r']))],
        body: Bytes::from_static(body),
    }
}

async fn store(redis: &RedisServer) -> RedisStore {
    match RedisStore::connect(&redis.url()).await {
        Ok(store) => store,
        Err(e) => panic!("connect to {}: {e}", redis.url()),
    }
}

async fn redis_conn(redis: &RedisServer) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(redis.url()).expect("test URL parses");
    client
        .get_multiplexed_async_connection()
        .await
        .expect("test redis-server accepts connections")
}

/// C26: the whole store conformance suite, on a store with the default 24 h grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_conforms() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    conformance::run_all(&store).await;
}

async fn reset_stats(conn: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .expect("RESETSTAT");
}

/// C26 without a script where none is needed: a miss reserves with one native `SET NX GET`
/// (and `TIME`, pipelined), a replay is the same two native commands, byte-exact and with the
/// record's remaining TTL; only a live reservation (a concurrent duplicate) goes on to the
/// reserve script.
#[tokio::test]
async fn misses_and_replays_use_native_commands_only() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut conn = redis_conn(&redis).await;
    let s = scope("t", "native");
    let stored = response(b"\x00body\xff");

    reset_stats(&mut conn).await;
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    assert_eq!(command_calls(&mut conn, "set").await, 1);
    assert_eq!(command_calls(&mut conn, "time").await, 1);
    assert_eq!(command_calls(&mut conn, "evalsha").await, 0, "no script");
    store
        .complete(&s, &token, &stored, TTL)
        .await
        .expect("complete");

    reset_stats(&mut conn).await;
    match store.reserve(&s, &FP_B, LEASE).await {
        Ok(ReserveOutcome::Completed {
            fingerprint,
            response,
            expires_in,
        }) => {
            assert_eq!(
                fingerprint, FP_A,
                "the stored fingerprint, not the caller's"
            );
            assert_eq!(response, stored);
            let left = expires_in.expect("remaining TTL");
            assert!(
                left <= TTL && left > TTL - Duration::from_secs(60),
                "{left:?}"
            );
        }
        other => panic!("expected the replay, got {other:?}"),
    }
    assert_eq!(command_calls(&mut conn, "set").await, 1);
    assert_eq!(command_calls(&mut conn, "time").await, 1);
    assert_eq!(command_calls(&mut conn, "evalsha").await, 0, "no script");

    // A live reservation: the script decides (it may not be taken over).
    let busy = scope("t", "busy");
    reserved(&store, &busy, &FP_A, LEASE).await;
    // Once to load the script (a first EVALSHA answers NOSCRIPT), then counted.
    let _ = store.reserve(&busy, &FP_A, LEASE).await;
    reset_stats(&mut conn).await;
    assert!(matches!(
        store.reserve(&busy, &FP_A, LEASE).await,
        Ok(ReserveOutcome::InFlight { .. })
    ));
    assert_eq!(command_calls(&mut conn, "evalsha").await, 1);
}

/// C12 without purge: Redis drops an expired completed record and, after lease + grace, a dead
/// reservation by itself; `purge_expired` has nothing to do.
#[tokio::test]
async fn expiry_replaces_purge() {
    let redis = RedisServer::start();
    let store = RedisStore::builder()
        .in_flight_grace(Duration::from_millis(200))
        .connect(&redis.url())
        .await
        .expect("connect");
    let short = Duration::from_millis(200);
    let done = scope("t", "done");
    let dead = scope("t", "dead");
    let live = scope("t", "live");
    let token = reserved(&store, &done, &FP_A, LEASE).await;
    assert_eq!(
        store
            .complete(&done, &token, &response(b"d"), short)
            .await
            .ok(),
        Some(WriteOutcome::Applied)
    );
    reserved(&store, &dead, &FP_A, short).await;
    reserved(&store, &live, &FP_A, LEASE).await;
    let mut conn = redis_conn(&redis).await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(store.key_of(&dead))
        .query_async(&mut conn)
        .await
        .expect("PTTL");
    assert!(
        pttl > 200 && pttl <= 400,
        "a reservation lives lease + grace (400 ms), PTTL {pttl}"
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(store.purge_expired(Duration::ZERO).await.ok(), Some(0));
    for gone in [&done, &dead] {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(store.key_of(gone))
            .query_async(&mut conn)
            .await
            .expect("EXISTS");
        assert_eq!(exists, 0, "{gone:?} should have expired in Redis");
    }
    reserved(&store, &dead, &FP_B, LEASE).await;
    assert!(matches!(
        store.reserve(&live, &FP_B, LEASE).await,
        Ok(ReserveOutcome::InFlight { .. })
    ));
}

/// C9 with the default 24 h grace: after its lease an ended reservation still refuses another
/// body, and its holder's late `complete` applies (as in PostgreSQL) until a takeover.
#[tokio::test]
async fn ended_reservation_refuses_other_body_and_accepts_late_complete() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let s = scope("t", "late");
    let token = reserved(&store, &s, &FP_A, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    match store.reserve(&s, &FP_B, LEASE).await {
        Ok(ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining,
        }) => {
            assert_eq!(fingerprint, FP_A);
            assert_eq!(lease_remaining, Duration::ZERO);
        }
        other => panic!("another body must see the ended reservation, got {other:?}"),
    }
    let late = response(b"late but mine");
    assert_eq!(
        store.complete(&s, &token, &late, TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    match store.reserve(&s, &FP_A, LEASE).await {
        Ok(ReserveOutcome::Completed {
            response,
            expires_in,
            ..
        }) => {
            assert_eq!(response, late);
            let left = expires_in.expect("Redis reports the time left");
            assert!(
                left > TTL - Duration::from_secs(5) && left <= TTL,
                "{left:?}"
            );
        }
        other => panic!("expected the late completion, got {other:?}"),
    }
}

/// The key's remaining life in milliseconds.
async fn pttl(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(conn)
        .await
        .expect("PTTL")
}

/// The record's bytes.
async fn raw_record(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Vec<u8> {
    redis::cmd("GET")
        .arg(key)
        .query_async(conn)
        .await
        .expect("GET")
}

/// C9 on Redis: a renewal moves the key's expiry and nothing else. The key lives the new lease
/// plus the grace from Redis's now (so the lease left, `PTTL` less grace, is the renewed one),
/// the record's bytes are untouched, a stale token's renewal leaves the expiry as it was, and
/// a `Duration::MAX` lease is bounded as reserve bounds it (about 100 years) instead of
/// failing or overflowing in the script.
#[tokio::test]
async fn a_renewal_moves_the_keys_expiry_and_nothing_else() {
    let redis = RedisServer::start();
    let grace = Duration::from_secs(3600);
    let store = RedisStore::builder()
        .in_flight_grace(grace)
        .connect(&redis.url())
        .await
        .expect("connect");
    let mut conn = redis_conn(&redis).await;
    let s = scope("t", "renewed");
    let key = store.key_of(&s);
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let token = reserved(&store, &s, &FP_A, Duration::from_secs(1)).await;
    let before = raw_record(&mut conn, &key).await;
    assert!(pttl(&mut conn, &key).await <= ms(Duration::from_secs(1) + grace));

    assert_eq!(
        store.renew_lease(&s, &token, LEASE).await.ok(),
        Some(WriteOutcome::Applied)
    );
    let life = pttl(&mut conn, &key).await;
    assert!(
        life <= ms(LEASE + grace) && life > ms(LEASE + grace - Duration::from_secs(5)),
        "the key lives lease + grace from now: {life} ms"
    );
    assert_eq!(raw_record(&mut conn, &key).await, before, "bytes untouched");
    match store.reserve(&s, &FP_A, LEASE).await {
        Ok(ReserveOutcome::InFlight {
            lease_remaining, ..
        }) => assert!(
            lease_remaining <= LEASE && lease_remaining > LEASE - Duration::from_secs(5),
            "{lease_remaining:?}"
        ),
        other => panic!("expected the renewed reservation, got {other:?}"),
    }

    // A foreign token: stale, and the expiry is not moved (a longer lease would show).
    assert_eq!(
        store
            .renew_lease(&s, &ReservationToken::random(), 10 * LEASE)
            .await
            .ok(),
        Some(WriteOutcome::Stale)
    );
    assert!(pttl(&mut conn, &key).await <= ms(LEASE + grace));

    // "For ever": about 100 years, like a reserve with `Duration::MAX`.
    let century = Duration::from_secs(100 * 365 * 24 * 3600);
    assert_eq!(
        store.renew_lease(&s, &token, Duration::MAX).await.ok(),
        Some(WriteOutcome::Applied)
    );
    assert!(pttl(&mut conn, &key).await > ms(century));
    match store.reserve(&s, &FP_A, LEASE).await {
        Ok(ReserveOutcome::InFlight {
            lease_remaining, ..
        }) => assert!(
            lease_remaining <= century && lease_remaining > century - Duration::from_secs(60),
            "{lease_remaining:?}"
        ),
        other => panic!("expected the renewed reservation, got {other:?}"),
    }
    assert_eq!(raw_record(&mut conn, &key).await, before, "bytes untouched");
    // And it still completes.
    assert_eq!(
        store
            .complete(&s, &token, &response(b"at last"), TTL)
            .await
            .ok(),
        Some(WriteOutcome::Applied)
    );
}

/// A second `complete` by the token that completed the record answers `Applied` and changes
/// nothing (a retry after a lost reply or an unacknowledged `WAIT` is not a takeover); after a
/// takeover the old token stays stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_complete_by_its_token_is_applied_and_changes_nothing() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let s = scope("t", "again");
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    let first = response(b"first");
    for (attempt, body) in [(1, &first), (2, &response(b"second"))] {
        assert_eq!(
            store.complete(&s, &token, body, TTL).await.ok(),
            Some(WriteOutcome::Applied),
            "attempt {attempt}"
        );
    }
    match store.reserve(&s, &FP_A, LEASE).await {
        Ok(ReserveOutcome::Completed { response, .. }) => assert_eq!(response, first),
        other => panic!("expected the first response, got {other:?}"),
    }
    // A takeover (here: the completed record expired and a new request reserved) fences the
    // old token out again.
    let short = scope("t", "again-expired");
    let old = reserved(&store, &short, &FP_A, LEASE).await;
    assert_eq!(
        store
            .complete(&short, &old, &first, Duration::from_millis(50))
            .await
            .ok(),
        Some(WriteOutcome::Applied)
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    let _new = reserved(&store, &short, &FP_A, LEASE).await;
    assert_eq!(
        store.complete(&short, &old, &first, TTL).await.ok(),
        Some(WriteOutcome::Stale)
    );
}

/// Keys: no Cluster hash tag or glob character whatever the scope holds, no two scopes share a
/// key, and the CLI can read the scope back.
#[test]
fn record_keys_are_cluster_and_scan_safe_and_reversible() {
    let hostile = [
        scope("{tenant}", "k"),
        scope("a:b", "c"),
        scope("a", "b:c"),
        scope("*", "?[x]\\"),
        scope("", "%41"),
        scope("ténant ✓", "key with spaces\n"),
        Scope {
            tenant: "t".into(),
            method: "PATCH".into(),
            path: "/a/{b}/*".into(),
            key: String::new(),
        },
    ];
    let mut seen = std::collections::HashSet::new();
    for s in &hostile {
        let key = record_key("idem:", s);
        assert!(
            !key.contains(['{', '}', '*', '?', '[', ']', '\\', ' ', '\n']),
            "{key}"
        );
        assert!(seen.insert(key.clone()), "collision on {key}");
        assert_eq!(parse_record_key("idem:", key.as_bytes()).as_ref(), Some(s));
    }
    assert_eq!(
        record_key("idem:", &scope("acme", "order-42")),
        "idem:acme:POST:/payments:order-42"
    );
    assert_eq!(parse_record_key("idem:", b"idem:a:b:c"), None);
    assert_eq!(parse_record_key("other:", b"idem:a:b:c:d"), None);
    assert_eq!(parse_record_key("idem:", b"idem:a:b:c:d:e"), None);
}

/// A prefix that would break Cluster slots or SCAN patterns is refused, and so is one that
/// does not end with `:` (`idem:a` with tenant `b` would write where `idem:` with tenant `ab`
/// does).
#[tokio::test]
async fn unsafe_prefix_is_refused() {
    let redis = RedisServer::start();
    for prefix in ["", "{app}:", "app*:", "a b:", "idem", "idem:a", "app-"] {
        let result = RedisStore::builder()
            .key_prefix(prefix)
            .connect(&redis.url())
            .await;
        assert!(
            matches!(result, Err(StoreError::Backend(_))),
            "prefix {prefix:?}"
        );
    }
}

/// Two apps on one server, one prefix inside the other's (`idem:` and `idem:x:`): neither sees
/// the other's records, and a purge by either (the outer's `SCAN idem:*` also finds
/// `idem:x:...`, the inner's `SCAN idem:x:*` finds the outer's tenant `x`) deletes only its own
/// ended reservations. Failed before the purge skipped keys that are not its own records: the
/// outer store deleted the inner one's ended reservations with its own grace.
#[tokio::test]
async fn stores_under_nested_prefixes_keep_to_their_own_records() {
    let redis = RedisServer::start();
    let connect = |prefix: &'static str| {
        let url = redis.url();
        async move {
            RedisStore::builder()
                .key_prefix(prefix)
                .connect(&url)
                .await
                .unwrap_or_else(|e| panic!("connect with prefix {prefix:?}: {e}"))
        }
    };
    let (outer, inner) = (connect("idem:").await, connect("idem:x:").await);
    // The outer store's tenant `x` comes closest to the inner store's keys.
    let (s, x) = (scope("t", "k"), scope("x", "k"));
    let short = Duration::from_millis(100);
    for one in [&s, &x] {
        reserved(&inner, one, &FP_B, short).await;
        // Reserved: nothing of the inner store's is at the outer store's key.
        reserved(&outer, one, &FP_A, short).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Each store finds its own ended reservations, never the other's.
    for (store, mine, name) in [(&outer, FP_A, "idem:"), (&inner, FP_B, "idem:x:")] {
        for one in [&s, &x] {
            match store.reserve(one, &FP_Z, LEASE).await {
                Ok(ReserveOutcome::InFlight { fingerprint, .. }) => {
                    assert_eq!(fingerprint, mine, "{name} {one:?}")
                }
                other => panic!("{name} {one:?}: expected its own reservation, got {other:?}"),
            }
        }
    }

    let mut conn = redis_conn(&redis).await;
    assert_eq!(
        outer.purge_expired(Duration::ZERO).await.ok(),
        Some(2),
        "the outer store's own ended reservations only"
    );
    for one in [&s, &x] {
        let key = inner.key_of(one);
        assert!(
            key_exists(&mut conn, &key).await,
            "the outer purge deleted {key}"
        );
    }
    // And the other way round: an ended reservation of the outer store's tenant `x`.
    reserved(&outer, &x, &FP_A, short).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(inner.purge_expired(Duration::ZERO).await.ok(), Some(2));
    let key = outer.key_of(&x);
    assert!(
        key_exists(&mut conn, &key).await,
        "the inner purge deleted {key}"
    );
}

/// C26: reserve and a replay are one native `SET` each, complete, release and a lease renewal
/// one EVALSHA each (the scripts are loaded once), and a flushed script cache is reloaded
/// transparently (NOSCRIPT).
#[tokio::test]
async fn each_operation_is_one_command_and_noscript_reloads() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut conn = redis_conn(&redis).await;
    // Warm up: load the four scripts.
    let warm = scope("warm", "k");
    let t = reserved(&store, &warm, &FP_A, LEASE).await;
    store.release(&warm, &t).await.expect("release");
    let t = reserved(&store, &warm, &FP_A, LEASE).await;
    store.renew_lease(&warm, &t, LEASE).await.expect("renew");
    store
        .complete(&warm, &t, &response(b"w"), TTL)
        .await
        .expect("complete");
    reset_stats(&mut conn).await;

    let s = scope("t", "count");
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    assert_eq!(
        store.release(&s, &token).await.ok(),
        Some(WriteOutcome::Applied)
    );
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    assert_eq!(
        store.renew_lease(&s, &token, LEASE).await.ok(),
        Some(WriteOutcome::Applied)
    );
    assert_eq!(
        store.complete(&s, &token, &response(b"c"), TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    assert!(matches!(
        store.reserve(&s, &FP_A, LEASE).await,
        Ok(ReserveOutcome::Completed { .. })
    ));
    assert_eq!(
        command_calls(&mut conn, "evalsha").await,
        3,
        "a release, a renewal and a complete"
    );
    assert_eq!(
        command_calls(&mut conn, "pexpire").await,
        1,
        "the renewal's, inside its script"
    );
    // Two reserves and a replay; the scripts' own SETs count too (one, the complete's).
    assert_eq!(command_calls(&mut conn, "set").await, 4);
    for other in ["eval", "script|load", "ping", "multi", "exec", "watch"] {
        assert_eq!(
            command_calls(&mut conn, other).await,
            0,
            "unexpected {other}"
        );
    }

    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .expect("SCRIPT FLUSH");
    // The renew and complete scripts are reloaded on NOSCRIPT.
    let after = scope("t", "after-flush");
    let token = reserved(&store, &after, &FP_A, LEASE).await;
    assert_eq!(
        store.renew_lease(&after, &token, LEASE).await.ok(),
        Some(WriteOutcome::Applied)
    );
    assert_eq!(
        store
            .complete(&after, &token, &response(b"f"), TTL)
            .await
            .ok(),
        Some(WriteOutcome::Applied)
    );
}

/// C15: Redis down is `StoreError::Unavailable` within the timeout, not a hang; the store
/// reconnects by itself once Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_unavailable_and_the_store_recovers() {
    let mut redis = RedisServer::start();
    let store = RedisStore::builder()
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_millis(500))
        .connect(&redis.url())
        .await
        .expect("connect");
    reserved(&store, &scope("t", "before"), &FP_A, LEASE).await;
    redis.kill();
    let started = std::time::Instant::now();
    let result = store.reserve(&scope("t", "during"), &FP_A, LEASE).await;
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "got {result:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    redis.restart();
    let recovered = idempotency_e2e::eventually(Duration::from_secs(15), || async {
        matches!(
            store.reserve(&scope("t", "after"), &FP_A, LEASE).await,
            Ok(ReserveOutcome::Reserved { .. })
        )
    })
    .await;
    assert!(recovered, "the store must reconnect once Redis is back");
}

/// C22: a `maxmemory-policy` that may evict records is refused when asked to, and otherwise
/// only warned about; `noeviction` passes.
#[tokio::test]
async fn evicting_policy_is_detected() {
    let lru = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let refused = RedisStore::builder()
        .eviction_check(EvictionCheck::Refuse)
        .connect(&lru.url())
        .await;
    match refused {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("noeviction"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(
        RedisStore::connect(&lru.url()).await.is_ok(),
        "Warn connects"
    );
    let volatile = RedisServer::start_with(&["--maxmemory-policy", "volatile-ttl"]);
    assert!(RedisStore::builder()
        .eviction_check(EvictionCheck::Refuse)
        .connect(&volatile.url())
        .await
        .is_err());
    let safe = RedisServer::start();
    assert!(RedisStore::builder()
        .eviction_check(EvictionCheck::Refuse)
        .connect(&safe.url())
        .await
        .is_ok());
}

/// C22 after start: `check()` (the readiness probe) asks for the policy again, so a policy
/// changed while the app runs (by an operator, or a failover to a replica configured
/// otherwise) takes an instance that refuses evicting policies out of rotation.
#[tokio::test]
async fn a_policy_changed_after_connect_fails_the_readiness_check() {
    let server = RedisServer::start();
    let refusing = RedisStore::builder()
        .eviction_check(EvictionCheck::Refuse)
        .connect(&server.url())
        .await
        .expect("noeviction connects");
    let warning = RedisStore::connect(&server.url()).await.expect("connects");
    assert!(refusing.check().await.is_ok());
    let mut admin = idempotency_e2e::redis_server::connection(&server.url()).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");
    match refusing.check().await {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("allkeys-lru"), "{e}"),
        other => panic!("expected the readiness check to fail, got {other:?}"),
    }
    assert!(warning.check().await.is_ok(), "Warn only warns");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query_async(&mut admin)
        .await
        .expect("CONFIG SET");
    assert!(refusing.check().await.is_ok(), "ready again once fixed");
}

/// Fill Redis (`noeviction`, `maxmemory 1`): from now on it refuses every command that may
/// grow memory with `OOM`, as a Redis that ran out of memory does. Checked with a plain `SET`,
/// so a test that relies on it proves something.
async fn fill_redis(conn: &mut redis::aio::MultiplexedConnection) {
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query_async(conn)
            .await
            .expect("CONFIG SET");
    }
    let refused = redis::cmd("SET")
        .arg("probe")
        .arg("x")
        .query_async::<()>(conn)
        .await;
    assert!(
        refused.as_ref().is_err_and(|e| e.code() == Some("OOM")),
        "Redis must refuse writes for this test: {refused:?}"
    );
}

/// Whether `key` exists.
async fn key_exists(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> bool {
    let n: i64 = redis::cmd("EXISTS")
        .arg(key)
        .query_async(conn)
        .await
        .expect("EXISTS");
    n == 1
}

/// C22 with `noeviction`: a full Redis fails closed for new keys only, as the memory store
/// does (`full_store_refuses_new_keys_by_default`). A key it already holds still answers: a
/// completed record replays (or, with another body, carries its fingerprint for the 422) and a
/// live reservation is in flight (409), and its completion is stored. Only what needs a new
/// write fails: a new key, a takeover. Redis refuses `SET` under `OOM` before running it, even for a key that
/// exists; this failed before the store fell back to the reserve script (every reserve was
/// `Unavailable`, so a client retrying a completed payment got 503 until memory was freed).
#[tokio::test]
async fn a_full_redis_refuses_new_keys_and_still_answers_existing_ones() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut conn = redis_conn(&redis).await;
    let (done, busy, ended) = (scope("t", "done"), scope("t", "busy"), scope("t", "ended"));
    let stored = response(b"paid once");
    let token = reserved(&store, &done, &FP_A, LEASE).await;
    assert_eq!(
        store.complete(&done, &token, &stored, TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    let busy_token = reserved(&store, &busy, &FP_A, LEASE).await;
    reserved(&store, &ended, &FP_A, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    fill_redis(&mut conn).await;

    for (fp, what) in [(FP_A, "the same body"), (FP_B, "another body")] {
        match store.reserve(&done, &fp, LEASE).await {
            Ok(ReserveOutcome::Completed {
                fingerprint,
                response,
                expires_in,
            }) => {
                assert_eq!(fingerprint, FP_A, "{what}: the stored fingerprint");
                assert_eq!(response, stored, "{what}");
                let left = expires_in.expect("Redis reports the time left");
                assert!(
                    left <= TTL && left > TTL - Duration::from_secs(60),
                    "{what}: {left:?}"
                );
            }
            other => panic!("{what}: a full Redis must still replay, got {other:?}"),
        }
        match store.reserve(&busy, &fp, LEASE).await {
            Ok(ReserveOutcome::InFlight {
                fingerprint,
                lease_remaining,
            }) => {
                assert_eq!(fingerprint, FP_A, "{what}");
                assert!(
                    lease_remaining > Duration::ZERO,
                    "{what}: the lease is live"
                );
            }
            other => panic!("{what}: a full Redis must still see the reservation, got {other:?}"),
        }
    }
    // An ended reservation refuses another body without a write; its own body would take it
    // over, which is a write: refused, and the reservation stays as it was.
    match store.reserve(&ended, &FP_B, LEASE).await {
        Ok(ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining,
        }) => {
            assert_eq!(fingerprint, FP_A);
            assert_eq!(lease_remaining, Duration::ZERO);
        }
        other => panic!("another body must see the ended reservation, got {other:?}"),
    }
    let takeover = store.reserve(&ended, &FP_A, LEASE).await;
    assert!(
        matches!(takeover, Err(StoreError::Unavailable(_))),
        "a takeover needs a write: {takeover:?}"
    );
    // A new key fails closed (503), and nothing was written for it.
    let fresh = scope("t", "fresh");
    let refused = store.reserve(&fresh, &FP_A, LEASE).await;
    assert!(
        matches!(refused, Err(StoreError::Unavailable(_))),
        "a new key must fail closed: {refused:?}"
    );
    assert!(!key_exists(&mut conn, &store.key_of(&fresh)).await);
    // A lease renewal grows nothing (a `PEXPIRE`, not `denyoom`): it still applies, so a slow
    // handler keeps its key while Redis is full.
    assert_eq!(
        store.renew_lease(&busy, &busy_token, LEASE).await.ok(),
        Some(WriteOutcome::Applied),
        "a full Redis still renews"
    );
    // A completion of an admitted request is stored even while Redis is full (`allow-oom`):
    // refused, its reservation would end and the retry run the handler again
    // (`redis_degraded::a_redis_that_fills_up_while_the_handler_runs_does_not_run_it_twice`).
    assert_eq!(
        store.complete(&busy, &busy_token, &stored, TTL).await.ok(),
        Some(WriteOutcome::Applied),
        "a full Redis still stores an admitted request's response"
    );
    assert!(matches!(
        store.reserve(&busy, &FP_A, LEASE).await,
        Ok(ReserveOutcome::Completed { .. })
    ));

    // Memory freed: the new key reserves.
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("0")
        .query_async(&mut conn)
        .await
        .expect("CONFIG SET");
    reserved(&store, &fresh, &FP_A, LEASE).await;
}

/// A store over a connection the app already has works the same.
#[tokio::test]
async fn from_connection_uses_the_apps_connection() {
    let redis = RedisServer::start();
    let conn = redis_conn(&redis).await;
    let store = RedisStore::from_connection(conn);
    let s = scope("t", "own-conn");
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    assert_eq!(
        store.complete(&s, &token, &response(b"x"), TTL).await.ok(),
        Some(WriteOutcome::Applied)
    );
    let stranger = ReservationToken::random();
    assert_eq!(
        store.release(&s, &stranger).await.ok(),
        Some(WriteOutcome::Stale)
    );
}

async fn reserved<S: IdempotencyStore>(
    store: &S,
    scope: &Scope,
    fp: &Fingerprint,
    lease: Duration,
) -> ReservationToken {
    match store.reserve(scope, fp, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("expected Reserved for {scope:?}, got {other:?}"),
    }
}

/// A user that may not run `INFO` (an ACL such as managed Redis services hand out) still
/// connects: the cluster-mode check at connect is skipped with a warning, not a refusal.
#[tokio::test]
async fn connect_works_for_a_user_without_info() {
    let redis = RedisServer::start();
    let url = redis.user_url("limited", &["-info"]);
    let limited = redis::Client::open(url.as_str()).expect("URL parses");
    let mut conn = limited
        .get_multiplexed_async_connection()
        .await
        .expect("the limited user connects");
    let refused = redis::cmd("INFO")
        .arg("cluster")
        .query_async::<String>(&mut conn)
        .await;
    assert!(refused.is_err(), "the ACL must refuse INFO for this test");
    let store = RedisStore::connect(&url)
        .await
        .expect("a user without INFO still connects");
    reserved(&store, &scope("t", "acl"), &FP_A, LEASE).await;
}

/// A key at a record's place that is not a record (a hash written by an earlier build of this
/// store, or by another program) is a store error, never overwritten and never taken for a
/// miss.
#[tokio::test]
async fn a_key_that_is_not_a_record_is_an_error_and_left_alone() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut conn = redis_conn(&redis).await;
    let (hash, text) = (scope("t", "hash"), scope("t", "text"));
    let _: () = redis::cmd("HSET")
        .arg(store.key_of(&hash))
        .arg("st")
        .arg("c")
        .query_async(&mut conn)
        .await
        .expect("HSET");
    let _: () = redis::cmd("SET")
        .arg(store.key_of(&text))
        .arg("not a record")
        .query_async(&mut conn)
        .await
        .expect("SET");
    for s in [&hash, &text] {
        let result = store.reserve(s, &FP_A, LEASE).await;
        assert!(
            matches!(result, Err(StoreError::Backend(_))),
            "{s:?}: {result:?}"
        );
    }
    let kind: String = redis::cmd("TYPE")
        .arg(store.key_of(&hash))
        .query_async(&mut conn)
        .await
        .expect("TYPE");
    assert_eq!(kind, "hash");
    let value: String = redis::cmd("GET")
        .arg(store.key_of(&text))
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(value, "not a record");
}

/// Redis's count of connected clients.
async fn connected_clients(redis: &RedisServer) -> usize {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query_async(&mut redis_conn(redis).await)
        .await
        .expect("INFO clients");
    info.lines()
        .find_map(|l| l.trim().strip_prefix("connected_clients:"))
        .and_then(|n| n.parse::<usize>().ok())
        .expect("connected_clients")
        // Not the connection that asked.
        - 1
}

/// Reserve fresh keys on `store` until Redis counts `clients` connections (each call must
/// succeed), within 5 s.
async fn reserve_until_clients(store: &RedisStore, redis: &RedisServer, clients: usize, tag: &str) {
    for i in 0..100 {
        reserved(store, &scope(tag, &i.to_string()), &FP_A, LEASE).await;
        if connected_clients(redis).await == clients {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{tag}: Redis counts {} connections, expected {clients}",
        connected_clients(redis).await
    );
}

/// `connect`'s store gives each calling thread a connection of its own, made on that thread's
/// runtime (so an actix worker's commands do not cross to the thread that made the store).
/// A thread whose runtime shut down and that runs another gets a new connection: no call
/// goes into the dead one (checked to fail without the sentinel: the first call on the second
/// runtime was answered unavailable).
#[test]
fn each_thread_gets_a_connection_of_its_own_and_a_new_one_with_a_new_runtime() {
    let redis = RedisServer::start();
    let home = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let store = home.block_on(store(&redis));
    // The shared connection only.
    assert_eq!(home.block_on(connected_clients(&redis)), 1);
    let worker = std::thread::spawn(move || {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        first.block_on(reserve_until_clients(&store, &redis, 2, "first"));
        drop(first);
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        // Every call succeeds from the first on; the thread gets a connection again (the
        // first runtime's closed with it).
        second.block_on(reserve_until_clients(&store, &redis, 2, "second"));
        (store, redis)
    });
    let (store, redis) = worker.join().expect("worker thread");
    drop(store);
    drop(home);
    drop(redis);
}

/// `connection_per_thread(false)`: one shared connection, whatever thread calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_per_thread_off_keeps_one_connection() {
    let redis = RedisServer::start();
    let store = RedisStore::builder()
        .connection_per_thread(false)
        .connect(&redis.url())
        .await
        .expect("connect");
    let calls = (0..50).map(|i| {
        let store = store.clone();
        tokio::spawn(
            async move { reserved(&store, &scope("off", &i.to_string()), &FP_A, LEASE).await },
        )
    });
    for call in calls {
        call.await.expect("call");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(connected_clients(&redis).await, 1);
}

/// A thread's connection closes when the thread exits, while the store and the runtime live on
/// (here a thread of Tokio's blocking pool, which exits after 100 ms idle): short-lived threads
/// leave no connections behind.
#[test]
fn a_threads_connection_closes_when_the_thread_exits() {
    let redis = std::sync::Arc::new(RedisServer::start());
    let home = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_keep_alive(Duration::from_millis(100))
        .enable_all()
        .build()
        .expect("runtime");
    let store = home.block_on(store(&redis));
    let (s, r, h) = (store.clone(), redis.clone(), home.handle().clone());
    home.block_on(
        home.spawn_blocking(move || h.block_on(reserve_until_clients(&s, &r, 2, "blocking"))),
    )
    .expect("blocking thread");
    home.block_on(async {
        for _ in 0..100 {
            if connected_clients(&redis).await == 1 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "the exited thread's connection is still open: {} connections",
            connected_clients(&redis).await
        );
    });
    // The store still works, over the shared connection.
    home.block_on(reserved(&store, &scope("after", "k"), &FP_A, LEASE));
}

/// A reserve whose reply times out (C15: 503, the handler does not run) but whose `SET` Redis
/// runs afterwards used to leave a reservation nobody holds: the client's retry of the very
/// same request was told 409 for a whole lease, though no handler ever ran. The store now
/// gives it back, fenced by its token, on the same connection (found by review, 2026-12-04).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_reserve_does_not_leave_the_key_held_by_nobody() {
    let redis = RedisServer::start();
    let store = RedisStore::builder()
        .response_timeout(Duration::from_millis(300))
        .connection_per_thread(false)
        .connect(&redis.url())
        .await
        .expect("connect");
    let s = scope("t", "timed-out");
    // Redis frozen: the SET is sent and queued, its reply never comes in time.
    redis.signal("STOP");
    let first = store.reserve(&s, &FP_A, LEASE).await;
    redis.signal("CONT");
    assert!(
        matches!(first, Err(StoreError::Unavailable(_))),
        "got {first:?}"
    );
    // Redis has now run the queued SET. The client retries its request after the 503.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let retry = store.reserve(&s, &FP_A, LEASE).await;
    assert!(
        matches!(retry, Ok(ReserveOutcome::Reserved { .. })),
        "the retry of a request that never ran is refused for a whole lease: {retry:?}"
    );
}

/// A reservation whose key lost its expiry (`PERSIST`, or a copy made with `DUMP`/`RESTORE key
/// 0`, as some migration tools do) has `PTTL` -1. reserve.lua read its lease end as
/// `PTTL * 1000 - grace`, i.e. negative: "ended", so a retry with the same body took the key
/// over at once while the holder's handler still ran (a second charge; found by a review,
/// 2026-12-05). A key with no expiry says nothing about the lease: it is read as not ended.
#[tokio::test]
async fn a_reservation_without_expiry_is_not_taken_over() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let mut conn = redis_conn(&redis).await;
    let s = scope("t", "persisted");
    let holder = reserved(&store, &s, &FP_A, LEASE).await;
    let key = store.key_of(&s);
    let persisted: i64 = redis::cmd("PERSIST")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("PERSIST");
    assert_eq!(persisted, 1);
    assert_eq!(pttl(&mut conn, &key).await, -1);
    // The holder's lease (60 s) has not ended by anyone's clock.
    match store.reserve(&s, &FP_A, LEASE).await {
        Ok(ReserveOutcome::InFlight { fingerprint, .. }) => assert_eq!(fingerprint, FP_A),
        other => {
            let holder_can_complete = store
                .complete(&s, &holder, &response(b"first run"), TTL)
                .await;
            panic!(
                "a same-body retry 0 s into a 60 s lease must be told in flight, got {other:?} \
                 (the holder's complete then: {holder_can_complete:?})"
            )
        }
    }
}
