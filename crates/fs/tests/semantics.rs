//! `doc/SEMANTICS.md` held to the code. Every table row of the doc (section + first cell) must
//! appear in [`CLAIMS`], with either a check here (run through a real FUSE mount, mostly on a real
//! S3 server: versitygw), a named test elsewhere that checks it, or a stated gap. A row added,
//! renamed or removed in the doc without the same change here fails
//! `every_row_of_the_doc_has_a_check`; a claim that stops holding fails `every_claim_holds`, which
//! runs every check and names every failing row.
//!
//! Where versitygw cannot hold what a row talks about (a key `x` next to `x/y`, keys with empty,
//! `.`/`..` or over-long segments: its posix backend stores keys as paths), the check mounts a
//! `MemoryStore` instead. Store errors are injected with a `FaultyStore` around the S3 store, and
//! server faults with a `FaultProxy` in front of versitygw.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsStr};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::os::unix::io::{AsRawFd, IntoRawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::{errno, Env, Mount, BUCKET};
use ferry_fs::{MetadataTtl, MountConfig};
use ferry_s3::S3Store;
use ferry_store::{FaultyStore, MemoryStore, ObjectStore, Op, StoreError};
use ferry_testkit::{Fault, FaultPlan, FaultProxy};

const DOC: &str = include_str!("../../../doc/SEMANTICS.md");

/// How a row of the doc is checked.
enum How {
    /// By a check in this file.
    Here(fn(&Ctx)),
    /// By the test `fn` named in the file (path from the workspace root).
    Elsewhere(&'static str, &'static str),
    /// Not checked by a test; why.
    Gap(&'static str),
}
use How::*;

/// Every row of every table of `doc/SEMANTICS.md`: (section, first cell without backticks).
const CLAIMS: &[(&str, &str, How)] = &[
    ("Names and the tree", "Tree", Here(tree)),
    ("Names and the tree", "Keys that are not POSIX names", Here(non_posix_keys)),
    (
        "Names and the tree",
        "Keys anyone can write",
        Elsewhere("crates/fs/tests/hostile_keys.rs", "hostile_keys_never_take_a_directory_down"),
    ),
    ("Names and the tree", "File and directory with the same name", Here(file_and_dir_same_name)),
    ("Names and the tree", "Names from the kernel", Here(names_from_the_kernel)),
    ("Names and the tree", "Inode numbers", Here(inode_numbers)),
    ("Names and the tree", "Owner, modes", Here(owner_modes)),
    ("Names and the tree", "Mount options", Here(mount_options)),
    ("Metadata and caching", "TTL", Here(ttl)),
    ("Metadata and caching", "Listing", Here(listing)),
    ("Metadata and caching", "Kernel directory cache", Here(kernel_dir_cache)),
    ("Metadata and caching", "Lookup", Here(lookup)),
    ("Metadata and caching", "getattr", Here(getattr)),
    ("Metadata and caching", "Changes by others", Here(changes_by_others)),
    ("Operations", "lookup/stat", Here(op_lookup)),
    ("Operations", "opendir/readdir", Here(op_readdir)),
    ("Operations", "open O_RDONLY", Here(op_open_rdonly)),
    ("Operations", "read", Here(op_read)),
    ("Operations", "create (O_CREAT, new name)", Here(op_create)),
    ("Operations", "open for writing an existing object", Here(op_open_write_existing)),
    ("Operations", "write", Here(op_write)),
    ("Operations", "close (flush)", Here(op_close)),
    ("Operations", "fsync", Here(op_fsync)),
    (
        "Operations",
        "release (last close)",
        Elsewhere("crates/fs/src/fs/tests.rs", "empty_file_via_release_only"),
    ),
    ("Operations", "Failed upload", Here(op_failed_upload)),
    ("Operations", "ftruncate/truncate", Here(op_truncate)),
    ("Operations", "chmod/chown", Here(op_chmod_chown)),
    ("Operations", "utimes/touch on existing", Here(op_utimes)),
    ("Operations", "mkdir", Here(op_mkdir)),
    ("Operations", "unlink", Here(op_unlink)),
    ("Operations", "rmdir", Here(op_rmdir)),
    ("Operations", "rename", Here(op_rename)),
    (
        "Operations",
        "ioctl, poll, fallocate, lseek (SEEK_DATA/SEEK_HOLE), copy_file_range",
        Here(op_unsupported_quietly),
    ),
    ("Operations", "link, symlink, mknod", Here(op_link_symlink_mknod)),
    ("Operations", "xattrs", Here(op_xattrs)),
    ("Operations", "statfs", Here(op_statfs)),
    ("Operations", "Read-only mount", Here(read_only_mount)),
    ("Store errors → errno", "NotFound", Here(err_not_found)),
    ("Store errors → errno", "AccessDenied, Credentials", Here(err_access)),
    ("Store errors → errno", "CredentialsUnavailable", Here(err_credentials_unavailable)),
    ("Store errors → errno", "PreconditionFailed (ETag changed)", Here(err_precondition)),
    ("Store errors → errno", "InvalidRequest", Here(err_invalid)),
    ("Store errors → errno", "Throttled, Transient, Corrupt, NoSuchBucket, Other", Here(err_eio)),
    (
        "Node cache",
        "What is cached",
        Elsewhere("crates/fs/src/fs/cache_tests.rs", "a_changed_object_is_a_new_block_and_the_old_handle_gets_estale"),
    ),
    (
        "Node cache",
        "Correct bytes",
        Elsewhere("crates/cache/src/tests.rs", "a_flipped_byte_is_a_counted_miss_never_served"),
    ),
    (
        "Node cache",
        "Who may read",
        Elsewhere("crates/fs/tests/cache_identity.rs", "a_pod_denied_the_objects_gets_eacces_while_the_allowed_pod_reads_from_the_cache"),
    ),
    (
        "Node cache",
        "One GET per block",
        Elsewhere("crates/fs/src/fs/cache_tests.rs", "concurrent_readers_on_four_mounts_fetch_each_block_once"),
    ),
    (
        "Node cache",
        "Read granularity",
        Elsewhere("crates/fs/src/fs/cache_tests.rs", "a_small_random_read_on_a_cold_cache_fetches_the_one_block_it_touches"),
    ),
    (
        "Node cache",
        "Directory sweep",
        Elsewhere("crates/fs/src/fs/cache_tests.rs", "a_directory_read_in_shuffled_order_is_swept_into_the_cache"),
    ),
    (
        "Node cache",
        "Space",
        Elsewhere("crates/cache/tests/disk_full.rs", "a_full_disk_makes_the_cache_step_aside_and_reads_still_succeed"),
    ),
    (
        "Node cache",
        "Whole objects and passthrough",
        Elsewhere("crates/fs/tests/cache_identity.rs", "a_pod_denied_the_objects_gets_eacces_while_the_allowed_pod_reads_from_the_cache"),
    ),
    (
        "Node cache",
        "Checked before hand-out",
        Elsewhere("crates/cache/src/tests.rs", "a_clean_shutdown_lets_the_next_process_trust_unchanged_whole_files_only"),
    ),
    (
        "Node cache",
        "Restarts",
        Elsewhere("crates/cache/src/tests.rs", "blocks_survive_a_restart_and_the_index_is_rebuilt"),
    ),
    (
        "Node cache",
        "Opt-out",
        Elsewhere("crates/fs/src/fs/cache_tests.rs", "cache_none_keeps_a_mount_out_of_the_cache"),
    ),
    (
        "Node cache",
        "Warm-up",
        Elsewhere("crates/fs/src/warmup.rs", "warms_the_prefix_once_within_the_cache_size"),
    ),
    (
        "Through CSI",
        "Read-only",
        Elsewhere("e2e/tests/csi.rs", "readonly_publish_refuses_writes"),
    ),
    (
        "Through CSI",
        "Users",
        Gap("node-level: the fsGroup → gid and 0664/0775 defaults are in node/src/service.rs with no test of their own yet"),
    ),
    (
        "Through CSI",
        "Prefixes",
        Elsewhere("e2e/tests/csi.rs", "prefixes_with_any_characters_mount_and_unservable_ones_are_refused_up_front"),
    ),
    (
        "Through CSI",
        "Target paths",
        Elsewhere("e2e/tests/csi.rs", "a_symlinked_target_is_never_mounted_through_or_removed"),
    ),
    (
        "Through CSI",
        "Files in a target",
        Elsewhere("node/src/service.rs", "unpublish_leaves_a_target_directory_with_files_in_place_and_answers_ok"),
    ),
    (
        "Through CSI",
        "Missing buckets",
        Elsewhere("controller/tests/missing_bucket.rs", "delete_volume_with_keys_the_server_does_not_know_fails_and_deletes_nothing"),
    ),
    (
        "Through CSI",
        "Validating a volume",
        Elsewhere("controller/src/service.rs", "validate_and_conflicts"),
    ),
    (
        "Through CSI",
        "What unpublish touches",
        Elsewhere("e2e/tests/csi.rs", "a_foreign_mount_at_the_target_is_never_touched"),
    ),
    (
        "Through CSI",
        "Other mount namespaces",
        Elsewhere("e2e/tests/csi.rs", "unpublish_returns_while_another_mount_namespace_holds_a_copy"),
    ),
    (
        "Through CSI",
        "Error messages",
        Elsewhere("e2e/tests/csi.rs", "impossible_targets_are_invalid_and_errors_quote_inputs_short"),
    ),
    (
        "Through CSI",
        "Node plugin exit",
        Elsewhere("e2e/src/bin/ferry-harness.rs", "restart"),
    ),
    (
        "Node plugin exit",
        "Upgrade",
        Elsewhere("e2e/src/takeover.rs", "upgrade"),
    ),
    (
        "Node plugin exit",
        "Handover refused",
        Elsewhere("e2e/src/takeover.rs", "refusals"),
    ),
    (
        "Node plugin exit",
        "SIGTERM during a handover",
        Elsewhere("e2e/src/takeover.rs", "stopped_mid_handover"),
    ),
    (
        "Node plugin exit",
        "Crash, with the holder",
        Elsewhere("e2e/src/takeover.rs", "crash"),
    ),
    (
        "Node plugin exit",
        "Kernel without FUSE_NOTIFY_RESEND",
        Gap("this machine's kernel has it; the owner's refusal is in NodeService::export (node/src/service.rs) without a test on an older kernel"),
    ),
    (
        "Node plugin exit",
        "Crash, without the holder",
        Elsewhere("e2e/src/bin/ferry-harness.rs", "restart"),
    ),
    (
        "Node plugin exit",
        "SIGTERM, no successor",
        Elsewhere("e2e/src/bin/ferry-harness.rs", "restart"),
    ),
    (
        "Through CSI",
        "Endpoints",
        Elsewhere("e2e/tests/csi.rs", "endpoints_the_operator_did_not_allow_are_refused_before_any_connection"),
    ),
];

/// (section, first cell) of every table row of the doc, header rows excluded.
fn doc_rows() -> Vec<(String, String)> {
    let mut rows = Vec::new();
    let mut section = String::new();
    let lines: Vec<&str> = DOC.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(h) = line.strip_prefix("## ") {
            section = h.trim().to_owned();
            continue;
        }
        if !line.starts_with('|') || line.starts_with("|---") {
            continue;
        }
        // A header row is followed by the separator row.
        if lines.get(i + 1).is_some_and(|n| n.starts_with("|---")) {
            continue;
        }
        let first = line[1..].split('|').next().unwrap_or("").trim();
        rows.push((section.clone(), first.replace('`', "")));
    }
    rows
}

