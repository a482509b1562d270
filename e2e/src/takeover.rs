//! `ferry-harness takeover`: live mounts under load across graceful upgrades (a new `ferry-node`
//! takes the mounts from the running one) and `kill -9` restarts (a new one recovers them from
//! the descriptor holder and the mounts' journals), through the real binaries, a real S3 server
//! and real FUSE mounts.
//!
//! While the node plugin is replaced again and again, at once: readers looping over a large
//! object (every byte compared), readers over many small files, `ls -la` of a large directory,
//! and a writer that always has a file half written. It passes with no failed read, no wrong
//! byte, no `ENOTCONN`, no read that stalled beyond [`STALL_BOUND`], and every written object
//! either complete and correct in S3 or its `close` reported an error.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::IntoRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use ferry_proto::csi::v1 as pb;
use ferry_s3::S3Store;
use ferry_store::ObjectStore;
use pb::volume_capability::access_mode::Mode;

use crate::{bin_dir, mount_capability, payload, Plugin};

/// The longest a single `read`/`readdir`/`open` may take across a takeover.
pub const STALL_BOUND: Duration = Duration::from_secs(10);

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub upgrades: u32,
    pub kills: u32,
    /// Size of the large object, MiB.
    pub big_mib: usize,
    /// Small files (and entries of the listed directory).
    pub small: usize,
    /// Seconds of load between two replacements.
    pub settle: f64,
}

#[derive(Default)]
struct Stats {
    ok: AtomicU64,
    failed: AtomicU64,
    wrong: AtomicU64,
    enotconn: AtomicU64,
    /// Microseconds.
    max_stall: AtomicU64,
    errors: Mutex<Vec<String>>,
}

impl Stats {
    /// Times one call; its error is counted (and `ENOTCONN` separately).
    fn timed<T>(&self, what: &str, f: impl FnOnce() -> std::io::Result<T>) -> Option<T> {
        let t = Instant::now();
        let r = f();
        self.max_stall
            .fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                if e.raw_os_error() == Some(libc::ENOTCONN) {
                    self.enotconn.fetch_add(1, Ordering::Relaxed);
                }
                let mut errs = self.errors.lock().unwrap();
                if errs.len() < 20 {
                    errs.push(format!("{what}: {e}"));
                }
                None
            }
        }
    }

    fn wrong(&self, what: String) {
        self.wrong.fetch_add(1, Ordering::Relaxed);
        let mut errs = self.errors.lock().unwrap();
        if errs.len() < 20 {
            errs.push(what);
        }
    }
}

/// One written file: its name, seed, length and what `close` said.
#[derive(serde::Serialize, serde::Deserialize)]
struct Written {
    name: String,
    seed: u64,
    len: usize,
    closed: std::result::Result<(), String>,
}

fn small_name(i: usize) -> String {
    format!("f{i:05}")
}

fn small_seed(i: usize) -> u64 {
    1000 + i as u64
}

const SMALL_LEN: usize = 8 << 10;
const WRITE_LEN: usize = 12 << 20;
const WRITE_CHUNK: usize = 256 << 10;

fn big_reader(mnt: PathBuf, want: Bytes, stats: Arc<Stats>, stop: Arc<AtomicBool>) {
    let path = mnt.join("big.bin");
    let mut buf = vec![0u8; 1 << 20];
    while !stop.load(Ordering::Relaxed) {
        let Some(mut f) = stats.timed("open big.bin", || std::fs::File::open(&path)) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let mut off = 0usize;
        while let Some(n) = stats.timed("read big.bin", || f.read(&mut buf)) {
            if n == 0 {
                if off != want.len() {
                    stats.wrong(format!("big.bin ended at {off}, not {}", want.len()));
                } else {
                    stats.ok.fetch_add(1, Ordering::Relaxed);
                }
                break;
            }
            if off + n > want.len() || buf[..n] != want[off..off + n] {
                stats.wrong(format!("big.bin: wrong bytes at {off}..{}", off + n));
                break;
            }
            off += n;
            if stop.load(Ordering::Relaxed) {
                break;
            }
        }
    }
}

