//! The admin API `idem-cli` and the test harness use: reading, releasing and purging records,
//! and the helpers both need to report failures the same way the middleware does.
//!
//! **Not part of the stable API.** It is `pub` only because `idem-cli` (another crate of this
//! workspace) calls it, and `#[doc(hidden)]` so it stays out of the user-facing docs; it may
//! change in any release. Applications use [`PostgresStore`](super::PostgresStore).
//!
//! Every statement behind these functions lives in the private `sql` module, next to those of
//! the request path, and is described in `docs/sql.md`. Rows come back as [`Record`] (the
//! columns of the [`schema`]), or [`Detail`] (a record with its stored response).

use std::time::{Duration, SystemTime};

use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::pg::{Pg, PgValue};
use diesel::sql_types::Timestamptz;
use diesel::{QueryResult, Queryable, Selectable};
use diesel_async::AsyncPgConnection;

pub use super::error::{
    classify_connection_error, classify_error, classify_query_error, not_provisioned, table_exists,
    MIGRATE_HINT,
};
pub use super::schema;
use super::schema::idempotency_keys as k;
pub use super::schema::State;
use super::sql;
pub use super::{establish, establish_within, redact, with_dbname};

/// Advisory lock key of a running `idem-cli purge`: the ASCII bytes of "idempurg" as a
/// bigint, its low 32 bits XORed with the oid of the `idempotency_keys` table it purges (so
/// purges of two schemas' tables in one database never skip each other). Documented in
/// docs/operations.md so operators can find the holder in `pg_locks` (`classid` = 1768187245,
/// `objid` = 1886745191 XOR the table's oid, `objsubid` = 1).
pub const PURGE_LOCK_KEY: i64 = 0x6964_656d_7075_7267;

/// One row of `idempotency_keys` without its stored response bytes, as read at `read_at` by
/// the database's clock (ages and lease times are measured against that clock, the same one
/// the store uses for leases and TTLs).
#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = k, check_for_backend(Pg))]
pub struct Record {
    /// Scope: tenant (empty for the global scope).
    pub tenant: String,
    /// Scope: HTTP method.
    pub method: String,
    /// Scope: path.
    pub path: String,
    /// Scope: the key.
    pub idempotency_key: String,
    /// SHA-256 of the request.
    pub fingerprint: Vec<u8>,
    /// In flight or completed.
    pub state: State,
    /// Fencing token of the reservation.
    pub token: Option<uuid::Uuid>,
    /// Lease deadline (in-flight rows).
    pub locked_until: Option<Time>,
    /// Stored status (completed rows).
    pub response_status: Option<i16>,
    /// When the reservation was made.
    pub created_at: Time,
    /// When the response was stored.
    pub completed_at: Option<Time>,
    /// Lease end (in flight) or completion + TTL (completed).
    pub expires_at: Time,
    /// Size of the stored body, without fetching it.
    #[diesel(
        select_expression = sql::body_bytes(),
        select_expression_type = sql::ResponseColumn<diesel::sql_types::Nullable<diesel::sql_types::Integer>>
    )]
    pub body_bytes: Option<i32>,
    /// The database's `now()` when the row was read.
    #[diesel(
        select_expression = sql::DbNow,
        select_expression_type = sql::DbNow
    )]
    pub read_at: Time,
}

/// A `timestamptz` from the database, as a [`SystemTime`] (read through the `time` crate,
/// diesel's own mapping for the type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, FromSqlRow)]
pub struct Time(pub SystemTime);

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 UTC).
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

impl FromSql<Timestamptz, Pg> for Time {
    /// PostgreSQL's binary `timestamptz`, decoded by hand: microseconds since 2000-01-01 UTC,
    /// `infinity` and `-infinity` being the largest and smallest values. Not through `time`'s
    /// date type, which stops at year 9999: one row with a later or infinite time (a hand
    /// edit, another writer; the store caps its own at about 100 years) failed every `stats`,
    /// `list`, `show` and `release` of `idem-cli` (review, 2026-12-06). Displays clamp.
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let since_2000 = <i64 as FromSql<diesel::sql_types::BigInt, Pg>>::from_sql(bytes)?;
        Ok(Time::from_unix_micros(
            since_2000.saturating_add(PG_EPOCH_UNIX_MICROS),
        ))
    }
}

impl Time {
    /// Microseconds since the Unix epoch (negative before it).
    pub fn from_unix_micros(us: i64) -> Time {
        let magnitude = Duration::from_micros(us.unsigned_abs());
        Time(if us >= 0 {
            SystemTime::UNIX_EPOCH + magnitude
        } else {
            SystemTime::UNIX_EPOCH - magnitude
        })
    }

