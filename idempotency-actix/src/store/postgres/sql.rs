//! Every statement on `idempotency_keys`, in one place: the request path, purge, the
//! provisioning probe, and the admin queries `idem-cli` runs (through [`super::admin`]).
//! `docs/sql.md` describes each of them; keep the two in step.
//!
//! Every request-path statement is a call of a function the migrations define (reserve,
//! replay, complete, release, lease renewal, the completed-by check, the transactional
//! claim): the functions are the one place that names the table's key, so a migration can
//! change it without changing what app instances of either version send (`docs/sql.md`, "The
//! request path is function calls only"). The other statements are written with diesel's query
//! builder over the [`schema`](super::schema), so columns and state values are named in one
//! place. Raw SQL remains only where the builder cannot say it, each with the reason next to
//! it: the function calls, purge (a CTE over a `DELETE` that finds its rows by `ctid`), and the
//! `to_regclass` probe.
//!
//! # Prepared once per connection
//! `diesel::sql_query` is never cached as a prepared statement, and diesel-async then pays a
//! Parse round trip before every Execute. Query-builder statements and the hand-written
//! fragments here have a *static* [`QueryId`], so diesel-async's per-connection statement cache
//! prepares each on first use and every later execution on that connection is one round trip
//! (Bind/Execute/Sync in one flight). The request-path statements are checked for that below
//! (`const _`), and `tests/tests/e2e/postgres_round_trips.rs` counts the messages. The admin
//! queries are built dynamically (`into_boxed`): the CLI runs each once.
//!
//! All times come from the database (`now()`); durations travel as bigint microseconds.

use diesel::dsl::count;
use diesel::expression::ValidGrouping;
use diesel::expression::{is_aggregate, AppearsOnTable, Expression, SelectableExpression};
use diesel::expression_methods::AggregateExpressionMethods;
use std::marker::PhantomData;

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Bool, Bytea, Nullable, SmallInt, Text, Timestamptz, Untyped};
use diesel::{
    BoolExpressionMethods, Column, ExpressionMethods, NullableExpressionMethods, OptionalExtension,
    PgExpressionMethods, QueryDsl, QueryResult, QueryableByName, SelectableHelper,
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::admin::{
    Detail, KeyScope, ListFilter, ListState, Partition, PurgeFilter, Purged, Record, Stats,
};
use super::schema::{idempotency_keys as k, State};

// ---------------------------------------------------------------------------------------------
// Small expressions the query builder lacks

/// `now()`: the database's clock, typed `timestamptz` (diesel's own `now` is `timestamp`, which
/// cannot be compared with or added to a `timestamptz` column without a cast).
#[derive(Debug, Clone, Copy)]
pub struct DbNow;

/// `now() - $n * interval '1 microsecond'`: a point before the database's clock (purge's
/// grace). Microseconds, the database's interval precision.
#[derive(Debug, Clone, Copy)]
pub struct NowShifted {
    micros: i64,
}

impl DbNow {
    /// `now()` minus `micros`.
    pub(crate) fn minus(micros: i64) -> NowShifted {
        NowShifted { micros }
    }
}

impl QueryFragment<Pg> for DbNow {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("now()");
        Ok(())
    }
}

impl QueryFragment<Pg> for NowShifted {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("(now() - ");
        out.push_bind_param::<BigInt, _>(&self.micros)?;
        out.push_sql(" * interval '1 microsecond')");
        Ok(())
    }
}

/// The plumbing that lets a hand-written fragment be used as a query-builder expression of type
/// `$sql_type`, with a static query id (its SQL text never varies).
macro_rules! expression {
    ($name:ident, $sql_type:ty) => {
        impl Expression for $name {
            type SqlType = $sql_type;
        }
        impl<QS> AppearsOnTable<QS> for $name {}
        impl<QS> SelectableExpression<QS> for $name {}
        impl<GB> ValidGrouping<GB> for $name {
            type IsAggregate = is_aggregate::Never;
        }
        impl QueryId for $name {
            type QueryId = Self;
            const HAS_STATIC_QUERY_ID: bool = true;
        }
    };
}

/// A hand-written statement with a fixed SQL text: its static query id (`$id`), so diesel-async
/// prepares it once per connection, and an untyped result loaded by name.
macro_rules! statement {
    ($statement:ty, $id:ident) => {
        /// Static query id for the statement cache.
        pub(crate) struct $id;

        impl QueryId for $statement {
            type QueryId = $id;
            const HAS_STATIC_QUERY_ID: bool = true;
        }

        impl Query for $statement {
            type SqlType = Untyped;
        }
    };
}

expression!(DbNow, Timestamptz);
expression!(NowShifted, Timestamptz);

/// A column of a record's stored response, read through `idempotency_response` (migration
/// 000004, or the partitioned layout's of 000005), so the admin queries are the same text in
/// both layouts: a correlated scalar subquery over a one-SELECT SQL function, which the planner
/// inlines (a primary-key probe of the same row in the plain layout, a `(token, expires_at)`
/// probe of `idempotency_responses` in the partitioned one).
macro_rules! response_column {
    ($expr:literal) => {
        concat!(
            "(SELECT ",
            $expr,
            " FROM idempotency_response(\"idempotency_keys\".\"tenant\", ",
            "\"idempotency_keys\".\"method\", \"idempotency_keys\".\"path\", ",
            "\"idempotency_keys\".\"idempotency_key\", \"idempotency_keys\".\"token\", ",
            "\"idempotency_keys\".\"expires_at\") r)"
        )
    };
}

/// The SQL type of a response column read by [`response_column!`].
pub(crate) type ResponseColumn<ST> = diesel::expression::SqlLiteral<ST>;

/// The stored body's size, without fetching it (`octet_length` reads the length word).
pub(crate) fn body_bytes() -> ResponseColumn<Nullable<diesel::sql_types::Integer>> {
    diesel::dsl::sql(response_column!("octet_length(r.response_body)"))
}

/// The stored headers, encoded.
pub(crate) fn response_headers() -> ResponseColumn<Nullable<Bytea>> {
    diesel::dsl::sql(response_column!("r.response_headers"))
}

/// The stored body.
pub(crate) fn response_body() -> ResponseColumn<Nullable<Bytea>> {
    diesel::dsl::sql(response_column!("r.response_body"))
}

diesel::define_sql_function! {
    /// `starts_with(text, text)`: a key-prefix filter with no `LIKE` escaping to get wrong.
    fn starts_with(text: Text, prefix: Text) -> Bool;
}

// ---------------------------------------------------------------------------------------------
// Request path

/// The four parts of a scope, borrowed.
pub(crate) struct ScopeBinds<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    pub(crate) key: &'a str,
}

impl<'a> ScopeBinds<'a> {
    /// The four scope binds as function arguments: `$n, $n+1, $n+2, $n+3`.
    pub(crate) fn push_binds<'b>(&'b self, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_bind_param::<Text, _>(&self.tenant)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&self.method)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&self.path)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&self.key)
    }
}

/// Reserve-or-fetch in one statement: a call of the PL/pgSQL function `idempotency_reserve`
/// (migration `2026-11-30-000002_reserve_function`). Binds: `$1..$4` scope, `$5` fingerprint,
/// `$6` token, `$7` lease in microseconds.
///
/// Raw SQL: diesel's query builder has no way to call a set-returning function in `FROM`.
pub(crate) struct Reserve<'a> {
    pub(crate) scope: ScopeBinds<'a>,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) token: uuid::Uuid,
    pub(crate) lease_us: i64,
}

