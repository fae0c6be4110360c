//! The Redis store's server-side scripts when Redis forgets them (a review of 2026-12-05): the
//! script cache flushed under traffic, Redis restarted between a reserve and its complete (as a
//! promoted replica that never loaded the scripts looks to the client), and on Redis Cluster a
//! primary whose cache is empty while another node is silent. Nothing may run twice and every
//! completion must land and replay byte-exact.

use super::redis_store::scope;
use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::redis::redis;
use idempotency_actix::store::{
    IdempotencyStore, RedisStore, ReserveOutcome, StoreError, StoredResponse, WriteOutcome,
};
use idempotency_actix::Fingerprint;
use idempotency_e2e::redis_server::RedisServer;

const FP: Fingerprint = Fingerprint([7; 32]);
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-raw".into(), Bytes::from_static(&[0xff, 0x00, b'\r'])),
        ],
        body: Bytes::from_static(body),
    }
}

async fn store(redis: &RedisServer) -> RedisStore {
    RedisStore::connect(&redis.url())
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

async fn conn(redis: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

// ---- The older encoder (f710b21's record.rs), copied ----
#[track_caller]
fn expect_replay(outcome: Result<ReserveOutcome, StoreError>, want: &StoredResponse) {
    match outcome {
        Ok(ReserveOutcome::Completed {
            response,
            fingerprint,
            ..
        }) => {
            assert_eq!(fingerprint, FP);
            assert_eq!(&response, want, "byte-exact replay");
        }
        other => panic!("expected a replay, got {other:?}"),
    }
}

/// Item 1: records as the first one-string build (f710b21) wrote them, bytes by the old
/// encoder and completions by the old complete script, read by the current store and idem-cli.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn script_flush_under_traffic_runs_nothing_twice() {
    let server = RedisServer::start();
    let a = store(&server).await;
    let b = store(&server).await;
    let stop = Arc::new(AtomicBool::new(false));
    let flushes = Arc::new(AtomicUsize::new(0));
    let flusher = {
        let stop = stop.clone();
        let flushes = flushes.clone();
        let mut c = conn(&server).await;
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let _: () = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                flushes.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        })
    };
    let errors = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (a, b, errors) = (a.clone(), b.clone(), errors.clone());
        tasks.push(tokio::spawn(async move {
            let s = scope("t", &format!("k{i}"));
            let body: &'static [u8] =
                Box::leak(format!("body-{i}").into_bytes().into_boxed_slice());
            let want = response(body);
            let mut reserved = 0;
            let mut token = None;
            // Both stores race; each retries until it gets a decision other than an error.
            let (ra, rb) = tokio::join!(a.reserve(&s, &FP, LEASE), b.reserve(&s, &FP, LEASE));
            for r in [ra, rb] {
                match r {
                    Ok(ReserveOutcome::Reserved { token: t }) => {
                        reserved += 1;
                        token = Some(t);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        *errors
                            .lock()
                            .unwrap()
                            .entry(format!("reserve: {e}"))
                            .or_default() += 1
                    }
                }
            }
            assert!(reserved <= 1, "key {i} reserved {reserved} times");
            if let Some(t) = token {
                let mut applied = false;
                for _ in 0..50 {
                    match a.complete(&s, &t, &want, TTL).await {
                        Ok(WriteOutcome::Applied) => {
                            applied = true;
                            break;
                        }
                        Ok(WriteOutcome::Stale) => panic!("key {i}: complete stale"),
                        Err(e) => {
                            *errors
                                .lock()
                                .unwrap()
                                .entry(format!("complete: {e}"))
                                .or_default() += 1
                        }
                    }
                }
                assert!(applied, "key {i}: complete never applied");
                loop {
                    match b.reserve(&s, &FP, LEASE).await {
                        Ok(ReserveOutcome::Completed { response, .. }) => {
                            assert_eq!(response, want);
                            break;
                        }
                        Ok(other) => panic!("key {i}: after complete {other:?}"),
                        Err(_) => continue,
                    }
                }
            }
            reserved
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    stop.store(true, Ordering::SeqCst);
    flusher.await.unwrap();
    eprintln!(
        "flushes {}, reserved {total}, errors {:?}",
        flushes.load(Ordering::SeqCst),
        errors.lock().unwrap()
    );
}

/// Item 3: Redis restarted (a new redis-server on the same port, with its AOF) between a
/// reserve and its complete: the script cache is empty; the holder's complete reloads it and
/// applies, a duplicate meanwhile is 409, the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_between_reserve_and_complete_reloads_the_scripts_and_runs_once() {
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let store = store(&server).await;
    let s = scope("t", "restart");
    // Warm the scripts.
    let w = scope("t", "warm");
    if let Ok(ReserveOutcome::Reserved { token }) = store.reserve(&w, &FP, LEASE).await {
        store
            .complete(&w, &token, &response(b"w"), TTL)
            .await
            .unwrap();
    }
    let token = match store.reserve(&s, &FP, LEASE).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("{other:?}"),
    };
    server.restart();
    // A duplicate while the holder runs: 409 (maybe 503 while reconnecting), never Reserved.
    let mut seen = Vec::new();
    for _ in 0..20 {
        let r = store.reserve(&s, &FP, LEASE).await;
        assert!(!matches!(r, Ok(ReserveOutcome::Reserved { .. })), "{r:?}");
        let done = matches!(r, Ok(ReserveOutcome::InFlight { .. }));
        seen.push(format!("{r:?}"));
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let want = response(b"after restart");
    let mut applied = None;
    for _ in 0..40 {
        match store.complete(&s, &token, &want, TTL).await {
            Ok(o) => {
                applied = Some(o);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert_eq!(applied, Some(WriteOutcome::Applied), "{seen:?}");
    expect_replay(store.reserve(&s, &FP, LEASE).await, &want);
}

async fn node_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("node")
}

/// The pid of the redis-server at `url` (a node this test's harness started).
async fn node_pid(url: &str) -> String {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut node_conn(url).await)
        .await
        .expect("INFO");
    info.lines()
        .find_map(|l| l.trim().strip_prefix("process_id:"))
        .expect("process_id")
        .to_owned()
}

fn signal(pid: &str, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid)
        .status();
    assert!(ok.is_ok_and(|s| s.success()), "kill -{sig} {pid}");
}

/// Item 3 on Redis Cluster: a primary whose script cache is empty (restarted from its AOF, a
/// replica promoted that never loaded the scripts, an operator's `SCRIPT FLUSH`) while one
/// *other* node does not answer (SIGSTOP: partitioned away). The redis crate answers
/// `NOSCRIPT` with a `SCRIPT LOAD` routed to every node (AllSucceeded): checks that the
/// holder's `complete` of a key on the healthy primary still lands within the lease, so the
/// client's retry after it replays instead of running the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_script_reload_with_a_silent_replica_still_completes() {
    script_reload_with_a_silent_node(true).await;
}

