//! The filesystem on the node cache: several mounts (`Fs` instances) sharing one `BlockCache`,
//! each with its own store (its own credentials), on `MemoryStore`.

use std::ffi::OsStr;

use ferry_cache::{CacheConfig, MIN_BLOCK_SIZE};
use ferry_store::{FaultyStore, MemoryStore, Op};

use super::*;

const B: &str = "bkt";
const PID: u32 = 7;
const BS: u64 = MIN_BLOCK_SIZE;

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(seed as u32) as u8
                ^ seed
        })
        .collect()
}

fn cache(dir: &std::path::Path) -> Arc<BlockCache> {
    BlockCache::open(CacheConfig {
        block_size: BS,
        ..CacheConfig::new(dir, 1 << 30)
    })
    .unwrap()
}

/// The tests' mount of bucket `B` (listings kept for the mount's life).
fn mount_config() -> MountConfig {
    let mut cfg = MountConfig::new(B);
    cfg.endpoint = "http://s3.test".into();
    cfg.metadata_ttl = crate::config::MetadataTtl::Indefinite;
    cfg
}

fn mount(
    store: Arc<dyn ObjectStore>,
    cache: &Arc<BlockCache>,
    tweak: impl FnOnce(&mut MountConfig),
) -> Fs {
    let mut cfg = mount_config();
    tweak(&mut cfg);
    Fs::new(store, cfg).with_cache(Some(cache.clone()))
}

/// A mount of bucket `B` on `cache` whose memory is charged to `budget`.
fn mount_with_budget(store: &MemoryStore, cache: &Arc<BlockCache>, budget: &MemoryBudget) -> Fs {
    Fs::with_budget(
        Arc::new(store.clone()),
        mount_config(),
        budget.clone(),
        PrefetchConfig::default(),
    )
    .with_cache(Some(cache.clone()))
}

/// `files` put in bucket `B`: each one's ETag by name.
fn insert_files(store: &MemoryStore, files: &[(String, Vec<u8>)]) -> HashMap<String, String> {
    files
        .iter()
        .map(|(name, body)| (name.clone(), store.insert(B, name, body.clone())))
        .collect()
}

/// A ready cache in a temporary directory and an empty store with the bucket.
async fn cache_and_store() -> (tempfile::TempDir, Arc<BlockCache>, MemoryStore) {
    let dir = tempfile::tempdir().unwrap();
    let cache = cache(dir.path());
    cache.ready().await;
    let store = MemoryStore::new();
    store.create_bucket(B);
    (dir, cache, store)
}

/// The bucket as credentials that may list but not read see it: every HEAD and GET is denied.
fn lister_only(store: &MemoryStore) -> FaultyStore<MemoryStore> {
    let denied = FaultyStore::new(store.clone(), 1);
    for op in [Op::Head, Op::Get] {
        denied.fail_next(
            op,
            u64::MAX,
            StoreError::AccessDenied("403 AccessDenied".into()),
        );
    }
    denied
}

/// Opens `ino` for reading, expecting `errno`. An open that succeeds is joined to the inode's
/// backing file as the adapter would (`Passthrough::existing`), and fails the test with `what`.
async fn refused_open(fs: &Fs, ino: Ino, errno: i32, what: &str) {
    match fs.open(ino, libc::O_RDONLY, PID).await {
        Ok(b) => {
            let joined = fs.join_passthrough(b.fh, 1);
            panic!("{what} (joined to the inode's backing file: {joined})");
        }
        Err(e) => assert_eq!(e.errno(), errno, "{e}"),
    }
}

/// Reads `f` (whose bytes are `body`) to its end, so that it is one whole file in the node cache,
/// then opens it through passthrough as the adapter would (backing file 1): its inode, the
/// handle, and the whole file handed out.
async fn open_f_through_passthrough(
    fs: &Fs,
    cache: &BlockCache,
    body: &[u8],
) -> (Ino, u64, std::fs::File) {
    assert_eq!(read_all(fs, "f", 1 << 20).await.unwrap(), body);
    cache.settle().await;
    let ino = ino_of(fs, "f").await.unwrap();
    let a = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let file = fs
        .passthrough_file(a.fh)
        .expect("the whole file is handed out");
    fs.set_backing_id(a.fh, 1);
    (ino, a.fh, file)
}

async fn ino_of(fs: &Fs, name: &str) -> Result<Ino, FsError> {
    Ok(fs.lookup(ROOT_INO, OsStr::new(name)).await?.attr.ino)
}

/// The names in the root directory, from a LIST (readdirplus: no HEAD per entry).
async fn list_root(fs: &Fs) -> Vec<String> {
    let fh = fs.opendir(ROOT_INO).unwrap().fh;
    struct Sink(Vec<String>);
    impl crate::fs::DirSink for Sink {
        fn add(&mut self, e: &crate::fs::DirEntry<'_>) -> bool {
            self.0.push(e.name.to_owned());
            false
        }
    }
    let mut sink = Sink(Vec::new());
    fs.readdir(ROOT_INO, fh, 0, true, &mut sink).await.unwrap();
    fs.releasedir(fh);
    sink.0
}

