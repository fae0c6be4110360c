//! The rotated layout (migration 000016; docs/sql.md, "Rotated layout") against a real
//! PostgreSQL: the store's contract across rotations, one winner per key while the tables
//! turn over, records that outlive the period carried forward, the rotation held back by a
//! transaction older than the last one, and `idem-cli purge` rotating without dropping a live
//! record. (The rest of the suites run on this layout with `IDEM_TEST_LAYOUT=rotated`.)
//!
//! Each test shortens its database's rotation period to a microsecond, so every rotation it
//! asks for is due: what the period guards (how often the tables turn over) is not what these
//! tests check, and what they check must hold at any period.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use futures_util::future::join_all;
use idempotency_actix::store::postgres::{self, admin, PostgresStore, DEFAULT_ROTATION_PERIOD};
use idempotency_actix::store::{
    conformance, Fingerprint, IdempotencyStore, ReservationToken, ReserveOutcome, Scope,
    StoredResponse, WriteOutcome,
};
use idempotency_e2e::proc::run_idem_cli;
use idempotency_e2e::records::count;
use idempotency_e2e::TestDb;

const FP: Fingerprint = Fingerprint([9; 32]);
const OTHER: Fingerprint = Fingerprint([8; 32]);
const LEASE: Duration = Duration::from_secs(60);
const GRACE: Duration = Duration::from_secs(24 * 3600);
const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(body),
    }
}

/// A fresh database with the rotated layout, every rotation due from now on, and a connection
/// for the rotations.
async fn rotated_db() -> (TestDb, AsyncPgConnection) {
    let db = TestDb::new_rotated(DEFAULT_ROTATION_PERIOD).await;
    let mut conn = postgres::establish(&db.url).await.unwrap();
    conn.batch_execute("UPDATE idempotency_generation SET period = interval '1 microsecond'")
        .await
        .unwrap();
    (db, conn)
}

async fn rotate(conn: &mut AsyncPgConnection) -> admin::Rotation {
    admin::rotate(conn, LOCK_TIMEOUT, GRACE).await.unwrap()
}

async fn reserved(store: &PostgresStore, key: &str, ttl_or_lease: Duration) -> ReservationToken {
    match store.reserve(&scope(key), &FP, ttl_or_lease).await.unwrap() {
        ReserveOutcome::Reserved { token } => token,
        other => panic!("{key}: expected Reserved, got {other:?}"),
    }
}

async fn completed(store: &PostgresStore, key: &str, body: &'static [u8], ttl: Duration) {
    let token = reserved(store, key, LEASE).await;
    let outcome = store
        .complete(&scope(key), &token, &response(body), ttl)
        .await
        .unwrap();
    assert_eq!(outcome, WriteOutcome::Applied, "{key}");
}

async fn assert_replays(store: &PostgresStore, key: &str, body: &[u8], when: &str) {
    match store.reserve(&scope(key), &FP, LEASE).await.unwrap() {
        ReserveOutcome::Completed { response, .. } => {
            assert_eq!(&response.body[..], body, "{key} {when}")
        }
        other => panic!("{key} {when}: expected its replay, got {other:?}"),
    }
}

/// How many rows with `key` the three generation tables hold, the one a rotation made unread
/// included.
fn rows_of(url: &str, key: &str) -> i64 {
    count(
        url,
        &format!(
            "SELECT count(*) AS n FROM (SELECT idempotency_key FROM idempotency_keys_0 \
             UNION ALL SELECT idempotency_key FROM idempotency_keys_1 \
             UNION ALL SELECT idempotency_key FROM idempotency_keys_2) k \
             WHERE idempotency_key = '{key}'"
        ),
    )
}

#[tokio::test]
async fn the_store_conforms_on_the_rotated_layout() {
    let db = TestDb::new_rotated(DEFAULT_ROTATION_PERIOD).await;
    let store = PostgresStore::connect(&db.url).await.unwrap();
    conformance::run_all(&store).await;
}

