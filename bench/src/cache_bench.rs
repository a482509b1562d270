//! `ferry-bench-cache`: benchmark P9, the shared node cache.
//!
//! One real `ferry-node serve` with `--cache-dir`, four NodePublishVolume calls of the same volume
//! at four kubelet-style target paths (four pods on one node), one dataset of >= 1 GiB in files of
//! 1–64 MiB on a local S3 server (versitygw, data on tmpfs) behind the counting delay proxy:
//!
//! 1. **Epoch 1**: the four pods read every file concurrently, each in its own shuffled order.
//!    S3 GET bytes are taken from Ferry's metrics (`ferry_s3_received_bytes_total`) and cross-checked
//!    with the bytes the proxy forwarded from the server.
//! 2. **Restart**: the node plugin gets SIGTERM, a new one starts on the same cache directory, the
//!    four targets are published again, the page cache is dropped.
//! 3. **Epoch 2**: the same reads; Ferry's GET count must be 0. Its speed is compared with the four
//!    readers reading the same files from a directory on the local disk (page cache dropped too).
//!
//! Once per block size (`--block-sizes`). A program to run by hand as root, never a test.

#[allow(dead_code)] // shared with ferry-bench, which uses the rest
#[path = "proxy.rs"]
mod proxy;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use ferry_e2e::unix_channel;
use ferry_proto::csi::v1 as pb;
use ferry_store::ObjectStore;
use ferry_testkit::S3Server;
use tonic::transport::Channel;

use proxy::DelayProxy;

const BUCKET: &str = "bench";
const PREFIX: &str = "p9/";
const MIB: u64 = 1 << 20;
const PODS: usize = 4;
/// File sizes in MiB, repeated until the dataset is large enough (1–64 MiB, 127 MiB a round).
const SIZES_MIB: [u64; 7] = [1, 64, 2, 32, 4, 16, 8];

#[derive(Debug, Parser)]
#[command(about = "P9: four pods on one node reading one dataset through the node cache (root)")]
struct Cli {
    /// Cache block sizes to measure, comma-separated (each a --cache-block-size value).
    #[arg(long, value_delimiter = ',', default_value = "1MiB,4MiB,8MiB")]
    block_sizes: Vec<String>,
    /// Dataset size in MiB (rounded up to whole files).
    #[arg(long, default_value_t = 1100)]
    dataset_mib: u64,
    /// Round trip the delay proxy adds, in ms.
    #[arg(long, default_value_t = 0)]
    rtt_ms: u64,
    /// ferry-node to run.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/release/ferry-node"))]
    ferry_bin: PathBuf,
    /// Work directory on the local disk (cache, local copy, logs); default a new one in /var/tmp.
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Append the table (Markdown) to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Keep the work directory.
    #[arg(long)]
    keep_work: bool,
    /// Run ferry-node with --no-cache-passthrough (every read through Ferry and its checksums).
    #[arg(long)]
    no_passthrough: bool,
}

/// The 8-byte word at `offset` (a multiple of 8) of file `file`: lets every read be checked.
fn word(file: usize, offset: u64) -> u64 {
    ((file as u64) << 48) ^ offset ^ 0x5bd1_e995
}

fn content(file: usize, size: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(size as usize);
    for off in (0..size).step_by(8) {
        v.extend_from_slice(&word(file, off).to_le_bytes());
    }
    v
}

#[derive(Clone)]
struct FileSpec {
    index: usize,
    name: String,
    size: u64,
}

fn dataset(mib: u64) -> Vec<FileSpec> {
    let mut files = Vec::new();
    let mut total = 0;
    while total < mib * MIB {
        let size = SIZES_MIB[files.len() % SIZES_MIB.len()] * MIB;
        files.push(FileSpec {
            index: files.len(),
            name: format!("shard-{:03}.bin", files.len()),
            size,
        });
        total += size;
    }
    files
}

