//! Mounting: [`mount`] starts a FUSE session for a [`MountConfig`] and returns once the kernel
//! mount is live; [`MountHandle::unmount`] and [`MountHandle::detach`] end it.
//!
//! As root (the node plugin) Ferry mounts by itself: it opens the target directory without following
//! a symlink, checks the descriptor is the directory it meant, and mounts on that descriptor
//! (`/proc/self/fd/N`), so a path swapped for a symlink meanwhile cannot send the mount elsewhere;
//! the FUSE session is then built on the `/dev/fuse` descriptor it mounted with. Unprivileged (a
//! user's `ferry-node mount`), fuser mounts through `fusermount3`.
//!
//! Ending a mount never waits on other mount namespaces: a process that unshared its mount
//! namespace while the volume was mounted holds a copy of it, which keeps the FUSE connection (and
//! the session thread serving it) alive after our unmount. Once our mount is gone the connection is
//! aborted (`/sys/fs/fuse/connections/N/abort`): such copies then fail with `ENOTCONN`, as they
//! would had this process exited, and the session thread ends.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ferry_store::ObjectStore;
use fuser::{BackgroundSession, MountOption, SessionACL};

use crate::budget::MountContext;
use crate::config::{ConfigError, MountConfig};
use crate::fs::{Fs, FsSnapshot};
use crate::fuse::FuseAdapter;
use crate::handover::{self, Gate, KernelInit};
use crate::mountinfo;

/// Why a mount did not happen.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    // `error`, not `source`: the message already carries it, and a chain printer (anyhow's
    // `{:#}`) would repeat it as the cause.
    #[error("mount target {path}: {error}")]
    Target { path: PathBuf, error: io::Error },
    #[error("FUSE mount at {path} failed: {error}")]
    Fuse { path: PathBuf, error: io::Error },
    #[error("the mount at {0} did not appear in /proc/self/mountinfo")]
    NotVisible(PathBuf),
}

/// How the session was mounted, which decides who unmounts it.
#[derive(Debug)]
enum Session {
    /// Mounted by Ferry on the target's descriptor; Ferry unmounts it.
    Own(BackgroundSession),
    /// Mounted by fuser (through `fusermount3`); dropping it unmounts.
    Fuser(BackgroundSession),
}

/// A live mount. Dropping it unmounts too (not lazily; errors are then only logged).
#[derive(Debug)]
pub struct MountHandle {
    session: Option<Session>,
    fs: Arc<Fs>,
    target: PathBuf,
    config: MountConfig,
    /// The mount's device (`major:minor` in mountinfo); the minor is its FUSE connection.
    dev: (u32, u32),
    /// Its connection's abort file, opened at mount time (`None` without `fusectl`).
    abort: Option<mountinfo::ConnectionAbort>,
    /// A duplicate of the `/dev/fuse` descriptor serving the mount (mounted by Ferry itself): what
    /// a successor process or the descriptor holder is given.
    device: Option<OwnedFd>,
    /// Admits the session's requests to the filesystem ([`MountHandle::freeze`]).
    gate: Arc<Gate>,
    /// What the kernel offered at `INIT`.
    kernel: Arc<Mutex<Option<KernelInit>>>,
    /// The session's share of the memory budget ([`crate::budget::SESSION_BYTES`]).
    _session: crate::Reservation,
    /// Gives idle writers' spare budget back, while the mount lives ([`idle_writers`]).
    _idle_writers: tokio_util::task::AbortOnDropHandle<()>,
}

/// A writer with no write for this long gives back what it holds of the memory budget beyond its
/// buffered bytes ([`Fs::shrink_idle_writers`]).
pub const WRITER_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// Every [`WRITER_IDLE`] / 3, gives back what `fs`'s idle writers hold beyond their buffers, until
/// the mount (the task) or `fs` goes.
fn idle_writers(
    fs: &Arc<Fs>,
    rt: &tokio::runtime::Handle,
) -> tokio_util::task::AbortOnDropHandle<()> {
    let fs = Arc::downgrade(fs);
    tokio_util::task::AbortOnDropHandle::new(rt.spawn(async move {
        let mut tick = tokio::time::interval(WRITER_IDLE / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(fs) = fs.upgrade() else { return };
            let freed = fs.shrink_idle_writers(WRITER_IDLE);
            if freed > 0 {
                tracing::debug!(freed, "idle writers gave memory back");
            }
        }
    }))
}

