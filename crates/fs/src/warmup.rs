//! Warm-up: fills the node cache from a volume's prefix (or some sub-prefixes) in the background
//! after a publish, with the publishing mount's own credentials, bounded by the cache's size.
//!
//! A warm-up of the same (endpoint, bucket, prefixes) runs once per node plugin process
//! ([`BlockCache::claim`]): a second pod publishing the volume does not start another. Blocks
//! already cached are skipped without a request; concurrent readers share the warm-up's GETs
//! through the cache's single flight.

use std::sync::Arc;

use ferry_cache::{BlockCache, BlockKey, ObjectKey};
use ferry_store::{list_pages, ListRequest, ObjectStore, StoreError, Version};
use futures::stream::{FuturesUnordered, StreamExt, TryStreamExt};

use crate::prefetch::fetch_exact;

/// Blocks fetched at once by one warm-up.
const IN_FLIGHT: usize = 8;
/// Progress is logged every this many bytes.
const LOG_EVERY: u64 = 1 << 30;

/// What to warm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmUp {
    /// The endpoint part of the block keys (the mount's [`crate::MountConfig::endpoint`]).
    pub endpoint: String,
    pub bucket: String,
    /// Full key prefixes to list (no delimiter).
    pub prefixes: Vec<String>,
}

impl WarmUp {
    /// The id under which the node runs this warm-up at most once.
    pub fn id(&self) -> String {
        format!(
            "{}\n{}\n{}",
            self.endpoint,
            self.bucket,
            self.prefixes.join("\n")
        )
    }
}

/// What a warm-up did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WarmUpReport {
    pub objects: u64,
    /// Blocks fetched from S3 (not counting the ones already cached).
    pub fetched: u64,
    /// Blocks that were already cached.
    pub cached: u64,
    /// Bytes fetched.
    pub bytes: u64,
    /// Stopped because the listed data would not fit in the cache.
    pub truncated: bool,
}

/// Lists every object under the prefixes and puts each block into `cache` (at most the cache's
/// `max_size` in total), fetching with `store`. Progress goes to the log and to metrics.
pub async fn warm_up(
    store: Arc<dyn ObjectStore>,
    cache: Arc<BlockCache>,
    w: WarmUp,
) -> Result<WarmUpReport, StoreError> {
    let bs = cache.block_size();
    let limit = cache.config().max_size;
    let mut report = WarmUpReport::default();
    let mut planned = 0u64;
    let mut next_log = LOG_EVERY;
    let mut inflight = FuturesUnordered::new();
    'prefixes: for prefix in &w.prefixes {
        let pages = list_pages(&*store, &w.bucket, ListRequest::keys_under(prefix));
        futures::pin_mut!(pages);
        while let Some(page) = pages.try_next().await? {
            for obj in page.objects {
                let Some(etag) = obj.etag.clone() else {
                    continue;
                };
                if obj.size == 0 || obj.key.ends_with('/') {
                    continue;
                }
                report.objects += 1;
                // Once all its blocks are in, an object larger than a block becomes one whole
                // file (passthrough; a smaller one stays a block, see `Fs::passthrough_file`).
                if obj.size > bs {
                    cache.want_whole(
                        ObjectKey {
                            endpoint: w.endpoint.clone(),
                            bucket: w.bucket.clone(),
                            key: obj.key.clone(),
                            etag: etag.clone(),
                        },
                        obj.size,
                    );
                }
                for index in 0..obj.size.div_ceil(bs) {
                    let start = index * bs;
                    let end = obj.size.min(start + bs);
                    if planned + (end - start) > limit {
                        report.truncated = true;
                        break 'prefixes;
                    }
                    planned += end - start;
                    let key = BlockKey {
                        endpoint: w.endpoint.clone(),
                        bucket: w.bucket.clone(),
                        key: obj.key.clone(),
                        etag: etag.clone(),
                        index,
                    };
                    if cache.contains(&key) {
                        report.cached += 1;
                        continue;
                    }
                    while inflight.len() >= IN_FLIGHT {
                        let len = inflight.next().await.expect("non-empty")?;
                        record(&mut report, len, &w, &mut next_log);
                    }
                    let (store, cache, bucket) = (store.clone(), cache.clone(), w.bucket.clone());
                    inflight.push(async move {
                        let data = cache
                            .get_or_fetch(&key, || {
                                fetch_exact(
                                    &*store,
                                    &bucket,
                                    &key.key,
                                    start..end,
                                    Version::ETag(&key.etag),
                                )
                            })
                            .await?;
                        Ok::<u64, StoreError>(data.len() as u64)
                    });
                }
            }
        }
    }
    while let Some(len) = inflight.next().await {
        record(&mut report, len?, &w, &mut next_log);
    }
    Ok(report)
}

fn record(report: &mut WarmUpReport, len: u64, w: &WarmUp, next_log: &mut u64) {
    report.fetched += 1;
    report.bytes += len;
    ferry_cache::warmup_bytes(len);
    if report.bytes >= *next_log {
        *next_log += LOG_EVERY;
        tracing::info!(bucket = %w.bucket, prefixes = ?w.prefixes, bytes = report.bytes, objects = report.objects, "warm-up progress");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_cache::CacheConfig;
    use ferry_store::MemoryStore;

    #[tokio::test]
    async fn warms_the_prefix_once_within_the_cache_size() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlockCache::open(CacheConfig {
            block_size: 64 << 10,
            ..CacheConfig::new(dir.path(), 1 << 20)
        })
        .unwrap();
        cache.ready().await;
        let store = MemoryStore::new();
        store.create_bucket("b");
        store.insert("b", "ds/a", vec![1u8; 200 << 10]);
        store.insert("b", "ds/sub/c", vec![2u8; 10]);
        store.insert("b", "other/x", vec![3u8; 100]);
        let w = WarmUp {
            endpoint: String::new(),
            bucket: "b".into(),
            prefixes: vec!["ds/".into()],
        };
        let r = warm_up(Arc::new(store.clone()), cache.clone(), w.clone())
            .await
            .unwrap();
        assert_eq!(
            (r.objects, r.fetched, r.bytes, r.truncated),
            (2, 5, (200 << 10) + 10, false)
        );
        cache.settle().await;
        assert_eq!(store.stats().get_bytes, (200 << 10) + 10);
        // Again: everything is cached, no GET.
        let again = warm_up(Arc::new(store.clone()), cache.clone(), w)
            .await
            .unwrap();
        assert_eq!((again.fetched, again.cached), (0, 5));
        assert_eq!(store.stats().get_bytes, (200 << 10) + 10);
        // Bounded by the cache size.
        store.insert("b", "big/y", vec![4u8; 3 << 20]);
        let big = WarmUp {
            endpoint: String::new(),
            bucket: "b".into(),
            prefixes: vec!["big/".into()],
        };
        let r = warm_up(Arc::new(store.clone()), cache.clone(), big)
            .await
            .unwrap();
        assert!(r.truncated);
        assert_eq!(r.bytes, 1 << 20);
    }
}
