//! `ferry-bench-load`: many volumes and many pods on one node plugin.
//!
//! `storm` starts versitygw behind a delay proxy (`--rtt-ms`), `ferry-controller` and a
//! `ferry-node serve` configured as the chart's defaults configure it (the node cache on,
//! `FERRY_MEMORY_LIMIT` = the container's 4 GiB limit, the memory budget 75 % of it), and then:
//! 1. `--volumes` NodePublish calls for as many volumes at once (one prefix each), and beside them
//!    one volume whose endpoint accepts connections and never answers (a hung S3 server): the
//!    others' latency must not wait for it;
//! 2. `--pods` NodePublish calls for one volume from as many pods at once;
//! 3. the node plugin's RSS with all of them mounted and idle, and after one `ls` and one file
//!    read in each;
//! 4. every volume unpublished at once, and the RSS, fds, threads and FUSE connections after.
//!
//! `soak` publishes `--mounts` volumes, runs readers and writers on all of them for `--minutes`
//! with the node plugin in a cgroup of `--limit-mib` and S3 faults injected between it and the
//! server, and samples RSS, fds, threads, FUSE connections and cache files every `--sample-secs`.
//!
//! A program to run by hand as root, never a test. See doc/BENCHMARKS.md.

mod instance;
#[allow(dead_code)] // the data-path benchmark uses all of it
mod proxy;
mod soak;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use ferry_e2e::{bin_dir, mount_capability, Plugin};
use ferry_proto::csi::v1 as pb;
use ferry_s3::S3Store;
use ferry_store::ObjectStore;
use futures::StreamExt;
use pb::volume_capability::access_mode::Mode;

pub(crate) const BUCKET: &str = "load";
/// The chart's `node.resources.limits.memory` and `node.memoryBudget`.
const CHART_LIMIT: u64 = 4 << 30;
const CHART_BUDGET: &str = "75%";

#[derive(Debug, Parser)]
#[command(about = "Mount storms, idle mounts and a soak on one ferry-node (root)")]
struct Cli {
    #[command(subcommand)]
    what: What,
    /// Round-trip time the delay proxy adds between the node plugin and S3, ms.
    #[arg(long, default_value_t = 10, global = true)]
    rtt_ms: u64,
    /// Append the tables (Markdown) to this file.
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    /// Extra environment of the node plugin (`KEY=VALUE`, repeatable): allocator tunables, logs.
    #[arg(long = "node-env", global = true)]
    node_env: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Mount storms (many volumes; one volume from many pods), idle mounts, unpublish.
    Storm {
        /// Volumes published at once.
        #[arg(long, default_value_t = 100)]
        volumes: usize,
        /// Pods publishing one volume at once.
        #[arg(long, default_value_t = 100)]
        pods: usize,
    },
    /// Readers and writers on many mounts for a long time, S3 faults injected, under a memory limit.
    Soak {
        /// Mounts (each with one reader and one writer).
        #[arg(long, default_value_t = 50)]
        mounts: usize,
        /// How long the load runs, minutes.
        #[arg(long, default_value_t = 30.0)]
        minutes: f64,
        /// The node plugin's memory limit (a memory cgroup), MiB; the budget is 75 % of it.
        #[arg(long, default_value_t = 1024)]
        limit_mib: u64,
        /// The node cache's largest size, MiB (smaller than the data, so it evicts all along).
        #[arg(long, default_value_t = 512)]
        cache_mib: u64,
        /// Seconds between samples.
        #[arg(long, default_value_t = 10)]
        sample_secs: u64,
        /// Every n-th S3 request breaks (503 SlowDown, 500, a body cut half-way, in turn).
        #[arg(long, default_value_t = 25)]
        fault_every: u64,
    },
}

/// What `/proc` says of a process.
#[derive(Debug, Clone, Copy, Default)]
struct Usage {
    rss: u64,
    anon: u64,
    fds: usize,
    threads: usize,
}

fn usage(pid: u32) -> anyhow::Result<Usage> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok(Usage {
        rss: field("VmRSS:") * 1024,
        anon: field("RssAnon:") * 1024,
        threads: field("Threads:") as usize,
        fds: std::fs::read_dir(format!("/proc/{pid}/fd"))?.count(),
    })
}

