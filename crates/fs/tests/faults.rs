//! Faults through the whole stack: a real FUSE mount on an [`S3Store`] that talks to versitygw
//! through a [`FaultProxy`] (throttling, 5xx, bodies cut off or short, requests never answered),
//! and a FUSE mount on a [`FaultyStore`] that cuts bodies short above the store's own checks.
//!
//! What must hold (issue 3, "Faults"): a flaky server gives slower reads, never wrong bytes; `EIO`
//! only after bounded retries; no hung FUSE request. Every call runs under a generous watchdog
//! ([`common::within`]) so a hang fails the test instead of stalling it; nothing asserts a timing.

mod common;

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::{errno, within, Env, BUCKET};
use ferry_fs::{mount, MetadataTtl, MountConfig, MountContext};
use ferry_s3::{S3Options, S3Store};
use ferry_store::{FaultyStore, MemoryStore, ObjectStore, Op, StoreError};
use ferry_testkit::{Fault, FaultPlan, FaultProxy};

/// Generous: the slowest failing call below takes attempts × attempt timeout + backoffs ≈ 10 s.
const WATCHDOG: Duration = Duration::from_secs(120);

fn body(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8 ^ seed as u8)
        .collect()
}

/// Retries as in production but with short backoffs, and short timeouts so a hung request is
/// abandoned (and retried) quickly.
fn flaky_options(max_attempts: u32) -> S3Options {
    S3Options {
        max_attempts,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(100),
        connect_timeout: Duration::from_secs(2),
        read_timeout: Duration::from_secs(2),
        attempt_timeout: Duration::from_secs(2),
        body_timeout: Duration::from_secs(5),
        ca_bundle: None,
        raw_get: true,
        time_source: None,
    }
}

struct Flaky {
    env: Env,
    proxy: FaultProxy,
    store: Arc<S3Store>,
}

/// A mount's store behind a fault proxy, retrying each request up to 4 times.
fn flaky() -> Flaky {
    flaky_with(4)
}

fn flaky_with(max_attempts: u32) -> Flaky {
    let env = Env::start();
    let proxy = FaultProxy::start(([127, 0, 0, 1], env.server.port()).into()).unwrap();
    let mut cfg = env.server.s3_config();
    cfg.endpoint_url = Some(proxy.url());
    let store = Arc::new(
        env.rt
            .block_on(S3Store::with_options(cfg, flaky_options(max_attempts)))
            .unwrap(),
    );
    Flaky { env, proxy, store }
}

fn read_all(p: PathBuf) -> std::io::Result<Vec<u8>> {
    within(WATCHDOG, &format!("reading {}", p.display()), move || {
        fs::read(&p)
    })
}

#[test]
fn transient_faults_slow_reads_down_but_never_corrupt_them() {
    // Every other request fails. One reader's retries alternate with successes, but concurrent
    // readers' requests interleave, so one request can meet several faults in a row: with 4
    // attempts a lookup (HEAD and LIST) failed about one run in a few. 10 attempts make that
    // (1/2)^10 per request; the persistent-fault tests keep 4.
    let f = flaky_with(10);
    let prefix = f.env.fresh_prefix("transient");
    let big = body(5 << 20, 1);
    f.env.put(&format!("{prefix}big"), &big);
    let rand = body(5 << 20, 2);
    f.env.put(&format!("{prefix}rand"), &rand);
    let par: Vec<Vec<u8>> = (0..8)
        .map(|i| body(300_000 + i * 1000, 50 + i as u32))
        .collect();
    for (i, b) in par.iter().enumerate() {
        f.env.put(&format!("{prefix}par/{i}"), b);
    }
    let small: Vec<Vec<u8>> = (0..12).map(|i| body(1000 + i * 777, i as u32)).collect();
    for (i, b) in small.iter().enumerate() {
        f.env.put(&format!("{prefix}small/{i:02}"), b);
    }
    let m = f.env.mount(f.store.clone(), &prefix, |c| {
        c.read_only = true;
        c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO);
    });

    // Every other GET, HEAD and LIST breaks, each fault kind in turn.
    f.proxy.set_plan(Some(FaultPlan {
        methods: vec!["GET".into(), "HEAD".into()],
        faults: vec![
            Fault::SlowDown,
            Fault::CutBody,
            Fault::InternalError,
            Fault::ShortBody,
            Fault::Hang,
        ],
        every: 2,
        ranged_only: false,
    }));

    let root = m.root.clone();
    let names = within(WATCHDOG, "listing", move || {
        let mut n: Vec<String> = fs::read_dir(root.join("small"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        n.sort();
        n
    });
    let want: Vec<String> = (0..12).map(|i| format!("{i:02}")).collect();
    assert_eq!(names, want);

    // Small files in listing order (the small-file prefetch path).
    for (i, b) in small.iter().enumerate() {
        let got = read_all(m.path(&format!("small/{i:02}"))).expect("small read");
        assert_eq!(&got, b, "small/{i:02}");
    }
    // A large sequential read (prefetch windows, parallel parts).
    let got = read_all(m.path("big")).expect("big read");
    assert!(got == big, "big: {} bytes, wrong content", got.len());
    // Random reads of another object (each its own ranged GET; the page cache has none of it).
    let p = m.path("rand");
    let big2 = rand.clone();
    within(WATCHDOG, "random reads", move || {
        let file = fs::File::open(&p).unwrap();
        for k in 0..12u64 {
            let off = (k * 1_234_567) % (big2.len() as u64 - 70_000);
            let mut buf = vec![0u8; 70_000];
            file.read_exact_at(&mut buf, off).unwrap();
            assert!(
                buf == big2[off as usize..off as usize + buf.len()],
                "random read at {off}"
            );
        }
    });
    // Readers in parallel, each its own files.
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (root, par) = (m.root.clone(), par.clone());
            std::thread::spawn(move || {
                for i in (t..par.len()).step_by(4) {
                    let got = fs::read(root.join(format!("par/{i}"))).expect("parallel read");
                    assert!(got == par[i], "par/{i}");
                }
            })
        })
        .collect();
    within(WATCHDOG, "parallel readers", move || {
        for h in handles {
            h.join().unwrap();
        }
    });

    let injected = f.proxy.injected();
    eprintln!(
        "{} requests, {} faults injected",
        f.proxy.requests(),
        injected.len()
    );
    for kind in [
        Fault::SlowDown,
        Fault::InternalError,
        Fault::CutBody,
        Fault::ShortBody,
        Fault::Hang,
    ] {
        assert!(
            injected.contains(&kind),
            "{kind:?} never injected: {injected:?}"
        );
    }
    f.proxy.set_plan(None);
    m.unmount();
    f.env.assert_budget_released();
}