statement!(Reserve<'_>, ReserveId);

/// The reserve call.
///
/// How it works (the function body is in `migrations/2026-11-30-000002_reserve_function/up.sql`,
/// explained in `docs/sql.md`):
/// - It reads first: a plain primary-key SELECT, no lock. A live completed row (replay), a live
///   reservation, or an ended reservation of another fingerprint is returned as `existing`
///   without any write. So the replay path costs one index read.
/// - Only then does it write: `INSERT ... ON CONFLICT DO NOTHING` for an absent key, or an
///   UPDATE fenced by `expires_at <= now()` and "completed, or the same fingerprint" for an
///   ended, eligible row. Each write is conditional on the row being absent/ended *under its
///   lock* (READ COMMITTED's EvalPlanQual), so at most one call can reserve a key.
/// - A write that found nothing to do means a concurrent writer won; the function re-reads and
///   decides again, in a bounded loop. Only if the key changed under every attempt does it
///   answer `raced` (nothing written); the caller then calls again.
///
/// The row is loaded by name ([`ReserveRow`]), so `SELECT *` is exact: the function's
/// `RETURNS TABLE` is the column list.
impl QueryFragment<Pg> for Reserve<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT * FROM idempotency_reserve(");
        self.push_binds(&mut out)?;
        out.push_sql(")");
        Ok(())
    }
}

impl Reserve<'_> {
    /// The reserve arguments (scope, fingerprint, token, lease), shared by the reserve call and
    /// the transactional claim, whose signature ends with the same seven. The functions'
    /// signatures fix the parameter types of the prepared statements.
    fn push_binds<'b>(&'b self, out: &mut AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.scope.push_binds(out)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&self.fingerprint)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.lease_us)
    }
}

/// The replay fast path ([`PostgresStoreBuilder::replay_fast_path`](super::PostgresStoreBuilder::replay_fast_path)):
/// a plain primary-key `SELECT` of a *live completed* record, shaped like a row of
/// [`Reserve`] (outcome `existing`, `live` and `eligible` true) so one decoder serves both.
/// Binds: `$1..$4` scope. No row means "not a replay": the caller then calls [`Reserve`],
/// which decides everything else (absent, in flight, ended) as before. It only reads, so it
/// cannot change what `reserve` decides: a completed record is immutable until it expires,
/// and one that expires between this read and a later call is the function's to take over.
pub(crate) struct ReplayRead<'a> {
    pub(crate) scope: ScopeBinds<'a>,
}

statement!(ReplayRead<'_>, ReplayReadId);

impl QueryFragment<Pg> for ReplayRead<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        // Raw SQL, as for the reserve call: a set-returning function in `FROM`. The function
        // (`idempotency_replay`, migration 000004, or the partitioned layout's of 000005) is
        // a one-SELECT SQL function, which the planner inlines: the plan is the plain
        // primary-key read (plus, in the partitioned layout, the response's index probe).
        out.push_sql("SELECT * FROM idempotency_replay(");
        self.scope.push_binds(&mut out)?;
        out.push_sql(")");
        Ok(())
    }
}

/// A column of the schema by its bare name (a result column then carries that name, which is
/// what [`ReserveRow`]'s load by name needs).
fn name<C: Column>(out: &mut AstPass<'_, '_, Pg>) -> QueryResult<()> {
    out.push_identifier(C::NAME)
}

/// One row of the reserve statement.
#[derive(QueryableByName, Debug)]
pub(crate) struct ReserveRow {
    /// `reserved`, `existing` or `raced` (the function's own vocabulary, not a table value).
    #[diesel(sql_type = Text)]
    pub(crate) outcome: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) state: Option<State>,
    #[diesel(sql_type = Nullable<Bytea>)]
    pub(crate) fingerprint: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) lease_remaining_us: Option<i64>,
    #[diesel(sql_type = Nullable<SmallInt>)]
    pub(crate) response_status: Option<i16>,
    #[diesel(sql_type = Nullable<Bytea>)]
    pub(crate) response_headers: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Bytea>)]
    pub(crate) response_body: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Bool>)]
    pub(crate) live: Option<bool>,
    #[diesel(sql_type = Nullable<Bool>)]
    pub(crate) eligible: Option<bool>,
}

/// Run [`ReplayRead`].
pub(crate) async fn replay_read(
    conn: &mut AsyncPgConnection,
    query: &ReplayRead<'_>,
) -> QueryResult<Vec<ReserveRow>> {
    query.load(conn).await
}

/// Run [`Reserve`].
pub(crate) async fn reserve(
    conn: &mut AsyncPgConnection,
    query: &Reserve<'_>,
) -> QueryResult<Vec<ReserveRow>> {
    query.load(conn).await
}

/// The values `complete` stores.
pub(crate) struct Completion<'a> {
    pub(crate) token: uuid::Uuid,
    pub(crate) status: i16,
    pub(crate) headers: &'a [u8],
    pub(crate) body: &'a [u8],
    pub(crate) ttl_us: i64,
}

/// Store the response, fenced by the token: `SELECT idempotency_complete($1..$9)`, the
/// function of migration 000004 (one primary-key UPDATE) or, in the partitioned layout, of
/// 000005 (the same UPDATE of the claim plus the INSERT of the response row). Binds: `$1..$4`
/// scope, `$5` token, `$6` status, `$7` headers, `$8` body, `$9` TTL in microseconds.
///
/// Raw SQL: a function call, so the store sends the same statement whatever the layout.
struct Complete<'a> {
    scope: &'a ScopeBinds<'a>,
    completion: &'a Completion<'a>,
}

statement!(Complete<'_>, CompleteId);

impl QueryFragment<Pg> for Complete<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT idempotency_complete(");
        self.scope.push_binds(&mut out)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.completion.token)?;
        out.push_sql(", ");
        out.push_bind_param::<SmallInt, _>(&self.completion.status)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&self.completion.headers)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&self.completion.body)?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.completion.ttl_us)?;
        out.push_sql(") AS applied");
        Ok(())
    }
}

/// The row of [`Complete`].
#[derive(QueryableByName, Debug)]
struct CompletedRow {
    #[diesel(sql_type = Bool)]
    applied: bool,
}

/// Store the response, fenced by the token ([`Complete`]). 1 when applied, 0 when stale (the
/// token no longer holds an in-flight reservation). Read with `load`: see [`committed`].
pub(crate) async fn complete(
    conn: &mut AsyncPgConnection,
    scope: &ScopeBinds<'_>,
    completion: &Completion<'_>,
) -> QueryResult<usize> {
    let rows: Vec<CompletedRow> = Complete { scope, completion }.load(conn).await?;
    Ok(usize::from(committed(rows)?.applied))
}

/// The one row a write answered, once its transaction has committed.
///
/// Why writes are read with `load` and never with `get_result`: a statement sent outside a
/// transaction block commits when the server processes the `Sync` that follows it, *after*
/// its `DataRow` and `CommandComplete` have gone out. diesel-async's `get_result` resolves at
/// the first `DataRow`, so a commit that then fails (the server shutting down or crashing, a
/// serialization failure at commit, a deferred constraint) was taken for success: a
/// `complete` reported stored while the record stayed in flight, and after the lease a retry
/// ran the handler again (CI caught it, `postgres_store::a_write_whose_commit_fails_is_not_reported_done`).
/// `load` reads to `ReadyForQuery`, where such a failure arrives as an error. The same
/// messages, no extra round trip.
fn committed<T>(rows: Vec<T>) -> QueryResult<T> {
    rows.into_iter()
        .next()
        .ok_or(diesel::result::Error::NotFound)
}

