//! The workloads of the data-path issue (P1–P14), run against one mount at a time, and the
//! references they are compared with (the SDK ceiling, the page cache).
//!
//! Each group of workloads gets a fresh mount; each workload runs on a worker thread under a
//! deadline. A workload that overruns gets `timeout`: the mounter is killed and its mount detached,
//! which makes the worker's blocked system calls fail, so the benchmark always moves on.

use std::io::{BufRead, BufReader, Read, Write as _};
use std::os::fd::IntoRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ferry_s3::S3Store;
use ferry_store::ObjectStore;
use futures::stream::{self, StreamExt, TryStreamExt};

use crate::dataset::{check_sample, content, random_word, seed_of, Dataset, BUCKET, MIB};
use crate::mounters::{memory_of, Mode, Mount};

/// What a user program reads or writes with at a time (`dd bs=1M`).
const IO_BUF: usize = 1024 * 1024;

/// One row of the result table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Row {
    P1,
    P2,
    P3,
    P4One,
    P4Eight,
    P5Cold,
    P5Warm,
    P6,
    P7,
    P10,
    P11,
    P12Epoch1,
    P12Epoch2,
    P13,
    P14Cold,
    P14Warm,
}

impl Row {
    pub const ALL: [Row; 16] = [
        Row::P1,
        Row::P2,
        Row::P3,
        Row::P4One,
        Row::P4Eight,
        Row::P5Cold,
        Row::P5Warm,
        Row::P6,
        Row::P7,
        Row::P10,
        Row::P11,
        Row::P12Epoch1,
        Row::P12Epoch2,
        Row::P13,
        Row::P14Cold,
        Row::P14Warm,
    ];

    /// The workload name as the issue spells it (`--only` takes these).
    pub fn workload(self) -> &'static str {
        match self {
            Row::P1 => "P1",
            Row::P2 => "P2",
            Row::P3 => "P3",
            Row::P4One | Row::P4Eight => "P4",
            Row::P5Cold | Row::P5Warm => "P5",
            Row::P6 => "P6",
            Row::P7 => "P7",
            Row::P10 => "P10",
            Row::P11 => "P11",
            Row::P12Epoch1 | Row::P12Epoch2 => "P12",
            Row::P13 => "P13",
            Row::P14Cold | Row::P14Warm => "P14",
        }
    }

    pub fn title(self, ds: &Dataset) -> String {
        let mib = |b: u64| b / MIB;
        match self {
            Row::P1 => format!("P1 {} MiB sequential read, cold", mib(ds.big_size)),
            Row::P2 => "P2 same file re-read, warm (same mount)".to_string(),
            Row::P3 => format!("P3 {} × 8 KiB files written, closed each", ds.write_count),
            Row::P4One => format!("P4 {} × 128 KiB read cold, 1 reader", ds.small_count),
            Row::P4Eight => format!("P4 {} × 128 KiB read cold, 8 readers", ds.small_count),
            Row::P5Cold => format!("P5 ls -la of {} entries, cold", ds.listing_count),
            Row::P5Warm => format!("P5 ls -la of {} entries, warm", ds.listing_count),
            Row::P6 => format!(
                "P6 fio randread 4 KiB O_DIRECT, 4 jobs, {} MiB file",
                mib(ds.big_size)
            ),
            Row::P7 => format!("P7 8 concurrent readers × {} MiB", mib(ds.shard_size)),
            Row::P10 => "P10 mounter peak RSS (VmHWM) after P1".to_string(),
            Row::P11 => format!("P11 readdir of {} entries", ds.many_count),
            Row::P12Epoch1 => format!(
                "P12 ML loader epoch 1 ({ML_WORKERS} processes, {} × 128 KiB, read-only mount, cold)",
                ds.small_count
            ),
            Row::P12Epoch2 => "P12 ML loader epoch 2 (same mount, no cache drop)".to_string(),
            Row::P13 => "P13 mounter peak RSS (VmHWM) after P7".to_string(),
            Row::P14Cold => format!(
                "P14 ls -la of {} entries, read-only mount, cold",
                ds.listing_count
            ),
            Row::P14Warm => format!(
                "P14 ls -la of {} entries, read-only mount, warm",
                ds.listing_count
            ),
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Row::P1 | Row::P2 | Row::P7 => "MiB/s ↑",
            Row::P3 | Row::P4One | Row::P4Eight | Row::P12Epoch1 | Row::P12Epoch2 => "files/s ↑",
            Row::P5Cold | Row::P5Warm | Row::P11 | Row::P14Cold | Row::P14Warm => "s ↓",
            Row::P6 => "IOPS ↑",
            Row::P10 | Row::P13 => "MiB ↓",
        }
    }

    pub fn higher_is_better(self) -> bool {
        self.unit().ends_with('↑')
    }
}

