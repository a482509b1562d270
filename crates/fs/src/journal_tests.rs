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
    let dir_fh = fs.opendir(a).unwrap().fh;
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

/// A journal of a few inodes and handles, and its file.
async fn small_journal() -> (MemoryStore, Fs, File) {
    let (store, cfg) = setup();
    store.insert(B, "a/x.txt", &b"hello x"[..]);
    let (fs, file) = journaled(&store, cfg);
    let a = fs.lookup(ROOT_INO, n("a")).await.unwrap().attr.ino;
    let x = fs.lookup(a, n("x.txt")).await.unwrap().attr.ino;
    fs.open(x, libc::O_RDONLY, PID).await.unwrap();
    fs.mkdir(ROOT_INO, n("d")).await.unwrap();
    (store, fs, file)
}

fn bytes_of(file: &mut File) -> Vec<u8> {
    let mut v = Vec::new();
    file.seek(SeekFrom::Start(0)).unwrap();
    std::io::Read::read_to_end(file, &mut v).unwrap();
    v
}

fn file_with(bytes: &[u8]) -> File {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(bytes).unwrap();
    f
}

#[tokio::test]
async fn a_torn_last_record_is_ignored() {
    let (_store, fs, mut file) = small_journal().await;
    let whole = replay(&mut file).unwrap();
    // One record.
    let fh = fs.opendir(ROOT_INO).unwrap().fh;
    let bytes = bytes_of(&mut file);
    let last = replay(&mut file.try_clone().unwrap()).unwrap();
    assert_eq!(last.handles.len(), whole.handles.len() + 1);
    assert_eq!(last.handles.last().unwrap().0, fh);
    // Every cut inside the last record replays to the state before it.
    let start = whole_len(&whole, &bytes);
    for cut in start..bytes.len() {
        let got = replay(&mut file_with(&bytes[..cut])).unwrap();
        assert_eq!(got, whole, "cut at {cut}");
    }
    // A torn payload of the right length fails its CRC: ignored too.
    let mut flipped = bytes.clone();
    *flipped.last_mut().unwrap() ^= 0x55;
    assert_eq!(replay(&mut file_with(&flipped)).unwrap(), whole);
}

/// Where the last record of `bytes` starts (the journal `whole` is everything before it).
fn whole_len(whole: &Recovered, bytes: &[u8]) -> usize {
    let mut offset = FILE_HEADER_LEN;
    let mut last = offset;
    while offset < bytes.len() {
        last = offset;
        let len = u32::from_le_bytes(bytes[offset..offset + 4].try_into().unwrap()) as usize;
        offset += 8 + len;
    }
    assert!(!whole.handles.is_empty());
    last
}