/// A call of one of the functions that act on a reservation by its scope and token (migration
/// 000015): `SELECT <function>(scope, token[, lease]) AS found`, true when the function found
/// its row. Functions, not statements, so that a migration can change the table's key without
/// changing what the application sends (`docs/sql.md`, "The request path is function calls
/// only").
struct Fenced<'a, F> {
    scope: &'a ScopeBinds<'a>,
    token: uuid::Uuid,
    lease_us: i64,
    function: PhantomData<F>,
}

/// The function a [`Fenced`] call names; also its static query id.
trait FencedFunction: Send + Sync + 'static {
    /// `SELECT <function>(`.
    const CALL: &'static str;
    /// Whether the function takes the lease (bigint microseconds) after the token.
    const TAKES_LEASE: bool;
}

/// `idempotency_release`: the holder's DELETE of its in-flight reservation.
pub(crate) struct ReleaseId;
/// `idempotency_renew_lease`: the holder's move of its lease end.
pub(crate) struct RenewLeaseId;
/// `idempotency_completed_by`: whether the record is completed under this token.
pub(crate) struct CompletedById;

impl FencedFunction for ReleaseId {
    const CALL: &'static str = "SELECT idempotency_release(";
    const TAKES_LEASE: bool = false;
}

impl FencedFunction for RenewLeaseId {
    const CALL: &'static str = "SELECT idempotency_renew_lease(";
    const TAKES_LEASE: bool = true;
}

impl FencedFunction for CompletedById {
    const CALL: &'static str = "SELECT idempotency_completed_by(";
    const TAKES_LEASE: bool = false;
}

impl<F: FencedFunction> QueryId for Fenced<'_, F> {
    type QueryId = F;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<F> Query for Fenced<'_, F> {
    type SqlType = Untyped;
}

impl<F: FencedFunction> QueryFragment<Pg> for Fenced<'_, F> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(F::CALL);
        self.scope.push_binds(&mut out)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        if F::TAKES_LEASE {
            out.push_sql(", ");
            out.push_bind_param::<BigInt, _>(&self.lease_us)?;
        }
        out.push_sql(") AS found");
        Ok(())
    }
}

#[derive(QueryableByName, Debug)]
struct FoundRow {
    #[diesel(sql_type = Bool)]
    found: bool,
}

async fn fenced<F: FencedFunction>(
    conn: &mut AsyncPgConnection,
    scope: &ScopeBinds<'_>,
    token: uuid::Uuid,
    lease_us: i64,
) -> QueryResult<bool> {
    let call = Fenced::<F> {
        scope,
        token,
        lease_us,
        function: PhantomData,
    };
    let rows: Vec<FoundRow> = call.load(conn).await?;
    Ok(committed(rows)?.found)
}

/// Whether `token` completed `scope`'s record: one primary-key lookup, asked only after a
/// [`complete`] found no reservation, so that a retry of a completion that was applied but
/// whose reply was lost (the connection dropped after the commit) answers applied instead of
/// stale. The token is unique per reservation, so a match is this request's own record.
/// `idempotency_completed_by`.
pub(crate) async fn completed_by(
    conn: &mut AsyncPgConnection,
    scope: &ScopeBinds<'_>,
    token: uuid::Uuid,
) -> QueryResult<bool> {
    fenced::<CompletedById>(conn, scope, token, 0).await
}

/// Delete the reservation, fenced by the token: `idempotency_release`, one primary-key DELETE.
pub(crate) async fn release(
    conn: &mut AsyncPgConnection,
    scope: &ScopeBinds<'_>,
    token: uuid::Uuid,
) -> QueryResult<usize> {
    fenced::<ReleaseId>(conn, scope, token, 0)
        .await
        .map(usize::from)
}

/// Renew the lease of an in-flight reservation, fenced by the token: `idempotency_renew_lease`,
/// one primary-key UPDATE of the claim row (`idempotency_keys` in both layouts), setting its
/// lease end and expiry (equal for a reservation) to `now() + lease`. Matches nothing once the
/// record was completed, released, purged or taken over (a takeover writes a new token under
/// the row lock), so a stale holder never extends the new holder's lease.
pub(crate) async fn renew_lease(
    conn: &mut AsyncPgConnection,
    scope: &ScopeBinds<'_>,
    token: uuid::Uuid,
    lease_us: i64,
) -> QueryResult<usize> {
    fenced::<RenewLeaseId>(conn, scope, token, lease_us)
        .await
        .map(usize::from)
}

// ---------------------------------------------------------------------------------------------
// Transactional mode (C25): the statements the middleware sends on the handler's connection

/// Reserve-or-fetch inside the request's transaction, with the tenant setting for row-level
/// security first: a call of `idempotency_tx_claim` (migration
/// `2026-12-01-000003_transactional_claim`). Binds: `$1` setting name (NULL: none), `$2` its
/// value, then [`Reserve`]'s seven (`$3..$6` scope, `$7` fingerprint, `$8` token, `$9` lease in
/// microseconds). The function returns the reserve function's row shape, so [`ReserveRow`]
/// and one decoder serve both.
///
/// Raw SQL: as [`Reserve`], a set-returning function call in `FROM`.
pub(crate) struct TxClaim<'a> {
    pub(crate) setting: Option<&'a str>,
    pub(crate) setting_value: Option<&'a str>,
    pub(crate) reserve: Reserve<'a>,
}

statement!(TxClaim<'_>, TxClaimId);

impl QueryFragment<Pg> for TxClaim<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT * FROM idempotency_tx_claim(");
        out.push_bind_param::<Nullable<Text>, _>(&self.setting)?;
        out.push_sql(", ");
        out.push_bind_param::<Nullable<Text>, _>(&self.setting_value)?;
        out.push_sql(", ");
        self.reserve.push_binds(&mut out)?;
        out.push_sql(")");
        Ok(())
    }
}

/// Run [`TxClaim`].
pub(crate) async fn tx_claim(
    conn: &mut AsyncPgConnection,
    query: &TxClaim<'_>,
) -> QueryResult<Vec<ReserveRow>> {
    query.load(conn).await
}

/// `SELECT set_config($1, $2, true)`: the tenant of a keyless transactional request.
///
/// Raw SQL: a function call with no table.
pub(crate) struct SetTenant<'a> {
    pub(crate) name: &'a str,
    pub(crate) value: &'a str,
}

statement!(SetTenant<'_>, SetTenantId);

impl QueryFragment<Pg> for SetTenant<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT set_config(");
        out.push_bind_param::<Text, _>(&self.name)?;
        out.push_sql(", ");
        out.push_bind_param::<Text, _>(&self.value)?;
        out.push_sql(", true)");
        Ok(())
    }
}

/// Run [`SetTenant`].
pub(crate) async fn set_tenant(
    conn: &mut AsyncPgConnection,
    query: &SetTenant<'_>,
) -> QueryResult<()> {
    query.execute(conn).await.map(|_| ())
}

// ---------------------------------------------------------------------------------------------
// Purge: the one statement, for the store and for `idem-cli purge`

