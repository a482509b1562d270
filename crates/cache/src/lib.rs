//! Ferry's node-level read cache: blocks of S3 objects in files under one local directory, shared
//! by every mount of the node plugin.
//!
//! - **Keys.** A block is named by (endpoint, bucket, key, ETag, block index) ([`BlockKey`]); a
//!   new object version has a new ETag, so it never meets the old version's blocks.
//! - **Integrity.** Each file carries its key and a crc32c of each 64 KiB piece of its data
//!   ([`block`]); a read checks the pieces it takes bytes from ([`BlockCache::get_part_or_fetch_as`]).
//!   A file that does not check out is a miss: it is deleted, counted (`corrupt`) and refetched.
//! - **Atomic writes.** A block is written to a temporary file in its own `blocks/xx/` directory
//!   and renamed into place (a whole object: in `tmp/`, renamed into `objects/`); a reader sees a
//!   whole file or none. No fsync: after a crash a torn file fails its checksum and is a miss.
//! - **Single flight.** Concurrent misses of one block, from any number of mounts, run one fetch;
//!   the others wait for it (`joins`). If that fetch fails, the next waiter runs its own.
//! - **Budget.** LRU eviction ([`lru`]) keeps the files (and the ones being written) within
//!   `max_size`, and keeps `min_free` bytes free on the filesystem (`statvfs`); when neither can be
//!   met, or a write fails (disk full), the block is simply not cached: a read never fails
//!   because of the cache.
//! - **Persistence.** The files outlive the process. [`BlockCache::open`] returns at once and
//!   rebuilds the index (sizes, LRU order by modification time) on a background thread; until it
//!   is done, hits are served but no new block is stored (so the budget cannot be overrun).
//!
//! - **Whole objects.** Once every block of an object version is on disk and a reader asked for
//!   it ([`BlockCache::want_whole`]), the blocks are joined into one file with exactly the
//!   object's bytes plus a sidecar of per-piece crc32c ([`object`]), and the blocks are deleted.
//!   Blocks are then read from that file (each piece read checked against its crc), and
//!   [`BlockCache::open_whole`] hands it out, checked in full once per process, for the kernel to
//!   read directly (FUSE passthrough).
//! - **Checked across a clean restart.** A process checks a whole file in full before its first
//!   hand-out. [`BlockCache::save_checked`] (at a clean shutdown, after a `syncfs`) records the
//!   files it checked with their inode, size, mtime and ctime; the next process trusts exactly
//!   those whose stat is unchanged and deletes the record at start, so after a crash everything
//!   is checked again. Any write to a file changes its ctime, so a file altered in between is
//!   checked (and refused) again.
//! - **Layout.** A `layout` file records the format and block size; a cache directory written with
//!   another block size (or an older format) is emptied at open rather than misread.
//!
//! The cache knows nothing about credentials: callers (the filesystem) serve a block only to a
//! mount whose own credentials have shown access to that object version.

pub mod block;
pub mod direct;
pub mod lru;
pub mod object;
pub mod space;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::future::Future;
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use tokio::sync::{watch, Notify, OnceCell};

pub use block::{BlockKey, FileId, Invalid};
use lru::Lru;
pub use object::{ObjectKey, ObjectMeta};

/// The on-disk layout this code reads and writes (see [`object`] and [`block`]). Block formats 3
/// (a crc per piece) and 4 (padded to whole pages) and sidecar format 2 (a crc per piece) kept
/// layout 3: this code reads the formats before them,
/// so a node's cache survives the upgrade. (An older Ferry takes a newer file for a bad one:
/// deleted, counted, fetched again.)
const LAYOUT_VERSION: u32 = 3;

/// Objects remembered as wanted whole until their last block arrives (oldest dropped first).
const MAX_WISHES: usize = 16_384;

/// An entry of the eviction order: a block file or a whole-object file (with its sidecar).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Entry {
    Block(FileId),
    Object(FileId),
}

/// Default block size: 4 MiB (see `doc/BENCHMARKS.md`, P9, for the 1 / 4 / 8 MiB measurements).
pub const DEFAULT_BLOCK_SIZE: u64 = 4 << 20;
/// Smallest block size accepted.
pub const MIN_BLOCK_SIZE: u64 = 64 << 10;
/// Largest block size accepted.
pub const MAX_BLOCK_SIZE: u64 = 64 << 20;

/// Where the cache lives and how big it may grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    pub dir: PathBuf,
    /// Most bytes of block files (headers included) on disk.
    pub max_size: u64,
    /// Bytes to keep free on the cache's filesystem (0 = no floor besides a full disk).
    pub min_free: u64,
    /// Bytes per block (a power of two, [`MIN_BLOCK_SIZE`]..=[`MAX_BLOCK_SIZE`]).
    pub block_size: u64,
}

impl CacheConfig {
    /// `dir` with `max_size`, no free-space floor and the default block size.
    pub fn new(dir: impl Into<PathBuf>, max_size: u64) -> Self {
        CacheConfig {
            dir: dir.into(),
            max_size,
            min_free: 0,
            block_size: DEFAULT_BLOCK_SIZE,
        }
    }

    pub fn validate(&self) -> Result<(), CacheError> {
        let bs = self.block_size;
        if !bs.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bs) {
            return Err(CacheError::BlockSize(bs));
        }
        if self.max_size < bs {
            return Err(CacheError::MaxSize {
                max: self.max_size,
                block: bs,
            });
        }
        Ok(())
    }
}

/// A cache that cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "cache block size {0} must be a power of two between 64 KiB and 64 MiB (e.g. 1MiB, 4MiB)"
    )]
    BlockSize(u64),
    #[error("cache max size {max} is smaller than one block ({block} bytes)")]
    MaxSize { max: u64, block: u64 },
    /// (`err` is in the message, not the error's source: a chain would say it twice.)
    #[error("cache directory {path}: {err}")]
    Dir { path: PathBuf, err: io::Error },
    #[error(
        "cache directory {path} is in use by another process{}: each process needs a cache \
         directory of its own (the mounts of one node plugin share its cache)",
        holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default()
    )]
    InUse { path: PathBuf, holder: Option<u32> },
}

/// What the cache did since it was opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Blocks served from disk.
    pub hits: u64,
    /// Bytes served from disk.
    pub hit_bytes: u64,
    /// Fetches run (each one a miss that nobody else was already fetching).
    pub misses: u64,
    /// Callers that waited for another caller's fetch of the same block instead of fetching.
    pub joins: u64,
    /// Blocks written to disk.
    pub stored: u64,
    /// Fetched blocks not stored (index not ready, no room under the floor, the writers' queue
    /// full, the memory budget spent, write failed), and parts of blocks fetched alone because the
    /// budget had no room for the whole block (counted when that fetch starts).
    pub skipped: u64,
    pub evictions: u64,
    /// Block or whole-object files that failed their checksum or named another object (deleted,
    /// not served).
    pub corrupt: u64,
    /// Objects whose blocks were joined into one whole-object file.
    pub assembled: u64,
    /// Whole-object files handed out by [`BlockCache::open_whole`].
    pub whole_opens: u64,
    /// Whole-object files found at start that the previous process checked and recorded at a
    /// clean shutdown, unchanged since (not read again before their first hand-out).
    pub trusted: u64,
    /// Bytes of block and whole-object files on disk (indexed).
    pub bytes: u64,
    /// Block files on disk (indexed).
    pub blocks: u64,
    /// Whole-object files on disk (indexed).
    pub objects: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    hit_bytes: AtomicU64,
    misses: AtomicU64,
    joins: AtomicU64,
    stored: AtomicU64,
    skipped: AtomicU64,
    evictions: AtomicU64,
    corrupt: AtomicU64,
    assembled: AtomicU64,
    whole_opens: AtomicU64,
    trusted: AtomicU64,
}

/// Counts bytes a warm-up fetched into the cache.
pub fn warmup_bytes(n: u64) {
    metrics().warmup_bytes.inc_by(n);
}

/// Counts a finished warm-up by `result` (`ok`, `truncated`, `error`).
pub fn warmup_done(result: &str) {
    metrics().warmup_done(result);
}

/// The node cache's metrics (pre-created handles: recording is an atomic add).
fn metrics() -> &'static ferry_metrics::CacheMetrics {
    &ferry_metrics::metrics().cache
}

struct State {
    lru: Lru<Entry>,
    /// Whole-object entries in `lru`.
    objects: u64,
    /// Bytes of files being written (reserved under the budget before the write starts).
    pending: u64,
    /// Objects a reader wants whole, by object file id, with their size: joined when the last
    /// block is stored.
    wishes: HashMap<FileId, Wish>,
    /// Objects being joined right now.
    assembling: HashSet<FileId>,
}

/// An object a reader wants whole, and the block indices it still lacks (so a stored block
/// checks its own index, not the whole object: [`State::has_all_blocks`] hashes every block key).
struct Wish {
    obj: ObjectKey,
    size: u64,
    missing: HashSet<u64>,
}

impl State {
    fn insert(&mut self, entry: Entry, len: u64) {
        if matches!(entry, Entry::Object(_)) && !self.lru.contains(&entry) {
            self.objects += 1;
        }
        self.lru.insert(entry, len);
    }

    fn remove(&mut self, entry: &Entry) -> Option<u64> {
        let len = self.lru.remove(entry);
        if len.is_some() && matches!(entry, Entry::Object(_)) {
            self.objects -= 1;
        }
        len
    }

    /// The least recent entry `keep` does not keep, removed.
    fn pop_lru_except(&mut self, keep: impl Fn(&Entry) -> bool) -> Option<(Entry, u64)> {
        let (entry, len) = self.lru.pop_lru_except(keep)?;
        if matches!(entry, Entry::Object(_)) {
            self.objects -= 1;
        }
        Some((entry, len))
    }

    fn pop_lru(&mut self) -> Option<(Entry, u64)> {
        let (entry, len) = self.lru.pop_lru()?;
        if matches!(entry, Entry::Object(_)) {
            self.objects -= 1;
        }
        Some((entry, len))
    }

    fn has_all_blocks(&self, obj: &ObjectKey, blocks: u64) -> bool {
        (0..blocks).all(|i| self.lru.contains(&Entry::Block(obj.block(i).file_id())))
    }
}

/// Threads writing blocks to disk.
const WRITERS: usize = 2;
/// Most bytes of blocks waiting for a writer; more are not stored.
const WRITE_QUEUE_MAX: u64 = 64 << 20;
/// The writers' (and the joiner's) nice value: on a node whose CPUs are busy, the copy of every
/// filled byte into the cache's files yields to the readers it would otherwise slow down.
const WRITER_NICE: i32 = 10;

