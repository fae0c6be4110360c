//! The SQL of the request path, as diesel query fragments that are prepared once per
//! connection.
//!
//! `diesel::sql_query` is never cached as a prepared statement, and diesel-async then pays a
//! Parse round trip before every Execute. Each statement here is a small struct implementing
//! [`QueryFragment`] (static SQL plus binds) with a *static* [`QueryId`], so diesel-async's
//! per-connection statement cache prepares it on first use and every later execution on that
//! connection is one round trip (Bind/Execute/Sync in one flight). `docs/sql.md` explains each
//! statement and how the round trips were counted.
//!
//! Every statement references each bind parameter once (`$1`..`$n` in order of appearance),
//! because diesel numbers binds as they are pushed; reserve passes them to a PL/pgSQL function
//! (created by the second migration) in that order.
//!
//! All times come from the database (`now()`); durations travel as bigint microseconds.

use diesel::pg::Pg;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::sql_types::{BigInt, Bool, Bytea, Nullable, SmallInt, Text, Untyped};
use diesel::{QueryResult, QueryableByName};

/// Marks a statement struct as a query with a static id (so diesel-async caches its prepared
/// statement per connection) whose rows are loaded by name.
macro_rules! cached_statement {
    ($name:ident, $id:ident) => {
        /// Static query id for the statement cache.
        pub(crate) struct $id;

        impl QueryId for $name<'_> {
            type QueryId = $id;
            const HAS_STATIC_QUERY_ID: bool = true;
        }

        impl Query for $name<'_> {
            type SqlType = Untyped;
        }
    };
}

/// The scope binds shared by every statement: always `$1`..`$4`.
fn push_scope<'b>(out: &mut AstPass<'_, 'b, Pg>, scope: &'b ScopeBinds<'_>) -> QueryResult<()> {
    out.push_bind_param::<Text, _>(&scope.tenant)?;
    out.push_sql(", ");
    out.push_bind_param::<Text, _>(&scope.method)?;
    out.push_sql(", ");
    out.push_bind_param::<Text, _>(&scope.path)?;
    out.push_sql(", ");
    out.push_bind_param::<Text, _>(&scope.key)?;
    Ok(())
}

/// The four parts of a scope, borrowed.
pub(crate) struct ScopeBinds<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) method: &'a str,
    pub(crate) path: &'a str,
    pub(crate) key: &'a str,
}

// ---------------------------------------------------------------------------------------------
// reserve-or-fetch

/// Reserve-or-fetch in one statement: a call of the PL/pgSQL function `idempotency_reserve`
/// (migration `2026-11-30-000002_reserve_function`). Binds: `$1..$4` scope, `$5` fingerprint,
/// `$6` token, `$7` lease in microseconds.
pub(crate) struct Reserve<'a> {
    pub(crate) scope: ScopeBinds<'a>,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) token: uuid::Uuid,
    pub(crate) lease_us: i64,
}

cached_statement!(Reserve, ReserveId);

/// The reserve call, in two parts around the binds.
///
/// How it works (the function body is in `migrations/2026-11-30-000002_reserve_function/up.sql`,
/// explained in `docs/sql.md`):
/// - It reads first: a plain primary-key SELECT, no lock. A live completed row (replay), a live
///   reservation, or an ended reservation of another fingerprint is returned as `existing`
///   without any write. So the replay path costs one index read, where the CTE statement this
///   replaces planned and initialised an UPDATE and an INSERT on every call.
/// - Only then does it write: `INSERT ... ON CONFLICT DO NOTHING` for an absent key, or an
///   UPDATE fenced by `expires_at <= now()` and `state = 'completed' OR fingerprint = $5` for an
///   ended, eligible row. Each write is conditional on the row being absent/ended *under its
///   lock* (the UPDATE's WHERE is re-evaluated on the newest row version after waiting for a
///   concurrent writer, READ COMMITTED's EvalPlanQual), so at most one call can reserve a key.
/// - A write that found nothing to do means a concurrent writer won; the function re-reads
///   (each statement of a VOLATILE function in READ COMMITTED gets a fresh snapshot) and
///   decides again, in a bounded loop. Only if the key changed under every attempt does it
///   answer `raced` (nothing written); the caller then calls again.
///
/// The statement names its columns, so the row is loaded by name exactly as before. It is still
/// one statement, prepared once per connection: one round trip per reserve.
const RESERVE_SQL_HEAD: &str = "\
SELECT outcome, state, fingerprint, lease_remaining_us, response_status, response_headers,
       response_body, live, eligible
FROM idempotency_reserve(";
// $1, $2, $3, $4 (scope), $5 fingerprint, $6 token, $7 lease_us, then:
const RESERVE_SQL_TAIL: &str = ")";

impl QueryFragment<Pg> for Reserve<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(RESERVE_SQL_HEAD);
        // The function's signature fixes the parameter types of the prepared statement.
        push_scope(&mut out, &self.scope)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&self.fingerprint)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.lease_us)?;
        out.push_sql(RESERVE_SQL_TAIL);
        Ok(())
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

