//! Unit tests of [`BlockCache`] on a temporary directory.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use proptest::prelude::*;
use tokio::sync::Notify;

use super::*;

const BS: u64 = MIN_BLOCK_SIZE;

fn key(name: &str, index: u64) -> BlockKey {
    BlockKey {
        endpoint: "http://s3.test".into(),
        bucket: "bucket".into(),
        key: name.into(),
        etag: "\"e1\"".into(),
        index,
    }
}

fn data(seed: u8, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| seed.wrapping_add(i as u8))
            .collect::<Vec<_>>(),
    )
}

async fn open(dir: &Path, max_size: u64) -> Arc<BlockCache> {
    let cache = BlockCache::open(CacheConfig {
        block_size: BS,
        ..CacheConfig::new(dir, max_size)
    })
    .unwrap();
    cache.ready().await;
    cache
}

/// Gets `k` through the cache; the fetch returns `d` and counts itself in `fetches`.
async fn get(cache: &Arc<BlockCache>, k: &BlockKey, d: &Bytes, fetches: &AtomicUsize) -> Bytes {
    cache
        .get_or_fetch(k, || async {
            fetches.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::convert::Infallible>(d.clone())
        })
        .await
        .unwrap()
}

/// Every block file on disk: (file id, size).
fn files_on_disk(cache: &BlockCache) -> Vec<(FileId, u64)> {
    let mut out = Vec::new();
    for dir in std::fs::read_dir(&cache.blocks_dir).unwrap() {
        for f in std::fs::read_dir(dir.unwrap().path()).unwrap() {
            let f = f.unwrap();
            let id = block::parse_hex(f.file_name().to_str().unwrap()).unwrap();
            out.push((id, f.metadata().unwrap().len()));
        }
    }
    out.sort();
    out
}

/// Temporary files left: in `tmp/` (whole objects) and beside the blocks.
fn temp_files(cache: &BlockCache) -> usize {
    let beside_blocks: usize = std::fs::read_dir(&cache.blocks_dir)
        .unwrap()
        .map(|dir| {
            std::fs::read_dir(dir.unwrap().path())
                .unwrap()
                .filter(|f| {
                    let f = f.as_ref().unwrap().file_name();
                    f.to_str().unwrap().starts_with(TMP_MARK)
                })
                .count()
        })
        .sum();
    beside_blocks + std::fs::read_dir(&cache.tmp_dir).unwrap().count()
}

#[tokio::test]
async fn a_block_whose_directory_is_not_made_yet_makes_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let fetches = AtomicUsize::new(0);
    let (k, d) = (key("a", 0), data(1, 1000));
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    cache.dirs_made().await;
    let sub_of = |k: &BlockKey| cache.block_path(&k.file_id()).parent().unwrap().to_owned();
    let k2 = (1..)
        .map(|i| key(&format!("b{i}"), 0))
        .find(|k2| sub_of(k2) != sub_of(&k))
        .unwrap();
    let sub = sub_of(&k2);
    std::fs::remove_dir(&sub).unwrap();
    let d2 = data(2, 1000);
    assert_eq!(get(&cache, &k2, &d2, &fetches).await, d2);
    cache.settle().await;
    assert!(cache.contains(&k2) && sub.is_dir());
    assert_eq!(get(&cache, &k2, &d2, &fetches).await, d2);
    assert_eq!(
        fetches.load(Ordering::SeqCst),
        2,
        "the second read is a hit"
    );
}

/// `blocks/` itself removed by hand while the cache runs: the next block is stored again (its
/// directories made anew), not skipped for ever with a warning per write (`statvfs` was asked of
/// `blocks/`).
#[tokio::test]
async fn the_blocks_directory_removed_is_made_again_by_the_next_write() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let fetches = AtomicUsize::new(0);
    cache.dirs_made().await;
    std::fs::remove_dir_all(&cache.blocks_dir).unwrap();
    let (k, d) = (key("a", 0), data(1, 1000));
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    cache.settle().await;
    assert!(cache.contains(&k), "stored again");
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    assert_eq!(
        fetches.load(Ordering::SeqCst),
        1,
        "the second read is a hit"
    );
}

#[tokio::test]
async fn a_miss_fetches_and_stores_then_hits_are_served_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let fetches = AtomicUsize::new(0);
    let (k, d) = (key("a", 0), data(1, 1000));
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    cache.settle().await;
    assert!(cache.contains(&k));
    cache.dirs_made().await;
    assert_eq!(
        std::fs::read_dir(&cache.blocks_dir).unwrap().count(),
        256,
        "every block directory is made once the index is ready"
    );
    for _ in 0..3 {
        assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    }
    assert_eq!(fetches.load(Ordering::SeqCst), 1);
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.hit_bytes, s.stored), (1, 3, 3000, 1));
    assert_eq!(s.blocks, 1);
    assert_eq!(s.bytes, files_on_disk(&cache)[0].1);
    // Another version (ETag) of the same key is another block.
    let other = BlockKey {
        etag: "\"e2\"".into(),
        ..k.clone()
    };
    assert_eq!(
        get(&cache, &other, &data(9, 10), &fetches).await,
        data(9, 10)
    );
    assert_eq!(fetches.load(Ordering::SeqCst), 2);
    // Stores are written behind the reader: wait for them before looking at the disk.
    cache.settle().await;
    assert_eq!(temp_files(&cache), 0, "no temp files left");
}

#[tokio::test]
async fn a_flipped_byte_is_a_counted_miss_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let fetches = AtomicUsize::new(0);
    let (k, d) = (key("a", 2), data(7, 5000));
    get(&cache, &k, &d, &fetches).await;
    cache.settle().await;
    let path = cache.block_path(&k.file_id());
    let mut file = std::fs::read(&path).unwrap();
    let last = file.len() - 1;
    file[last] ^= 1;
    std::fs::write(&path, &file).unwrap();

    assert_eq!(get(&cache, &k, &d, &fetches).await, d, "correct data");
    assert_eq!(fetches.load(Ordering::SeqCst), 2, "refetched");
    let s = cache.stats();
    assert_eq!((s.corrupt, s.hits), (1, 0));
    cache.settle().await;
    // The refetched block was stored again and is intact.
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    assert_eq!(fetches.load(Ordering::SeqCst), 2);
    assert_eq!(cache.stats().hits, 1);

    // A file of another block under this block's name (e.g. a hash collision) is refused too.
    let other = key("b", 0);
    std::fs::write(&path, block::encode(&other, &d)).unwrap();
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    assert_eq!(cache.stats().corrupt, 2);
}

#[tokio::test]
async fn concurrent_misses_of_one_block_run_one_fetch() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let fetches = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(Notify::new());
    let k = key("shared", 0);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (cache, fetches, release, k) =
            (cache.clone(), fetches.clone(), release.clone(), k.clone());
        tasks.push(tokio::spawn(async move {
            cache
                .get_or_fetch(&k, || async {
                    fetches.fetch_add(1, Ordering::SeqCst);
                    release.notified().await;
                    Ok::<_, std::convert::Infallible>(data(3, 100))
                })
                .await
                .unwrap()
        }));
    }
    // Wait until one fetch is running and every other caller joined it.
    while fetches.load(Ordering::SeqCst) == 0 || Arc::strong_count(&cache) < 9 {
        tokio::task::yield_now().await;
    }
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
    release.notify_one();
    for t in tasks {
        assert_eq!(t.await.unwrap(), data(3, 100));
    }
    assert_eq!(fetches.load(Ordering::SeqCst), 1);
    let s = cache.stats();
    assert_eq!(s.misses + s.hits + s.joins, 8);
    assert_eq!(s.misses, 1);
}

#[tokio::test]
async fn a_failed_fetch_is_not_shared_and_the_next_caller_fetches() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let k = key("x", 0);
    let err = cache
        .get_or_fetch(&k, || async { Err::<Bytes, _>("denied") })
        .await;
    assert_eq!(err, Err("denied"));
    let ok = cache
        .get_or_fetch(&k, || async { Ok::<_, &str>(data(1, 10)) })
        .await;
    assert_eq!(ok, Ok(data(1, 10)));
}

#[tokio::test]
async fn blocks_survive_a_restart_and_the_index_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let before = {
        let cache = open(dir.path(), 100 * BS).await;
        for i in 0..20 {
            get(&cache, &key("f", i), &data(i as u8, 3000), &fetches).await;
        }
        cache.settle().await;
        cache.stats()
    };
    // Half-written temporary files of the old process are removed: a whole object's in
    // `tmp/`, a block's beside the blocks.
    let blocks_xx = std::fs::read_dir(dir.path().join("blocks"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let torn = [
        dir.path().join("tmp/leftover"),
        blocks_xx.join(format!("{TMP_MARK}17a0-3")),
    ];
    for f in &torn {
        std::fs::write(f, b"torn").unwrap();
    }
    let cache = open(dir.path(), 100 * BS).await;
    for f in &torn {
        assert!(!f.exists(), "{} left", f.display());
    }
    assert_eq!(temp_files(&cache), 0);
    let after = cache.stats();
    assert_eq!((after.blocks, after.bytes), (before.blocks, before.bytes));
    for i in 0..20 {
        assert_eq!(
            get(&cache, &key("f", i), &data(i as u8, 3000), &fetches).await,
            data(i as u8, 3000)
        );
    }
    assert_eq!(
        fetches.load(Ordering::SeqCst),
        20,
        "no fetch after the restart"
    );
    assert_eq!(cache.stats().hits, 20);
}

/// An object of `size` bytes under `name`, and its content.
fn object(name: &str, size: u64, seed: u8) -> (ObjectKey, Bytes) {
    (
        ObjectKey {
            endpoint: "http://s3.test".into(),
            bucket: "bucket".into(),
            key: name.into(),
            etag: "\"e1\"".into(),
        },
        data(seed, size as usize),
    )
}

/// Reads every block of `obj` through the cache (fetching from `content` on a miss).
async fn read_all(
    cache: &Arc<BlockCache>,
    obj: &ObjectKey,
    content: &Bytes,
    fetches: &AtomicUsize,
) {
    let n = (content.len() as u64).div_ceil(BS);
    for i in 0..n {
        let piece = content.slice((i * BS) as usize..content.len().min(((i + 1) * BS) as usize));
        assert_eq!(
            get(cache, &obj.block(i), &piece, fetches).await,
            piece,
            "block {i}"
        );
    }
}

fn read_file(mut f: File) -> Vec<u8> {
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut f, &mut out).unwrap();
    out
}