    /// Seconds from `earlier` to `self` (negative when `self` is earlier).
    pub fn seconds_since(self, earlier: Time) -> f64 {
        match self.0.duration_since(earlier.0) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        }
    }
}

impl Record {
    /// Whether a handler holds (or held) the reservation.
    pub fn is_in_flight(&self) -> bool {
        self.state == State::InFlight
    }

    /// Seconds since the reservation was made.
    pub fn age_secs(&self) -> f64 {
        self.read_at.seconds_since(self.created_at)
    }

    /// Seconds until `expires_at` (negative once it passed).
    pub fn expires_in_secs(&self) -> f64 {
        self.expires_at.seconds_since(self.read_at)
    }

    /// Seconds left on the lease (in-flight rows).
    pub fn lease_remaining_secs(&self) -> Option<f64> {
        self.locked_until.map(|t| t.seconds_since(self.read_at))
    }
}

/// A record with its stored response (`idem-cli show`, test helpers).
#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = k, check_for_backend(Pg))]
pub struct Detail {
    /// The columns.
    #[diesel(embed)]
    pub record: Record,
    /// Stored headers, encoded (`StoredResponse::decode_headers`).
    #[diesel(
        select_expression = sql::response_headers(),
        select_expression_type = sql::ResponseColumn<diesel::sql_types::Nullable<diesel::sql_types::Bytea>>
    )]
    pub response_headers: Option<Vec<u8>>,
    /// Stored body.
    #[diesel(
        select_expression = sql::response_body(),
        select_expression_type = sql::ResponseColumn<diesel::sql_types::Nullable<diesel::sql_types::Bytea>>
    )]
    pub response_body: Option<Vec<u8>>,
}

impl std::ops::Deref for Detail {
    type Target = Record;

    fn deref(&self) -> &Record {
        &self.record
    }
}

/// A key and, optionally, the rest of its scope (`None`: any).
#[derive(Debug, Clone, Default)]
pub struct KeyScope {
    /// The key.
    pub key: String,
    /// Tenant.
    pub tenant: Option<String>,
    /// Method, as stored (upper case).
    pub method: Option<String>,
    /// Path.
    pub path: Option<String>,
}

/// `idem-cli list --state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListState {
    /// Reservations.
    InFlight,
    /// Completed and still replayable.
    Completed,
    /// Completed past their TTL, not purged yet.
    Expired,
}

/// `idem-cli list`'s filters.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only this tenant.
    pub tenant: Option<String>,
    /// Only keys starting with this.
    pub key_prefix: Option<String>,
    /// Only records created at least this long ago.
    pub older_than: Option<Duration>,
    /// Only this state.
    pub state: Option<ListState>,
    /// At most this many rows.
    pub limit: Option<i64>,
}

/// Which rows purge deletes: completed rows past their TTL and reservations whose lease ended
/// more than `grace` ago; optionally only those created `older_than` ago, of one tenant.
#[derive(Debug, Clone, Default)]
pub struct PurgeFilter {
    /// How long after its lease ended a reservation is kept.
    pub grace: Duration,
    /// Only records created at least this long ago.
    pub older_than: Option<Duration>,
    /// Only this tenant.
    pub tenant: Option<String>,
}

/// Rows purged (or, for a dry run, purgeable), by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Completed records.
    pub completed: u64,
    /// Reservations.
    pub in_flight: u64,
}

impl Purged {
    /// Both.
    pub fn total(&self) -> u64 {
        self.completed + self.in_flight
    }
}

/// `idem-cli stats`' counts and sizes.
#[derive(Debug, Clone, Default)]
#[allow(missing_docs)]
pub struct Stats {
    pub total: i64,
    pub in_flight: i64,
    pub in_flight_lease_live: i64,
    pub in_flight_lease_ended: i64,
    pub completed: i64,
    pub completed_live: i64,
    pub completed_expired: i64,
    pub expired_not_purged: i64,
    pub table_bytes: Option<i64>,
    pub index_bytes: Option<i64>,
    pub total_bytes: Option<i64>,
}

/// The query behind `idem-cli list` (a query, so the caller can stream it with
/// `load_stream`).
pub fn list_query(
    filter: &ListFilter,
) -> k::BoxedQuery<'_, Pg, diesel::dsl::SqlTypeOf<diesel::dsl::AsSelect<Record, Pg>>> {
    sql::list(filter)
}

/// The records with `scope.key` in `scope`, in scope order.
pub async fn find(conn: &mut AsyncPgConnection, scope: &KeyScope) -> QueryResult<Vec<Record>> {
    sql::find(conn, scope).await
}

