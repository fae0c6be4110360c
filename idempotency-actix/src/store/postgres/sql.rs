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
//! because diesel numbers binds as they are pushed; the reserve statement reaches its
//! parameters through a one-row `p` CTE for that reason.
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

/// Reserve-or-fetch in one statement. Binds: `$1..$4` scope, `$5` fingerprint, `$6` token,
/// `$7` lease in microseconds.
pub(crate) struct Reserve<'a> {
    pub(crate) scope: ScopeBinds<'a>,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) token: uuid::Uuid,
    pub(crate) lease_us: i64,
}

cached_statement!(Reserve, ReserveId);

/// The reserve statement, in three parts around the scope binds and the rest.
///
/// How it works (all sub-statements see the same snapshot and the same `now()`):
/// - `p` names the parameters once, so each bind is sent once. `NOT MATERIALIZED` makes
///   PostgreSQL inline it (a one-row VALUES is pulled up into plain parameters), so every
///   lookup below is a primary-key index condition on `$1..$4`, in custom and generic plans
///   alike. (Materialized, the UPDATE's join against it was planned as a scan of the
///   `expires_at` index over *every* expired row.)
/// - `existing` reads the row by primary key: a plain index read, no lock. `live` says its
///   lease/TTL has not ended; `eligible` says an ended row may be taken over (a completed row
///   that expired counts as absent; an expired reservation only for the same fingerprint,
///   i.e. a retry of the request whose holder died).
/// - `taken` replaces an ended, eligible row with a fresh reservation. Its `EXISTS` guard is
///   an uncorrelated InitPlan: when `existing` shows no ended eligible row (the replay and
///   in-flight paths) PostgreSQL skips the UPDATE entirely (One-Time Filter), so those paths
///   take no row lock and write nothing. The conditions on `k` are repeated because they are
///   re-evaluated on the newest row version after waiting for a concurrent writer's lock
///   (EvalPlanQual): if someone else took the row over first, `k.expires_at <= now()` is no
///   longer true and nothing is updated.
/// - `inserted` creates the reservation when there was no row at all. `ON CONFLICT DO
///   NOTHING` makes a concurrent insert of the same key (committed after our snapshot) a
///   no-op instead of an error.
/// - The final SELECT returns `reserved` if either write happened, else the `existing` row.
///
/// Zero rows, or an `existing` row that is ended and eligible, means a concurrent writer won
/// a race this statement could not see; the caller re-runs the statement (a new snapshot),
/// which can never produce two reservations because every write is conditional on the row
/// still being absent/ended under its lock.
const RESERVE_SQL_HEAD: &str = "\
WITH p AS NOT MATERIALIZED (
    SELECT t.tenant, t.method, t.path, t.idempotency_key, t.fingerprint, t.token,
           now() + t.lease_us * interval '1 microsecond' AS lease_end
    FROM (VALUES (";
// $1, $2, $3, $4 (scope), then:
const RESERVE_SQL_MID: &str = ", ";
const RESERVE_SQL_TAIL: &str =
    ")) AS t(tenant, method, path, idempotency_key, fingerprint, token, lease_us)
),
existing AS MATERIALIZED (
    SELECT k.state, k.fingerprint, k.expires_at, k.response_status, k.response_headers,
           k.response_body,
           k.expires_at > now() AS live,
           (k.state = 'completed' OR k.fingerprint = p.fingerprint) AS eligible
    FROM idempotency_keys k
    JOIN p ON (k.tenant, k.method, k.path, k.idempotency_key)
            = (p.tenant, p.method, p.path, p.idempotency_key)
),
taken AS (
    UPDATE idempotency_keys k
    SET fingerprint = p.fingerprint, state = 'in_flight', token = p.token,
        locked_until = p.lease_end, expires_at = p.lease_end, created_at = now(),
        completed_at = NULL, response_status = NULL, response_headers = NULL,
        response_body = NULL
    FROM p
    WHERE (k.tenant, k.method, k.path, k.idempotency_key)
          = (p.tenant, p.method, p.path, p.idempotency_key)
      AND EXISTS (SELECT 1 FROM existing e WHERE NOT e.live AND e.eligible)
      AND k.expires_at <= now()
      AND (k.state = 'completed' OR k.fingerprint = p.fingerprint)
    RETURNING 1
),
inserted AS (
    INSERT INTO idempotency_keys
        (tenant, method, path, idempotency_key, fingerprint, state, token, locked_until,
         created_at, expires_at)
    SELECT p.tenant, p.method, p.path, p.idempotency_key, p.fingerprint, 'in_flight', p.token,
           p.lease_end, now(), p.lease_end
    FROM p
    WHERE NOT EXISTS (SELECT 1 FROM existing)
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT 'reserved'::text AS outcome, NULL::text AS state, NULL::bytea AS fingerprint,
       NULL::bigint AS lease_remaining_us, NULL::smallint AS response_status,
       NULL::bytea AS response_headers, NULL::bytea AS response_body,
       NULL::boolean AS live, NULL::boolean AS eligible
FROM taken
UNION ALL
SELECT 'reserved', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
FROM inserted
UNION ALL
SELECT 'existing', e.state, e.fingerprint,
       (extract(epoch FROM greatest(e.expires_at - now(), interval '0')) * 1000000)::bigint,
       e.response_status, e.response_headers, e.response_body, e.live, e.eligible
FROM existing e
WHERE NOT EXISTS (SELECT 1 FROM taken) AND NOT EXISTS (SELECT 1 FROM inserted)";

impl QueryFragment<Pg> for Reserve<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql(RESERVE_SQL_HEAD);
        // Casts on the VALUES row fix the column types for the prepared statement.
        push_scope(&mut out, &self.scope)?;
        out.push_sql(RESERVE_SQL_MID);
        out.push_bind_param::<Bytea, _>(&self.fingerprint)?;
        out.push_sql(", ");
        out.push_bind_param::<diesel::sql_types::Uuid, _>(&self.token)?;
        out.push_sql(", ");
        out.push_bind_param::<BigInt, _>(&self.lease_us)?;
        out.push_sql(RESERVE_SQL_TAIL);
        Ok(())
    }
}

/// One row of the reserve statement.
#[derive(QueryableByName, Debug)]
pub(crate) struct ReserveRow {
    /// `reserved` or `existing`.
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

/// `SELECT to_regclass('idempotency_keys') IS NOT NULL`: whether the table is visible on the
/// connection's `search_path`. Used to recognise SQLSTATE 42P01, which diesel-async reports
/// only as an unknown database error.
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
        out.push_sql("SELECT to_regclass('idempotency_keys') IS NOT NULL AS present");
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
