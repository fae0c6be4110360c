//! Aligned text tables for `list`.
//!
//! Columns are padded by *display width* (`unicode-width`), not by `char` count: a CJK
//! character or an emoji takes two terminal columns, and counting it as one misaligns every
//! column after it.

use unicode_width::UnicodeWidthStr;

/// Render rows under a header, columns padded to the widest cell. Cells are shown as given;
/// callers pass them through [`display`](super::escape::display) first.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.width()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.width());
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
                let pad = width.saturating_sub(cell.width());
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Guards issue 10 (tables misaligned on wide characters): padding counted `char`s, so a
    /// tenant of three CJK characters (six columns) pushed its row's next column three
    /// columns to the right of the header's.
    #[test]
    fn wide_characters_keep_columns_aligned() {
        let lines = table(
            &["TENANT", "KEY"],
            &[
                vec!["支払い".into(), "k1".into()],
                vec!["acme".into(), "k2".into()],
            ],
        );
        let columns: Vec<usize> = lines
            .iter()
            .map(|l| {
                let at = l.rfind(' ').map_or(0, |i| i + 1);
                l[..at].width()
            })
            .collect();
        assert_eq!(columns, vec![8, 8, 8], "{lines:#?}");
    }
}
