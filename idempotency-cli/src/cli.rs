//! The command line, declared with clap's derive API. Every help text here is read by operators
//! at 3 a.m.: each command says what it touches, what it refuses, and shows an example.

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::duration::HumanDuration;

const EXIT_CODES: &str = "\
Exit codes:
  0  success (also: purge skipped because another purge holds the lock)
  1  unexpected error (a query failed for another reason)
  2  bad arguments, or no --database-url / DATABASE_URL
  3  database unavailable: unreachable, wrong credentials, unknown database, TLS failure
  4  database not provisioned (table idempotency_keys missing): run `idem-cli migrate`
  5  migrate --check: migrations are pending
  6  show/release: no such record, or release refused (see `idem-cli release --help`)";

const MAIN_EXAMPLES: &str = "\
Examples:
  idem-cli migrate --check || idem-cli migrate        # deploy step
  idem-cli purge --batch-size 1000                     # from cron, every 15 minutes
  idem-cli list --state in-flight --older-than 5m      # reservations that look stuck
  idem-cli show 'order-42' --tenant acme               # one record and its stored response
  idem-cli stats --format json                         # for monitoring
  idem-cli release 'order-42' --tenant acme            # unstick a crashed request's key";

/// Provision, inspect and purge the idempotency-actix PostgreSQL table (`idempotency_keys`).
#[derive(Debug, Parser)]
#[command(
    name = "idem-cli",
    version,
    about = "Provision, inspect and purge the idempotency-actix PostgreSQL table",
    long_about = "Provision, inspect and purge the idempotency-actix PostgreSQL table \
                  (idempotency_keys).\n\nEvery command connects to --database-url or \
                  DATABASE_URL (postgres://user:password@host:5432/db; add ?sslmode=require \
                  or ?sslmode=verify-full for TLS). Failures print one line on stderr and exit \
                  with a documented code.",
    after_help = format!("{MAIN_EXAMPLES}\n\n{EXIT_CODES}"),
    disable_help_subcommand = true
)]
pub struct Cli {
    /// PostgreSQL connection URL (the password is never printed).
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Global options"
    )]
    pub database_url: Option<String>,

    /// Redis URL of a RedisStore (redis:// or rediss://), instead of a database: list, show,
    /// stats and release read its records; migrate and purge have nothing to do.
    #[arg(
        long,
        env = "REDIS_URL",
        global = true,
        hide_env_values = true,
        value_name = "URL",
        help_heading = "Global options"
    )]
    pub redis_url: Option<String>,

    /// Key prefix of the RedisStore (default idem:).
    #[arg(
        long,
        global = true,
        value_name = "PREFIX",
        help_heading = "Global options"
    )]
    pub redis_prefix: Option<String>,

    /// Output: human-readable text/table, or JSON (one object per line) for scripts.
    #[arg(long, global = true, value_enum, default_value_t = Format::Text,
          help_heading = "Global options")]
    pub format: Format,

    /// Give up connecting after this long (e.g. 10s); the database is then "unavailable" (exit 3).
    /// With --redis-url also the longest wait for any one Redis reply.
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        default_value = "10s",
        help_heading = "Global options"
    )]
    pub connect_timeout: HumanDuration,

    /// PostgreSQL: the longest any one statement may run (the session's statement_timeout).
    /// The CLI also stops waiting for any one answer 5s after it, so a server or network gone
    /// silent mid-command is "unavailable" (exit 3) instead of a hang.
    #[arg(
        long,
        global = true,
        value_name = "DURATION",
        default_value = "5m",
        help_heading = "Global options"
    )]
    pub statement_timeout: HumanDuration,

    #[command(subcommand)]
    pub command: Command,
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Text for people: aligned tables and labelled fields.
    #[value(alias = "table")]
    Text,
    /// JSON, one object per line (records, summaries), for scripts and monitoring.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the schema from the migrations embedded in this binary.
    #[command(
        long_about = "Create or upgrade the schema from the migrations embedded in this binary. \
                      Running it again is harmless: applied migrations are skipped. Prints one \
                      line per migration applied.\n\nWith --check nothing is applied: it lists \
                      the pending migrations and exits 5 if there are any, 0 if the schema is \
                      current (a deploy gate).",
        after_help = "Examples:\n  \
                      idem-cli migrate                 # apply pending migrations\n  \
                      idem-cli migrate --check         # exit 5 and list them if any are pending"
    )]
    Migrate(MigrateArgs),

    /// Delete expired records in short batches (safe from cron).
    #[command(
        long_about = "Delete expired records in short batches, each its own statement and \
                      transaction, so live traffic is not blocked (rows a request is touching \
                      are skipped and left for the next run). On the partitioned layout, \
                      dropping expired partitions and attaching new ones take short exclusive \
                      locks that replays and completes wait behind (purge itself waits at most \
                      --lock-timeout for each); --tenant skips those steps.\n\n\
                      Deleted: completed records whose retention (TTL) has ended, and in-flight \
                      reservations whose lease ended more than --grace ago. A record is never \
                      deleted before it expires; --older-than and --tenant only narrow the set.\n\n\
                      Only one purge works at a time (PostgreSQL advisory lock): a purge started \
                      while another runs prints that it skipped and exits 0. Output is one \
                      summary line. Use a direct or session-pooled connection (not PgBouncer \
                      transaction pooling), or the lock does not hold.",
        after_help = "Examples:\n  \
                      idem-cli purge                               # everything that expired\n  \
                      idem-cli purge --dry-run                     # count only\n  \
                      idem-cli purge --older-than 7d               # keep expired rows a week\n  \
                      idem-cli purge --batch-size 5000 --pause 50ms --format json\n\n\
                      Cron (every 15 minutes):\n  \
                      */15 * * * * DATABASE_URL=postgres://... idem-cli purge --batch-size 1000"
    )]
    Purge(PurgeArgs),

    /// List records (oldest first) as a table or JSON lines.
    #[command(
        long_about = "List records, oldest first, as a table or (--format json) one JSON \
                      object per record. Filters combine with AND. States: in-flight (a \
                      reservation, whether or not its lease ended: the EXPIRES column of an \
                      in-flight row is its lease end), completed (a stored response that is still \
                      replayed), expired (a completed record past its TTL, waiting for purge).",
        after_help = "Examples:\n  \
                      idem-cli list --tenant acme --limit 20\n  \
                      idem-cli list --state in-flight --older-than 5m     # likely stuck\n  \
                      idem-cli list --key-prefix order- --format json | jq .key"
    )]
    List(ListArgs),

    /// Show records with this key: fields, lease, stored status, headers and body.
    #[command(
        long_about = "Show every record with this Idempotency-Key (narrow with --tenant, \
                      --method, --path): scope, state, fingerprint, timestamps, lease, and the \
                      stored response: status, headers and body (JSON pretty-printed, text as \
                      is, binary as a hex excerpt; --format json carries the exact bytes as \
                      base64). Exits 6 when nothing matches.",
        after_help = "Examples:\n  \
                      idem-cli show order-42\n  \
                      idem-cli show order-42 --tenant acme --method POST --path /payments\n  \
                      idem-cli show order-42 --format json | jq .response.body_json"
    )]
    Show(ShowArgs),

    /// Count records by state, expired-but-not-purged, oldest in-flight, table and index size.
    #[command(after_help = "Examples:\n  \
                      idem-cli stats\n  \
                      idem-cli stats --format json     # for a monitoring check")]
    Stats,

    /// Remove stuck in-flight reservations so their keys can be used again.
    #[command(
        long_about = "Remove in-flight reservations so their keys can be used again, printing \
                      what was removed. Each KEY must match exactly one record (narrow with \
                      --tenant/--method/--path).\n\n\
                      Refused without --force (exit 6): a reservation whose lease is still \
                      running (its request may still be executing: releasing it lets a retry run \
                      the operation a second time) and a completed record (removing it makes the \
                      next request with that key execute again instead of replaying).\n\n\
                      --token (the token `show` printed) releases only that record while it \
                      is in the state `show` printed (--state, in-flight unless told): one \
                      that finished or was taken over since is left alone.",
        after_help = "Examples:\n  \
                      idem-cli release order-42 --tenant acme\n  \
                      idem-cli release k1 k2 k3 --tenant acme --method POST --path /payments\n  \
                      idem-cli release order-42 --tenant acme --force   # also live/completed\n  \
                      idem-cli release order-42 --tenant acme --force --token <token from show>\n  \
                      idem-cli release order-42 --tenant acme --force --token <token> --state completed"
    )]
    Release(ReleaseArgs),
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Apply nothing; list pending migrations and exit 5 if there are any.
    #[arg(long)]
    pub check: bool,

    /// Provision the time-partitioned layout (responses partitioned by expiry, purged by
    /// dropping partitions; see docs/operations.md). Only on a database being provisioned:
    /// the layout is chosen once.
    #[arg(long, conflicts_with = "check")]
    pub partitioned: bool,

    /// Partition interval of the partitioned layout (default: daily). Like the layout, it is
    /// chosen once: asking for another one than the database has fails.
    // An Option, not `default_value = "daily"`: the default only picks the interval of a
    // database being provisioned. Re-running a plain `migrate --partitioned` (a deploy step)
    // on an hourly database asks for no particular interval and must not fail; only an
    // explicit --interval is compared with the database's.
    #[arg(long, value_enum, requires = "partitioned")]
    pub interval: Option<IntervalArg>,

    /// Provision the rotated layout (three generation tables used in turn; `purge` empties one
    /// with TRUNCATE at most once per --rotation-period; see docs/operations.md). Only on a
    /// database being provisioned: the layout is chosen once.
    #[arg(long, conflicts_with_all = ["check", "partitioned"])]
    pub rotated: bool,

    /// Rotation period of the rotated layout (default 2d; at least 1h): the least time between
    /// two rotations. Records that outlive it are carried forward, one move per rotation;
    /// dead rows stay on disk for up to about three periods. Chosen when the database is
    /// provisioned: asking for another one than the database has fails.
    #[arg(long, value_name = "DURATION", requires = "rotated")]
    pub rotation_period: Option<HumanDuration>,
}

