//! Reference-model test of the core: random sequences of create+write, read, list, stat, unlink,
//! mkdir, rmdir and "the kernel forgets everything", run against `Fs` on a `MemoryStore` (driven
//! the way the kernel drives it: a lookup per path segment, then the operation) and against a
//! `BTreeMap` model; every result and every errno must agree.
//!
//! Listings go through a model of the kernel's directory cache (`fs/fuse/readdir.c`: filled by
//! handles opened with `FOPEN_CACHE_DIR` as they are answered, read whole once complete, dropped
//! by an `opendir` without `FOPEN_KEEP_CACHE`, reset when a change through the mount bumps the
//! directory's i_version), with directory handles held open across other operations, read part
//! of the way and finished later: whatever those fill the cache with, every listing must be the
//! model's, and no stream may name an entry twice.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::sync::Arc;
use std::time::Duration;

use ferry_fs::fs::{DirEntry, DirSink, Entry, Fs, KernelInvalidator};
use ferry_fs::handles::PART_SIZE;
use ferry_fs::inode::{Ino, ROOT_INO};
use ferry_fs::names::Kind;
use ferry_fs::{FsError, MetadataTtl, MountConfig};
use ferry_store::MemoryStore;
use proptest::prelude::*;

const B: &str = "bkt";
const DIRS: [&str; 2] = ["d0", "d1"];
const FILES: [&str; 3] = ["f0", "f1", "f2"];
const PID: u32 = 7;

#[derive(Debug, Clone)]
enum Op {
    Write {
        dir: Option<usize>,
        file: usize,
        len: usize,
        seed: u8,
        chunk: usize,
    },
    Read {
        dir: Option<usize>,
        file: usize,
    },
    List {
        dir: Option<usize>,
    },
    Stat {
        dir: Option<usize>,
        file: usize,
    },
    Unlink {
        dir: Option<usize>,
        file: usize,
    },
    Mkdir {
        dir: usize,
    },
    Rmdir {
        dir: usize,
    },
    ForgetAll,
    /// Opens a directory handle, reads `batches` answers of it and keeps it open.
    Hold {
        dir: Option<usize>,
        batches: usize,
    },
    /// Reads the oldest held handle to its end (filling the kernel's cache, if it may) and
    /// releases it.
    Finish,
}

fn op() -> impl Strategy<Value = Op> {
    let dir = prop::option::of(0..DIRS.len());
    let file = 0..FILES.len();
    let len = prop_oneof![20 => 0..3000usize, 1 => Just(PART_SIZE + 4321)];
    prop_oneof![
        4 => (dir.clone(), file.clone(), len, any::<u8>(), 1..5000usize)
            .prop_map(|(dir, file, len, seed, chunk)| Op::Write { dir, file, len, seed, chunk }),
        3 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Read { dir, file }),
        2 => dir.clone().prop_map(|dir| Op::List { dir }),
        2 => (dir.clone(), 0..4usize).prop_map(|(dir, batches)| Op::Hold { dir, batches }),
        2 => Just(Op::Finish),
        2 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Stat { dir, file }),
        2 => (dir, file).prop_map(|(dir, file)| Op::Unlink { dir, file }),
        2 => (0..DIRS.len()).prop_map(|dir| Op::Mkdir { dir }),
        2 => (0..DIRS.len()).prop_map(|dir| Op::Rmdir { dir }),
        1 => Just(Op::ForgetAll),
    ]
}

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

fn path(dir: Option<usize>, file: usize) -> String {
    match dir {
        Some(d) => format!("{}/{}", DIRS[d], FILES[file]),
        None => FILES[file].to_owned(),
    }
}

/// What the model and the filesystem must both say.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Data(Vec<u8>),
    Names(Vec<(String, Kind)>),
    Size(u64),
    Err(i32),
}

#[derive(Default)]
struct Model {
    files: BTreeMap<String, Vec<u8>>,
    dirs: BTreeSet<String>,
}

impl Model {
    fn dir_ok(&self, dir: Option<usize>) -> bool {
        dir.is_none_or(|d| self.dirs.contains(DIRS[d]))
    }

