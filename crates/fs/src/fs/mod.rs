//! The filesystem core: every operation Ferry supports, on inode and handle numbers, with no fuser
//! type in sight. [`crate::fuse`] only translates requests to these calls and results to replies.
//!
//! Locking: one `std` mutex over the plain-data state (inode table, handle table), never held
//! across an `.await`; each open handle has its own async mutex, held across its S3 calls so one
//! handle's reads (or writes) are ordered while different handles proceed in parallel.
//!
//! This file holds the state and what every operation shares (attributes, handles, the handle
//! lifecycle at `release` and unmount, the journal); the operations live by seam:
//! - [`namespace`]: lookup, attributes, directories, unlink, rename, statfs;
//! - [`read`]: open and read, the node cache and passthrough, prefetching;
//! - [`upload`]: create, write, and completing uploads at flush, fsync or release;
//! - [`sweep`]: with the node cache, fetching a directory a loader goes through ahead of it.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use ferry_store::{
    list_all, CompletedPart, ListAll, ListRequest, ObjectInfo, ObjectStore, StoreError,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use ferry_cache::{BlockCache, ObjectKey};

use crate::proofs::Proofs;

use crate::budget::{MemoryBudget, PrefetchConfig, Use};
use crate::config::MountConfig;
use crate::error::FsError;
use crate::handles::{
    DirHandle, Handle, HandleTable, MultipartState, PartRecord, ReadHandle, Snapshot, WriteHandle,
    WriteStatus, MAX_PARTS, PART_SIZE,
};
use crate::inode::{
    kept_listing_bytes, now_secs, CachedEntry, Ino, Inode, InodeState, InodeTable, Validity,
    ROOT_INO,
};
use crate::journal::Journal;
use crate::names::{
    child_path, dir_prefix, file_key, lookup_name, new_name, Kind, ListedEntry, Listing,
    ListingBuilder, ObjectMeta, KEY_MAX,
};
use crate::prefetch::{fetch, CacheUse, Part, SmallObjects, Source};

mod kdir;
mod namespace;
mod read;
mod sweep;
mod upload;

pub use upload::Closing;

/// Block size reported by `stat`.
pub const BLKSIZE: u32 = 4096;
/// Most hidden keys remembered (so each is logged once).
const HIDDEN_LOG_MAX: usize = 10_000;

/// LIST requests in flight at most while one directory of many pages is listed: after its first
/// page, the listing guesses where later pages start and lists them at once
/// ([`ferry_store::listing`]).
const LIST_CONCURRENCY: usize = 8;

/// A file's or directory's attributes as `stat` shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: Ino,
    pub kind: Kind,
    pub size: u64,
    /// 512-byte blocks.
    pub blocks: u64,
    pub mtime: SystemTime,
    /// Permission bits only.
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub blksize: u32,
}

/// An inode's attributes and how long the kernel may cache them (and the name → inode mapping).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub attr: Attr,
    pub ttl: Duration,
}

/// An opened file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    pub fh: u64,
    /// The kernel may keep the page cache (same ETag as the previous open of this inode).
    pub keep_cache: bool,
}

/// What a `setattr` asks to change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetAttr {
    pub size: Option<u64>,
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// atime and/or mtime were given (accepted, not stored).
    pub times: bool,
    pub fh: Option<u64>,
}

/// What `statfs` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// One directory entry on its way to the kernel.
#[derive(Debug)]
pub struct DirEntry<'a> {
    pub ino: Ino,
    /// The offset of the entry after this one.
    pub offset: u64,
    pub name: &'a str,
    pub kind: Kind,
    /// Used by readdirplus only.
    pub attr: &'a Attr,
    pub ttl: Duration,
}

