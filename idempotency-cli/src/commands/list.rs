//! `idem-cli list` (contract C20): records matching filters, as a table or JSON lines.

use std::io::Write;
use std::ops::ControlFlow;

use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::admin::{self, ListFilter, ListState, Record};

use crate::cli::{Format, ListArgs, StateFilter};
use crate::error::CliError;
use crate::output::{table, Out};
use crate::record::{RecordView, TABLE_HEADER};

pub async fn run(
    conn: &mut AsyncPgConnection,
    args: &ListArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    // One row more than the limit tells us whether the output was cut, without a count(*).
    let filter = ListFilter {
        tenant: args.tenant.clone(),
        key_prefix: args.key_prefix.clone(),
        older_than: args.older_than.map(|d| d.0),
        state: args.state.map(|s| match s {
            StateFilter::InFlight => ListState::InFlight,
            StateFilter::Completed => ListState::Completed,
            StateFilter::Expired => ListState::Expired,
        }),
        limit: (args.limit > 0).then(|| i64::from(args.limit) + 1),
    };
    let query = admin::list_query(&filter);
    // Rows are streamed: `--limit 0 --format json` on a table of millions prints them as they
    // arrive instead of holding them all in memory. The text table needs its column widths, so
    // it collects (what a person reads is bounded by --limit anyway).
    let limit = usize::try_from(args.limit).unwrap_or(usize::MAX);
    let mut rows: Vec<Record> = Vec::new();
    let mut seen = 0usize;
    let mut truncated = false;
    crate::db::for_each_row(conn, query, |row: Record| {
        if limit > 0 && seen == limit {
            truncated = true;
            return Ok(ControlFlow::Break(()));
        }
        seen += 1;
        match format {
            Format::Json => out.json(&row.to_json())?,
            Format::Text => rows.push(row),
        }
        Ok(ControlFlow::Continue(()))
    })
    .await?;

    match format {
        Format::Json => {}
        Format::Text => {
            if rows.is_empty() {
                out.line("no matching records")?;
            } else {
                let cells: Vec<Vec<String>> = rows.iter().map(RecordView::table_cells).collect();
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
