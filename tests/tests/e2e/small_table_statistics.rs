//! Migration 000018 (docs/sql.md, "Statistics of a table that starts empty"): the store's
//! PL/pgSQL functions look records up by index whatever the tables' statistics say.
//!
//! The danger it closes: a table that starts empty (a new deployment's, the rotated layout's
//! current table after every rotation, a new response partition) gets statistics while it
//! holds a page or two (autovacuum's first analyze after 50 changed rows, or an `ANALYZE` by
//! hand). A sequential scan is then the cheaper plan for a primary-key lookup, and each
//! session caches it (a generic plan) until the next analyze while the table grows: measured,
//! a reserve took 40-60 ms on a 300,000-row table instead of 0.5 ms. Here the tables are
//! analyzed with 60 records in them, and then the functions are called often enough to plan
//! generically, in one transaction whose own scan counts (`pg_stat_xact_user_tables`) tell
//! which plans ran. Before 000018: sequential scans in all three layouts.

use std::time::Duration;

use bytes::Bytes;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::{self, admin, PartitionInterval, PostgresStore};
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, ReserveOutcome, Scope, StoredResponse, WriteOutcome,
};
use idempotency_e2e::TestDb;

/// Records stored before the tables are analyzed: a page or two.
const STORED: usize = 60;
/// Calls of each kind afterwards: past the five after which PL/pgSQL plans generically.
const CALLS: usize = 12;

#[derive(Clone, Copy, Debug)]
enum Layout {
    Plain,
    Rotated,
    Partitioned,
}

async fn provisioned(layout: Layout) -> TestDb {
    match layout {
        Layout::Plain => TestDb::new().await,
        Layout::Rotated => TestDb::new_rotated(postgres::DEFAULT_ROTATION_PERIOD).await,
        Layout::Partitioned => TestDb::new_partitioned(PartitionInterval::Hourly).await,
    }
}

#[derive(diesel::QueryableByName)]
struct Scans {
    #[diesel(sql_type = BigInt)]
    seq: i64,
    #[diesel(sql_type = BigInt)]
    idx: i64,
}

#[derive(diesel::QueryableByName)]
struct Name {
    #[diesel(sql_type = Text)]
    name: String,
}

fn scope(key: &str) -> Scope {
    Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: key.into(),
    }
}

/// The arguments every function takes first: the scope of key `key`.
fn scope_args(key: &str) -> String {
    format!("'t', 'POST', '/payments', '{key}'")
}

const FINGERPRINT: &str = "decode(repeat('07', 32), 'hex')";
const LEASE_US: &str = "60000000::bigint";

async fn store_records(url: &str, layout: Layout) {
    let store = PostgresStore::connect(url).await.unwrap();
    if let Layout::Partitioned = layout {
        let mut conn = postgres::establish(url).await.unwrap();
        admin::create_partitions(&mut conn, 3, Duration::from_secs(5))
            .await
            .unwrap();
    }
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(b"created"),
    };
    for i in 0..STORED {
        let scope = scope(&format!("k-{i}"));
        let outcome = store
            .reserve(&scope, &Fingerprint([7; 32]), Duration::from_secs(60))
            .await
            .unwrap();
        let ReserveOutcome::Reserved { token } = outcome else {
            panic!("{outcome:?}");
        };
        let written = store
            .complete(&scope, &token, &response, Duration::from_secs(3600))
            .await
            .unwrap();
        assert_eq!(written, WriteOutcome::Applied);
    }
}