/// Reads the whole file with `chunk`-byte reads.
async fn read_all(fs: &Fs, name: &str, chunk: u32) -> Result<Vec<u8>, FsError> {
    let ino = ino_of(fs, name).await?;
    let o = fs.open(ino, libc::O_RDONLY, PID).await?;
    let mut out = Vec::new();
    loop {
        let got = fs.read(o.fh, out.len() as u64, chunk).await?;
        if got.is_empty() {
            break;
        }
        out.extend_from_slice(&got);
    }
    fs.release(o.fh).await?;
    Ok(out)
}

#[tokio::test]
async fn a_second_mount_reads_from_the_cache_with_no_get() {
    let (_dir, cache, store) = cache_and_store().await;
    let big = data((5 * BS + 123) as usize, 1);
    store.insert(B, "big.bin", big.clone());
    // Two pods with their own clients (same credentials here).
    let a = mount(Arc::new(store.clone()), &cache, |_| {});
    let b = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(read_all(&a, "big.bin", 4096).await.unwrap(), big);
    cache.settle().await;
    let first = store.stats();
    // And the first byte once more: the lookup's proof of access (`head_readable`).
    assert_eq!(
        first.get_bytes,
        big.len() as u64 + 1,
        "each block fetched once"
    );
    // Sequential and random reads on the other mount: only its own lookup (a HEAD and its
    // proof, the first byte) reaches S3.
    assert_eq!(read_all(&b, "big.bin", 128 << 10).await.unwrap(), big);
    let ino = ino_of(&b, "big.bin").await.unwrap();
    let o = b.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let got = b.read(o.fh, 3 * BS - 10, 100).await.unwrap();
    assert_eq!(
        &got[..],
        &big[(3 * BS - 10) as usize..(3 * BS + 90) as usize]
    );
    let s = store.stats();
    assert_eq!(
        s.get_bytes,
        first.get_bytes + 1,
        "no block from the second mount"
    );
    assert_eq!(
        s.get,
        first.get + 1,
        "no GET from the second mount but its proof"
    );
    assert_eq!(s.head, first.head + 1, "one HEAD: its own lookup");
    assert!(cache.stats().hits >= 6);
}

#[tokio::test]
async fn a_sequential_read_through_the_cache_fetches_neighbouring_blocks_in_one_get() {
    let (_dir, cache, store) = cache_and_store().await;
    let big = data((40 * BS + 7) as usize, 3);
    store.insert(B, "seq", big.clone());
    let a = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(read_all(&a, "seq", 128 << 10).await.unwrap(), big);
    cache.settle().await;
    let s = store.stats();
    // (And the first byte once more: the lookup's proof of access.)
    assert_eq!(s.get_bytes, big.len() as u64 + 1, "every byte fetched once");
    // 41 blocks, fetched ahead in runs that share a GET (one per block before).
    assert!(s.get <= 10, "{s:?}");
    // Each block was stored on its own: another mount reads every byte from disk.
    let b = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(read_all(&b, "seq", 128 << 10).await.unwrap(), big);
    assert_eq!(
        store.stats().get,
        s.get + 1,
        "no GET from the second mount but its lookup's proof"
    );
}

#[tokio::test]
async fn concurrent_readers_on_four_mounts_fetch_each_block_once() {
    let (_dir, cache, store) = cache_and_store().await;
    let big = data((8 * BS) as usize, 2);
    store.insert(B, "f", big.clone());
    let mounts: Vec<Arc<Fs>> = (0..4)
        .map(|_| Arc::new(mount(Arc::new(store.clone()), &cache, |_| {})))
        .collect();
    let tasks: Vec<_> = mounts
        .iter()
        .map(|fs| {
            let fs = fs.clone();
            tokio::spawn(async move { read_all(&fs, "f", 64 << 10).await.unwrap() })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), big);
    }
    // And the first byte of each mount's lookup: its proof of access.
    assert_eq!(store.stats().get_bytes, big.len() as u64 + 4);
}

#[tokio::test]
async fn a_mount_whose_credentials_are_denied_gets_eacces_though_the_blocks_are_cached() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data((2 * BS) as usize, 3);
    store.insert(B, "secret.bin", body.clone());
    let allowed = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(
        read_all(&allowed, "secret.bin", 1 << 20).await.unwrap(),
        body
    );
    cache.settle().await;

    // The other pod's credentials may list the prefix but not read its objects.
    let denied = mount(Arc::new(lister_only(&store)), &cache, |_| {});
    let names = list_root(&denied).await;
    assert!(
        names.contains(&"secret.bin".to_owned()),
        "the LIST is allowed: {names:?}"
    );
    // Known from the listing (size, ETag) — but a LIST proves no read access: open HEADs.
    let ino = ino_of(&denied, "secret.bin").await.unwrap();
    let err = denied.open(ino, libc::O_RDONLY, PID).await.unwrap_err();
    assert_eq!(err.errno(), libc::EACCES);
    let hits = cache.stats().hits;
    assert_eq!(
        read_all(&allowed, "secret.bin", 1 << 20).await.unwrap(),
        body
    );
    assert!(
        cache.stats().hits > hits,
        "the allowed mount still reads from the cache"
    );
}