static COMPLETED: State = State::Completed;
static IN_FLIGHT: State = State::InFlight;

/// Which rows purge may delete, as a boolean expression (shared by the DELETE and by
/// `purge --dry-run`'s count):
///
/// ```sql
/// expires_at <= now()
/// AND (state = $completed OR expires_at <= now() - $grace)
/// AND ($older_than IS NULL OR created_at <= now() - $older_than)
/// AND ($tenant IS NULL OR tenant = $tenant)
/// ```
///
/// (`$completed`, `$in_flight`: the [`State`] values, bound.) The leading `expires_at <= now()`
/// lets the planner walk the `expires_at` index. The
/// optional filters are binds tested for NULL rather than clauses left out, so the statement's
/// text (and its prepared plan) is the same for every caller.
#[derive(Debug, Clone)]
pub(crate) struct Purgeable {
    grace: NowShifted,
    older_than_us: Option<i64>,
    tenant: Option<String>,
}

expression!(Purgeable, Bool);

impl Purgeable {
    pub(crate) fn new(filter: &PurgeFilter) -> Self {
        Purgeable {
            grace: DbNow::minus(super::micros(filter.grace)),
            older_than_us: filter.older_than.map(super::micros),
            tenant: filter.tenant.clone(),
        }
    }
}

impl QueryFragment<Pg> for Purgeable {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        // Written out rather than built from `k::state.eq(...)` and friends: a walked
        // expression must outlive the pass, and these borrow nothing but `self` and statics.
        k::expires_at.walk_ast(out.reborrow())?;
        out.push_sql(" <= now() AND (");
        k::state.walk_ast(out.reborrow())?;
        out.push_sql(" = ");
        out.push_bind_param::<Text, _>(&COMPLETED)?;
        out.push_sql(" OR ");
        k::expires_at.walk_ast(out.reborrow())?;
        out.push_sql(" <= ");
        self.grace.walk_ast(out.reborrow())?;
        out.push_sql(")");
        out.push_sql(" AND (");
        out.push_bind_param::<Nullable<BigInt>, _>(&self.older_than_us)?;
        out.push_sql("::bigint IS NULL OR ");
        k::created_at.walk_ast(out.reborrow())?;
        out.push_sql(" <= now() - ");
        out.push_bind_param::<Nullable<BigInt>, _>(&self.older_than_us)?;
        out.push_sql(" * interval '1 microsecond') AND (");
        out.push_bind_param::<Nullable<Text>, _>(&self.tenant)?;
        out.push_sql("::text IS NULL OR ");
        k::tenant.walk_ast(out.reborrow())?;
        out.push_sql(" = ");
        out.push_bind_param::<Nullable<Text>, _>(&self.tenant)?;
        out.push_sql(")");
        Ok(())
    }
}

/// Delete up to `limit` purgeable rows and count them by state, in one statement:
///
/// ```sql
/// WITH gone AS (
///     DELETE FROM idempotency_keys WHERE ctid = ANY (ARRAY(
///         SELECT ctid FROM idempotency_keys WHERE <Purgeable>
///         ORDER BY expires_at LIMIT $limit FOR UPDATE SKIP LOCKED))
///     RETURNING state)
/// SELECT count(*) FILTER (WHERE state = $completed) AS completed,
///        count(*) FILTER (WHERE state = $in_flight) AS in_flight
/// FROM gone
/// ```
///
/// The inner SELECT walks the `expires_at` index and locks at most `limit` rows, skipping rows
/// someone else holds (a request working on a row, an overlapping purge): purge never queues
/// behind traffic. `FOR UPDATE` re-checks the WHERE clause on the newest row version, so a
/// reservation taken over in between is not deleted. The DELETE then finds the rows by `ctid`
/// (a TID scan, stable because we hold their locks); joining back on the primary key instead
/// was planned as a hash join over a sequential scan of the whole table. Each call is its own
/// short transaction.
///
/// Raw SQL around query-builder parts: diesel's builder has neither CTEs nor the `ctid`
/// system column.
pub(crate) struct Purge {
    pub(crate) rows: Purgeable,
    pub(crate) limit: i64,
}

statement!(Purge, PurgeId);

