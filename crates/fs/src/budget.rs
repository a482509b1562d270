//! [`MemoryBudget`]: one byte budget shared by everything of every mount of the node plugin that
//! grows with load ([`Use`]: prefetch and write buffers, small objects and directory sweeps read
//! ahead, listings kept, FUSE sessions, blocks waiting for the node cache's writers), and
//! [`MountContext`], the node-level things a mount is given besides its plain-data
//! [`crate::MountConfig`].
//!
//! What each kind does when the budget is spent: prefetching shrinks or stops, a write buffer
//! waits, a listing is served but not kept (the next `readdir` or lookup lists again), a block is
//! not stored in the node cache (it was read; only the copy on disk is given up), and a FUSE
//! session is charged regardless (a mount is never refused for memory) so the others give way.
//!
//! Reservations are RAII ([`Reservation`] gives its bytes back when dropped). Prefetching never
//! waits ([`MemoryBudget::try_reserve`]): when the budget is exhausted it shrinks or stops and reads
//! fetch only what they need. A writer waits ([`MemoryBudget::reserve`]) for its buffer to fit, and
//! while writers wait, prefetching may not take the memory they wait for — but only for a bounded
//! time: then it takes the memory over the limit (counted, so prefetching stays stopped until usage
//! falls back). The bound is what keeps writers from deadlocking: memory held by buffers of files
//! that only the waiting process would close, or by a paused reader's prefetch, comes back only
//! when that process moves on. The count stays true throughout (a waiting writer keeps what it
//! holds).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Default node-wide memory budget (everything of [`Use`]): 1 GiB.
pub const DEFAULT_BUDGET: u64 = 1 << 30;

/// What a reservation is for: `ferry_memory_budget_used_bytes{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Sequential prefetch windows.
    Prefetch,
    /// Write buffers of files being written.
    Write,
    /// Small objects and directory sweeps read ahead (into memory or the node cache).
    ReadAhead,
    /// Directory listings kept for later `readdir`s and lookups.
    Listing,
    /// A FUSE session's resident cost (request buffer, thread, tables of an idle mount).
    Session,
    /// Blocks handed to the node cache's writers, until they are on disk.
    CacheWrite,
}

impl Use {
    pub const ALL: [Use; 6] = [
        Use::Prefetch,
        Use::Write,
        Use::ReadAhead,
        Use::Listing,
        Use::Session,
        Use::CacheWrite,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Use::Prefetch => "prefetch",
            Use::Write => "write",
            Use::ReadAhead => "read_ahead",
            Use::Listing => "listing",
            Use::Session => "session",
            Use::CacheWrite => "cache_write",
        }
    }
}

/// What an idle mount's FUSE session holds, charged as [`Use::Session`] while it lives: measured
/// with `ferry-bench-load storm` at 115 KiB per idle mount (doc/BENCHMARKS.md), rounded up.
pub const SESSION_BYTES: u64 = 128 << 10;

