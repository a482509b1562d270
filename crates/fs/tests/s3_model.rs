//! Reference-model test through the whole stack: random sequences of create+write, read, list,
//! stat, unlink, mkdir, rmdir and remount, run with plain `std::fs` calls on a real FUSE mount of a
//! real S3 server (versitygw) and against a model of the bucket built from `doc/SEMANTICS.md`.
//! Results, errnos and the bucket's keys must agree after every step.
//!
//! One versitygw for the test; every case (shrink runs included) mounts a fresh prefix, so cases
//! are independent and shrinking works. The mount allows delete and overwrite and has a metadata
//! TTL of 0, so every lookup asks S3 (read-your-writes through one mount holds with any TTL, but 0
//! also makes the remount step prove that everything lives in S3).
//!
//! Cases: `$PROPTEST_CASES` (default 64), up to 40 steps each.
//!
//! The model (SEMANTICS "Operations"): a file is an object, visible once `close` returned; `mkdir`
//! makes a local directory that exists in S3 only once a file is written below it (no marker is
//! written); `unlink` of the last file of a directory leaves the directory in the mount until
//! `rmdir`; an unmount forgets local directories with no files below; `rmdir` of a directory with
//! anything below is `ENOTEMPTY`. Names never collide between files and directories: versitygw's
//! posix backend cannot hold an object `a` and an object `a/b` at once, so the generator keeps file
//! and directory names apart (the file-vs-directory rule is checked in the SEMANTICS test on a
//! store that can hold both).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use common::{Env, Mount};
use ferry_fs::MetadataTtl;
use ferry_store::ObjectStore;
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
    /// Unmount and mount the same prefix again.
    Remount,
}

fn op() -> impl Strategy<Value = Op> {
    let dir = prop::option::weighted(0.6, 0..DIRS.len());
    let file = 0..FILES.len();
    let len = prop_oneof![15 => 0..3000usize, 1 => Just(BIG)];
    prop_oneof![
        5 => (dir.clone(), file.clone(), len, any::<u8>(), 1..5000usize)
            .prop_map(|(dir, file, len, seed, chunk)| Op::Write { dir, file, len, seed, chunk }),
        3 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Read { dir, file }),
        2 => dir.clone().prop_map(|dir| Op::List { dir }),
        2 => (dir.clone(), file.clone()).prop_map(|(dir, file)| Op::Stat { dir, file }),
        1 => (0..DIRS.len()).prop_map(|dir| Op::StatDir { dir }),
        2 => (dir, file).prop_map(|(dir, file)| Op::Unlink { dir, file }),
        1 => (0..DIRS.len()).prop_map(|dir| Op::UnlinkDir { dir }),
        3 => (0..DIRS.len()).prop_map(|dir| Op::Mkdir { dir }),
        2 => (0..DIRS.len()).prop_map(|dir| Op::Rmdir { dir }),
        1 => Just(Op::Remount),
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
}

#[derive(Default)]
struct Model {
    files: BTreeMap<String, Vec<u8>>,
    dirs: BTreeSet<String>,
}

impl Model {
    fn dir_ok(&self, dir: Option<usize>) -> bool {
        dir.is_none_or(|d| self.dirs.contains(DIRS[d]))
    }

    fn has_below(&self, dir: &str) -> bool {
        let p = format!("{dir}/");
        self.files.keys().any(|k| k.starts_with(&p)) || self.dirs.iter().any(|d| d.starts_with(&p))
    }

    fn apply(&mut self, op: &Op) -> Outcome {
        use libc::{EEXIST, EISDIR, ENOENT, ENOTEMPTY};
        match *op {
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
                let mut names: Vec<(String, bool)> = self
                    .files
                    .keys()
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
                    Outcome::Ok
                }
            }
            Op::Remount => {
                // Only directories with a file below them exist in S3.
                let files = &self.files;
                self.dirs
                    .retain(|d| files.keys().any(|k| k.starts_with(&format!("{d}/"))));
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
fn run(env: &Env, prefix: &str, m: &mut Mount, op: &Op) -> Outcome {
    match *op {
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
            let old = std::mem::replace(m, mount(env, prefix));
            old.unmount();
            Outcome::Ok
        }
    }
}

fn mount(env: &Env, prefix: &str) -> Mount {
    env.mount(env.store.clone() as Arc<dyn ObjectStore>, prefix, |c| {
        c.allow_delete = true;
        c.allow_overwrite = true;
        c.metadata_ttl = MetadataTtl::Duration(Duration::ZERO);
    })
}

fn check(env: &Env, ops: &[Op]) -> Result<(), TestCaseError> {
    let prefix = env.fresh_prefix("model");
    let mut m = mount(env, &prefix);
    let mut model = Model::default();
    for (i, op) in ops.iter().enumerate() {
        let want = model.apply(op);
        let got = run(env, &prefix, &mut m, op);
        prop_assert_eq!(got, want, "step {}: {:?}", i, op);
        // The bucket holds exactly the model's files: no markers, no leftovers.
        let keys: Vec<String> = model.files.keys().cloned().collect();
        prop_assert_eq!(env.keys(&prefix), keys, "bucket after step {}: {:?}", i, op);
    }
    m.unmount();
    Ok(())
}

#[test]
fn fuse_mount_on_s3_matches_the_model() {
    let env = Env::start();
    let mut runner = TestRunner::new(Config {
        cases: common::cases(64),
        // Each case mounts; keep shrinking bounded.
        max_shrink_iters: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(op(), 1..40), |ops| check(&env, &ops));
    if let Err(e) = result {
        panic!("{e}\n--- versitygw log ---\n{}", env.server.log());
    }
}
