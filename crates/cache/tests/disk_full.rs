//! The cache on a tiny filesystem (an 8 MiB tmpfs, mounted for the test; needs root): it keeps
//! the free-space floor by evicting, steps aside when the disk is full, and never fails a read.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use ferry_cache::{space, BlockCache, BlockKey, CacheConfig};

const MIB: u64 = 1 << 20;

/// An 8 MiB tmpfs, unmounted on drop.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount() -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8m", "ferry-cache-test"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // In CI a missing prerequisite fails the test rather than counting as a pass.
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "missing prerequisite in CI: mounting a tmpfs (needs root)"
            );
            eprintln!("SKIPPED (not in CI): cannot mount a tmpfs (not root?)");
            return None;
        }
        Some(Tmpfs(dir))
    }

    fn path(&self) -> &Path {
        self.0.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

fn key(i: u64) -> BlockKey {
    BlockKey {
        endpoint: String::new(),
        bucket: "b".into(),
        key: "k".into(),
        etag: "\"e\"".into(),
        index: i,
    }
}

fn block(i: u64) -> Bytes {
    Bytes::from(vec![i as u8; MIB as usize])
}

async fn get(cache: &std::sync::Arc<BlockCache>, i: u64, fetches: &AtomicUsize) -> Bytes {
    cache
        .get_or_fetch(&key(i), || async {
            fetches.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::convert::Infallible>(block(i))
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn the_free_space_floor_is_kept_by_evicting() {
    let Some(fs) = Tmpfs::mount() else { return };
    let cache = BlockCache::open(CacheConfig {
        dir: fs.path().join("cache"),
        max_size: 1 << 30, // far more than the disk: the floor is what limits
        min_free: 3 * MIB,
        block_size: MIB,
    })
    .unwrap();
    cache.ready().await;
    let fetches = AtomicUsize::new(0);
    for i in 0..20 {
        assert_eq!(get(&cache, i, &fetches).await, block(i));
        cache.settle().await;
        let free = space::available(fs.path()).unwrap();
        assert!(free >= 3 * MIB, "{free} bytes free, under the 3 MiB floor");
    }
    let s = cache.stats();
    assert!(s.evictions > 0 && s.blocks > 0 && s.blocks < 6, "{s:?}");
    // The newest blocks are the ones kept, and they are served.
    let before = fetches.load(Ordering::SeqCst);
    assert_eq!(get(&cache, 19, &fetches).await, block(19));
    assert_eq!(fetches.load(Ordering::SeqCst), before);
}

#[tokio::test]
async fn a_full_disk_makes_the_cache_step_aside_and_reads_still_succeed() {
    let Some(fs) = Tmpfs::mount() else { return };
    let cache = BlockCache::open(CacheConfig {
        dir: fs.path().join("cache"),
        max_size: 1 << 30,
        min_free: 0,
        block_size: MIB,
    })
    .unwrap();
    cache.ready().await;
    // Something else fills the disk to within half a block.
    let free = space::available(fs.path()).unwrap();
    let ballast = fs.path().join("ballast");
    std::fs::write(&ballast, vec![0u8; (free - MIB / 2) as usize]).unwrap();
    let fetches = AtomicUsize::new(0);
    for i in 0..4 {
        assert_eq!(get(&cache, i, &fetches).await, block(i));
        cache.settle().await;
    }
    let s = cache.stats();
    assert_eq!((s.blocks, s.skipped), (0, 4), "{s:?}");
    assert!(std::fs::read_dir(fs.path().join("cache/tmp"))
        .unwrap()
        .next()
        .is_none());
    // Room again: the cache resumes.
    std::fs::remove_file(&ballast).unwrap();
    assert_eq!(get(&cache, 0, &fetches).await, block(0));
    cache.settle().await;
    assert_eq!(cache.stats().blocks, 1);
    assert_eq!(get(&cache, 0, &fetches).await, block(0));
    assert_eq!(fetches.load(Ordering::SeqCst), 5);
}