#[tokio::test]
async fn an_object_wanted_whole_is_joined_when_its_last_block_is_stored() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 20 * BS).await;
    let fetches = AtomicUsize::new(0);
    let size = 3 * BS + 1234;
    let (obj, content) = object("big", size, 3);
    assert!(cache.open_whole(&obj, size).is_none(), "nothing cached yet");
    cache.want_whole(obj.clone(), size);
    read_all(&cache, &obj, &content, &fetches).await;
    cache.settle().await;
    let s = cache.stats();
    assert_eq!((s.assembled, s.objects, s.blocks), (1, 1, 0), "{s:?}");
    assert!(
        files_on_disk(&cache).is_empty(),
        "the blocks are deleted once joined"
    );
    assert!(cache.has_whole(&obj));
    assert!(cache.contains(&obj.block(2)));
    // The whole file is exactly the object; blocks are now read out of it.
    let f = cache.open_whole(&obj, size).expect("whole file");
    assert_eq!(read_file(f), content.to_vec());
    read_all(&cache, &obj, &content, &fetches).await;
    assert_eq!(fetches.load(Ordering::SeqCst), 4, "no fetch after the join");
    let s = cache.stats();
    assert_eq!((s.whole_opens, s.hits), (1, 4));
    let on_disk = std::fs::metadata(cache.object_path(&obj.file_id()))
        .unwrap()
        .len()
        + std::fs::metadata(cache.meta_path(&obj.file_id()))
            .unwrap()
            .len();
    assert_eq!(s.bytes, on_disk);
    assert_eq!(temp_files(&cache), 0);

    // Wanting it when every block is already there joins it at once; a missing block never.
    let (small, small_content) = object("small", BS / 2, 9);
    read_all(&cache, &small, &small_content, &fetches).await;
    cache.settle().await;
    cache.want_whole(small.clone(), BS / 2);
    cache.settle().await;
    assert!(cache.has_whole(&small));
    let (partial, partial_content) = object("partial", 2 * BS, 5);
    get(
        &cache,
        &partial.block(0),
        &partial_content.slice(..BS as usize),
        &fetches,
    )
    .await;
    cache.settle().await;
    cache.want_whole(partial.clone(), 2 * BS);
    cache.settle().await;
    assert!(!cache.has_whole(&partial));
    assert!(cache.open_whole(&partial, 2 * BS).is_none());
}

#[tokio::test]
async fn a_flipped_byte_in_a_whole_object_is_never_served() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let size = 2 * BS + 10;
    let (obj, content) = object("o", size, 1);
    let flip = |cache: &BlockCache, at: u64| {
        let path = cache.object_path(&obj.file_id());
        let mut f = std::fs::read(&path).unwrap();
        f[at as usize] ^= 0x40;
        std::fs::write(&path, f).unwrap();
    };
    {
        let cache = open(dir.path(), 20 * BS).await;
        cache.want_whole(obj.clone(), size);
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
        assert!(cache.has_whole(&obj));
        // Read as a block: the piece fails its crc, the file is dropped, the block refetched.
        flip(&cache, BS + 7);
        let piece = content.slice(BS as usize..2 * BS as usize);
        assert_eq!(get(&cache, &obj.block(1), &piece, &fetches).await, piece);
        assert_eq!(cache.stats().corrupt, 1);
        assert!(!cache.has_whole(&obj));
        // Everything is fetched and joined again.
        cache.want_whole(obj.clone(), size);
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
        assert!(cache.has_whole(&obj));
    }
    // A new process checks the whole file before handing it out: a flipped byte means no file.
    let cache = open(dir.path(), 20 * BS).await;
    assert_eq!(cache.stats().objects, 1, "indexed after the restart");
    flip(&cache, size - 1);
    assert!(cache.open_whole(&obj, size).is_none());
    let s = cache.stats();
    assert_eq!((s.corrupt, s.objects, s.whole_opens), (1, 0, 0));
    // A sidecar that names another object is refused the same way.
    cache.want_whole(obj.clone(), size);
    read_all(&cache, &obj, &content, &fetches).await;
    cache.settle().await;
    assert!(cache.has_whole(&obj));
    let other = ObjectKey {
        etag: "\"e2\"".into(),
        ..obj.clone()
    };
    let meta = object::encode_meta(
        &other,
        &ObjectMeta {
            size,
            block_size: BS,
            chunk: block::CHUNK,
            crcs: vec![0; 3],
        },
    );
    std::fs::write(cache.meta_path(&obj.file_id()), meta).unwrap();
    cache.metas.lock().unwrap().clear();
    cache.verified.lock().unwrap().clear();
    assert!(cache.open_whole(&obj, size).is_none());
    assert_eq!(cache.stats().corrupt, 2);
}

#[tokio::test]
async fn whole_objects_survive_a_restart_and_are_checked_once() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let size = 3 * BS;
    let (obj, content) = object("w", size, 4);
    {
        let cache = open(dir.path(), 20 * BS).await;
        cache.want_whole(obj.clone(), size);
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
    }
    // A sidecar without its data file is stray.
    let stray = cache_dir_file(
        dir.path(),
        "objects/00/00000000000000000000000000000000.meta",
    );
    std::fs::write(&stray, b"x").unwrap();
    let cache = open(dir.path(), 20 * BS).await;
    assert!(!stray.exists());
    assert_eq!(cache.stats().objects, 1);
    for _ in 0..3 {
        let f = cache.open_whole(&obj, size).expect("whole file");
        assert_eq!(read_file(f), content.to_vec());
    }
    assert_eq!(cache.stats().whole_opens, 3);
    // A wrong size (another version would have another ETag) is refused.
    cache.verified.lock().unwrap().clear();
    assert!(cache.open_whole(&obj, size + 1).is_none());
    assert_eq!(fetches.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_clean_shutdown_lets_the_next_process_trust_unchanged_whole_files_only() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let size = 2 * BS + 99;
    let (obj, content) = object("t", size, 6);
    {
        let cache = open(dir.path(), 20 * BS).await;
        cache.want_whole(obj.clone(), size);
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
        assert_eq!(
            cache.save_checked().unwrap(),
            1,
            "written by this process: checked"
        );
    }
    {
        let cache = open(dir.path(), 20 * BS).await;
        assert!(
            !dir.path().join(CHECKED_FILE).exists(),
            "the record is used once"
        );
        assert_eq!(cache.stats().trusted, 1);
        let f = cache.open_whole(&obj, size).expect("trusted file");
        assert_eq!(read_file(f), content.to_vec());
        // No clean shutdown (a crash): nothing recorded.
    }
    {
        let cache = open(dir.path(), 20 * BS).await;
        assert_eq!(
            cache.stats().trusted,
            0,
            "after a crash everything is checked again"
        );
        assert!(cache.open_whole(&obj, size).is_some());
        assert_eq!(cache.save_checked().unwrap(), 1);
    }
    // Changed after the record (a later clock tick: ctime moves): checked, and refused.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let cache_path = {
        let cache = BlockCache::open(CacheConfig {
            block_size: BS,
            ..CacheConfig::new(dir.path(), 20 * BS)
        })
        .unwrap();
        let p = cache.object_path(&obj.file_id());
        // Let this process's index finish without keeping its record.
        cache.ready().await;
        assert_eq!(cache.save_checked().unwrap(), 1);
        p
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut bytes = std::fs::read(&cache_path).unwrap();
    bytes[5] ^= 1;
    std::fs::write(&cache_path, bytes).unwrap();
    let cache = open(dir.path(), 20 * BS).await;
    assert_eq!(cache.stats().trusted, 0, "a changed file is not trusted");
    assert!(cache.open_whole(&obj, size).is_none());
    assert_eq!(cache.stats().corrupt, 1);
}

/// `obj` (`content`) read whole through `cache`, which joins it into one whole file.
async fn make_whole(
    cache: &Arc<BlockCache>,
    obj: &ObjectKey,
    content: &Bytes,
    fetches: &AtomicUsize,
) {
    cache.want_whole(obj.clone(), content.len() as u64);
    read_all(cache, obj, content, fetches).await;
    cache.settle().await;
    assert!(cache.has_whole(obj));
}