#[tokio::test]
async fn a_flipped_byte_mid_file_is_an_error() {
    let (_store, _fs, mut file) = small_journal().await;
    let mut bytes = bytes_of(&mut file);
    // Inside the Start record's payload (well past the 8-byte frame header).
    bytes[FILE_HEADER_LEN + 20] ^= 0x01;
    match replay(&mut file_with(&bytes)) {
        Err(JournalError::Corrupt { offset, .. }) => assert_eq!(offset, FILE_HEADER_LEN as u64),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn other_versions_and_files_are_refused() {
    let (_store, _fs, mut file) = small_journal().await;
    let mut bytes = bytes_of(&mut file);
    bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
    let err = replay(&mut file_with(&bytes)).unwrap_err();
    assert!(matches!(err, JournalError::UnsupportedVersion { found: 2 }));
    assert_eq!(
        err.to_string(),
        "journal format version 2 is not supported (this build reads version 1)"
    );
    bytes[..8].copy_from_slice(b"NOTAJRNL");
    assert!(matches!(
        replay(&mut file_with(&bytes)),
        Err(JournalError::BadMagic)
    ));
    // A journal cut off before its live set was complete.
    let bytes = bytes_of(&mut file);
    assert!(matches!(
        replay(&mut file_with(&bytes[..FILE_HEADER_LEN + 40])),
        Err(JournalError::Incomplete(_))
    ));
}

#[tokio::test]
async fn a_broken_journal_is_refused() {
    let (store, cfg) = setup();
    let (fs, mut file) = journaled(&store, cfg);
    fs.mkdir(ROOT_INO, n("d")).await.unwrap();
    let journal = fs.journal().unwrap();
    // What a failed append does (the file itself still takes the markers here).
    journal.fail(&mut journal.lock(), std::io::Error::other("no space left"));
    assert!(journal.is_broken());
    let len = journal.len_bytes();
    let written = bytes_of(&mut file).len();
    fs.mkdir(ROOT_INO, n("after")).await.unwrap();
    assert_eq!(journal.len_bytes(), len, "nothing is appended once broken");
    assert_eq!(bytes_of(&mut file).len(), written);
    let err = replay(&mut file).unwrap_err();
    assert!(matches!(err, JournalError::Incomplete(_)), "{err}");
    assert!(err.to_string().starts_with("incomplete journal"), "{err}");
    // The Broken record alone (magic intact) is refused too.
    let mut bytes = bytes_of(&mut file);
    bytes[..8].copy_from_slice(JOURNAL_MAGIC);
    let err = replay(&mut file_with(&bytes)).unwrap_err();
    assert!(err.to_string().contains("no space left"), "{err}");
}

#[tokio::test]
async fn compaction_keeps_the_live_set_and_later_appends_land_in_the_new_file() {
    let (store, cfg) = setup();
    for i in 0..20 {
        store.insert(B, &format!("f{i}"), &b"x"[..]);
    }
    let (fs, mut old) = journaled(&store, cfg);
    let mut inos = Vec::new();
    for i in 0..20 {
        inos.push(
            fs.lookup(ROOT_INO, n(&format!("f{i}")))
                .await
                .unwrap()
                .attr
                .ino,
        );
    }
    for &ino in &inos[..15] {
        fs.forget(ino, 1);
    }
    let fh = fs.open(inos[19], libc::O_RDONLY, PID).await.unwrap().fh;
    let closed = fs.open(inos[18], libc::O_RDONLY, PID).await.unwrap().fh;
    fs.release(closed).await.unwrap();
    let journal = fs_journal(&fs);
    assert!(journal.records_since_compaction() >= 20 + 15 + 3);
    let before = replay(&mut old).unwrap();

    let mut new = tempfile::tempfile().unwrap();
    fs.compact_journal(new.try_clone().unwrap()).unwrap();
    assert_eq!(journal.records_since_compaction(), 0);
    assert_eq!(journal.len_bytes(), bytes_of(&mut new).len() as u64);
    let compacted = replay(&mut new).unwrap();
    assert_eq!(compacted, before);
    assert_eq!(compacted.inodes.len(), 5);
    assert_eq!(compacted.handles.len(), 1);
    assert_eq!(compacted.handles[0].0, fh);
    assert!(matches!(replay(&mut old), Err(JournalError::Superseded)));

    fs.mkdir(ROOT_INO, n("later")).await.unwrap();
    // The new inode, then its local state.
    assert_eq!(journal.records_since_compaction(), 2);
    let after = replay(&mut new).unwrap();
    assert_eq!(after.inodes.len(), 6);
    assert!(after
        .inodes
        .iter()
        .any(|r| r.inode.name == "later" && r.inode.local_dir));
}

fn fs_journal(fs: &Fs) -> Arc<Journal> {
    fs.journal().expect("attached")
}

/// One change to the tables.
#[derive(Debug, Clone)]
enum Op {
    /// Install child `name` (of a small set) of kind `dir` below the `parent`-th live directory.
    Install {
        parent: usize,
        name: u8,
        dir: bool,
    },
    /// The kernel forgets the `n`-th live inode.
    Forget(usize),
    /// Make the `n`-th live directory local (or not).
    Local(usize, bool),
    Open(usize),
    Close(usize),
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..4, any::<bool>())
            .prop_map(|(parent, name, dir)| Op::Install { parent, name, dir }),
        3 => any::<usize>().prop_map(Op::Forget),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, l)| Op::Local(i, l)),
        2 => any::<usize>().prop_map(Op::Open),
        2 => any::<usize>().prop_map(Op::Close),
        1 => Just(Op::Compact),
    ]
}

