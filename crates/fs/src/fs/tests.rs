//! Unit tests of the core on `MemoryStore` (no FUSE).

use std::ffi::OsStr;
use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use ferry_store::{ListPage, MemoryStore, ObjectInfo, PutResult};

use super::*;
use crate::config::MetadataTtl;

const B: &str = "bkt";
const PID: u32 = 42;

fn setup(tweak: impl FnOnce(&mut MountConfig)) -> (MemoryStore, Fs) {
    let store = MemoryStore::new();
    store.create_bucket(B);
    let mut cfg = MountConfig::new(B);
    cfg.read_only = false;
    cfg.allow_delete = true;
    cfg.allow_overwrite = true;
    cfg.uid = 1000;
    cfg.gid = 2000;
    tweak(&mut cfg);
    cfg.validate().unwrap();
    let fs = Fs::new(Arc::new(store.clone()), cfg);
    (store, fs)
}

fn n(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(seed as u32 % 31) as u8
                ^ seed
        })
        .collect()
}

#[derive(Default)]
struct VecSink {
    cap: usize,
    got: Vec<(String, Ino, u64, Kind, Attr)>,
}

impl DirSink for VecSink {
    fn add(&mut self, e: &DirEntry<'_>) -> bool {
        if self.got.len() >= self.cap {
            return true;
        }
        self.got
            .push((e.name.to_owned(), e.ino, e.offset, e.kind, e.attr.clone()));
        false
    }
}

/// Every entry (`.` and `..` included) of directory handle `fh` from its start, as the sink got
/// them, read in batches of `batch`.
async fn read_handle(
    fs: &Fs,
    ino: Ino,
    fh: u64,
    batch: usize,
    plus: bool,
) -> Vec<(String, Ino, u64, Kind, Attr)> {
    read_handle_from(fs, ino, fh, 0, batch, plus).await
}

/// [`read_handle`] from `offset` on.
async fn read_handle_from(
    fs: &Fs,
    ino: Ino,
    fh: u64,
    mut offset: u64,
    batch: usize,
    plus: bool,
) -> Vec<(String, Ino, u64, Kind, Attr)> {
    let mut out = Vec::new();
    loop {
        let mut sink = VecSink {
            cap: batch,
            got: Vec::new(),
        };
        fs.readdir(ino, fh, offset, plus, &mut sink).await.unwrap();
        let Some(last) = sink.got.last() else {
            return out;
        };
        offset = last.2;
        out.extend(sink.got);
    }
}

/// Every entry (without `.` and `..`) of the directory, read in batches of `batch`.
async fn list_batched(fs: &Fs, ino: Ino, batch: usize, plus: bool) -> Vec<(String, Kind, Attr)> {
    let fh = fs.opendir(ino).unwrap().fh;
    let out = read_handle(fs, ino, fh, batch, plus).await;
    fs.releasedir(fh);
    out.into_iter()
        .filter(|(name, ..)| name != "." && name != "..")
        .map(|(name, _, _, kind, attr)| (name, kind, attr))
        .collect()
}

async fn names(fs: &Fs, ino: Ino) -> Vec<(String, Kind)> {
    list_batched(fs, ino, 1000, false)
        .await
        .into_iter()
        .map(|(name, kind, _)| (name, kind))
        .collect()
}

/// Looks up each segment of `path` (as the kernel's path walk does).
async fn walk(fs: &Fs, path: &str) -> Result<Entry, FsError> {
    let mut entry = fs.getattr(ROOT_INO).await?;
    for seg in path.split('/').filter(|s| !s.is_empty()) {
        entry = fs.lookup(entry.attr.ino, n(seg)).await?;
    }
    Ok(entry)
}

async fn read_all(fs: &Fs, ino: Ino, chunk: u32) -> Vec<u8> {
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let mut out = Vec::new();
    loop {
        let got = fs.read(o.fh, out.len() as u64, chunk).await.unwrap();
        if got.is_empty() {
            break;
        }
        out.extend_from_slice(&got);
    }
    fs.release(o.fh).await.unwrap();
    out
}

async fn write_new(fs: &Fs, parent: Ino, name: &str, bytes: &[u8], chunk: usize) -> Ino {
    let (e, o) = fs.create(parent, n(name), PID).await.unwrap();
    let mut off = 0;
    for c in bytes.chunks(chunk.max(1)) {
        assert_eq!(fs.write(o.fh, off, c).await.unwrap() as usize, c.len());
        off += c.len() as u64;
    }
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    e.attr.ino
}

fn errno<T: std::fmt::Debug>(r: Result<T, FsError>) -> i32 {
    r.expect_err("expected an error").errno()
}

#[tokio::test]
async fn lookup_getattr_read() {
    let (store, fs) = setup(|_| {});
    let big = data(300 * 1024, 3);
    store.insert(B, "a.txt", &b"hello"[..]);
    store.insert(B, "dir/b.bin", big.clone());

    let a = walk(&fs, "a.txt").await.unwrap();
    assert_eq!(a.attr.kind, Kind::File);
    assert_eq!(a.attr.size, 5);
    assert_eq!(
        (a.attr.perm, a.attr.uid, a.attr.gid, a.attr.nlink),
        (0o644, 1000, 2000, 1)
    );
    assert_eq!(a.ttl, Duration::from_secs(1));
    let d = walk(&fs, "dir").await.unwrap();
    assert_eq!(
        (d.attr.kind, d.attr.perm, d.attr.nlink),
        (Kind::Dir, 0o755, 2)
    );
    let b = walk(&fs, "dir/b.bin").await.unwrap();
    assert_eq!(b.attr.size, big.len() as u64);
    assert_eq!(
        fs.getattr(b.attr.ino).await.unwrap().attr.size,
        big.len() as u64
    );
    assert_eq!(read_all(&fs, a.attr.ino, 4096).await, b"hello");
    assert_eq!(read_all(&fs, b.attr.ino, 128 * 1024).await, big);
    assert_eq!(read_all(&fs, b.attr.ino, 7000).await, big);

    assert_eq!(errno(walk(&fs, "nope").await), libc::ENOENT);
    assert_eq!(errno(walk(&fs, "a.txt/x").await), libc::ENOTDIR);
    assert_eq!(
        errno(fs.open(d.attr.ino, libc::O_RDONLY, PID).await),
        libc::EISDIR
    );
    assert_eq!(errno(fs.opendir(a.attr.ino)), libc::ENOTDIR);
    // Same path, same inode number.
    assert_eq!(walk(&fs, "dir/b.bin").await.unwrap().attr.ino, b.attr.ino);
}

#[tokio::test]
async fn empty_file_reads_without_get() {
    let (store, fs) = setup(|_| {});
    store.insert(B, "empty", Vec::new());
    let e = walk(&fs, "empty").await.unwrap();
    assert_eq!(read_all(&fs, e.attr.ino, 4096).await, b"");
    assert_eq!(store.stats().get, 0);
}

#[tokio::test]
async fn implicit_dirs_and_markers() {
    let (store, fs) = setup(|_| {});
    store.insert(B, "x/y/z", &b"1"[..]);
    store.insert(B, "m/", Vec::new());
    store.insert(B, "m2/", Vec::new());
    store.insert(B, "m2/f", &b"22"[..]);
    assert_eq!(
        names(&fs, ROOT_INO).await,
        [
            ("m".to_owned(), Kind::Dir),
            ("m2".to_owned(), Kind::Dir),
            ("x".to_owned(), Kind::Dir)
        ]
    );
    let m = walk(&fs, "m").await.unwrap();
    assert_eq!(m.attr.kind, Kind::Dir);
    assert!(names(&fs, m.attr.ino).await.is_empty());
    let m2 = walk(&fs, "m2").await.unwrap();
    assert_eq!(
        names(&fs, m2.attr.ino).await,
        [("f".to_owned(), Kind::File)]
    );
    let y = walk(&fs, "x/y").await.unwrap();
    assert_eq!(y.attr.kind, Kind::Dir);
    assert_eq!(names(&fs, y.attr.ino).await, [("z".to_owned(), Kind::File)]);
}

#[tokio::test]
async fn mount_prefix_scopes_everything() {
    let (store, fs) = setup(|c| c.prefix = "data/".into());
    store.insert(B, "data/a", &b"A"[..]);
    store.insert(B, "datafile", &b"no"[..]);
    store.insert(B, "other/b", &b"no"[..]);
    assert_eq!(names(&fs, ROOT_INO).await, [("a".to_owned(), Kind::File)]);
    assert_eq!(errno(walk(&fs, "other").await), libc::ENOENT);
    write_new(&fs, ROOT_INO, "new", b"N", 1).await;
    assert_eq!(store.get_object(B, "data/new").unwrap(), &b"N"[..]);
}

#[tokio::test]
async fn weird_keys_are_hidden_and_directory_wins() {
    let (store, fs) = setup(|_| {});
    let long = "L".repeat(256);
    for key in [
        "a//b".to_owned(),
        "./c".to_owned(),
        "../d".to_owned(),
        "e/./f".to_owned(),
        "e/../g".to_owned(),
        long.clone(),
        format!("{long}/h"),
        "dup".to_owned(),
        "dup/inner".to_owned(),
        "ok".to_owned(),
        "ünï cödé ✓".to_owned(),
    ] {
        store.insert(B, &key, &b"x"[..]);
    }
    assert_eq!(
        names(&fs, ROOT_INO).await,
        [
            ("a".to_owned(), Kind::Dir),
            ("dup".to_owned(), Kind::Dir),
            ("e".to_owned(), Kind::Dir),
            ("ok".to_owned(), Kind::File),
            ("ünï cödé ✓".to_owned(), Kind::File),
        ]
    );
    let a = walk(&fs, "a").await.unwrap();
    assert!(names(&fs, a.attr.ino).await.is_empty(), "a//b is hidden");
    let e = walk(&fs, "e").await.unwrap();
    assert!(names(&fs, e.attr.ino).await.is_empty());
    // The directory wins on lookup too (the LIST proves it), even though a HEAD would succeed.
    assert_eq!(walk(&fs, "dup").await.unwrap().attr.kind, Kind::Dir);
    assert_eq!(walk(&fs, "dup/inner").await.unwrap().attr.kind, Kind::File);
    assert_eq!(errno(walk(&fs, &long).await), libc::ENAMETOOLONG);
    assert_eq!(
        walk(&fs, "ünï cödé ✓").await.unwrap().attr.size,
        1,
        "non-ASCII names work"
    );
}

#[tokio::test]
async fn pagination_lists_every_entry_once_with_stable_offsets() {
    let (store, fs) = setup(|_| {});
    let total = 2500;
    for i in 0..total {
        store.insert(B, &format!("big/f{i:05}"), &b"x"[..]);
    }
    for i in 0..20 {
        store.insert(B, &format!("big/sub{i:02}/x"), &b"x"[..]);
    }
    let big = walk(&fs, "big").await.unwrap().attr.ino;
    store.reset_stats();
    let all = list_batched(&fs, big, 37, false).await;
    assert_eq!(all.len(), total + 20);
    let mut seen: Vec<_> = all.iter().map(|(name, ..)| name.clone()).collect();
    let listed = seen.clone();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), total + 20, "every entry exactly once");
    assert_eq!(listed, seen, "in name order");
    // 2520 entries = 3 pages of 1000, the first one listed by walk's lookup, the second in
    // two halves; the range guessed past the end may be asked too (it is not waited for).
    let lists = store.stats().list;
    assert!((3..=4).contains(&lists), "{lists} LISTs");

    // Offsets index the snapshot taken at the first readdir: a key added meanwhile neither shifts
    // nor duplicates entries; a rewind (offset 0 again) within the TTL is served from the cached
    // listing (see listing_cache_serves_new_opendirs_within_the_ttl for after it).
    let fh = fs.opendir(big).unwrap().fh;
    let mut sink = VecSink {
        cap: 100,
        got: Vec::new(),
    };
    fs.readdir(big, fh, 0, false, &mut sink).await.unwrap();
    let resume = sink.got.last().unwrap().2;
    store.insert(B, "big/a-new-first-entry", &b"x"[..]);
    let mut rest = VecSink {
        cap: usize::MAX,
        got: Vec::new(),
    };
    fs.readdir(big, fh, resume, false, &mut rest).await.unwrap();
    assert_eq!(sink.got.len() - 2 + rest.got.len(), total + 20);
    assert!(rest
        .got
        .iter()
        .all(|(name, ..)| name != "a-new-first-entry"));
    // Re-reading from an old offset gives the same entries.
    let mut again = VecSink {
        cap: 5,
        got: Vec::new(),
    };
    fs.readdir(big, fh, resume, false, &mut again)
        .await
        .unwrap();
    assert_eq!(
        again.got.iter().map(|e| &e.0).collect::<Vec<_>>(),
        rest.got[..5].iter().map(|e| &e.0).collect::<Vec<_>>()
    );
    let mut rewound = VecSink {
        cap: usize::MAX,
        got: Vec::new(),
    };
    fs.readdir(big, fh, 0, false, &mut rewound).await.unwrap();
    assert_eq!(rewound.got.len(), total + 20 + 2);
    assert_eq!(store.stats().list, lists, "served from the listing cache");
    fs.releasedir(fh);
    assert_eq!(fs.table_sizes().1, 0);
}

