//! `idem-cli purge` (contract C19): delete expired records in bounded batches.
//!
//! Design, for a table that live payment traffic writes to:
//! - Each batch is one `DELETE` statement in autocommit, so it is its own short transaction and
//!   holds row locks only on the rows it deletes, only for that statement.
//! - Candidates are picked with `FOR UPDATE SKIP LOCKED`: a row a request is working on right now
//!   is skipped (the next run gets it) rather than waited for, so purge never queues behind
//!   traffic, and traffic waits on purge at most one batch.
//! - `FOR UPDATE` re-checks the `WHERE` clause against the newest row version, so a reservation
//!   taken over between selection and deletion (its lease renewed) is not deleted.
//! - A session-level advisory lock makes overlapping runs (a slow purge and the next cron tick)
//!   cooperate: the second one notices, says so and exits 0. The lock dies with the connection,
//!   so a killed purge never leaves it behind.
//! - Partitioned layout (migration 000005): the claims are deleted exactly as above; then the
//!   response partitions whose whole range is past `--older-than` are dropped, the expired rows
//!   of the default partition (long TTLs) are deleted in batches, and the partitions of the
//!   next `--partitions-ahead` intervals are created. Dropping and creating take an ACCESS
//!   EXCLUSIVE lock on `idempotency_responses` for milliseconds, waiting at most
//!   `--lock-timeout` for it (traffic queued behind the waiting lock waits as long); on a
//!   timeout the step fails, changes nothing, and the next run tries again. With `--tenant`
//!   the partition steps are skipped (a partition holds every tenant's responses).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::admin::{self, PurgeFilter, Purged};
use serde_json::json;

use crate::cli::{Format, PurgeArgs};
use crate::duration::format_elapsed;
use crate::error::CliError;
use crate::output::Out;

/// What a purge did, for the summary line.
#[derive(Default)]
struct Summary {
    completed: u64,
    in_flight: u64,
    batches: u64,
    longest_batch: Duration,
    /// Partitioned layout only (`None`: plain layout, or skipped).
    partitions: Option<PartitionWork>,
}

/// What a purge did to the partitions of the partitioned layout.
#[derive(Default)]
struct PartitionWork {
    dropped: Vec<String>,
    created: Vec<String>,
    default_rows_deleted: u64,
}

impl Summary {
    fn total(&self) -> u64 {
        self.completed + self.in_flight
    }
}

/// The library runs the one purge statement (the same one `PostgresStore::purge_expired`
/// runs); this command adds the batching loop, the lock, progress and the summary.
pub async fn run(
    conn: &mut AsyncPgConnection,
    args: &PurgeArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let started = Instant::now();
    let filter = PurgeFilter {
        grace: args.grace.0,
        older_than: Some(args.older_than.0),
        tenant: args.tenant.clone(),
    };

    if args.dry_run {
        let counts: Purged = sql!(conn, admin::purge_count(conn, &filter));
        let summary = Summary {
            completed: counts.completed,
            in_flight: counts.in_flight,
            ..Summary::default()
        };
        return report(out, format, args, &summary, started.elapsed(), true);
    }

    let locked: bool = sql!(conn, admin::try_lock_purge(conn));
    if !locked {
        match format {
            Format::Json => out.json(&json!({
                "skipped": true,
                "reason": "another purge is running",
                "purged": 0,
            }))?,
            Format::Text => out.line(
                "purge skipped: another purge is running (advisory lock held); nothing deleted",
            )?,
        }
        return out.flush();
    }

    let progress = Progress::new();
    let mut summary = Summary::default();
    loop {
        let batch_started = Instant::now();
        let result = admin::purge_batch(conn, &filter, args.batch_size).await;
        let counts = match result {
            Ok(counts) => counts,
            Err(err) => {
                // Batches already deleted stay deleted (each committed on its own): say how far
                // the purge got, so the cron log shows progress even for a failed run.
                progress.clear();
                let err = crate::db::classify(conn, err).await;
                return Err(err.context(&format!(
                    "purge stopped after deleting {} records in {} batches",
                    summary.total(),
                    summary.batches
                )));
            }
        };
        summary.longest_batch = summary.longest_batch.max(batch_started.elapsed());
        summary.batches += 1;
        summary.completed += counts.completed;
        summary.in_flight += counts.in_flight;
        progress.update(&summary, started);
        // A short batch means the candidates ran out (rows skipped because a request held them
        // are left for the next run, which is what we want).
        if counts.total() < u64::from(args.batch_size) {
            break;
        }
        if !args.pause.0.is_zero() {
            tokio::time::sleep(args.pause.0).await;
        }
    }
    progress.clear();
    let layout = sql!(conn, admin::partition_interval(conn));
    if layout.is_some() && args.tenant.is_none() {
        summary.partitions = Some(partition_work(conn, args).await?);
    }
    // Unlock explicitly so the next cron run never has to wait for the disconnect to be noticed.
    let _: bool = sql!(conn, admin::unlock_purge(conn));
    report(out, format, args, &summary, started.elapsed(), false)
}