/// A mount stopped for a handover: its session admits no request, none is running, and `snapshot`
/// is its whole state. [`MountHandle::hand_over`] completes it, [`MountHandle::thaw`] calls it off.
#[derive(Debug)]
pub struct Frozen {
    pub snapshot: FsSnapshot,
    pub kernel: KernelInit,
}

impl MountHandle {
    /// Unmounts (not lazily: fails with `EBUSY` while files are open; the mount then stays served
    /// by its session thread until something unmounts it), then ends the FUSE connection (copies
    /// in other mount namespaces fail with `ENOTCONN` from then on) and waits for the session.
    pub fn unmount(mut self) -> io::Result<()> {
        self.end(false)
    }

    /// Unmounts, detaching the mount (`MNT_DETACH`) if something still uses it, then ends the FUSE
    /// connection like [`MountHandle::unmount`]. Returns without waiting on anything outside this
    /// process: the path is free when it returns.
    pub fn detach(mut self) -> io::Result<()> {
        self.end(true)
    }

    /// Whether this mount is still the one on top at its target in this mount namespace.
    pub fn is_mounted(&self) -> io::Result<bool> {
        Ok(mountinfo::mounted_at(&self.target)?.is_some_and(|m| m.dev == self.dev))
    }

    /// The mount's FUSE connection number (`/sys/fs/fuse/connections/<n>`).
    pub fn connection(&self) -> u32 {
        self.dev.1
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

    /// The mount's device numbers (`major`, `minor`) as mountinfo shows them.
    pub fn device_numbers(&self) -> (u32, u32) {
        self.dev
    }

    /// The `/dev/fuse` descriptor serving the mount, when Ferry mounted it itself (root).
    pub fn device(&self) -> Option<BorrowedFd<'_>> {
        self.device.as_ref().map(|d| d.as_fd())
    }