/// A byte budget shared by clones (cheap to clone).
#[derive(Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    limit: u64,
    used: AtomicU64,
    /// Bytes that [`MemoryBudget::reserve`] callers are waiting for.
    waiting: AtomicU64,
    /// Woken when reservations are given back while someone waits.
    freed: Notify,
    /// `ferry_memory_budget_used_bytes{kind}`: every reservation adds to its kind's and takes back.
    gauges: [&'static ferry_metrics::Gauge; 6],
    /// Sequential readers holding a prefetch window now (see [`StreamSlot`]).
    streams: AtomicU64,
    /// Bytes in use by [`Use`].
    by_kind: [AtomicU64; 6],
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
                waiting: AtomicU64::new(0),
                freed: Notify::new(),
                gauges: Use::ALL
                    .map(|u| ferry_metrics::metrics().node.memory_budget_used(u.label())),
                streams: AtomicU64::new(0),
                by_kind: Default::default(),
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

    /// Counts one more sequential reader with a prefetch window until the slot is dropped.
    pub fn join_stream(&self) -> StreamSlot {
        self.inner.streams.fetch_add(1, Ordering::Relaxed);
        StreamSlot {
            budget: self.clone(),
        }
    }

    /// Sequential readers holding a prefetch window now, on every mount of the budget.
    pub fn streams(&self) -> u64 {
        self.inner.streams.load(Ordering::Relaxed)
    }

    /// Reserves `bytes` if they fit, without waiting; `None` when the budget cannot hold them, or
    /// could only by taking memory that writers wait for.
    pub fn try_reserve(&self, bytes: u64) -> Option<Reservation> {
        self.take(Use::Prefetch, bytes, true)
    }

    /// [`MemoryBudget::try_reserve`] for another use than prefetch.
    pub fn try_reserve_for(&self, kind: Use, bytes: u64) -> Option<Reservation> {
        self.take(kind, bytes, true)
    }

    /// Charges `bytes` for `kind` whatever the limit (what must exist anyway: a mount's session).
    /// Over the limit, prefetching stops and writers wait until usage falls back.
    pub fn charge(&self, kind: Use, bytes: u64) -> Reservation {
        self.force(kind, bytes)
    }

    /// Bytes in use for `kind`.
    pub fn used_for(&self, kind: Use) -> u64 {
        self.inner.by_kind[kind as usize].load(Ordering::Relaxed)
    }

    /// Reserves `bytes`, waiting up to `max_wait` for them to fit; after that they are taken over
    /// the limit.
    pub async fn reserve(&self, bytes: u64, max_wait: std::time::Duration) -> Reservation {
        if let Some(r) = self.take(Use::Write, bytes, true) {
            return r;
        }
        match tokio::time::timeout(max_wait, self.wait_for(bytes)).await {
            Ok(r) => r,
            Err(_) => {
                tracing::debug!(
                    bytes,
                    used = self.used(),
                    limit = self.limit(),
                    "memory budget exhausted: a write buffer goes over it"
                );
                self.force(Use::Write, bytes)
            }
        }
    }

    /// Takes `bytes` whatever the limit.
    fn force(&self, kind: Use, bytes: u64) -> Reservation {
        self.inner.used.fetch_add(bytes, Ordering::SeqCst);
        self.counted(kind, bytes)
    }

    /// Counts `bytes` already added to `used` for `kind`, in a reservation.
    fn counted(&self, kind: Use, bytes: u64) -> Reservation {
        self.inner.by_kind[kind as usize].fetch_add(bytes, Ordering::Relaxed);
        self.inner.gauges[kind as usize].inc_by(bytes as i64);
        Reservation {
            budget: self.clone(),
            kind,
            bytes,
        }
    }

    async fn wait_for(&self, bytes: u64) -> Reservation {
        struct Waiting<'a>(&'a Inner, u64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.waiting.fetch_sub(self.1, Ordering::SeqCst);
            }
        }
        self.inner.waiting.fetch_add(bytes, Ordering::SeqCst);
        let _waiting = Waiting(&self.inner, bytes);
        loop {
            // Registered before the attempt, so a release between the two is not missed.
            let freed = self.inner.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(r) = self.take(Use::Write, bytes, false) {
                return r;
            }
            freed.await;
        }
    }

    fn take(&self, kind: Use, bytes: u64, behind_waiters: bool) -> Option<Reservation> {
        let mut used = self.inner.used.load(Ordering::Relaxed);
        loop {
            let mut new = used.checked_add(bytes)?;
            if behind_waiters {
                new = new.checked_add(self.inner.waiting.load(Ordering::SeqCst))?;
            }
            if new > self.inner.limit {
                return None;
            }
            let new = used + bytes;
            match self.inner.used.compare_exchange_weak(
                used,
                new,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.counted(kind, bytes)),
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes held from a [`MemoryBudget`] until dropped.
pub struct Reservation {
    budget: MemoryBudget,
    kind: Use,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Takes `other`'s bytes into this reservation (both from the same budget).
    fn absorb(&mut self, mut other: Reservation) {
        debug_assert!(Arc::ptr_eq(&self.budget.inner, &other.budget.inner));
        debug_assert_eq!(self.kind, other.kind);
        self.bytes += std::mem::take(&mut other.bytes);
    }
}

/// What one write buffer holds of the budget: grows with the buffer, given back when the upload
/// completes or fails. A copy (a snapshot of the handle) holds nothing.
#[derive(Default)]
pub struct BufferCharge(Option<Reservation>);

impl BufferCharge {
    pub fn bytes(&self) -> u64 {
        self.0.as_ref().map_or(0, Reservation::bytes)
    }

    /// Makes the charge at least `bytes`, waiting up to `max_wait` for the budget (then going over
    /// it; see [`MemoryBudget::reserve`]).
    pub async fn grow_to(
        &mut self,
        budget: &MemoryBudget,
        bytes: u64,
        max_wait: std::time::Duration,
    ) {
        let have = self.bytes();
        if bytes <= have {
            return;
        }
        let more = budget.reserve(bytes - have, max_wait).await;
        match &mut self.0 {
            Some(r) => r.absorb(more),
            None => self.0 = Some(more),
        }
    }

    /// Gives back what the charge holds beyond `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        if let Some(r) = &mut self.0 {
            if r.bytes > bytes {
                let excess = Reservation {
                    budget: r.budget.clone(),
                    kind: r.kind,
                    bytes: r.bytes - bytes,
                };
                r.bytes = bytes;
                drop(excess);
            }
        }
    }

    /// Gives the charge back.
    pub fn release(&mut self) {
        self.0 = None;
    }
}

