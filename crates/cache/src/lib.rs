//! Ferry's node-level read cache: blocks of S3 objects in files under one local directory, shared
//! by every mount of the node plugin.
//!
//! - **Keys.** A block is named by (endpoint, bucket, key, ETag, block index) ([`BlockKey`]); a
//!   new object version has a new ETag, so it never meets the old version's blocks.
//! - **Integrity.** Each file carries its key and a crc32c over header and data ([`block`]); a
//!   file that does not check out is a miss: it is deleted, counted (`corrupt`) and refetched.
//! - **Atomic writes.** A block is written to `tmp/` and renamed into `blocks/`; a reader sees a
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
//! The cache knows nothing about credentials: callers (the filesystem) serve a block only to a
//! mount whose own credentials have shown access to that object version.

pub mod block;
pub mod lru;
pub mod space;

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use ferry_metrics::names;
use tokio::sync::{watch, Notify, OnceCell};

pub use block::{BlockKey, FileId, Invalid};
use lru::Lru;

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
    #[error("cache directory {path}: {source}")]
    Dir { path: PathBuf, source: io::Error },
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
    /// Fetched blocks not stored (index not ready, no room under the floor, write failed).
    pub skipped: u64,
    pub evictions: u64,
    /// Block files that failed their checksum or named another block (deleted, not served).
    pub corrupt: u64,
    /// Bytes of block files on disk (indexed).
    pub bytes: u64,
    /// Block files on disk (indexed).
    pub blocks: u64,
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
}

/// Counts bytes a warm-up fetched into the cache.
pub fn warmup_bytes(n: u64) {
    counter(
        names::CACHE_WARMUP_BYTES,
        "Bytes fetched into the node cache by volume warm-ups.",
    )
    .add(n);
}

/// Counts a finished warm-up by `result` (`ok`, `truncated`, `error`).
pub fn warmup_done(result: &str) {
    ferry_metrics::global()
        .counter(
            names::CACHE_WARMUPS,
            "Volume warm-ups finished, by result.",
            &[("result", result)],
        )
        .inc();
}

fn counter(name: &'static str, help: &'static str) -> Arc<ferry_metrics::Counter> {
    ferry_metrics::global().counter(name, help, &[])
}

fn gauge(name: &'static str, help: &'static str) -> Arc<ferry_metrics::Gauge> {
    ferry_metrics::global().gauge(name, help, &[])
}

struct State {
    lru: Lru<FileId>,
    /// Bytes of files being written (reserved under the budget before the write starts).
    pending: u64,
}