fn fuse_connections() -> usize {
    std::fs::read_dir("/sys/fs/fuse/connections")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// A TCP server that accepts connections and never answers: an S3 endpoint that hangs.
struct BlackHole {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl BlackHole {
    fn start() -> anyhow::Result<BlackHole> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(c) = conn {
                    held.push(c);
                }
            }
        });
        Ok(BlackHole { addr, stop })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = std::net::TcpStream::connect(self.addr);
    }
}

struct Published {
    target: PathBuf,
    volume_id: String,
}

/// One NodePublish: its latency, and the error if it failed.
async fn publish(
    node: &mut pb::node_client::NodeClient<tonic::transport::Channel>,
    volume_id: String,
    target: PathBuf,
    ctx: HashMap<String, String>,
    mode: Mode,
    flags: &[&str],
) -> (Duration, Result<Published, String>) {
    let t = Instant::now();
    let res = node
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: volume_id.clone(),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability(mode, flags)),
            readonly: mode == Mode::MultiNodeReaderOnly,
            volume_context: ctx,
            ..Default::default()
        })
        .await;
    let took = t.elapsed();
    (
        took,
        res.map(|_| Published { target, volume_id })
            .map_err(|s| format!("{:?}: {}", s.code(), s.message())),
    )
}

fn context(prefix: &str) -> HashMap<String, String> {
    [
        ("bucketName".to_string(), BUCKET.to_string()),
        ("prefix".to_string(), prefix.to_string()),
    ]
    .into()
}

struct Storm {
    ok: usize,
    failed: Vec<String>,
    lat: Vec<f64>,
    wall: Duration,
}

impl Storm {
    fn row(&self, what: &str) -> String {
        format!(
            "| {what} | {}/{} | {:.0} | {:.0} | {:.0} | {:.2} |\n",
            self.ok,
            self.ok + self.failed.len(),
            pct(&self.lat, 0.5) * 1e3,
            pct(&self.lat, 0.99) * 1e3,
            self.lat.last().copied().unwrap_or(f64::NAN) * 1e3,
            self.wall.as_secs_f64()
        )
    }
}

async fn storm_of(
    plugin: &Plugin,
    calls: Vec<(String, PathBuf, HashMap<String, String>, Mode)>,
    published: &mut Vec<Published>,
) -> anyhow::Result<Storm> {
    let node = plugin.node().await?;
    let t = Instant::now();
    let results: Vec<_> = futures::stream::iter(calls)
        .map(|(id, target, ctx, mode)| {
            let mut node = node.clone();
            tokio::spawn(async move { publish(&mut node, id, target, ctx, mode, &[]).await })
        })
        .buffer_unordered(usize::MAX)
        .collect()
        .await;
    let wall = t.elapsed();
    let mut storm = Storm {
        ok: 0,
        failed: Vec::new(),
        lat: Vec::new(),
        wall,
    };
    for r in results {
        let (took, res) = r?;
        storm.lat.push(took.as_secs_f64());
        match res {
            Ok(p) => {
                storm.ok += 1;
                published.push(p);
            }
            Err(e) => storm.failed.push(e),
        }
    }
    storm.lat.sort_by(f64::total_cmp);
    Ok(storm)
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("ferry-bench-load must run as root (FUSE mounts)");
    }
    let _lock = instance::single_instance_lock()?;
    if std::env::var_os("FERRY_TEST_TMPDIR").is_none() && Path::new("/dev/shm").is_dir() {
        std::env::set_var("FERRY_TEST_TMPDIR", "/dev/shm");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let mut plugin = Plugin::start(&bin_dir()?).await?;
        let res = match &cli.what {
            What::Storm { volumes, pods } => storm(&mut plugin, &cli, *volumes, *pods).await,
            What::Soak { .. } => soak::run(&mut plugin, &cli).await,
        };
        if res.is_err() {
            let log = std::fs::read_to_string(plugin.log_path("ferry-node")).unwrap_or_default();
            eprintln!("last lines of ferry-node's log:");
            let tail: Vec<_> = log.lines().rev().take(30).collect();
            for l in tail.iter().rev() {
                eprintln!("  {l}");
            }
        }
        res
    })?;
    instance::report(&report, cli.out.as_deref())
}