#[tokio::test]
async fn ls_la_needs_no_head_per_entry() {
    let (store, fs) = setup(|_| {});
    for i in 0..50 {
        store.insert(B, &format!("d/f{i}"), data(i, 1));
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    store.reset_stats();
    // readdir, then a lookup + getattr per entry (what `ls -la` does without readdirplus).
    let listed = names(&fs, d).await;
    for (name, _) in &listed {
        let e = fs.lookup(d, n(name)).await.unwrap();
        let a = fs.getattr(e.attr.ino).await.unwrap();
        assert_eq!(a.attr.size, name[1..].parse::<u64>().unwrap());
    }
    let s = store.stats();
    assert_eq!(
        (s.list, s.head, s.get),
        (0, 0, 0),
        "the listing is the page walk's lookup of d listed: {s:?}"
    );
}

#[tokio::test]
async fn readdirplus_counts_lookups_and_forget_empties_the_table() {
    let (store, fs) = setup(|_| {});
    for i in 0..30 {
        store.insert(B, &format!("f{i:02}"), data(i, 2));
    }
    store.insert(B, "sub/x", &b"x"[..]);
    let entries = list_batched(&fs, ROOT_INO, 7, true).await;
    assert_eq!(entries.len(), 31);
    for (name, kind, attr) in &entries {
        if *kind == Kind::File {
            assert_eq!(attr.size, name[1..].parse::<u64>().unwrap());
        }
    }
    assert_eq!(fs.table_sizes().0, 32);
    store.reset_stats();
    // Everything readdirplus returned is answered from the table.
    for (name, ..) in &entries {
        let e = fs.lookup(ROOT_INO, n(name)).await.unwrap();
        fs.getattr(e.attr.ino).await.unwrap();
        fs.forget(e.attr.ino, 2);
    }
    assert_eq!(store.stats().total_requests(), 0);
    assert_eq!(fs.table_sizes(), (1, 0), "forget drops every inode");
}

#[tokio::test]
async fn forget_keeps_table_bounded_and_inos_stable() {
    let (store, fs) = setup(|_| {});
    for i in 0..100 {
        store.insert(B, &format!("a/b/f{i}"), &b"x"[..]);
    }
    let mut first = Vec::new();
    for i in 0..100 {
        let e = walk(&fs, &format!("a/b/f{i}")).await.unwrap();
        first.push(e.attr.ino);
    }
    let a = walk(&fs, "a").await.unwrap().attr.ino;
    let b = walk(&fs, "a/b").await.unwrap().attr.ino;
    assert_eq!(fs.table_sizes().0, 103);
    for ino in &first {
        fs.forget(*ino, 1);
    }
    fs.forget(b, 101);
    fs.forget(a, 102);
    assert_eq!(fs.table_sizes().0, 1);
    for (i, ino) in first.iter().enumerate() {
        assert_eq!(
            walk(&fs, &format!("a/b/f{i}")).await.unwrap().attr.ino,
            *ino
        );
    }
}

#[tokio::test(start_paused = true)]
async fn ttl_and_negative_cache() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(10)));
    assert_eq!(errno(fs.lookup(ROOT_INO, n("late")).await), libc::ENOENT);
    let s = store.stats();
    assert_eq!((s.head, s.list), (1, 1), "HEAD and LIST once");
    store.insert(B, "late", &b"123"[..]);
    assert_eq!(errno(fs.lookup(ROOT_INO, n("late")).await), libc::ENOENT);
    assert_eq!(
        store.stats().total_requests(),
        2,
        "answered by the negative cache"
    );
    tokio::time::advance(Duration::from_secs(11)).await;
    let e = fs.lookup(ROOT_INO, n("late")).await.unwrap();
    assert_eq!(e.attr.size, 3);

    // Positive entries: trusted for the TTL, then refreshed with a HEAD.
    store.reset_stats();
    store.insert(B, "late", &b"12345"[..]);
    assert_eq!(fs.getattr(e.attr.ino).await.unwrap().attr.size, 3);
    assert_eq!(fs.lookup(ROOT_INO, n("late")).await.unwrap().attr.size, 3);
    assert_eq!(store.stats().total_requests(), 0);
    tokio::time::advance(Duration::from_secs(11)).await;
    assert_eq!(fs.getattr(e.attr.ino).await.unwrap().attr.size, 5);
    assert_eq!(store.stats().head, 1);
}

#[tokio::test(start_paused = true)]
async fn indefinite_ttl_never_expires() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Indefinite);
    store.insert(B, "f", &b"1"[..]);
    let e = fs.lookup(ROOT_INO, n("f")).await.unwrap();
    assert!(e.ttl > Duration::from_secs(365 * 24 * 3600));
    assert_eq!(errno(fs.lookup(ROOT_INO, n("missing")).await), libc::ENOENT);
    store.insert(B, "missing", &b"1"[..]);
    store.insert(B, "f", &b"changed"[..]);
    // The first lookup's one-page listing of the directory runs in the background: let it.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    store.reset_stats();
    tokio::time::advance(Duration::from_secs(10_000_000)).await;
    assert_eq!(fs.getattr(e.attr.ino).await.unwrap().attr.size, 1);
    assert_eq!(errno(fs.lookup(ROOT_INO, n("missing")).await), libc::ENOENT);
    assert_eq!(store.stats().total_requests(), 0);
}