    fn apply(&mut self, op: &Op) -> Outcome {
        match *op {
            Op::Write {
                dir,
                file,
                len,
                seed,
                ..
            } => {
                if !self.dir_ok(dir) {
                    return Outcome::Err(libc::ENOENT);
                }
                self.files.insert(path(dir, file), bytes(len, seed));
                Outcome::Ok
            }
            Op::Read { dir, file } => match self.files.get(&path(dir, file)) {
                Some(d) if self.dir_ok(dir) => Outcome::Data(d.clone()),
                _ => Outcome::Err(libc::ENOENT),
            },
            Op::Stat { dir, file } => match self.files.get(&path(dir, file)) {
                Some(d) if self.dir_ok(dir) => Outcome::Size(d.len() as u64),
                _ => Outcome::Err(libc::ENOENT),
            },
            Op::List { dir } => {
                if !self.dir_ok(dir) {
                    return Outcome::Err(libc::ENOENT);
                }
                let mut names: Vec<(String, Kind)> = match dir {
                    None => {
                        let mut v: Vec<_> = self
                            .files
                            .keys()
                            .filter(|k| !k.contains('/'))
                            .map(|k| (k.clone(), Kind::File))
                            .collect();
                        v.extend(self.dirs.iter().map(|d| (d.clone(), Kind::Dir)));
                        v
                    }
                    Some(d) => {
                        let prefix = format!("{}/", DIRS[d]);
                        self.files
                            .keys()
                            .filter_map(|k| k.strip_prefix(&prefix))
                            .map(|n| (n.to_owned(), Kind::File))
                            .collect()
                    }
                };
                names.sort();
                Outcome::Names(names)
            }
            Op::Unlink { dir, file } => {
                if self.dir_ok(dir) && self.files.remove(&path(dir, file)).is_some() {
                    Outcome::Ok
                } else {
                    Outcome::Err(libc::ENOENT)
                }
            }
            Op::Mkdir { dir } => {
                if self.dirs.insert(DIRS[dir].to_owned()) {
                    Outcome::Ok
                } else {
                    Outcome::Err(libc::EEXIST)
                }
            }
            Op::Rmdir { dir } => {
                let name = DIRS[dir];
                if !self.dirs.contains(name) {
                    Outcome::Err(libc::ENOENT)
                } else if self
                    .files
                    .keys()
                    .any(|k| k.starts_with(&format!("{name}/")))
                {
                    Outcome::Err(libc::ENOTEMPTY)
                } else {
                    self.dirs.remove(name);
                    Outcome::Ok
                }
            }
            Op::ForgetAll | Op::Finish => Outcome::Ok,
            Op::Hold { dir, .. } => match self.dir_ok(dir) {
                true => Outcome::Ok,
                false => Outcome::Err(libc::ENOENT),
            },
        }
    }

    /// Directories pinned as local after the kernel forgets everything: the empty ones.
    fn empty_dirs(&self) -> usize {
        self.dirs
            .iter()
            .filter(|d| !self.files.keys().any(|k| k.starts_with(&format!("{d}/"))))
            .count()
    }
}

/// Drives `Fs` the way the kernel does, remembering references to forget and inode numbers.
struct Kernel {
    fs: Fs,
    refs: HashMap<Ino, u64>,
    inos: HashMap<(String, Kind), Ino>,
    /// The kernel's cache of each directory it holds.
    dirs: HashMap<Ino, KDir>,
    /// Directory handles held open (oldest first).
    held: Vec<DirStream>,
    /// Directories whose caches Ferry told the kernel to drop (`FUSE_NOTIFY_INVAL_INODE`), not
    /// yet applied.
    dropped: Arc<std::sync::Mutex<Vec<Ino>>>,
}

