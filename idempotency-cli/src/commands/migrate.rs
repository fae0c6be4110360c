//! `idem-cli migrate [--check]` (contract C18).
//!
//! The CLI applies the library's embedded migrations itself, on a connection from
//! [`db::connect`], rather than through `postgres::run_migrations` (which opens a connection
//! of its own that knows nothing of the CLI's connect timeout and session settings). So the
//! migration connection is bounded like every other: it shows as `idem-cli` in
//! `pg_stat_activity`, its statements have the CLI's `statement_timeout` and `lock_timeout`,
//! and the migration lock is waited for at most [`db::LOCK_TIMEOUT`].

use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::migration::{Migration, MigrationConnection, MigrationSource};
use diesel::pg::Pg;
use diesel::sql_types::{BigInt, Bool, Text};
use diesel::{Connection, QueryableByName};
use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::{self, admin, PartitionInterval};
use serde_json::json;

use crate::cli::{Format, IntervalArg, MigrateArgs};
use crate::db;
use crate::error::{chain, CliError};
use crate::output::Out;

/// The library's migration advisory lock ("idem" + "migr"): the CLI and applications migrating
/// at start-up must serialise on the same key.
const MIGRATION_LOCK_KEY: i64 = 0x6964_656d_6d69_6772;

/// How often a waiting `migrate` retries the migration lock.
const LOCK_POLL: Duration = Duration::from_millis(100);

/// Apply the embedded migrations, or with `--check` list the pending ones and fail (exit 5) if
/// there are any. Both use the library's embedded set, the one the middleware was built with,
/// so "up to date" means "matches this binary's schema".
pub async fn run(
    url: &str,
    connect_timeout: Duration,
    args: &MigrateArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let mut conn = db::connect(url, connect_timeout).await?;

    if args.check {
        let pending = sql!(&mut conn, pending_migrations(&mut conn));
        let pending = full_names(pending);
        // The layout is only known once its migration ran; before that there is no table.
        let layout = if matches!(db::bounded(admin::table_exists(&mut conn)).await?, Ok(true)) {
            Some(layout_name(
                sql!(&mut conn, admin::partition_interval(&mut conn)).as_deref(),
            ))
        } else {
            None
        };
        match format {
            Format::Json => out.json(&json!({
                "up_to_date": pending.is_empty(),
                "pending": pending,
                "layout": layout,
            }))?,
            Format::Text if pending.is_empty() => out.line(format!(
                "schema is up to date (layout: {})",
                layout.as_deref().unwrap_or("unknown")
            ))?,
            Format::Text => {
                for name in &pending {
                    out.line(format!("pending {name}"))?;
                }
            }
        }
        out.flush()?;
        return if pending.is_empty() {
            Ok(())
        } else {
            Err(CliError::Pending(pending.len()))
        };
    }

    let settings = args.partitioned.then(|| {
        let interval = match args.interval {
            IntervalArg::Hourly => PartitionInterval::Hourly,
            IntervalArg::Daily => PartitionInterval::Daily,
        };
        format!(
            "SET idempotency.layout = 'partitioned'; SET idempotency.partition_interval = '{}'",
            interval.as_str()
        )
    });
    // diesel's migration harness is synchronous: it runs on a blocking thread, through
    // diesel-async's wrapper, while this (current-thread) runtime keeps driving the socket.
    let (mut conn, applied) =
        tokio::task::spawn_blocking(move || apply_pending(conn, settings.as_deref()))
            .await
            .map_err(|_| CliError::Other("the migration thread panicked".into()))??;
    let applied = full_names(applied);
    let layout = sql!(&mut conn, admin::partition_interval(&mut conn));
    if args.partitioned && layout.is_none() {
        // The layout migration ran earlier, without the setting: nothing was converted.
        return Err(CliError::Other(
            "the database already has the plain layout (the layout is chosen when it is \
             provisioned); see docs/operations.md for moving a deployment to the partitioned one"
                .into(),
        ));
    }
    let layout_name = layout_name(layout.as_deref());
    match format {
        Format::Json => {
            out.json(&json!({ "applied": applied, "layout": layout_name, "interval": layout }))?
        }
        Format::Text if applied.is_empty() => out.line("schema is up to date; nothing to apply")?,
        Format::Text => {
            for name in &applied {
                out.line(format!("applied {name}"))?;
            }
        }
    }
    if format == Format::Text {
        out.line(format!("layout: {layout_name}"))?;
    }
    out.flush()
}

/// `plain`, or `partitioned (hourly|daily)`.
fn layout_name(interval: Option<&str>) -> String {
    match interval {
        None => "plain".into(),
        Some(interval) => format!("partitioned ({interval})"),
    }
}

/// The library reports migration versions (`20261130000001`); operators know them by their
/// folder names (`2026-11-30-000001_create_idempotency_keys`), which the embedded set carries.
fn full_names(versions: Vec<String>) -> Vec<String> {
    let known: Vec<(String, String)> = MigrationSource::<Pg>::migrations(&postgres::MIGRATIONS)
        .map(|all| {
            all.iter()
                .map(|m| (m.name().version().to_string(), m.name().to_string()))
                .collect()
        })
        .unwrap_or_default();
    versions
        .into_iter()
        .map(|v| {
            known
                .iter()
                .find(|(version, _)| *version == v)
                .map_or(v.clone(), |(_, name)| name.clone())
        })
        .collect()
}