#[tokio::test]
async fn zero_ttl_always_asks_s3() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO));
    store.insert(B, "f", &b"1"[..]);
    let e = fs.lookup(ROOT_INO, n("f")).await.unwrap();
    assert_eq!(e.ttl, Duration::ZERO);
    store.reset_stats();
    fs.getattr(e.attr.ino).await.unwrap();
    fs.lookup(ROOT_INO, n("f")).await.unwrap();
    let s = store.stats();
    assert_eq!((s.head, s.list), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn an_open_that_finds_a_new_version_has_the_kernel_drop_the_old_ones_size_and_pages() {
    // A mount that keeps metadata for its life: the kernel never asks for the size again by
    // itself, so without the drop it would stop reading the grown object at the old size.
    let (store, fs) = setup(|c| {
        c.read_only = true;
        c.metadata_ttl = MetadataTtl::Indefinite;
    });
    let dropped: Arc<std::sync::Mutex<Vec<Ino>>> = Default::default();
    let seen = dropped.clone();
    fs.set_kernel_invalidator(KernelInvalidator::new(move |ino| {
        seen.lock().unwrap().push(ino)
    }));
    store.insert(B, "f", &b"old"[..]);
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    assert_eq!(&fs.read(o.fh, 0, 3).await.unwrap()[..], b"old");
    fs.release(o.fh).await.unwrap();
    store.insert(B, "f", &b"newer and longer"[..]);
    // The kept metadata: the old version, refused by S3 at the read (its pages were dropped).
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    assert_eq!(errno(fs.read(o.fh, 0, 4096).await), libc::ESTALE);
    fs.release(o.fh).await.unwrap();
    assert!(
        dropped.lock().unwrap().is_empty(),
        "the same version: nothing to drop"
    );
    // The next open learns the new version, and the kernel forgets the old one's size before
    // the open is answered.
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    assert_eq!(*dropped.lock().unwrap(), [ino]);
    assert_eq!(fs.getattr(ino).await.unwrap().attr.size, 16);
    assert_eq!(
        &fs.read(o.fh, 0, 4096).await.unwrap()[..],
        b"newer and longer"
    );
    fs.release(o.fh).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_file_open_for_reading_is_not_replaced_beside_its_reader() {
    // The kernel has one size and one page cache per inode: a replacement written beside a
    // reader would hand the reader the new bytes (or the new size) as its version's.
    let (store, fs) = setup(|_| {});
    store.insert(B, "f", &b"version one"[..]);
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let r = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let trunc = libc::O_WRONLY | libc::O_TRUNC;
    let started = tokio::time::Instant::now();
    assert_eq!(errno(fs.open(ino, trunc, PID).await), libc::EBUSY);
    assert!(
        started.elapsed() >= read::READERS_WAIT,
        "waited for the reader's last close first"
    );
    // Deleted and created again by name (the same inode number): the same.
    fs.unlink(ROOT_INO, n("f")).await.unwrap();
    assert_eq!(errno(fs.create(ROOT_INO, n("f"), PID).await), libc::EBUSY);
    // A reader's last close reaches Ferry after its close returned: a replacement arriving
    // first waits for it.
    let fs = Arc::new(fs);
    let f2 = fs.clone();
    let replace = tokio::spawn(async move { f2.create(ROOT_INO, n("f"), PID).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    fs.release(r.fh).await.unwrap();
    let (_, w) = replace.await.unwrap().unwrap();
    fs.write(w.fh, 0, b"version two").await.unwrap();
    fs.release(w.fh).await.unwrap();
    assert_eq!(store.get_object(B, "f").unwrap(), &b"version two"[..]);
}

#[tokio::test(start_paused = true)]
async fn changed_object_is_estale_and_reopen_sees_new_version() {
    let (store, fs) = setup(|_| {});
    let v1 = data(3 << 20, 1);
    store.insert(B, "f", v1.clone());
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(!o.keep_cache);
    assert_eq!(&fs.read(o.fh, 0, 10).await.unwrap()[..], &v1[..10]);
    // Served from the read-ahead buffer (same version): fine.
    assert_eq!(&fs.read(o.fh, 10, 100).await.unwrap()[..], &v1[10..110]);
    let v2 = data(3 << 20, 2);
    store.insert(B, "f", v2.clone());
    // A GET outside the buffer carries If-Match with the ETag of the open: refused.
    assert_eq!(
        errno(fs.read(o.fh, (5 << 19) + 7, 4096).await),
        libc::ESTALE
    );
    fs.release(o.fh).await.unwrap();
    // A new open after the TTL pins the new version (no page-cache reuse: the ETag changed).
    tokio::time::advance(Duration::from_secs(2)).await;
    let o2 = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(!o2.keep_cache);
    assert_eq!(&fs.read(o2.fh, 0, 64).await.unwrap()[..], &v2[..64]);
    fs.release(o2.fh).await.unwrap();
    // Deleted object: ESTALE too.
    let o3 = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(o3.keep_cache, "same ETag as the previous open");
    fs.unlink(ROOT_INO, n("f")).await.unwrap();
    assert_eq!(errno(fs.read(o3.fh, 1 << 20, 10).await), libc::ESTALE);
    fs.release(o3.fh).await.unwrap();
}

#[tokio::test]
async fn sequential_reads_use_growing_windows_random_reads_do_not() {
    let (store, fs) = setup(|_| {});
    let body = data(20 << 20, 5);
    store.insert(B, "big", body.clone());
    let ino = walk(&fs, "big").await.unwrap().attr.ino;
    store.reset_stats();
    assert_eq!(read_all(&fs, ino, 128 * 1024).await, body);
    let s = store.stats();
    // The initial 1 MiB window, then whole 8 MiB parts on part boundaries: [0, 1), [1, 8),
    // [8, 16), [16, 20) MiB. Not 160 GETs of the reads' size, nor a window doubling through
    // 1, 2, 3, 5 MiB GETs cut wherever it ended.
    assert_eq!(s.get, 4, "{s:?}");
    assert_eq!(s.get_bytes, body.len() as u64, "nothing fetched twice");

    store.reset_stats();
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    for &off in &[15u64 << 20, 3 << 20, 9 << 20, 1 << 20] {
        let got = fs.read(o.fh, off, 4096).await.unwrap();
        assert_eq!(&got[..], &body[off as usize..off as usize + 4096]);
    }
    // Past the end: empty, no GET.
    assert!(fs.read(o.fh, 20 << 20, 4096).await.unwrap().is_empty());
    let s = store.stats();
    assert_eq!(
        (s.get, s.get_bytes),
        (4, 4 * (64 << 10)),
        "random reads fetch what they ask, rounded out to 64 KiB"
    );
    fs.release(o.fh).await.unwrap();
}

/// A reader that takes only the head of a large object (a file type sniffed, a header parsed)
/// costs the initial window, not a part; one that reads on past half of it gets whole parts.
#[tokio::test]
async fn a_stream_fetches_whole_parts_only_once_it_reads_past_half_its_first_window() {
    let (store, fs) = setup(|_| {});
    let body = data(40 << 20, 6);
    store.insert(B, "big", body.clone());
    let ino = walk(&fs, "big").await.unwrap().attr.ino;
    store.reset_stats();
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    // Reads on from `from` in 128 KiB reads up to `to`, checking the bytes.
    let read_to = |from: u64, to: u64| {
        let (fs, body) = (&fs, &body);
        async move {
            let mut off = from;
            while off < to {
                let got = fs.read(o.fh, off, 128 << 10).await.unwrap();
                assert_eq!(&got[..], &body[off as usize..off as usize + got.len()]);
                off += got.len() as u64;
            }
        }
    };
    read_to(0, 256 << 10).await;
    let s = store.stats();
    assert_eq!(
        (s.get, s.get_bytes),
        (1, 1 << 20),
        "the initial window only"
    );
    read_to(256 << 10, 40 << 20).await;
    fs.release(o.fh).await.unwrap();
    let s = store.stats();
    // [0, 1), [1, 8), then [8, 16) … [32, 40) MiB.
    assert_eq!((s.get, s.get_bytes), (6, 40 << 20), "{s:?}");
}

#[tokio::test]
async fn concurrent_reads_on_one_handle() {
    let (store, fs) = setup(|_| {});
    let body = data(4 << 20, 9);
    store.insert(B, "f", body.clone());
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let fs = Arc::new(fs);
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let chunk = 128 * 1024u64;
    let tasks: Vec<_> = (0..32u64)
        .map(|i| {
            let fs = fs.clone();
            tokio::spawn(async move { (i, fs.read(o.fh, i * chunk, chunk as u32).await) })
        })
        .collect();
    for t in tasks {
        let (i, got) = t.await.unwrap();
        let got = got.unwrap();
        assert_eq!(
            &got[..],
            &body[(i * chunk) as usize..((i + 1) * chunk) as usize]
        );
    }
    fs.release(o.fh).await.unwrap();
}

#[tokio::test]
async fn small_write_is_one_put_visible_at_flush() {
    let (store, fs) = setup(|_| {});
    let (e, o) = fs.create(ROOT_INO, n("new.txt"), PID).await.unwrap();
    assert_eq!(e.ttl, Duration::ZERO);
    assert_eq!(fs.write(o.fh, 0, b"hello ").await.unwrap(), 6);
    assert_eq!(fs.write(o.fh, 6, b"world").await.unwrap(), 5);
    assert_eq!(fs.getattr(e.attr.ino).await.unwrap().attr.size, 11);
    assert!(
        store.get_object(B, "new.txt").is_none(),
        "not visible before flush"
    );
    assert_eq!(
        errno(fs.open(e.attr.ino, libc::O_RDONLY, PID).await),
        libc::EBUSY
    );
    // A flush from another process (a forked child closing its copy) does not complete it.
    fs.flush(o.fh, || PID + 1).await.unwrap();
    assert!(store.get_object(B, "new.txt").is_none());
    fs.flush(o.fh, || PID).await.unwrap();
    assert_eq!(store.get_object(B, "new.txt").unwrap(), &b"hello world"[..]);
    assert_eq!(errno(fs.write(o.fh, 11, b"!").await), libc::EBADF);
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    let s = store.stats();
    assert_eq!((s.put, s.create_multipart), (1, 0));
    assert_eq!(read_all(&fs, e.attr.ino, 4096).await, b"hello world");
    assert_eq!(
        names(&fs, ROOT_INO).await,
        [("new.txt".to_owned(), Kind::File)]
    );
    assert_eq!(fs.getattr(e.attr.ino).await.unwrap().attr.size, 11);
}

#[tokio::test]
async fn empty_file_via_release_only() {
    let (store, fs) = setup(|_| {});
    let (_, o) = fs.create(ROOT_INO, n("touched"), PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    assert_eq!(store.get_object(B, "touched").unwrap().len(), 0);
}

/// `tempfile`, `mkstemp` + close + unlink, lock files: a file closed with nothing written is
/// completed at its last close, which reaches Ferry after `close` returned. An unlink or an open
/// arriving first waits for it, instead of `EBUSY`.
#[tokio::test(start_paused = true)]
async fn a_file_closed_with_nothing_written_can_be_removed_or_opened_at_once() {
    let (store, fs) = setup(|_| {});
    let fs = Arc::new(fs);
    for then_open in [false, true] {
        let (e, o) = fs.create(ROOT_INO, n("tmp"), PID).await.unwrap();
        fs.flush(o.fh, || PID).await.unwrap();
        let f2 = fs.clone();
        let next = tokio::spawn(async move {
            match then_open {
                false => f2.unlink(ROOT_INO, n("tmp")).await.map(|_| None),
                true => f2.open(e.attr.ino, libc::O_RDONLY, PID).await.map(Some),
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        fs.release(o.fh).await.unwrap();
        match next.await.unwrap().unwrap() {
            None => assert!(store.get_object(B, "tmp").is_none(), "removed"),
            Some(r) => {
                assert!(fs.read(r.fh, 0, 10).await.unwrap().is_empty());
                fs.release(r.fh).await.unwrap();
                fs.unlink(ROOT_INO, n("tmp")).await.unwrap();
            }
        }
    }
    // A writer that keeps its file open: EBUSY after the wait, as before.
    let (e, o) = fs.create(ROOT_INO, n("held"), PID).await.unwrap();
    assert_eq!(errno(fs.unlink(ROOT_INO, n("held")).await), libc::EBUSY);
    assert_eq!(
        errno(fs.open(e.attr.ino, libc::O_RDONLY, PID).await),
        libc::EBUSY
    );
    fs.release(o.fh).await.unwrap();
}

/// The shell's `> file`: open, dup2 onto stdout, close the first descriptor (a flush with
/// nothing written), then write through the duplicate and close it.
#[tokio::test]
async fn a_flush_before_the_first_write_completes_nothing() {
    let (store, fs) = setup(|_| {});
    let (_, o) = fs.create(ROOT_INO, n("redirected"), PID).await.unwrap();
    fs.flush(o.fh, || PID).await.unwrap();
    assert!(store.get_object(B, "redirected").is_none());
    assert_eq!(fs.write(o.fh, 0, b"hi\n").await.unwrap(), 3);
    fs.flush(o.fh, || PID).await.unwrap();
    assert_eq!(store.get_object(B, "redirected").unwrap(), &b"hi\n"[..]);
    fs.release(o.fh).await.unwrap();
    assert_eq!(store.stats().put, 1, "one PUT, of the data");
}

/// Handles the kernel never released when the session ends (the unmount cut their `release`
/// off): an empty new file is completed, a file with data no close completed is abandoned (no
/// truncated object, no multipart upload left), a replacement with nothing written leaves the old
/// object.
#[tokio::test]
async fn teardown_settles_unreleased_write_handles() {
    let (store, fs) = setup(|_| {});
    store.insert(B, "kept", &b"old content"[..]);
    let (_, empty) = fs.create(ROOT_INO, n("touched"), PID).await.unwrap();
    fs.flush(empty.fh, || PID).await.unwrap();
    let (_, big) = fs.create(ROOT_INO, n("unfinished"), PID).await.unwrap();
    let body = data(9 << 20, 3);
    assert_eq!(
        fs.write(big.fh, 0, &body).await.unwrap() as usize,
        body.len()
    );
    let kept = fs.lookup(ROOT_INO, n("kept")).await.unwrap().attr.ino;
    fs.open(kept, libc::O_WRONLY | libc::O_TRUNC, PID)
        .await
        .unwrap();
    assert_eq!(store.pending_uploads(B), 1, "a part of the big file is up");
    fs.teardown().await;
    assert_eq!(store.get_object(B, "touched").unwrap().len(), 0);
    assert!(store.get_object(B, "unfinished").is_none());
    assert_eq!(store.pending_uploads(B), 0, "its multipart upload aborted");
    assert_eq!(store.get_object(B, "kept").unwrap(), &b"old content"[..]);
}

#[tokio::test]
async fn large_write_is_multipart() {
    let (store, fs) = setup(|_| {});
    let body = data(20 << 20, 7);
    let ino = write_new(&fs, ROOT_INO, "big.bin", &body, 1 << 20).await;
    assert_eq!(store.get_object(B, "big.bin").unwrap(), &body[..]);
    let s = store.stats();
    assert_eq!(
        (
            s.put,
            s.create_multipart,
            s.upload_part,
            s.complete_multipart
        ),
        (0, 1, 3, 1),
        "8 + 8 + 4 MiB"
    );
    assert_eq!(store.pending_uploads(B), 0);
    assert_eq!(fs.getattr(ino).await.unwrap().attr.size, body.len() as u64);
    // Exactly one part's worth: multipart with one part.
    let one = data(PART_SIZE, 8);
    write_new(&fs, ROOT_INO, "one-part", &one, 128 * 1024).await;
    assert_eq!(store.get_object(B, "one-part").unwrap(), &one[..]);
    assert_eq!(store.pending_uploads(B), 0);
}

#[tokio::test]
async fn write_rules() {
    let (store, fs) = setup(|cfg| cfg.allow_overwrite = true);
    // A write refused (a hole: `cp` of a sparse file; a rewrite) ends the upload: a new file is
    // not created and an existing object not replaced, and close says so (EIO). Never the bytes
    // before the gap as the whole file.
    store.insert(B, "old", &b"the old object"[..]);
    for (name, at) in [("hole", 10), ("rewrite", 1), ("old", 10)] {
        let fh = match name {
            "old" => {
                let ino = fs.lookup(ROOT_INO, n(name)).await.unwrap().attr.ino;
                fs.open(ino, libc::O_WRONLY | libc::O_TRUNC, PID)
                    .await
                    .unwrap()
                    .fh
            }
            _ => fs.create(ROOT_INO, n(name), PID).await.unwrap().1.fh,
        };
        fs.write(fh, 0, b"abc").await.unwrap();
        assert_eq!(errno(fs.write(fh, at, b"x").await), libc::EINVAL, "{name}");
        assert_eq!(
            errno(fs.write(fh, 3, b"d").await),
            libc::EIO,
            "{name}: then"
        );
        assert_eq!(
            errno(fs.flush(fh, || PID).await),
            libc::EIO,
            "{name}: close"
        );
        assert_eq!(errno(fs.release(fh).await), libc::EIO, "{name}: release");
        let kept = (name == "old").then(|| Bytes::from_static(b"the old object"));
        assert_eq!(store.get_object(B, name), kept, "{name}");
    }
    assert_eq!(store.pending_uploads(B), 0);
    let (e, o) = fs.create(ROOT_INO, n("f"), PID).await.unwrap();
    fs.write(o.fh, 0, b"abc").await.unwrap();
    assert_eq!(errno(fs.read(o.fh, 0, 3).await), libc::EBADF);
    // Truncation to the current size is a no-op, to 0 restarts, others refused.
    let attr = |size| SetAttr {
        size: Some(size),
        fh: Some(o.fh),
        ..Default::default()
    };
    fs.setattr(e.attr.ino, attr(3)).await.unwrap();
    assert_eq!(errno(fs.setattr(e.attr.ino, attr(1)).await), libc::EINVAL);
    assert_eq!(fs.setattr(e.attr.ino, attr(0)).await.unwrap().attr.size, 0);
    fs.write(o.fh, 0, b"xyz").await.unwrap();
    // Times are accepted; chmod/chown only to what they already are.
    let times = SetAttr {
        times: true,
        ..Default::default()
    };
    fs.setattr(e.attr.ino, times).await.unwrap();
    let chmod = |mode| SetAttr {
        mode: Some(mode),
        ..Default::default()
    };
    fs.setattr(e.attr.ino, chmod(0o100644)).await.unwrap();
    assert_eq!(
        errno(fs.setattr(e.attr.ino, chmod(0o600)).await),
        libc::EPERM
    );
    let chown = SetAttr {
        uid: Some(0),
        ..Default::default()
    };
    assert_eq!(errno(fs.setattr(e.attr.ino, chown).await), libc::EPERM);
    fs.release(o.fh).await.unwrap();
    assert_eq!(store.get_object(B, "f").unwrap(), &b"xyz"[..]);
    // Existing file: truncate without a write handle is refused (unless it changes nothing).
    assert_eq!(errno(fs.setattr(e.attr.ino, attr(0)).await), libc::EPERM);
    fs.setattr(e.attr.ino, attr(3)).await.unwrap();
    // Creating an existing name.
    assert_eq!(errno(fs.create(ROOT_INO, n("f"), PID).await), libc::EEXIST);
    assert_eq!(
        errno(fs.create(ROOT_INO, OsStr::new(".."), PID).await),
        libc::EINVAL
    );
    assert_eq!(
        errno(fs.create(ROOT_INO, n(&"n".repeat(256)), PID).await),
        libc::ENAMETOOLONG
    );
    assert_eq!(errno(fs.rename()), libc::EXDEV);
}

#[tokio::test]
async fn overwrite_rules() {
    let (store, fs) = setup(|c| c.allow_overwrite = false);
    store.insert(B, "f", &b"old"[..]);
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let wr = libc::O_WRONLY;
    assert_eq!(
        errno(fs.open(ino, wr | libc::O_TRUNC, PID).await),
        libc::EPERM
    );
    assert_eq!(errno(fs.open(ino, wr, PID).await), libc::EPERM);
    assert_eq!(
        errno(fs.open(ino, libc::O_RDWR | libc::O_APPEND, PID).await),
        libc::EPERM
    );
    let rdonly_trunc = libc::O_RDONLY | libc::O_TRUNC;
    assert_eq!(errno(fs.open(ino, rdonly_trunc, PID).await), libc::EPERM);

    let (store, fs) = setup(|_| {});
    store.insert(B, "f", &b"old"[..]);
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    assert_eq!(
        errno(fs.open(ino, wr, PID).await),
        libc::EPERM,
        "no in-place edits"
    );
    let o = fs.open(ino, wr | libc::O_TRUNC, PID).await.unwrap();
    assert_eq!(errno(fs.open(ino, libc::O_RDONLY, PID).await), libc::EBUSY);
    assert_eq!(
        errno(fs.open(ino, wr | libc::O_TRUNC, PID).await),
        libc::EBUSY
    );
    assert_eq!(fs.getattr(ino).await.unwrap().attr.size, 0);
    fs.write(o.fh, 0, b"new!").await.unwrap();
    assert_eq!(
        store.get_object(B, "f").unwrap(),
        &b"old"[..],
        "old until flush"
    );
    fs.release(o.fh).await.unwrap();
    assert_eq!(store.get_object(B, "f").unwrap(), &b"new!"[..]);
    assert_eq!(read_all(&fs, ino, 100).await, b"new!");
}

/// A new name on a mount that may not replace objects is created only if still absent: an
/// object someone else put at the key after this mount looked is kept, and `close` is `EEXIST`
/// (PUT and multipart alike). A mount that may replace objects replaces it, as it would have
/// had it seen it.
#[tokio::test]
async fn a_new_name_never_replaces_an_object_put_meanwhile_without_allow_overwrite() {
    let big = data(PART_SIZE + 4096, 7);
    for body in [&b"mine"[..], &big[..]] {
        let (store, fs) = setup(|c| c.allow_overwrite = false);
        let (e, o) = fs.create(ROOT_INO, n("race"), PID).await.unwrap();
        fs.write(o.fh, 0, body).await.unwrap();
        store.insert(B, "race", &b"theirs"[..]);
        assert_eq!(
            errno(fs.flush(o.fh, || PID).await),
            libc::EEXIST,
            "{}",
            body.len()
        );
        // The failed upload's handle: its release says so again (the kernel ignores it).
        assert_eq!(errno(fs.release(o.fh).await), libc::EIO);
        assert_eq!(store.get_object(B, "race").unwrap(), &b"theirs"[..]);
        assert!(
            store.uploads(B).is_empty(),
            "the multipart upload is aborted"
        );
        // The mount sees their object, not a ghost of its own.
        assert_eq!(read_all(&fs, e.attr.ino, 100).await, b"theirs");

        let (store, fs) = setup(|c| c.allow_overwrite = true);
        let (_, o) = fs.create(ROOT_INO, n("race"), PID).await.unwrap();
        fs.write(o.fh, 0, body).await.unwrap();
        store.insert(B, "race", &b"theirs"[..]);
        fs.flush(o.fh, || PID).await.unwrap();
        fs.release(o.fh).await.unwrap();
        assert_eq!(store.get_object(B, "race").unwrap(), body);
    }
}

/// The kernel closes a killed process's files with the same `flush` a `close` sends: the
/// opener's flush on its way out of a fatal signal abandons the upload (no truncated object, a
/// replaced one kept), and so does a last close (`release`) by a killed process. A normal exit
/// without `close` completes it, as ever.
#[tokio::test]
async fn a_writer_killed_mid_file_never_commits_a_truncated_object() {
    let (store, fs) = setup(|_| {});
    store.insert(B, "ckpt", &b"the good checkpoint"[..]);
    let ino = walk(&fs, "ckpt").await.unwrap().attr.ino;
    let o = fs
        .open(ino, libc::O_WRONLY | libc::O_TRUNC, PID)
        .await
        .unwrap();
    fs.write(o.fh, 0, b"half a new").await.unwrap();
    assert_eq!(
        errno(fs.flush_by(o.fh, || PID, |_| Closing::Killed).await),
        libc::EIO
    );
    assert_eq!(errno(fs.release(o.fh).await), libc::EIO);
    assert_eq!(
        store.get_object(B, "ckpt").unwrap(),
        &b"the good checkpoint"[..]
    );
    // A forked child killed: not the opener, nothing happens; the opener's close completes.
    let (_, o) = fs.create(ROOT_INO, n("new"), PID).await.unwrap();
    fs.write(o.fh, 0, b"whole").await.unwrap();
    fs.flush_by(o.fh, || PID + 1, |_| Closing::Killed)
        .await
        .unwrap();
    assert!(store.get_object(B, "new").is_none());
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    assert_eq!(store.get_object(B, "new").unwrap(), &b"whole"[..]);
    // The last close by a killed process (its opener's flush did nothing: below).
    let (_, o) = fs.create_for(ROOT_INO, n("last"), 0, None).await.unwrap();
    fs.write(o.fh, 0, b"cut").await.unwrap();
    assert_eq!(errno(fs.release_by(o.fh, || true).await), libc::EIO);
    assert!(store.get_object(B, "last").is_none());
}

/// A shell builtin with a redirection (`echo x >&3`, `echo x >&2` after `exec >log 2>&1`)
/// `dup2`s the file over a descriptor and puts the old one back: the opener closes one copy while
/// it holds another. That close leaves the upload open, and the next writes land in the same
/// object; the close of the last copy completes it.
#[tokio::test]
async fn a_close_while_the_opener_holds_another_descriptor_goes_on() {
    let (store, fs) = setup(|_| {});
    let (_, o) = fs.create(ROOT_INO, n("log"), PID).await.unwrap();
    fs.write(o.fh, 0, b"one\n").await.unwrap();
    fs.flush_by(o.fh, || PID, |_| Closing::StillHeld)
        .await
        .unwrap();
    assert!(store.get_object(B, "log").is_none());
    fs.write(o.fh, 4, b"two\n").await.unwrap();
    fs.flush_by(o.fh, || PID, |_| Closing::Last).await.unwrap();
    assert_eq!(store.get_object(B, "log").unwrap(), &b"one\ntwo\n"[..]);
    fs.release(o.fh).await.unwrap();
}

/// An opener outside the node plugin's pid namespace is seen as pid 0, as are all its children:
/// no flush can tell the opener's from a child's, so none completes the upload (a child's would
/// commit the file cut where it was); the last close does.
#[tokio::test]
async fn an_opener_this_mount_cannot_see_is_completed_by_the_last_close() {
    let (store, fs) = setup(|_| {});
    let (_, o) = fs
        .create_for(ROOT_INO, n("log.csv"), 0, None)
        .await
        .unwrap();
    fs.write(o.fh, 0, b"line 1\n").await.unwrap();
    // `subprocess.run`: the child's copy of the descriptor closed.
    fs.flush(o.fh, || 0).await.unwrap();
    assert!(store.get_object(B, "log.csv").is_none());
    fs.write(o.fh, 7, b"line 2\n").await.unwrap();
    fs.flush(o.fh, || 0).await.unwrap();
    fs.release(o.fh).await.unwrap();
    assert_eq!(
        store.get_object(B, "log.csv").unwrap(),
        &b"line 1\nline 2\n"[..]
    );
}

#[tokio::test]
async fn read_only_mount_refuses_every_mutation() {
    let (store, fs) = setup(|c| c.read_only = true);
    store.insert(B, "f", &b"x"[..]);
    store.insert(B, "d/g", &b"x"[..]);
    let f = walk(&fs, "f").await.unwrap().attr.ino;
    walk(&fs, "d").await.unwrap();
    let rofs = libc::EROFS;
    assert_eq!(errno(fs.create(ROOT_INO, n("new"), PID).await), rofs);
    assert_eq!(errno(fs.mkdir(ROOT_INO, n("nd")).await), rofs);
    assert_eq!(errno(fs.unlink(ROOT_INO, n("f")).await), rofs);
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("d")).await), rofs);
    assert_eq!(
        errno(fs.open(f, libc::O_WRONLY | libc::O_TRUNC, PID).await),
        rofs
    );
    assert_eq!(errno(fs.setattr(f, SetAttr::default()).await), rofs);
    assert_eq!(errno(fs.rename()), rofs);
    assert_eq!(read_all(&fs, f, 10).await, b"x");
    assert_eq!(store.keys(B).len(), 2);
}

#[tokio::test]
async fn delete_rules() {
    let (store, fs) = setup(|c| c.allow_delete = false);
    store.insert(B, "f", &b"x"[..]);
    walk(&fs, "f").await.unwrap();
    assert_eq!(errno(fs.unlink(ROOT_INO, n("f")).await), libc::EPERM);
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("f")).await), libc::ENOTDIR);
    // A directory only this mount has (mkdir, still empty) goes: nothing in S3 is deleted. One
    // with a marker object stays.
    fs.mkdir(ROOT_INO, n("typo")).await.unwrap();
    fs.rmdir(ROOT_INO, n("typo")).await.unwrap();
    assert_eq!(errno(walk(&fs, "typo").await), libc::ENOENT);
    store.insert(B, "marked/", &b""[..]);
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("marked")).await), libc::EPERM);
    assert!(store.get_object(B, "marked/").is_some());

    let (store, fs) = setup(|_| {});
    store.insert(B, "f", &b"x"[..]);
    store.insert(B, "full/a", &b"x"[..]);
    store.insert(B, "marker/", Vec::new());
    store.insert(B, "hidden-only/", Vec::new());
    store.insert(B, "hidden-only//x", &b"x"[..]);
    for p in ["f", "full", "marker", "hidden-only"] {
        walk(&fs, p).await.unwrap();
    }
    assert_eq!(errno(fs.unlink(ROOT_INO, n("full")).await), libc::EISDIR);
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("f")).await), libc::ENOTDIR);
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("full")).await), libc::ENOTEMPTY);
    assert_eq!(
        errno(fs.rmdir(ROOT_INO, n("hidden-only")).await),
        libc::ENOTEMPTY,
        "hidden keys count"
    );
    assert_eq!(errno(fs.unlink(ROOT_INO, n("nope")).await), libc::ENOENT);
    fs.unlink(ROOT_INO, n("f")).await.unwrap();
    assert!(store.get_object(B, "f").is_none());
    assert_eq!(errno(walk(&fs, "f").await), libc::ENOENT);
    fs.rmdir(ROOT_INO, n("marker")).await.unwrap();
    assert!(store.get_object(B, "marker/").is_none());
    assert_eq!(errno(walk(&fs, "marker").await), libc::ENOENT);

    // Emptying an implicit directory keeps it (POSIX) until rmdir.
    let full = walk(&fs, "full").await.unwrap().attr.ino;
    fs.unlink(full, n("a")).await.unwrap();
    assert!(store.keys(B).iter().all(|k| !k.starts_with("full")));
    assert_eq!(walk(&fs, "full").await.unwrap().attr.kind, Kind::Dir);
    assert!(names(&fs, ROOT_INO)
        .await
        .contains(&("full".to_owned(), Kind::Dir)));
    fs.rmdir(ROOT_INO, n("full")).await.unwrap();
    assert_eq!(errno(walk(&fs, "full").await), libc::ENOENT);
}

