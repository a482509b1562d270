//! The inode table: stable inode numbers per path, kernel lookup counts, local-only state (new
//! directories, files being written) and the per-directory metadata caches.
//!
//! Inode numbers are a fixed 64-bit hash of (kind, path), so a path keeps its number for the
//! mount's life even after the kernel forgets it and the entry is dropped from the table. On a
//! collision with a live inode of another path the next probe value is used (that path's number is
//! then stable only while it stays live). Plain data: it derives serde so a later process can take
//! it over; cache validity is not carried over (it restarts expired). With a [`Journal`]
//! attached, every change to the live set (an inode installed, re-attached, made or unmade local,
//! dropped) is also appended there, so a successor can rebuild the table after a crash.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::config::MetadataTtl;
use crate::journal::{InodeRecord, Journal, JournalLink};
use crate::names::{child_path, Kind, ListedEntry, ObjectMeta};

pub type Ino = u64;
pub const ROOT_INO: Ino = 1;

/// The lookup count of an inode rebuilt from a journal (the kernel's real count is not
/// journaled): high enough that no `forget` brings it to zero, so it stays for the mount's life.
pub const RECOVERED_LOOKUPS: u64 = u64::MAX / 2;

/// Most negative entries remembered per directory; beyond it expired ones are purged, then all.
const NEGATIVE_MAX: usize = 4096;

/// Until when a cached fact holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Validity {
    #[default]
    Expired,
    Until(Instant),
    Forever,
}

impl Validity {
    pub fn new(ttl: MetadataTtl, now: Instant) -> Self {
        match ttl {
            MetadataTtl::Indefinite => Validity::Forever,
            MetadataTtl::Duration(d) if d.is_zero() => Validity::Expired,
            MetadataTtl::Duration(d) => now
                .checked_add(d)
                .map_or(Validity::Forever, Validity::Until),
        }
    }

    pub fn is_valid(self, now: Instant) -> bool {
        match self {
            Validity::Expired => false,
            Validity::Until(t) => now < t,
            Validity::Forever => true,
        }
    }
}

/// Whether an inode exists in S3 or only in this mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InodeState {
    /// Backed by S3 (a key, a marker or keys below it).
    Remote,
    /// Created by `mkdir` in this mount; nothing in S3 yet. Pinned in the table.
    LocalDir,
    /// Created (or truncated) and being written through handle `fh`; pinned until the upload ends.
    Writing { fh: u64 },
}

/// What the last listing of a directory said about one name.
#[derive(Debug, Clone)]
pub struct CachedEntry {
    pub kind: Kind,
    pub meta: Option<ObjectMeta>,
}

/// Per-directory caches: names from the last listing and names known to be missing.
///
/// The listing is kept once, sorted by name: lookups binary-search it, and what this mount learns
/// after it (a name created, a name found missing) is an overlay on it (`added`, `removed`), so a
/// kept listing costs one copy of its names and metadata.
#[derive(Debug, Clone, Default)]
pub struct DirCache {
    /// Until when the names (the listing and its overlay) are believed.
    pub entries_valid: Validity,
    pub negative: HashMap<String, Validity>,
    /// The last listing (S3's entries, sorted by name) and when it was taken.
    listing: Option<(Arc<Vec<ListedEntry>>, Instant)>,
    /// Whether new `opendir`s may be served from `listing` (while `entries_valid` holds): no
    /// longer once this mount changed the directory (the overlay is not a listing's order).
    serves_readdir: bool,
    /// What this mount learned since the listing (boxed: most directories never have one).
    overlay: Option<Box<Overlay>>,
    /// What `listing` holds of the memory budget ([`crate::budget::Use::Listing`]), shared by
    /// copies of this cache.
    charge: Option<Arc<crate::Reservation>>,
}

/// An inode's [`DirCache`], allocated at its first change: files (most inodes) never have one,
/// and read through an empty one. Derefs to the cache; a mutable access allocates it.
#[derive(Debug, Clone, Default)]
pub struct DirSlot(Option<Box<DirCache>>);

/// What an inode without a directory cache reads.
static NO_DIR_CACHE: std::sync::LazyLock<DirCache> = std::sync::LazyLock::new(DirCache::default);