/// A cache at `dir` holding object `name` whole (two blocks and a bit), handed out once (so
/// checked), whose file is then altered on disk (a byte flipped at a later clock tick: its ctime
/// moves) while the cache still runs.
async fn whole_file_checked_then_altered(
    dir: &Path,
    name: &str,
    seed: u8,
) -> (Arc<BlockCache>, ObjectKey, u64) {
    let fetches = AtomicUsize::new(0);
    let size = 2 * BS + 99;
    let (obj, content) = object(name, size, seed);
    let cache = open(dir, 20 * BS).await;
    make_whole(&cache, &obj, &content, &fetches).await;
    let f = cache.open_whole(&obj, size).expect("whole file");
    assert_eq!(read_file(f), content.to_vec());
    std::thread::sleep(std::time::Duration::from_millis(20));
    let path = cache.object_path(&obj.file_id());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[5] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    (cache, obj, size)
}

/// A whole file this process checked (or wrote) and that then changed on disk while it ran is
/// not recorded as checked at its clean shutdown: the record vouches for what was checked, so
/// the next process checks the file and refuses it.
#[tokio::test]
async fn a_whole_file_changed_after_its_check_is_not_trusted_by_the_next_process() {
    let dir = tempfile::tempdir().unwrap();
    let (obj, size) = {
        let (cache, obj, size) = whole_file_checked_then_altered(dir.path(), "changed", 8).await;
        cache.save_checked().unwrap();
        (obj, size)
    };
    let cache = open(dir.path(), 20 * BS).await;
    assert_eq!(
        cache.stats().trusted,
        0,
        "a file changed since its check is not trusted"
    );
    assert!(
        cache.open_whole(&obj, size).is_none(),
        "a corrupt whole file is handed out unchecked"
    );
    assert_eq!(cache.stats().corrupt, 1);
}

/// The same within one process: a whole file changed on disk since this process checked (or
/// wrote) it is checked again before the next hand-out, and refused (one `fstat` per open tells).
#[tokio::test]
async fn a_whole_file_changed_after_its_check_is_checked_again_before_the_next_hand_out() {
    let dir = tempfile::tempdir().unwrap();
    let (cache, obj, size) = whole_file_checked_then_altered(dir.path(), "changed-live", 9).await;
    assert!(
        cache.open_whole(&obj, size).is_none(),
        "a whole file changed since its check is handed out unchecked"
    );
    assert_eq!(cache.stats().corrupt, 1);
}

/// A whole file shorter than its sidecar says (cut short: a crash before its data reached the
/// disk, a full disk) is a bad file: dropped and counted when a read finds it short, as one that
/// fails its crcs is. Kept, it stays indexed, every block of its object is turned away from the
/// cache ("joined into a whole file meanwhile") and every read of them is a GET for good (without
/// passthrough, nothing else ever checks it).
#[tokio::test]
async fn a_whole_file_cut_short_is_dropped_by_the_read_that_finds_it_short() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 20 * BS).await;
    let fetches = AtomicUsize::new(0);
    let size = 3 * BS;
    let (obj, content) = object("short", size, 10);
    make_whole(&cache, &obj, &content, &fetches).await;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(cache.object_path(&obj.file_id()))
        .unwrap();
    f.set_len(size - 100).unwrap();
    drop(f);
    // The first read finds it short (the file is dropped: its blocks are fetched and stored
    // again, once) ...
    for _ in 0..2 {
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
    }
    // ... and later ones read them from the cache.
    let before = fetches.load(Ordering::SeqCst);
    for _ in 0..2 {
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
    }
    assert_eq!(
        fetches.load(Ordering::SeqCst) - before,
        0,
        "the last block is fetched at every read: {:?}",
        cache.stats()
    );
    assert_eq!(cache.stats().corrupt, 1);
}

fn cache_dir_file(dir: &Path, rel: &str) -> PathBuf {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    p
}

#[tokio::test]
async fn whole_objects_are_evicted_under_the_budget_like_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    // Room for one 3-block object and its blocks while it is joined, not for two objects.
    let cache = open(dir.path(), 7 * BS).await;
    let (a, ca) = object("a", 3 * BS, 1);
    let (b, cb) = object("b", 3 * BS, 2);
    for (o, c) in [(&a, &ca), (&b, &cb)] {
        cache.want_whole(o.clone(), 3 * BS);
        read_all(&cache, o, c, &fetches).await;
        cache.settle().await;
    }
    assert!(cache.has_whole(&b), "{:?}", cache.stats());
    assert!(!cache.has_whole(&a), "the older object was evicted");
    let s = cache.stats();
    assert!(s.bytes <= 7 * BS && s.evictions >= 1, "{s:?}");
    assert!(!cache.object_path(&a.file_id()).exists());
}

#[tokio::test]
async fn a_cache_directory_of_another_block_size_is_emptied_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    {
        let cache = open(dir.path(), 20 * BS).await;
        get(&cache, &key("x", 1), &data(1, 100), &fetches).await;
        cache.settle().await;
        assert_eq!(cache.stats().blocks, 1);
    }
    let cache = BlockCache::open(CacheConfig {
        block_size: 2 * BS,
        ..CacheConfig::new(dir.path(), 20 * BS)
    })
    .unwrap();
    cache.ready().await;
    assert_eq!(cache.stats().blocks, 0);
    assert!(
        !dir.path().join("trash").exists(),
        "the old files are deleted"
    );
    get(&cache, &key("x", 1), &data(2, 100), &fetches).await;
    assert_eq!(
        fetches.load(Ordering::SeqCst),
        2,
        "block 1 of another size is a miss"
    );
}

#[tokio::test]
async fn a_smaller_budget_at_restart_evicts_down_to_it() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    {
        let cache = open(dir.path(), 100 * BS).await;
        for i in 0..10 {
            get(&cache, &key("f", i), &data(0, BS as usize), &fetches).await;
        }
        cache.settle().await;
    }
    let cache = open(dir.path(), 4 * BS).await;
    let on_disk: u64 = files_on_disk(&cache).iter().map(|f| f.1).sum();
    assert!(on_disk <= 4 * BS, "{on_disk} bytes on disk over the budget");
    assert_eq!(cache.stats().bytes, on_disk);
    assert!(cache.stats().evictions >= 6);
}

#[test]
fn bad_configs_are_refused_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let bad = CacheConfig {
        block_size: 3 << 20,
        ..CacheConfig::new(dir.path(), 1 << 30)
    };
    assert!(BlockCache::open(bad)
        .unwrap_err()
        .to_string()
        .contains("power of two"));
    let small = CacheConfig::new(dir.path(), 1 << 20);
    assert!(BlockCache::open(small)
        .unwrap_err()
        .to_string()
        .contains("smaller than one block"));
}

/// The reference model of eviction: blocks by recency, each with its file size.
#[derive(Default)]
struct ModelCache(Vec<(u8, u64)>);

impl ModelCache {
    /// A get of block `b` whose file is `size` bytes; `true` for a hit.
    fn get(&mut self, b: u8, size: u64, max: u64) -> bool {
        if let Some(i) = self.0.iter().position(|e| e.0 == b) {
            let e = self.0.remove(i);
            self.0.push(e);
            return true;
        }
        while self.0.iter().map(|e| e.1).sum::<u64>() + size > max && !self.0.is_empty() {
            self.0.remove(0);
        }
        self.0.push((b, size));
        false
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any sequence of gets: the cache hits exactly when the LRU model does, the files on disk are
    /// exactly the model's, and they never exceed the budget.
    #[test]
    fn eviction_matches_the_lru_model(
        max_blocks in 2u64..6,
        gets in proptest::collection::vec(0u8..10, 1..60),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let max = max_blocks * 2 * BS;
            let cache = open(dir.path(), max).await;
            let mut model = ModelCache::default();
            let fetches = AtomicUsize::new(0);
            let sizes: Vec<u64> = (0u8..10).map(|b| block::encode(&key("m", b.into()), &data(b, 1)).len() as u64).collect();
            for b in gets {
                // Block b always has the same length: half, one or one and a half blocks' worth.
                let len = (BS as usize / 2) * (1 + (b as usize % 3));
                let size = sizes[b as usize] - 1 + len as u64;
                let before = fetches.load(Ordering::SeqCst);
                let got = get(&cache, &key("m", b.into()), &data(b, len), &fetches).await;
                cache.settle().await;
                prop_assert_eq!(got, data(b, len));
                let hit = fetches.load(Ordering::SeqCst) == before;
                prop_assert_eq!(hit, model.get(b, size, max));
                let disk: HashSet<FileId> = files_on_disk(&cache).iter().map(|f| f.0).collect();
                let want: HashSet<FileId> = model.0.iter().map(|e| key("m", e.0.into()).file_id()).collect();
                prop_assert_eq!(disk, want);
                let bytes: u64 = files_on_disk(&cache).iter().map(|f| f.1).sum();
                prop_assert!(bytes <= max);
                prop_assert_eq!(cache.stats().bytes, bytes);
            }
            Ok(())
        })?;
    }
}