impl QueryFragment<Pg> for Purge {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("WITH gone AS (DELETE FROM ");
        k::table.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ctid = ANY (ARRAY(SELECT ctid FROM ");
        k::table.walk_ast(out.reborrow())?;
        out.push_sql(" WHERE ");
        self.rows.walk_ast(out.reborrow())?;
        out.push_sql(" ORDER BY ");
        k::expires_at.walk_ast(out.reborrow())?;
        out.push_sql(" LIMIT ");
        out.push_bind_param::<BigInt, _>(&self.limit)?;
        out.push_sql(" FOR UPDATE SKIP LOCKED)) RETURNING ");
        // Unqualified from here on: outside the DELETE only the CTE `gone` is in scope.
        name::<k::state>(&mut out)?;
        out.push_sql(") SELECT count(*) FILTER (WHERE ");
        name::<k::state>(&mut out)?;
        out.push_sql(" = ");
        out.push_bind_param::<Text, _>(&COMPLETED)?;
        out.push_sql(") AS completed, count(*) FILTER (WHERE ");
        name::<k::state>(&mut out)?;
        out.push_sql(" = ");
        out.push_bind_param::<Text, _>(&IN_FLIGHT)?;
        out.push_sql(") AS in_flight FROM gone");
        Ok(())
    }
}

/// The row of [`Purge`].
#[derive(QueryableByName, Debug)]
struct PurgedRow {
    #[diesel(sql_type = BigInt)]
    completed: i64,
    #[diesel(sql_type = BigInt)]
    in_flight: i64,
}

/// Run [`Purge`]; on the rotated layout, whose `idempotency_keys` is a view, the same statement
/// on its current and previous tables (`idempotency_purge_rows`, migration 000016).
pub(crate) async fn purge(
    conn: &mut AsyncPgConnection,
    filter: &PurgeFilter,
    limit: u32,
) -> QueryResult<Purged> {
    let row = if rotated(conn).await? {
        let call = diesel::sql_query(
            "SELECT completed, in_flight FROM idempotency_purge_rows($1, $2, $3, $4)",
        )
        .bind::<BigInt, _>(super::micros(filter.grace))
        .bind::<Nullable<BigInt>, _>(filter.older_than.map(super::micros))
        .bind::<Nullable<Text>, _>(filter.tenant.as_deref())
        .bind::<BigInt, _>(i64::from(limit));
        committed::<PurgedRow>(call.load(conn).await?)?
    } else {
        let query = Purge {
            rows: Purgeable::new(filter),
            limit: i64::from(limit),
        };
        committed::<PurgedRow>(query.load(conn).await?)?
    };
    Ok(Purged {
        completed: non_negative(row.completed),
        in_flight: non_negative(row.in_flight),
    })
}

/// What [`purge`] would delete now, by state, without deleting (`purge --dry-run`).
pub(crate) async fn purge_count(
    conn: &mut AsyncPgConnection,
    filter: &PurgeFilter,
) -> QueryResult<Purged> {
    let counts: Vec<(State, i64)> = k::table
        .filter(Purgeable::new(filter))
        .group_by(k::state)
        .select((k::state, count(k::tenant)))
        .load(conn)
        .await?;
    let mut purged = Purged::default();
    for (state, n) in counts {
        match state {
            State::Completed => purged.completed = non_negative(n),
            State::InFlight => purged.in_flight = non_negative(n),
        }
    }
    Ok(purged)
}

/// The lock key `$1` for the `idempotency_keys` table the session's `search_path` finds: its
/// low 32 bits XORed with the table's oid, so the tables of two schemas in one database get
/// two locks (one key per database made the purge of one schema skip the other's); the high 32
/// bits (`classid` in `pg_locks`) stay the key's.
macro_rules! table_lock_key {
    () => {
        "($1 # 'idempotency_keys'::regclass::oid::bigint)"
    };
}

/// The answer of an advisory-lock function.
#[derive(QueryableByName)]
struct LockAnswer {
    #[diesel(sql_type = Bool)]
    done: bool,
}

/// Take the purge advisory lock of this session's table without waiting; `false` when another
/// session holds it.
pub(crate) async fn try_lock(conn: &mut AsyncPgConnection, key: i64) -> QueryResult<bool> {
    let query = concat!(
        "SELECT pg_try_advisory_lock(",
        table_lock_key!(),
        ") AS done"
    );
    lock_call(conn, query, key).await
}

/// Release the advisory lock [`try_lock`] took.
pub(crate) async fn unlock(conn: &mut AsyncPgConnection, key: i64) -> QueryResult<bool> {
    let query = concat!("SELECT pg_advisory_unlock(", table_lock_key!(), ") AS done");
    lock_call(conn, query, key).await
}

/// One advisory-lock function call on `key` ([`table_lock_key`]), and its answer.
async fn lock_call(
    conn: &mut AsyncPgConnection,
    query: &'static str,
    key: i64,
) -> QueryResult<bool> {
    diesel::sql_query(query)
        .bind::<BigInt, _>(key)
        .get_result::<LockAnswer>(conn)
        .await
        .map(|answer| answer.done)
}

fn non_negative(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Provisioning probe

/// Whether the schema is provisioned: the table `idempotency_keys` and the functions the
/// request path calls (`idempotency_reserve`, `idempotency_complete`, and since migration 000015
/// `idempotency_release`, `idempotency_renew_lease`, `idempotency_completed_by`) are visible on the
/// connection's `search_path`, and on the partitioned layout (which its own function
/// `idempotency_partitions_drop` marks) its response table `idempotency_responses` too.
/// Used to recognise SQLSTATE 42P01 / 42883 (undefined table / function), which diesel-async
/// reports only as an unknown database error; a database migrated only to the first migration
/// thus also gets the "run `idem-cli migrate`" hint.
///
/// Raw SQL: catalog lookups by name (`to_regclass`, `to_regprocedure`) are not table queries.
pub(crate) struct TableExists;

/// The tables of the layout the database has: `idempotency_keys`, and on the partitioned
/// layout (which its own function `idempotency_partitions_drop` marks) `idempotency_responses`,
/// on the rotated layout (marked by `idempotency_rotate`; there `idempotency_keys` is a view)
/// `idempotency_generation` and the three generation tables.
/// Part of [`TableExists`], and alone [`keys_table_exists`].
const TABLES_PRESENT: &str = "to_regclass('idempotency_keys') IS NOT NULL \
     AND (to_regprocedure('idempotency_partitions_drop(bigint, integer)') IS NULL \
          OR to_regclass('idempotency_responses') IS NOT NULL) \
     AND (to_regprocedure('idempotency_rotate(integer, bigint)') IS NULL \
          OR (to_regclass('idempotency_generation') IS NOT NULL \
              AND to_regclass('idempotency_keys_0') IS NOT NULL \
              AND to_regclass('idempotency_keys_1') IS NOT NULL \
              AND to_regclass('idempotency_keys_2') IS NOT NULL))";

statement!(TableExists, TableExistsId);

impl QueryFragment<Pg> for TableExists {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("SELECT ");
        out.push_sql(TABLES_PRESENT);
        out.push_sql(
            " AND to_regprocedure(\
                 'idempotency_reserve(text, text, text, text, bytea, uuid, bigint)') IS NOT NULL \
             AND to_regprocedure('idempotency_complete(text, text, text, text, uuid, \
                 smallint, bytea, bytea, bigint)') IS NOT NULL \
             AND to_regprocedure('idempotency_release(text, text, text, text, uuid)') \
                 IS NOT NULL \
             AND to_regprocedure('idempotency_renew_lease(text, text, text, text, uuid, \
                 bigint)') IS NOT NULL \
             AND to_regprocedure('idempotency_completed_by(text, text, text, text, \
                 uuid)') IS NOT NULL AS present",
        );
        Ok(())
    }
}

/// The row of [`TableExists`] and [`ClaimExists`].
#[derive(QueryableByName, Debug)]
pub(crate) struct ExistsRow {
    #[diesel(sql_type = Bool)]
    pub(crate) present: bool,
}

/// Whether the tables of the database's layout are visible ([`TABLES_PRESENT`]), whatever the
/// functions [`TableExists`] requires too: the layout can be read. `idem-cli migrate` asks
/// before it applies pending migrations, which may be what adds the functions.
///
/// Raw SQL: catalog lookups by name, as [`TableExists`]; the admin path runs it once.
pub(crate) async fn keys_table_exists(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    diesel::sql_query(format!("SELECT {TABLES_PRESENT} AS present"))
        .get_result::<ExistsRow>(conn)
        .await
        .map(|row| row.present)
}

/// Whether the transactional claim function (third migration) exists, to tell a database
/// migrated only to the second migration from another failure: visible on the connection's
/// `search_path`, or that `search_path` is not the one the session started with (a handler's
/// leaked `SET search_path`: not a database to migrate, and the connection is discarded after
/// the failure anyway). A function in some other schema does not count: a deployment may keep
/// a second, older schema on the same database (`docs/operations.md`).
///
/// Raw SQL: catalog lookups by name, as [`TableExists`].
pub(crate) struct ClaimExists;

statement!(ClaimExists, ClaimExistsId);

impl QueryFragment<Pg> for ClaimExists {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "SELECT to_regprocedure('idempotency_tx_claim(text, text, text, text, text, text, \
             bytea, uuid, bigint)') IS NOT NULL \
             OR current_setting('search_path') IS DISTINCT FROM \
                (SELECT reset_val FROM pg_catalog.pg_settings WHERE name = 'search_path') \
             AS present",
        );
        Ok(())
    }
}

/// Whether a connection carries a session setting a handler changed (`SET` without `LOCAL`:
/// `search_path`, `default_transaction_read_only`, `statement_timeout`), which can fail the
/// store's own statements. The two settings diesel-async itself sets for the session when it
/// connects (`TimeZone`, `client_encoding`) are not counted. `SET SESSION AUTHORIZATION`
/// counts too: PostgreSQL hides it from `pg_settings`, so the session's user is compared with
/// the role the connection logged in as (review, 2026-12-06). `SET ROLE` is not seen: it is
/// hidden as well, and comparing the current role with the session's would count a login
/// role's own default role (`ALTER ROLE .. SET role`, `-c role=..`) as a change, closing a
/// connection on every failed claim. Asked after one of the
/// middleware's statements failed on a request's
/// connection, so that only such a connection is closed: an error a client can choose (a path
/// too long for the index) keeps its connection, rather than cost the database a new session
/// per request.
///
/// Raw SQL: a catalog read, sent unnamed (not prepared), so it works on a connection whose
/// prepared statements are gone.
pub(crate) const SESSION_ALTERED: &str = "SELECT EXISTS (SELECT FROM pg_catalog.pg_settings \
     WHERE source = 'session' AND name NOT IN ('TimeZone', 'client_encoding')) \
     OR session_user IS DISTINCT FROM (SELECT usename FROM pg_catalog.pg_stat_activity \
     WHERE pid = pg_catalog.pg_backend_pid()) AS present";

