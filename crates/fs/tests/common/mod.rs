//! Helpers shared by the integration tests that mount Ferry through real FUSE on a real S3 server
//! (versitygw, from `ferry-testkit`): a server with one bucket, mounts of a fresh prefix, a
//! watchdog for calls that must not hang, and errno extraction.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use ferry_fs::{mount, MemoryBudget, MountConfig, MountContext, MountHandle, PrefetchConfig};
use ferry_s3::S3Store;
use ferry_store::{ListRequest, ObjectStore};
use ferry_testkit::S3Server;
use futures::TryStreamExt;

pub const BUCKET: &str = "ferry-test";

/// A running versitygw with [`BUCKET`] created, a store on it and a runtime for the mounts.
pub struct Env {
    pub rt: tokio::runtime::Runtime,
    pub store: Arc<S3Store>,
    /// The prefetch budget every mount of this `Env` shares, as a node plugin's mounts do.
    pub budget: MemoryBudget,
    /// The node-level tuning every mount of this `Env` gets.
    pub prefetch: PrefetchConfig,
    // Dropped last: the mounts and the store must go first.
    pub server: S3Server,
}

impl Env {
    /// Starts versitygw and creates the bucket. Panics if versitygw or `/dev/fuse` is missing:
    /// these tests fail rather than skip silently.
    pub fn start() -> Env {
        let rt = fuse_runtime();
        let server = S3Server::start();
        let store = rt.block_on(async {
            server.create_bucket(BUCKET).await;
            Arc::new(server.store().await)
        });
        Env {
            rt,
            store,
            budget: MemoryBudget::default(),
            prefetch: PrefetchConfig::default(),
            server,
        }
    }

    /// A prefix (ending in `/`) no other mount of this process has used.
    pub fn fresh_prefix(&self, what: &str) -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        format!("{what}-{}/", NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// Mounts `prefix` of the bucket from `store` with `tweak` applied to a writable config
    /// (uid = ours, so `default_permissions` lets us write).
    pub fn mount(
        &self,
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        tweak: impl FnOnce(&mut MountConfig),
    ) -> Mount {
        mount_bucket_with(
            &self.rt,
            &self.budget,
            self.prefetch,
            store,
            BUCKET,
            prefix,
            tweak,
        )
    }

    /// Waits (up to a generous minute) until no prefetch memory is charged to the budget any more:
    /// call it once every mount is gone. Reservations left behind would be a leak.
    pub fn assert_budget_released(&self) {
        assert_budget_released(&self.budget);
    }

    /// Every key under `prefix`, relative to it, sorted.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.rt.block_on(async {
            let req = ListRequest {
                prefix,
                ..ListRequest::default()
            };
            let mut keys = ferry_store::list_pages(&*self.store, BUCKET, req)
                .try_fold(Vec::new(), |mut keys, page| async move {
                    keys.extend(
                        page.objects
                            .into_iter()
                            .map(|o| o.key[prefix.len()..].to_owned()),
                    );
                    Ok(keys)
                })
                .await
                .expect("listing the bucket");
            keys.sort();
            keys
        })
    }

    /// Writes an object directly (behind the mount's back).
    pub fn put(&self, key: &str, body: &[u8]) {
        self.rt
            .block_on(
                self.store
                    .put(BUCKET, key, bytes::Bytes::copy_from_slice(body)),
            )
            .expect("put");
    }

    /// Reads an object directly, `None` if missing.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.rt.block_on(async {
            let info = match self.store.head(BUCKET, key).await {
                Ok(i) => i,
                Err(ferry_store::StoreError::NotFound(_)) => return None,
                Err(e) => panic!("HEAD {key}: {e}"),
            };
            if info.size == 0 {
                return Some(Vec::new());
            }
            Some(
                self.store
                    .get_range(BUCKET, key, 0..info.size, None)
                    .await
                    .expect("get")
                    .to_vec(),
            )
        })
    }
}

