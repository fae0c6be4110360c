//! `RedisStore` against a real `redis-server` (one per test, on a free loopback port, killed on
//! drop): the store conformance suite, Redis's own expiry instead of purge, key encoding,
//! one round trip per operation, script reloading, faults and the eviction-policy check.

use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::conformance;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::redis::redis::aio::MultiplexedConnection;
use idempotency_actix::store::redis::{
    parse_record_key, record_key, EvictionCheck, RedisStore, RedisStoreBuilder,
};
use idempotency_actix::store::{
    IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
    WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::redis_server::{command_calls, connection, RedisServer};

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

/// A 201 with `body` and a header value that is not text.
fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("x-raw".into(), Bytes::from_static(&[0xff, 0, b'\r']))],
        body: Bytes::from_static(body),
    }
}

/// A store with the defaults on `redis`.
async fn store(redis: &RedisServer) -> RedisStore {
    match RedisStore::connect(&redis.url()).await {
        Ok(store) => store,
        Err(e) => panic!("connect to {}: {e}", redis.url()),
    }
}

/// A fresh server, a store with the defaults on it and a connection of the test's own to it.
async fn server_store_conn() -> (RedisServer, RedisStore, MultiplexedConnection) {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    let conn = connection(&redis.url()).await;
    (redis, store, conn)
}

/// The store `builder` makes on `redis`.
async fn connect(builder: RedisStoreBuilder, redis: &RedisServer) -> RedisStore {
    builder.connect(&redis.url()).await.expect("connect")
}

/// A store on `redis` that refuses an evicting `maxmemory-policy`.
async fn connect_refusing(redis: &RedisServer) -> Result<RedisStore, StoreError> {
    RedisStore::builder()
        .eviction_check(EvictionCheck::Refuse)
        .connect(&redis.url())
        .await
}

/// Run the command `args` (its name first) on `conn`; an error panics with the command.
async fn cmd<T: redis::FromRedisValue>(conn: &mut MultiplexedConnection, args: &[&str]) -> T {
    let mut command = redis::cmd(args[0]);
    for arg in &args[1..] {
        command.arg(*arg);
    }
    command
        .query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", args.join(" ")))
}

/// `CONFIG SET name value`.
async fn config_set(conn: &mut MultiplexedConnection, name: &str, value: &str) {
    cmd::<()>(conn, &["CONFIG", "SET", name, value]).await;
}

/// Zero Redis's command counts (`CONFIG RESETSTAT`).
async fn reset_stats(conn: &mut MultiplexedConnection) {
    cmd::<()>(conn, &["CONFIG", "RESETSTAT"]).await;
}

/// The key's remaining life in milliseconds.
async fn pttl(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    cmd(conn, &["PTTL", key]).await
}

/// The record's bytes.
async fn raw_record(conn: &mut MultiplexedConnection, key: &str) -> Vec<u8> {
    cmd(conn, &["GET", key]).await
}

/// Whether `key` exists.
async fn key_exists(conn: &mut MultiplexedConnection, key: &str) -> bool {
    cmd::<i64>(conn, &["EXISTS", key]).await == 1
}

/// Reserve `scope` with `fp` for `lease`, which must be a fresh reservation: its token.
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

/// Reserve `s` with `fp`: in flight (else panic with `what`), its fingerprint and lease left.
async fn in_flight(
    store: &RedisStore,
    s: &Scope,
    fp: &Fingerprint,
    what: &str,
) -> (Fingerprint, Duration) {
    match store.reserve(s, fp, LEASE).await {
        Ok(ReserveOutcome::InFlight {
            fingerprint,
            lease_remaining,
        }) => (fingerprint, lease_remaining),
        other => panic!("{what}, got {other:?}"),
    }
}

/// Reserve `s` with `fp`: a replay (else panic with `what`), its fingerprint, response, TTL.
async fn replayed(
    store: &RedisStore,
    s: &Scope,
    fp: &Fingerprint,
    what: &str,
) -> (Fingerprint, StoredResponse, Option<Duration>) {
    match store.reserve(s, fp, LEASE).await {
        Ok(ReserveOutcome::Completed {
            fingerprint,
            response,
            expires_in,
        }) => (fingerprint, response, expires_in),
        other => panic!("{what}, got {other:?}"),
    }
}

