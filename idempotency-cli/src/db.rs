//! Connecting, and turning database failures into exit codes.
//!
//! Connection, TLS and migration logic live in `idempotency_actix::store::postgres` so that the
//! CLI and the middleware agree on what a URL means; this module only adds the CLI's session
//! settings and its error classification.

use std::future::Future;
use std::ops::ControlFlow;
use std::sync::OnceLock;
use std::time::Duration;

use diesel_async::methods::LoadQuery;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use idempotency_actix::store::postgres::admin;
use idempotency_actix::store::StoreError;

use crate::error::{chain, CliError};

/// Reject strings that are certainly not PostgreSQL connection strings before connecting, so a
/// typo is a usage error (exit 2) rather than a confusing connection failure. No part of the
/// string is repeated: before `://` may be password text (a key=value string holding `://`).
pub fn check_url(url: &str) -> Result<(), CliError> {
    let url = url.trim();
    if url.is_empty() {
        return Err(CliError::Usage(
            "empty database URL: pass --database-url or set DATABASE_URL".into(),
        ));
    }
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if !postgres && url.contains("://") && !url.contains('=') {
        return Err(CliError::Usage(
            "the database URL is not a postgres:// or postgresql:// URL (nor a key=value \
             connection string); the URL is not shown"
                .into(),
        ));
    }
    Ok(())
}

/// The connection string for messages: the library's [`admin::redact`] (rebuilt from the
/// driver's parse, password as `***`, nothing of a string it cannot parse).
pub fn redact(url: &str) -> String {
    admin::redact(url)
}

/// The session's `statement_timeout` (`--statement-timeout`), set once by `main`.
static STATEMENT_TIMEOUT: OnceLock<Duration> = OnceLock::new();

/// How much longer than the statement timeout the CLI waits for an answer: the server's own
/// cancellation (a clearer error) arrives first whenever the server is still there.
const ANSWER_MARGIN: Duration = Duration::from_secs(5);

/// Default `--statement-timeout`.
const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(300);

/// Set the statement timeout for every connection and query of this run.
pub fn set_statement_timeout(timeout: Duration) {
    // Set once, from `main`; a second call changes nothing.
    let _ = STATEMENT_TIMEOUT.set(timeout);
}

fn statement_timeout() -> Duration {
    STATEMENT_TIMEOUT
        .get()
        .copied()
        .unwrap_or(DEFAULT_STATEMENT_TIMEOUT)
}

/// The longest the CLI waits for any one answer from the database. `statement_timeout` is
/// enforced by the server, so it cannot help when the server or the network froze: the socket
/// stays open and nothing ever arrives.
pub fn answer_limit() -> Duration {
    statement_timeout() + ANSWER_MARGIN
}

/// Await one database round trip for at most [`answer_limit`]; past it the database is
/// "unavailable" (exit 3).
pub async fn bounded<F: Future>(round_trip: F) -> Result<F::Output, CliError> {
    tokio::time::timeout(answer_limit(), round_trip)
        .await
        .map_err(|_| {
            CliError::Unavailable(format!(
                "database unavailable: no answer within {}s (--statement-timeout plus {}s)",
                answer_limit().as_secs_f64(),
                ANSWER_MARGIN.as_secs()
            ))
        })
}

/// The CLI's `lock_timeout`: the longest any of its statements waits for a lock, and the
/// longest `migrate` waits for the migration lock.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// Open a connection with the library's TLS-aware `establish_within`, bounded by `timeout`
/// (each host of a failover list by its share), and set
/// the session up: `application_name` so operators can spot the CLI in `pg_stat_activity`,
/// and timeouts so a forgotten CLI can never hold locks or a statement for long.
pub async fn connect(url: &str, timeout: Duration) -> Result<AsyncPgConnection, CliError> {
    check_url(url)?;
    let target = redact(url);
    let no_answer = || {
        CliError::Unavailable(format!(
            "cannot connect to {target}: no answer within {}s",
            timeout.as_secs_f64()
        ))
    };
    // Login and the session settings both count as connecting: a server that accepts the
    // login and then goes silent is as unavailable as one that never answers.
    let deadline = tokio::time::Instant::now() + timeout;
    let mut conn =
        match tokio::time::timeout_at(deadline, admin::establish_within(url, timeout)).await {
            Err(_) => return Err(no_answer()),
            Ok(Err(err)) => return Err(connect_error(&target, err)),
            Ok(Ok(conn)) => conn,
        };
    let settings = format!(
        "SET application_name = 'idem-cli'; \
         SET statement_timeout = '{}ms'; \
         SET lock_timeout = '{}ms'; \
         SET idle_in_transaction_session_timeout = '1min'",
        statement_timeout().as_millis().max(1),
        LOCK_TIMEOUT.as_millis()
    );
    match tokio::time::timeout_at(deadline, conn.batch_execute(&settings)).await {
        Err(_) => return Err(no_answer()),
        Ok(result) => result.map_err(|err| store_error(admin::classify_error(err)))?,
    }
    Ok(conn)
}