/// A flight whose creator (an identity without access) fails is taken over by a proven reader of
/// other credentials: a waiting reader of the first identity never gets those bytes, it fetches
/// with its own.
#[tokio::test]
async fn an_unproven_reader_never_takes_bytes_another_identity_fetched() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let k = key("secret", 0);
    let go = Arc::new(Notify::new());
    let x = {
        let (cache, k, go) = (cache.clone(), k.clone(), go.clone());
        tokio::spawn(async move {
            cache
                .get_or_fetch_as(&k, Reader::Unproven { owner: 1 }, || async move {
                    go.notified().await;
                    Err::<Bytes, &str>("403 AccessDenied")
                })
                .await
        })
    };
    tokio::task::yield_now().await;
    let y = {
        let (cache, k) = (cache.clone(), k.clone());
        tokio::spawn(async move {
            cache
                .get_or_fetch_as(&k, Reader::Proven { owner: 2 }, || async {
                    Ok::<_, &str>(Bytes::from_static(b"fetched by y"))
                })
                .await
        })
    };
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let x2 = {
        let (cache, k) = (cache.clone(), k.clone());
        tokio::spawn(async move {
            cache
                .get_or_fetch_as(&k, Reader::Unproven { owner: 1 }, || async {
                    Err::<Bytes, &str>("403 AccessDenied")
                })
                .await
        })
    };
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    go.notify_one();
    assert_eq!(x.await.unwrap(), Err("403 AccessDenied"));
    assert_eq!(
        y.await.unwrap().unwrap(),
        Bytes::from_static(b"fetched by y")
    );
    assert_eq!(
        x2.await.unwrap(),
        Err("403 AccessDenied"),
        "the second reader of identity 1 fetched with its own credentials"
    );
}

/// Identity `owner`'s fetch of `k` (giving `d`), started and held in flight until `go` is
/// notified; the task gives its result.
async fn fetch_held_as(
    cache: &Arc<BlockCache>,
    k: &BlockKey,
    d: &Bytes,
    owner: u64,
) -> (
    Arc<Notify>,
    tokio::task::JoinHandle<Result<Bytes, std::convert::Infallible>>,
) {
    let go = Arc::new(Notify::new());
    let x = {
        let (cache, k, d, go) = (cache.clone(), k.clone(), d.clone(), go.clone());
        tokio::spawn(async move {
            cache
                .get_or_fetch_as(&k, Reader::Proven { owner }, || async move {
                    go.notified().await;
                    Ok(d)
                })
                .await
        })
    };
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    (go, x)
}

/// A reader of another identity that may not join a fetch in flight fetches with its own
/// credentials and gets only the part it asked for, not the whole block.
#[tokio::test]
async fn an_unproven_part_read_beside_another_identitys_fetch_gets_its_part() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let (k, d) = (key("shared", 0), data(7, 4096));
    let (go, x) = fetch_held_as(&cache, &k, &d, 1).await;
    let part = Part {
        len: d.len() as u64,
        within: 5..9,
    };
    let own = cache
        .get_part_or_fetch_as(&k, part, Reader::Unproven { owner: 2 }, None, |range| {
            let d = d.clone();
            async move {
                Ok::<_, std::convert::Infallible>(d.slice(range.start as usize..range.end as usize))
            }
        })
        .await
        .unwrap();
    assert_eq!(own.len(), 4, "the part's length, not the block's");
    assert_eq!(
        own,
        d.slice(5..9),
        "the part, fetched with identity 2's credentials"
    );
    go.notify_one();
    assert_eq!(x.await.unwrap().unwrap(), d);
}

/// The same lone fetch under a spent budget asks only for the part's bytes, as a flight's
/// fetch would, and the block is not stored from it.
#[tokio::test]
async fn an_unproven_part_read_beside_another_identitys_fetch_keeps_to_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    assert!(cache.charge_writes(Box::new(|_| None), u64::MAX));
    let (k, d) = (key("shared", 0), data(9, 4096));
    let (go, x) = fetch_held_as(&cache, &k, &d, 1).await;
    let part = Part {
        len: d.len() as u64,
        within: 100..200,
    };
    let asked = Mutex::new(Vec::new());
    let own = cache
        .get_part_or_fetch_as(&k, part, Reader::Unproven { owner: 2 }, None, |range| {
            asked.lock().unwrap().push(range.clone());
            let d = d.clone();
            async move {
                Ok::<_, std::convert::Infallible>(d.slice(range.start as usize..range.end as usize))
            }
        })
        .await
        .unwrap();
    assert_eq!(own, d.slice(100..200));
    assert_eq!(
        *asked.lock().unwrap(),
        vec![100..200],
        "only the part's bytes were fetched"
    );
    go.notify_one();
    assert_eq!(
        x.await.unwrap().unwrap(),
        d,
        "identity 1's fetch is its own"
    );
    cache.settle().await;
    assert!(!cache.contains(&k), "the budget is spent: nothing stored");
}

/// A cache of four-piece blocks, for part reads.
async fn open_pieces(dir: &Path) -> Arc<BlockCache> {
    let cache = BlockCache::open(CacheConfig {
        block_size: 4 * block::CHUNK,
        ..CacheConfig::new(dir, 64 * block::CHUNK)
    })
    .unwrap();
    cache.ready().await;
    cache
}

async fn get_part(
    cache: &Arc<BlockCache>,
    k: &BlockKey,
    d: &Bytes,
    within: std::ops::Range<u64>,
    fetches: &AtomicUsize,
) -> Bytes {
    let part = Part {
        len: d.len() as u64,
        within,
    };
    cache
        .get_part_or_fetch_as(k, part, Reader::Proven { owner: 0 }, None, |_| async {
            fetches.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::convert::Infallible>(d.clone())
        })
        .await
        .unwrap()
}

fn flip_at(path: &Path, at: u64) {
    let mut f = std::fs::read(path).unwrap();
    f[at as usize] ^= 0x40;
    std::fs::write(path, f).unwrap();
}

#[tokio::test]
async fn a_part_is_read_from_its_pieces_and_a_bad_piece_is_found_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open_pieces(dir.path()).await;
    let c = block::CHUNK;
    let fetches = AtomicUsize::new(0);
    let (k, d) = (key("p", 0), data(3, (4 * c - 9) as usize));
    // A miss fetches the whole block and gives the part.
    assert_eq!(
        get_part(&cache, &k, &d, 5..9, &fetches).await,
        d.slice(5..9)
    );
    cache.settle().await;
    flip_at(&cache.block_path(&k.file_id()), 3 * c + 1);
    // Parts in the good pieces are served from disk: no fetch, no corruption seen.
    for within in [0..10, c - 3..c + 3, 2 * c..3 * c] {
        let want = d.slice(within.start as usize..within.end as usize);
        assert_eq!(get_part(&cache, &k, &d, within, &fetches).await, want);
    }
    let s = cache.stats();
    assert_eq!(
        (fetches.load(Ordering::SeqCst), s.hits, s.corrupt),
        (1, 3, 0)
    );
    assert_eq!(s.hit_bytes, 10 + 6 + c);
    // A part in the bad piece: refused, the file deleted, the block fetched again.
    let want = d.slice((3 * c) as usize..(3 * c + 4) as usize);
    assert_eq!(
        get_part(&cache, &k, &d, 3 * c..3 * c + 4, &fetches).await,
        want
    );
    assert_eq!(
        (fetches.load(Ordering::SeqCst), cache.stats().corrupt),
        (2, 1)
    );

    // The same for a whole object, read in parts from its one file.
    let size = 8 * c + 10;
    let (obj, content) = object("w", size, 5);
    cache.want_whole(obj.clone(), size);
    for i in 0..3 {
        let piece = content.slice((4 * c * i) as usize..size.min(4 * c * (i + 1)) as usize);
        get(&cache, &obj.block(i), &piece, &fetches).await;
    }
    cache.settle().await;
    assert!(cache.has_whole(&obj));
    let before = fetches.load(Ordering::SeqCst);
    flip_at(&cache.object_path(&obj.file_id()), 4 * c + 2 * c + 7);
    let block1 = content.slice((4 * c) as usize..(8 * c) as usize);
    let read = |within: std::ops::Range<u64>| {
        let want = block1.slice(within.start as usize..within.end as usize);
        (within, want)
    };
    for (within, want) in [read(0..4096), read(c + 1..2 * c), read(3 * c..4 * c)] {
        assert_eq!(
            get_part(&cache, &obj.block(1), &block1, within, &fetches).await,
            want
        );
    }
    assert_eq!(fetches.load(Ordering::SeqCst), before);
    assert_eq!(cache.stats().corrupt, 1);
    let (within, want) = read(2 * c + 5..2 * c + 9);
    assert_eq!(
        get_part(&cache, &obj.block(1), &block1, within, &fetches).await,
        want
    );
    assert_eq!(fetches.load(Ordering::SeqCst), before + 1);
    assert_eq!(cache.stats().corrupt, 2);
    assert!(!cache.has_whole(&obj), "the bad whole file is dropped");
}

#[tokio::test]
async fn files_an_older_ferry_wrote_are_still_served() {
    let dir = tempfile::tempdir().unwrap();
    let c = block::CHUNK;
    let fetches = AtomicUsize::new(0);
    let (k, d) = (key("old", 0), data(8, (4 * c) as usize));
    let size = 4 * c + 100;
    let (obj, content) = object("old-whole", size, 9);
    {
        // Written as before: a format-2 block file, a whole object with a format-1 sidecar.
        let cache = open_pieces(dir.path()).await;
        let path = cache.block_path(&k.file_id());
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, block::tests::encode_2(&k, &d)).unwrap();
        let id = obj.file_id();
        let data_path = cache.object_path(&id);
        std::fs::create_dir_all(data_path.parent().unwrap()).unwrap();
        std::fs::write(&data_path, &content).unwrap();
        let crcs = [
            crate::block::crc32c(&content[..(4 * c) as usize]),
            crate::block::crc32c(&content[(4 * c) as usize..]),
        ];
        let meta = object::tests::encode_meta_1(&obj, size, 4 * c, &crcs);
        std::fs::write(cache.meta_path(&id), meta).unwrap();
    }
    let cache = open_pieces(dir.path()).await;
    assert_eq!(
        get_part(&cache, &k, &d, 7..9, &fetches).await,
        d.slice(7..9)
    );
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    let block1 = content.slice((4 * c) as usize..);
    assert_eq!(
        get_part(&cache, &obj.block(1), &block1, 3..50, &fetches).await,
        block1.slice(3..50)
    );
    assert!(cache.open_whole(&obj, size).is_some());
    let s = cache.stats();
    assert_eq!(
        (fetches.load(Ordering::SeqCst), s.corrupt, s.hits),
        (0, 0, 3)
    );
}

