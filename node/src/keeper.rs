//! Keeping every mount recoverable after this process dies (`kill -9`, OOM, panic): each mount's
//! state goes into a journal on a memfd ([`ferry_fs::journal`]), and the mount's `/dev/fuse`
//! descriptor and that memfd are deposited with `ferry-fd-holder`, a separate process that only
//! holds descriptors. The FUSE connection then outlives this process; the next one takes the
//! descriptors back, replays the journal and serves on ([`recover`]).
//!
//! What the holder keeps beside the descriptors (the [`Kept`] blob) includes the mount's publish
//! request, secrets included: it lives in the holder's memory only, never on disk. The journal
//! holds no secret.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ferry_fs::KernelInit;
use serde::{Deserialize, Serialize};

use crate::handover::MountRecord;
use crate::holder;
use crate::mounts::Mounted;

/// The blob format this build writes and reads.
pub const KEPT_VERSION: u32 = 1;

/// What the holder keeps for one mount besides its descriptors (`/dev/fuse`, then the journal).
#[derive(Debug, Serialize, Deserialize)]
pub struct Kept {
    pub version: u32,
    pub target: PathBuf,
    pub dev: (u32, u32),
    pub kernel: KernelInit,
    /// The publish request (protobuf), base64.
    pub request: String,
    /// Whether the warm-up the mount asked for had finished (deposited again when it does).
    /// Absent (an older process): not known finished, run again.
    #[serde(default)]
    pub warmed: bool,
}

/// The link to the holder (none without `--holder-socket`: mounts then end with this process).
#[derive(Debug, Clone, Default)]
pub struct Keeper {
    link: Option<Arc<Link>>,
}

#[derive(Debug)]
struct Link {
    socket: PathBuf,
    client: Mutex<Option<holder::Client>>,
}

/// An anonymous memory file (`memfd_create`), close-on-exec.
pub fn memfd(name: &str) -> std::io::Result<std::fs::File> {
    use nix::sys::memfd::{memfd_create, MFdFlags};
    Ok(memfd_create(name, MFdFlags::MFD_CLOEXEC)?.into())
}

fn key(target: &Path) -> String {
    target.to_string_lossy().into_owned()
}

impl Keeper {
    pub fn new(socket: Option<PathBuf>) -> Self {
        Keeper {
            link: socket.map(|socket| {
                Arc::new(Link {
                    socket,
                    client: Mutex::new(None),
                })
            }),
        }
    }

    pub fn enabled(&self) -> bool {
        self.link.is_some()
    }

