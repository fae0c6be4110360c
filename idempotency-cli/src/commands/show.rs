//! `idem-cli show KEY` (contract C20): the whole record and its stored response.

use base64::prelude::{Engine as _, BASE64_STANDARD};
use std::ops::ControlFlow;

use diesel_async::AsyncPgConnection;
use idempotency_actix::store::postgres::admin::{self, Detail, KeyScope, State};
use idempotency_actix::store::StoredResponse;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::cli::{Format, ScopeArgs, ShowArgs};
use crate::duration::format_age_secs;
use crate::error::CliError;
use crate::output::hex::{hex, hex_dump};
use crate::output::json::{compact_json, pretty_json};
use crate::output::{display, quoted, tenant_label, Out};
use crate::record::{timestamp, RecordView};

/// How much of a binary body the text output shows.
const HEX_EXCERPT: usize = 256;
/// How much of a text body the text output shows before cutting.
const TEXT_EXCERPT: usize = 64 * 1024;

/// The method as stored: the middleware stores it upper case.
pub fn method(scope: &ScopeArgs) -> Option<String> {
    scope.method.as_ref().map(|m| m.to_ascii_uppercase())
}

/// `key` in the scope the arguments name.
pub fn key_scope(key: &str, scope: &ScopeArgs) -> KeyScope {
    KeyScope {
        key: key.to_owned(),
        tenant: scope.tenant.clone(),
        method: method(scope),
        path: scope.path.clone(),
    }
}

pub async fn run(
    conn: &mut AsyncPgConnection,
    args: &ShowArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let scope = key_scope(&args.key, &args.scope);
    // Streamed, as `list` streams: a bare key can name a record in every tenant, each with a
    // response of up to the middleware's `max_response_bytes`, and only the one being printed
    // is held in memory.
    let mut shown = 0usize;
    let query = admin::find_detail_query(&scope);
    crate::db::for_each_row(conn, query, |row: Detail| {
        match format {
            Format::Json => out.json(&detail_json(&row))?,
            Format::Text => {
                if shown > 0 {
                    out.line("")?;
                }
                for line in detail_text(&row) {
                    out.line(line)?;
                }
            }
        }
        shown += 1;
        Ok(ControlFlow::Continue(()))
    })
    .await?;
    if shown == 0 {
        return Err(CliError::NotFoundOrRefused(no_record(
            &args.key,
            &args.scope,
        )));
    }
    out.flush()
}

/// "no record with key \"k1\" in tenant \"acme\"": `show`'s and `release`'s refusal.
pub fn no_record(key: &str, scope: &ScopeArgs) -> String {
    format!("no record with key {}{}", quoted(key), scope_words(scope))
}

/// A key that names several records: `release` refuses to pick one; `labels` are their scopes.
pub fn ambiguous_key(key: &str, labels: &[String]) -> String {
    format!(
        "key {} matches {} records ({}); name one with --tenant/--method/--path",
        quoted(key),
        labels.len(),
        labels.join("; ")
    )
}

/// " in tenant \"acme\" POST /x" for messages; empty when no scope was given.
pub fn scope_words(scope: &ScopeArgs) -> String {
    let mut s = String::new();
    if let Some(t) = &scope.tenant {
        s.push_str(&format!(" in tenant {}", quoted(t)));
    }
    if let Some(m) = method(scope) {
        s.push_str(&format!(
            " method {}",
            crate::output::escape::display(&m, 0)
        ));
    }
    if let Some(p) = &scope.path {
        s.push_str(&format!(" path {}", quoted(p)));
    }
    s
}

fn decode_headers(row: &Detail) -> Result<Vec<(String, Vec<u8>)>, String> {
    match &row.response_headers {
        None => Ok(Vec::new()),
        Some(raw) => StoredResponse::decode_headers(raw)
            .map(|h| h.into_iter().map(|(n, v)| (n, v.to_vec())).collect())
            .map_err(|e| e.to_string()),
    }
}

/// `show --format json`: the record's fields and, once completed, its response.
#[derive(Serialize)]
pub(crate) struct DetailJson {
    #[serde(flatten)]
    record: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<ResponseJson>,
    /// A completed record whose response is gone (see [`response_gone`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    response_gone: bool,
}

/// What `show` says of a completed record without a stored response.
const RESPONSE_GONE: &str = "gone: the record expired and `purge` dropped the partition that \
                             held its response; the record itself goes at the next purge";