/// The node's block cache. Cheap to share (`Arc`); every method is safe to call concurrently.
pub struct BlockCache {
    cfg: CacheConfig,
    blocks_dir: PathBuf,
    tmp_dir: PathBuf,
    state: Mutex<State>,
    flights: Mutex<HashMap<BlockKey, Arc<OnceCell<Bytes>>>>,
    ready: watch::Sender<bool>,
    counters: Counters,
    tmp_seq: AtomicU64,
    writes: AtomicUsize,
    writes_done: Notify,
    /// Warm-ups started in this process (by id), so each runs once.
    claimed: Mutex<std::collections::HashSet<String>>,
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
    pub fn open(cfg: CacheConfig) -> Result<Arc<BlockCache>, CacheError> {
        cfg.validate()?;
        let dir_err = |path: &Path| {
            let path = path.to_owned();
            move |source| CacheError::Dir { path, source }
        };
        let blocks_dir = cfg.dir.join("blocks");
        let tmp_dir = cfg.dir.join("tmp");
        std::fs::create_dir_all(&blocks_dir).map_err(dir_err(&blocks_dir))?;
        // Leftovers of a previous process's unfinished writes.
        if tmp_dir.exists() {
            std::fs::remove_dir_all(&tmp_dir).map_err(dir_err(&tmp_dir))?;
        }
        std::fs::create_dir_all(&tmp_dir).map_err(dir_err(&tmp_dir))?;
        let cache = Arc::new(BlockCache {
            cfg,
            blocks_dir,
            tmp_dir,
            state: Mutex::new(State {
                lru: Lru::default(),
                pending: 0,
            }),
            flights: Mutex::new(HashMap::new()),
            ready: watch::channel(false).0,
            counters: Counters::default(),
            tmp_seq: AtomicU64::new(0),
            writes: AtomicUsize::new(0),
            writes_done: Notify::new(),
            claimed: Mutex::new(Default::default()),
        });
        let c = cache.clone();
        std::thread::Builder::new()
            .name("ferry-cache-index".into())
            .spawn(move || c.rebuild_index())
            .map_err(dir_err(&cache.cfg.dir))?;
        Ok(cache)
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

    /// Waits until every block write started so far has finished (tests, warm-up progress).
    pub async fn settle(&self) {
        loop {
            let notified = self.writes_done.notified();
            if self.writes.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
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
            bytes: st.lru.bytes(),
            blocks: st.lru.len() as u64,
        }
    }

    /// `true` the first time `id` is claimed in this process (a warm-up runs once per node).
    pub fn claim(&self, id: &str) -> bool {
        self.claimed
            .lock()
            .expect("claims lock")
            .insert(id.to_owned())
    }

    /// Counts an open refused because the mount's own credentials were denied the object (its
    /// blocks may be on disk; they are not served to that mount).
    pub fn note_denied(&self) {
        counter(
            names::CACHE_DENIED,
            "Opens through a cached mount refused because its credentials were denied the object.",
        )
        .inc();
    }

    /// The file of block `id`.
    pub fn block_path(&self, id: &FileId) -> PathBuf {
        let hex = block::hex(id);
        self.blocks_dir.join(&hex[..2]).join(hex)
    }

    /// Whether block `key` is on disk and indexed (does not check its contents).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.lock().lru.contains(&key.file_id())
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
        if let Some(data) = self.read(key).await {
            return Ok(data);
        }
        let cell = self
            .flights
            .lock()
            .expect("flights lock")
            .entry(key.clone())
            .or_default()
            .clone();
        let mut ran = false;
        let result = cell
            .get_or_try_init(|| async {
                ran = true;
                // A fill may have finished between the read above and joining the flight.
                if let Some(data) = self.read(key).await {
                    return Ok(data);
                }
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                counter(names::CACHE_MISSES, "Cache block misses (fetches from S3).").inc();
                let data = fetch().await?;
                self.store_in_background(key.clone(), data.clone(), cell.clone());
                Ok(data)
            })
            .await
            .cloned();
        match &result {
            Ok(_) if !ran => {
                self.counters.joins.fetch_add(1, Ordering::Relaxed);
                counter(
                    names::CACHE_JOINS,
                    "Cache misses that waited for another reader's fetch of the same block.",
                )
                .inc();
            }
            Ok(_) => {}
            Err(_) => self.end_flight(key, &cell),
        }
        result
    }

    fn end_flight(&self, key: &BlockKey, cell: &Arc<OnceCell<Bytes>>) {
        let mut flights = self.flights.lock().expect("flights lock");
        if flights.get(key).is_some_and(|c| Arc::ptr_eq(c, cell)) {
            flights.remove(key);
        }
    }

    /// Writes the block on a blocking thread, then ends its flight (late joiners take the bytes
    /// from the flight until the file is there).
    fn store_in_background(
        self: &Arc<Self>,
        key: BlockKey,
        data: Bytes,
        cell: Arc<OnceCell<Bytes>>,
    ) {
        self.writes.fetch_add(1, Ordering::AcqRel);
        let cache = self.clone();
        tokio::task::spawn_blocking(move || {
            cache.store(&key, &data);
            cache.end_flight(&key, &cell);
            cache.writes.fetch_sub(1, Ordering::AcqRel);
            cache.writes_done.notify_waiters();
        });
    }