/// Objects waiting for the joiner, each once.
#[derive(Default)]
struct Joins {
    queue: std::collections::VecDeque<(ObjectKey, u64)>,
    queued: HashSet<FileId>,
    /// The cache was dropped: the joiner ends.
    closed: bool,
}

#[derive(Default)]
struct WriteQueue {
    jobs: std::collections::VecDeque<WriteJob>,
    bytes: u64,
    /// The cache was dropped: the writers end.
    closed: bool,
}

/// What the cache's writer and joiner threads wait on. They hold it, and the cache only while
/// they work on a job: waiting, they keep the cache alive no more than a dropped handle does,
/// and its drop ends them (`closed`, set under each queue's lock).
#[derive(Default)]
struct Work {
    /// Blocks waiting for the writer threads.
    write_queue: Mutex<WriteQueue>,
    write_ready: std::sync::Condvar,
    /// Objects whose blocks are all on disk, to be joined into whole files once the cache is
    /// idle (see [`JOIN_IDLE`]); each counts in `writes` until joined.
    joins: Mutex<Joins>,
    joins_ready: std::sync::Condvar,
}

struct WriteJob {
    key: BlockKey,
    data: Bytes,
    cell: Option<Arc<FlightCell>>,
    /// The charge for the block's bytes (its fetcher's, or one [`BlockCache::charge_writes`]
    /// handed out): held until the block is written (dropped with the job).
    _charge: Option<WriteCharge>,
}

/// A charge for a block's bytes while it waits for the writers (and is written): given back
/// when dropped.
pub type WriteCharge = Box<dyn Send>;

/// A charge the fetcher of a block holds for its bytes already, taken when the fetched block is
/// handed to the writers: `None` if the fetcher no longer holds it (then [`ChargeWrites`] is
/// asked). See [`BlockCache::get_part_or_fetch_as`].
pub type HeldCharge = Box<dyn FnOnce() -> Option<WriteCharge> + Send>;

/// Charges `bytes` of a block handed to the writers, or says no (`None`): the block is then not
/// stored. See [`BlockCache::charge_writes`].
pub type ChargeWrites = Box<dyn Fn(u64) -> Option<WriteCharge> + Send + Sync>;

/// Lowers the calling thread's priority to [`WRITER_NICE`] (Linux: a thread's nice value is its
/// own). Best effort.
fn lower_priority() {
    let tid = nix::unistd::gettid().as_raw() as libc::id_t;
    // SAFETY: setpriority has no memory-safety preconditions.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, WRITER_NICE) };
}

/// A writer thread: stores queued blocks; ends when the cache is dropped.
fn write_blocks(cache: std::sync::Weak<BlockCache>, work: Arc<Work>) {
    lower_priority();
    loop {
        let job = {
            let mut q = work.write_queue.lock().expect("write queue lock");
            loop {
                if q.closed {
                    return;
                }
                if let Some(job) = q.jobs.pop_front() {
                    break job;
                }
                q = work.write_ready.wait(q).expect("write queue lock");
            }
        };
        let Some(c) = cache.upgrade() else { return };
        c.store(&job.key, &job.data);
        if let Some(cell) = &job.cell {
            c.end_flight(&job.key, cell);
        }
        work.write_queue.lock().expect("write queue lock").bytes -= job.data.len() as u64;
        // The block's buffer and its charge go before the write counts as done (`settle`).
        drop(job);
        c.writes.fetch_sub(1, Ordering::AcqRel);
        c.writes_done.notify_waiters();
    }
}

/// How long no block must have been stored before objects are joined into whole files: joining
/// reads and writes every byte again, which a reader filling the cache would otherwise wait for
/// (on a small node, for CPU).
const JOIN_IDLE: std::time::Duration = std::time::Duration::from_millis(300);

/// The joiner thread: joins queued objects one at a time once the cache has been idle for
/// [`JOIN_IDLE`]; ends when the cache is dropped.
fn join_when_idle(cache: std::sync::Weak<BlockCache>, work: Arc<Work>) {
    lower_priority();
    loop {
        {
            // Woken by a new join, or by the cache's drop.
            let mut joins = work.joins.lock().expect("joins lock");
            while joins.queue.is_empty() && !joins.closed {
                joins = work.joins_ready.wait(joins).expect("joins lock");
            }
            if joins.closed {
                return;
            }
        }
        let Some(c) = cache.upgrade() else { return };
        let next = {
            let mut joins = work.joins.lock().expect("joins lock");
            if joins.queue.is_empty() {
                None
            } else {
                let idle = c.idle_for();
                if idle < JOIN_IDLE && c.flushing.load(Ordering::Acquire) == 0 {
                    drop(joins);
                    drop(c);
                    let nap = (JOIN_IDLE - idle).min(std::time::Duration::from_millis(50));
                    std::thread::sleep(nap);
                    continue;
                }
                let next = joins.queue.pop_front();
                if let Some((obj, _)) = &next {
                    joins.queued.remove(&obj.file_id());
                }
                next
            }
        };
        if let Some((obj, size)) = next {
            c.assemble(&obj, size);
            c.writes.fetch_sub(1, Ordering::AcqRel);
            c.writes_done.notify_waiters();
        }
    }
}

/// Who asks [`BlockCache::get_or_fetch_as`] for a block. `owner` names the caller's identity
/// (its credentials; 0 for none in particular).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reader {
    /// Has shown access to the version: served from disk, joins any fetch in flight.
    Proven { owner: u64 },
    /// Has not: fetches with its own credentials (and takes a fetch in flight only if it was
    /// made by the same owner).
    Unproven { owner: u64 },
}

/// A block being fetched, by whose identity.
#[derive(Debug)]
struct Flight {
    owner: u64,
    cell: Arc<FlightCell>,
}

/// Ends a flight when the init that holds it ends without bytes to store: failed, refused,
/// served from disk, or dropped (its reader went away). Owned by the init, it runs while the
/// init still holds the cell, before a waiter can take the flight over: ended later, it could
/// end the flight that waiter has just claimed, and a reader arriving then would start a
/// second GET.
struct EndFlightOnDrop<'a> {
    cache: &'a BlockCache,
    key: &'a BlockKey,
    cell: &'a Arc<FlightCell>,
    armed: bool,
}

impl Drop for EndFlightOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.cache.end_flight(self.key, self.cell);
        }
    }
}

/// A flight's result: the bytes and the owner whose fetch got them (the one that ran the init,
/// which is not always the flight's creator: a failed or cancelled init leaves it to the next
/// waiter); `None` when the init found the block on disk (no GET: no proof for anyone).
type FlightCell = OnceCell<(Option<u64>, Bytes)>;

/// Why a flight's init left it empty.
enum InitError<E> {
    /// The fetch failed.
    Fetch(E),
    /// The budget has no room for the whole block: only these bytes (a part's) may be fetched.
    Refused(Range<u64>),
}

/// The node's block cache. Cheap to share (`Arc`); every method is safe to call concurrently.
pub struct BlockCache {
    cfg: CacheConfig,
    blocks_dir: PathBuf,
    objects_dir: PathBuf,
    tmp_dir: PathBuf,
    /// Whether cache files are written with `O_DIRECT` ([`direct`]; probed at open).
    direct: bool,
    /// Directories of an earlier layout, deleted by the index thread.
    trash_dir: PathBuf,
    /// Whole files the previous process checked and saved at a clean shutdown (read at open,
    /// used by the index thread).
    saved_checks: Mutex<HashMap<FileId, FileStamp>>,
    state: Mutex<State>,
    /// Sidecars of whole objects read so far.
    metas: Mutex<HashMap<FileId, Arc<ObjectMeta>>>,
    /// Per whole object: a gate held while it is checked, and, once it was checked in full by
    /// this process (or written by it, or trusted from the previous one), the stamp its file had
    /// then: [`Self::save_checked`] records it only if the file still has that stamp.
    verified: Mutex<HashMap<FileId, Arc<Mutex<Option<FileStamp>>>>>,
    flights: Mutex<HashMap<BlockKey, Flight>>,
    ready: watch::Sender<bool>,
    /// Whether the index thread has made every block directory (after `ready`).
    dirs_made: watch::Sender<bool>,
    counters: Counters,
    tmp_seq: AtomicU64,
    /// `statvfs` of the cache's directory failed the last time it was asked ([`Self::free_on_disk`]).
    statvfs_failing: AtomicBool,
    /// This process's temporary block files: `blocks/xx/{tmp_prefix}{seq}` (never a block's
    /// name, so the index thread deletes those a dead process left).
    tmp_prefix: String,
    /// The directory's lock, held for the cache's life ([`Self::open`]).
    _lock: File,
    writes: AtomicUsize,
    writes_done: Notify,
    /// The writers' and the joiner's queues ([`Work`]).
    work: Arc<Work>,
    /// [`Self::settle`] calls waiting: joins run without waiting for the cache to go idle.
    flushing: AtomicUsize,
    /// Charges the bytes of every block handed to the writers until it is written (the node
    /// plugin's memory budget), and the most bytes that may wait: [`Self::charge_writes`].
    charge_writes: std::sync::OnceLock<(ChargeWrites, u64)>,
    /// When a block was last stored: milliseconds since `opened`.
    last_fill: AtomicU64,
    opened: std::time::Instant,
    /// Warm-ups started in this process (by id), so each runs once; `true` once it finished.
    claimed: Mutex<std::collections::HashMap<String, bool>>,
}

impl Drop for BlockCache {
    /// Ends the writer and joiner threads (blocks still queued are not stored). Set under each
    /// queue's lock, so a thread that found its queue open is waiting by the time it is told.
    fn drop(&mut self) {
        if let Ok(mut q) = self.work.write_queue.lock() {
            q.closed = true;
        }
        self.work.write_ready.notify_all();
        if let Ok(mut joins) = self.work.joins.lock() {
            joins.closed = true;
        }
        self.work.joins_ready.notify_all();
    }
}

impl std::fmt::Debug for BlockCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCache")
            .field("dir", &self.cfg.dir)
            .field("max_size", &self.cfg.max_size)
            .field("block_size", &self.cfg.block_size)
            .finish()
    }
}

impl BlockCache {
    /// Opens (creating) the cache at `cfg.dir`. Returns at once; the index of the blocks already
    /// there is rebuilt on a background thread ([`BlockCache::ready`]).
    ///
    /// One process at a time: the cache holds an exclusive lock on the directory (`lock`) for
    /// its life. Held by another process, open waits up to [`LOCK_WAIT`] for it (a node plugin's
    /// predecessor lets go as it exits, just before its successor opens the cache), then fails
    /// with [`CacheError::InUse`]: two processes would each keep `max_size` of their own in it,
    /// and delete each other's files.
    pub fn open(cfg: CacheConfig) -> Result<Arc<BlockCache>, CacheError> {
        Self::open_waiting(cfg, LOCK_WAIT)
    }

