//! The one result table (rows = workloads, columns = mounters, then the reference "ceiling"
//! column, then "ferry / X" ratio columns and "ferry-cache / ferry") and the targets
//! evaluated from it, as Markdown.

use std::collections::HashMap;
use std::fmt::Write as _;

use crate::dataset::Dataset;
use crate::mounters::Kind;
use crate::workloads::{Cell, Row};

/// A column of the table besides the workload name and unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Column {
    Mounter(Kind),
    /// The reference a mounter is measured against, through the same proxy: the SDK's parallel
    /// ranged GETs (P1, P7), one GET per small file (P4, P12 epoch 1), LIST of the directory (P5
    /// cold, P11, P14 cold); or the page cache of a local copy (P2), a local directory's listing
    /// (P14 warm).
    Ceiling,
}

pub struct Table {
    pub rows: Vec<Row>,
    /// Mounters in column order, each with why it is n/a, if it is.
    pub mounters: Vec<(Kind, Option<String>)>,
    pub cells: HashMap<(Row, Column), Cell>,
}

pub fn fmt_value(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

impl Table {
    pub fn value(&self, row: Row, col: Column) -> Option<f64> {
        match self.cells.get(&(row, col)) {
            Some(Cell::Value(v)) => Some(*v),
            _ => None,
        }
    }

    fn cell_text(&self, row: Row, col: Column) -> String {
        if let Column::Mounter(k) = col {
            if let Some((_, Some(_))) = self.mounters.iter().find(|(m, _)| *m == k) {
                return "n/a".into();
            }
        }
        match self.cells.get(&(row, col)) {
            Some(Cell::Value(v)) => fmt_value(*v),
            Some(Cell::Failed(why)) => why.clone(),
            None => "—".into(),
        }
    }

    /// `num / den` for `row`, as the table prints ratios.
    fn ratio_text(&self, row: Row, num: Column, den: Column) -> String {
        match (self.value(row, num), self.value(row, den)) {
            (Some(f), Some(x)) if x > 0.0 => format!("{:.2}", f / x),
            _ => "—".into(),
        }
    }

    /// The table as Markdown.
    pub fn markdown(&self, ds: &Dataset) -> String {
        let peers: Vec<Kind> = self
            .mounters
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| !k.is_ferry())
            .collect();
        let has = |kind: Kind| self.mounters.iter().any(|(k, _)| *k == kind);
        let has_ferry = has(Kind::Ferry);
        let has_cache_ratio = has_ferry && has(Kind::FerryCache);
        let ferry = Column::Mounter(Kind::Ferry);
        let mut head = vec!["workload".to_string(), "unit".to_string()];
        head.extend(self.mounters.iter().map(|(k, _)| k.name().to_string()));
        head.push("ceiling".into());
        if has_ferry {
            head.extend(peers.iter().map(|k| format!("ferry / {}", k.name())));
            head.push("ferry / ceiling".into());
        }
        if has_cache_ratio {
            head.push("ferry-cache / ferry".into());
        }
        let mut out = String::new();
        let _ = writeln!(out, "| {} |", head.join(" | "));
        let _ = writeln!(
            out,
            "|{}",
            head.iter()
                .enumerate()
                .map(|(i, _)| if i < 2 { "---|" } else { "---:|" })
                .collect::<String>()
        );
        for &row in &self.rows {
            let mut line = vec![row.title(ds), row.unit().to_string()];
            line.extend(
                self.mounters
                    .iter()
                    .map(|(k, _)| self.cell_text(row, Column::Mounter(*k))),
            );
            line.push(self.cell_text(row, Column::Ceiling));
            if has_ferry {
                line.extend(
                    peers
                        .iter()
                        .map(|k| self.ratio_text(row, ferry, Column::Mounter(*k))),
                );
                line.push(self.ratio_text(row, ferry, Column::Ceiling));
            }
            if has_cache_ratio {
                line.push(self.ratio_text(row, Column::Mounter(Kind::FerryCache), ferry));
            }
            let _ = writeln!(out, "| {} |", line.join(" | "));
        }
        let na: Vec<String> = self
            .mounters
            .iter()
            .filter_map(|(k, why)| why.as_ref().map(|w| format!("{}: n/a ({w})", k.name())))
            .collect();
        if !na.is_empty() {
            let _ = writeln!(out, "\n{}", na.join("; "));
        }
        out
    }

    /// One line per target of the issue: met / not met, with the numbers.
    pub fn targets(&self) -> Vec<String> {
        let ferry = Column::Mounter(Kind::Ferry);
        let ms3 = Column::Mounter(Kind::MountS3);
        let mut lines = Vec::new();
        // (row, target text, reference column, bound, ferry must be >= bound × reference?)
        // For ↓ rows the check is ferry <= bound × reference.
        let checks: [(Row, &str, Column, f64); 10] = [
            (Row::P1, "P1 ≥ 1.0 × mount-s3", ms3, 1.0),
            (Row::P6, "P6 ≥ 1.0 × mount-s3", ms3, 1.0),
            (Row::P7, "P7 ≥ 1.0 × mount-s3", ms3, 1.0),
            (Row::P4One, "P4 (1 reader) ≥ 3 × mount-s3", ms3, 3.0),
            (Row::P4Eight, "P4 (8 readers) ≥ 3 × mount-s3", ms3, 3.0),
            (
                Row::P5Cold,
                "P5 cold ≥ 3 × mount-s3 (time ≤ ⅓)",
                ms3,
                1.0 / 3.0,
            ),
            (Row::P2, "P2 ≥ 0.8 × page cache", Column::Ceiling, 0.8),
            (Row::P1, "P1 ≥ 0.9 × ceiling", Column::Ceiling, 0.9),
            (Row::P10, "P10 ≤ ¼ of mount-s3's RSS", ms3, 0.25),
            (Row::P11, "P11 ≤ ⅓ of mount-s3's time", ms3, 1.0 / 3.0),
        ];
        for (row, text, col, bound) in checks {
            if !self.rows.contains(&row) {
                continue;
            }
            let name = match col {
                Column::Mounter(k) => k.name(),
                Column::Ceiling => "ceiling",
            };
            let line = match (self.value(row, ferry), self.value(row, col)) {
                (Some(f), Some(x)) if x > 0.0 => {
                    let ratio = f / x;
                    let met = if row.higher_is_better() {
                        ratio >= bound
                    } else {
                        ratio <= bound
                    };
                    format!(
                        "- {text}: **{}** — ferry {} vs {name} {} {} (ferry / {name} = {ratio:.2})",
                        if met { "met" } else { "not met" },
                        fmt_value(f),
                        fmt_value(x),
                        row.unit().trim_end_matches([' ', '↑', '↓']),
                    )
                }
                (f, x) => format!(
                    "- {text}: **unknown** — ferry {}, {name} {}",
                    f.map(fmt_value)
                        .unwrap_or_else(|| self.cell_text(row, ferry)),
                    x.map(fmt_value).unwrap_or_else(|| self.cell_text(row, col)),
                ),
            };
            lines.push(line);
        }
        lines
    }
}
