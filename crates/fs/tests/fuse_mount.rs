//! Real-FUSE tests: mount a MemoryStore-backed filesystem and use it through plain `std::fs`.

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;

use ferry_fs::{is_mounted, mount, MetadataTtl, MountConfig, MountContext, MountHandle};
use ferry_store::MemoryStore;

mod common;
use common::metric;

const B: &str = "bkt";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
}

/// Whether `/dev/fuse` is there; in CI its absence fails the test ([`ferry_testkit::prerequisite`]).
fn fuse_available() -> bool {
    ferry_testkit::prerequisite(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse (real FUSE mounts)",
    )
}

fn body(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed as u8)
        .collect()
}

fn mount_store(
    store: &MemoryStore,
    dir: &Path,
    rt: &tokio::runtime::Runtime,
    tweak: impl FnOnce(&mut MountConfig),
) -> MountHandle {
    let mut cfg = MountConfig::new(B);
    cfg.fs_name = format!("ferry:{B}/");
    cfg.uid = my_uid();
    cfg.gid = 0;
    tweak(&mut cfg);
    mount(
        Arc::new(store.clone()),
        cfg,
        dir,
        MountContext::new(rt.handle().clone()),
    )
    .expect("mount")
}

/// The uid the files are shown with: ours (root in CI), so DefaultPermissions lets us write.
fn my_uid() -> u32 {
    fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
}

fn mountinfo_line(target: &Path) -> Option<String> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let target = target.to_str().unwrap();
    info.lines()
        .find(|l| l.split(' ').nth(4) == Some(target))
        .map(str::to_owned)
}

#[test]
fn read_write_unlink_through_the_kernel() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = MemoryStore::new();
    store.create_bucket(B);
    let big = body(3 << 20, 1);
    store.insert(B, "hello.txt", &b"hello, world\n"[..]);
    store.insert(B, "dir/a.bin", big.clone());
    store.insert(B, "dir/sub/b", &b"b"[..]);
    store.insert(B, "marker/", Vec::new());
    store.insert(B, "weird//key", &b"hidden"[..]);
    for i in 0..100 {
        store.insert(B, &format!("many/f{i:03}"), body(i, 2));
    }

    let dir = tempfile::tempdir().unwrap();
    let handle = mount_store(&store, dir.path(), &rt, |c| {
        c.read_only = false;
        c.allow_delete = true;
        c.allow_overwrite = true;
    });
    let root = handle.target().to_owned();
    let line = mountinfo_line(&root).expect("mounted");
    assert!(line.contains(" fuse.ferry "), "{line}");
    assert!(line.contains(" ferry:bkt/ "), "{line}");
    assert!(line.contains("nosuid") && line.contains("nodev"), "{line}");

    // Listing, stat, read.
    let names: BTreeSet<_> = fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let want: BTreeSet<_> = ["dir", "hello.txt", "many", "marker", "weird"]
        .map(String::from)
        .into();
    assert_eq!(names, want);
    let meta = fs::metadata(root.join("hello.txt")).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.len(), 13);
    assert_eq!(meta.permissions().mode() & 0o7777, 0o644);
    assert_eq!(meta.uid(), my_uid());
    assert!(fs::metadata(root.join("dir/sub")).unwrap().is_dir());
    assert_eq!(fs::read(root.join("hello.txt")).unwrap(), b"hello, world\n");
    assert_eq!(fs::read(root.join("dir/a.bin")).unwrap(), big);
    assert_eq!(
        fs::read(root.join("dir/a.bin")).unwrap(),
        big,
        "warm re-read"
    );
    assert!(fs::read_dir(root.join("marker")).unwrap().next().is_none());
    assert!(fs::read_dir(root.join("weird")).unwrap().next().is_none());
    assert_eq!(
        fs::metadata(root.join("nope")).unwrap_err().raw_os_error(),
        Some(libc::ENOENT)
    );

    // `ls -la` of a directory: no HEAD per entry.
    store.reset_stats();
    let mut sizes = Vec::new();
    for e in fs::read_dir(root.join("many")).unwrap() {
        let e = e.unwrap();
        sizes.push(fs::symlink_metadata(e.path()).unwrap().len());
    }
    assert_eq!(sizes.len(), 100);
    assert_eq!(sizes.iter().sum::<u64>(), (0..100u64).sum::<u64>());
    assert_eq!(store.stats().head, 0, "{:?}", store.stats());

    // Parallel reads from several threads.
    std::thread::scope(|s| {
        for t in 0..8 {
            let root = &root;
            s.spawn(move || {
                for i in (t..100).step_by(8) {
                    let got = fs::read(root.join(format!("many/f{i:03}"))).unwrap();
                    assert_eq!(got, body(i, 2));
                }
            });
        }
    });

    // Writes: a small file, a multipart one, one in a new directory.
    fs::write(root.join("new.txt"), b"written through FUSE").unwrap();
    assert_eq!(
        store.get_object(B, "new.txt").unwrap(),
        &b"written through FUSE"[..]
    );
    assert_eq!(fs::metadata(root.join("new.txt")).unwrap().len(), 20);
    let large = body(10 << 20, 3);
    {
        let mut f = fs::File::create(root.join("large.bin")).unwrap();
        for chunk in large.chunks(1 << 20) {
            f.write_all(chunk).unwrap();
        }
    }
    assert_eq!(store.get_object(B, "large.bin").unwrap(), &large[..]);
    assert_eq!(fs::read(root.join("large.bin")).unwrap(), large);
    fs::create_dir(root.join("nd")).unwrap();
    assert!(fs::metadata(root.join("nd")).unwrap().is_dir());
    fs::write(root.join("nd/f"), b"in a new dir").unwrap();
    assert_eq!(store.get_object(B, "nd/f").unwrap(), &b"in a new dir"[..]);

    // Overwrite with O_TRUNC works; writing without it (append / in place) is refused.
    fs::write(root.join("hello.txt"), b"replaced").unwrap();
    assert_eq!(store.get_object(B, "hello.txt").unwrap(), &b"replaced"[..]);
    let err = fs::OpenOptions::new()
        .append(true)
        .open(root.join("hello.txt"))
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM));
    let mut f = fs::File::open(root.join("hello.txt")).unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    assert_eq!(s, "replaced");
    drop(f);

    // rename is EXDEV (mv copies instead); unlink/rmdir.
    let err = fs::rename(root.join("new.txt"), root.join("moved.txt")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EXDEV));
    fs::remove_file(root.join("new.txt")).unwrap();
    assert!(store.get_object(B, "new.txt").is_none());
    assert_eq!(
        fs::metadata(root.join("new.txt"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENOENT)
    );
    let err = fs::remove_dir(root.join("dir")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTEMPTY));
    fs::remove_dir(root.join("marker")).unwrap();
    assert!(store.get_object(B, "marker/").is_none());
    fs::remove_file(root.join("nd/f")).unwrap();
    assert!(
        fs::metadata(root.join("nd")).unwrap().is_dir(),
        "emptied dir stays"
    );
    fs::remove_dir(root.join("nd")).unwrap();

    handle.unmount().unwrap();
    assert!(mountinfo_line(&root).is_none());
    assert!(!is_mounted(&root).unwrap());
}