fn small_reader(
    mnt: PathBuf,
    k: usize,
    of: usize,
    n: usize,
    stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
) {
    let dir = mnt.join("small");
    let mut i = k;
    while !stop.load(Ordering::Relaxed) {
        let name = small_name(i % n);
        let want = payload(small_seed(i % n), SMALL_LEN);
        if let Some(got) = stats.timed(&format!("read small/{name}"), || {
            std::fs::read(dir.join(&name))
        }) {
            if got == want {
                stats.ok.fetch_add(1, Ordering::Relaxed);
            } else {
                stats.wrong(format!(
                    "small/{name}: {} bytes, not the expected ones",
                    got.len()
                ));
            }
        }
        i += of;
    }
}

fn lister(mnt: PathBuf, n: usize, stats: Arc<Stats>, stop: Arc<AtomicBool>) {
    let dir = mnt.join("small");
    let want: Vec<PathBuf> = (0..n).map(|i| dir.join(small_name(i))).collect();
    while !stop.load(Ordering::Relaxed) {
        // `ls -la`: the listing, then every entry's attributes.
        let listed = stats.timed("readdir small", || {
            std::fs::read_dir(&dir)?
                .map(|e| e.map(|e| e.path()))
                .collect::<std::io::Result<Vec<_>>>()
        });
        let Some(mut entries) = listed else { continue };
        entries.sort();
        if entries != want {
            let missing = want.iter().filter(|p| !entries.contains(p)).count();
            stats.wrong(format!(
                "{} listed {} entries, not the {n} names ({missing} missing)",
                dir.display(),
                entries.len()
            ));
            continue;
        }
        let mut all = true;
        for p in &entries {
            match stats.timed("stat small/*", || std::fs::symlink_metadata(p)) {
                Some(m) if m.len() == SMALL_LEN as u64 => {}
                Some(m) => {
                    stats.wrong(format!("{}: size {}", p.display(), m.len()));
                    all = false;
                }
                None => all = false,
            }
        }
        if all {
            stats.ok.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Writes file after file, each in slow chunks so that a takeover finds one half written.
fn writer(mnt: PathBuf, stop: Arc<AtomicBool>) -> Vec<Written> {
    let dir = mnt.join("written");
    let _ = std::fs::create_dir(&dir);
    let mut out = Vec::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("w{n:04}");
        let seed = 50_000 + n;
        let data = payload(seed, WRITE_LEN);
        let res = (|| -> std::result::Result<(), String> {
            let mut f =
                std::fs::File::create(dir.join(&name)).map_err(|e| format!("create: {e}"))?;
            for chunk in data.chunks(WRITE_CHUNK) {
                f.write_all(chunk).map_err(|e| format!("write: {e}"))?;
                std::thread::sleep(Duration::from_millis(15));
            }
            // close(2)'s own result: that is where an upload reports its end.
            let fd = f.into_raw_fd();
            // SAFETY: closes the descriptor we own, once.
            if unsafe { libc::close(fd) } != 0 {
                return Err(format!("close: {}", std::io::Error::last_os_error()));
            }
            Ok(())
        })();
        out.push(Written {
            name,
            seed,
            len: WRITE_LEN,
            closed: res,
        });
        n += 1;
    }
    out
}

/// An upgrade as the chart's DaemonSet does it: a new pod (its own fd holder and node plugin)
/// beside the old one; once the old node plugin has handed over and exited, the old pod (its
/// holder) goes away.
async fn upgrade(plugin: &mut Plugin) -> Result<Duration> {
    upgrade_with(plugin, &[]).await
}

async fn upgrade_with(plugin: &mut Plugin, env: &[(&str, &str)]) -> Result<Duration> {
    let t = Instant::now();
    plugin.start_holder()?;
    plugin.start_node_with(&[], env)?;
    let status = plugin.wait_exit("ferry-node", Duration::from_secs(120))?;
    if !status.success() {
        bail!("the previous ferry-node exited with {status} instead of handing over");
    }
    let took = t.elapsed();
    plugin.signal_process("ferry-fd-holder", libc::SIGTERM)?;
    plugin.wait_node().await?;
    Ok(took)
}

/// Handovers that must not happen, while the load runs: a successor that cannot read the owner's
/// state format is declined, and one that receives state in a format it cannot read (an owner
/// stamping version 2) refuses it; each time the owner serves on and the successor exits with an
/// error. The mis-stamping owner is then killed and its mounts recovered by a normal process.
async fn refusals(plugin: &mut Plugin) -> Result<()> {
    plugin.start_node_with(&["--handover-readable", "2"], &[])?;
    let status = plugin.wait_exit_newest("ferry-node", Duration::from_secs(120))?;
    if status.success() || !plugin.running("ferry-node")? {
        bail!("a successor reading only format 2 was not refused cleanly ({status})");
    }
    println!("    a successor that reads only format 2: declined, exited with {status}; the owner serves on");
    // An owner that stamps its state with version 2 (the format it announces is 1).
    upgrade_with(plugin, &[("FERRY_HANDOVER_WRITE_VERSION", "2")]).await?;
    plugin.start_node()?;
    let status = plugin.wait_exit_newest("ferry-node", Duration::from_secs(120))?;
    if status.success() || !plugin.running("ferry-node")? {
        bail!("a successor given state version 2 did not refuse it cleanly ({status})");
    }
    println!("    a successor given state in format 2: refused, exited with {status}; the owner serves on");
    plugin.signal_process("ferry-node", libc::SIGKILL)?;
    plugin.start_node()?;
    plugin.wait_node().await?;
    println!("    the mis-stamping owner killed; its mounts recovered by a new process");
    // A successor that dies after it took the mounts and before it served them (the owner is
    // gone by then): what it deposited with the holder first lets the next process recover them.
    // A new pod: its holder has nothing but what that successor deposits, and the old pod's
    // holder goes away with the old pod.
    plugin.start_holder()?;
    plugin.start_node_with(&[], &[("FERRY_TEST_ABORT_AFTER_ADOPTED", "1")])?;
    let owner = plugin.wait_exit("ferry-node", Duration::from_secs(120))?;
    let successor = plugin.wait_exit("ferry-node", Duration::from_secs(120))?;
    if !owner.success() || successor.success() {
        bail!("expected the owner to hand over ({owner}) and the successor to die ({successor})");
    }
    plugin.signal_process("ferry-fd-holder", libc::SIGTERM)?;
    plugin.start_node()?;
    plugin.wait_node().await?;
    println!("    a successor that died after taking the mounts ({successor}): recovered by the next one");
    Ok(())
}

/// A rolling update deletes the old node pod as soon as the new one starts: SIGTERM reaches the
/// owner while it hands its mounts over (here, held between the successor taking the mounts and
/// adopting them). The owner waits for that handover to end and exits 0; the successor serves.
async fn stopped_mid_handover(plugin: &mut Plugin) -> Result<()> {
    let go = plugin.dir.path().join("adopt-now");
    let from = plugin.log_len("ferry-node");
    plugin.start_holder()?;
    plugin.start_node_with(&[], &[("FERRY_TEST_ADOPT_WHEN", &go.display().to_string())])?;
    let wait = Duration::from_secs(120);
    plugin.wait_log(
        "ferry-node",
        from,
        "adopting the mounts once this file exists",
        wait,
    )?;
    plugin.send_signal("ferry-node", libc::SIGTERM)?;
    plugin.wait_log(
        "ferry-node",
        from,
        "a handover to a successor is under way",
        wait,
    )?;
    std::fs::write(&go, b"")?;
    let owner = plugin.wait_exit("ferry-node", wait)?;
    if !owner.success() {
        bail!("the owner stopped during a handover exited with {owner}");
    }
    plugin.wait_node().await?;
    plugin.wait_log("ferry-node", from, "handed-over mounts serving", wait)?;
    plugin.signal_process("ferry-fd-holder", libc::SIGTERM)?;
    println!("    the owner got SIGTERM during a handover: it finished it and exited 0; the successor serves");
    Ok(())
}

/// `kill -9` of the running node plugin, then a new one.
async fn crash(plugin: &mut Plugin) -> Result<Duration> {
    plugin.signal_process("ferry-node", libc::SIGKILL)?;
    let t = Instant::now();
    plugin.start_node()?;
    plugin.wait_node().await?;
    Ok(t.elapsed())
}

pub async fn run(o: Options) -> Result<()> {
    let mut plugin = Plugin::start(&bin_dir()?).await?;
    let res = run_on(&mut plugin, o).await;
    if let Some(dir) = std::env::var_os("FERRY_HARNESS_KEEP_LOGS") {
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir)?;
        for name in ["ferry-node", "ferry-fd-holder"] {
            let _ = std::fs::copy(plugin.log_path(name), dir.join(format!("{name}.log")));
        }
    }
    if res.is_err() {
        let log = std::fs::read_to_string(plugin.log_path("ferry-node")).unwrap_or_default();
        let tail: Vec<_> = log.lines().rev().take(30).collect();
        println!("    last lines of ferry-node's log:");
        for l in tail.iter().rev() {
            println!("      {l}");
        }
    }
    res
}

async fn run_on(plugin: &mut Plugin, o: Options) -> Result<()> {
    // The node plugin started with the harness has no holder: replace it with one that has, and
    // with the chart's node cache (objects read whole are then read through FUSE passthrough).
    plugin.start_holder()?;
    let cache = plugin.dir.path().join("cache");
    plugin.set_env("FERRY_CACHE_DIR", &cache.display().to_string());
    plugin.signal_process("ferry-node", libc::SIGTERM)?;
    plugin.start_node()?;
    plugin.wait_node().await?;
    plugin.s3.create_bucket("takeover").await;
    let s3 = S3Store::new(plugin.s3.s3_config()).await?;
    let big = payload(7, o.big_mib << 20);
    println!(
        "    uploading a {} MiB object and {} small files",
        o.big_mib, o.small
    );
    s3.put("takeover", "vol/big.bin", big.clone()).await?;
    {
        use futures::StreamExt;
        let s3 = &s3;
        let puts = futures::stream::iter(0..o.small).map(|i| async move {
            s3.put(
                "takeover",
                &format!("vol/small/{}", small_name(i)),
                payload(small_seed(i), SMALL_LEN),
            )
            .await
        });
        let results: Vec<_> = puts.buffer_unordered(32).collect().await;
        for r in results {
            r?;
        }
    }
    let ctx: HashMap<String, String> = [("bucketName", "takeover"), ("prefix", "vol/")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let target = plugin.target_path("pod-a", "pv")?;
    plugin
        .node()
        .await?
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: "takeover-vol".into(),
            target_path: target.display().to_string(),
            volume_capability: Some(mount_capability(Mode::SingleNodeWriter, &[])),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .context("publishing the volume")?;
    // The same prefix as a dataset (read-only: metadata kept for the mount's life, directories
    // cached in the kernel), listed by two listers at once through every takeover.
    let ro_target = plugin.target_path("pod-b", "pv-ro")?;
    plugin
        .node()
        .await?
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: "takeover-ro".into(),
            target_path: ro_target.display().to_string(),
            volume_capability: Some(mount_capability(Mode::MultiNodeReaderOnly, &[])),
            volume_context: ctx,
            readonly: true,
            ..Default::default()
        })
        .await
        .context("publishing the read-only volume")?;

    // The load runs in a process of its own: one that holds files open on the mount must not
    // start the node plugin, whose `exec` would close them (a FLUSH the dead plugin's successor,
    // that very process, cannot answer yet).
    let mut load = std::process::Command::new(std::env::current_exe()?)
        .args([
            "takeover-load",
            &target.display().to_string(),
            "--big-mib",
            &o.big_mib.to_string(),
            "--small",
            &o.small.to_string(),
            "--ro-target",
            &ro_target.display().to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the load")?;
    let settle = Duration::from_secs_f64(o.settle);
    tokio::time::sleep(settle).await;

    refusals(plugin).await?;
    tokio::time::sleep(settle).await;
    stopped_mid_handover(plugin).await?;
    tokio::time::sleep(settle).await;

    let mut took = Vec::new();
    for i in 0..o.upgrades {
        let t = upgrade(plugin)
            .await
            .with_context(|| format!("upgrade {}", i + 1))?;
        println!(
            "    upgrade {:>2}: handed over in {:>5} ms",
            i + 1,
            t.as_millis()
        );
        took.push(t);
        tokio::time::sleep(settle).await;
    }
    for i in 0..o.kills {
        let t = crash(plugin)
            .await
            .with_context(|| format!("kill -9 {}", i + 1))?;
        println!(
            "    kill -9 {:>2}: serving again in {:>5} ms",
            i + 1,
            t.as_millis()
        );
        took.push(t);
        tokio::time::sleep(settle).await;
    }
    drop(load.stdin.take());
    let mut out = String::new();
    load.stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)?;
    let status = load.wait()?;
    if !status.success() {
        bail!("the load process failed: {status}");
    }
    let report: Report = serde_json::from_str(&out).context("the load's report")?;
    let written = report.written;
    // Every object whose close succeeded is complete and correct.
    let (mut complete, mut reported) = (0, 0);
    let mut bad = Vec::new();
    for f in &written {
        match &f.closed {
            Ok(()) => {
                let key = format!("vol/written/{}", f.name);
                match s3
                    .get_range("takeover", &key, 0..f.len as u64 + 1, None)
                    .await
                {
                    Ok(got) if got[..] == payload(f.seed, f.len)[..] => complete += 1,
                    Ok(got) => bad.push(format!(
                        "{key}: {} bytes, not the {} written",
                        got.len(),
                        f.len
                    )),
                    Err(e) => bad.push(format!("{key}: close succeeded but GET failed: {e}")),
                }
            }
            Err(e) => {
                reported += 1;
                println!("    {}: close reported {e}", f.name);
            }
        }
    }
    let max_stall = Duration::from_micros(report.max_stall_us);
    let mut sorted = took.clone();
    sorted.sort();
    println!(
        "    reads/listings ok: {}, failed: {}, wrong: {}, ENOTCONN: {}, longest call: {} ms (bound {} s)",
        report.ok, report.failed, report.wrong, report.enotconn,
        max_stall.as_millis(),
        STALL_BOUND.as_secs()
    );
    println!(
        "    files written: {} complete and correct, {} closes reported an error, {} wrong",
        complete,
        reported,
        bad.len()
    );
    if let (Some(first), Some(last)) = (sorted.first(), sorted.last()) {
        println!(
            "    takeovers: {} (fastest {} ms, median {} ms, slowest {} ms)",
            sorted.len(),
            first.as_millis(),
            sorted[sorted.len() / 2].as_millis(),
            last.as_millis()
        );
    }
    for e in &report.errors {
        println!("    error: {e}");
    }
    for b in &bad {
        println!("    wrong object: {b}");
    }
    let failed = report.failed + report.wrong;
    if failed > 0 || !bad.is_empty() || max_stall > STALL_BOUND {
        bail!("takeover: reads failed, bytes were wrong or a call stalled");
    }
    if report.ok == 0 || written.is_empty() {
        bail!("takeover: the workload did not run");
    }
    let mut node = plugin.node().await?;
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: "takeover-vol".into(),
        target_path: target.display().to_string(),
    })
    .await?;
    node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
        volume_id: "takeover-ro".into(),
        target_path: ro_target.display().to_string(),
    })
    .await?;
    plugin.check_logs_for_secrets(&[])?;
    println!(
        "takeover: {} upgrades and {} kill -9 restarts under load, 0 failed",
        o.upgrades, o.kills
    );
    Ok(())
}

