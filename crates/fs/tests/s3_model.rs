//! Reference-model test through the whole stack: random sequences of create+write, read, list,
//! stat, unlink, mkdir, rmdir and remount, run with plain `std::fs` calls on a real FUSE mount of a
//! real S3 server (versitygw) and against a model of the bucket built from `doc/SEMANTICS.md`.
//! Results, errnos and the bucket's keys must agree after every step.
//!
//! One versitygw per test; every case (shrink runs included) seeds a fresh prefix with a few
//! objects and directory markers put behind the mount's back, then mounts it, so cases are
//! independent and shrinking works. The mount allows delete and overwrite; one test runs with a
//! metadata TTL of 0 (every lookup asks S3), the other with an indefinite TTL (nothing learned
//! from S3 expires: the doc promises that changes made through the mount show at once anyway).
//!
//! Cases: `$PROPTEST_CASES` (default 48 per test), up to 40 steps each. Steps include keeping one
//! file open for writing across other steps (it shows in listings and `stat`, is `EBUSY` to
//! open, replace or unlink, and reaches S3 at close).
//!
//! The model (SEMANTICS "Names and the tree", "Operations"): `a/b` implies directory `a`, a
//! zero-byte `d/` is a directory marker; a file is an object, visible once `close` returned;
//! `mkdir` makes a local directory that exists in S3 only once a file is written below it (no
//! marker is written); `unlink` of the last file of a directory leaves the directory in the mount
//! until `rmdir`; an unmount forgets local directories; `rmdir` of a directory with anything below
//! is `ENOTEMPTY`, else it deletes its marker. Names never collide between files and directories:
//! versitygw's posix backend cannot hold an object `a` and an object `a/b` at once, so the
//! generator keeps file and directory names apart (the file-vs-directory rule is checked in the
//! SEMANTICS test on a store that can hold both).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use common::{Env, Mount};
use ferry_fs::MetadataTtl;
use ferry_s3::{S3Options, S3Store};
use ferry_store::ObjectStore;
use ferry_testkit::{Fault, FaultPlan, FaultProxy};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// Directories, a nested one included (its parent must exist first).
const DIRS: [&str; 3] = ["d0", "d1", "d0/e"];
const FILES: [&str; 2] = ["f0", "f1"];
/// A size that takes the multipart path (more than one 8 MiB part).
const BIG: usize = 8 * 1024 * 1024 + 4321;

#[derive(Debug, Clone)]
enum Op {
    Write {
        dir: Option<usize>,
        file: usize,
        len: usize,
        seed: u8,
        chunk: usize,
    },
    Read {
        dir: Option<usize>,
        file: usize,
    },
    List {
        dir: Option<usize>,
    },
    Stat {
        dir: Option<usize>,
        file: usize,
    },
    StatDir {
        dir: usize,
    },
    Unlink {
        dir: Option<usize>,
        file: usize,
    },
    /// `unlink` of a directory.
    UnlinkDir {
        dir: usize,
    },
    Mkdir {
        dir: usize,
    },
    Rmdir {
        dir: usize,
    },
    /// Unmount and mount the same prefix again (closing the open writer first).
    Remount,
    /// Create (or truncate) a file and write `len` bytes, keeping it open: at most one such
    /// writer at a time (a second one is skipped).
    OpenWrite {
        dir: Option<usize>,
        file: usize,
        len: usize,
        seed: u8,
    },
    /// Close the open writer (skipped if there is none).
    CloseWrite,
}

