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
//!   of the default partition are deleted in batches, and the partitions ahead are created,
//!   until they cover now + `--horizon` (default 36 h: the default 24 h TTL plus 12 h of missed
//!   runs) or exactly `--partitions-ahead` intervals. Dropping takes ACCESS EXCLUSIVE on
//!   `idempotency_responses` for milliseconds; creating (migration 000008) never moves a row
//!   and takes ACCESS EXCLUSIVE on the default partition only, one partition at a time, for
//!   the scan `ATTACH PARTITION` makes of it (short while the default partition is small,
//!   which the horizon keeps it). Each waits at most `--lock-timeout` for its lock (traffic
//!   queued behind the waiting lock waits as long); on a timeout the step fails, changes
//!   nothing, and the next run tries again. The steps are independent: one failing, the
//!   claims' deletion included, does not skip the others (a failed drop must not leave the
//!   partitions ahead to run out), and the run then exits with the first failure. The exception is a step that got no answer within
//!   `--statement-timeout` plus 5 s (a frozen server or network; each partition created is a
//!   step of its own): that ends the run (exit 3) at once, in the claims loop as in the
//!   partition steps, since every later step would wait as long for nothing.
//!   With `--tenant` the partition steps are skipped (a partition holds every tenant's
//!   responses).

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
    /// Expired partitions the drop step left (another session held one of its locks).
    left: Vec<String>,
    created: Vec<String>,
    default_rows_deleted: u64,
    /// Set when partitions ahead stopped at the budget (`admin::max_partitions`).
    capped: Option<admin::PartitionBudget>,
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

    // The partitioned layout's partition work (none with --tenant), and how many partitions
    // ahead it creates: a --horizon it cannot meet is refused before anything is deleted, and
    // by a dry run as by the run.
    let layout = sql!(conn, admin::partition_interval(conn));
    let ahead = match (layout.as_deref(), &args.tenant) {
        (Some(interval), None) => Some(partitions_ahead(args, interval)?),
        _ => None,
    };
    // The rotated layout: a rotation instead of row deletes (with --tenant, that tenant's
    // expired rows are deleted as on the plain layout: a rotation empties every tenant's).
    let rotation = args.tenant.is_none() && sql!(conn, admin::rotated(conn));

    if args.dry_run && rotation {
        let due: admin::Rotation = sql!(conn, admin::next_rotation(conn));
        return report_rotation(out, format, &due, started.elapsed(), true);
    }
    if args.dry_run {
        let counts: Purged = sql!(conn, admin::purge_count(conn, &filter));
        let mut summary = Summary {
            completed: counts.completed,
            in_flight: counts.in_flight,
            ..Summary::default()
        };
        // The partitions the run would drop (its largest deletion).
        if ahead.is_some() {
            let dropped = sql!(conn, admin::droppable_partitions(conn, args.older_than.0));
            summary.partitions = Some(PartitionWork {
                dropped,
                ..PartitionWork::default()
            });
        }
        return report(out, format, args, &summary, started.elapsed(), true);
    }

    // Before the lock: a session whose host vanished must not hold it for hours.
    crate::db::end_when_left_idle(conn, args.pause.0).await?;
    let locked: bool = sql!(conn, admin::try_lock_purge(conn));
    if !locked {
        // A normal end: the session as we found it, as after a finished purge.
        crate::db::keep_when_left_idle(conn).await;
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

    if rotation {
        let result =
            crate::db::bounded(admin::rotate(conn, args.lock_timeout.0, args.grace.0)).await?;
        let rotated = match result {
            Ok(rotated) => rotated,
            Err(err) => {
                return Err(crate::db::classify(conn, err)
                    .await
                    .context("rotating the generation tables"))
            }
        };
        let _: bool = sql!(conn, admin::unlock_purge(conn));
        crate::db::keep_when_left_idle(conn).await;
        report_rotation(out, format, &rotated, started.elapsed(), false)?;
        if let Some(pid) = rotated.blocked_by_pid {
            // On stderr too, where cron's alerts look: a rotation held back run after run
            // never empties a table.
            let _ = writeln!(std::io::stderr(), "idem-cli: warning: {}", held_back(pid));
        }
        return Ok(());
    }

    let progress = Progress::new();
    let mut summary = Summary::default();
    // A batch the database refused (a permission, a trigger, a statement timeout: exit 1) does
    // not skip the partition steps: they are independent of the claims (a claims purge failing
    // run after run must not let the partitions ahead run out; review, 2026-12-06). One that
    // got no answer, or lost the database (exit 3), or found no table (exit 4), ends the run
    // at once: each later step would fail the same way.
    let mut claims_failed = None;
    loop {
        let batch_started = Instant::now();
        let result = crate::db::bounded(admin::purge_batch(conn, &filter, args.batch_size)).await;
        let stopped = |err: CliError, summary: &Summary| {
            // Batches already deleted stay deleted (each committed on its own): say how far the
            // purge got, so the cron log shows progress even for a failed run.
            err.context(&format!(
                "purge stopped after deleting {} records in {} batches",
                summary.total(),
                summary.batches
            ))
        };
        let counts = match result {
            Ok(Ok(counts)) => counts,
            Ok(Err(err)) => {
                progress.clear();
                let err = stopped(crate::db::classify(conn, err).await, &summary);
                if !matches!(err, CliError::Other(_)) {
                    return Err(err);
                }
                claims_failed = Some(err);
                break;
            }
            Err(frozen) => {
                progress.clear();
                return Err(stopped(frozen, &summary));
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
    if let Some(ahead) = ahead {
        let (work, failed) = partition_work(conn, args, ahead).await;
        if let Some(err) = claims_failed {
            let done = format!(
                "partitions dropped [{}], created [{}]; default partition: {} expired rows \
                 deleted{}",
                work.dropped.join(", "),
                work.created.join(", "),
                work.default_rows_deleted,
                warnings(&work)
            );
            return Err(match failed {
                // The database went away or stopped answering meanwhile: that is the run's
                // exit code (3), which alerts watch for, with the claims' failure in words.
                Some(failed) if !matches!(failed, CliError::Other(_)) => failed.note(&format!(
                    "the claims purge had failed before: {err}; {done}"
                )),
                // The first failure, then what the partition steps did after it.
                Some(failed) => err.note(&format!(
                    "the partition steps ran: {done}; a partition step failed too: {failed}"
                )),
                None => err.note(&format!("the partition steps ran: {done}")),
            });
        }
        if let Some(err) = failed {
            // The steps that ran are done (each committed on its own): say what they did.
            return Err(err.context(&format!(
                "purge deleted {} records; partitions dropped [{}], created [{}]; default \
                 partition: {} expired rows deleted{}; then a partition step failed",
                summary.total(),
                work.dropped.join(", "),
                work.created.join(", "),
                work.default_rows_deleted,
                warnings(&work)
            )));
        }
        summary.partitions = Some(work);
    }
    if let Some(err) = claims_failed {
        return Err(err);
    }
    // Unlock explicitly so the next cron run never has to wait for the disconnect to be noticed.
    let _: bool = sql!(conn, admin::unlock_purge(conn));
    crate::db::keep_when_left_idle(conn).await;
    report(out, format, args, &summary, started.elapsed(), false)?;
    // Also on stderr, where cron's and a scheduler's alerts look: partitions left run after run
    // would pile up.
    if let Some(words) = summary.partitions.as_ref().and_then(left_words) {
        let _ = writeln!(std::io::stderr(), "idem-cli: warning: {words}");
    }
    Ok(())
}

/// Why a due rotation did not happen.
fn held_back(pid: i32) -> String {
    format!(
        "rotation due but held back: session {pid} has had a transaction open since before the \
         last rotation (it could still write into the table a rotation empties), or its \
         activity is hidden from this role (grant it pg_read_all_stats); the next run tries \
         again"
    )
}

/// The summary of a purge on the rotated layout: the rotation it made (or, dry, would make).
fn report_rotation(
    out: &mut Out,
    format: Format,
    rotation: &admin::Rotation,
    elapsed: Duration,
    dry_run: bool,
) -> Result<(), CliError> {
    let due = rotation.due;
    let next = crate::record::timestamp_secs(rotation.next_rotation);
    match format {
        Format::Json => out.json(&json!({
            "dry_run": dry_run,
            "layout": "rotated",
            "rotated": rotation.rotated,
            "would_rotate": if dry_run { Some(due) } else { None },
            "generation": rotation.generation,
            "next_rotation": next,
            "carried": rotation.carried,
            "blocked_by_pid": rotation.blocked_by_pid,
            "purged": 0,
            "elapsed_ms": elapsed.as_millis(),
        }))?,
        Format::Text => {
            let table = format!("idempotency_keys_{}", rotation.generation);
            out.line(match (dry_run, rotation.rotated, rotation.blocked_by_pid) {
                (true, _, _) if due => format!(
                    "dry run: a rotation is due (since {next}): it would empty the table after \
                     {table} and make it current"
                ),
                (true, _, _) => format!("dry run: no rotation is due until {next}"),
                (false, true, _) => format!(
                    "rotated: emptied {table} and made it current, carrying {} live records \
                     into it; next rotation not before {next} ({})",
                    rotation.carried,
                    format_elapsed(elapsed)
                ),
                (false, false, Some(pid)) => held_back(pid),
                (false, false, None) => format!("no rotation due until {next}; nothing purged"),
            })?;
        }
    }
    out.flush()
}

/// How many intervals ahead of the current one to create: `--partitions-ahead` as given, or
/// enough for the last partition to cover now + `--horizon` (the current interval's partition
/// starts at most one interval before now, so `ceil(horizon / interval)` more reach past it).
fn partitions_ahead(args: &PurgeArgs, interval: &str) -> Result<u32, CliError> {
    if let Some(n) = args.partitions_ahead {
        return Ok(n);
    }
    let step_ms: u128 = if interval == "hourly" {
        3_600_000
    } else {
        86_400_000
    };
    let ahead = args.horizon.0.as_millis().div_ceil(step_ms);
    match u32::try_from(ahead) {
        Ok(n) if n <= MAX_AHEAD => Ok(n),
        _ => Err(CliError::Usage(format!(
            "--horizon {} needs {ahead} {interval} partitions ahead; at most {MAX_AHEAD}",
            args.horizon
        ))),
    }
}

/// The most partitions a purge keeps ahead (the bound of `--partitions-ahead`).
const MAX_AHEAD: u32 = 1000;

/// The partitioned layout's steps, under the purge lock (see the module docs). Every step runs
/// even when an earlier one failed, unless the database stopped answering; the first failure
/// is returned with what was done.
async fn partition_work(
    conn: &mut AsyncPgConnection,
    args: &PurgeArgs,
    ahead: u32,
) -> (PartitionWork, Option<CliError>) {
    let lock_timeout = args.lock_timeout.0;
    let mut work = PartitionWork::default();
    let mut failed = None;
    // Each step bounded like every other round trip: a frozen server is "unavailable". A
    // round trip that got no answer ends the partition work: the connection is unusable, and
    // each later step would only wait as long again (three times the bound for one freeze).
    // The drop takes the default partition and each partition it drops with NOWAIT (holding
    // the table requests queue behind, it must not wait for anyone else): what it could not
    // lock (autovacuum on the default partition, a query on one partition) is reported as
    // left for the next run. Not tried again in this run: each try queues every request
    // behind the table's lock once more.
    //
    // What it left is what was droppable both before and after it: listed after it alone, a
    // partition that became droppable meanwhile (an interval boundary passed) was reported left
    // "because another session held a lock" that nobody held (review, 2026-12-06).
    let droppable_before = admin::droppable_partitions(conn, args.older_than.0);
    let droppable_before = match crate::db::bounded(droppable_before).await {
        Err(frozen) => return (work, Some(frozen.context("listing past partitions"))),
        Ok(Ok(names)) => Some(names),
        // The drop reads the same catalogs: if this failed, it says why.
        Ok(Err(_)) => None,
    };
    match crate::db::bounded(admin::drop_partitions(
        conn,
        args.older_than.0,
        lock_timeout,
    ))
    .await
    {
        Err(frozen) => return (work, Some(frozen.context("dropping past partitions"))),
        Ok(Ok(dropped)) => {
            work.dropped = dropped;
            let left = admin::droppable_partitions(conn, args.older_than.0);
            match crate::db::bounded(left).await {
                Err(frozen) => return (work, Some(frozen.context("listing past partitions"))),
                Ok(Ok(left)) => {
                    work.left = left
                        .into_iter()
                        .filter(|name| droppable_before.as_ref().is_none_or(|b| b.contains(name)))
                        .collect();
                }
                Ok(Err(err)) => {
                    let err = crate::db::classify(conn, err).await;
                    failed = Some(err.context("listing past partitions"));
                }
            }
        }
        Ok(Err(err)) => {
            let err = crate::db::classify(conn, err).await;
            failed = Some(err.context("dropping past partitions"));
        }
    }
    loop {
        match crate::db::bounded(admin::purge_default_partition(
            conn,
            args.batch_size,
            args.older_than.0,
        ))
        .await
        {
            Err(frozen) => {
                keep_worst(&mut failed, frozen.context("purging the default partition"));
                return (work, failed);
            }
            Ok(Ok(deleted)) => {
                work.default_rows_deleted += deleted;
                if deleted < u64::from(args.batch_size) {
                    break;
                }
            }
            Ok(Err(err)) => {
                let err = crate::db::classify(conn, err).await;
                keep_worst(&mut failed, err.context("purging the default partition"));
                break;
            }
        }
    }
    // One partition at a time, each step bounded on its own: a step's ATTACH scans the default
    // partition, so a run of many (the first purge after `migrate --partitioned`) can take far
    // longer than one round trip's bound without anything being wrong (review, 2026-12-06: the
    // whole loop had one bound, and such a run ended "database unavailable", every time).
    // Into `work.created` as they are made: on a failure part-way the ones made are reported.
    for k in 0..=ahead {
        match crate::db::bounded(admin::create_partitions_step(conn, k, lock_timeout)).await {
            Err(frozen) => {
                keep_worst(&mut failed, frozen.context("creating partitions ahead"));
                break;
            }
            Ok(Ok(Ok(names))) => work.created.extend(names),
            Ok(Ok(Err(budget))) => {
                work.capped = Some(budget);
                break;
            }
            Ok(Err(err)) => {
                let err = crate::db::classify(conn, err).await;
                keep_worst(&mut failed, err.context("creating partitions ahead"));
                break;
            }
        }
    }
    (work, failed)
}

/// Keep the first failure of the partition steps, unless `err` is worse: the database gone or
/// silent (exit 3) or the table missing (exit 4) after a step the database refused (exit 1).
/// The run's exit code is the worse one, which alerts watch for, and the first is kept in words
/// (review, 2026-12-06: a drop's lock timeout, then a step without an answer, exited 1).
fn keep_worst(failed: &mut Option<CliError>, err: CliError) {
    *failed = Some(match failed.take() {
        None => err,
        Some(first @ CliError::Other(_)) if !matches!(err, CliError::Other(_)) => {
            err.note(&format!("after an earlier step failed: {first}"))
        }
        Some(first) => first,
    });
}

/// What a run says of its partition work beyond what it did, in its summary line or in its
/// error when a step failed: the partitions it left and the budget it stopped at (`; ...`
/// each, or nothing).
fn warnings(work: &PartitionWork) -> String {
    let mut words = String::new();
    if let Some(left) = left_words(work) {
        words.push_str("; ");
        words.push_str(&left);
    }
    if let Some(c) = work.capped {
        words.push_str(&format!(
            "; no more partitions ahead: {} is the most max_locks_per_transaction = {} allows \
             (every replay locks each one), later responses go to the default partition; raise \
             it, or use a longer interval",
            c.leaves, c.max_locks_per_transaction
        ));
    }
    words
}

/// The expired partitions a run left, in words (`None`: it left none).
fn left_words(work: &PartitionWork) -> Option<String> {
    (!work.left.is_empty()).then(|| {
        format!(
            "expired partitions left for the next run {} [{}] (another session held a lock \
             the drop needs: autovacuum, or a query on one partition)",
            work.left.len(),
            work.left.join(", ")
        )
    })
}

fn report(
    out: &mut Out,
    format: Format,
    args: &PurgeArgs,
    summary: &Summary,
    elapsed: Duration,
    dry_run: bool,
) -> Result<(), CliError> {
    // A dry run's partition work is what it would drop; a run's, what it did.
    let (done, planned) = match (&summary.partitions, dry_run) {
        (Some(p), false) => (Some(p), None),
        (Some(p), true) => (None, Some(p)),
        (None, _) => (None, None),
    };
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
            "partitions_dropped": done.map(|p| &p.dropped),
            "partitions_left": done.map(|p| &p.left),
            "would_drop_partitions": planned.map(|p| &p.dropped),
            "partitions_created": done.map(|p| &p.created),
            "default_partition_rows_deleted": done.map(|p| p.default_rows_deleted),
            "partitions_capped_at": summary.partitions.as_ref()
                .and_then(|p| p.capped).map(|c| c.leaves),
        }))?,
        Format::Text if dry_run => out.line(format!(
            "dry run: would purge {} records ({} completed, {} in-flight){} [counted in {}]",
            summary.total(),
            summary.completed,
            summary.in_flight,
            summary
                .partitions
                .as_ref()
                .map_or(String::new(), |p| format!(
                    "; partitions: would drop {} [{}]",
                    p.dropped.len(),
                    p.dropped.join(", ")
                )),
            format_elapsed(elapsed)
        ))?,
        Format::Text => {
            // One line per run (C19), the partition work of the partitioned layout included:
            // cron logs and their alerts read a run as one line.
            let partitions = summary.partitions.as_ref().map_or(String::new(), |p| {
                format!(
                    "; partitions: dropped {} [{}], created {} [{}]; default partition: {} \
                     expired rows deleted",
                    p.dropped.len(),
                    p.dropped.join(", "),
                    p.created.len(),
                    p.created.join(", "),
                    p.default_rows_deleted
                ) + &warnings(p)
            });
            out.line(format!(
                "purged {} records in {} ({} completed, {} in-flight; {} batches, longest {}){partitions}",
                summary.total(),
                format_elapsed(elapsed),
                summary.completed,
                summary.in_flight,
                summary.batches,
                format_elapsed(summary.longest_batch)
            ))?
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A partition step the database refused (exit 1), then one that lost the database (exit
    /// 3): the run exits 3, alerts on exit 3 fire, and the first failure is still said.
    #[test]
    fn the_worse_partition_failure_sets_the_exit_code() {
        let code = |e: &Option<CliError>| format!("{:?}", e.as_ref().map(CliError::exit_code));
        let mut failed = None;
        keep_worst(&mut failed, CliError::Other("lock timeout".into()));
        keep_worst(&mut failed, CliError::Unavailable("no answer".into()));
        assert_eq!(
            code(&failed),
            code(&Some(CliError::Unavailable(String::new())))
        );
        let text = failed.as_ref().map(ToString::to_string).unwrap_or_default();
        assert!(
            text.contains("no answer") && text.contains("lock timeout"),
            "{text}"
        );
        // Otherwise the first failure stays.
        keep_worst(&mut failed, CliError::Other("later".into()));
        keep_worst(&mut failed, CliError::NotProvisioned("later".into()));
        let text = failed.as_ref().map(ToString::to_string).unwrap_or_default();
        assert!(!text.contains("later"), "{text}");
        let mut failed = None;
        keep_worst(&mut failed, CliError::Other("first".into()));
        keep_worst(&mut failed, CliError::Other("second".into()));
        let text = failed.as_ref().map(ToString::to_string).unwrap_or_default();
        assert_eq!(text, "first");
    }
}
