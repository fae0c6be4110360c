//! Humane durations for the command line: `7d`, `36h`, `90m`, `30s`, `250ms`, `1h30m`.
//!
//! Hand-written rather than pulled from a crate: the grammar is tiny, and an operator typing a
//! retention period into a cron line deserves an error that says exactly what was wrong (a
//! missing unit, an unknown unit, an overflow) instead of a silently misread value.

use std::fmt;
use std::time::Duration;

/// A parsed duration; its `Display` is the canonical humane form (`1h30m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct HumanDuration(pub Duration);

/// The longest duration accepted: 100 years. Anything larger is a typo, and refusing it keeps
/// the value inside PostgreSQL's interval range when bound as milliseconds.
const MAX_MILLIS: u128 = 100 * 365 * 24 * 3_600_000;

const UNITS: &[(&str, u128)] = &[
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
    ("w", 7 * 86_400_000),
];

/// Parse `input` as one or more `<integer><unit>` parts (`ms`, `s`, `m`, `h`, `d`, `w`), e.g.
/// `7d`, `36h`, `1h30m`. A bare `0` is accepted (it needs no unit); any other bare number is
/// rejected because `--older-than 7` could mean seven seconds or seven days.
pub fn parse(input: &str) -> Result<HumanDuration, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("empty duration (expected e.g. 7d, 36h, 90m, 30s)".into());
    }
    if s == "0" {
        return Ok(HumanDuration(Duration::ZERO));
    }
    let mut total: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!(
                "invalid duration '{input}': expected a number at '{rest}' (e.g. 7d, 36h, 90m, 30s)"
            ));
        }
        let (number, after) = rest.split_at(digits);
        let unit_len = after
            .bytes()
            .take_while(|b| b.is_ascii_alphabetic())
            .count();
        let (unit, after) = after.split_at(unit_len);
        if unit.is_empty() {
            return Err(format!(
                "invalid duration '{input}': '{number}' has no unit (use ms, s, m, h, d or w)"
            ));
        }
        let Some(&(_, factor)) = UNITS.iter().find(|(name, _)| *name == unit) else {
            return Err(format!(
                "invalid duration '{input}': unknown unit '{unit}' (use ms, s, m, h, d or w)"
            ));
        };
        let value: u128 = number
            .parse()
            .map_err(|_| format!("invalid duration '{input}': number too large"))?;
        total = value
            .checked_mul(factor)
            .and_then(|v| total.checked_add(v))
            .filter(|v| *v <= MAX_MILLIS)
            .ok_or_else(|| format!("invalid duration '{input}': longer than 100 years"))?;
        rest = after;
    }
    // MAX_MILLIS fits in u64, so the conversion cannot fail after the check above.
    let millis = u64::try_from(total).unwrap_or(u64::MAX);
    Ok(HumanDuration(Duration::from_millis(millis)))
}

impl std::str::FromStr for HumanDuration {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s)
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut millis = self.0.as_millis();
        if millis == 0 {
            return f.write_str("0s");
        }
        for &(name, factor) in UNITS.iter().rev().filter(|(n, _)| *n != "w") {
            if millis >= factor {
                write!(f, "{}{name}", millis / factor)?;
                millis %= factor;
            }
        }
        Ok(())
    }
}

/// An elapsed time for humans and summary lines: `850ms`, `12.3s`, `4m05s`, `2h03m`.
pub fn format_elapsed(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs < 1.0 {
        format!("{}ms", d.as_millis())
    } else if secs < 60.0 {
        format!("{secs:.1}s")
    } else if secs < 3600.0 {
        let s = d.as_secs();
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let s = d.as_secs();
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    }
}

/// An age in seconds (from SQL, may be fractional or negative for "in the future") rendered
/// compactly for tables: `45s`, `12m`, `3h`, `2d`; negative ages get a `-` prefix.
pub fn format_age_secs(secs: f64) -> String {
    let sign = if secs < 0.0 { "-" } else { "" };
    let s = secs.abs();
    let body = if s < 60.0 {
        format!("{}s", s.floor())
    } else if s < 3600.0 {
        format!("{}m", (s / 60.0).floor())
    } else if s < 86_400.0 {
        format!("{}h", (s / 3600.0).floor())
    } else {
        format!("{}d", (s / 86_400.0).floor())
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> HumanDuration {
        HumanDuration(Duration::from_millis(n))
    }

    #[test]
    fn accepts_the_documented_forms() {
        assert_eq!(parse("7d"), Ok(ms(7 * 86_400_000)));
        assert_eq!(parse("36h"), Ok(ms(36 * 3_600_000)));
        assert_eq!(parse("90m"), Ok(ms(90 * 60_000)));
        assert_eq!(parse("30s"), Ok(ms(30_000)));
        assert_eq!(parse("250ms"), Ok(ms(250)));
        assert_eq!(parse("2w"), Ok(ms(14 * 86_400_000)));
        assert_eq!(parse("1h30m"), Ok(ms(90 * 60_000)));
        assert_eq!(parse(" 0 "), Ok(ms(0)));
        assert_eq!(parse("0s"), Ok(ms(0)));
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        for (input, reason) in [
            ("", "empty"),
            ("7", "no unit"),
            ("7x", "unknown unit 'x'"),
            ("d", "expected a number"),
            ("-5m", "expected a number"),
            ("1.5h", "no unit"),
            ("7 d", "no unit"),
            ("99999999999999999999999999999999999999999d", "too large"),
            ("36501d", "100 years"),
            ("7days", "unknown unit 'days'"),
        ] {
            let err = parse(input).expect_err(input);
            assert!(err.contains(reason), "{input}: {err}");
        }
    }

    #[test]
    fn display_is_canonical() {
        assert_eq!(ms(0).to_string(), "0s");
        assert_eq!(ms(90 * 60_000).to_string(), "1h30m");
        assert_eq!(ms(86_400_000 + 1).to_string(), "1d1ms");
        assert_eq!(parse("36h").map(|d| d.to_string()), Ok("1d12h".into()));
    }

    #[test]
    fn elapsed_and_age_formatting() {
        assert_eq!(format_elapsed(Duration::from_millis(850)), "850ms");
        assert_eq!(format_elapsed(Duration::from_millis(12_345)), "12.3s");
        assert_eq!(format_elapsed(Duration::from_secs(245)), "4m05s");
        assert_eq!(format_elapsed(Duration::from_secs(7380)), "2h03m");
        assert_eq!(format_age_secs(45.7), "45s");
        assert_eq!(format_age_secs(-125.0), "-2m");
        assert_eq!(format_age_secs(3.0 * 86_400.0), "3d");
    }
}
