//! The FUSE mounters under test: how each is found, started (in the foreground, as our child, so
//! its PID is the process whose memory P10 reads), waited for, and always unmounted and reaped.
//!
//! Every mounter gets the same semantics as far as it allows: read-write, no local data cache,
//! metadata (names and attributes) trusted for [`METADATA_TTL_SECS`], path-style requests to the
//! delay proxy, static keys from the environment, owner = the mounting user (root). Two exceptions:
//! `ferry-cache` is Ferry with the node cache as the Helm chart enables it (a fresh, empty cache
//! directory per mount), and a [`Mode::ReadOnly`] mount (P12, P14) gets what each mounter's users run
//! for a dataset. [`Kind::flags`] is the single place those flags are spelled, and the report
//! prints them.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// How long every mounter may trust metadata it has seen.
pub const METADATA_TTL_SECS: u32 = 60;
/// The node cache of `ferry-cache`, as the Helm chart sets it (`node.cache.maxSize: 20GiB`), in
/// MiB; every other cache flag keeps `ferry-node mount`'s default (4 MiB blocks, passthrough on).
pub const FERRY_CACHE_MAX_MIB: u32 = 20 * 1024;
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Ferry,
    /// Ferry with the node cache on (the chart's default).
    FerryCache,
    MountS3,
    S3fs,
    Rclone,
    Geesefs,
    Goofys,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Ferry,
        Kind::FerryCache,
        Kind::MountS3,
        Kind::S3fs,
        Kind::Rclone,
        Kind::Geesefs,
        Kind::Goofys,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Ferry => "ferry",
            Kind::FerryCache => "ferry-cache",
            Kind::MountS3 => "mount-s3",
            Kind::S3fs => "s3fs",
            Kind::Rclone => "rclone",
            Kind::Geesefs => "geesefs",
            Kind::Goofys => "goofys",
        }
    }

    pub fn parse(s: &str) -> anyhow::Result<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.name() == s.trim())
            .with_context(|| {
                let names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown mounter {s:?} ({})", names.join(", "))
            })
    }

    /// Whether this is `ferry-node` (with or without the node cache).
    pub fn is_ferry(self) -> bool {
        matches!(self, Kind::Ferry | Kind::FerryCache)
    }

    /// The executable for this mounter, or why there is none.
    pub fn binary(self, tools: &Tools) -> Result<PathBuf, String> {
        let found = |p: PathBuf, hint: &str| {
            if p.is_file() {
                Ok(p)
            } else {
                Err(format!("{} not found ({hint})", p.display()))
            }
        };
        match self {
            Kind::Ferry | Kind::FerryCache => found(
                tools.ferry_bin.clone(),
                "cargo build --release -p ferry-node",
            ),
            Kind::MountS3 => found(
                tools.dir.join("mount-s3-bench"),
                "bench/setup-peers.sh builds it",
            ),
            Kind::S3fs => found("/usr/bin/s3fs".into(), "apt-get install s3fs"),
            Kind::Rclone => found("/usr/bin/rclone".into(), "apt-get install rclone fuse3"),
            Kind::Geesefs => found(tools.dir.join("geesefs"), "bench/setup-peers.sh"),
            Kind::Goofys => found(tools.dir.join("goofys"), "bench/setup-peers.sh"),
        }
    }

    /// The mounter's arguments after its executable; `creds` is a file holding `KEY:SECRET`
    /// (s3fs reads keys only from a file), `cache` the node cache directory (`ferry-cache` only).
    pub fn flags(
        self,
        s3: &S3Target,
        dir: &Path,
        creds: &Path,
        cache: &Path,
        mode: Mode,
    ) -> Vec<String> {
        let ttl = METADATA_TTL_SECS;
        let ro = mode == Mode::ReadOnly;
        let dir = dir.display().to_string();
        let mut v: Vec<String> = Vec::new();
        let mut push = |items: &[&str]| v.extend(items.iter().map(|s| s.to_string()));
        match self {
            Kind::Ferry | Kind::FerryCache => {
                push(&[
                    "mount",
                    &s3.bucket,
                    &dir,
                    "--endpoint-url",
                    &s3.endpoint_url,
                ]);
                push(&["--force-path-style", "--region", &s3.region]);
                if ro {
                    // A read-only volume keeps metadata for the mount's life unless told otherwise:
                    // what a user of a dataset runs.
                    push(&["--read-only"]);
                } else {
                    push(&["--metadata-ttl", &ttl.to_string()]);
                }
                push(&["--foreground"]);
                if self == Kind::FerryCache {
                    let max = FERRY_CACHE_MAX_MIB.to_string();
                    push(&["--cache", &cache.display().to_string()]);
                    push(&["--max-cache-size", &max]);
                }
            }
            Kind::MountS3 => {
                push(&[&s3.bucket, &dir, "--endpoint-url", &s3.endpoint_url]);
                push(&["--force-path-style", "--region", &s3.region]);
                if ro {
                    // Mountpoint's documented setting for data that does not change.
                    push(&["--read-only", "--metadata-ttl", "indefinite"]);
                } else {
                    push(&["--metadata-ttl", &ttl.to_string()]);
                }
            }
            Kind::S3fs => {
                push(&[
                    &s3.bucket,
                    &dir,
                    "-f",
                    "-o",
                    &format!("url={}", s3.endpoint_url),
                ]);
                push(&["-o", "use_path_request_style"]);
                push(&["-o", &format!("endpoint={}", s3.region)]);
                push(&["-o", &format!("passwd_file={}", creds.display())]);
                push(&["-o", &format!("stat_cache_expire={ttl}")]);
                if ro {
                    push(&["-o", "ro"]);
                }
            }
            Kind::Rclone => {
                push(&["mount", &format!(":s3:{}", s3.bucket), &dir]);
                push(&["--s3-provider", "Other", "--s3-endpoint", &s3.endpoint_url]);
                push(&["--s3-region", &s3.region, "--s3-force-path-style"]);
                push(&["--s3-access-key-id", &s3.access_key]);
                push(&["--s3-secret-access-key", &s3.secret_key]);
                push(&["--vfs-cache-mode", "off"]);
                push(&["--dir-cache-time", &format!("{ttl}s")]);
                push(&["--attr-timeout", &format!("{ttl}s")]);
                if ro {
                    push(&["--read-only"]);
                }
            }
            Kind::Geesefs => {
                push(&["-f", "--endpoint", &s3.endpoint_url, "--region", &s3.region]);
                push(&["--stat-cache-ttl", &format!("{ttl}s")]);
                if ro {
                    push(&["-o", "ro"]);
                }
                push(&[&s3.bucket, &dir]);
            }
            Kind::Goofys => {
                push(&["-f", "--endpoint", &s3.endpoint_url, "--region", &s3.region]);
                push(&["--stat-cache-ttl", &format!("{ttl}s")]);
                push(&["--type-cache-ttl", &format!("{ttl}s")]);
                if ro {
                    push(&["-o", "ro"]);
                }
                push(&[&s3.bucket, &dir]);
            }
        }
        v
    }
}