    /// [`Self::open`], waiting at most `wait` for another process's lock on the directory.
    fn open_waiting(
        cfg: CacheConfig,
        wait: std::time::Duration,
    ) -> Result<Arc<BlockCache>, CacheError> {
        cfg.validate()?;
        let dir_err = |path: &Path| {
            let path = path.to_owned();
            move |err| CacheError::Dir { path, err }
        };
        let blocks_dir = cfg.dir.join("blocks");
        let objects_dir = cfg.dir.join("objects");
        let tmp_dir = cfg.dir.join("tmp");
        let trash_dir = cfg.dir.join("trash");
        if cfg.dir.exists() && !cfg.dir.is_dir() {
            // (`create_dir_all` would say "File exists".)
            return Err(dir_err(&cfg.dir)(io::Error::new(
                io::ErrorKind::NotADirectory,
                "not a directory",
            )));
        }
        std::fs::create_dir_all(&cfg.dir).map_err(dir_err(&cfg.dir))?;
        let lock = lock_dir(&cfg.dir, wait)?;
        // A directory written with another block size or format is emptied, not misread: its
        // files move to `trash/` (deleted by the index thread, so opening stays quick).
        let layout_path = cfg.dir.join("layout");
        let layout = format!(
            "ferry-cache {LAYOUT_VERSION} block_size={}\n",
            cfg.block_size
        );
        let found = std::fs::read_to_string(&layout_path).ok();
        if found.as_deref() != Some(layout.as_str()) {
            let stamp = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            for dir in [&blocks_dir, &objects_dir] {
                if dir.exists() {
                    let to = trash_dir.join(format!(
                        "{}-{stamp}",
                        dir.file_name().and_then(|n| n.to_str()).unwrap_or("old")
                    ));
                    std::fs::create_dir_all(&trash_dir).map_err(dir_err(&trash_dir))?;
                    std::fs::rename(dir, &to).map_err(dir_err(dir))?;
                }
            }
            if found.is_some() {
                tracing::warn!(dir = %cfg.dir.display(), was = ?found, now = %layout.trim(),
                    "cache: the directory holds another block size or format; emptying it");
            }
            std::fs::write(&layout_path, &layout).map_err(dir_err(&layout_path))?;
        }
        std::fs::create_dir_all(&blocks_dir).map_err(dir_err(&blocks_dir))?;
        std::fs::create_dir_all(&objects_dir).map_err(dir_err(&objects_dir))?;
        // Block files are made in their own `blocks/xx` directories, spread over the disk's
        // block groups (directories made before this flag stay where they are).
        match space::spread_subdirs(&blocks_dir) {
            Ok(spread) => {
                tracing::debug!(dir = %blocks_dir.display(), spread, "cache: block directories")
            }
            Err(e) => tracing::info!(dir = %blocks_dir.display(), error = %e,
                "cache: could not spread the block directories over the disk"),
        }
        // Leftovers of a previous process's unfinished writes.
        if tmp_dir.exists() {
            std::fs::remove_dir_all(&tmp_dir).map_err(dir_err(&tmp_dir))?;
        }
        std::fs::create_dir_all(&tmp_dir).map_err(dir_err(&tmp_dir))?;
        // Used once: after a crash, the next start finds no record and checks everything.
        let checked_path = cfg.dir.join(CHECKED_FILE);
        let saved_checks = std::fs::read_to_string(&checked_path)
            .map(|s| parse_checked(&s))
            .unwrap_or_default();
        let _ = std::fs::remove_file(&checked_path);
        let direct = direct::supported(&tmp_dir);
        let cache = Arc::new(BlockCache {
            _lock: lock,
            cfg,
            blocks_dir,
            objects_dir,
            tmp_dir,
            direct,
            trash_dir,
            saved_checks: Mutex::new(saved_checks),
            state: Mutex::new(State {
                lru: Lru::default(),
                objects: 0,
                pending: 0,
                wishes: HashMap::new(),
                assembling: HashSet::new(),
            }),
            metas: Mutex::new(HashMap::new()),
            verified: Mutex::new(HashMap::new()),
            flights: Mutex::new(HashMap::new()),
            ready: watch::channel(false).0,
            dirs_made: watch::channel(false).0,
            counters: Counters::default(),
            tmp_seq: AtomicU64::new(0),
            statvfs_failing: AtomicBool::new(false),
            tmp_prefix: format!(
                "{TMP_MARK}{:x}-",
                SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or_default()
            ),
            writes: AtomicUsize::new(0),
            writes_done: Notify::new(),
            work: Arc::default(),
            flushing: AtomicUsize::new(0),
            charge_writes: std::sync::OnceLock::new(),
            last_fill: AtomicU64::new(0),
            opened: std::time::Instant::now(),
            claimed: Mutex::new(Default::default()),
        });
        let c = cache.clone();
        std::thread::Builder::new()
            .name("ferry-cache-index".into())
            .spawn(move || c.rebuild_index())
            .map_err(dir_err(&cache.cfg.dir))?;
        let (weak, work) = (Arc::downgrade(&cache), cache.work.clone());
        std::thread::Builder::new()
            .name("ferry-cache-join".into())
            .spawn(move || join_when_idle(weak, work))
            .map_err(dir_err(&cache.cfg.dir))?;
        for i in 0..WRITERS {
            let (weak, work) = (Arc::downgrade(&cache), cache.work.clone());
            std::thread::Builder::new()
                .name(format!("ferry-cache-w{i}"))
                .spawn(move || write_blocks(weak, work))
                .map_err(dir_err(&cache.cfg.dir))?;
        }
        Ok(cache)
    }

    /// Queues `obj` to be joined into one whole file when the cache is idle.
    fn queue_join(&self, obj: ObjectKey, size: u64) {
        {
            let mut joins = self.work.joins.lock().expect("joins lock");
            if !joins.queued.insert(obj.file_id()) {
                return;
            }
            self.writes.fetch_add(1, Ordering::AcqRel);
            joins.queue.push_back((obj, size));
        }
        self.work.joins_ready.notify_one();
    }

    /// Milliseconds since the last block was stored.
    fn idle_for(&self) -> std::time::Duration {
        let now = self.opened.elapsed().as_millis() as u64;
        std::time::Duration::from_millis(now.saturating_sub(self.last_fill.load(Ordering::Relaxed)))
    }

    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    pub fn block_size(&self) -> u64 {
        self.cfg.block_size
    }