/// Run [`SESSION_ALTERED`]; `true` also when it cannot be answered.
pub(crate) async fn session_altered(conn: &mut AsyncPgConnection) -> bool {
    diesel::sql_query(SESSION_ALTERED)
        .get_result::<ExistsRow>(conn)
        .await
        .map_or(true, |row| row.present)
}

/// Run [`ClaimExists`].
pub(crate) async fn claim_exists(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    ClaimExists
        .get_result::<ExistsRow>(conn)
        .await
        .map(|row| row.present)
}

// ---------------------------------------------------------------------------------------------
// Admin queries (idem-cli list, show, stats, release)

/// The rows `idem-cli list` shows, oldest first, at most `filter.limit` (all when `None`). A
/// query, not rows: the CLI streams it.
pub(crate) fn list(
    filter: &ListFilter,
) -> k::BoxedQuery<'_, Pg, diesel::dsl::SqlTypeOf<diesel::dsl::AsSelect<Record, Pg>>> {
    let mut query = k::table.select(Record::as_select()).into_boxed();
    if let Some(tenant) = &filter.tenant {
        query = query.filter(k::tenant.eq(tenant));
    }
    if let Some(prefix) = &filter.key_prefix {
        query = query.filter(starts_with(k::idempotency_key, prefix));
    }
    if let Some(age) = filter.older_than {
        query = query.filter(k::created_at.le(DbNow::minus(super::micros(age))));
    }
    query = match filter.state {
        None => query,
        Some(ListState::InFlight) => query.filter(k::state.eq(State::InFlight)),
        Some(ListState::Completed) => query
            .filter(k::state.eq(State::Completed))
            .filter(k::expires_at.gt(DbNow)),
        Some(ListState::Expired) => query
            .filter(k::state.eq(State::Completed))
            .filter(k::expires_at.le(DbNow)),
    };
    query = query.order((
        k::created_at,
        k::tenant,
        k::method,
        k::path,
        k::idempotency_key,
    ));
    match filter.limit {
        Some(limit) => query.limit(limit),
        None => query,
    }
}

/// `query` narrowed to a key in an optional scope, in scope order.
macro_rules! key_scope {
    ($query:expr, $scope:expr) => {{
        let scope: &KeyScope = $scope;
        let mut query = $query.filter(k::idempotency_key.eq(&scope.key));
        if let Some(tenant) = &scope.tenant {
            query = query.filter(k::tenant.eq(tenant));
        }
        if let Some(method) = &scope.method {
            query = query.filter(k::method.eq(method));
        }
        if let Some(path) = &scope.path {
            query = query.filter(k::path.eq(path));
        }
        query.order((k::tenant, k::method, k::path))
    }};
}

/// The records with `scope.key` in the scope given (`idem-cli release`).
pub(crate) async fn find(
    conn: &mut AsyncPgConnection,
    scope: &KeyScope,
) -> QueryResult<Vec<Record>> {
    key_scope!(k::table.select(Record::as_select()).into_boxed(), scope)
        .load(conn)
        .await
}

/// As [`find`], with the stored responses (`idem-cli show`). A query, not rows: the CLI
/// streams it, so a key that names many records with large responses is printed record by
/// record instead of held whole in memory.
pub(crate) fn find_detail(
    scope: &KeyScope,
) -> k::BoxedQuery<'_, Pg, diesel::dsl::SqlTypeOf<diesel::dsl::AsSelect<Detail, Pg>>> {
    key_scope!(k::table.select(Detail::as_select()).into_boxed(), scope)
}

/// Delete exactly the record that was inspected: same scope, state and token; without `force`
/// its lease must still be over at the moment of deletion. `false` when it changed meanwhile.
pub(crate) async fn release_inspected(
    conn: &mut AsyncPgConnection,
    record: &Record,
    force: bool,
) -> QueryResult<bool> {
    let target = k::table
        .find((
            &record.tenant,
            &record.method,
            &record.path,
            &record.idempotency_key,
        ))
        .filter(k::state.eq(record.state))
        .filter(k::token.is_not_distinct_from(record.token));
    let deleted = if force {
        diesel::delete(target).execute(conn).await?
    } else {
        diesel::delete(
            target
                .filter(k::state.eq(State::InFlight))
                .filter(k::locked_until.le(DbNow.nullable())),
        )
        .execute(conn)
        .await?
    };
    Ok(deleted > 0)
}

