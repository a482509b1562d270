//! Journal tests: round trips through the filesystem on `MemoryStore`, torn and corrupt files,
//! compaction, and a property test of the tables against their replay.

use std::ffi::OsStr;
use std::io::{Seek, SeekFrom, Write};

use ferry_store::MemoryStore;
use proptest::prelude::*;

use super::*;
use crate::budget::{MemoryBudget, PrefetchConfig};
use crate::error::FsError;
use crate::fs::Fs;
use crate::inode::InodeState;

const B: &str = "bkt";
const PID: u32 = 42;

fn n(s: &str) -> &OsStr {
    OsStr::new(s)
}

fn setup() -> (MemoryStore, MountConfig) {
    let store = MemoryStore::new();
    store.create_bucket(B);
    let mut cfg = MountConfig::new(B);
    cfg.read_only = false;
    cfg.allow_delete = true;
    cfg.allow_overwrite = true;
    cfg.validate().unwrap();
    (store, cfg)
}

fn journaled(store: &MemoryStore, cfg: MountConfig) -> (Fs, File) {
    let file = tempfile::tempfile().unwrap();
    let journal = Journal::new(
        file.try_clone().unwrap(),
        serde_json::json!({"volume": "v1"}),
    );
    let fs = Fs::new(Arc::new(store.clone()), cfg).with_journal(Arc::new(journal));
    (fs, file)
}

fn recover(store: &MemoryStore, file: &mut File) -> (Recovered, Fs) {
    let rec = replay(file).unwrap();
    let fs = Fs::from_snapshot(
        Arc::new(store.clone()),
        recovered_snapshot(&rec),
        MemoryBudget::default(),
        PrefetchConfig::default(),
    );
    (rec, fs)
}

/// (ino, parent, name, path, kind, local) of every inode, sorted.
async fn inodes_of(fs: &Fs) -> Vec<(Ino, Ino, String, String, Kind, bool)> {
    let mut v: Vec<_> = fs
        .snapshot()
        .await
        .inodes
        .iter()
        .map(|i| {
            (
                i.ino,
                i.parent,
                i.name.clone(),
                i.path.clone(),
                i.kind,
                i.state == InodeState::LocalDir,
            )
        })
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn a_crashed_mount_comes_back_from_its_journal() {
    let (store, cfg) = setup();
    store.insert(B, "a/x.txt", &b"hello x"[..]);
    store.insert(B, "b.txt", &b"bee"[..]);
    store.insert(B, "c.txt", &b"sea"[..]);
    let (fs, mut file) = journaled(&store, cfg);

    let a = fs.lookup(ROOT_INO, n("a")).await.unwrap().attr.ino;
    let x = fs.lookup(a, n("x.txt")).await.unwrap().attr.ino;
    let b = fs.lookup(ROOT_INO, n("b.txt")).await.unwrap().attr.ino;
    let reading = fs.open(x, libc::O_RDONLY, PID).await.unwrap().fh;
    assert_eq!(&fs.read(reading, 0, 5).await.unwrap()[..], b"hello");
    let c = fs.lookup(ROOT_INO, n("c.txt")).await.unwrap().attr.ino;
    let pinned = fs.open(c, libc::O_RDONLY, PID).await.unwrap().fh;
    let closed = fs.open(b, libc::O_RDONLY, PID).await.unwrap().fh;
    fs.release(closed).await.unwrap();
    fs.forget(b, 1);
    let dir_fh = fs.opendir(a).unwrap();
    let d = fs.mkdir(ROOT_INO, n("d")).await.unwrap().attr.ino;
    let (e, w) = fs.create(d, n("new.bin"), PID).await.unwrap();
    fs.write(w.fh, 0, b"lost with the process").await.unwrap();
    let before = inodes_of(&fs).await;
    // kill -9: nothing runs after this point.
    drop(fs);

    // The object changes meanwhile: the open handle stays pinned to the version it opened.
    store.insert(B, "c.txt", &b"SEA, v2"[..]);
    let (rec, fs) = recover(&store, &mut file);
    assert_eq!(rec.header.extra["volume"], "v1");
    assert_eq!(inodes_of(&fs).await, before);
    assert!(
        before.iter().all(|i| i.0 != b),
        "forgotten inodes stay gone"
    );
    assert!(before.contains(&(d, ROOT_INO, "d".into(), "d".into(), Kind::Dir, true)));

    // Same numbers, same names.
    assert_eq!(fs.lookup(ROOT_INO, n("a")).await.unwrap().attr.ino, a);
    assert_eq!(fs.lookup(a, n("x.txt")).await.unwrap().attr.ino, x);
    assert_eq!(fs.getattr(d).await.unwrap().attr.kind, Kind::Dir);
    // Open read handles read on, pinned to the version they opened.
    assert_eq!(&fs.read(reading, 5, 100).await.unwrap()[..], b" x");
    assert!(matches!(
        fs.read(pinned, 0, 5).await,
        Err(FsError::Stale(_))
    ));
    let again = fs.open(c, libc::O_RDONLY, PID).await.unwrap().fh;
    assert_eq!(&fs.read(again, 0, 100).await.unwrap()[..], b"SEA, v2");
    // The directory handle lists afresh.
    let mut sink = Names::default();
    fs.readdir(a, dir_fh, 0, false, &mut sink).await.unwrap();
    assert_eq!(sink.0, [".", "..", "x.txt"]);
    // The write handle lost its data: the writer gets EIO, and no object appears.
    let err = fs.write(w.fh, 21, b"more").await.unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    let err = fs.flush(w.fh, || PID).await.unwrap_err();
    assert_eq!(err.errno(), libc::EIO);
    assert!(fs.release(w.fh).await.is_err());
    assert!(store.get_object(B, "d/new.bin").is_none());
    assert!(fs.lookup(d, n("new.bin")).await.is_err());
    // Recovered inodes outlive any forget (the kernel's counts are unknown).
    fs.forget(e.attr.ino, 1_000_000);
    fs.forget(x, 1_000_000);
    assert!(inodes_of(&fs).await.iter().any(|i| i.0 == x));
}

#[derive(Default)]
struct Names(Vec<String>);

impl crate::fs::DirSink for Names {
    fn add(&mut self, e: &crate::fs::DirEntry<'_>) -> bool {
        self.0.push(e.name.to_owned());
        false
    }
}