#[test]
fn every_row_of_the_doc_has_a_check() {
    let doc: BTreeSet<(String, String)> = doc_rows().into_iter().collect();
    let ours: BTreeSet<(String, String)> = CLAIMS
        .iter()
        .map(|(s, r, _)| (s.to_string(), r.to_string()))
        .collect();
    assert_eq!(doc.len(), doc_rows().len(), "duplicate rows in the doc");
    assert_eq!(ours.len(), CLAIMS.len(), "duplicate rows in CLAIMS");
    let unchecked: Vec<_> = doc.difference(&ours).collect();
    let stale: Vec<_> = ours.difference(&doc).collect();
    assert!(
        unchecked.is_empty() && stale.is_empty(),
        "doc/SEMANTICS.md and CLAIMS disagree.\nrows in the doc with no entry in CLAIMS: {unchecked:#?}\nentries in CLAIMS with no row in the doc: {stale:#?}"
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for (section, row, how) in CLAIMS {
        if let Elsewhere(file, func) = how {
            let src = fs::read_to_string(root.join(file))
                .unwrap_or_else(|e| panic!("{section} / {row}: reading {file}: {e}"));
            assert!(
                src.contains(&format!("fn {func}(")),
                "{section} / {row}: {file} has no fn {func}"
            );
        }
    }
}

#[test]
fn every_claim_holds() {
    let ctx = Ctx::new();
    let mut failed = Vec::new();
    let mut gaps = Vec::new();
    for (section, row, how) in CLAIMS {
        match how {
            Here(check) => {
                eprintln!("--- checking {section} / {row}");
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&ctx)));
                ctx.proxy.set_plan(None);
                if let Err(e) = r {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    failed.push(format!("{section} / {row}: {msg}"));
                }
            }
            Elsewhere(..) => {}
            Gap(why) => gaps.push(format!("{section} / {row}: {why}")),
        }
    }
    eprintln!("rows not checked by any test: {gaps:#?}");
    assert!(
        failed.is_empty(),
        "{} claim(s) of doc/SEMANTICS.md do not hold:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// The context: versitygw behind a FaultProxy (nothing broken unless a check asks), mounts of fresh
// prefixes.

struct Ctx {
    env: Env,
    proxy: FaultProxy,
    /// The S3 store through the proxy.
    s3: Arc<S3Store>,
}

impl Ctx {
    fn new() -> Ctx {
        let env = Env::start();
        let proxy = FaultProxy::start(([127, 0, 0, 1], env.server.port()).into()).unwrap();
        let mut cfg = env.server.s3_config();
        cfg.endpoint_url = Some(proxy.url());
        let opts = ferry_s3::S3Options {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(20),
            ..ferry_s3::S3Options::default()
        };
        let s3 = Arc::new(env.rt.block_on(S3Store::with_options(cfg, opts)).unwrap());
        Ctx { env, proxy, s3 }
    }

    /// A fresh prefix with `objects` put into it.
    fn prefix(&self, objects: &[(&str, &[u8])]) -> String {
        let p = self.env.fresh_prefix("sem");
        for (k, v) in objects {
            self.env.put(&format!("{p}{k}"), v);
        }
        p
    }

    /// A mount of `prefix` on versitygw (through the proxy): writable, delete and overwrite
    /// allowed, TTL 0, then `tweak`.
    fn mount(&self, prefix: &str, tweak: impl FnOnce(&mut MountConfig)) -> Mount {
        self.env.mount(self.s3.clone(), prefix, |c| {
            c.allow_delete = true;
            c.allow_overwrite = true;
            c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO);
            tweak(c);
        })
    }

    fn key(&self, prefix: &str, k: &str) -> Option<Vec<u8>> {
        self.env.get(&format!("{prefix}{k}"))
    }

    fn put(&self, prefix: &str, k: &str, v: &[u8]) {
        self.env.put(&format!("{prefix}{k}"), v);
    }

    fn delete(&self, prefix: &str, k: &str) {
        self.env
            .rt
            .block_on(self.env.store.delete(BUCKET, &format!("{prefix}{k}")))
            .unwrap();
    }

    /// A mount of a `MemoryStore` holding `objects` (keys versitygw cannot store).
    fn memory_mount(&self, objects: &[(&str, &[u8])]) -> (MemoryStore, Mount) {
        let mem = MemoryStore::new();
        mem.create_bucket(BUCKET);
        for (k, v) in objects {
            mem.insert(BUCKET, k, v.to_vec());
        }
        let m = self.env.mount(Arc::new(mem.clone()), "", |c| {
            c.allow_delete = true;
            c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO);
        });
        (mem, m)
    }
}

fn names(dir: &Path) -> Vec<(String, bool)> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                e.file_type().unwrap().is_dir(),
            )
        })
        .collect()
}

fn sorted_names(dir: &Path) -> Vec<(String, bool)> {
    let mut n = names(dir);
    n.sort();
    n
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// The result of a libc call returning -1 on error, as an errno.
fn libc_errno(r: libc::c_int) -> i32 {
    if r == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap()
    }
}

fn mountinfo_line(target: &Path) -> String {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let t = target.to_str().unwrap();
    info.lines()
        .find(|l| l.split(' ').nth(4) == Some(t))
        .unwrap_or_else(|| panic!("{t} not in mountinfo"))
        .to_owned()
}