fn op() -> impl Strategy<Value = Op> {
    let dir = prop::option::weighted(0.6, 0..DIRS.len());
    let file = 0..FILES.len();
    let len = prop_oneof![15 => 0..3000usize, 1 => Just(BIG)];
    prop_oneof![
        5 => (dir.clone(), file.clone(), len.clone(), any::<u8>(), 1..5000usize)
            .prop_map(|(dir, file, len, seed, chunk)| Op::Write { dir, file, len, seed, chunk }),
        3 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Read { dir, file }),
        2 => dir.clone().prop_map(|dir| Op::List { dir }),
        2 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Stat { dir, file }),
        1 => (0..DIRS.len()).prop_map(|dir| Op::StatDir { dir }),
        2 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Unlink { dir, file }),
        1 => (0..DIRS.len()).prop_map(|dir| Op::UnlinkDir { dir }),
        3 => (0..DIRS.len()).prop_map(|dir| Op::Mkdir { dir }),
        2 => (0..DIRS.len()).prop_map(|dir| Op::Rmdir { dir }),
        1 => Just(Op::Remount),
        2 => (dir.clone(), file.clone(), len.clone(), any::<u8>())
            .prop_map(|(dir, file, len, seed)| Op::OpenWrite { dir, file, len, seed }),
        2 => Just(Op::CloseWrite),
    ]
}

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2] ^ seed)
        .collect()
}

fn path(dir: Option<usize>, file: usize) -> String {
    match dir {
        Some(d) => format!("{}/{}", DIRS[d], FILES[file]),
        None => FILES[file].to_owned(),
    }
}

fn parent(dir: &str) -> Option<&str> {
    dir.rsplit_once('/').map(|(p, _)| p)
}

/// What the model and the mount must both say.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Data(Vec<u8>),
    /// Directory entries: name and whether it is a directory.
    Names(Vec<(String, bool)>),
    /// File size.
    Size(u64),
    Dir,
    Err(i32),
    /// The step did not apply (a second writer, or no writer to close).
    Skip,
}

#[derive(Default)]
struct Model {
    files: BTreeMap<String, Vec<u8>>,
    /// Directories the mount shows.
    dirs: BTreeSet<String>,
    /// Directories with a marker object (`d/`), put before the mount.
    markers: BTreeSet<String>,
    /// The file open for writing (not in S3 until closed): path and content.
    writing: Option<(String, Vec<u8>)>,
}

/// What is in the bucket before the first mount: files (path, length, seed) and markers.
#[derive(Debug, Clone)]
struct Seed {
    files: Vec<(Option<usize>, usize, usize, u8)>,
    markers: Vec<usize>,
}

fn seed() -> impl Strategy<Value = Seed> {
    (
        prop::collection::vec(
            (
                prop::option::of(0..DIRS.len()),
                0..FILES.len(),
                0..2000usize,
                any::<u8>(),
            ),
            0..3,
        ),
        prop::collection::vec(0..DIRS.len(), 0..2),
    )
        .prop_map(|(files, markers)| Seed { files, markers })
}

impl Model {
    /// The bucket holds `seed`: its files, its markers, and the directories they imply.
    fn seeded(seed: &Seed) -> Model {
        let mut m = Model::default();
        for &(dir, file, len, s) in &seed.files {
            m.files.insert(path(dir, file), bytes(len, s));
        }
        for &d in &seed.markers {
            m.markers.insert(DIRS[d].to_owned());
        }
        m.dirs = m.s3_dirs();
        m
    }

    /// The directories S3 implies: those with a file or a marker at or below them.
    fn s3_dirs(&self) -> BTreeSet<String> {
        DIRS.iter()
            .filter(|d| {
                let p = format!("{d}/");
                self.files.keys().any(|k| k.starts_with(&p))
                    || self
                        .markers
                        .iter()
                        .any(|m| m.as_str() == **d || m.starts_with(&p))
            })
            .map(|d| d.to_string())
            .collect()
    }