/// The kernel's cache of one directory's entries, as far as what it serves goes.
#[derive(Default)]
struct KDir {
    /// The directory's i_version: bumped by every change made in it through the mount.
    iversion: u64,
    cached: bool,
    /// Cached entries (`.` and `..` too) with their `d_off`, in order.
    entries: Vec<(String, Kind, u64)>,
    /// The `d_off` of the last cached entry: where the cache goes on (0: empty).
    end: u64,
    /// Pages were dropped since the fill started: reading it finds one missing and resets.
    holes: bool,
    /// The i_version when the fill started.
    started: u64,
    version: u64,
}

impl KDir {
    fn reset(&mut self) {
        self.cached = false;
        self.entries.clear();
        self.end = 0;
        self.holes = false;
        self.version += 1;
    }
}

/// An open directory as the kernel keeps it (`struct fuse_file`'s readdir state).
struct DirStream {
    ino: Ino,
    fh: u64,
    cache_dir: bool,
    /// `ctx->pos`: where the next `getdents` goes on.
    pos: u64,
    /// The position reached while walking the cache, and the entry index there.
    cache_pos: u64,
    cache_idx: usize,
    version: u64,
}

/// One answer's entries, at most `cap`.
struct Batch {
    cap: usize,
    got: Vec<(String, Kind, u64)>,
}

impl DirSink for Batch {
    fn add(&mut self, e: &DirEntry<'_>) -> bool {
        if self.got.len() >= self.cap {
            return true;
        }
        self.got.push((e.name.to_owned(), e.kind, e.offset));
        false
    }
}

impl Kernel {
    async fn lookup(
        &mut self,
        parent: Ino,
        parent_path: &str,
        name: &str,
    ) -> Result<Entry, FsError> {
        let e = self.fs.lookup(parent, OsStr::new(name)).await?;
        *self.refs.entry(e.attr.ino).or_default() += 1;
        let path = if parent_path.is_empty() {
            name.to_owned()
        } else {
            format!("{parent_path}/{name}")
        };
        let known = *self
            .inos
            .entry((path.clone(), e.attr.kind))
            .or_insert(e.attr.ino);
        assert_eq!(known, e.attr.ino, "inode number of {path} changed");
        Ok(e)
    }

    /// The directory holding `dir`'s files (the root for `None`).
    async fn dir(&mut self, dir: Option<usize>) -> Result<Ino, FsError> {
        match dir {
            None => Ok(ROOT_INO),
            Some(d) => {
                let e = self.lookup(ROOT_INO, "", DIRS[d]).await?;
                if e.attr.kind != Kind::Dir {
                    return Err(FsError::NotDir);
                }
                Ok(e.attr.ino)
            }
        }
    }

    /// The kernel forgets every inode no open directory handle holds (and with a directory's
    /// inode, its cache).
    fn forget_all(&mut self) {
        let open: BTreeSet<Ino> = self.held.iter().map(|s| s.ino).collect();
        let refs: Vec<(Ino, u64)> = self.refs.iter().map(|(i, n)| (*i, *n)).collect();
        for (ino, n) in refs {
            if !open.contains(&ino) {
                self.refs.remove(&ino);
                self.dirs.remove(&ino);
                self.fs.forget(ino, n);
            }
        }
    }

    /// A change through the mount in directory `ino` (`fuse_dir_changed`).
    fn changed(&mut self, ino: Ino) {
        self.dirs.entry(ino).or_default().iversion += 1;
    }

    /// Applies the drops Ferry asked for: the pages go (a complete cache then resets when
    /// read).
    fn apply_drops(&mut self) {
        let dropped: Vec<Ino> = std::mem::take(&mut *self.dropped.lock().unwrap());
        for ino in dropped {
            if let Some(d) = self.dirs.get_mut(&ino) {
                if !d.entries.is_empty() {
                    d.holes = true;
                }
            }
        }
    }

    fn opendir(&mut self, ino: Ino) -> Result<DirStream, FsError> {
        self.apply_drops();
        let o = self.fs.opendir(ino)?;
        if !o.keep_cache {
            let d = self.dirs.entry(ino).or_default();
            if !d.entries.is_empty() {
                d.holes = true;
            }
        }
        Ok(DirStream {
            ino,
            fh: o.fh,
            cache_dir: o.cache_dir,
            pos: 0,
            cache_pos: 0,
            cache_idx: 0,
            version: 0,
        })
    }