fn secs(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// A file being written through the mount, left open.
fn writing(p: &Path, data: &[u8]) -> File {
    let mut f = File::create(p).unwrap();
    f.write_all(data).unwrap();
    f
}

// ---------------------------------------------------------------------------------------------
// Names and the tree

fn tree(c: &Ctx) {
    let p = c.prefix(&[("a/b/c", b"c"), ("m/", b"")]);
    let m = c.mount(&p, |_| {});
    assert_eq!(
        sorted_names(&m.root),
        [("a".into(), true), ("m".into(), true)]
    );
    assert_eq!(sorted_names(&m.path("a")), [("b".into(), true)]);
    assert_eq!(sorted_names(&m.path("a/b")), [("c".into(), false)]);
    assert!(fs::metadata(m.path("m")).unwrap().is_dir(), "marker dir");
    assert!(names(&m.path("m")).is_empty(), "marker dir is empty");
    // A marker with content (versitygw cannot hold one): a directory, its bytes shown nowhere.
    let (_mem, m) = c.memory_mount(&[("full/", b"hidden bytes"), ("full/f", b"f")]);
    assert!(fs::metadata(m.path("full")).unwrap().is_dir());
    assert_eq!(names(&m.path("full")), [("f".into(), false)]);
}

fn non_posix_keys(c: &Ctx) {
    let long = "l".repeat(256);
    let (_mem, m) = c.memory_mount(&[
        ("a//b", b"x"),
        ("d/./e", b"x"),
        ("u/../v", b"x"),
        (&format!("w/{long}"), b"x"),
        ("n\0m", b"x"),
        ("ok", b"x"),
    ]);
    assert_eq!(
        sorted_names(&m.root),
        [
            ("a".into(), true),
            ("d".into(), true),
            ("ok".into(), false),
            ("u".into(), true),
            ("w".into(), true)
        ]
    );
    for d in ["a", "d", "u", "w"] {
        assert!(names(&m.path(d)).is_empty(), "{d} shows as empty");
    }
}

fn file_and_dir_same_name(c: &Ctx) {
    let (_mem, m) = c.memory_mount(&[("x", b"file"), ("x/y", b"y")]);
    assert_eq!(sorted_names(&m.root), [("x".into(), true)]);
    assert!(fs::metadata(m.path("x")).unwrap().is_dir());
    assert_eq!(fs::read(m.path("x/y")).unwrap(), b"y");
}

fn names_from_the_kernel(c: &Ctx) {
    let p = c.prefix(&[]);
    let m = c.mount(&p, |_| {});
    let bad = m.root.join(OsStr::from_bytes(b"bad\xff"));
    assert_eq!(errno(fs::metadata(&bad)), libc::ENOENT, "lookup");
    assert_eq!(errno(File::create(&bad)), libc::EINVAL, "create");
    assert_eq!(errno(fs::create_dir(&bad)), libc::EINVAL, "mkdir");
    // Control characters: refused before any request (the server's answer would be EIO).
    for name in ["ctl\x01", "esc\x1b[31m", "new\nline", "del\x7f"] {
        assert_eq!(
            errno(File::create(m.path(name))),
            libc::EINVAL,
            "create {name:?}"
        );
        assert_eq!(
            errno(fs::create_dir(m.path(name))),
            libc::EINVAL,
            "mkdir {name:?}"
        );
    }
    let long = m.path(&"n".repeat(256));
    assert_eq!(errno(fs::metadata(&long)), libc::ENAMETOOLONG);
    assert_eq!(errno(File::create(&long)), libc::ENAMETOOLONG);
    // A key over 1024 bytes: 4 directories of 250 bytes, then a 30-byte name.
    let mut dir = m.root.clone();
    let mut key_len = 0;
    for i in 0..4 {
        dir = dir.join(format!("{i}").repeat(250));
        key_len += 251;
        let _ = fs::create_dir(&dir);
    }
    let file = dir.join("f".repeat(30));
    assert!(key_len + 30 > 1024);
    assert_eq!(errno(File::create(file)), libc::ENAMETOOLONG, "key > 1024");
}

fn inode_numbers(c: &Ctx) {
    let p = c.prefix(&[("f", b"f"), ("d/g", b"g")]);
    let m1 = c.mount(&p, |_| {});
    let m2 = c.mount(&p, |_| {});
    let ino = |m: &Mount, k: &str| fs::metadata(m.path(k)).unwrap().ino();
    assert_eq!(ino(&m1, "f"), ino(&m1, "f"));
    assert_eq!(
        ino(&m1, "f"),
        ino(&m2, "f"),
        "a fixed hash: same in every mount"
    );
    assert_eq!(ino(&m1, "d/g"), ino(&m2, "d/g"));
    assert_ne!(ino(&m1, "f"), ino(&m1, "d/g"));
    // A file and a directory at one path: different numbers.
    let (mem, m) = c.memory_mount(&[("x", b"file"), ("x/y", b"y")]);
    let dir_ino = ino(&m, "x");
    c.env.rt.block_on(mem.delete(BUCKET, "x/y")).unwrap();
    let md = fs::metadata(m.path("x")).unwrap();
    assert!(md.is_file());
    assert_ne!(md.ino(), dir_ino);
}

fn owner_modes(c: &Ctx) {
    let p = c.prefix(&[("f", b"12345"), ("d/g", b"")]);
    let before = secs(SystemTime::now());
    let m = c.mount(&p, |cfg| {
        cfg.read_only = true;
        cfg.uid = 4242;
        cfg.gid = 4343;
        cfg.file_mode = 0o640;
        cfg.dir_mode = 0o750;
    });
    let after = secs(SystemTime::now());
    let f = fs::metadata(m.path("f")).unwrap();
    assert_eq!(f.mode() & 0o7777, 0o640);
    assert_eq!(
        (f.uid(), f.gid(), f.nlink(), f.blksize()),
        (4242, 4343, 1, 4096)
    );
    assert_eq!(f.size(), 5);
    let head = c
        .env
        .rt
        .block_on(c.env.store.head(BUCKET, &format!("{p}f")))
        .unwrap();
    assert_eq!(
        f.mtime(),
        secs(head.last_modified.unwrap()),
        "mtime = Last-Modified"
    );
    assert_eq!((f.atime(), f.ctime()), (f.mtime(), f.mtime()));
    let d = fs::metadata(m.path("d")).unwrap();
    assert_eq!(d.mode() & 0o7777, 0o750);
    assert_eq!((d.uid(), d.gid(), d.nlink(), d.size()), (4242, 4343, 2, 0));
    assert!(
        (before..=after).contains(&d.mtime()),
        "dir mtime = mount time"
    );
    assert_eq!((d.atime(), d.ctime()), (d.mtime(), d.mtime()));
}

fn mount_options(c: &Ctx) {
    let p = c.prefix(&[]);
    let m = c.mount(&p, |_| {});
    let line = mountinfo_line(&m.root);
    assert!(line.contains(" fuse.ferry "), "{line}");
    assert!(line.contains(&format!(" ferry:{BUCKET}/{p} ")), "{line}");
    for opt in ["nodev", "nosuid", "default_permissions"] {
        assert!(line.contains(opt), "{opt}: {line}");
    }
    assert!(!line.contains("allow_other"), "{line}");
    assert!(line.split(' ').nth(5).unwrap().starts_with("rw"), "{line}");
    let ro = c.mount(&p, |cfg| {
        cfg.read_only = true;
        cfg.allow_other = true;
    });
    let line = mountinfo_line(&ro.root);
    assert!(line.split(' ').nth(5).unwrap().starts_with("ro"), "{line}");
    assert!(line.contains("allow_other"), "{line}");
}

// ---------------------------------------------------------------------------------------------
// Metadata and caching

fn ttl(c: &Ctx) {
    let p = c.prefix(&[("f", b"12345")]);
    let forever = c.mount(&p, |cfg| cfg.metadata_ttl = MetadataTtl::Indefinite);
    let zero = c.mount(&p, |_| {});
    assert_eq!(fs::metadata(forever.path("f")).unwrap().len(), 5);
    assert_eq!(fs::metadata(zero.path("f")).unwrap().len(), 5);
    c.put(&p, "f", b"1234567890");
    assert_eq!(
        fs::metadata(forever.path("f")).unwrap().len(),
        5,
        "indefinite"
    );
    assert_eq!(fs::metadata(zero.path("f")).unwrap().len(), 10, "TTL 0");
    // Files being written: TTL 0 (the size grows as written), even on an indefinite mount.
    let mut w = writing(&forever.path("w"), &[1; 100]);
    assert_eq!(fs::metadata(forever.path("w")).unwrap().len(), 100);
    w.write_all(&[2; 50]).unwrap();
    assert_eq!(fs::metadata(forever.path("w")).unwrap().len(), 150);
}

fn listing(c: &Ctx) {
    let p = c.prefix(&[("d/b", b"b")]);
    let m = c.mount(&p, |cfg| cfg.metadata_ttl = MetadataTtl::Indefinite);
    assert_eq!(names(&m.path("d")), [("b".into(), false)]);
    c.put(&p, "d/a", b"a");
    assert_eq!(names(&m.path("d")), [("b".into(), false)], "cached listing");
    // A change through this mount drops the cached listing; local entries are merged; by name.
    fs::write(m.path("d/c"), b"c").unwrap();
    fs::create_dir(m.path("d/B")).unwrap();
    let mut w = writing(&m.path("d/_"), b"w");
    assert_eq!(
        names(&m.path("d")),
        [
            ("B".into(), true),
            ("_".into(), false),
            ("a".into(), false),
            ("b".into(), false),
            ("c".into(), false)
        ]
    );
    w.flush().unwrap();
    drop(w);
    // Unlink shows at once.
    fs::remove_file(m.path("d/a")).unwrap();
    assert_eq!(names(&m.path("d")).len(), 4);

    // A directory of three pages is listed with several LISTs in flight (ranges guessed from
    // the names of the first page): the same entries as one listing page by page, in order,
    // subdirectories (common prefixes) inside the guessed ranges included.
    let p = c.env.fresh_prefix("sem-pages");
    let mut keys: Vec<String> = (0..2300).map(|i| format!("f-{i:05}")).collect();
    keys.extend(["f-01000x/y", "f-01999x/y/z", "f-02999x/y", "g/1", "a b"].map(String::from));
    let store = c.env.store.clone();
    c.env.rt.block_on(async {
        for chunk in keys.chunks(64) {
            let puts = chunk.iter().map(|k| {
                let key = format!("{p}{k}");
                let store = store.clone();
                async move {
                    store
                        .put(BUCKET, &key, bytes::Bytes::from_static(b"x"))
                        .await
                }
            });
            for r in futures::future::join_all(puts).await {
                r.unwrap();
            }
        }
    });
    let m = c.mount(&p, |_| {});
    let mut want: Vec<(String, bool)> = keys
        .iter()
        .map(|k| match k.split_once('/') {
            Some((d, _)) => (d.to_owned(), true),
            None => (k.clone(), false),
        })
        .collect();
    want.sort();
    want.dedup();
    assert_eq!(names(&m.path("")), want, "a listing of 3 pages");
}

fn kernel_dir_cache(c: &Ctx) {
    let files: Vec<String> = (0..300).map(|i| format!("d/f{i:03}")).collect();
    let objs: Vec<(&str, &[u8])> = files.iter().map(|k| (k.as_str(), &b"x"[..])).collect();
    let p = c.prefix(&objs);
    // READDIR and READDIRPLUS requests Ferry answered, once every directory handle opened so
    // far is released (the kernel releases a handle after its last `readdir` was answered). An
    // answer is counted just after it is sent, on the runtime thread that sent it: each of the
    // mount's 2 worker threads may not have counted its last one yet (`LATE`). A listing Ferry
    // answers costs at least 2 (entries, then the end), so 3 of them cost more than `LATE`.
    const LATE: f64 = 2.0;
    let op = |name: &str| common::metric("ferry_fuse_operations_total", &format!("op=\"{name}\""));
    let dir_reads = || {
        common::wait_until("every directory handle released", || {
            op("opendir") == op("releasedir")
        });
        op("readdir") + op("readdirplus")
    };
    // A dataset mount (read-only, metadata for the mount's life): the first listing fills the
    // kernel's cache, and every later one is the kernel's alone.
    let ro = c.mount(&p, |cfg| {
        cfg.read_only = true;
        cfg.metadata_ttl = MetadataTtl::Indefinite;
    });
    // Three more listings of `dir`, each `want`, answered by the kernel alone.
    let kept = |dir: &Path, want: &[(String, bool)], what: &str| {
        let before = dir_reads();
        for _ in 0..3 {
            assert_eq!(names(dir), want, "{what}");
        }
        let after = dir_reads();
        assert!(
            after <= before + LATE,
            "{what}: READDIRs reached Ferry ({before} → {after})"
        );
    };
    let first = names(&ro.path("d"));
    assert_eq!(first.len(), 300);
    kept(&ro.path("d"), &first, "read-only");
    // A writable one with the same TTL: a change through it shows at once, and the listing
    // after it is cached again.
    let rw = c.mount(&p, |cfg| cfg.metadata_ttl = MetadataTtl::Indefinite);
    assert_eq!(names(&rw.path("d")), first);
    fs::write(rw.path("d/new"), b"n").unwrap();
    let changed = names(&rw.path("d"));
    assert_eq!(changed.len(), 301);
    assert!(changed.contains(&("new".into(), false)));
    let _ = names(&rw.path("d"));
    kept(&rw.path("d"), &changed, "writable, after a change");
    // A mount with a TTL: kept within it too.
    let ttl = c.mount(&p, |cfg| {
        cfg.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(60))
    });
    let listed = names(&ttl.path("d"));
    assert_eq!(listed.len(), 301);
    kept(&ttl.path("d"), &listed, "within the TTL");
    // At the TTL's end the kernel is told to drop it: a stream held open and rewound then
    // lists afresh, and sees what was put meanwhile.
    let short = c.mount(&p, |cfg| {
        cfg.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(2))
    });
    let held = HeldDir::open(&short.path("d"));
    assert_eq!(held.rewound().len(), 301);
    assert_eq!(held.rewound().len(), 301);
    c.put(&p, "d/late", b"l");
    common::wait_until(
        "a held stream, rewound, sees an object put after its TTL",
        || held.rewound().contains(&"late".to_string()),
    );
    assert_eq!(names(&short.path("d")).len(), 302);
}

