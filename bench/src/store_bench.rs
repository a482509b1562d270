//! `ferry-bench-store`: what the node cache's writers pay per stored block when the cache is full
//! and evicting, as a node cache is for most of a long job.
//!
//! It opens a real [`BlockCache`] in a new directory on the local disk (`--dir`, default under
//! `/var/tmp`) with room for `--keep` blocks, and offers it `--blocks` new blocks of `--block-kib`
//! each (what a reader's fill does), paced so that none is dropped for a full write queue. Past
//! `--keep`, every block stored evicts (deletes) the oldest. It does this `--passes` times, each
//! pass with new keys, back to back in the same cache, and prints per pass the process's CPU
//! (the writer threads are in it) and wall time per stored block, and the whole machine's busy
//! CPU meanwhile (the kernel writes the filesystem's metadata back from its own threads; each pass
//! ends with a `syncfs`, so its writeback is in the pass).
//!
//! The ceiling row is the same bytes written with `O_DIRECT` into one preallocated file on the
//! same disk, one `pwrite` a block (what the data alone costs, without a file per block).
//!
//! Why passes: on ext4 without a journal, a new file's inode skips every free inode of its block
//! group whose file was deleted in the last minutes (`recently_deleted`, `fs/ext4/ialloc.c`), so
//! what a pass costs depends on what was deleted near its files before. On the benchmark VM the
//! passes of one run cost the same, and a run made seconds after another paid for the other's
//! deletions (the work directory is deleted at the end of a run, as a node's cache files are by
//! eviction): run it several times in a row.
//!
//! A program to run by hand (no root needed), never a test.

#[allow(dead_code)] // shared with ferry-bench, which uses the rest
#[path = "cpu.rs"]
mod cpu;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Parser;
use ferry_cache::{BlockCache, BlockKey, CacheConfig};

#[derive(Debug, Parser)]
#[command(about = "The node cache's cost per stored block while it evicts (ferry-cache writers)")]
struct Cli {
    /// Bytes of each block, in KiB (a small dataset file is one block of its size).
    #[arg(long, default_value_t = 128)]
    block_kib: u64,
    /// Blocks stored per pass.
    #[arg(long, default_value_t = 12_000)]
    blocks: u64,
    /// Blocks the cache has room for (past it, each block stored evicts one).
    #[arg(long, default_value_t = 2_000)]
    keep: u64,
    /// Passes, back to back in the same cache, each with new keys.
    #[arg(long, default_value_t = 2)]
    passes: u32,
    /// Parent of the work directory (the cache), on the disk to measure.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

/// The ceiling: `n` blocks of `len` bytes written with `O_DIRECT` into one file, at `keep`
/// offsets in turn (so it takes the disk space of the cache, not of every block).
fn ceiling(path: &std::path::Path, n: u64, len: u64, keep: u64) -> anyhow::Result<Pass> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let layout = std::alloc::Layout::from_size_align(len as usize, 4096)?;
    // SAFETY: the layout's size is not zero (`main` refuses a block of 0 KiB).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `ptr` points to `len` zeroed bytes allocated above, freed below.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) };
    let run = || -> anyhow::Result<Pass> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .with_context(|| format!("{} with O_DIRECT", path.display()))?;
        f.set_len(keep * len)?;
        for i in 0..keep {
            f.write_all_at(buf, i * len)?;
        }
        f.sync_all()?;
        let (cpu0, machine0, t0) = (cpu_seconds(), machine_busy_seconds(), Instant::now());
        for i in 0..n {
            f.write_all_at(buf, (i % keep) * len)?;
        }
        f.sync_all()?;
        Ok(Pass {
            stored: n,
            evicted: 0,
            wall: t0.elapsed(),
            cpu: cpu_seconds() - cpu0,
            machine: machine_busy_seconds() - machine0,
        })
    };
    let out = run();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    let _ = std::fs::remove_file(path);
    out
}

/// CPU seconds (user + system) of this process, its threads (the cache's writers) included.
fn cpu_seconds() -> f64 {
    cpu::process("self").unwrap_or(0.0)
}

/// Seconds the whole machine's CPUs were busy ([`cpu::machine`]): the kernel writes the
/// filesystem's metadata back from its own threads, not from this process.
fn machine_busy_seconds() -> f64 {
    cpu::machine().0
}

