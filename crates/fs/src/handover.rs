//! Taking over a live FUSE connection from another process (a node plugin upgrade or crash).
//!
//! The kernel sends `INIT` once per connection, and fuser's `Session::from_fd` always performs that
//! handshake. A successor therefore builds its session on one end of a socket pair, feeds it the
//! `INIT` the kernel sent the first process ([`KernelInit`], recorded by the adapter's `init`),
//! discards the reply, and then puts the real `/dev/fuse` descriptor in the place of the socket
//! (`dup3` onto the session's own descriptor number) before the session reads its first request.
//! The adapter's `init` is deterministic in what the kernel offered, so the successor negotiates
//! (in its own head) what the kernel already applied.
//!
//! A process that hands its mounts over first closes each adapter's [`Gate`]: new requests park on
//! the session thread (read from the kernel, not answered), requests in flight finish, and the
//! state is then frozen. The parked requests stay in the kernel's processing queue of the shared
//! `/dev/fuse` file; the successor asks the kernel to queue them again ([`notify_resend`],
//! `FUSE_NOTIFY_RESEND`, Linux 6.9+) before it serves, and answers them. After a crash the
//! requests the dead process had read are in that queue too. Passthrough backing files stay
//! registered: their ids travel with the handles, and the successor's opens of those inodes name
//! the same ids (the kernel admits nothing else beside an open passthrough file).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// What the kernel's `INIT` offered a connection: replayed to a successor's session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelInit {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// `flags | flags2 << 32`.
    pub flags: u64,
}

/// `FUSE_HAS_RESEND`: the kernel re-queues unanswered requests on [`notify_resend`].
const FUSE_HAS_RESEND: u64 = 1 << 39;
/// `FUSE_INIT_EXT`: `flags2` carries the high half.
const FUSE_INIT_EXT: u64 = 1 << 30;
const FUSE_INIT: u32 = 26;
/// `fuse_notify_code::FUSE_NOTIFY_RESEND`.
const FUSE_NOTIFY_RESEND: i32 = 7;
/// The bit the kernel sets in a re-sent request's unique id.
pub const FUSE_UNIQUE_RESEND: u64 = 1 << 63;
// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)` (include/uapi/linux/fuse.h).
nix::ioctl_write_ptr!(fuse_dev_ioc_backing_close, 229, 2, u32);

impl KernelInit {
    /// Whether the kernel can re-send the requests a previous process left unanswered.
    pub fn has_resend(&self) -> bool {
        self.flags & FUSE_HAS_RESEND != 0
    }

    /// The `INIT` request (`fuse_in_header` + `fuse_init_in`) the kernel sent, as bytes.
    pub(crate) fn request(&self) -> Vec<u8> {
        const LEN: u32 = 40 + 64;
        let mut flags = self.flags;
        if flags >> 32 != 0 {
            flags |= FUSE_INIT_EXT;
        }
        let mut b = Vec::with_capacity(LEN as usize);
        b.extend_from_slice(&LEN.to_ne_bytes());
        b.extend_from_slice(&FUSE_INIT.to_ne_bytes());
        b.extend_from_slice(&1u64.to_ne_bytes()); // unique
        b.extend_from_slice(&0u64.to_ne_bytes()); // nodeid
        b.extend_from_slice(&[0u8; 16]); // uid, gid, pid, padding
        b.extend_from_slice(&self.major.to_ne_bytes());
        b.extend_from_slice(&self.minor.to_ne_bytes());
        b.extend_from_slice(&self.max_readahead.to_ne_bytes());
        b.extend_from_slice(&(flags as u32).to_ne_bytes());
        b.extend_from_slice(&((flags >> 32) as u32).to_ne_bytes());
        b.extend_from_slice(&[0u8; 44]);
        debug_assert_eq!(b.len(), LEN as usize);
        b
    }
}

/// Asks the kernel to queue again every request of the connection that was read but not answered
/// (by a process that handed over or died). Each comes back with [`FUSE_UNIQUE_RESEND`] set.
pub fn notify_resend(dev: BorrowedFd<'_>) -> io::Result<()> {
    let mut msg = [0u8; 16];
    msg[0..4].copy_from_slice(&16u32.to_ne_bytes());
    msg[4..8].copy_from_slice(&FUSE_NOTIFY_RESEND.to_ne_bytes());
    nix::unistd::write(dev, &msg)?;
    Ok(())
}