/// A measured value or why there is none.
#[derive(Debug, Clone)]
pub enum Cell {
    Value(f64),
    Failed(String),
}

/// Workloads that share one fresh mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// P1 (cold read), P10 (memory after it), P2 (warm re-read).
    Sequential,
    Writes,
    SmallOne,
    SmallEight,
    Listing,
    Random,
    Concurrent,
    Huge,
    /// P12: both epochs on one fresh read-only mount.
    MlLoader,
    /// P14: P5's listings on a fresh read-only mount.
    ListingReadOnly,
}

impl Group {
    pub const ALL: [Group; 10] = [
        Group::Sequential,
        Group::Writes,
        Group::SmallOne,
        Group::SmallEight,
        Group::Listing,
        Group::Random,
        Group::Concurrent,
        Group::Huge,
        Group::MlLoader,
        Group::ListingReadOnly,
    ];

    pub fn rows(self) -> &'static [Row] {
        match self {
            Group::Sequential => &[Row::P1, Row::P10, Row::P2],
            Group::Writes => &[Row::P3],
            Group::SmallOne => &[Row::P4One],
            Group::SmallEight => &[Row::P4Eight],
            Group::Listing => &[Row::P5Cold, Row::P5Warm],
            Group::Random => &[Row::P6],
            Group::Concurrent => &[Row::P7, Row::P13],
            Group::Huge => &[Row::P11],
            Group::MlLoader => &[Row::P12Epoch1, Row::P12Epoch2],
            Group::ListingReadOnly => &[Row::P14Cold, Row::P14Warm],
        }
    }

    /// How the group's fresh mount is made.
    pub fn mode(self) -> Mode {
        match self {
            Group::MlLoader | Group::ListingReadOnly => Mode::ReadOnly,
            _ => Mode::ReadWrite,
        }
    }
}

/// What every workload needs besides its mount.
pub struct Bench {
    pub ds: Dataset,
    pub timeout: Duration,
    pub fio_runtime: u64,
    /// Straight to the server, for checking what writes left behind.
    pub direct: S3Store,
    pub rt: tokio::runtime::Handle,
    pub run_id: String,
    /// The round being measured (from 0): each round's P3 writes new files.
    pub round: u32,
    /// How many rounds the run measures (notes of a run of several say their round).
    pub rounds: u32,
    /// Observations for the notes under the table.
    pub notes: Vec<String>,
}

