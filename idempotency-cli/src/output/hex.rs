//! Hex, the CLI's one helper for it: fingerprints, binary header values and hex dumps of
//! binary bodies.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lower_case() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
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
