//! `idem-cli show KEY` (contract C20): the whole record and its stored response.

use diesel::sql_types::{Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use base64::prelude::{Engine as _, BASE64_STANDARD};
use idempotency_actix::store::StoredResponse;
use serde_json::{json, Value};

use crate::cli::{Format, ScopeArgs, ShowArgs};
use crate::duration::format_age_secs;
use crate::error::CliError;
use crate::output::hex::{hex, hex_dump};
use crate::output::json::pretty_json;
use crate::output::{display, tenant_label, Out};
use crate::record::{DetailRow, RECORD_COLUMNS};

/// How much of a binary body the text output shows.
const HEX_EXCERPT: usize = 256;
/// How much of a text body the text output shows before cutting.
const TEXT_EXCERPT: usize = 64 * 1024;

/// `WHERE` clause selecting a key in an optional scope: `$1` key, `$2` tenant, `$3` method,
/// `$4` path (NULL = any). Shared with `release`.
pub const SCOPE_WHERE: &str = "\
    idempotency_key = $1 \
    AND ($2::text IS NULL OR tenant = $2::text) \
    AND ($3::text IS NULL OR method = $3::text) \
    AND ($4::text IS NULL OR path = $4::text)";

/// The method as stored: the middleware stores it upper case.
pub fn method(scope: &ScopeArgs) -> Option<String> {
    scope.method.as_ref().map(|m| m.to_ascii_uppercase())
}

pub async fn run(
    conn: &mut AsyncPgConnection,
    args: &ShowArgs,
    format: Format,
    out: &mut Out,
) -> Result<(), CliError> {
    let query = diesel::sql_query(format!(
        "SELECT {RECORD_COLUMNS}, response_headers, response_body FROM idempotency_keys \
         WHERE {SCOPE_WHERE} ORDER BY tenant, method, path"
    ))
    .bind::<Text, _>(args.key.clone())
    .bind::<Nullable<Text>, _>(args.scope.tenant.clone())
    .bind::<Nullable<Text>, _>(method(&args.scope))
    .bind::<Nullable<Text>, _>(args.scope.path.clone());
    let rows: Vec<DetailRow> = sql!(conn, query.load(conn));
    if rows.is_empty() {
        return Err(CliError::NotFoundOrRefused(format!(
            "no record with key {:?}{}",
            args.key,
            scope_words(&args.scope)
        )));
    }
    for (i, row) in rows.iter().enumerate() {
        match format {
            Format::Json => out.json(&detail_json(row))?,
            Format::Text => {
                if i > 0 {
                    out.line("")?;
                }
                for line in detail_text(row) {
                    out.line(line)?;
                }
            }
        }
    }
    out.flush()
}

/// " in tenant \"acme\" POST /x" for messages; empty when no scope was given.
pub fn scope_words(scope: &ScopeArgs) -> String {
    let mut s = String::new();
    if let Some(t) = &scope.tenant {
        s.push_str(&format!(" in tenant {t:?}"));
    }
    if let Some(m) = method(scope) {
        s.push_str(&format!(" method {m}"));
    }
    if let Some(p) = &scope.path {
        s.push_str(&format!(" path {p:?}"));
    }
    s
}

fn decode_headers(row: &DetailRow) -> Result<Vec<(String, Vec<u8>)>, String> {
    match &row.response_headers {
        None => Ok(Vec::new()),
        Some(raw) => StoredResponse::decode_headers(raw)
            .map(|h| h.into_iter().map(|(n, v)| (n, v.to_vec())).collect())
            .map_err(|e| e.to_string()),
    }
}

pub(crate) fn detail_json(row: &DetailRow) -> Value {
    let mut value = row.record.to_json();
    if row.record.state == "completed" {
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
        let body_json = serde_json::from_slice::<Value>(body).ok();
        let body_text = match &body_json {
            Some(_) => None,
            None => std::str::from_utf8(body).ok(),
        };
        value["response"] = json!({
            "status": row.record.status,
            "headers": headers,
            "body_bytes": body.len(),
            "body_base64": BASE64_STANDARD.encode(body),
            "body_json": body_json,
            "body_text": body_text,
        });
    }
    value
}

pub(crate) fn detail_text(row: &DetailRow) -> Vec<String> {
    let r = &row.record;
    let mut lines = vec![
        format!("key          {:?}", r.idempotency_key),
        format!("tenant       {}", tenant_label(&r.tenant)),
        format!("method       {}", display(&r.method, 0)),
        format!("path         {}", display(&r.path, 0)),
        format!("state        {}", r.state),
        format!("fingerprint  {}", r.fingerprint_hex),
        format!("token        {}", r.token.as_deref().unwrap_or("-")),
        format!(
            "created_at   {} ({} ago)",
            r.created_at,
            format_age_secs(r.age_s)
        ),
    ];
    if let Some(completed) = &r.completed_at {
        lines.push(format!("completed_at {completed}"));
    }
    if r.is_in_flight() {
        if let Some(until) = &r.locked_until {
            lines.push(format!("lease        until {until} ({})", r.expiry_words()));
        }
    } else {
        lines.push(format!(
            "expires_at   {} ({})",
            r.expires_at,
            r.expiry_words()
        ));
    }
    if r.state != "completed" {
        lines.push("response     none yet (the request is running, or its holder died)".into());
        return lines;
    }
    lines.push(format!(
        "status       {}",
        r.status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "-".into())
    ));
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
    if let Some(pretty) = pretty_json(body) {
        lines.extend(pretty.lines().map(|l| format!("  {}", display(l, 0))));
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