/// As [`find`], with the stored responses: the query, which the caller streams with
/// `load_stream` (one record's response in memory at a time).
pub fn find_detail_query(
    scope: &KeyScope,
) -> k::BoxedQuery<'_, Pg, diesel::dsl::SqlTypeOf<diesel::dsl::AsSelect<Detail, Pg>>> {
    sql::find_detail(scope)
}

/// Every record with its response, in scope order.
pub async fn all(conn: &mut AsyncPgConnection) -> QueryResult<Vec<Detail>> {
    sql::all(conn).await
}

/// Delete exactly `record` as inspected (same state and token); unless `force`, only a
/// reservation whose lease is over. `false` when the row changed meanwhile.
pub async fn release(
    conn: &mut AsyncPgConnection,
    record: &Record,
    force: bool,
) -> QueryResult<bool> {
    sql::release_inspected(conn, record, force).await
}

/// Counts and sizes, from one scan.
pub async fn stats(conn: &mut AsyncPgConnection) -> QueryResult<Stats> {
    sql::stats(conn).await
}

/// The oldest reservation, if any.
pub async fn oldest_in_flight(conn: &mut AsyncPgConnection) -> QueryResult<Option<Record>> {
    sql::oldest_in_flight(conn).await
}

/// One purge batch: delete up to `limit` rows matching `filter` (the statement the store's
/// `purge_expired` runs too).
pub async fn purge_batch(
    conn: &mut AsyncPgConnection,
    filter: &PurgeFilter,
    limit: u32,
) -> QueryResult<Purged> {
    sql::purge(conn, filter, limit).await
}

/// What [`purge_batch`] would delete now, without deleting.
pub async fn purge_count(
    conn: &mut AsyncPgConnection,
    filter: &PurgeFilter,
) -> QueryResult<Purged> {
    sql::purge_count(conn, filter).await
}

/// Take [`PURGE_LOCK_KEY`] without waiting: `false` when another purge holds it.
pub async fn try_lock_purge(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    sql::try_lock(conn, PURGE_LOCK_KEY).await
}

/// Release [`PURGE_LOCK_KEY`].
pub async fn unlock_purge(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    sql::unlock(conn, PURGE_LOCK_KEY).await
}

/// One partition of `idempotency_responses` (partitioned layout), as the catalog states it.
#[derive(Debug, Clone, diesel::QueryableByName)]
pub struct Partition {
    /// Table name.
    #[diesel(sql_type = diesel::sql_types::Text)]
    pub name: String,
    /// The default partition (rows no range covers: long TTLs).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub is_default: bool,
    /// Inclusive lower bound of `expires_at` (`None` for the default partition).
    #[diesel(sql_type = diesel::sql_types::Nullable<Timestamptz>)]
    pub lower_bound: Option<Time>,
    /// Exclusive upper bound of `expires_at` (`None` for the default partition).
    #[diesel(sql_type = diesel::sql_types::Nullable<Timestamptz>)]
    pub upper_bound: Option<Time>,
    /// `pg_total_relation_size`.
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub bytes: i64,
    /// The planner's row estimate (`reltuples`; 0 before the first ANALYZE).
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub estimated_rows: i64,
}

/// Whether the tables of the database's layout exist (`idempotency_keys`, and on the
/// partitioned layout `idempotency_responses`), whatever the functions the store calls (which
/// [`table_exists`] requires as well): with pending migrations, those may be what adds them.
pub async fn keys_table_exists(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    sql::keys_table_exists(conn).await
}

/// `Some("hourly" | "daily")` when the database has the partitioned layout (migration
/// 000005 run with `idempotency.layout = 'partitioned'`), `None` for the plain layout. Detected
/// by catalog (`to_regclass('idempotency_responses')`).
pub async fn partition_interval(conn: &mut AsyncPgConnection) -> QueryResult<Option<String>> {
    sql::partition_interval(conn).await
}

/// Whether the database has the rotated layout (migration 000016 run with
/// `idempotency.layout = 'rotated'`). Detected by catalog (`to_regclass('idempotency_generation')`).
pub async fn rotated(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    sql::rotated(conn).await
}

/// The rotated layout's rotation period, as provisioned.
pub async fn rotation_period(conn: &mut AsyncPgConnection) -> QueryResult<Duration> {
    sql::rotation_period(conn).await
}

