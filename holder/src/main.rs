//! `ferry-fd-holder`: holds the fds of live mounts (`/dev/fuse` fds, journal memfds) so that they
//! survive a SIGKILL, OOM kill or panic of `ferry-node`, and hands them back to its next start.
//!
//! It runs as a sidecar container in the node plugin pod and only dies with the pod (on SIGTERM it
//! exits and its fds close: by then the mounts are going away anyway). It must outlive every bug of
//! the data path, so it runs none of it: its code uses std, nix, serde, tracing, clap and
//! [`ferry_holder`] (its library, with [`ferry_holder::fdpass`]), a package of its own that depends on none of the filesystem, store or CSI crates
//! (so not even a library constructor of theirs is linked in).
//! The protocol is described in [`ferry_holder`].
//!
//! Each connection gets a thread of its own, with a read and write timeout, so that a slow or stuck
//! client holds up only itself; the table sits behind one mutex that is never held across a send or
//! receive.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use ferry_holder::fdpass;
use ferry_holder::{self as holder, EntryInfo, Reply, Request};
use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::stat::{umask, Mode};
use tracing::{debug, error, info, warn};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Holds the fds of Ferry's live mounts across restarts of ferry-node"
)]
struct Cli {
    /// The unix socket to serve (mode 0600); a stale socket file there is replaced.
    #[arg(long, env = "FERRY_HOLDER_SOCKET")]
    socket: PathBuf,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, env = "FERRY_LOG", default_value = "info")]
    log: String,
}

/// How long a connection may take to send a whole request or to take a whole reply, and may sit
/// idle; the client reconnects after an idle close.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; beyond it a new one is told so and closed (ferry-node needs one).
const MAX_CONNECTIONS: usize = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = match tracing_subscriber::EnvFilter::try_new(&cli.log) {
        Ok(filter) => filter,
        Err(e) => {
            eprintln!("invalid log filter {:?}: {e}", cli.log);
            return ExitCode::FAILURE;
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .init();
    match run(&cli.socket) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(socket: &Path) -> anyhow::Result<()> {
    // Blocked before any thread starts, so every thread inherits the mask and only the waiter
    // below takes them (as PID 1 of a container the process has no default action for SIGTERM).
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.thread_block().context("blocking SIGTERM")?;

    raise_fd_limit();
    let _lock = lock(socket)?;
    let listener = bind(socket)?;
    let table = Arc::new(Mutex::new(Table::default()));
    info!(socket = %socket.display(), pid = std::process::id(), "holding fds; serving");

    {
        let (socket, table) = (socket.to_path_buf(), Arc::clone(&table));
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                // sigwait fails only on an invalid set; exit then too rather than hold on unkillable.
                let signal = signals.wait().map_or("?", |s| s.as_str());
                let table = table.lock().unwrap_or_else(PoisonError::into_inner);
                info!(
                    signal,
                    entries = table.entries.len(),
                    fds = table.fd_count(),
                    "exiting; the held fds close"
                );
                // Ours to remove: the lock is held until the process is gone.
                let _ = std::fs::remove_file(&socket);
                std::process::exit(0);
            })
            .context("starting the signal thread")?;
    }

    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(stream) => stream,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning on the same error.
                warn!("accepting a connection: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let Some(slot) = Slot::take(&active) else {
            warn!("refusing a connection: {MAX_CONNECTIONS} are open");
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let busy = error_reply(format!(
                "the holder is serving {MAX_CONNECTIONS} connections already"
            ));
            let _ = fdpass::send(&stream, &holder::encode(busy), &[]);
            continue;
        };
        let table = Arc::clone(&table);
        let spawned = std::thread::Builder::new()
            .name("connection".into())
            .spawn(move || {
                let _slot = slot;
                serve(stream, &table);
            });
        if let Err(e) = spawned {
            warn!("starting a connection thread: {e}");
        }
    }
    unreachable!("a listener's incoming() never ends")
}