/// Where `readdir` puts entries: the FUSE reply buffer, or a `Vec` in tests.
pub trait DirSink {
    /// Adds one entry; returns `true` if it did not fit (and was not added).
    fn add(&mut self, entry: &DirEntry<'_>) -> bool;
}

/// Everything a mount holds, as plain data (a later process can take over a live mount with it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FsSnapshot {
    pub config: MountConfig,
    pub mount_time: SystemTime,
    pub inodes: InodeTable,
    pub next_fh: u64,
    pub handles: Vec<(u64, Handle)>,
    /// The kernel requests that opened handles, as (handle, request `unique`), when known.
    #[serde(default)]
    pub requests: Vec<(u64, u64)>,
}

#[derive(Debug)]
struct FsState {
    inodes: InodeTable,
    handles: HandleTable,
    hidden_logged: HashSet<String>,
    /// Small objects fetched ahead of listing-order readers.
    small: SmallObjects,
    /// Per directory: the furthest listing index opened for reading so far and how many opens
    /// in a row followed listing order (within [`ORDER_SLACK`]).
    order: HashMap<Ino, (usize, u32)>,
    /// Per inode: read handles open in the kernel's cached mode and through passthrough. The
    /// kernel refuses to mix the two on one inode, so passthrough is offered only when no other
    /// cached-mode handle is open (derived from the handles: rebuilt on a handover).
    io: HashMap<Ino, IoModes>,
    /// Listings started by the first lookup miss in a directory without a cached listing, with
    /// [`FsState::changes`] and the time at their start (see [`Fs::probe_dir`]).
    probes: HashMap<Ino, (u64, Instant, Owned<Option<Listing>>)>,
    /// Directories probed already (bounded: cleared past [`PROBED_MAX`]).
    probed: HashSet<Ino>,
    /// Bumped by every change this mount makes to the namespace: a probe that started before
    /// one is not adopted (its listing may predate the change).
    changes: u64,
    /// The first listing page of directories a lookup found in S3 (its LIST proving the
    /// directory asks for a whole page): the next listing goes on from it (bounded: the oldest
    /// goes past [`FIRST_PAGES_MAX`]).
    first_pages: HashMap<Ino, FirstPage>,
    /// Pending drops of directories' caches in the kernel, at the end of the TTL of what they
    /// were filled with (deadline, timer); past [`KERNEL_DIRS_MAX`] directories, those whose
    /// timers all fired are forgotten.
    dir_invals: HashMap<Ino, Vec<(Instant, Owned<()>)>>,
    /// What each directory's cache in the kernel may hold ([`kdir`]); bounded: past
    /// [`KERNEL_DIRS_MAX`] the entries no open handle needs are forgotten (unknown again).
    kernel_dirs: HashMap<Ino, kdir::KernelDir>,
    /// Tags of directory snapshots ([`kdir`]).
    tags: kdir::Tags,
    /// Listings going on in the background from a first page a `readdir` already served
    /// (bounded like the first pages: the oldest is dropped).
    rest_listings: HashMap<Ino, RestListing>,
    /// Per directory: opens for reading counted towards a sweep, or the sweep (see [`sweep`]).
    sweeps: HashMap<Ino, sweep::SweepState>,
    /// Sweeps of this mount that may run at once (the others wait).
    sweep_slots: Arc<tokio::sync::Semaphore>,
}

/// A background task of this mount (a directory's probe or the rest of its listing, a sweep):
/// aborted when dropped, so none outlives the mount (its `FsState`) or the state that wants its
/// result. Awaiting it gives the task's result.
pub(super) type Owned<T> = tokio_util::task::AbortOnDropHandle<T>;

/// Spawns `task` as an [`Owned`] task of this mount.
pub(super) fn spawn_owned<T: Send + 'static>(
    task: impl std::future::Future<Output = T> + Send + 'static,
) -> Owned<T> {
    Owned::new(tokio::spawn(task))
}