#[tokio::test]
async fn a_part_that_is_none_of_its_block_never_costs_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open_pieces(dir.path()).await;
    let fetches = AtomicUsize::new(0);
    let (k, d) = (key("q", 0), data(4, 1000));
    get(&cache, &k, &d, &fetches).await;
    cache.settle().await;
    // Empty, and past the block's end: what the block has of it, the file kept.
    assert!(get_part(&cache, &k, &d, 5..5, &fetches).await.is_empty());
    assert_eq!(
        get_part(&cache, &k, &d, 990..1010, &fetches).await,
        d.slice(990..)
    );
    let s = cache.stats();
    assert_eq!((fetches.load(Ordering::SeqCst), s.corrupt), (1, 0));
    assert!(cache.contains(&k));
}

/// A block's bytes are charged from the moment it is handed to the writers until it is on disk;
/// a refused charge leaves the block unstored (counted as skipped), and the reader still has it;
/// a fetcher's own charge for the bytes is held instead of asking for one.
#[tokio::test]
async fn a_blocks_bytes_are_charged_until_it_is_written_and_a_refused_charge_skips_it() {
    struct Charge {
        held: Arc<std::sync::atomic::AtomicU64>,
        bytes: u64,
        /// The block file, and whether it existed when the charge was given back.
        file: PathBuf,
        on_disk: Arc<Mutex<Vec<bool>>>,
    }
    impl Drop for Charge {
        fn drop(&mut self) {
            self.on_disk.lock().unwrap().push(self.file.exists());
            self.held.fetch_sub(self.bytes, Ordering::SeqCst);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let held = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let charged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let refuse = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let next_file = Arc::new(Mutex::new(PathBuf::new()));
    let on_disk = Arc::new(Mutex::new(Vec::new()));
    let (h, c, r, f, o) = (
        held.clone(),
        charged.clone(),
        refuse.clone(),
        next_file.clone(),
        on_disk.clone(),
    );
    assert!(cache.charge_writes(
        Box::new(move |bytes| {
            if r.load(Ordering::SeqCst) {
                return None;
            }
            h.fetch_add(bytes, Ordering::SeqCst);
            c.fetch_add(bytes, Ordering::SeqCst);
            Some(Box::new(Charge {
                held: h.clone(),
                bytes,
                file: f.lock().unwrap().clone(),
                on_disk: o.clone(),
            }))
        }),
        u64::MAX
    ));
    assert!(
        !cache.charge_writes(Box::new(|_| None), u64::MAX),
        "set once: the first charge stays"
    );

    let fetches = AtomicUsize::new(0);
    for (i, k) in [key("a", 0), key("a", 1)].iter().enumerate() {
        *next_file.lock().unwrap() = cache.block_path(&k.file_id());
        let d = data(i as u8, 1000 + i);
        assert_eq!(get(&cache, k, &d, &fetches).await, d);
        cache.settle().await;
        assert!(cache.contains(k));
    }
    assert_eq!(charged.load(Ordering::SeqCst), 2001, "each block's bytes");
    assert_eq!(held.load(Ordering::SeqCst), 0, "given back once written");
    assert_eq!(
        *on_disk.lock().unwrap(),
        [true, true],
        "each charge is held until its block is on disk"
    );

    refuse.store(true, Ordering::SeqCst);
    let (k, d) = (key("b", 0), data(7, 500));
    assert_eq!(get(&cache, &k, &d, &fetches).await, d, "the reader has it");
    cache.offer(key("b", 1), data(8, 500));
    cache.settle().await;
    assert!(!cache.contains(&k) && !cache.contains(&key("b", 1)));
    let s = cache.stats();
    assert_eq!((s.stored, s.skipped), (2, 2));
    assert_eq!(charged.load(Ordering::SeqCst), 2001);
    // Not stored, so a second read fetches again.
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    assert_eq!(fetches.load(Ordering::SeqCst), 4);

    // A fetcher that holds the charge for the bytes already (a prefetch window's share) hands
    // it to the write: the block is stored without a second charge, and the caller's charge
    // is given back only once the block is on disk.
    let k = key("c", 0);
    let file = cache.block_path(&k.file_id());
    let own = Charge {
        held: held.clone(),
        bytes: 0,
        file: file.clone(),
        on_disk: on_disk.clone(),
    };
    let part = Part {
        len: 600,
        within: 0..600,
    };
    let got = cache
        .get_part_or_fetch_as(
            &k,
            part,
            Reader::Proven { owner: 0 },
            Some(Box::new(move || Some(Box::new(own) as WriteCharge))),
            |_| async { Ok::<_, std::convert::Infallible>(data(9, 600)) },
        )
        .await
        .unwrap();
    assert_eq!(got, data(9, 600));
    cache.settle().await;
    assert!(cache.contains(&k), "stored though the hook refuses");
    assert_eq!(charged.load(Ordering::SeqCst), 2001, "no second charge");
    assert_eq!(*on_disk.lock().unwrap(), [true, true, true]);
}

/// A part of a block fetched with nothing held for its bytes: the block's charge is taken before
/// the fetch and held through it; refused, only the part is fetched, and not stored.
#[tokio::test]
async fn a_part_fetches_its_whole_block_only_if_the_budget_can_carry_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    let held = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let room = Arc::new(std::sync::atomic::AtomicBool::new(false));
    struct Charge(Arc<std::sync::atomic::AtomicU64>, u64);
    impl Drop for Charge {
        fn drop(&mut self) {
            self.0.fetch_sub(self.1, Ordering::SeqCst);
        }
    }
    let (h, r) = (held.clone(), room.clone());
    assert!(cache.charge_writes(
        Box::new(move |bytes| {
            r.load(Ordering::SeqCst).then(|| {
                h.fetch_add(bytes, Ordering::SeqCst);
                Box::new(Charge(h.clone(), bytes)) as WriteCharge
            })
        }),
        u64::MAX
    ));
    let whole = data(5, 3000);
    let read = |k: BlockKey, asked: Arc<Mutex<Vec<std::ops::Range<u64>>>>| {
        let (cache, whole, held) = (cache.clone(), whole.clone(), held.clone());
        async move {
            let part = Part {
                len: 3000,
                within: 1000..1200,
            };
            cache
                .get_part_or_fetch_as(&k, part, Reader::Proven { owner: 0 }, None, |range| {
                    let whole_block = if range == (0..3000) { 3000 } else { 0 };
                    assert_eq!(
                        held.load(Ordering::SeqCst),
                        whole_block,
                        "charged when fetched"
                    );
                    asked.lock().unwrap().push(range.clone());
                    let bytes = whole.slice(range.start as usize..range.end as usize);
                    async move { Ok::<_, std::convert::Infallible>(bytes) }
                })
                .await
                .unwrap()
        }
    };

    // No room: only the part's bytes are fetched, and the block is not stored.
    let asked = Arc::new(Mutex::new(Vec::new()));
    let k = key("r", 0);
    assert_eq!(
        read(k.clone(), asked.clone()).await,
        whole.slice(1000..1200)
    );
    cache.settle().await;
    assert_eq!(*asked.lock().unwrap(), vec![1000..1200]);
    assert!(!cache.contains(&k));
    assert_eq!(cache.stats().skipped, 1);

    // Room: the whole block, charged from the fetch until it is written.
    room.store(true, Ordering::SeqCst);
    assert_eq!(
        read(k.clone(), asked.clone()).await,
        whole.slice(1000..1200)
    );
    cache.settle().await;
    assert_eq!(*asked.lock().unwrap(), [1000..1200, 0..3000]);
    assert!(cache.contains(&k));
    assert_eq!(held.load(Ordering::SeqCst), 0, "given back once written");
    // Stored: read from disk, nothing fetched or charged.
    assert_eq!(
        read(k.clone(), asked.clone()).await,
        whole.slice(1000..1200)
    );
    assert_eq!(asked.lock().unwrap().len(), 2);
}

/// The writers' queue is kept to what the charge's owner allows: at least one block, at most
/// the cache's own cap.
#[tokio::test]
async fn the_write_queue_is_kept_to_the_share_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    assert_eq!(
        cache.write_backlog(),
        (0, WRITE_QUEUE_MAX),
        "the cache's own cap"
    );
    assert!(cache.charge_writes(Box::new(|_| None), 0));
    assert_eq!(cache.write_backlog(), (0, BS), "one block at least");
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    assert!(cache.charge_writes(Box::new(|_| None), 3 * BS));
    assert_eq!(cache.write_backlog(), (0, 3 * BS));
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 10 * BS).await;
    assert!(cache.charge_writes(Box::new(|_| None), u64::MAX));
    assert_eq!(
        cache.write_backlog(),
        (0, WRITE_QUEUE_MAX),
        "never above the cap"
    );
}