#[derive(QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    version: String,
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Bool)]
    flag: bool,
}

/// The versions applied so far, read with a plain `SELECT` (an empty list when diesel's
/// bookkeeping table does not exist yet). diesel's own `pending_migrations` first runs
/// `CREATE TABLE IF NOT EXISTS`, which PostgreSQL refuses to a role without `CREATE` on the
/// schema even when the table exists: `--check` must work with `SELECT` alone.
async fn applied_versions(
    conn: &mut AsyncPgConnection,
) -> Result<Vec<String>, diesel::result::Error> {
    use diesel_async::RunQueryDsl;
    let present =
        diesel::sql_query("SELECT to_regclass('__diesel_schema_migrations') IS NOT NULL AS flag")
            .get_result::<Flag>(conn)
            .await?;
    if !present.flag {
        return Ok(Vec::new());
    }
    let rows = diesel::sql_query("SELECT version::text AS version FROM __diesel_schema_migrations")
        .load::<Version>(conn)
        .await?;
    Ok(rows.into_iter().map(|r| r.version).collect())
}

/// The embedded migrations' versions not applied yet, oldest first. Reads only.
async fn pending_migrations(
    conn: &mut AsyncPgConnection,
) -> Result<Vec<String>, diesel::result::Error> {
    let applied = applied_versions(conn).await?;
    Ok(embedded()
        .iter()
        .map(|m| m.name().version().to_string())
        .filter(|v| !applied.contains(v))
        .collect())
}

/// The embedded migrations, oldest first (diesel's order: by version).
fn embedded() -> Vec<Box<dyn Migration<Pg>>> {
    let mut all = MigrationSource::<Pg>::migrations(&postgres::MIGRATIONS).unwrap_or_default();
    all.sort_by(|a, b| a.name().version().cmp(&b.name().version()));
    all
}

type Harness = AsyncConnectionWrapper<AsyncPgConnection>;

/// Take the migration lock (waiting at most [`db::LOCK_TIMEOUT`]), apply every pending
/// migration as diesel's harness does (each in its own transaction with its bookkeeping row),
/// release the lock. Runs on a blocking thread; returns the connection for the layout query.
fn apply_pending(
    conn: AsyncPgConnection,
    settings: Option<&str>,
) -> Result<(AsyncPgConnection, Vec<String>), CliError> {
    let mut harness: Harness = AsyncConnectionWrapper::from(conn);
    take_migration_lock(&mut harness)?;
    let result = apply_locked(&mut harness, settings);
    // Closing the connection would release the lock too; the connection is used again.
    let _ = harness.batch_execute(&format!("SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})"));
    result.map(|applied| (harness.into_inner(), applied))
}

/// `pg_try_advisory_lock` until it succeeds or [`db::LOCK_TIMEOUT`] passed. Polling instead
/// of a blocking `pg_advisory_lock` under `lock_timeout` tells "someone else holds it" apart
/// from other failures without reading the server's (localised) error text.
fn take_migration_lock(harness: &mut Harness) -> Result<(), CliError> {
    use diesel::RunQueryDsl;
    let deadline = Instant::now() + db::LOCK_TIMEOUT;
    loop {
        let locked = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS flag")
            .bind::<BigInt, _>(MIGRATION_LOCK_KEY)
            .get_result::<Flag>(harness)
            .map_err(|e| db::store_error(admin::classify_error(e)))?;
        if locked.flag {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(CliError::Unavailable(format!(
                "another migration holds the lock (advisory lock {MIGRATION_LOCK_KEY}, an \
                 application migrating at start-up or another idem-cli migrate); gave up after \
                 {}s: run it again once that one finished",
                db::LOCK_TIMEOUT.as_secs()
            )));
        }
        std::thread::sleep(LOCK_POLL);
    }
}

fn apply_locked(harness: &mut Harness, settings: Option<&str>) -> Result<Vec<String>, CliError> {
    use diesel::RunQueryDsl;
    let failed = |e: diesel::result::Error| db::store_error(admin::classify_error(e));
    if let Some(settings) = settings {
        harness.batch_execute(settings).map_err(failed)?;
    }
    harness.setup().map_err(failed)?;
    let applied: Vec<String> =
        diesel::sql_query("SELECT version::text AS version FROM __diesel_schema_migrations")
            .load::<Version>(harness)
            .map_err(failed)?
            .into_iter()
            .map(|r| r.version)
            .collect();
    let mut done = Vec::new();
    for migration in embedded() {
        let version = migration.name().version().to_string();
        if applied.contains(&version) {
            continue;
        }
        let apply = |conn: &mut Harness| -> diesel::migration::Result<()> {
            migration.run(conn)?;
            diesel::sql_query("INSERT INTO __diesel_schema_migrations (version) VALUES ($1)")
                .bind::<Text, _>(&version)
                .execute(conn)?;
            Ok(())
        };
        let result = if migration.metadata().run_in_transaction() {
            harness.transaction(apply)
        } else {
            apply(harness)
        };
        if let Err(err) = result {
            let name = migration.name().to_string();
            return Err(match err.downcast::<diesel::result::Error>() {
                Ok(err) => failed(*err).context(&format!("migration {name} failed")),
                Err(err) => {
                    CliError::Other(format!("migration {name} failed: {}", chain(err.as_ref())))
                }
            });
        }
        done.push(version);
    }
    Ok(done)
}