/// Unregisters the connection's passthrough backing file `id` (open files keep reading theirs).
pub fn close_backing_id(dev: BorrowedFd<'_>, id: u32) -> io::Result<()> {
    // SAFETY: the ioctl reads one u32 from a live local.
    unsafe { fuse_dev_ioc_backing_close(dev.as_raw_fd(), &id) }?;
    Ok(())
}

/// Decides whether the session thread may hand a request to the filesystem: open while the mount
/// is served here; closed while the mount is being handed over (requests then park, unanswered,
/// for the successor); handed over for good once the successor took it.
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    closed: bool,
    handed_over: bool,
    in_flight: usize,
}

/// One request admitted through the [`Gate`]; dropped when it has been answered.
#[derive(Debug)]
pub struct Pass<'a>(&'a Gate);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.in_flight -= 1;
        if st.in_flight == 0 {
            self.0.changed.notify_all();
        }
    }
}

/// A [`Pass`] that can move into a task.
#[derive(Debug)]
pub struct OwnedPass(std::sync::Arc<Gate>);

impl Drop for OwnedPass {
    fn drop(&mut self) {
        drop(Pass(&self.0));
    }
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits while the gate is closed (forever once handed over: the request is the successor's),
    /// then admits one request.
    pub fn enter(self: &std::sync::Arc<Self>) -> OwnedPass {
        let mut st = self.lock();
        while st.closed {
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.in_flight += 1;
        OwnedPass(self.clone())
    }

    /// Closes the gate and waits until no admitted request is left, at most `timeout`; if some
    /// are still running then, opens it again and says so (the handover is off).
    pub fn close(&self, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        st.closed = true;
        while st.in_flight > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let n = st.in_flight;
                st.closed = false;
                self.changed.notify_all();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{n} requests still running after {timeout:?}"),
                ));
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Opens the gate again (a handover that did not happen).
    pub fn open(&self) {
        let mut st = self.lock();
        if !st.handed_over {
            st.closed = false;
            self.changed.notify_all();
        }
    }

    /// The successor has the mount: the gate stays closed and the session's end (this process
    /// exiting) must not settle any handle.
    pub fn hand_over(&self) {
        let mut st = self.lock();
        st.closed = true;
        st.handed_over = true;
    }

    pub fn is_handed_over(&self) -> bool {
        self.lock().handed_over
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn init_request_layout() {
        let ki = KernelInit {
            major: 7,
            minor: 45,
            max_readahead: 1 << 20,
            flags: (1 << 39) | 1,
        };
        let b = ki.request();
        assert_eq!(b.len(), 104);
        assert_eq!(u32::from_ne_bytes(b[4..8].try_into().unwrap()), FUSE_INIT);
        let flags = u32::from_ne_bytes(b[52..56].try_into().unwrap());
        assert_eq!(u64::from(flags), 1 | FUSE_INIT_EXT);
        assert_eq!(u32::from_ne_bytes(b[56..60].try_into().unwrap()), 1 << 7);
        assert!(ki.has_resend());
    }

    #[test]
    fn gate_waits_for_requests_in_flight_and_parks_new_ones() {
        let gate = Arc::new(Gate::default());
        let pass = gate.enter();
        // One request in flight: closing times out and reopens.
        assert!(gate.close(Duration::from_millis(20)).is_err());
        let again = gate.enter();
        drop(again);
        let g = gate.clone();
        let closer = std::thread::spawn(move || g.close(Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        drop(pass);
        closer.join().unwrap().unwrap();
        // Closed: a new request parks until the gate opens.
        let g = gate.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let parked = std::thread::spawn(move || {
            let _p = g.enter();
            tx.send(()).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        gate.open();
        rx.recv_timeout(Duration::from_secs(30)).unwrap();
        parked.join().unwrap();
        gate.hand_over();
        gate.open();
        assert!(gate.is_handed_over());
    }
}