/// End the session on the server's side once it has been idle (between statements, outside a
/// transaction) for longer than `longest_pause` plus 20 s: a CLI whose host vanished (power,
/// network, no FIN) otherwise keeps its session, and the purge lock with it, until the
/// server's TCP keepalive gives up (about 2 h 11 min by default), and every purge meanwhile
/// is skipped. PostgreSQL 14 and later (`idle_session_timeout`; an older server has no such
/// row in `pg_settings`, and keeps the session as before). [`keep_when_left_idle`] undoes it.
pub async fn end_when_left_idle(
    conn: &mut AsyncPgConnection,
    longest_pause: Duration,
) -> Result<(), CliError> {
    let limit_ms = longest_pause
        .saturating_add(Duration::from_secs(20))
        .as_millis()
        .min(i32::MAX as u128);
    let statement = format!(
        "SELECT set_config(name, '{limit_ms}ms', false) FROM pg_settings \
         WHERE name = 'idle_session_timeout'"
    );
    match bounded(conn.batch_execute(&statement)).await {
        Err(frozen) => Err(frozen),
        Ok(result) => result.map_err(|err| store_error(admin::classify_error(err))),
    }
}

/// The server's default `idle_session_timeout` again, before the session ends: behind a
/// session pooler that does not reset sessions (PgBouncer with `server_reset_query = ''`),
/// the limit would stay on the server connection the app gets next. Best effort: a session
/// that cannot take it is about to end anyway.
pub async fn keep_when_left_idle(conn: &mut AsyncPgConnection) {
    let statement = "SELECT set_config(name, reset_val, false) FROM pg_settings \
                     WHERE name = 'idle_session_timeout'";
    let _ = bounded(conn.batch_execute(statement)).await;
}

/// Every failure to *connect* is "unavailable" (exit 3) from the operator's point of view:
/// refused, timed out, wrong password, unknown database and TLS errors all mean the CLI never
/// got to look at the table. The exception is a URL the library cannot parse (it reports that as
/// `Backend`): that is a usage error (exit 2), and retrying will not fix it.
fn connect_error(target: &str, err: StoreError) -> CliError {
    match err {
        StoreError::NotProvisioned { hint } => CliError::NotProvisioned(hint),
        StoreError::Backend(source) => {
            let detail = chain(source.as_ref());
            let detail = detail
                .strip_prefix("invalid database URL: ")
                .unwrap_or(&detail);
            CliError::Usage(format!("invalid database URL {target}: {detail}"))
        }
        StoreError::Unavailable(source) => CliError::Unavailable(format!(
            "cannot connect to {target}: {}",
            chain(source.as_ref())
        )),
        other => CliError::Unavailable(format!("cannot connect to {target}: {other}")),
    }
}

/// Classify a failed statement. On an unclassified error this asks `conn` whether the table
/// exists (the library's check; diesel-async does not expose SQLSTATE 42P01), so a missing table
/// is reported as "run `idem-cli migrate`" (exit 4) and not as a generic failure.
pub async fn classify(conn: &mut AsyncPgConnection, err: diesel::result::Error) -> CliError {
    // The check is a round trip too: bounded like any other.
    match bounded(admin::classify_query_error(conn, err)).await {
        Ok(err) => store_error(err),
        Err(frozen) => frozen,
    }
}

/// Streams `query`'s rows to `each` as they arrive (`list`, `show`): only the row being handled
/// is in memory, however many match. Every round trip is bounded, as [`bounded`]; `each`
/// returns [`ControlFlow::Break`] to stop early. A failed statement is classified once its
/// stream is dropped (the connection is free again).
pub async fn for_each_row<'query, Q, T>(
    conn: &mut AsyncPgConnection,
    query: Q,
    mut each: impl FnMut(T) -> Result<ControlFlow<()>, CliError>,
) -> Result<(), CliError>
where
    Q: RunQueryDsl<AsyncPgConnection> + LoadQuery<'query, AsyncPgConnection, T> + 'query,
{
    let mut failure = None;
    {
        match bounded(query.load_stream::<T>(conn)).await? {
            Err(err) => failure = Some(err),
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                while let Some(item) = bounded(stream.next()).await? {
                    match item {
                        Ok(row) => {
                            if each(row)?.is_break() {
                                break;
                            }
                        }
                        Err(err) => {
                            failure = Some(err);
                            break;
                        }
                    }
                }
            }
        }
    }
    match failure {
        Some(err) => Err(classify(conn, err).await),
        None => Ok(()),
    }
}

