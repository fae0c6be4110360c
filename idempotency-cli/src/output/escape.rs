//! Text from the database made safe for a terminal: control characters escaped, long text cut
//! to a display width.

use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};

/// Text from the database made safe for a terminal: control characters (which a tenant or path
/// could contain) are escaped so they cannot move the cursor or forge table rows, and the
/// result is cut to `max` terminal columns with an ellipsis (0: no limit).
pub fn display(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if max > 0 && out.width() > max {
        // Room for the ellipsis (one column); a wide character that would overflow is left out.
        let mut cut = String::new();
        let mut width = 0;
        for c in out.chars() {
            let w = c.width().unwrap_or(0);
            if width + w > max.saturating_sub(1) {
                break;
            }
            width += w;
            cut.push(c);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_escapes_control_characters_and_truncates() {
        assert_eq!(display("a\nb\u{1b}[2J", 0), "a\\nb\\u{1b}[2J");
        assert_eq!(display("abcdef", 4), "abc…");
    }

    /// A cut counts terminal columns: four wide characters fill eight of them.
    #[test]
    fn truncation_counts_display_width() {
        let shown = display("支払い処理", 6);
        assert!(shown.width() <= 6, "{shown}");
        assert_eq!(shown, "支払…");
    }
}