/// Emptying `a/b/` where `a` held nothing else keeps both `a/b` and `a` (found by the
/// reference-model test through FUSE with TTL 0: `a` used to vanish above a local `a/b`).
#[tokio::test]
async fn emptying_a_nested_implicit_directory_keeps_its_ancestors() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO));
    store.insert(B, "a/b/f", &b"x"[..]);
    store.insert(B, "k/other", &b"x"[..]);
    store.insert(B, "k/b/f", &b"x"[..]);
    for (dir, file) in [("a/b", "f"), ("k/b", "f")] {
        let d = walk(&fs, dir).await.unwrap().attr.ino;
        fs.unlink(d, n(file)).await.unwrap();
    }
    assert_eq!(store.keys(B), ["k/other"]);
    for dir in ["a", "a/b", "k", "k/b"] {
        assert_eq!(walk(&fs, dir).await.unwrap().attr.kind, Kind::Dir, "{dir}");
    }
    assert_eq!(
        names(&fs, ROOT_INO).await,
        [("a".to_owned(), Kind::Dir), ("k".to_owned(), Kind::Dir)]
    );
    let a = walk(&fs, "a").await.unwrap().attr.ino;
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("a")).await), libc::ENOTEMPTY);
    fs.rmdir(a, n("b")).await.unwrap();
    fs.rmdir(ROOT_INO, n("a")).await.unwrap();
    assert_eq!(errno(walk(&fs, "a").await), libc::ENOENT);
}

#[tokio::test]
async fn mkdir_is_local_until_a_file_is_written() {
    let (store, fs) = setup(|_| {});
    let d = fs.mkdir(ROOT_INO, n("new")).await.unwrap();
    assert_eq!(d.attr.kind, Kind::Dir);
    assert_eq!(errno(fs.mkdir(ROOT_INO, n("new")).await), libc::EEXIST);
    assert_eq!(walk(&fs, "new").await.unwrap().attr.ino, d.attr.ino);
    assert_eq!(names(&fs, ROOT_INO).await, [("new".to_owned(), Kind::Dir)]);
    assert!(store.keys(B).is_empty(), "no marker object");
    let sub = fs.mkdir(d.attr.ino, n("sub")).await.unwrap();
    assert_eq!(errno(fs.rmdir(ROOT_INO, n("new")).await), libc::ENOTEMPTY);
    write_new(&fs, sub.attr.ino, "f", b"data", 2).await;
    assert_eq!(store.keys(B), ["new/sub/f"]);
    // Now real: still there after the kernel forgets everything.
    fs.forget(sub.attr.ino, 1);
    fs.forget(d.attr.ino, 2);
    assert_eq!(walk(&fs, "new/sub/f").await.unwrap().attr.size, 4);
    // An empty local directory can be removed.
    fs.mkdir(ROOT_INO, n("gone")).await.unwrap();
    fs.rmdir(ROOT_INO, n("gone")).await.unwrap();
    assert_eq!(errno(walk(&fs, "gone").await), libc::ENOENT);
    assert_eq!(names(&fs, ROOT_INO).await, [("new".to_owned(), Kind::Dir)]);
}

/// Delegates to a `MemoryStore`, but HEAD of the keys in `failing` answers 500; every LIST's
/// prefix is logged in `lists` as it starts, and a LIST of prefix `gate.0` waits for `gate.1`.
#[derive(Debug, Default)]
struct Hooked {
    inner: MemoryStore,
    failing: Vec<String>,
    lists: Arc<std::sync::Mutex<Vec<String>>>,
    gate: Option<(String, Arc<tokio::sync::Notify>)>,
}

#[async_trait]
impl ObjectStore for Hooked {
    async fn head_bucket(&self, bucket: &str) -> ferry_store::Result<()> {
        self.inner.head_bucket(bucket).await
    }
    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> ferry_store::Result<ListPage> {
        self.lists.lock().unwrap().push(req.prefix.to_owned());
        if let Some((prefix, open)) = &self.gate {
            if req.prefix == prefix {
                open.notified().await;
            }
        }
        self.inner.list(bucket, req).await
    }
    async fn head(&self, bucket: &str, key: &str) -> ferry_store::Result<ObjectInfo> {
        if self.failing.iter().any(|k| k == key) {
            return Err(StoreError::Transient("500 InternalError".into()));
        }
        self.inner.head(bucket, key).await
    }
    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> ferry_store::Result<Bytes> {
        self.inner.get_range(bucket, key, range, if_match).await
    }
    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<std::time::SystemTime>,
        size: u64,
    ) -> ferry_store::Result<Bytes> {
        self.inner
            .get_range_unmodified(bucket, key, range, last_modified, size)
            .await
    }
    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> ferry_store::Result<PutResult> {
        self.inner.put(bucket, key, body).await
    }
    async fn put_if_absent(
        &self,
        bucket: &str,
        key: &str,
        body: Bytes,
    ) -> ferry_store::Result<PutResult> {
        self.inner.put_if_absent(bucket, key, body).await
    }
    async fn create_multipart(&self, bucket: &str, key: &str) -> ferry_store::Result<String> {
        self.inner.create_multipart(bucket, key).await
    }
    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> ferry_store::Result<CompletedPart> {
        self.inner
            .upload_part(bucket, key, upload_id, part_number, body)
            .await
    }
    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> ferry_store::Result<PutResult> {
        self.inner
            .complete_multipart(bucket, key, upload_id, parts)
            .await
    }
    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> ferry_store::Result<PutResult> {
        self.inner
            .complete_multipart_if_absent(bucket, key, upload_id, parts)
            .await
    }
    async fn abort_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> ferry_store::Result<()> {
        self.inner.abort_multipart(bucket, key, upload_id).await
    }
    async fn list_uploads(
        &self,
        bucket: &str,
        req: ferry_store::UploadsRequest<'_>,
    ) -> ferry_store::Result<ferry_store::UploadsPage> {
        self.inner.list_uploads(bucket, req).await
    }
    async fn delete(&self, bucket: &str, key: &str) -> ferry_store::Result<()> {
        self.inner.delete(bucket, key).await
    }
    async fn delete_many(&self, bucket: &str, keys: &[String]) -> ferry_store::Result<()> {
        self.inner.delete_many(bucket, keys).await
    }
}

#[tokio::test]
async fn head_error_on_a_directory_is_ignored_when_list_proves_it() {
    let inner = MemoryStore::new();
    inner.create_bucket(B);
    inner.insert(B, "dir/file", &b"x"[..]);
    inner.insert(B, "plain", &b"x"[..]);
    let store = Hooked {
        inner,
        failing: vec!["dir".into(), "plain".into()],
        ..Hooked::default()
    };
    let fs = Fs::new(Arc::new(store), MountConfig::new(B));
    assert_eq!(
        fs.lookup(ROOT_INO, n("dir")).await.unwrap().attr.kind,
        Kind::Dir
    );
    assert_eq!(errno(fs.lookup(ROOT_INO, n("plain")).await), libc::EIO);
}

#[tokio::test]
async fn snapshot_round_trips_and_resumes_an_upload() {
    let (store, fs) = setup(|_| {});
    store.insert(B, "r", data(1000, 1));
    let r = walk(&fs, "r").await.unwrap().attr.ino;
    let ro = fs.open(r, libc::O_RDONLY, PID).await.unwrap();
    fs.read(ro.fh, 0, 100).await.unwrap();
    let d = walk(&fs, "").await.unwrap().attr.ino;
    let dh = fs.opendir(d).unwrap().fh;
    let body = data(9 << 20, 3);
    let (_, wo) = fs.create(ROOT_INO, n("w"), PID).await.unwrap();
    fs.write(wo.fh, 0, &body[..5 << 20]).await.unwrap();
    fs.write(wo.fh, 5 << 20, &body[5 << 20..(17 << 19)])
        .await
        .unwrap();

    let snap = fs.snapshot().await;
    let json = serde_json::to_string(&snap).unwrap();
    let back: FsSnapshot = serde_json::from_str(&json).unwrap();
    let fs2 = Fs::from_snapshot(
        Arc::new(store.clone()),
        back,
        MemoryBudget::default(),
        PrefetchConfig::default(),
    );
    assert_eq!(fs2.table_sizes(), fs.table_sizes());
    // The new process continues where the old one stopped.
    fs2.write(wo.fh, 17 << 19, &body[17 << 19..]).await.unwrap();
    fs2.release(wo.fh).await.unwrap();
    assert_eq!(store.get_object(B, "w").unwrap(), &body[..]);
    assert_eq!(
        &fs2.read(ro.fh, 100, 100).await.unwrap()[..],
        &data(1000, 1)[100..200]
    );
    fs2.release(ro.fh).await.unwrap();
    fs2.releasedir(dh);
    // A new handle number does not collide with restored ones.
    let o = fs2.open(r, libc::O_RDONLY, PID).await.unwrap();
    assert!(o.fh > wo.fh);
}

// ----- prefetch, memory budget, listing cache ------------------------------------------------

/// What the budget holds besides kept listings (prefetch, read-ahead, buffers).
fn unlisted(budget: &MemoryBudget) -> u64 {
    budget.used() - budget.used_for(crate::budget::Use::Listing)
}

/// A filesystem on `store` (a `FaultyStore` over `mem`, usually) with this budget and tuning.
fn setup_budget(
    store: Arc<dyn ObjectStore>,
    budget: MemoryBudget,
    prefetch: PrefetchConfig,
    ttl: MetadataTtl,
) -> Fs {
    let mut cfg = MountConfig::new(B);
    cfg.metadata_ttl = ttl;
    Fs::with_budget(store, cfg, budget, prefetch)
}

fn faulty() -> (MemoryStore, Arc<ferry_store::FaultyStore<MemoryStore>>) {
    let mem = MemoryStore::new();
    mem.create_bucket(B);
    let f = Arc::new(ferry_store::FaultyStore::new(mem.clone(), 7));
    (mem, f)
}