/// The live set of the tables, as a journal records it.
fn live_set(inodes: &InodeTable, handles: &HandleTable) -> Recovered {
    let mut v: Vec<_> = inodes
        .iter()
        .filter(|i| i.ino != ROOT_INO)
        .map(|i| RecoveredInode {
            inode: InodeRecord::of(i),
            attached: inodes.is_attached(i),
        })
        .collect();
    v.sort_by_key(|r| r.inode.ino);
    Recovered {
        header: JournalHeader {
            config: MountConfig::new(B),
            mount_time: SystemTime::UNIX_EPOCH,
            extra: serde_json::Value::Null,
        },
        inodes: v,
        handles: handles
            .journaled()
            .into_iter()
            .map(|(fh, h, _)| (fh, h.clone()))
            .collect(),
        requests: handles.requests(),
    }
}

proptest! {
    #[test]
    fn replay_matches_the_tables(ops in prop::collection::vec(op(), 1..80)) {
        let mut file = tempfile::tempfile().unwrap();
        let journal = Arc::new(Journal::new(file.try_clone().unwrap(), serde_json::Value::Null));
        let mut inodes = InodeTable::new();
        let mut handles = HandleTable::default();
        journal.begin(&MountConfig::new(B), SystemTime::UNIX_EPOCH, &inodes, &handles);
        inodes.attach_journal(journal.clone());
        handles.attach_journal(journal.clone());
        for op in ops {
            let mut live: Vec<Ino> = inodes.iter().map(|i| i.ino).collect();
            live.sort();
            let mut dirs: Vec<Ino> =
                inodes.iter().filter(|i| i.kind == Kind::Dir).map(|i| i.ino).collect();
            dirs.sort();
            match op {
                Op::Install { parent, name, dir } => {
                    let parent = dirs[parent % dirs.len()];
                    let kind = if dir { Kind::Dir } else { Kind::File };
                    let ino = inodes.install_child(parent, &format!("n{name}"), kind).unwrap();
                    inodes.get_mut(ino).unwrap().lookups += 1;
                }
                Op::Forget(i) => inodes.forget(live[i % live.len()], 1),
                Op::Local(i, local) => {
                    let ino = dirs[i % dirs.len()];
                    if ino != ROOT_INO {
                        let state = if local { InodeState::LocalDir } else { InodeState::Remote };
                        inodes.set_state(ino, state);
                        inodes.maybe_remove(ino);
                    }
                }
                Op::Open(i) => {
                    let ino = live[i % live.len()];
                    handles.insert(Handle::Dir(DirHandle::new(ino)));
                }
                Op::Close(i) => {
                    let open: Vec<u64> = handles.journaled().iter().map(|(fh, _, _)| *fh).collect();
                    if !open.is_empty() {
                        handles.remove(open[i % open.len()]);
                    }
                }
                Op::Compact => {
                    let new = tempfile::tempfile().unwrap();
                    journal.compact_into(new.try_clone().unwrap(), &inodes, &handles).unwrap();
                    file = new;
                }
            }
        }
        prop_assert!(!journal.is_broken());
        let mut got = replay(&mut file).unwrap();
        got.header.config = MountConfig::new(B);
        prop_assert_eq!(got, live_set(&inodes, &handles));
    }
}

