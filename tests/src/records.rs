//! Reading `idempotency_keys` (and running ad-hoc SQL) from synchronous tests: each call opens
//! one connection on a fresh thread and runtime ([`crate::block_on_fresh_thread`]), bounded by
//! a timeout.

use std::time::Duration;

use diesel::sql_types::BigInt;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::admin;
pub use idempotency_actix::store::postgres::admin::State;

/// Longest time one helper may take.
const TIMEOUT: Duration = Duration::from_secs(20);

/// One row of `idempotency_keys` with its stored response: the library's row type (it derefs
/// to [`admin::Record`] for the columns).
pub type Record = admin::Detail;

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

fn run<F, T>(future: F) -> T
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    crate::block_on_fresh_thread(async move {
        tokio::time::timeout(TIMEOUT, future)
            .await
            .expect("SQL helper timed out")
    })
    .expect("SQL helper panicked")
}

/// Every row of `idempotency_keys`, ordered by scope (the library's admin query).
pub fn records(url: &str) -> Vec<Record> {
    let url = url.to_owned();
    run(async move {
        let mut conn = admin::establish(&url).await.expect("connect");
        admin::all(&mut conn)
            .await
            .expect("reading idempotency_keys")
    })
}

/// How many rows are in `state`.
pub fn count_in_state(url: &str, state: State) -> usize {
    records(url).iter().filter(|r| r.state == state).count()
}

/// The rows whose key is `key` (any tenant, method, path).
pub fn records_for_key(url: &str, key: &str) -> Vec<Record> {
    records(url)
        .into_iter()
        .filter(|r| r.idempotency_key == key)
        .collect()
}

/// `SELECT count(*) AS n ...`: pass the whole statement, whose single column is named `n`.
pub fn count(url: &str, sql: &str) -> i64 {
    let (url, sql) = (url.to_owned(), sql.to_owned());
    run(async move {
        let mut conn = admin::establish(&url).await.expect("connect");
        diesel::sql_query(&sql)
            .get_result::<Count>(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .n
    })
}

/// Run statements (simple protocol, several allowed).
pub fn execute(url: &str, sql: &str) {
    let (url, sql) = (url.to_owned(), sql.to_owned());
    run(async move {
        let mut conn = admin::establish(&url).await.expect("connect");
        conn.batch_execute(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    })
}

/// A login role (with password `pw`) that is dropped, with everything it owns, on drop. Create
/// it on the server of `admin_url`; grant it privileges in each database yourself.
#[derive(Debug)]
pub struct TempRole {
    /// The role name.
    pub name: String,
    admin_url: String,
}

impl TempRole {
    /// Create the role (non-superuser, LOGIN, password `pw`).
    pub fn create(admin_url: &str, prefix: &str) -> TempRole {
        let name = format!(
            "{prefix}_{}_{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.subsec_nanos())
                .unwrap_or(0)
        );
        execute(
            admin_url,
            &format!("CREATE ROLE \"{name}\" LOGIN NOSUPERUSER PASSWORD 'pw'"),
        );
        TempRole {
            name,
            admin_url: admin_url.to_owned(),
        }
    }

    /// `url` with this role as the user (password `pw`).
    pub fn url_for(&self, url: &str) -> String {
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .expect("a postgres:// URL");
        let host = rest.split_once('@').map_or(rest, |(_, host)| host);
        format!("postgres://{}:pw@{host}", self.name)
    }
}

impl Drop for TempRole {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let sql = format!("DROP ROLE IF EXISTS \"{}\"", self.name);
        let dropped = crate::block_on_fresh_thread(async move {
            let mut conn = admin::establish(&admin_url).await.ok()?;
            conn.batch_execute(&sql).await.ok()
        });
        if !matches!(dropped, Some(Some(()))) {
            eprintln!("warning: could not drop role {}", self.name);
        }
    }
}