/// An open directory handle and how the kernel is to treat its directory's cache ([`kdir`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirOpened {
    pub fh: u64,
    /// `FOPEN_CACHE_DIR`: the kernel may cache the entries this handle is answered.
    pub cache_dir: bool,
    /// `FOPEN_KEEP_CACHE`: the kernel's cache of the directory, if complete, is this handle's
    /// listing.
    pub keep_cache: bool,
}

/// A directory's first listing page, taken by a lookup's LIST.
#[derive(Debug)]
struct FirstPage {
    page: ferry_store::ListPage,
    /// The directory's prefix the page lists.
    prefix: String,
    /// When the LIST was sent.
    at: Instant,
    /// [`FsState::changes`] when the LIST was sent: a change through this mount since then
    /// discards the page.
    changes: u64,
    /// Listed by the listing itself (not a lookup's): as fresh as a listing started now, so it
    /// serves even where the TTL is 0, and names learned missing before it do not stay so.
    own: bool,
}

/// The rest of a directory's listing, going on in the background from a lookup's first page
/// whose entries a `readdir` served meanwhile (see [`Fs::list_dir_start`]).
#[derive(Debug)]
struct RestListing {
    /// The directory's prefix.
    prefix: String,
    /// When the first page's LIST was sent: the listing is as old as that.
    at: Instant,
    /// [`FsState::changes`] when the first page's LIST was sent: a change through this mount
    /// since then makes the next listing start anew.
    changes: u64,
    /// The first page was the listing's own ([`FirstPage::own`]).
    own: bool,
    task: Owned<ferry_store::Result<ferry_store::Listed>>,
}

/// Most first pages kept (each up to 1,000 entries).
const FIRST_PAGES_MAX: usize = 32;

/// Most directories whose kernel cache is remembered ([`FsState::kernel_dirs`]).
const KERNEL_DIRS_MAX: usize = 65_536;

/// A first page older than this is not gone on from (a server may refuse an old continuation
/// token, even where the metadata TTL would still believe the page).
const FIRST_PAGE_MAX_AGE: Duration = Duration::from_secs(60);

impl FsState {
    /// Tables as given; every per-process cache (small objects, order, probes) empty.
    fn new(inodes: InodeTable, handles: HandleTable, io: HashMap<Ino, IoModes>) -> Self {
        FsState {
            inodes,
            handles,
            hidden_logged: HashSet::new(),
            small: SmallObjects::default(),
            order: HashMap::new(),
            io,
            probes: HashMap::new(),
            probed: HashSet::new(),
            changes: 0,
            first_pages: HashMap::new(),
            kernel_dirs: HashMap::new(),
            dir_invals: HashMap::new(),
            tags: kdir::Tags::new(),
            rest_listings: HashMap::new(),
            sweeps: HashMap::new(),
            sweep_slots: Arc::new(tokio::sync::Semaphore::new(sweep::SWEEPS_AT_ONCE)),
        }
    }
}

/// Blocks waiting for the node cache's writers hold at most this share of the memory budget
/// (1/8: 128 MiB of the default 1 GiB, so the cache's own 64 MiB cap is what binds there): on
/// a small budget, writers that fall behind leave the rest to the readers' prefetch.
pub const CACHE_QUEUE_SHARE: u64 = 8;

/// Most pages a lookup's background listing of a directory reads (see [`Fs::probe_dir`]).
const PROBE_PAGES: usize = 10;

/// Most directories remembered as probed.
const PROBED_MAX: usize = 4096;

/// Open file handles of one inode by kernel I/O mode.
#[derive(Debug, Default, Clone)]
struct IoModes {
    /// Read handles in cached mode, and write handles (always cached mode, until their last
    /// close, also once their upload completed).
    cached: u32,
    passthrough: u32,
    /// Read handles, in either mode: a replacement of the file through this mount waits for them
    /// to close (the kernel keeps one size and one page cache for the inode, so a reader beside
    /// the writer would read the new version's bytes, or stop at its size, as the old one's).
    readers: u32,
    /// The version (ETag) the passthrough handles pinned: their backing file is its whole file,
    /// which the kernel makes every passthrough open of the inode share.
    passthrough_etag: Option<String>,
}