#[tokio::test]
async fn a_flipped_byte_on_disk_is_refetched_and_counted() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data((3 * BS) as usize, 4);
    let etag = store.insert(B, "f", body.clone());
    let fs = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(read_all(&fs, "f", 1 << 20).await.unwrap(), body);
    cache.settle().await;
    let obj = ferry_cache::ObjectKey {
        endpoint: "http://s3.test".into(),
        bucket: B.into(),
        key: "f".into(),
        etag,
    };
    // Read to its end, the object is one whole file in the cache; flip a byte of block 1 in it.
    assert!(cache.has_whole(&obj), "{:?}", cache.stats());
    let path = cache.object_path(&obj.file_id());
    let mut file = std::fs::read(&path).unwrap();
    let i = (BS + 1000) as usize;
    file[i] ^= 0x10;
    std::fs::write(&path, file).unwrap();
    let gets = store.stats().get;
    let other = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(
        read_all(&other, "f", 1 << 20).await.unwrap(),
        body,
        "correct data"
    );
    assert_eq!(cache.stats().corrupt, 1);
    // The bad file is dropped whole: the blocks not yet read from it are fetched again, once
    // (beside the first byte that the other mount's lookup reads: its proof of access).
    let refetched = store.stats().get - gets - 1;
    assert!((1..=3).contains(&refetched), "{refetched} GETs");
    // The next reader fetches what is still missing and the object is whole again.
    let third = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(read_all(&third, "f", 1 << 20).await.unwrap(), body);
    cache.settle().await;
    assert!(cache.has_whole(&obj), "{:?}", cache.stats());
}

#[tokio::test]
async fn mounts_of_one_store_share_proofs_of_access_and_other_stores_do_not() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data(5000, 8);
    store.insert(B, "f", body.clone());
    let registry = crate::proofs::ProofRegistry::default();
    let shared: Arc<dyn ObjectStore> = Arc::new(store.clone());
    let pod = || mount(shared.clone(), &cache, |_| {}).with_proofs(registry.for_store(&shared));
    let (a, b) = (pod(), pod());
    assert_eq!(read_all(&a, "f", 4096).await.unwrap(), body);
    cache.settle().await;
    // The other pods know the file from a LIST, which proves no read access.
    let other: Arc<dyn ObjectStore> = Arc::new(store.clone());
    let c = mount(other.clone(), &cache, |_| {}).with_proofs(registry.for_store(&other));
    assert!(list_root(&b).await.contains(&"f".to_owned()));
    assert!(list_root(&c).await.contains(&"f".to_owned()));
    let requests = || {
        let s = store.stats();
        (s.head, s.get, s.get_bytes)
    };
    let before = requests();
    // Another pod of the same identity (the same store): a's proof holds, no request.
    assert_eq!(read_all(&b, "f", 4096).await.unwrap(), body);
    assert_eq!(requests(), before);
    // A store of its own (other credentials) proves access itself, by reading the first byte
    // (a HEAD proves no access to the bytes).
    assert_eq!(read_all(&c, "f", 4096).await.unwrap(), body);
    assert_eq!(requests(), (before.0, before.1 + 1, before.2 + 1));
}

#[tokio::test]
async fn cache_none_keeps_a_mount_out_of_the_cache() {
    let (_dir, cache, store) = cache_and_store().await;
    store.insert(B, "f", data(1000, 5));
    let fs = mount(Arc::new(store.clone()), &cache, |c| c.node_cache = false);
    assert!(!fs.uses_cache());
    read_all(&fs, "f", 4096).await.unwrap();
    read_all(&fs, "f", 4096).await.unwrap();
    cache.settle().await;
    assert_eq!(cache.stats(), ferry_cache::CacheStats::default());
    assert_eq!(store.stats().get, 2);
}

#[tokio::test]
async fn a_changed_object_is_a_new_block_and_the_old_handle_gets_estale() {
    let (_dir, cache, store) = cache_and_store().await;
    store.insert(B, "f", data(1000, 6));
    let fs = mount(Arc::new(store.clone()), &cache, |c| {
        c.metadata_ttl = crate::config::MetadataTtl::Duration(Duration::ZERO)
    });
    assert_eq!(read_all(&fs, "f", 4096).await.unwrap(), data(1000, 6));
    cache.settle().await;
    store.insert(B, "f", data(2000, 7));
    assert_eq!(read_all(&fs, "f", 4096).await.unwrap(), data(2000, 7));
}