/// The runtime mounts serve on, once FUSE is known to be there (these tests fail rather than skip
/// silently without `/dev/fuse`), with tracing installed.
pub fn fuse_runtime() -> tokio::runtime::Runtime {
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: these tests need FUSE (run as root with fuse3 installed)"
    );
    ferry_testkit::init_tracing();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Mounts `prefix` of `bucket` from `store`, serving on `rt` and charging `budget`, with `tweak`
/// applied to a writable config (uid = ours, so `default_permissions` lets us write).
pub fn mount_bucket(
    rt: &tokio::runtime::Runtime,
    budget: &MemoryBudget,
    store: Arc<dyn ObjectStore>,
    bucket: &str,
    prefix: &str,
    tweak: impl FnOnce(&mut MountConfig),
) -> Mount {
    let prefetch = PrefetchConfig::default();
    mount_bucket_with(rt, budget, prefetch, store, bucket, prefix, tweak)
}

/// [`mount_bucket`] with this node-level tuning.
pub fn mount_bucket_with(
    rt: &tokio::runtime::Runtime,
    budget: &MemoryBudget,
    prefetch: PrefetchConfig,
    store: Arc<dyn ObjectStore>,
    bucket: &str,
    prefix: &str,
    tweak: impl FnOnce(&mut MountConfig),
) -> Mount {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = MountConfig::new(bucket);
    cfg.prefix = prefix.to_owned();
    cfg.fs_name = format!("ferry:{bucket}/{prefix}");
    cfg.read_only = false;
    cfg.uid = my_uid();
    cfg.gid = 0;
    tweak(&mut cfg);
    let ctx = MountContext {
        runtime: rt.handle().clone(),
        budget: budget.clone(),
        prefetch,
        cache: None,
        passthrough: true,
        proofs: Default::default(),
        journal: None,
    };
    let handle = mount(store, cfg, dir.path(), ctx).expect("mount");
    Mount {
        root: handle.target().to_owned(),
        handle: Some(handle),
        _dir: dir,
    }
}

/// A live mount; unmounts when dropped.
pub struct Mount {
    pub root: PathBuf,
    pub handle: Option<MountHandle>,
    _dir: tempfile::TempDir,
}

impl Mount {
    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    pub fn unmount(mut self) {
        if let Some(h) = self.handle.take() {
            h.unmount().expect("unmount");
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            if let Err(e) = h.unmount() {
                // Still busy (a test failed with a file open): detach it, or the mount would
                // outlive this process as a dead FUSE connection in the machine's mount table.
                eprintln!("unmounting {}: {e}; detaching it", self.root.display());
                let path = std::ffi::CString::new(self.root.as_os_str().as_encoded_bytes())
                    .expect("no NUL in a temp dir path");
                // SAFETY: a valid NUL-terminated path; umount2 only reads it.
                unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
            }
        }
    }
}

pub fn my_uid() -> u32 {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0)
}

/// The errno of a failed `std::io` call (panics on success or on an error without one).
pub fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    match r {
        Ok(v) => panic!("expected an error, got Ok({v:?})"),
        Err(e) => e
            .raw_os_error()
            .unwrap_or_else(|| panic!("error without an errno: {e}")),
    }
}

/// Runs `f` on its own thread and panics if it does not finish within `limit` (a hung FUSE request
/// would otherwise hang the test forever). The limit is a generous safety net, not a timing
/// assertion.
pub fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(v)) => v,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what}: no answer within {limit:?} (a hung request)"),
    }
}

/// Waits (up to a generous minute) until `budget` has nothing charged: call it once every mount
/// using it is gone. Reservations left behind would be a leak.
pub fn assert_budget_released(budget: &MemoryBudget) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while budget.used() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} bytes still charged to the prefetch budget",
            budget.used()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Number of proptest cases: `$PROPTEST_CASES`, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The sum of every series of metric `name` in the process-wide registry whose labels contain
/// `labels`.
pub fn metric(name: &str, labels: &str) -> f64 {
    ferry_metrics::render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split(['{', ' ']).next() == Some(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls `done` (every millisecond, for at most 10 s) until it holds; panics naming `what` if it
/// never does. For what a mount records just after answering the kernel (operation metrics).
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