impl FsState {
    /// Whether handle `fh`'s inode may switch it to passthrough: another handle already reads
    /// through passthrough, or it is the only cached-mode handle.
    fn passthrough_allowed(&self, ino: Ino) -> bool {
        self.io
            .get(&ino)
            .is_some_and(|m| m.passthrough > 0 || m.cached == 1)
    }

    /// Whether handles of `ino` read through passthrough: the kernel admits no cached-mode open
    /// (a writer, a reader through Ferry) beside them.
    fn open_through_passthrough(&self, ino: Ino) -> bool {
        self.io.get(&ino).is_some_and(|m| m.passthrough > 0)
    }

    /// Whether an open of `ino` pinning version `etag` must be refused: the inode's passthrough
    /// handles read another version's whole file, and the kernel would serve this open from it
    /// too (it admits no cached-mode open beside them).
    fn passthrough_of_another_version(&self, ino: Ino, etag: Option<&str>) -> bool {
        self.open_through_passthrough(ino)
            && self
                .io
                .get(&ino)
                .and_then(|m| m.passthrough_etag.as_deref())
                != etag
    }

    fn io_closed(&mut self, ino: Ino, passthrough: bool, reader: bool) {
        if let Some(m) = self.io.get_mut(&ino) {
            if reader {
                m.readers = m.readers.saturating_sub(1);
            }
            if passthrough {
                m.passthrough = m.passthrough.saturating_sub(1);
                if m.passthrough == 0 {
                    m.passthrough_etag = None;
                }
            } else {
                m.cached = m.cached.saturating_sub(1);
            }
            if m.cached == 0 && m.passthrough == 0 {
                self.io.remove(&ino);
            }
        }
    }
}

/// How far behind a sequential reader its fetched parts are kept, for the kernel's reordered
/// read-ahead requests.
const REORDER_KEEP: u64 = 2 << 20;

/// How far ahead of the furthest entry opened so far an open still counts as following the
/// listing (concurrent readers taking entries in turn open them slightly out of order).
const ORDER_SLACK: usize = 16;

/// Most directories whose listing-order streak is remembered.
const ORDER_MAX: usize = 1024;

/// What `find_child` learned about a name.
enum Found {
    /// A live inode whose information is current (or local).
    Live(Ino),
    /// Known from a listing or a HEAD/LIST, not (necessarily) in the table yet.
    Fresh {
        kind: Kind,
        meta: Option<ObjectMeta>,
        valid: Validity,
        /// A directory's first listing page, when the lookup listed it.
        first_page: Option<Box<FirstPage>>,
    },
}

/// The filesystem of one mount.
#[derive(Debug)]
pub struct Fs {
    store: Arc<dyn ObjectStore>,
    cfg: MountConfig,
    mount_time: SystemTime,
    state: Mutex<FsState>,
    /// The node-wide budget every prefetched byte is charged to.
    budget: MemoryBudget,
    prefetch: PrefetchConfig,
    /// The node's block cache (`None` without one, or when this mount opted out).
    cache: Option<Arc<BlockCache>>,
    /// Object versions this mount's credentials showed access to (a HEAD or GET returned that
    /// ETag), and when: the node cache serves a version only to mounts that proved access to
    /// it. Shared with the mounts of the same store (the same credentials); not carried over a
    /// handover (proofs start afresh).
    proofs: Arc<Proofs>,
    /// Tells the kernel to drop what it cached of an inode (`FUSE_NOTIFY_INVAL_INODE`), once the
    /// mount's session is live: a directory's entries (a mount with a TTL caches directories in
    /// the kernel only with it, [`kdir`]), a file's attributes and pages when an open found a new
    /// version.
    kernel_inval: std::sync::OnceLock<KernelInvalidator>,
}

