//! Handing live mounts from one `ferry-node serve` process to its successor (an upgrade), over a
//! unix socket in the plugin's state directory.
//!
//! The owner of the node's mounts holds an exclusive `flock` on `owner.lock` in the state
//! directory and listens on `handover.sock` there. A new process that cannot take the lock asks
//! the owner for its mounts:
//!
//! 1. successor → owner: [`Hello`] with the state formats it reads.
//! 2. The owner stops its CSI operations and freezes every mount (each FUSE session admits no new
//!    request; running ones finish), then sends [`State`] in its format with each mount's
//!    `/dev/fuse` descriptor attached (SCM_RIGHTS). A successor that cannot read that format is
//!    not sent anything: the owner says so and serves on. The owner lock's descriptor travels with
//!    the mounts': an `flock` belongs to its open file description, so it is never free between.
//! 3. successor → owner: [`Answer::Adopted`] once it has read every record (or
//!    [`Answer::Refused`], and the owner thaws its mounts and serves on).
//! 4. The owner forgets its mounts without unmounting anything and exits at once: requests its
//!    parked session threads had read are then unanswered in the kernel's queue.
//! 5. The successor sees the connection close (the owner's last thread is gone), asks the kernel
//!    to re-send those requests, and serves every mount from its record.
//!
//! The records carry each mount's NodePublishVolume request, secrets included, so the successor
//! signs as the mount did: they only ever travel over this socket, never to disk.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_fs::{FsSnapshot, KernelInit};
use serde::{Deserialize, Serialize};

use crate::fdpass;

/// The handover state format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// How long either side waits for the other's next message.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// One live mount as the owner hands it over.
#[derive(Debug, Serialize, Deserialize)]
pub struct MountRecord {
    /// The canonical mount point.
    pub target: PathBuf,
    /// The mount's device numbers (its FUSE connection is the minor).
    pub dev: (u32, u32),
    /// What the kernel offered at `INIT`.
    pub kernel: KernelInit,
    /// The NodePublishVolume request the mount was made (or last republished) with, protobuf
    /// encoded, secrets included.
    pub request: Vec<u8>,
    /// The filesystem's state.
    pub snapshot: FsSnapshot,
    /// Whether the warm-up the mount asked for (`prefetchOnMount`) had finished: the successor
    /// does not run it again. Absent (an older owner): not known finished, run again.
    #[serde(default)]
    pub warmed: bool,
}

/// The successor's opening message.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    /// State formats the successor reads.
    pub readable: Vec<u32>,
    pub pid: u32,
}

/// The owner's reply: its mounts, one descriptor attached per record in order.
#[derive(Debug, Serialize, Deserialize)]
pub struct State {
    pub version: u32,
    pub pid: u32,
    pub mounts: Vec<MountRecord>,
}

/// The owner's reply when it cannot hand over.
#[derive(Debug, Serialize, Deserialize)]
pub struct Declined {
    pub declined: String,
}

/// The successor's verdict.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    Adopted,
    Refused { reason: String },
}

fn json<T: Serialize>(v: &T) -> io::Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(io::Error::other)
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Paths in the state directory.
#[derive(Debug, Clone)]
pub struct StateDir(pub PathBuf);

impl StateDir {
    pub fn socket(&self) -> PathBuf {
        self.0.join("handover.sock")
    }

    pub fn lock(&self) -> PathBuf {
        self.0.join("owner.lock")
    }

    /// A marker that pod `uid`'s process handed its mounts over: a restart of that container must
    /// not take them back.
    pub fn retired(&self, uid: &str) -> PathBuf {
        self.0.join(format!("retired-{uid}"))
    }
}

/// What the successor received: the records with their descriptors, the owner lock, and the
/// connection on which it must still answer.
pub struct Received {
    pub mounts: Vec<(MountRecord, OwnedFd)>,
    pub owner_pid: u32,
    pub lock: std::fs::File,
    stream: UnixStream,
}

impl Received {
    /// Tells the owner the mounts are ours: it exits.
    pub fn adopt(&self) -> io::Result<()> {
        fdpass::send(&self.stream, &json(&Answer::Adopted)?, &[])
    }

    /// Waits (at most [`STEP_TIMEOUT`]) until the owner has exited: its end of the connection
    /// closes only when its last thread is gone, so no thread of it can take a request after.
    pub fn wait_owner_exit(&self) -> io::Result<()> {
        use std::io::Read;
        let mut buf = [0u8; 64];
        loop {
            match (&self.stream).read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("the owner (pid {}) did not exit: {e}", self.owner_pid),
                    ))
                }
            }
        }
    }
}