    /// What the kernel offered at `INIT` (known once the session started).
    pub fn kernel_init(&self) -> Option<KernelInit> {
        *self.kernel.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops admitting requests (new ones park unanswered on the session thread, for a successor
    /// to answer after `FUSE_NOTIFY_RESEND`), waits up to `timeout` for those running to be
    /// answered, and takes the state. On error the mount is served on as before.
    pub async fn freeze(&self, timeout: Duration) -> io::Result<Frozen> {
        let (Some(_), Some(kernel)) = (&self.device, self.kernel_init()) else {
            return Err(io::Error::other(
                "this mount was made through fusermount3: its connection cannot be handed over",
            ));
        };
        let gate = self.gate.clone();
        tokio::task::spawn_blocking(move || gate.close(timeout))
            .await
            .map_err(io::Error::other)??;
        let snapshot = self.fs.snapshot().await;
        Ok(Frozen { snapshot, kernel })
    }

    /// Serves the mount again after a [`MountHandle::freeze`] whose handover did not happen.
    pub fn thaw(&self) {
        self.gate.open();
    }

    /// The successor serves the mount now: this process forgets it without unmounting, aborting
    /// or settling anything. The session thread stays parked at the gate until the process exits;
    /// requests it took meanwhile are re-sent to the successor.
    pub fn hand_over(mut self) {
        self.gate.hand_over();
        if let Some(Session::Own(bg) | Session::Fuser(bg)) = self.session.take() {
            // Dropping it would unmount (fuser) or join a thread that never returns.
            std::mem::forget(bg);
        }
        tracing::info!(target = %self.target.display(), conn = self.connection(), "mount handed over");
    }
    /// Unmounts our mount if it is still on top at the target (never a mount stacked on it, nor
    /// what a symlink at the target points to), aborts the connection and reaps the session.
    fn end(&mut self, lazy: bool) -> io::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let guard = match session {
            Session::Own(bg) => {
                match mountinfo::mounted_at(&self.target)? {
                    Some(m) if m.dev == self.dev => {
                        let plain = mountinfo::unmount(&self.target, false);
                        match plain {
                            Ok(()) => {}
                            Err(e) if lazy && e.raw_os_error() == Some(libc::EBUSY) => {
                                tracing::info!(target = %self.target.display(), "mount busy; detaching it");
                                mountinfo::unmount(&self.target, true)?;
                            }
                            Err(e) => {
                                self.session = Some(Session::Own(bg));
                                return Err(e);
                            }
                        }
                    }
                    Some(m) if self.covered(&m)? => {
                        self.session = Some(Session::Own(bg));
                        return Err(io::Error::other(format!(
                            "another filesystem ({} from {}) is mounted over {}",
                            m.fs_type,
                            m.source,
                            self.target.display()
                        )));
                    }
                    // Unmounted behind our back: nothing of ours is left at the path.
                    _ => {}
                }
                bg.guard
            }
            Session::Fuser(bg) => {
                let guard = bg.guard;
                // The rest of the session (its fuser `Mount`) unmounts as it is dropped here.
                guard
            }
        };
        self.reap(guard);
        Ok(())
    }

    /// Whether our mount is still at the target under `top` (another mount stacked on it).
    fn covered(&self, top: &mountinfo::MountEntry) -> io::Result<bool> {
        let p = self.target.to_string_lossy();
        Ok(top.dev != self.dev
            && mountinfo::mounts()?
                .iter()
                .any(|m| m.mount_point == p && m.dev == self.dev))
    }

    /// Ends the connection (copies of the mount in other namespaces keep it alive otherwise) and
    /// joins the session thread, which then ends at once. Without `fusectl` the connection cannot
    /// be aborted: if it is still alive the thread is left to end with the last copy.
    fn reap(&self, guard: JoinHandle<io::Result<()>>) {
        let conn = self.connection();
        let ended = match &self.abort {
            Some(abort) => match abort.abort() {
                Ok(()) => {
                    tracing::info!(target = %self.target.display(), conn, "FUSE connection ended (copies of the mount in other mount namespaces now fail with ENOTCONN)");
                    true
                }
                Err(e) => {
                    tracing::warn!(target = %self.target.display(), conn, error = %e, "cannot abort the FUSE connection; its session ends when the last copy of the mount does");
                    false
                }
            },
            // Without the abort file the connection may only be waited for if it is gone already
            // (the number is checked, not used: another mount may have it now, and then the
            // session thread is left to end by itself).
            None => {
                let gone = mountinfo::connection_alive(conn) == Some(false);
                if !gone {
                    tracing::warn!(target = %self.target.display(), conn, "fusectl is unavailable: the FUSE session ends when the last copy of the mount does");
                }
                gone
            }
        };
        if ended {
            match guard.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "FUSE session ended with an error"),
                Err(_) => tracing::error!("FUSE session thread panicked"),
            }
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if let Err(e) = self.end(false) {
            tracing::warn!(target = %self.target.display(), error = %e, "unmount on drop failed; the mount stays served");
            // Still served: leave its thread running rather than join it.
            if let Some(Session::Own(bg) | Session::Fuser(bg)) = self.session.take() {
                drop(bg.guard);
            }
        }
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
    if cfg.allow_other {
        options.acl = SessionACL::All;
    }
    options
}

/// Whether this process may mount by itself (root).
fn privileged() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The target's parent resolved and the target itself opened as a directory without following a
/// symlink (`O_PATH | O_NOFOLLOW | O_DIRECTORY`), checked to be the directory at that path.
fn open_target(target: &Path) -> io::Result<(PathBuf, OwnedFd)> {
    use std::os::unix::fs::OpenOptionsExt;
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a directory below another",
        ));
    };
    let path = parent.canonicalize()?.join(name);
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTDIR) => io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
            Some(libc::ELOOP) => io::Error::new(
                io::ErrorKind::NotADirectory,
                "a symbolic link, which is never followed",
            ),
            _ => e,
        })?;
    let fd: OwnedFd = dir.into();
    // The directory we opened must be the one at `path` (no parent was swapped meanwhile).
    let at = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    if at != path {
        return Err(io::Error::other(format!(
            "the directory moved while being opened (now at {})",
            at.display()
        )));
    }
    Ok((path, fd))
}

/// Mounts FUSE on the directory `dir` (a descriptor from [`open_target`]) and returns the
/// `/dev/fuse` descriptor serving it.
fn mount_on(dir: &OwnedFd, cfg: &MountConfig) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/fuse")?;
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    let mut data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions,subtype=ferry",
        dev.as_raw_fd()
    );
    if cfg.allow_other {
        data.push_str(",allow_other");
    }
    use nix::mount::MsFlags;
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if cfg.read_only {
        flags |= MsFlags::MS_RDONLY;
    }
    nix::mount::mount(
        Some(cfg.fs_name.as_str()),
        format!("/proc/self/fd/{}", dir.as_raw_fd()).as_str(),
        Some("fuse"),
        flags,
        Some(data.as_str()),
    )?;
    Ok(dev.into())
}