impl std::ops::Deref for DirSlot {
    type Target = DirCache;
    fn deref(&self) -> &DirCache {
        self.0.as_deref().unwrap_or(&NO_DIR_CACHE)
    }
}

impl std::ops::DerefMut for DirSlot {
    fn deref_mut(&mut self) -> &mut DirCache {
        self.0.get_or_insert_with(Default::default)
    }
}

/// Names a directory's mount learned after its listing.
#[derive(Debug, Clone, Default)]
struct Overlay {
    /// Names learned since the listing (created here, or found by a lookup); they win over it.
    added: HashMap<String, CachedEntry>,
    /// Names of the listing found missing since.
    removed: std::collections::HashSet<String>,
}

/// Bytes a listing of `entries` costs kept in a [`DirCache`] (each entry, and its name and ETag
/// as malloc holds them), for the memory budget.
pub fn kept_listing_bytes(entries: &[ListedEntry]) -> u64 {
    entries
        .iter()
        .map(|e| {
            let etag = e.meta.as_ref().and_then(|m| m.etag.as_ref());
            (std::mem::size_of::<ListedEntry>()
                + malloc_chunk(e.name.len())
                + etag.map_or(0, |t| malloc_chunk(t.len()))) as u64
        })
        .sum()
}

/// What glibc's malloc holds for an allocation of `len` bytes: its 8-byte header, rounded up to
/// 16, at least 32 (nothing for an empty string, which allocates nothing).
fn malloc_chunk(len: usize) -> usize {
    if len == 0 {
        0
    } else {
        ((len + 8).div_ceil(16) * 16).max(32)
    }
}

impl DirCache {
    /// Forgets everything but the negative entries; names are believed until `valid`.
    pub fn clear(&mut self, valid: Validity) {
        self.entries_valid = valid;
        self.listing = None;
        self.serves_readdir = false;
        self.overlay = None;
        self.charge = None;
    }

    /// Keeps `listing` (sorted by name, taken at `at`), charged `charge`: lookups are answered
    /// from it and new `opendir`s served from it while `entries_valid` holds.
    pub fn keep(
        &mut self,
        listing: Arc<Vec<ListedEntry>>,
        at: Instant,
        charge: crate::Reservation,
    ) {
        self.listing = Some((listing, at));
        self.serves_readdir = true;
        self.overlay = None;
        self.charge = Some(Arc::new(charge));
    }

    /// The last listing, while it is valid and may serve `readdir`.
    pub fn cached_listing(&self, now: Instant) -> Option<&(Arc<Vec<ListedEntry>>, Instant)> {
        self.listing
            .as_ref()
            .filter(|_| self.serves_readdir && self.entries_valid.is_valid(now))
    }

    pub fn is_negative(&self, name: &str, now: Instant) -> bool {
        self.negative.get(name).is_some_and(|v| v.is_valid(now))
    }

    /// What the listing (and what this mount learned since) says of `name`, while valid.
    pub fn cached(&self, name: &str, now: Instant) -> Option<(Kind, Option<&ObjectMeta>)> {
        if !self.entries_valid.is_valid(now) {
            return None;
        }
        if let Some(o) = &self.overlay {
            if let Some(e) = o.added.get(name) {
                return Some((e.kind, e.meta.as_ref()));
            }
            if o.removed.contains(name) {
                return None;
            }
        }
        let e = self.listed(name)?;
        Some((e.kind, e.meta.as_ref()))
    }

    /// Whether a listing is kept and still believed: a name [`Self::cached`] knows nothing of is
    /// then in neither it nor what this mount learned since.
    pub fn has_listing(&self, now: Instant) -> bool {
        self.listing.is_some() && self.entries_valid.is_valid(now)
    }

    /// `name`'s entry in the kept listing (whatever the overlay says).
    fn listed(&self, name: &str) -> Option<&ListedEntry> {
        let (listing, _) = self.listing.as_ref()?;
        let i = listing
            .binary_search_by(|e| e.name.as_str().cmp(name))
            .ok()?;
        Some(&listing[i])
    }

