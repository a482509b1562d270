//! `ferry-bench-load soak`: readers and writers on many mounts for a long time, with S3 faults
//! injected between the node plugin and the server and the node plugin in a memory cgroup.
//!
//! Every mount has one reader (whole files, large and small, checked byte for byte, and a listing
//! now and then) and one writer (a new file of 1–12 MiB, read back and checked, the oldest of its
//! files deleted). Every `--sample-secs`: the node plugin's RSS, fds and threads, the cgroup's
//! usage and OOM kills, FUSE connections and the node cache's files. At the end every volume is
//! unpublished and the process is looked at once more.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry_e2e::Plugin;
use ferry_proto::csi::v1 as pb;
use ferry_s3::S3Store;
use ferry_store::ObjectStore;
use ferry_testkit::fault_proxy::{Fault, FaultPlan, FaultProxy};
use futures::StreamExt;
use pb::volume_capability::access_mode::Mode;

use super::{chart_node, context, fuse_connections, mib, publish, usage, Cli, Usage, What, BUCKET};

const LARGE: usize = 8 << 20;
const LARGE_FILES: usize = 3;
const SMALL: usize = 64 << 10;
const SMALL_FILES: usize = 16;

/// Deterministic contents: a file's bytes follow from its name.
fn content(name: &str, len: usize) -> Vec<u8> {
    let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    ferry_e2e::payload(seed, len).into()
}

/// A v1 memory cgroup holding the node plugin (this machine's kernel mounts cgroup v1; v2 too).
struct Cgroup(PathBuf);

impl Cgroup {
    fn create(limit: u64) -> anyhow::Result<Cgroup> {
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        let base = if v2 {
            PathBuf::from("/sys/fs/cgroup")
        } else {
            PathBuf::from("/sys/fs/cgroup/memory")
        };
        let dir = base.join(format!("ferry-soak-{}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let cg = Cgroup(dir);
        let limit_file = if v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        std::fs::write(cg.0.join(limit_file), limit.to_string())?;
        Ok(cg)
    }

    fn add(&self, pid: u32) -> anyhow::Result<()> {
        std::fs::write(self.0.join("cgroup.procs"), pid.to_string())
            .context("moving ferry-node into the cgroup")
    }

    fn read(&self, v1: &str, v2: &str) -> u64 {
        std::fs::read_to_string(self.0.join(v1))
            .or_else(|_| std::fs::read_to_string(self.0.join(v2)))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Usage now (RSS, and page cache of files the process wrote: the node cache).
    fn usage(&self) -> u64 {
        self.read("memory.usage_in_bytes", "memory.current")
    }

    fn peak(&self) -> u64 {
        self.read("memory.max_usage_in_bytes", "memory.peak")
    }

    /// OOM kills in the cgroup (v1 `memory.oom_control`'s `oom_kill`, v2 `memory.events`').
    fn oom_kills(&self) -> u64 {
        ["memory.oom_control", "memory.events"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(self.0.join(f)).ok())
            .flat_map(|s| {
                s.lines()
                    .filter_map(|l| l.strip_prefix("oom_kill "))
                    .filter_map(|v| v.trim().parse::<u64>().ok())
                    .collect::<Vec<_>>()
            })
            .sum()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Whatever is left in it moves back to the root, then the group goes.
        if let Ok(procs) = std::fs::read_to_string(self.0.join("cgroup.procs")) {
            let root = self
                .0
                .parent()
                .expect("under the hierarchy")
                .join("cgroup.procs");
            for pid in procs.lines() {
                let _ = std::fs::write(&root, pid);
            }
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    written_bytes: AtomicU64,
    listings: AtomicU64,
    /// Operations that failed (an errno), by under faults: S3 retries should hide nearly all.
    errors: AtomicU64,
    /// Bytes that differed from what was written: must stay 0.
    wrong: AtomicU64,
}

fn reader(target: PathBuf, vol: usize, stop: Arc<AtomicBool>, c: Arc<Counters>) {
    let mut i = vol;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let (name, len) = if i.is_multiple_of(4) {
            (format!("large-{}.bin", i / 4 % LARGE_FILES), LARGE)
        } else {
            (format!("small-{:02}.bin", i % SMALL_FILES), SMALL)
        };
        match std::fs::read(target.join(&name)) {
            Ok(data) => {
                c.reads.fetch_add(1, Ordering::Relaxed);
                c.read_bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                if data != content(&format!("vol-{vol:03}/{name}"), len) {
                    c.wrong.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                if c.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!("read {name}: {e}");
                }
            }
        }
        if i.is_multiple_of(50) {
            match std::fs::read_dir(&target).map(|d| d.count()) {
                Ok(_) => c.listings.fetch_add(1, Ordering::Relaxed),
                Err(_) => c.errors.fetch_add(1, Ordering::Relaxed),
            };
        }
    }
}

fn writer(target: PathBuf, vol: usize, stop: Arc<AtomicBool>, c: Arc<Counters>) {
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let name = format!("w-{n:06}.bin");
        let len = (1 + (vol * 7 + n * 13) % 12) << 20;
        let data = content(&format!("{vol}/{name}"), len);
        let path = target.join(&name);
        let res = std::fs::write(&path, &data).and_then(|()| std::fs::read(&path));
        match res {
            Ok(back) => {
                c.writes.fetch_add(1, Ordering::Relaxed);
                c.written_bytes.fetch_add(len as u64, Ordering::Relaxed);
                if back != data {
                    c.wrong.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                if c.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!("write {name}: {e}");
                }
            }
        }
        if n > 3 {
            let old = target.join(format!("w-{:06}.bin", n - 3));
            if let Err(e) = std::fs::remove_file(old) {
                if c.errors.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!("remove: {e}");
                }
            }
        }
    }
}

fn count_files(dir: &Path) -> (u64, u64) {
    let mut stack = vec![dir.to_path_buf()];
    let (mut files, mut bytes) = (0, 0);
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => {
                    files += 1;
                    bytes += m.len();
                }
                Err(_) => {}
            }
        }
    }
    (files, bytes)
}