    /// Whether the index of the blocks found at start is rebuilt (until then nothing is stored).
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until the index is rebuilt.
    pub async fn ready(&self) {
        let mut rx = self.ready.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Waits until every block directory is made (tests).
    #[cfg(test)]
    async fn dirs_made(&self) {
        let mut rx = self.dirs_made.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Waits until every block write started so far has finished, and every object queued to be
    /// joined is joined (without waiting for the cache to go idle): tests, warm-up progress, a
    /// stopping node plugin (which bounds the wait with [`Self::settle_within`]).
    pub async fn settle(&self) {
        struct Flushing<'a>(&'a AtomicUsize);
        impl Drop for Flushing<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.flushing.fetch_add(1, Ordering::AcqRel);
        let _flushing = Flushing(&self.flushing);
        self.work.joins_ready.notify_all();
        loop {
            let notified = self.writes_done.notified();
            if self.writes.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Bytes of blocks waiting for the writer threads, and the most that may wait (over it,
    /// blocks are not stored): a background filler (a sweep) waits for room instead of having its
    /// blocks dropped.
    pub fn write_backlog(&self) -> (u64, u64) {
        let q = self.work.write_queue.lock().expect("write queue lock");
        (q.bytes, self.queue_max())
    }

    /// Waits until blocks of `len` bytes may go to the writers without making their backlog more
    /// than half full, or until it is empty (a file larger than half the queue goes then): a
    /// background filler (a sweep, a warm-up) keeps behind the writers, so the blocks it fetches
    /// are not dropped and fetched again by readers.
    pub async fn writers_have_room(&self, len: u64) {
        loop {
            let (waiting, most) = self.write_backlog();
            if waiting == 0 || waiting + len <= most / 2 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// A file of `entry` found missing (`e` is `NotFound`): the entry is forgotten if it is gone
    /// under the index, as [`Self::read`] does for a block file (blocking).
    fn forget_if_missing(&self, e: &io::Error, entry: Entry) {
        if e.kind() == io::ErrorKind::NotFound {
            self.forget_if_gone(entry);
        }
    }

    /// Charges the bytes of every block handed to the writers with `charge` from then on, until
    /// the block is written (unless its fetcher hands over a charge of its own), and lets at
    /// most `queue_max` bytes wait (never more than [`WRITE_QUEUE_MAX`], never less than one
    /// block): a block whose bytes `charge` refuses, or that would make the queue longer, is not
    /// stored (counted as skipped). The node plugin charges them to its memory budget, so blocks
    /// waiting for the disk count among the memory the budget bounds (a fetched block's buffer
    /// outlives the read that fetched it while it waits), and keeps the queue to a share of the
    /// budget, so writers behind do not pin what readers need. A read of part of a block with no
    /// charge of its own asks `charge` before it fetches the block (under the cache's lock: it
    /// must not call back into the cache), and fetches only its part when refused
    /// ([`Self::get_part_or_fetch_as`]). Set once: `false`, and `charge` dropped, if it was set
    /// already.
    pub fn charge_writes(&self, charge: ChargeWrites, queue_max: u64) -> bool {
        let queue_max = queue_max.clamp(self.cfg.block_size, WRITE_QUEUE_MAX);
        self.charge_writes.set((charge, queue_max)).is_ok()
    }

    /// A charge for `bytes` of a block its caller is about to fetch, from [`Self::charge_writes`]
    /// (to hand to [`Self::get_part_or_fetch_as`], so the block is charged from before its GET
    /// until it is written): `Some(None)` when no charge is set, `None` when it is refused (a
    /// background filler, such as a warm-up, waits and asks again rather than fetch a block the
    /// cache would not keep).
    pub fn charge_block(&self, bytes: u64) -> Option<Option<WriteCharge>> {
        match self.charge_writes.get() {
            None => Some(None),
            Some((charge, _)) => charge(bytes).map(Some),
        }
    }

    /// The most bytes of blocks that may wait for the writers ([`Self::charge_writes`]).
    fn queue_max(&self) -> u64 {
        self.charge_writes
            .get()
            .map_or(WRITE_QUEUE_MAX, |(_, max)| *max)
    }

    /// [`Self::settle`], for at most `limit` (readers of live mounts may keep filling the cache
    /// while a node plugin stops); `false` if it had not settled by then.
    pub async fn settle_within(&self, limit: std::time::Duration) -> bool {
        tokio::time::timeout(limit, self.settle()).await.is_ok()
    }

    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        let st = self.lock();
        CacheStats {
            hits: c.hits.load(Ordering::Relaxed),
            hit_bytes: c.hit_bytes.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            joins: c.joins.load(Ordering::Relaxed),
            stored: c.stored.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            assembled: c.assembled.load(Ordering::Relaxed),
            whole_opens: c.whole_opens.load(Ordering::Relaxed),
            trusted: c.trusted.load(Ordering::Relaxed),
            bytes: st.lru.bytes(),
            blocks: st.lru.len() as u64 - st.objects,
            objects: st.objects,
        }
    }

    /// `true` the first time `id` is claimed in this process (a warm-up runs once per node).
    pub fn claim(&self, id: &str) -> bool {
        self.claim_as(id, false)
    }

    /// Claims `id` unless it is claimed, recorded as finished (`done`) or not.
    fn claim_as(&self, id: &str, done: bool) -> bool {
        let mut claimed = self.claimed.lock().expect("claims lock");
        if claimed.contains_key(id) {
            return false;
        }
        claimed.insert(id.to_owned(), done);
        true
    }

    /// Lets go of `id` (a warm-up stopped before its end): the next [`claim`](Self::claim) of it
    /// succeeds.
    pub fn unclaim(&self, id: &str) {
        self.claimed.lock().expect("claims lock").remove(id);
    }

    /// The warm-up `id` (claimed) finished: its claim is held for good.
    pub fn finish(&self, id: &str) {
        if let Some(done) = self.claimed.lock().expect("claims lock").get_mut(id) {
            *done = true;
        }
    }

    /// Whether the warm-up `id` finished in this process (or in the one it took over from).
    pub fn finished(&self, id: &str) -> bool {
        self.claimed
            .lock()
            .expect("claims lock")
            .get(id)
            .copied()
            .unwrap_or(false)
    }

    /// Claims `id` as finished (by the process this one took over from), unless it is claimed
    /// already; `true` if it was not.
    pub fn claim_finished(&self, id: &str) -> bool {
        self.claim_as(id, true)
    }

    /// Counts an open refused because the mount's own credentials were denied the object (its
    /// blocks may be on disk; they are not served to that mount).
    pub fn note_denied(&self) {
        metrics().denied.inc();
    }

    /// The file of block `id`.
    pub fn block_path(&self, id: &FileId) -> PathBuf {
        let hex = block::hex(id);
        self.blocks_dir.join(&hex[..2]).join(hex)
    }

    /// The whole-object file of `id`; its sidecar is this path plus `.meta`.
    pub fn object_path(&self, id: &FileId) -> PathBuf {
        let hex = block::hex(id);
        self.objects_dir.join(&hex[..2]).join(hex)
    }

    fn meta_path(&self, id: &FileId) -> PathBuf {
        let hex = block::hex(id);
        self.objects_dir.join(&hex[..2]).join(format!("{hex}.meta"))
    }

    fn entry_paths(&self, entry: &Entry) -> Vec<PathBuf> {
        match entry {
            Entry::Block(id) => vec![self.block_path(id)],
            Entry::Object(id) => vec![self.object_path(id), self.meta_path(id)],
        }
    }

    /// Whether block `key` is on disk and indexed, as a block file or in its object's whole file
    /// (does not check its contents).
    pub fn contains(&self, key: &BlockKey) -> bool {
        let st = self.lock();
        st.lru.contains(&Entry::Block(key.file_id()))
            || st.lru.contains(&Entry::Object(key.object().file_id()))
    }

    /// Whether `obj` is on disk as one whole-object file.
    pub fn has_whole(&self, obj: &ObjectKey) -> bool {
        self.lock().lru.contains(&Entry::Object(obj.file_id()))
    }

    /// Block `key`: from disk if it is there and intact, else from `fetch` (stored for next
    /// time). Concurrent callers for the same block share one `fetch`. Errors are `fetch`'s only:
    /// a cache that cannot read or write steps aside.
    pub async fn get_or_fetch<F, Fut, E>(
        self: &Arc<Self>,
        key: &BlockKey,
        fetch: F,
    ) -> Result<Bytes, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        self.get_or_fetch_as(key, Reader::Proven { owner: 0 }, fetch)
            .await
    }

    /// [`Self::get_or_fetch`] for `reader`: a [`Reader::Unproven`] one is never served from disk
    /// and joins only a fetch of its own `owner`; otherwise it runs `fetch` itself (its own
    /// credentials' GET) and the block is stored behind it.
    pub async fn get_or_fetch_as<F, Fut, E>(
        self: &Arc<Self>,
        key: &BlockKey,
        reader: Reader,
        fetch: F,
    ) -> Result<Bytes, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        self.get_or_fetch_part(key, None, reader, None, |_| fetch())
            .await
    }

    /// Bytes `part.within` of block `key` (`part.len` bytes long), as
    /// [`Self::get_or_fetch_as`] gets the block: from disk only the pieces that cover them are
    /// read and checked ([`block::read_range`]); a miss fetches (and stores) the whole block.
    /// `fetch(range)` gets bytes `range` of the block (relative to its start): the whole block,
    /// `0..part.len`, unless said below.
    ///
    /// `charge`, if given, takes what the caller holds for the fetched bytes (a prefetch window's
    /// share of the budget): if this call's fetch runs, the block's write holds it instead of
    /// asking [`Self::charge_writes`] for a second charge of the same buffer (only when `part`
    /// is the whole block: a smaller part's charge does not cover the block). Without it, a miss
    /// that fetches asks [`Self::charge_writes`] for the block's bytes before fetching them, held
    /// from the fetch until the block is written: refused (the budget is spent), the miss fetches
    /// only `part.within`, not stored (counted as skipped), rather than a whole block the cache
    /// would not keep.
    pub async fn get_part_or_fetch_as<F, Fut, E>(
        self: &Arc<Self>,
        key: &BlockKey,
        part: Part,
        reader: Reader,
        charge: Option<HeldCharge>,
        fetch: F,
    ) -> Result<Bytes, E>
    where
        F: FnOnce(Range<u64>) -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        let len = part.len;
        let fetch = move |range: Option<Range<u64>>| fetch(range.unwrap_or(0..len));
        if !part.is_valid() {
            // None of its block: the whole block, cut (never a reason to doubt the file).
            let data = self
                .get_or_fetch_part(key, None, reader, charge, fetch)
                .await?;
            return Ok(part.cut(data));
        }
        self.get_or_fetch_part(key, Some(part), reader, charge, fetch)
            .await
    }

    /// `fetch(None)` gets the whole block, `fetch(Some(range))` only `range` of it (a `part`'s,
    /// when the budget has no room for the whole block: [`Self::get_part_or_fetch_as`]).
    async fn get_or_fetch_part<F, Fut, E>(
        self: &Arc<Self>,
        key: &BlockKey,
        part: Option<Part>,
        reader: Reader,
        mut charge: Option<HeldCharge>,
        fetch: F,
    ) -> Result<Bytes, E>
    where
        F: FnOnce(Option<Range<u64>>) -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        metrics().lookups.inc();
        let (owner, from_disk) = match reader {
            Reader::Proven { owner } => (owner, true),
            Reader::Unproven { owner } => (owner, false),
        };
        if from_disk {
            if let Some(data) = self.read(key, part.clone()).await {
                return Ok(data);
            }
        }
        let cut = |data: Bytes| cut_to(part.as_ref(), data);
        let cell = {
            let mut flights = self.flights.lock().expect("flights lock");
            // This call will fetch: a part's whole block only if its bytes can be charged until
            // written (the charge is taken now, held by the fetch).
            let refused = if flights.contains_key(key) {
                None
            } else {
                match self.charge_fetch(part.as_ref(), charge.take()) {
                    Ok(c) => {
                        charge = c;
                        None
                    }
                    Err(within) => Some(within),
                }
            };
            match refused {
                Some(within) => Err(within),
                None => {
                    let flight = flights.entry(key.clone()).or_insert_with(|| Flight {
                        owner,
                        cell: Arc::default(),
                    });
                    Ok((from_disk || flight.owner == owner).then(|| flight.cell.clone()))
                }
            }
        };
        let cell = match cell {
            Ok(cell) => cell,
            Err(within) => return self.fetch_only(key, within, fetch).await,
        };
        let Some(cell) = cell else {
            // Another identity's fetch is in flight: this reader may not take its bytes.
            return self.fetch_alone(key, part, charge, fetch).await;
        };
        let mut ran = false;
        let mut fetch = Some(fetch);
        let mut charge = Some(charge);
        let result = cell
            .get_or_try_init(|| async {
                ran = true;
                // Unless its block goes to the writers (who end the flight once it is stored),
                // this init ends the flight, so no orphan stays in the map.
                let mut guard = EndFlightOnDrop {
                    cache: self,
                    key,
                    cell: &cell,
                    armed: true,
                };
                // This caller runs the flight's fetch: the map names the flight, by this caller's
                // identity, also when it joined and a failed or cancelled init before it took the
                // flight out of the map (later readers join this fetch, not start another).
                self.claim_flight(key, &cell, owner);
                // A fill may have finished between the read above and joining the flight.
                if from_disk {
                    // The whole block: every caller joining this flight takes its part of it.
                    if let Some(data) = self.read(key, None).await {
                        // Nothing to write: the flight ends here (`guard`; left in the map, it
                        // would hand these bytes to later readers without a look at the disk or
                        // a GET).
                        return Ok((None, data));
                    }
                }
                // The flight's creator was charged when it made the flight (passed through
                // here); a caller that joined it and now fetches in its place is charged now.
                let charge = self
                    .charge_fetch(part.as_ref(), charge.take().flatten())
                    .map_err(InitError::Refused)?;
                self.miss();
                let data = (fetch.take().expect("one init per caller"))(None)
                    .await
                    .map_err(InitError::Fetch)?;
                let charge = charge.and_then(|held| held());
                self.store_in_background(key.clone(), data.clone(), cell.clone(), charge);
                guard.armed = false;
                Ok((Some(owner), data))
            })
            .await
            .cloned();
        match result {
            // Bytes another identity's fetch got, for a reader that has not shown access: never
            // handed over. (Its own init may have failed, leaving the flight to a proven one.)
            // Nor bytes a proven reader's init took from disk: no GET with its credentials.
            Ok((by, _)) if !from_disk && by != Some(owner) => match fetch.take() {
                Some(fetch) => {
                    let charge = charge.take().flatten();
                    self.fetch_alone(key, part, charge, fetch).await
                }
                None => unreachable!("a caller that ran the init got its own bytes"),
            },
            Ok((_, data)) => {
                if !ran {
                    self.counters.joins.fetch_add(1, Ordering::Relaxed);
                    metrics().joins.inc();
                }
                Ok(cut(data))
            }
            // The init ended the flight: it is left to the next waiter (or to a new flight).
            Err(InitError::Fetch(e)) => Err(e),
            Err(InitError::Refused(within)) => {
                let fetch = fetch.take().expect("refused before its fetch ran");
                self.fetch_only(key, within, fetch).await
            }
        }
    }

    /// The charge a fetch of a whole block holds until the block is written: the caller's
    /// `charge` when its part is the whole block, or, for a `part` without one (or with one for
    /// only some of the block), the block's bytes charged now through [`Self::charge_writes`]
    /// (`Err(part.within)` when refused: only those bytes may be fetched).
    /// Runs the hook, so the caller may hold the cache's locks but must not call back into it.
    fn charge_fetch(
        &self,
        part: Option<&Part>,
        charge: Option<HeldCharge>,
    ) -> Result<Option<HeldCharge>, Range<u64>> {
        // The caller's charge is for its part's bytes: it covers the fetched block's buffer only
        // when the part is the whole block (a smaller part is cut out as a copy, which that
        // charge goes on covering, and the block waits for the writers on its own).
        let charge = charge.filter(|_| part.is_none_or(|p| p.within == (0..p.len)));
        match (part, charge, self.charge_writes.get()) {
            (Some(p), None, Some((charge_writes, _))) => match charge_writes(p.len) {
                Some(c) => Ok(Some(Box::new(move || Some(c)))),
                None => Err(p.within.clone()),
            },
            (_, charge, _) => Ok(charge),
        }
    }

    /// Block `key` (or `part` of it) fetched by this caller on its own, outside any flight (it
    /// may not take another identity's bytes), the block stored behind it under the same charge
    /// rules as a flight's fetch ([`Self::charge_fetch`]).
    async fn fetch_alone<F, Fut, E>(
        self: &Arc<Self>,
        key: &BlockKey,
        part: Option<Part>,
        charge: Option<HeldCharge>,
        fetch: F,
    ) -> Result<Bytes, E>
    where
        F: FnOnce(Option<Range<u64>>) -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        let charge = match self.charge_fetch(part.as_ref(), charge) {
            Ok(charge) => charge,
            Err(within) => return self.fetch_only(key, within, fetch).await,
        };
        self.miss();
        let data = fetch(None).await?;
        self.offer_with(key.clone(), data.clone(), charge.and_then(|held| held()));
        Ok(cut_to(part.as_ref(), data))
    }

