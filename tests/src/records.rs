//! Reading `idempotency_keys` (and running ad-hoc SQL) from synchronous tests: each call opens
//! one connection on a fresh thread and runtime ([`crate::block_on_fresh_thread`]), bounded by
//! a timeout.

use std::time::Duration;

use diesel::sql_types::{BigInt, Bytea, Nullable, SmallInt, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres;

/// Longest time one helper may take.
const TIMEOUT: Duration = Duration::from_secs(20);

/// One row of `idempotency_keys`, as the tests look at it.
#[derive(Debug, Clone, diesel::QueryableByName)]
pub struct Record {
    /// Scope: tenant.
    #[diesel(sql_type = Text)]
    pub tenant: String,
    /// Scope: method.
    #[diesel(sql_type = Text)]
    pub method: String,
    /// Scope: path.
    #[diesel(sql_type = Text)]
    pub path: String,
    /// Scope: the key.
    #[diesel(sql_type = Text)]
    pub idempotency_key: String,
    /// `in_flight` or `completed`.
    #[diesel(sql_type = Text)]
    pub state: String,
    /// The fencing token, as text.
    #[diesel(sql_type = Nullable<Text>)]
    pub token: Option<String>,
    /// Stored status.
    #[diesel(sql_type = Nullable<SmallInt>)]
    pub response_status: Option<i16>,
    /// Stored headers, encoded (`StoredResponse::decode_headers`).
    #[diesel(sql_type = Nullable<Bytea>)]
    pub response_headers: Option<Vec<u8>>,
    /// Stored body.
    #[diesel(sql_type = Nullable<Bytea>)]
    pub response_body: Option<Vec<u8>>,
}

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

/// Every row of `idempotency_keys`, ordered by scope.
pub fn records(url: &str) -> Vec<Record> {
    let url = url.to_owned();
    run(async move {
        let mut conn = postgres::establish(&url).await.expect("connect");
        diesel::sql_query(
            "SELECT tenant, method, path, idempotency_key, state, token::text AS token, \
             response_status, response_headers, response_body FROM idempotency_keys \
             ORDER BY tenant, method, path, idempotency_key",
        )
        .load::<Record>(&mut conn)
        .await
        .expect("reading idempotency_keys")
    })
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
        let mut conn = postgres::establish(&url).await.expect("connect");
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
        let mut conn = postgres::establish(&url).await.expect("connect");
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
            let mut conn = postgres::establish(&admin_url).await.ok()?;
            conn.batch_execute(&sql).await.ok()
        });
        if !matches!(dropped, Some(Some(()))) {
            eprintln!("warning: could not drop role {}", self.name);
        }
    }
}
