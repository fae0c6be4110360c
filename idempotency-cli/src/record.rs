//! One row of `idempotency_keys` as the CLI reads it, shared by list, show and release.
//!
//! Timestamps and ages are computed by PostgreSQL (`to_char`, `now() - ...`) so the CLI needs no
//! date library and every age is measured against the database clock, the same clock the store
//! uses for leases and TTLs.

use diesel::sql_types::{BigInt, Binary, Double, Nullable, SmallInt, Text};
use diesel::QueryableByName;
use serde_json::{json, Value};

use crate::duration::format_age_secs;
use crate::output::{display, tenant_label};

/// The columns of [`RecordRow`], for `SELECT {RECORD_COLUMNS} FROM idempotency_keys ...`.
pub const RECORD_COLUMNS: &str = "\
    tenant, method, path, idempotency_key, state, \
    response_status AS status, token::text AS token, \
    encode(fingerprint, 'hex') AS fingerprint_hex, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS created_at, \
    to_char(completed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS completed_at, \
    to_char(expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS expires_at, \
    to_char(locked_until AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS locked_until, \
    extract(epoch FROM now() - created_at)::float8 AS age_s, \
    extract(epoch FROM expires_at - now())::float8 AS expires_in_s, \
    extract(epoch FROM locked_until - now())::float8 AS lease_remaining_s, \
    octet_length(response_body)::int8 AS body_bytes";

/// A record without its stored response bytes.
#[derive(Debug, Clone, QueryableByName)]
pub struct RecordRow {
    #[diesel(sql_type = Text)]
    pub tenant: String,
    #[diesel(sql_type = Text)]
    pub method: String,
    #[diesel(sql_type = Text)]
    pub path: String,
    #[diesel(sql_type = Text)]
    pub idempotency_key: String,
    #[diesel(sql_type = Text)]
    pub state: String,
    #[diesel(sql_type = Nullable<SmallInt>)]
    pub status: Option<i16>,
    #[diesel(sql_type = Nullable<Text>)]
    pub token: Option<String>,
    #[diesel(sql_type = Text)]
    pub fingerprint_hex: String,
    #[diesel(sql_type = Text)]
    pub created_at: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub completed_at: Option<String>,
    #[diesel(sql_type = Text)]
    pub expires_at: String,
    #[diesel(sql_type = Nullable<Text>)]
    pub locked_until: Option<String>,
    #[diesel(sql_type = Double)]
    pub age_s: f64,
    #[diesel(sql_type = Double)]
    pub expires_in_s: f64,
    #[diesel(sql_type = Nullable<Double>)]
    pub lease_remaining_s: Option<f64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub body_bytes: Option<i64>,
}

/// A record with its stored response headers and body (for `show`).
#[derive(Debug, Clone, QueryableByName)]
pub struct DetailRow {
    #[diesel(embed)]
    pub record: RecordRow,
    #[diesel(sql_type = Nullable<Binary>)]
    pub response_headers: Option<Vec<u8>>,
    #[diesel(sql_type = Nullable<Binary>)]
    pub response_body: Option<Vec<u8>>,
}

impl RecordRow {
    pub fn is_in_flight(&self) -> bool {
        self.state == "in_flight"
    }

    pub fn is_expired(&self) -> bool {
        self.expires_in_s <= 0.0
    }

    /// For in-flight rows: whether the lease is still running (its request may be executing).
    pub fn lease_live(&self) -> bool {
        self.is_in_flight() && self.lease_remaining_s.is_some_and(|s| s > 0.0)
    }

    /// `tenant="acme" POST /payments key="k1"`: the scope, unambiguous and terminal-safe.
    pub fn scope_label(&self) -> String {
        format!(
            "tenant={} {} {} key={:?}",
            if self.tenant.is_empty() {
                "(global)".to_owned()
            } else {
                format!("{:?}", self.tenant)
            },
            display(&self.method, 0),
            display(&self.path, 0),
            self.idempotency_key
        )
    }

    /// The lease or expiry in words: "lease ends in 45s", "lease ended 3h ago", "expires in 23h",
    /// "expired 2d ago".
    pub fn expiry_words(&self) -> String {
        let (live, ended) = if self.is_in_flight() {
            ("lease ends in", "lease ended")
        } else {
            ("expires in", "expired")
        };
        if self.expires_in_s > 0.0 {
            format!("{live} {}", format_age_secs(self.expires_in_s))
        } else {
            format!("{ended} {} ago", format_age_secs(-self.expires_in_s))
        }
    }

    /// The record as JSON (one object; `list` prints one per line).
    pub fn to_json(&self) -> Value {
        json!({
            "tenant": self.tenant,
            "method": self.method,
            "path": self.path,
            "key": self.idempotency_key,
            "state": self.state,
            "expired": self.is_expired(),
            "lease_live": self.lease_live(),
            "status": self.status,
            "token": self.token,
            "fingerprint": self.fingerprint_hex,
            "created_at": self.created_at,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "locked_until": self.locked_until,
            "age_seconds": round_ms(self.age_s),
            "expires_in_seconds": round_ms(self.expires_in_s),
            "body_bytes": self.body_bytes,
        })
    }

    /// The cells of a `list` table row.
    pub fn table_cells(&self) -> Vec<String> {
        vec![
            display(&tenant_label(&self.tenant), 24),
            display(&self.method, 8),
            display(&self.path, 32),
            display(&self.idempotency_key, 40),
            self.state.clone(),
            self.status
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
            format_age_secs(self.age_s),
            if self.expires_in_s > 0.0 {
                format!("in {}", format_age_secs(self.expires_in_s))
            } else {
                format!("{} ago", format_age_secs(-self.expires_in_s))
            },
        ]
    }
}

/// The header of a `list` table, matching [`RecordRow::table_cells`].
pub const TABLE_HEADER: &[&str] = &[
    "TENANT", "METHOD", "PATH", "KEY", "STATE", "STATUS", "AGE", "EXPIRES",
];

/// Seconds rounded to milliseconds: JSON consumers get stable, readable numbers.
pub fn round_ms(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}