/// What the load process reports when its stdin closes.
#[derive(serde::Serialize, serde::Deserialize)]
struct Report {
    ok: u64,
    failed: u64,
    wrong: u64,
    enotconn: u64,
    max_stall_us: u64,
    errors: Vec<String>,
    written: Vec<Written>,
}

/// `ferry-harness takeover-load`: runs the readers, the lister and the writer on the mount at
/// `target`, and two listers on the read-only mount at `ro_target`, until stdin closes, then
/// prints a JSON [`Report`].
pub fn load(target: PathBuf, ro_target: PathBuf, big_mib: usize, small: usize) -> Result<()> {
    let big = payload(7, big_mib << 20);
    let stats = Arc::new(Stats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..4 {
        let (m, b, s, st) = (target.clone(), big.clone(), stats.clone(), stop.clone());
        readers.push(std::thread::spawn(move || big_reader(m, b, s, st)));
    }
    for k in 0..8 {
        let (m, s, st) = (target.clone(), stats.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            small_reader(m, k, 8, small, s, st)
        }));
    }
    for m in [target.clone(), ro_target.clone(), ro_target] {
        let (s, st) = (stats.clone(), stop.clone());
        readers.push(std::thread::spawn(move || lister(m, small, s, st)));
    }
    let w = {
        let (m, st) = (target.clone(), stop.clone());
        std::thread::spawn(move || writer(m, st))
    };
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().map_err(|_| anyhow::anyhow!("a reader panicked"))?;
    }
    let written = w
        .join()
        .map_err(|_| anyhow::anyhow!("the writer panicked"))?;
    let report = Report {
        ok: stats.ok.load(Ordering::Relaxed),
        failed: stats.failed.load(Ordering::Relaxed),
        wrong: stats.wrong.load(Ordering::Relaxed),
        enotconn: stats.enotconn.load(Ordering::Relaxed),
        max_stall_us: stats.max_stall.load(Ordering::Relaxed),
        errors: stats.errors.lock().unwrap().clone(),
        written,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