#[test]
fn an_inode_whose_parent_is_gone_is_detached() {
    // Found by fuzzing: replay called such an inode attached, the table rebuilt from the replay
    // (and so the journal a successor writes) detached.
    let header = JournalHeader {
        config: MountConfig::new(B),
        mount_time: SystemTime::UNIX_EPOCH,
        extra: serde_json::Value::Null,
    };
    let inode = |ino, parent, name: &str, kind| Record::Inode {
        inode: InodeRecord {
            ino,
            parent,
            name: name.into(),
            path: name.into(),
            kind,
            local_dir: false,
        },
        attached: true,
    };
    let mut file = file_with(&[&JOURNAL_MAGIC[..], &JOURNAL_VERSION.to_le_bytes()].concat());
    for r in [
        Record::Start { header },
        inode(2, ROOT_INO, "d", Kind::Dir),
        inode(3, 2, "f", Kind::File),
        inode(4, 9, "g", Kind::File),
        Record::Ready,
    ] {
        write_record(&file, &r).unwrap();
    }
    let rec = replay(&mut file).unwrap();
    let attached: Vec<_> = rec
        .inodes
        .iter()
        .map(|i| (i.inode.ino, i.attached))
        .collect();
    assert_eq!(attached, [(2, true), (3, true), (4, false)]);
    let again = file_with(&[]);
    write_snapshot(
        again.try_clone().unwrap(),
        &recovered_snapshot(&rec),
        serde_json::Value::Null,
    )
    .unwrap();
    assert_eq!(
        replay(&mut again.try_clone().unwrap()).unwrap().inodes,
        rec.inodes
    );
}

/// The process is killed after an open's handle is journaled but before the kernel got the
/// reply: the kernel re-sends that `OPEN` (same `unique`) to the successor, which opens it again.
/// The handle the kernel never received (here one through passthrough, as the adapter's join of
/// an inode's backing file makes it) must not keep the inode open for the rest of the mount's
/// life. Likewise a `CREATE`'s write handle.
#[tokio::test]
async fn a_handle_whose_open_was_never_answered_does_not_outlive_the_crash() {
    const OPEN: u64 = 1000;
    const CREATE: u64 = 1001;
    let (store, cfg) = setup();
    store.insert(B, "f", &b"old"[..]);
    let (fs, mut file) = journaled(&store, cfg);
    let ino = fs.lookup(ROOT_INO, n("f")).await.unwrap().attr.ino;
    let orphan = fs
        .open_for(ino, libc::O_RDONLY, PID, Some(OPEN))
        .await
        .unwrap()
        .fh;
    assert!(fs.join_passthrough(orphan, 7));
    fs.create_for(ROOT_INO, n("g"), PID, Some(CREATE))
        .await
        .unwrap();
    // kill -9 before the replies.
    drop(fs);

    let (rec, fs) = recover(&store, &mut file);
    assert_eq!(rec.requests.len(), 2, "{:?}", rec.requests);
    // The kernel's re-sent OPEN, answered this time; then the reader closes.
    assert_eq!(fs.forget_unanswered(OPEN).await, Some(orphan));
    let r = fs
        .open_for(ino, libc::O_RDONLY, PID, Some(OPEN))
        .await
        .unwrap()
        .fh;
    assert!(fs.join_passthrough(r, 7));
    fs.release(r).await.unwrap();
    // Nothing is open in the kernel: the file can be replaced.
    match fs.open(ino, libc::O_WRONLY | libc::O_TRUNC, PID).await {
        Ok(w) => fs.release(w.fh).await.unwrap(),
        Err(e) => panic!(
            "replacing the file after its only reader closed: {e} (errno {}); handles left: {:?}",
            e.errno(),
            fs.passthrough_handles()
        ),
    }
    // The re-sent CREATE makes the file, written by its writer.
    assert!(fs.forget_unanswered(CREATE).await.is_some());
    let (_, w) = fs
        .create_for(ROOT_INO, n("g"), PID, Some(CREATE))
        .await
        .unwrap();
    fs.write(w.fh, 0, b"new").await.unwrap();
    fs.release(w.fh).await.unwrap();
    assert_eq!(&store.get_object(B, "g").unwrap()[..], b"new");
    assert_eq!(fs.table_sizes().1, 0, "handles left");
    // A request never re-sent (answered) names no handle to drop.
    assert_eq!(fs.forget_unanswered(OPEN).await, None);
}