/// Drops what the kernel cached of inode `ino`: its attributes and its page cache (a directory's
/// entries). Blocking: the kernel may wait for reads of the inode in flight.
#[derive(Clone)]
pub struct KernelInvalidator(Arc<dyn Fn(Ino) + Send + Sync>);

impl KernelInvalidator {
    pub fn new(f: impl Fn(Ino) + Send + Sync + 'static) -> Self {
        KernelInvalidator(Arc::new(f))
    }

    fn invalidate(&self, ino: Ino) {
        (self.0)(ino)
    }
}

impl std::fmt::Debug for KernelInvalidator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelInvalidator")
    }
}

fn stale(ino: Ino) -> FsError {
    FsError::Stale(format!("unknown inode {ino}"))
}

fn bad_fh() -> FsError {
    FsError::BadHandle("unknown file handle")
}

impl Fs {
    /// A fresh filesystem for `cfg` (which should have passed [`MountConfig::validate`]) with
    /// its own default budget and prefetch tuning (tests; mounts use [`Fs::with_budget`]).
    pub fn new(store: Arc<dyn ObjectStore>, cfg: MountConfig) -> Self {
        Self::with_budget(
            store,
            cfg,
            MemoryBudget::default(),
            PrefetchConfig::default(),
        )
    }

    /// A fresh filesystem whose prefetching is charged to `budget` (shared by the node's mounts).
    pub fn with_budget(
        store: Arc<dyn ObjectStore>,
        cfg: MountConfig,
        budget: MemoryBudget,
        prefetch: PrefetchConfig,
    ) -> Self {
        Fs::assemble(
            store,
            cfg,
            now_secs(),
            FsState::new(InodeTable::new(), HandleTable::default(), HashMap::new()),
            budget,
            prefetch,
        )
    }

    /// Rebuilds a filesystem from [`Fs::snapshot`] (caches start expired, nothing prefetched).
    pub fn from_snapshot(
        store: Arc<dyn ObjectStore>,
        mut snap: FsSnapshot,
        budget: MemoryBudget,
        prefetch: PrefetchConfig,
    ) -> Self {
        let mut io: HashMap<Ino, IoModes> = HashMap::new();
        // Every directory handle taken over may still fill its directory's cache in the kernel
        // (the predecessor's listing, or the one this process gives it).
        let mut kernel_dirs: HashMap<Ino, kdir::KernelDir> = HashMap::new();
        let mut last_tag = 0;
        for (_, h) in &mut snap.handles {
            match h {
                Handle::Read(r) => {
                    let m = io.entry(r.ino).or_default();
                    m.readers += 1;
                    match r.passthrough {
                        true => {
                            m.passthrough += 1;
                            m.passthrough_etag = r.etag.clone();
                        }
                        false => m.cached += 1,
                    }
                }
                // Open in the kernel's cached mode, like a cached-mode read handle.
                Handle::Write(w) => io.entry(w.ino).or_default().cached += 1,
                Handle::Dir(d) => {
                    d.counted = true;
                    kernel_dirs.entry(d.ino).or_default().active += 1;
                    last_tag = last_tag.max(d.tag);
                }
            }
        }
        let mut state = FsState::new(
            {
                let mut inodes = snap.inodes;
                inodes.report_size();
                inodes
            },
            HandleTable::restore(snap.next_fh, snap.handles).with_requests(&snap.requests),
            io,
        );
        state.kernel_dirs = kernel_dirs;
        if last_tag != 0 {
            state.tags = kdir::Tags::after(last_tag);
        }
        Fs::assemble(store, snap.config, snap.mount_time, state, budget, prefetch)
    }

    /// The filesystem around `state`: no node cache, no access proofs yet.
    fn assemble(
        store: Arc<dyn ObjectStore>,
        cfg: MountConfig,
        mount_time: SystemTime,
        state: FsState,
        budget: MemoryBudget,
        prefetch: PrefetchConfig,
    ) -> Self {
        Fs {
            store,
            cfg,
            mount_time,
            state: Mutex::new(state),
            budget,
            prefetch,
            cache: None,
            proofs: Arc::new(Proofs::default()),
            kernel_inval: std::sync::OnceLock::new(),
        }
    }