    /// The keys the bucket must hold.
    fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.files.keys().cloned().collect();
        k.extend(self.markers.iter().map(|m| format!("{m}/")));
        k.sort();
        k
    }

    fn dir_ok(&self, dir: Option<usize>) -> bool {
        dir.is_none_or(|d| self.dirs.contains(DIRS[d]))
    }

    fn has_below(&self, dir: &str) -> bool {
        let p = format!("{dir}/");
        self.files.keys().any(|k| k.starts_with(&p))
            || self.dirs.iter().any(|d| d.starts_with(&p))
            || self
                .writing
                .as_ref()
                .is_some_and(|(w, _)| w.starts_with(&p))
    }

    fn is_writing(&self, p: &str) -> bool {
        self.writing.as_ref().is_some_and(|(w, _)| w == p)
    }

    fn apply(&mut self, op: &Op) -> Outcome {
        use libc::{EBUSY, EEXIST, EISDIR, ENOENT, ENOTEMPTY};
        // A file being written: cannot be opened, replaced or unlinked; stat shows what was
        // written so far.
        match *op {
            Op::Write { dir, file, .. }
            | Op::Read { dir, file }
            | Op::Unlink { dir, file }
            | Op::OpenWrite { dir, file, .. }
                if self.is_writing(&path(dir, file)) =>
            {
                if matches!(op, Op::OpenWrite { .. }) {
                    return Outcome::Skip;
                }
                return Outcome::Err(EBUSY);
            }
            Op::Stat { dir, file } if self.is_writing(&path(dir, file)) => {
                return Outcome::Size(self.writing.as_ref().unwrap().1.len() as u64);
            }
            _ => {}
        }
        match *op {
            Op::OpenWrite {
                dir,
                file,
                len,
                seed,
            } => {
                if self.writing.is_some() {
                    return Outcome::Skip;
                }
                if !self.dir_ok(dir) {
                    return Outcome::Err(ENOENT);
                }
                self.writing = Some((path(dir, file), bytes(len, seed)));
                Outcome::Ok
            }
            Op::CloseWrite => match self.writing.take() {
                Some((p, data)) => {
                    self.files.insert(p, data);
                    Outcome::Ok
                }
                None => Outcome::Skip,
            },
            Op::Write {
                dir,
                file,
                len,
                seed,
                ..
            } => {
                if !self.dir_ok(dir) {
                    return Outcome::Err(ENOENT);
                }
                self.files.insert(path(dir, file), bytes(len, seed));
                Outcome::Ok
            }
            Op::Read { dir, file } => match self.files.get(&path(dir, file)) {
                Some(d) => Outcome::Data(d.clone()),
                None => Outcome::Err(ENOENT),
            },
            Op::Stat { dir, file } => match self.files.get(&path(dir, file)) {
                Some(d) => Outcome::Size(d.len() as u64),
                None => Outcome::Err(ENOENT),
            },
            Op::StatDir { dir } => {
                if self.dirs.contains(DIRS[dir]) {
                    Outcome::Dir
                } else {
                    Outcome::Err(ENOENT)
                }
            }
            Op::List { dir } => {
                if !self.dir_ok(dir) {
                    return Outcome::Err(ENOENT);
                }
                let prefix = dir.map_or(String::new(), |d| format!("{}/", DIRS[d]));
                let direct = |k: &String| {
                    k.strip_prefix(&prefix)
                        .filter(|n| !n.contains('/'))
                        .map(str::to_owned)
                };
                let writing = self.writing.iter().map(|(w, _)| w);
                let mut names: Vec<(String, bool)> = self
                    .files
                    .keys()
                    .chain(writing.filter(|w| !self.files.contains_key(*w)))
                    .filter_map(direct)
                    .map(|n| (n, false))
                    .chain(self.dirs.iter().filter_map(direct).map(|n| (n, true)))
                    .collect();
                names.sort();
                Outcome::Names(names)
            }
            Op::Unlink { dir, file } => match self.files.remove(&path(dir, file)) {
                Some(_) => Outcome::Ok,
                None => Outcome::Err(ENOENT),
            },
            Op::UnlinkDir { dir } => {
                if self.dirs.contains(DIRS[dir]) {
                    Outcome::Err(EISDIR)
                } else {
                    Outcome::Err(ENOENT)
                }
            }
            Op::Mkdir { dir } => {
                let name = DIRS[dir];
                if parent(name).is_some_and(|p| !self.dirs.contains(p)) {
                    Outcome::Err(ENOENT)
                } else if self.dirs.insert(name.to_owned()) {
                    Outcome::Ok
                } else {
                    Outcome::Err(EEXIST)
                }
            }
            Op::Rmdir { dir } => {
                let name = DIRS[dir];
                if !self.dirs.contains(name) {
                    Outcome::Err(ENOENT)
                } else if self.has_below(name) {
                    Outcome::Err(ENOTEMPTY)
                } else {
                    self.dirs.remove(name);
                    self.markers.remove(name);
                    Outcome::Ok
                }
            }
            Op::Remount => {
                if let Some((p, data)) = self.writing.take() {
                    self.files.insert(p, data);
                }
                // Local directories are gone; what S3 implies stays.
                self.dirs = self.s3_dirs();
                Outcome::Ok
            }
        }
    }
}

