//! Byte sizes on the command line: `20GiB`, `512MiB`, `4M`, `1000000`, and the memory budget's
//! `SIZE | PCT%` (a share of the container's memory limit).

/// Parses `N[unit]`: no unit = bytes; `K`/`KiB`/`KB`, `M`/`MiB`/`MB`, `G`/`GiB`/`GB`, `T`/`TiB`/`TB`
/// (all binary: `1G` = `1GiB` = 2^30), case-insensitive, optional space before the unit.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 20GiB, 512MiB, 4096)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => {
            return Err(format!(
                "{s:?}: unknown size unit {other:?} (use KiB, MiB, GiB or TiB)"
            ))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// A memory budget as given: bytes, or a percentage of the container's memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSpec {
    Bytes(u64),
    Percent(u8),
}

pub fn parse_budget(s: &str) -> Result<BudgetSpec, String> {
    match s.trim().strip_suffix('%') {
        Some(p) => match p.trim().parse::<u8>() {
            Ok(p) if (1..=100).contains(&p) => Ok(BudgetSpec::Percent(p)),
            _ => Err(format!("{s:?}: a percentage must be 1% to 100%")),
        },
        None => match parse_size(s)? {
            0 => Err(format!("{s:?}: the memory budget must not be 0")),
            n => Ok(BudgetSpec::Bytes(n)),
        },
    }
}

impl BudgetSpec {
    /// The budget in bytes; a percentage needs `limit` (FERRY_MEMORY_LIMIT, the container's memory
    /// limit in bytes).
    pub fn resolve(self, limit: Option<&str>) -> Result<u64, String> {
        match self {
            BudgetSpec::Bytes(n) => Ok(n),
            BudgetSpec::Percent(p) => {
                let limit = limit.ok_or_else(|| {
                    format!("--memory-budget {p}% needs FERRY_MEMORY_LIMIT (the container's memory limit in bytes)")
                })?;
                let bytes: u64 = limit.trim().parse().map_err(|_| {
                    format!("FERRY_MEMORY_LIMIT={limit:?} is not a number of bytes")
                })?;
                Ok((bytes as u128 * p as u128 / 100) as u64)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("4 M"), Ok(4 << 20));
        assert_eq!(parse_size("20GiB"), Ok(20 << 30));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("12XB")
            .unwrap_err()
            .contains("unknown size unit"));
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn budgets() {
        assert_eq!(parse_budget("1GiB"), Ok(BudgetSpec::Bytes(1 << 30)));
        assert_eq!(parse_budget("75%"), Ok(BudgetSpec::Percent(75)));
        assert!(parse_budget("0").is_err());
        assert!(parse_budget("150%").is_err());
        assert_eq!(BudgetSpec::Percent(75).resolve(Some("4000")), Ok(3000));
        assert!(BudgetSpec::Percent(75)
            .resolve(None)
            .unwrap_err()
            .contains("FERRY_MEMORY_LIMIT"));
        assert!(BudgetSpec::Percent(75).resolve(Some("lots")).is_err());
        assert_eq!(BudgetSpec::Bytes(5).resolve(None), Ok(5));
    }
}
