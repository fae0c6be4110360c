//! `idem-cli migrate [--check]` (contract C18).

use diesel::migration::MigrationSource;
use diesel::pg::Pg;
use idempotency_actix::store::postgres;
use serde_json::json;

use crate::cli::{Format, MigrateArgs};
use crate::db;
use crate::error::CliError;
use crate::output::Out;

/// Apply the embedded migrations, or with `--check` list the pending ones and fail (exit 5) if
/// there are any. Both go through the library's functions, which use the same embedded set the
/// middleware was built with, so "up to date" means "matches this binary's schema".
pub async fn run(
    url: &str,
    connect_timeout: std::time::Duration,
    args: &MigrateArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    // Connecting first gives the same "unavailable" diagnosis (and exit 3) as every other
    // command, instead of whatever the migration harness would say about a refused socket.
    drop(db::connect(url, connect_timeout).await?);

    if args.check {
        let pending = postgres::pending_migrations(url)
            .await
            .map_err(db::store_error)?;
        let pending = full_names(pending);
        match format {
            Format::Json => out.json(&json!({
                "up_to_date": pending.is_empty(),
                "pending": pending,
            }))?,
            Format::Text if pending.is_empty() => out.line("schema is up to date")?,
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

    let applied = postgres::run_migrations(url)
        .await
        .map_err(db::store_error)?;
    let applied = full_names(applied);
    match format {
        Format::Json => out.json(&json!({ "applied": applied }))?,
        Format::Text if applied.is_empty() => out.line("schema is up to date; nothing to apply")?,
        Format::Text => {
            for name in &applied {
                out.line(format!("applied {name}"))?;
            }
        }
    }
    out.flush()
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
