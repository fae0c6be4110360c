//! Writing results: a stdout that survives `| head`, aligned tables, and renderings of stored
//! bytes (pretty JSON without reordering keys, hex excerpts, base64).

use std::io::{self, Write};

use crate::error::CliError;

/// Buffered, locked stdout. Every write returns `io::Result`, so a closed pipe ends the command
/// quietly (exit 0) instead of panicking the way `println!` does.
pub struct Out {
    inner: io::BufWriter<io::StdoutLock<'static>>,
}

impl Out {
    pub fn new() -> Self {
        Self {
            inner: io::BufWriter::new(io::stdout().lock()),
        }
    }

    pub fn line(&mut self, text: impl AsRef<str>) -> Result<(), CliError> {
        self.inner.write_all(text.as_ref().as_bytes())?;
        self.inner.write_all(b"\n")?;
        Ok(())
    }

    /// One JSON value on one line.
    pub fn json(&mut self, value: &serde_json::Value) -> Result<(), CliError> {
        self.line(value.to_string())
    }

    pub fn flush(&mut self) -> Result<(), CliError> {
        self.inner.flush()?;
        Ok(())
    }
}

/// Render rows under a header, columns padded to the widest cell. Cells are shown as given;
/// callers pass them through [`display`] first.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let render = |cells: &mut dyn Iterator<Item = &str>| -> String {
        let mut line = String::new();
        for (i, (cell, width)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            if i + 1 < widths.len() {
                let pad = width.saturating_sub(cell.chars().count());
                line.push_str(&" ".repeat(pad));
            }
        }
        line.trim_end().to_owned()
    };
    let mut lines = vec![render(&mut header.iter().copied())];
    for row in rows {
        lines.push(render(&mut row.iter().map(String::as_str)));
    }
    lines
}

/// Text from the database made safe for a terminal: control characters (which a tenant or path
/// could contain) are escaped so they cannot move the cursor or forge table rows, and the
/// result is cut to `max` characters with an ellipsis (0: no limit).
pub fn display(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if max > 0 && out.chars().count() > max {
        let cut: String = out.chars().take(max.saturating_sub(1)).collect();
        return format!("{cut}…");
    }
    out
}

/// A tenant for people: the global scope's empty string is shown as `(global)`.
pub fn tenant_label(tenant: &str) -> String {
    if tenant.is_empty() {
        "(global)".into()
    } else {
        display(tenant, 0)
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// A classic hex dump (offset, 16 bytes in hex, printable ASCII) of at most `limit` bytes,
/// with a final line saying how much was left out.
pub fn hex_dump(bytes: &[u8], limit: usize) -> Vec<String> {
    let shown = &bytes[..bytes.len().min(limit)];
    let mut lines = Vec::new();
    for (i, chunk) in shown.chunks(16).enumerate() {
        let mut hex_part = String::new();
        for (j, b) in chunk.iter().enumerate() {
            if j == 8 {
                hex_part.push(' ');
            }
            hex_part.push_str(&hex(&[*b]));
            hex_part.push(' ');
        }
        let ascii: String = chunk
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    char::from(b)
                } else {
                    '.'
                }
            })
            .collect();
        lines.push(format!("{:08x}  {hex_part:<49} |{ascii}|", i * 16));
    }
    if bytes.len() > shown.len() {
        lines.push(format!(
            "... {} more bytes (use --format json for all of them, as base64)",
            bytes.len() - shown.len()
        ));
    }
    lines
}

/// Standard base64 with padding (RFC 4648), for exact bytes in JSON output.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 0x3f) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Pretty-print JSON text with two-space indentation, keeping the stored key order (parsing into
/// `serde_json::Value` would sort object keys and show the operator a body that was never sent).
/// Returns `None` unless `bytes` is valid JSON.
pub fn pretty_json(bytes: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).ok()?;
    let text = std::str::from_utf8(bytes).ok()?;
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut chars = text.chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&" ".repeat(depth * 2));
    };
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                // Skip whitespace to see whether the container is empty: `{}` stays on one line.
                while chars.peek().is_some_and(|n| n.is_whitespace()) {
                    chars.next();
                }
                if matches!(chars.peek(), Some('}') | Some(']')) {
                    if let Some(close) = chars.next() {
                        out.push(close);
                    }
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretty_json_keeps_key_order() {
        let out = pretty_json(br#"{"z":1, "a":{"b":[1,2,{}],"s":"x, {y}: \"q\""},"e":[]}"#);
        assert_eq!(
            out.as_deref(),
            Some(
                "{\n  \"z\": 1,\n  \"a\": {\n    \"b\": [\n      1,\n      2,\n      {}\n    ],\n    \
                 \"s\": \"x, {y}: \\\"q\\\"\"\n  },\n  \"e\": []\n}"
            )
        );
        assert_eq!(pretty_json(b"not json"), None);
        assert_eq!(pretty_json(b"42").as_deref(), Some("42"));
    }

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected);
        }
    }

    #[test]
    fn display_escapes_control_characters_and_truncates() {
        assert_eq!(display("a\nb\u{1b}[2J", 0), "a\\nb\\u{1b}[2J");
        assert_eq!(display("abcdef", 4), "abc…");
    }

    #[test]
    fn table_aligns_columns() {
        let lines = table(
            &["A", "LONGER"],
            &[
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(lines, vec!["A    LONGER", "xyz  1", "q    22"]);
    }

    #[test]
    fn hex_dump_excerpt() {
        let lines = hex_dump(&[0u8, 1, 0xff, b'A'], 3);
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("00000000  00 01 ff"));
        assert!(lines[0].ends_with("|...|"));
        assert!(lines[1].contains("1 more bytes"));
    }
}