/// How a workload group mounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The benchmark's common semantics (P3 writes; metadata trusted for 60 s).
    ReadWrite,
    /// A dataset mounted as its users mount it (P12).
    ReadOnly,
}

/// Where the mounters' executables are.
#[derive(Debug, Clone)]
pub struct Tools {
    /// `target/release/ferry-node`.
    pub ferry_bin: PathBuf,
    /// `~/.cache/ferry-tools/bin`.
    pub dir: PathBuf,
}

/// The S3 endpoint (the delay proxy) and credentials every mounter is given.
#[derive(Debug, Clone)]
pub struct S3Target {
    pub endpoint_url: String,
    pub bucket: String,
    pub region: String,
    pub access_key: String,
    pub secret_key: String,
}

/// Whether the node cache in `cache` has made its 256 block directories (`blocks/00` to
/// `blocks/ff`, `ff` last). A fresh cache makes them in the background when it opens: the CSI
/// node plugin opens its cache when it starts, before it serves any volume, so its pods' first
/// reads never share the CPU with those `mkdir`s (59–80 ms of CPU on the benchmark VM, where ext4
/// spreads new directories over the disk); a standalone `mount --cache` opens it at the mount.
/// Waiting for them measures what the chart's users run.
fn cache_dirs_made(cache: &Path) -> bool {
    cache.join("blocks").join("ff").is_dir()
}

/// A live mount; unmounted (or killed and detached) when dropped.
pub struct Mount {
    pub kind: Kind,
    pub dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
    /// Where ferry serves Prometheus metrics (ferry only).
    metrics_addr: Option<String>,
}

