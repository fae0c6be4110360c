//! Re-indenting a stored JSON body for `show`: pretty for the text output, compact (one line)
//! for `--format json`.
//!
//! Home-made on purpose: serde_json's pretty printer re-encodes a parsed value, which reorders
//! keys, drops duplicates and rounds large numbers, so the operator would see a body that was
//! never sent. This only re-indents the stored text (after serde_json checked that it is JSON);
//! every token is copied as stored.

/// Pretty-print JSON text with two-space indentation, keeping the stored tokens and key order,
/// cut after about `limit` bytes of output (`true` when cut: indentation grows with the
/// nesting, so a deep body of a few MB would print gigabytes). Returns `None` unless `bytes` is
/// valid JSON.
pub fn pretty_json(bytes: &[u8], limit: usize) -> Option<(String, bool)> {
    reformat(bytes, true, limit)
}

/// JSON text on one line: the whitespace between tokens removed, every token (key order,
/// duplicate keys, numbers of any size) as stored. Returns `None` unless `bytes` is valid JSON.
pub fn compact_json(bytes: &[u8]) -> Option<String> {
    reformat(bytes, false, usize::MAX).map(|(text, _)| text)
}

fn reformat(bytes: &[u8], pretty: bool, limit: usize) -> Option<(String, bool)> {
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).ok()?;
    let text = std::str::from_utf8(bytes).ok()?;
    let wanted = if pretty { text.len() * 2 } else { text.len() };
    let mut out = String::with_capacity(wanted.min(limit.saturating_add(1)));
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut chars = text.chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        if pretty {
            out.push('\n');
            out.push_str(&" ".repeat(depth * 2));
        }
    };
    while let Some(c) = chars.next() {
        if out.len() > limit {
            let mut end = limit;
            while !out.is_char_boundary(end) {
                end -= 1;
            }
            out.truncate(end);
            return Some((out, true));
        }
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
            ':' if pretty => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    Some((out, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pretty_json_keeps_key_order() {
        let out = pretty_json(
            br#"{"z":1, "a":{"b":[1,2,{}],"s":"x, {y}: \"q\""},"e":[]}"#,
            1000,
        );
        assert_eq!(
            out.as_ref().map(|(text, cut)| (text.as_str(), *cut)),
            Some((
                "{\n  \"z\": 1,\n  \"a\": {\n    \"b\": [\n      1,\n      2,\n      {}\n    ],\n    \
                 \"s\": \"x, {y}: \\\"q\\\"\"\n  },\n  \"e\": []\n}",
                false
            ))
        );
        assert_eq!(pretty_json(b"not json", 1000), None);
        assert_eq!(pretty_json(b"42", 1000), Some(("42".into(), false)));
    }

    /// Indentation grows with the nesting: the output is cut, not the size of the body times
    /// its depth.
    #[test]
    fn pretty_json_is_cut_at_its_limit() {
        let deep = format!(
            "{}{}{}",
            "[".repeat(100),
            "1,".repeat(10_000) + "1",
            "]".repeat(100)
        );
        let (text, cut) = pretty_json(deep.as_bytes(), 4096).expect("valid JSON");
        assert!(cut);
        assert!(text.len() <= 4096, "{}", text.len());
        let (whole, cut) = pretty_json(deep.as_bytes(), usize::MAX).expect("valid JSON");
        assert!(!cut && whole.len() > 1_000_000, "{}", whole.len());
    }

    #[test]
    fn compact_json_keeps_every_token() {
        assert_eq!(
            compact_json(b" {\"b\" : [1 , 2.50e3],\n \"a\": \"x y\" , \"a\": {} } ").as_deref(),
            Some(r#"{"b":[1,2.50e3],"a":"x y","a":{}}"#)
        );
        assert_eq!(compact_json(b"{"), None);
    }
}
