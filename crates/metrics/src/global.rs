//! The process-wide metrics: every family created and registered once, at first use, with the
//! handles the hot paths record on kept in [`Metrics`].
//!
//! Recording is an atomic add on a handle: no lock, no allocation, no name or label lookup. A
//! labelled series whose label values are only known when it happens (an HTTP status, an errno)
//! sits in a [`Grid`] cell: looked up in its family (a lock and an allocation) the first time
//! that combination happens, and read from the cell (one atomic load) ever after.

use std::borrow::Cow;
use std::sync::{LazyLock, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::registry::{AlreadyRegistered, Histogram, Registry};
use crate::{fuse, names, s3};

/// A label set: names are fixed, values are known when the series is first used.
pub(crate) type Labels = Vec<(&'static str, Cow<'static, str>)>;

/// A family addressed by a dense index (e.g. operation × status), each series looked up in the
/// family the first time it is used (so a process exports only the series it has used).
#[derive(Debug)]
pub(crate) struct Grid<M = Counter> {
    family: Family<Labels, M>,
    cells: Box<[OnceLock<M>]>,
}

impl<M: Clone + Default> Grid<M> {
    fn new(family: Family<Labels, M>, len: usize) -> Self {
        Grid {
            family,
            cells: (0..len).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The series of cell `i`, created with `labels` the first time.
    #[inline]
    pub(crate) fn get(&self, i: usize, labels: impl FnOnce() -> Labels) -> &M {
        self.cells[i].get_or_init(|| self.family.get_or_create_owned(&labels()))
    }
}

fn counters<const N: usize>(
    family: &Family<Labels, Counter>,
    label: &'static str,
    values: [&'static str; N],
) -> [Counter; N] {
    values.map(|v| family.get_or_create_owned(&vec![(label, Cow::Borrowed(v))]))
}

/// S3 requests: logical calls of the store ([`crate::InstrumentedStore`]) and HTTP attempts
/// ([`crate::record_s3_attempt`]).
#[derive(Debug)]
pub struct S3Metrics {
    /// op × result.
    pub(crate) requests: Grid,
    /// By op.
    pub(crate) request_seconds: Grid<Histogram>,
    /// op × status.
    pub(crate) attempts: Grid,
    /// By op.
    pub(crate) attempt_seconds: Grid<Histogram>,
    pub received_bytes: Counter,
    pub sent_bytes: Counter,
}

/// FUSE operations ([`crate::record_fuse_op`]).
#[derive(Debug)]
pub struct FuseMetrics {
    /// op × outcome.
    pub(crate) ops: Grid,
    /// By op.
    pub(crate) seconds: Grid<Histogram>,
}

/// The node cache.
#[derive(Debug)]
pub struct CacheMetrics {
    pub lookups: Counter,
    pub hits: Counter,
    pub hit_bytes: Counter,
    pub misses: Counter,
    pub joins: Counter,
    pub fills: Counter,
    pub evictions: Counter,
    pub corrupt: Counter,
    pub skipped: Counter,
    pub denied: Counter,
    pub assembled: Counter,
    pub passthrough_opens: Counter,
    pub warmup_bytes: Counter,
    /// `ok`, `truncated`, `error`, `stopped`.
    warmups: [Counter; 4],
    pub bytes: Gauge,
    pub blocks: Gauge,
    pub objects: Gauge,
}

impl CacheMetrics {
    /// Counts a finished warm-up by result: `ok`, `truncated`, `stopped` (its mount was
    /// unpublished first), anything else is `error`.
    pub fn warmup_done(&self, result: &str) {
        let i = match result {
            "ok" => 0,
            "truncated" => 1,
            "stopped" => 3,
            _ => 2,
        };
        self.warmups[i].inc();
    }
}

/// The node plugin: mounts and takeovers, the prefetch memory budget, prefetched bytes.
#[derive(Debug)]
pub struct NodeMetrics {
    pub mounts: Gauge,
    /// Inodes kept for the kernel by every mount of the process (each about half a KiB, not
    /// charged to the memory budget: the kernel holds them until it forgets them).
    pub inodes: Gauge,
    /// `handover`, `recovery`, `failed`.
    taken_over: [Counter; 3],
    pub takeover_pause_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// By kind ([`MEMORY_KINDS`]).
    memory_budget_used: [Gauge; 6],
    pub memory_budget_limit: Gauge,
    pub prefetch_hit_bytes: Counter,
    pub prefetch_wasted_bytes: Counter,
}

/// The kinds of `ferry_memory_budget_used_bytes{kind}` (ferry-fs's `budget::Use`).
pub const MEMORY_KINDS: [&str; 6] = [
    "prefetch",
    "write",
    "read_ahead",
    "listing",
    "session",
    "cache_write",
];

impl NodeMetrics {
    /// The memory budget's bytes in use for `kind` (one of [`MEMORY_KINDS`]; anything else counts
    /// as the last).
    pub fn memory_budget_used(&self, kind: &str) -> &Gauge {
        let i = MEMORY_KINDS
            .iter()
            .position(|k| *k == kind)
            .unwrap_or(MEMORY_KINDS.len() - 1);
        &self.memory_budget_used[i]
    }

    /// Counts `n` mounts taken over by `how` (`handover`, `recovery`; anything else is `failed`).
    pub fn taken_over(&self, how: &str, n: u64) {
        let i = match how {
            "handover" => 0,
            "recovery" => 1,
            _ => 2,
        };
        self.taken_over[i].inc_by(n);
    }

    /// Records the pause of the last takeover.
    pub fn takeover_pause(&self, pause: Duration) {
        self.takeover_pause_seconds.set(pause.as_secs_f64());
    }
}

/// Every metric of the process.
#[derive(Debug)]
pub struct Metrics {
    pub s3: S3Metrics,
    pub fuse: FuseMetrics,
    pub cache: CacheMetrics,
    pub node: NodeMetrics,
}

struct Global {
    registry: Registry,
    metrics: Metrics,
}

static GLOBAL: LazyLock<Global> = LazyLock::new(|| {
    let (registry, metrics, refused) = build();
    for e in refused {
        tracing::error!(error = %e, "metric not exported");
    }
    Global { registry, metrics }
});

/// The process-wide metrics (created at first use).
pub fn metrics() -> &'static Metrics {
    &GLOBAL.metrics
}

/// The process-wide registry (what `/metrics` serves).
pub fn registry() -> &'static Registry {
    &GLOBAL.registry
}

/// Creates every metric and registers it; a name registered twice is returned, not a panic.
pub(crate) fn build() -> (Registry, Metrics, Vec<AlreadyRegistered>) {
    let mut reg = Registry::default();
    let mut refused = Vec::new();
    // Each metric is created here and a clone registered: clones share their values.
    macro_rules! reg {
        ($name:expr, $help:expr, $m:expr) => {{
            let m = $m;
            if let Err(e) = reg.register($name, $help, m.clone()) {
                refused.push(e);
            }
            m
        }};
    }
    let counter = || Counter::<u64>::default();
    let gauge = || Gauge::<i64>::default();

    let s3_requests = reg!(
        names::S3_REQUESTS,
        "S3 requests (calls of the store, whatever their retries) by operation and result.",
        Family::<Labels, Counter>::default()
    );
    let s3_request_seconds = reg!(
        names::S3_REQUEST_SECONDS,
        "S3 request latency in seconds (retries included), by operation.",
        Family::<Labels, Histogram>::default()
    );
    let s3_attempts = reg!(
        names::S3_ATTEMPTS,
        "S3 HTTP attempts (each retry one more) by operation and HTTP status (no_response: connect error or timeout).",
        Family::<Labels, Counter>::default()
    );
    let s3_attempt_seconds = reg!(
        names::S3_ATTEMPT_SECONDS,
        "S3 HTTP attempt latency in seconds, by operation.",
        Family::<Labels, Histogram>::default()
    );
    let s3 = S3Metrics {
        requests: Grid::new(s3_requests, s3::OPS.len() * s3::RESULTS.len()),
        request_seconds: Grid::new(s3_request_seconds, s3::OPS.len()),
        attempts: Grid::new(s3_attempts, s3::OPS.len() * s3::STATUS_SLOTS),
        attempt_seconds: Grid::new(s3_attempt_seconds, s3::OPS.len()),
        received_bytes: reg!(
            names::S3_BYTES_IN,
            "Bytes received from S3 in GET bodies.",
            counter()
        ),
        sent_bytes: reg!(
            names::S3_BYTES_OUT,
            "Bytes sent to S3 in PUT and part bodies.",
            counter()
        ),
    };

    let fuse_ops = reg!(
        names::FUSE_OPS,
        "FUSE operations answered, by operation and outcome (ok or the errno's name).",
        Family::<Labels, Counter>::default()
    );
    let fuse_seconds = reg!(
        names::FUSE_OP_SECONDS,
        "FUSE operation latency in seconds (request to reply), by operation.",
        Family::<Labels, Histogram>::default()
    );
    let fuse = FuseMetrics {
        ops: Grid::new(fuse_ops, fuse::OPS.len() * fuse::OUTCOMES.len()),
        seconds: Grid::new(fuse_seconds, fuse::OPS.len()),
    };

    let warmups = reg!(
        names::CACHE_WARMUPS,
        "Volume warm-ups finished, by result (`stopped`: the mount running it was unpublished first).",
        Family::<Labels, Counter>::default()
    );
    let cache = CacheMetrics {
        lookups: reg!(names::CACHE_LOOKUPS, "Cache block lookups (each a hit, a miss or a single-flight join).", counter()),
        hits: reg!(names::CACHE_HITS, "Cache block hits.", counter()),
        hit_bytes: reg!(names::CACHE_HIT_BYTES, "Bytes served from the node cache.", counter()),
        misses: reg!(names::CACHE_MISSES, "Cache block misses (fetches from S3).", counter()),
        joins: reg!(names::CACHE_JOINS, "Cache misses that waited for another reader's fetch of the same block.", counter()),
        fills: reg!(names::CACHE_FILLS, "Fetched blocks written into the node cache.", counter()),
        evictions: reg!(names::CACHE_EVICTIONS, "Cache blocks evicted.", counter()),
        corrupt: reg!(names::CACHE_CORRUPT, "Cache block or whole-object files that failed their checksum or key check (deleted).", counter()),
        skipped: reg!(names::CACHE_SKIPPED, "Fetched blocks not stored in the node cache (no room, writers behind, memory budget spent, write failed, index not yet rebuilt), and reads that fetched only their part of a block for lack of budget.", counter()),
        denied: reg!(names::CACHE_DENIED, "Opens through a cached mount refused because its credentials were denied the object.", counter()),
        assembled: reg!(names::CACHE_ASSEMBLED, "Objects whose cached blocks were joined into one whole-object file.", counter()),
        passthrough_opens: reg!(names::CACHE_WHOLE_OPENS, "Opens served by handing the kernel a whole cached object (FUSE passthrough).", counter()),
        warmup_bytes: reg!(names::CACHE_WARMUP_BYTES, "Bytes fetched into the node cache by volume warm-ups.", counter()),
        warmups: counters(&warmups, "result", ["ok", "truncated", "error", "stopped"]),
        bytes: reg!(names::CACHE_BYTES, "Bytes of block and whole-object files in the node cache.", gauge()),
        blocks: reg!(names::CACHE_BLOCKS, "Block files in the node cache.", gauge()),
        objects: reg!(names::CACHE_OBJECTS, "Whole-object files in the node cache.", gauge()),
    };

    let taken_over = reg!(
        names::MOUNTS_TAKEN_OVER,
        "Mounts taken over from a previous process, by how (handover, recovery; failed: not taken over).",
        Family::<Labels, Counter>::default()
    );
    let node = NodeMetrics {
        mounts: reg!(names::MOUNTS, "Live FUSE mounts in this process.", gauge()),
        inodes: reg!(
            names::INODES,
            "Inodes the mounts of this process keep for the kernel (about 0.5 KiB each, outside the memory budget).",
            gauge()
        ),
        taken_over: counters(&taken_over, "how", ["handover", "recovery", "failed"]),
        takeover_pause_seconds: reg!(
            names::TAKEOVER_PAUSE,
            "Seconds the last takeover stopped the mounts.",
            Gauge::<f64, std::sync::atomic::AtomicU64>::default()
        ),
        memory_budget_used: {
            let family = reg!(
                names::MEMORY_BUDGET_USED,
                "Bytes of the node-wide memory budget in use, by kind (prefetch, write buffers, read-ahead, listings kept, FUSE sessions).",
                Family::<Labels, Gauge>::default()
            );
            MEMORY_KINDS.map(|k| family.get_or_create_owned(&vec![("kind", Cow::Borrowed(k))]))
        },
        memory_budget_limit: reg!(
            names::MEMORY_BUDGET_LIMIT,
            "The node-wide memory budget in bytes.",
            gauge()
        ),
        prefetch_hit_bytes: reg!(
            names::PREFETCH_HIT_BYTES,
            "Prefetched bytes later read by the application.",
            counter()
        ),
        prefetch_wasted_bytes: reg!(
            names::PREFETCH_WASTE_BYTES,
            "Prefetched bytes dropped unread (random access, close, expiry).",
            counter()
        ),
    };
    (
        reg,
        Metrics {
            s3,
            fuse,
            cache,
            node,
        },
        refused,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_registered_once() {
        let (reg, m, refused) = build();
        assert!(refused.is_empty(), "{refused:?}");
        m.cache.hits.inc();
        m.cache.warmup_done("truncated");
        m.node.taken_over("recovery", 2);
        m.node.takeover_pause(Duration::from_millis(1500));
        let text = reg.encode_text();
        for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let name = line.split(' ').nth(2).unwrap();
            assert_eq!(
                text.matches(&format!("# TYPE {name} ")).count(),
                1,
                "{name}"
            );
        }
        assert!(text.contains("ferry_cache_hits_total 1\n"), "{text}");
        assert!(
            text.contains("ferry_cache_warmups_total{result=\"truncated\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("ferry_mounts_taken_over_total{how=\"recovery\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("ferry_takeover_pause_seconds 1.5\n"),
            "{text}"
        );
    }
}