#[tokio::test(start_paused = true)]
async fn a_listing_is_kept_only_while_the_memory_budget_holds_it() {
    let (mem, store) = faulty();
    for i in 0..200 {
        mem.insert(B, &format!("d/file-{i:03}"), b"x".to_vec());
    }
    async fn listed(fs: &Fs) -> usize {
        let d = walk(fs, "d").await.unwrap().attr.ino;
        list_batched(fs, d, 64, false).await.len()
    }
    let ttl = MetadataTtl::Indefinite;
    // Room for it: kept and charged; the second listing asks S3 nothing.
    let with_budget = |limit: u64| {
        let budget = MemoryBudget::new(limit);
        let fs = setup_budget(
            store.clone(),
            budget.clone(),
            PrefetchConfig::default(),
            ttl,
        );
        (budget, fs)
    };
    let (budget, fs) = with_budget(1 << 20);
    assert_eq!(listed(&fs).await, 200);
    let kept = budget.used_for(crate::budget::Use::Listing);
    let each = std::mem::size_of::<ListedEntry>() as u64 + 2 * 32;
    assert!(kept >= 200 * each, "{kept} bytes charged for 200 names");
    mem.reset_stats();
    assert_eq!(listed(&fs).await, 200);
    assert_eq!(mem.stats().list, 0, "served from the kept listing");
    drop(fs);
    assert_eq!(
        budget.used_for(crate::budget::Use::Listing),
        0,
        "given back with the filesystem"
    );

    // No room: served whole, not kept, so the next listing and lookups ask S3 again.
    let (budget, fs) = with_budget(4 << 10);
    assert_eq!(listed(&fs).await, 200);
    assert_eq!(budget.used_for(crate::budget::Use::Listing), 0);
    mem.reset_stats();
    assert_eq!(listed(&fs).await, 200);
    assert!(mem.stats().list > 0, "listed again");
    assert_eq!(walk(&fs, "d/file-007").await.unwrap().attr.size, 1);
    assert!(walk(&fs, "d/missing").await.is_err());
    // A name this mount saw missing, created since: the listing that shows it, kept or not,
    // makes it found.
    mem.insert(B, "d/missing", b"now".to_vec());
    assert_eq!(listed(&fs).await, 201);
    assert_eq!(walk(&fs, "d/missing").await.unwrap().attr.size, 3);

    // Kept listings take at most a quarter of the budget, whatever else is free.
    let (budget, fs) = with_budget(4 * (kept - 1));
    assert_eq!(listed(&fs).await, 201);
    assert_eq!(
        budget.used_for(crate::budget::Use::Listing),
        0,
        "over a quarter: not kept"
    );
}

#[tokio::test(start_paused = true)]
async fn exhausted_budget_reads_fetch_only_what_they_need() {
    let (mem, store) = faulty();
    let body = data(3 << 20, 11);
    mem.insert(B, "f", body.clone());
    let budget = MemoryBudget::new(0);
    let fs = setup_budget(
        store,
        budget.clone(),
        PrefetchConfig::default(),
        MetadataTtl::default(),
    );
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    mem.reset_stats();
    assert_eq!(read_all(&fs, ino, 128 << 10).await, body);
    let s = mem.stats();
    assert_eq!(
        (s.get, s.get_bytes),
        (24, 3 << 20),
        "one GET per read, no more"
    );
    assert_eq!(budget.used(), 0);
}