#[test]
fn persistent_faults_give_eio_after_bounded_retries() {
    let f = flaky();
    let prefix = f.env.fresh_prefix("persistent");
    let data = body(300_000, 7);
    let cases = [
        Fault::SlowDown,
        Fault::InternalError,
        Fault::CutBody,
        Fault::ShortBody,
        Fault::Hang,
    ];
    for i in 0..cases.len() {
        f.env.put(&format!("{prefix}f{i}"), &data);
    }
    f.env.put(&format!("{prefix}after"), &data);
    f.env.put(&format!("{prefix}sub/x"), b"x");
    f.env.put(&format!("{prefix}other/y"), b"y");
    let m = f.env.mount(f.store.clone(), &prefix, |c| {
        c.read_only = true;
        c.metadata_ttl = MetadataTtl::Indefinite;
    });
    // Learn every name and ETag while the server is healthy: only GETs break below.
    let root = m.root.clone();
    within(WATCHDOG, "listing", move || {
        fs::read_dir(root).unwrap().count()
    });

    for (i, fault) in cases.into_iter().enumerate() {
        f.proxy.set_plan(Some(FaultPlan::always(&["GET"], fault)));
        let before = f.proxy.requests();
        let r = read_all(m.path(&format!("f{i}")));
        assert_eq!(errno(r), libc::EIO, "{fault:?}: a read gives EIO");
        let tries = f.proxy.requests() - before;
        eprintln!("{fault:?}: EIO after {tries} requests");
        assert!(
            tries >= 2,
            "{fault:?}: retried before giving up ({tries} requests)"
        );
    }

    // A persistent HEAD failure fails the open of an unknown name with EIO, not a hang. (In a
    // directory not listed yet: the root's listing, kept on this `indefinite` mount, answers
    // names it does not hold with ENOENT and no request.)
    f.proxy.set_plan(Some(FaultPlan::always(
        &["GET", "HEAD"],
        Fault::InternalError,
    )));
    let p = m.path("other/never-seen");
    let r = within(WATCHDOG, "stat", move || fs::metadata(p));
    assert_eq!(errno(r), libc::EIO);

    // A listing that keeps failing: EIO, not an empty directory.
    let p = m.path("sub");
    let r = within(WATCHDOG, "readdir", move || {
        fs::read_dir(p).and_then(|d| d.collect::<Result<Vec<_>, _>>())
    });
    assert_eq!(errno(r), libc::EIO);

    // The server recovers: so does the mount (no failure was cached).
    f.proxy.set_plan(None);
    let p = m.path("sub");
    let names = within(WATCHDOG, "readdir", move || {
        fs::read_dir(p).unwrap().count()
    });
    assert_eq!(names, 1);
    assert_eq!(read_all(m.path("after")).unwrap(), data);
    assert_eq!(read_all(m.path("f0")).unwrap(), data);
    m.unmount();
    f.env.assert_budget_released();
}

