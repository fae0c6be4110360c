//! The table `idempotency_keys` for diesel, and the values of its `state` column.
//!
//! This module and `migrations/` are the only places that spell out the columns and the state
//! strings: every statement (the `sql` module), the CLI's admin queries and the test helpers
//! go through them, so renaming a column is a migration plus an edit here, and the compiler
//! finds every use. Columns are documented in the first migration (`COMMENT ON COLUMN`).

use std::io::Write;

use diesel::deserialize::{self, FromSql, FromSqlRow};
use diesel::expression::AsExpression;
use diesel::pg::{Pg, PgValue};
use diesel::serialize::{self, IsNull, Output, ToSql};
use diesel::sql_types::Text;

diesel::table! {
    /// One row per idempotency key in its scope (`tenant`, `method`, `path`,
    /// `idempotency_key`). Created by `migrations/2026-11-30-000001_create_idempotency_keys`.
    idempotency_keys (tenant, method, path, idempotency_key) {
        /// Scope part 1: the tenant, empty for the global scope.
        tenant -> Text,
        /// Scope part 2: the HTTP method.
        method -> Text,
        /// Scope part 3: the request path.
        path -> Text,
        /// Scope part 4: the client's key, parsed.
        idempotency_key -> Text,
        /// SHA-256 of the request (32 bytes).
        fingerprint -> Bytea,
        /// [`State`](crate::store::postgres::schema::State).
        state -> Text,
        /// Fencing token of the current reservation.
        token -> Nullable<Uuid>,
        /// Lease deadline of an in-flight reservation.
        locked_until -> Nullable<Timestamptz>,
        /// Stored HTTP status (completed rows).
        response_status -> Nullable<SmallInt>,
        /// Stored headers, encoded by `StoredResponse::encode_headers`.
        response_headers -> Nullable<Bytea>,
        /// Stored body, byte for byte.
        response_body -> Nullable<Bytea>,
        /// When the current reservation was made.
        created_at -> Timestamptz,
        /// When the response was stored.
        completed_at -> Nullable<Timestamptz>,
        /// When the row stops mattering (lease end, or completion + TTL).
        expires_at -> Timestamptz,
    }
}

/// The `state` column: the only two values its check constraint allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, AsExpression, FromSqlRow)]
#[diesel(sql_type = Text)]
pub enum State {
    /// `in_flight`: a handler holds the reservation (token and lease set).
    InFlight,
    /// `completed`: the response is stored for replay.
    Completed,
}

impl State {
    /// The value as stored.
    pub const fn as_str(self) -> &'static str {
        match self {
            State::InFlight => "in_flight",
            State::Completed => "completed",
        }
    }

    /// The state for a stored value, `None` for anything else.
    pub fn parse(text: &str) -> Option<State> {
        [State::InFlight, State::Completed]
            .into_iter()
            .find(|s| s.as_str() == text)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ToSql<Text, Pg> for State {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        out.write_all(self.as_str().as_bytes())?;
        Ok(IsNull::No)
    }
}

impl FromSql<Text, Pg> for State {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let text = std::str::from_utf8(bytes.as_bytes())?;
        State::parse(text).ok_or_else(|| format!("unknown idempotency_keys.state {text:?}").into())
    }
}

#[cfg(test)]
mod tests {
    use super::State;

    #[test]
    fn states_round_trip_through_their_text() {
        for state in [State::InFlight, State::Completed] {
            assert_eq!(State::parse(state.as_str()), Some(state));
        }
        assert_eq!(State::parse("done"), None);
    }
}
