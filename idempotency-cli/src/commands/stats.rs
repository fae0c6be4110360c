//! `idem-cli stats` (contract C20): what a monitoring check needs in one query.

use diesel::sql_types::{BigInt, Nullable};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::json;

use crate::cli::Format;
use crate::duration::format_age_secs;
use crate::error::CliError;
use crate::output::Out;
use crate::record::{RecordRow, RECORD_COLUMNS};

#[derive(QueryableByName)]
struct Counts {
    #[diesel(sql_type = BigInt)]
    total: i64,
    #[diesel(sql_type = BigInt)]
    in_flight: i64,
    #[diesel(sql_type = BigInt)]
    in_flight_lease_live: i64,
    #[diesel(sql_type = BigInt)]
    in_flight_lease_ended: i64,
    #[diesel(sql_type = BigInt)]
    completed: i64,
    #[diesel(sql_type = BigInt)]
    completed_live: i64,
    #[diesel(sql_type = BigInt)]
    completed_expired: i64,
    #[diesel(sql_type = BigInt)]
    expired_not_purged: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    table_bytes: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    index_bytes: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    total_bytes: Option<i64>,
}

pub async fn run(
    conn: &mut AsyncPgConnection,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    // One scan for all counts (count(*) FILTER), so the numbers are mutually consistent.
    // Sizes come from the catalog: pg_table_size includes TOAST, where large bodies live.
    let counts = diesel::sql_query(
        "SELECT count(*) AS total, \
                count(*) FILTER (WHERE state = 'in_flight') AS in_flight, \
                count(*) FILTER (WHERE state = 'in_flight' AND locked_until > now()) \
                    AS in_flight_lease_live, \
                count(*) FILTER (WHERE state = 'in_flight' AND locked_until <= now()) \
                    AS in_flight_lease_ended, \
                count(*) FILTER (WHERE state = 'completed') AS completed, \
                count(*) FILTER (WHERE state = 'completed' AND expires_at > now()) \
                    AS completed_live, \
                count(*) FILTER (WHERE state = 'completed' AND expires_at <= now()) \
                    AS completed_expired, \
                count(*) FILTER (WHERE expires_at <= now()) AS expired_not_purged, \
                pg_table_size('idempotency_keys'::regclass) AS table_bytes, \
                pg_indexes_size('idempotency_keys'::regclass) AS index_bytes, \
                pg_total_relation_size('idempotency_keys'::regclass) AS total_bytes \
         FROM idempotency_keys",
    );
    let c: Counts = sql!(conn, counts.get_result(conn));
    let oldest = diesel::sql_query(format!(
        "SELECT {RECORD_COLUMNS} FROM idempotency_keys WHERE state = 'in_flight' \
         ORDER BY created_at LIMIT 1"
    ));
    let oldest: Vec<RecordRow> = sql!(conn, oldest.load(conn));
    let oldest = oldest.into_iter().next();

    match format {
        Format::Json => out.json(&json!({
            "total": c.total,
            "in_flight": c.in_flight,
            "in_flight_lease_live": c.in_flight_lease_live,
            "in_flight_lease_ended": c.in_flight_lease_ended,
            "completed": c.completed,
            "completed_live": c.completed_live,
            "completed_expired": c.completed_expired,
            "expired_not_purged": c.expired_not_purged,
            "oldest_in_flight": oldest.as_ref().map(RecordRow::to_json),
            "oldest_in_flight_age_seconds": oldest.as_ref().map(|r| crate::record::round_ms(r.age_s)),
            "table_bytes": c.table_bytes,
            "index_bytes": c.index_bytes,
            "total_bytes": c.total_bytes,
        }))?,
        Format::Text => {
            out.line(format!("records              {}", c.total))?;
            out.line(format!(
                "  in-flight          {}  (lease running {}, lease ended {})",
                c.in_flight, c.in_flight_lease_live, c.in_flight_lease_ended
            ))?;
            out.line(format!(
                "  completed          {}  (replayable {}, expired {})",
                c.completed, c.completed_live, c.completed_expired
            ))?;
            out.line(format!(
                "expired, not purged  {}  (completed past TTL + reservations past lease)",
                c.expired_not_purged
            ))?;
            match &oldest {
                None => out.line("oldest in-flight     none")?,
                Some(r) => out.line(format!(
                    "oldest in-flight     {} created {} ago, {}",
                    r.scope_label(),
                    format_age_secs(r.age_s),
                    r.expiry_words()
                ))?,
            }
            out.line(format!(
                "size                 {} total (table {}, indexes {})",
                bytes(c.total_bytes),
                bytes(c.table_bytes),
                bytes(c.index_bytes)
            ))?;
        }
    }
    out.flush()
}

/// Bytes in binary units, one decimal: `8.0 KiB`, `1.2 GiB`.
fn bytes(n: Option<i64>) -> String {
    let Some(n) = n else {
        return "?".into();
    };
    let mut value = n as f64;
    for unit in ["B", "KiB", "MiB", "GiB"] {
        if value < 1024.0 {
            return if unit == "B" {
                format!("{n} B")
            } else {
                format!("{value:.1} {unit}")
            };
        }
        value /= 1024.0;
    }
    format!("{value:.1} TiB")
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_are_humane() {
        assert_eq!(super::bytes(Some(512)), "512 B");
        assert_eq!(super::bytes(Some(8192)), "8.0 KiB");
        assert_eq!(super::bytes(Some(3 * 1024 * 1024 * 1024 / 2)), "1.5 GiB");
        assert_eq!(super::bytes(None), "?");
    }
}