    /// Bytes `within` of block `key` fetched by this caller alone and not stored: the budget has
    /// no room for the whole block.
    async fn fetch_only<F, Fut, E>(
        &self,
        key: &BlockKey,
        within: Range<u64>,
        fetch: F,
    ) -> Result<Bytes, E>
    where
        F: FnOnce(Option<Range<u64>>) -> Fut,
        Fut: Future<Output = Result<Bytes, E>>,
    {
        self.miss();
        self.skip(key, "the memory budget is spent");
        fetch(Some(within)).await
    }

    /// Makes `cell` block `key`'s flight, fetched by `owner`: a flight still in the map is
    /// given the new owner; one taken out of it (its earlier init failed or was cancelled) is put
    /// back, unless a newer flight of the block has started meanwhile.
    fn claim_flight(&self, key: &BlockKey, cell: &Arc<FlightCell>, owner: u64) {
        let mut flights = self.flights.lock().expect("flights lock");
        match flights.get_mut(key) {
            None => {
                flights.insert(
                    key.clone(),
                    Flight {
                        owner,
                        cell: cell.clone(),
                    },
                );
            }
            Some(f) if Arc::ptr_eq(&f.cell, cell) => f.owner = owner,
            Some(_) => {}
        }
    }

    fn end_flight(&self, key: &BlockKey, cell: &Arc<FlightCell>) {
        let mut flights = self.flights.lock().expect("flights lock");
        if flights.get(key).is_some_and(|f| Arc::ptr_eq(&f.cell, cell)) {
            flights.remove(key);
        }
    }

    /// Stores block `key`, fetched by a caller outside [`Self::get_or_fetch`], on a blocking
    /// thread (write-behind: the caller does not wait for the disk). Nothing happens if the block
    /// is already on disk.
    pub fn offer(self: &Arc<Self>, key: BlockKey, data: Bytes) {
        self.offer_with(key, data, None);
    }

    /// [`Self::offer`], the write holding `charge` (else one from [`Self::charge_writes`]).
    fn offer_with(&self, key: BlockKey, data: Bytes, charge: Option<WriteCharge>) {
        if data.is_empty() || self.contains(&key) {
            return;
        }
        self.queue_write(key, data, None, charge);
    }

    /// Hands block `key` to the writer threads (ending its flight, if any, once stored), holding
    /// `charge` (the caller's, for these bytes) or else one from [`Self::charge_writes`] until it
    /// is written. When more than [`Self::queue_max`] bytes wait already, or that charge is
    /// refused, the block is not stored (counted as skipped): readers never wait for the cache's
    /// disk, nor pile up its memory.
    fn queue_write(
        &self,
        key: BlockKey,
        data: Bytes,
        cell: Option<Arc<FlightCell>>,
        charge: Option<WriteCharge>,
    ) {
        self.writes.fetch_add(1, Ordering::AcqRel);
        let len = data.len() as u64;
        let charge = match (charge, self.charge_writes.get()) {
            (Some(held), _) => Ok(Some(held)),
            (None, Some((charge, _))) => charge(len).map(Some).ok_or("the memory budget is spent"),
            (None, None) => Ok(None),
        };
        let why = match charge {
            Err(why) => why,
            Ok(charge) => {
                let mut q = self.work.write_queue.lock().expect("write queue lock");
                if q.bytes + len <= self.queue_max() {
                    q.bytes += len;
                    q.jobs.push_back(WriteJob {
                        key,
                        data,
                        cell,
                        _charge: charge,
                    });
                    drop(q);
                    self.work.write_ready.notify_one();
                    return;
                }
                "the cache's writers are behind"
            }
        };
        self.skip(&key, why);
        if let Some(cell) = cell {
            self.end_flight(&key, &cell);
        }
        self.writes.fetch_sub(1, Ordering::AcqRel);
        self.writes_done.notify_waiters();
    }

    /// Writes the block on a blocking thread, then ends its flight (late joiners take the bytes
    /// from the flight until the file is there).
    fn store_in_background(
        self: &Arc<Self>,
        key: BlockKey,
        data: Bytes,
        cell: Arc<FlightCell>,
        charge: Option<WriteCharge>,
    ) {
        self.queue_write(key, data, Some(cell), charge);
    }