/// What [`rotate`] did (rotated layout).
#[derive(Debug, Clone, diesel::QueryableByName)]
pub struct Rotation {
    /// Whether it emptied the next generation table and made it current.
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub rotated: bool,
    /// Whether a rotation was due (the period had passed since the last one), by the
    /// database's clock.
    #[diesel(sql_type = diesel::sql_types::Bool)]
    pub due: bool,
    /// The current generation afterwards (`idempotency_keys_<generation>`).
    #[diesel(sql_type = diesel::sql_types::SmallInt)]
    pub generation: i16,
    /// The earliest time of the next rotation (the last one plus the period).
    #[diesel(sql_type = Timestamptz)]
    pub next_rotation: Time,
    /// Records it carried from the table it made unread (the one before the previous) into the
    /// new current one: those that still mattered (unexpired, or in flight within `grace`).
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    pub carried: i64,
    /// When a rotation was due but held back: the pid of the oldest session whose transaction
    /// began before the last rotation (it may still write into the table a rotation empties).
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Integer>)]
    pub blocked_by_pid: Option<i32>,
}

/// The rotated layout's current generation and the earliest time of its next rotation, read
/// without rotating (`purge --dry-run`): a [`Rotation`] that did not rotate.
pub async fn next_rotation(conn: &mut AsyncPgConnection) -> QueryResult<Rotation> {
    sql::next_rotation(conn).await
}

/// Rotate the rotated layout's generation tables if the period has passed since the last
/// rotation: `TRUNCATE` the next table (no request reads it) and make it current, carrying
/// into it the records of the previous table that still matter (as [`purge_batch`] judges
/// them, with `grace`), since that table becomes the unread one. The `TRUNCATE` waits at most
/// `lock_timeout` for its lock; past it the call fails and changes nothing.
pub async fn rotate(
    conn: &mut AsyncPgConnection,
    lock_timeout: Duration,
    grace: Duration,
) -> QueryResult<Rotation> {
    sql::rotate(conn, lock_timeout_ms(lock_timeout), super::micros(grace)).await
}

/// The partitions of `idempotency_responses` (partitioned layout only).
pub async fn partitions(conn: &mut AsyncPgConnection) -> QueryResult<Vec<Partition>> {
    sql::partitions(conn).await
}

/// Create the partitions of the current interval and the next `ahead` intervals that are
/// missing, except those whose range the default partition already holds rows for (they stay
/// there; nothing is moved: migration 000008). Each partition is attached in its own
/// transaction, which holds `ACCESS EXCLUSIVE` on the default partition for the one scan
/// `ATTACH PARTITION` makes of it; each waits at most `lock_timeout` for its locks. On an
/// error the partitions attached before it stay, and the next run carries on. No partition is
/// created past [`max_partitions`] (a warning is logged): responses expiring later go to the
/// default partition.
///
/// Call it outside a transaction (autocommit), or the locks add up until the caller commits.
pub async fn create_partitions(
    conn: &mut AsyncPgConnection,
    ahead: u32,
    lock_timeout: Duration,
) -> QueryResult<Vec<String>> {
    let mut created = Vec::new();
    create_partitions_into(conn, ahead, lock_timeout, &mut created).await?;
    Ok(created)
}

/// As [`create_partitions`], pushing each name onto `created` as soon as its partition is
/// committed, so a caller that gets an error still knows which partitions were made. Stops
/// short of `ahead` at the partition budget ([`max_partitions`]) and then says so.
pub async fn create_partitions_into(
    conn: &mut AsyncPgConnection,
    ahead: u32,
    lock_timeout: Duration,
    created: &mut Vec<String>,
) -> QueryResult<Option<PartitionBudget>> {
    for k in 0..=ahead {
        match create_partitions_step(conn, k, lock_timeout).await? {
            Ok(names) => created.extend(names),
            Err(budget) => return Ok(Some(budget)),
        }
    }
    Ok(None)
}

/// One step of [`create_partitions_into`]: the partitions missing up to `k` intervals ahead
/// (their names), or, at the partition budget, none (`Err` with the budget). Two round trips,
/// for a caller that bounds each step by itself (`idem-cli purge`: a step's `ATTACH` scans the
/// default partition, so a run of many steps can take far longer than one).
///
/// The function creates every missing partition up to `k` intervals ahead in one transaction;
/// asking for one more interval per call makes each call one `ATTACH`, so the default
/// partition's lock is released between partitions instead of being held across all of them.
/// (Two when an interval boundary passes between calls: the function counts from `now()`.)
pub async fn create_partitions_step(
    conn: &mut AsyncPgConnection,
    k: u32,
    lock_timeout: Duration,
) -> QueryResult<Result<Vec<String>, PartitionBudget>> {
    let (leaves, max_locks) = sql::partition_lock_budget(conn).await?;
    let budget = PartitionBudget {
        leaves: u32::try_from(leaves).unwrap_or(u32::MAX),
        max_locks_per_transaction: u32::try_from(max_locks).unwrap_or(0),
    };
    if budget.leaves >= max_partitions(budget.max_locks_per_transaction) {
        tracing::warn!(target: "idempotency_actix", leaves = budget.leaves, max_locks_per_transaction = budget.max_locks_per_transaction, "no more response partitions created ahead: every replay locks each of them; later responses go to the default partition");
        return Ok(Err(budget));
    }
    let k = i32::try_from(k).unwrap_or(i32::MAX);
    Ok(Ok(sql::create_partitions(
        conn,
        k,
        lock_timeout_ms(lock_timeout),
    )
    .await?))
}