/// An inode open through passthrough reads the whole file of the version its first handle
/// pinned; the kernel makes every later open of the inode use that same backing file. An open
/// that pins a newer version (the object was replaced) must not be joined to it: its reads
/// would return the older version's bytes.
#[tokio::test]
async fn an_open_of_a_newer_version_is_not_joined_to_the_older_versions_passthrough_file() {
    let (_dir, cache, store) = cache_and_store().await;
    let old = data((3 * BS) as usize, 11);
    store.insert(B, "f", old.clone());
    let fs = mount(Arc::new(store.clone()), &cache, |_| {});
    let (ino, a, mut file) = open_f_through_passthrough(&fs, &cache, &old).await;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes).unwrap();
    assert_eq!(bytes, old);

    // The object is replaced; the inode's metadata expires: the next open HEADs the new version.
    let new = data((3 * BS) as usize, 12);
    store.insert(B, "f", new.clone());
    fs.lock().inodes.get_mut(ino).unwrap().valid = Validity::Expired;
    refused_open(
        &fs,
        ino,
        libc::EBUSY,
        "the new version's open was not refused",
    )
    .await;
    // Once the old version's handle is closed, the new version opens and reads as itself.
    fs.release(a).await.unwrap();
    fs.lock().inodes.get_mut(ino).unwrap().valid = Validity::Expired;
    let b = fs
        .open(ino, libc::O_RDONLY, PID)
        .await
        .expect("the new version opens once the old one's handle is closed");
    let got = fs.read(b.fh, 0, 1 << 20).await.unwrap();
    assert_eq!(&got[..], &new[..got.len()], "the new version's bytes");
    fs.release(b.fh).await.unwrap();
}

#[tokio::test]
async fn a_small_random_read_on_a_cold_cache_fetches_the_one_block_it_touches() {
    let (_dir, cache, store) = cache_and_store().await;
    let big = data((6 * BS) as usize, 4);
    store.insert(B, "big.bin", big.clone());
    let fs = mount(Arc::new(store.clone()), &cache, |_| {});
    let ino = ino_of(&fs, "big.bin").await.unwrap();
    let o = fs.open(ino, libc::O_RDONLY, PID).await.unwrap();
    store.reset_stats();
    // 4 KiB in the middle of block 3 (not at the file's start: not a sequential reader).
    let off = 3 * BS + BS / 2;
    let got = fs.read(o.fh, off, 4096).await.unwrap();
    assert_eq!(&got[..], &big[off as usize..off as usize + 4096]);
    cache.settle().await;
    let s = store.stats();
    assert_eq!(s.get, 1, "one GET: {s:?}");
    assert_eq!(s.get_bytes, BS, "the whole block it touches, nothing more");
    // The same block again: served from the cache.
    let got = fs.read(o.fh, 3 * BS + 10, 100).await.unwrap();
    assert_eq!(
        &got[..],
        &big[(3 * BS + 10) as usize..(3 * BS + 110) as usize]
    );
    assert_eq!(store.stats().get, 1, "a hit");
    fs.release(o.fh).await.unwrap();
}

#[tokio::test]
async fn a_version_known_from_a_listing_costs_no_head_its_first_get_proves_access() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data((3 * BS + 17) as usize, 11);
    store.insert(B, "shard", body.clone());
    let registry = crate::proofs::ProofRegistry::default();
    let shared: Arc<dyn ObjectStore> = Arc::new(store.clone());
    let pod = || mount(shared.clone(), &cache, |_| {}).with_proofs(registry.for_store(&shared));
    let a = pod();
    assert!(list_root(&a).await.contains(&"shard".to_owned()));
    // Opened from the listing's ETag: the GETs that fetch the blocks are the proof, as many
    // requests as without the cache.
    assert_eq!(read_all(&a, "shard", 128 << 10).await.unwrap(), body);
    let s = store.stats();
    assert_eq!(s.head, 0, "no HEAD to prove access");
    assert_eq!(s.get_bytes, body.len() as u64, "each byte fetched once");
    cache.settle().await;
    // Another pod of the same identity is served the cached blocks on a's proof.
    let b = pod();
    assert!(list_root(&b).await.contains(&"shard".to_owned()));
    assert_eq!(read_all(&b, "shard", 128 << 10).await.unwrap(), body);
    let again = store.stats();
    assert_eq!((again.head, again.get), (0, s.get), "b read from the cache");
}

#[tokio::test]
async fn a_denied_mount_gets_eacces_on_its_first_read_of_cached_blocks() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data((32 * BS) as usize, 12);
    store.insert(B, "secret.bin", body.clone());
    // The allowed pod reads one block only (a random read): cached as a block, the object not
    // whole (the open of a whole object HEADs, for passthrough; see the test above that).
    let allowed = mount(Arc::new(store.clone()), &cache, |_| {});
    let ino = ino_of(&allowed, "secret.bin").await.unwrap();
    let o = allowed.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let at = 20 * BS;
    let got = allowed.read(o.fh, at, 4096).await.unwrap();
    assert_eq!(&got[..], &body[at as usize..at as usize + 4096]);
    allowed.release(o.fh).await.unwrap();
    cache.settle().await;

    let denied = mount(Arc::new(lister_only(&store)), &cache, |_| {});
    assert!(list_root(&denied).await.contains(&"secret.bin".to_owned()));
    let ino = ino_of(&denied, "secret.bin").await.unwrap();
    let o = denied.open(ino, libc::O_RDONLY, PID).await.unwrap();
    let hits = cache.stats().hits;
    // The cached block: a HEAD first. The block not cached: its own GET.
    for offset in [at, 0] {
        let err = denied.read(o.fh, offset, 4096).await.unwrap_err();
        assert_eq!(err.errno(), libc::EACCES, "offset {offset}");
    }
    assert_eq!(
        cache.stats().hits,
        hits,
        "no cached byte reached the denied mount"
    );
}

