//! Test harness for the end-to-end tests: a PostgreSQL server to test against, and a fresh
//! database per test that is dropped afterwards.
//!
//! Where the server comes from, in order ([`server_url`]):
//! 1. `DATABASE_URL`, when set (any database on the server; test databases are created next to
//!    it, so the role needs `CREATEDB`).
//! 2. `postgres://postgres@127.0.0.1:5432/postgres`, when something answers there.
//! 3. A throwaway cluster: `initdb` + `pg_ctl` from `PATH` or `/usr/lib/postgresql/*/bin`, in a
//!    temporary directory, on a free port, stopped and deleted when the test process exits.
//! 4. Otherwise a panic naming what to install.
//!
//! `IDEM_E2E_SKIP_LOCAL=1` skips step 2 (to exercise the throwaway cluster on a machine that
//! has a local server).
//!
//! Modules by job: [`database`] (per-test databases), [`cluster`] (throwaway clusters),
//! [`urls`] (connection strings), [`records`] (reading the table), and the HTTP, process and
//! proxy helpers.
//!
//! ```no_run
//! # async fn demo() {
//! let db = idempotency_e2e::TestDb::new().await; // created and migrated
//! let store = idempotency_actix::store::PostgresStore::connect(&db.url).await.unwrap();
//! # let _ = store;
//! } // dropped here: DROP DATABASE ... WITH (FORCE)
//! ```

use std::future::Future;
use std::time::{Duration, Instant};

pub mod cluster;
pub mod database;
pub mod faults;
pub mod proc;
pub mod proxy;
pub mod raw_http;
pub mod records;
pub mod redis_server;
pub mod server;
pub mod urls;

pub use cluster::{skip_without_binaries, ClusterError, TempCluster};
pub use database::{migrate_in_test_layout, server_url, TestDb, LOCAL_SERVER_URL};
pub use urls::with_database;

/// Run `future` to completion on a new thread with its own current-thread runtime, so it works
/// from any context (inside a runtime, in `Drop`, without a runtime). `None` if it panicked.
pub fn block_on_fresh_thread<F>(future: F) -> Option<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()
            .map(|rt| rt.block_on(future))
    })
    .join()
    .ok()
    .flatten()
}

/// Wait until `check` returns true or `timeout` passes; returns the last result.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