#[test]
fn read_only_mount() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = MemoryStore::new();
    store.create_bucket(B);
    store.insert(B, "data/shard-0", body(1 << 20, 4));
    let dir = tempfile::tempdir().unwrap();
    let handle = mount_store(&store, dir.path(), &rt, |c| {
        c.prefix = "data/".into();
        c.metadata_ttl = MetadataTtl::Indefinite;
        c.allow_other = true;
    });
    let root = handle.target().to_owned();
    let line = mountinfo_line(&root).unwrap();
    assert!(
        line.contains(" ro,") && line.contains("allow_other"),
        "{line}"
    );
    assert_eq!(fs::read(root.join("shard-0")).unwrap(), body(1 << 20, 4));
    let err = fs::write(root.join("x"), b"no").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    let err = fs::remove_file(root.join("shard-0")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    // Dropping the handle unmounts too.
    drop(handle);
    assert!(mountinfo_line(&root).is_none());
}

#[test]
fn fuse_operations_prefetch_hits_and_the_memory_budget_show_in_the_metrics() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = MemoryStore::new();
    store.create_bucket(B);
    let data = body(6 << 20, 9);
    store.insert(B, "metrics/seq.bin", data.clone());
    let dir = tempfile::tempdir().unwrap();
    let before = (
        metric("ferry_fuse_operations_total", "op=\"read\""),
        metric("ferry_fuse_operation_duration_seconds_count", "op=\"open\""),
        metric("ferry_prefetch_hit_bytes_total", ""),
    );
    let m = mount_store(&store, dir.path(), &rt, |_| {});
    let got = fs::read(dir.path().join("metrics/seq.bin")).unwrap();
    assert!(got == data);
    let after = (
        metric("ferry_fuse_operations_total", "op=\"read\""),
        metric("ferry_fuse_operation_duration_seconds_count", "op=\"open\""),
        metric("ferry_prefetch_hit_bytes_total", ""),
    );
    assert!(
        after.0 > before.0,
        "FUSE reads counted: {before:?} -> {after:?}"
    );
    assert!(
        after.1 > before.1,
        "FUSE opens timed: {before:?} -> {after:?}"
    );
    m.unmount().unwrap();
    // The sequential reader was served from prefetched parts (counted when they are dropped).
    let hits = metric("ferry_prefetch_hit_bytes_total", "") - before.2;
    assert!(hits >= (4 << 20) as f64, "{hits} prefetched bytes read");
    assert!(
        metric("ferry_memory_budget_used_bytes", "") >= 0.0,
        "the budget gauge never goes below zero"
    );
}