/// Eight readers taking entries in turn, one of them far behind the others (it waited on a slow
/// GET): its opens are of files fetched ahead, so they neither break the listing-order streak
/// nor count toward the directory's sweep (which would read from the cache's disk, behind the
/// writers, what the prefetch holds in memory).
#[tokio::test]
async fn a_listing_order_reader_far_behind_the_others_does_not_start_the_sweep() {
    let (_dir, cache, store) = cache_and_store().await;
    let files: Vec<(String, Vec<u8>)> = (0..256u32)
        .map(|i| (format!("f{i:03}"), data(4096, (i % 251) as u8)))
        .collect();
    for (name, body) in &files {
        store.insert(B, name, body.clone());
    }
    let fs = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(list_root(&fs).await.len(), 2 + 256, ". and .. too");
    // Every eighth file is opened 40 entries late (past ORDER_SLACK): 32 late opens.
    let late = |i: usize| i.is_multiple_of(8);
    let mut order: Vec<usize> = Vec::new();
    for i in 0..256 + 40 {
        if i < 256 && !late(i) {
            order.push(i);
        }
        if i >= 40 && late(i - 40) {
            order.push(i - 40);
        }
    }
    assert_eq!(order.len(), 256);
    for &i in &order {
        let (name, body) = &files[i];
        assert_eq!(&read_all(&fs, name, 1 << 20).await.unwrap(), body, "{name}");
    }
    {
        let st = fs.lock();
        assert!(!Fs::swept(&st, ROOT_INO), "the directory was swept");
        let streak = st.order.get(&ROOT_INO).map(|&(_, streak)| streak);
        assert!(streak.is_some_and(|s| s > 150), "streak {streak:?}");
    }
    assert_eq!(store.stats().get, 256, "each file fetched once");
}

/// A loader's order: every 37th file (a shuffle as far as listing order goes).
#[tokio::test]
async fn a_directory_read_in_shuffled_order_is_swept_into_the_cache() {
    swept_in_order(37).await;
}

