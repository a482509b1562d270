//! The filesystem core: every operation Ferry supports, on inode and handle numbers, with no fuser
//! type in sight. [`crate::fuse`] only translates requests to these calls and results to replies.
//!
//! Locking: one `std` mutex over the plain-data state (inode table, handle table), never held
//! across an `.await`; each open handle has its own async mutex, held across its S3 calls so one
//! handle's reads (or writes) are ordered while different handles proceed in parallel.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use ferry_store::{list_all, CompletedPart, ListAll, ListRequest, ObjectStore, StoreError};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use ferry_cache::{BlockCache, ObjectKey};

use crate::proofs::Proofs;

use crate::budget::{MemoryBudget, PrefetchConfig};
use crate::config::MountConfig;
use crate::error::FsError;
use crate::handles::{
    DirHandle, Handle, HandleTable, MultipartState, PartRecord, ReadHandle, WriteHandle,
    WriteStatus, MAX_PARTS, PART_SIZE,
};
use crate::inode::{now_secs, CachedEntry, Ino, Inode, InodeState, InodeTable, Validity, ROOT_INO};
use crate::journal::Journal;
use crate::names::{
    child_path, dir_prefix, file_key, lookup_name, new_name, Kind, ListedEntry, Listing,
    ListingBuilder, ObjectMeta, KEY_MAX,
};
use crate::prefetch::{fetch, CacheUse, Part, SmallObjects, Source};

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
    /// One-page listings started by the first lookup miss in a directory without a cached
    /// listing, with [`FsState::changes`] at their start (see [`Fs::probe_dir`]).
    probes: HashMap<Ino, (u64, tokio::task::JoinHandle<Option<Listing>>)>,
    /// Directories probed already (bounded: cleared past [`PROBED_MAX`]).
    probed: HashSet<Ino>,
    /// Bumped by every change this mount makes to the namespace: a probe that started before
    /// one is not adopted (its listing may predate the change).
    changes: u64,
}

/// Most directories remembered as probed.
const PROBED_MAX: usize = 4096;

/// Open read handles of one inode by kernel I/O mode.
#[derive(Debug, Default, Clone, Copy)]
struct IoModes {
    cached: u32,
    passthrough: u32,
}

impl FsState {
    /// Whether handle `fh`'s inode may switch it to passthrough: another handle already reads
    /// through passthrough, or it is the only cached-mode handle.
    fn passthrough_allowed(&self, ino: Ino) -> bool {
        self.io
            .get(&ino)
            .is_some_and(|m| m.passthrough > 0 || m.cached == 1)
    }