/// Successor side: asks the owner listening at `socket` for its mounts. `readable`: the formats
/// this process reads (normally `[FORMAT_VERSION]`). A format it cannot read is refused here, and
/// the owner serves on.
pub fn request(socket: &Path, readable: &[u32]) -> io::Result<Received> {
    let stream = UnixStream::connect(socket)?;
    stream.set_read_timeout(Some(STEP_TIMEOUT))?;
    stream.set_write_timeout(Some(STEP_TIMEOUT))?;
    let hello = Hello {
        readable: readable.to_vec(),
        pid: std::process::id(),
    };
    fdpass::send(&stream, &json(&hello)?, &[])?;
    let (payload, fds) = fdpass::recv(&stream)?;
    let value: serde_json::Value = serde_json::from_slice(&payload)
        .map_err(|e| invalid(format!("the owner's reply is not JSON: {e}")))?;
    if let Some(why) = value.get("declined").and_then(|v| v.as_str()) {
        return Err(io::Error::other(format!(
            "the owner declined the handover: {why}"
        )));
    }
    let version = value.get("version").and_then(|v| v.as_u64());
    let refuse = |reason: String| -> io::Error {
        let answer = Answer::Refused {
            reason: reason.clone(),
        };
        if let Ok(bytes) = json(&answer) {
            let _ = fdpass::send(&stream, &bytes, &[]);
        }
        invalid(reason)
    };
    let readable_version = version.filter(|v| readable.iter().any(|r| u64::from(*r) == *v));
    if readable_version.is_none() {
        return Err(refuse(format!(
            "the owner's state has format version {}, this build reads {readable:?}: refused (the owner keeps serving)",
            version.map_or("(none)".to_string(), |v| v.to_string())
        )));
    }
    let state: State = match serde_json::from_value(value) {
        Ok(s) => s,
        Err(e) => return Err(refuse(format!("the owner's state does not parse: {e}"))),
    };
    // One descriptor per mount, then the owner lock.
    if state.mounts.len() + 1 != fds.len() {
        return Err(refuse(format!(
            "{} mounts came with {} descriptors",
            state.mounts.len(),
            fds.len()
        )));
    }
    let mut fds = fds;
    let lock = std::fs::File::from(fds.pop().expect("counted"));
    Ok(Received {
        mounts: state.mounts.into_iter().zip(fds).collect(),
        owner_pid: state.pid,
        lock,
        stream,
    })
}

/// Owner side of one connection: reads the successor's [`Hello`]; `None` (after telling it) when
/// it cannot read our format.
pub fn read_hello(stream: &UnixStream) -> io::Result<Option<Hello>> {
    stream.set_read_timeout(Some(STEP_TIMEOUT))?;
    stream.set_write_timeout(Some(STEP_TIMEOUT))?;
    let (payload, _) = fdpass::recv(stream)?;
    let hello: Hello =
        serde_json::from_slice(&payload).map_err(|e| invalid(format!("bad hello: {e}")))?;
    if !hello.readable.contains(&FORMAT_VERSION) {
        decline(
            stream,
            &format!(
                "this process writes state format {FORMAT_VERSION}, the successor reads {:?}",
                hello.readable
            ),
        )?;
        return Ok(None);
    }
    Ok(Some(hello))
}

/// Refuses a peer that is not this process's user (the socket's mode says so too; this holds
/// even if its directory was made reachable).
pub fn same_user(stream: &UnixStream) -> io::Result<()> {
    let cred = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(io::Error::from)?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "peer pid {} runs as uid {}, not {me}",
                cred.pid(),
                cred.uid()
            ),
        ));
    }
    Ok(())
}

/// Tells the successor there is no handover.
pub fn decline(stream: &UnixStream, why: &str) -> io::Result<()> {
    fdpass::send(
        stream,
        &json(&Declined {
            declined: why.to_string(),
        })?,
        &[],
    )
}

/// The version stamped on the state this process sends: [`FORMAT_VERSION`], or, to test that a
/// successor refuses state it cannot read, `FERRY_HANDOVER_WRITE_VERSION`.
pub fn write_version() -> u32 {
    std::env::var("FERRY_HANDOVER_WRITE_VERSION")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(FORMAT_VERSION)
}

/// Owner side: sends the state (`mounts` with `fds`, one each, in order, then the owner lock)
/// and waits for the successor's verdict.
pub fn send_state_refs(
    stream: &UnixStream,
    mounts: &[&MountRecord],
    fds: &[BorrowedFd<'_>],
    lock: BorrowedFd<'_>,
) -> io::Result<Answer> {
    if mounts.len() != fds.len() {
        return Err(io::Error::other("a mount without its FUSE descriptor"));
    }
    let mut fds = fds.to_vec();
    fds.push(lock);
    #[derive(Serialize)]
    struct StateRef<'a> {
        version: u32,
        pid: u32,
        mounts: &'a [&'a MountRecord],
    }
    let state = StateRef {
        version: write_version(),
        pid: std::process::id(),
        mounts,
    };
    fdpass::send(stream, &json(&state)?, &fds)?;
    let (payload, _) = fdpass::recv(stream)?;
    serde_json::from_slice(&payload).map_err(|e| invalid(format!("bad answer: {e}")))
}

/// Takes an exclusive `flock` on `path` without waiting: `Ok(None)` if another process holds it.
pub fn try_lock(path: &Path) -> io::Result<Option<std::fs::File>> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    // `flock(LOCK_EX | LOCK_NB)` on Linux.
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}