/// As above, the silent node being another shard's primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_script_reload_with_a_silent_primary_still_completes() {
    script_reload_with_a_silent_node(false).await;
}

async fn script_reload_with_a_silent_node(replica: bool) {
    use idempotency_e2e::redis_server::RedisCluster;
    let cluster = RedisCluster::start_with_replicas(&[]);
    let urls = cluster.urls();
    let store = RedisStore::builder()
        .connect_cluster(&[&urls[0]])
        .await
        .unwrap_or_else(|e| panic!("connect_cluster: {e}"));
    // Warm: every script loaded on every node.
    for i in 0..30 {
        let s = scope("warm", &format!("w{i}"));
        if let Ok(ReserveOutcome::Reserved { token }) = store.reserve(&s, &FP, LEASE).await {
            store.renew_lease(&s, &token, LEASE).await.expect("renew");
            store
                .complete(&s, &token, &response(b"w"), TTL)
                .await
                .expect("complete");
        }
    }
    // A key of primary 0.
    let mut p0 = node_conn(&urls[0]).await;
    let mut key = None;
    for i in 0..1000 {
        let s = scope("t", &format!("k{i}"));
        let name = store.key_of(&s);
        let here: Result<i64, _> = redis::cmd("EXISTS").arg(&name).query_async(&mut p0).await;
        if here.is_ok() {
            key = Some(s);
            break;
        }
    }
    let s = key.expect("a key of primary 0");
    let lease = Duration::from_secs(4);
    let token = match store.reserve(&s, &FP, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("{other:?}"),
    };
    let started = std::time::Instant::now();
    // Primary 0 loses its script cache (restart from AOF / promoted replica / SCRIPT FLUSH).
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut p0)
        .await
        .expect("flush");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut p0)
        .await
        .expect("resetstat");
    // A replica (of whichever shard) stops answering.
    let mut stopped = None;
    for url in &urls[1..] {
        let role: Vec<redis::Value> = redis::cmd("ROLE")
            .query_async(&mut node_conn(url).await)
            .await
            .expect("ROLE");
        if format!("{:?}", role[0]).contains("slave") == replica {
            stopped = Some(node_pid(url).await);
            break;
        }
    }
    let stopped = stopped.expect("a replica");
    signal(&stopped, "STOP");
    // The holder's handler is done: the middleware's complete, retried until the lease ends.
    let mut attempts = Vec::new();
    let mut applied = false;
    while started.elapsed() < lease {
        match store.complete(&s, &token, &response(b"paid"), TTL).await {
            Ok(WriteOutcome::Applied) => {
                applied = true;
                break;
            }
            other => attempts.push(format!("{:?} {other:?}", started.elapsed())),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The client's retry after the lease.
    tokio::time::sleep(lease.saturating_sub(started.elapsed()) + Duration::from_millis(300)).await;
    let retry = store.reserve(&s, &FP, LEASE).await;
    signal(&stopped, "CONT");
    let loads = idempotency_e2e::redis_server::command_calls(&mut p0, "script|load").await;
    eprintln!("script loads on primary 0 after the flush: {loads}");
    eprintln!(
        "applied {applied} at {:?}; attempts {attempts:#?}; retry {retry:?}",
        started.elapsed()
    );
    assert!(
        applied && !matches!(retry, Ok(ReserveOutcome::Reserved { .. })),
        "complete never applied within the lease ({} attempts: {attempts:#?}); the retry after \
         the lease: {retry:?} (Reserved = the handler runs a second time)",
        attempts.len()
    );
}

/// Item 3 on Redis Cluster: three primaries (no replicas), primary 0 (holding the key) with
/// its script cache emptied (a restart from its AOF, an operator's `SCRIPT FLUSH`), and
/// another, primary 1, silent for longer than the lease (SIGSTOP: a stall shorter than
/// `cluster-node-timeout`, so the cluster stays `ok`). The redis crate's reload on `NOSCRIPT`
/// is a `SCRIPT LOAD` to every primary that must all answer, so the first `complete` times
/// out waiting for primary 1; checked: the load did reach primary 0, so the middleware's next
/// retry lands within the lease and the client's retry after it replays (held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_another_silent_primary_delays_the_keys_completion_by_one_attempt_only() {
    use idempotency_e2e::redis_server::RedisCluster;
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let store = RedisStore::builder()
        .response_timeout(Duration::from_millis(500))
        .connect_cluster(&[&urls[0]])
        .await
        .unwrap_or_else(|e| panic!("connect_cluster: {e}"));
    for i in 0..30 {
        let s = scope("warm", &format!("w{i}"));
        if let Ok(ReserveOutcome::Reserved { token }) = store.reserve(&s, &FP, LEASE).await {
            store
                .complete(&s, &token, &response(b"w"), TTL)
                .await
                .expect("complete");
        }
    }
    let mut p0 = node_conn(&urls[0]).await;
    let mut key = None;
    for i in 0..1000 {
        let s = scope("t", &format!("k{i}"));
        let here: Result<i64, _> = redis::cmd("EXISTS")
            .arg(store.key_of(&s))
            .query_async(&mut p0)
            .await;
        if here.is_ok() {
            key = Some(s);
            break;
        }
    }
    let s = key.expect("a key of primary 0");
    let lease = Duration::from_secs(3);
    let token = match store.reserve(&s, &FP, lease).await {
        Ok(ReserveOutcome::Reserved { token }) => token,
        other => panic!("{other:?}"),
    };
    let started = std::time::Instant::now();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut p0)
        .await
        .expect("flush");
    let silent = node_pid(&urls[1]).await;
    signal(&silent, "STOP");
    // Primary 0 itself answers plain commands all along.
    let pong: String = redis::cmd("PING").query_async(&mut p0).await.expect("PING");
    assert_eq!(pong, "PONG");
    // The middleware's complete and its retries, until the lease ends (C16).
    let mut attempts = Vec::new();
    let mut applied = false;
    while started.elapsed() + Duration::from_millis(100) < lease {
        match store.complete(&s, &token, &response(b"paid"), TTL).await {
            Ok(WriteOutcome::Applied) => {
                applied = true;
                break;
            }
            other => attempts.push(format!("{:?} {other:?}", started.elapsed())),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Primary 1 answers again, soon after the lease; the client retries.
    tokio::time::sleep(lease.saturating_sub(started.elapsed()) + Duration::from_millis(500)).await;
    signal(&silent, "CONT");
    let mut retry = store.reserve(&s, &FP, LEASE).await;
    for _ in 0..20 {
        if retry.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = store.reserve(&s, &FP, LEASE).await;
    }
    eprintln!("applied {applied}; attempts {attempts:#?}; retry {retry:?}");
    assert!(
        !matches!(retry, Ok(ReserveOutcome::Reserved { .. })),
        "the key's primary answered all along, yet the holder's complete never landed \
         (applied: {applied}; {} attempts: {attempts:#?}) and the retry after the lease got \
         {retry:?}: the handler runs a second time",
        attempts.len()
    );
}
