//! The node cache and credentials, on a real S3 server that enforces access (versitygw with its
//! internal IAM and a bucket policy) through real FUSE mounts: a pod whose credentials may list a
//! prefix but not read its objects gets `EACCES`, although the bytes are in the node cache, while
//! the pod allowed to read them is served from the cache. And two pods of different identities
//! reading one object at once each get their own bytes.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ferry_cache::{BlockCache, CacheConfig};
use ferry_fs::{mount, MetadataTtl, MountConfig, MountContext, MountHandle};
use ferry_s3::{S3Options, S3Store};
use ferry_store::{ObjectStore, StoreError};
use ferry_testkit::{Fault, FaultPlan, FaultProxy, S3Server};

const BUCKET: &str = "data";

fn mount_as(
    store: S3Store,
    server: &S3Server,
    cache: &Arc<BlockCache>,
    dir: &Path,
    rt: &tokio::runtime::Runtime,
    passthrough: bool,
) -> MountHandle {
    let mut cfg = MountConfig::new(BUCKET);
    cfg.fs_name = format!("ferry:{BUCKET}/");
    cfg.prefix = "ds/".into();
    cfg.endpoint = server.endpoint_url();
    cfg.metadata_ttl = MetadataTtl::Indefinite;
    let mut ctx = MountContext::new(rt.handle().clone());
    ctx.cache = Some(cache.clone());
    ctx.passthrough = passthrough;
    mount(Arc::new(store), cfg, dir, ctx).expect("mount")
}

/// A runtime for real FUSE mounts; `None` (and a CI failure) without `/dev/fuse`.
fn fuse_runtime() -> Option<tokio::runtime::Runtime> {
    if !ferry_testkit::prerequisite(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse (real FUSE mounts)",
    ) {
        return None;
    }
    Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap(),
    )
}

/// A node cache of 1 MiB blocks in `dir`, ready.
fn node_cache(dir: &Path, rt: &tokio::runtime::Runtime) -> Arc<BlockCache> {
    let cache = BlockCache::open(CacheConfig {
        block_size: 1 << 20,
        ..CacheConfig::new(dir, 64 << 20)
    })
    .unwrap();
    rt.block_on(cache.ready());
    cache
}

/// A shard's bytes (3 MiB and 77 bytes: four blocks, the last short), seeded by `seed`.
fn shard(seed: u32) -> Vec<u8> {
    (0..(3u32 << 20) + 77)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> seed) as u8)
        .collect()
}

#[test]
fn a_pod_denied_the_objects_gets_eacces_while_the_allowed_pod_reads_from_the_cache() {
    let Some(rt) = fuse_runtime() else {
        return;
    };
    let server = S3Server::start_with_iam();
    server.create_user("alice", "alice-secret-key", "user");
    server.create_user("bob", "bob-secret-key", "user");
    let body = shard(11);
    let (alice, bob) = rt.block_on(async {
        server.create_bucket(BUCKET).await;
        let root = server.store().await;
        root.put(BUCKET, "ds/shard-0.bin", body.clone().into()).await.unwrap();
        // alice may list and read the prefix; bob may only list it.
        let policy = serde_json::json!({
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Principal": {"AWS": ["alice"]},
                 "Action": ["s3:ListBucket", "s3:GetObject"],
                 "Resource": [format!("arn:aws:s3:::{BUCKET}"), format!("arn:aws:s3:::{BUCKET}/*")]},
                {"Effect": "Allow", "Principal": {"AWS": ["bob", "alice"]},
                 "Action": ["s3:ListBucket"],
                 "Resource": [format!("arn:aws:s3:::{BUCKET}")]}
            ]
        });
        root.put_bucket_policy(BUCKET, &policy.to_string()).await.unwrap();
        let opts = S3Server::test_options();
        let alice = S3Store::with_options(server.s3_config_as("alice", "alice-secret-key"), opts.clone()).await.unwrap();
        let bob = S3Store::with_options(server.s3_config_as("bob", "bob-secret-key"), opts).await.unwrap();
        // The server really enforces it: bob lists, but his HEAD and GET are refused.
        let page = bob.list(BUCKET, ferry_store::ListRequest { prefix: "ds/", ..Default::default() }).await.unwrap();
        assert_eq!(page.objects.len(), 1);
        assert!(matches!(bob.head(BUCKET, "ds/shard-0.bin").await, Err(StoreError::AccessDenied(_))));
        assert!(matches!(bob.get_range(BUCKET, "ds/shard-0.bin", 0..10, None).await, Err(StoreError::AccessDenied(_))));
        assert_eq!(alice.get_range(BUCKET, "ds/shard-0.bin", 0..10, None).await.unwrap(), &body[..10]);
        (alice, bob)
    });

    let cache_dir = tempfile::tempdir().unwrap();
    let cache = node_cache(cache_dir.path(), &rt);
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let pod_a = mount_as(alice, &server, &cache, dir_a.path(), &rt, true);
    let pod_b = mount_as(bob, &server, &cache, dir_b.path(), &rt, true);

    // alice's pod fills the cache.
    assert_eq!(
        std::fs::read(dir_a.path().join("shard-0.bin")).unwrap(),
        body
    );
    rt.block_on(cache.settle());
    let filled = cache.stats();
    // Read to its end, the object's four blocks were joined into one whole file.
    assert_eq!(
        (filled.blocks, filled.objects, filled.assembled),
        (0, 1, 1),
        "{filled:?}"
    );

    // bob's pod sees the file in the listing (LIST is allowed), with its size ...
    let names: Vec<String> = std::fs::read_dir(dir_b.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["shard-0.bin"]);
    assert_eq!(
        std::fs::metadata(dir_b.path().join("shard-0.bin"))
            .unwrap()
            .len(),
        body.len() as u64
    );
    // ... but cannot read it, although every block is on the node's disk.
    let err = std::fs::read(dir_b.path().join("shard-0.bin")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "{err}");
    assert_eq!(cache.stats().hits, filled.hits, "nothing served to bob");
    assert_eq!(
        cache.stats().whole_opens,
        0,
        "no whole file handed out for bob"
    );

    // Another pod of alice's (a fresh mount: no page cache) is handed the whole file: the
    // kernel reads it directly (FUSE passthrough), so no read reaches Ferry.
    let alice_again = || {
        rt.block_on(S3Store::with_options(
            server.s3_config_as("alice", "alice-secret-key"),
            S3Server::test_options(),
        ))
        .unwrap()
    };
    let dir_c = tempfile::tempdir().unwrap();
    let pod_c = mount_as(alice_again(), &server, &cache, dir_c.path(), &rt, true);
    assert_eq!(
        std::fs::read(dir_c.path().join("shard-0.bin")).unwrap(),
        body
    );
    let after = cache.stats();
    assert_eq!(after.whole_opens, 1, "{after:?}");
    assert_eq!(
        after.hits, filled.hits,
        "the kernel read the file, not Ferry"
    );
    assert_eq!(after.misses, filled.misses, "no new fetch");

    // Without passthrough, the same pod reads the four blocks out of the whole file.
    let dir_d = tempfile::tempdir().unwrap();
    let pod_d = mount_as(alice_again(), &server, &cache, dir_d.path(), &rt, false);
    assert_eq!(
        std::fs::read(dir_d.path().join("shard-0.bin")).unwrap(),
        body
    );
    let last = cache.stats();
    assert_eq!(last.hits - after.hits, 4, "{last:?}");
    assert_eq!((last.whole_opens, last.misses), (1, filled.misses));

    for m in [pod_a, pod_b, pod_c, pod_d] {
        m.unmount().unwrap();
    }
}

