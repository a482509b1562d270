//! `ferry-bench-takeover`: the pause a node plugin takeover causes on live mounts.
//!
//! Starts versitygw (data on `/dev/shm`), `ferry-fd-holder` and a `ferry-node serve` with the
//! e2e harness's [`Plugin`], publishes `--volumes` volumes (one prefix of one bucket each, one
//! object per prefix), and starts one reader per mount in a process of its own (a process holding
//! files open on a mount must not be the one that starts the next node plugin: `exec` closes its
//! files, and their FLUSH would wait on the very process being started). Each reader reads its
//! object over and over with `O_DIRECT` (so that every `read` is one FUSE READ, never the page
//! cache) and records every read's start and latency on `CLOCK_MONOTONIC`.
//!
//! Then `--handovers` graceful handovers (a second `ferry-node serve` takes the mounts and the
//! first exits) and `--kills` `kill -9` + restart recoveries (through the fd holder), `--settle`
//! seconds apart. For each, the time from "successor started" (or "kill") to "the new process
//! answers Probe" — the time to take over every mount — and, from the reads, the latency of the
//! reads that overlapped the event and of those in the `--tail` seconds after it, against the same
//! run's other reads (the baseline), and each mount's longest read in each event (its stall). The
//! node plugin's own log lines break each pause down.
//!
//! A program to run by hand as root, never a test. See doc/BENCHMARKS.md.

mod instance;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use ferry_e2e::{bin_dir, mount_capability, Plugin};
use ferry_proto::csi::v1 as pb;
use ferry_s3::S3Store;
use ferry_store::ObjectStore;
use pb::volume_capability::access_mode::Mode;

const BUCKET: &str = "takeover";
const OBJECT: &str = "data.bin";
const MIB: usize = 1 << 20;
/// `O_DIRECT` buffers are aligned to this.
const ALIGN: usize = 4096;
/// A record's latency field has this bit set when the read failed or returned wrong bytes.
const FAILED: u64 = 1 << 63;

#[derive(Debug, Parser)]
#[command(
    about = "The pause a ferry-node handover or kill -9 recovery causes on live mounts (root)"
)]
struct Cli {
    #[command(subcommand)]
    load: Option<Load>,
    /// Volumes published (each its own mount and reader).
    #[arg(long, default_value_t = 50)]
    volumes: usize,
    /// Size of each volume's object, MiB.
    #[arg(long, default_value_t = 64)]
    object_mib: usize,
    /// Size of each read, KiB.
    #[arg(long, default_value_t = 128)]
    read_kib: usize,
    /// Graceful handovers.
    #[arg(long, default_value_t = 10)]
    handovers: u32,
    /// `kill -9` + restart recoveries.
    #[arg(long, default_value_t = 10)]
    kills: u32,
    /// Seconds of reading before the first event and after each.
    #[arg(long, default_value_t = 5.0)]
    settle: f64,
    /// Reads starting this many seconds after a takeover count as its tail, not as the baseline.
    #[arg(long, default_value_t = 2.0)]
    tail: f64,
    /// Append the tables (Markdown) to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Copy the node plugin's and the holder's logs into this directory.
    #[arg(long)]
    keep_logs: Option<PathBuf>,
    /// Run the node plugin without its node cache (the chart turns it on).
    #[arg(long)]
    no_cache: bool,
}

#[derive(Debug, Subcommand)]
enum Load {
    /// (internal) The readers: one thread per target until stdin closes, then the records to `--out`.
    #[command(hide = true)]
    Readers {
        #[arg(long)]
        read_kib: usize,
        #[arg(long)]
        object_mib: usize,
        #[arg(long)]
        out: PathBuf,
        /// Mount targets, in volume order.
        targets: Vec<PathBuf>,
    },
}

/// `CLOCK_MONOTONIC` in nanoseconds: the one clock this process and the readers' share.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The 8-byte word at `offset` (a multiple of 8) of volume `vol`'s object: every read is checked.
fn word(vol: usize, offset: u64) -> u64 {
    ((vol as u64) << 48) ^ offset ^ 0x5bd1_e995
}