/// A completed record whose response is not there: in the partitioned layout the response
/// lives in a partition of its own table, which `purge` drops once every response in it has
/// expired, before it deletes the expired records (the plain layout keeps both in one row).
/// Shown as an empty body, it would read as a handler that answered nothing.
fn response_gone(row: &Detail) -> bool {
    row.record.state == State::Completed
        && row.response_headers.is_none()
        && row.response_body.is_none()
}

/// The stored response. `body_json` is the stored body itself when it is JSON: its tokens (key
/// order, duplicate keys, numbers of any size) exactly as stored, only the whitespace between
/// them removed so the output stays one line. Never a re-encoding of a parsed value.
#[derive(Serialize)]
struct ResponseJson {
    status: Option<i16>,
    headers: Value,
    body_bytes: usize,
    body_base64: String,
    body_json: Option<Box<RawValue>>,
    body_text: Option<String>,
}

pub(crate) fn detail_json(row: &Detail) -> DetailJson {
    let record = row.record.to_json();
    if row.record.state != State::Completed || response_gone(row) {
        return DetailJson {
            record,
            response: None,
            response_gone: response_gone(row),
        };
    }
    let headers = match decode_headers(row) {
        Ok(headers) => Value::Array(
            headers
                .iter()
                .map(|(name, v)| match std::str::from_utf8(v) {
                    Ok(text) => json!({ "name": name, "value": text }),
                    Err(_) => json!({ "name": name, "value_base64": BASE64_STANDARD.encode(v) }),
                })
                .collect(),
        ),
        Err(e) => json!({ "error": e }),
    };
    let body = row.response_body.as_deref().unwrap_or_default();
    let body_json = compact_json(body).and_then(|text| RawValue::from_string(text).ok());
    let body_text = match &body_json {
        Some(_) => None,
        None => std::str::from_utf8(body).ok().map(str::to_owned),
    };
    DetailJson {
        record,
        response: Some(ResponseJson {
            status: row.record.response_status,
            headers,
            body_bytes: body.len(),
            body_base64: BASE64_STANDARD.encode(body),
            body_json,
            body_text,
        }),
        response_gone: false,
    }
}

pub(crate) fn detail_text(row: &Detail) -> Vec<String> {
    let r = &row.record;
    let mut lines = vec![
        format!("key          {}", quoted(&r.idempotency_key)),
        format!("tenant       {}", tenant_label(&r.tenant)),
        format!("method       {}", display(&r.method, 0)),
        format!("path         {}", display(&r.path, 0)),
        format!("state        {}", r.state),
        format!("fingerprint  {}", hex(&r.fingerprint)),
        format!("token        {}", r.token_text()),
        format!(
            "created_at   {} ({} ago)",
            timestamp(r.created_at),
            format_age_secs(r.age_secs())
        ),
    ];
    if let Some(completed) = r.completed_at {
        lines.push(format!("completed_at {}", timestamp(completed)));
    }
    if r.is_in_flight() {
        match r.locked_until {
            Some(until) => lines.push(format!(
                "lease        until {} ({})",
                timestamp(until),
                r.expiry_words()
            )),
            None => lines.push(format!(
                "lease        {} (read as not ended; `release --force` frees it once its \
                 request is gone)",
                r.expiry_words()
            )),
        }
    } else {
        lines.push(format!(
            "expires_at   {} ({})",
            timestamp(r.expires_at),
            r.expiry_words()
        ));
    }
    if r.state != State::Completed {
        lines.push("response     none yet (the request is running, or its holder died)".into());
        return lines;
    }
    lines.push(format!(
        "status       {}",
        r.response_status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "-".into())
    ));
    if response_gone(row) {
        lines.push(format!("response     {RESPONSE_GONE}"));
        return lines;
    }
    let headers = decode_headers(row);
    let mut content_type = None;
    match headers {
        Err(e) => lines.push(format!("headers      unreadable: {e}")),
        Ok(headers) if headers.is_empty() => lines.push("headers      none".into()),
        Ok(headers) => {
            lines.push("headers".into());
            for (name, value) in headers {
                let shown = match std::str::from_utf8(&value) {
                    Ok(text) => display(text, 0),
                    Err(_) => format!("(binary) 0x{}", hex(&value)),
                };
                if name.eq_ignore_ascii_case("content-type") {
                    content_type = Some(shown.clone());
                }
                lines.push(format!("  {}: {shown}", display(&name, 0)));
            }
        }
    }
    let body = row.response_body.as_deref().unwrap_or_default();
    let kind = content_type.unwrap_or_else(|| "no content-type".into());
    lines.push(format!("body         {} bytes ({kind})", body.len()));
    if body.is_empty() {
        return lines;
    }
    if let Some((pretty, cut)) = pretty_json(body, TEXT_EXCERPT) {
        lines.extend(pretty.lines().map(|l| format!("  {}", display(l, 0))));
        if cut {
            lines.push(format!(
                "  ... cut after {} KiB of output (use --format json for the whole body)",
                TEXT_EXCERPT / 1024
            ));
        }
    } else if let Ok(text) = std::str::from_utf8(body) {
        let shown: String = text.chars().take(TEXT_EXCERPT).collect();
        lines.extend(shown.lines().map(|l| format!("  {}", display(l, 0))));
        if shown.len() < text.len() {
            lines.push(format!(
                "  ... {} more bytes (use --format json for all of them)",
                text.len() - shown.len()
            ));
        }
    } else {
        lines.push("  binary; hex excerpt:".into());
        lines.extend(
            hex_dump(body, HEX_EXCERPT)
                .into_iter()
                .map(|l| format!("  {l}")),
        );
    }
    lines
}

