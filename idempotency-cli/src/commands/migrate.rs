//! `idem-cli migrate [--check]` (contract C18).
//!
//! The CLI applies the library's embedded migrations on a connection from [`db::connect`]
//! (through `postgres::apply_pending_migrations`, the one implementation behind
//! `postgres::run_migrations` too), rather than through `run_migrations` itself, which opens
//! a connection of its own that knows nothing of the CLI's connect timeout and session
//! settings. So the migration connection is bounded like every other: it shows as `idem-cli`
//! in `pg_stat_activity`, its statements have the CLI's `statement_timeout` and
//! `lock_timeout`, and the migration lock is waited for at most [`db::LOCK_TIMEOUT`].

use std::time::Duration;

use diesel::migration::MigrationSource;
use diesel::pg::Pg;
use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::{self, admin, Harness, PartitionInterval};
use serde_json::json;

use crate::cli::{Format, IntervalArg, MigrateArgs};
use crate::db;
use crate::error::CliError;
use crate::output::Out;

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
    if let Some(period) = args.rotation_period {
        // The migration would refuse it too, but only after applying every migration before
        // the layout's: the database would be left plain, which `migrate --rotated` refuses.
        if period.0 < postgres::MIN_ROTATION_PERIOD {
            return Err(CliError::Usage(format!(
                "--rotation-period must be at least {}, not {period}",
                crate::duration::HumanDuration(postgres::MIN_ROTATION_PERIOD)
            )));
        }
    }
    let mut conn = db::connect(url, connect_timeout).await?;

    if args.check {
        let pending = db::bounded(postgres::pending_migrations_on(&mut conn))
            .await?
            .map_err(db::store_error)?;
        let layout_known = !pending
            .iter()
            .any(|v| v == postgres::LAYOUT_MIGRATION_VERSION);
        let pending = full_names(pending);
        // The layout is only known once its migration (000005) ran; before that none is chosen.
        // The whole schema (the tables and every function the store calls) must be there once
        // nothing is pending; with migrations pending, the tables are enough to read the layout
        // once the layout migration has run.
        let provisioned = db::bounded(admin::table_exists(&mut conn))
            .await?
            .map_err(db::store_error)?;
        if pending.is_empty() && !provisioned {
            return Err(dropped_by_hand());
        }
        let has_tables =
            provisioned || (layout_known && sql!(&mut conn, admin::keys_table_exists(&mut conn)));
        let layout = if has_tables {
            Some(read_layout(&mut conn).await?.name())
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

    let wanted = args.interval.map(|interval| match interval {
        IntervalArg::Hourly => PartitionInterval::Hourly,
        IntervalArg::Daily => PartitionInterval::Daily,
    });
    let layout = if args.partitioned {
        Some(postgres::Layout::Partitioned(
            wanted.unwrap_or(PartitionInterval::Daily),
        ))
    } else if args.rotated {
        Some(postgres::Layout::Rotated {
            period: args
                .rotation_period
                .map_or(postgres::DEFAULT_ROTATION_PERIOD, |p| p.0),
        })
    } else {
        None
    };
    // diesel's migration harness is synchronous: it runs on a blocking thread, through
    // diesel-async's wrapper, while this (current-thread) runtime keeps driving the socket.
    // Its statements carry no client-side bound, so a server gone silent mid-migration would
    // hold it for ever: the whole run is bounded instead, by the lock wait and then a few round
    // trips per pending migration and for the harness's bookkeeping, each of which a live
    // server answers within `answer_limit`.
    let pending = db::bounded(postgres::pending_migrations_on(&mut conn))
        .await?
        .map_err(db::store_error)?;
    if !pending
        .iter()
        .any(|v| v == postgres::LAYOUT_MIGRATION_VERSION)
    {
        // The layout is fixed already: refuse another one before applying anything, rather
        // than apply the pending migrations and then fail.
        if args.partitioned || args.rotated {
            let schema = if pending.is_empty() {
                Schema::Whole
            } else {
                Schema::TableOnly
            };
            let existing = provisioned_layout(&mut conn, schema).await?;
            refuse_another_layout(args, wanted, &existing)?;
        }
    }
    let pending = pending.len();
    let round_trips = u32::try_from(pending)
        .unwrap_or(u32::MAX)
        .saturating_mul(4)
        .saturating_add(4);
    let limit = db::LOCK_TIMEOUT.saturating_add(db::answer_limit().saturating_mul(round_trips));
    let applying = tokio::task::spawn_blocking(move || {
        let mut harness = Harness::from(conn);
        let applied = postgres::apply_pending_migrations(&mut harness, layout, db::LOCK_TIMEOUT);
        (harness.into_inner(), applied)
    });
    let (mut conn, applied) = tokio::time::timeout(limit, applying)
        .await
        .map_err(|_| {
            CliError::Unavailable(format!(
                "database unavailable: the migration did not finish within {}s ({pending} pending); \
                 the migrations that completed stay applied, run `migrate` again",
                limit.as_secs()
            ))
        })?
        .map_err(|_| CliError::Other("the migration thread panicked".into()))?;
    let applied = applied.map_err(db::store_error)?;
    let applied = full_names(applied);
    let existing = provisioned_layout(&mut conn, Schema::Whole).await?;
    // Again after applying: another migrator may have run the layout migration meanwhile.
    refuse_another_layout(args, wanted, &existing)?;
    let layout_name = existing.name();
    let interval = match &existing {
        Existing::Partitioned(interval) => Some(interval.as_str()),
        _ => None,
    };
    match format {
        Format::Json => {
            out.json(&json!({ "applied": applied, "layout": layout_name, "interval": interval }))?
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

/// The migrations that create the schema are recorded as applied, yet a table or a function
/// the store calls is missing: something dropped it outside idem-cli. Applying nothing and
/// answering "up to date" would send operators in a circle (every other command says "run `idem-cli migrate`"), and
/// re-running the migrations in place would fail on the objects that are left, so the
/// recovery is a documented manual step.
fn dropped_by_hand() -> CliError {
    CliError::NotProvisioned(
        "the migrations are recorded as applied (__diesel_schema_migrations), but a table \
         (`idempotency_keys`, or `idempotency_responses` on the partitioned layout, or a \
         generation table on the rotated one) or a function the store calls is missing: it was dropped outside \
         idem-cli; restore it from a backup, or see docs/operations.md, \"A schema dropped by \
         hand\""
            .into(),
    )
}

/// The layout a provisioned database has.
enum Existing {
    Plain,
    /// With its partition interval (`hourly` or `daily`).
    Partitioned(String),
    /// With its rotation period.
    Rotated(Duration),
}

impl Existing {
    /// `plain`, `partitioned (hourly|daily)` or `rotated`.
    fn name(&self) -> String {
        match self {
            Existing::Plain => "plain".into(),
            Existing::Partitioned(interval) => format!("partitioned ({interval})"),
            Existing::Rotated(_) => "rotated".into(),
        }
    }
}

/// The layout of a database whose tables are there, by catalog.
async fn read_layout(conn: &mut AsyncPgConnection) -> Result<Existing, CliError> {
    if sql!(conn, admin::rotated(conn)) {
        return Ok(Existing::Rotated(sql!(conn, admin::rotation_period(conn))));
    }
    Ok(match sql!(conn, admin::partition_interval(conn)) {
        Some(interval) => Existing::Partitioned(interval),
        None => Existing::Plain,
    })
}

/// What [`provisioned_layout`] requires of the schema.
#[derive(Clone, Copy)]
enum Schema {
    /// Before applying pending migrations: the tables (those migrations may add functions).
    TableOnly,
    /// After applying every migration: the tables and every function the store calls.
    Whole,
}

/// The layout of a provisioned schema.
/// Without its table the layout cannot be read ("plain" would be a guess): a schema whose
/// migrations are recorded but whose table (or, once none is pending, a function the store
/// calls) is gone was dropped by hand (exit 4).
async fn provisioned_layout(
    conn: &mut AsyncPgConnection,
    schema: Schema,
) -> Result<Existing, CliError> {
    let provisioned = match schema {
        Schema::Whole => db::bounded(admin::table_exists(conn))
            .await?
            .map_err(db::store_error)?,
        Schema::TableOnly => sql!(conn, admin::keys_table_exists(conn)),
    };
    if !provisioned {
        return Err(dropped_by_hand());
    }
    read_layout(conn).await
}

/// Refuse a layout other than the one the database has, once the layout migration has run.
fn refuse_another_layout(
    args: &MigrateArgs,
    wanted: Option<PartitionInterval>,
    existing: &Existing,
) -> Result<(), CliError> {
    let (asked, other) = match existing {
        Existing::Plain | Existing::Rotated(_) if args.partitioned => ("partitioned", existing),
        Existing::Plain | Existing::Partitioned(_) if args.rotated => ("rotated", existing),
        _ => ("", existing),
    };
    if !asked.is_empty() {
        // The layout migration ran earlier, without this setting: nothing is converted.
        return Err(CliError::Other(format!(
            "the database already has the {} layout (the layout is chosen when it is \
             provisioned); see docs/operations.md for moving a deployment to the {asked} one",
            other.name()
        )));
    }
    if let (Some(asked), Existing::Rotated(period)) = (args.rotation_period, existing) {
        if asked.0 != *period {
            // As for --interval: "nothing to apply" would read as if the period were in place.
            return Err(CliError::Other(format!(
                "the database already has the rotated layout with a rotation period of {}, \
                 not {asked} (the period is chosen when it is provisioned); drop \
                 --rotation-period to keep it",
                crate::duration::HumanDuration(*period)
            )));
        }
    }
    if let (Some(wanted), Existing::Partitioned(existing)) = (wanted, existing) {
        if wanted.as_str() != existing {
            // The layout migration ran earlier with the other interval: nothing is changed,
            // and "nothing to apply" would read as if the requested interval were in place.
            return Err(CliError::Other(format!(
                "the database already has the partitioned layout with {existing} partitions, \
                 not {} (the interval is chosen when it is provisioned); drop --interval to \
                 keep {existing}",
                wanted.as_str()
            )));
        }
    }
    Ok(())
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