async fn swept_in_order(step: usize) {
    let (_dir, cache, store) = cache_and_store().await;
    let files: Vec<(String, Vec<u8>)> = (0..200u32)
        .map(|i| (format!("f{i:03}"), data(4096 + i as usize, (i % 251) as u8)))
        .collect();
    let etags = insert_files(&store, &files);
    let fs = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(list_root(&fs).await.len(), 2 + 200, ". and .. too");
    let order: Vec<usize> = (0..200).map(|i| (i * step) % 200).collect();
    for &i in &order[..16] {
        let (name, body) = &files[i];
        assert_eq!(&read_all(&fs, name, 1 << 20).await.unwrap(), body);
    }
    // The sixteenth open started the sweep: every file comes into the cache.
    for _ in 0..200 {
        if files
            .iter()
            .all(|(name, _)| is_cached(&cache, name, &etags[name]))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cache.settle().await;
    let gets = store.stats().get;
    assert_eq!(gets, 200, "step {step}: each file fetched once");
    for &i in &order[16..] {
        let (name, body) = &files[i];
        assert_eq!(&read_all(&fs, name, 1 << 20).await.unwrap(), body);
    }
    assert_eq!(
        store.stats().get,
        gets,
        "step {step}: the rest read from the cache"
    );
}

fn is_cached(cache: &BlockCache, name: &str, etag: &str) -> bool {
    cache.contains(&ferry_cache::BlockKey {
        endpoint: "http://s3.test".into(),
        bucket: B.into(),
        key: name.into(),
        etag: etag.into(),
        index: 0,
    })
}

/// Opens of a directory's files spread over a long time (a few now and then, over a job's days)
/// never add up to a sweep: an open more than `SWEEP_OPEN_GAP` after the last one counts from 1.
#[tokio::test]
async fn opens_far_apart_do_not_add_up_to_a_sweep() {
    let (_dir, cache, store) = cache_and_store().await;
    let files: Vec<(String, Vec<u8>)> = (0..200u32)
        .map(|i| (format!("f{i:03}"), data(4096, (i % 251) as u8)))
        .collect();
    for (name, body) in &files {
        store.insert(B, name, body.clone());
    }
    let fs = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(list_root(&fs).await.len(), 2 + 200, ". and .. too");
    let order: Vec<usize> = (0..200).map(|i| (i * 37) % 200).collect();
    let open = |i: usize| {
        let (name, body) = &files[order[i]];
        let fs = &fs;
        async move { assert_eq!(&read_all(fs, name, 1 << 20).await.unwrap(), body) }
    };
    let age_last_open = || {
        let mut st = fs.lock();
        match st.sweeps.get_mut(&ROOT_INO) {
            Some(super::sweep::SweepState::Counting { last, .. }) => {
                *last = Instant::now() - (super::sweep::SWEEP_OPEN_GAP + Duration::from_secs(1));
            }
            other => panic!("not counting: {other:?}"),
        }
    };
    // Fifteen opens, a long pause, fifteen more: never sixteen in a row.
    for i in 0..15 {
        open(i).await;
    }
    age_last_open();
    for i in 15..30 {
        open(i).await;
    }
    assert!(!Fs::swept(&fs.lock(), ROOT_INO), "swept after a pause");
    // One more without a pause is the sixteenth in a row.
    open(30).await;
    assert!(Fs::swept(&fs.lock(), ROOT_INO), "not swept");
}

/// A sweep near the memory budget: each file it fetches is charged once, from before its GET
/// until its block is on disk. Charged twice (its read-ahead reservation, and again as a block
/// waiting for the writers), a file the budget holds once but not twice is fetched and never
/// stored, and every later open of it is a GET.
#[tokio::test]
async fn a_sweep_near_the_budget_stores_what_it_fetches() {
    let (_dir, cache, store) = cache_and_store().await;
    const SIZE: usize = 30_000;
    let files: Vec<(String, Vec<u8>)> = (0..40u32)
        .map(|i| (format!("f{i:02}"), data(SIZE + i as usize, i as u8)))
        .collect();
    let etags = insert_files(&store, &files);
    // The listing's charge, measured on a mount of the same bucket with room to spare (and
    // without the cache, whose writes are charged to the first budget it is given).
    let probe = Fs::new(Arc::new(store.clone()), mount_config());
    assert_eq!(list_root(&probe).await.len(), 2 + 40, ". and .. too");
    let listing = probe.budget().used_for(Use::Listing);
    drop(probe);
    // Room for the listing and one file and a half: every file fits once, none twice.
    let budget = MemoryBudget::new(listing + (SIZE as u64 + 39) * 3 / 2);
    let fs = mount_with_budget(&store, &cache, &budget);
    assert_eq!(list_root(&fs).await.len(), 2 + 40);
    assert_eq!(
        budget.used_for(Use::Listing),
        listing,
        "the listing is kept"
    );
    // A shuffled order: the sixteenth open starts the sweep of the 24 files left.
    let order: Vec<usize> = (0..40).map(|i| (i * 37) % 40).collect();
    for &i in &order[..16] {
        let (name, body) = &files[i];
        assert_eq!(&read_all(&fs, name, 1 << 20).await.unwrap(), body);
        cache.settle().await;
        assert!(
            is_cached(&cache, name, &etags[name]),
            "{name} read, not stored"
        );
    }
    assert!(Fs::swept(&fs.lock(), ROOT_INO), "not swept");
    // The sweep's GETs (one file at a time: each waits its turn for the budget).
    for _ in 0..3000 {
        if store.stats().get >= 40 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.stats().get, 40, "each file fetched once");
    cache.settle().await;
    for &i in &order[16..] {
        let (name, _) = &files[i];
        assert!(
            is_cached(&cache, name, &etags[name]),
            "{name} was swept but not stored"
        );
    }
    for &i in &order[16..] {
        let (name, body) = &files[i];
        assert_eq!(&read_all(&fs, name, 1 << 20).await.unwrap(), body);
    }
    assert_eq!(store.stats().get, 40, "the swept files read from the cache");
    assert_eq!(
        budget.used(),
        listing,
        "every charge but the listing's given back"
    );
}

/// A warm-up fetches with the publishing mount's credentials: a reader of that identity that has
/// not proven access yet (it knows the file from a LIST) joins the warm-up's GET of a block in
/// flight, as concurrent misses of one identity do (One GET per block; Warm-up: "readers share
/// its GETs through the single flight"), and makes no second GET of its own.
#[tokio::test(start_paused = true)]
async fn a_reader_of_the_warming_identity_joins_the_warm_ups_get() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data(BS as usize, 21);
    store.insert(B, "f", body.clone());
    let slow = Arc::new(FaultyStore::new(store.clone(), 1));
    slow.set_latency([Op::Get], Duration::from_millis(500), Duration::ZERO);
    let shared: Arc<dyn ObjectStore> = slow.clone();
    let registry = crate::proofs::ProofRegistry::default();
    let fs = mount(shared.clone(), &cache, |_| {}).with_proofs(registry.for_store(&shared));
    assert!(list_root(&fs).await.contains(&"f".to_owned()));
    let w = crate::WarmUp {
        endpoint: "http://s3.test".into(),
        bucket: B.into(),
        prefixes: vec![String::new()],
    };
    let warm = tokio::spawn(crate::warm_up_as(
        shared.clone(),
        registry.for_store(&shared),
        cache.clone(),
        w,
    ));
    // The warm-up's GET of the block has started (and takes 500 ms).
    while slow.stats().calls_of(Op::Get) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(read_all(&fs, "f", 128 << 10).await.unwrap(), body);
    assert_eq!(warm.await.unwrap().unwrap().fetched, 1);
    cache.settle().await;
    let s = store.stats();
    assert_eq!((s.head, s.get), (0, 1), "one GET of the block: {s:?}");
}