#[tokio::test(start_paused = true)]
async fn many_open_files_stay_within_the_budget() {
    // "64 open files must not OOM a 1 GiB budget", scaled down 64x: 64 handles reading 6 MiB
    // files sequentially and concurrently against a slow store, with a 16 MiB budget.
    let (mem, store) = faulty();
    store.set_latency(
        [ferry_store::Op::Get],
        Duration::from_millis(20),
        Duration::from_millis(20),
    );
    let limit = 16u64 << 20;
    let budget = MemoryBudget::new(limit);
    let fs = Arc::new(setup_budget(
        store,
        budget.clone(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    ));
    let mut tasks = Vec::new();
    for i in 0..64u8 {
        let body = data(6 << 20, i);
        mem.insert(B, &format!("f{i:02}"), body.clone());
        let fs = fs.clone();
        let budget = budget.clone();
        tasks.push(tokio::spawn(async move {
            let ino = walk(&fs, &format!("f{i:02}")).await.unwrap().attr.ino;
            let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
            let mut off = 0u64;
            while off < body.len() as u64 {
                let got = fs.read(o.fh, off, 1 << 20).await.unwrap();
                assert_eq!(&got[..], &body[off as usize..off as usize + got.len()]);
                assert!(budget.used() <= limit);
                off += got.len() as u64;
            }
            fs.release(o.fh).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(budget.used(), 0, "every reservation given back");
}

#[tokio::test(start_paused = true)]
async fn sequential_prefetch_runs_ahead_in_parallel_and_release_aborts_it() {
    let (mem, store) = faulty();
    store.set_latency(
        [ferry_store::Op::Get],
        Duration::from_millis(100),
        Duration::ZERO,
    );
    let body = data(160 << 20, 3);
    mem.insert(B, "big", body.clone());
    let budget = MemoryBudget::new(1 << 30);
    let fs = setup_budget(
        store.clone(),
        budget.clone(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    );
    let ino = walk(&fs, "big").await.unwrap().attr.ino;
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let started = tokio::time::Instant::now();
    let mut off = 0u64;
    while off < 128 << 20 {
        let got = fs.read(o.fh, off, 1 << 20).await.unwrap();
        assert_eq!(&got[..], &body[off as usize..off as usize + got.len()]);
        off += got.len() as u64;
    }
    // 128 MiB in 8 MiB parts would take 1.6 s of GET latency one after the other; with up to
    // 64 MiB in flight the reader waits for far fewer round trips.
    let took = started.elapsed();
    assert!(took < Duration::from_millis(1000), "{took:?}");
    // The window is full ahead of the reader: GETs in flight, charged to the budget.
    assert!(budget.used() >= 32 << 20, "{}", budget.used());
    assert!(budget.used() <= (64 << 20) + (8 << 20), "{}", budget.used());
    // A random read drops the parts (and their budget) and fetches only its range.
    mem.reset_stats();
    let got = fs.read(o.fh, 5 << 20, 4096).await.unwrap();
    assert_eq!(&got[..], &body[5 << 20..(5 << 20) + 4096]);
    assert_eq!(budget.used(), 0);
    assert_eq!(mem.stats().get_bytes, 64 << 10);
    // Sequential again: the window restarts small.
    fs.read(o.fh, (5 << 20) + 4096, 4096).await.unwrap();
    assert!(budget.used() <= 1 << 20, "{}", budget.used());
    fs.release(o.fh).await.unwrap();
    assert_eq!(
        budget.used(),
        0,
        "release aborts prefetch and frees its memory"
    );
    // The aborted GETs never complete.
    let before = mem.stats().get;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(mem.stats().get, before);
}

/// Eight sequential readers share the node's prefetch: each window grows to an eighth of
/// `shared_window` (16 MiB), not to `max_window` (64 MiB) each.
#[tokio::test(start_paused = true)]
async fn concurrent_sequential_readers_share_the_prefetch_window() {
    let (mem, store) = faulty();
    store.set_latency(
        [ferry_store::Op::Get],
        Duration::from_millis(100),
        Duration::ZERO,
    );
    let budget = MemoryBudget::new(1 << 30);
    let cfg = PrefetchConfig::default();
    let fs = Arc::new(setup_budget(
        store.clone(),
        budget.clone(),
        cfg,
        MetadataTtl::Indefinite,
    ));
    let mut handles = Vec::new();
    for i in 0..8u8 {
        let name = format!("shard{i}");
        mem.insert(B, &name, data(96 << 20, i));
        let ino = walk(&fs, &name).await.unwrap().attr.ino;
        handles.push(fs.open(ino, libc::O_RDONLY, PID).await.unwrap().fh);
    }
    // Every reader starts, then all read 40 MiB in turns.
    let mut off = 0u64;
    while off < 40 << 20 {
        for &fh in &handles {
            let got = fs.read(fh, off, 1 << 20).await.unwrap();
            assert_eq!(got.len(), 1 << 20);
        }
        off += 1 << 20;
    }
    assert_eq!(budget.streams(), 8);
    // Each reader: its 16 MiB window plus a part being replaced and what it keeps behind.
    let most = 8 * ((16 << 20) + (8 << 20) + (2 << 20));
    assert!(budget.used() <= most, "{} > {most}", budget.used());
    for fh in handles {
        fs.release(fh).await.unwrap();
    }
    assert_eq!(budget.streams(), 0, "released readers leave the count");
    assert_eq!(budget.used(), 0);
}

#[tokio::test(start_paused = true)]
async fn short_body_is_retried_once_then_eio() {
    let (mem, store) = faulty();
    let body = data(2 << 20, 5);
    mem.insert(B, "f", body.clone());
    let fs = setup_budget(
        store.clone(),
        MemoryBudget::default(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    );
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    // Random read: one short body is retried.
    store.truncate_next(1);
    let got = fs.read(o.fh, 1 << 20, 4096).await.unwrap();
    assert_eq!(&got[..], &body[1 << 20..(1 << 20) + 4096]);
    // Two in a row: EIO.
    store.truncate_next(2);
    assert_eq!(errno(fs.read(o.fh, 100 << 10, 4096).await), libc::EIO);
    fs.release(o.fh).await.unwrap();
    // Prefetched part: the same rule.
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    store.truncate_next(1);
    assert_eq!(&fs.read(o.fh, 0, 4096).await.unwrap()[..], &body[..4096]);
    store.truncate_next(2);
    assert_eq!(errno(fs.read(o.fh, 1 << 20, 4096).await), libc::EIO);
    fs.release(o.fh).await.unwrap();
    assert_eq!(read_all(&fs, ino, 128 << 10).await, body);
}

#[tokio::test(start_paused = true)]
async fn prefetch_keeps_the_etag_pinned_at_open() {
    let (mem, store) = faulty();
    mem.insert(B, "f", data(40 << 20, 1));
    let fs = setup_budget(
        store,
        MemoryBudget::default(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    );
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    fs.read(o.fh, 0, 1 << 20).await.unwrap();
    // Replaced while parts are in flight / not yet fetched: a later part is refused by If-Match.
    mem.insert(B, "f", data(40 << 20, 2));
    let mut off = 1 << 20;
    let err = loop {
        match fs.read(o.fh, off, 1 << 20).await {
            Ok(d) => off += d.len() as u64,
            Err(e) => break e,
        }
        assert!(off < 40 << 20, "some GET must carry If-Match");
    };
    assert_eq!(err.errno(), libc::ESTALE);
    fs.release(o.fh).await.unwrap();
}

/// A directory `ds` of `n` small files behind a store whose GETs take 50 ms, listed once.
struct SmallFiles {
    mem: MemoryStore,
    fs: Fs,
    budget: MemoryBudget,
    ds: Ino,
    files: Vec<Vec<u8>>,
}

impl SmallFiles {
    async fn new(n: u8, len: usize, also: &[(&str, Vec<u8>)]) -> Self {
        let (mem, store) = faulty();
        store.set_latency(
            [ferry_store::Op::Get],
            Duration::from_millis(50),
            Duration::ZERO,
        );
        let files: Vec<Vec<u8>> = (0..n).map(|i| data(len, i)).collect();
        for (i, f) in files.iter().enumerate() {
            mem.insert(B, &format!("ds/f{i:03}"), f.clone());
        }
        for (name, body) in also {
            mem.insert(B, &format!("ds/{name}"), body.clone());
        }
        let budget = MemoryBudget::new(1 << 30);
        let fs = setup_budget(
            store,
            budget.clone(),
            PrefetchConfig::default(),
            MetadataTtl::Indefinite,
        );
        let ds = walk(&fs, "ds").await.unwrap().attr.ino;
        let listed = list_batched(&fs, ds, 1000, true).await;
        assert_eq!(listed.len(), files.len() + also.len());
        mem.reset_stats();
        SmallFiles {
            mem,
            fs,
            budget,
            ds,
            files,
        }
    }

    /// Opens and reads the files in `order` (indices), checking every byte; returns the time taken.
    async fn read_in(&self, order: impl IntoIterator<Item = usize>) -> Duration {
        let started = tokio::time::Instant::now();
        for i in order {
            let ino = self
                .fs
                .lookup(self.ds, n(&format!("f{i:03}")))
                .await
                .unwrap()
                .attr
                .ino;
            assert_eq!(&read_all(&self.fs, ino, 128 << 10).await, &self.files[i]);
        }
        started.elapsed()
    }
}

#[tokio::test(start_paused = true)]
async fn listing_order_opens_prefetch_the_next_small_files() {
    let t = SmallFiles::new(40, 128 << 10, &[("huge", data(2 << 20, 9))]).await;
    let took = t.read_in(0..40).await;
    let s = t.mem.stats();
    assert_eq!(s.get, 40, "each file fetched once: {s:?}");
    assert_eq!(s.head, 0, "ETags come from the listing");
    // 40 round trips of 50 ms one after the other would be 2 s.
    assert!(took < Duration::from_millis(800), "{took:?}");
    // Nothing left over (huge is not small; nothing after it).
    assert_eq!(t.fs.small_objects_cached(), 0);
    assert_eq!(unlisted(&t.budget), 0);
}

#[tokio::test(start_paused = true)]
async fn prefetched_small_files_expire_and_respect_the_etag() {
    let mem = MemoryStore::new();
    mem.create_bucket(B);
    for i in 0..40u8 {
        mem.insert(B, &format!("ds/f{i:02}"), data(1000, i));
    }
    let budget = MemoryBudget::new(1 << 30);
    let fs = setup_budget(
        Arc::new(mem.clone()),
        budget.clone(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    );
    let ds = walk(&fs, "ds").await.unwrap().attr.ino;
    list_batched(&fs, ds, 1000, false).await;
    for i in 0..2 {
        let ino = fs
            .lookup(ds, n(&format!("f{i:02}")))
            .await
            .unwrap()
            .attr
            .ino;
        read_all(&fs, ino, 4096).await;
    }
    // f02, f03 fetched ahead.
    tokio::task::yield_now().await;
    assert_eq!(fs.small_objects_cached(), 2);
    assert_eq!(unlisted(&budget), 2000);
    // Not opened within the TTL: dropped at the next open.
    tokio::time::advance(Duration::from_secs(11)).await;
    let ino = fs.lookup(ds, n("f30")).await.unwrap().attr.ino;
    read_all(&fs, ino, 4096).await;
    assert_eq!(
        fs.small_objects_cached(),
        0,
        "expired, and f30 broke the pattern"
    );
    assert_eq!(unlisted(&budget), 0);
}

/// An idle mount does not keep small files fetched ahead charged to the node's budget: they are
/// dropped when their TTL passes even if nothing is opened any more.
#[tokio::test(start_paused = true)]
async fn prefetched_small_files_expire_on_an_idle_mount() {
    let mem = MemoryStore::new();
    mem.create_bucket(B);
    for i in 0..10u8 {
        mem.insert(B, &format!("ds/f{i}"), data(1000, i));
    }
    let budget = MemoryBudget::new(1 << 30);
    let fs = setup_budget(
        Arc::new(mem.clone()),
        budget.clone(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    );
    let ds = walk(&fs, "ds").await.unwrap().attr.ino;
    list_batched(&fs, ds, 1000, false).await;
    for i in 0..2 {
        let ino = fs.lookup(ds, n(&format!("f{i}"))).await.unwrap().attr.ino;
        read_all(&fs, ino, 4096).await;
    }
    tokio::task::yield_now().await;
    assert_eq!(fs.small_objects_cached(), 2);
    assert_eq!(unlisted(&budget), 2000);
    tokio::time::advance(Duration::from_secs(9)).await;
    tokio::task::yield_now().await;
    assert_eq!(fs.small_objects_cached(), 2, "still within the TTL");
    tokio::time::advance(Duration::from_secs(2)).await;
    tokio::task::yield_now().await;
    assert_eq!(fs.small_objects_cached(), 0, "expired without another open");
    assert_eq!(unlisted(&budget), 0);
}

#[tokio::test(start_paused = true)]
async fn listing_cache_serves_new_opendirs_within_the_ttl() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(5)));
    for i in 0..1500 {
        store.insert(B, &format!("d/f{i:04}"), &b"x"[..]);
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    store.reset_stats();
    assert_eq!(list_batched(&fs, d, 50, true).await.len(), 1500);
    // Two pages (the first one listed by walk's lookup of d); the second's first half (500
    // entries) ends the listing, so the range guessed after it is not waited for (perhaps not
    // even asked): once, not per readdir call.
    let lists = store.stats().list;
    assert!((1..=2).contains(&lists), "half a page, once: {lists} LISTs");
    for _ in 0..3 {
        assert_eq!(list_batched(&fs, d, 100, false).await.len(), 1500);
    }
    assert_eq!(
        store.stats().list,
        lists,
        "new opendirs served from the cache"
    );
    // A change through this mount is seen at once.
    fs.unlink(d, n("f0000")).await.unwrap();
    let names_now = names(&fs, d).await;
    assert_eq!(names_now.len(), 1499);
    assert_eq!(
        store.stats().list,
        lists + 1 + 2,
        "keep_dir_if_empty + a fresh listing (a page and half a page)"
    );
    write_new(&fs, d, "new", b"n", 1).await;
    assert_eq!(names(&fs, d).await.len(), 1500);
    // After the TTL: listed again (a change by someone else shows up).
    store.insert(B, "d/other", &b"x"[..]);
    tokio::time::advance(Duration::from_secs(6)).await;
    store.reset_stats();
    assert_eq!(names(&fs, d).await.len(), 1501);
    assert_eq!(store.stats().list, 3);
}

#[tokio::test(start_paused = true)]
async fn zero_ttl_lists_every_time() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO));
    store.insert(B, "d/a", &b"x"[..]);
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    store.reset_stats();
    names(&fs, d).await;
    names(&fs, d).await;
    assert_eq!(store.stats().list, 2);
}

/// Reads `ino` in `chunk`s in the order `order` gives the chunk indices; returns the bytes put
/// back in place.
async fn read_chunks_in(fs: &Fs, ino: Ino, len: usize, chunk: usize, order: &[usize]) -> Vec<u8> {
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let mut out = vec![0u8; len];
    for &i in order {
        let got = fs
            .read(o.fh, (i * chunk) as u64, chunk as u32)
            .await
            .unwrap();
        out[i * chunk..i * chunk + got.len()].copy_from_slice(&got);
    }
    fs.release(o.fh).await.unwrap();
    out
}

#[tokio::test(start_paused = true)]
async fn reads_the_kernel_reorders_do_not_restart_the_sequential_stream() {
    let (mem, store) = faulty();
    let len = 48 << 20;
    let body = data(len, 3);
    mem.insert(B, "f", body.clone());
    let fs = setup_budget(
        store,
        MemoryBudget::default(),
        PrefetchConfig::default(),
        MetadataTtl::Indefinite,
    );
    let ino = walk(&fs, "f").await.unwrap().attr.ino;
    let chunk = 1 << 20;
    let in_order: Vec<usize> = (0..len / chunk).collect();
    mem.reset_stats();
    assert_eq!(read_chunks_in(&fs, ino, len, chunk, &in_order).await, body);
    let sequential_gets = mem.stats().get;
    // The first reads in order (the kernel's synchronous start), then every pair of
    // neighbouring reads swapped, as concurrent read-ahead requests can arrive.
    let mut swapped = in_order.clone();
    for pair in swapped[4..].chunks_mut(2) {
        pair.reverse();
    }
    mem.reset_stats();
    assert_eq!(read_chunks_in(&fs, ino, len, chunk, &swapped).await, body);
    let reordered_gets = mem.stats().get;
    assert!(
        reordered_gets <= sequential_gets + 2,
        "reordered reads restarted the stream: {reordered_gets} GETs against {sequential_gets} in order"
    );
}

#[tokio::test(start_paused = true)]
async fn interleaved_listing_order_readers_still_get_small_files_ahead() {
    let t = SmallFiles::new(64, 64 << 10, &[]).await;
    // Eight readers taking entries in turn open them slightly out of listing order.
    let order: Vec<usize> = (0..64usize)
        .collect::<Vec<_>>()
        .chunks(8)
        .flat_map(|c| {
            let mut c = c.to_vec();
            c.swap(1, 5);
            c.swap(2, 7);
            c
        })
        .collect();
    let took = t.read_in(order).await;
    let s = t.mem.stats();
    assert_eq!(s.get, 64, "each file fetched once: {s:?}");
    // 64 round trips of 50 ms one after the other would be 3.2 s.
    assert!(took < Duration::from_millis(1200), "{took:?}");
    assert_eq!(unlisted(&t.budget), 0);
}

/// Lets background tasks (a lookup's directory probe) run on the test's runtime.
async fn let_background_run() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

/// A lookup's background probe of the parent starts once the lookup's own requests are
/// answered: while the directory's LIST (its first page, which a cold `ls -la` waits for) is out,
/// no LIST of the parent competes with it for the server.
#[tokio::test]
async fn the_parents_probe_waits_for_the_lookups_own_list() {
    let inner = MemoryStore::new();
    inner.create_bucket(B);
    inner.insert(B, "dir/file", &b"x"[..]);
    let open = Arc::new(tokio::sync::Notify::new());
    let lists = Arc::new(std::sync::Mutex::new(Vec::new()));
    let store = Hooked {
        inner,
        lists: lists.clone(),
        gate: Some(("dir/".into(), open.clone())),
        ..Hooked::default()
    };
    let mut cfg = MountConfig::new(B);
    cfg.metadata_ttl = MetadataTtl::Indefinite;
    let fs = Arc::new(Fs::new(Arc::new(store), cfg));
    let f = fs.clone();
    let lookup = tokio::spawn(async move { f.lookup(ROOT_INO, n("dir")).await });
    while lists.lock().unwrap().is_empty() {
        tokio::task::yield_now().await;
    }
    let_background_run().await;
    assert_eq!(*lists.lock().unwrap(), ["dir/"], "no probe while it is out");
    open.notify_one();
    let entry = lookup.await.unwrap().unwrap();
    assert_eq!(entry.attr.kind, Kind::Dir);
    let_background_run().await;
    assert_eq!(
        *lists.lock().unwrap(),
        ["dir/", ""],
        "then the root's probe"
    );
}

#[tokio::test]
async fn files_opened_by_path_in_an_unlisted_directory_cost_one_lookup_round_trip() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Indefinite);
    for i in 0..50 {
        store.insert(B, &format!("ds/f{i:02}"), &b"x"[..]);
    }
    let ds = fs.lookup(ROOT_INO, n("ds")).await.unwrap().attr.ino;
    let_background_run().await;
    store.reset_stats();
    // The first name: HEAD + LIST as always, and the directory's first page in the background.
    fs.lookup(ds, n("f00")).await.unwrap();
    let_background_run().await;
    let first = store.stats();
    assert_eq!((first.head, first.list), (1, 2), "{first:?}");
    // That page was the whole directory: every other name, and a missing one, without requests.
    for i in 1..50 {
        assert_eq!(
            fs.lookup(ds, n(&format!("f{i:02}")))
                .await
                .unwrap()
                .attr
                .size,
            1
        );
    }
    let after = store.stats();
    assert_eq!(
        (after.head, after.list),
        (first.head, first.list),
        "{after:?}"
    );
    // readdir is served from the adopted listing too.
    assert_eq!(names(&fs, ds).await.len(), 50);
    assert_eq!(store.stats().list, first.list);
}

#[tokio::test]
async fn a_directory_probe_is_dropped_when_the_directory_is_bigger_or_changed_meanwhile() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Indefinite);
    for i in 0..10_001 {
        store.insert(B, &format!("big/f{i:05}"), &b"x"[..]);
    }
    for i in 0..1500 {
        store.insert(B, &format!("mid/f{i:04}"), &b"x"[..]);
    }
    store.insert(B, "small/a", &b"x"[..]);
    store.insert(B, "small/b", &b"x"[..]);
    let big = fs.lookup(ROOT_INO, n("big")).await.unwrap().attr.ino;
    let mid = fs.lookup(ROOT_INO, n("mid")).await.unwrap().attr.ino;
    let small = fs.lookup(ROOT_INO, n("small")).await.unwrap().attr.ino;
    let_background_run().await;
    // Two pages: listed whole in the background and adopted.
    fs.lookup(mid, n("f0000")).await.unwrap();
    let_background_run().await;
    store.reset_stats();
    fs.lookup(mid, n("f1499")).await.unwrap();
    let s = store.stats();
    assert_eq!((s.head, s.list), (0, 0), "{s:?}");
    // More than ten pages: the probe is not adopted, each name is looked up on its own (and the
    // directory is probed once only).
    fs.lookup(big, n("f00000")).await.unwrap();
    let_background_run().await;
    store.reset_stats();
    fs.lookup(big, n("f00001")).await.unwrap();
    let_background_run().await;
    fs.lookup(big, n("f00002")).await.unwrap();
    let s = store.stats();
    assert_eq!((s.head, s.list), (2, 2), "{s:?}");
    // A change through this mount while the probe is out: its (older) listing is not adopted,
    // so the file written meanwhile is not hidden by it.
    fs.lookup(small, n("a")).await.unwrap();
    let ino = write_new(&fs, small, "c", b"new", 3).await;
    let_background_run().await;
    fs.lookup(small, n("b")).await.unwrap();
    let listed: Vec<String> = names(&fs, small)
        .await
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(listed, ["a", "b", "c"]);
    assert_eq!(fs.getattr(ino).await.unwrap().attr.size, 3);
}

#[tokio::test(start_paused = true)]
async fn readers_that_move_the_listing_frontier_back_never_fetch_a_file_twice() {
    let t = SmallFiles::new(64, 64 << 10, &[]).await;
    // A streak builds up (files fetched ahead), one reader jumps far ahead (the streak resets
    // there), then the others go on from far behind it (the frontier moves back and a new streak
    // would fetch ahead again over files the fast reader already opened).
    let mut order: Vec<usize> = (0..=10).collect();
    order.extend([40, 41, 42, 43]);
    order.extend(11..40);
    order.extend(44..64);
    t.read_in(order).await;
    let s = t.mem.stats();
    assert_eq!(s.get, 64, "each file fetched once: {s:?}");
    assert_eq!(unlisted(&t.budget), 0);
}

// ----- write buffers in the memory budget ----------------------------------------------------

fn writable_with_budget(store: Arc<dyn ObjectStore>, budget: MemoryBudget) -> Fs {
    let mut cfg = MountConfig::new(B);
    cfg.read_only = false;
    cfg.allow_delete = true;
    cfg.validate().unwrap();
    Fs::with_budget(store, cfg, budget, PrefetchConfig::default())
}

#[tokio::test]
async fn write_buffers_are_charged_to_the_budget_until_the_upload_completes() {
    let (mem, store) = faulty();
    let budget = MemoryBudget::new(64 << 20);
    let fs = writable_with_budget(store, budget.clone());
    let (_, o) = fs.create(ROOT_INO, n("f"), PID).await.unwrap();
    fs.write(o.fh, 0, &data(3 << 20, 1)).await.unwrap();
    assert!(
        budget.used() >= 3 << 20,
        "3 MiB buffered, {} charged",
        budget.used()
    );
    // Past 1 MiB the charge is a whole part plus the write, at once.
    for i in 0..4u64 {
        fs.write(o.fh, (3 << 20) + i * (1 << 20), &data(1 << 20, 2))
            .await
            .unwrap();
    }
    assert!(budget.used() >= 7 << 20);
    assert_eq!(budget.used(), (PART_SIZE + (3 << 20)) as u64);
    // Past a part: the part is uploaded and the charge stays a part and a write of this size,
    // for the next part.
    fs.write(o.fh, 7 << 20, &data(2 << 20, 2)).await.unwrap();
    assert_eq!(budget.used(), (PART_SIZE + (2 << 20)) as u64);
    // After one huge write, a part and a part at most.
    fs.write(o.fh, 9 << 20, &data(40 << 20, 3)).await.unwrap();
    assert_eq!(budget.used(), 2 * PART_SIZE as u64);
    fs.flush(o.fh, || PID).await.unwrap();
    assert_eq!(budget.used(), 0, "given back when the upload completed");
    fs.release(o.fh).await.unwrap();
    assert_eq!(mem.get_object(B, "f").unwrap().len(), 49 << 20);

    // An abandoned upload (unmounted before any close) gives its charge back too.
    let (_, o) = fs.create(ROOT_INO, n("g"), PID).await.unwrap();
    fs.write(o.fh, 0, &data(1 << 20, 3)).await.unwrap();
    assert!(budget.used() >= 1 << 20);
    fs.teardown().await;
    assert_eq!(budget.used(), 0);
    assert!(mem.get_object(B, "g").is_none());
}

#[tokio::test(start_paused = true)]
async fn a_writer_waits_for_the_budget_and_prefetch_does_not_take_what_it_waits_for() {
    let (mem, store) = faulty();
    let budget = MemoryBudget::new(10 << 20);
    let fs = Arc::new(writable_with_budget(store, budget.clone()));
    let (_, a) = fs.create(ROOT_INO, n("a"), PID).await.unwrap();
    fs.write(a.fh, 0, &data(7 << 20, 4)).await.unwrap();
    let charged = budget.used();
    assert!(charged >= 7 << 20);

    // Writer b needs 4 MiB, which does not fit beside a's buffer: its write waits.
    let (_, b) = fs.create(ROOT_INO, n("b"), PID).await.unwrap();
    let writer = {
        let fs = fs.clone();
        tokio::spawn(async move { fs.write(b.fh, 0, &data(4 << 20, 5)).await })
    };
    // Until b waits: then a one-byte prefetch reservation is refused (3 MiB are free, but b
    // waits for 4).
    let mut spins = 0;
    while budget.try_reserve(1).is_some() {
        assert!(!writer.is_finished(), "b's write cannot fit yet");
        spins += 1;
        assert!(spins < 10_000, "b never waited for the budget");
        tokio::task::yield_now().await;
    }
    assert!(!writer.is_finished(), "b waits while a holds the budget");
    assert_eq!(
        budget.used(),
        charged,
        "b's first charge is what it waits for"
    );
    assert!(
        budget.try_reserve(1).is_none(),
        "prefetch may not take memory a writer waits for"
    );

    // a completes: b's write goes through.
    fs.flush(a.fh, || PID).await.unwrap();
    fs.release(a.fh).await.unwrap();
    assert_eq!(writer.await.unwrap().unwrap(), 4 << 20);
    assert!(budget.used() >= 4 << 20);
    fs.flush(b.fh, || PID).await.unwrap();
    fs.release(b.fh).await.unwrap();
    assert_eq!(budget.used(), 0);
    assert_eq!(mem.get_object(B, "a").unwrap().len(), 7 << 20);
    assert_eq!(mem.get_object(B, "b").unwrap().len(), 4 << 20);
}

#[tokio::test(start_paused = true)]
async fn a_writer_that_cannot_get_memory_goes_over_the_budget_after_a_bounded_wait() {
    let (mem, store) = faulty();
    let budget = MemoryBudget::new(1 << 20);
    let fs = writable_with_budget(store, budget.clone());
    // A paused reader's prefetch (or buffers of files only this process would close) holds it all.
    let held = budget.try_reserve(1 << 20).expect("fits");
    let (_, o) = fs.create(ROOT_INO, n("f"), PID).await.unwrap();
    let start = tokio::time::Instant::now();
    assert_eq!(fs.write(o.fh, 0, &data(100, 1)).await.unwrap(), 100);
    assert!(
        start.elapsed() >= PrefetchConfig::default().write_budget_wait,
        "it waited for the budget first"
    );
    assert!(
        budget.used() > budget.limit(),
        "over the limit, and counted"
    );
    assert!(budget.try_reserve(1).is_none(), "prefetching stays stopped");
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    drop(held);
    assert_eq!(budget.used(), 0);
    assert_eq!(mem.get_object(B, "f").unwrap().len(), 100);
}

/// A part that fails for a reason that may pass (here a server restarting: connections refused
/// through the store's own retries) is tried again for about a minute: the file is kept whole.
/// Longer, or a refusal, fails the upload (nothing committed).
#[tokio::test(start_paused = true)]
async fn a_part_upload_outlives_a_short_outage() {
    let (mem, store) = faulty();
    let fs = writable_with_budget(store.clone(), MemoryBudget::new(64 << 20));
    let body = data(2 * PART_SIZE + 5, 9);
    let down = || StoreError::Transient("connection refused".into());
    store.fail_next(ferry_store::Op::UploadPart, 3, down());
    let (_, o) = fs.create(ROOT_INO, n("kept"), PID).await.unwrap();
    let start = tokio::time::Instant::now();
    fs.write(o.fh, 0, &body).await.unwrap();
    assert!(start.elapsed() >= Duration::from_secs(2 + 4 + 8));
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    assert_eq!(mem.get_object(B, "kept").unwrap(), &body[..]);

    store.fail_next(ferry_store::Op::UploadPart, 6, down());
    let (_, o) = fs.create(ROOT_INO, n("lost"), PID).await.unwrap();
    assert_eq!(errno(fs.write(o.fh, 0, &body).await), libc::EIO);
    assert_eq!(errno(fs.release(o.fh).await), libc::EIO);
    store.fail_next(
        ferry_store::Op::UploadPart,
        1,
        StoreError::AccessDenied("no".into()),
    );
    let (_, o) = fs.create(ROOT_INO, n("refused"), PID).await.unwrap();
    let start = tokio::time::Instant::now();
    assert_eq!(errno(fs.write(o.fh, 0, &body).await), libc::EACCES);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "a refusal is not tried again"
    );
    assert_eq!(errno(fs.release(o.fh).await), libc::EIO);
    assert!(mem.get_object(B, "lost").is_none() && mem.get_object(B, "refused").is_none());
    assert!(mem.uploads(B).is_empty());
}