impl Bench {
    /// Runs `group` on `mount` and returns a cell per row.
    pub fn run_group(&mut self, group: Group, mount: &mut Mount) -> Vec<(Row, Cell)> {
        let root = mount.dir.clone();
        let ds = self.ds.clone();
        let mut out = Vec::new();
        match group {
            Group::Sequential => {
                drop_caches();
                let path = root.join(&ds.big_key);
                let seed = seed_of(&ds.big_key);
                let p = path.clone();
                let p1 = self.guarded(mount, move || read_file(&p, seed, IO_BUF));
                let p1_ok = p1.is_ok();
                out.push((Row::P1, self.mib_per_s(mount, "P1", p1)));
                out.push((Row::P10, peak_rss(mount, p1_ok, "no P1")));
                let p2 = if p1_ok {
                    self.guarded(mount, move || read_file(&path, seed, IO_BUF))
                } else {
                    Err("skipped (P1 failed)".into())
                };
                out.push((Row::P2, self.mib_per_s(mount, "P2", p2)));
            }
            Group::Writes => {
                let name = format!("{}-{}-r{}", mount.kind.name(), self.run_id, self.round);
                let dir = root.join(format!("writes/{name}"));
                let (count, size) = (ds.write_count, ds.write_size as usize);
                let d = dir.clone();
                let r = self.guarded(mount, move || write_files(&d, count, size));
                let cell = match r {
                    Ok((secs, _)) => {
                        let prefix = format!("writes/{name}/");
                        let missing = self.missing_objects(&prefix, count, size as u64);
                        if missing > 0 {
                            let at = self.at();
                            self.notes.push(format!(
                                "{at}{}: P3: {missing} of {count} files were not in S3 (with their full size) right after close returned",
                                mount.kind.name()
                            ));
                        }
                        Cell::Value(count as f64 / secs)
                    }
                    Err(e) => self.failed(mount, "P3", e),
                };
                out.push((Row::P3, cell));
            }
            Group::SmallOne | Group::SmallEight => {
                let readers = if group == Group::SmallOne { 1 } else { 8 };
                let row = if readers == 1 {
                    Row::P4One
                } else {
                    Row::P4Eight
                };
                drop_caches();
                let dir = root.join(&ds.small_dir);
                let (expect, size, prefix) = (ds.small_count, ds.small_size, ds.small_dir.clone());
                let r = self.guarded(mount, move || {
                    read_small_files(&dir, &prefix, readers, expect, size)
                });
                let cell = match r {
                    Ok(((), secs)) => Cell::Value(expect as f64 / secs),
                    Err(e) => self.failed(mount, "P4", e),
                };
                out.push((row, cell));
            }
            Group::Listing | Group::ListingReadOnly => {
                let (cold_row, warm_row, w) = match group {
                    Group::Listing => (Row::P5Cold, Row::P5Warm, "P5"),
                    _ => (Row::P14Cold, Row::P14Warm, "P14"),
                };
                drop_caches();
                let dir = root.join(&ds.listing_dir);
                let expect = ds.listing_count;
                let d = dir.clone();
                let cold = self.guarded(mount, move || ls_la(&d, expect));
                let cold_ok = cold.is_ok();
                let cell = self.seconds(mount, &format!("{w} cold"), cold);
                out.push((cold_row, cell));
                let warm = if cold_ok {
                    self.guarded(mount, move || ls_la(&dir, expect))
                } else {
                    Err("skipped (cold failed)".into())
                };
                let cell = self.seconds(mount, &format!("{w} warm"), warm);
                out.push((warm_row, cell));
            }
            Group::Random => {
                drop_caches();
                let cell =
                    match fio_randread(&root.join(&ds.big_key), self.fio_runtime, self.timeout) {
                        Ok(iops) => Cell::Value(iops),
                        Err(e) => {
                            let msg = format!("{e:#}");
                            if msg.contains("timeout") {
                                mount.abort();
                            }
                            self.failed(mount, "P6", msg)
                        }
                    };
                out.push((Row::P6, cell));
            }
            Group::Concurrent => {
                drop_caches();
                let files: Vec<(PathBuf, u64)> = ds
                    .shard_keys
                    .iter()
                    .map(|k| (root.join(k), seed_of(k)))
                    .collect();
                let r = self.guarded(mount, move || read_concurrently(files));
                let p7_ok = r.is_ok();
                out.push((Row::P7, self.mib_per_s(mount, "P7", r)));
                out.push((Row::P13, peak_rss(mount, p7_ok, "no P7")));
            }
            Group::Huge => {
                drop_caches();
                let dir = root.join(&ds.many_dir);
                let expect = ds.many_count;
                let r = self.guarded(mount, move || readdir_count(&dir, expect));
                let cell = self.seconds(mount, "P11", r);
                out.push((Row::P11, cell));
            }
            Group::MlLoader => out.extend(self.ml_loader(mount)),
        }
        out
    }