/// A current-thread runtime with one blocking thread: blocking hops (disk reads while the index
/// is rebuilt) run one at a time, in the order they were spawned.
fn one_blocking_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(1)
        .build()
        .unwrap()
}

/// A cache in `dir` whose reads go to the disk (a blocking hop), as while its index is rebuilt
/// at start.
async fn reading_from_disk(dir: &Path) -> Arc<BlockCache> {
    let cache = open(dir, 1 << 30).await;
    cache.dirs_made().await;
    cache.ready.send_replace(false);
    cache
}

/// The one blocking thread is held by `g1` (let go through `tx1`), and a reader's first disk
/// read is queued behind it: lets that read run (it misses), then stores block `k` before the
/// reader's next disk read, which waits behind the returned hold (`g2`, let go through `tx2`).
async fn store_after_first_disk_read(
    cache: &Arc<BlockCache>,
    k: &BlockKey,
    d: &Bytes,
    tx1: std::sync::mpsc::Sender<()>,
    g1: tokio::task::JoinHandle<()>,
) -> (std::sync::mpsc::Sender<()>, tokio::task::JoinHandle<()>) {
    // Queued behind the reader's first disk read: started once that read is done.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel::<()>();
    let (tx2, rx2) = std::sync::mpsc::channel::<()>();
    let g2 = tokio::task::spawn_blocking(move || {
        started_tx.send(()).unwrap();
        rx2.recv().unwrap()
    });
    tx1.send(()).unwrap();
    g1.await.unwrap();
    started_rx.await.unwrap();
    cache.ready.send_replace(true);
    cache.store(k, d);
    cache.ready.send_replace(false);
    (tx2, g2)
}

/// A proven reader that misses on disk, then finds the block on disk when its flight's init
/// reads again (the block was stored in between: a writer thread, or a predecessor process at a
/// handover while this one's index is rebuilt), returns the disk's bytes from the init: its
/// flight must still be ended, not left in the map (where it would pin the block's bytes for
/// good and hand them to later readers, proven or not, without a GET).
///
/// The window between the two disk reads is made deterministic with a blocking pool of one
/// thread: the reader's first disk read runs, then the block is written, then its second.
#[test]
fn a_flight_whose_init_is_served_from_disk_is_ended() {
    one_blocking_thread().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let cache = reading_from_disk(dir.path()).await;
        let (k, d) = (key("raced", 0), data(4, 3000));
        // Hold the one blocking thread.
        let (tx1, rx1) = std::sync::mpsc::channel::<()>();
        let g1 = tokio::task::spawn_blocking(move || rx1.recv().unwrap());
        let fetches = Arc::new(AtomicUsize::new(0));
        let p = {
            let (cache, k, fetches) = (cache.clone(), k.clone(), fetches.clone());
            tokio::spawn(async move {
                cache
                    .get_or_fetch_as(&k, Reader::Proven { owner: 1 }, || async move {
                        fetches.fetch_add(1, Ordering::SeqCst);
                        Ok::<_, &str>(data(4, 3000))
                    })
                    .await
                    .unwrap()
            })
        };
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        // The first read missed; the block is now written (the reader's init reads it next).
        let (tx2, g2) = store_after_first_disk_read(&cache, &k, &d, tx1, g1).await;
        assert!(cache.contains(&k));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        tx2.send(()).unwrap();
        g2.await.unwrap();
        assert_eq!(p.await.unwrap(), d);
        assert_eq!(fetches.load(Ordering::SeqCst), 0, "served from disk");
        cache.settle().await;
        cache.ready.send_replace(true);
        // Later (the proof expired, the identity's read permission revoked): a reader of the
        // same identity that has not proven access must fetch with its credentials (denied).
        let late = cache
            .get_or_fetch_as(&k, Reader::Unproven { owner: 1 }, || async {
                Err::<Bytes, &str>("403 AccessDenied")
            })
            .await;
        assert_eq!(
            late.map(|b| b.len()),
            Err("403 AccessDenied"),
            "an unproven reader was handed the block without a GET"
        );
        assert!(
            cache.flights.lock().unwrap().is_empty(),
            "a flight was left in the map: {:?}",
            cache.flights.lock().unwrap().keys().collect::<Vec<_>>()
        );
    });
}

/// A part read with nothing held for its bytes that waited on another reader's flight and
/// fetches after that fetch failed starts the block's GET itself: under a spent budget it must
/// fetch only its part (Read granularity), as it would had it found no flight.
#[tokio::test]
async fn a_part_read_taking_over_a_failed_flight_keeps_to_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    assert!(cache.charge_writes(Box::new(|_| None), u64::MAX));
    let (k, d) = (key("budget", 0), data(2, 4096));
    let fail = Arc::new(Notify::new());
    // A whole-block reader (a warm-up) starts the flight, then fails.
    let a = {
        let (cache, k, fail) = (cache.clone(), k.clone(), fail.clone());
        tokio::spawn(async move {
            cache
                .get_or_fetch(&k, || async move {
                    fail.notified().await;
                    Err::<Bytes, &str>("503 SlowDown")
                })
                .await
        })
    };
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let asked = Arc::new(Mutex::new(Vec::new()));
    let b = {
        let (cache, k, d, asked) = (cache.clone(), k.clone(), d.clone(), asked.clone());
        tokio::spawn(async move {
            let part = Part {
                len: d.len() as u64,
                within: 100..200,
            };
            cache
                .get_part_or_fetch_as(&k, part, Reader::Proven { owner: 1 }, None, |range| {
                    asked.lock().unwrap().push(range.clone());
                    async move { Ok::<_, &str>(d.slice(range.start as usize..range.end as usize)) }
                })
                .await
        })
    };
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    fail.notify_one();
    assert_eq!(a.await.unwrap(), Err("503 SlowDown"));
    assert_eq!(b.await.unwrap().unwrap(), d.slice(100..200));
    assert_eq!(
        *asked.lock().unwrap(),
        vec![100..200],
        "only the part's bytes: the budget has no room for the block"
    );
}

/// Reader `b` waits on a flight whose first fetch never ends by itself; `end_first` ends it
/// without bytes (a failed GET, a reader gone), so `b` fetches next; reader `c` arrives while
/// `b`'s GET runs. Returns how many GETs had started when `c` had arrived: 1 when `c` joined
/// `b`'s, as "One GET per block" says.
async fn gets_after_the_first_fetch_ends<End, EndFut>(first: Fetching, end_first: End) -> usize
where
    End: FnOnce(Fetching) -> EndFut,
    EndFut: std::future::Future<Output = ()>,
{
    let (cache, k) = (first.cache.clone(), first.key.clone());
    let d = data(6, 3000);
    let fetches = Arc::new(AtomicUsize::new(0));
    let go = Arc::new(Notify::new());
    let fetch = || {
        let (cache, k, d, fetches, go) = (
            cache.clone(),
            k.clone(),
            d.clone(),
            fetches.clone(),
            go.clone(),
        );
        tokio::spawn(async move {
            cache
                .get_or_fetch(&k, || async move {
                    fetches.fetch_add(1, Ordering::SeqCst);
                    go.notified().await;
                    Ok::<_, &str>(d)
                })
                .await
        })
    };
    let b = fetch();
    settle_tasks().await;
    end_first(first).await;
    settle_tasks().await;
    assert_eq!(fetches.load(Ordering::SeqCst), 1, "b fetches next");
    let c = fetch();
    settle_tasks().await;
    let running = fetches.load(Ordering::SeqCst);
    go.notify_waiters();
    assert_eq!(b.await.unwrap().unwrap(), d);
    go.notify_waiters();
    assert_eq!(c.await.unwrap().unwrap(), d);
    running
}

/// A reader's fetch of block `key` in flight, started by [`fetching`].
struct Fetching {
    cache: Arc<BlockCache>,
    key: BlockKey,
    task: tokio::task::JoinHandle<Result<Bytes, &'static str>>,
}

/// Starts a reader fetching block `key` with `fetch`, and lets it run until it waits.
async fn fetching<F>(cache: &Arc<BlockCache>, key: &BlockKey, fetch: F) -> Fetching
where
    F: std::future::Future<Output = Result<Bytes, &'static str>> + Send + 'static,
{
    let task = {
        let (cache, key) = (cache.clone(), key.clone());
        tokio::spawn(async move { cache.get_or_fetch(&key, || fetch).await })
    };
    settle_tasks().await;
    Fetching {
        cache: cache.clone(),
        key: key.clone(),
        task,
    }
}

/// Lets every spawned task of this (current-thread) runtime run until it waits.
async fn settle_tasks() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

/// When a flight's fetch fails, the waiter that fetches next runs the one GET of the block: a
/// reader arriving while that GET is in flight joins it rather than starting a second one.
#[tokio::test]
async fn a_reader_arriving_after_a_failed_fetch_joins_the_next_waiters_get() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let fail = Arc::new(Notify::new());
    let failing = {
        let fail = fail.clone();
        async move {
            fail.notified().await;
            Err("503 SlowDown")
        }
    };
    let first = fetching(&cache, &key("retry", 0), failing).await;
    let gets = gets_after_the_first_fetch_ends(first, |first| async move {
        fail.notify_one();
        assert_eq!(first.task.await.unwrap(), Err("503 SlowDown"));
    })
    .await;
    assert_eq!(gets, 1, "c started a second GET of the block beside b's");
}