/// Drops a directory's entries from the kernel's cache through `session`'s notifier. The kernel
/// answers `ENOENT` for an inode it no longer holds (nothing cached then).
fn kernel_invalidator(session: &BackgroundSession) -> crate::fs::KernelInvalidator {
    let notifier = session.notifier();
    crate::fs::KernelInvalidator::new(move |ino| {
        if let Err(e) = notifier.inval_inode(fuser::INodeNo(ino), 0, 0) {
            tracing::debug!(ino, error = %e, "a directory's cache in the kernel was not dropped");
        }
    })
}

/// The filesystem `fs` of one mount with the node's cache, its store's proofs and its journal, and
/// its adapter.
fn adapter_for(
    fs: Fs,
    proofs: Arc<crate::proofs::Proofs>,
    ctx: MountContext,
) -> (Arc<Fs>, FuseAdapter) {
    let mut fs = fs.with_cache(ctx.cache).with_proofs(proofs);
    if let Some(journal) = ctx.journal {
        fs = fs.with_journal(journal);
    }
    let fs = Arc::new(fs);
    let adapter = FuseAdapter::new(fs.clone(), ctx.runtime, ctx.passthrough);
    (fs, adapter)
}

/// Mounts `store`'s `cfg.bucket`/`cfg.prefix` at `target` (an existing directory; a symlink there
/// is refused, never followed) and returns once the kernel mount is live. Request handlers run on
/// `ctx.runtime`; prefetching is charged to `ctx.budget` (shared by every mount of the node). This
/// call blocks (it mounts and completes the FUSE handshake); from async code call it in
/// `spawn_blocking`.
pub fn mount(
    store: Arc<dyn ObjectStore>,
    cfg: MountConfig,
    target: &Path,
    ctx: MountContext,
) -> Result<MountHandle, MountError> {
    cfg.validate()?;
    let target_err = |error| MountError::Target {
        path: target.to_owned(),
        error,
    };
    let (target, dir) = open_target(target).map_err(target_err)?;
    let fuse_err = |error| MountError::Fuse {
        path: target.clone(),
        error,
    };
    let proofs = ctx.proofs.for_store(&store);
    let session_charge = ctx
        .budget
        .charge(crate::budget::Use::Session, crate::budget::SESSION_BYTES);
    let fs = Fs::with_budget(store, cfg.clone(), ctx.budget.clone(), ctx.prefetch);
    let runtime = ctx.runtime.clone();
    let (fs, adapter) = adapter_for(fs, proofs, ctx);
    let (gate, kernel) = (adapter.gate(), adapter.kernel_init());
    let options = mount_options(&cfg);
    let mut device = None;
    let session = if privileged() {
        let dev = mount_on(&dir, &cfg).map_err(fuse_err)?;
        device = Some(dev.try_clone().map_err(fuse_err)?);
        let adapter = adapter.with_device(dev.try_clone().map_err(fuse_err)?);
        let started = fuser::Session::from_fd(adapter, dev, options.acl, options.clone())
            .and_then(|s| s.spawn());
        match started {
            Ok(bg) => Session::Own(bg),
            Err(e) => {
                let _ = mountinfo::unmount(&target, true);
                return Err(fuse_err(e));
            }
        }
    } else {
        Session::Fuser(fuser::spawn_mount(adapter, &target, &options).map_err(fuse_err)?)
    };
    let (Session::Own(bg) | Session::Fuser(bg)) = &session;
    fs.set_kernel_invalidator(kernel_invalidator(bg));
    {
        let _runtime = runtime.enter();
        fs.probe_root();
    }
    drop(dir);
    let entry = mountinfo::mounted_at(&target)
        .ok()
        .flatten()
        .filter(|m| m.fs_type.starts_with("fuse"));
    let Some(entry) = entry else {
        // The session cannot be told apart from a foreign mount: leave its thread be.
        let (Session::Own(bg) | Session::Fuser(bg)) = session;
        drop(bg.guard);
        return Err(MountError::NotVisible(target));
    };
    // Opened now, while the mount holds its connection number (see `ConnectionAbort`).
    let abort = mountinfo::ConnectionAbort::open(entry.dev.1)
        .inspect_err(|e| tracing::info!(conn = entry.dev.1, error = %e, "the FUSE connection's abort file cannot be opened"))
        .ok();
    let handle = MountHandle {
        _session: session_charge,
        _idle_writers: idle_writers(&fs, &runtime),
        session: Some(session),
        fs,
        target,
        config: cfg,
        dev: entry.dev,
        abort,
        device,
        gate,
        kernel,
    };
    tracing::info!(target = %handle.target.display(), fs_name = %handle.config.fs_name, conn = handle.connection(), "mounted");
    raise_read_ahead(handle.dev);
    Ok(handle)
}