/// A deterministic shuffle per pod (xorshift).
fn order(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Reads every file under `dir` in each pod's order, 4 pods at once, checking one word per MiB.
/// Returns the wall time.
fn read_epoch(dirs: &[PathBuf], files: &[FileSpec]) -> anyhow::Result<Duration> {
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = dirs
            .iter()
            .enumerate()
            .map(|(pod, dir)| {
                s.spawn(move || -> anyhow::Result<()> {
                    let mut buf = vec![0u8; MIB as usize];
                    for i in order(files.len(), pod as u64 + 1) {
                        let f = &files[i];
                        let path = dir.join(&f.name);
                        let mut file = std::fs::File::open(&path)
                            .with_context(|| format!("opening {}", path.display()))?;
                        let mut off = 0u64;
                        loop {
                            let n = file
                                .read(&mut buf)
                                .with_context(|| format!("reading {}", path.display()))?;
                            if n == 0 {
                                break;
                            }
                            let aligned = off.next_multiple_of(8);
                            if aligned + 8 <= off + n as u64 {
                                let at = (aligned - off) as usize;
                                let got = u64::from_le_bytes(buf[at..at + 8].try_into().unwrap());
                                if got != word(f.index, aligned) {
                                    bail!("{}: wrong data at offset {aligned}", path.display());
                                }
                            }
                            off += n as u64;
                        }
                        if off != f.size {
                            bail!("{}: read {off} bytes of {}", path.display(), f.size);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join().expect("reader thread")?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(start.elapsed())
}

fn drop_caches() {
    let _ = std::process::Command::new("sync").status();
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("warning: could not drop the page cache: {e}");
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// One `ferry-node serve` process.
struct Node {
    child: Child,
    socket: PathBuf,
    metrics: SocketAddr,
}

impl Node {
    async fn start(
        cli: &Cli,
        work: &Path,
        server: &S3Server,
        proxy: &DelayProxy,
        cache: &Path,
        block_size: &str,
    ) -> anyhow::Result<Node> {
        let socket = work.join("node.sock");
        let _ = std::fs::remove_file(&socket);
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(work.join(format!("ferry-node-{block_size}.log")))?;
        let child = Command::new(&cli.ferry_bin)
            .args(["serve", "--node-id", "bench", "--force-path-style"])
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", socket.display()))
            .arg("--kubelet-root")
            .arg(work.join("kubelet"))
            .args(["--endpoint-url", &proxy.url(), "--region", server.region()])
            .args(["--allowed-endpoints", &proxy.url()])
            .args(["--metrics-addr", &metrics.to_string()])
            .arg("--cache-dir")
            .arg(cache)
            .args(["--cache-max-size", "8GiB", "--cache-min-free", "1GiB"])
            .args(cli.no_passthrough.then_some("--no-cache-passthrough"))
            .args(["--cache-block-size", block_size])
            .env("AWS_ACCESS_KEY_ID", server.access_key())
            .env("AWS_SECRET_ACCESS_KEY", server.secret_key())
            .env("FERRY_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", cli.ferry_bin.display()))?;
        let mut node = Node {
            child,
            socket,
            metrics,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = node.child.try_wait()? {
                bail!(
                    "ferry-node exited with {status} (see the log in {})",
                    work.display()
                );
            }
            if node.socket.exists() {
                if let Ok(ch) = unix_channel(&node.socket).await {
                    let ready = pb::identity_client::IdentityClient::new(ch)
                        .probe(pb::ProbeRequest {})
                        .await
                        .map(|r| r.into_inner().ready.unwrap_or(true));
                    if let Ok(true) = ready {
                        return Ok(node);
                    }
                }
            }
            if Instant::now() > deadline {
                bail!("ferry-node did not become ready within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn client(&self) -> anyhow::Result<pb::node_client::NodeClient<Channel>> {
        Ok(pb::node_client::NodeClient::new(
            unix_channel(&self.socket).await?,
        ))
    }

    async fn publish(&self, target: &Path) -> anyhow::Result<()> {
        use pb::volume_capability::access_mode::Mode;
        let cap = pb::VolumeCapability {
            access_type: Some(pb::volume_capability::AccessType::Mount(
                pb::volume_capability::MountVolume {
                    fs_type: String::new(),
                    mount_flags: vec!["metadata-ttl indefinite".into()],
                    volume_mount_group: String::new(),
                },
            )),
            access_mode: Some(pb::volume_capability::AccessMode {
                mode: Mode::MultiNodeReaderOnly as i32,
            }),
        };
        let ctx: HashMap<String, String> = [
            ("bucketName".to_string(), BUCKET.to_string()),
            ("prefix".to_string(), PREFIX.to_string()),
        ]
        .into();
        self.client()
            .await?
            .node_publish_volume(pb::NodePublishVolumeRequest {
                volume_id: format!("{BUCKET}/{PREFIX}"),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                readonly: true,
                volume_context: ctx,
                ..Default::default()
            })
            .await
            .with_context(|| format!("NodePublishVolume at {}", target.display()))?;
        Ok(())
    }

    async fn unpublish(&self, target: &Path) -> anyhow::Result<()> {
        self.client()
            .await?
            .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                volume_id: format!("{BUCKET}/{PREFIX}"),
                target_path: target.display().to_string(),
            })
            .await?;
        Ok(())
    }

    /// The sum of every series of metric `name` whose labels contain `filter`.
    fn metric(&self, name: &str, filter: &str) -> anyhow::Result<f64> {
        let mut s = TcpStream::connect(self.metrics)?;
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.split(['{', ' ']).next() == Some(name)
                    && (filter.is_empty() || l.contains(filter))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .fold(0.0, |a, b| a + b))
    }

    fn stop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; at worst ESRCH.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Row {
    block_size: String,
    epoch1: Duration,
    get_bytes: f64,
    proxy_bytes: u64,
    joins: f64,
    /// Blocks evicted and fetched blocks not stored during epoch 1 (space pressure).
    evicted: f64,
    skipped: f64,
    epoch2: Duration,
    gets2: f64,
    proxy_bytes2: u64,
    hit_bytes2: f64,
    /// Whole objects joined in epoch 1, and opens handed to the kernel (passthrough) in epoch 2.
    assembled: f64,
    whole_opens2: f64,
}

fn mibs(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / MIB as f64 / d.as_secs_f64()
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("run ferry-bench-cache as root (FUSE mounts, drop_caches)");
    }
    if !cli.ferry_bin.exists() {
        bail!(
            "{} not found: cargo build --release -p ferry-node",
            cli.ferry_bin.display()
        );
    }
    if Path::new("/dev/shm").is_dir() && std::env::var_os("FERRY_TEST_TMPDIR").is_none() {
        // Single-threaded here: nothing else reads the environment concurrently.
        std::env::set_var("FERRY_TEST_TMPDIR", "/dev/shm");
    }
    let work = match &cli.work_dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.clone()
        }
        None => tempfile::Builder::new()
            .prefix("ferry-bench-cache-")
            .tempdir_in("/var/tmp")?
            .keep(),
    };
    let result = run(&cli, &work);
    if !cli.keep_work {
        let _ = std::fs::remove_dir_all(&work);
    }
    result
}

fn run(cli: &Cli, work: &Path) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    let files = dataset(cli.dataset_mib);
    let total: u64 = files.iter().map(|f| f.size).sum();
    eprintln!(
        "P9: {} files, {} MiB; block sizes {:?}; work dir {}",
        files.len(),
        total / MIB,
        cli.block_sizes,
        work.display()
    );
    let server = S3Server::start();
    // The local-disk baseline: the same files in a directory on this disk.
    let local = work.join("local");
    std::fs::create_dir_all(&local)?;
    rt.block_on(async {
        server.create_bucket(BUCKET).await;
        let store = server.store().await;
        for f in &files {
            let body = content(f.index, f.size);
            std::fs::write(local.join(&f.name), &body)?;
            store
                .put(BUCKET, &format!("{PREFIX}{}", f.name), body.into())
                .await?;
        }
        anyhow::Ok(())
    })?;
    let upstream = SocketAddr::from(([127, 0, 0, 1], server.port()));
    let proxy = DelayProxy::start(upstream, Duration::from_millis(cli.rtt_ms) / 2)?;

    let mut rows = Vec::new();
    for bs in &cli.block_sizes {
        eprintln!("P9 block size {bs}: epoch 1");
        let cache = work.join(format!("cache-{bs}"));
        let targets: Vec<PathBuf> = (0..PODS)
            .map(|i| {
                let parent = work
                    .join("kubelet/pods")
                    .join(format!("pod-{i}"))
                    .join("volumes/kubernetes.io~csi/pv-p9");
                std::fs::create_dir_all(&parent).map(|()| parent.join("mount"))
            })
            .collect::<Result<_, _>>()?;
        let row = rt.block_on(async {
            let mut node = Node::start(cli, work, &server, &proxy, &cache, bs).await?;
            for t in &targets {
                node.publish(t).await?;
            }
            drop_caches();
            let (p0, m0) = (
                proxy.bytes_down(),
                node.metric("ferry_s3_received_bytes_total", "")?,
            );
            let targets2 = targets.clone();
            let files2 = files.clone();
            let epoch1 =
                tokio::task::spawn_blocking(move || read_epoch(&targets2, &files2)).await??;
            let get_bytes = node.metric("ferry_s3_received_bytes_total", "")? - m0;
            let proxy_bytes = proxy.bytes_down() - p0;
            let joins = node.metric("ferry_cache_single_flight_joins_total", "")?;
            let evicted = node.metric("ferry_cache_evictions_total", "")?;
            let skipped = node.metric("ferry_cache_store_skipped_total", "")?;
            let assembled = node.metric("ferry_cache_objects_assembled_total", "")?;
            eprintln!("P9 block size {bs}: restart");
            node.stop();
            let node = Node::start(cli, work, &server, &proxy, &cache, bs).await?;
            for t in &targets {
                node.publish(t).await?;
            }
            drop_caches();
            let p1 = proxy.bytes_down();
            let targets2 = targets.clone();
            let files2 = files.clone();
            eprintln!("P9 block size {bs}: epoch 2");
            let epoch2 =
                tokio::task::spawn_blocking(move || read_epoch(&targets2, &files2)).await??;
            let gets2 = node.metric("ferry_s3_requests_total", "op=\"get\"")?;
            let hit_bytes2 = node.metric("ferry_cache_hit_bytes_total", "")?;
            let whole_opens2 = node.metric("ferry_cache_passthrough_opens_total", "")?;
            let proxy_bytes2 = proxy.bytes_down() - p1;
            for t in &targets {
                node.unpublish(t).await?;
            }
            let mut node = node;
            node.stop();
            anyhow::Ok(Row {
                block_size: bs.clone(),
                epoch1,
                get_bytes,
                proxy_bytes,
                joins,
                evicted,
                skipped,
                epoch2,
                gets2,
                proxy_bytes2,
                hit_bytes2,
                assembled,
                whole_opens2,
            })
        })?;
        let _ = std::fs::remove_dir_all(&cache);
        rows.push(row);
    }

    // Three runs (this disk's speed varies by ±20 % from run to run): the median is the baseline.
    eprintln!("P9 local-disk baseline");
    let locals: Vec<PathBuf> = (0..PODS).map(|_| local.clone()).collect();
    let mut local_times = Vec::new();
    for _ in 0..3 {
        drop_caches();
        local_times.push(read_epoch(&locals, &files)?);
    }
    local_times.sort();
    let local_time = local_times[1];
    let read_bytes = total * PODS as u64;

    let mut out = String::new();
    out.push_str(&format!(
        "\n### P9: {PODS} pods, one node cache, {} files ({} MiB, 1–64 MiB each), RTT {} ms, load {:.1}\n\n",
        files.len(),
        total / MIB,
        cli.rtt_ms,
        load_average()
    ));
    out.push_str(&format!(
        "Passthrough: {}.\n\n",
        if cli.no_passthrough {
            "off (--no-cache-passthrough)"
        } else {
            "on"
        }
    ));
    out.push_str("| block size | epoch 1 MiB/s (4 pods) | S3 GET bytes / dataset (Ferry metrics) | proxy bytes / dataset | single-flight joins | evicted / not stored (epoch 1) | objects joined whole (epoch 1) | epoch 2 after restart MiB/s | epoch 2 data GETs | epoch 2 passthrough opens | epoch 2 bytes Ferry read from cache / read | epoch 2 proxy bytes | epoch 2 / local disk |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    let local_speed = mibs(read_bytes, local_time);
    for r in &rows {
        out.push_str(&format!(
            "| {} | {:.0} | {:.3} | {:.3} | {:.0} | {:.0} / {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {} | {:.2} |\n",
            r.block_size,
            mibs(read_bytes, r.epoch1),
            r.get_bytes / total as f64,
            r.proxy_bytes as f64 / total as f64,
            r.joins,
            r.evicted,
            r.skipped,
            r.assembled,
            mibs(read_bytes, r.epoch2),
            r.gets2,
            r.whole_opens2,
            r.hit_bytes2 / read_bytes as f64,
            r.proxy_bytes2,
            mibs(read_bytes, r.epoch2) / local_speed,
        ));
    }
    out.push_str(&format!(
        "\nLocal disk (same files, same 4 readers, page cache dropped before each of 3 runs): \
         {local_speed:.0} MiB/s (median; runs {}).\n",
        local_times
            .iter()
            .map(|t| format!("{:.0}", mibs(read_bytes, *t)))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    print!("{out}");
    if let Some(path) = &cli.out {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?
            .write_all(out.as_bytes())?;
    }
    Ok(())
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split(' ').next()?.parse().ok())
        .unwrap_or(f64::NAN)
}