    /// The block from disk (only `part` of it, if given), if intact; a bad file is deleted and
    /// counted.
    async fn read(self: &Arc<Self>, key: &BlockKey, part: Option<Part>) -> Option<Bytes> {
        // A miss the index already knows costs no blocking hop (until the index is rebuilt at
        // start, the disk is asked).
        if self.is_ready() && !self.contains(key) {
            return None;
        }
        let id = key.file_id();
        let path = self.block_path(&id);
        let (k, p) = (key.clone(), part.clone());
        let cache = self.clone();
        let got = tokio::task::spawn_blocking(move || {
            let got = read_block_file(&path, &k, p);
            if let Err(e) = &got {
                // Indexed, yet gone (deleted under the index: by something other than the
                // cache, or a bad file a read deleted while the index was rebuilt): forgotten,
                // or the fetched block would never be stored again.
                cache.forget_if_missing(e, Entry::Block(id));
            }
            got
        })
        .await
        .ok()?;
        let got = match got {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A plain miss stays cheap: no blocking hop unless the object is whole on disk.
                if !self.has_whole(&key.object()) {
                    return None;
                }
                let (cache, key) = (self.clone(), key.clone());
                return tokio::task::spawn_blocking(move || cache.read_from_whole(&key, part))
                    .await
                    .ok()
                    .flatten();
            }
            Err(e) => {
                tracing::warn!(key = %key.key, error = %e, "cache: reading a block file failed; fetching it");
                return None;
            }
        };
        match got {
            Ok(data) => {
                self.lock().lru.touch(&Entry::Block(id));
                self.hit(data.len());
                Some(data)
            }
            Err(why) => {
                tracing::warn!(key = %key.key, etag = %key.etag, index = key.index, %why,
                    "cache: bad block file deleted; fetching the block again");
                let cache = self.clone();
                let _ =
                    tokio::task::spawn_blocking(move || cache.drop_corrupt(Entry::Block(id))).await;
                None
            }
        }
    }

    /// Counts a fetch run for a block not on disk.
    fn miss(&self) {
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        metrics().misses.inc();
    }

    fn hit(&self, len: usize) {
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        self.counters
            .hit_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        metrics().hits.inc();
        metrics().hit_bytes.inc_by(len as u64);
    }

    /// Deletes a file that failed its check and counts it (blocking).
    fn drop_corrupt(&self, entry: Entry) {
        self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
        metrics().corrupt.inc();
        self.forget(&entry);
        for path in self.entry_paths(&entry) {
            let _ = std::fs::remove_file(path);
        }
        self.publish_size();
    }

    /// Drops `entry` from the index if one of its files is gone (blocking). Checked under the
    /// index's lock: a file is renamed into place before it is indexed, and taken out of the
    /// index before it is deleted, so a file missing then is not one being stored.
    fn forget_if_gone(&self, entry: Entry) {
        let paths = self.entry_paths(&entry);
        let gone = {
            let mut st = self.lock();
            if !st.lru.contains(&entry) {
                return;
            }
            let gone = paths.iter().any(|p| !p.exists());
            if gone {
                st.remove(&entry);
                // The rest of it (a whole object's data file whose sidecar went, or the other
                // way round) would stay on disk counted by nothing. Deleted under the lock: a
                // join of the object cannot put a new file there meanwhile.
                for p in &paths {
                    let _ = std::fs::remove_file(p);
                }
            }
            gone
        };
        if gone {
            self.forget(&entry);
            self.publish_size();
        }
    }

    /// Runs `f` on `map` (the `metas` or `verified` of whole objects) if whole object `id` is in
    /// the index, under `map`'s lock. [`delete`](Self::delete) and [`forget`](Self::forget) take
    /// an entry out of the index before they take it out of `map`, so nothing is remembered for
    /// an object already gone (a sidecar read or a check racing its eviction).
    fn while_indexed<T, R>(
        &self,
        map: &Mutex<HashMap<FileId, T>>,
        id: &FileId,
        f: impl FnOnce(&mut HashMap<FileId, T>) -> R,
    ) -> Option<R> {
        let mut m = map.lock().expect("whole-object map lock");
        // Lock order: the map, then the index (never the other way round).
        if !self.lock().lru.contains(&Entry::Object(*id)) {
            return None;
        }
        Some(f(&mut m))
    }

    /// Drops `entry` from the index and, for an object, what is remembered about it.
    fn forget(&self, entry: &Entry) {
        self.lock().remove(entry);
        if let Entry::Object(id) = entry {
            self.metas.lock().expect("metas lock").remove(id);
            self.verified.lock().expect("verified lock").remove(id);
        }
    }

    /// The sidecar of whole object `obj` (read once); a bad one drops the object (blocking).
    fn meta(&self, obj: &ObjectKey, id: &FileId) -> Option<Arc<ObjectMeta>> {
        if let Some(m) = self.metas.lock().expect("metas lock").get(id) {
            return Some(m.clone());
        }
        let file = match std::fs::read(self.meta_path(id)) {
            Ok(file) => file,
            Err(e) => {
                self.forget_if_missing(&e, Entry::Object(*id));
                return None;
            }
        };
        match object::decode_meta(obj, &file) {
            Ok(meta) if meta.block_size == self.cfg.block_size => {
                let meta = Arc::new(meta);
                self.while_indexed(&self.metas, id, |m| m.insert(*id, meta.clone()));
                Some(meta)
            }
            Ok(_) | Err(_) => {
                tracing::warn!(key = %obj.key, etag = %obj.etag,
                    "cache: bad whole-object sidecar; deleting the object's file");
                self.drop_corrupt(Entry::Object(*id));
                None
            }
        }
    }

    /// Block `key` out of its object's whole file, if there is one and the piece checks out
    /// (blocking). A bad piece drops the whole file.
    fn read_from_whole(&self, key: &BlockKey, part: Option<Part>) -> Option<Bytes> {
        let obj = key.object();
        let id = obj.file_id();
        if !self.lock().lru.contains(&Entry::Object(id)) {
            return None;
        }
        let meta = self.meta(&obj, &id)?;
        let piece = meta.piece(key.index)?;
        let within = match &part {
            Some(p) if p.len == piece.end - piece.start && p.within.end <= p.len => {
                piece.start + p.within.start..piece.start + p.within.end
            }
            Some(_) => return None,
            None => piece,
        };
        // The pieces the sidecar's crcs cover that hold `within`.
        let (span, first) = block::chunk_span(&within, meta.chunk, meta.size);
        let file = match File::open(self.object_path(&id)) {
            Ok(file) => file,
            Err(e) => {
                self.forget_if_missing(&e, Entry::Object(id));
                return None;
            }
        };
        let mut buf = vec![0u8; (span.end - span.start) as usize];
        if let Err(e) = file.read_exact_at(&mut buf, span.start) {
            tracing::warn!(key = %key.key, error = %e, "cache: reading a whole-object file failed");
            if e.kind() == io::ErrorKind::UnexpectedEof {
                // Shorter than its sidecar says: a bad file, as one that fails its crcs (kept,
                // it would turn its object's blocks away from the cache for good).
                self.drop_corrupt(Entry::Object(id));
            }
            return None;
        }
        if block::check_chunks(&buf, meta.chunk, &meta.crcs, first).is_err() {
            tracing::warn!(key = %key.key, etag = %key.etag, index = key.index,
                "cache: whole-object file failed its checksum; deleted, fetching again");
            self.drop_corrupt(Entry::Object(id));
            return None;
        }
        self.lock().lru.touch(&Entry::Object(id));
        let at = (within.start - span.start) as usize..(within.end - span.start) as usize;
        let data = block::exactly(Bytes::from(buf), at);
        self.hit(data.len());
        Some(data)
    }

    /// The whole-object file of `obj` (`size` bytes) opened for reading, for the kernel to read
    /// directly: only if it is indexed, and only after this process checked every piece against
    /// its sidecar (once; concurrent callers wait for that one check). `None` (and a bad file
    /// deleted and counted) otherwise. Blocking.
    pub fn open_whole(&self, obj: &ObjectKey, size: u64) -> Option<File> {
        let file = self.checked_whole(obj, size)?;
        self.lock().lru.touch(&Entry::Object(obj.file_id()));
        self.counters.whole_opens.fetch_add(1, Ordering::Relaxed);
        metrics().passthrough_opens.inc();
        Some(file)
    }

    /// Gets the whole file of `obj` ready for a hand-out that may follow (checks it if needed,
    /// brings its directory entry and inode into memory) without handing it out: run while the
    /// caller proves access, so the two overlap. Blocking.
    pub fn prepare_whole(&self, obj: &ObjectKey, size: u64) {
        let _ = self.checked_whole(obj, size);
    }

    fn checked_whole(&self, obj: &ObjectKey, size: u64) -> Option<File> {
        let id = obj.file_id();
        let gate = self.while_indexed(&self.verified, &id, |v| v.entry(id).or_default().clone())?;
        let mut checked = gate.lock().expect("verify gate");
        let file = match File::open(self.object_path(&id)) {
            Ok(file) => file,
            Err(e) => {
                // Not under the gate: forgetting takes the `verified` lock, which a join holds
                // while it takes the gate.
                drop(checked);
                self.forget_if_missing(&e, Entry::Object(id));
                return None;
            }
        };
        // Stamped before a check: a write during it changes the file's ctime. A file whose
        // stamp moved since it was checked (written to since) is checked again.
        let stamp = file.metadata().ok().map(|m| FileStamp::of(&m));
        if checked.is_none() || *checked != stamp {
            let meta = self.meta(obj, &id)?;
            let ok = meta.size == size
                && stamp.is_some_and(|st| st.size == size)
                && check_whole(&file, &meta);
            if !ok {
                tracing::warn!(key = %obj.key, etag = %obj.etag,
                    "cache: whole-object file failed its check; deleted, reading through blocks");
                drop(checked);
                self.drop_corrupt(Entry::Object(id));
                return None;
            }
            *checked = stamp;
        }
        Some(file)
    }

    /// Records the whole files this process checked (or wrote), for the next process to trust
    /// while they stay unchanged: call at a clean shutdown, after [`BlockCache::settle`]. Flushes
    /// the cache's filesystem first (`syncfs`), so a recorded file is on disk as checked.
    /// Blocking; returns how many files it recorded.
    pub fn save_checked(&self) -> io::Result<usize> {
        let ids: Vec<(FileId, FileStamp)> = {
            let verified = self.verified.lock().expect("verified lock");
            verified
                .iter()
                .filter_map(|(id, gate)| Some((*id, (*gate.try_lock().ok()?)?)))
                .collect()
        };
        let dir = File::open(&self.cfg.dir)?;
        nix::unistd::syncfs(&dir)?;
        let mut out = String::new();
        let mut n = 0;
        for (id, checked) in ids {
            if !self.lock().lru.contains(&Entry::Object(id)) {
                continue;
            }
            if let Ok(meta) = std::fs::metadata(self.object_path(&id)) {
                let st = FileStamp::of(&meta);
                if st != checked {
                    // Changed since it was checked: the next process checks it again.
                    continue;
                }
                out.push_str(&format!(
                    "{} {} {} {} {}\n",
                    block::hex(&id),
                    st.ino,
                    st.size,
                    st.mtime_ns,
                    st.ctime_ns
                ));
                n += 1;
            }
        }
        let tmp = self.tmp_dir.join(CHECKED_FILE);
        let mut f = File::create(&tmp)?;
        f.write_all(out.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.cfg.dir.join(CHECKED_FILE))?;
        dir.sync_all()?;
        Ok(n)
    }

    /// Asks for `obj` (`size` bytes) as one whole-object file: joined now if every block is on
    /// disk, else when its last block is stored. Cheap; the join runs on a blocking thread.
    pub fn want_whole(self: &Arc<Self>, obj: ObjectKey, size: u64) {
        if size == 0 || !self.is_ready() {
            return;
        }
        let id = obj.file_id();
        let blocks = size.div_ceil(self.cfg.block_size);
        {
            let mut st = self.lock();
            if st.lru.contains(&Entry::Object(id))
                || st.assembling.contains(&id)
                || st.wishes.contains_key(&id)
            {
                return;
            }
            let missing: HashSet<u64> = (0..blocks)
                .filter(|&i| !st.lru.contains(&Entry::Block(obj.block(i).file_id())))
                .collect();
            if !missing.is_empty() {
                if st.wishes.len() >= MAX_WISHES {
                    st.wishes.clear();
                }
                st.wishes.insert(id, Wish { obj, size, missing });
                return;
            }
        }
        self.queue_join(obj, size);
    }

    /// Joins the blocks of `obj` into its whole-object file and deletes them (blocking). Does
    /// nothing if a block is missing or bad, the object is already whole or being joined, or
    /// there is no room.
    fn assemble(&self, obj: &ObjectKey, size: u64) -> bool {
        let id = obj.file_id();
        let bs = self.cfg.block_size;
        let blocks = size.div_ceil(bs);
        {
            let mut st = self.lock();
            st.wishes.remove(&id);
            if size == 0
                || st.lru.contains(&Entry::Object(id))
                || !st.has_all_blocks(obj, blocks)
                || !st.assembling.insert(id)
            {
                return false;
            }
        }
        let done = self.assemble_now(obj, &id, size, blocks, |out| {
            self.copy_blocks(obj, size, blocks, out)
        });
        self.lock().assembling.remove(&id);
        if !done {
            tracing::debug!(key = %obj.key, "cache: object not joined into one file");
        }
        done
    }

    fn assemble_now(
        &self,
        obj: &ObjectKey,
        id: &FileId,
        size: u64,
        blocks: u64,
        write: impl FnOnce(&mut dyn Write) -> io::Result<Option<Vec<u32>>>,
    ) -> bool {
        let bs = self.cfg.block_size;
        let ours: HashSet<Entry> = (0..blocks)
            .map(|i| Entry::Block(obj.block(i).file_id()))
            .collect();
        let meta_len = object::encode_meta(
            obj,
            &ObjectMeta {
                size,
                block_size: bs,
                chunk: block::CHUNK,
                crcs: vec![0; size.div_ceil(block::CHUNK) as usize],
            },
        )
        .len() as u64;
        let len = size + meta_len;
        let Some(free) = self.free_on_disk() else {
            return false;
        };
        // Room for the new file while the blocks are still there: never by evicting them (passed
        // over where they are in the order, however old), and nothing evicted for a file that
        // cannot fit beside them, in the cache or on its filesystem.
        let (victims, own) = {
            let mut st = self.lock();
            let own: u64 = ours.iter().filter_map(|b| st.lru.size(b)).sum();
            if own + st.pending + len > self.cfg.max_size
                || !self.could_fit_on_disk(&st, free, len, own)
            {
                return false;
            }
            let mut victims = Vec::new();
            while st.lru.bytes() + st.pending + len > self.cfg.max_size {
                match st.pop_lru_except(|e| ours.contains(e)) {
                    Some((v, _)) => victims.push(v),
                    None => break,
                }
            }
            st.pending += len;
            (victims, own)
        };
        self.delete(&victims);
        let written = self.make_room_on_disk(len, own, |e| ours.contains(e))
            && self.write_whole(obj, id, size, write);
        let mut st = self.lock();
        st.pending -= len;
        if !written {
            return false;
        }
        st.insert(Entry::Object(*id), len);
        for block in &ours {
            st.remove(block);
        }
        drop(st);
        for block in &ours {
            for path in self.entry_paths(block) {
                let _ = std::fs::remove_file(path);
            }
        }
        // Written from checked blocks by this process: no need to check it again before use.
        let stamp = std::fs::metadata(self.object_path(id))
            .ok()
            .map(|m| FileStamp::of(&m));
        self.while_indexed(&self.verified, id, |v| {
            *v.entry(*id).or_default().lock().expect("verify gate") = stamp;
        });
        self.counters.assembled.fetch_add(1, Ordering::Relaxed);
        metrics().assembled.inc();
        self.publish_size();
        true
    }

    /// The object's block files (each checked) written one after the other to `out`; their
    /// crc32c. A bad block is dropped and counted (`None`).
    fn copy_blocks(
        &self,
        obj: &ObjectKey,
        size: u64,
        blocks: u64,
        out: &mut dyn Write,
    ) -> io::Result<Option<Vec<u32>>> {
        let bs = self.cfg.block_size;
        let mut crcs = Vec::with_capacity(size.div_ceil(block::CHUNK) as usize);
        for i in 0..blocks {
            let key = obj.block(i);
            let bid = key.file_id();
            let file = Bytes::from(std::fs::read(self.block_path(&bid))?);
            let want = size.min((i + 1) * bs) - i * bs;
            match block::decode(&key, file) {
                Ok(data) if data.len() as u64 == want => {
                    // Whole pieces: a block is a whole number of them (a power of two, at
                    // least one piece), and only the last block may be shorter.
                    crcs.extend(block::chunk_crcs(&data, block::CHUNK));
                    out.write_all(&data)?;
                }
                Ok(_) | Err(_) => {
                    tracing::warn!(key = %key.key, index = i,
                        "cache: bad block file found while joining an object; deleted");
                    self.drop_corrupt(Entry::Block(bid));
                    return Ok(None);
                }
            }
        }
        Ok(Some(crcs))
    }

    /// Writes the data file (with `write`) and the sidecar under `tmp/`, then renames both into
    /// place. Buffered, not `O_DIRECT`: the joiner runs once the cache is idle, and the file it
    /// writes stays in the page cache for the kernel to read through passthrough.
    fn write_whole(
        &self,
        obj: &ObjectKey,
        id: &FileId,
        size: u64,
        write: impl FnOnce(&mut dyn Write) -> io::Result<Option<Vec<u32>>>,
    ) -> bool {
        let bs = self.cfg.block_size;
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let hex = block::hex(id);
        let tmp_data = self.tmp_dir.join(format!("{hex}-{seq}"));
        let tmp_meta = self.tmp_dir.join(format!("{hex}-{seq}.meta"));
        let result = (|| -> io::Result<bool> {
            let mut out = io::BufWriter::with_capacity(1 << 20, File::create(&tmp_data)?);
            let Some(crcs) = write(&mut out)? else {
                return Ok(false);
            };
            out.into_inner().map_err(|e| e.into_error())?;
            let meta = object::encode_meta(
                obj,
                &ObjectMeta {
                    size,
                    block_size: bs,
                    chunk: block::CHUNK,
                    crcs,
                },
            );
            std::fs::write(&tmp_meta, meta)?;
            let (data_path, meta_path) = (self.object_path(id), self.meta_path(id));
            std::fs::create_dir_all(data_path.parent().expect("objects/xx/file"))?;
            // The data first: a sidecar without its data file is never indexed.
            std::fs::rename(&tmp_data, &data_path)?;
            std::fs::rename(&tmp_meta, &meta_path)?;
            Ok(true)
        })();
        match result {
            Ok(true) => true,
            Ok(false) | Err(_) => {
                if let Err(e) = &result {
                    tracing::debug!(error = %e, "cache: joining an object failed");
                }
                let _ = std::fs::remove_file(&tmp_data);
                let _ = std::fs::remove_file(&tmp_meta);
                let _ = std::fs::remove_file(self.object_path(id));
                false
            }
        }
    }

    /// Stores one block (blocking). Never fails: a block that cannot be stored is skipped.
    fn store(&self, key: &BlockKey, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if !self.is_ready() {
            self.skip(key, "the index is still being rebuilt");
            return;
        }
        let id = key.file_id();
        let obj_id = key.object().file_id();
        {
            let st = self.lock();
            if st.lru.contains(&Entry::Object(obj_id)) || st.lru.contains(&Entry::Block(id)) {
                // Stored or joined into a whole file meanwhile (a late duplicate fetch).
                return;
            }
        }
        self.last_fill
            .store(self.opened.elapsed().as_millis() as u64, Ordering::Relaxed);
        let tail = block::encode_tail(key, data);
        let len = (data.len() + tail.len()) as u64;
        if len > self.cfg.max_size {
            self.skip(key, "block larger than the cache");
            return;
        }
        let victims = {
            let mut st = self.lock();
            let mut victims = Vec::new();
            while st.lru.bytes() + st.pending + len > self.cfg.max_size {
                match st.pop_lru() {
                    Some((victim, _)) => victims.push(victim),
                    None => break,
                }
            }
            if st.lru.bytes() + st.pending + len > self.cfg.max_size {
                // Everything else is being written right now.
                drop(st);
                self.delete(&victims);
                self.skip(key, "the cache is full of blocks being written");
                return;
            }
            st.pending += len;
            victims
        };
        self.delete(&victims);
        let stored = self.make_room_on_disk(len, 0, |_| false) && self.write(&id, &[data, &tail]);
        let mut st = self.lock();
        st.pending -= len;
        if stored {
            st.insert(Entry::Block(id), len);
        }
        // The last block of an object a reader wants whole: join it now (`assemble` checks
        // that every block is still there).
        let wish = match st.wishes.get_mut(&obj_id) {
            Some(w) if stored => {
                w.missing.remove(&key.index);
                w.missing.is_empty().then(|| (w.obj.clone(), w.size))
            }
            _ => None,
        };
        drop(st);
        if stored {
            self.counters.stored.fetch_add(1, Ordering::Relaxed);
            metrics().fills.inc();
        } else {
            self.skip(key, "no room on the cache's filesystem");
        }
        self.publish_size();
        if let Some((obj, size)) = wish {
            self.queue_join(obj, size);
        }
    }

    /// Bytes available on the cache's filesystem; `None` if `statvfs` fails (logged once until it
    /// works again: it is asked before every write). Asked of the cache's own directory, not of
    /// `blocks/`: a `blocks/` removed by hand is made again by the next write.
    fn free_on_disk(&self) -> Option<u64> {
        match space::available(&self.cfg.dir) {
            Ok(free) => {
                self.statvfs_failing.store(false, Ordering::Relaxed);
                Some(free)
            }
            Err(e) => {
                if !self.statvfs_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(dir = %self.cfg.dir.display(), error = %e, "cache: statvfs failed; nothing is stored until it works again");
                }
                None
            }
        }
    }

    /// Whether `len` more bytes would leave `min_free` free on the cache's filesystem, which has
    /// `free` bytes available, once every entry but the `kept` bytes of them were evicted.
    fn could_fit_on_disk(&self, st: &State, free: u64, len: u64, kept: u64) -> bool {
        free.saturating_add(st.lru.bytes().saturating_sub(kept))
            >= self.cfg.min_free.saturating_add(len)
    }

    /// Evicts until `len` more bytes leave `min_free` free, passing over the entries `keep`
    /// keeps (a join's own blocks, `kept` bytes); `false`, with nothing evicted, if evicting
    /// every other entry would not be enough.
    fn make_room_on_disk(&self, len: u64, kept: u64, keep: impl Fn(&Entry) -> bool) -> bool {
        loop {
            let Some(free) = self.free_on_disk() else {
                return false;
            };
            if free >= self.cfg.min_free.saturating_add(len) {
                return true;
            }
            let victim = {
                let mut st = self.lock();
                if !self.could_fit_on_disk(&st, free, len, kept) {
                    return false;
                }
                st.pop_lru_except(&keep)
            };
            match victim {
                Some((victim, _)) => self.delete(&[victim]),
                None => return false,
            }
        }
    }

    /// Writes to a temporary file beside the block's and renames it into place. Made in the
    /// block's own directory, the file's inode comes from that directory's part of the disk
    /// (see [`space::spread_subdirs`]), not from one `tmp/` for every block.
    fn write(&self, id: &FileId, pieces: &[&[u8]]) -> bool {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let path = self.block_path(id);
        let tmp = path.with_file_name(format!("{}{seq}", self.tmp_prefix));
        let result = (|| -> io::Result<()> {
            if self.direct {
                let mut f = in_its_dir(&tmp, direct::DirectFile::create)?;
                let one_write = match pieces {
                    [data, tail] => f.write_pages(data, tail)?,
                    _ => false,
                };
                if !one_write {
                    for piece in pieces {
                        f.write_all(piece)?;
                    }
                }
                f.finish()?;
            } else {
                let mut f = in_its_dir(&tmp, |p| File::create(p))?;
                for piece in pieces {
                    f.write_all(piece)?;
                }
            }
            std::fs::rename(&tmp, &path)
        })();
        match result {
            Ok(()) => true,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::debug!(error = %e, "cache: writing a block failed; not cached");
                false
            }
        }
    }

    /// Deletes the files of entries already taken out of the index (evicted).
    fn delete(&self, victims: &[Entry]) {
        for entry in victims {
            if let Entry::Object(id) = entry {
                self.metas.lock().expect("metas lock").remove(id);
                self.verified.lock().expect("verified lock").remove(id);
            }
            // An open whole-object file stays readable until closed (the kernel holds it).
            for path in self.entry_paths(entry) {
                if let Err(e) = std::fs::remove_file(path) {
                    if e.kind() != io::ErrorKind::NotFound {
                        tracing::warn!(error = %e, "cache: deleting an evicted file failed");
                    }
                }
            }
        }
        if !victims.is_empty() {
            let n = victims.len() as u64;
            self.counters.evictions.fetch_add(n, Ordering::Relaxed);
            metrics().evictions.inc_by(n);
        }
    }

    fn skip(&self, key: &BlockKey, why: &str) {
        self.counters.skipped.fetch_add(1, Ordering::Relaxed);
        metrics().skipped.inc();
        tracing::debug!(key = %key.key, index = key.index, why, "cache: block not stored");
    }

    fn publish_size(&self) {
        let (bytes, blocks, objects) = {
            let st = self.lock();
            (st.lru.bytes(), st.lru.len() as u64 - st.objects, st.objects)
        };
        let m = metrics();
        m.bytes.set(bytes as i64);
        m.blocks.set(blocks as i64);
        m.objects.set(objects as i64);
    }

    /// Indexes the block and whole-object files already on disk (oldest modification first),
    /// evicts down to the budget and marks the cache ready; then makes the block directories.
    /// Runs on its own thread, after deleting what an earlier layout left in `trash/`.
    fn rebuild_index(&self) {
        let started = Instant::now();
        if self.trash_dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.trash_dir) {
                tracing::warn!(dir = %self.trash_dir.display(), error = %e, "cache: emptying trash failed");
            }
        }
        let mut found: Vec<(SystemTime, Entry, u64)> = Vec::new();
        let mut stray = 0usize;
        let saved = std::mem::take(&mut *self.saved_checks.lock().expect("saved checks lock"));
        let mut trusted: Vec<(FileId, FileStamp)> = Vec::new();
        let mtime = |m: &std::fs::Metadata| m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        for (dir, whole) in [(&self.blocks_dir, false), (&self.objects_dir, true)] {
            let Ok(subdirs) = std::fs::read_dir(dir) else {
                continue;
            };
            for sub in subdirs.flatten() {
                let Ok(files) = std::fs::read_dir(sub.path()) else {
                    continue;
                };
                for file in files.flatten() {
                    let name = file.file_name();
                    let name = name.to_str().unwrap_or("");
                    if whole && name.ends_with(".meta") {
                        // Counted with its data file; one without a data file is stray.
                        if !sub.path().join(name.trim_end_matches(".meta")).is_file() {
                            stray += 1;
                            let _ = std::fs::remove_file(file.path());
                        }
                        continue;
                    }
                    let id = block::parse_hex(name);
                    let meta = file.metadata();
                    let sidecar =
                        whole.then(|| std::fs::metadata(sub.path().join(format!("{name}.meta"))));
                    match (id, meta, sidecar) {
                        (Some(id), Ok(meta), None) if meta.is_file() => {
                            found.push((mtime(&meta), Entry::Block(id), meta.len()))
                        }
                        (Some(id), Ok(meta), Some(Ok(side))) if meta.is_file() => {
                            let stamp = FileStamp::of(&meta);
                            if saved.get(&id) == Some(&stamp) {
                                trusted.push((id, stamp));
                            }
                            found.push((mtime(&meta), Entry::Object(id), meta.len() + side.len()))
                        }
                        // Not a block's name: a dead process's unfinished write (`.tmp-`,
                        // none of this one's yet: nothing is stored before the index is
                        // rebuilt), or a stray file.
                        _ => {
                            stray += 1;
                            let _ = std::fs::remove_file(file.path());
                        }
                    }
                }
            }
        }
        found.sort_unstable_by_key(|a| a.0);
        let victims = {
            let mut st = self.lock();
            for (_, entry, len) in &found {
                st.insert(*entry, *len);
            }
            let mut victims = Vec::new();
            while st.lru.bytes() > self.cfg.max_size {
                match st.pop_lru() {
                    Some((entry, _)) => victims.push(entry),
                    None => break,
                }
            }
            victims
        };
        {
            let mut verified = self.verified.lock().expect("verified lock");
            for (id, stamp) in &trusted {
                verified.insert(*id, Arc::new(Mutex::new(Some(*stamp))));
            }
            self.counters
                .trusted
                .store(trusted.len() as u64, Ordering::Relaxed);
        }
        self.delete(&victims);
        self.publish_size();
        let objects = found
            .iter()
            .filter(|(_, e, _)| matches!(e, Entry::Object(_)))
            .count();
        tracing::info!(
            dir = %self.cfg.dir.display(),
            blocks = found.len() - objects,
            objects,
            checked_before = trusted.len(),
            evicted = victims.len(),
            stray,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "cache index rebuilt"
        );
        self.ready.send_replace(true);
        // Every block directory, made now rather than by the first block stored in it: where the
        // filesystem spreads them ([`space::spread_subdirs`]), making one reads the metadata of
        // its part of the disk, which that block's writer would otherwise wait for. Made once
        // the index is ready (a fresh cache has nothing to index) and at the writers' priority:
        // made first, at the thread's own, they took 60 ms of CPU from a new mount's first reads
        // on the benchmark VM. A block written before its directory is made makes it.
        lower_priority();
        for first in 0..=u8::MAX {
            let _ = std::fs::create_dir(self.blocks_dir.join(format!("{first:02x}")));
        }
        self.dirs_made.send_replace(true);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("cache state lock")
    }
}