/// Assert `left` is at most `full` and less than `slack` short of it.
fn assert_left(left: Duration, full: Duration, slack: Duration, what: &str) {
    assert!(left <= full && left > full - slack, "{what}: {left:?}");
}

/// Assert another body (`FP_B`) finds `s` an ended reservation of `FP_A` (no lease left).
async fn assert_ended_reservation(store: &RedisStore, s: &Scope) {
    let (fingerprint, lease_remaining) = in_flight(
        store,
        s,
        &FP_B,
        "another body must see the ended reservation",
    )
    .await;
    assert_eq!(fingerprint, FP_A, "{s:?}");
    assert_eq!(lease_remaining, Duration::ZERO, "{s:?}");
}

/// Complete `s` with `token`, storing `body` for `ttl`: it must apply.
async fn complete_applied(
    store: &impl IdempotencyStore,
    s: &Scope,
    token: &ReservationToken,
    body: &StoredResponse,
    ttl: Duration,
) {
    assert_eq!(
        store.complete(s, token, body, ttl).await.ok(),
        Some(WriteOutcome::Applied),
        "complete {s:?}"
    );
}

/// Renew `s`'s lease to `lease` with `token`: it must apply.
async fn renew_applied(store: &RedisStore, s: &Scope, token: &ReservationToken, lease: Duration) {
    assert_eq!(
        store.renew_lease(s, token, lease).await.ok(),
        Some(WriteOutcome::Applied),
        "renew {s:?} to {lease:?}"
    );
}

/// Assert the commands since `reset_stats` were one `SET` and one `TIME`, and no script.
async fn assert_native_only(conn: &mut MultiplexedConnection, what: &str) {
    assert_eq!(command_calls(conn, "set").await, 1, "{what}");
    assert_eq!(command_calls(conn, "time").await, 1, "{what}");
    assert_eq!(command_calls(conn, "evalsha").await, 0, "{what}: no script");
}

/// C26: the whole store conformance suite, on a store with the default 24 h grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_conforms() {
    let redis = RedisServer::start();
    let store = store(&redis).await;
    conformance::run_all(&store).await;
}

