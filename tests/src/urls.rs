//! Connection strings: deriving a database's URL, and showing one without its password (both
//! the library's functions, so the harness has no rules of its own).

use idempotency_actix::store::postgres;

/// `url` with its database replaced by `database` (URL or `key=value` form), where the driver
/// reads it (the library's `with_dbname`), so passwords holding `/`, `?` or `#` survive.
pub fn with_database(url: &str, database: &str) -> String {
    postgres::with_dbname(url, database)
}

/// The connection string for messages, password hidden: the library's one redaction.
pub(crate) fn redact(url: &str) -> String {
    postgres::redact(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_in_urls() {
        assert_eq!(
            with_database("postgres://u:p@h:1/postgres?sslmode=require", "x"),
            "postgres://u:p@h:1/x?sslmode=require"
        );
        assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
        assert_eq!(
            with_database("postgres://u:p/w?d@h:1/postgres?sslmode=require", "x"),
            "postgres://u:p/w?d@h:1/x?sslmode=require"
        );
        assert_eq!(
            with_database("host=h user=u", "x"),
            "host=h user=u dbname='x'"
        );
    }

    /// Guards issue 9 item 5: the harness had a third redaction, with its own rules (it
    /// printed everything after the first `:` of a password holding an `@`-less `/`...).
    #[test]
    fn passwords_are_redacted() {
        for url in [
            "postgres://u:HUNTER/ALPHA@h/db",
            "postgres://u:HUNTER?ALPHA@h/db",
            "postgres://u:HUNTER#ALPHA@h/db",
            "host=h password='HUNTER ALPHA'",
            "postgres://u:HUNTER?ALPHA@h:x/db",
        ] {
            let shown = redact(url);
            assert!(
                !shown.contains("HUNTER") && !shown.contains("ALPHA"),
                "{shown}"
            );
        }
        assert_eq!(
            redact("postgres://u:secret@h/db"),
            "postgres://u:***@h:5432/db"
        );
    }
}
