//! `ferry-bench-metrics`: what recording a metric costs on Ferry's hot paths, before (the
//! hand-written registry of f2ed9b3, kept in `old_registry.rs` as the baseline) and now
//! (prometheus-client with pre-created handles): ns and heap allocations per record, one thread
//! and four threads at once.
//!
//!     cargo run --release -p ferry-bench --bin ferry-bench-metrics [-- ROUNDS]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod old_registry;

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
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

/// (ns per record, allocations per record) of `f` over `n` records on each of `threads`.
fn measure(threads: usize, n: u64, f: fn(u64)) -> (f64, f64) {
    for i in 0..1000 {
        f(i); // series created, caches warm
    }
    let a0 = ALLOCS.load(Ordering::Relaxed);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(move || {
                for i in 0..n {
                    f(i);
                }
            });
        }
    });
    let el = t.elapsed();
    let a = ALLOCS.load(Ordering::Relaxed) - a0;
    // Wall time per record of one thread: contention shows as a larger figure.
    (
        el.as_nanos() as f64 / n as f64,
        a as f64 / (n * threads as u64) as f64,
    )
}

fn d(i: u64) -> Duration {
    Duration::from_micros(i % 20_000)
}

const FUSE_OPS: [&str; 3] = ["lookup", "read", "getattr"];

/// The old FUSE path: each operation's counter and histogram, looked up once (as fuse.rs did).
type OldSeries = (
    std::sync::Arc<old_registry::Counter>,
    std::sync::Arc<old_registry::Histogram>,
);
static OLD_FUSE: std::sync::OnceLock<std::collections::HashMap<&'static str, OldSeries>> =
    std::sync::OnceLock::new();

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let old = old_registry::global;
    let old_fuse: std::collections::HashMap<&str, _> = FUSE_OPS
        .iter()
        .map(|&op| {
            let r = old();
            let c = r.counter("ferry_fuse_operations_total", "", &[("op", op)]);
            let h = r.histogram("ferry_fuse_operation_duration_seconds", "", &[("op", op)]);
            (op, (c, h))
        })
        .collect();
    let _ = OLD_FUSE.set(old_fuse);

    type Case = (&'static str, fn(u64), fn(u64));
    let cases: [Case; 3] = [
        (
            "cache hit (hits + hit bytes)",
            |i| {
                let r = old_registry::global();
                r.counter("ferry_cache_hits_total", "", &[]).inc();
                r.counter("ferry_cache_hit_bytes_total", "", &[])
                    .add(i & 4095);
            },
            |i| {
                let c = &ferry_metrics::metrics().cache;
                c.hits.inc();
                c.hit_bytes.inc_by(i & 4095);
            },
        ),
        (
            "S3 request (count + latency)",
            |i| {
                let r = old_registry::global();
                let op = if i % 2 == 0 { "get" } else { "head" };
                r.histogram("ferry_s3_request_duration_seconds", "", &[("op", op)])
                    .observe(d(i));
                r.counter(
                    "ferry_s3_requests_total",
                    "",
                    &[("op", op), ("result", "ok")],
                )
                .inc();
            },
            |i| {
                let op = if i % 2 == 0 { "get" } else { "head" };
                ferry_metrics::record_s3_attempt(op, Some(200), d(i));
            },
        ),
        (
            "FUSE operation (count + latency)",
            |i| {
                let op = FUSE_OPS[(i % 3) as usize];
                let (c, h) = &OLD_FUSE.get().unwrap()[op];
                c.inc();
                h.observe(d(i));
            },
            |i| {
                let op = FUSE_OPS[(i % 3) as usize];
                ferry_metrics::record_fuse_op(op, None, d(i));
            },
        ),
    ];
    println!("{n} records per thread; ns = wall time per record of one thread\n");
    println!("| hot path | threads | before ns | before allocs | after ns | after allocs | before / after |");
    println!("|---|---|---|---|---|---|---|");
    for threads in [1, 4] {
        for (name, before, after) in cases {
            let (bn, ba) = measure(threads, n, before);
            let (an, aa) = measure(threads, n, after);
            println!(
                "| {name} | {threads} | {bn:.1} | {ba:.2} | {an:.1} | {aa:.2} | {:.1}x |",
                bn / an
            );
        }
    }
    let t = Instant::now();
    let text = ferry_metrics::render();
    println!(
        "\nscrape (after): {} bytes in {:?}; it reads atomics and blocks no recorder",
        text.len(),
        t.elapsed()
    );
}
