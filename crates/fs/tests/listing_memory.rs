//! What a kept directory listing costs in memory, measured with a counting allocator, against what
//! the memory budget is charged for it (`Use::Listing`): the charge must cover the heap the
//! listing keeps (the budget bounds memory only if its charges do), and not overstate it so much
//! that directories the budget could hold are listed again and again.
//!
//! One test in this file: the allocator counts every thread of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::ffi::OsStr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use ferry_fs::budget::Use;
use ferry_fs::fs::{DirEntry, DirSink};
use ferry_fs::inode::ROOT_INO;
use ferry_fs::{Fs, MemoryBudget, MetadataTtl, MountConfig, PrefetchConfig};
use ferry_store::MemoryStore;

struct Counting;

static IN_USE: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        IN_USE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        IN_USE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        IN_USE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

struct Count(usize);

impl DirSink for Count {
    fn add(&mut self, _: &DirEntry<'_>) -> bool {
        self.0 += 1;
        false
    }
}

/// Lists `dir` once, to its end, through `readdir` or (`plus`) `readdirplus`, which hands the
/// kernel an inode per entry; returns how many entries it gave.
async fn list(fs: &Fs, dir: u64, plus: bool) -> usize {
    let fh = fs.opendir(dir).unwrap().fh;
    let mut total = 0;
    loop {
        let mut batch = Count(0);
        fs.readdir(dir, fh, total as u64, plus, &mut batch)
            .await
            .unwrap();
        if batch.0 == 0 {
            break;
        }
        total += batch.0;
    }
    fs.releasedir(fh);
    total
}

#[tokio::test(flavor = "current_thread")]
async fn a_kept_listing_is_charged_what_it_keeps() {
    const B: &str = "bkt";
    const N: usize = 20_000;
    let store = MemoryStore::new();
    store.create_bucket(B);
    // Names as a dataset has them: 30–40 bytes, every ETag a quoted MD5 (34 bytes).
    for i in 0..N {
        store.insert(
            B,
            &format!("train/images/n{:08}_{i:06}.JPEG", i * 7919 % 100_000_000),
            vec![b'x'; 1 + i % 7],
        );
    }
    let budget = MemoryBudget::new(1 << 30);
    let mut cfg = MountConfig::new(B);
    cfg.metadata_ttl = MetadataTtl::Indefinite;
    let fs = Fs::with_budget(
        Arc::new(store.clone()),
        cfg,
        budget.clone(),
        PrefetchConfig::default(),
    );
    let mut images = ROOT_INO;
    for name in ["train", "images"] {
        images = fs.lookup(images, OsStr::new(name)).await.unwrap().attr.ino;
    }

    let before = IN_USE.load(Ordering::Relaxed);
    assert_eq!(
        list(&fs, images, false).await,
        N + 2,
        "every name, with . and .."
    );
    let kept = IN_USE.load(Ordering::Relaxed) - before;
    let charged = budget.used_for(Use::Listing) as i64;
    // Served from what is kept: the second listing asks S3 nothing and keeps nothing more.
    store.reset_stats();
    assert_eq!(list(&fs, images, false).await, N + 2);
    assert_eq!(store.stats().list, 0, "the second listing is the kept one");
    let again = IN_USE.load(Ordering::Relaxed) - before;
    eprintln!(
        "{N} entries: kept {kept} bytes ({} per entry), charged {charged} ({} per entry); \
         after a second listing {again}",
        kept / N as i64,
        charged / N as i64
    );
    assert!(charged > 0, "the listing is kept and charged");
    assert!(
        charged >= kept,
        "charged {charged} bytes for a listing that keeps {kept}"
    );
    assert!(
        charged <= kept + kept / 2,
        "charged {charged} bytes for a listing that keeps {kept}: more than 1.5 times"
    );
    assert!(
        again <= kept + kept / 20,
        "a second listing keeps nothing more: {again} against {kept}"
    );

    // Eight readers with the directory open at once (data loader workers listing a dataset):
    // their handles share the kept listing, none copies it.
    let open_before = IN_USE.load(Ordering::Relaxed);
    let mut handles = Vec::new();
    for _ in 0..8 {
        let fh = fs.opendir(images).unwrap().fh;
        let mut batch = Count(0);
        fs.readdir(images, fh, 0, false, &mut batch).await.unwrap();
        assert!(batch.0 > 0);
        handles.push(fh);
    }
    let held = IN_USE.load(Ordering::Relaxed) - open_before;
    eprintln!("8 open handles of the directory: {held} bytes");
    assert!(
        held < kept / 10,
        "8 open handles hold {held} bytes against a listing of {kept}"
    );
    for fh in handles {
        fs.releasedir(fh);
    }

    // `ls -l`: readdirplus hands the kernel an inode per entry, which Ferry keeps until the
    // kernel forgets it.
    let inodes = || ferry_metrics::metrics().node.inodes.get();
    let inodes_before = inodes();
    let plus_before = IN_USE.load(Ordering::Relaxed);
    assert_eq!(list(&fs, images, true).await, N + 2);
    // `ferry_inodes` shows them, and gives them back with the mount.
    assert_eq!(
        inodes() - inodes_before,
        N as i64,
        "ferry_inodes counts each entry's inode"
    );
    let per_inode = (IN_USE.load(Ordering::Relaxed) - plus_before) / N as i64;
    eprintln!("an inode per entry (readdirplus): {per_inode} bytes each");
    assert!(
        per_inode <= 640,
        "{per_inode} bytes per file inode (name, path and metadata included)"
    );
    let mounted = inodes();
    drop(fs);
    assert_eq!(
        mounted - inodes(),
        N as i64 + 3,
        "the mount's inodes (root, train, images and the files) leave ferry_inodes with it"
    );
}