/// Some of a block's bytes: `within` of its `len` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The block's length (the object's bytes it covers).
    pub len: u64,
    /// The bytes wanted, relative to the block's start (non-empty, within `len`).
    pub within: std::ops::Range<u64>,
}

impl Part {
    /// This part of the whole block `data` ([`block::exactly`]; a block shorter than the part
    /// gives what it has: the caller checks lengths).
    fn cut(&self, data: Bytes) -> Bytes {
        block::exactly(data, self.within.start as usize..self.within.end as usize)
    }

    /// Whether the part is some of its block: not empty, not past the end.
    fn is_valid(&self) -> bool {
        self.within.start < self.within.end && self.within.end <= self.len
    }
}

/// `part` of the whole block `data` ([`Part::cut`]), or all of it without one.
fn cut_to(part: Option<&Part>, data: Bytes) -> Bytes {
    match part {
        Some(p) => p.cut(data),
        None => data,
    }
}

/// Block `key`'s file at `path`: only `part` of its data, read and checked, when the file allows
/// it, else the whole file, decoded (and cut to `part`). The outer error is the file's (a missing
/// file is `NotFound`), the inner one its contents'. Blocking.
fn read_block_file(
    path: &Path,
    key: &BlockKey,
    part: Option<Part>,
) -> io::Result<Result<Bytes, Invalid>> {
    use std::io::Read;
    let mut file = File::open(path)?;
    if let Some(p) = &part {
        match block::read_range(&file, key, p.len, p.within.clone()) {
            Ok(Some(data)) => return Ok(Ok(data)),
            Ok(None) => {}
            Err(why) => return Ok(Err(why)),
        }
    }
    let mut buf = Vec::with_capacity(file.metadata().map_or(0, |m| m.len() as usize));
    file.read_to_end(&mut buf)?;
    Ok(
        block::decode(key, Bytes::from(buf)).and_then(|data| match &part {
            Some(p) if data.len() as u64 != p.len => Err(Invalid::Malformed),
            Some(p) => Ok(p.cut(data)),
            None => Ok(data),
        }),
    )
}