/// The sweep waits while the cache's writers are behind (over half their queue), but a file
/// larger than half of an empty queue must not wait for ever: with a small memory budget (the
/// writers' queue is an eighth of it) and small blocks, files of a few hundred KiB (below
/// `small_object_max`) were never swept, and the sweep's slot was held until the mount went.
#[tokio::test]
async fn a_sweep_fetches_files_larger_than_half_the_writers_queue() {
    let (_dir, cache, store) = cache_and_store().await;
    const SIZE: usize = 300 << 10;
    let files: Vec<(String, Vec<u8>)> = (0..40u32)
        .map(|i| (format!("g{i:02}"), data(SIZE, i as u8)))
        .collect();
    let etags = insert_files(&store, &files);
    // 4 MiB: the writers' queue is 512 KiB, half of it less than one file.
    let budget = MemoryBudget::new(4 << 20);
    let fs = mount_with_budget(&store, &cache, &budget);
    assert_eq!(list_root(&fs).await.len(), 2 + 40);
    let order: Vec<usize> = (0..40).map(|i| (i * 37) % 40).collect();
    for &i in &order[..16] {
        let (name, body) = &files[i];
        assert_eq!(&read_all(&fs, name, 128 << 10).await.unwrap(), body);
    }
    cache.settle().await;
    assert!(Fs::swept(&fs.lock(), ROOT_INO), "not swept");
    for _ in 0..3000 {
        if order[16..]
            .iter()
            .all(|&i| is_cached(&cache, &files[i].0, &etags[&files[i].0]))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        cache.settle().await;
    }
    for &i in &order[16..] {
        let name = &files[i].0;
        assert!(
            is_cached(&cache, name, &etags[name]),
            "{name} never swept: {:?}",
            cache.stats()
        );
    }
}