/// The same when the flight's fetch is cancelled (its reader went away: a prefetch aborted by a
/// random read).
#[tokio::test]
async fn a_reader_arriving_after_a_cancelled_fetch_joins_the_next_waiters_get() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let first = fetching(&cache, &key("cancel", 0), std::future::pending()).await;
    let gets = gets_after_the_first_fetch_ends(first, |first| async move {
        first.task.abort();
        assert!(first.task.await.unwrap_err().is_cancelled());
    })
    .await;
    assert_eq!(gets, 1, "c started a second GET of the block beside b's");
}

/// An object too big to be joined within the budget even with every other entry gone (its
/// blocks stay on disk while its whole file is written) is not joined: nothing else may be
/// evicted for a join that cannot happen.
#[tokio::test]
async fn a_join_that_cannot_fit_evicts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    // Room for ten blocks: six blocks and their six-block whole file never fit.
    let cache = open(dir.path(), 10 * (BS + 4096)).await;
    let others: Vec<BlockKey> = (0..3).map(|i| key("other", i)).collect();
    for (i, k) in others.iter().enumerate() {
        get(&cache, k, &data(i as u8, BS as usize), &fetches).await;
    }
    cache.settle().await;
    let (obj, content) = object("too-big", 6 * BS, 7);
    read_all(&cache, &obj, &content, &fetches).await;
    cache.settle().await;
    let before = cache.stats();
    assert_eq!((before.blocks, before.evictions), (9, 0), "{before:?}");
    cache.want_whole(obj.clone(), 6 * BS);
    cache.settle().await;
    let after = cache.stats();
    assert!(!cache.has_whole(&obj), "{after:?}");
    let kept: Vec<bool> = others.iter().map(|k| cache.contains(k)).collect();
    assert_eq!(
        (kept, after.evictions),
        (vec![true; 3], 0),
        "blocks evicted for a join that could not fit: {after:?}"
    );
}

/// A join that fits once one other (older or newer) entry is evicted is made, also when a block
/// of the object itself is the least recently used entry: the object's own blocks are passed
/// over, not taken for a reason to give up (and not made the most recent entries either).
#[tokio::test]
async fn a_join_that_fits_is_made_when_its_own_block_is_least_recent() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let cache = open(dir.path(), 10 * (BS + 4096)).await;
    // The object's two blocks first (least recent), then seven others: nine of ten blocks' room.
    let (obj, content) = object("old", 2 * BS, 7);
    read_all(&cache, &obj, &content, &fetches).await;
    cache.settle().await;
    for i in 0..7 {
        get(
            &cache,
            &key("newer", i),
            &data(i as u8, BS as usize),
            &fetches,
        )
        .await;
    }
    cache.settle().await;
    assert_eq!(cache.stats().blocks, 9);
    // Evicting one newer block makes room for the two-block whole file beside its blocks.
    cache.want_whole(obj.clone(), 2 * BS);
    cache.settle().await;
    assert!(
        cache.has_whole(&obj),
        "a join with room for it was refused: {:?}",
        cache.stats()
    );
}

/// A reader that has not proven access joins a flight of its own identity (the bytes of a GET
/// made with its own credentials would be its proof). The flight's proven reader then finds the
/// block on disk when its init reads again (stored in between) and makes no GET: the waiting
/// unproven reader must not be handed those disk bytes (no GET with its credentials was made,
/// "Who may read"); it fetches with its own credentials.
///
/// Ordered as in `a_flight_whose_init_is_served_from_disk_is_ended`: a blocking pool of one
/// thread, the proven reader's second disk read held until the unproven reader waits.
#[test]
fn an_unproven_waiter_is_not_handed_bytes_its_flight_read_from_disk() {
    one_blocking_thread().block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let cache = reading_from_disk(dir.path()).await;
        let (k, d) = (key("unproven-join", 0), data(5, 3000));
        let (tx1, rx1) = std::sync::mpsc::channel::<()>();
        let g1 = tokio::task::spawn_blocking(move || rx1.recv().unwrap());
        let p = {
            let (cache, k) = (cache.clone(), k.clone());
            tokio::spawn(async move {
                cache
                    .get_or_fetch_as(&k, Reader::Proven { owner: 1 }, || async move {
                        Ok::<_, &str>(data(5, 3000))
                    })
                    .await
                    .unwrap()
            })
        };
        settle_tasks().await;
        // The proven reader's first read missed; the block is written now.
        let (tx2, g2) = store_after_first_disk_read(&cache, &k, &d, tx1, g1).await;
        settle_tasks().await;
        assert!(
            cache.flights.lock().unwrap().contains_key(&k),
            "the proven reader's flight is up, its init's disk read queued"
        );
        // Same identity, not proven (its mount's proof lifetime is over): joins the flight.
        let u = {
            let (cache, k) = (cache.clone(), k.clone());
            tokio::spawn(async move {
                cache
                    .get_or_fetch_as(&k, Reader::Unproven { owner: 1 }, || async {
                        Err::<Bytes, &str>("403 AccessDenied")
                    })
                    .await
            })
        };
        settle_tasks().await;
        tx2.send(()).unwrap();
        g2.await.unwrap();
        assert_eq!(p.await.unwrap(), d, "the proven reader is served from disk");
        cache.ready.send_replace(true);
        assert_eq!(
            u.await.unwrap().map(|b| b.len()),
            Err("403 AccessDenied"),
            "an unproven reader was handed the block from disk without a GET"
        );
    });
}

/// A block file that goes away under the index (deleted by something other than the cache: an
/// operator freeing space, a cleaner of old files such as systemd-tmpfiles for a cache under
/// `/var/tmp`; or a read during the index rebuild deleting a bad file the scan had listed
/// already) must not stay indexed: read, it is a miss, and the fetched block is stored again, so
/// the next read is a hit, not a GET for as long as the index keeps the ghost.
#[tokio::test]
async fn a_block_file_gone_under_the_index_is_stored_again() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let fetches = AtomicUsize::new(0);
    let (x, dx) = (key("ghost", 0), data(1, 40_000));
    assert_eq!(get(&cache, &x, &dx, &fetches).await, dx);
    cache.settle().await;
    assert!(cache.contains(&x));
    std::fs::remove_file(cache.block_path(&x.file_id())).unwrap();
    let before = fetches.load(Ordering::SeqCst);
    assert_eq!(get(&cache, &x, &dx, &fetches).await, dx);
    cache.settle().await;
    assert_eq!(get(&cache, &x, &dx, &fetches).await, dx);
    assert_eq!(
        fetches.load(Ordering::SeqCst) - before,
        1,
        "the block was never stored again: every read is a GET"
    );
    assert!(cache.block_path(&x.file_id()).exists());
}

/// The same for a whole-object file (and its sidecar) that goes away under the index: its
/// blocks are stored again once fetched (an indexed whole file turns every block of its object
/// away: "joined into a whole file meanwhile").
#[tokio::test]
async fn a_whole_object_gone_under_the_index_is_stored_again() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let fetches = AtomicUsize::new(0);
    let size = BS + 100;
    let (obj, content) = object("ghost-whole", size, 4);
    make_whole(&cache, &obj, &content, &fetches).await;
    let id = obj.file_id();
    std::fs::remove_file(cache.object_path(&id)).unwrap();
    std::fs::remove_file(cache.meta_path(&id)).unwrap();
    let before = fetches.load(Ordering::SeqCst);
    read_all(&cache, &obj, &content, &fetches).await;
    cache.settle().await;
    read_all(&cache, &obj, &content, &fetches).await;
    assert_eq!(
        fetches.load(Ordering::SeqCst) - before,
        2,
        "the object's two blocks were never stored again: every read is a GET"
    );
}

/// A whole object whose sidecar goes away under the index (a cleaner of old files: a sidecar is
/// read once per process, so it looks unused) is dropped from the index by the read that finds
/// it missing; its data file must go with it, or it stays on disk counted by nothing (the budget
/// is exceeded by the object's size until the next restart deletes it as stray).
#[tokio::test]
async fn a_whole_object_whose_sidecar_is_gone_leaves_no_uncounted_data_file() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let fetches = AtomicUsize::new(0);
    let size = 2 * BS + 100;
    let (obj, content) = object("no-sidecar", size, 5);
    make_whole(&cache, &obj, &content, &fetches).await;
    let id = obj.file_id();
    std::fs::remove_file(cache.meta_path(&id)).unwrap();
    read_all(&cache, &obj, &content, &fetches).await;
    cache.settle().await;
    assert!(!cache.has_whole(&obj), "forgotten by the read");
    let mut on_disk = 0;
    for dir in [&cache.blocks_dir, &cache.objects_dir] {
        for sub in std::fs::read_dir(dir).unwrap() {
            for f in std::fs::read_dir(sub.unwrap().path()).unwrap() {
                on_disk += f.unwrap().metadata().unwrap().len();
            }
        }
    }
    assert_eq!(
        cache.stats().bytes,
        on_disk,
        "bytes on disk the index does not count (the data file left behind: {})",
        cache.object_path(&id).exists()
    );
}