/// A pod that has not proven access reads a page of a block while another identity's GET of that
/// block is in flight (held open by a fault proxy): it may not take those bytes, so it fetches
/// with its own credentials and gets exactly the page; the other pod gets its bytes once its GET
/// is retried. (The many-pods-per-node case with pod-level identities; a part read there was
/// once answered with the whole block, which the mount turned into `EIO`.)
#[test]
fn a_pod_reading_beside_another_identitys_get_gets_its_own_bytes() {
    let Some(rt) = fuse_runtime() else {
        return;
    };
    let server = S3Server::start();
    let body = shard(13);
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).unwrap();
    let (first, second) = rt.block_on(async {
        server.create_bucket(BUCKET).await;
        let root = server.store().await;
        root.put(BUCKET, "ds/shard-0.bin", body.clone().into())
            .await
            .unwrap();
        // The first pod's store goes through the proxy; a hung GET is abandoned after 5 s and
        // retried.
        let mut cfg = server.s3_config();
        cfg.endpoint_url = Some(proxy.url());
        let opts = S3Options {
            read_timeout: Duration::from_secs(5),
            attempt_timeout: Duration::from_secs(5),
            ..S3Server::test_options()
        };
        let first = S3Store::with_options(cfg, opts).await.unwrap();
        (first, server.store().await)
    });
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = node_cache(cache_dir.path(), &rt);
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Two mounts, each its own identity (no shared proofs), on one node cache.
    let pod_a = mount_as(first, &server, &cache, dir_a.path(), &rt, false);
    let pod_b = mount_as(second, &server, &cache, dir_b.path(), &rt, false);
    // The second pod knows the file from its listing only: no HEAD, so no proof of access.
    let listed = std::fs::read_dir(dir_b.path()).unwrap().count();
    assert_eq!(listed, 1);
    // Both files open (their lookups done: a LIST is a GET too).
    let file_a = std::fs::File::open(dir_a.path().join("shard-0.bin")).unwrap();
    let file_b = std::fs::File::open(dir_b.path().join("shard-0.bin")).unwrap();

    // The first pod's first GET is never answered: its fetch of block 0 stays in flight.
    proxy.set_plan(Some(FaultPlan::always(&["GET"], Fault::Hang)));
    let reader_a = std::thread::spawn(move || {
        let mut all = vec![0u8; (3 << 20) + 77];
        file_a.read_exact_at(&mut all, 0).map(|()| all)
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while proxy.injected().is_empty() || cache.stats().misses == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first pod's GET never came: {} requests through the proxy, {:?} injected, {:?}",
            proxy.requests(),
            proxy.injected(),
            cache.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    proxy.set_plan(None);

    // The second pod reads one page of that block beside it.
    let mut page = vec![0u8; 4096];
    file_b.read_exact_at(&mut page, 3 * 4096).unwrap();
    assert!(page == body[3 * 4096..4 * 4096], "the second pod's page");
    let mut tail = vec![0u8; 77];
    file_b.read_exact_at(&mut tail, 3 << 20).unwrap();
    assert!(tail == body[3 << 20..], "the second pod's last bytes");

    let read_a = reader_a.join().unwrap().unwrap();
    assert!(
        read_a == body,
        "the first pod's bytes, after its GET was retried"
    );
    drop(file_b);
    for m in [pod_a, pod_b] {
        m.unmount().unwrap();
    }
}