/// Serves a live mount another process handed over (or left behind when it died): `dev` is the
/// `/dev/fuse` descriptor of its connection, `dev_numbers` the mount's device as that process
/// recorded it, `snapshot` its state and `kernel` the `INIT` the kernel sent it. The session is
/// built without a handshake (see [`crate::handover`]); with `resend` the kernel first queues again
/// every request that process read and did not answer. Blocks briefly: call it in
/// `spawn_blocking`.
#[allow(clippy::too_many_arguments)]
pub fn resume(
    store: Arc<dyn ObjectStore>,
    snapshot: FsSnapshot,
    dev: OwnedFd,
    dev_numbers: (u32, u32),
    kernel: KernelInit,
    target: &Path,
    ctx: MountContext,
    resend: bool,
) -> Result<MountHandle, MountError> {
    let cfg = snapshot.config.clone();
    cfg.validate()?;
    let target = target.to_path_buf();
    let fuse_err = |error| MountError::Fuse {
        path: target.clone(),
        error,
    };
    // The mount must still be there, on this connection.
    let entry = mountinfo::mounted_at(&target)
        .map_err(fuse_err)?
        .filter(|m| m.dev == dev_numbers && m.fs_type.starts_with("fuse"))
        .ok_or_else(|| MountError::NotVisible(target.clone()))?;
    let proofs = ctx.proofs.for_store(&store);
    let session_charge = ctx
        .budget
        .charge(crate::budget::Use::Session, crate::budget::SESSION_BYTES);
    let fs = Fs::from_snapshot(store, snapshot, ctx.budget.clone(), ctx.prefetch);
    let runtime = ctx.runtime.clone();
    let (fs, adapter) = adapter_for(fs, proofs, ctx);
    let (gate, kernel_rec) = (adapter.gate(), adapter.kernel_init());
    let options = mount_options(&cfg);
    let adapter = adapter.with_device(dev.try_clone().map_err(fuse_err)?);
    let (ours, theirs) = std::os::unix::net::UnixDatagram::pair().map_err(fuse_err)?;
    ours.send(&kernel.request()).map_err(fuse_err)?;
    let session = fuser::Session::from_fd(adapter, OwnedFd::from(theirs), options.acl, options)
        .map_err(fuse_err)?;
    let mut reply = [0u8; 512];
    let n = ours.recv(&mut reply).map_err(fuse_err)?;
    if n < 16 || i32::from_ne_bytes(reply[4..8].try_into().expect("4 bytes")) != 0 {
        return Err(fuse_err(io::Error::other("the replayed INIT was refused")));
    }
    // From here the session reads and answers the real connection.
    // SAFETY: both descriptors are open; dup3 atomically replaces the session's socket end with
    // the connection, under the same number, before the session reads anything.
    let rc = unsafe {
        libc::dup3(
            dev.as_raw_fd(),
            session.as_fd().as_raw_fd(),
            libc::O_CLOEXEC,
        )
    };
    if rc < 0 {
        return Err(fuse_err(io::Error::last_os_error()));
    }
    if resend {
        if let Err(e) = handover::notify_resend(dev.as_fd()) {
            tracing::warn!(target = %target.display(), error = %e, "the kernel did not re-send the unanswered requests");
        }
    }
    let bg = session.spawn().map_err(fuse_err)?;
    fs.set_kernel_invalidator(kernel_invalidator(&bg));
    let abort = mountinfo::ConnectionAbort::open(entry.dev.1).ok();
    let handle = MountHandle {
        _session: session_charge,
        _idle_writers: idle_writers(&fs, &runtime),
        session: Some(Session::Own(bg)),
        fs,
        target,
        config: cfg,
        dev: entry.dev,
        abort,
        device: Some(dev),
        gate,
        kernel: kernel_rec,
    };
    tracing::info!(target = %handle.target.display(), conn = handle.connection(), "mount taken over");
    Ok(handle)
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
fn raise_read_ahead((major, minor): (u32, u32)) {
    let kb = READ_AHEAD_KB;
    let path = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
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