/// A file open for writing is open in the kernel's cached I/O mode until its last close, also
/// once its upload completed (`fsync`, or a `close` of one of several descriptors): the kernel
/// fails a passthrough open of the inode beside it (`EIO` to the reader). Its read opens must
/// stay in cached mode until the writer's handle is released.
#[tokio::test]
async fn a_file_still_open_for_writing_is_not_read_through_passthrough() {
    let (_dir, cache, store) = cache_and_store().await;
    let fs = mount(Arc::new(store.clone()), &cache, |c| c.read_only = false);
    let body = data((3 * BS) as usize, 13);
    let (e, w) = fs.create(ROOT_INO, OsStr::new("f"), PID).await.unwrap();
    fs.write(w.fh, 0, &body).await.unwrap();
    fs.fsync(w.fh).await.unwrap();
    // Read whole through the cache (it is then whole there), the writer's handle still open.
    assert_eq!(read_all(&fs, "f", 1 << 20).await.unwrap(), body);
    cache.settle().await;
    let r = fs.open(e.attr.ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(
        !fs.may_passthrough(r.fh) && fs.passthrough_file(r.fh).is_none(),
        "handed to the kernel for passthrough beside the open write handle"
    );
    fs.release(r.fh).await.unwrap();
    // Once the writer's handle is released, the next open may read through passthrough.
    fs.release(w.fh).await.unwrap();
    let r = fs.open(e.attr.ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(
        fs.passthrough_file(r.fh).is_some(),
        "passthrough once the writer closed"
    );
    fs.release(r.fh).await.unwrap();
}

/// Inode numbers are the path's: a file created again (after an unlink) at the path of a file
/// still open through passthrough is the same inode, which the kernel admits no cached-mode
/// open of beside those handles. Like an open that replaces it, its creation is refused (`EBUSY`)
/// rather than failed by the kernel (`EIO` to the writer, after the empty object was put).
#[tokio::test]
async fn a_file_is_not_created_again_at_the_path_of_one_open_through_passthrough() {
    let (_dir, cache, store) = cache_and_store().await;
    let old = data((3 * BS) as usize, 14);
    store.insert(B, "f", old.clone());
    let fs = mount(Arc::new(store.clone()), &cache, |c| {
        c.read_only = false;
        c.allow_delete = true;
    });
    let (ino, a, _file) = open_f_through_passthrough(&fs, &cache, &old).await;
    fs.unlink(ROOT_INO, OsStr::new("f")).await.unwrap();
    match fs.create(ROOT_INO, OsStr::new("f"), PID).await {
        Ok((e, w)) => panic!(
            "created as inode {} (the passthrough handles' {ino}), handle {}",
            e.attr.ino, w.fh
        ),
        Err(e) => assert_eq!(e.errno(), libc::EBUSY, "{e}"),
    }
    // Once the passthrough handle is closed, the file is created.
    fs.release(a).await.unwrap();
    let (_, w) = fs.create(ROOT_INO, OsStr::new("f"), PID).await.unwrap();
    fs.release(w.fh).await.unwrap();
}

/// A successor (take-over) counts the write handles it inherits as cached-mode opens too: the
/// kernel still has them open.
#[tokio::test]
async fn a_successor_does_not_read_through_passthrough_beside_an_inherited_write_handle() {
    let (_dir, cache, store) = cache_and_store().await;
    let fs = mount(Arc::new(store.clone()), &cache, |c| c.read_only = false);
    let body = data((3 * BS) as usize, 15);
    let (e, w) = fs.create(ROOT_INO, OsStr::new("f"), PID).await.unwrap();
    fs.write(w.fh, 0, &body).await.unwrap();
    fs.fsync(w.fh).await.unwrap();
    let next = Fs::from_snapshot(
        Arc::new(store.clone()),
        fs.snapshot().await,
        MemoryBudget::default(),
        PrefetchConfig::default(),
    )
    .with_cache(Some(cache.clone()));
    assert_eq!(read_all(&next, "f", 1 << 20).await.unwrap(), body);
    cache.settle().await;
    let r = next.open(e.attr.ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(
        next.passthrough_file(r.fh).is_none(),
        "handed to the kernel for passthrough beside the inherited write handle"
    );
    next.release(r.fh).await.unwrap();
    next.release(w.fh).await.unwrap();
    let r = next.open(e.attr.ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(
        next.passthrough_file(r.fh).is_some(),
        "passthrough once the writer closed"
    );
    next.release(r.fh).await.unwrap();
}

/// A new open of an inode already open through passthrough is handed the same backing file by
/// the kernel (the adapter joins it, `Passthrough::existing`): a read of the node cache's whole
/// file like any other, so it needs a proof of access within the lifetime too. With metadata
/// that never expires and the whole file gone from the cache's index (evicted; the kernel still
/// holds the backing file), the open asked nothing of S3: credentials refused since (or whose
/// proof ended long ago) were handed the cached bytes.
#[tokio::test]
async fn joining_an_inodes_passthrough_file_needs_a_live_proof() {
    let (_dir, cache, store) = cache_and_store().await;
    let body = data((3 * BS) as usize, 16);
    let etag = store.insert(B, "f", body.clone());
    let creds = Arc::new(FaultyStore::new(store.clone(), 1));
    let fs = mount(creds.clone(), &cache, |_| {});
    let (ino, a, _file) = open_f_through_passthrough(&fs, &cache, &body).await;

    // The whole file leaves the cache (evicted: gone from disk and index); the kernel keeps the
    // backing file open for handle `a`.
    let obj = ferry_cache::ObjectKey {
        endpoint: "http://s3.test".into(),
        bucket: B.into(),
        key: "f".into(),
        etag,
    };
    std::fs::remove_file(cache.object_path(&obj.file_id())).unwrap();
    cache.prepare_whole(&obj, body.len() as u64);
    assert!(!cache.has_whole(&obj), "{:?}", cache.stats());
    // The proof's lifetime passes and the credentials lose read access.
    tokio::time::pause();
    tokio::time::advance(crate::proofs::PROOF_LIFETIME + Duration::from_secs(1)).await;
    for op in [Op::Head, Op::Get] {
        creds.fail_next(op, u64::MAX, StoreError::AccessDenied("403".into()));
    }
    refused_open(&fs, ino, libc::EACCES, "opened without a proof of access").await;
    fs.release(a).await.unwrap();
}

/// A HEAD is no proof of access to an object's bytes: S3 answers it to credentials whose GET it
/// refuses (an SSE-KMS object without `kms:Decrypt` on its key, an archived object). A mount with
/// such credentials is never served the bytes another mount's reads left in the node cache: not
/// from blocks, nor from a whole file (passthrough).
#[tokio::test]
async fn a_head_alone_does_not_prove_access_to_cached_bytes() {
    let (_dir, cache, store) = cache_and_store().await;
    let (small, big) = (data(1000, 3), data((3 * BS) as usize, 5));
    store.insert(B, "small", small.clone());
    store.insert(B, "big", big.clone());
    let reader = mount(Arc::new(store.clone()), &cache, |_| {});
    assert_eq!(read_all(&reader, "small", 1 << 20).await.unwrap(), small);
    assert_eq!(read_all(&reader, "big", 1 << 20).await.unwrap(), big);
    cache.settle().await;
    assert_eq!(cache.stats().objects, 1, "{:?}", cache.stats());

    let head_only = FaultyStore::new(store.clone(), 2);
    head_only.fail_next(Op::Get, u64::MAX, StoreError::AccessDenied("403".into()));
    let other = mount(Arc::new(head_only), &cache, |_| {});
    // Its HEAD is answered: the file is there, as without the cache; its bytes are not its own.
    let attr = other
        .lookup(ROOT_INO, OsStr::new("big"))
        .await
        .unwrap()
        .attr;
    assert_eq!(attr.size, big.len() as u64);
    let o = other.open(attr.ino, libc::O_RDONLY, PID).await.unwrap();
    assert!(
        other.passthrough_file(o.fh).is_none(),
        "the whole file handed to the kernel for credentials whose GET is refused"
    );
    other.release(o.fh).await.unwrap();
    for name in ["small", "big"] {
        match read_all(&other, name, 1 << 20).await {
            Ok(got) => panic!(
                "{name}: {} cached bytes served to credentials whose GET is refused",
                got.len()
            ),
            Err(e) => assert_eq!(e.errno(), libc::EACCES, "{name}: {e}"),
        }
    }
}