/// The record of checked whole files a clean shutdown leaves for the next process.
const CHECKED_FILE: &str = "checked";

/// How a temporary block file's name starts (no block's name does: those are hex).
const TMP_MARK: &str = ".tmp-";

/// `create(path)`, making `path`'s directory first if it is missing (the index thread makes every
/// block directory at start; this makes one removed since).
fn in_its_dir<T>(path: &Path, create: impl Fn(&Path) -> io::Result<T>) -> io::Result<T> {
    match create(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(path.parent().expect("a file in a directory"))?;
            create(path)
        }
        other => other,
    }
}

/// How long [`BlockCache::open`] waits for another process to let go of the cache directory.
pub const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Takes the exclusive lock on cache directory `dir` (`flock` on `dir/lock`, which records the
/// holder's pid), waiting up to `wait` for another process to let go.
fn lock_dir(dir: &Path, wait: std::time::Duration) -> Result<File, CacheError> {
    let path = dir.join("lock");
    let dir_err = |err| CacheError::Dir {
        path: path.clone(),
        err,
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(dir_err)?;
    let deadline = Instant::now() + wait;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|s| s.trim().parse().ok());
                return Err(CacheError::InUse {
                    path: dir.to_owned(),
                    holder,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(dir_err(e)),
        }
    }
    file.set_len(0).map_err(dir_err)?;
    file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)
        .map_err(dir_err)?;
    Ok(file)
}

/// What identifies one version of a file on disk: any write changes its ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileStamp {
    fn of(m: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileStamp {
            ino: m.ino(),
            size: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
            ctime_ns: i128::from(m.ctime()) * 1_000_000_000 + i128::from(m.ctime_nsec()),
        }
    }
}

/// Parses [`CHECKED_FILE`]; malformed lines are ignored (those files are checked again).
fn parse_checked(s: &str) -> HashMap<FileId, FileStamp> {
    s.lines()
        .filter_map(|line| {
            let mut f = line.split(' ');
            let id = block::parse_hex(f.next()?)?;
            let stamp = FileStamp {
                ino: f.next()?.parse().ok()?,
                size: f.next()?.parse().ok()?,
                mtime_ns: f.next()?.parse().ok()?,
                ctime_ns: f.next()?.parse().ok()?,
            };
            f.next().is_none().then_some((id, stamp))
        })
        .collect()
}

/// Whether every piece of the whole-object `file` matches its crc in `meta` (blocking). Asks
/// the kernel to read the whole file ahead first, so the disk works while pieces are checked.
fn check_whole(file: &File, meta: &ObjectMeta) -> bool {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    let _ = posix_fadvise(file, 0, 0, PosixFadviseAdvice::POSIX_FADV_WILLNEED);
    // Read a block's worth of whole pieces at a time.
    let step = (meta.block_size.max(meta.chunk) / meta.chunk).max(1) * meta.chunk;
    let mut buf = vec![0u8; step.min(meta.size) as usize];
    (0..meta.size.div_ceil(step)).all(|i| {
        let (start, end) = (i * step, meta.size.min((i + 1) * step));
        let buf = &mut buf[..(end - start) as usize];
        let first = (start / meta.chunk) as usize;
        file.read_exact_at(buf, start).is_ok()
            && block::check_chunks(buf, meta.chunk, &meta.crcs, first).is_ok()
    })
}

#[cfg(test)]
mod tests;