    /// Reads through the node's block cache `cache` (ignored when the mount opted out with
    /// [`MountConfig::node_cache`] `false`). From the first mount on, the cache's writes are
    /// charged to this mount's memory budget (the node plugin's, which all its mounts share),
    /// and blocks waiting for them hold at most [`CACHE_QUEUE_SHARE`] of it.
    pub fn with_cache(mut self, cache: Option<Arc<BlockCache>>) -> Self {
        self.cache = cache.filter(|_| self.cfg.node_cache);
        if let Some(cache) = &self.cache {
            let budget = self.budget.clone();
            let queue_max = budget.limit() / CACHE_QUEUE_SHARE;
            cache.charge_writes(
                Box::new(move |bytes| {
                    budget
                        .try_reserve_for(Use::CacheWrite, bytes)
                        .map(|r| Box::new(r) as ferry_cache::WriteCharge)
                }),
                queue_max,
            );
        }
        self
    }

    /// Whether reads may use the node cache.
    pub fn uses_cache(&self) -> bool {
        self.cache.is_some()
    }

    /// The HEAD of an object (a lookup, `getattr`, an open). With the node cache, one that also
    /// proves access to its bytes when they can be read (`head_readable`: on S3, one GET of the
    /// first byte instead of the HEAD), so that the mount's reads may be served bytes other mounts
    /// left in the cache, and join their GETs, from the first. Bytes refused (403) with the HEAD
    /// answered: the object's metadata, and no proof (its reads are refused as without the cache).
    async fn head_object(&self, key: &str) -> Result<ObjectInfo, StoreError> {
        if self.cache.is_none() {
            return self.store.head(self.bucket(), key).await;
        }
        let probed = self.store.head_readable(self.bucket(), key).await?;
        if probed.readable {
            self.prove(key, probed.info.etag.as_deref());
        }
        Ok(probed.info)
    }

    /// Remembers that this mount's credentials just read `etag` of `key` (for the metadata TTL).
    fn prove(&self, key: &str, etag: Option<&str>) {
        if let (Some(_), Some(etag)) = (&self.cache, etag) {
            self.proofs.prove(&self.cfg.bucket, key, etag);
        }
    }

    fn is_proven(&self, key: &str, etag: &str) -> bool {
        self.proofs
            .is_proven(&self.cfg.bucket, key, etag, self.cfg.metadata_ttl)
    }

    /// Shares proofs of access with the other mounts of the same store (see [`Proofs`]).
    pub fn with_proofs(mut self, proofs: Arc<Proofs>) -> Self {
        self.proofs = proofs;
        self
    }

    /// The budget prefetching is charged to.
    pub fn budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// Small objects currently prefetched (or being fetched) and not yet opened.
    pub fn small_objects_cached(&self) -> usize {
        self.lock().small.len()
    }

    /// The inode and handle tables as plain data. Waits for in-flight operations on each handle.
    pub async fn snapshot(&self) -> FsSnapshot {
        let (inodes, next_fh, entries, requests) = {
            let st = self.lock();
            (
                st.inodes.clone(),
                st.handles.next_fh(),
                st.handles.entries(),
                st.handles.requests(),
            )
        };
        let mut handles = Vec::with_capacity(entries.len());
        for (fh, h) in entries {
            handles.push((fh, h.lock().await.clone()));
        }
        FsSnapshot {
            config: self.cfg.clone(),
            mount_time: self.mount_time,
            inodes,
            next_fh,
            handles,
            requests,
        }
    }

    pub fn config(&self) -> &MountConfig {
        &self.cfg
    }

