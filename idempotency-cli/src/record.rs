//! How the CLI shows a record: the library's one row type,
//! [`admin::Record`](idempotency_actix::store::postgres::admin::Record), read from PostgreSQL
//! or built from a Redis hash, rendered as words, table cells and JSON.
//!
//! Ages and expiries are measured against the clock of the store that was read (the row's
//! `read_at`), the same clock the store uses for leases and TTLs.

use idempotency_actix::store::postgres::admin::{Record, Time};
use serde_json::{json, Value};

use crate::duration::format_age_secs;
use crate::output::hex::hex;
use crate::output::{display, quoted, tenant_label};

/// A timestamp as `2026-11-30T12:00:00.123Z` (UTC, milliseconds).
pub fn timestamp(t: Time) -> String {
    humantime::format_rfc3339_millis(printable(t)).to_string()
}

/// A timestamp as `2026-11-30T12:00:00Z` (UTC, seconds).
pub fn timestamp_secs(t: Time) -> String {
    humantime::format_rfc3339_seconds(printable(t)).to_string()
}

/// `t` within what RFC 3339 formatting can print (humantime panics outside it): from the Unix
/// epoch to the end of year 9999. PostgreSQL holds wider values (a partition attached by hand).
fn printable(t: Time) -> std::time::SystemTime {
    // 10000-01-01T00:00:00Z, less a second.
    const LAST: std::time::Duration = std::time::Duration::from_secs(253_402_300_799);
    let epoch = std::time::SystemTime::UNIX_EPOCH;
    t.0.clamp(epoch, epoch + LAST)
}

/// The CLI's renderings of a [`Record`].
pub trait RecordView {
    /// Whether `expires_at` has passed.
    fn is_expired(&self) -> bool;
    /// For in-flight rows: whether the lease is still running (its request may be executing).
    fn lease_live(&self) -> bool;
    /// An in-flight record whose lease has no known end: a Redis key without an expiry
    /// (`PERSIST`, `RESTORE key 0`), which the store reads as not ended. (PostgreSQL's in-flight
    /// rows always have one.)
    fn lease_unbounded(&self) -> bool;
    /// A completed record that never expires: a Redis key without an expiry, which the store
    /// replays for as long as it lives, or a PostgreSQL row expiring at `infinity`.
    fn never_expires(&self) -> bool;
    /// Whether an end is known, of the lease or of the record: what `expires_at` shows.
    fn has_expiry(&self) -> bool {
        !self.lease_unbounded() && !self.never_expires()
    }
    /// `tenant="acme" POST /payments key="k1"`: the scope, unambiguous and terminal-safe.
    fn scope_label(&self) -> String;
    /// The lease or expiry in words: "lease ends in 45s", "expired 2d ago".
    fn expiry_words(&self) -> String;
    /// The token as text, `-` when there is none.
    fn token_text(&self) -> String;
    /// The record as JSON (one object; `list` prints one per line).
    fn to_json(&self) -> Value;
    /// The cells of a `list` table row.
    fn table_cells(&self) -> Vec<String>;
}

impl RecordView for Record {
    fn is_expired(&self) -> bool {
        !self.lease_unbounded() && self.expires_in_secs() <= 0.0
    }

    fn lease_live(&self) -> bool {
        self.is_in_flight() && self.lease_remaining_secs().is_none_or(|s| s > 0.0)
    }

    fn lease_unbounded(&self) -> bool {
        self.is_in_flight() && self.locked_until.is_none()
    }

    fn never_expires(&self) -> bool {
        !self.is_in_flight() && self.expires_at == Time::from_unix_micros(i64::MAX)
    }

    fn scope_label(&self) -> String {
        format!(
            "tenant={} {} {} key={}",
            if self.tenant.is_empty() {
                "(global)".to_owned()
            } else {
                quoted(&self.tenant)
            },
            display(&self.method, 0),
            display(&self.path, 0),
            quoted(&self.idempotency_key)
        )
    }

    fn expiry_words(&self) -> String {
        if self.lease_unbounded() {
            // Not "ends in ...": no lease will end while the key has no expiry (review,
            // 2026-12-06: the lease as reserved was shown, ending "in 1m" on every run).
            return "no lease end: its key has no expiry".into();
        }
        if self.never_expires() {
            return "never expires: no expiry is set".into();
        }
        let (live, ended) = if self.is_in_flight() {
            ("lease ends in", "lease ended")
        } else {
            ("expires in", "expired")
        };
        let left = self.expires_in_secs();
        if left > 0.0 {
            format!("{live} {}", format_age_secs(left))
        } else {
            format!("{ended} {} ago", format_age_secs(-left))
        }
    }

    fn token_text(&self) -> String {
        self.token.map_or_else(|| "-".to_owned(), |t| t.to_string())
    }

    fn to_json(&self) -> Value {
        json!({
            "tenant": self.tenant,
            "method": self.method,
            "path": self.path,
            "key": self.idempotency_key,
            "state": self.state.as_str(),
            "expired": self.is_expired(),
            "lease_live": self.lease_live(),
            "status": self.response_status,
            "token": self.token.map(|t| t.to_string()),
            "fingerprint": hex(&self.fingerprint),
            "created_at": timestamp(self.created_at),
            "completed_at": self.completed_at.map(timestamp),
            "expires_at": self.has_expiry().then(|| timestamp(self.expires_at)),
            "locked_until": self.locked_until.map(timestamp),
            "age_seconds": round_ms(self.age_secs()),
            "expires_in_seconds": self.has_expiry().then(|| round_ms(self.expires_in_secs())),
            "body_bytes": self.body_bytes,
        })
    }

    fn table_cells(&self) -> Vec<String> {
        let left = self.expires_in_secs();
        vec![
            display(&tenant_label(&self.tenant), 24),
            display(&self.method, 8),
            display(&self.path, 32),
            display(&self.idempotency_key, 40),
            self.state.to_string(),
            self.response_status
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
            format_age_secs(self.age_secs()),
            if !self.has_expiry() {
                "never".into()
            } else if left > 0.0 {
                format!("in {}", format_age_secs(left))
            } else {
                format!("{} ago", format_age_secs(-left))
            },
        ]
    }
}

/// The header of a `list` table, matching [`RecordView::table_cells`].
pub const TABLE_HEADER: &[&str] = &[
    "TENANT", "METHOD", "PATH", "KEY", "STATE", "STATUS", "AGE", "EXPIRES",
];

/// Seconds rounded to milliseconds: JSON consumers get stable, readable numbers.
pub fn round_ms(secs: f64) -> f64 {
    (secs * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::{timestamp, timestamp_secs, Time};

    /// PostgreSQL holds times RFC 3339 formatting cannot print (before 1970, after 9999): shown
    /// at the nearest printable one instead of a panic.
    #[test]
    fn times_outside_rfc3339_are_printed_at_its_bounds() {
        let epoch = SystemTime::UNIX_EPOCH;
        let before = Time(epoch - Duration::from_secs(86_400));
        let after = Time(epoch + Duration::from_secs(400_000_000_000));
        assert_eq!(timestamp_secs(before), "1970-01-01T00:00:00Z");
        assert_eq!(timestamp(before), "1970-01-01T00:00:00.000Z");
        assert_eq!(timestamp_secs(after), "9999-12-31T23:59:59Z");
        assert_eq!(
            timestamp_secs(Time(epoch + Duration::from_secs(86_400))),
            "1970-01-02T00:00:00Z"
        );
    }
}
