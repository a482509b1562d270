//! The registry (prometheus-client's, with each name registered once) and the one metric type we
//! add to the library's: a lock-free latency [`Histogram`].
//!
//! prometheus-client's own histogram takes a mutex on every observation; ours is a fixed set of
//! atomic buckets, so recording never waits on a scrape or another recorder. It plugs into the
//! library through [`EncodeMetric`], which encodes it in both exposition formats.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Metric;

/// Upper bounds of the latency buckets, in nanoseconds: 100 µs to 60 s.
const BOUNDS_NANOS: [u64; 14] = [
    100_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    5_000_000_000,
    60_000_000_000,
];

/// A latency histogram with fixed buckets (100 µs to 60 s): one atomic add per bucket hit and
/// one for the sum. Clones share their counts (register one clone, record on another).
#[derive(Debug, Clone, Default)]
pub struct Histogram(Arc<Buckets>);

#[derive(Debug, Default)]
struct Buckets {
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    counts: [AtomicU64; BOUNDS_NANOS.len() + 1],
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = BOUNDS_NANOS.partition_point(|&b| b < nanos);
        self.0.counts[i].fetch_add(1, Ordering::Relaxed);
        self.0.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = self
            .0
            .counts
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let bound = BOUNDS_NANOS
                    .get(i)
                    .map_or(f64::INFINITY, |&b| b as f64 / 1e9);
                (bound, c.load(Ordering::Relaxed))
            })
            .collect();
        // The count is the buckets' sum, so `_count` always equals the `+Inf` bucket.
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.0.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A name registered twice.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("metric {0} is registered already")]
pub struct AlreadyRegistered(pub String);

/// A set of metric families, each name at most once. Registering is done at start-up; recording
/// goes to the metrics' own handles, so encoding (a scrape) reads atomics and never blocks it.
#[derive(Debug, Default)]
pub struct Registry {
    inner: prometheus_client::registry::Registry,
    names: HashSet<String>,
}

impl Registry {
    /// Registers `metric` as `name` (as queried: a counter's `_total` included). A name already
    /// there is refused, and the first registration stays.
    pub fn register(
        &mut self,
        name: &str,
        help: &str,
        metric: impl Metric,
    ) -> Result<(), AlreadyRegistered> {
        if !self.names.insert(name.to_string()) {
            return Err(AlreadyRegistered(name.to_string()));
        }
        // prometheus-client adds a counter's `_total` and the help's full stop itself.
        let family = match metric.metric_type() {
            MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
            _ => name,
        };
        let help = help.strip_suffix('.').unwrap_or(help);
        self.inner.register(family, help, metric);
        Ok(())
    }

    /// Everything, in Prometheus' text format (version 0.0.4): what `promtool check metrics` and
    /// scrapers that ask for nothing else read.
    pub fn encode_text(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.inner)
            .expect("writing to a String cannot fail");
        out
    }

    /// Everything, in the OpenMetrics text format (what Prometheus asks for first).
    pub fn encode_openmetrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.inner)
            .expect("writing to a String cannot fail");
        out
    }
}

/// `Content-Type` of [`Registry::encode_text`].
pub const TEXT_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
/// `Content-Type` of [`Registry::encode_openmetrics`].
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;

    #[test]
    fn renders_both_formats() {
        let mut r = Registry::default();
        let c: Counter = Counter::default();
        r.register("t_requests_total", "Requests.", c.clone())
            .unwrap();
        c.inc_by(4);
        let g: Gauge = Gauge::default();
        r.register("t_mounts", "Mounts.", g.clone()).unwrap();
        g.set(2);
        let h: Family<Vec<(&str, String)>, Histogram> = Family::default();
        r.register("t_seconds", "Latency.", h.clone()).unwrap();
        h.get_or_create(&vec![("op", "a\"b".to_string())])
            .observe(Duration::from_millis(3));
        let text = r.encode_text();
        assert!(
            text.contains(
                "# HELP t_requests_total Requests.\n# TYPE t_requests_total counter\nt_requests_total 4\n"
            ),
            "{text}"
        );
        assert!(text.contains("t_mounts 2\n"), "{text}");
        assert!(
            text.contains("t_seconds_bucket{op=\"a\\\"b\",le=\"0.005\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{op=\"a\\\"b\",le=\"0.001\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_bucket{op=\"a\\\"b\",le=\"+Inf\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("t_seconds_count{op=\"a\\\"b\"} 1\n"),
            "{text}"
        );
        assert!(!text.contains("# EOF"), "{text}");
        let om = r.encode_openmetrics();
        assert!(om.contains("# TYPE t_requests counter\n"), "{om}");
        assert!(om.ends_with("# EOF\n"), "{om}");
    }

    #[test]
    fn a_name_registered_twice_is_refused_not_a_panic() {
        let mut r = Registry::default();
        let c: Counter = Counter::default();
        r.register("t_total", "A counter.", c.clone()).unwrap();
        let g: Gauge = Gauge::default();
        assert_eq!(
            r.register("t_total", "Now a gauge.", g),
            Err(AlreadyRegistered("t_total".into()))
        );
        c.inc();
        let text = r.encode_text();
        assert_eq!(text.matches("# TYPE t_total").count(), 1, "{text}");
        assert!(text.contains("t_total 1\n"), "{text}");
    }

    #[test]
    fn buckets_hold_their_upper_bound() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(100)); // le 0.0001
        h.observe(Duration::from_nanos(100_001)); // le 0.0005
        h.observe(Duration::from_secs(120)); // +Inf
        let n: Vec<u64> =
            h.0.counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect();
        assert_eq!((n[0], n[1], n[BOUNDS_NANOS.len()]), (1, 1, 1));
        assert_eq!(h.count(), 3);
    }
}