/// `migrate --interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IntervalArg {
    /// One partition per hour of expiry.
    Hourly,
    /// One partition per day of expiry (UTC).
    Daily,
}

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Only records created at least this long ago (e.g. 7d, 36h). Never deletes unexpired ones.
    #[arg(long, value_name = "DURATION", default_value = "0")]
    pub older_than: HumanDuration,

    /// In-flight reservations are deleted only once their lease ended this long ago.
    #[arg(long, value_name = "DURATION", default_value = "24h")]
    pub grace: HumanDuration,

    /// Records deleted per statement (1..=100000); see docs/operations.md for sizing.
    #[arg(long, value_name = "N", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,

    /// Sleep between batches (e.g. 50ms) to spread WAL and replication load.
    #[arg(long, value_name = "DURATION", default_value = "0")]
    pub pause: HumanDuration,

    /// Count what would be deleted; delete nothing (takes no lock).
    #[arg(long)]
    pub dry_run: bool,

    /// Only this tenant's records ('' for the global scope).
    #[arg(long, value_name = "TENANT")]
    pub tenant: Option<String>,

    /// Partitioned layout: keep partitions created until their ranges cover now + this (e.g.
    /// 36h, 3d). Keep it above the longest response TTL plus the time purge may miss runs:
    /// a response expiring past it goes to the default partition (see docs/operations.md).
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "36h",
        conflicts_with = "partitions_ahead"
    )]
    pub horizon: HumanDuration,

    /// Partitioned layout: instead of --horizon, exactly this many intervals ahead of the
    /// current one.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub partitions_ahead: Option<u32>,

    /// Partitioned layout: the longest wait for each lock that dropping or creating a
    /// partition takes (live traffic queued behind it waits as long).
    #[arg(long, value_name = "DURATION", default_value = "1s")]
    pub lock_timeout: HumanDuration,
}