#[cfg(test)]
mod tests {
    use idempotency_actix::store::postgres::admin::{Record, Time};

    use super::*;

    fn completed(body: &[u8]) -> Detail {
        let t = Time::from_unix_micros(1_800_000_000_000_000);
        Detail {
            record: Record {
                tenant: String::new(),
                method: "POST".into(),
                path: "/p".into(),
                idempotency_key: "k".into(),
                fingerprint: vec![0xab; 32],
                state: State::Completed,
                token: None,
                locked_until: None,
                response_status: Some(201),
                created_at: t,
                completed_at: Some(t),
                expires_at: t,
                body_bytes: i32::try_from(body.len()).ok(),
                read_at: t,
            },
            response_headers: None,
            response_body: Some(body.to_vec()),
        }
    }

    /// Guards issue 10 (`show`'s `body_json`): the body was parsed into a `serde_json::Value`
    /// and re-encoded, which sorted its keys, dropped a duplicate key and rounded a large
    /// number, so the operator saw a body that was never sent.
    #[test]
    fn body_json_is_the_stored_body() {
        let stored = br#"{"z": 1, "a": [true, null], "dup": 1, "dup": 2, "n": 123456789012345678901234567890}"#;
        let shown = serde_json::to_string(&detail_json(&completed(stored))).unwrap();
        assert!(
            shown.contains(
                r#""body_json":{"z":1,"a":[true,null],"dup":1,"dup":2,"n":123456789012345678901234567890}"#
            ),
            "{shown}"
        );
        assert!(!shown.contains('\n'));
    }

    /// A completed record whose response partition was dropped said `body 0 bytes`, as if
    /// the handler had answered nothing.
    #[test]
    fn a_response_dropped_with_its_partition_is_not_shown_as_an_empty_body() {
        let mut row = completed(b"");
        row.response_body = None;
        let text = detail_text(&row).join("\n");
        assert!(text.contains("response     gone"), "{text}");
        assert!(!text.contains("body "), "{text}");
        let json = serde_json::to_value(detail_json(&row)).unwrap();
        assert_eq!(json["response_gone"], true);
        assert_eq!(json["response"], Value::Null);
        assert_eq!(json["state"], "completed");

        let kept = serde_json::to_value(detail_json(&completed(b"{}"))).unwrap();
        assert_eq!(kept.get("response_gone"), None);
        assert!(detail_text(&completed(b""))
            .join("\n")
            .contains("body         0 bytes"));
    }

    #[test]
    fn a_body_that_is_not_json_is_text() {
        let shown = serde_json::to_value(detail_json(&completed(b"plain {"))).unwrap();
        assert_eq!(shown["response"]["body_json"], Value::Null);
        assert_eq!(shown["response"]["body_text"], "plain {");
        assert_eq!(shown["response"]["status"], 201);
        assert_eq!(shown["state"], "completed");
    }
}