    /// Runs `f` with a connected client (connecting first if needed).
    fn with<T>(
        &self,
        f: impl FnOnce(&mut holder::Client) -> std::io::Result<T>,
    ) -> Option<std::io::Result<T>> {
        let link = self.link.as_ref()?;
        let mut guard = link.client.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            match holder::Client::connect(&link.socket) {
                Ok(c) => *guard = Some(c),
                Err(e) => return Some(Err(e)),
            }
        }
        let res = f(guard.as_mut().expect("connected"));
        if res.is_err() {
            *guard = None;
        }
        Some(res)
    }

    /// Deposits the mount's descriptors and journal file under its target (replacing what was
    /// there), with its request and whether its warm-up finished. A mount the holder does not
    /// have is not recoverable after a crash: logged. Nothing without a journal (no holder).
    pub fn keep(&self, m: &Mounted) {
        use base64::Engine;
        let (handle, request) = (&m.handle, &m.request);
        let (Some(journal), Some(device), Some(kernel)) =
            (&m.journal, handle.device(), handle.kernel_init())
        else {
            return;
        };
        let kept = Kept {
            version: KEPT_VERSION,
            target: handle.target().to_path_buf(),
            dev: handle.device_numbers(),
            kernel,
            request: base64::engine::general_purpose::STANDARD.encode(request),
            warmed: m.warmed(),
        };
        let blob = serde_json::to_vec(&kept).expect("serializable");
        let res =
            self.with(|c| c.deposit(&key(handle.target()), &blob, &[device, journal.as_fd()]));
        if let Some(Err(e)) = res {
            tracing::warn!(target = %handle.target().display(), error = %e, "the fd holder does not have this mount: it will not survive a crash of this process");
        }
    }

    /// Deposits a mount received in a handover before this process serves it: its descriptor and
    /// a journal written from its snapshot. If this process dies before it serves the mount, the
    /// next one recovers it from here (the previous owner, gone by then, cannot).
    pub fn keep_received(&self, record: &MountRecord, device: &OwnedFd) -> std::io::Result<()> {
        use base64::Engine;
        if !self.enabled() {
            return Ok(());
        }
        let journal = memfd("ferry-journal")?;
        ferry_fs::journal::write_snapshot(
            journal.try_clone()?,
            &record.snapshot,
            serde_json::json!({ "target": record.target }),
        )?;
        let kept = Kept {
            version: KEPT_VERSION,
            target: record.target.clone(),
            dev: record.dev,
            kernel: record.kernel,
            request: base64::engine::general_purpose::STANDARD.encode(&record.request),
            warmed: record.warmed,
        };
        let blob = serde_json::to_vec(&kept).map_err(std::io::Error::other)?;
        match self.with(|c| {
            c.deposit(
                &key(&record.target),
                &blob,
                &[device.as_fd(), journal.as_fd()],
            )
        }) {
            Some(res) => res,
            None => Ok(()),
        }
    }

    /// The mount at `target` is gone: the holder lets go of it.
    pub fn release(&self, target: &Path) {
        if let Some(Err(e)) = self.with(|c| c.withdraw(&key(target))) {
            tracing::warn!(target = %target.display(), error = %e, "the fd holder still keeps this mount's descriptors");
        }
    }

    /// Every mount the holder keeps, with its descriptor, rebuilt from its journal. Entries that
    /// cannot be read are returned as errors (with what to cut off, when known).
    pub fn take_kept(&self) -> std::io::Result<Vec<Result<(MountRecord, OwnedFd), Unreadable>>> {
        let Some(entries) = self.with(|c| c.list()) else {
            return Ok(Vec::new());
        };
        Ok(entries?.into_iter().map(read_entry).collect())
    }
}

/// A kept entry that cannot be served.
#[derive(Debug)]
pub struct Unreadable {
    pub key: String,
    /// The mount to cut off, when the blob could be read.
    pub mount: Option<(PathBuf, (u32, u32))>,
    pub reason: String,
}

fn read_entry(e: holder::HeldEntry) -> Result<(MountRecord, OwnedFd), Unreadable> {
    use base64::Engine;
    let fail = |mount, reason: String| Unreadable {
        key: e.key.clone(),
        mount,
        reason,
    };
    let value: serde_json::Value = serde_json::from_slice(&e.blob)
        .map_err(|err| fail(None, format!("the kept blob is not JSON: {err}")))?;
    let version = value.get("version").and_then(|v| v.as_u64());
    if version != Some(u64::from(KEPT_VERSION)) {
        return Err(fail(
            None,
            format!(
                "kept by a process writing format {version:?}; this build reads {KEPT_VERSION}"
            ),
        ));
    }
    let kept: Kept = serde_json::from_value(value)
        .map_err(|err| fail(None, format!("the kept blob does not parse: {err}")))?;
    let mount = Some((kept.target.clone(), kept.dev));
    let request = base64::engine::general_purpose::STANDARD
        .decode(&kept.request)
        .map_err(|err| fail(mount.clone(), format!("the kept request: {err}")))?;
    let mut fds = e.fds.into_iter();
    let (Some(device), Some(journal)) = (fds.next(), fds.next()) else {
        return Err(fail(mount, "kept without its two descriptors".into()));
    };
    let mut journal = std::fs::File::from(journal);
    let rec = ferry_fs::replay(&mut journal)
        .map_err(|err| fail(mount.clone(), format!("its journal: {err}")))?;
    let snapshot = ferry_fs::journal::recovered_snapshot(&rec);
    Ok((
        MountRecord {
            target: kept.target,
            dev: kept.dev,
            kernel: kept.kernel,
            request,
            snapshot,
            warmed: kept.warmed,
        },
        device,
    ))
}
