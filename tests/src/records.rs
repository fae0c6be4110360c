//! Reading `idempotency_keys` (and running ad-hoc SQL) from synchronous tests: each call opens
//! one connection on a fresh thread and runtime ([`crate::block_on_fresh_thread`]), bounded by
//! a timeout.

use std::time::Duration;

use diesel::sql_types::{BigInt, Timestamptz};
use diesel::{ExpressionMethods, NullableExpressionMethods, QueryDsl, QueryResult};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idempotency_actix::store::postgres::admin;
pub use idempotency_actix::store::postgres::admin::State;
use idempotency_actix::store::postgres::schema::idempotency_keys as k;

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

/// The method of every [`Seed`] row.
pub const SEED_METHOD: &str = "POST";
/// The path of every [`Seed`] row.
pub const SEED_PATH: &str = "/payments";
/// The fingerprint byte of every [`Seed`] row (32 of them).
pub const SEED_FINGERPRINT_BYTE: u8 = 0xab;
/// The stored headers of a completed [`Seed`] row: no headers, in
/// `StoredResponse::encode_headers`' format.
pub const SEED_HEADERS: &[u8] = &[1, 0, 0, 0, 0];
/// The stored body of a completed [`Seed`] row.
pub const SEED_BODY: &[u8] = b"{}";
/// The stored status of a completed [`Seed`] row.
pub const SEED_STATUS: i16 = 201;

/// A record written as it is, bypassing the store, so a test can place it anywhere in time
/// (fixtures for purge, list, stats and show). Times are seconds from the database's clock:
/// negative is in the past. A completed row gets [`SEED_STATUS`], [`SEED_HEADERS`] and
/// [`SEED_BODY`], completed at `created`; an in-flight row gets a token and its lease ends at
/// `expires` (the store's invariant `locked_until = expires_at`).
#[derive(Debug, Clone, Copy)]
pub struct Seed<'a> {
    /// Scope: tenant.
    pub tenant: &'a str,
    /// Scope: the key (method [`SEED_METHOD`], path [`SEED_PATH`]).
    pub key: &'a str,
    /// In flight or completed.
    pub state: State,
    /// `created_at`, seconds from now.
    pub created: i64,
    /// `expires_at`, seconds from now.
    pub expires: i64,
}

/// `now()` shifted by `secs` seconds, by the database's clock.
fn db_now_plus(secs: i64) -> diesel::expression::SqlLiteral<Timestamptz> {
    diesel::dsl::sql::<Timestamptz>(&format!("(now() + {secs} * interval '1 second')"))
}

/// Insert `seed` (one statement, built on the schema module).
pub async fn seed(conn: &mut AsyncPgConnection, seed: &Seed<'_>) -> QueryResult<()> {
    let scope = (
        k::tenant.eq(seed.tenant),
        k::method.eq(SEED_METHOD),
        k::path.eq(SEED_PATH),
        k::idempotency_key.eq(seed.key),
        k::fingerprint.eq(vec![SEED_FINGERPRINT_BYTE; 32]),
        k::state.eq(seed.state),
        k::token.eq(uuid::Uuid::new_v4()),
        k::created_at.eq(db_now_plus(seed.created)),
        k::expires_at.eq(db_now_plus(seed.expires)),
    );
    let insert = diesel::insert_into(k::table);
    match seed.state {
        State::InFlight => {
            insert
                .values((
                    scope,
                    k::locked_until.eq(db_now_plus(seed.expires).nullable()),
                ))
                .execute(conn)
                .await?
        }
        State::Completed => {
            insert
                .values((
                    scope,
                    k::response_status.eq(SEED_STATUS),
                    k::response_headers.eq(SEED_HEADERS),
                    k::response_body.eq(SEED_BODY),
                    k::completed_at.eq(db_now_plus(seed.created).nullable()),
                ))
                .execute(conn)
                .await?
        }
    };
    Ok(())
}