cached_statement!(ReplayRead, ReplayReadId);

const REPLAY_READ_SQL_HEAD: &str = "\
SELECT 'existing'::text AS outcome, state, fingerprint,
       (extract(epoch FROM expires_at - now()) * 1000000)::bigint AS lease_remaining_us,
       response_status, response_headers, response_body, true AS live, true AS eligible
FROM idempotency_keys
WHERE (tenant, method, path, idempotency_key) = (";
// $1, $2, $3, $4 (scope), then:
const REPLAY_READ_SQL_TAIL: &str = ") AND state = 'completed' AND expires_at > now()";

impl QueryFragment<Pg> for ReplayRead<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(REPLAY_READ_SQL_HEAD);
        push_scope(&mut out, &self.scope)?;
        out.push_sql(REPLAY_READ_SQL_TAIL);
        Ok(())
    }
}

/// One row of the reserve statement.
#[derive(QueryableByName, Debug)]
pub(crate) struct ReserveRow {
    /// `reserved`, `existing` or `raced`.
    #[diesel(sql_type = Text)]
    pub(crate) outcome: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) state: Option<String>,
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

// ---------------------------------------------------------------------------------------------
// complete

/// Store the response, fenced by the token. Binds: `$1..$4` scope, `$5` token, `$6` status,
/// `$7` encoded headers, `$8` body, `$9` TTL in microseconds. Affects one row (applied) or
/// none (stale: the token no longer holds an in-flight reservation).
pub(crate) struct Complete<'a> {
    pub(crate) scope: ScopeBinds<'a>,
    pub(crate) token: uuid::Uuid,
    pub(crate) status: i16,
    pub(crate) headers: &'a [u8],
    pub(crate) body: &'a [u8],
    pub(crate) ttl_us: i64,
}

cached_statement!(Complete, CompleteId);

impl QueryFragment<Pg> for Complete<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        // The WHERE clause comes first in bind order, so the statement is written with the
        // scope and token binds leading, via a one-row VALUES joined in as `p`.
        out.push_sql(
            "UPDATE idempotency_keys k \
             SET state = 'completed', response_status = p.status, \
                 response_headers = p.headers, response_body = p.body, \
                 completed_at = now(), locked_until = NULL, \
                 expires_at = now() + p.ttl_us * interval '1 microsecond' \
             FROM (VALUES (",
        );
        push_scope(&mut out, &self.scope)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        out.push_sql(", ");
        out.push_bind_param::<SmallInt, _>(&self.status)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&self.headers)?;
        out.push_sql(", ");
        out.push_bind_param::<Bytea, _>(&self.body)?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.ttl_us)?;
        out.push_sql(
            ")) AS p(tenant, method, path, idempotency_key, token, status, headers, body, ttl_us) \
             WHERE (k.tenant, k.method, k.path, k.idempotency_key) \
                   = (p.tenant, p.method, p.path, p.idempotency_key) \
               AND k.state = 'in_flight' AND k.token = p.token",
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// release

/// Delete the reservation, fenced by the token. Binds: `$1..$4` scope, `$5` token.
pub(crate) struct Release<'a> {
    pub(crate) scope: ScopeBinds<'a>,
    pub(crate) token: uuid::Uuid,
}

cached_statement!(Release, ReleaseId);

