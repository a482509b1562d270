//! [`MemoryBudget`]: one byte budget shared by the prefetch buffers of every mount of the node
//! plugin, and [`MountContext`], the node-level things a mount is given besides its plain-data
//! [`crate::MountConfig`].
//!
//! Reservations are RAII ([`Reservation`] gives its bytes back when dropped) and never wait: when
//! the budget is exhausted, prefetching shrinks or stops and reads fetch only what they need.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Default node-wide budget for prefetched data: 1 GiB.
pub const DEFAULT_BUDGET: u64 = 1 << 30;

/// A byte budget shared by clones (cheap to clone).
#[derive(Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    limit: u64,
    used: AtomicU64,
    /// `ferry_memory_budget_used_bytes`: every reservation adds to it and takes back.
    gauge: &'static ferry_metrics::Gauge,
}

impl fmt::Debug for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBudget")
            .field("limit", &self.limit())
            .field("used", &self.used())
            .finish()
    }
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget::new(DEFAULT_BUDGET)
    }
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        MemoryBudget {
            inner: Arc::new(Inner {
                limit,
                used: AtomicU64::new(0),
                gauge: &ferry_metrics::metrics().node.memory_budget_used,
            }),
        }
    }

    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes currently reserved (for metrics).
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` if they fit, without waiting; `None` when the budget cannot hold them.
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        let mut used = self.inner.used.load(Ordering::Relaxed);
        loop {
            let new = used.checked_add(bytes)?;
            if new > self.inner.limit {
                return None;
            }
            match self.inner.used.compare_exchange_weak(
                used,
                new,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.inner.gauge.inc_by(bytes as i64);
                    return Some(Reservation {
                        budget: self.clone(),
                        bytes,
                    });
                }
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes held from a [`MemoryBudget`] until dropped.
pub struct Reservation {
    budget: MemoryBudget,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Reservation({})", self.bytes)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let inner = &self.budget.inner;
        inner.used.fetch_sub(self.bytes, Ordering::AcqRel);
        inner.gauge.dec_by(self.bytes as i64);
    }
}

/// How reads fetch ahead (node-level tuning, the same for every mount).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// Largest single ranged GET of a sequential reader.
    pub part_size: u64,
    /// Bytes fetched ahead when a reader first looks sequential; doubles per consumed part.
    pub initial_window: u64,
    /// Most bytes in flight or buffered ahead of one sequential reader.
    pub max_window: u64,
    /// Random reads fetch their range rounded out to this alignment.
    pub random_align: u64,
    /// Objects up to this size are fetched whole ahead of a listing-order reader (0 disables).
    pub small_object_max: u64,
    /// Most small objects fetched ahead of one listing-order reader.
    pub small_objects_ahead: usize,
    /// Prefetched small objects not opened within this time are dropped.
    pub small_object_ttl: std::time::Duration,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            part_size: 8 << 20,
            initial_window: 1 << 20,
            max_window: 64 << 20,
            random_align: 64 << 10,
            small_object_max: 1 << 20,
            small_objects_ahead: 32,
            small_object_ttl: std::time::Duration::from_secs(10),
        }
    }
}

/// What every mount of one node plugin shares: the runtime its requests run on, the memory
/// budget of all prefetching, the prefetch tuning and the block cache. Not part of the per-mount plain data.
#[derive(Debug, Clone)]
pub struct MountContext {
    pub runtime: tokio::runtime::Handle,
    pub budget: MemoryBudget,
    pub prefetch: PrefetchConfig,
    /// The node's block cache, if the node plugin has one (`--cache-dir`).
    pub cache: Option<Arc<ferry_cache::BlockCache>>,
    /// Hand objects whole in the node cache to the kernel to read directly (FUSE passthrough),
    /// where the kernel allows it. On by default.
    pub passthrough: bool,
    /// Proofs of access by store, shared by the mounts of one store (the same credentials).
    pub proofs: Arc<crate::proofs::ProofRegistry>,
    /// The journal the next mount keeps its state in (set per mount; see [`crate::journal`]).
    pub journal: Option<Arc<crate::journal::Journal>>,
}

impl MountContext {
    /// The default budget ([`DEFAULT_BUDGET`]) and prefetch tuning on `runtime`.
    pub fn new(runtime: tokio::runtime::Handle) -> Self {
        MountContext {
            runtime,
            budget: MemoryBudget::default(),
            prefetch: PrefetchConfig::default(),
            cache: None,
            passthrough: true,
            proofs: Arc::default(),
            journal: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_bounded_and_released_on_drop() {
        let b = MemoryBudget::new(100);
        let r1 = b.try_reserve(60).expect("fits");
        assert_eq!(b.used(), 60);
        assert!(b.try_reserve(41).is_none(), "over the limit");
        let r2 = b.clone().try_reserve(40).expect("exactly fits");
        assert_eq!(b.used(), 100);
        assert!(b.try_reserve(1).is_none());
        drop(r1);
        assert_eq!(b.used(), 40);
        assert_eq!(r2.bytes(), 40);
        drop(r2);
        assert_eq!(b.used(), 0);
        assert!(b.try_reserve(u64::MAX).is_none());
        assert_eq!(b.used(), 0);
    }
}