struct Sample {
    at: Duration,
    u: Usage,
    cgroup: u64,
    conns: usize,
    cache_files: u64,
    cache_bytes: u64,
    reads: u64,
    writes: u64,
}

pub async fn run(plugin: &mut Plugin, cli: &Cli) -> anyhow::Result<String> {
    let What::Soak {
        mounts,
        minutes,
        limit_mib,
        cache_mib,
        sample_secs,
        fault_every,
    } = cli.what
    else {
        unreachable!("soak::run runs the soak")
    };
    let limit = limit_mib << 20;
    let proxy = FaultProxy::start(([127, 0, 0, 1], plugin.s3.port()).into())?;
    plugin.set_env("FERRY_CACHE_MAX_SIZE", &format!("{cache_mib}MiB"));
    chart_node(plugin, cli, limit, &proxy.url(), &[]).await?;
    let pid = plugin
        .pid("ferry-node")
        .context("ferry-node is not running")?;
    let cgroup = Cgroup::create(limit)?;
    cgroup.add(pid)?;
    let cache_dir = plugin.dir.path().join("cache");

    plugin.s3.create_bucket(BUCKET).await;
    let s3 = S3Store::new(plugin.s3.s3_config()).await?;
    let mut keys = Vec::new();
    for vol in 0..mounts {
        for f in 0..LARGE_FILES {
            keys.push((format!("vol-{vol:03}/large-{f}.bin"), LARGE));
        }
        for f in 0..SMALL_FILES {
            keys.push((format!("vol-{vol:03}/small-{f:02}.bin"), SMALL));
        }
    }
    let puts: Vec<_> = futures::stream::iter(keys)
        .map(|(k, len)| {
            let s3 = &s3;
            async move { s3.put(BUCKET, &k, content(&k, len).into()).await }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    puts.into_iter().collect::<Result<Vec<_>, _>>()?;

    let before = usage(pid)?;
    let conns_before = fuse_connections();
    let mut node = plugin.node().await?;
    let mut targets = Vec::new();
    for vol in 0..mounts {
        let target = plugin.target_path(&format!("pod-{vol:03}"), "pv")?;
        let (_, res) = publish(
            &mut node,
            format!("soak-{vol:03}"),
            target,
            context(&format!("vol-{vol:03}/")),
            Mode::MultiNodeMultiWriter,
            &["allow-delete"],
        )
        .await;
        let p = res.map_err(anyhow::Error::msg)?;
        targets.push((p.volume_id, p.target));
    }
    proxy.set_plan(Some(FaultPlan {
        methods: ["GET", "PUT", "POST", "HEAD", "DELETE"]
            .iter()
            .map(|m| m.to_string())
            .collect(),
        faults: vec![Fault::SlowDown, Fault::InternalError, Fault::CutBody],
        every: fault_every,
        ranged_only: false,
    }));

    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let mut threads = Vec::new();
    for (vol, (_, target)) in targets.iter().enumerate() {
        for role in [
            reader as fn(PathBuf, usize, Arc<AtomicBool>, Arc<Counters>),
            writer,
        ] {
            let (t, s, c) = (target.clone(), stop.clone(), counters.clone());
            threads.push(std::thread::spawn(move || role(t, vol, s, c)));
        }
    }

    let started = Instant::now();
    let run_for = Duration::from_secs_f64(minutes * 60.0);
    let mut samples = Vec::new();
    while started.elapsed() < run_for {
        tokio::time::sleep(Duration::from_secs(sample_secs)).await;
        let u = match usage(pid) {
            Ok(u) => u,
            Err(e) => bail!(
                "ferry-node is gone ({e:#}); OOM kills: {}",
                cgroup.oom_kills()
            ),
        };
        let (cache_files, cache_bytes) = count_files(&cache_dir);
        samples.push(Sample {
            at: started.elapsed(),
            u,
            cgroup: cgroup.usage(),
            conns: fuse_connections(),
            cache_files,
            cache_bytes,
            reads: counters.reads.load(Ordering::Relaxed),
            writes: counters.writes.load(Ordering::Relaxed),
        });
        let s = samples.last().expect("pushed");
        eprintln!(
            "[soak {:>5.1} min] RSS {} MiB, cgroup {} MiB, fds {}, threads {}, reads {}, writes {}, errors {}, wrong {}",
            s.at.as_secs_f64() / 60.0,
            mib(s.u.rss),
            mib(s.cgroup),
            s.u.fds,
            s.u.threads,
            s.reads,
            s.writes,
            counters.errors.load(Ordering::Relaxed),
            counters.wrong.load(Ordering::Relaxed),
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    proxy.set_plan(None);
    let injected = proxy.injected().len();
    let loaded = usage(pid)?;
    for (volume_id, target) in &targets {
        node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: volume_id.clone(),
            target_path: target.display().to_string(),
        })
        .await
        .with_context(|| format!("unpublishing {volume_id}"))?;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = usage(pid)?;
    let conns_after = fuse_connections();
    let (cache_files, cache_bytes) = count_files(&cache_dir);

    let c = &counters;
    let warm = samples
        .iter()
        .position(|s| s.at >= Duration::from_secs(300))
        .unwrap_or(samples.len() / 4);
    let peak_rss = samples.iter().map(|s| s.u.rss).max().unwrap_or(0);
    let after_warm = &samples[warm.min(samples.len().saturating_sub(1))..];
    let (lo, hi) = (
        after_warm.iter().map(|s| s.u.rss).min().unwrap_or(0),
        after_warm.iter().map(|s| s.u.rss).max().unwrap_or(0),
    );
    let mut r = format!(
        "Soak: {mounts} mounts × (1 reader + 1 writer) for {minutes} min on one ferry-node in a \
         {limit_mib} MiB memory cgroup (FERRY_MEMORY_LIMIT the same, budget 75 %), node cache \
         {cache_mib} MiB, every {fault_every}th S3 request broken (503, 500, body cut; {injected} \
         injected), {} CPUs.\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    r += &format!(
        "Reads {} ({} MiB), writes {} ({} MiB) read back, listings {}; failed operations {}, \
         wrong bytes {}; OOM kills {}.\n\n",
        c.reads.load(Ordering::Relaxed),
        c.read_bytes.load(Ordering::Relaxed) >> 20,
        c.writes.load(Ordering::Relaxed),
        c.written_bytes.load(Ordering::Relaxed) >> 20,
        c.listings.load(Ordering::Relaxed),
        c.errors.load(Ordering::Relaxed),
        c.wrong.load(Ordering::Relaxed),
        cgroup.oom_kills()
    );
    r += "| at min | RSS MiB | cgroup MiB | fds | threads | FUSE conns | cache files | cache MiB | reads | writes |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    let every = (samples.len() / 12).max(1);
    for (i, s) in samples.iter().enumerate() {
        if i % every == 0 || i + 1 == samples.len() {
            r += &format!(
                "| {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                s.at.as_secs_f64() / 60.0,
                mib(s.u.rss),
                mib(s.cgroup),
                s.u.fds,
                s.u.threads,
                s.conns,
                s.cache_files,
                mib(s.cache_bytes),
                s.reads,
                s.writes
            );
        }
    }
    r += &format!(
        "\nPeak RSS {} MiB of the {limit_mib} MiB limit ({:.0} %); cgroup peak {} MiB. After \
         warm-up (from {:.1} min) RSS stayed within {}–{} MiB.\n\n",
        mib(peak_rss),
        peak_rss as f64 * 100.0 / limit as f64,
        mib(cgroup.peak()),
        after_warm
            .first()
            .map_or(0.0, |s| s.at.as_secs_f64() / 60.0),
        mib(lo),
        mib(hi)
    );
    r += "| node plugin | RSS MiB | fds | threads | FUSE conns |\n|---|---:|---:|---:|---:|\n";
    r += &format!(
        "| before the mounts | {} | {} | {} | {conns_before} |\n",
        mib(before.rss),
        before.fds,
        before.threads
    );
    r += &format!(
        "| end of the load, {mounts} mounts | {} | {} | {} | – |\n",
        mib(loaded.rss),
        loaded.fds,
        loaded.threads
    );
    r += &format!(
        "| all unpublished (+10 s) | {} | {} | {} | {conns_after} |\n",
        mib(after.rss),
        after.fds,
        after.threads
    );
    r += &format!(
        "\nNode cache after: {cache_files} files, {} MiB (limit {cache_mib} MiB).\n",
        mib(cache_bytes)
    );
    Ok(r)
}
