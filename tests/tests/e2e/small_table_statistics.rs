//! Migration 000018 (docs/sql.md, "Statistics of a table that starts empty"): autovacuum
//! leaves the request path's tables alone until they hold enough rows that no plan made from
//! their statistics reads them whole.
//!
//! The danger it closes: a table that starts empty (a new deployment's, the rotated layout's
//! current table after every rotation, a new response partition) is analyzed by autovacuum as
//! soon as 50 rows changed. With a few pages in its statistics, a sequential scan is the
//! cheaper plan for a primary-key lookup, and the store's functions cache that plan (a generic
//! plan) until the next analyze, up to a minute later, while the table grows: measured, a
//! reserve took 40-55 ms on a 300,000-row table instead of 0.5 ms. So each test runs its own
//! cluster with autovacuum every second, writes more than 50 records through the store, and
//! checks that autovacuum left the tables alone and that the cached plan is an index scan;
//! then writes past the new threshold and checks that autovacuum did analyze them, and that
//! the plan is still an index scan.

use std::time::{Duration, Instant};

use bytes::Bytes;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::{self, admin, PartitionInterval, PostgresStore};
use idempotency_actix::store::{
    Fingerprint, IdempotencyStore, ReserveOutcome, Scope, StoredResponse, WriteOutcome,
};
use idempotency_e2e::TempCluster;

/// Records written before the first look: past autovacuum's default thresholds (50 changed
/// rows for an analyze, 50 dead rows for a vacuum), short of the ones 000018 sets, and few
/// enough (a few pages) that statistics taken now make a sequential scan the cheaper plan.
const FIRST: usize = 60;
/// Records in all once the second phase is written: past 000018's thresholds (1,000 changed
/// rows) for every table, the response partitions included, which only see inserts.
const TOTAL: usize = 1_300;
/// Long enough for autovacuum, every second here, to visit the database a few times.
const AUTOVACUUM_VISITS: Duration = Duration::from_secs(4);

#[derive(Clone, Copy, Debug)]
enum Layout {
    Plain,
    Rotated,
    Partitioned,
}

#[derive(diesel::QueryableByName)]
struct PlanLine {
    #[diesel(sql_type = Text, column_name = "QUERY PLAN")]
    line: String,
}

#[derive(diesel::QueryableByName)]
struct Name {
    #[diesel(sql_type = Text)]
    name: String,
}

#[derive(diesel::QueryableByName)]
struct Visits {
    #[diesel(sql_type = BigInt)]
    analyzed: i64,
    #[diesel(sql_type = BigInt)]
    vacuumed: i64,
    #[diesel(sql_type = BigInt)]
    changed: i64,
}

fn scope(i: usize) -> Scope {
    Scope {
        tenant: "t".into(),
        method: "POST".into(),
        path: "/payments".into(),
        key: format!("k-{i}"),
    }
}

/// Records `from..to`, each reserved and completed through the store.
async fn write_records(store: &PostgresStore, from: usize, to: usize) {
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"text/plain"))],
        body: Bytes::from_static(b"created"),
    };
    for i in from..to {
        let outcome = store
            .reserve(&scope(i), &Fingerprint([7; 32]), Duration::from_secs(60))
            .await
            .unwrap();
        let ReserveOutcome::Reserved { token } = outcome else {
            panic!("{outcome:?}");
        };
        let written = store
            .complete(&scope(i), &token, &response, Duration::from_secs(3600))
            .await
            .unwrap();
        assert_eq!(written, WriteOutcome::Applied);
    }
}

/// The tables a request reads by key, with the columns of that key and sample values: the
/// records table (the rotated layout's current one) and, on the partitioned layout, the
/// partition the responses went to.
async fn looked_up_tables(
    conn: &mut AsyncPgConnection,
    layout: Layout,
) -> Vec<(String, &'static str)> {
    let by_scope = "tenant = $1 AND method = $2 AND path = $3 AND idempotency_key = $4";
    match layout {
        Layout::Plain => vec![("idempotency_keys".into(), by_scope)],
        Layout::Rotated => {
            let current: Name = diesel::sql_query(
                "SELECT 'idempotency_keys_' || current AS name FROM idempotency_generation",
            )
            .get_result(conn)
            .await
            .unwrap();
            vec![(current.name, by_scope)]
        }
        Layout::Partitioned => {
            let partitions: Vec<Name> = diesel::sql_query(
                "SELECT DISTINCT tableoid::regclass::text AS name FROM idempotency_responses",
            )
            .load(conn)
            .await
            .unwrap();
            assert_eq!(partitions.len(), 1, "responses in one partition");
            assert_ne!(
                partitions[0].name, "idempotency_responses_default",
                "the responses belong in a range partition, created ahead"
            );
            vec![
                ("idempotency_keys".into(), by_scope),
                (
                    partitions[0].name.clone(),
                    "token = $1::uuid AND expires_at = $2::timestamptz",
                ),
            ]
        }
    }
}