/// Where [`create_partitions_into`] stopped for the partition budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionBudget {
    /// Response partitions there are (range partitions and the default).
    pub leaves: u32,
    /// The server's `max_locks_per_transaction`.
    pub max_locks_per_transaction: u32,
}

/// The most response partitions (range partitions and the default) the partitioned layout
/// keeps, given the server's `max_locks_per_transaction`.
///
/// A replay reads its response through the reserve function's generic plan, and PostgreSQL 15
/// locks every partition of a generic plan, and its primary-key index, before it prunes: two
/// locks per leaf, held while the statement runs. The shared lock table holds
/// `max_locks_per_transaction` locks per connection, so the more leaves, the fewer replays can
/// be running at once before it is full and replays (and anything else that needs a lock on
/// that server) fail with "out of shared memory": a review measured 910 of 1,200 replays by
/// 40 concurrent clients failing with 1,001 hourly partitions, none with 172. At this bound
/// (64 leaves at the default) a replay holds about twice `max_locks_per_transaction`, so half
/// the server's connections can be in a replay at the same moment.
pub fn max_partitions(max_locks_per_transaction: u32) -> u32 {
    max_locks_per_transaction.max(8)
}

/// Drop the range partitions whose upper bound is at least `grace` in the past (every row in
/// them expired at least `grace` ago). Lock wait bounded as in [`create_partitions`].
pub async fn drop_partitions(
    conn: &mut AsyncPgConnection,
    grace: Duration,
    lock_timeout: Duration,
) -> QueryResult<Vec<String>> {
    sql::drop_partitions(conn, super::micros(grace), lock_timeout_ms(lock_timeout)).await
}

/// The range partitions [`drop_partitions`] would drop now with this `grace`, oldest first,
/// without dropping anything (`idem-cli purge --dry-run`).
pub async fn droppable_partitions(
    conn: &mut AsyncPgConnection,
    grace: Duration,
) -> QueryResult<Vec<String>> {
    sql::droppable_partitions(conn, super::micros(grace)).await
}

/// One batch of the default partition's rows (long TTLs) that expired `older_than` or more
/// ago, at most `limit`: the same age [`drop_partitions`] gives the range partitions.
pub async fn purge_default_partition(
    conn: &mut AsyncPgConnection,
    limit: u32,
    older_than: Duration,
) -> QueryResult<u64> {
    let limit = i32::try_from(limit).unwrap_or(i32::MAX);
    sql::purge_default_partition(conn, limit, super::micros(older_than)).await
}

fn lock_timeout_ms(timeout: Duration) -> i32 {
    // At least 1 ms: 0 would mean "wait forever".
    i32::try_from(timeout.as_millis())
        .unwrap_or(i32::MAX)
        .max(1)
}

/// The message of an error followed by its sources, each on one line and deduplicated (many
/// wrappers repeat the inner message in their own `Display`): `a: b: c`. The one flattening
/// of error chains, used by the store's connection errors and by `idem-cli`.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        let text = one_line(&e.to_string());
        if !text.is_empty() && !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

/// Collapse a (possibly multi-line) message into one line: PostgreSQL errors carry DETAIL and
/// HINT lines.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrap(&'static str, Option<Box<Wrap>>);

    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn chains_are_flattened_once() {
        let err = Wrap(
            "db error: password authentication failed",
            Some(Box::new(Wrap(
                "password authentication failed",
                Some(Box::new(Wrap("FATAL\n  HINT: x", None))),
            ))),
        );
        assert_eq!(
            error_chain(&err),
            "db error: password authentication failed: FATAL HINT: x"
        );
    }

    #[test]
    fn negative_micros_are_before_the_epoch() {
        let t = Time::from_unix_micros(-1_500_000);
        assert_eq!(Time::from_unix_micros(0).seconds_since(t), 1.5);
    }
}