    /// The block from disk, if intact; a bad file is deleted and counted.
    async fn read(self: &Arc<Self>, key: &BlockKey) -> Option<Bytes> {
        let id = key.file_id();
        let path = self.block_path(&id);
        let file = tokio::task::spawn_blocking(move || std::fs::read(path))
            .await
            .ok()?;
        let file = match file {
            Ok(file) => Bytes::from(file),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(key = %key.key, error = %e, "cache: reading a block file failed; fetching it");
                return None;
            }
        };
        match block::decode(key, file) {
            Ok(data) => {
                self.lock().lru.touch(&id);
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .hit_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                counter(names::CACHE_HITS, "Cache block hits.").inc();
                counter(names::CACHE_HIT_BYTES, "Bytes served from the node cache.")
                    .add(data.len() as u64);
                Some(data)
            }
            Err(why) => {
                tracing::warn!(key = %key.key, etag = %key.etag, index = key.index, %why,
                    "cache: bad block file deleted; fetching the block again");
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                counter(
                    names::CACHE_CORRUPT,
                    "Cache block files that failed their checksum or key check (deleted).",
                )
                .inc();
                let path = self.block_path(&id);
                let cache = self.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    let _ = std::fs::remove_file(path);
                    cache.lock().lru.remove(&id);
                    cache.publish_size();
                })
                .await;
                None
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
        let file = block::encode(key, data);
        let len = file.len() as u64;
        if len > self.cfg.max_size {
            self.skip(key, "block larger than the cache");
            return;
        }
        let victims = {
            let mut st = self.lock();
            let mut victims = Vec::new();
            while st.lru.bytes() + st.pending + len > self.cfg.max_size {
                match st.lru.pop_lru() {
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
        let stored = self.make_room_on_disk(len) && self.write(&id, &file);
        let mut st = self.lock();
        st.pending -= len;
        if stored {
            st.lru.insert(id, len);
        }
        drop(st);
        if stored {
            self.counters.stored.fetch_add(1, Ordering::Relaxed);
        } else {
            self.skip(key, "no room on the cache's filesystem");
        }
        self.publish_size();
    }

    /// Evicts until `len` more bytes leave `min_free` free; `false` if that is impossible.
    fn make_room_on_disk(&self, len: u64) -> bool {
        loop {
            let free = match space::available(&self.blocks_dir) {
                Ok(free) => free,
                Err(e) => {
                    tracing::warn!(dir = %self.cfg.dir.display(), error = %e, "cache: statvfs failed");
                    return false;
                }
            };
            if free >= self.cfg.min_free.saturating_add(len) {
                return true;
            }
            let victim = self.lock().lru.pop_lru();
            match victim {
                Some((victim, _)) => self.delete(&[victim]),
                None => return false,
            }
        }
    }

    /// Writes to a temporary file and renames it into place.
    fn write(&self, id: &FileId, file: &[u8]) -> bool {
        let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let tmp = self.tmp_dir.join(format!("{}-{seq}", block::hex(id)));
        let path = self.block_path(id);
        let result = (|| -> io::Result<()> {
            std::fs::write(&tmp, file)?;
            match std::fs::rename(&tmp, &path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(path.parent().expect("blocks/xx/file"))?;
                    std::fs::rename(&tmp, &path)
                }
                other => other,
            }
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

    fn delete(&self, victims: &[FileId]) {
        for id in victims {
            if let Err(e) = std::fs::remove_file(self.block_path(id)) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(error = %e, "cache: deleting an evicted block failed");
                }
            }
        }
        if !victims.is_empty() {
            let n = victims.len() as u64;
            self.counters.evictions.fetch_add(n, Ordering::Relaxed);
            counter(names::CACHE_EVICTIONS, "Cache blocks evicted.").add(n);
        }
    }

    fn skip(&self, key: &BlockKey, why: &str) {
        self.counters.skipped.fetch_add(1, Ordering::Relaxed);
        counter(
            names::CACHE_SKIPPED,
            "Fetched blocks not stored in the cache (no room, write failed, index not ready).",
        )
        .inc();
        tracing::debug!(key = %key.key, index = key.index, why, "cache: block not stored");
    }

    fn publish_size(&self) {
        let (bytes, blocks) = {
            let st = self.lock();
            (st.lru.bytes(), st.lru.len())
        };
        gauge(
            names::CACHE_BYTES,
            "Bytes of block files in the node cache.",
        )
        .set(bytes as i64);
        gauge(names::CACHE_BLOCKS, "Block files in the node cache.").set(blocks as i64);
    }

    /// Indexes the block files already on disk (oldest modification first), evicts down to the
    /// budget and marks the cache ready. Runs on its own thread.
    fn rebuild_index(&self) {
        let started = Instant::now();
        let mut found: Vec<(SystemTime, FileId, u64)> = Vec::new();
        let mut stray = 0usize;
        if let Ok(dirs) = std::fs::read_dir(&self.blocks_dir) {
            for dir in dirs.flatten() {
                let Ok(files) = std::fs::read_dir(dir.path()) else {
                    continue;
                };
                for file in files.flatten() {
                    let name = file.file_name();
                    let id = name.to_str().and_then(block::parse_hex);
                    let meta = file.metadata();
                    match (id, meta) {
                        (Some(id), Ok(meta)) if meta.is_file() => found.push((
                            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                            id,
                            meta.len(),
                        )),
                        _ => {
                            stray += 1;
                            let _ = std::fs::remove_file(file.path());
                        }
                    }
                }
            }
        }
        found.sort_unstable();
        let victims = {
            let mut st = self.lock();
            for (_, id, len) in &found {
                st.lru.insert(*id, *len);
            }
            let mut victims = Vec::new();
            while st.lru.bytes() > self.cfg.max_size {
                match st.lru.pop_lru() {
                    Some((id, _)) => victims.push(id),
                    None => break,
                }
            }
            victims
        };
        self.delete(&victims);
        self.publish_size();
        tracing::info!(
            dir = %self.cfg.dir.display(),
            blocks = found.len() - victims.len(),
            evicted = victims.len(),
            stray,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "cache index rebuilt"
        );
        self.ready.send_replace(true);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("cache state lock")
    }
}

#[cfg(test)]
mod tests;