    /// (inodes in the table, open handles): for leak checks.
    pub fn table_sizes(&self) -> (usize, usize) {
        let st = self.lock();
        (st.inodes.len(), st.handles.len())
    }

    fn lock(&self) -> MutexGuard<'_, FsState> {
        // Every critical section leaves the tables consistent, so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bucket(&self) -> &str {
        &self.cfg.bucket
    }

    fn ttl(&self) -> Validity {
        Validity::new(self.cfg.metadata_ttl, Instant::now())
    }

    fn attr_from(&self, ino: Ino, kind: Kind, meta: Option<&ObjectMeta>) -> Attr {
        match kind {
            Kind::Dir => Attr {
                ino,
                kind,
                size: 0,
                blocks: 0,
                mtime: self.mount_time,
                perm: self.cfg.dir_mode,
                nlink: 2,
                uid: self.cfg.uid,
                gid: self.cfg.gid,
                blksize: BLKSIZE,
            },
            Kind::File => {
                let size = meta.map_or(0, |m| m.size);
                Attr {
                    ino,
                    kind,
                    size,
                    blocks: size.div_ceil(512),
                    mtime: meta.and_then(|m| m.mtime).unwrap_or(self.mount_time),
                    perm: self.cfg.file_mode,
                    nlink: 1,
                    uid: self.cfg.uid,
                    gid: self.cfg.gid,
                    blksize: BLKSIZE,
                }
            }
        }
    }

    fn entry_of(&self, inode: &Inode) -> Entry {
        let ttl = if matches!(inode.state, InodeState::Writing { .. }) {
            Duration::ZERO
        } else {
            self.cfg.metadata_ttl.kernel_ttl()
        };
        Entry {
            attr: self.attr_from(inode.ino, inode.kind, inode.meta.as_ref()),
            ttl,
        }
    }

    fn handle(&self, fh: u64) -> Result<Arc<tokio::sync::Mutex<Handle>>, FsError> {
        self.lock().handles.get(fh).ok_or_else(bad_fh)
    }

    fn log_hidden(st: &mut FsState, hidden: Vec<(String, &'static str)>) {
        for (key, why) in hidden {
            if st.hidden_logged.len() < HIDDEN_LOG_MAX && st.hidden_logged.insert(key.clone()) {
                tracing::debug!(key = %key, reason = why, "key hidden: not a POSIX name");
            }
        }
    }

    /// The session ended (unmounted, or its connection aborted) with handles the kernel never
    /// released: their `release` was cut off by the unmount, or a process in another mount
    /// namespace still held them. A new file with nothing written (`touch` just before the
    /// unmount) is completed, as its `release` would have; one with data that no close completed
    /// is abandoned (its multipart upload aborted), never a truncated object; a replacement with
    /// nothing written leaves the old object as it is. Read handles stop prefetching.
    pub async fn teardown(&self) {
        let handles = self.lock().handles.entries();
        for (fh, h) in handles {
            self.lock().handles.remove(fh);
            let mut g = h.lock().await;
            match &mut *g {
                Handle::Write(w) if w.status == WriteStatus::Open => {
                    if w.written == 0 && !w.replaces {
                        if let Err(e) = self.complete(w).await {
                            tracing::warn!(key = %w.key, error = %e, "completing an empty file at unmount failed");
                        }
                    } else {
                        tracing::warn!(key = %w.key, bytes = w.written, "a file still being written at unmount is abandoned (never a truncated object)");
                        self.fail_write(w).await;
                    }
                }
                Handle::Read(r) => r.prefetch.reset(),
                Handle::Write(_) | Handle::Dir(_) => {}
            }
        }
    }

    /// The kernel re-sent its request `request` (`FUSE_NOTIFY_RESEND`, to a successor after a
    /// crash): that request was never answered, so a handle the process before opened for it
    /// (journaled before the reply) never reached the kernel, which will neither use nor release
    /// it. Forgets that handle as a `release` would, except that a write handle's upload is not
    /// completed (nobody wrote to it), and returns its number (the adapter lets go of its backing
    /// file). The request is then served afresh.
    pub async fn forget_unanswered(&self, request: u64) -> Option<u64> {
        let (fh, h) = {
            let mut st = self.lock();
            let fh = st.handles.unanswered(request)?;
            (fh, st.handles.remove(fh)?)
        };
        let mut g = h.lock().await;
        let (ino, passthrough, reader) = match &mut *g {
            Handle::Write(w) => {
                if w.status == WriteStatus::Open {
                    self.fail_write(w).await;
                }
                (w.ino, false, false)
            }
            Handle::Read(r) => {
                r.prefetch.reset();
                (r.ino, r.passthrough, true)
            }
            Handle::Dir(_) => return Some(fh),
        };
        self.lock().io_closed(ino, passthrough, reader);
        tracing::info!(
            fh,
            ino,
            "dropped a handle whose open the kernel re-sent (never answered)"
        );
        Some(fh)
    }

    /// `release` (last close): completes an upload still open and forgets the handle.
    pub async fn release(&self, fh: u64) -> Result<(), FsError> {
        self.release_by(fh, || false).await
    }

    /// [`Fs::release`]; `killed` (asked only of a write handle whose upload is open with data):
    /// the last close is a process's on its way out of a fatal signal, and the upload is
    /// abandoned, not completed (see [`Fs::flush_by`]).
    pub async fn release_by(&self, fh: u64, killed: impl FnOnce() -> bool) -> Result<(), FsError> {
        let h = self.lock().handles.remove(fh).ok_or_else(bad_fh)?;
        let mut g = h.lock().await;
        match &mut *g {
            Handle::Write(w) => {
                // Counted as a cached-mode open until its last close, also once completed.
                self.lock().io_closed(w.ino, false, false);
                if w.written > 0 && w.status == WriteStatus::Open && killed() {
                    tracing::warn!(key = %w.key, bytes = w.written, "the last process holding a file being written was killed: its upload is abandoned (never a truncated object)");
                    self.fail_write(w).await;
                    return Err(FsError::UploadFailed);
                }
                self.complete(w).await
            }
            Handle::Read(r) => {
                // Aborts GETs in flight and gives their memory back.
                r.prefetch.reset();
                self.lock().io_closed(r.ino, r.passthrough, true);
                Ok(())
            }
            Handle::Dir(_) => Ok(()),
        }
    }
}