/// Partitioned layout: `n` completed records (keys `{prefix}{i}`, tenant `t`,
/// [`SEED_METHOD`] [`SEED_PATH`]) whose claims and response rows expire at `expires_sql` (an SQL
/// expression of the database's clock), bypassing the store so a test can place them in a past
/// partition. The claims through the schema module; the response rows by position.
pub fn seed_partitioned_completed(url: &str, prefix: &str, n: usize, expires_sql: &str) {
    let (url, prefix, expires_sql) = (url.to_owned(), prefix.to_owned(), expires_sql.to_owned());
    run(async move {
        let mut conn = admin::establish(&url).await.expect("connect");
        for i in 1..=n {
            let expires = diesel::dsl::sql::<Timestamptz>(&expires_sql);
            let token: Option<uuid::Uuid> = diesel::insert_into(k::table)
                .values((
                    k::tenant.eq("t"),
                    k::method.eq(SEED_METHOD),
                    k::path.eq(SEED_PATH),
                    k::idempotency_key.eq(format!("{prefix}{i}")),
                    k::fingerprint.eq(vec![SEED_FINGERPRINT_BYTE; 32]),
                    k::state.eq(State::Completed),
                    k::token.eq(uuid::Uuid::new_v4()),
                    k::response_status.eq(SEED_STATUS),
                    k::created_at.eq(db_now_plus(-4 * 3600)),
                    k::completed_at.eq(db_now_plus(-4 * 3600).nullable()),
                    k::expires_at.eq(expires),
                ))
                .returning(k::token)
                .get_result(&mut conn)
                .await
                .expect("seed claim");
            // The response row by position (token, expires_at, headers, body), its expiry
            // copied from the claim.
            diesel::sql_query(
                "INSERT INTO idempotency_responses SELECT $1, expires_at, $2, $3 \
                 FROM idempotency_keys WHERE token = $1",
            )
            .bind::<diesel::sql_types::Nullable<diesel::sql_types::Uuid>, _>(token)
            .bind::<diesel::sql_types::Bytea, _>(SEED_HEADERS)
            .bind::<diesel::sql_types::Bytea, _>(SEED_BODY)
            .execute(&mut conn)
            .await
            .expect("seed response");
        }
    })
}

/// Every key in the table, sorted.
pub async fn keys(conn: &mut AsyncPgConnection) -> QueryResult<Vec<String>> {
    k::table
        .select(k::idempotency_key)
        .order(k::idempotency_key)
        .load(conn)
        .await
}

/// Take row locks (`FOR UPDATE`) on the rows with `key`, as a request working on them would;
/// call inside a transaction the caller opened, which holds them until it ends.
/// (On the table that holds a fresh database's records, [`records_table`]: a `FOR UPDATE`
/// through the rotated layout's view locks nothing.)
pub async fn lock_key(conn: &mut AsyncPgConnection, key: &str) -> QueryResult<usize> {
    diesel::sql_query(format!(
        "SELECT tenant FROM {} WHERE idempotency_key = $1 FOR UPDATE",
        records_table()
    ))
    .bind::<diesel::sql_types::Text, _>(key)
    .execute(conn)
    .await
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

/// SQL granting `role` what the store's requests need on the tables of any layout:
/// `idempotency_keys`, and `idempotency_responses` when the database has the partitioned
/// layout (its completes insert there), or the generation tables and `idempotency_generation`
/// on the rotated layout, so a test run with `IDEM_TEST_LAYOUT` tests the fault it means to,
/// not a missing grant.
pub fn grant_store_tables(role: &str) -> String {
    format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys TO \"{role}\"; \
         DO $$ BEGIN IF to_regclass('idempotency_responses') IS NOT NULL THEN \
         GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_responses TO \"{role}\"; \
         END IF; IF to_regclass('idempotency_generation') IS NOT NULL THEN \
         GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency_keys_0, idempotency_keys_1, \
         idempotency_keys_2 TO \"{role}\"; \
         GRANT SELECT, UPDATE (singleton) ON idempotency_generation TO \"{role}\"; \
         END IF; END $$"
    )
}

/// The table a fresh test database keeps its records in, for a test that locks it, puts a
/// trigger on it or revokes a privilege on it: `idempotency_keys`, or on the rotated layout
/// (`IDEM_TEST_LAYOUT=rotated`, where `idempotency_keys` is a view) its current generation
/// table, `idempotency_keys_0` until a rotation.
pub fn records_table() -> &'static str {
    match crate::database::test_layout() {
        Some(idempotency_actix::store::postgres::Layout::Rotated { .. }) => "idempotency_keys_0",
        _ => "idempotency_keys",
    }
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