    /// One `getdents` of at most `cap` entries (none: the end), as `fuse_readdir` answers it.
    async fn getdents(
        &mut self,
        s: &mut DirStream,
        cap: usize,
    ) -> Result<Vec<(String, Kind)>, FsError> {
        self.apply_drops();
        if s.cache_dir {
            if s.cache_pos != s.pos {
                s.cache_pos = 0;
                s.cache_idx = 0;
            }
            let d = self.dirs.entry(s.ino).or_default();
            loop {
                if !d.cached {
                    if s.pos == 0 && d.entries.is_empty() {
                        d.started = d.iversion;
                    }
                    break;
                }
                if d.holes || (s.pos == 0 && d.started != d.iversion) {
                    d.reset();
                    continue;
                }
                if s.version != d.version {
                    s.cache_pos = 0;
                    s.cache_idx = 0;
                }
                if s.cache_pos == 0 {
                    s.version = d.version;
                }
                let mut out = Vec::new();
                while let Some((name, kind, off)) = d.entries.get(s.cache_idx).cloned() {
                    if s.cache_pos == s.pos {
                        if out.len() == cap {
                            return Ok(out);
                        }
                        out.push((name, kind));
                        s.pos = off;
                    }
                    s.cache_pos = off;
                    s.cache_idx += 1;
                }
                if !out.is_empty() || s.cache_pos == s.pos {
                    return Ok(out);
                }
                break;
            }
        }
        let mut batch = Batch {
            cap,
            got: Vec::new(),
        };
        self.fs
            .readdir(s.ino, s.fh, s.pos, false, &mut batch)
            .await?;
        let d = self.dirs.entry(s.ino).or_default();
        if batch.got.is_empty() {
            if s.cache_dir && !d.cached && d.end == s.pos {
                d.cached = true;
            }
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for (name, kind, off) in batch.got {
            if s.cache_dir && !d.cached && d.end == s.pos {
                d.entries.push((name.clone(), kind, off));
                d.end = off;
            }
            s.pos = off;
            out.push((name, kind));
        }
        Ok(out)
    }

    /// The rest of stream `s`, in answers of at most `cap` entries.
    async fn read_to_end(
        &mut self,
        s: &mut DirStream,
        cap: usize,
    ) -> Result<Vec<(String, Kind)>, FsError> {
        let mut all = Vec::new();
        loop {
            let got = self.getdents(s, cap).await?;
            if got.is_empty() {
                return Ok(all);
            }
            all.extend(got);
        }
    }

    async fn apply(&mut self, op: &Op) -> Outcome {
        match self.run(op).await {
            Ok(o) => o,
            Err(e) => Outcome::Err(e.errno()),
        }
    }

    async fn run(&mut self, op: &Op) -> Result<Outcome, FsError> {
        match *op {
            Op::Write {
                dir,
                file,
                len,
                seed,
                chunk,
            } => {
                let parent = self.dir(dir).await?;
                let parent_path = dir.map_or("", |d| DIRS[d]);
                let name = FILES[file];
                let fh = match self.lookup(parent, parent_path, name).await {
                    Ok(e) => {
                        let flags = libc::O_WRONLY | libc::O_TRUNC;
                        self.fs.open(e.attr.ino, flags, PID).await?.fh
                    }
                    Err(FsError::NotFound) => {
                        let (e, o) = self.fs.create(parent, OsStr::new(name), PID).await?;
                        *self.refs.entry(e.attr.ino).or_default() += 1;
                        self.changed(parent);
                        o.fh
                    }
                    Err(e) => return Err(e),
                };
                let data = bytes(len, seed);
                let mut off = 0u64;
                for c in data.chunks(chunk) {
                    self.fs.write(fh, off, c).await?;
                    off += c.len() as u64;
                }
                self.fs.flush(fh, || PID).await?;
                self.fs.release(fh).await?;
                Ok(Outcome::Ok)
            }
            Op::Read { dir, file } => {
                let parent = self.dir(dir).await?;
                let e = self
                    .lookup(parent, dir.map_or("", |d| DIRS[d]), FILES[file])
                    .await?;
                let o = self.fs.open(e.attr.ino, libc::O_RDONLY, PID).await?;
                let mut out = Vec::new();
                loop {
                    let got = self.fs.read(o.fh, out.len() as u64, 128 * 1024).await?;
                    if got.is_empty() {
                        break;
                    }
                    out.extend_from_slice(&got);
                }
                self.fs.release(o.fh).await?;
                Ok(Outcome::Data(out))
            }
            Op::Stat { dir, file } => {
                let parent = self.dir(dir).await?;
                let e = self
                    .lookup(parent, dir.map_or("", |d| DIRS[d]), FILES[file])
                    .await?;
                Ok(Outcome::Size(self.fs.getattr(e.attr.ino).await?.attr.size))
            }
            Op::List { dir } => {
                let ino = self.dir(dir).await?;
                let mut s = self.opendir(ino)?;
                let r = self.read_to_end(&mut s, 3).await;
                self.fs.releasedir(s.fh);
                let mut names: Vec<(String, Kind)> = r?
                    .into_iter()
                    .filter(|(n, _)| n != "." && n != "..")
                    .collect();
                names.sort();
                Ok(Outcome::Names(names))
            }
            Op::Hold { dir, batches } => {
                let ino = self.dir(dir).await?;
                let mut s = self.opendir(ino)?;
                for _ in 0..batches {
                    self.getdents(&mut s, 2).await?;
                }
                self.held.push(s);
                Ok(Outcome::Ok)
            }
            Op::Finish => {
                if self.held.is_empty() {
                    return Ok(Outcome::Ok);
                }
                let mut s = self.held.remove(0);
                // From where it stopped (its directory may be gone: then an error, as a
                // process reading a removed directory gets one).
                let mut seen = BTreeSet::new();
                let got = self.read_to_end(&mut s, 2).await;
                self.fs.releasedir(s.fh);
                for (name, _) in got.unwrap_or_default() {
                    assert!(
                        seen.insert(name.clone()),
                        "{name} listed twice by one stream"
                    );
                }
                Ok(Outcome::Ok)
            }
            Op::Unlink { dir, file } => {
                let parent = self.dir(dir).await?;
                self.lookup(parent, dir.map_or("", |d| DIRS[d]), FILES[file])
                    .await?;
                self.fs.unlink(parent, OsStr::new(FILES[file])).await?;
                self.changed(parent);
                Ok(Outcome::Ok)
            }
            Op::Mkdir { dir } => match self.lookup(ROOT_INO, "", DIRS[dir]).await {
                Ok(_) => Err(FsError::Exists),
                Err(FsError::NotFound) => {
                    let e = self.fs.mkdir(ROOT_INO, OsStr::new(DIRS[dir])).await?;
                    *self.refs.entry(e.attr.ino).or_default() += 1;
                    self.changed(ROOT_INO);
                    Ok(Outcome::Ok)
                }
                Err(e) => Err(e),
            },
            Op::Rmdir { dir } => {
                self.lookup(ROOT_INO, "", DIRS[dir]).await?;
                self.fs.rmdir(ROOT_INO, OsStr::new(DIRS[dir])).await?;
                self.changed(ROOT_INO);
                Ok(Outcome::Ok)
            }
            Op::ForgetAll => {
                self.forget_all();
                Ok(Outcome::Ok)
            }
        }
    }
}

fn check(ops: &[Op], ttl: MetadataTtl) -> Result<(), TestCaseError> {
    check_paged(ops, ttl, 1000)
}

/// [`check`] with LIST pages of at most `page` entries: a directory of a few names is then listed
/// in many pages (first pages served while the rest is listed, the rest joined, ranges guessed).
fn check_paged(ops: &[Op], ttl: MetadataTtl, page: u32) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = MemoryStore::new();
        store.create_bucket(B);
        store.set_list_page_max(page);
        let mut cfg = MountConfig::new(B);
        cfg.read_only = false;
        cfg.allow_delete = true;
        cfg.allow_overwrite = true;
        cfg.metadata_ttl = ttl;
        let mut kernel = Kernel {
            fs: Fs::new(Arc::new(store.clone()), cfg),
            refs: HashMap::new(),
            inos: HashMap::new(),
            dirs: HashMap::new(),
            held: Vec::new(),
            dropped: Default::default(),
        };
        let dropped = kernel.dropped.clone();
        kernel
            .fs
            .set_kernel_invalidator(KernelInvalidator::new(move |ino| {
                dropped.lock().unwrap().push(ino)
            }));
        let mut model = Model::default();
        for (i, op) in ops.iter().enumerate() {
            let want = model.apply(op);
            let got = kernel.apply(op).await;
            prop_assert_eq!(got, want, "step {}: {:?}", i, op);
            // The store holds exactly the model's files (no stray markers or uploads).
            let keys: Vec<String> = model.files.keys().cloned().collect();
            prop_assert_eq!(store.keys(B), keys, "step {}: {:?}", i, op);
            prop_assert_eq!(store.pending_uploads(B), 0);
        }
        while let Some(s) = kernel.held.pop() {
            kernel.fs.releasedir(s.fh);
        }
        kernel.forget_all();
        prop_assert_eq!(
            kernel.fs.table_sizes(),
            (1 + model.empty_dirs(), 0),
            "after forgetting everything only the root and empty local dirs stay"
        );
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn matches_the_model_with_indefinite_ttl(ops in prop::collection::vec(op(), 1..40)) {
        check(&ops, MetadataTtl::Indefinite)?;
    }