/// A directory stream held open (`opendir(3)`), read again from its start (`rewinddir(3)`).
struct HeldDir(*mut libc::DIR);

impl HeldDir {
    fn open(dir: &Path) -> Self {
        let path = CString::new(dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid C string; the stream is closed on drop.
        let d = unsafe { libc::opendir(path.as_ptr()) };
        assert!(!d.is_null(), "opendir {}", dir.display());
        HeldDir(d)
    }

    /// Every name but `.` and `..`, from the start.
    fn rewound(&self) -> Vec<String> {
        let mut out = Vec::new();
        // SAFETY: the stream is open; each entry is read before the next readdir.
        unsafe {
            libc::rewinddir(self.0);
            loop {
                let e = libc::readdir(self.0);
                if e.is_null() {
                    break;
                }
                let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr());
                let name = name.to_string_lossy().into_owned();
                if name != "." && name != ".." {
                    out.push(name);
                }
            }
        }
        out
    }
}

impl Drop for HeldDir {
    fn drop(&mut self) {
        // SAFETY: opened in `open`, closed once.
        unsafe { libc::closedir(self.0) };
    }
}

fn lookup(c: &Ctx) {
    let files: Vec<(String, Vec<u8>)> =
        (0..5).map(|i| (format!("many/f{i}"), vec![i; 3])).collect();
    let objs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_slice()))
        .collect();
    let p = c.prefix(&objs);
    c.put(&p, "dir/x", b"x");
    let m = c.mount(&p, |cfg| cfg.metadata_ttl = MetadataTtl::Indefinite);
    // The root's listing first: a lookup in a directory with no listing starts a background
    // probe of it once the lookup is answered, and that LIST may reach the server at any time
    // after (it is not what this check counts).
    let _ = names(&m.path(""));
    // `ls -la`: no request per entry after the listing.
    let _ = names(&m.path("many"));
    let before = c.proxy.requests();
    for i in 0..5 {
        assert_eq!(
            fs::symlink_metadata(m.path(&format!("many/f{i}")))
                .unwrap()
                .len(),
            3
        );
    }
    assert_eq!(
        c.proxy.requests(),
        before,
        "stat after readdir asks S3 nothing"
    );
    // Negative cache.
    assert_eq!(errno(fs::metadata(m.path("late"))), libc::ENOENT);
    c.put(&p, "late", b"l");
    assert_eq!(
        errno(fs::metadata(m.path("late"))),
        libc::ENOENT,
        "miss remembered"
    );
    // A non-empty LIST means directory even if the HEAD fails.
    let zero = c.mount(&p, |_| {});
    c.proxy
        .set_plan(Some(FaultPlan::always(&["HEAD"], Fault::InternalError)));
    assert!(fs::metadata(zero.path("dir")).unwrap().is_dir());
    // A failed LIST fails the lookup.
    c.proxy
        .set_plan(Some(FaultPlan::always(&["GET"], Fault::InternalError)));
    assert_eq!(errno(fs::metadata(zero.path("other"))), libc::EIO);
}

fn getattr(c: &Ctx) {
    let p = c.prefix(&[("d/f", b"12345")]);
    let m = c.mount(&p, |_| {});
    let dir = File::open(m.path("d")).unwrap();
    let file = File::open(m.path("d/f")).unwrap();
    c.proxy.set_plan(Some(FaultPlan::always(
        &["GET", "HEAD"],
        Fault::InternalError,
    )));
    assert!(dir.metadata().unwrap().is_dir(), "directories: from memory");
    assert_eq!(errno(file.metadata()), libc::EIO, "files: HEAD (TTL 0)");
    c.proxy.set_plan(None);
    assert_eq!(file.metadata().unwrap().len(), 5);
    c.delete(&p, "d/f");
    assert_eq!(errno(file.metadata()), libc::ENOENT, "404 → ENOENT");
}

fn changes_by_others(c: &Ctx) {
    let p = c.prefix(&[("f", b"old")]);
    let zero = c.mount(&p, |_| {});
    let forever = c.mount(&p, |cfg| cfg.metadata_ttl = MetadataTtl::Indefinite);
    let minute = c.mount(&p, |cfg| {
        cfg.metadata_ttl = MetadataTtl::Duration(Duration::from_secs(60))
    });
    assert_eq!(fs::read(zero.path("f")).unwrap(), b"old");
    assert_eq!(fs::read(forever.path("f")).unwrap(), b"old");
    assert_eq!(sorted_names(&forever.root), [("f".into(), false)]);
    assert_eq!(sorted_names(&minute.root), [("f".into(), false)]);
    c.put(&p, "f", b"newer");
    c.put(&p, "g", b"g");
    assert_eq!(
        fs::read(zero.path("f")).unwrap(),
        b"newer",
        "TTL 0: at once"
    );
    assert!(fs::metadata(zero.path("g")).is_ok());
    assert_eq!(
        fs::metadata(forever.path("f")).unwrap().len(),
        3,
        "indefinite: never"
    );
    assert_eq!(sorted_names(&forever.root), [("f".into(), false)]);
    // A name the kept listing lacks: ENOENT with no request on the indefinite mount; the mount
    // with a TTL looks it up in S3 and finds it.
    let before = c.proxy.requests();
    assert_eq!(errno(fs::metadata(forever.path("g"))), libc::ENOENT);
    assert_eq!(
        errno(fs::metadata(forever.path("__init__.py"))),
        libc::ENOENT
    );
    assert_eq!(c.proxy.requests(), before, "indefinite: no request");
    assert_eq!(fs::metadata(minute.path("g")).unwrap().len(), 1);
    // Once the kernel's pages of the old version are gone, its read is refused by S3 (ESTALE);
    // an open that then learns the grown version reads it whole: never its bytes cut at the old
    // version's size.
    drop_pages(&forever.path("f"));
    assert_eq!(errno(fs::read(forever.path("f"))), libc::ESTALE);
    assert_eq!(fs::read(forever.path("f")).unwrap(), b"newer");
    assert_eq!(fs::metadata(forever.path("f")).unwrap().len(), 5);
}

/// Drops the kernel's cached pages of file `p` (an open in the mount's kept metadata, which
/// costs no request, and `POSIX_FADV_DONTNEED`).
fn drop_pages(p: &Path) {
    let f = File::open(p).unwrap();
    // SAFETY: a descriptor we own, the whole file.
    assert_eq!(
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) },
        0
    );
}

// ---------------------------------------------------------------------------------------------
// Operations