fn content(vol: usize, size: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(size);
    for off in (0..size as u64).step_by(8) {
        v.extend_from_slice(&word(vol, off).to_le_bytes());
    }
    v
}

/// A zeroed buffer of `len` bytes aligned for `O_DIRECT`.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let layout = std::alloc::Layout::from_size_align(len, ALIGN).expect("buffer layout");
        // SAFETY: the layout has a non-zero size (reads are at least 1 KiB).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Aligned { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `layout.size()` initialised bytes that only `self` owns.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// One reader: `O_DIRECT` reads of `read` bytes through the object, from the start again at its
/// end, each recorded as (start ns, latency ns | FAILED).
fn reader(
    vol: usize,
    path: PathBuf,
    read: usize,
    size: u64,
    started: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Vec<[u64; 2]>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut buf = Aligned::new(read);
    let buf = buf.as_mut();
    let mut records = Vec::with_capacity(1 << 16);
    let mut off = 0u64;
    let mut first = true;
    while !stop.load(Ordering::Relaxed) {
        let t = mono_ns();
        let r = file.read_at(buf, off);
        let lat = mono_ns() - t;
        let ok = match r {
            Ok(n) if n > 0 => {
                let got = u64::from_le_bytes(buf[..8].try_into().expect("8 bytes"));
                let ok = got == word(vol, off);
                off += n as u64;
                ok
            }
            Ok(_) => false,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(1));
                false
            }
        };
        if off >= size {
            off = 0;
        }
        records.push([t, if ok { lat } else { lat | FAILED }]);
        if first {
            first = false;
            started.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(records)
}

