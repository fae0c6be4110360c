//! The test-database harness itself: fresh databases are created, migrated and dropped, and a
//! throwaway cluster can be started when no server is around.

use diesel_async::RunQueryDsl;
use idempotency_actix::store::postgres;
use idempotency_e2e::{server_url, TempCluster, TestDb};

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

async fn database_count(name: &str) -> i64 {
    let mut conn = postgres::establish(&server_url()).await.unwrap();
    diesel::sql_query(format!(
        "SELECT count(*) AS n FROM pg_database WHERE datname = '{name}'"
    ))
    .get_result::<Count>(&mut conn)
    .await
    .unwrap()
    .n
}

#[tokio::test]
async fn fresh_databases_are_migrated_unique_and_dropped() {
    let a = TestDb::new().await;
    let b = TestDb::new_unmigrated().await;
    assert_ne!(a.name, b.name);
    assert_eq!(database_count(&a.name).await, 1);

    let mut conn = postgres::establish(&a.url).await.unwrap();
    assert!(postgres::table_exists(&mut conn).await.unwrap());
    assert!(postgres::pending_migrations(&a.url)
        .await
        .unwrap()
        .is_empty());
    drop(conn);

    let mut conn = postgres::establish(&b.url).await.unwrap();
    assert!(!postgres::table_exists(&mut conn).await.unwrap());
    assert_eq!(postgres::pending_migrations(&b.url).await.unwrap().len(), 1);
    drop(conn);

    // Migrating twice is harmless; the second run applies nothing.
    assert_eq!(postgres::run_migrations(&b.url).await.unwrap().len(), 1);
    assert!(postgres::run_migrations(&b.url).await.unwrap().is_empty());

    let name = a.name.clone();
    drop(a);
    assert_eq!(database_count(&name).await, 0, "dropped with the TestDb");
}

#[actix_web::test]
async fn migrations_run_from_inside_an_actix_runtime() {
    let db = TestDb::new_unmigrated().await;
    let applied = postgres::run_migrations(&db.url).await.unwrap();
    assert_eq!(applied.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_apply_each_version_once() {
    let db = TestDb::new_unmigrated().await;
    let runs = (0..4).map(|_| {
        let url = db.url.clone();
        tokio::spawn(async move { postgres::run_migrations(&url).await })
    });
    let mut applied = 0;
    for run in runs {
        applied += run.await.unwrap().unwrap().len();
    }
    assert_eq!(applied, 1, "exactly one run applied the migration");
}

#[test]
fn throwaway_cluster_starts_and_stops() {
    let cluster = match TempCluster::start(&[], &[]) {
        Ok(c) => c,
        Err(idempotency_e2e::ClusterError::NotInstalled) => {
            eprintln!("skipped: initdb/pg_ctl not installed");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let url = cluster.url();
    let ok = idempotency_e2e::block_on_fresh_thread(async move {
        postgres::run_migrations(&url).await.map(|v| v.len())
    });
    assert_eq!(ok.unwrap().unwrap(), 1);
    let dir = cluster.data_dir.clone();
    drop(cluster);
    assert!(!dir.exists(), "cluster directory removed");
}