fn op_lookup(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    assert_eq!(errno(fs::metadata(m.path("nope"))), libc::ENOENT);
    assert_eq!(errno(fs::metadata(m.path("f/x"))), libc::ENOTDIR);
    assert_eq!(
        errno(fs::metadata(m.path(&"n".repeat(256)))),
        libc::ENAMETOOLONG
    );
}

fn op_readdir(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    assert_eq!(errno(fs::read_dir(m.path("f"))), libc::ENOTDIR);
}

fn op_open_rdonly(c: &Ctx) {
    let p = c.prefix(&[("f", b"f"), ("d/g", b"g")]);
    let m = c.mount(&p, |_| {});
    assert_eq!(errno(File::open(m.path("nope"))), libc::ENOENT);
    assert_eq!(
        errno(OpenOptions::new().write(true).open(m.path("d"))),
        libc::EISDIR
    );
    let _w = writing(&m.path("w"), b"w");
    assert_eq!(errno(File::open(m.path("w"))), libc::EBUSY, "being written");
    // The ETag is pinned at open: a new version behind the handle is ESTALE, not a mix.
    let f = File::open(m.path("f")).unwrap();
    c.put(&p, "f", b"other");
    let mut buf = [0u8; 5];
    assert_eq!(errno(f.read_at(&mut buf, 0)), libc::ESTALE);
    // The page cache is kept only for the same ETag: a new version of the same size is read
    // anew, not served from the pages of the old one.
    c.put(&p, "k", b"aaaa");
    assert_eq!(fs::read(m.path("k")).unwrap(), b"aaaa");
    assert_eq!(fs::read(m.path("k")).unwrap(), b"aaaa");
    c.put(&p, "k", b"bbbb");
    assert_eq!(fs::read(m.path("k")).unwrap(), b"bbbb", "no stale pages");
}

fn op_read(c: &Ctx) {
    let big: Vec<u8> = (0..3u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u8)
        .collect();
    let p = c.prefix(&[("big", &big), ("del", b"del"), ("short", &[7; 100_000])]);
    let m = c.mount(&p, |_| {});
    assert!(fs::read(m.path("big")).unwrap() == big, "sequential read");
    let f = File::open(m.path("big")).unwrap();
    for off in [2_000_000u64, 17, 1_500_000, 3_000_000] {
        let mut buf = vec![0u8; 100_000];
        let n = f.read_at(&mut buf, off).unwrap();
        assert!(
            buf[..n] == big[off as usize..off as usize + n],
            "random read at {off}"
        );
    }
    // Deleted under an open handle: ESTALE.
    let d = File::open(m.path("del")).unwrap();
    c.delete(&p, "del");
    let mut buf = [0u8; 3];
    assert_eq!(errno(d.read_at(&mut buf, 0)), libc::ESTALE);
    // A read on a write handle: EBADF.
    let mut w = writing(&m.path("w"), b"abc");
    assert_eq!(errno(w.read(&mut buf)), libc::EBADF);
    // Without an ETag (a file put in versitygw's directory behind its back has none), reads are
    // pinned to Last-Modified and size: an overwrite under an open handle is ESTALE, never bytes
    // of the new version after bytes of the old one.
    // 24 MiB: the read after the overwrite, at 20 MiB, is past what the first read's prefetch
    // may have fetched of the old version before the overwrite (a stream's window: 8 MiB).
    let file = c.env.server.root().join(BUCKET).join(format!("{p}noetag"));
    let old_time = SystemTime::now() - Duration::from_secs(100);
    let put_behind = |byte: u8, time: SystemTime| {
        fs::write(&file, vec![byte; 24 << 20]).unwrap();
        File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(time)
            .unwrap();
    };
    put_behind(1, old_time);
    let head = c.env.rt.block_on(c.s3.head(BUCKET, &format!("{p}noetag")));
    assert_eq!(
        head.unwrap().etag,
        None,
        "the server must send no ETag here"
    );
    let f = File::open(m.path("noetag")).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    assert_eq!(f.read_at(&mut buf, 0).unwrap(), 1 << 20);
    assert!(buf.iter().all(|&b| b == 1), "the old version");
    put_behind(2, SystemTime::now());
    assert_eq!(
        errno(f.read_exact_at(&mut buf, 20 << 20)),
        libc::ESTALE,
        "a read after an overwrite of an object without an ETag"
    );
    drop(f);
    let mut fresh = File::open(m.path("noetag")).unwrap();
    let mut all = Vec::new();
    fresh.read_to_end(&mut all).unwrap();
    assert!(
        all.len() == 24 << 20 && all.iter().all(|&b| b == 2),
        "a new open reads the new version"
    );
    // versitygw lists such a file with an empty ETag: no ETag either, never one that every
    // version shares. A small file replaced by one of the same size, listed again, is read in its
    // new version (with the empty ETag taken for one, the kernel kept the old version's pages).
    let small = c.env.server.root().join(BUCKET).join(format!("{p}ls/z"));
    fs::create_dir_all(small.parent().unwrap()).unwrap();
    let put_small = |byte: u8, time: SystemTime| {
        fs::write(&small, vec![byte; 3000]).unwrap();
        File::options()
            .write(true)
            .open(&small)
            .unwrap()
            .set_modified(time)
            .unwrap();
    };
    // A TTL, so that the open takes the listing's metadata (a HEAD has no ETag at all).
    let ttl = Duration::from_secs(1);
    let m1 = c.mount(&p, |c| c.metadata_ttl = MetadataTtl::Duration(ttl));
    put_small(3, old_time);
    assert_eq!(names(&m1.path("ls")).len(), 1);
    assert!(fs::read(m1.path("ls/z")).unwrap() == vec![3; 3000]);
    put_small(4, SystemTime::now());
    std::thread::sleep(ttl + Duration::from_millis(500));
    assert_eq!(names(&m1.path("ls")).len(), 1);
    assert!(
        fs::read(m1.path("ls/z")).unwrap() == vec![4; 3000],
        "an object without an ETag, replaced by one of the same size: the old bytes"
    );
    // Small files opened in listing order are fetched ahead, keyed by the listing's ETag: one
    // changed after the listing is read in its new version, never the prefetched old one.
    for i in 0..8 {
        c.put(&p, &format!("s/{i}"), format!("old {i}").as_bytes());
    }
    assert_eq!(names(&m.path("s")).len(), 8);
    for i in 0..3 {
        assert_eq!(
            fs::read(m.path(&format!("s/{i}"))).unwrap(),
            format!("old {i}").as_bytes()
        );
    }
    for i in 3..8 {
        c.put(&p, &format!("s/{i}"), format!("new {i}").as_bytes());
    }
    for i in 3..8 {
        assert_eq!(
            fs::read(m.path(&format!("s/{i}"))).unwrap(),
            format!("new {i}").as_bytes(),
            "s/{i}"
        );
    }
    // A body shorter than asked for, every time: EIO, never short data.
    let s = File::open(m.path("short")).unwrap();
    c.proxy
        .set_plan(Some(FaultPlan::always(&["GET"], Fault::ShortBody)));
    let mut buf = vec![0u8; 100_000];
    assert_eq!(errno(s.read_at(&mut buf, 0)), libc::EIO);
}

fn op_create(c: &Ctx) {
    let p = c.prefix(&[("old", b"old")]);
    let m = c.mount(&p, |_| {});
    let w = writing(&m.path("new"), b"new");
    assert_eq!(c.key(&p, "new"), None, "not in S3 before close");
    drop(w);
    assert_eq!(c.key(&p, "new").unwrap(), b"new");
    assert_eq!(
        errno(
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(m.path("old"))
        ),
        libc::EEXIST
    );
    // Without allow_overwrite, an object someone else put at the new name while it was being
    // written is kept: the close that would have replaced it is EEXIST (`If-None-Match: *`).
    let m = c.mount(&p, |cfg| cfg.allow_overwrite = false);
    let w = writing(&m.path("raced"), b"mine");
    c.put(&p, "raced", b"theirs");
    assert_eq!(errno(w.sync_all()), libc::EEXIST);
    drop(w);
    assert_eq!(c.key(&p, "raced").unwrap(), b"theirs");
}

fn op_open_write_existing(c: &Ctx) {
    let p = c.prefix(&[("f", b"old")]);
    let m = c.mount(&p, |_| {});
    let path = m.path("f");
    let open = |o: &mut OpenOptions| errno(o.open(&path));
    assert_eq!(
        open(OpenOptions::new().write(true)),
        libc::EPERM,
        "O_WRONLY"
    );
    assert_eq!(
        open(OpenOptions::new().append(true)),
        libc::EPERM,
        "O_APPEND"
    );
    assert_eq!(
        open(OpenOptions::new().read(true).write(true)),
        libc::EPERM,
        "O_RDWR"
    );
    let mut w = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    w.write_all(b"new content").unwrap();
    assert_eq!(
        c.key(&p, "f").unwrap(),
        b"old",
        "old object readable until completion"
    );
    assert_eq!(
        open(OpenOptions::new().write(true).truncate(true)),
        libc::EBUSY,
        "already being written"
    );
    drop(w);
    assert_eq!(c.key(&p, "f").unwrap(), b"new content");
    // Open for reading on this mount: not replaced beside its reader (the kernel has one size
    // and one page cache for the file), EBUSY once the reader had a second to close; the reader
    // reads its version whole.
    let r = File::open(&path).unwrap();
    let mut head = [0u8; 4];
    r.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(
        open(OpenOptions::new().write(true).truncate(true)),
        libc::EBUSY,
        "open for reading"
    );
    let mut all = Vec::new();
    (&r).read_to_end(&mut all).unwrap();
    assert_eq!(all, b"new content");
    drop(r);
    // Its last close reaches Ferry after close returned: a replacement right after waits for it.
    let mut w = OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    w.write_all(b"third").unwrap();
    drop(w);
    assert_eq!(c.key(&p, "f").unwrap(), b"third");
    let no = c.mount(&p, |cfg| cfg.allow_overwrite = false);
    assert_eq!(
        errno(
            OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(no.path("f"))
        ),
        libc::EPERM,
        "without allow_overwrite"
    );
}