/// `ferry-bench-takeover readers`: prints `ready` once every reader has read once, runs until
/// stdin closes, then writes to `out`, reader after reader in volume order, the number of records
/// and the records (little endian u64s).
fn run_readers(
    read_kib: usize,
    object_mib: usize,
    out: PathBuf,
    targets: Vec<PathBuf>,
) -> anyhow::Result<()> {
    let started = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = targets
        .iter()
        .enumerate()
        .map(|(vol, t)| {
            let (path, started, stop) = (t.join(OBJECT), started.clone(), stop.clone());
            let size = (object_mib * MIB) as u64;
            std::thread::spawn(move || reader(vol, path, read_kib << 10, size, started, stop))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while started.load(Ordering::Relaxed) < targets.len() {
        if Instant::now() > deadline || threads.iter().any(|t| t.is_finished()) {
            stop.store(true, Ordering::Relaxed);
            bail!("the readers did not all start");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("ready");
    std::io::stdout().flush()?;
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    stop.store(true, Ordering::Relaxed);
    let mut w = std::io::BufWriter::new(std::fs::File::create(&out)?);
    for t in threads {
        let records = t
            .join()
            .map_err(|_| anyhow::anyhow!("a reader panicked"))??;
        w.write_all(&(records.len() as u64).to_le_bytes())?;
        for [s, l] in records {
            w.write_all(&s.to_le_bytes())?;
            w.write_all(&l.to_le_bytes())?;
        }
    }
    w.flush()?;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Handover,
    Kill,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Handover => "graceful handover",
            Kind::Kill => "kill -9 + restart",
        }
    }
}

/// One recorded read: its mount, start (monotonic ns) and latency (ns, | [`FAILED`]).
#[derive(Debug, Clone, Copy)]
struct Read1 {
    vol: usize,
    start: u64,
    lat: u64,
}

impl Read1 {
    fn ms(&self) -> f64 {
        (self.lat & !FAILED) as f64 / 1e6
    }

    fn overlaps(&self, e: &Event) -> bool {
        self.start < e.serving && self.start + (self.lat & !FAILED) > e.start
    }

    /// Started within `tail` ns after the new process answered Probe.
    fn follows(&self, e: &Event, tail: u64) -> bool {
        self.start >= e.serving && self.start < e.serving + tail
    }
}

/// One takeover, on the monotonic clock (ns) and, for matching log lines, the wall clock (s).
#[derive(Debug)]
struct Event {
    kind: Kind,
    /// Successor started (handover) or SIGKILL sent (kill).
    start: u64,
    /// The new process answered Probe.
    serving: u64,
    wall_start: f64,
    /// Log lines of the node plugin within the event: (message, wall time, fields).
    log: Vec<LogLine>,
}

impl Event {
    fn took_ms(&self) -> f64 {
        (self.serving - self.start) as f64 / 1e6
    }
}

/// Waits until the node plugin's CSI socket answers Probe, polling every 2 ms (the harness's
/// `wait_node` polls every 100 ms, too coarse here).
async fn wait_probe(socket: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if ferry_e2e::probe_ready(socket).await {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the node plugin did not answer Probe within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A graceful handover: start a successor, wait for the owner to exit 0 and the successor to
/// answer Probe (only once the owner is gone: until then Probe could reach the owner).
async fn handover(plugin: &mut Plugin) -> anyhow::Result<Event> {
    let wall_start = unix_secs(SystemTime::now());
    let start = mono_ns();
    // As the chart's DaemonSet does it: a new pod with its own fd holder; the old pod (and its
    // holder) goes once its node plugin has handed over.
    plugin.start_holder()?;
    plugin.start_node()?;
    let status = plugin.wait_exit("ferry-node", Duration::from_secs(120))?;
    if !status.success() {
        bail!("the previous ferry-node exited with {status} instead of handing over");
    }
    plugin.signal_process("ferry-fd-holder", libc::SIGTERM)?;
    wait_probe(&plugin.node_socket).await?;
    Ok(Event {
        kind: Kind::Handover,
        start,
        serving: mono_ns(),
        wall_start,
        log: Vec::new(),
    })
}

/// `kill -9` of the node plugin, then a new one, which recovers the mounts from the holder.
async fn kill_restart(plugin: &mut Plugin) -> anyhow::Result<Event> {
    let wall_start = unix_secs(SystemTime::now());
    let start = mono_ns();
    plugin.signal_process("ferry-node", libc::SIGKILL)?;
    plugin.start_node()?;
    wait_probe(&plugin.node_socket).await?;
    Ok(Event {
        kind: Kind::Kill,
        start,
        serving: mono_ns(),
        wall_start,
        log: Vec::new(),
    })
}

/// A line of the node plugin's log this program reads.
#[derive(Debug, Clone)]
struct LogLine {
    msg: &'static str,
    wall: f64,
    fields: HashMap<String, String>,
}

const HANDING: &str = "handing the mounts over";
const EXITING: &str = "mounts handed over; exiting";
const RECEIVED: &str = "mounts handed over";
const SERVING: &str = "handed-over mounts serving";
const RECOVERED: &str = "mounts of a previous process recovered";
const STARTED: &str = "ferry-node serving";
/// `ferry_fs::mount`'s line for each mount resumed by a new process.
const TAKEN: &str = "mount taken over";

/// Seconds since the epoch of an RFC 3339 timestamp (`2026-12-01T18:55:00.303916Z`).
fn parse_utc(ts: &str) -> Option<f64> {
    let t: k8s_openapi::jiff::Timestamp = ts.parse().ok()?;
    Some(t.as_nanosecond() as f64 / 1e9)
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The lines of `ferry_node` this program knows, with their `key=value` fields.
fn parse_log(text: &str) -> Vec<LogLine> {
    let mut out = Vec::new();
    for raw in text.lines() {
        let line = strip_ansi(raw);
        let Some((ts, rest)) = line.split_once(' ') else {
            continue;
        };
        let Some(wall) = parse_utc(ts) else { continue };
        if rest.contains(" ferry_fs::mount: mount taken over ") {
            out.push(LogLine {
                msg: TAKEN,
                wall,
                fields: HashMap::new(),
            });
            continue;
        }
        let Some((_, body)) = rest.split_once(" ferry_node: ") else {
            continue;
        };
        // Longest first: "mounts handed over" is a prefix of "mounts handed over; exiting".
        let Some(msg) = [EXITING, RECOVERED, SERVING, HANDING, STARTED, RECEIVED]
            .into_iter()
            .find(|m| body == *m || body.starts_with(&format!("{m} ")))
        else {
            continue;
        };
        let fields = body[msg.len()..]
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
            .collect();
        out.push(LogLine { msg, wall, fields });
    }
    out
}

/// The 1-minute load average, as /proc/loadavg prints it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_default()
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

fn ms(v: f64) -> String {
    if v.is_nan() {
        "—".into()
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn ratio(a: f64, b: f64) -> String {
    let r = a / b;
    if r.is_finite() {
        format!("{r:.1}")
    } else {
        "—".into()
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(Load::Readers {
        read_kib,
        object_mib,
        out,
        targets,
    }) = cli.load
    {
        return run_readers(read_kib, object_mib, out, targets);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("ferry-bench-takeover must run as root (FUSE mounts)");
    }
    if cli.volumes == 0 || cli.read_kib == 0 || cli.read_kib % 4 != 0 {
        bail!("--volumes must be positive and --read-kib a positive multiple of 4");
    }
    let _lock = instance::single_instance_lock()?;
    // The S3 server's data on tmpfs, as in the other benchmarks.
    if std::env::var_os("FERRY_TEST_TMPDIR").is_none() && Path::new("/dev/shm").is_dir() {
        std::env::set_var("FERRY_TEST_TMPDIR", "/dev/shm");
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let run_started = Instant::now();
    let mut plugin = Plugin::start(&bin_dir()?).await?;
    let res = run_on(&mut plugin, &cli).await;
    if let Some(dir) = &cli.keep_logs {
        std::fs::create_dir_all(dir)?;
        for name in ["ferry-node", "ferry-fd-holder"] {
            let _ = std::fs::copy(plugin.log_path(name), dir.join(format!("{name}.log")));
        }
    }
    if res.is_err() {
        let log = std::fs::read_to_string(plugin.log_path("ferry-node")).unwrap_or_default();
        eprintln!("last lines of ferry-node's log:");
        let tail: Vec<_> = log.lines().rev().take(30).collect();
        for l in tail.iter().rev() {
            eprintln!("  {}", strip_ansi(l));
        }
    }
    let report = res?;
    let report = format!(
        "{report}\nWall time of this run: {:.1} min.\n",
        run_started.elapsed().as_secs_f64() / 60.0
    );
    instance::report(&report, cli.out.as_deref())
}

async fn run_on(plugin: &mut Plugin, cli: &Cli) -> anyhow::Result<String> {
    // The node plugin started with the harness has no holder: replace it with one that has, and
    // (unless --no-cache) the chart's node cache.
    plugin.start_holder()?;
    if !cli.no_cache {
        let cache = plugin.dir.path().join("cache");
        plugin.set_env("FERRY_CACHE_DIR", &cache.display().to_string());
    }
    plugin.signal_process("ferry-node", libc::SIGTERM)?;
    plugin.start_node()?;
    plugin.wait_node().await?;

    let t = Instant::now();
    plugin.s3.create_bucket(BUCKET).await;
    let s3 = S3Store::new(plugin.s3.s3_config()).await?;
    {
        use futures::StreamExt;
        let (s3, size) = (&s3, cli.object_mib * MIB);
        let puts = futures::stream::iter(0..cli.volumes).map(|vol| async move {
            let data = tokio::task::spawn_blocking(move || content(vol, size)).await?;
            s3.put(BUCKET, &format!("vol-{vol:03}/{OBJECT}"), data.into())
                .await
                .with_context(|| format!("uploading volume {vol}'s object"))
        });
        let results: Vec<_> = puts.buffer_unordered(8).collect().await;
        results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    }
    let uploaded = t.elapsed();
    let t = Instant::now();
    let mut targets = Vec::new();
    let mut node = plugin.node().await?;
    for vol in 0..cli.volumes {
        let target = plugin.target_path(&format!("pod-{vol:03}"), "pv")?;
        let ctx: HashMap<String, String> = [
            ("bucketName".to_string(), BUCKET.to_string()),
            ("prefix".to_string(), format!("vol-{vol:03}/")),
        ]
        .into();
        node.node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: format!("takeover-{vol:03}"),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability(Mode::MultiNodeReaderOnly, &[])),
            readonly: true,
            volume_context: ctx,
            ..Default::default()
        })
        .await
        .with_context(|| format!("publishing volume {vol}"))?;
        targets.push(target);
    }
    let published = t.elapsed();
    eprintln!(
        "{} × {} MiB uploaded in {:.1} s, {} volumes published in {:.1} s",
        cli.volumes,
        cli.object_mib,
        uploaded.as_secs_f64(),
        cli.volumes,
        published.as_secs_f64()
    );

    // The readers, in a process of their own (see the module comment).
    let records_path = plugin.dir.path().join("reads.bin");
    let mut load = Command::new(std::env::current_exe()?)
        .args([
            "readers",
            "--read-kib",
            &cli.read_kib.to_string(),
            "--object-mib",
            &cli.object_mib.to_string(),
            "--out",
            &records_path.display().to_string(),
        ])
        .args(&targets)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the readers")?;
    let mut line = String::new();
    BufReader::new(load.stdout.take().expect("piped")).read_line(&mut line)?;
    if line.trim() != "ready" {
        let _ = load.wait();
        bail!("the readers did not start");
    }
    let settle = Duration::from_secs_f64(cli.settle);
    let load_before = load_average();
    tokio::time::sleep(settle).await;
    let reading_from = mono_ns();

    let mut events = Vec::new();
    let plan = std::iter::repeat_n(Kind::Handover, cli.handovers as usize)
        .chain(std::iter::repeat_n(Kind::Kill, cli.kills as usize));
    for (i, kind) in plan.enumerate() {
        let ev = match kind {
            Kind::Handover => handover(plugin).await,
            Kind::Kill => kill_restart(plugin).await,
        }
        .with_context(|| format!("event {} ({})", i + 1, kind.label()))?;
        eprintln!(
            "{:>2} {}: serving again after {:.0} ms",
            i + 1,
            kind.label(),
            ev.took_ms()
        );
        events.push(ev);
        tokio::time::sleep(settle).await;
    }
    let load_after = load_average();
    drop(load.stdin.take());
    let status = load.wait()?;
    if !status.success() {
        bail!("the readers failed: {status}");
    }
    let mut raw = Vec::new();
    std::fs::File::open(&records_path)?.read_to_end(&mut raw)?;
    let words: Vec<u64> = raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let mut records = Vec::new();
    let mut rest = &words[..];
    for vol in 0..cli.volumes {
        let n = *rest.first().context("the readers' records are cut short")? as usize;
        let mine = rest
            .get(1..1 + 2 * n)
            .context("the readers' records are cut short")?;
        records.extend(
            mine.chunks_exact(2)
                .map(|c| Read1 {
                    vol,
                    start: c[0],
                    lat: c[1],
                })
                // From the first settle on: the first reads of each mount are cold.
                .filter(|r| r.start >= reading_from),
        );
        rest = &rest[1 + 2 * n..];
    }
    if let Some(dir) = &cli.keep_logs {
        std::fs::create_dir_all(dir)?;
        std::fs::copy(&records_path, dir.join("reads.bin"))?;
        let mut f = std::fs::File::create(dir.join("events.csv"))?;
        writeln!(f, "kind,start_ns,serving_ns")?;
        for e in &events {
            writeln!(f, "{},{},{}", e.kind.label(), e.start, e.serving)?;
        }
    }

    let mut node = plugin.node().await?;
    for (n, target) in targets.iter().enumerate() {
        node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: format!("takeover-{n:03}"),
            target_path: target.display().to_string(),
        })
        .await?;
    }

    let log = parse_log(&std::fs::read_to_string(plugin.log_path("ferry-node"))?);
    for ev in &mut events {
        let end = ev.wall_start + ev.took_ms() / 1e3 + 0.5;
        ev.log = log
            .iter()
            .filter(|l| l.wall >= ev.wall_start && l.wall <= end)
            .cloned()
            .collect();
    }
    Ok(report(
        cli,
        &events,
        &records,
        &format!("1-minute load average {load_before} before the events, {load_after} after"),
    ))
}

/// The Markdown tables.
fn report(cli: &Cli, events: &[Event], records: &[Read1], note: &str) -> String {
    let failed = records.iter().filter(|r| r.lat & FAILED != 0).count();
    // The reads overlapping each event, each mount's longest read in it (its stall), the reads
    // of the tail after it, and the rest: the baseline.
    let tail = (cli.tail * 1e9) as u64;
    let mut per_event: Vec<Vec<f64>> = vec![Vec::new(); events.len()];
    let mut stall: Vec<Vec<f64>> = vec![vec![0.0; cli.volumes]; events.len()];
    let mut after: Vec<Vec<f64>> = vec![Vec::new(); events.len()];
    let mut baseline = Vec::new();
    for r in records {
        if let Some(i) = events.iter().position(|e| r.overlaps(e)) {
            per_event[i].push(r.ms());
            stall[i][r.vol] = stall[i][r.vol].max(r.ms());
        } else if let Some(i) = events.iter().position(|e| r.follows(e, tail)) {
            after[i].push(r.ms());
        } else {
            baseline.push(r.ms());
        }
    }
    let baseline = sorted(baseline);
    let (b50, b99) = (pct(&baseline, 50.0), pct(&baseline, 99.0));
    let mut s = String::new();
    let w = &mut s;
    use std::fmt::Write as _;
    let _ = writeln!(
        w,
        "#### {} volumes, one reader each ({} KiB `O_DIRECT` reads of a {} MiB object)\n",
        cli.volumes, cli.read_kib, cli.object_mib
    );
    let _ = writeln!(
        w,
        "| event | n | take over all mounts p50 ms | p99 ms | max ms | reads overlapping | their p50 ms | p99 ms | max ms | p50 / baseline p50 | p99 / baseline p99 | stall per mount p50 ms | p99 ms |"
    );
    let _ = writeln!(
        w,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for kind in [Kind::Handover, Kind::Kill] {
        let idx: Vec<usize> = (0..events.len())
            .filter(|&i| events[i].kind == kind)
            .collect();
        if idx.is_empty() {
            continue;
        }
        let took = sorted(idx.iter().map(|&i| events[i].took_ms()).collect());
        let reads = sorted(idx.iter().flat_map(|&i| per_event[i].clone()).collect());
        let stalls = sorted(idx.iter().flat_map(|&i| stall[i].clone()).collect());
        let (r50, r99) = (pct(&reads, 50.0), pct(&reads, 99.0));
        let _ = writeln!(
            w,
            "| {}: reads overlapping it | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            kind.label(),
            idx.len(),
            ms(pct(&took, 50.0)),
            ms(pct(&took, 99.0)),
            ms(pct(&took, 100.0)),
            reads.len(),
            ms(r50),
            ms(r99),
            ms(pct(&reads, 100.0)),
            ratio(r50, b50),
            ratio(r99, b99),
            ms(pct(&stalls, 50.0)),
            ms(pct(&stalls, 99.0)),
        );
        let reads = sorted(idx.iter().flat_map(|&i| after[i].clone()).collect());
        let (r50, r99) = (pct(&reads, 50.0), pct(&reads, 99.0));
        let _ = writeln!(
            w,
            "| {}: reads in the {} s after | | | | | {} | {} | {} | {} | {} | {} | | |",
            kind.label(),
            cli.tail,
            reads.len(),
            ms(r50),
            ms(r99),
            ms(pct(&reads, 100.0)),
            ratio(r50, b50),
            ratio(r99, b99),
        );
    }
    let _ = writeln!(
        w,
        "| baseline: every other read | | | | | {} | {} | {} | {} | 1.0 | 1.0 | | |",
        baseline.len(),
        ms(b50),
        ms(b99),
        ms(pct(&baseline, 100.0)),
    );
    let _ = writeln!(
        w,
        "\nReads recorded: {} ({} failed or wrong). {note}.\n",
        records.len(),
        failed
    );

    // Where the time goes, from the node plugin's log (medians over the events of each kind).
    let field = |l: &LogLine, k: &str| l.fields.get(k).and_then(|v| v.parse::<f64>().ok());
    let find = |e: &Event, msg: &str| e.log.iter().find(|l| l.msg == msg).cloned();
    let since = |e: &Event, l: &LogLine| (l.wall - e.wall_start) * 1e3;
    // The first and the last mount the new process resumed, ms after the event's start.
    let resumed = |e: &Event| {
        let t: Vec<f64> = e
            .log
            .iter()
            .filter(|l| l.msg == TAKEN)
            .map(|l| since(e, l))
            .collect();
        (
            t.first().copied().unwrap_or(f64::NAN),
            t.last().copied().unwrap_or(f64::NAN),
        )
    };
    let med = |v: Vec<f64>| {
        ms(pct(
            &sorted(v.into_iter().filter(|x| !x.is_nan()).collect()),
            50.0,
        ))
    };
    let _ = writeln!(
        w,
        "Where a graceful handover's time goes (median over the handovers, ms, from ferry-node's log):\n"
    );
    let _ = writeln!(
        w,
        "| successor started → owner asked (exec, start-up) | owner: freeze + send (`{EXITING}` elapsed_ms) | successor: ask → owner gone (`{RECEIVED}` elapsed_ms) | successor: ask → all mounts adopted (`{SERVING}` pause_ms) | first mount resumed | last mount resumed | adopted → Probe answered | successor started → Probe answered |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut cols: [Vec<f64>; 8] = Default::default();
    for e in events.iter().filter(|e| e.kind == Kind::Handover) {
        let serving = find(e, SERVING);
        let (first, last) = resumed(e);
        let get = |msg, k| find(e, msg).and_then(|l| field(&l, k)).unwrap_or(f64::NAN);
        cols[0].push(find(e, HANDING).map_or(f64::NAN, |l| since(e, &l)));
        cols[1].push(get(EXITING, "elapsed_ms"));
        cols[2].push(get(RECEIVED, "elapsed_ms"));
        cols[3].push(get(SERVING, "pause_ms"));
        cols[4].push(first);
        cols[5].push(last);
        cols[6].push(serving.map_or(f64::NAN, |l| e.took_ms() - since(e, &l)));
        cols[7].push(e.took_ms());
    }
    let row: Vec<String> = cols.into_iter().map(med).collect();
    let _ = writeln!(w, "| {} |\n", row.join(" | "));

    let _ = writeln!(
        w,
        "Where a `kill -9` recovery's time goes (median over the kills, ms, from ferry-node's log):\n"
    );
    let _ = writeln!(
        w,
        "| kill → new process recovering (reap, exec, start-up) | recovery (`{RECOVERED}` elapsed_ms) | first mount resumed | last mount resumed | recovered → Probe answered | kill → Probe answered | mounts recovered / cut off (all kills) |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---|");
    let mut cols: [Vec<f64>; 6] = Default::default();
    let (mut served, mut cut) = (0.0, 0.0);
    for e in events.iter().filter(|e| e.kind == Kind::Kill) {
        let rec = find(e, RECOVERED);
        let elapsed = rec.as_ref().and_then(|l| field(l, "elapsed_ms"));
        let done = rec.as_ref().map(|l| since(e, l));
        let (first, last) = resumed(e);
        served += rec.as_ref().and_then(|l| field(l, "served")).unwrap_or(0.0);
        cut += rec
            .as_ref()
            .and_then(|l| field(l, "cut_off"))
            .unwrap_or(0.0);
        cols[0].push(match (done, elapsed) {
            (Some(d), Some(el)) => d - el,
            _ => f64::NAN,
        });
        cols[1].push(elapsed.unwrap_or(f64::NAN));
        cols[2].push(first);
        cols[3].push(last);
        cols[4].push(done.map_or(f64::NAN, |d| e.took_ms() - d));
        cols[5].push(e.took_ms());
    }
    let row: Vec<String> = cols.into_iter().map(med).collect();
    let _ = writeln!(w, "| {} | {served:.0} / {cut:.0} |", row.join(" | "));
    s
}
