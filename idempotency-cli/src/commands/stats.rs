//! `idem-cli stats` (contract C20): what a monitoring check needs in one query.

use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::admin;
use serde_json::json;

use crate::cli::Format;
use crate::duration::format_age_secs;
use crate::error::CliError;
use crate::output::Out;
use crate::record::{round_ms, timestamp_secs, RecordView};

pub async fn run(
    conn: &mut AsyncPgConnection,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let c = sql!(conn, admin::stats(conn));
    let oldest = sql!(conn, admin::oldest_in_flight(conn));
    let interval = sql!(conn, admin::partition_interval(conn));
    let partitions = match interval {
        Some(_) => sql!(conn, admin::partitions(conn)),
        None => Vec::new(),
    };
    let responses_bytes: i64 = partitions.iter().map(|p| p.bytes).sum();
    let default = partitions.iter().find(|p| p.is_default);
    let rotation = if sql!(conn, admin::rotated(conn)) {
        Some(sql!(conn, admin::next_rotation(conn)))
    } else {
        None
    };
    let layout = match (&interval, &rotation) {
        (Some(_), _) => "partitioned",
        (None, Some(_)) => "rotated",
        (None, None) => "plain",
    };

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
            "oldest_in_flight": oldest.as_ref().map(RecordView::to_json),
            "oldest_in_flight_age_seconds": oldest.as_ref().map(|r| round_ms(r.age_secs())),
            "table_bytes": c.table_bytes,
            "index_bytes": c.index_bytes,
            "total_bytes": c.total_bytes,
            "layout": layout,
            "generation": rotation.as_ref().map(|r| r.generation),
            "next_rotation": rotation.as_ref().map(|r| timestamp_secs(r.next_rotation)),
            "partition_interval": interval,
            "partitions": partitions.iter().map(|p| json!({
                "name": p.name,
                "default": p.is_default,
                "from": p.lower_bound.map(timestamp_secs),
                "to": p.upper_bound.map(timestamp_secs),
                "bytes": p.bytes,
                "estimated_rows": p.estimated_rows,
            })).collect::<Vec<_>>(),
            "responses_bytes": interval.as_ref().map(|_| responses_bytes),
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
                    format_age_secs(r.age_secs()),
                    r.expiry_words()
                ))?,
            }
            out.line(format!(
                "size                 {} total (table {}, indexes {})",
                bytes(c.total_bytes),
                bytes(c.table_bytes),
                bytes(c.index_bytes)
            ))?;
            match (&interval, &rotation) {
                (None, None) => out.line("layout               plain")?,
                (None, Some(r)) => out.line(format!(
                    "layout               rotated: current table idempotency_keys_{}, next \
                     rotation not before {} (the counts leave out the table it empties)",
                    r.generation,
                    timestamp_secs(r.next_rotation)
                ))?,
                (Some(interval), _) => {
                    out.line(format!(
                        "layout               partitioned ({interval}): {} range partitions, \
                         responses {}",
                        partitions.iter().filter(|p| !p.is_default).count(),
                        bytes(Some(responses_bytes))
                    ))?;
                    if let Some(d) = default {
                        out.line(format!(
                            "default partition    ~{} rows, {} (long TTLs; purge deletes them \
                             once expired)",
                            d.estimated_rows,
                            bytes(Some(d.bytes))
                        ))?;
                    }
                }
            }
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
