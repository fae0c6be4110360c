//! `idem-cli`: provision, inspect and purge the idempotency-actix PostgreSQL table.
//!
//! Run by deploy pipelines and cron, so it is built to be boring: one summary line per command,
//! one line on stderr per failure, documented exit codes (see [`error::code`]), no panics on
//! anything a user or a database controls.
#![forbid(unsafe_code)]

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

/// Await a diesel-async query on `$conn`; on failure return the classified [`error::CliError`].
/// The failed query's future (which borrows the connection) is dropped before the connection is
/// used again to ask whether the table exists.
macro_rules! sql {
    ($conn:expr, $query:expr) => {{
        // Bounded: a frozen server or network is "unavailable" (exit 3), never a hang.
        let result = $crate::db::bounded($query).await?;
        match result {
            Ok(value) => value,
            Err(err) => return Err($crate::db::classify($conn, err).await),
        }
    }};
}

mod cli;
mod commands;
mod db;
mod duration;
mod error;
mod output;
mod record;
mod redis_store;

use cli::{Cli, Command};
use error::{code, CliError};
use idempotency_actix::store::postgres::MAX_STATEMENT_TIMEOUT;

fn main() -> ExitCode {
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|matches| Ok((Cli::from_arg_matches(&matches)?, flags_given(&matches))));
    let (cli, given) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => return clap_exit(err),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => return fail(&CliError::Other(format!("cannot start the runtime: {err}"))),
    };
    let result = runtime.block_on(run(cli, &given));
    // Without waiting for blocking threads: a migration stuck on a server gone silent (its
    // harness is synchronous, `commands::migrate`) must not keep the process from exiting.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => fail(&err),
    }
}

/// The command's own flags that were given on the command line (`--grace`), as its
/// definition names them: not the global ones (`--format`), which clap copies into every
/// command's matches, nor the argument groups it adds.
fn flags_given(matches: &ArgMatches) -> Vec<String> {
    let Some((name, given)) = matches.subcommand() else {
        return Vec::new();
    };
    let cli = Cli::command();
    let Some(command) = cli.find_subcommand(name) else {
        return Vec::new();
    };
    command
        .get_arguments()
        .filter(|arg| given.value_source(arg.get_id().as_str()) == Some(ValueSource::CommandLine))
        .filter_map(|arg| arg.get_long().map(|long| format!("--{long}")))
        .collect()
}

/// `migrate` and `purge` have nothing to do on Redis, and say so; a flag that asks them for
/// other work (`purge --grace 1h` or `--tenant`: delete something sooner; `migrate
/// --partitioned`, `--rotated`) is refused rather than ignored, so an operator's intent is not dropped with
/// exit 0. The others only tune how PostgreSQL's work is done (`--batch-size`, `--pause`, a
/// cron line shared by both stores) or ask whether there is work (`--check`, `--dry-run`),
/// which "none" answers.
const ASKS_FOR_WORK: [&str; 7] = [
    "--grace",
    "--older-than",
    "--tenant",
    "--partitioned",
    "--interval",
    "--rotated",
    "--rotation-period",
];

fn no_postgres_only_flags(command: &Command, given: &[String]) -> Result<(), CliError> {
    let (name, noun) = match command {
        Command::Migrate(_) => ("migrate", "migration"),
        Command::Purge(_) => ("purge", "purge"),
        _ => return Ok(()),
    };
    match given
        .iter()
        .find(|flag| ASKS_FOR_WORK.contains(&flag.as_str()))
    {
        Some(flag) => Err(CliError::Usage(format!(
            "{name} {flag} applies to PostgreSQL only: Redis needs no {noun} (records expire by \
             themselves; see docs/redis.md)"
        ))),
        None => Ok(()),
    }
}