/// The partitioned layout's steps, under the purge lock (see the module docs).
async fn partition_work(
    conn: &mut AsyncPgConnection,
    args: &PurgeArgs,
) -> Result<PartitionWork, CliError> {
    let lock_timeout = args.lock_timeout.0;
    let mut work = PartitionWork {
        dropped: sql!(
            conn,
            admin::drop_partitions(conn, args.older_than.0, lock_timeout)
        ),
        ..PartitionWork::default()
    };
    loop {
        let deleted = sql!(conn, admin::purge_default_partition(conn, args.batch_size));
        work.default_rows_deleted += deleted;
        if deleted < u64::from(args.batch_size) {
            break;
        }
    }
    work.created = sql!(
        conn,
        admin::create_partitions(conn, args.partitions_ahead, lock_timeout)
    );
    Ok(work)
}

fn report(
    out: &mut Out,
    format: Format,
    args: &PurgeArgs,
    summary: &Summary,
    elapsed: Duration,
    dry_run: bool,
) -> Result<(), CliError> {
    match format {
        Format::Json => out.json(&json!({
            "dry_run": dry_run,
            "purged": if dry_run { 0 } else { summary.total() },
            "would_purge": if dry_run { Some(summary.total()) } else { None },
            "completed": summary.completed,
            "in_flight": summary.in_flight,
            "batches": summary.batches,
            "batch_size": args.batch_size,
            "elapsed_ms": elapsed.as_millis(),
            "longest_batch_ms": summary.longest_batch.as_millis(),
            "tenant": args.tenant,
            "older_than": args.older_than.to_string(),
            "grace": args.grace.to_string(),
            "partitions_dropped": summary.partitions.as_ref().map(|p| &p.dropped),
            "partitions_created": summary.partitions.as_ref().map(|p| &p.created),
            "default_partition_rows_deleted":
                summary.partitions.as_ref().map(|p| p.default_rows_deleted),
        }))?,
        Format::Text if dry_run => out.line(format!(
            "dry run: would purge {} records ({} completed, {} in-flight) [counted in {}]",
            summary.total(),
            summary.completed,
            summary.in_flight,
            format_elapsed(elapsed)
        ))?,
        Format::Text => out.line(format!(
            "purged {} records in {} ({} completed, {} in-flight; {} batches, longest {})",
            summary.total(),
            format_elapsed(elapsed),
            summary.completed,
            summary.in_flight,
            summary.batches,
            format_elapsed(summary.longest_batch)
        ))?,
    }
    if let (Format::Text, Some(p)) = (format, &summary.partitions) {
        out.line(format!(
            "partitions: dropped {} [{}], created {} [{}]; default partition: {} expired rows deleted",
            p.dropped.len(),
            p.dropped.join(", "),
            p.created.len(),
            p.created.join(", "),
            p.default_rows_deleted
        ))?;
    }
    out.flush()
}

/// A one-line progress display on stderr, only when stderr is a terminal and the purge has run
/// for a while: cron mail and CI logs get just the summary line.
struct Progress {
    enabled: bool,
    last: std::cell::Cell<Option<Instant>>,
}

impl Progress {
    const AFTER: Duration = Duration::from_secs(2);
    const EVERY: Duration = Duration::from_millis(200);

    fn new() -> Self {
        Self {
            enabled: std::io::stderr().is_terminal(),
            last: std::cell::Cell::new(None),
        }
    }

    fn update(&self, summary: &Summary, started: Instant) {
        if !self.enabled || started.elapsed() < Self::AFTER {
            return;
        }
        if self.last.get().is_some_and(|t| t.elapsed() < Self::EVERY) {
            return;
        }
        self.last.set(Some(Instant::now()));
        // Progress is best effort: a closed stderr must not fail the purge.
        let _ = write!(
            std::io::stderr(),
            "\rpurging: {} records in {} batches, {}   ",
            summary.total(),
            summary.batches,
            format_elapsed(started.elapsed())
        );
    }

    fn clear(&self) {
        if self.enabled && self.last.get().is_some() {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}