/// C26 without a script where none is needed: a miss reserves with one native `SET NX GET`
/// (and `TIME`, pipelined), a replay is the same two native commands, byte-exact and with the
/// record's remaining TTL; only a live reservation (a concurrent duplicate) goes on to the
/// reserve script.
#[tokio::test]
async fn misses_and_replays_use_native_commands_only() {
    let (_redis, store, mut conn) = server_store_conn().await;
    let s = scope("t", "native");
    let stored = response(b"\x00body\xff");

    reset_stats(&mut conn).await;
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    assert_native_only(&mut conn, "the miss").await;
    store
        .complete(&s, &token, &stored, TTL)
        .await
        .expect("complete");

    reset_stats(&mut conn).await;
    let (fingerprint, replay, expires_in) =
        replayed(&store, &s, &FP_B, "expected the replay").await;
    assert_eq!(
        fingerprint, FP_A,
        "the stored fingerprint, not the caller's"
    );
    assert_eq!(replay, stored);
    let left = expires_in.expect("remaining TTL");
    assert_left(left, TTL, Duration::from_secs(60), "the replay's TTL");
    assert_native_only(&mut conn, "the replay").await;

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
    let builder = RedisStore::builder().in_flight_grace(Duration::from_millis(200));
    let store = connect(builder, &redis).await;
    let short = Duration::from_millis(200);
    let done = scope("t", "done");
    let dead = scope("t", "dead");
    let live = scope("t", "live");
    let token = reserved(&store, &done, &FP_A, LEASE).await;
    complete_applied(&store, &done, &token, &response(b"d"), short).await;
    reserved(&store, &dead, &FP_A, short).await;
    reserved(&store, &live, &FP_A, LEASE).await;
    let mut conn = connection(&redis.url()).await;
    let left = pttl(&mut conn, &store.key_of(&dead)).await;
    assert!(
        left > 200 && left <= 400,
        "a reservation lives lease + grace (400 ms), PTTL {left}"
    );
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(store.purge_expired(Duration::ZERO).await.ok(), Some(0));
    for gone in [&done, &dead] {
        let exists: i64 = cmd(&mut conn, &["EXISTS", &store.key_of(gone)]).await;
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
    assert_ended_reservation(&store, &s).await;
    let late = response(b"late but mine");
    complete_applied(&store, &s, &token, &late, TTL).await;
    let (_, replay, expires_in) = replayed(&store, &s, &FP_A, "expected the late completion").await;
    assert_eq!(replay, late);
    let left = expires_in.expect("Redis reports the time left");
    assert_left(
        left,
        TTL,
        Duration::from_secs(5),
        "the late completion's TTL",
    );
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
    let store = connect(RedisStore::builder().in_flight_grace(grace), &redis).await;
    let mut conn = connection(&redis.url()).await;
    let s = scope("t", "renewed");
    let key = store.key_of(&s);
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let token = reserved(&store, &s, &FP_A, Duration::from_secs(1)).await;
    let before = raw_record(&mut conn, &key).await;
    assert!(pttl(&mut conn, &key).await <= ms(Duration::from_secs(1) + grace));

    renew_applied(&store, &s, &token, LEASE).await;
    let life = pttl(&mut conn, &key).await;
    assert!(
        life <= ms(LEASE + grace) && life > ms(LEASE + grace - Duration::from_secs(5)),
        "the key lives lease + grace from now: {life} ms"
    );
    assert_eq!(raw_record(&mut conn, &key).await, before, "bytes untouched");
    let renewed = "expected the renewed reservation";
    let (_, lease_remaining) = in_flight(&store, &s, &FP_A, renewed).await;
    assert_left(lease_remaining, LEASE, Duration::from_secs(5), "the lease");

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
    renew_applied(&store, &s, &token, Duration::MAX).await;
    assert!(pttl(&mut conn, &key).await > ms(century));
    let (_, lease_remaining) = in_flight(&store, &s, &FP_A, renewed).await;
    let slack = Duration::from_secs(60);
    assert_left(lease_remaining, century, slack, "the century lease");
    assert_eq!(raw_record(&mut conn, &key).await, before, "bytes untouched");
    // And it still completes.
    complete_applied(&store, &s, &token, &response(b"at last"), TTL).await;
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
    let (_, replay, _) = replayed(&store, &s, &FP_A, "expected the first response").await;
    assert_eq!(replay, first);
    // A takeover (here: the completed record expired and a new request reserved) fences the
    // old token out again.
    let short = scope("t", "again-expired");
    let old = reserved(&store, &short, &FP_A, LEASE).await;
    complete_applied(&store, &short, &old, &first, Duration::from_millis(50)).await;
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
            let what = format!("{name} {one:?}: expected its own reservation");
            let (fingerprint, _) = in_flight(store, one, &FP_Z, &what).await;
            assert_eq!(fingerprint, mine, "{name} {one:?}");
        }
    }

    let mut conn = connection(&redis.url()).await;
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
    let (_redis, store, mut conn) = server_store_conn().await;
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
    renew_applied(&store, &s, &token, LEASE).await;
    complete_applied(&store, &s, &token, &response(b"c"), TTL).await;
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

    cmd::<()>(&mut conn, &["SCRIPT", "FLUSH"]).await;
    // The renew and complete scripts are reloaded on NOSCRIPT.
    let after = scope("t", "after-flush");
    let token = reserved(&store, &after, &FP_A, LEASE).await;
    renew_applied(&store, &after, &token, LEASE).await;
    complete_applied(&store, &after, &token, &response(b"f"), TTL).await;
}