/// Four rotations, two of which make the table holding the records unread: live records and a
/// reservation in flight are carried into the new current table each time (so a TTL of a year
/// outlives a period of a microsecond), the holder's late complete still applies, and an
/// expired record is emptied with its table.
#[tokio::test]
async fn live_records_are_carried_across_rotations_and_expired_ones_emptied() {
    let (db, mut conn) = rotated_db().await;
    let store = PostgresStore::connect(&db.url).await.unwrap();
    completed(
        &store,
        "year",
        b"kept a year",
        Duration::from_secs(365 * 24 * 3600),
    )
    .await;
    completed(&store, "day", b"kept a day", Duration::from_secs(24 * 3600)).await;
    completed(&store, "gone", b"kept a second", Duration::from_secs(1)).await;
    let held = reserved(&store, "held", LEASE).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    // The records sit in table 0. Rotation 1 makes table 1 current (table 2, empty, becomes
    // unread); rotation 2 makes table 2 current and table 0 unread, so it carries the three
    // that matter; rotation 3 empties table 0; rotation 4 carries the three again.
    let mut carried = Vec::new();
    for n in 1..=4 {
        let rotation = rotate(&mut conn).await;
        assert!(rotation.rotated, "rotation {n}: {rotation:?}");
        assert_eq!(i64::from(rotation.generation), n % 3, "rotation {n}");
        carried.push(rotation.carried);
        let when = format!("after rotation {n}");
        assert_replays(&store, "year", b"kept a year", &when).await;
        assert_replays(&store, "day", b"kept a day", &when).await;
        match store.reserve(&scope("held"), &OTHER, LEASE).await.unwrap() {
            ReserveOutcome::InFlight { fingerprint, .. } => assert_eq!(fingerprint, FP, "{when}"),
            other => panic!("held {when}: expected in flight, got {other:?}"),
        }
        for key in ["year", "day", "held"] {
            assert_eq!(rows_of(&db.url, key), 1, "{key} {when}: one row");
        }
    }
    assert_eq!(carried, [0, 3, 0, 3], "records carried per rotation");
    assert_eq!(
        rows_of(&db.url, "gone"),
        0,
        "the expired record was emptied"
    );

    // The holder's complete, four rotations late, applies to its carried reservation.
    let late = store
        .complete(&scope("held"), &held, &response(b"late"), LEASE)
        .await
        .unwrap();
    assert_eq!(late, WriteOutcome::Applied);
    assert_replays(&store, "held", b"late", "after its late complete").await;
    // The emptied key is free again.
    reserved(&store, "gone", LEASE).await;
}

