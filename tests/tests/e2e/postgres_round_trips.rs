//! Round trips per store operation, counted on the wire by a protocol-aware proxy (see
//! `idempotency_e2e::proxy`): every extended-protocol round trip ends in one `Sync` message,
//! and a `Parse` means a statement was prepared. After the first use on a connection, each
//! operation must be exactly one round trip and prepare nothing; the pool checkout must not
//! add a `SELECT 1`.

use std::time::Duration;

use bytes::Bytes;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, ReserveOutcome, Scope, StoredResponse, WriteOutcome,
};
use idempotency_e2e::proxy::{MessageCounts, PgProxy};
use idempotency_e2e::TestDb;

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "tenant".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

const FP: Fingerprint = Fingerprint([3; 32]);
const LEASE: Duration = Duration::from_secs(60);

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )],
        body: Bytes::from_static(b"{\"id\":1}"),
    }
}

async fn reserve(store: &PostgresStore, key: &str, fp: &Fingerprint) -> ReserveOutcome {
    store.reserve(&scope(key), fp, LEASE).await.unwrap()
}

/// Runs `op` and returns the messages it sent.
async fn measured<F: std::future::Future<Output = ()>>(proxy: &PgProxy, op: F) -> MessageCounts {
    let before = proxy.counts();
    op.await;
    proxy.counts().since(&before)
}

fn assert_one_round_trip(what: &str, counts: &MessageCounts) {
    assert_eq!(counts.round_trips(), 1, "{what}: {counts:?}");
    assert_eq!(
        counts.get(b'P'),
        0,
        "{what} must reuse the prepared statement: {counts:?}"
    );
    assert_eq!(
        counts.get(b'Q'),
        0,
        "{what} must not send a simple query: {counts:?}"
    );
    println!(
        "{what}: {} round trip(s), messages {counts:?}",
        counts.round_trips()
    );
}