/// One of the [`MAX_CONNECTIONS`] connections, given back when dropped (also when its thread
/// panics, or fails to start).
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(active: &Arc<AtomicUsize>) -> Option<Slot> {
        active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_CONNECTIONS).then_some(n + 1)
            })
            .ok()
            .map(|_| Slot(Arc::clone(active)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Raises the soft fd limit to the hard one: a full table is [`holder::MAX_ENTRIES`] ×
/// [`holder::MAX_FDS_PER_ENTRY`] fds, and a list reply duplicates them for a moment.
fn raise_fd_limit() {
    let want = (2 * holder::MAX_ENTRIES * holder::MAX_FDS_PER_ENTRY + 256) as u64;
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => {
            if soft < hard {
                if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                    warn!("raising the fd limit from {soft} to {hard}: {e}");
                }
            }
            if hard < want {
                warn!("the fd limit is {hard}: a full table needs {want}; deposits may fail with EMFILE");
            }
        }
        Err(e) => warn!("reading the fd limit: {e}"),
    }
}

/// Takes `SOCKET.lock`, so two holders never serve one path (each would think the other's socket
/// file stale). A live holder's pid is named in the error when it answers.
fn lock(socket: &Path) -> anyhow::Result<Flock<File>> {
    let mut path = socket.as_os_str().to_owned();
    path.push(".lock");
    let path = PathBuf::from(path);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(lock),
        Err((_, Errno::EWOULDBLOCK)) => {
            let who = match holder::Client::connect(socket).and_then(|mut c| c.ping()) {
                Ok(pong) => format!("pid {}, holding {} entries", pong.pid, pong.entries),
                Err(e) => format!("it did not answer: {e}"),
            };
            bail!(
                "another ferry-fd-holder is serving {} ({who}); refusing to start a second",
                socket.display()
            )
        }
        Err((_, e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

/// Binds `socket` with mode 0600, first removing a socket file nobody listens on. Anything else at
/// the path (a live listener, a regular file) is left alone and refused.
fn bind(socket: &Path) -> anyhow::Result<UnixListener> {
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => match UnixStream::connect(socket) {
            Ok(_) => bail!(
                "something already listens on {}; refusing to replace it",
                socket.display()
            ),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                info!(socket = %socket.display(), "removing a stale socket file");
                std::fs::remove_file(socket)
                    .with_context(|| format!("removing the stale socket {}", socket.display()))?;
            }
            Err(e) => bail!("probing the existing socket {}: {e}", socket.display()),
        },
        Ok(_) => bail!(
            "{} exists and is not a socket; refusing to remove it",
            socket.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => bail!("inspecting {}: {e}", socket.display()),
    }
    // The umask makes the socket 0600 from its first moment (no window in which others could
    // connect); set_permissions says so again whatever the umask did. Only the signal thread runs
    // beside this one and it creates no files.
    let old = umask(Mode::from_bits_truncate(0o177));
    let bound = UnixListener::bind(socket);
    umask(old);
    let listener = bound.with_context(|| format!("binding {}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", socket.display()))?;
    Ok(listener)
}

/// Serves one connection until it closes, times out or garbles a frame.
fn serve(stream: UnixStream, table: &Mutex<Table>) {
    if let Err(e) = stream
        .set_read_timeout(Some(CONNECTION_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(CONNECTION_TIMEOUT)))
    {
        warn!("setting a connection's timeouts: {e}");
        return;
    }
    loop {
        let (payload, fds) = match fdpass::recv(&stream) {
            Ok(message) => message,
            Err(e) => {
                match e.kind() {
                    // The usual end (or a client gone mid-message, or idle for too long).
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::WouldBlock => {
                        debug!("connection closed: {e}")
                    }
                    _ => warn!("dropping a connection: {e}"),
                }
                return;
            }
        };
        let (reply, fds) = handle(table, &payload, fds);
        let fds: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
        if let Err(e) = fdpass::send(&stream, &holder::encode(reply), &fds) {
            warn!("sending a reply: {e}");
            return;
        }
    }
}

/// Answers one request. The frame was whole, so even a refused request leaves the connection in
/// step. Fds that came with a request that takes none are closed (dropped) with it.
fn handle(table: &Mutex<Table>, payload: &[u8], fds: Vec<OwnedFd>) -> (Reply, Vec<OwnedFd>) {
    let request = match holder::decode::<Request>(payload) {
        Ok(request) => request,
        Err(message) => return (error_reply(message), Vec::new()),
    };
    // A panic in another connection's thread must not take the held fds down with it: the table
    // is consistent between calls (every method changes it in one step), so poisoning is ignored.
    let lock = || table.lock().unwrap_or_else(PoisonError::into_inner);
    let reply = match request {
        Request::Deposit { key, blob } => {
            let (blob_len, fd_count) = (blob.len(), fds.len());
            let mut table = lock();
            match table.deposit(key.clone(), blob, fds) {
                Ok(replaced) => {
                    debug!(
                        key,
                        blob_len,
                        fd_count,
                        replaced = replaced.is_some(),
                        entries = table.entries.len(),
                        fds = table.fd_count(),
                        "deposit"
                    );
                    Reply::Ok
                }
                Err(message) => {
                    warn!(key, "refused a deposit: {message}");
                    error_reply(message)
                }
            }
        }
        Request::List | Request::Ping | Request::Withdraw { .. } if !fds.is_empty() => error_reply(
            format!("this request carries no fds, yet {} came", fds.len()),
        ),
        Request::Withdraw { key } => {
            let mut table = lock();
            let withdrawn = table.withdraw(&key);
            debug!(
                key,
                present = withdrawn.is_some(),
                entries = table.entries.len(),
                fds = table.fd_count(),
                "withdraw"
            );
            Reply::Ok
        }
        Request::Ping => {
            let entries = lock().entries.len();
            Reply::Pong {
                pid: std::process::id(),
                entries,
            }
        }
        Request::List => {
            // Duplicates under the lock, the encoding and the send outside it.
            let snapshot = lock().snapshot();
            return match snapshot {
                Ok((entries, fds)) => {
                    info!(
                        entries = entries.len(),
                        fds = fds.len(),
                        "handing back the held fds (list)"
                    );
                    let entries = entries
                        .into_iter()
                        .map(|(key, blob, fd_count)| EntryInfo {
                            key,
                            blob: blob.to_vec(),
                            fd_count,
                        })
                        .collect();
                    (Reply::Entries { entries }, fds)
                }
                Err(e) => (
                    error_reply(format!("duplicating the held fds: {e}")),
                    Vec::new(),
                ),
            };
        }
    };
    (reply, Vec::new())
}

fn error_reply(message: String) -> Reply {
    Reply::Error { message }
}

/// The held entries, by key. Invariants: at most [`holder::MAX_ENTRIES`] entries, each within
/// [`holder::check_deposit`]'s limits, and `list_bytes` is the sum of the entries' own, at most
/// [`holder::MAX_LIST_BYTES`] — so a list reply always fits in one frame.
#[derive(Default)]
struct Table {
    entries: BTreeMap<String, Held>,
    list_bytes: usize,
}

#[derive(Debug)]
struct Held {
    /// Shared, so a list copies it outside the lock.
    blob: Arc<[u8]>,
    fds: Vec<OwnedFd>,
    /// What this entry adds to a list reply ([`holder::list_bytes`]).
    list_bytes: usize,
}

type Snapshot = (Vec<(String, Arc<[u8]>, usize)>, Vec<OwnedFd>);

impl Table {
    /// Keeps `fds` and `blob` under `key` and returns the entry it replaced (the caller drops it,
    /// closing its fds). A refused deposit changes nothing and its fds close with the error.
    fn deposit(
        &mut self,
        key: String,
        blob: Vec<u8>,
        fds: Vec<OwnedFd>,
    ) -> Result<Option<Held>, String> {
        holder::check_deposit(&key, &blob, fds.len())?;
        let old = self.entries.get(&key).map(|held| held.list_bytes);
        if old.is_none() && self.entries.len() >= holder::MAX_ENTRIES {
            return Err(format!(
                "the holder is full: it keeps at most {} entries; withdraw some first",
                holder::MAX_ENTRIES
            ));
        }
        let list_bytes = holder::list_bytes(&key, blob.len());
        let total = self.list_bytes - old.unwrap_or(0) + list_bytes;
        if total > holder::MAX_LIST_BYTES {
            return Err(format!(
                "the holder is full: its entries would take {total} bytes to list, above the \
                 limit of {}; withdraw some first",
                holder::MAX_LIST_BYTES
            ));
        }
        self.list_bytes = total;
        let held = Held {
            blob: blob.into(),
            fds,
            list_bytes,
        };
        Ok(self.entries.insert(key, held))
    }

    fn withdraw(&mut self, key: &str) -> Option<Held> {
        let held = self.entries.remove(key)?;
        self.list_bytes -= held.list_bytes;
        Some(held)
    }

    /// Every entry's key, blob and fd count, and duplicates of all their fds in entry order.
    fn snapshot(&self) -> io::Result<Snapshot> {
        let mut fds = Vec::with_capacity(self.fd_count());
        let mut entries = Vec::with_capacity(self.entries.len());
        for (key, held) in &self.entries {
            for fd in &held.fds {
                fds.push(fd.try_clone()?);
            }
            entries.push((key.clone(), Arc::clone(&held.blob), held.fds.len()));
        }
        Ok((entries, fds))
    }

    fn fd_count(&self) -> usize {
        self.entries.values().map(|held| held.fds.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fd() -> OwnedFd {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap().1
    }

    #[test]
    fn a_deposit_replaces_its_key_and_keeps_the_byte_count() {
        let mut table = Table::default();
        assert!(table
            .deposit("a".into(), vec![1; 10], vec![fd()])
            .unwrap()
            .is_none());
        let one = table.list_bytes;
        let replaced = table
            .deposit("a".into(), vec![2; 10], vec![fd(), fd()])
            .unwrap();
        assert_eq!(replaced.unwrap().fds.len(), 1);
        assert_eq!(
            (table.entries.len(), table.fd_count(), table.list_bytes),
            (1, 2, one)
        );
        assert!(table.withdraw("a").is_some());
        assert!(table.withdraw("a").is_none());
        assert_eq!((table.entries.len(), table.list_bytes), (0, 0));
    }

    #[test]
    fn the_table_refuses_beyond_its_entry_count_but_still_replaces() {
        // One fd per entry: more than a default soft limit of 1024.
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
        let mut table = Table::default();
        let shared = fd();
        for i in 0..holder::MAX_ENTRIES {
            let dup = shared.try_clone().unwrap();
            table.deposit(i.to_string(), Vec::new(), vec![dup]).unwrap();
        }
        let err = table
            .deposit("one more".into(), Vec::new(), vec![fd()])
            .unwrap_err();
        assert!(err.contains("at most 4096 entries"), "{err}");
        table
            .deposit("7".into(), b"new".to_vec(), vec![fd()])
            .unwrap();
        assert_eq!(table.entries.len(), holder::MAX_ENTRIES);
    }

    #[test]
    fn the_table_refuses_what_would_not_fit_one_list_reply() {
        let mut table = Table::default();
        let big = vec![0; holder::MAX_BLOB_BYTES];
        table.deposit("1".into(), big.clone(), vec![fd()]).unwrap();
        table.deposit("2".into(), big.clone(), vec![fd()]).unwrap();
        let err = table
            .deposit("3".into(), big.clone(), vec![fd()])
            .unwrap_err();
        assert!(err.contains("to list"), "{err}");
        // Replacing an entry counts only the difference.
        table.deposit("2".into(), big, vec![fd()]).unwrap();
        assert!(table.list_bytes <= holder::MAX_LIST_BYTES);
    }

    #[test]
    fn a_list_snapshot_duplicates_in_entry_order() {
        let mut table = Table::default();
        table
            .deposit("b".into(), b"B".to_vec(), vec![fd(), fd()])
            .unwrap();
        table
            .deposit("a".into(), b"A".to_vec(), vec![fd()])
            .unwrap();
        let (entries, fds) = table.snapshot().unwrap();
        let summary: Vec<(&str, &[u8], usize)> = entries
            .iter()
            .map(|(k, b, n)| (k.as_str(), &b[..], *n))
            .collect();
        assert_eq!(summary, [("a", &b"A"[..], 1), ("b", &b"B"[..], 2)]);
        assert_eq!(fds.len(), 3);
        assert_eq!(table.fd_count(), 3, "the table keeps its own");
    }
}