impl QueryFragment<Pg> for Release<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "DELETE FROM idempotency_keys \
             WHERE (tenant, method, path, idempotency_key) = (",
        );
        push_scope(&mut out, &self.scope)?;
        out.push_sql(") AND state = 'in_flight' AND token = ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// purge

/// Delete up to `$2` expired rows: completed rows past their TTL, reservations whose lease
/// ended more than `$1` microseconds ago. `FOR UPDATE SKIP LOCKED` lets overlapping purges
/// (and requests touching a row) pass each other instead of queueing; each batch is its own
/// short transaction.
pub(crate) struct PurgeBatch {
    pub(crate) grace_us: i64,
    pub(crate) limit: i64,
}

/// Static query id for the statement cache.
pub(crate) struct PurgeBatchId;

impl QueryId for PurgeBatch {
    type QueryId = PurgeBatchId;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for PurgeBatch {
    type SqlType = Untyped;
}

impl QueryFragment<Pg> for PurgeBatch {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        // The inner SELECT walks the expires_at index and locks at most `limit` rows, skipping
        // rows someone else holds; the DELETE then finds them by ctid (a TID scan, stable
        // because we hold their locks). Joining back on the primary key instead was planned
        // as a hash join over a sequential scan of the whole table.
        out.push_sql(
            "DELETE FROM idempotency_keys WHERE ctid = ANY (ARRAY( \
                 SELECT ctid FROM idempotency_keys \
                 WHERE expires_at <= now() \
                   AND (state = 'completed' OR expires_at <= now() - ",
        );
        out.push_bind_param::<BigInt, _>(&self.grace_us)?;
        out.push_sql(" * interval '1 microsecond') ORDER BY expires_at LIMIT ");
        out.push_bind_param::<BigInt, _>(&self.limit)?;
        out.push_sql(" FOR UPDATE SKIP LOCKED))");
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// provisioning probe

/// Whether the schema is provisioned: the table `idempotency_keys` *and* the function
/// `idempotency_reserve` (second migration) are visible on the connection's `search_path`.
/// Used to recognise SQLSTATE 42P01 / 42883 (undefined table / function), which diesel-async
/// reports only as an unknown database error; a database migrated only to the first migration
/// thus also gets the "run `idem-cli migrate`" hint.
pub(crate) struct TableExists;

/// Static query id for the statement cache.
pub(crate) struct TableExistsId;

impl QueryId for TableExists {
    type QueryId = TableExistsId;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl Query for TableExists {
    type SqlType = Untyped;
}

impl QueryFragment<Pg> for TableExists {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(
            "SELECT to_regclass('idempotency_keys') IS NOT NULL \
                    AND to_regprocedure(\
                        'idempotency_reserve(text, text, text, text, bytea, uuid, bigint)') \
                        IS NOT NULL AS present",
        );
        Ok(())
    }
}

/// The row of [`TableExists`].
#[derive(QueryableByName, Debug)]
pub(crate) struct ExistsRow {
    #[diesel(sql_type = Bool)]
    pub(crate) present: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope() -> ScopeBinds<'static> {
        ScopeBinds {
            tenant: "t",
            method: "POST",
            path: "/p",
            key: "k",
        }
    }

    /// diesel numbers binds as they are pushed; every `$n` must appear exactly once and in
    /// order, or a value would land in the wrong place.
    fn assert_binds_in_order(sql: &str, count: usize) {
        let mut last = 0;
        for n in 1..=count {
            let needle = format!("${n}");
            let found: Vec<_> = sql
                .match_indices(&needle)
                .filter(|(i, _)| !sql[i + needle.len()..].starts_with(|c: char| c.is_ascii_digit()))
                .collect();
            assert_eq!(found.len(), 1, "{needle} in {sql}");
            assert!(found[0].0 > last, "{needle} out of order in {sql}");
            last = found[0].0;
        }
        assert!(!sql.contains(&format!("${}", count + 1)), "{sql}");
    }

    fn sql_of<T: QueryFragment<Pg>>(query: &T) -> String {
        diesel::debug_query::<Pg, _>(query).to_string()
    }

    #[test]
    fn statements_bind_each_parameter_once_in_order() {
        let fingerprint = [0u8; 32];
        let reserve = Reserve {
            scope: scope(),
            fingerprint: &fingerprint,
            token: uuid::Uuid::nil(),
            lease_us: 1,
        };
        assert_binds_in_order(&sql_of(&reserve), 7);
        let complete = Complete {
            scope: scope(),
            token: uuid::Uuid::nil(),
            status: 200,
            headers: &[],
            body: &[],
            ttl_us: 1,
        };
        assert_binds_in_order(&sql_of(&complete), 9);
        let release = Release {
            scope: scope(),
            token: uuid::Uuid::nil(),
        };
        assert_binds_in_order(&sql_of(&release), 5);
        assert_binds_in_order(
            &sql_of(&PurgeBatch {
                grace_us: 0,
                limit: 1,
            }),
            2,
        );
        assert_binds_in_order(&sql_of(&TableExists), 0);
    }

    // Checked at compile time: without a static id diesel-async would not cache the prepared
    // statement, and every execution would cost a Parse round trip.
    const _: () = {
        assert!(<Reserve<'static> as QueryId>::HAS_STATIC_QUERY_ID);
        assert!(<Complete<'static> as QueryId>::HAS_STATIC_QUERY_ID);
        assert!(<Release<'static> as QueryId>::HAS_STATIC_QUERY_ID);
        assert!(<PurgeBatch as QueryId>::HAS_STATIC_QUERY_ID);
        assert!(<TableExists as QueryId>::HAS_STATIC_QUERY_ID);
    };

    #[test]
    #[ignore = "prints the SQL for docs/sql.md"]
    fn print_sql() {
        let fingerprint = [0u8; 32];
        let reserve = Reserve {
            scope: scope(),
            fingerprint: &fingerprint,
            token: uuid::Uuid::nil(),
            lease_us: 1,
        };
        println!("{}", sql_of(&reserve));
        let complete = Complete {
            scope: scope(),
            token: uuid::Uuid::nil(),
            status: 200,
            headers: &[],
            body: &[],
            ttl_us: 1,
        };
        println!("{}", sql_of(&complete));
        println!(
            "{}",
            sql_of(&Release {
                scope: scope(),
                token: uuid::Uuid::nil()
            })
        );
        println!(
            "{}",
            sql_of(&PurgeBatch {
                grace_us: 0,
                limit: 1
            })
        );
    }
}
