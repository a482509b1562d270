//! The hot paths record without a lock or an allocation: a counting global allocator (this test
//! binary's own) sees no allocation in thousands of records once each series exists, and a
//! scrape running meanwhile loses none of them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use ferry_metrics::{metrics, record_fuse_op, record_s3_attempt};

struct Counting;

thread_local! {
    /// Allocations made by this thread (const-initialised, no destructor: safe in an allocator).
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is forwarded to the system allocator unchanged; counting touches only a
// thread-local Cell.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

/// One S3 attempt (two statuses, one without a response), one cache hit, one FUSE operation
/// each way, a budget reservation.
fn record(i: u64) {
    let d = Duration::from_micros(i % 20_000);
    record_s3_attempt("get", Some(200), d);
    record_s3_attempt("GetObject", Some(503), d);
    record_s3_attempt("put", None, d);
    let m = metrics();
    m.cache.lookups.inc();
    m.cache.hits.inc();
    m.cache.hit_bytes.inc_by(4096);
    record_fuse_op("read", None, d);
    record_fuse_op("lookup", Some(libc::ENOENT), d);
    m.node.memory_budget_used("prefetch").inc_by(1);
}

#[test]
fn recording_allocates_nothing_once_a_series_exists() {
    record(0); // the first of each series creates it
    const N: u64 = 10_000;
    let before = allocs();
    for i in 0..N {
        record(i);
    }
    let after = allocs();
    assert_eq!(
        after - before,
        0,
        "{} allocations in {N} rounds of hot-path records",
        after - before
    );
}

#[test]
fn a_scrape_meanwhile_loses_no_record() {
    let hits = || metrics().cache.passthrough_opens.get();
    let start = hits();
    let scraper = std::thread::spawn(|| {
        let mut n = 0;
        for _ in 0..50 {
            n += ferry_metrics::render().len();
        }
        n
    });
    for _ in 0..100_000 {
        metrics().cache.passthrough_opens.inc();
    }
    assert!(scraper.join().unwrap() > 0);
    assert_eq!(hits() - start, 100_000);
}