    /// P12: [`ML_WORKERS`] worker processes started and ready (their binary paged in), then the
    /// page cache dropped, then epoch 1 and, without a drop, epoch 2, each timed from the moment
    /// the workers are handed their lists until the last has read its last file.
    fn ml_loader(&mut self, mount: &mut Mount) -> Vec<(Row, Cell)> {
        let ds = self.ds.clone();
        let keys: Vec<String> = (0..ds.small_count).map(|i| ds.small_key(i)).collect();
        let (root, size) = (mount.dir.clone(), ds.small_size);
        let started = self.guarded(mount, move || {
            let pool = MlPool::start(&root, size)?;
            drop_caches();
            Ok(pool)
        });
        let mut pool = match started {
            Ok((pool, _)) => Some(pool),
            Err(e) => {
                let cell = self.failed(mount, "P12 workers", e);
                return vec![(Row::P12Epoch1, cell.clone()), (Row::P12Epoch2, cell)];
            }
        };
        let mut out = Vec::new();
        for (epoch, row) in [(1, Row::P12Epoch1), (2, Row::P12Epoch2)] {
            let Some(p) = pool.take() else {
                out.push((row, Cell::Failed("skipped".into())));
                continue;
            };
            let order = ml_epoch_order(&keys, epoch);
            let r = self.guarded(mount, move || {
                let mut p = p;
                p.epoch(&order)?;
                Ok(p)
            });
            let what = format!("P12 epoch {epoch}");
            let cell = match r {
                Ok((p, secs)) => {
                    pool = Some(p);
                    Cell::Value(keys.len() as f64 / secs)
                }
                Err(e) => self.failed(mount, &what, e),
            };
            out.push((row, cell));
        }
        out
    }

    /// Runs `f` on a worker thread; past the deadline the mount is aborted (which unblocks the
    /// worker) and the result is `timeout`. Returns the value and the wall time.
    fn guarded<T: Send + 'static>(
        &self,
        mount: &mut Mount,
        f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
    ) -> Result<(T, f64), String> {
        if mount.pid().is_none() {
            return Err("skipped (mount aborted)".into());
        }
        let (tx, rx) = mpsc::channel();
        let t = Instant::now();
        std::thread::spawn(move || {
            let r = f();
            let _ = tx.send((r, t.elapsed().as_secs_f64()));
        });
        match rx.recv_timeout(self.timeout) {
            Ok((Ok(v), secs)) => Ok((v, secs)),
            Ok((Err(e), _)) => Err(format!("{e:#}")),
            Err(_) => {
                mount.abort();
                // The worker's calls now fail; give it a moment to notice.
                let _ = rx.recv_timeout(Duration::from_secs(30));
                Err(format!("timeout ({} s)", self.timeout.as_secs()))
            }
        }
    }

    /// "round N: " when the run measures several rounds, else nothing.
    pub fn at(&self) -> String {
        match self.rounds {
            0 | 1 => String::new(),
            _ => format!("round {}: ", self.round + 1),
        }
    }

    fn failed(&mut self, mount: &Mount, what: &str, e: String) -> Cell {
        let at = self.at();
        self.notes
            .push(format!("{at}{}: {what}: {e}", mount.kind.name()));
        let short = if e.starts_with("timeout") || e.starts_with("skipped") {
            e.split(' ').next().unwrap_or("error").to_string()
        } else {
            "error".to_string()
        };
        Cell::Failed(short)
    }

    fn mib_per_s(
        &mut self,
        mount: &Mount,
        what: &str,
        r: Result<((u64, u64), f64), String>,
    ) -> Cell {
        match r {
            Ok(((bytes, bad), secs)) => {
                if bad > 0 {
                    self.failed(mount, what, format!("{bad} buffers with wrong content"))
                } else {
                    Cell::Value(bytes as f64 / MIB as f64 / secs)
                }
            }
            Err(e) => self.failed(mount, what, e),
        }
    }

    fn seconds(&mut self, mount: &Mount, what: &str, r: Result<((), f64), String>) -> Cell {
        match r {
            Ok(((), secs)) => Cell::Value(secs),
            Err(e) => self.failed(mount, what, e),
        }
    }

    /// How many of the `count` objects P3 wrote under `prefix` are missing or short in S3.
    fn missing_objects(&self, prefix: &str, count: usize, size: u64) -> usize {
        let store = self.direct.clone();
        let prefix = prefix.to_string();
        self.rt.block_on(async move {
            stream::iter(0..count)
                .map(|i| {
                    let (store, key) = (store.clone(), format!("{prefix}w-{i:04}.bin"));
                    async move {
                        match store.head(BUCKET, &key).await {
                            Ok(info) if info.size == size => 0,
                            _ => 1,
                        }
                    }
                })
                .buffer_unordered(32)
                .fold(0, |a, b| async move { a + b })
                .await
        })
    }
}