fn io<T>(r: std::io::Result<T>, ok: impl FnOnce(T) -> Outcome) -> Outcome {
    match r {
        Ok(v) => ok(v),
        Err(e) => Outcome::Err(e.raw_os_error().unwrap_or(-1)),
    }
}

/// Runs `op` on the mount with plain `std::fs` calls.
fn run(
    env: &Env,
    prefix: &str,
    how: &How,
    m: &mut Mount,
    writer: &mut Option<fs::File>,
    op: &Op,
) -> Outcome {
    match *op {
        Op::OpenWrite {
            dir,
            file,
            len,
            seed,
        } => {
            if writer.is_some() {
                return Outcome::Skip;
            }
            let r = fs::File::create(m.path(&path(dir, file))).and_then(|mut f| {
                f.write_all(&bytes(len, seed))?;
                Ok(f)
            });
            io(r, |f| {
                *writer = Some(f);
                Outcome::Ok
            })
        }
        Op::CloseWrite => match writer.take() {
            Some(f) => io(f.sync_all(), |_| Outcome::Ok),
            None => Outcome::Skip,
        },
        Op::Write {
            dir,
            file,
            len,
            seed,
            chunk,
        } => {
            let data = bytes(len, seed);
            let r = (|| {
                let mut f = fs::File::create(m.path(&path(dir, file)))?;
                for c in data.chunks(chunk) {
                    f.write_all(c)?;
                }
                // The upload completes at close; its errors are close's (`File` drop ignores
                // them, `sync_all` is the same completion and reports them).
                f.sync_all()
            })();
            io(r, |_| Outcome::Ok)
        }
        Op::Read { dir, file } => io(fs::read(m.path(&path(dir, file))), Outcome::Data),
        Op::Stat { dir, file } => io(fs::metadata(m.path(&path(dir, file))), |md| {
            if md.is_file() {
                Outcome::Size(md.len())
            } else {
                Outcome::Dir
            }
        }),
        Op::StatDir { dir } => io(fs::metadata(m.path(DIRS[dir])), |md| {
            if md.is_dir() {
                Outcome::Dir
            } else {
                Outcome::Size(md.len())
            }
        }),
        Op::List { dir } => {
            let p = dir.map_or(m.root.clone(), |d| m.path(DIRS[d]));
            let r = fs::read_dir(p).and_then(|rd| {
                rd.map(|e| {
                    let e = e?;
                    Ok((
                        e.file_name().into_string().unwrap(),
                        e.file_type()?.is_dir(),
                    ))
                })
                .collect::<std::io::Result<Vec<_>>>()
            });
            io(r, |mut names| {
                names.sort();
                Outcome::Names(names)
            })
        }
        Op::Unlink { dir, file } => io(fs::remove_file(m.path(&path(dir, file))), |_| Outcome::Ok),
        Op::UnlinkDir { dir } => io(fs::remove_file(m.path(DIRS[dir])), |_| Outcome::Ok),
        Op::Mkdir { dir } => io(fs::create_dir(m.path(DIRS[dir])), |_| Outcome::Ok),
        Op::Rmdir { dir } => io(fs::remove_dir(m.path(DIRS[dir])), |_| Outcome::Ok),
        Op::Remount => {
            if let Some(f) = writer.take() {
                if let Err(e) = f.sync_all() {
                    return Outcome::Err(e.raw_os_error().unwrap_or(-1));
                }
            }
            let old = std::mem::replace(m, mount(env, prefix, how));
            old.unmount();
            Outcome::Ok
        }
    }
}

/// How a case mounts: through which store, with which TTL.
struct How {
    store: Arc<dyn ObjectStore>,
    ttl: MetadataTtl,
}