/// The generic plan (the one a function caches) of a lookup of `table` by `key`.
async fn generic_plan(url: &str, table: &str, key: &str) -> String {
    let mut conn = postgres::establish(url).await.unwrap();
    let params = if key.starts_with("token") {
        "(text, text)"
    } else {
        "(text, text, text, text)"
    };
    let args = if key.starts_with("token") {
        "('00000000-0000-0000-0000-000000000000', '2030-01-01 00:00:00+00')"
    } else {
        "('t', 'POST', '/payments', 'k-1')"
    };
    conn.batch_execute(&format!(
        "SET plan_cache_mode = force_generic_plan;
         PREPARE lookup{params} AS SELECT 1 FROM \"{table}\" WHERE {key}"
    ))
    .await
    .unwrap();
    let plan: Vec<PlanLine> = diesel::sql_query(format!("EXPLAIN EXECUTE lookup{args}"))
        .load(&mut conn)
        .await
        .unwrap();
    plan.into_iter().map(|l| l.line + "\n").collect()
}

async fn autovacuum_visits(conn: &mut AsyncPgConnection, table: &str) -> Visits {
    diesel::sql_query(
        "SELECT autoanalyze_count AS analyzed, autovacuum_count AS vacuumed,
                n_mod_since_analyze AS changed
           FROM pg_stat_user_tables WHERE relid = $1::regclass",
    )
    .bind::<Text, _>(table)
    .get_result(conn)
    .await
    .unwrap()
}

async fn statistics_wait_until_the_table_is_large(layout: Layout) {
    let cluster = match TempCluster::start(&["autovacuum_naptime = 1"], &[]) {
        Ok(c) => c,
        Err(idempotency_e2e::ClusterError::NotInstalled) => {
            idempotency_e2e::skip_without_binaries("small_table_statistics");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let url = cluster.url();
    match layout {
        Layout::Plain => postgres::run_migrations(&url).await.map(drop),
        Layout::Rotated => {
            postgres::run_migrations_rotated(&url, postgres::DEFAULT_ROTATION_PERIOD)
                .await
                .map(drop)
        }
        Layout::Partitioned => {
            postgres::run_migrations_partitioned(&url, PartitionInterval::Hourly)
                .await
                .map(drop)
        }
    }
    .unwrap();
    let mut conn = postgres::establish(&url).await.unwrap();
    if let Layout::Rotated = layout {
        // The current table as every rotation leaves it: truncated.
        conn.batch_execute("UPDATE idempotency_generation SET period = interval '1 microsecond'")
            .await
            .unwrap();
        assert!(
            admin::rotate(&mut conn, Duration::from_secs(5), Duration::ZERO)
                .await
                .unwrap()
                .rotated
        );
    }
    if let Layout::Partitioned = layout {
        admin::create_partitions(&mut conn, 3, Duration::from_secs(5))
            .await
            .unwrap();
    }
    let store = PostgresStore::connect(&url).await.unwrap();

    // The responses go to the partition of their expiry, an hour ahead: one partition for
    // the whole test.
    idempotency_e2e::database::clear_of_the_hour(Duration::from_secs(300)).await;
    write_records(&store, 0, FIRST).await;
    let tables = looked_up_tables(&mut conn, layout).await;
    for (table, _) in &tables {
        // Autovacuum acts on the statistics the writers' backends report, which an idle
        // backend flushes within about 10 s: once they show, it has had its chance after a few
        // more visits.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let visits = autovacuum_visits(&mut conn, table).await;
            if visits.changed >= FIRST as i64 || visits.analyzed > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{layout:?}: {table}'s changes never reported"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    tokio::time::sleep(AUTOVACUUM_VISITS).await;
    for (table, key) in &tables {
        let plan = generic_plan(&url, table, key).await;
        assert!(!plan.contains("Seq Scan"), "{layout:?}, {table}:\n{plan}");
        let visits = autovacuum_visits(&mut conn, table).await;
        assert_eq!(
            (visits.analyzed, visits.vacuumed),
            (0, 0),
            "{layout:?}: autovacuum visited {table} with {FIRST} records (analyzed, vacuumed)"
        );
    }

    write_records(&store, FIRST, TOTAL).await;
    for (table, key) in &tables {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if autovacuum_visits(&mut conn, table).await.analyzed > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{layout:?}: {table} not analyzed by autovacuum with {TOTAL} records"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let plan = generic_plan(&url, table, key).await;
        assert!(!plan.contains("Seq Scan"), "{layout:?}, {table}:\n{plan}");
    }
    drop(store);
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_layout_statistics_wait_until_the_table_is_large() {
    statistics_wait_until_the_table_is_large(Layout::Plain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_layout_statistics_wait_until_the_current_table_is_large() {
    statistics_wait_until_the_table_is_large(Layout::Rotated).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_layout_statistics_wait_until_the_tables_are_large() {
    statistics_wait_until_the_table_is_large(Layout::Partitioned).await;
}