impl Mount {
    /// Starts `kind` on `dir` (created if missing) and waits until the kernel shows the mount.
    /// `ferry-cache` gets a fresh, empty cache directory under `work` (so a cold workload is cold
    /// for the node cache too), removed with `work` at the end of the run, and is waited for
    /// until the cache has made its block directories ([`cache_dirs_made`]).
    pub fn start(
        kind: Kind,
        tools: &Tools,
        s3: &S3Target,
        dir: &Path,
        work: &Path,
        mode: Mode,
    ) -> anyhow::Result<Mount> {
        let bin = kind.binary(tools).map_err(anyhow::Error::msg)?;
        std::fs::create_dir_all(dir)?;
        if mounted(dir)? {
            bail!("{} is already a mount point", dir.display());
        }
        let creds = work.join("s3fs.passwd");
        std::fs::write(&creds, format!("{}:{}\n", s3.access_key, s3.secret_key))?;
        set_mode_600(&creds)?;
        let log = work.join(format!(
            "{}-{}.log",
            kind.name(),
            dir.file_name().unwrap_or_default().to_string_lossy()
        ));
        let out = File::create(&log)?;
        let cache = cache_dir(work, dir);
        if kind == Kind::FerryCache {
            // Named by round and group in a fresh work dir: new, so empty (an existing one is an
            // error, never emptied here; see `finish`).
            std::fs::create_dir(&cache).with_context(|| format!("creating {}", cache.display()))?;
        }
        let mut args = kind.flags(s3, dir, &creds, &cache, mode);
        // Ferry's own request counters, read back per workload group (observability only).
        let metrics_addr = kind.is_ferry().then(free_local_addr).transpose()?;
        if let Some(addr) = &metrics_addr {
            args.extend(["--metrics-addr".to_string(), addr.clone()]);
        }
        let child = Command::new(&bin)
            .args(args)
            .env("AWS_ACCESS_KEY_ID", &s3.access_key)
            .env("AWS_SECRET_ACCESS_KEY", &s3.secret_key)
            .env("AWS_REGION", &s3.region)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            // The endpoint is plain http; a CA bundle from the caller's environment only breaks
            // rclone's SDK ("unsupported transport").
            .env_remove("AWS_CA_BUNDLE")
            .env(
                "FERRY_LOG",
                std::env::var("FERRY_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env("RCLONE_CONFIG", work.join("rclone.conf"))
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut m = Mount {
            kind,
            dir: dir.to_owned(),
            child: Some(child),
            log,
            metrics_addr,
        };
        let deadline = Instant::now() + MOUNT_TIMEOUT;
        loop {
            if let Some(status) = m.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                m.child = None;
                bail!(
                    "{} exited with {status} before mounting; its log:\n{}",
                    kind.name(),
                    m.log_tail()
                );
            }
            let is_mounted = mounted(dir)?;
            if is_mounted && (kind != Kind::FerryCache || cache_dirs_made(&cache)) {
                return Ok(m);
            }
            if Instant::now() > deadline {
                let tail = m.log_tail();
                drop(m);
                let what = if is_mounted {
                    format!("had not made {}/blocks/ff", cache.display())
                } else {
                    "did not mount".to_string()
                };
                bail!(
                    "{} {what} within {MOUNT_TIMEOUT:?}; its log:\n{tail}",
                    kind.name()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Ferry's S3 requests so far by operation, from its `/metrics` endpoint, e.g.
    /// `get 2000, list 3`; results other than `ok` are spelled out; and its FUSE requests by
    /// operation (`FUSE read 8192`, `FUSE open 1`); and, with the node cache, the blocks it
    /// stored and did not store so far (`cache fills 1990, cache not stored 10`: blocks still in
    /// its write queue are in neither); and the GET bodies' bytes (`MiB received 256`). `None`
    /// for other mounters.
    pub fn s3_requests(&self) -> Option<String> {
        use std::io::{Read, Write};
        let addr = self.metrics_addr.as_ref()?;
        let mut s = std::net::TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let mut counts: Vec<(String, f64)> = Vec::new();
        for line in text.lines() {
            for (metric, key, unit) in [
                ("ferry_cache_fills_total ", "cache fills", 1.0),
                ("ferry_cache_store_skipped_total ", "cache not stored", 1.0),
                ("ferry_s3_received_bytes_total ", "MiB received", 1048576.0),
            ] {
                if let Some(v) = line.strip_prefix(metric) {
                    let v: f64 = v.trim().parse().unwrap_or(0.0);
                    counts.push((key.to_string(), (v / unit).round()));
                }
            }
            // FUSE requests too: e.g. how many requests the kernel split the reads into.
            let (rest, fuse) = match (
                line.strip_prefix("ferry_s3_requests_total{"),
                line.strip_prefix("ferry_fuse_operations_total{"),
            ) {
                (Some(rest), _) => (rest, false),
                (_, Some(rest)) => (rest, true),
                _ => continue,
            };
            let Some((labels, value)) = rest.split_once("} ") else {
                continue;
            };
            let label = |name: &str| {
                labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
                    .unwrap_or_default()
            };
            let (op, result) = (label("op"), label("result"));
            let key = match (fuse, result == "ok" || result.is_empty()) {
                (true, _) => format!("FUSE {op}"),
                (false, true) => op,
                (false, false) => format!("{op} ({result})"),
            };
            let v: f64 = value.trim().parse().unwrap_or(0.0);
            match counts.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += v,
                None => counts.push((key, v)),
            }
        }
        counts.sort_by(|a, b| a.0.cmp(&b.0));
        Some(
            counts
                .iter()
                .filter(|(_, n)| *n > 0.0)
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
        )
    }

    /// The last lines the mounter printed.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// `umount`, then waits for the mounter to exit (killing it if it does not). Reports an
    /// unmount that needed force.
    pub fn unmount(mut self) -> anyhow::Result<()> {
        self.finish(false)
    }

    /// Kills the mounter at once and detaches the mount: what a hung workload gets, so that its
    /// blocked system calls fail (ENOTCONN) instead of hanging forever.
    pub fn abort(&mut self) {
        let _ = self.finish(true);
    }

    fn finish(&mut self, force: bool) -> anyhow::Result<()> {
        // The cache directory stays until the work dir is removed at the end of the run:
        // deleting its thousands of files here would charge them to the next group. On an ext4
        // without a journal (this VM's root), every new inode is searched for past the inodes
        // deleted in the last 5 s (300 s while their inode table block is dirty), one by one
        // (`find_inode_bit`, `recently_deleted` in `fs/ext4/ialloc.c`): the next mount's cache
        // would pay that on every block it stores (`doc/BENCHMARKS.md`, issue 17).
        self.stop(force)
    }

    fn stop(&mut self, force: bool) -> anyhow::Result<()> {
        let Some(mut child) = self.child.take() else {
            if mounted(&self.dir).unwrap_or(false) {
                let _ = umount(&self.dir, true);
            }
            return Ok(());
        };
        let mut problems = Vec::new();
        if force {
            let _ = child.kill();
        } else if let Err(e) = umount(&self.dir, false) {
            problems.push(format!("umount: {e}"));
        }
        if wait_timeout(&mut child, EXIT_TIMEOUT).is_none() {
            problems.push("did not exit after unmount; killed".to_string());
            let _ = child.kill();
            let _ = child.wait();
        }
        if mounted(&self.dir).unwrap_or(false) {
            let _ = umount(&self.dir, true);
        }
        if problems.is_empty() || force {
            Ok(())
        } else {
            bail!("{}: {}", self.kind.name(), problems.join("; "))
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = self.finish(false) {
            eprintln!("cleanup: {e:#}");
        }
    }
}

fn wait_timeout(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `umount DIR` (`umount -l DIR` when `lazy`).
fn umount(dir: &Path, lazy: bool) -> anyhow::Result<()> {
    let mut cmd = Command::new("umount");
    if lazy {
        cmd.arg("-l");
    }
    let out = cmd.arg(dir).stdin(Stdio::null()).output()?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Whether `dir` is a mount point now (from `/proc/self/mountinfo`).
pub fn mounted(dir: &Path) -> anyhow::Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let want = dir.to_string_lossy().replace(' ', "\\040");
    Ok(info
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str())))
}

/// The node cache directory of the `ferry-cache` mount at `dir`: on the work dir's filesystem (a
/// local disk, as the chart asks of `node.cache.hostPath`), one per mount point.
pub fn cache_dir(work: &Path, dir: &Path) -> PathBuf {
    work.join(format!(
        "cache-{}",
        dir.file_name().unwrap_or_default().to_string_lossy()
    ))
}

/// `127.0.0.1:<a port that was free a moment ago>`.
fn free_local_addr() -> anyhow::Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

fn set_mode_600(p: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))?;
    Ok(())
}

/// Peak resident memory (VmHWM) and current resident memory (VmRSS) of `pid`, in bytes.
pub fn memory_of(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// A one-line version string for the report.
pub fn version_of(kind: Kind, tools: &Tools) -> String {
    let Ok(bin) = kind.binary(tools) else {
        return "-".into();
    };
    let arg = match kind {
        Kind::MountS3 => {
            return "mountpoint-s3-fs 0.11.0 / mountpoint-s3-client 0.22.0 (library; our own main)"
                .into()
        }
        Kind::Rclone => "version",
        _ => "--version",
    };
    Command::new(bin)
        .arg(arg)
        .stdin(Stdio::null())
        .output()
        .map(|o| {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            text.lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("?")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|e| format!("? ({e})"))
}
