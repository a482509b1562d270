//! RFC 3339 timestamps as the API server writes them (`2026-11-30T09:20:00Z`, optionally with
//! fractional seconds or a numeric offset), parsed into [`SystemTime`] without a date library.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`; `None` if it is anything else.
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        t.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| t.parse().ok())?
    };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, min, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut nanos = 0u32;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 {
            return None;
        }
        let mut n: u64 = 0;
        for (i, c) in frac[..digits].bytes().enumerate() {
            if i < 9 {
                n = n * 10 + u64::from(c - b'0');
            }
        }
        for _ in digits..9 {
            n *= 10;
        }
        nanos = u32::try_from(n).ok()?;
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let ob = rest.as_bytes();
            if ob.len() != 6 || ob[3] != b':' || !matches!(ob[0], b'+' | b'-') {
                return None;
            }
            let h: i64 = rest[1..3].parse().ok()?;
            let m: i64 = rest[4..6].parse().ok()?;
            let o = h * 3600 + m * 60;
            if ob[0] == b'-' {
                -o
            } else {
                o
            }
        }
    };
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + min * 60 + sec - offset;
    let secs = u64::try_from(secs).ok()?;
    Some(UNIX_EPOCH + Duration::new(secs, nanos))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: &str) -> u64 {
        parse_rfc3339(s)
            .unwrap()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    #[test]
    fn known_instants() {
        assert_eq!(secs("1970-01-01T00:00:00Z"), 0);
        assert_eq!(secs("2000-03-01T00:00:00Z"), 951_868_800);
        assert_eq!(secs("2026-11-30T09:20:00Z"), 1_796_030_400);
        assert_eq!(secs("2026-11-30T10:20:00+01:00"), 1_796_030_400);
        assert_eq!(secs("2026-11-30T09:20:00.999999999Z"), 1_796_030_400);
    }

    #[test]
    fn garbage_is_none() {
        for s in [
            "",
            "2026-11-30",
            "2026-13-01T00:00:00Z",
            "2026-11-30T09:20:00",
            "x026-11-30T09:20:00Z",
        ] {
            assert!(parse_rfc3339(s).is_none(), "{s}");
        }
    }
}
