//! Warm-up: fills the node cache from a volume's prefix (or some sub-prefixes) in the background
//! after a publish, with the publishing mount's own credentials, bounded by the cache's size.
//!
//! A warm-up of the same (endpoint, bucket, prefixes) runs once per node plugin process
//! ([`BlockCache::claim`]): a second pod publishing the volume does not start another. Blocks
//! already cached are skipped without a request; concurrent readers share the warm-up's GETs
//! through the cache's single flight.

use std::sync::Arc;

use ferry_cache::{BlockCache, BlockKey, HeldCharge, ObjectKey, Part, Reader};
use ferry_store::{list_pages, ListRequest, ObjectStore, StoreError, Version};
use futures::stream::{FuturesUnordered, StreamExt, TryStreamExt};

use crate::prefetch::fetch_exact;
use crate::proofs::Proofs;

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
    /// Objects passed over because the mount's credentials were refused them (403: a KMS key
    /// the role may not use, an archived object, a bucket policy on some keys).
    pub denied: u64,
}

/// Objects refused (403) before any block was fetched after which the warm-up ends: the
/// credentials cannot read the prefix, and a GET per object would all be refused.
const DENIED_BEFORE_ANY: u64 = 16;

/// How one block of a warm-up went.
enum Fetched {
    /// Fetched (its length) and handed to the cache.
    Bytes(u64),
    /// Its object changed or went away since the listing.
    Changed,
    /// Its object is refused to the warm-up's credentials.
    Denied(String),
}

/// Lists every object under the prefixes and puts each block into `cache` (at most the cache's
/// `max_size` in total), fetching with `store`. Progress goes to the log and to metrics.
pub async fn warm_up(
    store: Arc<dyn ObjectStore>,
    cache: Arc<BlockCache>,
    w: WarmUp,
) -> Result<WarmUpReport, StoreError> {
    warm_up_as(store, Arc::new(Proofs::default()), cache, w).await
}

/// [`warm_up`] as the identity whose proofs are `proofs` (the publishing mount's store's): its
/// GETs are that identity's, so a reader of it that has not proven access yet joins them.
pub async fn warm_up_as(
    store: Arc<dyn ObjectStore>,
    proofs: Arc<Proofs>,
    cache: Arc<BlockCache>,
    w: WarmUp,
) -> Result<WarmUpReport, StoreError> {
    // Nothing is stored, and nothing found on disk is known, until the cache's index of its
    // blocks is rebuilt (a node plugin just started or taking over).
    cache.ready().await;
    // The flights it starts are this identity's (another identity's readers never take them).
    let owner = proofs.id();
    let bs = cache.block_size();
    let limit = cache.config().max_size;
    let mut report = WarmUpReport::default();
    let mut planned = 0u64;
    let mut next_log = LOG_EVERY;
    let mut inflight = FuturesUnordered::new();
    // Objects refused to these credentials: their other blocks are not asked for.
    let mut denied = std::collections::HashSet::new();
    'prefixes: for prefix in &w.prefixes {
        let pages = list_pages(&*store, &w.bucket, ListRequest::keys_under(prefix));
        futures::pin_mut!(pages);
        while let Some(page) = pages.try_next().await? {
            for obj in page.objects {
                let Some(etag) = obj.etag.clone() else {
                    continue;
                };
                if obj.size == 0 || obj.key.ends_with('/') || denied.contains(&obj.key) {
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
                        let done = inflight.next().await.expect("non-empty")?;
                        record(&mut report, done, &mut denied, &w, &mut next_log)?;
                    }
                    if denied.contains(&key.key) {
                        continue;
                    }
                    let (store, cache, bucket) = (store.clone(), cache.clone(), w.bucket.clone());
                    inflight.push(async move {
                        let len = end - start;
                        // Never faster than the cache's writers (a block over their backlog is
                        // not stored) ...
                        cache.writers_have_room(len).await;
                        // ... nor over the memory budget: the block is charged from before its
                        // GET until it is on disk (a warm-up can wait; a block fetched while the
                        // budget has no room for it would be dropped, not stored).
                        let charge = loop {
                            match cache.charge_block(len) {
                                Some(charge) => break charge,
                                None => {
                                    tokio::time::sleep(std::time::Duration::from_millis(50)).await
                                }
                            }
                        };
                        let held = charge.map(|c| Box::new(move || Some(c)) as HeldCharge);
                        // As the publishing mount's identity: its readers join this GET.
                        let data = cache
                            .get_part_or_fetch_as(
                                &key,
                                Part {
                                    len,
                                    within: 0..len,
                                },
                                Reader::Proven { owner },
                                held,
                                |range| {
                                    fetch_exact(
                                        &*store,
                                        &bucket,
                                        &key.key,
                                        start + range.start..start + range.end,
                                        Version::ETag(&key.etag),
                                    )
                                },
                            )
                            .await;
                        match data {
                            Ok(data) => Ok(Fetched::Bytes(data.len() as u64)),
                            // Overwritten or deleted since the LIST: passed over, not the end of
                            // the warm-up (a reader of the new version fetches it then).
                            Err(StoreError::PreconditionFailed(_) | StoreError::NotFound(_)) => {
                                tracing::debug!(key = %key.key, "warm-up: object changed since its listing; skipped");
                                Ok(Fetched::Changed)
                            }
                            // Refused to these credentials (some keys only, or all of them:
                            // see `record`).
                            Err(StoreError::AccessDenied(e)) => {
                                tracing::debug!(key = %key.key, error = %e, "warm-up: object refused to the mount's credentials; skipped");
                                Ok(Fetched::Denied(key.key.clone()))
                            }
                            Err(e) => Err(e),
                        }
                    });
                }
            }
        }
    }
    while let Some(done) = inflight.next().await {
        record(&mut report, done?, &mut denied, &w, &mut next_log)?;
    }
    if report.denied > 0 {
        tracing::warn!(bucket = %w.bucket, prefixes = ?w.prefixes, objects = report.denied, "warm-up: objects refused to the mount's credentials were passed over");
    }
    Ok(report)
}