async fn run(cli: Cli, given: &[String]) -> Result<(), CliError> {
    // Before the Redis branch: there it bounds every reply too.
    positive(cli.connect_timeout.0, "--connect-timeout", "10s")?;
    no_connection_string_as_a_value(&cli)?;
    one_key_per_token(&cli.command)?;
    if let Some(redis_url) = cli.redis_url.as_deref().filter(|u| !u.is_empty()) {
        if cli.database_url.as_deref().is_some_and(|u| !u.is_empty()) {
            return Err(CliError::Usage(
                "both a database URL and a Redis URL are set: pick one (unset DATABASE_URL \
                 or REDIS_URL, or drop --database-url/--redis-url)"
                    .into(),
            ));
        }
        no_postgres_only_flags(&cli.command, given)?;
        let mut out = out_for(&cli.command);
        let (prefix, timeout) = (cli.redis_prefix.as_deref(), cli.connect_timeout.0);
        return redis_store::run(
            redis_url,
            prefix,
            &cli.command,
            cli.format,
            timeout,
            &mut out,
        )
        .await;
    }
    let url = cli.database_url.as_deref().ok_or_else(|| {
        CliError::Usage("no database: pass --database-url or set DATABASE_URL (or --redis-url / REDIS_URL for a RedisStore)".into())
    })?;
    let timeout = cli.connect_timeout.0;
    // PostgreSQL only (Redis has no statements to bound).
    positive(cli.statement_timeout.0, "--statement-timeout", "5m")?;
    // PostgreSQL takes at most i32::MAX ms (about 24.8 days); a longer value would fail every
    // command at connect as a "database error".
    if cli.statement_timeout.0 > MAX_STATEMENT_TIMEOUT {
        return Err(CliError::Usage(
            "--statement-timeout can be at most 24d (PostgreSQL's limit is about 24.8 days)".into(),
        ));
    }
    db::set_statement_timeout(cli.statement_timeout.0);
    let mut out = out_for(&cli.command);
    if let Command::Migrate(args) = &cli.command {
        return commands::migrate::run(url, timeout, args, cli.format, &mut out).await;
    }
    let mut conn = db::connect(url, timeout).await?;
    let conn = &mut conn;
    match &cli.command {
        Command::Migrate(_) => Ok(()),
        Command::Purge(args) => commands::purge::run(conn, args, cli.format, &mut out).await,
        Command::List(args) => commands::list::run(conn, args, cli.format, &mut out).await,
        Command::Show(args) => commands::show::run(conn, args, cli.format, &mut out).await,
        Command::Stats => commands::stats::run(conn, cli.format, &mut out).await,
        Command::Release(args) => commands::release::run(conn, args, cli.format, &mut out).await,
    }
}

/// `release` and `show` take any word as a KEY, and repeat a key they cannot find (on stderr,
/// or in their JSON), with the scope flags' values; `purge` and `list` repeat their filters in
/// their JSON. A
/// connection string typed there (`release k1 postgres://..`, `--tenant` given the URL, or a
/// crontab line split at its spaces into `password=..`) would be printed, password and all.
/// Such a value is refused without being shown. One that holds `://` and `@`, or `password=`,
/// is no key, tenant, path or prefix anyone means; a URL without credentials still is a key.
fn no_connection_string_as_a_value(cli: &Cli) -> Result<(), CliError> {
    fn scope(scope: &cli::ScopeArgs) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("--tenant", &scope.tenant),
            ("--method", &scope.method),
            ("--path", &scope.path),
        ]
        .into_iter()
        .filter_map(|(flag, value)| value.as_deref().map(|v| (flag, v)))
    }
    let mut values: Vec<(&str, &str)> = Vec::new();
    match &cli.command {
        Command::Release(args) => {
            values.extend(args.keys.iter().map(|k| ("a KEY", k.as_str())));
            values.extend(scope(&args.scope));
        }
        Command::Show(args) => {
            values.push(("the KEY", &args.key));
            values.extend(scope(&args.scope));
        }
        // Repeated in their JSON summaries.
        Command::Purge(args) => values.extend(args.tenant.as_deref().map(|t| ("--tenant", t))),
        Command::List(args) => {
            values.extend(args.tenant.as_deref().map(|t| ("--tenant", t)));
            values.extend(args.key_prefix.as_deref().map(|p| ("--key-prefix", p)));
        }
        _ => {}
    }
    values.extend(cli.redis_prefix.as_deref().map(|p| ("--redis-prefix", p)));
    let looks_like_one = |value: &str| {
        (value.contains("://") && value.contains('@'))
            || value.to_ascii_lowercase().contains("password=")
    };
    if let Some((what, _)) = values.iter().find(|(_, value)| looks_like_one(value)) {
        return Err(CliError::Usage(format!(
            "{what} looks like a connection string (not shown: it may hold a password); pass \
             the database with --database-url or DATABASE_URL (--redis-url or REDIS_URL)"
        )));
    }
    Ok(())
}

/// `release --token` names one record's token: with several keys all but one would be refused
/// for holding another, so it is refused before any is looked at (exit 2).
fn one_key_per_token(command: &Command) -> Result<(), CliError> {
    match command {
        Command::Release(args) if args.token.is_some() && args.keys.len() > 1 => Err(
            CliError::Usage("release --token takes one KEY (a token names one record)".into()),
        ),
        _ => Ok(()),
    }
}

/// Where the command writes: a closed pipe ends a listing, but not a command whose exit code
/// is its outcome (`output::Out::for_outcome`).
fn out_for(command: &Command) -> output::Out {
    match command {
        Command::Migrate(_) | Command::Purge(_) | Command::Release(_) => output::Out::for_outcome(),
        Command::List(_) | Command::Show(_) | Command::Stats => output::Out::new(),
    }
}