/// The request that completes a file (its PUT, or the CompleteMultipartUpload after its parts)
/// outlives a short outage as a part does: the close waits, and the file is kept whole. Longer,
/// and the close fails with nothing committed.
#[tokio::test(start_paused = true)]
async fn the_request_completing_a_file_outlives_a_short_outage() {
    let (mem, store) = faulty();
    let fs = writable_with_budget(store.clone(), MemoryBudget::new(64 << 20));
    let down = || StoreError::Transient("connection refused".into());
    let big = data(PART_SIZE + 5, 4);
    for (op, name, body) in [
        (ferry_store::Op::Put, "small", &b"small"[..]),
        (ferry_store::Op::CompleteMultipart, "big", &big[..]),
    ] {
        store.fail_next(op, 3, down());
        let (_, o) = fs.create(ROOT_INO, n(name), PID).await.unwrap();
        fs.write(o.fh, 0, body).await.unwrap();
        let start = tokio::time::Instant::now();
        fs.flush(o.fh, || PID).await.unwrap();
        assert!(start.elapsed() >= Duration::from_secs(2 + 4 + 8), "{name}");
        fs.release(o.fh).await.unwrap();
        assert!(mem.get_object(B, name).unwrap() == body, "{name}");

        store.fail_next(op, 6, down());
        let lost = format!("lost-{name}");
        let (_, o) = fs.create(ROOT_INO, n(&lost), PID).await.unwrap();
        fs.write(o.fh, 0, body).await.unwrap();
        assert_eq!(errno(fs.flush(o.fh, || PID).await), libc::EIO, "{name}");
        assert_eq!(errno(fs.release(o.fh).await), libc::EIO);
        assert!(mem.get_object(B, &lost).is_none(), "{name}");
    }
    assert!(mem.uploads(B).is_empty());
}

/// Past a part, a writer keeps a part plus a write charged for its next part; once it has written
/// nothing for the idle time it gives all but its buffered bytes back (the heap too), and its next
/// write charges again. A writer that goes on keeps its charge.
#[tokio::test(start_paused = true)]
async fn an_idle_writer_gives_its_spare_budget_back() {
    use crate::budget::Use;
    let (mem, store) = faulty();
    let budget = MemoryBudget::new(64 << 20);
    let fs = writable_with_budget(store.clone(), budget.clone());
    let idle = Duration::from_secs(30);
    let body = data(PART_SIZE * 2 + 300, 6);
    let (_, o) = fs.create(ROOT_INO, n("events"), PID).await.unwrap();
    let first = PART_SIZE + 100;
    // Its first part is tried again for 2 + 4 + 8 + 16 s: the writer was busy all along.
    let down = StoreError::Transient("connection refused".into());
    store.fail_next(ferry_store::Op::UploadPart, 4, down);
    fs.write(o.fh, 0, &body[..first]).await.unwrap();
    assert!(budget.used_for(Use::Write) > PART_SIZE as u64);
    tokio::time::advance(idle / 2).await;
    assert_eq!(fs.shrink_idle_writers(idle), 0, "not idle yet");
    tokio::time::advance(idle / 2).await;
    assert!(fs.shrink_idle_writers(idle) > PART_SIZE as u64 - 100);
    assert_eq!(budget.used_for(Use::Write), 100, "the buffered bytes");
    assert_eq!(fs.shrink_idle_writers(idle), 0, "given back once");
    fs.write(o.fh, first as u64, &body[first..]).await.unwrap();
    assert!(budget.used_for(Use::Write) >= 300, "charged again");
    tokio::time::advance(idle * 2).await;
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    assert!(mem.get_object(B, "events").unwrap() == body);
    assert_eq!(budget.used_for(Use::Write), 0);
}

/// Writers that stopped mid-file hold the budget (each its part's charge, until it closes): a
/// writer that goes on waits the bounded wait twice for its first part, and never again for the
/// next ones (each part asked for its memory again, twice, waiting the whole wait each time).
#[tokio::test(start_paused = true)]
async fn a_writer_beside_stopped_writers_waits_for_its_first_part_only() {
    let (mem, store) = faulty();
    let budget = MemoryBudget::new(16 << 20);
    let fs = writable_with_budget(store, budget.clone());
    for name in ["stopped-1", "stopped-2"] {
        let (_, o) = fs.create(ROOT_INO, n(name), PID).await.unwrap();
        fs.write(o.fh, 0, &data(3 << 20, 1)).await.unwrap();
    }
    assert!(budget.used() >= 16 << 20, "{} charged", budget.used());
    let (_, o) = fs.create(ROOT_INO, n("going-on"), PID).await.unwrap();
    let wait = PrefetchConfig::default().write_budget_wait;
    let start = tokio::time::Instant::now();
    let mut at = 0u64;
    while at < 4 * PART_SIZE as u64 {
        fs.write(o.fh, at, &data(1 << 20, 2)).await.unwrap();
        at += 1 << 20;
    }
    let waited = start.elapsed();
    assert!(waited >= wait, "it waited for the budget first");
    assert!(
        waited <= 2 * wait + Duration::from_millis(100),
        "waited {waited:?} for four parts"
    );
    fs.flush(o.fh, || PID).await.unwrap();
    fs.release(o.fh).await.unwrap();
    assert_eq!(mem.get_object(B, "going-on").unwrap().len(), 4 * PART_SIZE);
}

/// A cold `readdir` after the lookup that brought a directory's first page answers from that
/// page at once and lists the rest meanwhile; every entry comes once, whatever the pages'
/// boundary splits (a file shadowed by a directory of the same name on a later page, which also
/// sorts before names of the first page).
#[tokio::test]
async fn a_cold_readdir_serves_the_lookups_first_page_while_the_rest_is_listed() {
    let (store, fs) = setup(|_| {});
    // Page 1 (1,000 keys): 997 "f…", then "zb", "zb-0" and "zb-1"; the next pages: "zb/x"
    // (the directory "zb", shadowing the file, and sorting before "zb-0") and 300 "zz…".
    for i in 0..997 {
        store.insert(B, &format!("d/f{i:04}"), &b"x"[..]);
    }
    for k in ["d/zb", "d/zb-0", "d/zb-1", "d/zb/x"] {
        store.insert(B, k, &b"x"[..]);
    }
    for i in 0..300 {
        store.insert(B, &format!("d/zz{i:04}"), &b"x"[..]);
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    store.reset_stats();
    let fh = fs.opendir(d).unwrap().fh;
    let mut offset = 0;
    let mut seen: Vec<(String, Kind)> = Vec::new();
    loop {
        let mut sink = VecSink {
            cap: 64,
            got: Vec::new(),
        };
        fs.readdir(d, fh, offset, true, &mut sink).await.unwrap();
        if offset == 0 {
            assert_eq!(sink.got.len(), 64);
            assert_eq!(store.stats().list, 0, "answered before any LIST");
        }
        let Some(last) = sink.got.last() else {
            break;
        };
        offset = last.2;
        seen.extend(
            sink.got
                .into_iter()
                .filter(|e| e.0 != "." && e.0 != "..")
                .map(|e| (e.0, e.3)),
        );
    }
    fs.releasedir(fh);
    assert!(store.stats().list >= 1, "the rest was listed");
    assert_eq!(seen.len(), 997 + 3 + 300);
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 997 + 3 + 300, "every entry once");
    let kind = |name: &str| seen.iter().find(|(n, _)| n == name).map(|(_, k)| *k);
    assert_eq!(
        kind("zb"),
        Some(Kind::Dir),
        "the directory shadows the file"
    );
    assert_eq!(kind("zb-0"), Some(Kind::File));
    assert_eq!(kind("zb-1"), Some(Kind::File));
    // The listing is cached as a whole: a new handle lists nothing again, in name order.
    let lists = store.stats().list;
    let again = names(&fs, d).await;
    assert_eq!(again.len(), 997 + 3 + 300);
    assert!(again.windows(2).all(|w| w[0].0 < w[1].0), "in name order");
    assert_eq!(store.stats().list, lists);
}

/// The mount's background listings end with it: once the `Fs` is dropped (unmounted), the rest of
/// a listing a `readdir` went on from a first page, and a lookup's probe of the parent, are
/// aborted, holding the store no longer (before, they went on, detached, until their LISTs
/// ended).
#[tokio::test(start_paused = true)]
async fn the_mounts_background_listings_end_with_it() {
    let (mem, store) = faulty();
    for i in 0..1000 {
        mem.insert(B, &format!("d/f{i:04}"), b"x".to_vec());
    }
    for i in 0..300 {
        mem.insert(B, &format!("d/zz{i:04}"), b"x".to_vec());
    }
    let fs = Fs::new(store.clone(), MountConfig::new(B));
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    // Every LIST from now on takes an hour (the paused clock moves only when all else waits).
    store.set_latency(
        [ferry_store::Op::List],
        Duration::from_secs(3600),
        Duration::ZERO,
    );
    let fh = fs.opendir(d).unwrap().fh;
    let mut sink = VecSink {
        cap: 64,
        got: Vec::new(),
    };
    fs.readdir(d, fh, 0, true, &mut sink).await.unwrap();
    assert_eq!(sink.got.len(), 64, "served from the lookup's first page");
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(Arc::strong_count(&store) > 2, "the rest is being listed");
    drop(fs);
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(
        Arc::strong_count(&store),
        1,
        "no task of the mount holds the store once it is gone"
    );
}

/// A directory whose name its parent's kept listing gave (no lookup brought its first page): a
/// cold `readdir` lists that page itself and answers from it while the rest is listed, as after
/// a lookup's page, instead of waiting for every page.
#[tokio::test(start_paused = true)]
async fn a_cold_readdir_lists_its_own_first_page_and_serves_it_while_the_rest_is_listed() {
    let (mem, store) = faulty();
    for i in 0..1000 {
        mem.insert(B, &format!("d/f{i:04}"), b"x".to_vec());
    }
    for i in 0..300 {
        mem.insert(B, &format!("d/zz{i:04}"), b"x".to_vec());
    }
    let mut cfg = MountConfig::new(B);
    cfg.metadata_ttl = MetadataTtl::Indefinite;
    let fs = Fs::new(store.clone(), cfg);
    assert_eq!(
        names(&fs, ROOT_INO).await,
        vec![("d".to_string(), Kind::Dir)]
    );
    mem.reset_stats();
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    assert_eq!(mem.stats().list, 0, "d is known from the root's listing");
    // Every LIST from now on takes an hour of the paused clock.
    store.set_latency(
        [ferry_store::Op::List],
        Duration::from_secs(3600),
        Duration::ZERO,
    );
    let fh = fs.opendir(d).unwrap().fh;
    let started = Instant::now();
    let mut sink = VecSink {
        cap: 64,
        got: Vec::new(),
    };
    fs.readdir(d, fh, 0, true, &mut sink).await.unwrap();
    assert_eq!(sink.got.len(), 64);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(3600) && waited < Duration::from_secs(7200),
        "one LIST waited for, not the rest after it: {waited:?}"
    );
    let offset = sink.got.last().unwrap().2;
    let mut seen: Vec<String> = sink.got.into_iter().map(|e| e.0).collect();
    let rest = read_handle_from(&fs, d, fh, offset, 64, true).await;
    seen.extend(rest.into_iter().map(|e| e.0));
    fs.releasedir(fh);
    assert_eq!(seen.len(), 2 + 1000 + 300);
    let mut unique = seen.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), seen.len(), "every entry once");
    // The first page was not listed twice, and the listing is kept whole.
    let lists = mem.stats().list;
    assert!((2..=3).contains(&lists), "{lists} LISTs");
    assert_eq!(names(&fs, d).await.len(), 1300);
    assert_eq!(mem.stats().list, lists);
}

/// The root's probe, started as the mount goes live: once it is done, the first lookups and the
/// first listing of the root cost no request. Not with a TTL of 0.
#[tokio::test(start_paused = true)]
async fn the_roots_probe_at_mount_answers_its_first_lookups_and_listing() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(60)));
    for k in ["a", "b/x", "c"] {
        store.insert(B, k, &b"x"[..]);
    }
    fs.probe_root();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(store.stats().list, 1, "the probe's one page");
    store.reset_stats();
    assert_eq!(walk(&fs, "a").await.unwrap().attr.size, 1);
    assert_eq!(walk(&fs, "b").await.unwrap().attr.kind, Kind::Dir);
    assert_eq!(names(&fs, ROOT_INO).await.len(), 3);
    let stats = store.stats();
    assert_eq!((stats.list, stats.head, stats.get), (0, 0, 0), "{stats:?}");

    // With a TTL of 0 nothing listed is kept: no probe.
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO));
    store.insert(B, "a", &b"x"[..]);
    fs.probe_root();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(store.stats().list, 0);
}

