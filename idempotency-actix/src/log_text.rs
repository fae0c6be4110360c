//! Client-controlled text (a key, a tenant, a path) as a log field.
//!
//! The router decodes most percent-escapes of the path (`%0A` is a line feed, `%1B` an escape
//! character), a quoted key may hold spaces and `=`, and tracing's text format writes a field's
//! value as it is: such a value could forge log lines, drive the terminal of whoever reads the
//! log, or pass for another field (`key=a tenant=other`). So these fields are recorded through
//! [`LogText`]: a value made only of visible ASCII other than `"`, `=` and `\` is written as
//! it is (the common case: `key=k1`, and a plain string in JSON logs), anything else quoted
//! and escaped as Rust's `Debug` does (control and format characters as `\u{..}`).

use std::fmt;

/// A client-controlled string to record in a log field (see the module docs).
pub(crate) struct LogText<'a>(pub(crate) &'a str);

impl fmt::Display for LogText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plain = !self.0.is_empty()
            && self
                .0
                .bytes()
                .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'=' | b'\\'));
        if plain {
            f.write_str(self.0)
        } else {
            write!(f, "{:?}", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LogText;

    #[test]
    fn hostile_values_are_quoted_and_escaped_plain_ones_kept() {
        for (value, logged) in [
            ("k1", "k1"),
            ("/payments/{id}", "/payments/{id}"),
            ("", "\"\""),
            ("a b", "\"a b\""),
            ("a tenant=other", "\"a tenant=other\""),
            (
                "x\n2026-01-01 ERROR forged",
                "\"x\\n2026-01-01 ERROR forged\"",
            ),
            ("\u{1b}[2J", "\"\\u{1b}[2J\""),
            ("say \"hi\"", "\"say \\\"hi\\\"\""),
            ("back\\slash", "\"back\\\\slash\""),
            ("caf\u{e9}", "\"caf\u{e9}\""),
            ("\u{202e}gnp.exe", "\"\\u{202e}gnp.exe\""),
        ] {
            let shown = LogText(value).to_string();
            assert_eq!(shown, logged, "{value:?}");
            assert!(!shown.chars().any(char::is_control), "{shown:?}");
        }
    }
}