/// Bodies cut short *above* the store (past its length checks) at random: the filesystem's own
/// length check retries once, then fails. Every read gives the right bytes or `EIO`, never short
/// or wrong data.
#[test]
fn short_bodies_past_the_store_are_never_data() {
    assert!(std::path::Path::new("/dev/fuse").exists(), "needs FUSE");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mem = MemoryStore::new();
    mem.create_bucket(BUCKET);
    let data = body(3 << 20, 9);
    mem.insert(BUCKET, "f", data.clone());
    let faulty = Arc::new(FaultyStore::new(mem, 42));
    faulty.truncate_with_probability(0.4);
    faulty.fail_with_probability([Op::Get], 0.1, StoreError::Transient("injected".into()));
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = MountConfig::new(BUCKET);
    cfg.uid = common::my_uid();
    let ctx = MountContext::new(rt.handle().clone());
    let budget = ctx.budget.clone();
    let handle = mount(faulty.clone() as Arc<dyn ObjectStore>, cfg, dir.path(), ctx).unwrap();
    let p = handle.target().join("f");
    let data2 = data.clone();
    let (ok, eio) = within(WATCHDOG, "reads over a FaultyStore", move || {
        let (mut ok, mut eio) = (0, 0);
        for k in 0..60u64 {
            // Pages read before may come from the page cache: those are right bytes too.
            let file = fs::File::open(&p).unwrap();
            let off = (k * 987_654) % (data2.len() as u64 - 200_000);
            let mut buf = vec![0u8; 200_000];
            match file.read_exact_at(&mut buf, off) {
                Ok(()) => {
                    assert!(
                        buf == data2[off as usize..off as usize + buf.len()],
                        "read at {off}: wrong bytes"
                    );
                    ok += 1;
                }
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "read at {off}: {e}");
                    eio += 1;
                }
            }
        }
        (ok, eio)
    });
    let stats = faulty.stats();
    eprintln!("{ok} reads right, {eio} EIO; {stats:?}");
    assert!(stats.truncated > 0, "{stats:?}");
    assert!(ok > 0, "some reads succeed ({eio} EIO)");
    handle.unmount().unwrap();
    common::assert_budget_released(&budget);
}

#[test]
fn uploads_survive_transient_faults_and_fail_cleanly_on_persistent_ones() {
    let f = flaky();
    let prefix = f.env.fresh_prefix("upload");
    f.env.put(&format!("{prefix}old"), b"old content");
    let m = f.env.mount(f.store.clone(), &prefix, |c| {
        c.allow_overwrite = true;
        c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO);
    });
    let small = body(100_000, 3);
    let large = body(10 << 20, 4); // two parts: CreateMultipartUpload, 2 × UploadPart, Complete

    // Every other PUT and POST (create/complete multipart) breaks, each fault kind in turn.
    f.proxy.set_plan(Some(FaultPlan {
        methods: vec!["PUT".into(), "POST".into()],
        faults: vec![Fault::SlowDown, Fault::InternalError, Fault::Hang],
        every: 2,
        ranged_only: false,
    }));
    for (name, data) in [("small", &small), ("large", &large)] {
        let (p, d) = (m.path(name), data.clone());
        within(WATCHDOG, name, move || fs::write(p, d)).expect("write");
        assert!(
            f.env.get(&format!("{prefix}{name}")).as_ref() == Some(data),
            "{name} in the bucket"
        );
    }
    assert!(f.proxy.injected().len() >= 3, "{:?}", f.proxy.injected());

    // Every upload request fails: close reports EIO, the new file disappears, an overwritten
    // object keeps its old content, and nothing hangs.
    for fault in [Fault::InternalError, Fault::Hang] {
        f.proxy
            .set_plan(Some(FaultPlan::always(&["PUT", "POST"], fault)));
        for name in ["new", "old"] {
            let p = m.path(name);
            let r = within(WATCHDOG, "failing upload", move || {
                use std::io::Write;
                let mut file = fs::File::create(p)?;
                file.write_all(b"doomed")?;
                file.sync_all()
            });
            assert_eq!(errno(r), libc::EIO, "{fault:?} {name}");
        }
        f.proxy.set_plan(None);
        let p = m.path("new");
        assert_eq!(
            errno(within(WATCHDOG, "stat", move || fs::metadata(p))),
            libc::ENOENT
        );
        assert_eq!(read_all(m.path("old")).unwrap(), b"old content");
        assert_eq!(f.env.get(&format!("{prefix}new")), None);
    }
    m.unmount();
}
