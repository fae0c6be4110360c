//! `idem-cli release KEY...` (contract C20): remove stuck reservations, with guard rails.
//!
//! Releasing a reservation lets the next request with that key run the handler. That is the
//! point when the original request died, and a double execution when it is still running, so:
//! - each KEY must match exactly one record (an ambiguous key across tenants is refused: the
//!   operator names the scope rather than releasing several customers' keys at once);
//! - a reservation whose lease is still running, and a completed record, are refused without
//!   `--force` (an expired completed record too, with the reason: it changes nothing that
//!   `purge` would not);
//! - the `DELETE` names the exact record that was inspected (state and fencing token), so a
//!   record that changed in between (taken over, completed) is left alone and reported;
//! - `--token` (with `--state`) carries that fence back to the record the operator inspected
//!   with `show`: between `show` and `release --force` the stuck request may have finished
//!   (same token, now completed), or its record may have expired and been taken over by a
//!   retry that is running now, and releasing either runs the request again.

use std::io::Write;

use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::admin::{self, Record};
use serde_json::json;

use super::show::{ambiguous_key, key_scope, no_record};
use crate::cli::{Format, HeldState, ReleaseArgs};
use crate::duration::format_age_secs;
use crate::error::CliError;
use crate::output::Out;
use crate::record::RecordView;

pub async fn run(
    conn: &mut AsyncPgConnection,
    args: &ReleaseArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let mut refusals: Vec<String> = Vec::new();
    let result = release_each(conn, args, format, out, &mut refusals).await;
    finish(out, result, refusals, args.keys.len())
}

/// The end of a `release` of `asked` keys: the exit for its refusals, or its error with the
/// reasons of the keys refused before it (the operator looks at those, and runs the rest
/// again).
pub(crate) fn finish(
    out: &mut Out,
    result: Result<(), CliError>,
    refusals: Vec<String>,
    asked: usize,
) -> Result<(), CliError> {
    if let Err(error) = result {
        let _ = out.flush();
        report_refusals(&refusals);
        return Err(error);
    }
    out.flush()?;
    release_exit(refusals, asked)
}

/// Release each key in turn, recording the refused ones in `refusals`; stops at the first
/// database error.
async fn release_each(
    conn: &mut AsyncPgConnection,
    args: &ReleaseArgs,
    format: Format,
    out: &mut Out,
    refusals: &mut Vec<String>,
) -> Result<(), CliError> {
    for key in &args.keys {
        let scope = key_scope(key, &args.scope);
        let rows: Vec<Record> = sql!(conn, admin::find(conn, &scope));

        let verdict = match rows.as_slice() {
            [] => Err(no_record(key, &args.scope)),
            [row] => check(row, args).map(|()| row),
            many => Err(ambiguous_key(
                key,
                &many.iter().map(RecordView::scope_label).collect::<Vec<_>>(),
            )),
        };
        let row = match verdict {
            Ok(row) => row,
            Err(reason) => {
                refuse(out, format, key, &reason, refusals)?;
                continue;
            }
        };

        // Delete exactly what was inspected: same scope, state and token; without --force the
        // lease must still be over at the moment of deletion.
        let deleted = sql!(conn, admin::release(conn, row, args.force));
        if !deleted {
            let reason = format!(
                "{} changed while releasing (completed, taken over or purged); nothing removed",
                row.scope_label()
            );
            refuse(out, format, key, &reason, refusals)?;
            continue;
        }
        released(out, format, row)?;
    }
    Ok(())
}

/// Why this record may not be released as `args` ask (another token than `--token`, or, without
/// `--force`, a record that may still be in use), if it may not.
pub(crate) fn check(row: &Record, args: &ReleaseArgs) -> Result<(), String> {
    if let Some(token) = args.token {
        if row.token != Some(token) {
            return Err(format!(
                "{} holds token {}, not {token}: it changed since it was inspected (taken over \
                 or reserved again); nothing removed",
                row.scope_label(),
                row.token_text()
            ));
        }
        // A completion keeps its reservation's token: a record `show` printed in flight may
        // have finished since, and its response would go (review, 2026-12-06). (A completed
        // record never returns to flight with its token: a takeover writes a new one.)
        let completed_asked = args.state == Some(HeldState::Completed);
        if completed_asked && row.is_in_flight() {
            return Err(format!(
                "{} is in flight, not completed; nothing removed (--state names the state \
                 `show` printed)",
                row.scope_label()
            ));
        }
        if !completed_asked && !row.is_in_flight() {
            return Err(format!(
                "{} is {} now; nothing removed (if `show` printed it in flight, its request \
                 has finished since; if it printed it {}, add --state completed)",
                row.scope_label(),
                row.state,
                row.state
            ));
        }
    }
    if args.force {
        return Ok(());
    }
    if !row.is_in_flight() && row.is_expired() {
        return Err(format!(
            "{} is {} and {}: the next request with this key runs again whether or not it is \
             removed; `idem-cli purge` removes expired records, or use --force",
            row.scope_label(),
            row.state,
            row.expiry_words()
        ));
    }
    if !row.is_in_flight() {
        return Err(format!(
            "{} is {} ({}): removing it makes the next request with this key execute again; \
             use --force if that is intended",
            row.scope_label(),
            row.state,
            row.expiry_words()
        ));
    }
    if row.lease_unbounded() {
        return Err(format!(
            "{} is in flight with {}: the store reads it as running, and no lease will end; \
             use --force once you know its request is gone",
            row.scope_label(),
            row.expiry_words()
        ));
    }
    if row.lease_live() {
        return Err(format!(
            "{} is in flight and its {}: its request may still be running; wait for the lease \
             to end, or use --force",
            row.scope_label(),
            row.expiry_words()
        ));
    }
    Ok(())
}