impl Clone for BufferCharge {
    fn clone(&self) -> Self {
        BufferCharge(None)
    }
}

impl fmt::Debug for BufferCharge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BufferCharge({})", self.bytes())
    }
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Reservation({})", self.bytes)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let inner = &self.budget.inner;
        inner.used.fetch_sub(self.bytes, Ordering::SeqCst);
        inner.by_kind[self.kind as usize].fetch_sub(self.bytes, Ordering::Relaxed);
        inner.gauges[self.kind as usize].dec_by(self.bytes as i64);
        if inner.waiting.load(Ordering::SeqCst) > 0 {
            inner.freed.notify_waiters();
        }
    }
}

/// One sequential reader counted by [`MemoryBudget::join_stream`] while it holds a window.
pub struct StreamSlot {
    budget: MemoryBudget,
}

impl fmt::Debug for StreamSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StreamSlot")
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.budget.inner.streams.fetch_sub(1, Ordering::Relaxed);
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
    /// Most bytes all sequential readers of the node plugin keep ahead together: each one's
    /// window is at most an equal share of it (between `part_size` and `max_window`), so many
    /// concurrent readers do not each grow to `max_window`. See [`PrefetchConfig::window_cap`].
    pub shared_window: u64,
    /// Random reads fetch their range rounded out to this alignment.
    pub random_align: u64,
    /// Objects up to this size are fetched whole ahead of a listing-order reader (0 disables).
    pub small_object_max: u64,
    /// Most small objects fetched ahead of one listing-order reader.
    pub small_objects_ahead: usize,
    /// Prefetched small objects not opened within this time are dropped.
    pub small_object_ttl: std::time::Duration,
    /// How long a write waits for the memory budget before its buffer goes over it: long enough
    /// for other uploads to finish a part, short enough that memory held by files only the
    /// waiting process would close (or by a paused reader's prefetch) never stops it for good.
    pub write_budget_wait: std::time::Duration,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            part_size: 8 << 20,
            initial_window: 1 << 20,
            max_window: 64 << 20,
            shared_window: 128 << 20,
            random_align: 64 << 10,
            small_object_max: 1 << 20,
            small_objects_ahead: 32,
            small_object_ttl: std::time::Duration::from_secs(10),
            write_budget_wait: std::time::Duration::from_secs(5),
        }
    }
}

