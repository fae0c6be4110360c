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

/// How many migrations the repository ships: one directory each under `migrations/`, the single
/// source of the schema (counted there rather than written down, so a new migration needs no
/// edit here).
fn migration_count() -> usize {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let count = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|e| e.path().join("up.sql").is_file())
        })
        .count();
    assert!(
        count >= 5,
        "expected at least the five shipped migrations, found {count}"
    );
    count
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
    assert_eq!(
        postgres::pending_migrations(&b.url).await.unwrap().len(),
        migration_count()
    );
    drop(conn);

    // Migrating twice is harmless; the second run applies nothing.
    assert_eq!(
        postgres::run_migrations(&b.url).await.unwrap().len(),
        migration_count()
    );
    assert!(postgres::run_migrations(&b.url).await.unwrap().is_empty());

    let name = a.name.clone();
    drop(a);
    assert_eq!(database_count(&name).await, 0, "dropped with the TestDb");
}

#[actix_web::test]
async fn migrations_run_from_inside_an_actix_runtime() {
    let db = TestDb::new_unmigrated().await;
    let applied = postgres::run_migrations(&db.url).await.unwrap();
    assert_eq!(applied.len(), migration_count());
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
    assert_eq!(
        applied,
        migration_count(),
        "exactly one run applied each migration"
    );
}

#[test]
fn throwaway_cluster_starts_and_stops() {
    let cluster = match TempCluster::start(&[], &[]) {
        Ok(c) => c,
        Err(idempotency_e2e::ClusterError::NotInstalled) => {
            idempotency_e2e::skip_without_binaries("throwaway_cluster_starts_and_stops");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let url = cluster.url();
    let ok = idempotency_e2e::block_on_fresh_thread(async move {
        postgres::run_migrations(&url).await.map(|v| v.len())
    });
    assert_eq!(ok.unwrap().unwrap(), migration_count());
    let dir = cluster.data_dir.clone();
    drop(cluster);
    assert!(!dir.exists(), "cluster directory removed");
}

/// Run by `server_url_falls_back_to_a_throwaway_cluster` in a child process.
#[tokio::test]
#[ignore = "run as a child process with IDEM_E2E_SKIP_LOCAL=1"]
async fn child_uses_the_fallback_server() {
    let url = server_url();
    println!("FALLBACK_URL={url}");
    let db = TestDb::new().await;
    let store = idempotency_actix::store::PostgresStore::connect(&db.url)
        .await
        .unwrap();
    store.check().await.unwrap();
}

#[test]
fn server_url_falls_back_to_a_throwaway_cluster_and_cleans_it_up() {
    if std::env::var_os("DATABASE_URL").is_some() {
        eprintln!("skipped: DATABASE_URL is set, so the fallback is not used");
        return;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's name in this binary: its module path below the crate, then the name.
            "postgres_harness::child_uses_the_fallback_server",
            "--ignored",
            "--nocapture",
        ])
        .env("IDEM_E2E_SKIP_LOCAL", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    // The child's panic message goes to its stderr.
    if String::from_utf8_lossy(&output.stderr).contains("initdb/pg_ctl are not on PATH") {
        idempotency_e2e::skip_without_binaries(
            "server_url_falls_back_to_a_throwaway_cluster_and_cleans_it_up",
        );
        return;
    }
    assert!(
        output.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let url = stdout
        .lines()
        .find_map(|l| l.strip_prefix("FALLBACK_URL="))
        .expect("child printed its server URL")
        .to_owned();
    assert_ne!(url, idempotency_e2e::LOCAL_SERVER_URL);
    let addr = idempotency_e2e::proxy::host_port(&url);
    // The watchdog stops the cluster within a few seconds of the child's exit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(&addr).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "cluster at {addr} still running"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}