    fn io_closed(&mut self, ino: Ino, passthrough: bool) {
        if let Some(m) = self.io.get_mut(&ino) {
            if passthrough {
                m.passthrough = m.passthrough.saturating_sub(1);
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
        Fs {
            store,
            cfg,
            mount_time: now_secs(),
            state: Mutex::new(FsState {
                inodes: InodeTable::new(),
                handles: HandleTable::default(),
                hidden_logged: HashSet::new(),
                small: SmallObjects::default(),
                order: HashMap::new(),
                io: HashMap::new(),
                probes: HashMap::new(),
                probed: HashSet::new(),
                changes: 0,
            }),
            budget,
            prefetch,
            cache: None,
            proofs: Arc::new(Proofs::default()),
        }
    }

    /// Rebuilds a filesystem from [`Fs::snapshot`] (caches start expired, nothing prefetched).
    pub fn from_snapshot(
        store: Arc<dyn ObjectStore>,
        snap: FsSnapshot,
        budget: MemoryBudget,
        prefetch: PrefetchConfig,
    ) -> Self {
        let mut io: HashMap<Ino, IoModes> = HashMap::new();
        for (_, h) in &snap.handles {
            if let Handle::Read(r) = h {
                let m = io.entry(r.ino).or_default();
                match r.passthrough {
                    true => m.passthrough += 1,
                    false => m.cached += 1,
                }
            }
        }
        Fs {
            store,
            cfg: snap.config,
            mount_time: snap.mount_time,
            state: Mutex::new(FsState {
                inodes: snap.inodes,
                handles: HandleTable::restore(snap.next_fh, snap.handles),
                hidden_logged: HashSet::new(),
                small: SmallObjects::default(),
                order: HashMap::new(),
                io,
                probes: HashMap::new(),
                probed: HashSet::new(),
                changes: 0,
            }),
            budget,
            prefetch,
            cache: None,
            proofs: Arc::new(Proofs::default()),
        }
    }

    /// Reads through the node's block cache `cache` (ignored when the mount opted out with
    /// [`MountConfig::node_cache`] `false`).
    pub fn with_cache(mut self, cache: Option<Arc<BlockCache>>) -> Self {
        self.cache = cache.filter(|_| self.cfg.node_cache);
        self
    }

    /// Whether reads may use the node cache.
    pub fn uses_cache(&self) -> bool {
        self.cache.is_some()
    }

    /// Remembers that this mount's credentials just saw `etag` for `key` (for the metadata TTL).
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
        let (inodes, next_fh, entries) = {
            let st = self.lock();
            (
                st.inodes.clone(),
                st.handles.next_fh(),
                st.handles.entries(),
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

    // ----- lookup / getattr -------------------------------------------------------------------

    /// HEAD `path` and LIST `path/` (one key) concurrently. A directory wins over a file; when the
    /// LIST proves a directory, a failed HEAD does not matter.
    async fn remote_lookup(
        &self,
        path: &str,
    ) -> Result<Option<(Kind, Option<ObjectMeta>)>, FsError> {
        let key = file_key(&self.cfg.prefix, path);
        if key.len() > KEY_MAX {
            return Ok(None);
        }
        let dir = format!("{key}/");
        let list_req = ListRequest {
            prefix: &dir,
            delimiter: Some("/"),
            max_keys: Some(1),
            ..Default::default()
        };
        let (head, list) = futures::join!(
            self.store.head(self.bucket(), &key),
            self.store.list(self.bucket(), list_req)
        );
        let page = list?;
        if !page.objects.is_empty() || !page.common_prefixes.is_empty() {
            return Ok(Some((Kind::Dir, None)));
        }
        match head {
            Ok(info) => {
                self.prove(&key, info.etag.as_deref());
                Ok(Some((Kind::File, Some(ObjectMeta::from(&info)))))
            }
            Err(StoreError::NotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Resolves `name` in `parent`: local state, then the caches, then S3 (recording a miss).
    async fn find_child(&self, parent: Ino, name: &str) -> Result<Found, FsError> {
        self.adopt_probe(parent);
        let path = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let now = Instant::now();
            let p = st.inodes.get(parent).ok_or_else(|| stale(parent))?;
            if p.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            let child = st.inodes.child(parent, name);
            if let Some(c) = child.filter(|c| c.is_local()) {
                return Ok(Found::Live(c.ino));
            }
            if p.cache.is_negative(name, now) {
                return Err(FsError::NotFound);
            }
            if let Some(c) = child.filter(|c| c.valid.is_valid(now)) {
                return Ok(Found::Live(c.ino));
            }
            if let Some(e) = p.cache.cached(name, now) {
                return Ok(Found::Fresh {
                    kind: e.kind,
                    meta: e.meta.clone(),
                    valid: p.cache.entries_valid,
                });
            }
            let path = child_path(&p.path, name);
            // With a zero TTL no listing is ever cached: nothing to probe for.
            let caches = self.ttl().is_valid(now);
            if caches && p.cache.cached_listing(now).is_none() && !p.is_local() {
                let dprefix = dir_prefix(&self.cfg.prefix, &p.path);
                self.probe_dir(st, parent, dprefix);
            }
            path
        };
        match self.remote_lookup(&path).await? {
            Some((kind, meta)) => Ok(Found::Fresh {
                kind,
                meta,
                valid: self.ttl(),
            }),
            None => {
                let valid = self.ttl();
                let mut st = self.lock();
                if let Some(p) = st.inodes.get_mut(parent) {
                    p.cache.add_negative(name, valid, Instant::now());
                }
                Err(FsError::NotFound)
            }
        }
    }

    /// Starts listing the first page (up to 1,000 entries) of directory `dir` in the background,
    /// once per directory: when that page is the whole directory, a later lookup adopts it as
    /// the directory's cached listing ([`Fs::adopt_probe`]), so opening its files by path (no
    /// `readdir` first) costs no HEAD + LIST per name after the first. A bigger directory costs
    /// this one extra LIST.
    fn probe_dir(&self, st: &mut FsState, dir: Ino, dprefix: String) {
        if st.probes.contains_key(&dir) || st.probed.contains(&dir) {
            return;
        }
        if st.probed.len() >= PROBED_MAX {
            st.probed.clear();
        }
        st.probed.insert(dir);
        let (store, bucket) = (self.store.clone(), self.cfg.bucket.clone());
        let task = tokio::spawn(async move {
            let req = ListRequest {
                prefix: &dprefix,
                delimiter: Some("/"),
                ..Default::default()
            };
            let page = store.list(&bucket, req).await.ok()?;
            if page.next_token.is_some() {
                return None;
            }
            let mut builder = ListingBuilder::new(&dprefix);
            builder.add_page(&page.objects, &page.common_prefixes);
            Some(builder.finish())
        });
        st.probes.insert(dir, (st.changes, task));
    }

    /// Installs `dir`'s probe listing if it finished, was complete and no change was made
    /// through this mount since it started.
    fn adopt_probe(&self, dir: Ino) {
        let listing = {
            let mut st = self.lock();
            match st.probes.get(&dir) {
                Some((_, task)) if task.is_finished() => {}
                _ => return,
            }
            let (at, task) = st.probes.remove(&dir).expect("checked");
            let listing = futures::FutureExt::now_or_never(task)
                .and_then(Result::ok)
                .flatten();
            match listing {
                Some(l) if at == st.changes => l,
                _ => return,
            }
        };
        if self
            .install_listing(dir, listing, Instant::now(), true)
            .is_ok()
        {
            tracing::debug!(dir, "directory listing adopted from a lookup's probe");
        }
    }

    /// Puts what `find_child` found into the table; returns the inode number.
    fn install(st: &mut FsState, parent: Ino, name: &str, found: Found) -> Result<Ino, FsError> {
        match found {
            Found::Live(ino) => st.inodes.get(ino).map(|i| i.ino).ok_or_else(|| stale(ino)),
            Found::Fresh { kind, meta, valid } => {
                let ino = st
                    .inodes
                    .install_child(parent, name, kind)
                    .ok_or_else(|| stale(parent))?;
                let inode = st.inodes.get_mut(ino).expect("just installed");
                if !inode.is_local() {
                    inode.meta = meta;
                    inode.valid = valid;
                }
                Ok(ino)
            }
        }
    }

    /// `lookup`: counts one kernel reference on success.
    pub async fn lookup(&self, parent: Ino, name: &OsStr) -> Result<Entry, FsError> {
        let name = lookup_name(name)?;
        let found = self.find_child(parent, name).await?;
        let mut st = self.lock();
        let ino = Self::install(&mut st, parent, name, found)?;
        let inode = st.inodes.get_mut(ino).expect("installed");
        inode.lookups += 1;
        Ok(self.entry_of(inode))
    }

    /// `forget`: the kernel dropped `n` references.
    pub fn forget(&self, ino: Ino, n: u64) {
        self.lock().inodes.forget(ino, n);
    }

    /// `getattr`: directories and local files from the table; files from the cache or a HEAD.
    pub async fn getattr(&self, ino: Ino) -> Result<Entry, FsError> {
        let key = {
            let st = self.lock();
            let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
            if inode.kind == Kind::Dir || inode.is_local() || inode.valid.is_valid(Instant::now()) {
                return Ok(self.entry_of(inode));
            }
            file_key(&self.cfg.prefix, &inode.path)
        };
        let head = self.store.head(self.bucket(), &key).await;
        let valid = self.ttl();
        let mut st = self.lock();
        if let Ok(info) = &head {
            self.prove(&key, info.etag.as_deref());
        }
        let inode = st.inodes.get_mut(ino).ok_or_else(|| stale(ino))?;
        match head {
            Ok(info) => {
                if !inode.is_local() {
                    inode.meta = Some(ObjectMeta::from(&info));
                    inode.valid = valid;
                }
                Ok(self.entry_of(inode))
            }
            Err(StoreError::NotFound(_)) if !inode.is_local() => {
                inode.valid = Validity::Expired;
                Err(FsError::NotFound)
            }
            Err(StoreError::NotFound(_)) => Ok(self.entry_of(inode)),
            Err(e) => Err(e.into()),
        }
    }

    /// `setattr`: truncation of a file being written (to 0 or its current size); chmod/chown to
    /// the current values; times accepted and ignored. Everything else is refused.
    pub async fn setattr(&self, ino: Ino, req: SetAttr) -> Result<Entry, FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let writer =
            {
                let st = self.lock();
                let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
                let perm = match inode.kind {
                    Kind::Dir => self.cfg.dir_mode,
                    Kind::File => self.cfg.file_mode,
                };
                if req.mode.is_some_and(|m| m & 0o7777 != u32::from(perm)) {
                    return Err(FsError::NotPermitted("chmod: modes are set per mount"));
                }
                if req.uid.is_some_and(|u| u != self.cfg.uid)
                    || req.gid.is_some_and(|g| g != self.cfg.gid)
                {
                    return Err(FsError::NotPermitted("chown: owners are set per mount"));
                }
                let known_size = inode.meta.as_ref().map(|m| m.size);
                match (inode.kind, inode.state) {
                    (Kind::Dir, _) if req.size.is_some() => return Err(FsError::IsDir),
                    (_, InodeState::Writing { fh }) => Some(fh),
                    // Truncating to the size it has changes nothing.
                    _ if req.size.is_some() && req.size == known_size => None,
                    _ if req.size.is_some() => return Err(FsError::NotPermitted(
                        "truncate: only a file being written through this mount can be truncated",
                    )),
                    _ => None,
                }
            };
        if let (Some(size), Some(fh)) = (req.size, writer) {
            let h = self.handle(fh)?;
            let mut g = h.lock().await;
            let Handle::Write(w) = &mut *g else {
                return Err(bad_fh());
            };
            match w.status {
                WriteStatus::Open => {}
                WriteStatus::Completed => {
                    return Err(FsError::BadHandle("the upload already completed"))
                }
                WriteStatus::Failed => return Err(FsError::UploadFailed),
            }
            if size != w.written {
                if size != 0 {
                    return Err(FsError::InvalidArgument(
                        "truncate: only to 0 or to the current size",
                    ));
                }
                if let Some(up) = w.upload.take() {
                    self.abort_upload(&w.key, &up).await;
                }
                w.pending.clear();
                w.written = 0;
                self.set_local_size(ino, 0);
            }
        }
        let st = self.lock();
        let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        Ok(self.entry_of(inode))
    }

    // ----- directories ------------------------------------------------------------------------

    /// `opendir`: a handle whose listing is taken at the first `readdir`.
    pub fn opendir(&self, ino: Ino) -> Result<u64, FsError> {
        let mut st = self.lock();
        let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        if inode.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        Ok(st.handles.insert(Handle::Dir(DirHandle {
            ino,
            snapshot: None,
            listed_at: None,
            served: false,
        })))
    }

    /// `releasedir`.
    /// Drops directory handle `fh` (only a directory handle: a stale number never takes a file's).
    pub fn releasedir(&self, fh: u64) {
        let mut st = self.lock();
        let is_dir = st
            .handles
            .get(fh)
            .is_some_and(|h| h.try_lock().is_ok_and(|g| matches!(&*g, Handle::Dir(_))));
        if is_dir {
            st.handles.remove(fh);
        }
    }

    /// The directory's entries, local ones merged in, and when S3's part was listed: from the
    /// cached listing while it is valid, else listed (every page), refreshing the caches.
    async fn list_dir(&self, ino: Ino) -> Result<(Vec<ListedEntry>, Instant), FsError> {
        let dprefix = {
            let st = self.lock();
            let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
            if inode.kind != Kind::Dir {
                return Err(FsError::NotDir);
            }
            if let Some((listing, at)) = inode.cache.cached_listing(Instant::now()) {
                let mut entries = Vec::clone(listing);
                for (name, child) in &inode.children {
                    let Some(c) = st.inodes.get(*child).filter(|c| c.is_local()) else {
                        continue;
                    };
                    let local = ListedEntry {
                        name: name.clone(),
                        kind: c.kind,
                        meta: c.meta.clone(),
                    };
                    match entries.binary_search_by(|e| e.name.as_str().cmp(name)) {
                        Ok(i) => entries[i] = local,
                        Err(i) => entries.insert(i, local),
                    }
                }
                return Ok((entries, *at));
            }
            dir_prefix(&self.cfg.prefix, &inode.path)
        };
        let mut builder = ListingBuilder::new(&dprefix);
        let listed = list_all(
            &*self.store,
            self.bucket(),
            ListAll::dir(&dprefix, LIST_CONCURRENCY),
        )
        .await?;
        builder.add_page(&listed.objects, &listed.common_prefixes);
        self.install_listing(ino, builder.finish(), Instant::now(), false)
    }

    /// Makes `listing` (taken at `now`) directory `ino`'s listing: live children learn its
    /// metadata, local ones are merged in, and within the TTL it is cached (entries and the
    /// snapshot). Returns the merged entries and `now`. With `keep_negatives` (a listing that
    /// may have started before this mount learned that a name was missing), names still in the
    /// negative cache stay missing and are left out of the listing.
    fn install_listing(
        &self,
        ino: Ino,
        listing: Listing,
        now: Instant,
        keep_negatives: bool,
    ) -> Result<(Vec<ListedEntry>, Instant), FsError> {
        let valid = self.ttl();
        let mut guard = self.lock();
        let st = &mut *guard;
        Self::log_hidden(st, listing.hidden);
        let mut remote = listing.entries;
        let dir = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        if keep_negatives {
            remote.retain(|e| !dir.cache.is_negative(&e.name, now));
        }
        let children: Vec<(String, Ino)> =
            dir.children.iter().map(|(n, i)| (n.clone(), *i)).collect();

        // Live children learn the listing's metadata; local ones replace or join the listing.
        let mut entries = remote.clone();
        for (name, child) in children {
            let Some(c) = st.inodes.get_mut(child) else {
                continue;
            };
            let pos = entries.binary_search_by(|e| e.name.as_str().cmp(&name));
            if c.is_local() {
                let local = ListedEntry {
                    name,
                    kind: c.kind,
                    meta: c.meta.clone(),
                };
                match pos {
                    Ok(i) => entries[i] = local,
                    Err(i) => entries.insert(i, local),
                }
            } else if let Ok(i) = pos {
                if entries[i].kind == c.kind {
                    if c.kind == Kind::File {
                        c.meta = entries[i].meta.clone();
                    }
                    c.valid = valid;
                }
            }
        }

        let dir = st.inodes.get_mut(ino).expect("checked above");
        if dir.state == InodeState::LocalDir && (listing.has_marker || !remote.is_empty()) {
            dir.state = InodeState::Remote;
            dir.valid = valid;
        }
        dir.cache.entries.clear();
        dir.cache.entries_valid = valid;
        dir.cache.listing = None;
        if valid.is_valid(now) {
            dir.cache.listing = Some((Arc::new(remote.clone()), now));
            for e in &remote {
                dir.cache.negative.remove(&e.name);
                dir.cache.entries.insert(
                    e.name.clone(),
                    CachedEntry {
                        kind: e.kind,
                        meta: e.meta.clone(),
                    },
                );
            }
        }
        Ok((entries, now))
    }

    /// `readdir` / `readdirplus` from offset `offset` (0 = start; a repeated 0 lists again).
    /// With `plus`, every entry the sink accepts (except `.` and `..`) counts one kernel reference.
    pub async fn readdir(
        &self,
        ino: Ino,
        fh: u64,
        offset: u64,
        plus: bool,
        sink: &mut (dyn DirSink + Send),
    ) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        let Handle::Dir(d) = &mut *g else {
            return Err(bad_fh());
        };
        if d.ino != ino {
            return Err(bad_fh());
        }
        if d.snapshot.is_none() || (offset == 0 && d.served) {
            let (entries, listed_at) = self.list_dir(ino).await?;
            d.snapshot = Some(entries);
            d.listed_at = Some(listed_at);
        }
        d.served = true;
        let entries = d.snapshot.as_deref().unwrap_or_default();
        let snapshot_valid = Validity::new(
            self.cfg.metadata_ttl,
            d.listed_at.unwrap_or_else(Instant::now),
        );

        let mut guard = self.lock();
        let st = &mut *guard;
        let now = Instant::now();
        let dir = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
        let dir_path = dir.path.clone();
        let dir_entry = self.entry_of(dir);
        let parent_ino = dir.parent;
        let parent_entry = st
            .inodes
            .get(parent_ino)
            .map_or_else(|| dir_entry.clone(), |p| self.entry_of(p));
        let mut idx = offset;
        loop {
            let (name, kind, entry) = match idx {
                0 => (".", Kind::Dir, dir_entry.clone()),
                1 => ("..", Kind::Dir, parent_entry.clone()),
                n => {
                    let Some(e) = usize::try_from(n - 2).ok().and_then(|i| entries.get(i)) else {
                        break;
                    };
                    let entry = match st.inodes.child(ino, &e.name).filter(|c| c.kind == e.kind) {
                        Some(c) if c.is_local() || c.valid.is_valid(now) => self.entry_of(c),
                        _ => {
                            let path = child_path(&dir_path, &e.name);
                            let child_ino = st.inodes.ino_for(ino, &e.name, &path, e.kind);
                            Entry {
                                attr: self.attr_from(child_ino, e.kind, e.meta.as_ref()),
                                ttl: self.cfg.metadata_ttl.kernel_ttl(),
                            }
                        }
                    };
                    (e.name.as_str(), e.kind, entry)
                }
            };
            let full = sink.add(&DirEntry {
                ino: entry.attr.ino,
                offset: idx + 1,
                name,
                kind,
                attr: &entry.attr,
                ttl: entry.ttl,
            });
            if full {
                break;
            }
            if plus && idx >= 2 {
                let child = st
                    .inodes
                    .install_child(ino, name, kind)
                    .ok_or_else(|| stale(ino))?;
                let c = st.inodes.get_mut(child).expect("installed");
                if !c.is_local() && !c.valid.is_valid(now) {
                    let e = &entries[(idx - 2) as usize];
                    c.meta = e.meta.clone();
                    c.valid = snapshot_valid;
                }
                c.lookups += 1;
            }
            idx += 1;
        }
        Ok(())
    }

    /// `mkdir`: a local directory, visible in this mount until a file written into it makes it
    /// real in S3 (no marker object is written).
    pub async fn mkdir(&self, parent: Ino, name: &OsStr) -> Result<Entry, FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let name = new_name(name)?;
        let mut st = self.lock();
        let path = self.check_new_child(&st, parent, name)?;
        if dir_prefix(&self.cfg.prefix, &path).len() > KEY_MAX {
            return Err(FsError::NameTooLong);
        }
        let ino = st
            .inodes
            .install_child(parent, name, Kind::Dir)
            .ok_or_else(|| stale(parent))?;
        st.inodes.set_state(ino, InodeState::LocalDir);
        let inode = st.inodes.get_mut(ino).expect("installed");
        inode.lookups += 1;
        let entry = self.entry_of(inode);
        if let Some(p) = st.inodes.get_mut(parent) {
            p.cache.negative.remove(name);
        }
        st.changes += 1;
        Ok(entry)
    }

    /// Refuses to create `name` if the parent is not a directory or the name is known to exist.
    /// Returns the new child's path.
    fn check_new_child(&self, st: &FsState, parent: Ino, name: &str) -> Result<String, FsError> {
        let now = Instant::now();
        let p = st.inodes.get(parent).ok_or_else(|| stale(parent))?;
        if p.kind != Kind::Dir {
            return Err(FsError::NotDir);
        }
        let negative = p.cache.is_negative(name, now);
        let live = st.inodes.child(parent, name);
        if live.is_some_and(|c| c.is_local() || (!negative && c.valid.is_valid(now)))
            || (!negative && p.cache.cached(name, now).is_some())
        {
            return Err(FsError::Exists);
        }
        Ok(child_path(&p.path, name))
    }

    /// `unlink` (needs `allow_delete`): deletes the key.
    pub async fn unlink(&self, parent: Ino, name: &OsStr) -> Result<(), FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        if !self.cfg.allow_delete {
            return Err(FsError::NotPermitted("deletes are disabled on this mount"));
        }
        let name = lookup_name(name)?;
        let found = self.find_child(parent, name).await?;
        let (key, live) = {
            let st = self.lock();
            let parent_path = &st.inodes.get(parent).ok_or_else(|| stale(parent))?.path;
            let key = file_key(&self.cfg.prefix, &child_path(parent_path, name));
            match &found {
                Found::Live(ino) => {
                    let c = st.inodes.get(*ino).ok_or_else(|| stale(*ino))?;
                    match (c.kind, c.state) {
                        (Kind::Dir, _) => return Err(FsError::IsDir),
                        (Kind::File, InodeState::Writing { .. }) => {
                            return Err(FsError::Busy("the file is being written"))
                        }
                        _ => (key, Some(*ino)),
                    }
                }
                Found::Fresh {
                    kind: Kind::Dir, ..
                } => return Err(FsError::IsDir),
                Found::Fresh { .. } => (key, st.inodes.child(parent, name).map(|c| c.ino)),
            }
        };
        self.store.delete(self.bucket(), &key).await?;
        let valid = self.ttl();
        {
            let mut st = self.lock();
            st.changes += 1;
            if let Some(c) = live.and_then(|ino| st.inodes.get_mut(ino)) {
                if c.kind == Kind::File && !c.is_local() {
                    c.meta = None;
                    c.valid = Validity::Expired;
                    c.last_open_etag = None;
                }
            }
            if let Some(p) = st.inodes.get_mut(parent) {
                p.cache.add_negative(name, valid, Instant::now());
            }
        }
        self.keep_dir_if_empty(parent).await;
        Ok(())
    }

    /// After removing an entry: if the directory has nothing left in S3 (it was implicit), keep it
    /// as a local directory, so it stays until `rmdir` as POSIX expects; and so on up the tree,
    /// since an ancestor whose only content was this directory is now implicit in nothing either
    /// (it must stay too, or the local directory would hang below a directory that does not
    /// exist). Best effort.
    async fn keep_dir_if_empty(&self, dir: Ino) {
        let mut dir = dir;
        loop {
            let (dprefix, parent) = {
                let st = self.lock();
                match st.inodes.get(dir) {
                    Some(d) if dir != ROOT_INO && d.state == InodeState::Remote => {
                        (dir_prefix(&self.cfg.prefix, &d.path), d.parent)
                    }
                    _ => return,
                }
            };
            let req = ListRequest {
                prefix: &dprefix,
                max_keys: Some(1),
                ..Default::default()
            };
            match self.store.list(self.bucket(), req).await {
                Ok(page) if page.objects.is_empty() && page.common_prefixes.is_empty() => {
                    let mut st = self.lock();
                    if st.inodes.get(dir).map(|d| d.state) == Some(InodeState::Remote) {
                        st.inodes.set_state(dir, InodeState::LocalDir);
                    }
                    drop(st);
                    dir = parent;
                }
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "checking whether a directory became empty");
                    return;
                }
            }
        }
    }