fn op_write(c: &Ctx) {
    let p = c.prefix(&[("old", b"the old object")]);
    let m = c.mount(&p, |_| {});
    // Only at the end. A write elsewhere (past it: `cp` of a sparse file; in place) is EINVAL
    // and ends the upload: nothing is created or replaced, and close says EIO. Never the bytes
    // before the gap as the whole file.
    for (name, at, what) in [
        ("f", 20, "past the end"),
        ("g", 3, "in place"),
        ("old", 20, "a replacement"),
    ] {
        let w = writing(&m.path(name), b"0123456789");
        assert_eq!(errno(w.write_at(b"x", at)), libc::EINVAL, "{what}");
        assert_eq!(errno(w.write_at(b"x", 10)), libc::EIO, "{what}: then");
        let fd = w.into_raw_fd();
        // SAFETY: fd came from into_raw_fd, so nothing else closes it.
        assert_eq!(
            libc_errno(unsafe { libc::close(fd) }),
            libc::EIO,
            "{what}: close"
        );
        let kept = (name == "old").then(|| b"the old object".to_vec());
        assert_eq!(c.key(&p, name), kept, "{what}");
    }
    // O_SYNC and O_DSYNC: each write would complete the upload (an fsync); refused at the open.
    for flag in [libc::O_SYNC, libc::O_DSYNC] {
        use std::os::unix::fs::OpenOptionsExt;
        let o = OpenOptions::new()
            .write(true)
            .create(true)
            .custom_flags(flag)
            .open(m.path("s"));
        assert_eq!(errno(o), libc::EINVAL, "{flag:#o}");
        let o = OpenOptions::new()
            .write(true)
            .truncate(true)
            .custom_flags(flag)
            .open(m.path("old"));
        assert_eq!(errno(o), libc::EINVAL, "{flag:#o}: existing");
    }
    assert_eq!(c.key(&p, "s"), None);
    // Written again after the failed upload: a new file as usual.
    let w = writing(&m.path("f"), b"0123456789");
    w.write_at(b"ab", 10).unwrap();
    w.sync_all().unwrap();
    assert_eq!(c.key(&p, "f").unwrap(), b"0123456789ab");
    assert_eq!(errno(w.write_at(b"c", 12)), libc::EBADF, "after completion");
    // After a failed upload: EIO.
    let w = writing(&m.path("g"), b"g");
    c.proxy
        .set_plan(Some(FaultPlan::always(&["PUT"], Fault::InternalError)));
    assert_eq!(errno(w.sync_all()), libc::EIO);
    assert_eq!(errno(w.write_at(b"h", 1)), libc::EIO);
}

fn op_close(c: &Ctx) {
    let p = c.prefix(&[("ckpt", b"the good checkpoint")]);
    let m = c.mount(&p, |_| {});
    // A process killed mid-file: the kernel closes its files with the flush a close sends.
    // Killed (`kill -9`, or SIGTERM's default action): nothing committed, a replaced object
    // kept. Exited without closing: completed, as a close would have.
    let run = |name: &str, end: &str| {
        let status = std::process::Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import os, signal, sys\n\
                 fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n\
                 os.write(fd, bytes(100000))\n\
                 {end}"
            ))
            .arg(m.path(name))
            .status()
            .expect("python3 runs the writer");
        status.code()
    };
    let kill = "os.kill(os.getpid(), signal.SIGKILL)";
    assert_eq!(run("ckpt", kill), None, "killed by a signal");
    assert_eq!(c.key(&p, "ckpt").unwrap(), b"the good checkpoint");
    assert_eq!(run("cut", kill), None);
    assert_eq!(c.key(&p, "cut"), None, "no truncated object");
    assert_eq!(run("termed", "os.kill(os.getpid(), signal.SIGTERM)"), None);
    assert_eq!(c.key(&p, "termed"), None);
    assert_eq!(run("exited", "os._exit(0)"), Some(0));
    assert_eq!(c.key(&p, "exited").unwrap().len(), 100000);
    // Replaced by another program: `execve` closes the (close-on-exec) file while it holds a lock
    // that reading the process's /proc stat waits for; completed, never a hang.
    assert_eq!(run("execed", "os.execv('/bin/true', ['true'])"), Some(0));
    assert_eq!(c.key(&p, "execed").unwrap().len(), 100000);
    // A shell builtin with a redirection `dup2`s the file over a descriptor and puts the old one
    // back, which closes one copy while the shell holds another: the file goes on, and is
    // complete when the shell closes its last copy (or exits).
    let sh = |name: &str, script: &str| {
        let status = std::process::Command::new("bash")
            .arg("-c")
            .arg(script)
            .arg("sh")
            .arg(m.path(name))
            .status()
            .expect("bash runs the writer");
        status.code()
    };
    let fd3 = "exec 3>\"$1\"; echo one >&3; echo two >&3; exec 3>&-; echo three >&3";
    assert_eq!(sh("fd3", fd3), Some(1), "written to a closed descriptor");
    assert_eq!(c.key(&p, "fd3").unwrap(), b"one\ntwo\n");
    let log = "exec >\"$1\" 2>&1; echo one; echo two >&2; echo three";
    assert_eq!(sh("log", log), Some(0));
    assert_eq!(c.key(&p, "log").unwrap(), b"one\ntwo\nthree\n");
    // Closed with nothing written (completed at the last close, which reaches Ferry a moment
    // after close returned): removed or opened at once, as `tempfile` and lock files do.
    for i in 0..5 {
        let name = format!("tmp{i}");
        drop(File::create(m.path(&name)).unwrap());
        fs::remove_file(m.path(&name)).unwrap();
        drop(File::create(m.path(&name)).unwrap());
        assert_eq!(fs::read(m.path(&name)).unwrap(), b"");
    }
    // Visible when close returns.
    let w = writing(&m.path("f"), b"data");
    drop(w);
    assert_eq!(c.key(&p, "f").unwrap(), b"data");
    // A child closing an inherited descriptor does not complete the upload.
    let mut w = writing(&m.path("g"), b"first ");
    let fd = w.as_raw_fd();
    // SAFETY: fd is a descriptor we own; clearing FD_CLOEXEC only lets the child inherit it.
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    let st = std::process::Command::new("true").status().unwrap();
    assert!(st.success());
    assert_eq!(c.key(&p, "g"), None, "the child's flush did nothing");
    w.write_all(b"second").unwrap();
    // Upload errors are close's.
    c.proxy
        .set_plan(Some(FaultPlan::always(&["PUT"], Fault::InternalError)));
    let fd = w.into_raw_fd();
    // SAFETY: fd came from into_raw_fd, so nothing else closes it.
    assert_eq!(libc_errno(unsafe { libc::close(fd) }), libc::EIO);
    c.proxy.set_plan(None);
    let w = writing(&m.path("g"), b"first second");
    let fd = w.into_raw_fd();
    // SAFETY: as above.
    assert_eq!(libc_errno(unsafe { libc::close(fd) }), 0);
    assert_eq!(c.key(&p, "g").unwrap(), b"first second");
    // A read-only open is closed without a FLUSH request (FOPEN_NOFLUSH); a write handle's close
    // sends one. (The checks run one at a time, so the process-wide count is this mount's.) An
    // operation is counted just after its reply: the write handle's FLUSH is awaited, and one
    // from the read-only close, counted long before it (that close needs no PUT), would show.
    let flushes = || common::metric("ferry_fuse_operations_total", "op=\"flush\"");
    let before = flushes();
    assert_eq!(fs::read(m.path("g")).unwrap(), b"first second");
    drop(writing(&m.path("h"), b"h"));
    common::wait_until("the write handle's FLUSH counted", || flushes() > before);
    assert_eq!(
        flushes(),
        before + 1.0,
        "one FLUSH: none for the read-only close"
    );
    // A close before anything was written completes nothing: the way shells redirect (open, dup2
    // onto stdout, close the first descriptor, then write) works.
    let f = File::create(m.path("dup")).unwrap();
    // SAFETY: dup of a descriptor we own; the new one is owned by the File made from it.
    let mut out =
        unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(libc::dup(f.as_raw_fd())) };
    drop(f);
    assert_eq!(c.key(&p, "dup"), None, "not completed by the first close");
    out.write_all(b"through the duplicate").unwrap();
    drop(out);
    assert_eq!(c.key(&p, "dup").unwrap(), b"through the duplicate");
    shell_writes(c);
}

