//! Failures and their exit codes.
//!
//! The codes are part of the CLI's interface: deploy gates and cron wrappers branch on them, so
//! they are few, distinct, documented in `--help` and docs/operations.md, and never change meaning.

use std::fmt;
use std::process::ExitCode;

/// Exit codes. `0` is success (including "another purge holds the lock": nothing is wrong).
pub mod code {
    /// Unexpected failure: a query failed for another reason, a record could not be decoded.
    pub const OTHER: u8 = 1;
    /// Bad arguments or missing `--database-url`/`DATABASE_URL` (clap uses 2 as well).
    pub const USAGE: u8 = 2;
    /// The database cannot be reached, or refused us (wrong credentials, unknown database, TLS).
    pub const UNAVAILABLE: u8 = 3;
    /// The database is reachable but the `idempotency_keys` table is missing: run `idem-cli migrate`.
    pub const NOT_PROVISIONED: u8 = 4;
    /// `migrate --check`: migrations are pending (the deploy gate is closed).
    pub const PENDING: u8 = 5;
    /// `show` / `release`: no record matched, or `release` refused (completed record, live lease
    /// or an ambiguous key) without `--force` or a narrower scope.
    pub const NOT_FOUND_OR_REFUSED: u8 = 6;
}

/// Why a command failed; rendered as one line on stderr, mapped to an exit code.
#[derive(Debug)]
pub enum CliError {
    /// See [`code::USAGE`].
    Usage(String),
    /// See [`code::UNAVAILABLE`].
    Unavailable(String),
    /// See [`code::NOT_PROVISIONED`].
    NotProvisioned(String),
    /// See [`code::PENDING`]; the pending list has already been printed.
    Pending(usize),
    /// See [`code::NOT_FOUND_OR_REFUSED`].
    NotFoundOrRefused(String),
    /// See [`code::OTHER`].
    Other(String),
    /// stdout was closed (`idem-cli list | head`): not an error worth a message.
    BrokenPipe,
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            CliError::Usage(_) => code::USAGE,
            CliError::Unavailable(_) => code::UNAVAILABLE,
            CliError::NotProvisioned(_) => code::NOT_PROVISIONED,
            CliError::Pending(_) => code::PENDING,
            CliError::NotFoundOrRefused(_) => code::NOT_FOUND_OR_REFUSED,
            CliError::Other(_) => code::OTHER,
            CliError::BrokenPipe => 0,
        })
    }
}

impl CliError {
    /// The same failure (same exit code) with `prefix` in front of its message, e.g. how far
    /// a purge got before the database went away.
    pub fn context(self, prefix: &str) -> Self {
        self.map_message(|m| format!("{prefix}: {m}"))
    }

    /// The same failure with `note` after its message (`message; note`), e.g. what a purge
    /// did after its first failure.
    pub fn note(self, note: &str) -> Self {
        self.map_message(|m| format!("{m}; {note}"))
    }

    fn map_message(self, f: impl FnOnce(String) -> String) -> Self {
        match self {
            CliError::Usage(m) => CliError::Usage(f(m)),
            CliError::Unavailable(m) => CliError::Unavailable(f(m)),
            CliError::NotProvisioned(m) => CliError::NotProvisioned(f(m)),
            CliError::NotFoundOrRefused(m) => CliError::NotFoundOrRefused(f(m)),
            CliError::Other(m) => CliError::Other(f(m)),
            other @ (CliError::Pending(_) | CliError::BrokenPipe) => other,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            CliError::Usage(m)
            | CliError::Unavailable(m)
            | CliError::NotProvisioned(m)
            | CliError::NotFoundOrRefused(m)
            | CliError::Other(m) => m.clone(),
            CliError::Pending(n) => format!("{n} migration(s) pending: run `idem-cli migrate`"),
            CliError::BrokenPipe => String::new(),
        };
        // Escaped too: a message may repeat what an operator typed or a server said (a
        // database name, a method), and a terminal must not run an escape sequence in it.
        f.write_str(&crate::output::escape::display(&one_line(&text), 0))
    }
}

impl From<std::io::Error> for CliError {
    fn from(err: std::io::Error) -> Self {
        if err.kind() == std::io::ErrorKind::BrokenPipe {
            CliError::BrokenPipe
        } else {
            CliError::Other(format!("cannot write output: {err}"))
        }
    }
}

pub use idempotency_actix::store::postgres::admin::{error_chain as chain, one_line};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_line() {
        let e = CliError::Other("relation missing\nHINT:  run it\n".into());
        assert_eq!(e.to_string(), "relation missing HINT: run it");
    }

    #[test]
    fn codes_are_distinct() {
        let codes = [
            code::OTHER,
            code::USAGE,
            code::UNAVAILABLE,
            code::NOT_PROVISIONED,
            code::PENDING,
            code::NOT_FOUND_OR_REFUSED,
        ];
        for (i, a) in codes.iter().enumerate() {
            for b in &codes[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    fn same_code(a: ExitCode, b: u8) -> bool {
        format!("{a:?}") == format!("{:?}", ExitCode::from(b))
    }

    /// Every variant maps to its documented code; a closed stdout is a success.
    #[test]
    fn each_failure_has_its_code() {
        let cases = [
            (CliError::Usage("u".into()), code::USAGE),
            (CliError::Unavailable("u".into()), code::UNAVAILABLE),
            (CliError::NotProvisioned("n".into()), code::NOT_PROVISIONED),
            (CliError::Pending(2), code::PENDING),
            (
                CliError::NotFoundOrRefused("n".into()),
                code::NOT_FOUND_OR_REFUSED,
            ),
            (CliError::Other("o".into()), code::OTHER),
            (CliError::BrokenPipe, 0),
        ];
        for (err, expected) in cases {
            assert!(same_code(err.exit_code(), expected), "{err:?}");
        }
    }

    /// `context` prefixes the message and keeps the code; the variants without a message stay
    /// as they are.
    #[test]
    fn context_keeps_the_code() {
        let cases = [
            CliError::Usage("m".into()),
            CliError::Unavailable("m".into()),
            CliError::NotProvisioned("m".into()),
            CliError::NotFoundOrRefused("m".into()),
            CliError::Other("m".into()),
        ];
        for err in cases {
            let before = format!("{:?}", err.exit_code());
            let err = err.context("purged 10 rows");
            assert_eq!(err.to_string(), "purged 10 rows: m");
            assert_eq!(format!("{:?}", err.exit_code()), before);
        }
        let pending = CliError::Pending(3).context("ignored");
        assert_eq!(
            pending.to_string(),
            "3 migration(s) pending: run `idem-cli migrate`"
        );
        let pipe = CliError::BrokenPipe.context("ignored");
        assert!(matches!(pipe, CliError::BrokenPipe));
        assert_eq!(pipe.to_string(), "");
    }

    /// A closed pipe is silent; any other write failure is a one-line error.
    #[test]
    fn io_errors() {
        let pipe = CliError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(matches!(pipe, CliError::BrokenPipe));
        let full = CliError::from(std::io::Error::other("disk full"));
        assert!(matches!(&full, CliError::Other(m) if m == "cannot write output: disk full"));
    }
}