    /// `rmdir` (needs `allow_delete`): only if nothing (no key at all, hidden ones included) is
    /// below it; deletes its marker if it has one.
    pub async fn rmdir(&self, parent: Ino, name: &OsStr) -> Result<(), FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        if !self.cfg.allow_delete {
            return Err(FsError::NotPermitted("deletes are disabled on this mount"));
        }
        let name = lookup_name(name)?;
        let found = self.find_child(parent, name).await?;
        let (dprefix, live) = {
            let st = self.lock();
            let parent_path = &st.inodes.get(parent).ok_or_else(|| stale(parent))?.path;
            let dprefix = dir_prefix(&self.cfg.prefix, &child_path(parent_path, name));
            let live = match &found {
                Found::Live(ino) => Some(*ino),
                Found::Fresh { kind, .. } => {
                    if *kind != Kind::Dir {
                        return Err(FsError::NotDir);
                    }
                    st.inodes
                        .child(parent, name)
                        .filter(|c| c.kind == Kind::Dir)
                        .map(|c| c.ino)
                }
            };
            if let Some(ino) = live {
                let c = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
                if c.kind != Kind::Dir {
                    return Err(FsError::NotDir);
                }
                let local_child = c
                    .children
                    .values()
                    .any(|k| st.inodes.get(*k).is_some_and(Inode::is_local));
                if local_child {
                    return Err(FsError::NotEmpty);
                }
            }
            (dprefix, live)
        };
        let page = self
            .store
            .list(
                self.bucket(),
                ListRequest {
                    prefix: &dprefix,
                    max_keys: Some(2),
                    ..Default::default()
                },
            )
            .await?;
        if page.objects.iter().any(|o| o.key != dprefix) || !page.common_prefixes.is_empty() {
            return Err(FsError::NotEmpty);
        }
        if page.objects.iter().any(|o| o.key == dprefix) {
            self.store.delete(self.bucket(), &dprefix).await?;
        }
        let valid = self.ttl();
        {
            let mut st = self.lock();
            st.changes += 1;
            if let Some(ino) = live {
                st.inodes.set_state(ino, InodeState::Remote);
                if let Some(c) = st.inodes.get_mut(ino) {
                    c.valid = Validity::Expired;
                    c.cache = Default::default();
                }
                st.inodes.maybe_remove(ino);
            }
            if let Some(p) = st.inodes.get_mut(parent) {
                p.cache.add_negative(name, valid, Instant::now());
            }
        }
        self.keep_dir_if_empty(parent).await;
        Ok(())
    }

    /// `rename`: S3 has no rename. EXDEV makes `mv` fall back to copy + delete.
    pub fn rename(&self) -> Result<(), FsError> {
        if self.cfg.read_only {
            Err(FsError::ReadOnly)
        } else {
            Err(FsError::CrossDevice)
        }
    }

    /// `statfs`: large constant numbers (S3 has no capacity), so tools that check free space write.
    pub fn statfs(&self) -> StatFs {
        const BLOCKS: u64 = 1 << 40;
        StatFs {
            blocks: BLOCKS,
            bfree: BLOCKS,
            bavail: BLOCKS,
            files: 1 << 32,
            ffree: 1 << 32,
            bsize: BLKSIZE,
            namelen: crate::names::NAME_MAX as u32,
            frsize: BLKSIZE,
        }
    }

    // ----- files ------------------------------------------------------------------------------

    /// `open`. Reading pins the ETag (from the cache if fresh, else a HEAD). Writing needs
    /// `O_TRUNC` and `allow_overwrite`, and starts a new upload that replaces the object.
    /// `pid` is the opening process (only its `flush` completes an upload).
    pub async fn open(&self, ino: Ino, flags: i32, pid: u32) -> Result<Opened, FsError> {
        // O_RDONLY|O_TRUNC truncates too (the kernel already checked write permission).
        let write = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        let (key, cached) = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let inode = st.inodes.get(ino).ok_or_else(|| stale(ino))?;
            if inode.kind == Kind::Dir {
                return Err(FsError::IsDir);
            }
            if matches!(inode.state, InodeState::Writing { .. }) {
                return Err(FsError::Busy("the file is being written"));
            }
            if write && st.io.get(&ino).is_some_and(|m| m.passthrough > 0) {
                // The kernel would refuse a cached-mode open next to passthrough ones anyway.
                return Err(FsError::Busy(
                    "the file is open for reading straight from the node cache; close it first",
                ));
            }
            if write {
                if self.cfg.read_only {
                    return Err(FsError::ReadOnly);
                }
                if flags & libc::O_TRUNC == 0 {
                    return Err(FsError::NotPermitted(
                        "existing objects can only be replaced (O_TRUNC), not modified or appended",
                    ));
                }
                if !self.cfg.allow_overwrite {
                    return Err(FsError::NotPermitted(
                        "overwrites are disabled on this mount",
                    ));
                }
                let (parent, name, path) = (inode.parent, inode.name.clone(), inode.path.clone());
                let fh = st.handles.peek_next();
                let inode = st.inodes.get_mut(ino).expect("checked");
                inode.state = InodeState::Writing { fh };
                inode.meta = Some(ObjectMeta {
                    size: 0,
                    mtime: Some(now_secs()),
                    etag: None,
                });
                inode.last_open_etag = None;
                let got = st.handles.insert(Handle::Write(WriteHandle {
                    ino,
                    parent,
                    name,
                    key: file_key(&self.cfg.prefix, &path),
                    pid,
                    written: 0,
                    pending: Vec::new(),
                    upload: None,
                    status: WriteStatus::Open,
                    replaces: true,
                }));
                debug_assert_eq!(got, fh);
                return Ok(Opened {
                    fh,
                    keep_cache: false,
                });
            }
            let key = file_key(&self.cfg.prefix, &inode.path);
            let fresh = inode.valid.is_valid(Instant::now())
                && inode.meta.as_ref().is_some_and(|m| m.etag.is_some());
            // With the node cache, a version this mount has not proven access to (e.g. known only
            // from a LIST, which needs no read permission) is HEADed with its own credentials.
            let usable = |m: &ObjectMeta| match (&self.cache, m.etag.as_deref()) {
                (Some(_), Some(etag)) => self.is_proven(&key, etag),
                _ => true,
            };
            let cached = fresh
                .then(|| inode.meta.clone())
                .flatten()
                .filter(|m| usable(m));
            (key, cached)
        };
        if cached.is_none() {
            self.prepare_whole(ino, &key);
        }
        let meta = match cached {
            Some(meta) => meta,
            None => match self.store.head(self.bucket(), &key).await {
                Ok(info) => {
                    self.prove(&key, info.etag.as_deref());
                    ObjectMeta::from(&info)
                }
                Err(e) => {
                    if let (Some(cache), StoreError::AccessDenied(_)) = (&self.cache, &e) {
                        cache.note_denied();
                    }
                    return Err(e.into());
                }
            },
        };
        let valid = self.ttl();
        let mut st = self.lock();
        let inode = st.inodes.get_mut(ino).ok_or_else(|| stale(ino))?;
        if inode.meta.as_ref() != Some(&meta) {
            inode.meta = Some(meta.clone());
            inode.valid = valid;
        }
        let keep_cache = meta.etag.is_some() && inode.last_open_etag == meta.etag;
        inode.last_open_etag = meta.etag.clone();
        let (parent, name) = (inode.parent, inode.name.clone());
        let mut handle = ReadHandle::new(ino, key, meta.etag, meta.size);
        handle.last_modified = meta.mtime;
        handle.cached = self.cache.is_some() && handle.etag.is_some();
        if let Some(etag) = handle.etag.as_deref() {
            // Fetched ahead by a listing-order reader, for this very version: use it.
            if let Some(part) = st.small.take(&handle.key, etag) {
                if part.start == 0 && part.end == handle.size {
                    handle.prefetch.parts.push_back(part);
                }
            }
        }
        if let (true, Some(cache), Some(etag)) = (handle.cached, &self.cache, &handle.etag) {
            // Read to its end, the object becomes one file the kernel can read directly.
            cache.want_whole(
                ObjectKey {
                    endpoint: self.cfg.endpoint.clone(),
                    bucket: self.cfg.bucket.clone(),
                    key: handle.key.clone(),
                    etag: etag.clone(),
                },
                handle.size,
            );
        }
        self.prefetch_following(&mut st, parent, &name);
        st.io.entry(ino).or_default().cached += 1;
        let fh = st.handles.insert(Handle::Read(handle));
        Ok(Opened { fh, keep_cache })
    }

    /// While an open proves access with a HEAD: gets the node cache's whole file of the version
    /// the inode last saw ready in the background (nothing is served before the proof).
    fn prepare_whole(&self, ino: Ino, key: &str) {
        let Some(cache) = &self.cache else { return };
        let known = self.lock().inodes.get(ino).and_then(|i| i.meta.clone());
        let Some(ObjectMeta {
            size,
            etag: Some(etag),
            ..
        }) = known
        else {
            return;
        };
        let obj = ObjectKey {
            endpoint: self.cfg.endpoint.clone(),
            bucket: self.cfg.bucket.clone(),
            key: key.to_owned(),
            etag,
        };
        if size > 0 && cache.has_whole(&obj) {
            let cache = cache.clone();
            tokio::task::spawn_blocking(move || cache.prepare_whole(&obj, size));
        }
    }

    /// The node cache's whole file of read handle `fh`'s object version, for the kernel to read
    /// directly (FUSE passthrough), with the handle switched to passthrough: only for a handle
    /// that may use the cache (its mount proved access to this version at open), whose object
    /// is whole and checked in the cache, and whose inode has no other cached-mode handle open.
    /// Blocking (a first use checks the file). [`Fs::passthrough_failed`] undoes the switch.
    pub fn passthrough_file(&self, fh: u64) -> Option<std::fs::File> {
        let cache = self.cache.as_ref()?;
        let read_handle = |st: &FsState| -> Option<(Ino, ObjectKey, u64)> {
            let h = st.handles.get(fh)?;
            let g = h.try_lock().ok()?;
            let Handle::Read(r) = &*g else { return None };
            if !r.cached || r.passthrough || r.size == 0 || !st.passthrough_allowed(r.ino) {
                return None;
            }
            let obj = ObjectKey {
                endpoint: self.cfg.endpoint.clone(),
                bucket: self.cfg.bucket.clone(),
                key: r.key.clone(),
                etag: r.etag.clone()?,
            };
            Some((r.ino, obj, r.size))
        };
        let (ino, obj, size) = read_handle(&self.lock())?;
        if !cache.has_whole(&obj) {
            return None;
        }
        let file = cache.open_whole(&obj, size)?;
        let mut st = self.lock();
        // Another open of the inode may have come meanwhile.
        read_handle(&st)?;
        let h = st.handles.get(fh)?;
        let mut g = h.try_lock().ok()?;
        let Handle::Read(r) = &mut *g else {
            return None;
        };
        r.passthrough = true;
        drop(g);
        // A successor after a crash must know: it may not open the inode in cached mode.
        st.handles.set_passthrough(fh, Some(0));
        let m = st.io.entry(ino).or_default();
        m.cached -= 1;
        m.passthrough += 1;
        Some(file)
    }

    /// Read handle `fh` reads through the connection's backing file `id` (registered by the
    /// adapter): kept with the handle (snapshot and journal), since every later open of the inode
    /// must use the same id while it is open, in this process or a successor.
    pub fn set_backing_id(&self, fh: u64, id: u32) {
        let mut st = self.lock();
        let Some(h) = st.handles.get(fh) else { return };
        let Ok(mut g) = h.try_lock() else { return };
        let Handle::Read(r) = &mut *g else { return };
        r.backing_id = Some(id);
        drop(g);
        st.handles.set_passthrough(fh, Some(id));
    }

    /// Handle `fh` joins the passthrough handles of its inode (whose backing file, `id`, another
    /// open registered): the kernel admits no other kind of open beside them. `false` if it is
    /// not a read handle in cached mode.
    pub fn join_passthrough(&self, fh: u64, id: u32) -> bool {
        let mut st = self.lock();
        let Some(h) = st.handles.get(fh) else {
            return false;
        };
        let Ok(mut g) = h.try_lock() else {
            return false;
        };
        let Handle::Read(r) = &mut *g else {
            return false;
        };
        if r.passthrough {
            return false;
        }
        r.passthrough = true;
        r.backing_id = Some(id);
        let ino = r.ino;
        drop(g);
        st.handles.set_passthrough(fh, Some(id));
        let m = st.io.entry(ino).or_default();
        m.cached = m.cached.saturating_sub(1);
        m.passthrough += 1;
        true
    }

    /// The open read handles reading through a backing file: (handle, inode, backing id). A
    /// successor's adapter takes them over.
    pub fn passthrough_handles(&self) -> Vec<(u64, Ino, Option<u32>)> {
        let st = self.lock();
        st.handles
            .entries()
            .into_iter()
            .filter_map(|(fh, h)| {
                let g = h.try_lock().ok()?;
                match &*g {
                    Handle::Read(r) if r.passthrough => Some((fh, r.ino, r.backing_id)),
                    _ => None,
                }
            })
            .collect()
    }

    /// The kernel connection refused the passthrough file: handle `fh` reads through Ferry.
    pub fn passthrough_failed(&self, fh: u64) {
        let mut st = self.lock();
        let Some(h) = st.handles.get(fh) else { return };
        let Ok(mut g) = h.try_lock() else { return };
        let Handle::Read(r) = &mut *g else { return };
        if std::mem::take(&mut r.passthrough) {
            let ino = r.ino;
            drop(g);
            st.handles.set_passthrough(fh, None);
            let m = st.io.entry(ino).or_default();
            m.passthrough = m.passthrough.saturating_sub(1);
            m.cached += 1;
        }
    }

    /// A failed GET: a changed or vanished object is `ESTALE` and drops the inode's cached
    /// metadata so the next open sees the new version.
    fn read_error(&self, ino: Ino, e: StoreError) -> FsError {
        match e {
            StoreError::PreconditionFailed(_) | StoreError::NotFound(_) => {
                if let Some(inode) = self.lock().inodes.get_mut(ino) {
                    if !inode.is_local() {
                        inode.valid = Validity::Expired;
                    }
                }
                FsError::Stale(e.to_string())
            }
            e => e.into(),
        }
    }

    /// Exactly `range` of the handle's version: from the node cache when the handle may use it,
    /// else one ranged GET pinned to the handle's ETag (a short body is retried once, then `EIO`).
    async fn get(&self, r: &ReadHandle, range: std::ops::Range<u64>) -> Result<Bytes, FsError> {
        let src = self.handle_source(r);
        fetch(&src, range)
            .await
            .map_err(|e| self.read_error(r.ino, e))
    }

    /// Where to read `key` at `etag` from; `proven`: this mount's credentials showed access to
    /// that version (otherwise a cached read HEADs first).
    fn source(&self, key: &str, etag: Option<&str>, size: u64, proven: bool) -> Source {
        self.source_at(key, etag, None, size, proven)
    }

    /// [`Self::source`] of a read handle: its version as pinned at open.
    fn handle_source(&self, r: &ReadHandle) -> Source {
        self.source_at(&r.key, r.etag.as_deref(), r.last_modified, r.size, r.cached)
    }

    fn source_at(
        &self,
        key: &str,
        etag: Option<&str>,
        last_modified: Option<std::time::SystemTime>,
        size: u64,
        proven: bool,
    ) -> Source {
        Source {
            store: self.store.clone(),
            bucket: self.cfg.bucket.clone(),
            key: key.to_owned(),
            etag: etag.map(str::to_owned),
            last_modified,
            size,
            cache: self.cache.as_ref().map(|cache| CacheUse {
                cache: cache.clone(),
                endpoint: self.cfg.endpoint.clone(),
                proven,
            }),
        }
    }

    /// `read`. Sequential reads are served from parts fetched ahead by tasks (a window that grows
    /// from [`PrefetchConfig::initial_window`] to [`PrefetchConfig::max_window`] as the reader
    /// consumes parts, as far as the memory budget allows); a read the kernel reordered a little
    /// behind the stream is served from the parts kept behind the reader or fetched on its own,
    /// leaving the stream as it is; any other read drops the parts
    /// (aborting their GETs), resets the window and fetches just its range, rounded out to
    /// [`PrefetchConfig::random_align`].
    pub async fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Bytes, FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        let r = match &mut *g {
            Handle::Read(r) => r,
            Handle::Write(_) => return Err(FsError::BadHandle("not open for reading")),
            Handle::Dir(_) => return Err(FsError::IsDir),
        };
        if offset >= r.size || size == 0 {
            return Ok(Bytes::new());
        }
        let end = r.size.min(offset.saturating_add(u64::from(size)));
        let cfg = &self.prefetch;
        if !r.is_sequential(offset) && r.is_reordered(offset, cfg.part_size) {
            // The kernel's read-ahead requests for one file run concurrently and can arrive out
            // of order. A read a little behind the stream that the kept parts do not cover
            // (REORDER_KEEP) is fetched on its own; the stream, its window and parts stay.
            let r = r.clone();
            drop(g);
            return self.get(&r, offset..end).await;
        }
        if !r.is_sequential(offset) {
            r.prefetch.reset();
            r.next_offset = end;
            let align = cfg.random_align.max(1);
            let start = offset - offset % align;
            let stop = r.size.min(end.div_ceil(align).saturating_mul(align));
            let r = r.clone();
            drop(g);
            let data = self.get(&r, start..stop).await?;
            return Ok(data.slice((offset - start) as usize..(end - start) as usize));
        }
        if r.prefetch.window == 0 {
            r.prefetch.window = cfg.initial_window.max(1);
        }
        if r.prefetch.span().is_some_and(|(_, e)| offset > e) {
            // Skipped ahead past everything fetched (still within the tolerance): start there.
            r.prefetch.parts.clear();
        }
        // Parts are kept a little past the reader, for reads the kernel reorders.
        r.prefetch
            .consume_before(offset.saturating_sub(REORDER_KEEP));
        let src = self.handle_source(r);
        r.prefetch.fill(&src, r.size, offset, cfg, &self.budget);

        let mut pieces: Vec<Bytes> = Vec::with_capacity(2);
        let mut pos = offset;
        while pos < end {
            let covering = r
                .prefetch
                .parts
                .iter_mut()
                .find(|p| p.start <= pos && pos < p.end);
            let piece = match covering {
                Some(part) => {
                    let (pstart, pend) = (part.start, part.end);
                    match part.data().await {
                        Ok(data) => {
                            let stop = end.min(pend);
                            let piece =
                                data.slice((pos - pstart) as usize..(stop - pstart) as usize);
                            part.note_served(stop - pos);
                            Ok(piece)
                        }
                        Err(e) => Err(self.read_error(r.ino, e)),
                    }
                }
                None => {
                    // Not fetched ahead (the budget is exhausted, or a reordered read behind
                    // the parts): fetch just this piece.
                    let stop = r
                        .prefetch
                        .parts
                        .iter()
                        .map(|p| p.start)
                        .filter(|&s| s > pos)
                        .min()
                        .unwrap_or(end)
                        .min(end);
                    self.get(r, pos..stop).await
                }
            };
            match piece {
                Ok(piece) => {
                    pos += piece.len() as u64;
                    pieces.push(piece);
                }
                Err(e) => {
                    r.prefetch.reset();
                    return Err(e);
                }
            }
        }
        for _ in 0..r.prefetch.consume_before(end.saturating_sub(REORDER_KEEP)) {
            r.prefetch.window = (r.prefetch.window * 2).min(cfg.max_window.max(1));
        }
        r.prefetch.fill(&src, r.size, end, cfg, &self.budget);
        // A reordered read behind the stream does not move its end back.
        r.next_offset = r.next_offset.max(end);
        Ok(match pieces.len() {
            1 => pieces.pop().expect("one"),
            _ => {
                let mut out = BytesMut::with_capacity((end - offset) as usize);
                for p in pieces {
                    out.extend_from_slice(&p);
                }
                out.freeze()
            }
        })
    }

    /// Cross-file prefetch: called when the file `name` of directory `parent` is opened for
    /// reading. When the opens follow the directory's cached listing (each one a little past the
    /// furthest opened so far, or a little behind it: several readers taking entries in turn),
    /// fetches the small files after the furthest one whole, ahead of their opens: 2, 4, 8 … up
    /// to [`PrefetchConfig::small_objects_ahead`] while the pattern holds, each charged to the
    /// budget (none when it is exhausted).
    fn prefetch_following(&self, st: &mut FsState, parent: Ino, name: &str) {
        let cfg = self.prefetch;
        st.small.expire(cfg.small_object_ttl);
        if cfg.small_object_max == 0 || cfg.small_objects_ahead == 0 {
            return;
        }
        let now = Instant::now();
        let Some(dir) = st.inodes.get(parent) else {
            return;
        };
        let Some((listing, _)) = dir.cache.cached_listing(now) else {
            return;
        };
        let Ok(idx) = listing.binary_search_by(|e| e.name.as_str().cmp(name)) else {
            return;
        };
        // (furthest entry opened, streak): an open a little past the furthest one moves it and
        // extends the streak; one a little behind it (a concurrent reader) keeps the streak;
        // anything else starts over.
        let (front, streak) = match st.order.get(&parent) {
            Some(&(front, streak)) if idx > front && idx <= front + ORDER_SLACK => {
                (idx, streak + 1)
            }
            Some(&(front, streak)) if idx <= front && idx + ORDER_SLACK > front => (front, streak),
            _ => (idx, 0),
        };
        if st.order.len() >= ORDER_MAX && !st.order.contains_key(&parent) {
            st.order.clear();
        }
        st.order.insert(parent, (front, streak));
        if streak == 0 {
            return;
        }
        let ahead = (1usize << streak.min(16)).min(cfg.small_objects_ahead);
        let listing = listing.clone();
        let dir_path = dir.path.clone();
        for e in listing.iter().skip(front + 1).take(ahead) {
            let Some(meta) = e.meta.as_ref().filter(|_| e.kind == Kind::File) else {
                continue;
            };
            let Some(etag) = meta.etag.as_deref() else {
                continue;
            };
            if meta.size == 0 || meta.size > cfg.small_object_max {
                continue;
            }
            let key = file_key(&self.cfg.prefix, &child_path(&dir_path, &e.name));
            if st.small.contains(&key, etag) {
                continue;
            }
            let Some(reservation) = self.budget.try_reserve(meta.size) else {
                break;
            };
            let proven = self.is_proven(&key, etag);
            let part = Part::spawn(
                &self.source(&key, Some(etag), meta.size, proven),
                0..meta.size,
                Some(reservation),
            );
            st.small
                .insert(key, etag.to_owned(), part, cfg.small_object_ttl);
        }
    }

    /// `create`: a new local file and a write handle; the object appears when the upload
    /// completes (first flush by the opener, fsync, or release).
    pub async fn create(
        &self,
        parent: Ino,
        name: &OsStr,
        pid: u32,
    ) -> Result<(Entry, Opened), FsError> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly);
        }
        let name = new_name(name)?;
        let mut st = self.lock();
        let path = self.check_new_child(&st, parent, name)?;
        let key = file_key(&self.cfg.prefix, &path);
        if key.len() > KEY_MAX {
            return Err(FsError::NameTooLong);
        }
        let fh = st.handles.peek_next();
        let ino = st
            .inodes
            .install_child(parent, name, Kind::File)
            .ok_or_else(|| stale(parent))?;
        let inode = st.inodes.get_mut(ino).expect("installed");
        inode.state = InodeState::Writing { fh };
        inode.meta = Some(ObjectMeta {
            size: 0,
            mtime: Some(now_secs()),
            etag: None,
        });
        inode.valid = Validity::Expired;
        inode.last_open_etag = None;
        inode.lookups += 1;
        let entry = self.entry_of(inode);
        if let Some(p) = st.inodes.get_mut(parent) {
            p.cache.negative.remove(name);
        }
        st.changes += 1;
        let got = st.handles.insert(Handle::Write(WriteHandle {
            ino,
            parent,
            name: name.to_owned(),
            key,
            pid,
            written: 0,
            pending: Vec::new(),
            upload: None,
            status: WriteStatus::Open,
            replaces: false,
        }));
        debug_assert_eq!(got, fh);
        Ok((
            entry,
            Opened {
                fh,
                keep_cache: false,
            },
        ))
    }

    fn set_local_size(&self, ino: Ino, size: u64) {
        if let Some(inode) = self.lock().inodes.get_mut(ino) {
            inode.meta = Some(ObjectMeta {
                size,
                mtime: Some(now_secs()),
                etag: None,
            });
        }
    }

    /// `write`: appends at the current end only; full parts are uploaded as they fill.
    pub async fn write(&self, fh: u64, offset: u64, data: &[u8]) -> Result<u32, FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        let Handle::Write(w) = &mut *g else {
            return Err(FsError::BadHandle("not open for writing"));
        };
        match w.status {
            WriteStatus::Open => {}
            WriteStatus::Completed => {
                return Err(FsError::BadHandle(
                    "the upload completed (at a close after writing, or fsync); no more writes",
                ))
            }
            WriteStatus::Failed => return Err(FsError::UploadFailed),
        }
        if offset != w.written {
            return Err(FsError::InvalidArgument(
                "writes must be sequential (offset = current size)",
            ));
        }
        let len = data.len() as u64;
        if w.written + len > (PART_SIZE * MAX_PARTS) as u64 {
            return Err(FsError::FileTooLarge);
        }
        w.pending.extend_from_slice(data);
        w.written += len;
        while w.pending.len() >= PART_SIZE {
            let rest = w.pending.split_off(PART_SIZE);
            let part = std::mem::replace(&mut w.pending, rest);
            if let Err(e) = self.upload_part(w, part).await {
                self.fail_write(w).await;
                return Err(e);
            }
        }
        self.set_local_size(w.ino, w.written);
        u32::try_from(len).map_err(|_| FsError::InvalidArgument("write larger than 4 GiB"))
    }

    async fn upload_part(&self, w: &mut WriteHandle, part: Vec<u8>) -> Result<(), FsError> {
        if w.upload.is_none() {
            let upload_id = self.store.create_multipart(self.bucket(), &w.key).await?;
            w.upload = Some(MultipartState {
                upload_id,
                parts: Vec::new(),
            });
        }
        let up = w.upload.as_mut().expect("set above");
        let number = i32::try_from(up.parts.len() + 1).map_err(|_| FsError::FileTooLarge)?;
        let done = self
            .store
            .upload_part(
                self.bucket(),
                &w.key,
                &up.upload_id,
                number,
                Bytes::from(part),
            )
            .await?;
        up.parts.push(PartRecord {
            number,
            etag: done.etag,
        });
        Ok(())
    }

    async fn abort_upload(&self, key: &str, up: &MultipartState) {
        if let Err(e) = self
            .store
            .abort_multipart(self.bucket(), key, &up.upload_id)
            .await
        {
            tracing::warn!(key, error = %e, "aborting a multipart upload failed");
        }
    }

    /// The upload failed: the file disappears from this mount (an overwritten object stays).
    async fn fail_write(&self, w: &mut WriteHandle) {
        w.status = WriteStatus::Failed;
        w.pending = Vec::new();
        if let Some(up) = w.upload.take() {
            self.abort_upload(&w.key, &up).await;
        }
        let mut st = self.lock();
        if let Some(inode) = st.inodes.get_mut(w.ino) {
            inode.state = InodeState::Remote;
            inode.meta = None;
            inode.valid = Validity::Expired;
        }
        st.inodes.maybe_remove(w.ino);
    }

    /// Finishes the upload (PUT, or last part + complete). Idempotent once completed.
    async fn complete(&self, w: &mut WriteHandle) -> Result<(), FsError> {
        match w.status {
            WriteStatus::Open => {}
            WriteStatus::Completed => return Ok(()),
            WriteStatus::Failed => return Err(FsError::UploadFailed),
        }
        let result = match w.upload.is_some() {
            false => {
                let body = Bytes::from(std::mem::take(&mut w.pending));
                self.store
                    .put(self.bucket(), &w.key, body)
                    .await
                    .map_err(FsError::from)
            }
            true => {
                let last = std::mem::take(&mut w.pending);
                let uploaded = if last.is_empty() {
                    Ok(())
                } else {
                    self.upload_part(w, last).await
                };
                match uploaded {
                    Err(e) => Err(e),
                    Ok(()) => {
                        let up = w.upload.as_ref().expect("multipart");
                        let parts = up
                            .parts
                            .iter()
                            .map(|p| CompletedPart {
                                part_number: p.number,
                                etag: p.etag.clone(),
                            })
                            .collect();
                        self.store
                            .complete_multipart(self.bucket(), &w.key, &up.upload_id, parts)
                            .await
                            .map_err(FsError::from)
                    }
                }
            }
        };
        let put = match result {
            Ok(put) => put,
            Err(e) => {
                tracing::warn!(key = %w.key, error = %e, "upload failed");
                self.fail_write(w).await;
                return Err(e);
            }
        };
        w.status = WriteStatus::Completed;
        w.upload = None;
        let meta = ObjectMeta {
            size: w.written,
            mtime: Some(now_secs()),
            etag: put.etag,
        };
        let valid = self.ttl();
        let mut st = self.lock();
        st.changes += 1;
        if let Some(inode) = st.inodes.get_mut(w.ino) {
            inode.state = InodeState::Remote;
            inode.meta = Some(meta.clone());
            inode.valid = valid;
            inode.last_open_etag = None;
        }
        if let Some(p) = st.inodes.get_mut(w.parent) {
            p.cache.add_positive(
                &w.name,
                CachedEntry {
                    kind: Kind::File,
                    meta: Some(meta),
                },
            );
        }
        // Local ancestors now exist in S3 (implicitly); their parents' cached listings lack them.
        let mut up = w.parent;
        while let Some(dir) = st.inodes.get_mut(up) {
            if dir.state != InodeState::LocalDir {
                break;
            }
            dir.valid = valid;
            let this = std::mem::replace(&mut up, dir.parent);
            st.inodes.set_state(this, InodeState::Remote);
            if let Some(parent) = st.inodes.get_mut(up) {
                parent.cache.listing = None;
            }
        }
        st.inodes.maybe_remove(w.ino);
        Ok(())
    }

    /// `flush` (every `close`): completes the upload when called by the opening process after
    /// something was written, so `close` reports upload errors; other processes' closes (forked
    /// children) do nothing. A flush before the first write does nothing either: a shell's
    /// `> file` (and `dd`, `/bin/echo`) opens the file, `dup2`s it onto stdout and closes the
    /// first descriptor before anything is written; the empty file is then completed by a later
    /// flush, `fsync` or `release`. `pid` gives the caller's process id; it is asked only for a
    /// write handle with data. A failed upload is reported to the opener's flush even with
    /// nothing written (a write handle recovered from the journal has lost what was written).
    pub async fn flush(&self, fh: u64, pid: impl FnOnce() -> u32) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        match &mut *g {
            Handle::Write(w)
                if (w.written > 0 || w.status == WriteStatus::Failed) && w.pid == pid() =>
            {
                self.complete(w).await
            }
            Handle::Write(_) | Handle::Read(_) | Handle::Dir(_) => Ok(()),
        }
    }

    /// `fsync`: completes the upload (a file cannot be made durable in parts).
    pub async fn fsync(&self, fh: u64) -> Result<(), FsError> {
        let h = self.handle(fh)?;
        let mut g = h.lock().await;
        match &mut *g {
            Handle::Write(w) => self.complete(w).await,
            Handle::Read(_) | Handle::Dir(_) => Ok(()),
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

    /// `release` (last close): completes an upload still open and forgets the handle.
    pub async fn release(&self, fh: u64) -> Result<(), FsError> {
        let h = self.lock().handles.remove(fh).ok_or_else(bad_fh)?;
        let mut g = h.lock().await;
        match &mut *g {
            Handle::Write(w) => self.complete(w).await,
            Handle::Read(r) => {
                // Aborts GETs in flight and gives their memory back.
                r.prefetch.reset();
                self.lock().io_closed(r.ino, r.passthrough);
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
#[path = "fs_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "cache_tests.rs"]
mod cache_tests;