/// Concurrent reserves of new keys, and takeovers of ended reservations, from two pools while
/// another session rotates the tables as fast as it can: exactly one reservation per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_winner_per_key_while_the_tables_rotate() {
    let (db, mut conn) = rotated_db().await;
    let pool = |size| {
        PostgresStore::builder(db.url.as_str())
            .max_size(size)
            .build()
    };
    let (a, b) = (pool(8).await.unwrap(), pool(8).await.unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let rotations = Arc::new(AtomicUsize::new(0));
    let rotator = tokio::spawn({
        let (stop, rotations) = (Arc::clone(&stop), Arc::clone(&rotations));
        async move {
            while !stop.load(Ordering::Relaxed) {
                // Held back now and then by a reserve's transaction older than the last
                // rotation: that is the guard working, and the next try goes through.
                if rotate(&mut conn).await.rotated {
                    rotations.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }
    });

    let race = |key: String| {
        let attempts = (0..16).map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let key = scope(&key);
            tokio::spawn(async move { store.reserve(&key, &FP, LEASE).await })
        });
        join_all(attempts)
    };
    for round in 0..40 {
        let winners = race(format!("new-{round}"))
            .await
            .into_iter()
            .filter(|r| matches!(r, Ok(Ok(ReserveOutcome::Reserved { .. }))))
            .count();
        assert_eq!(winners, 1, "new key, round {round}");
    }
    for round in 0..20 {
        let key = format!("ended-{round}");
        reserved(&a, &key, Duration::from_millis(1)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let winners = race(key)
            .await
            .into_iter()
            .filter(|r| matches!(r, Ok(Ok(ReserveOutcome::Reserved { .. }))))
            .count();
        assert_eq!(winners, 1, "takeover, round {round}");
    }
    stop.store(true, Ordering::Relaxed);
    rotator.await.unwrap();
    let rotations = rotations.load(Ordering::Relaxed);
    // Rotations run between the races' statements; a few are enough to interleave with them
    // (held back now and then, see above, so not a fixed count).
    assert!(
        rotations >= 3,
        "only {rotations} rotations during the races"
    );
}

/// The miss's fast path (one `INSERT` that reads the previous table and the generation) on a
/// session that read the generation before a rotation, and on a scope whose record a rotation
/// left in the previous table: neither inserts there, and the general path answers. The miss
/// lands in the table that is current now, the session is brought up to date, and the older
/// record (live, or ended and taken over) is never doubled.
#[tokio::test]
async fn a_miss_behind_a_rotation_or_beside_a_previous_record_is_answered_once() {
    let (db, mut conn) = rotated_db().await;
    let current = || {
        count(
            &db.url,
            "SELECT current::bigint AS n FROM idempotency_generation",
        )
    };
    let rows_in = |table: i64, key: &str| {
        count(
            &db.url,
            &format!(
                "SELECT count(*) AS n FROM idempotency_keys_{table} WHERE idempotency_key = '{key}'"
            ),
        )
    };
    // One connection: the session whose generation goes stale is the one that reserves next.
    let store = PostgresStore::builder(db.url.as_str())
        .max_size(1)
        .build()
        .await
        .unwrap();
    completed(&store, "stored", b"stored", Duration::from_secs(3600)).await;
    reserved(&store, "ended", Duration::from_millis(1)).await;
    let before = current();
    assert!(rotate(&mut conn).await.rotated);
    let now = current();
    assert_ne!(now, before);

    reserved(&store, "new", LEASE).await;
    assert_eq!(
        rows_in(now, "new"),
        1,
        "the miss is in the table current now"
    );
    assert_eq!(rows_of(&db.url, "new"), 1);

    // Records stored before the rotation, in what is the previous table now.
    assert_eq!(rows_in(before, "stored"), 1);
    assert_replays(&store, "stored", b"stored", "after the rotation").await;
    match store
        .reserve(&scope("stored"), &OTHER, LEASE)
        .await
        .unwrap()
    {
        ReserveOutcome::Completed { fingerprint, .. } => assert_eq!(fingerprint, FP),
        other => panic!("another body for a stored record: {other:?}"),
    }
    assert_eq!(rows_of(&db.url, "stored"), 1, "never doubled");
    tokio::time::sleep(Duration::from_millis(5)).await;
    reserved(&store, "ended", LEASE).await;
    assert_eq!(rows_of(&db.url, "ended"), 1, "taken over, not doubled");
    assert_eq!(rows_in(now, "ended"), 1, "moved into the current table");
}

/// A transaction that began before the last rotation may have read the generation before it
/// and could still write into the table the next rotation empties: that rotation waits for it.
#[tokio::test]
async fn a_rotation_waits_for_a_transaction_older_than_the_last_one() {
    let (db, mut conn) = rotated_db().await;
    let mut old = postgres::establish(&db.url).await.unwrap();
    old.batch_execute("BEGIN; SELECT current FROM idempotency_generation")
        .await
        .unwrap();
    let pid = count(
        &db.url,
        "SELECT min(pid)::bigint AS n FROM pg_stat_activity \
         WHERE state = 'idle in transaction' AND datname = current_database()",
    );

    let first = rotate(&mut conn).await;
    assert!(
        first.rotated,
        "the transaction began after the last rotation: {first:?}"
    );
    let held = rotate(&mut conn).await;
    assert!(!held.rotated, "{held:?}");
    assert_eq!(held.blocked_by_pid.map(i64::from), Some(pid));
    assert_eq!(held.generation, first.generation, "nothing changed");

    old.batch_execute("COMMIT").await.unwrap();
    let after = rotate(&mut conn).await;
    assert!(after.rotated, "{after:?}");
}

/// `idem-cli purge` on the rotated layout rotates (no row deleted), says so, and never drops
/// a live record however often it runs; a dry run rotates nothing.
#[tokio::test]
async fn purge_rotates_and_never_drops_a_live_record() {
    let (db, _conn) = rotated_db().await;
    let store = PostgresStore::connect(&db.url).await.unwrap();
    completed(
        &store,
        "live",
        b"still here",
        Duration::from_secs(24 * 3600),
    )
    .await;
    completed(&store, "short", b"a second", Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let dry = run_idem_cli("DATABASE_URL", &db.url, &["purge", "--dry-run"]);
    assert_eq!(dry.status.code(), Some(0), "{dry:?}");
    let dry = String::from_utf8_lossy(&dry.stdout).into_owned();
    assert!(dry.contains("a rotation is due"), "{dry}");
    assert_eq!(
        count(
            &db.url,
            "SELECT current::bigint AS n FROM idempotency_generation"
        ),
        0,
        "a dry run rotates nothing"
    );

    for run in 1..=4 {
        let out = run_idem_cli("DATABASE_URL", &db.url, &["purge", "--format", "json"]);
        assert_eq!(out.status.code(), Some(0), "run {run}: {out:?}");
        let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(summary["rotated"], true, "run {run}: {summary}");
        assert_eq!(summary["purged"], 0, "run {run}: rotation deletes no row");
        assert_replays(&store, "live", b"still here", &format!("after purge {run}")).await;
    }
    assert_eq!(
        rows_of(&db.url, "short"),
        0,
        "the expired record was emptied"
    );
    assert_eq!(rows_of(&db.url, "live"), 1);
}

/// A transactional claim under SERIALIZABLE whose snapshot predates a rotation must not insert
/// beside the scope's row that a request made after the rotation, in the table the rotation
/// made current (its snapshot shows neither): it fails with a serialization failure, which
/// the middleware retries in a new transaction (review of 000016, 2026-12-07: it answered
/// `reserved`, two live reservations of one scope).
#[tokio::test]
async fn a_claim_whose_snapshot_predates_a_rotation_fails_to_serialize() {
    let (db, mut conn) = rotated_db().await;
    let store = PostgresStore::connect(&db.url).await.unwrap();
    let mut claim = postgres::establish(&db.url).await.unwrap();
    claim
        .batch_execute(
            "BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT current FROM idempotency_generation",
        )
        .await
        .unwrap();
    assert!(rotate(&mut conn).await.rotated);
    reserved(&store, "k", LEASE).await;

    let late = claim
        .batch_execute(
            "SELECT outcome FROM idempotency_tx_claim(NULL, NULL, 't', 'POST', '/payments', \
             'k', '\\x0909090909090909090909090909090909090909090909090909090909090909', \
             gen_random_uuid(), 60000000)",
        )
        .await;
    let error = late
        .expect_err("the claim must not be reserved")
        .to_string();
    assert!(
        error.contains("could not serialize"),
        "expected a serialization failure, got {error}"
    );
    claim.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(rows_of(&db.url, "k"), 1, "one row for the scope");
}

/// A reserve under REPEATABLE READ (or SERIALIZABLE) whose snapshot shows a rotation, but not
/// the row a READ COMMITTED reserve that read the generation before that rotation then
/// committed into the table the rotation made previous: it must not insert a second row into
/// the current table (on the plain layout the two inserts meet in one unique index, and the
/// later one fails to serialize). It fails with a serialization failure. Review of the
/// reserve's fast path, 2026-12-07: the defect was older than it, both answered `reserved`.
/// The same for the transactional claim's insert-first path under SERIALIZABLE.
#[tokio::test]
async fn a_repeatable_read_reserve_behind_a_writer_that_crossed_a_rotation_fails_to_serialize() {
    behind_a_writer_that_crossed_a_rotation(
        "REPEATABLE READ",
        "SELECT outcome FROM idempotency_reserve('t', 'POST', '/payments', 'k', \
         '\\x0909090909090909090909090909090909090909090909090909090909090909', \
         gen_random_uuid(), 60000000)",
    )
    .await;
    behind_a_writer_that_crossed_a_rotation(
        "SERIALIZABLE",
        "SELECT outcome FROM idempotency_tx_claim(NULL, NULL, 't', 'POST', '/payments', 'k', \
         '\\x0909090909090909090909090909090909090909090909090909090909090909', \
         gen_random_uuid(), 60000000)",
    )
    .await;
}

/// The interleaving above, with the late transaction at `isolation` making `call`.
async fn behind_a_writer_that_crossed_a_rotation(isolation: &str, call: &str) {
    let (db, mut conn) = rotated_db().await;
    let current = count(
        &db.url,
        "SELECT current::bigint AS n FROM idempotency_generation",
    );
    // An uncommitted row of the scope in the current table, inserted straight into it (no
    // scope lock): the first writer's INSERT waits for it, its generation already read.
    let mut holder = postgres::establish(&db.url).await.unwrap();
    holder
        .batch_execute(&format!(
            "BEGIN; INSERT INTO idempotency_keys_{current} (tenant, method, path, \
             idempotency_key, fingerprint, state, token, locked_until, created_at, expires_at) \
             VALUES ('t', 'POST', '/payments', 'k', decode(repeat('07', 32), 'hex'), \
             'in_flight', gen_random_uuid(), now() + interval '1 minute', now(), \
             now() + interval '1 minute')"
        ))
        .await
        .unwrap();
    let first = {
        let url = db.url.clone();
        tokio::spawn(async move {
            let store = PostgresStore::connect(&url).await.unwrap();
            store.reserve(&scope("k"), &FP, LEASE).await
        })
    };
    let waiting = "SELECT count(*) AS n FROM pg_locks \
                   WHERE locktype = 'transactionid' AND NOT granted";
    for _ in 0..500 {
        if count(&db.url, waiting) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        count(&db.url, waiting) > 0,
        "the first reserve never waited"
    );

    assert!(rotate(&mut conn).await.rotated);
    let mut late = postgres::establish(&db.url).await.unwrap();
    late.batch_execute(&format!("BEGIN ISOLATION LEVEL {isolation}; SELECT 1"))
        .await
        .unwrap();
    holder.batch_execute("ROLLBACK").await.unwrap();
    match first.await.unwrap().unwrap() {
        ReserveOutcome::Reserved { .. } => {}
        other => panic!("the first reserve: {other:?}"),
    }

    let second = late.batch_execute(call).await;
    let error = second
        .expect_err(&format!("{isolation}: a second reservation of the scope"))
        .to_string();
    assert!(
        error.contains("could not serialize"),
        "{isolation}: expected a serialization failure, got {error}"
    );
    late.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        rows_of(&db.url, "k"),
        1,
        "{isolation}: one row for the scope"
    );
}

/// Transactional claims under SERIALIZABLE of three different keys, open together, all commit:
/// the claim's look at the previous table takes no read lock of serializable snapshot
/// isolation that the others' probes there (previous test) would conflict with. Review,
/// 2026-12-07: with an index read before the probe, committing the third and then the second
/// failed the second ("identified as a pivot"), in an empty table (one index page).
#[tokio::test]
async fn serializable_claims_of_different_keys_do_not_fail_each_other() {
    let (db, _conn) = rotated_db().await;
    let mut claims = Vec::new();
    for key in ["0zz", "8zz", "fzz"] {
        let mut claim = postgres::establish(&db.url).await.unwrap();
        claim
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL SERIALIZABLE; \
                 SELECT outcome FROM idempotency_tx_claim(NULL, NULL, 't', 'POST', '/payments', \
                 '{key}', '\\x0909090909090909090909090909090909090909090909090909090909090909', \
                 gen_random_uuid(), 60000000)"
            ))
            .await
            .unwrap();
        claims.push((key, claim));
    }
    for (key, claim) in claims.iter_mut().rev() {
        claim
            .batch_execute("COMMIT")
            .await
            .unwrap_or_else(|e| panic!("the claim of {key} failed to commit: {e}"));
    }
    for key in ["0zz", "8zz", "fzz"] {
        assert_eq!(rows_of(&db.url, key), 1, "{key}");
    }
}

