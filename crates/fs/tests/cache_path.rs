//! The node cache on the read path, on a real S3 server (versitygw) through real FUSE mounts,
//! with every request counted: the cache costs no round trip a mount without it would not pay
//! (no HEAD to prove access to versions the listing named; each file fetched once, ahead of the
//! reader), a loader's shuffled epoch over a read-only dataset is swept into the cache, and its
//! second epoch makes no request at all.

use std::path::Path;
use std::sync::Arc;

use ferry_cache::{BlockCache, CacheConfig};
use ferry_fs::{mount, MemoryBudget, MetadataTtl, MountConfig, MountContext, MountHandle, Use};
use ferry_s3::S3Store;
use ferry_store::{FaultyStore, ObjectStore, Op};
use ferry_testkit::S3Server;

const BUCKET: &str = "data";

struct Setup {
    rt: tokio::runtime::Runtime,
    _server: S3Server,
    store: Arc<FaultyStore<S3Store>>,
    cache: Arc<BlockCache>,
    _cache_dir: tempfile::TempDir,
    dir: tempfile::TempDir,
    files: Vec<(String, Vec<u8>)>,
}

fn body(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((j as u32).wrapping_mul(2_654_435_761) >> 13) as u8 ^ i as u8)
        .collect()
}

/// `n` files of `len` bytes under `ds/`, and a FaultyStore (counting only) in front of the server.
fn setup(n: usize, len: usize) -> Option<Setup> {
    if !ferry_testkit::prerequisite(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse (real FUSE mounts)",
    ) {
        return None;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    let server = S3Server::start();
    let files: Vec<(String, Vec<u8>)> =
        (0..n).map(|i| (format!("f{i:04}"), body(i, len))).collect();
    let store = rt.block_on(async {
        server.create_bucket(BUCKET).await;
        let s3 = server.store().await;
        for (name, data) in &files {
            s3.put(BUCKET, &format!("ds/{name}"), data.clone().into())
                .await
                .unwrap();
        }
        s3
    });
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = BlockCache::open(CacheConfig::new(cache_dir.path(), 1 << 30)).unwrap();
    rt.block_on(cache.ready());
    Some(Setup {
        rt,
        _server: server,
        store: Arc::new(FaultyStore::new(store, 1)),
        cache,
        _cache_dir: cache_dir,
        dir: tempfile::tempdir().unwrap(),
        files,
    })
}

impl Setup {
    fn mount(&self, ttl: MetadataTtl, read_only: bool) -> MountHandle {
        self.mount_with(ttl, read_only, true)
    }

    fn mount_with(&self, ttl: MetadataTtl, read_only: bool, passthrough: bool) -> MountHandle {
        self.mount_in(ttl, read_only, |ctx| ctx.passthrough = passthrough)
    }

    /// A mount whose node-level context `ctx` sets up as it likes (the cache is set already).
    fn mount_in(
        &self,
        ttl: MetadataTtl,
        read_only: bool,
        ctx_with: impl FnOnce(&mut MountContext),
    ) -> MountHandle {
        let mut cfg = MountConfig::new(BUCKET);
        cfg.fs_name = format!("ferry:{BUCKET}/ds/");
        cfg.prefix = "ds/".into();
        cfg.endpoint = "http://versitygw.test".into();
        cfg.metadata_ttl = ttl;
        cfg.read_only = read_only;
        let mut ctx = MountContext::new(self.rt.handle().clone());
        ctx.cache = Some(self.cache.clone());
        ctx_with(&mut ctx);
        let store: Arc<dyn ObjectStore> = self.store.clone();
        mount(store, cfg, self.dir.path(), ctx).expect("mount")
    }

    fn calls(&self, op: Op) -> u64 {
        self.store.stats().calls_of(op)
    }

    /// Reads the files in `order` with `threads` readers taking them in turn.
    fn read(&self, order: &[usize], threads: usize) {
        std::thread::scope(|s| {
            for t in 0..threads {
                s.spawn(move || {
                    for &i in order.iter().skip(t).step_by(threads) {
                        let (name, data) = &self.files[i];
                        let got = std::fs::read(self.dir.path().join(name)).unwrap();
                        assert!(got == *data, "{name}: wrong bytes");
                    }
                });
            }
        });
    }
}

#[test]
fn with_the_cache_a_listing_order_reader_gets_each_file_once_and_no_head() {
    let Some(t) = setup(120, 100 << 10) else {
        return;
    };
    let m = t.mount(
        MetadataTtl::Duration(std::time::Duration::from_secs(600)),
        false,
    );
    let names = std::fs::read_dir(t.dir.path()).unwrap().count();
    assert_eq!(names, 120);
    let all: Vec<usize> = (0..120).collect();
    t.read(&all, 1);
    // The listing named every version: no HEAD proves access, the GETs do; the listing-order
    // prefetch and the sweep never fetch a file twice.
    assert_eq!(t.calls(Op::Head), 0);
    // (A body the server cut short is retried once.)
    assert!(
        (120..=124).contains(&t.calls(Op::Get)),
        "{:?}",
        t.store.stats()
    );
    // Again on the same mount: the page cache or the node cache, no request.
    t.rt.block_on(t.cache.settle());
    let before = t.store.stats();
    t.read(&all, 1);
    assert_eq!(t.store.stats(), before, "a warm re-read makes no request");
    m.unmount().unwrap();
}

#[test]
fn a_read_only_datasets_shuffled_epochs_sweep_it_then_make_no_request() {
    let Some(t) = setup(400, 16 << 10) else {
        return;
    };
    // What a read-only volume gets by default: metadata for the mount's life.
    let m = t.mount(MetadataTtl::Indefinite, true);
    // A loader: no readdir, files opened by path in a seeded shuffled order, 8 readers.
    let mut order: Vec<usize> = (0..400).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    t.read(&order, 8);
    t.rt.block_on(t.cache.settle());
    let epoch1 = t.store.stats();
    // Looked up by name until the background listing was adopted (a HEAD and the first byte
    // each: the proof of access); then swept into the cache: one GET per file (and now and then
    // a second, when the server cut a body short: retried once), fewer lookups than files.
    let lookups = epoch1.calls_of(Op::Head);
    assert!(lookups < 400, "{epoch1:?}");
    assert!(epoch1.calls_of(Op::Get) <= 400 + 4 + lookups, "{epoch1:?}");
    let stats = t.cache.stats();
    assert!(stats.objects + stats.blocks >= 400, "{stats:?}");
    // Epoch 2: no request of any kind.
    t.read(&order, 8);
    assert_eq!(t.store.stats(), epoch1, "epoch 2 made requests");
    m.unmount().unwrap();
}

#[test]
fn a_small_file_is_reread_from_the_page_cache_and_a_large_one_through_passthrough() {
    // Two blocks (passthrough is for objects larger than one) and one small file.
    let Some(mut t) = setup(1, 6 << 20) else {
        return;
    };
    let small = body(7, 100 << 10);
    t.rt.block_on(t.store.put(BUCKET, "ds/small", small.clone().into()))
        .unwrap();
    t.files.push(("small".into(), small));
    let m = t.mount(MetadataTtl::Indefinite, true);
    // Cold: nothing whole in the cache at open, so the kernel's cached mode; read to its end,
    // the large object becomes one whole file, the small one stays a block.
    t.read(&[0, 1], 1);
    t.rt.block_on(t.cache.settle());
    let filled = t.cache.stats();
    assert_eq!((filled.objects, filled.blocks), (1, 1), "{filled:?}");
    let before = t.store.stats();
    // Again, on this mount and on a new one: the large file is handed to the kernel at every
    // open; the small one never is (the page cache keeps it on this mount, the node cache serves
    // it on the new one).
    for _ in 0..3 {
        t.read(&[0, 1], 1);
    }
    assert_eq!(t.cache.stats().whole_opens, 3, "{:?}", t.cache.stats());
    m.unmount().unwrap();
    let m = t.mount(MetadataTtl::Indefinite, true);
    t.read(&[0, 1], 1);
    t.read(&[0, 1], 1);
    let last = t.cache.stats();
    assert_eq!(last.whole_opens, 5, "{last:?}");
    assert!(
        last.hits > filled.hits,
        "the small file came from the node cache: {last:?}"
    );
    // The new mount's two lookups read the first byte of each (their proofs of access).
    let after = t.store.stats();
    assert_eq!(
        after.calls_of(Op::Get),
        before.calls_of(Op::Get) + 2,
        "no new GET but the lookups' proofs"
    );
    assert_eq!(after.got_bytes, before.got_bytes + 2);
    m.unmount().unwrap();
}

#[test]
fn small_random_reads_from_the_node_cache_read_only_their_pieces() {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let Some(t) = setup(1, 6 << 20) else {
        return;
    };
    let (name, data) = &t.files[0];
    // Without passthrough, so that every O_DIRECT read below reaches the filesystem and is
    // served by the node cache.
    let m = t.mount_with(MetadataTtl::Indefinite, true, false);
    t.read(&[0], 1);
    t.rt.block_on(t.cache.settle());
    let (before, gets) = (t.cache.stats(), t.calls(Op::Get));
    assert_eq!(before.stored, 2, "both blocks stored: {before:?}");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(t.dir.path().join(name))
        .unwrap();
    // A page-aligned buffer, as O_DIRECT wants.
    let mut buf = vec![0u8; 2 * 4096];
    let shift = buf.as_ptr().align_offset(4096);
    let buf = &mut buf[shift..shift + 4096];
    let mut read_at = |at: u64| {
        f.read_exact_at(buf, at).unwrap();
        assert!(
            *buf == data[at as usize..at as usize + 4096],
            "bytes at {at}"
        );
    };
    // 64 reads of 4 KiB spread over both blocks (none where the last one ended, so none starts
    // a sequential stream): each a hit that read only the aligned 64 KiB a random read asks for
    // (`PrefetchConfig::random_align`), not its 4 MiB block.
    for i in 1..=64u64 {
        read_at((i * 1_597_463 % (6 << 20)) & !4095);
    }
    let after = t.cache.stats();
    assert_eq!(t.calls(Op::Get), gets, "no GET");
    assert_eq!(after.hits - before.hits, 64, "{after:?}");
    assert_eq!(
        after.hit_bytes - before.hit_bytes,
        64 * (64 << 10),
        "each hit served only the range read, not its block"
    );
    // A flipped byte in the cached copy (the whole file the blocks were joined into, or a
    // block): reads of other pieces are still served; a read of the bad piece is refused, the
    // object fetched again, the bytes correct.
    let key = format!("ds/{name}");
    let etag = t.rt.block_on(t.store.head(BUCKET, &key)).unwrap().etag;
    let obj = ferry_cache::ObjectKey {
        endpoint: "http://versitygw.test".into(),
        bucket: BUCKET.into(),
        key,
        etag: etag.unwrap(),
    };
    let bad = (1 << 20) + 12_345u64;
    let path = if t.cache.has_whole(&obj) {
        t.cache.object_path(&obj.file_id())
    } else {
        t.cache.block_path(&obj.block(0).file_id())
    };
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[bad as usize] ^= 0x20;
    std::fs::write(&path, bytes).unwrap();
    read_at(4096);
    read_at(3 << 20);
    assert_eq!(t.cache.stats().corrupt, 0);
    read_at(bad & !4095);
    assert_eq!(t.cache.stats().corrupt, 1, "{:?}", t.cache.stats());
    assert!(t.calls(Op::Get) > gets, "fetched again");
    drop(f);
    m.unmount().unwrap();
}

/// Blocks waiting for the cache's writers are memory the node plugin's budget counts: with no
/// room left in it, files are read (right) through the cache and none of their blocks is stored;
/// with room, every block is stored and charged to it until written.
#[test]
fn the_cache_stores_blocks_only_within_the_memory_budget() {
    let Some(t) = setup(8, 300 << 10) else {
        return;
    };
    let ttl = MetadataTtl::Duration(std::time::Duration::from_secs(600));
    // Less than one block: the mount's session is charged whatever the limit, so nothing else fits.
    let m = t.mount_in(ttl, true, |ctx| ctx.budget = MemoryBudget::new(64 << 10));
    let all: Vec<usize> = (0..8).collect();
    t.read(&all, 2);
    t.rt.block_on(t.cache.settle());
    let s = t.cache.stats();
    assert_eq!(s.stored, 0, "{s:?}");
    assert!(s.skipped >= 8, "every file's block was refused: {s:?}");
    // A 4 KiB read (`O_DIRECT`: just these bytes reach the mount) of blocks the cache will not
    // store fetches the read's bytes (rounded out to 64 KiB, as a random read is), not the whole
    // 300 KiB block.
    let got = t.store.stats().got_bytes;
    for (name, data) in &t.files {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(t.dir.path().join(name))
            .unwrap();
        // FUSE takes any buffer with `O_DIRECT` (no alignment asked).
        let mut buf = vec![0u8; 4096];
        f.read_exact_at(&mut buf, 100 << 10).unwrap();
        assert!(
            buf == data[100 << 10..(100 << 10) + 4096],
            "{name}: wrong bytes"
        );
    }
    let fetched = t.store.stats().got_bytes - got;
    assert!(
        fetched <= 8 * (64 << 10),
        "{fetched} bytes fetched for 8 reads of 4 KiB"
    );
    t.rt.block_on(t.cache.settle());
    assert_eq!(t.cache.stats().stored, 0);
    m.unmount().unwrap();

    // Another cache, charged to a budget with room: every block is stored, and each charge is
    // given back once its block is written.
    let Some(t) = setup(8, 300 << 10) else {
        return;
    };
    let budget = MemoryBudget::new(1 << 30);
    let b = budget.clone();
    let m = t.mount_in(ttl, true, move |ctx| ctx.budget = b);
    t.read(&all, 2);
    t.rt.block_on(t.cache.settle());
    let s = t.cache.stats();
    assert_eq!((s.stored, s.skipped), (8, 0), "{s:?}");
    assert_eq!(
        budget.used_for(Use::CacheWrite),
        0,
        "given back once written"
    );
    // A prefetched part's charge, which the write of its block shares, is given back too.
    assert_eq!(budget.used_for(Use::Prefetch), 0);
    m.unmount().unwrap();
}

/// A file written through the mount is open in the kernel's cached I/O mode until its last
/// close, also once `fsync` completed its upload. A read of it meanwhile, once it is whole in the
/// node cache, must not be handed to passthrough: the kernel fails that open (`EIO`).
#[test]
fn a_file_still_open_for_writing_is_read_beside_it() {
    use std::io::Write;
    let Some(t) = setup(0, 0) else {
        return;
    };
    let m = t.mount(MetadataTtl::Indefinite, false);
    let path = t.dir.path().join("new");
    let data = body(9, 6 << 20);
    let mut w = std::fs::File::create(&path).unwrap();
    w.write_all(&data).unwrap();
    w.sync_all().unwrap();
    // Read to its end (cached mode): the object is then whole in the node cache.
    assert!(std::fs::read(&path).unwrap() == data);
    t.rt.block_on(t.cache.settle());
    assert_eq!(t.cache.stats().objects, 1, "{:?}", t.cache.stats());
    let again = std::fs::read(&path);
    drop(w);
    assert!(again.expect("read beside the open writer") == data);
    m.unmount().unwrap();
}

/// Inode numbers are the path's: a file created again after an unlink, at the path of one still
/// open through passthrough, is the same inode, which the kernel does not open in cached mode
/// beside it. The create is refused (`EBUSY`), not failed by the kernel (`EIO`) after the empty
/// object was put.
#[test]
fn a_file_is_not_created_again_at_the_path_of_one_open_through_passthrough() {
    let Some(t) = setup(1, 6 << 20) else {
        return;
    };
    let mut cfg = MountConfig::new(BUCKET);
    cfg.prefix = "ds/".into();
    cfg.endpoint = "http://versitygw.test".into();
    cfg.metadata_ttl = MetadataTtl::Indefinite;
    cfg.read_only = false;
    cfg.allow_delete = true;
    let mut ctx = MountContext::new(t.rt.handle().clone());
    ctx.cache = Some(t.cache.clone());
    ctx.passthrough = true;
    let store: Arc<dyn ObjectStore> = t.store.clone();
    let m = mount(store, cfg, t.dir.path(), ctx).expect("mount");
    let (name, data) = &t.files[0];
    let path = t.dir.path().join(name);
    t.read(&[0], 1);
    t.rt.block_on(t.cache.settle());
    let reader = std::fs::File::open(&path).unwrap();
    assert_eq!(t.cache.stats().whole_opens, 1, "{:?}", t.cache.stats());
    std::fs::remove_file(&path).unwrap();
    let created = std::fs::File::create(&path).map(drop);
    let err = created.expect_err("created beside the passthrough reader");
    assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
    let mut got = Vec::new();
    std::io::Read::read_to_end(&mut &reader, &mut got).unwrap();
    assert!(got == *data, "the reader reads on");
    drop(reader);
    let gone = t.rt.block_on(t.store.head(BUCKET, &format!("ds/{name}")));
    assert!(gone.is_err(), "an object was put: {gone:?}");
    m.unmount().unwrap();
}