/// Restarts the harness's node plugin as the chart's defaults run it, S3 behind `proxy`.
async fn chart_node(
    plugin: &mut Plugin,
    cli: &Cli,
    limit: u64,
    endpoint: &str,
    also_allowed: &[String],
) -> anyhow::Result<()> {
    for kv in &cli.node_env {
        let (k, v) = kv.split_once('=').context("--node-env wants KEY=VALUE")?;
        plugin.set_env(k, v);
    }
    let cache = plugin.dir.path().join("cache");
    plugin.set_env("FERRY_CACHE_DIR", &cache.display().to_string());
    plugin.set_env("FERRY_MEMORY_LIMIT", &limit.to_string());
    plugin.set_env("FERRY_MEMORY_BUDGET", CHART_BUDGET);
    plugin.set_env("FERRY_ENDPOINT_URL", endpoint);
    let mut allowed = vec![endpoint.to_string()];
    allowed.extend(also_allowed.iter().cloned());
    plugin.set_env("FERRY_ALLOWED_ENDPOINTS", &allowed.join(","));
    plugin.signal_process("ferry-node", libc::SIGTERM)?;
    plugin.start_node()?;
    plugin.wait_node().await?;
    Ok(())
}

async fn storm(
    plugin: &mut Plugin,
    cli: &Cli,
    volumes: usize,
    pods: usize,
) -> anyhow::Result<String> {
    let upstream: SocketAddr = format!("127.0.0.1:{}", plugin.s3.port()).parse()?;
    let proxy = proxy::DelayProxy::start(upstream, Duration::from_micros(cli.rtt_ms * 500))?;
    let hole = BlackHole::start()?;
    chart_node(plugin, cli, CHART_LIMIT, &proxy.url(), &[hole.url()]).await?;
    let pid = plugin
        .pid("ferry-node")
        .context("ferry-node is not running")?;

    plugin.s3.create_bucket(BUCKET).await;
    let s3 = S3Store::new(plugin.s3.s3_config()).await?;
    let keys: Vec<String> = (0..volumes)
        .map(|v| format!("vol-{v:03}/data.bin"))
        .chain(std::iter::once("shared/data.bin".to_string()))
        .collect();
    let puts: Vec<_> = futures::stream::iter(keys)
        .map(|k| {
            let s3 = &s3;
            async move {
                s3.put(BUCKET, &k, bytes::Bytes::from(vec![7u8; 64 << 10]))
                    .await
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    puts.into_iter().collect::<Result<Vec<_>, _>>()?;

    let fuse_before = fuse_connections();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = usage(pid)?;

    // 1. Many volumes at once, and one whose S3 endpoint hangs.
    let mut published = Vec::new();
    let mut calls = Vec::new();
    for v in 0..volumes {
        let target = plugin.target_path(&format!("pod-v{v:03}"), "pv")?;
        calls.push((
            format!("load-{v:03}"),
            target,
            context(&format!("vol-{v:03}/")),
            Mode::MultiNodeMultiWriter,
        ));
    }
    let hung = {
        let node = plugin.node().await?;
        let target = plugin.target_path("pod-hung", "pv")?;
        let mut ctx = context("hung/");
        ctx.insert("endpointUrl".into(), hole.url());
        tokio::spawn(async move {
            let mut node = node;
            tokio::time::timeout(
                Duration::from_secs(120),
                publish(
                    &mut node,
                    "load-hung".into(),
                    target,
                    ctx,
                    Mode::MultiNodeMultiWriter,
                    &[],
                ),
            )
            .await
        })
    };
    let many = storm_of(plugin, calls, &mut published).await?;
    let hung = match hung.await? {
        Ok((took, Ok(p))) => {
            published.push(p);
            format!("mounted in {:.2} s", took.as_secs_f64())
        }
        Ok((took, Err(e))) => format!("refused in {:.2} s: {e}", took.as_secs_f64()),
        Err(_) => "no answer in 120 s".to_string(),
    };

    // 2. One volume from many pods at once.
    let calls = (0..pods)
        .map(|p| -> anyhow::Result<_> {
            Ok((
                "load-shared".to_string(),
                plugin.target_path(&format!("pod-s{p:03}"), "pv")?,
                context("shared/"),
                Mode::MultiNodeReaderOnly,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let shared = storm_of(plugin, calls, &mut published).await?;
    let mounts = published.len();

    tokio::time::sleep(Duration::from_secs(5)).await;
    let live = usage(pid)?;
    let fuse_live = fuse_connections();

    // 3. One `ls` and one read of the file in each mount.
    let t = Instant::now();
    let targets: Vec<PathBuf> = published.iter().map(|p| p.target.clone()).collect();
    let touched: Vec<anyhow::Result<()>> = futures::stream::iter(targets)
        .map(|t| {
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                let names = std::fs::read_dir(&t)?.count();
                if names != 1 {
                    bail!("{}: {names} entries, expected 1", t.display());
                }
                let data = std::fs::read(t.join("data.bin"))?;
                if data.len() != 64 << 10 || data.iter().any(|b| *b != 7) {
                    bail!("{}: wrong bytes", t.display());
                }
                Ok(())
            })
        })
        .buffer_unordered(16)
        .map(|r| r.map_err(anyhow::Error::from).and_then(|r| r))
        .collect()
        .await;
    let touch_took = t.elapsed();
    let touch_failed = touched.iter().filter(|r| r.is_err()).count();
    if let Some(Err(e)) = touched.iter().find(|r| r.is_err()) {
        eprintln!("a touch failed: {e:#}");
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let used = usage(pid)?;

    // 4. Everything unpublished at once.
    let node = plugin.node().await?;
    let t = Instant::now();
    let unpublished: Vec<_> = futures::stream::iter(published)
        .map(|p| {
            let mut node = node.clone();
            tokio::spawn(async move {
                node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                    volume_id: p.volume_id,
                    target_path: p.target.display().to_string(),
                })
                .await
            })
        })
        .buffer_unordered(usize::MAX)
        .collect()
        .await;
    let unpublish_took = t.elapsed();
    let unpublish_failed = unpublished
        .into_iter()
        .filter(|r| !matches!(r, Ok(Ok(_))))
        .count();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = usage(pid)?;
    let fuse_after = fuse_connections();

    let per_mount = |u: &Usage| (u.rss.saturating_sub(idle.rss)) / mounts.max(1) as u64;
    let mut r = String::new();
    r +=
        &format!(
        "Mount storm on one ferry-node (chart defaults: node cache on, FERRY_MEMORY_LIMIT 4 GiB, \
         budget 75 %), versitygw at {} ms RTT, {} CPUs, load before {}.\n\n",
        cli.rtt_ms,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim()
    );
    r +=
        "| storm | mounted | p50 ms | p99 ms | max ms | wall s |\n|---|---:|---:|---:|---:|---:|\n";
    r += &many.row(&format!("{volumes} volumes at once (+1 hung endpoint)"));
    r += &shared.row(&format!("1 volume from {pods} pods at once"));
    r += &format!("\nThe volume whose endpoint never answers: {hung}.\n\n");
    for f in many.failed.iter().chain(&shared.failed).take(5) {
        r += &format!("- failed: {f}\n");
    }
    r += "| node plugin | RSS MiB | anon MiB | per mount KiB | fds | threads | FUSE conns |\n|---|---:|---:|---:|---:|---:|---:|\n";
    let row = |what: &str, u: &Usage, conns: usize, per: Option<u64>| {
        format!(
            "| {what} | {} | {} | {} | {} | {} | {} |\n",
            mib(u.rss),
            mib(u.anon),
            per.map_or("–".to_string(), |p| format!("{:.0}", p as f64 / 1024.0)),
            u.fds,
            u.threads,
            conns
        )
    };
    r += &row("idle, no mounts", &idle, fuse_before, None);
    r += &row(
        &format!("{mounts} mounts, idle"),
        &live,
        fuse_live,
        Some(per_mount(&live)),
    );
    r += &row(
        &format!("{mounts} mounts after one ls + 64 KiB read each"),
        &used,
        fuse_live,
        Some(per_mount(&used)),
    );
    r += &row("all unpublished (+10 s)", &after, fuse_after, None);
    r += &format!(
        "\nls + read in every mount: {:.2} s, {touch_failed} failed; unpublish of all: {:.2} s, \
         {unpublish_failed} failed.\n",
        touch_took.as_secs_f64(),
        unpublish_took.as_secs_f64()
    );
    drop(proxy);
    Ok(r)
}