fn mount(env: &Env, prefix: &str, how: &How) -> Mount {
    let ttl = how.ttl;
    env.mount(how.store.clone(), prefix, |c| {
        c.allow_delete = true;
        c.allow_overwrite = true;
        c.metadata_ttl = ttl;
    })
}

fn check(env: &Env, how: &How, seed: &Seed, ops: &[Op]) -> Result<(), TestCaseError> {
    let prefix = env.fresh_prefix("model");
    let mut model = Model::seeded(seed);
    for (k, v) in &model.files {
        env.put(&format!("{prefix}{k}"), v);
    }
    for d in &model.markers {
        env.put(&format!("{prefix}{d}/"), b"");
    }
    let mut m = mount(env, &prefix, how);
    let mut writer = None;
    for (i, op) in ops.iter().enumerate() {
        let want = model.apply(op);
        let got = run(env, &prefix, how, &mut m, &mut writer, op);
        prop_assert_eq!(got, want, "step {}: {:?}", i, op);
        // The bucket holds exactly the model's files and markers: nothing written but files,
        // no leftovers.
        prop_assert_eq!(
            env.keys(&prefix),
            model.keys(),
            "bucket after step {}: {:?}",
            i,
            op
        );
    }
    drop(writer);
    m.unmount();
    env.assert_budget_released();
    Ok(())
}

fn run_model(ttl: MetadataTtl, default_cases: u32, flaky: bool) {
    let env = Env::start();
    let proxy = FaultProxy::start(([127, 0, 0, 1], env.server.port()).into()).unwrap();
    let store: Arc<dyn ObjectStore> = if flaky {
        // Every third request breaks, before reaching the server or in its response body, so
        // every retry is safe: the results must be exactly the model's, only slower. POST
        // (CreateMultipartUpload, CompleteMultipartUpload) is left alone: a broken response to a
        // completion that did happen cannot be retried (the upload is gone), which is EIO at
        // close by design.
        proxy.set_plan(Some(FaultPlan {
            methods: ["GET", "HEAD", "PUT", "DELETE"].map(String::from).to_vec(),
            faults: vec![
                Fault::SlowDown,
                Fault::CutBody,
                Fault::InternalError,
                Fault::ShortBody,
            ],
            every: 3,
            ranged_only: false,
        }));
        let mut cfg = env.server.s3_config();
        cfg.endpoint_url = Some(proxy.url());
        let opts = S3Options {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(50),
            ..S3Options::default()
        };
        Arc::new(env.rt.block_on(S3Store::with_options(cfg, opts)).unwrap())
    } else {
        env.store.clone()
    };
    let how = How { store, ttl };
    let mut runner = TestRunner::new(Config {
        cases: common::cases(default_cases),
        // Each case mounts; keep shrinking bounded.
        max_shrink_iters: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (seed(), prop::collection::vec(op(), 1..40));
    let result = runner.run(&strategy, |(seed, ops)| check(&env, &how, &seed, &ops));
    if let Err(e) = result {
        panic!("{e}\n--- versitygw log ---\n{}", env.server.log());
    }
    if flaky {
        assert!(proxy.injected().len() > 10, "faults were injected");
    }
}

/// TTL 0: every lookup asks S3.
#[test]
fn fuse_mount_on_s3_matches_the_model_with_zero_ttl() {
    run_model(MetadataTtl::Duration(Duration::ZERO), 48, false);
}

/// Indefinite TTL: nothing learned from S3 expires, so every answer after a change made through
/// the mount relies on the mount updating its own caches (read-your-writes through one mount).
#[test]
fn fuse_mount_on_s3_matches_the_model_with_indefinite_ttl() {
    run_model(MetadataTtl::Indefinite, 48, false);
}

/// TTL 0 through a server that fails every third request (throttling, 500s, bodies cut off or
/// short): retries hide every fault, so the mount must still agree with the model exactly.
#[test]
fn fuse_mount_on_flaky_s3_matches_the_model() {
    run_model(MetadataTtl::Duration(Duration::ZERO), 16, true);
}
