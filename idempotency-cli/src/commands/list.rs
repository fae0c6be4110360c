//! `idem-cli list` (contract C20): records matching filters, as a table or JSON lines.

use std::io::Write;

use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::StreamExt;

use crate::cli::{Format, ListArgs, StateFilter};
use crate::error::CliError;
use crate::output::{table, Out};
use crate::record::{RecordRow, RECORD_COLUMNS, TABLE_HEADER};

pub async fn run(
    conn: &mut AsyncPgConnection,
    args: &ListArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    // The state clauses are constants chosen by an enum, never user text; user input is bound.
    let state_clause = match args.state {
        None => "TRUE",
        Some(StateFilter::InFlight) => "state = 'in_flight'",
        Some(StateFilter::Completed) => "state = 'completed' AND expires_at > now()",
        Some(StateFilter::Expired) => "state = 'completed' AND expires_at <= now()",
    };
    // One row more than the limit tells us whether the output was cut, without a count(*).
    let fetch = (args.limit > 0).then(|| i64::from(args.limit) + 1);
    let query = diesel::sql_query(format!(
        "SELECT {RECORD_COLUMNS} FROM idempotency_keys \
         WHERE ($1::text IS NULL OR tenant = $1::text) \
           AND ($2::text IS NULL OR starts_with(idempotency_key, $2::text)) \
           AND ($3::int8 IS NULL OR created_at <= now() - $3::int8 * interval '1 millisecond') \
           AND {state_clause} \
         ORDER BY created_at, tenant, method, path, idempotency_key \
         LIMIT $4"
    ))
    .bind::<Nullable<Text>, _>(args.tenant.clone())
    .bind::<Nullable<Text>, _>(args.key_prefix.clone())
    .bind::<Nullable<BigInt>, _>(args.older_than.map(|d| d.as_millis_i64()))
    .bind::<Nullable<BigInt>, _>(fetch);
    // Rows are streamed: `--limit 0 --format json` on a table of millions prints them as they
    // arrive instead of holding them all in memory. The text table needs its column widths, so
    // it collects (what a person reads is bounded by --limit anyway).
    let limit = usize::try_from(args.limit).unwrap_or(usize::MAX);
    let mut rows: Vec<RecordRow> = Vec::new();
    let mut seen = 0usize;
    let mut truncated = false;
    let mut failure = None;
    {
        let result = query.load_stream::<RecordRow>(conn).await;
        match result {
            Err(err) => failure = Some(err),
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                while let Some(item) = stream.next().await {
                    let row = match item {
                        Ok(row) => row,
                        Err(err) => {
                            failure = Some(err);
                            break;
                        }
                    };
                    if limit > 0 && seen == limit {
                        truncated = true;
                        break;
                    }
                    seen += 1;
                    match format {
                        Format::Json => out.json(&row.to_json())?,
                        Format::Text => rows.push(row),
                    }
                }
            }
        }
    }
    if let Some(err) = failure {
        return Err(crate::db::classify(conn, err).await);
    }

    match format {
        Format::Json => {}
        Format::Text => {
            if rows.is_empty() {
                out.line("no matching records")?;
            } else {
                let cells: Vec<Vec<String>> = rows.iter().map(RecordRow::table_cells).collect();
                for line in table(TABLE_HEADER, &cells) {
                    out.line(line)?;
                }
            }
        }
    }
    out.flush()?;
    if truncated {
        // On stderr so `--format json | jq` still sees only records.
        let _ = writeln!(
            std::io::stderr(),
            "idem-cli: showing the first {} records; raise --limit (0 = all) for more",
            args.limit
        );
    }
    Ok(())
}