/// What shells, coreutils, rsync and Python do to write a file, each through a real mount.
fn shell_writes(c: &Ctx) {
    let p = c.prefix(&[("old", b"old content")]);
    let m = c.mount(&p, |_| {});
    let src = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    fs::write(src.path().join("src"), &data).unwrap();
    let run = |script: &str| {
        let out = std::process::Command::new("bash")
            .arg("-c")
            .arg(script)
            .current_dir(&m.root)
            .env("SRC", src.path().join("src"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{script}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let cases: &[(&str, &str, &[u8])] = &[
        ("builtin", "echo hi > builtin", b"hi\n"),
        ("binecho", "/bin/echo hi > binecho", b"hi\n"),
        ("sh", "sh -c 'echo dash > sh'", b"dash\n"),
        ("old", "echo replaced > old", b"replaced\n"),
        ("append", "echo more >> append", b"more\n"),
        ("group", "{ echo a; echo b; } > group", b"a\nb\n"),
        ("tee", "printf 'x\\ny\\n' | tee tee > /dev/null", b"x\ny\n"),
        ("dd", "printf abc | dd of=dd status=none", b"abc"),
        (
            "python",
            "python3 -c \"open('python', 'w').write('py')\"",
            b"py",
        ),
    ];
    for (name, script, want) in cases {
        run(script);
        assert_eq!(c.key(&p, name).as_deref(), Some(*want), "{script}");
    }
    for (name, script) in [
        ("cp", "cp \"$SRC\" cp"),
        ("dd-big", "dd if=\"$SRC\" of=dd-big bs=4096 status=none"),
        ("rsync-inplace", "rsync --inplace \"$SRC\" rsync-inplace"),
        // Default rsync writes a temporary file and renames it; S3 has no rename (EXDEV), and
        // rsync then copies it over and deletes the temporary file.
        ("rsync", "rsync \"$SRC\" rsync"),
    ] {
        run(script);
        assert!(c.key(&p, name).unwrap() == data, "{script}");
    }
    assert_eq!(
        c.env.keys(&p),
        [
            "append",
            "binecho",
            "builtin",
            "cp",
            "dd",
            "dd-big",
            "group",
            "old",
            "python",
            "rsync",
            "rsync-inplace",
            "sh",
            "tee"
        ],
        "no temporary file left behind"
    );
    // Nothing written: the empty object is completed at the last close (`release`), which the
    // kernel sends without waiting: it appears a moment after the command returns.
    run(": > empty");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while c.key(&p, "empty").is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the empty file never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.key(&p, "empty").unwrap(), b"");
}

fn op_fsync(c: &Ctx) {
    let p = c.prefix(&[("r", b"r")]);
    let m = c.mount(&p, |_| {});
    let w = writing(&m.path("f"), b"synced");
    w.sync_all().unwrap();
    assert_eq!(c.key(&p, "f").unwrap(), b"synced", "complete before close");
    File::open(m.path("r")).unwrap().sync_all().unwrap();
}

fn op_failed_upload(c: &Ctx) {
    let p = c.prefix(&[("old", b"old")]);
    let m = c.mount(&p, |_| {});
    c.proxy.set_plan(Some(FaultPlan::always(
        &["PUT", "POST"],
        Fault::InternalError,
    )));
    for name in ["new", "old"] {
        let w = writing(&m.path(name), b"doomed");
        assert_eq!(errno(w.sync_all()), libc::EIO);
    }
    c.proxy.set_plan(None);
    assert_eq!(
        errno(fs::metadata(m.path("new"))),
        libc::ENOENT,
        "new file gone"
    );
    assert_eq!(fs::read(m.path("old")).unwrap(), b"old", "old content kept");
    assert_eq!(c.key(&p, "new"), None);
}

fn op_truncate(c: &Ctx) {
    let p = c.prefix(&[("f", b"12345"), ("d/x", b"x")]);
    let m = c.mount(&p, |_| {});
    let trunc = |k: &str, len: i64| {
        // SAFETY: a valid NUL-terminated path.
        libc_errno(unsafe { libc::truncate(cstr(&m.path(k)).as_ptr(), len) })
    };
    assert_eq!(trunc("f", 5), 0, "same size: no-op");
    assert_eq!(trunc("f", 2), libc::EPERM);
    assert_eq!(trunc("d", 0), libc::EISDIR);
    let w = writing(&m.path("w"), b"abc");
    assert_eq!(errno(w.set_len(1)), libc::EINVAL);
    w.set_len(0).unwrap();
    // From offset 0 again (the descriptor's offset is still 3: a write there would be a hole,
    // which ends the upload).
    w.write_at(b"xy", 0).unwrap();
    drop(w);
    assert_eq!(c.key(&p, "w").unwrap(), b"xy", "truncate to 0 restarts");
}

fn op_chmod_chown(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    let f = m.path("f");
    fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        errno(fs::set_permissions(&f, fs::Permissions::from_mode(0o600))),
        libc::EPERM
    );
    let uid = common::my_uid();
    std::os::unix::fs::chown(&f, Some(uid), Some(0)).unwrap();
    assert_eq!(
        errno(std::os::unix::fs::chown(&f, Some(uid + 1), None)),
        libc::EPERM
    );
    assert_eq!(
        errno(std::os::unix::fs::chown(&f, None, Some(1))),
        libc::EPERM
    );
}

fn op_utimes(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    let before = fs::metadata(m.path("f")).unwrap().mtime();
    let f = File::options()
        .write(false)
        .read(true)
        .open(m.path("f"))
        .unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000))
        .unwrap();
    assert_eq!(
        fs::metadata(m.path("f")).unwrap().mtime(),
        before,
        "not stored"
    );
}

fn op_mkdir(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    fs::create_dir(m.path("d")).unwrap();
    assert!(fs::metadata(m.path("d")).unwrap().is_dir());
    assert_eq!(errno(fs::create_dir(m.path("d"))), libc::EEXIST);
    assert_eq!(errno(fs::create_dir(m.path("f"))), libc::EEXIST);
    assert_eq!(c.env.keys(&p), ["f"], "no marker written");
    let other = c.mount(&p, |_| {});
    assert_eq!(
        errno(fs::metadata(other.path("d"))),
        libc::ENOENT,
        "this mount only"
    );
    fs::create_dir(m.path("e")).unwrap();
    fs::write(m.path("e/x"), b"x").unwrap();
    assert!(
        fs::metadata(other.path("e")).unwrap().is_dir(),
        "real once a file is in it"
    );
    m.unmount();
    let again = c.mount(&p, |_| {});
    assert_eq!(
        errno(fs::metadata(again.path("d"))),
        libc::ENOENT,
        "lost at unmount"
    );
}

fn op_unlink(c: &Ctx) {
    let p = c.prefix(&[("f", b"f"), ("d/only", b"o"), ("g", b"g"), ("n/e/st", b"n")]);
    let no = c.mount(&p, |cfg| cfg.allow_delete = false);
    assert_eq!(errno(fs::remove_file(no.path("f"))), libc::EPERM);
    let m = c.mount(&p, |_| {});
    fs::remove_file(m.path("f")).unwrap();
    assert_eq!(c.key(&p, "f"), None);
    assert_eq!(errno(fs::remove_file(m.path("f"))), libc::ENOENT);
    assert_eq!(errno(fs::remove_file(m.path("d"))), libc::EISDIR);
    let _w = writing(&m.path("w"), b"w");
    assert_eq!(errno(fs::remove_file(m.path("w"))), libc::EBUSY);
    fs::remove_file(m.path("d/only")).unwrap();
    assert!(fs::metadata(m.path("d")).unwrap().is_dir(), "parent stays");
    fs::remove_dir(m.path("d")).unwrap();
    // Ancestors that held nothing else stay too.
    fs::remove_file(m.path("n/e/st")).unwrap();
    assert!(
        fs::metadata(m.path("n")).unwrap().is_dir(),
        "grandparent stays"
    );
    assert_eq!(names(&m.path("n")), [("e".into(), true)]);
    assert_eq!(errno(fs::remove_dir(m.path("n"))), libc::ENOTEMPTY);
    fs::remove_dir(m.path("n/e")).unwrap();
    fs::remove_dir(m.path("n")).unwrap();
    // Open read handles then get ESTALE.
    let g = File::open(m.path("g")).unwrap();
    fs::remove_file(m.path("g")).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(errno(g.read_at(&mut buf, 0)), libc::ESTALE);
}

fn op_rmdir(c: &Ctx) {
    let p = c.prefix(&[("full/x", b"x"), ("m/", b""), ("f", b"f")]);
    let no = c.mount(&p, |cfg| cfg.allow_delete = false);
    assert_eq!(errno(fs::remove_dir(no.path("m"))), libc::EPERM);
    assert_eq!(c.key(&p, "m/").unwrap(), b"", "the marker stays");
    // A directory only this mount made, still empty: removed without allow_delete (nothing in S3
    // to delete; a mistyped mkdir is undone).
    fs::create_dir(no.path("typo")).unwrap();
    fs::remove_dir(no.path("typo")).unwrap();
    assert_eq!(errno(fs::metadata(no.path("typo"))), libc::ENOENT);
    let m = c.mount(&p, |_| {});
    assert_eq!(errno(fs::remove_dir(m.path("full"))), libc::ENOTEMPTY);
    assert_eq!(errno(fs::remove_dir(m.path("f"))), libc::ENOTDIR);
    fs::remove_dir(m.path("m")).unwrap();
    assert_eq!(c.key(&p, "m/"), None, "marker deleted");
    // The parent of the last directory removed stays.
    c.put(&p, "up/m/", b"");
    fs::remove_dir(m.path("up/m")).unwrap();
    assert!(fs::metadata(m.path("up")).unwrap().is_dir(), "parent stays");
    fs::remove_dir(m.path("up")).unwrap();
    fs::create_dir(m.path("l")).unwrap();
    fs::create_dir(m.path("l/sub")).unwrap();
    assert_eq!(
        errno(fs::remove_dir(m.path("l"))),
        libc::ENOTEMPTY,
        "local entries"
    );
    // Hidden keys count (a MemoryStore: versitygw cannot hold `h/a//b`).
    let (_mem, mm) = c.memory_mount(&[("h/a//b", b"x")]);
    assert!(names(&mm.path("h/a")).is_empty());
    assert_eq!(errno(fs::remove_dir(mm.path("h/a"))), libc::ENOTEMPTY);
}

