//! Mounting: [`mount`] starts a FUSE session for a [`MountConfig`] and returns once the kernel
//! mount is live; [`MountHandle::unmount`] ends it.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_store::ObjectStore;
use fuser::{BackgroundSession, MountOption, SessionACL};

use crate::budget::MountContext;
use crate::config::{ConfigError, MountConfig};
use crate::fs::Fs;
use crate::fuse::FuseAdapter;

/// Why a mount did not happen.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("mount target {path}: {source}")]
    Target { path: PathBuf, source: io::Error },
    #[error("FUSE mount at {path} failed: {source}")]
    Fuse { path: PathBuf, source: io::Error },
    #[error("the mount at {0} did not appear in /proc/self/mountinfo")]
    NotVisible(PathBuf),
}

/// A live mount. Dropping it unmounts too (errors are then only logged).
#[derive(Debug)]
pub struct MountHandle {
    session: Option<BackgroundSession>,
    fs: Arc<Fs>,
    target: PathBuf,
    config: MountConfig,
}

impl MountHandle {
    /// Unmounts (not lazily: fails with `EBUSY` while files are open; the mount then stays served
    /// by its session thread until something unmounts it) and waits for the session to end.
    pub fn unmount(mut self) -> io::Result<()> {
        match self.session.take() {
            Some(session) => session.umount_and_join(),
            None => Ok(()),
        }
    }

    /// The (canonical) mount point.
    pub fn target(&self) -> &Path {
        &self.target
    }

    pub fn config(&self) -> &MountConfig {
        &self.config
    }

    /// The filesystem core (e.g. for [`Fs::snapshot`]).
    pub fn fs(&self) -> &Arc<Fs> {
        &self.fs
    }
}

/// The kernel mount options for `cfg`.
fn mount_options(cfg: &MountConfig) -> fuser::Config {
    let mut options = fuser::Config::default();
    options.mount_options = vec![
        MountOption::FSName(cfg.fs_name.clone()),
        MountOption::Subtype("ferry".to_owned()),
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
        if cfg.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    // As root, fuser calls mount(2) itself with type "fuse" and drops Subtype (a fusermount
    // option); the kernel takes it as `subtype=` so /proc/mounts says "fuse.ferry" either way.
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        options
            .mount_options
            .push(MountOption::CUSTOM("subtype=ferry".to_owned()));
    }
    if cfg.allow_other {
        options.acl = SessionACL::All;
    }
    options
}

/// Mounts `store`'s `cfg.bucket`/`cfg.prefix` at `target` (an existing directory) and returns
/// once the kernel mount is live. Request handlers run on `ctx.runtime`; prefetching is charged to
/// `ctx.budget` (shared by every mount of the node). This call blocks (it mounts and completes the
/// FUSE handshake); from async code call it in `spawn_blocking`.
pub fn mount(
    store: Arc<dyn ObjectStore>,
    cfg: MountConfig,
    target: &Path,
    ctx: MountContext,
) -> Result<MountHandle, MountError> {
    cfg.validate()?;
    let target_err = |source| MountError::Target {
        path: target.to_owned(),
        source,
    };
    let target = target.canonicalize().map_err(target_err)?;
    if !target.is_dir() {
        return Err(target_err(io::Error::new(
            io::ErrorKind::NotADirectory,
            "not a directory",
        )));
    }
    let proofs = ctx.proofs.for_store(&store);
    let fs = Arc::new(
        Fs::with_budget(store, cfg.clone(), ctx.budget, ctx.prefetch)
            .with_cache(ctx.cache)
            .with_proofs(proofs),
    );
    let adapter = FuseAdapter::new(fs.clone(), ctx.runtime, ctx.passthrough);
    let session = fuser::spawn_mount(adapter, &target, &mount_options(&cfg)).map_err(|source| {
        MountError::Fuse {
            path: target.clone(),
            source,
        }
    })?;
    let handle = MountHandle {
        session: Some(session),
        fs,
        target,
        config: cfg,
    };
    match is_mounted(&handle.target) {
        Ok(true) => {
            tracing::info!(target = %handle.target.display(), fs_name = %handle.config.fs_name, "mounted");
            raise_read_ahead(&handle.target);
            Ok(handle)
        }
        Ok(false) | Err(_) => Err(MountError::NotVisible(handle.target.clone())),
    }
}

/// Kernel read-ahead of a mount, in KiB: with it (and 1 MiB FUSE requests, `max_pages`) a
/// sequential reader's data comes in 1 MiB `read` requests instead of 128 KiB ones (P1 at 10 ms:
/// 8,192 → 1,024 FUSE reads). 4 MiB and 16 MiB were measured too: more requests in flight at
/// once arrive out of order and cost extra GETs (16 MiB: 510 instead of 135) and memory; see
/// doc/BENCHMARKS.md.
const READ_AHEAD_KB: u32 = 1024;

/// Raises the read-ahead of the mount's backing device (`/sys/class/bdi/MAJOR:MINOR`): FUSE
/// starts every mount at the kernel default (128 KiB) and `init` can only lower it. Needs root;
/// without it reads still work, in smaller requests.
fn raise_read_ahead(target: &Path) {
    use std::os::unix::fs::MetadataExt;
    let kb = READ_AHEAD_KB;
    let dev = match std::fs::metadata(target) {
        Ok(m) => m.dev(),
        Err(e) => {
            tracing::debug!(error = %e, "read-ahead: stat of the mount failed");
            return;
        }
    };
    let path = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    match std::fs::write(&path, kb.to_string()) {
        Ok(()) => tracing::debug!(path, kb, "read-ahead raised"),
        Err(e) => {
            tracing::info!(path, error = %e, "could not raise the mount's read-ahead; reads use 128 KiB requests")
        }
    }
}

/// Whether something is mounted exactly at `path` (compared as given: pass a canonical path).
pub fn is_mounted(path: &Path) -> io::Result<bool> {
    Ok(crate::mountinfo::mounted_at(path)?.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options() {
        let mut cfg = MountConfig::new("b");
        let o = mount_options(&cfg);
        assert!(o.mount_options.contains(&MountOption::RO));
        assert_eq!(o.acl, SessionACL::Owner);
        cfg.read_only = false;
        cfg.allow_other = true;
        let o = mount_options(&cfg);
        assert!(o.mount_options.contains(&MountOption::RW));
        assert!(o.mount_options.contains(&MountOption::DefaultPermissions));
        assert_eq!(o.acl, SessionACL::All);
    }
}