/// Empties the page cache (and dentries and inodes), as before every cold workload.
pub fn drop_caches() {
    // SAFETY: sync() has no preconditions.
    unsafe { libc::sync() };
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("warning: could not drop caches: {e}");
    }
}

/// Reads `path` to the end with `buf` bytes per read, checking a sample of every buffer.
/// Returns (bytes, buffers with wrong content).
pub fn read_file(path: &Path, seed: u64, buf: usize) -> anyhow::Result<(u64, u64)> {
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut b = vec![0u8; buf];
    let (mut off, mut bad) = (0u64, 0u64);
    loop {
        let n = f
            .read(&mut b)
            .with_context(|| format!("read {} at {off}", path.display()))?;
        if n == 0 {
            return Ok((off, bad));
        }
        if !check_sample(seed, off, &b[..n]) {
            bad += 1;
        }
        off += n as u64;
    }
}

/// P3: creates `count` files of `size` bytes one after the other, each written and closed (the
/// return value of close is checked). Returns seconds.
fn write_files(dir: &Path, count: usize, size: usize) -> anyhow::Result<f64> {
    std::fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
    let data = content(7, 0, size);
    let t = Instant::now();
    for i in 0..count {
        use std::io::Write;
        let p = dir.join(format!("w-{i:04}.bin"));
        let mut f = std::fs::File::create(&p).with_context(|| format!("create {}", p.display()))?;
        f.write_all(&data)
            .with_context(|| format!("write {}", p.display()))?;
        let fd = f.into_raw_fd();
        // SAFETY: we own `fd` (taken out of the File) and close it exactly once.
        if unsafe { libc::close(fd) } != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("close {}", p.display()));
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

/// P4: lists `dir`, then reads every file whole in listing order with `readers` threads taking
/// entries round-robin. Checks the count and a sample of each file. Returns ().
fn read_small_files(
    dir: &Path,
    prefix: &str,
    readers: usize,
    expect: usize,
    size: u64,
) -> anyhow::Result<()> {
    let names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("readdir {}", dir.display()))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .with_context(|| format!("readdir {}", dir.display()))?;
    if names.len() != expect {
        bail!(
            "{} lists {} entries, expected {expect}",
            dir.display(),
            names.len()
        );
    }
    let names = Arc::new(names);
    let handles: Vec<_> = (0..readers)
        .map(|r| {
            let (names, dir, prefix) = (names.clone(), dir.to_owned(), prefix.to_string());
            std::thread::spawn(move || -> anyhow::Result<()> {
                let mut buf = vec![0u8; IO_BUF];
                for name in names.iter().skip(r).step_by(readers) {
                    let seed = seed_of(&format!("{prefix}/{name}"));
                    read_whole(&dir.join(name), seed, size, &mut buf)?;
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a reader panicked"))??;
    }
    Ok(())
}

/// Opens `p`, reads it to the end with `buf.len()` bytes per read, checks a sample of every
/// buffer and the size, and closes it (P4, P12).
fn read_whole(p: &Path, seed: u64, size: u64, buf: &mut [u8]) -> anyhow::Result<()> {
    let mut f = std::fs::File::open(p).with_context(|| format!("open {}", p.display()))?;
    let mut off = 0u64;
    loop {
        let n = f
            .read(buf)
            .with_context(|| format!("read {}", p.display()))?;
        if n == 0 {
            break;
        }
        if !check_sample(seed, off, &buf[..n]) {
            bail!("{}: wrong content at {off}", p.display());
        }
        off += n as u64;
    }
    if off != size {
        bail!("{}: read {off} bytes, expected {size}", p.display());
    }
    Ok(())
}

/// P5: `ls -la`: readdir, then lstat of every entry.
fn ls_la(dir: &Path, expect: usize) -> anyhow::Result<()> {
    let mut n = 0;
    std::fs::symlink_metadata(dir)?;
    for e in std::fs::read_dir(dir).with_context(|| format!("readdir {}", dir.display()))? {
        let e = e?;
        std::fs::symlink_metadata(e.path())
            .with_context(|| format!("lstat {}", e.path().display()))?;
        n += 1;
    }
    if n != expect {
        bail!("{} lists {n} entries, expected {expect}", dir.display());
    }
    Ok(())
}

/// P11: readdir only (names), counting entries.
fn readdir_count(dir: &Path, expect: usize) -> anyhow::Result<()> {
    let mut n = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("readdir {}", dir.display()))? {
        e?;
        n += 1;
    }
    if n != expect {
        bail!("{} lists {n} entries, expected {expect}", dir.display());
    }
    Ok(())
}

/// P7: one thread per file, each reading its file sequentially. Returns (bytes, bad buffers).
fn read_concurrently(files: Vec<(PathBuf, u64)>) -> anyhow::Result<(u64, u64)> {
    let handles: Vec<_> = files
        .into_iter()
        .map(|(p, seed)| std::thread::spawn(move || read_file(&p, seed, IO_BUF)))
        .collect();
    let (mut bytes, mut bad) = (0, 0);
    for h in handles {
        let (b, x) = h
            .join()
            .map_err(|_| anyhow::anyhow!("a reader panicked"))??;
        bytes += b;
        bad += x;
    }
    Ok((bytes, bad))
}

/// P12's worker processes, as a PyTorch `DataLoader(num_workers=8)`.
pub const ML_WORKERS: usize = 8;
/// P12's read size: a loader reading a sample file with 128 KiB reads.
const ML_READ: usize = 128 * 1024;
/// P12's shuffle seed; epoch `e` is shuffled with `ML_SEED + e`, as `DistributedSampler` does
/// after `set_epoch(e)`: the same orders for every mounter, a new order each epoch.
const ML_SEED: u64 = 12;
/// The hidden subcommand a P12 worker process runs (`ferry-bench ml-worker ROOT SIZE`).
pub const ML_WORKER_CMD: &str = "ml-worker";

/// `keys` in epoch `epoch`'s order: a Fisher–Yates shuffle driven by the dataset's content
/// generator.
fn ml_epoch_order(keys: &[String], epoch: u64) -> Vec<String> {
    let mut v = keys.to_vec();
    for i in (1..v.len()).rev() {
        let j = (random_word(ML_SEED + epoch, i as u64) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// One P12 worker: a child process running [`ml_worker`], fed through its stdin.
struct MlWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl MlWorker {
    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("a P12 worker exited ({:?})", self.child.try_wait());
        }
        Ok(line.trim_end().to_string())
    }
}

/// P12's [`ML_WORKERS`] processes, alive across both epochs (`persistent_workers=True`); killed
/// when dropped.
struct MlPool {
    workers: Vec<MlWorker>,
}

impl MlPool {
    /// Starts the workers (this very program, re-executed) and waits until each says `ready`.
    fn start(root: &Path, size: u64) -> anyhow::Result<MlPool> {
        let mut pool = MlPool {
            workers: Vec::new(),
        };
        for _ in 0..ML_WORKERS {
            let mut child = Command::new("/proc/self/exe")
                .arg(ML_WORKER_CMD)
                .arg(root)
                .arg(size.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .context("starting a P12 worker")?;
            let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
                bail!("a P12 worker without pipes");
            };
            pool.workers.push(MlWorker {
                child,
                stdin,
                stdout: BufReader::new(stdout),
            });
        }
        for w in &mut pool.workers {
            let line = w.line()?;
            if line != "ready" {
                bail!("a P12 worker said {line:?}");
            }
        }
        Ok(pool)
    }

    /// One epoch: worker `i` reads files `i`, `i + 8`, … of `order`. Returns when every worker
    /// has read all of its files, or with the first error one reports.
    fn epoch(&mut self, order: &[String]) -> anyhow::Result<()> {
        for (i, w) in self.workers.iter_mut().enumerate() {
            let mine: Vec<&str> = order
                .iter()
                .skip(i)
                .step_by(ML_WORKERS)
                .map(String::as_str)
                .collect();
            writeln!(w.stdin, "{}", mine.join(" "))?;
            w.stdin.flush()?;
        }
        let mut files = 0;
        for w in &mut self.workers {
            let line = w.line()?;
            match line.strip_prefix("ok ") {
                Some(n) => files += n.parse::<usize>()?,
                None => bail!("{line}"),
            }
        }
        if files != order.len() {
            bail!("the workers read {files} files, expected {}", order.len());
        }
        Ok(())
    }
}

impl Drop for MlPool {
    fn drop(&mut self) {
        for w in &mut self.workers {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

/// A P12 worker process: says `ready`, then for each line of keys on stdin reads every file
/// `ROOT/KEY` whole with 128 KiB reads (checked against the dataset's content and `size`) and
/// answers `ok N`, or `error …` at the first failure; exits at the end of its input.
pub fn ml_worker(root: &Path, size: u64) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut buf = vec![0u8; ML_READ];
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let mut n = 0;
        let r = line.split_whitespace().try_for_each(|key| {
            read_whole(&root.join(key), seed_of(key), size, &mut buf)?;
            n += 1;
            Ok::<(), anyhow::Error>(())
        });
        match r {
            Ok(()) => writeln!(out, "ok {n}")?,
            Err(e) => writeln!(out, "error {}", format!("{e:#}").replace('\n', " "))?,
        }
        out.flush()?;
    }
    Ok(())
}

/// Peak resident memory of the mounter after a workload (P10, P13), if that workload succeeded.
fn peak_rss(mount: &Mount, ok: bool, why: &str) -> Cell {
    match mount.pid().and_then(memory_of) {
        Some((hwm, _)) if ok => Cell::Value(hwm as f64 / MIB as f64),
        _ => Cell::Failed(why.into()),
    }
}

/// P6: fio random 4 KiB reads with 4 jobs for `runtime` seconds; returns IOPS.
fn fio_randread(file: &Path, runtime: u64, timeout: Duration) -> anyhow::Result<f64> {
    let mut child = Command::new("fio")
        .args([
            "--name=p6",
            "--rw=randread",
            "--bs=4k",
            "--numjobs=4",
            "--ioengine=psync",
            "--readonly",
            // O_DIRECT: every read reaches the mounter (buffered random reads would be served more
            // and more from the page cache, the faster the mounter the sooner).
            "--direct=1",
            "--time_based",
            "--group_reporting",
            "--output-format=json",
        ])
        .arg(format!("--runtime={runtime}"))
        .arg(format!("--filename={}", file.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting fio (apt-get install fio)")?;
    let deadline = Instant::now() + timeout.max(Duration::from_secs(runtime + 30));
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("timeout");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // fio may print warnings before the JSON document.
    let json = stdout.find('{').map(|i| &stdout[i..]).unwrap_or("");
    let v: serde_json::Value = serde_json::from_str(json).with_context(|| {
        format!(
            "fio exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    let job = &v["jobs"][0];
    if job["error"].as_i64().unwrap_or(0) != 0 {
        bail!(
            "fio job error {}: {}",
            job["error"],
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    job["read"]["iops"]
        .as_f64()
        .context("fio JSON without read.iops")
}

/// The SDK ceiling: every `(key, size)` fetched with ranged GETs of `range` bytes, `in_flight` at a
/// time across all keys. Returns MiB/s.
pub async fn sdk_ranged(
    store: &S3Store,
    objects: &[(String, u64)],
    range: u64,
    in_flight: usize,
) -> anyhow::Result<f64> {
    let ranges: Vec<(String, u64, u64)> = objects
        .iter()
        .flat_map(|(k, size)| {
            (0..size.div_ceil(range))
                .map(move |i| (k.clone(), i * range, (*size).min((i + 1) * range)))
        })
        .collect();
    let t = Instant::now();
    let bytes: u64 = stream::iter(ranges)
        .map(|(k, a, b)| {
            let store = store.clone();
            async move {
                let data = store.get_range(BUCKET, &k, a..b, None).await?;
                if !check_sample(seed_of(&k), a, &data) {
                    bail!("{k}: wrong content at {a}");
                }
                Ok::<u64, anyhow::Error>(data.len() as u64)
            }
        })
        .buffer_unordered(in_flight)
        .try_fold(0, |acc, n| async move { Ok(acc + n) })
        .await?;
    Ok(bytes as f64 / MIB as f64 / t.elapsed().as_secs_f64())
}

/// The SDK reference for P4: every small object fetched whole with one GET, `in_flight` at a
/// time (no LIST, no HEAD). Returns files/s.
pub async fn sdk_small(
    store: &S3Store,
    keys: &[String],
    size: u64,
    in_flight: usize,
) -> anyhow::Result<f64> {
    let t = Instant::now();
    stream::iter(keys.iter().cloned())
        .map(|k| {
            let store = store.clone();
            async move { store.get_range(BUCKET, &k, 0..size, None).await.map(drop) }
        })
        .buffer_unordered(in_flight)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(keys.len() as f64 / t.elapsed().as_secs_f64())
}

/// P14 warm's reference: `ls -la` of a local directory of `count` empty files on this machine's
/// disk, listed once to warm the kernel's caches and then timed. Returns seconds.
pub fn local_listing_reference(dir: &Path, count: usize) -> anyhow::Result<f64> {
    let d = dir.join("p14-local-listing");
    std::fs::create_dir_all(&d)?;
    for i in 0..count {
        std::fs::File::create(d.join(format!("f{i:05}")))?;
    }
    ls_la(&d, count)?;
    let t = Instant::now();
    ls_la(&d, count)?;
    let secs = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&d);
    Ok(secs)
}

/// P2's reference: a local copy of the big object on this machine's disk, read once to warm the
/// page cache and then timed. Returns MiB/s.
pub fn page_cache_reference(dir: &Path, key: &str, size: u64) -> anyhow::Result<f64> {
    use std::io::Write;
    let path = dir.join("p2-local-copy.bin");
    let seed = seed_of(key);
    {
        let mut f = std::fs::File::create(&path)?;
        let mut off = 0;
        while off < size {
            let n = (8 * MIB).min(size - off);
            f.write_all(&content(seed, off, n as usize))?;
            off += n;
        }
    }
    read_file(&path, seed, IO_BUF)?;
    let t = Instant::now();
    let (bytes, bad) = read_file(&path, seed, IO_BUF)?;
    let secs = t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&path);
    if bad > 0 {
        bail!("local copy read back wrong");
    }
    Ok(bytes as f64 / MIB as f64 / secs)
}