/// C15: Redis down is `StoreError::Unavailable` within the timeout, not a hang; the store
/// reconnects by itself once Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_unavailable_and_the_store_recovers() {
    let mut redis = RedisServer::start();
    let builder = RedisStore::builder()
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_millis(500));
    let store = connect(builder, &redis).await;
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
    match connect_refusing(&lru).await {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("noeviction"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(
        RedisStore::connect(&lru.url()).await.is_ok(),
        "Warn connects"
    );
    let volatile = RedisServer::start_with(&["--maxmemory-policy", "volatile-ttl"]);
    assert!(
        connect_refusing(&volatile).await.is_err(),
        "volatile-ttl is refused"
    );
    let safe = RedisServer::start();
    assert!(connect_refusing(&safe).await.is_ok(), "noeviction connects");
}

/// C22 after start: `check()` (the readiness probe) asks for the policy again, so a policy
/// changed while the app runs (by an operator, or a failover to a replica configured
/// otherwise) takes an instance that refuses evicting policies out of rotation.
#[tokio::test]
async fn a_policy_changed_after_connect_fails_the_readiness_check() {
    let server = RedisServer::start();
    let refusing = connect_refusing(&server)
        .await
        .expect("noeviction connects");
    let warning = RedisStore::connect(&server.url()).await.expect("connects");
    assert!(refusing.check().await.is_ok());
    let mut admin = connection(&server.url()).await;
    config_set(&mut admin, "maxmemory-policy", "allkeys-lru").await;
    match refusing.check().await {
        Err(StoreError::Backend(e)) => assert!(e.to_string().contains("allkeys-lru"), "{e}"),
        other => panic!("expected the readiness check to fail, got {other:?}"),
    }
    assert!(warning.check().await.is_ok(), "Warn only warns");
    config_set(&mut admin, "maxmemory-policy", "noeviction").await;
    assert!(refusing.check().await.is_ok(), "ready again once fixed");
}

/// Fill Redis (`noeviction`, `maxmemory 1`): from now on it refuses every command that may
/// grow memory with `OOM`, as a Redis that ran out of memory does. Checked with a plain `SET`,
/// so a test that relies on it proves something.
async fn fill_redis(conn: &mut MultiplexedConnection) {
    for (name, value) in [("maxmemory-policy", "noeviction"), ("maxmemory", "1")] {
        config_set(conn, name, value).await;
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

/// C22 with `noeviction`: a full Redis fails closed for new keys only, as the memory store
/// does (`full_store_refuses_new_keys_by_default`). A key it already holds still answers: a
/// completed record replays (or, with another body, carries its fingerprint for the 422) and a
/// live reservation is in flight (409), and its completion is stored. Only what needs a new
/// write fails: a new key, a takeover. Redis refuses `SET` under `OOM` before running it, even for a key that
/// exists; this failed before the store fell back to the reserve script (every reserve was
/// `Unavailable`, so a client retrying a completed payment got 503 until memory was freed).
#[tokio::test]
async fn a_full_redis_refuses_new_keys_and_still_answers_existing_ones() {
    let (_redis, store, mut conn) = server_store_conn().await;
    let (done, busy, ended) = (scope("t", "done"), scope("t", "busy"), scope("t", "ended"));
    let stored = response(b"paid once");
    let token = reserved(&store, &done, &FP_A, LEASE).await;
    complete_applied(&store, &done, &token, &stored, TTL).await;
    let busy_token = reserved(&store, &busy, &FP_A, LEASE).await;
    reserved(&store, &ended, &FP_A, Duration::from_millis(100)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    fill_redis(&mut conn).await;

    for (fp, what) in [(FP_A, "the same body"), (FP_B, "another body")] {
        let must = format!("{what}: a full Redis must still replay");
        let (fingerprint, replay, expires_in) = replayed(&store, &done, &fp, &must).await;
        assert_eq!(fingerprint, FP_A, "{what}: the stored fingerprint");
        assert_eq!(replay, stored, "{what}");
        let left = expires_in.expect("Redis reports the time left");
        assert_left(left, TTL, Duration::from_secs(60), what);
        let must = format!("{what}: a full Redis must still see the reservation");
        let (fingerprint, lease_remaining) = in_flight(&store, &busy, &fp, &must).await;
        assert_eq!(fingerprint, FP_A, "{what}");
        assert!(
            lease_remaining > Duration::ZERO,
            "{what}: the lease is live"
        );
    }
    // An ended reservation refuses another body without a write; its own body would take it
    // over, which is a write: refused, and the reservation stays as it was.
    assert_ended_reservation(&store, &ended).await;
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
    config_set(&mut conn, "maxmemory", "0").await;
    reserved(&store, &fresh, &FP_A, LEASE).await;
}

/// A store over a connection the app already has works the same.
#[tokio::test]
async fn from_connection_uses_the_apps_connection() {
    let redis = RedisServer::start();
    let conn = connection(&redis.url()).await;
    let store = RedisStore::from_connection(conn);
    let s = scope("t", "own-conn");
    let token = reserved(&store, &s, &FP_A, LEASE).await;
    complete_applied(&store, &s, &token, &response(b"x"), TTL).await;
    let stranger = ReservationToken::random();
    assert_eq!(
        store.release(&s, &stranger).await.ok(),
        Some(WriteOutcome::Stale)
    );
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
    let (_redis, store, mut conn) = server_store_conn().await;
    let (hash, text) = (scope("t", "hash"), scope("t", "text"));
    cmd::<()>(&mut conn, &["HSET", &store.key_of(&hash), "st", "c"]).await;
    cmd::<()>(&mut conn, &["SET", &store.key_of(&text), "not a record"]).await;
    for s in [&hash, &text] {
        let result = store.reserve(s, &FP_A, LEASE).await;
        assert!(
            matches!(result, Err(StoreError::Backend(_))),
            "{s:?}: {result:?}"
        );
    }
    let kind: String = cmd(&mut conn, &["TYPE", &store.key_of(&hash)]).await;
    assert_eq!(kind, "hash");
    let value: String = cmd(&mut conn, &["GET", &store.key_of(&text)]).await;
    assert_eq!(value, "not a record");
}

/// Redis's count of connected clients.
async fn connected_clients(redis: &RedisServer) -> usize {
    let info: String = cmd(&mut connection(&redis.url()).await, &["INFO", "clients"]).await;
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

/// A one-worker runtime whose idle blocking threads exit after `keep_alive` (default if `None`).
fn home_runtime(keep_alive: Option<Duration>) -> tokio::runtime::Runtime {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.worker_threads(1);
    if let Some(keep_alive) = keep_alive {
        builder.thread_keep_alive(keep_alive);
    }
    builder.enable_all().build().expect("runtime")
}

/// A current-thread runtime.
fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// `connect`'s store gives each calling thread a connection of its own, made on that thread's
/// runtime (so an actix worker's commands do not cross to the thread that made the store).
/// A thread whose runtime shut down and that runs another gets a new connection: no call
/// goes into the dead one (checked to fail without the sentinel: the first call on the second
/// runtime was answered unavailable).
#[test]
fn each_thread_gets_a_connection_of_its_own_and_a_new_one_with_a_new_runtime() {
    let redis = RedisServer::start();
    let home = home_runtime(None);
    let store = home.block_on(store(&redis));
    // The shared connection only.
    assert_eq!(home.block_on(connected_clients(&redis)), 1);
    let worker = std::thread::spawn(move || {
        let first = current_thread_runtime();
        first.block_on(reserve_until_clients(&store, &redis, 2, "first"));
        drop(first);
        let second = current_thread_runtime();
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
    let store = connect(RedisStore::builder().connection_per_thread(false), &redis).await;
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
    let home = home_runtime(Some(Duration::from_millis(100)));
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
    let builder = RedisStore::builder()
        .response_timeout(Duration::from_millis(300))
        .connection_per_thread(false);
    let store = connect(builder, &redis).await;
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
    let (_redis, store, mut conn) = server_store_conn().await;
    let s = scope("t", "persisted");
    let holder = reserved(&store, &s, &FP_A, LEASE).await;
    let key = store.key_of(&s);
    let persisted: i64 = cmd(&mut conn, &["PERSIST", &key]).await;
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