/// A timeout flag of 0 is a usage error (exit 2): a zero `--connect-timeout` can never be met
/// (every connection would fail as "unavailable"), and PostgreSQL reads a zero
/// `statement_timeout` as "no limit", the opposite of what a bound is for.
fn positive(timeout: Duration, flag: &str, example: &str) -> Result<(), CliError> {
    if timeout.is_zero() {
        return Err(CliError::Usage(format!(
            "{flag} must be more than 0 (e.g. {example})"
        )));
    }
    Ok(())
}

/// Print one line on stderr and map the error to its exit code.
fn fail(err: &CliError) -> ExitCode {
    if !matches!(err, CliError::BrokenPipe) {
        // If stderr itself is gone there is nobody to tell; the exit code still says it.
        let _ = writeln!(std::io::stderr(), "idem-cli: {err}");
    }
    err.exit_code()
}

/// `--help` and `--version` print in full and exit 0. Usage errors become one line on stderr
/// (clap's first paragraph, e.g. "the following required arguments were not provided: `<KEY>`",
/// plus its "tip" when it has one, e.g. a similarly named flag) and exit 2. A bare `idem-cli`
/// is a usage error too: one line naming the commands rather than a page of help on stderr.
fn clap_exit(err: clap::Error) -> ExitCode {
    match err.kind() {
        // A help or version text that could not be written is a failure, as any output is
        // (review, 2026-12-06: `--help > /dev/full` exited 0); a reader that stopped reading
        // (`| head`) had what it wanted.
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => match err.print() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => {
                let _ = writeln!(std::io::stderr(), "idem-cli: cannot write output: {e}");
                ExitCode::from(code::OTHER)
            }
        },
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            let _ = writeln!(
                std::io::stderr(),
                "idem-cli: no command given (migrate, purge, list, show, stats, release); \
                 see `idem-cli --help`"
            );
            ExitCode::from(code::USAGE)
        }
        _ => {
            let line = stray_word_line(&err).unwrap_or_else(|| usage_line(&err));
            let _ = writeln!(std::io::stderr(), "idem-cli: {line}");
            ExitCode::from(code::USAGE)
        }
    }
}

/// The line for a word clap could not place, without the word unless it is a flag's name:
/// clap quotes it, and it may be a password (a connection string left unquoted in a crontab,
/// split at its spaces; a URL after the command; a misspelt flag with the URL after its `=`).
/// `None` for the other errors.
fn stray_word_line(err: &clap::Error) -> Option<String> {
    if !matches!(
        err.kind(),
        ErrorKind::UnknownArgument | ErrorKind::InvalidSubcommand
    ) {
        return None;
    }
    let suggestion = [ContextKind::SuggestedSubcommand, ContextKind::SuggestedArg]
        .into_iter()
        .find_map(|kind| match err.get(kind) {
            Some(ContextValue::String(s)) => Some(s.clone()),
            Some(ContextValue::Strings(v)) => v.first().cloned(),
            _ => None,
        })
        .map(|s| format!("; did you mean '{s}'?"))
        .unwrap_or_default();
    let word = [ContextKind::InvalidArg, ContextKind::InvalidSubcommand]
        .into_iter()
        .find_map(|kind| match err.get(kind) {
            Some(ContextValue::String(s)) => Some(s.as_str()),
            _ => None,
        })
        .unwrap_or_default();
    let what = match word.split('=').next() {
        Some(flag) if looks_like_a_flag(flag) => format!("unexpected argument '{flag}'"),
        _ => format!(
            "{} (not shown: it may hold a password; quote a connection string that has spaces)",
            if err.kind() == ErrorKind::InvalidSubcommand {
                "unknown command"
            } else {
                "unexpected word in the arguments"
            }
        ),
    };
    Some(format!("{what}{suggestion} (see `idem-cli --help`)"))
}

/// `-x` or `--some-flag`: what a misspelt flag looks like, and nothing else that starts with a
/// dash does. A password with a space in it, left unquoted, splits into words, and the one
/// after the space may start with `--` too (`--cd@db/pay`): not a name to repeat.
fn looks_like_a_flag(word: &str) -> bool {
    let name = word.strip_prefix("--").or_else(|| word.strip_prefix('-'));
    name.is_some_and(|name| {
        name.len() <= 40
            && name.starts_with(|c: char| c.is_ascii_alphabetic())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    })
}

/// Clap's multi-line error as one line.
fn usage_line(err: &clap::Error) -> String {
    let rendered = err.render().to_string();
    let mut paragraphs = rendered.split("\n\n");
    let first = paragraphs
        .next()
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let first = first.trim_start_matches("error: ");
    let first = if first.is_empty() {
        "invalid arguments"
    } else {
        first
    };
    let tip = rendered
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("tip:"))
        .map(|t| format!("; {t}"))
        .unwrap_or_default();
    format!("{first}{tip} (see `idem-cli --help`)")
}