/// A whole object's data file gone under the index is forgotten by the hand-out that finds it
/// missing too (as by a read), with its sidecar: not left indexed, so every open of the object
/// would keep asking for a file that is not there.
#[tokio::test]
async fn a_whole_file_gone_under_the_index_is_forgotten_by_the_hand_out_that_finds_it_missing() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let fetches = AtomicUsize::new(0);
    let size = 2 * BS + 100;
    let (obj, content) = object("no-data", size, 6);
    make_whole(&cache, &obj, &content, &fetches).await;
    let id = obj.file_id();
    std::fs::remove_file(cache.object_path(&id)).unwrap();
    assert!(cache.open_whole(&obj, size).is_none());
    assert!(!cache.has_whole(&obj), "still indexed");
    assert!(!cache.meta_path(&id).exists(), "its sidecar left behind");
    assert_eq!(cache.stats().bytes, 0);
}

/// The cache at `dir` as on a filesystem that has no room left above its floor (`min_free`),
/// its index rebuilt.
async fn open_with_no_room_on_disk(dir: &Path) -> Arc<BlockCache> {
    let cache = BlockCache::open(CacheConfig {
        block_size: BS,
        min_free: u64::MAX / 4,
        ..CacheConfig::new(dir, 1 << 30)
    })
    .unwrap();
    cache.ready().await;
    cache
}

/// A join short of free disk space (`min_free`) makes room as it does under the budget: never by
/// evicting the object's own blocks, which it is about to copy (evicted, the copy fails, the
/// join is lost and the blocks must be fetched again).
#[tokio::test]
async fn a_join_short_of_disk_space_never_evicts_the_objects_own_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let size = 3 * BS;
    let (obj, content) = object("tight", size, 7);
    {
        let cache = open(dir.path(), 1 << 30).await;
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
        assert_eq!(cache.stats().blocks, 3);
    }
    let cache = open_with_no_room_on_disk(dir.path()).await;
    assert_eq!(cache.stats().blocks, 3);
    cache.want_whole(obj.clone(), size);
    cache.settle().await;
    assert!(!cache.has_whole(&obj));
    assert!(
        (0..3).all(|i| cache.contains(&obj.block(i))),
        "the object's own blocks were evicted for its join: {:?}",
        cache.stats()
    );
}

/// What the cache remembers of a whole object (its sidecar, its check) is never kept for an
/// object no longer in the index: a sidecar read or a check that ran while the object was
/// evicted (out of the index first, then out of these maps) would otherwise put it back, for
/// the life of the process.
#[tokio::test]
async fn nothing_is_remembered_of_a_whole_object_taken_out_of_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let size = 2 * BS + 99;
    let (obj, content) = object("evicted-while-read", size, 5);
    let cache = open(dir.path(), 20 * BS).await;
    make_whole(&cache, &obj, &content, &fetches).await;
    let id = obj.file_id();
    cache.forget(&Entry::Object(id));
    assert!(cache.metas.lock().unwrap().is_empty());
    assert!(cache.verified.lock().unwrap().is_empty());
    // The sidecar and the file are still there (the eviction has not deleted them yet): a read
    // of the sidecar and a check racing it.
    assert!(cache.meta(&obj, &id).is_some());
    assert!(cache.checked_whole(&obj, size).is_none());
    assert!(
        cache.metas.lock().unwrap().is_empty(),
        "a sidecar was remembered for an object out of the index"
    );
    assert!(
        cache.verified.lock().unwrap().is_empty(),
        "a check was remembered for an object out of the index"
    );
}

/// A join that could not fit on the disk even after evicting every other entry evicts nothing:
/// what it would evict is lost for no join.
#[tokio::test]
async fn a_join_that_cannot_fit_on_the_disk_evicts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fetches = AtomicUsize::new(0);
    let size = 3 * BS;
    let (obj, content) = object("too-big", size, 7);
    let (other, other_content) = object("bystander", 2 * BS, 8);
    {
        let cache = open(dir.path(), 1 << 30).await;
        read_all(&cache, &other, &other_content, &fetches).await;
        read_all(&cache, &obj, &content, &fetches).await;
        cache.settle().await;
        assert_eq!(cache.stats().blocks, 5);
    }
    let cache = open_with_no_room_on_disk(dir.path()).await;
    cache.want_whole(obj.clone(), size);
    cache.settle().await;
    assert!(!cache.has_whole(&obj));
    assert!(
        (0..2).all(|i| cache.contains(&other.block(i))),
        "a join that could not fit evicted another object's blocks: {:?}",
        cache.stats()
    );
    assert_eq!(cache.stats().blocks, 5);
}

/// A prefetched part that starts in the middle of its block (`Prefetch::fill` after a seek: the
/// part runs from the reader to the block's end) holds the budget for its own bytes only. Its
/// miss fetches the whole block, and the part keeps a copy of its bytes, so the block's buffer
/// waiting for the writers is not the part's: it must be charged for its own length ("a block
/// waiting for them is charged ... until it is on disk"), not ride on the part's smaller charge.
#[tokio::test]
async fn a_block_fetched_for_a_part_of_it_is_charged_for_the_whole_block() {
    struct Charge(Arc<Mutex<Vec<(&'static str, u64)>>>, &'static str, u64);
    impl Drop for Charge {
        fn drop(&mut self) {
            self.0.lock().unwrap().push((self.1, self.2));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    // Every charge a stored block held, given back once the block was written.
    let released = Arc::new(Mutex::new(Vec::new()));
    let r = released.clone();
    assert!(cache.charge_writes(
        Box::new(move |bytes| Some(
            Box::new(Charge(r.clone(), "cache_write", bytes)) as WriteCharge
        )),
        u64::MAX
    ));
    let (k, d) = (key("mid-block", 0), data(3, 3000));
    // The part: bytes 1000..3000 of the block, the budget held for those 2,000 bytes.
    let part = Part {
        len: d.len() as u64,
        within: 1000..3000,
    };
    let own = Charge(released.clone(), "prefetch part", 2000);
    let got = cache
        .get_part_or_fetch_as(
            &k,
            part,
            Reader::Proven { owner: 0 },
            Some(Box::new(move || Some(Box::new(own) as WriteCharge))),
            |range| {
                let d = d.clone();
                async move {
                    Ok::<_, std::convert::Infallible>(
                        d.slice(range.start as usize..range.end as usize),
                    )
                }
            },
        )
        .await
        .unwrap();
    assert_eq!(got, data(3, 3000).slice(1000..3000));
    cache.settle().await;
    assert!(cache.contains(&k));
    let charges = released.lock().unwrap().clone();
    assert!(
        charges.contains(&("cache_write", 3000)),
        "the 3,000-byte block waited for the writers on the part's charge only: {charges:?}"
    );
}

/// One process per cache directory: a second open while the first cache lives is refused with an
/// error that names the directory and the holder (two caches would each keep `max_size` of
/// their own in it and delete each other's files). `flock` locks belong to the open file, so a
/// second open in the same process stands for another process here.
#[tokio::test]
async fn a_cache_directory_in_use_is_refused_naming_it_and_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let cfg = CacheConfig {
        block_size: BS,
        ..CacheConfig::new(dir.path(), 1 << 30)
    };
    let err = BlockCache::open_waiting(cfg, std::time::Duration::from_millis(50)).unwrap_err();
    match &err {
        CacheError::InUse { path, holder } => {
            assert_eq!(path, dir.path());
            assert_eq!(*holder, Some(std::process::id()));
        }
        other => panic!("not refused as in use: {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains(&dir.path().display().to_string())
            && msg.contains("in use by another process")
            && msg.contains(&format!("pid {}", std::process::id())),
        "{msg}"
    );
    // The first cache is untouched by the refused open.
    let (k, d) = (key("still-mine", 0), data(3, 5000));
    let fetches = AtomicUsize::new(0);
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    cache.settle().await;
    assert!(cache.contains(&k));
}

/// A cache path that is a file is refused naming the path and what is wrong with it, once (not
/// "File exists", and no source chain repeating the message), and the file is left alone.
#[test]
fn a_cache_path_that_is_a_file_is_refused_as_not_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"mine").unwrap();
    let Err(err) = BlockCache::open(CacheConfig {
        block_size: BS,
        ..CacheConfig::new(&file, 1 << 30)
    }) else {
        panic!("a file is no cache directory");
    };
    assert!(
        matches!(&err, CacheError::Dir { path, .. } if path == &file),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        format!("cache directory {}: not a directory", file.display())
    );
    assert!(std::error::Error::source(&err).is_none());
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
}

/// Dropping the last handle of a cache ends its writer and joiner threads (they hold the cache
/// only while they work on a job) and lets go of its directory: the next open of it succeeds
/// and finds what was stored.
#[tokio::test]
async fn a_dropped_cache_ends_its_threads_and_lets_go_of_its_directory() {
    let dir = tempfile::tempdir().unwrap();
    let cache = open(dir.path(), 1 << 30).await;
    let (k, d) = (key("kept", 0), data(4, 5000));
    let fetches = AtomicUsize::new(0);
    assert_eq!(get(&cache, &k, &d, &fetches).await, d);
    cache.settle().await;
    let (weak, work) = (Arc::downgrade(&cache), Arc::downgrade(&cache.work));
    drop(cache);
    // A writer that has just stored the block may hold the cache a moment longer: open waits
    // for its lock.
    let again = open(dir.path(), 1 << 30).await;
    assert!(weak.upgrade().is_none(), "the first cache is still alive");
    assert!(again.contains(&k));
    // The first cache's threads end once told (each holds its queues until then).
    let ended = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + LOCK_WAIT;
        while work.strong_count() > 0 && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        work.strong_count() == 0
    })
    .await
    .unwrap();
    assert!(ended, "the first cache's threads still run");
}