/// Each request-path function called `CALLS` times in one transaction on `conn`: replays,
/// misses and their completes, renewals, checks and releases; then the transaction's scans of
/// the record tables (and response partitions), and it is rolled back.
async fn scans_of_the_request_path(conn: &mut AsyncPgConnection, layout: Layout) -> Scans {
    conn.batch_execute("BEGIN").await.unwrap();
    let mut statements = Vec::new();
    for i in 0..CALLS {
        let token = format!("'00000000-0000-4000-8000-{i:012}'::uuid");
        let (replay, miss) = (scope_args(&format!("k-{i}")), scope_args(&format!("m-{i}")));
        let held = scope_args(&format!("h-{i}"));
        statements.push(format!(
            "SELECT outcome FROM idempotency_reserve({replay}, {FINGERPRINT}, {token}, {LEASE_US})"
        ));
        if let Layout::Rotated = layout {
            // PL/pgSQL only here; elsewhere a SQL function inlined into the store's statement.
            statements.push(format!("SELECT outcome FROM idempotency_replay({replay})"));
        }
        statements.push(format!(
            "SELECT outcome FROM idempotency_reserve({miss}, {FINGERPRINT}, {token}, {LEASE_US})"
        ));
        statements.push(format!(
            "SELECT idempotency_complete({miss}, {token}, 201::smallint, '\\x'::bytea, \
             '\\x'::bytea, 3600000000::bigint)"
        ));
        statements.push(format!(
            "SELECT outcome FROM idempotency_reserve({held}, {FINGERPRINT}, {token}, {LEASE_US})"
        ));
        statements.push(format!(
            "SELECT idempotency_renew_lease({held}, {token}, {LEASE_US})"
        ));
        statements.push(format!("SELECT idempotency_completed_by({held}, {token})"));
        statements.push(format!("SELECT idempotency_release({held}, {token})"));
    }
    for statement in &statements {
        diesel::sql_query(statement)
            .execute(conn)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let scans: Scans = diesel::sql_query(
        "SELECT coalesce(sum(seq_scan), 0)::bigint AS seq,
                coalesce(sum(idx_scan), 0)::bigint AS idx
           FROM pg_stat_xact_user_tables
          WHERE relname LIKE 'idempotency\\_keys%' OR relname LIKE 'idempotency\\_responses%'",
    )
    .get_result(conn)
    .await
    .unwrap();
    conn.batch_execute("ROLLBACK").await.unwrap();
    scans
}

async fn lookups_stay_index_scans_on_small_statistics(layout: Layout) {
    let db = provisioned(layout).await;
    store_records(&db.url, layout).await;
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    // The statistics of tables a page or two long, as autovacuum's first analyze takes them.
    conn.batch_execute("ANALYZE").await.unwrap();
    let scans = scans_of_the_request_path(&mut conn, layout).await;
    assert_eq!(
        scans.seq, 0,
        "{layout:?}: sequential scans of the record tables on the request path ({} index scans)",
        scans.idx
    );
    assert!(scans.idx > 0, "{layout:?}: the scenario read no table");
}

#[tokio::test]
async fn plain_layout_lookups_stay_index_scans_on_small_statistics() {
    lookups_stay_index_scans_on_small_statistics(Layout::Plain).await;
}

#[tokio::test]
async fn rotated_layout_lookups_stay_index_scans_on_small_statistics() {
    lookups_stay_index_scans_on_small_statistics(Layout::Rotated).await;
}

#[tokio::test]
async fn partitioned_layout_lookups_stay_index_scans_on_small_statistics() {
    lookups_stay_index_scans_on_small_statistics(Layout::Partitioned).await;
}

/// Every PL/pgSQL function the store calls on the request path carries both settings
/// (`enable_seqscan` and `jit`, which a plan priced past `jit_above_cost` by the first would
/// otherwise compile on each call), in each layout: a later migration that redefines one (`CREATE OR REPLACE` drops its settings) and
/// forgets it fails here.
#[tokio::test]
async fn every_request_function_plans_without_sequential_scans() {
    for (layout, expected) in [
        (Layout::Plain, 6),
        (Layout::Rotated, 7),
        (Layout::Partitioned, 6),
    ] {
        let db = provisioned(layout).await;
        let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
        let functions: Vec<Name> = diesel::sql_query(
            "SELECT p.proname::text || coalesce(' ' || array_to_string(p.proconfig, ' '), '')
                    AS name
               FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
              WHERE l.lanname = 'plpgsql'
                AND p.proname IN ('idempotency_reserve', 'idempotency_replay',
                                  'idempotency_complete', 'idempotency_tx_claim',
                                  'idempotency_release', 'idempotency_renew_lease',
                                  'idempotency_completed_by')
              ORDER BY 1",
        )
        .load(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            functions.len(),
            expected,
            "{layout:?}: {:?}",
            names(&functions)
        );
        for function in &functions {
            assert!(
                function.name.contains("enable_seqscan=off") && function.name.contains("jit=off"),
                "{layout:?}: {}",
                function.name
            );
        }
    }
}

fn names(functions: &[Name]) -> Vec<&str> {
    functions.iter().map(|f| f.name.as_str()).collect()
}
