//! Text from the database made safe for a terminal: control and format characters escaped,
//! long text cut to a display width.

use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};

/// Text from the database made safe for a terminal: control, format and other
/// default-ignorable characters (which a tenant or path could contain) are escaped so they
/// cannot move the cursor, reorder the line, hide text or forge table rows, and the result is
/// cut to `max` terminal columns with an ellipsis (0: no limit).
pub fn display(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        // U+2028/U+2029 (line and paragraph separators) are neither: some terminals and
        // viewers break lines at them.
        if c.is_control()
            || is_format(c)
            || is_default_ignorable(c)
            || matches!(c, '\u{2028}' | '\u{2029}')
        {
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

/// Unicode general category Cf (format characters, Unicode 15.1 `DerivedGeneralCategory.txt`):
/// invisible, yet they reorder what a terminal shows (bidi embeddings, overrides and isolates
/// U+202A-U+202E, U+2066-U+2069, marks U+200E, U+200F, U+061C) or hide text (zero-width
/// U+200B-U+200D, U+2060, U+FEFF, tag characters), so a tenant or path could pass for another
/// row. The standard library exposes no general category and the table is short and stable, so
/// it is listed here rather than pulled in as a dependency.
fn is_format(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{0600}'..='\u{0605}'
            | '\u{061c}'
            | '\u{06dd}'
            | '\u{070f}'
            | '\u{0890}'..='\u{0891}'
            | '\u{08e2}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{206f}'
            | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}'
            | '\u{110bd}'
            | '\u{110cd}'
            | '\u{13430}'..='\u{1343f}'
            | '\u{1bca0}'..='\u{1bca3}'
            | '\u{1d173}'..='\u{1d17a}'
            | '\u{e0001}'
            | '\u{e0020}'..='\u{e007f}'
    )
}

/// The default-ignorable code points that are not format characters (Unicode 15.1
/// `DerivedCoreProperties.txt`, Default_Ignorable_Code_Point, less category Cf): variation
/// selectors, the combining grapheme joiner, Hangul fillers and the reserved ranges. A
/// terminal shows them as nothing or as a blank, so `/items/1` and `/items/1` + U+FE0F would
/// look like one path. Listed here for the same reason as [`is_format`].
fn is_default_ignorable(c: char) -> bool {
    matches!(
        c,
        '\u{034f}'
            | '\u{115f}'..='\u{1160}'
            | '\u{17b4}'..='\u{17b5}'
            | '\u{180b}'..='\u{180d}'
            | '\u{180f}'
            | '\u{2065}'
            | '\u{3164}'
            | '\u{fe00}'..='\u{fe0f}'
            | '\u{ffa0}'
            | '\u{fff0}'..='\u{fff8}'
            | '\u{e0000}'
            | '\u{e0002}'..='\u{e001f}'
            | '\u{e0080}'..='\u{e0fff}'
    )
}

/// `text` in double quotes, as Rust's `Debug` quotes a string, with what `Debug` leaves as it
/// is escaped too: it prints invisible fillers (U+3164 and the like) raw, so a key ending in one
/// would read as a key ending in a blank.
pub fn quoted(text: &str) -> String {
    display(&format!("{text:?}"), 0)
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
    fn quoted_escapes_what_debug_leaves() {
        assert_eq!(quoted("k\u{3164}"), "\"k\\u{3164}\"");
        assert_eq!(quoted("a\"b\n"), "\"a\\\"b\\n\"");
    }

    #[test]
    fn display_escapes_control_characters_and_truncates() {
        assert_eq!(display("a\nb\u{1b}[2J", 0), "a\\nb\\u{1b}[2J");
        assert_eq!(display("abcdef", 4), "abc…");
    }

    /// Format characters (Unicode general category Cf) are invisible and can reorder what a
    /// terminal shows (bidi overrides and isolates) or hide text (zero-width ones): a tenant
    /// `acme\u{202e}...` could display as another tenant's row. They are escaped as controls are.
    #[test]
    fn display_escapes_format_characters() {
        let format_chars = [
            '\u{00ad}',
            '\u{061c}',
            '\u{200b}',
            '\u{200c}',
            '\u{200d}',
            '\u{200e}',
            '\u{200f}',
            '\u{202a}',
            '\u{202b}',
            '\u{202c}',
            '\u{202d}',
            '\u{202e}',
            '\u{2060}',
            '\u{2066}',
            '\u{2067}',
            '\u{2068}',
            '\u{2069}',
            '\u{feff}',
            '\u{fff9}',
            '\u{e0001}',
            '\u{e007f}',
        ];
        for c in format_chars {
            let shown = display(&format!("a{c}b"), 0);
            assert_eq!(shown, format!("a\\u{{{:x}}}b", u32::from(c)), "{:?}", c);
        }
        assert_eq!(display("acme\u{202e}evil", 0), "acme\\u{202e}evil");
        // Visible text, however far from ASCII, is left as it is.
        for visible in ["café", "支払い処理", "مرحبا", "😀", "a\u{301}"] {
            assert_eq!(display(visible, 0), visible);
        }
    }

    /// Default-ignorable code points that are not format characters show as nothing too (or as
    /// a blank): variation selectors, the combining grapheme joiner, the Hangul fillers. A path
    /// `/items/1` followed by U+FE0F looked like `/items/1` in `list` and in a `release`
    /// refusal (review, 2026-12-06).
    #[test]
    fn display_escapes_other_default_ignorable_characters() {
        let ignorable = [
            '\u{034f}',
            '\u{115f}',
            '\u{1160}',
            '\u{17b4}',
            '\u{180b}',
            '\u{180f}',
            '\u{2065}',
            '\u{3164}',
            '\u{fe00}',
            '\u{fe0f}',
            '\u{ffa0}',
            '\u{fff0}',
            '\u{e0000}',
            '\u{e0100}',
            '\u{e01ef}',
            '\u{e0fff}',
        ];
        for c in ignorable {
            let shown = display(&format!("a{c}b"), 0);
            assert_eq!(shown, format!("a\\u{{{:x}}}b", u32::from(c)), "{:?}", c);
        }
    }

    /// A cut counts terminal columns: four wide characters fill eight of them.
    #[test]
    fn truncation_counts_display_width() {
        let shown = display("支払い処理", 6);
        assert!(shown.width() <= 6, "{shown}");
        assert_eq!(shown, "支払…");
    }
}