// ----- the journal (surviving a crash of the node plugin) -------------------------------------

impl Fs {
    /// Journals this mount from now on ([`crate::journal`]): writes the start of the journal and
    /// the current live set to it, then attaches it to both tables. A write error does not fail
    /// the mount; the journal is then [broken](Journal::is_broken) and refused by a later replay.
    pub fn with_journal(self, journal: Arc<Journal>) -> Self {
        {
            let mut st = self.lock();
            let st = &mut *st;
            journal.begin(&self.cfg, self.mount_time, &st.inodes, &st.handles);
            st.inodes.attach_journal(journal.clone());
            st.handles.attach_journal(journal.clone());
        }
        self
    }

    /// The attached journal.
    pub fn journal(&self) -> Option<Arc<Journal>> {
        self.lock().inodes.journal().cloned()
    }

    /// Rewrites the attached journal into `new_file` (just the live set) and appends there from
    /// now on (see [`Journal::compact_into`]). The caller decides when, from
    /// [`Journal::records_since_compaction`] and [`Fs::table_sizes`].
    pub fn compact_journal(&self, new_file: std::fs::File) -> std::io::Result<()> {
        let st = self.lock();
        let journal = st
            .inodes
            .journal()
            .ok_or_else(|| std::io::Error::other("no journal attached"))?;
        journal.compact_into(new_file, &st.inodes, &st.handles)
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;

#[cfg(test)]
#[path = "cache_tests.rs"]
mod cache_tests;