/// The eight counts and three sizes of [`stats`], in select order.
type StatsRow = (
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// `idem-cli stats`: every count in one scan (`count(...) FILTER`), so the numbers are mutually
/// consistent, and the sizes from the catalog (`pg_table_size` includes TOAST, where large
/// bodies live).
pub(crate) async fn stats(conn: &mut AsyncPgConnection) -> QueryResult<Stats> {
    let in_flight = || k::state.eq(State::InFlight);
    let completed = || k::state.eq(State::Completed);
    let live = || k::expires_at.gt(DbNow);
    let ended = || k::expires_at.le(DbNow);
    // Raw SQL for the sizes: catalog functions of the tables' oids, no table columns. On the
    // rotated layout `idempotency_keys` is a view (no storage) and the bytes are its three
    // generation tables'.
    let size = |function: &str| {
        diesel::dsl::sql::<Nullable<BigInt>>(&format!(
            "(SELECT sum({function}(r))::bigint FROM unnest(ARRAY[\
             to_regclass('idempotency_keys'), to_regclass('idempotency_keys_0'), \
             to_regclass('idempotency_keys_1'), to_regclass('idempotency_keys_2')]) r \
             WHERE r IS NOT NULL)"
        ))
    };
    let row: StatsRow = k::table
        .select((
            count(k::tenant),
            count(k::tenant).aggregate_filter(in_flight()),
            // A reservation's lease is its `locked_until`, which equals its `expires_at`.
            count(k::tenant).aggregate_filter(in_flight().and(live())),
            count(k::tenant).aggregate_filter(in_flight().and(ended())),
            count(k::tenant).aggregate_filter(completed()),
            count(k::tenant).aggregate_filter(completed().and(live())),
            count(k::tenant).aggregate_filter(completed().and(ended())),
            count(k::tenant).aggregate_filter(ended()),
            size("pg_table_size"),
            size("pg_indexes_size"),
            size("pg_total_relation_size"),
        ))
        .get_result(conn)
        .await?;
    Ok(Stats {
        total: row.0,
        in_flight: row.1,
        in_flight_lease_live: row.2,
        in_flight_lease_ended: row.3,
        completed: row.4,
        completed_live: row.5,
        completed_expired: row.6,
        expired_not_purged: row.7,
        table_bytes: row.8,
        index_bytes: row.9,
        total_bytes: row.10,
    })
}

/// The oldest reservation (`idem-cli stats`).
pub(crate) async fn oldest_in_flight(conn: &mut AsyncPgConnection) -> QueryResult<Option<Record>> {
    k::table
        .filter(k::state.eq(State::InFlight))
        // Equal times by scope, so the answer is the same on every run (no index serves this
        // query either way: it reads the in-flight rows).
        .order((
            k::created_at,
            k::tenant,
            k::method,
            k::path,
            k::idempotency_key,
        ))
        .select(Record::as_select())
        .first(conn)
        .await
        .optional()
}

/// Every record with its response, in scope order (test helpers).
pub(crate) async fn all(conn: &mut AsyncPgConnection) -> QueryResult<Vec<Detail>> {
    k::table
        .select(Detail::as_select())
        .order((k::tenant, k::method, k::path, k::idempotency_key))
        .load(conn)
        .await
}

// ---------------------------------------------------------------------------------------------
// Layouts and partition maintenance (idem-cli migrate --check / stats / purge)
//
// Run once per command, so plain `sql_query` (not prepared across calls). The partition DDL is
// in functions of migration 000005 and the migrations that replaced them
// (`idempotency_partitions_create`, `_drop`, `idempotency_purge_default`,
// `idempotency_partitions`); these are their calls.

/// One name returned by a maintenance function.
#[derive(QueryableByName, Debug)]
struct NameRow {
    #[diesel(sql_type = Text)]
    name: String,
}

/// The layout probe's row.
#[derive(QueryableByName, Debug)]
struct LayoutRow {
    #[diesel(sql_type = Bool)]
    partitioned: bool,
}

/// The rotated layout probe's row.
#[derive(QueryableByName, Debug)]
struct RotatedRow {
    #[diesel(sql_type = Bool)]
    rotated: bool,
}

/// Whether the database has the rotated layout (migration 000016: `idempotency_generation`).
pub(crate) async fn rotated(conn: &mut AsyncPgConnection) -> QueryResult<bool> {
    let row: RotatedRow =
        diesel::sql_query("SELECT to_regclass('idempotency_generation') IS NOT NULL AS rotated")
            .get_result(conn)
            .await?;
    Ok(row.rotated)
}

/// Call `idempotency_rotate` (migration 000016), read to `ReadyForQuery` (its commit).
pub(crate) async fn rotate(
    conn: &mut AsyncPgConnection,
    lock_timeout_ms: i32,
    grace_us: i64,
) -> QueryResult<super::admin::Rotation> {
    let call = diesel::sql_query(
        "SELECT rotated, rotated OR blocked_by_pid IS NOT NULL AS due, generation, \
         next_rotation, carried, blocked_by_pid FROM idempotency_rotate($1, $2)",
    )
    .bind::<diesel::sql_types::Integer, _>(lock_timeout_ms)
    .bind::<BigInt, _>(grace_us);
    committed(call.load(conn).await?)
}

/// The rotated layout's period, in microseconds.
#[derive(QueryableByName, Debug)]
struct PeriodRow {
    #[diesel(sql_type = BigInt)]
    us: i64,
}

/// The rotated layout's rotation period (`idempotency_generation.period`).
pub(crate) async fn rotation_period(
    conn: &mut AsyncPgConnection,
) -> QueryResult<std::time::Duration> {
    let row: PeriodRow = diesel::sql_query(
        "SELECT (extract(epoch FROM period) * 1000000)::bigint AS us FROM idempotency_generation",
    )
    .get_result(conn)
    .await?;
    Ok(std::time::Duration::from_micros(
        u64::try_from(row.us).unwrap_or(0),
    ))
}

/// Read the generation row as [`rotate`] reports it, without rotating.
pub(crate) async fn next_rotation(
    conn: &mut AsyncPgConnection,
) -> QueryResult<super::admin::Rotation> {
    diesel::sql_query(
        "SELECT false AS rotated, now() >= switched_at + period AS due, current AS generation, \
         switched_at + period AS next_rotation, 0::bigint AS carried, \
         NULL::integer AS blocked_by_pid FROM idempotency_generation",
    )
    .get_result(conn)
    .await
}

/// The partition interval's row.
#[derive(QueryableByName, Debug)]
struct IntervalRow {
    #[diesel(sql_type = Text)]
    interval: String,
}

/// The partition interval of the partitioned layout (`hourly`/`daily`), `None` in the plain
/// layout. One catalog probe, then (partitioned only) the one-row settings table: two
/// statements, because a statement naming a missing table fails when parsed.
pub(crate) async fn partition_interval(
    conn: &mut AsyncPgConnection,
) -> QueryResult<Option<String>> {
    let layout: LayoutRow =
        diesel::sql_query("SELECT to_regclass('idempotency_responses') IS NOT NULL AS partitioned")
            .get_result(conn)
            .await?;
    if !layout.partitioned {
        return Ok(None);
    }
    let row: IntervalRow = diesel::sql_query(
        "SELECT CASE step WHEN interval '1 hour' THEN 'hourly' ELSE 'daily' END AS interval \
         FROM idempotency_partitioning",
    )
    .get_result(conn)
    .await?;
    Ok(Some(row.interval))
}

/// The partitions of `idempotency_responses`, range partitions in bound order, then the default.
pub(crate) async fn partitions(conn: &mut AsyncPgConnection) -> QueryResult<Vec<Partition>> {
    diesel::sql_query(
        "SELECT name, is_default, lower_bound, upper_bound, bytes, estimated_rows \
         FROM idempotency_partitions()",
    )
    .load(conn)
    .await
}

/// Create the partitions of the current interval and the next `ahead` ones that are missing.
pub(crate) async fn create_partitions(
    conn: &mut AsyncPgConnection,
    ahead: i32,
    lock_timeout_ms: i32,
) -> QueryResult<Vec<String>> {
    let rows: Vec<NameRow> =
        diesel::sql_query("SELECT p AS name FROM idempotency_partitions_create($1, $2) p")
            .bind::<diesel::sql_types::Integer, _>(ahead)
            .bind::<diesel::sql_types::Integer, _>(lock_timeout_ms)
            .load(conn)
            .await?;
    Ok(rows.into_iter().map(|r| r.name).collect())
}

/// The partitioned layout's response partitions (range partitions and the default) and the
/// server's `max_locks_per_transaction`, for the partition budget (`admin::max_partitions`).
pub(crate) async fn partition_lock_budget(conn: &mut AsyncPgConnection) -> QueryResult<(i64, i32)> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        leaves: i64,
        #[diesel(sql_type = diesel::sql_types::Integer)]
        max_locks: i32,
    }
    let row: Row = diesel::sql_query(
        "SELECT (SELECT count(*) FROM pg_inherits \
                  WHERE inhparent = 'idempotency_responses'::regclass) AS leaves, \
                current_setting('max_locks_per_transaction')::int AS max_locks",
    )
    .get_result(conn)
    .await?;
    Ok((row.leaves, row.max_locks))
}

/// Drop the range partitions whose upper bound is `grace_us` or more in the past.
pub(crate) async fn drop_partitions(
    conn: &mut AsyncPgConnection,
    grace_us: i64,
    lock_timeout_ms: i32,
) -> QueryResult<Vec<String>> {
    let rows: Vec<NameRow> =
        diesel::sql_query("SELECT p AS name FROM idempotency_partitions_drop($1, $2) p")
            .bind::<BigInt, _>(grace_us)
            .bind::<diesel::sql_types::Integer, _>(lock_timeout_ms)
            .load(conn)
            .await?;
    Ok(rows.into_iter().map(|r| r.name).collect())
}