/// Record states as `list --state` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateFilter {
    /// Reservations (request running, or lease ended and not yet taken over or purged).
    InFlight,
    /// Completed records still replayed (not expired).
    Completed,
    /// Completed records past their TTL, waiting for purge.
    Expired,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only this tenant ('' for the global scope).
    #[arg(long, value_name = "TENANT")]
    pub tenant: Option<String>,

    /// Only records in this state.
    #[arg(long, value_enum)]
    pub state: Option<StateFilter>,

    /// Only keys starting with this text.
    #[arg(long, value_name = "PREFIX")]
    pub key_prefix: Option<String>,

    /// Only records created at least this long ago (e.g. 5m, 2d).
    #[arg(long, value_name = "DURATION")]
    pub older_than: Option<HumanDuration>,

    /// At most this many records (0: no limit).
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub limit: u32,
}

/// Narrows a key to a scope; every part is optional.
#[derive(Debug, Args, Clone)]
pub struct ScopeArgs {
    /// Tenant of the record ('' for the global scope).
    #[arg(long, value_name = "TENANT")]
    pub tenant: Option<String>,

    /// HTTP method of the record (case-insensitive).
    #[arg(long, value_name = "METHOD")]
    pub method: Option<String>,

    /// Request path of the record, without query string (e.g. /payments).
    #[arg(long, value_name = "PATH")]
    pub path: Option<String>,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The Idempotency-Key as stored (sf-string quotes and escapes removed).
    pub key: String,