/// What a reserve call made over SQL answered: its outcome and the stored body, as text.
#[derive(diesel::QueryableByName, Debug)]
struct Answer {
    #[diesel(sql_type = diesel::sql_types::Text)]
    outcome: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Text>)]
    body: Option<String>,
}

/// `idempotency_reserve` of `key` on `conn`, as the store calls it.
async fn reserve_over_sql(conn: &mut AsyncPgConnection, key: &str) -> Answer {
    let call = diesel::sql_query(
        "SELECT outcome, convert_from(response_body, 'UTF8') AS body \
         FROM idempotency_reserve('t', 'POST', '/payments', $1, \
         '\\x0909090909090909090909090909090909090909090909090909090909090909', \
         gen_random_uuid(), 60000000)",
    )
    .bind::<diesel::sql_types::Text, _>(key);
    let mut rows: Vec<Answer> = diesel_async::RunQueryDsl::load(call, conn).await.unwrap();
    rows.remove(0)
}

/// A transaction that began before a record expired, and whose session still holds the
/// generation from before a rotation, reads the table that rotation made unread: the rotation
/// must not leave there a record that transaction would call live. Review of 000016,
/// 2026-12-07: the rotation judged by its own clock, left the record behind, and after a retry
/// stored a newer response the transaction replayed the old one.
#[tokio::test]
async fn a_transaction_behind_a_rotation_never_replays_a_superseded_response() {
    let db = TestDb::new_rotated(DEFAULT_ROTATION_PERIOD).await;
    let mut rotator = postgres::establish(&db.url).await.unwrap();
    // Due now, the period left as it is (so sessions keep their generation for a while).
    let due = "UPDATE idempotency_generation SET switched_at = now() - period - interval '1 s'";
    let store = PostgresStore::connect(&db.url).await.unwrap();
    completed(&store, "k", b"old", Duration::from_secs(2)).await;
    rotator.batch_execute(due).await.unwrap();
    assert!(rotate(&mut rotator).await.rotated);

    // The late session: it reads the generation now, then opens its transaction while "k" is
    // live.
    let mut late = postgres::establish(&db.url).await.unwrap();
    assert_eq!(
        reserve_over_sql(&mut late, "warm").await.outcome,
        "reserved"
    );
    late.batch_execute("BEGIN; SELECT now()").await.unwrap();
    tokio::time::sleep(Duration::from_millis(2300)).await;

    // "k" has expired; a rotation makes the table that holds it unread, and a retry of "k"
    // runs and stores a newer response.
    rotator.batch_execute(due).await.unwrap();
    assert!(rotate(&mut rotator).await.rotated);
    let token = reserved(&store, "k", LEASE).await;
    let stored = store
        .complete(&scope("k"), &token, &response(b"new"), LEASE)
        .await
        .unwrap();
    assert_eq!(stored, WriteOutcome::Applied);

    let answer = reserve_over_sql(&mut late, "k").await;
    late.batch_execute("COMMIT").await.unwrap();
    assert_eq!(answer.outcome, "existing", "{answer:?}");
    assert_eq!(answer.body.as_deref(), Some("new"), "{answer:?}");
}