#[test]
fn a_mount_reads_ahead_1_mib_so_sequential_reads_come_in_1_mib_requests() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = MemoryStore::new();
    store.create_bucket(B);
    let dir = tempfile::tempdir().unwrap();
    let m = mount_store(&store, dir.path(), &rt, |_| {});
    let dev = fs::metadata(dir.path()).unwrap().dev();
    let path = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    assert_eq!(fs::read_to_string(&path).unwrap().trim(), "1024", "{path}");
    m.unmount().unwrap();
}

/// Issue 14 item 2, at the filesystem's level: `unmount` and `detach` return while another mount
/// namespace holds a copy of the mount; the copy is cut off (`ENOTCONN`).
#[test]
fn unmount_and_detach_never_wait_on_a_copy_in_another_mount_namespace() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = MemoryStore::new();
    store.create_bucket(B);
    store.insert(B, "f", body(10, 1));
    for lazy in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let handle = mount_store(&store, dir.path(), &rt, |_| {});
        let mut child = ferry_testkit::hold_a_copy_in_another_namespace(dir.path());
        let cwd = format!("/proc/{}/cwd", child.id());
        assert_eq!(fs::read_dir(&cwd).unwrap().count(), 1, "the copy serves");
        let res = common::within(std::time::Duration::from_secs(120), "unmount", move || {
            if lazy {
                handle.detach()
            } else {
                handle.unmount()
            }
        });
        let after = fs::read_dir(&cwd).map(drop);
        child.kill().unwrap();
        child.wait().unwrap();
        res.unwrap();
        assert!(!is_mounted(dir.path()).unwrap());
        assert_eq!(after.unwrap_err().raw_os_error(), Some(libc::ENOTCONN));
    }
}

/// Issue 14 item 1, at the filesystem's level: a symlink at the target is refused, never
/// followed; and an unmount never touches what was mounted over the mount.
#[test]
fn a_symlink_target_is_refused_and_a_mount_stacked_on_ours_is_left_alone() {
    if !fuse_available() {
        return;
    }
    let rt = runtime();
    let store = MemoryStore::new();
    store.create_bucket(B);
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = dir.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    let err = mount(
        Arc::new(store.clone()),
        MountConfig::new(B),
        &link,
        MountContext::new(rt.handle().clone()),
    )
    .unwrap_err();
    assert!(
        matches!(&err, ferry_fs::MountError::Target { error, .. } if error.kind() == std::io::ErrorKind::NotADirectory),
        "{err}"
    );
    assert!(!is_mounted(&elsewhere).unwrap());

    let target = dir.path().join("t");
    fs::create_dir(&target).unwrap();
    let handle = mount_store(&store, &target, &rt, |_| {});
    assert!(handle.is_mounted().unwrap());
    let c = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: NUL-terminated strings alive across the call; mount(2) only reads them.
    let rc = unsafe {
        libc::mount(
            c"stacked".as_ptr(),
            c.as_ptr(),
            c"tmpfs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    assert!(!handle.is_mounted().unwrap(), "ours is covered");
    let err = handle.unmount().unwrap_err();
    assert!(err.to_string().contains("tmpfs"), "{err}");
    assert_eq!(
        ferry_fs::mountinfo::mounted_at(&target)
            .unwrap()
            .unwrap()
            .fs_type,
        "tmpfs",
        "the stacked mount is untouched"
    );
    ferry_fs::mountinfo::unmount(&target, false).unwrap();
    // Ours (left served when its handle was dropped) is on top again; clean it up.
    ferry_fs::mountinfo::detach(&target).unwrap();
}