/// Counts a block's outcome. `Err` once [`DENIED_BEFORE_ANY`] objects were refused and nothing
/// was fetched: the credentials cannot read the prefix.
fn record(
    report: &mut WarmUpReport,
    done: Fetched,
    denied: &mut std::collections::HashSet<String>,
    w: &WarmUp,
    next_log: &mut u64,
) -> Result<(), StoreError> {
    match done {
        Fetched::Bytes(len) => {
            report.fetched += 1;
            report.bytes += len;
            ferry_cache::warmup_bytes(len);
            if report.bytes >= *next_log {
                *next_log += LOG_EVERY;
                tracing::info!(bucket = %w.bucket, prefixes = ?w.prefixes, bytes = report.bytes, objects = report.objects, "warm-up progress");
            }
        }
        Fetched::Changed => {}
        Fetched::Denied(key) => {
            if denied.insert(key) {
                report.denied += 1;
            }
            if report.fetched == 0 && report.denied >= DENIED_BEFORE_ANY {
                return Err(StoreError::AccessDenied(format!(
                    "the mount's credentials were refused the first {} objects of bucket {:?} \
                     prefixes {:?} (s3:GetObject) and no block was fetched",
                    report.denied, w.bucket, w.prefixes
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_cache::CacheConfig;
    use ferry_store::MemoryStore;

    /// A ready cache of 64 KiB blocks with room for 1 MiB, at `dir`.
    async fn small_cache(dir: &std::path::Path) -> Arc<BlockCache> {
        let cache = BlockCache::open(CacheConfig {
            block_size: 64 << 10,
            ..CacheConfig::new(dir, 1 << 20)
        })
        .unwrap();
        cache.ready().await;
        cache
    }

    /// A store with bucket `b` holding `ds/0` … `ds/3`, 1,000 bytes each.
    fn four_small_objects() -> MemoryStore {
        let store = MemoryStore::new();
        store.create_bucket("b");
        for i in 0..4 {
            store.insert("b", &format!("ds/{i}"), vec![i as u8; 1000]);
        }
        store
    }

    #[tokio::test]
    async fn warms_the_prefix_once_within_the_cache_size() {
        let dir = tempfile::tempdir().unwrap();
        let cache = small_cache(dir.path()).await;
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

    /// A warm-up is there to fill the cache: a block it fetches is stored, not dropped because
    /// the memory budget had no room for it when it arrived (nor fetched uncharged before). Here
    /// the budget refuses the first two charges it is asked for, then has room.
    #[tokio::test]
    async fn a_warm_up_stores_every_block_it_fetches_when_the_budget_was_short_for_a_while() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let dir = tempfile::tempdir().unwrap();
        let cache = small_cache(dir.path()).await;
        let refusals = Arc::new(AtomicU64::new(2));
        let r = refusals.clone();
        assert!(cache.charge_writes(
            Box::new(move |_| {
                match r.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
                    Ok(_) => None,
                    Err(_) => Some(Box::new(()) as ferry_cache::WriteCharge),
                }
            }),
            u64::MAX,
        ));
        let store = MemoryStore::new();
        store.create_bucket("b");
        store.insert("b", "ds/a", vec![1u8; 200 << 10]);
        let w = WarmUp {
            endpoint: String::new(),
            bucket: "b".into(),
            prefixes: vec!["ds/".into()],
        };
        let r = warm_up(Arc::new(store.clone()), cache.clone(), w)
            .await
            .unwrap();
        cache.settle().await;
        let s = cache.stats();
        assert_eq!((r.fetched, s.stored, s.skipped), (4, 4, 0), "{s:?}");
        assert_eq!(
            store.stats().get_bytes,
            200 << 10,
            "each block fetched once"
        );
    }

    /// An object overwritten (412) or deleted (404) between the warm-up's LIST and its GET is
    /// passed over: the warm-up goes on with the rest of the prefix, as a sweep does, instead of
    /// ending there and leaving every later object cold.
    #[tokio::test]
    async fn a_warm_up_goes_on_past_an_object_changed_since_its_listing() {
        use ferry_store::{FaultyStore, Op};
        let dir = tempfile::tempdir().unwrap();
        let cache = small_cache(dir.path()).await;
        let store = four_small_objects();
        let faulty = FaultyStore::new(store.clone(), 1);
        faulty.fail_next(
            Op::Get,
            1,
            StoreError::PreconditionFailed("412: ds/0 was overwritten".into()),
        );
        let w = WarmUp {
            endpoint: String::new(),
            bucket: "b".into(),
            prefixes: vec!["ds/".into()],
        };
        let r = warm_up(Arc::new(faulty), cache.clone(), w).await;
        cache.settle().await;
        let r = r.expect("the warm-up goes on");
        assert_eq!((r.objects, r.fetched), (4, 3));
        assert_eq!(cache.stats().stored, 3, "{:?}", cache.stats());
    }

    /// An object refused to the mount's credentials (a 403 on its GET: a KMS key the role may not
    /// use, an archived object) is passed over, counted, and the rest of the prefix is warmed;
    /// when the first objects are all refused and nothing was fetched, the warm-up ends instead
    /// of asking for every object of a prefix it cannot read.
    #[tokio::test]
    async fn a_warm_up_passes_over_objects_its_credentials_are_refused() {
        use ferry_store::{FaultyStore, Op};
        let dir = tempfile::tempdir().unwrap();
        let cache = small_cache(dir.path()).await;
        let store = four_small_objects();
        for i in 0..40 {
            store.insert("b", &format!("sealed/{i:02}"), vec![i as u8; 1000]);
        }
        let faulty = Arc::new(FaultyStore::new(store.clone(), 1));
        let w = |prefix: &str| WarmUp {
            endpoint: String::new(),
            bucket: "b".into(),
            prefixes: vec![prefix.into()],
        };
        faulty.fail_next(Op::Get, 1, StoreError::AccessDenied("403".into()));
        let r = warm_up(faulty.clone(), cache.clone(), w("ds/"))
            .await
            .expect("the warm-up goes on past a refused object");
        assert_eq!((r.objects, r.fetched, r.denied), (4, 3, 1));
        // Nothing of the prefix may be read: it ends after the first few refusals.
        faulty.fail_next(Op::Get, 1000, StoreError::AccessDenied("403".into()));
        let gets = faulty.stats().calls_of(Op::Get);
        let r = warm_up(faulty.clone(), cache.clone(), w("sealed/")).await;
        let asked = faulty.stats().calls_of(Op::Get) - gets;
        match r {
            Err(StoreError::AccessDenied(m)) => assert!(m.contains("s3:GetObject"), "{m}"),
            other => panic!("a warm-up refused every object ended with {other:?}"),
        }
        assert!(
            asked < DENIED_BEFORE_ANY + IN_FLIGHT as u64,
            "{asked} GETs for a prefix nothing of which may be read"
        );
    }
}