    pub fn add_negative(&mut self, name: &str, valid: Validity, now: Instant) {
        if !valid.is_valid(now) {
            self.negative.remove(name);
            return;
        }
        if self.negative.len() >= NEGATIVE_MAX {
            self.negative.retain(|_, v| v.is_valid(now));
            if self.negative.len() >= NEGATIVE_MAX {
                self.negative.clear();
            }
        }
        if let Some(o) = &mut self.overlay {
            o.added.remove(name);
        }
        if self.listed(name).is_some() {
            let o = self.overlay.get_or_insert_with(Default::default);
            o.removed.insert(name.to_owned());
            self.serves_readdir = false;
        }
        self.negative.insert(name.to_owned(), valid);
    }

    /// Records a name that now exists (created here, or learned from S3).
    pub fn add_positive(&mut self, name: &str, entry: CachedEntry) {
        self.negative.remove(name);
        self.serves_readdir = false;
        if self.entries_valid != Validity::Expired {
            let o = self.overlay.get_or_insert_with(Default::default);
            o.removed.remove(name);
            o.added.insert(name.to_owned(), entry);
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Inode {
    pub ino: Ino,
    pub parent: Ino,
    pub name: String,
    /// Relative to the mount prefix: `""` for the root, `a/b` below it.
    pub path: String,
    pub kind: Kind,
    /// Kernel references (lookups, creates, readdirplus entries) not yet forgotten.
    pub lookups: u64,
    /// Changed through [`InodeTable::set_state`] between `LocalDir` and the others (the journal
    /// records whether a directory is local).
    pub state: InodeState,
    /// Files: the last known size / mtime / ETag. While writing: the local size.
    pub meta: Option<ObjectMeta>,
    /// Until when `meta` (files) or the existence (directories) is trusted.
    #[serde(skip)]
    pub valid: Validity,
    /// The ETag of the last open for reading (FOPEN_KEEP_CACHE when the next open sees the same).
    pub last_open_etag: Option<String>,
    /// Live children by name (directories).
    pub children: BTreeMap<String, Ino>,
    #[serde(skip)]
    pub cache: DirSlot,
}

impl Inode {
    pub fn is_local(&self) -> bool {
        !matches!(self.state, InodeState::Remote)
    }
}

/// Every inode the kernel may still reference, plus pinned local ones.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InodeTable {
    inodes: HashMap<Ino, Inode>,
    #[serde(skip)]
    journal: JournalLink,
    #[serde(skip)]
    reported: Reported,
}

/// Whether a table's size counts in `ferry_inodes`: a live mount's table does, from its making
/// (or [`InodeTable::report_size`]) until it is dropped; a copy (a snapshot's) does not.
#[derive(Debug, Default)]
struct Reported(bool);

impl Clone for Reported {
    fn clone(&self) -> Self {
        Reported(false)
    }
}

impl Drop for InodeTable {
    fn drop(&mut self) {
        self.report(-(self.inodes.len() as i64));
    }
}

impl Default for InodeTable {
    fn default() -> Self {
        Self::new()
    }
}

impl InodeTable {
    /// A table with just the root directory.
    pub fn new() -> Self {
        let root = Inode {
            ino: ROOT_INO,
            parent: ROOT_INO,
            name: String::new(),
            path: String::new(),
            kind: Kind::Dir,
            lookups: 0,
            state: InodeState::Remote,
            meta: None,
            valid: Validity::Forever,
            last_open_etag: None,
            children: BTreeMap::new(),
            cache: DirSlot::default(),
        };
        let table = InodeTable {
            inodes: HashMap::from([(ROOT_INO, root)]),
            journal: JournalLink::default(),
            reported: Reported(true),
        };
        table.report(1);
        table
    }

    /// Counts this table's inodes in `ferry_inodes` from now on (a table rebuilt from a
    /// snapshot); nothing if it counts already.
    pub fn report_size(&mut self) {
        if !self.reported.0 {
            self.reported.0 = true;
            self.report(self.inodes.len() as i64);
        }
    }

    fn report(&self, delta: i64) {
        if self.reported.0 {
            ferry_metrics::metrics().node.inodes.inc_by(delta);
        }
    }

    /// The table a journal describes ([`crate::journal::recovered_snapshot`]): the root, and
    /// `(record, attached)` with [`RECOVERED_LOOKUPS`] each, attached ones in their parent's
    /// directory.
    pub(crate) fn recovered(records: impl IntoIterator<Item = (InodeRecord, bool)>) -> Self {
        let mut table = InodeTable::new();
        let mut attached = Vec::new();
        for (r, is_attached) in records {
            if is_attached {
                attached.push((r.parent, r.name.clone(), r.ino));
            }
            table.report(1);
            table.inodes.insert(
                r.ino,
                Inode {
                    ino: r.ino,
                    parent: r.parent,
                    name: r.name,
                    path: r.path,
                    kind: r.kind,
                    lookups: RECOVERED_LOOKUPS,
                    state: match r.local_dir {
                        true => InodeState::LocalDir,
                        false => InodeState::Remote,
                    },
                    meta: None,
                    valid: Validity::Expired,
                    last_open_etag: None,
                    children: BTreeMap::new(),
                    cache: DirSlot::default(),
                },
            );
        }
        for (parent, name, ino) in attached {
            if let Some(p) = table.inodes.get_mut(&parent) {
                p.children.insert(name, ino);
            }
        }
        table
    }

    /// From now on, changes to the live set are appended to `journal`.
    pub(crate) fn attach_journal(&mut self, journal: Arc<Journal>) {
        self.journal = JournalLink(Some(journal));
    }

    /// The attached journal.
    pub(crate) fn journal(&self) -> Option<&Arc<Journal>> {
        self.journal.0.as_ref()
    }

    /// Whether `inode` is the child its parent's directory shows under its name.
    pub(crate) fn is_attached(&self, inode: &Inode) -> bool {
        self.inodes
            .get(&inode.parent)
            .is_some_and(|p| p.children.get(&inode.name) == Some(&inode.ino))
    }

    /// Sets `ino`'s state; journals it when the inode becomes or stops being a local directory.
    pub fn set_state(&mut self, ino: Ino, state: InodeState) {
        let Some(inode) = self.inodes.get_mut(&ino) else {
            return;
        };
        let was_local_dir = inode.state == InodeState::LocalDir;
        inode.state = state;
        if was_local_dir != (state == InodeState::LocalDir) {
            if let (Some(j), Some(inode)) = (self.journal.get(), self.inodes.get(&ino)) {
                j.inode(inode, self.is_attached(inode));
            }
        }
    }

    pub fn len(&self) -> usize {
        self.inodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inodes.is_empty()
    }

    pub fn get(&self, ino: Ino) -> Option<&Inode> {
        self.inodes.get(&ino)
    }

    pub fn get_mut(&mut self, ino: Ino) -> Option<&mut Inode> {
        self.inodes.get_mut(&ino)
    }

    /// The live child `name` of `parent`.
    pub fn child(&self, parent: Ino, name: &str) -> Option<&Inode> {
        let ino = *self.inodes.get(&parent)?.children.get(name)?;
        self.inodes.get(&ino)
    }

    /// The inode number `path` of `kind` has (or would get): the live child's if there is one.
    pub fn ino_for(&self, parent: Ino, name: &str, path: &str, kind: Kind) -> Ino {
        if let Some(child) = self.child(parent, name) {
            if child.kind == kind {
                return child.ino;
            }
        }
        (0u64..)
            .map(|probe| hash_ino(kind, path, probe))
            .find(|ino| match self.inodes.get(ino) {
                None => true,
                Some(other) => other.kind == kind && other.path == path,
            })
            .expect("2^64 probes")
    }

    /// Makes sure `parent` has a live child `name` of `kind` and returns its number. A live child
    /// of the other kind is detached (the kernel sees a new inode number, as the kind is hashed).
    pub fn install_child(&mut self, parent: Ino, name: &str, kind: Kind) -> Option<Ino> {
        let parent_path = self.inodes.get(&parent)?.path.clone();
        let path = child_path(&parent_path, name);
        let ino = self.ino_for(parent, name, &path, kind);
        let previous = self
            .inodes
            .get_mut(&parent)?
            .children
            .insert(name.to_owned(), ino);
        if let Some(old) = previous.filter(|&old| old != ino) {
            self.maybe_remove(old);
        }
        let created = !self.inodes.contains_key(&ino);
        if created {
            self.report(1);
        }
        let inode = self.inodes.entry(ino).or_insert_with(|| Inode {
            ino,
            parent,
            name: name.to_owned(),
            path,
            kind,
            lookups: 0,
            state: InodeState::Remote,
            meta: None,
            valid: Validity::Expired,
            last_open_etag: None,
            children: BTreeMap::new(),
            cache: DirSlot::default(),
        });
        // New, or a live inode (detached by one of the other kind) attached again.
        if created || previous != Some(ino) {
            if let Some(j) = self.journal.get() {
                j.inode(inode, true);
            }
        }
        Some(ino)
    }

    /// The kernel dropped `n` references.
    pub fn forget(&mut self, ino: Ino, n: u64) {
        if let Some(inode) = self.inodes.get_mut(&ino) {
            inode.lookups = inode.lookups.saturating_sub(n);
            self.maybe_remove(ino);
        }
    }

    /// Drops `ino` (and then ancestors that became unreferenced) if nothing needs it: no kernel
    /// references, not local, no live children. The root stays.
    pub fn maybe_remove(&mut self, mut ino: Ino) {
        while ino != ROOT_INO {
            let Some(inode) = self.inodes.get(&ino) else {
                return;
            };
            if inode.lookups > 0 || inode.is_local() || !inode.children.is_empty() {
                return;
            }
            let inode = self.inodes.remove(&ino).expect("just seen");
            self.report(-1);
            if let Some(j) = self.journal.get() {
                j.removed(ino);
            }
            let Some(parent) = self.inodes.get_mut(&inode.parent) else {
                return;
            };
            if parent.children.get(&inode.name) == Some(&ino) {
                parent.children.remove(&inode.name);
            }
            ino = inode.parent;
        }
    }

    /// Every inode, for checks and snapshots.
    pub fn iter(&self) -> impl Iterator<Item = &Inode> {
        self.inodes.values()
    }
}

/// Stable across processes and versions (unlike `DefaultHasher`): FNV-1a, then a SplitMix64 finish.
fn hash_ino(kind: Kind, path: &str, probe: u64) -> Ino {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let kind_byte = match kind {
        Kind::File => b'f',
        Kind::Dir => b'd',
    };
    let mut h = FNV_OFFSET;
    for &b in std::iter::once(&kind_byte)
        .chain(path.as_bytes())
        .chain(&probe.to_le_bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    // 0 is not an inode number and 1 is the root.
    if h <= ROOT_INO {
        h + 2
    } else {
        h
    }
}

/// Seconds-precision "now", like S3's Last-Modified.
pub fn now_secs() -> SystemTime {
    let now = SystemTime::now();
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(names: &[&str]) -> Arc<Vec<ListedEntry>> {
        Arc::new(
            names
                .iter()
                .map(|n| ListedEntry {
                    name: (*n).to_owned(),
                    kind: Kind::File,
                    meta: Some(ObjectMeta {
                        size: n.len() as u64,
                        mtime: None,
                        etag: Some(format!("\"{n}\"")),
                    }),
                })
                .collect(),
        )
    }

    #[test]
    fn an_inode_stays_small() {
        // Most inodes are files: what only directories need is boxed.
        assert!(
            std::mem::size_of::<Inode>() <= 224,
            "{} bytes",
            std::mem::size_of::<Inode>()
        );
    }

    #[test]
    fn a_kept_listing_answers_lookups_under_what_the_mount_learned_since() {
        let budget = crate::MemoryBudget::new(1 << 20);
        let now = Instant::now();
        let mut c = DirCache::default();
        c.clear(Validity::Forever);
        let l = listed(&["a", "b", "c"]);
        let charge = budget
            .try_reserve_for(crate::budget::Use::Listing, kept_listing_bytes(&l))
            .unwrap();
        c.keep(l, now, charge);
        assert!(c.cached_listing(now).is_some());
        assert_eq!(c.cached("b", now).unwrap().1.unwrap().size, 1);
        assert!(c.cached("z", now).is_none());

        // Found missing: hidden, and the listing no longer serves readdir; the rest still answer.
        c.add_negative("b", Validity::Forever, now);
        assert!(c.cached("b", now).is_none());
        assert!(c.cached_listing(now).is_none());
        assert!(c.cached("a", now).is_some());
        // Created again (or learned): the overlay wins over the listing.
        let meta = ObjectMeta {
            size: 9,
            mtime: None,
            etag: None,
        };
        c.add_positive(
            "b",
            CachedEntry {
                kind: Kind::File,
                meta: Some(meta.clone()),
            },
        );
        assert_eq!(c.cached("b", now).unwrap().1, Some(&meta));
        c.add_positive(
            "new",
            CachedEntry {
                kind: Kind::Dir,
                meta: None,
            },
        );
        assert_eq!(c.cached("new", now).unwrap().0, Kind::Dir);
        assert!(budget.used() > 0);

        // Relisted: the overlay goes, and the charge with the old listing.
        c.clear(Validity::Forever);
        assert!(c.cached("a", now).is_none());
        assert!(c.cached("new", now).is_none());
        assert_eq!(budget.used(), 0);
        // Past its validity nothing answers.
        let mut c = DirCache::default();
        c.clear(Validity::Until(now + std::time::Duration::from_secs(1)));
        let charge = budget
            .try_reserve_for(crate::budget::Use::Listing, 1)
            .unwrap();
        c.keep(listed(&["a"]), now, charge);
        assert!(c.cached("a", now).is_some());
        let later = now + std::time::Duration::from_secs(2);
        assert!(c.cached("a", later).is_none());
        assert!(c.cached_listing(later).is_none());
    }

    #[test]
    fn inos_are_stable_and_distinct() {
        let mut t = InodeTable::new();
        let a = t.install_child(ROOT_INO, "a", Kind::Dir).unwrap();
        let f = t.install_child(a, "f", Kind::File).unwrap();
        assert_ne!(a, f);
        assert_ne!(a, ROOT_INO);
        assert_eq!(t.ino_for(a, "f", "a/f", Kind::File), f);
        assert_ne!(t.ino_for(ROOT_INO, "a", "a", Kind::File), a);
        assert_eq!(
            hash_ino(Kind::File, "a/f", 0),
            hash_ino(Kind::File, "a/f", 0)
        );
    }

    #[test]
    fn forget_drops_unreferenced_and_cascades() {
        let mut t = InodeTable::new();
        let a = t.install_child(ROOT_INO, "a", Kind::Dir).unwrap();
        t.get_mut(a).unwrap().lookups = 1;
        let f = t.install_child(a, "f", Kind::File).unwrap();
        t.get_mut(f).unwrap().lookups = 2;
        t.forget(a, 1);
        assert!(t.get(a).is_some(), "kept while a child lives");
        t.forget(f, 1);
        assert!(t.get(f).is_some());
        t.forget(f, 1);
        assert!(t.get(f).is_none());
        assert!(t.get(a).is_none());
        assert_eq!(t.len(), 1);
        // Same path, same number after being forgotten.
        let a2 = t.install_child(ROOT_INO, "a", Kind::Dir).unwrap();
        assert_eq!(a, a2);
    }

    #[test]
    fn local_inodes_are_pinned() {
        let mut t = InodeTable::new();
        let d = t.install_child(ROOT_INO, "d", Kind::Dir).unwrap();
        t.get_mut(d).unwrap().state = InodeState::LocalDir;
        t.forget(d, 1);
        assert!(t.get(d).is_some());
        t.get_mut(d).unwrap().state = InodeState::Remote;
        t.maybe_remove(d);
        assert!(t.get(d).is_none());
    }

    #[test]
    fn validity() {
        let now = Instant::now();
        assert!(
            !Validity::new(MetadataTtl::Duration(std::time::Duration::ZERO), now).is_valid(now)
        );
        assert!(Validity::new(MetadataTtl::Indefinite, now).is_valid(now));
        let v = Validity::new(
            MetadataTtl::Duration(std::time::Duration::from_secs(1)),
            now,
        );
        assert!(v.is_valid(now));
        assert!(!v.is_valid(now + std::time::Duration::from_secs(1)));
    }
}