/// `syncfs(2)` of the filesystem holding `dir`.
fn syncfs(dir: &std::path::Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(dir)?;
    // SAFETY: syncfs takes a descriptor `d` owns, open for the call.
    if unsafe { libc::syncfs(d.as_raw_fd()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("syncfs");
    }
    Ok(())
}

struct Pass {
    stored: u64,
    evicted: u64,
    wall: Duration,
    cpu: f64,
    /// The whole machine's busy CPU meanwhile.
    machine: f64,
}

async fn pass(cache: &Arc<BlockCache>, n: u32, cli: &Cli, data: &Bytes) -> anyhow::Result<Pass> {
    let before = cache.stats();
    syncfs(&cli.dir)?;
    let (cpu0, machine0, t0) = (cpu_seconds(), machine_busy_seconds(), Instant::now());
    for i in 0..cli.blocks {
        // Offered as a fill is: wait for room in the write queue rather than have it dropped.
        loop {
            let (queued, max) = cache.write_backlog();
            if queued + data.len() as u64 <= max {
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let key = BlockKey {
            endpoint: "http://bench".into(),
            bucket: "bench".into(),
            key: format!("pass-{n}/file-{i:07}"),
            etag: "\"bench\"".into(),
            index: 0,
        };
        cache.offer(key, data.clone());
    }
    cache.settle().await;
    // The filesystem's metadata (and any data written through the page cache) to the disk now,
    // so that the pass pays for its writeback.
    syncfs(&cli.dir)?;
    let (wall, cpu) = (t0.elapsed(), cpu_seconds() - cpu0);
    let after = cache.stats();
    Ok(Pass {
        stored: after.stored - before.stored,
        evicted: after.evictions - before.evictions,
        wall,
        cpu,
        machine: machine_busy_seconds() - machine0,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let work = tempfile::Builder::new()
        .prefix("ferry-bench-store-")
        .tempdir_in(&cli.dir)
        .with_context(|| format!("a work directory in {}", cli.dir.display()))?;
    if cli.block_kib == 0 || cli.blocks == 0 || cli.keep == 0 {
        bail!("--block-kib, --blocks and --keep must be at least 1");
    }
    let block = cli.block_kib << 10;
    // A block file is its data plus a trailer of under 1 KiB (key, crcs): room for `keep` of them.
    let max_size = cli.keep * (block + 1024);
    // Each offered block is one object's only block (a small file), of the cache's block size or
    // shorter.
    let block_size = block
        .next_power_of_two()
        .clamp(ferry_cache::MIN_BLOCK_SIZE, ferry_cache::MAX_BLOCK_SIZE);
    if block > block_size {
        bail!("--block-kib: at most {} KiB", block_size >> 10);
    }
    let cache = BlockCache::open(CacheConfig {
        block_size,
        ..CacheConfig::new(work.path().join("cache"), max_size)
    })?;
    cache.ready().await;
    let data = Bytes::from(
        (0..block)
            .map(|i| (i * 31 % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    println!(
        "ferry-bench-store: {} blocks of {} KiB a pass, room for {}, in {} (ferry-cache {})",
        cli.blocks,
        cli.block_kib,
        cli.keep,
        work.path().display(),
        env!("CARGO_PKG_VERSION")
    );
    println!();
    let ceiling = ceiling(&work.path().join("ceiling"), cli.blocks, block, cli.keep)?;
    let ceiling_per = ceiling.cpu / ceiling.stored as f64;
    println!("| pass | stored | evicted | wall (s) | blocks/s | CPU (s) | CPU per block (ms) | CPU / ceiling's | machine's busy CPU (s) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let row = |name: &str, p: &Pass| {
        let per = p.cpu / p.stored as f64;
        // CPU time is counted in clock ticks: a short ceiling may count none.
        let ratio = if ceiling_per > 0.0 {
            format!("{:.1}", per / ceiling_per)
        } else {
            "—".to_owned()
        };
        println!(
            "| {name} | {} | {} | {:.2} | {:.0} | {:.2} | {:.3} | {ratio} | {:.2} |",
            p.stored,
            p.evicted,
            p.wall.as_secs_f64(),
            p.stored as f64 / p.wall.as_secs_f64(),
            p.cpu,
            per * 1e3,
            p.machine
        );
    };
    row("ceiling (one file, O_DIRECT)", &ceiling);
    for n in 1..=cli.passes {
        let p = pass(&cache, n, &cli, &data).await?;
        if p.stored != cli.blocks {
            bail!("pass {n}: {} of {} blocks stored", p.stored, cli.blocks);
        }
        row(&n.to_string(), &p);
    }
    drop(cache);
    Ok(())
}