/// On an `indefinite` mount a kept listing is the directory's whole content: a name it does not
/// hold is missing with no request, and names this mount creates or removes since are taken into
/// account. With a finite TTL, a name another client put since the listing is still found.
#[tokio::test(start_paused = true)]
async fn an_indefinite_mounts_kept_listing_answers_missing_names_without_a_request() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Indefinite);
    for k in ["d/a", "d/b"] {
        store.insert(B, k, &b"x"[..]);
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    assert_eq!(names(&fs, d).await.len(), 2);
    store.insert(B, "d/late", &b"x"[..]);
    store.reset_stats();
    for name in ["missing", "late", "__init__.py"] {
        assert!(
            matches!(fs.lookup(d, n(name)).await, Err(FsError::NotFound)),
            "{name}"
        );
    }
    assert_eq!(walk(&fs, "d/a").await.unwrap().attr.size, 1);
    let stats = store.stats();
    assert_eq!((stats.list, stats.head, stats.get), (0, 0, 0), "{stats:?}");
    // Created and removed through this mount: seen.
    write_new(&fs, d, "new", b"nn", 1).await;
    assert_eq!(walk(&fs, "d/new").await.unwrap().attr.size, 2);
    fs.unlink(d, n("a")).await.unwrap();
    assert!(matches!(walk(&fs, "d/a").await, Err(FsError::NotFound)));

    // A finite TTL: the listing lists `a` and `b`, and a name put since is looked up in S3.
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(60)));
    for k in ["d/a", "d/b"] {
        store.insert(B, k, &b"x"[..]);
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    assert_eq!(names(&fs, d).await.len(), 2);
    store.insert(B, "d/late", &b"x"[..]);
    assert_eq!(walk(&fs, "d/late").await.unwrap().attr.size, 1);
}

/// A change through this mount while a first page is served and the rest listed: the rest is
/// listed anew, so what the listing joins shows the change.
#[tokio::test]
async fn a_change_while_the_rest_is_listed_lists_it_anew() {
    let (store, fs) = setup(|_| {});
    for i in 0..1000 {
        store.insert(B, &format!("d/f{i:04}"), &b"x"[..]);
    }
    for i in 0..300 {
        store.insert(B, &format!("d/zz{i:04}"), &b"x"[..]);
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    let fh = fs.opendir(d).unwrap().fh;
    let mut sink = VecSink {
        cap: 64,
        got: Vec::new(),
    };
    fs.readdir(d, fh, 0, true, &mut sink).await.unwrap();
    let offset = sink.got.last().unwrap().2;
    let mut seen: Vec<String> = sink.got.into_iter().map(|e| e.0).collect();
    // The rest's LIST has answered (before the change).
    tokio::time::sleep(Duration::from_millis(50)).await;
    fs.unlink(d, n("zz0000")).await.unwrap();
    write_new(&fs, d, "zz0000-new", b"n", 1).await;
    store.reset_stats();
    let rest = read_handle_from(&fs, d, fh, offset, 64, true).await;
    seen.extend(rest.into_iter().map(|e| e.0));
    fs.releasedir(fh);
    assert!(store.stats().list >= 1, "listed anew");
    assert!(
        !seen.iter().any(|n| n == "zz0000"),
        "the unlinked file is gone"
    );
    assert!(
        seen.iter().any(|n| n == "zz0000-new"),
        "the new file is there"
    );
    assert_eq!(seen.len(), 2 + 1000 + 300, "every entry once");
}

/// `ls -la dir` on a cold mount: the lookup's LIST of `dir/` brings the first page, which the
/// listing goes on from — but not once this mount changed the namespace since, nor past the TTL.
#[tokio::test(start_paused = true)]
async fn a_lookups_first_page_starts_the_listing_unless_stale() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(5)));
    for i in 0..1200 {
        store.insert(B, &format!("d/f{i:04}"), &b"x"[..]);
    }
    store.insert(B, "e/x", &b"x"[..]);
    store.insert(B, "g/x", &b"x"[..]);
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    assert_eq!(store.stats().list, 1, "the lookup's LIST");
    store.reset_stats();
    assert_eq!(names(&fs, d).await.len(), 1200);
    // The rest after the first page (the range guessed past it perhaps asked, not waited
    // for), not the first page again.
    let lists = store.stats().list;
    assert!((1..=2).contains(&lists), "{lists} LISTs");

    // A change through this mount after the lookup: the page may miss it.
    let e = walk(&fs, "e").await.unwrap().attr.ino;
    write_new(&fs, ROOT_INO, "new", b"n", 1).await;
    store.reset_stats();
    assert_eq!(names(&fs, e).await.len(), 1);
    assert_eq!(store.stats().list, 1, "listed again");

    // Past the TTL: listed again.
    let g = walk(&fs, "g").await.unwrap().attr.ino;
    tokio::time::advance(Duration::from_secs(6)).await;
    store.insert(B, "g/y", &b"x"[..]);
    store.reset_stats();
    assert_eq!(names(&fs, g).await.len(), 2, "the new key is seen");
    assert_eq!(store.stats().list, 1);
}

/// Every entry (`.` and `..` included) of directory handle `fh` from its start, as (name, the
/// offset it gives), read in batches of `batch`.
async fn stream(fs: &Fs, ino: Ino, fh: u64, batch: usize) -> Vec<(String, u64)> {
    read_handle(fs, ino, fh, batch, true)
        .await
        .into_iter()
        .map(|(name, _, off, ..)| (name, off))
        .collect()
}

fn tag_of(stream: &[(String, u64)]) -> u64 {
    let tag = stream[0].1 >> 32;
    assert!(
        stream.iter().all(|(_, off)| off >> 32 == tag),
        "one tag per stream"
    );
    tag
}

#[tokio::test]
async fn the_kernel_keeps_a_directory_only_while_its_cache_can_hold_nothing_but_the_kept_listing() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Indefinite);
    for i in 0..1500 {
        store.insert(B, &format!("d/f{i:04}"), &b"x"[..]);
    }
    // The lookup lists d's first page: the first stream serves it while the rest is listed.
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    let first = fs.opendir(d).unwrap();
    assert!(
        first.cache_dir,
        "an indefinite mount lets the kernel cache directories"
    );
    assert!(
        !first.keep_cache,
        "nothing known of the kernel's cache yet: it is dropped"
    );
    let s1 = stream(&fs, d, first.fh, 300).await;
    assert_eq!(s1.len(), 1502);
    let indices: Vec<u64> = s1.iter().map(|(_, off)| off & 0xffff_ffff).collect();
    assert_eq!(indices, (1..=1502).collect::<Vec<_>>());
    // The page's entries carry the page's tag; once the rest joined it and the two are the
    // listing itself, the stream goes on under the kept listing's tag.
    let (page_tag, tag) = (s1[0].1 >> 32, s1[1501].1 >> 32);
    assert!(page_tag != 0 && tag != 0 && page_tag != tag);
    fs.releasedir(first.fh);

    // The cache that stream filled holds the kept listing: the next opendir keeps it, is pinned
    // to the listing (no LIST) and, if the kernel asks after all (a page of its cache was
    // reclaimed), gives the very same entries at the very same offsets.
    store.reset_stats();
    let second = fs.opendir(d).unwrap();
    assert!(second.keep_cache);
    // A third handle at once keeps it too.
    let third = fs.opendir(d).unwrap();
    assert!(third.keep_cache);
    let s2 = stream(&fs, d, second.fh, 1000).await;
    assert_eq!(tag_of(&s2), tag);
    let same = |a: &[(String, u64)], b: &[(String, u64)]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.0 == y.0 && x.1 & 0xffff_ffff == y.1 & 0xffff_ffff)
    };
    assert!(same(&s2, &s1), "the same entries at the same positions");
    assert_eq!(stream(&fs, d, third.fh, 7).await, s2);
    assert_eq!(store.stats().list, 0, "served from the kept listing");
    fs.releasedir(second.fh);

    // A change through this mount: the listing is no longer what a cache holds. While a handle
    // of the old listing (`third`) is still open, a new handle neither keeps the cache nor
    // shares a tag with the old listing's entries.
    write_new(&fs, d, "new", b"n", 1).await;
    let changed = fs.opendir(d).unwrap();
    assert!(!changed.keep_cache);
    let s_new = stream(&fs, d, changed.fh, 500).await;
    assert_eq!(s_new.len(), 1503);
    assert!(s_new.iter().any(|(name, _)| name == "new"));
    // (Streamed like the first: its own first page, then the rest joined.)
    assert!(
        s_new.iter().all(|(_, off)| off >> 32 != tag),
        "a different content, a different tag"
    );
    fs.releasedir(changed.fh);
    // The new listing is kept once listed again; `third` (open, and able to fill the kernel's
    // cache with the old entries) still forbids keeping.
    let _ = names(&fs, d).await;
    let o = fs.opendir(d).unwrap();
    assert!(!o.keep_cache, "an old handle is still open");
    fs.releasedir(o.fh);
    fs.releasedir(third.fh);
    // Nothing open: the next opendir drops the cache and its stream fills it; then it is kept.
    let o = fs.opendir(d).unwrap();
    assert!(!o.keep_cache);
    let s3 = stream(&fs, d, o.fh, 1000).await;
    fs.releasedir(o.fh);
    let o = fs.opendir(d).unwrap();
    assert!(o.keep_cache, "the cache holds the listing again");
    assert_eq!(stream(&fs, d, o.fh, 1000).await, s3);
    fs.releasedir(o.fh);
}

/// A mount whose metadata never expires, of a directory `d` of ten files `f0`…`f9`, looked up.
async fn indefinite_dir_of_ten() -> (MemoryStore, Fs, Ino) {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Indefinite);
    for i in 0..10 {
        store.insert(B, &format!("d/f{i}"), &b"x"[..]);
    }
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    (store, fs, d)
}

#[tokio::test]
async fn a_rewound_or_unfinished_stream_keeps_its_tag_rules() {
    let (_, fs, d) = indefinite_dir_of_ten().await;
    let o = fs.opendir(d).unwrap();
    // Half a stream, then released: nothing is known to be complete, and an unfinished fill
    // is no reason not to keep (a cache is only read once complete).
    let mut sink = VecSink {
        cap: 4,
        got: Vec::new(),
    };
    fs.readdir(d, o.fh, 0, true, &mut sink).await.unwrap();
    fs.releasedir(o.fh);
    let o = fs.opendir(d).unwrap();
    assert!(o.keep_cache, "the stream's listing is the kept one");
    // A rewind (offset 0 again) serves the same listing under the same tag.
    let a = stream(&fs, d, o.fh, 5).await;
    let b = stream(&fs, d, o.fh, 5).await;
    assert_eq!(a, b);
    fs.releasedir(o.fh);
}

#[tokio::test]
async fn a_mount_with_a_ttl_of_zero_or_no_way_to_drop_a_cache_leaves_directories_uncached() {
    for ttl in [Duration::ZERO, Duration::from_secs(60)] {
        let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(ttl));
        if ttl.is_zero() {
            fs.set_kernel_invalidator(KernelInvalidator::new(|_| {}));
        }
        store.insert(B, "d/a", &b"x"[..]);
        let d = walk(&fs, "d").await.unwrap().attr.ino;
        for _ in 0..2 {
            let o = fs.opendir(d).unwrap();
            assert!(!o.cache_dir && !o.keep_cache, "{ttl:?}");
            let s = stream(&fs, d, o.fh, 10).await;
            let offsets: Vec<u64> = s.iter().map(|(_, off)| *off).collect();
            assert_eq!(offsets, [1, 2, 3], "plain offsets");
            fs.releasedir(o.fh);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_mount_with_a_ttl_has_the_kernel_drop_a_directory_when_its_listing_expires() {
    let (store, fs) = setup(|c| c.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(10)));
    store.insert(B, "d/a", &b"x"[..]);
    let dropped: Arc<std::sync::Mutex<Vec<Ino>>> = Default::default();
    let seen = dropped.clone();
    fs.set_kernel_invalidator(KernelInvalidator::new(move |ino| {
        seen.lock().unwrap().push(ino)
    }));
    let d = walk(&fs, "d").await.unwrap().attr.ino;
    let o = fs.opendir(d).unwrap();
    assert!(o.cache_dir && !o.keep_cache);
    assert_eq!(stream(&fs, d, o.fh, 10).await.len(), 3);
    fs.releasedir(o.fh);
    let pinned = fs.opendir(d).unwrap();
    assert!(pinned.keep_cache, "within the TTL the cache is kept");
    let settle = || async {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    };
    tokio::time::advance(Duration::from_secs(9)).await;
    settle().await;
    assert!(
        dropped.lock().unwrap().is_empty(),
        "not before the TTL ends"
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    settle().await;
    assert_eq!(
        *dropped.lock().unwrap(),
        [d],
        "dropped once, at the TTL's end"
    );
    // Past it: a new opendir does not keep, and the handle pinned before it but read only
    // now lists afresh (what changed in S3 shows).
    store.insert(B, "d/b", &b"x"[..]);
    let o = fs.opendir(d).unwrap();
    assert!(!o.keep_cache);
    fs.releasedir(o.fh);
    let names: Vec<String> = stream(&fs, d, pinned.fh, 10)
        .await
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, [".", "..", "a", "b"]);
    fs.releasedir(pinned.fh);
}

#[tokio::test]
async fn a_successor_keeps_no_directory_its_predecessors_handles_may_have_filled() {
    let (store, fs, d) = indefinite_dir_of_ten().await;
    let old = fs.opendir(d).unwrap();
    let before = stream(&fs, d, old.fh, 3).await;
    let snap = fs.snapshot().await;
    let json = serde_json::to_string(&snap).unwrap();
    let fs2 = Fs::from_snapshot(
        Arc::new(store.clone()),
        serde_json::from_str(&json).unwrap(),
        MemoryBudget::default(),
        PrefetchConfig::default(),
    );
    // The carried handle goes on where it was (offsets index the entries whatever their tag).
    let mut sink = VecSink {
        cap: 100,
        got: Vec::new(),
    };
    fs2.readdir(d, old.fh, before[4].1, true, &mut sink)
        .await
        .unwrap();
    let rest: Vec<&str> = sink.got.iter().map(|g| g.0.as_str()).collect();
    assert_eq!(rest, ["f3", "f4", "f5", "f6", "f7", "f8", "f9"]);
    // The successor lists and streams the directory to its end: its cache could still hold
    // the predecessor's handle's entries, so nothing is kept while that handle is open.
    let o = fs2.opendir(d).unwrap();
    assert!(!o.keep_cache);
    let s = stream(&fs2, d, o.fh, 100).await;
    assert!(
        tag_of(&s) > tag_of(&before),
        "the successor's tags start above its predecessor's open handles'"
    );
    fs2.releasedir(o.fh);
    let o = fs2.opendir(d).unwrap();
    assert!(!o.keep_cache, "the carried handle is open");
    fs2.releasedir(o.fh);
    fs2.releasedir(old.fh);
    let o = fs2.opendir(d).unwrap();
    assert!(!o.keep_cache, "dropped now, with nothing open");
    stream(&fs2, d, o.fh, 100).await;
    fs2.releasedir(o.fh);
    assert!(fs2.opendir(d).unwrap().keep_cache);
}