    #[test]
    fn matches_the_model_with_zero_ttl(ops in prop::collection::vec(op(), 1..40)) {
        check(&ops, MetadataTtl::Duration(Duration::ZERO))?;
    }

    /// A TTL no run outlives: directories cached in the kernel as on an indefinite mount, on
    /// the TTL's rules (a listing not kept after a change is listed again).
    #[test]
    fn matches_the_model_with_an_hour_ttl(ops in prop::collection::vec(op(), 1..40)) {
        check(&ops, MetadataTtl::Duration(Duration::from_secs(3600)))?;
    }
}

proptest! {
    // Few runs have a directory longer than a page, so more runs than above.
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Every TTL again with LIST pages of one to three entries.
    #[test]
    fn matches_the_model_with_small_list_pages(
        ops in prop::collection::vec(op(), 1..40),
        page in 1u32..=3,
        ttl in prop_oneof![
            Just(MetadataTtl::Indefinite),
            Just(MetadataTtl::Duration(Duration::ZERO)),
            Just(MetadataTtl::Duration(Duration::from_secs(3600))),
        ],
    ) {
        check_paged(&ops, ttl, page)?;
    }
}

/// A handle pinned to the old listing at its `opendir`, read only after a change through the
/// mount while a new handle has begun filling the kernel's cache with the new listing: the two
/// never mix in the cache, and the listing after them is the new one.
#[test]
fn a_pinned_handle_and_a_new_listing_never_mix_in_the_kernels_cache() {
    let ops = [
        Op::Write {
            dir: None,
            file: 0,
            len: 1,
            seed: 1,
            chunk: 1,
        },
        Op::List { dir: None },
        Op::List { dir: None },
        Op::Hold {
            dir: None,
            batches: 0,
        },
        Op::Write {
            dir: None,
            file: 1,
            len: 1,
            seed: 2,
            chunk: 1,
        },
        Op::Hold {
            dir: None,
            batches: 1,
        },
        Op::Finish,
        Op::Finish,
        Op::List { dir: None },
        Op::List { dir: None },
    ];
    for ttl in [
        MetadataTtl::Indefinite,
        MetadataTtl::Duration(Duration::from_secs(3600)),
    ] {
        check(&ops, ttl).unwrap();
    }
}