/// The partitions [`drop_partitions`] would drop, read only (it may leave one that something
/// other than a request holds). The condition is that of `idempotency_partitions_drop`
/// (migration 000012), which a migration owns: the two must
/// change together (`idem-cli`'s `partitioned_layout_migrate_check_stats_show_and_purge`
/// compares a dry run with the run).
pub(crate) async fn droppable_partitions(
    conn: &mut AsyncPgConnection,
    grace_us: i64,
) -> QueryResult<Vec<String>> {
    let rows: Vec<NameRow> = diesel::sql_query(
        "SELECT name FROM idempotency_partitions() \
          WHERE NOT is_default AND upper_bound <= now() - $1 * interval '1 microsecond' \
          ORDER BY upper_bound",
    )
    .bind::<BigInt, _>(grace_us)
    .load(conn)
    .await?;
    Ok(rows.into_iter().map(|r| r.name).collect())
}

/// The row of [`purge_default_partition`].
#[derive(QueryableByName, Debug)]
struct DeletedRow {
    #[diesel(sql_type = BigInt)]
    deleted: i64,
}

/// Delete up to `limit` rows of the default partition that expired `older_than_us` or more
/// ago.
pub(crate) async fn purge_default_partition(
    conn: &mut AsyncPgConnection,
    limit: i32,
    older_than_us: i64,
) -> QueryResult<u64> {
    let rows: Vec<DeletedRow> =
        diesel::sql_query("SELECT idempotency_purge_default($1, $2) AS deleted")
            .bind::<diesel::sql_types::Integer, _>(limit)
            .bind::<BigInt, _>(older_than_us)
            .load(conn)
            .await?;
    Ok(non_negative(committed(rows)?.deleted))
}

// Checked at compile time: without a static id diesel-async would not cache the prepared
// statement, and every execution would cost a Parse round trip.
const _: () = {
    assert!(<Reserve<'static> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<ReplayRead<'static> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<Complete<'static> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<Purge as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<TableExists as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<NowShifted as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<TxClaim<'static> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<SetTenant<'static> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<ClaimExists as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<Fenced<'static, ReleaseId> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<Fenced<'static, RenewLeaseId> as QueryId>::HAS_STATIC_QUERY_ID);
    assert!(<Fenced<'static, CompletedById> as QueryId>::HAS_STATIC_QUERY_ID);
};

#[cfg(test)]
mod tests {
    use super::*;

    fn sql_of<T: QueryFragment<Pg>>(query: &T) -> String {
        diesel::debug_query::<Pg, _>(query).to_string()
    }

    /// Binds are numbered as they are pushed: the purge statement's text holds `$1`..`$n` in
    /// order, and the grep-able state values come from the schema.
    #[test]
    fn purge_statement_is_the_documented_one() {
        let purge = Purge {
            rows: Purgeable::new(&PurgeFilter {
                grace: std::time::Duration::from_secs(1),
                older_than: None,
                tenant: Some("t".into()),
            }),
            limit: 10,
        };
        let sql = sql_of(&purge);
        assert!(sql.starts_with("WITH gone AS (DELETE FROM \"idempotency_keys\" WHERE ctid"));
        assert!(sql.contains("FOR UPDATE SKIP LOCKED"), "{sql}");
        assert!(
            sql.contains("ORDER BY \"idempotency_keys\".\"expires_at\" LIMIT $"),
            "{sql}"
        );
        for n in 1..=9 {
            assert!(sql.contains(&format!("${n}")), "${n} in {sql}");
        }
        assert!(!sql.contains("$10"), "{sql}");
    }

    fn scope() -> ScopeBinds<'static> {
        ScopeBinds {
            tenant: "t",
            method: "POST",
            path: "/p",
            key: "k",
        }
    }

    fn reserve(fingerprint: &[u8]) -> Reserve<'_> {
        Reserve {
            scope: scope(),
            fingerprint,
            token: uuid::Uuid::nil(),
            lease_us: 1,
        }
    }

    /// Each bind once, numbered in order, none left over: the claim's two settings, then the
    /// reserve call's seven.
    #[test]
    fn claim_binds_each_parameter_once_in_order() {
        let fingerprint = [0u8; 32];
        let claim = TxClaim {
            setting: Some("app.tenant_id"),
            setting_value: Some("t"),
            reserve: reserve(&fingerprint),
        };
        let sql = sql_of(&claim);
        assert!(
            sql.starts_with("SELECT * FROM idempotency_tx_claim($1, $2, $3,"),
            "{sql}"
        );
        for n in 1..=9 {
            assert_eq!(sql.matches(&format!("${n}")).count(), 1, "{sql}");
        }
        assert!(!sql.contains("$10"), "{sql}");
        let reserve_sql = sql_of(&reserve(&fingerprint));
        assert!(
            reserve_sql
                .starts_with("SELECT * FROM idempotency_reserve($1, $2, $3, $4, $5, $6, $7)"),
            "{reserve_sql}"
        );
    }

    /// The replay read is one call of the layout's replay function (it
    /// knows where the response lives: the keys table or the partitioned
    /// responses table), binding the four scope parts once each, in order.
    #[test]
    fn replay_read_calls_the_layout_replay_function() {
        let sql = sql_of(&ReplayRead { scope: scope() });
        assert!(
            sql.starts_with("SELECT * FROM idempotency_replay($1, $2, $3, $4)"),
            "{sql}"
        );
        assert!(
            sql.ends_with("binds: [\"t\", \"POST\", \"/p\", \"k\"]"),
            "{sql}"
        );
        assert!(!sql.contains("$5"), "{sql}");
    }

    /// Release, lease renewal and the completed-by check are calls of their functions (so a
    /// migration can change the table's key under them), each bind once and in order.
    #[test]
    fn fenced_calls_name_their_functions() {
        let scope = scope();
        let token = uuid::Uuid::nil();
        fn call<F: FencedFunction>(scope: &ScopeBinds<'_>, token: uuid::Uuid) -> String {
            sql_of(&Fenced::<F> {
                scope,
                token,
                lease_us: 7,
                function: PhantomData,
            })
        }
        for (sql, expected) in [
            (
                call::<ReleaseId>(&scope, token),
                "SELECT idempotency_release($1, $2, $3, $4, $5) AS found",
            ),
            (
                call::<CompletedById>(&scope, token),
                "SELECT idempotency_completed_by($1, $2, $3, $4, $5) AS found",
            ),
            (
                call::<RenewLeaseId>(&scope, token),
                "SELECT idempotency_renew_lease($1, $2, $3, $4, $5, $6) AS found",
            ),
        ] {
            assert!(sql.starts_with(expected), "{sql}");
            assert!(
                sql.contains("binds: [\"t\", \"POST\", \"/p\", \"k\", "),
                "{sql}"
            );
        }
    }

    #[test]
    #[ignore = "prints the SQL for docs/sql.md"]
    fn print_sql() {
        let scope = ScopeBinds {
            tenant: "t",
            method: "POST",
            path: "/p",
            key: "k",
        };
        println!(
            "{}",
            sql_of(&Reserve {
                scope,
                fingerprint: &[0; 32],
                token: uuid::Uuid::nil(),
                lease_us: 1
            })
        );
        println!(
            "{}",
            sql_of(&Purge {
                rows: Purgeable::new(&PurgeFilter::default()),
                limit: 1
            })
        );
    }
}