fn op_rename(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    assert_eq!(errno(fs::rename(m.path("f"), m.path("g"))), libc::EXDEV);
    // Without allow_delete, mv's copy + delete would upload the copy and then fail to delete:
    // refused before the copy.
    let keep = c.mount(&p, |cfg| cfg.allow_delete = false);
    let mv = std::process::Command::new("mv")
        .arg(keep.path("f"))
        .arg(keep.path("g"))
        .status();
    assert!(!mv.unwrap().success());
    assert_eq!(
        errno(fs::rename(keep.path("f"), keep.path("g"))),
        libc::EPERM
    );
    assert_eq!(c.key(&p, "g"), None, "no copy uploaded");
    assert_eq!(c.key(&p, "f").unwrap(), b"f");
    let ro = c.mount(&p, |cfg| cfg.read_only = true);
    assert_eq!(errno(fs::rename(ro.path("f"), ro.path("g"))), libc::EROFS);
}

fn op_link_symlink_mknod(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    for (ro, want) in [(false, libc::EPERM), (true, libc::EROFS)] {
        let m = c.mount(&p, |cfg| cfg.read_only = ro);
        assert_eq!(errno(fs::hard_link(m.path("f"), m.path("l"))), want, "link");
        assert_eq!(
            errno(std::os::unix::fs::symlink("f", m.path("s"))),
            want,
            "symlink"
        );
        // SAFETY: a valid NUL-terminated path.
        let r = unsafe { libc::mknod(cstr(&m.path("n")).as_ptr(), libc::S_IFIFO | 0o644, 0) };
        assert_eq!(libc_errno(r), want, "mknod");
    }
}

fn op_unsupported_quietly(c: &Ctx) {
    let p = c.prefix(&[("f", b"data")]);
    let m = c.mount(&p, |_| {});
    let f = File::open(m.path("f")).unwrap();
    let mut termios = std::mem::MaybeUninit::<libc::termios>::uninit();
    // SAFETY: TCGETS writes one termios into the buffer given, or fails.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::TCGETS, termios.as_mut_ptr()) };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOTTY),
        "ioctl"
    );
    let w = File::create(m.path("g")).unwrap();
    for _ in 0..2 {
        // SAFETY: a valid descriptor; fallocate only asks the filesystem.
        let r = unsafe { libc::fallocate(w.as_raw_fd(), 0, 0, 4096) };
        assert_eq!(r, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EOPNOTSUPP),
            "fallocate"
        );
    }
    drop(w);
    // SEEK_DATA falls back to the generic one: data starts at 0.
    // SAFETY: a valid descriptor.
    assert_eq!(unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_DATA) }, 0);
    let out = m.path("copy");
    // The kernel copies itself (or says EXDEV/ENOSYS, and `cp` copies by reading and writing).
    let copied = {
        let o = File::create(&out).unwrap();
        // SAFETY: valid descriptors and null offsets (the files' own positions are used).
        let n = unsafe {
            libc::copy_file_range(
                f.as_raw_fd(),
                std::ptr::null_mut(),
                o.as_raw_fd(),
                std::ptr::null_mut(),
                4,
                0,
            )
        };
        (n, std::io::Error::last_os_error().raw_os_error())
    };
    assert!(
        copied.0 == 4 || copied.1 == Some(libc::EXDEV) || copied.1 == Some(libc::ENOSYS),
        "copy_file_range: {copied:?}"
    );
}

fn op_xattrs(c: &Ctx) {
    let p = c.prefix(&[("f", b"f")]);
    let m = c.mount(&p, |_| {});
    let path = cstr(&m.path("f"));
    let name = CString::new("user.x").unwrap();
    let mut buf = [0u8; 16];
    // The kernel turns the ENOSYS into EOPNOTSUPP (and stops asking).
    for _ in 0..2 {
        // SAFETY: valid C strings and a buffer of the given length.
        let r = unsafe {
            libc::getxattr(
                path.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert_eq!(r, -1);
        assert_eq!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EOPNOTSUPP)
        );
    }
    // SAFETY: as above.
    let r = unsafe { libc::setxattr(path.as_ptr(), name.as_ptr(), buf.as_ptr().cast(), 1, 0) };
    assert_eq!(libc_errno(r), libc::EOPNOTSUPP);
}

fn op_statfs(c: &Ctx) {
    let p = c.prefix(&[]);
    let m = c.mount(&p, |_| {});
    // SAFETY: statvfs is plain data; all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and a statvfs to fill.
    assert_eq!(unsafe { libc::statvfs(cstr(&m.root).as_ptr(), &mut st) }, 0);
    assert_eq!(st.f_bsize, 4096);
    assert_eq!(st.f_bfree, 1 << 40);
    assert_eq!(st.f_bavail, 1 << 40);
    assert_eq!(st.f_namemax, 255);
}

fn read_only_mount(c: &Ctx) {
    let p = c.prefix(&[("f", b"f"), ("d/x", b"x"), ("e/", b"")]);
    let m = c.mount(&p, |cfg| cfg.read_only = true);
    assert_eq!(errno(File::create(m.path("new"))), libc::EROFS);
    assert_eq!(
        errno(
            OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(m.path("f"))
        ),
        libc::EROFS
    );
    assert_eq!(errno(fs::create_dir(m.path("n"))), libc::EROFS);
    assert_eq!(errno(fs::remove_file(m.path("f"))), libc::EROFS);
    assert_eq!(errno(fs::remove_dir(m.path("e"))), libc::EROFS);
    assert_eq!(
        errno(fs::set_permissions(
            m.path("f"),
            fs::Permissions::from_mode(0o644)
        )),
        libc::EROFS
    );
    // SAFETY: a valid NUL-terminated path.
    let r = unsafe { libc::truncate(cstr(&m.path("f")).as_ptr(), 1) };
    assert_eq!(libc_errno(r), libc::EROFS);
    assert_eq!(fs::read(m.path("f")).unwrap(), b"f", "reads work");
}

// ---------------------------------------------------------------------------------------------
// Store errors → errno: a FaultyStore around the S3 store, each error injected on every GET (the
// read) or HEAD (the lookup) of one file.

fn store_error(c: &Ctx, on: Op, err: StoreError) -> i32 {
    let p = c.prefix(&[("f", &[5; 1000])]);
    let faulty = Arc::new(FaultyStore::new(c.s3.clone(), 1));
    let m = c.env.mount(faulty.clone(), &p, |cfg| {
        cfg.metadata_ttl = MetadataTtl::Duration(Duration::ZERO);
    });
    let r = match on {
        Op::Get => {
            let f = File::open(m.path("f")).unwrap();
            faulty.fail_with_probability([Op::Get], 1.0, err);
            let mut buf = [0u8; 1000];
            f.read_at(&mut buf, 0).map(|_| ())
        }
        _ => {
            faulty.fail_with_probability([on], 1.0, err);
            fs::metadata(m.path("f")).map(|_| ())
        }
    };
    faulty.clear();
    errno(r)
}

fn err_not_found(c: &Ctx) {
    let p = c.prefix(&[]);
    let m = c.mount(&p, |_| {});
    assert_eq!(errno(fs::metadata(m.path("nope"))), libc::ENOENT);
    assert_eq!(
        store_error(c, Op::Get, StoreError::NotFound("k".into())),
        libc::ESTALE,
        "read"
    );
}

fn err_access(c: &Ctx) {
    for e in [
        StoreError::AccessDenied("k".into()),
        StoreError::Credentials("k".into()),
    ] {
        assert_eq!(
            store_error(c, Op::Get, e.clone()),
            libc::EACCES,
            "{e:?} read"
        );
        assert_eq!(
            store_error(c, Op::List, e.clone()),
            libc::EACCES,
            "{e:?} lookup"
        );
    }
}

/// An identity provider that could not answer is not a refusal: `EIO`, on reads and lookups.
fn err_credentials_unavailable(c: &Ctx) {
    let e = StoreError::CredentialsUnavailable("STS unreachable".into());
    assert_eq!(store_error(c, Op::Get, e.clone()), libc::EIO, "read");
    assert_eq!(store_error(c, Op::List, e), libc::EIO, "lookup");
}

fn err_precondition(c: &Ctx) {
    let e = StoreError::PreconditionFailed("k".into());
    assert_eq!(store_error(c, Op::Get, e), libc::ESTALE);
}

fn err_invalid(c: &Ctx) {
    let e = StoreError::InvalidRequest("k".into());
    assert_eq!(store_error(c, Op::Get, e), libc::EINVAL);
}

fn err_eio(c: &Ctx) {
    let errs = [
        StoreError::Throttled("k".into()),
        StoreError::Transient("k".into()),
        StoreError::Corrupt("k".into()),
        StoreError::NoSuchBucket("k".into()),
        StoreError::Other("k".into()),
    ];
    let got: BTreeMap<String, (i32, i32)> = errs
        .iter()
        .map(|e| {
            (
                format!("{e:?}"),
                (
                    store_error(c, Op::Get, e.clone()),
                    store_error(c, Op::List, e.clone()),
                ),
            )
        })
        .collect();
    for (e, errnos) in &got {
        assert_eq!(*errnos, (libc::EIO, libc::EIO), "{e}");
    }
}