    #[command(flatten)]
    pub scope: ScopeArgs,
}

#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// One or more Idempotency-Keys.
    #[arg(required = true, num_args = 1.., value_name = "KEY")]
    pub keys: Vec<String>,

    #[command(flatten)]
    pub scope: ScopeArgs,

    /// Also remove completed records and reservations whose lease is still running.
    #[arg(long)]
    pub force: bool,

    /// Remove the record only while it holds this token, as `show` printed it (one KEY), in the
    /// state `--state` names (in flight unless told): a record completed, taken over or
    /// reserved again since it was inspected is left alone.
    #[arg(long, value_name = "UUID")]
    pub token: Option<uuid::Uuid>,

    /// With --token: the state `show` printed, `completed` to remove a completed record (with
    /// --force). Default: in-flight.
    #[arg(long, value_enum, requires = "token")]
    pub state: Option<HeldState>,
}

/// A record's state as `release --state` names it (`show`'s spelling accepted too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeldState {
    /// A reservation (its request running, or its lease ended).
    #[value(alias = "in_flight")]
    InFlight,
    /// A completed record (replayed, or expired).
    Completed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_a_cron_line() {
        let cli = Cli::try_parse_from([
            "idem-cli",
            "purge",
            "--older-than",
            "7d",
            "--batch-size",
            "500",
            "--format",
            "json",
        ])
        .expect("valid");
        match cli.command {
            Command::Purge(p) => {
                assert_eq!(p.batch_size, 500);
                assert_eq!(p.older_than.to_string(), "7d");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(cli.format, Format::Json);
    }

    #[test]
    fn rejects_bad_values() {
        for args in [
            &["idem-cli", "purge", "--older-than", "7x"][..],
            &["idem-cli", "purge", "--batch-size", "0"],
            &["idem-cli", "list", "--state", "sleeping"],
            &["idem-cli", "release"],
        ] {
            assert!(Cli::try_parse_from(args).is_err(), "{args:?}");
        }
    }
}