#[tokio::test]
async fn every_operation_is_one_round_trip_once_prepared() {
    let db = TestDb::new().await;
    if db.url.contains("sslmode=") && !db.url.contains("sslmode=disable") {
        eprintln!("skipped: the proxy cannot count messages inside TLS");
        return;
    }
    let proxy = PgProxy::for_url(&db.url).await.unwrap();
    // One connection, so every statement runs on the connection that prepared it.
    let store = PostgresStore::builder(proxy.url_through(&db.url))
        .max_size(1)
        .build()
        .await
        .unwrap();

    // Warm-up: each statement prepared once on this connection.
    let ReserveOutcome::Reserved { token } = reserve(&store, "warm", &FP).await else {
        panic!("warm-up reserve");
    };
    store
        .complete(&scope("warm"), &token, &response(), LEASE)
        .await
        .unwrap();
    let ReserveOutcome::Reserved { token } = reserve(&store, "warm2", &FP).await else {
        panic!("warm-up reserve");
    };
    store
        .renew_lease(&scope("warm2"), &token, LEASE)
        .await
        .unwrap();
    store.release(&scope("warm2"), &token).await.unwrap();

    let mut token = None;
    let miss = measured(&proxy, async {
        match reserve(&store, "k", &FP).await {
            ReserveOutcome::Reserved { token: t } => token = Some(t),
            other => panic!("{other:?}"),
        }
    })
    .await;
    assert_one_round_trip("reserve (miss: insert)", &miss);
    let token = token.unwrap();

    let in_flight = measured(&proxy, async {
        assert!(matches!(
            reserve(&store, "k", &FP).await,
            ReserveOutcome::InFlight { .. }
        ));
    })
    .await;
    assert_one_round_trip("reserve (in flight)", &in_flight);

    let complete = measured(&proxy, async {
        let outcome = store
            .complete(&scope("k"), &token, &response(), LEASE)
            .await
            .unwrap();
        assert_eq!(outcome, WriteOutcome::Applied);
    })
    .await;
    assert_one_round_trip("complete", &complete);

    let replay = measured(&proxy, async {
        assert!(matches!(
            reserve(&store, "k", &FP).await,
            ReserveOutcome::Completed { .. }
        ));
    })
    .await;
    assert_one_round_trip("reserve (replay)", &replay);

    let mismatch = measured(&proxy, async {
        let other = Fingerprint([4; 32]);
        assert!(matches!(
            reserve(&store, "k", &other).await,
            ReserveOutcome::Completed { .. }
        ));
    })
    .await;
    assert_one_round_trip("reserve (fingerprint mismatch)", &mismatch);

    let ReserveOutcome::Reserved { token } = reserve(&store, "r", &FP).await else {
        panic!("reserve r");
    };
    let renew = measured(&proxy, async {
        let outcome = store.renew_lease(&scope("r"), &token, LEASE).await.unwrap();
        assert_eq!(outcome, WriteOutcome::Applied);
    })
    .await;
    assert_one_round_trip("renew_lease", &renew);
    let release = measured(&proxy, async {
        let outcome = store.release(&scope("r"), &token).await.unwrap();
        assert_eq!(outcome, WriteOutcome::Applied);
    })
    .await;
    assert_one_round_trip("release", &release);

    // Takeover of an expired lease: still one statement, one round trip.
    store
        .reserve(&scope("t"), &FP, Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let takeover = measured(&proxy, async {
        assert!(matches!(
            reserve(&store, "t", &FP).await,
            ReserveOutcome::Reserved { .. }
        ));
    })
    .await;
    assert_one_round_trip("reserve (takeover of an expired lease)", &takeover);

    // The very first use of a statement on a new connection costs one extra round trip
    // (Parse/Describe), and only that once.
    let fresh = PostgresStore::builder(proxy.url_through(&db.url))
        .max_size(1)
        .build()
        .await
        .unwrap();
    // Open the connection first (startup and session setup are not the statement's cost), and
    // pass the store's one-time schema probe (`check` is that probe).
    fresh.check().await.unwrap();
    let first = measured(&proxy, async {
        reserve(&fresh, "first", &FP).await;
    })
    .await;
    assert_eq!(first.round_trips(), 2, "prepare + execute: {first:?}");
    assert_eq!(first.get(b'P'), 1, "{first:?}");
    println!("reserve (first use on a connection): {first:?}");
}

/// With the replay fast path on, a replay is one round trip (the plain SELECT, and no call of
/// the function) and a miss two (the SELECT that finds nothing, then the function); neither
/// prepares anything once warm.
#[tokio::test]
async fn replay_fast_path_replays_in_one_round_trip_and_misses_in_two() {
    let db = TestDb::new().await;
    if db.url.contains("sslmode=") && !db.url.contains("sslmode=disable") {
        eprintln!("skipped: the proxy cannot count messages inside TLS");
        return;
    }
    let proxy = PgProxy::for_url(&db.url).await.unwrap();
    let store = PostgresStore::builder(proxy.url_through(&db.url))
        .max_size(1)
        .replay_fast_path(true)
        .build()
        .await
        .unwrap();
    for key in ["warm", "warm2"] {
        let ReserveOutcome::Reserved { token } = reserve(&store, key, &FP).await else {
            panic!("warm-up reserve");
        };
        store
            .complete(&scope(key), &token, &response(), LEASE)
            .await
            .unwrap();
        reserve(&store, key, &FP).await; // the fast path's statement, prepared
    }

    let mut token = None;
    let miss = measured(&proxy, async {
        match reserve(&store, "k", &FP).await {
            ReserveOutcome::Reserved { token: t } => token = Some(t),
            other => panic!("{other:?}"),
        }
    })
    .await;
    assert_eq!(miss.round_trips(), 2, "miss: {miss:?}");
    assert_eq!(miss.get(b'P'), 0, "miss prepared a statement: {miss:?}");
    store
        .complete(&scope("k"), &token.unwrap(), &response(), LEASE)
        .await
        .unwrap();

    let replay = measured(&proxy, async {
        let ReserveOutcome::Completed { response: r, .. } = reserve(&store, "k", &FP).await else {
            panic!("expected a replay");
        };
        assert_eq!(r, response());
    })
    .await;
    assert_one_round_trip("reserve (replay, fast path)", &replay);
}