/// Map the store's classification onto the CLI's exit codes.
pub fn store_error(err: StoreError) -> CliError {
    match err {
        StoreError::NotProvisioned { hint } => CliError::NotProvisioned(hint),
        StoreError::Unavailable(source) => {
            CliError::Unavailable(format!("database unavailable: {}", chain(source.as_ref())))
        }
        StoreError::Backend(source) => {
            CliError::Other(format!("database error: {}", chain(source.as_ref())))
        }
        other => CliError::Other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards issue 9 item 5: the CLI's own redaction cut at the first `/` or `?` and printed
    /// the rest of the password; `check_url` printed everything before `://`. The CLI now uses
    /// the library's redaction, built on the driver's parse.
    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact("postgres://app:s3cret@db.internal:5432/payments?sslmode=require"),
            "postgres://app:***@db.internal:5432/payments?sslmode=require"
        );
        assert_eq!(
            redact("postgres://postgres:se/cret@127.0.0.1:1/db"),
            "postgres://postgres:***@127.0.0.1:1/db"
        );
        assert_eq!(
            redact("postgres://postgres:pa?ss@127.0.0.1:1/db"),
            "postgres://postgres:***@127.0.0.1:1/db"
        );
        assert_eq!(
            redact("postgresql://db/payments?password=x"),
            "postgres://:***@db:5432/payments"
        );
        assert_eq!(
            redact("host=db password='se cret' user=app"),
            "postgres://app:***@db"
        );
        for bad in [
            "host=db password=HUNTER ALPHA",
            "postgres://u:HUNTER?ALPHA@db:x/y",
        ] {
            let shown = redact(bad);
            assert!(
                !shown.contains("HUNTER") && !shown.contains("ALPHA"),
                "{shown}"
            );
        }
        // A key=value string holding `://` is not a URL with a foreign scheme.
        assert!(check_url("host=db password=se://cret").is_ok());
    }

    #[test]
    fn url_scheme_is_checked() {
        assert!(matches!(check_url("mysql://x/y"), Err(CliError::Usage(_))));
        assert!(matches!(check_url("  "), Err(CliError::Usage(_))));
        assert!(check_url("postgres://x/y").is_ok());
        let Err(err) = check_url("my:secret://x") else {
            panic!("not postgres");
        };
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    fn boxed(message: &str) -> Box<dyn std::error::Error + Send + Sync> {
        message.into()
    }

    /// How each connect failure maps to an exit code, with the redacted target and never more.
    #[test]
    fn connect_errors_are_classified() {
        let target = "postgres://app:***@db:5432/payments";
        let err = connect_error(
            target,
            StoreError::NotProvisioned {
                hint: "run idem-cli migrate".into(),
            },
        );
        assert!(matches!(&err, CliError::NotProvisioned(h) if h == "run idem-cli migrate"));

        let err = connect_error(
            target,
            StoreError::Backend(boxed("invalid database URL: bad port")),
        );
        assert!(
            matches!(&err, CliError::Usage(m) if m == "invalid database URL postgres://app:***@db:5432/payments: bad port"),
            "{err:?}"
        );

        let err = connect_error(target, StoreError::Unavailable(boxed("connection refused")));
        assert!(
            matches!(&err, CliError::Unavailable(m) if m == "cannot connect to postgres://app:***@db:5432/payments: connection refused"),
            "{err:?}"
        );

        let err = connect_error(target, StoreError::Capacity(7));
        assert!(
            matches!(&err, CliError::Unavailable(m) if m.starts_with("cannot connect to postgres://app:***@db:5432/payments: ")),
            "{err:?}"
        );
    }

    /// How a failed statement maps to an exit code.
    #[test]
    fn store_errors_are_classified() {
        assert!(matches!(
            store_error(StoreError::NotProvisioned { hint: "h".into() }),
            CliError::NotProvisioned(h) if h == "h"
        ));
        assert!(matches!(
            store_error(StoreError::Unavailable(boxed("reset by peer"))),
            CliError::Unavailable(m) if m == "database unavailable: reset by peer"
        ));
        assert!(matches!(
            store_error(StoreError::Backend(boxed("syntax error"))),
            CliError::Other(m) if m == "database error: syntax error"
        ));
        let capacity = StoreError::Capacity(3);
        let shown = capacity.to_string();
        assert!(matches!(store_error(capacity), CliError::Other(m) if m == shown));
    }

    /// A server that accepts the TCP connection and never answers the startup message: the
    /// CLI gives up after its timeout with exit 3 and the redacted target, never the password.
    #[tokio::test]
    async fn a_silent_server_times_out() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let port = listener.local_addr().expect("its address").port();
        let url = format!("postgres://app:HUNTER2@127.0.0.1:{port}/payments");
        let err = match connect(&url, Duration::from_millis(300)).await {
            Err(err) => err,
            Ok(_) => panic!("a server that never answers cannot be connected to"),
        };
        assert!(matches!(&err, CliError::Unavailable(_)), "{err:?}");
        let shown = err.to_string();
        assert!(shown.contains("no answer within 0.3s"), "{shown}");
        assert!(shown.contains(&format!("127.0.0.1:{port}")), "{shown}");
        assert!(!shown.contains("HUNTER2"), "{shown}");
        drop(listener);
    }

    /// A string that is not a URL is a usage error before any connection is tried.
    #[tokio::test]
    async fn a_foreign_scheme_is_a_usage_error() {
        let err = match connect("mysql://u:p@db/x", Duration::from_secs(1)).await {
            Err(err) => err,
            Ok(_) => panic!("mysql:// is not PostgreSQL"),
        };
        assert!(matches!(err, CliError::Usage(_)), "{err:?}");
    }
}
