//! glibc malloc tuned for a process that holds many FUSE sessions and returns memory after storms.
//!
//! Measured with `ferry-bench-load storm` (doc/BENCHMARKS.md, issue 16): each FUSE session
//! allocates a 16 MiB + 4 KiB request buffer (fuser's `FuseReadBuf`, `vec![0; …]`). glibc serves
//! that from `mmap` only while its mmap threshold is below it, and the threshold is *dynamic*: the
//! first such buffer freed raises it to 16 MiB + 4 KiB, and from then on every session's buffer
//! comes from a heap arena, where `calloc` must zero all 16 MiB. 200 mounts cost 1.7 GiB of RSS
//! (8.8 MiB each), the zeroing was most of a publish's latency in a storm, and 1.1 GiB stayed
//! resident after every volume was unpublished. With the threshold fixed at 16 MiB, the buffer is
//! a fresh mapping whose pages the kernel fills only as requests arrive (a few KiB on an idle
//! mount) and `munmap` returns it whole at unmount.
//!
//! The data path's buffers (4 MiB cache blocks, prefetch parts of at most 8 MiB, write parts of a
//! part and a write) stay below the threshold, in the heap, as they already were once the dynamic
//! threshold had risen. A 1 MiB threshold, which also hands every freed part back at once, cost
//! 30 % of a 1 GiB sequential read (`ferry-bench --only P1`, 426–478 against 594–675 MiB/s, same
//! run): each part was a fresh mapping, faulted in page by page and unmapped again. There is one
//! arena (glibc's default is 8 per CPU: 512 on a 64-CPU node, each keeping its own free memory):
//! freed parts and blocks are then reused for the next ones wherever the thread that frees or
//! allocates them runs. Measured with `ferry-bench --only P7,P13` (8 readers of 256 MiB objects,
//! versitygw, 10 ms), peak RSS: 4 arenas 269–279 MiB, 2 arenas 251–257, 1 arena 214–236, with P7's
//! throughput unchanged (1,385–1,426 MiB/s against 1,459–1,463) and P1, P4, P12 within the noise;
//! with 4 arenas 135 MiB stayed resident after every part was freed. Small allocations come from
//! glibc's per-thread cache, without the arena's lock. [`trim`] hands free heap pages back after a
//! burst (called when mounts end).
//!
//! An operator's `MALLOC_MMAP_THRESHOLD_` / `MALLOC_ARENA_MAX` (or `GLIBC_TUNABLES`) wins.

/// Allocations of at least this size are their own mappings.
pub const MMAP_THRESHOLD: usize = 16 << 20;

/// Most arenas (glibc: 8 × CPUs by default).
pub const ARENA_MAX: usize = 1;

/// Applies [`MMAP_THRESHOLD`] and [`ARENA_MAX`] unless the environment sets them. Call first in
/// `main`, before any thread exists.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |env: &str, tunable: &str| {
            std::env::var_os(env).is_some()
                || std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains(tunable))
        };
        // SAFETY: mallopt only changes allocator parameters; it is called before other threads.
        unsafe {
            if !set("MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold") {
                libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
            }
            if !set("MALLOC_ARENA_MAX", "glibc.malloc.arena_max") {
                libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX as libc::c_int);
            }
        }
    }
}

/// Returns free heap memory to the system (every arena, not just the top of the main heap).
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

static TRIM_WANTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks [`trimmer`] to [`trim`] soon (a mount ended: its buffers, tables and listings are free).
pub fn trim_soon() {
    TRIM_WANTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Trims at most every [`TRIM_EVERY`] when asked to, and every minute regardless (what a burst
/// of reads freed), on a blocking thread. Runs until the process ends.
pub async fn trimmer() {
    let mut since = 0u32;
    loop {
        tokio::time::sleep(TRIM_EVERY).await;
        since += 1;
        if TRIM_WANTED.swap(false, std::sync::atomic::Ordering::Relaxed) || since >= 30 {
            since = 0;
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    }
}

/// How often [`trimmer`] looks whether a trim was asked for.
pub const TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