impl PrefetchConfig {
    /// The largest window of one sequential reader while `streams` readers hold one: an equal
    /// share of `shared_window`, at least a part and at most `max_window` (1 or 2 readers: 64
    /// MiB each by default; 8: 16 MiB; 16 or more: 8 MiB).
    pub fn window_cap(&self, streams: u64) -> u64 {
        let share = self.shared_window / streams.max(1);
        share.max(self.part_size).min(self.max_window).max(1)
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

    /// Every kind has its own gauge: the metric's label set is exactly the kinds', in order.
    #[test]
    fn every_kind_is_a_label_of_the_metric() {
        assert_eq!(Use::ALL.map(Use::label), ferry_metrics::MEMORY_KINDS);
        for (i, u) in Use::ALL.iter().enumerate() {
            assert_eq!(*u as usize, i);
        }
    }

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

    #[test]
    fn each_kind_is_counted_and_a_charge_goes_over_the_limit() {
        let b = MemoryBudget::new(100);
        let p = b.try_reserve(30).expect("fits");
        let l = b.try_reserve_for(Use::Listing, 50).expect("fits");
        let s = b.charge(Use::Session, 40);
        assert_eq!(b.used(), 120, "a session is charged whatever the limit");
        assert_eq!(
            Use::ALL.map(|u| b.used_for(u)),
            [30, 0, 0, 50, 40, 0],
            "prefetch, write, read-ahead, listing, session, cache write"
        );
        assert!(
            b.try_reserve_for(Use::ReadAhead, 1).is_none(),
            "over: nothing else fits"
        );
        drop((p, l));
        assert_eq!(
            b.try_reserve_for(Use::ReadAhead, 60).map(|r| r.bytes()),
            Some(60)
        );
        drop(s);
        assert_eq!(b.used(), 0);
        assert_eq!(Use::ALL.map(|u| b.used_for(u)), [0; 6]);
    }

    #[test]
    fn a_readers_window_is_its_share_of_the_shared_window() {
        let c = PrefetchConfig::default();
        let mib = 1 << 20;
        let caps: Vec<u64> = [0, 1, 2, 4, 8, 16, 100]
            .map(|n| c.window_cap(n) / mib)
            .into();
        assert_eq!(caps, [64, 64, 64, 32, 16, 8, 8]);
        let b = MemoryBudget::new(100);
        let (s1, s2) = (b.join_stream(), b.clone().join_stream());
        assert_eq!(b.streams(), 2);
        drop(s1);
        drop(s2);
        assert_eq!(b.streams(), 0);
    }

    const LONG: std::time::Duration = std::time::Duration::from_secs(3600);

    #[tokio::test]
    async fn a_waiting_reservation_gets_freed_memory_and_a_cancelled_wait_leaves_nothing() {
        let b = MemoryBudget::new(100);
        let held = b.try_reserve(80).expect("fits");
        let waiter = {
            let b = b.clone();
            tokio::spawn(async move { b.reserve(50, LONG).await })
        };
        while b.try_reserve(1).is_some() {
            tokio::task::yield_now().await;
        }
        // The waiter's 50 bytes are counted against prefetch: 20 are free, none may be taken.
        assert!(b.try_reserve(20).is_none());
        drop(held);
        let got = waiter.await.unwrap();
        assert_eq!((got.bytes(), b.used()), (50, 50));

        // A wait that is given up (its future dropped) stops counting.
        let cancelled =
            tokio::time::timeout(std::time::Duration::from_millis(1), b.reserve(60, LONG));
        assert!(cancelled.await.is_err());
        assert!(b.try_reserve(50).is_some(), "nothing waits any more");
        // What does not fit in time is taken over the limit, and counted.
        drop(got);
        let over = b.reserve(1000, std::time::Duration::ZERO).await;
        assert_eq!((over.bytes(), b.used()), (1000, 1000));
        assert!(b.try_reserve(1).is_none());
        drop(over);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn a_buffer_charge_grows_and_a_copy_holds_nothing() {
        let b = MemoryBudget::new(100);
        let mut c = BufferCharge::default();
        c.grow_to(&b, 30, LONG).await;
        c.grow_to(&b, 60, LONG).await;
        c.grow_to(&b, 10, LONG).await;
        assert_eq!((c.bytes(), b.used()), (60, 60));
        let copy = c.clone();
        assert_eq!((copy.bytes(), b.used()), (0, 60));
        // Growing past what is free waits (keeping what it holds) until memory comes back.
        c.shrink_to(60);
        let other = b.try_reserve(30).expect("fits");
        let grow = tokio::spawn(async move {
            c.grow_to(&b.clone(), 90, LONG).await;
            (c, b)
        });
        tokio::task::yield_now().await;
        drop(other);
        let (mut c, b) = grow.await.unwrap();
        assert_eq!((c.bytes(), b.used()), (90, 90));
        c.release();
        assert_eq!(b.used(), 0);
    }
}