/// Say that `row` was released (a JSON object with `"released": true`, or a line of text).
pub(crate) fn released(out: &mut Out, format: Format, row: &Record) -> Result<(), CliError> {
    match format {
        Format::Json => {
            let mut value = row.to_json();
            value["released"] = json!(true);
            out.json(&value)
        }
        Format::Text => out.line(format!(
            "released {} {} (token {}, created {} ago, {})",
            row.state,
            row.scope_label(),
            row.token_text(),
            format_age_secs(row.age_secs()),
            row.expiry_words()
        )),
    }
}

/// The exit of a `release` of `asked` keys: success when none was refused; one refused key of
/// one asked is that key's reason; otherwise each reason on stderr and a count.
fn release_exit(mut refusals: Vec<String>, asked: usize) -> Result<(), CliError> {
    match refusals.len() {
        0 => Ok(()),
        1 if asked == 1 => Err(CliError::NotFoundOrRefused(refusals.remove(0))),
        n => {
            report_refusals(&refusals);
            Err(CliError::NotFoundOrRefused(format!(
                "{n} of {asked} keys not released (see above)"
            )))
        }
    }
}

/// Each refusal's reason on stderr, one line each, escaped as every message is
/// (`CliError`'s `Display`): a reason names a key, which may hold what a terminal shows as
/// nothing. Best effort: the exit code still says it.
fn report_refusals(refusals: &[String]) {
    for reason in refusals {
        let line = crate::output::display(&crate::error::one_line(reason), 0);
        let _ = writeln!(std::io::stderr(), "idem-cli: {line}");
    }
}

/// Record a key that was not released: its reason (reported by [`release_exit`]) and, in JSON, an
/// object with `"released": false` at once.
pub(crate) fn refuse(
    out: &mut Out,
    format: Format,
    key: &str,
    reason: &str,
    refusals: &mut Vec<String>,
) -> Result<(), CliError> {
    if format == Format::Json {
        out.json(&json!({ "key": key, "released": false, "reason": reason }))?;
    }
    refusals.push(reason.to_owned());
    Ok(())
}

#[cfg(test)]
mod tests {
    use idempotency_actix::store::postgres::admin::{Record, State, Time};

    use super::check;
    use crate::cli::{HeldState, ReleaseArgs, ScopeArgs};

    fn record(state: State, token: uuid::Uuid) -> Record {
        let now = 1_800_000_000_000_000;
        Record {
            tenant: "t".into(),
            method: "POST".into(),
            path: "/p".into(),
            idempotency_key: "k".into(),
            fingerprint: vec![0; 32],
            state,
            token: Some(token),
            locked_until: (state == State::InFlight).then(|| Time::from_unix_micros(now + 1)),
            response_status: None,
            created_at: Time::from_unix_micros(now - 1),
            completed_at: None,
            expires_at: Time::from_unix_micros(now + 1),
            body_bytes: None,
            read_at: Time::from_unix_micros(now),
        }
    }

    fn forced(token: uuid::Uuid, state: Option<HeldState>) -> ReleaseArgs {
        ReleaseArgs {
            keys: vec!["k".into()],
            scope: ScopeArgs {
                tenant: None,
                method: None,
                path: None,
            },
            force: true,
            token: Some(token),
            state,
        }
    }

    /// `--token` with `--force` releases the record only in the state `--state` names (in
    /// flight unless told), and only with that token.
    #[test]
    fn a_token_fences_to_the_state_show_printed() {
        let t = uuid::Uuid::from_u128(1);
        let running = record(State::InFlight, t);
        let finished = record(State::Completed, t);
        let completed = Some(HeldState::Completed);
        assert_eq!(check(&running, &forced(t, None)), Ok(()));
        assert_eq!(check(&finished, &forced(t, completed)), Ok(()));
        let refused = |row, args| check(row, &args).expect_err("refused");
        assert!(refused(&finished, forced(t, None)).contains("is completed now"));
        assert!(refused(&running, forced(t, completed)).contains("is in flight, not completed"));
        let other = uuid::Uuid::from_u128(2);
        assert!(refused(&running, forced(other, None)).contains("not 00000000"));
        assert!(refused(&finished, forced(other, completed)).contains("not 00000000"));
    }
}
