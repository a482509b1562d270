//! The thin fuser adapter: implements [`fuser::Filesystem`] by handing each request to the core
//! ([`crate::fs::Fs`]) on the tokio runtime and replying from the task, so the session thread
//! never waits for S3 and requests proceed concurrently. A few metadata operations are polled once
//! on the session thread first and answered there when they need nothing remote. No filesystem
//! logic lives here.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::future::Future;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use fuser::{
    AccessFlags, BackingId, CopyFileRangeFlags, Errno, FileAttr, FileHandle, FileType, Filesystem,
    FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenFlags,
    PollEvents, PollFlags, PollNotifier, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyLseek, ReplyOpen,
    ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use tokio::runtime::Handle;

use crate::error::FsError;
use crate::fs::{Attr, Closing, DirEntry, DirSink, Fs, Opened, SetAttr};
use crate::handover::{Gate, KernelInit};
use crate::names::Kind;

/// Kernel read-ahead asked for (the kernel caps it at what it offered).
const READAHEAD: u32 = 1 << 20;
/// Background requests (read-ahead, async reads) the kernel keeps in flight per mount.
const MAX_BACKGROUND: u16 = 128;

/// A write open with `O_SYNC` or `O_DSYNC`: each write would be an `fsync`, which completes the
/// upload (an S3 object exists only whole), so the object would be the first write's bytes and
/// every later write `EBADF`. Refused at the open instead.
const SYNC_WRITES: FsError = FsError::InvalidArgument(
    "O_SYNC/O_DSYNC writes cannot be honoured on S3 (an object exists only whole, at close)",
);

/// The [`fuser::Filesystem`] of one mount.
#[derive(Debug)]
pub struct FuseAdapter {
    fs: Arc<Fs>,
    rt: Handle,
    pt: Arc<Passthrough>,
    /// Admits requests; closed while the mount is handed to another process.
    gate: Arc<Gate>,
    /// What the kernel's `INIT` offered (kept for a successor's session).
    kernel: Arc<Mutex<Option<KernelInit>>>,
}

/// FUSE passthrough: the kernel reads an open file straight from a backing file (the node
/// cache's whole copy of the object) and no read reaches Ferry.
///
/// Backing files are registered by raw id on the connection's `/dev/fuse` descriptor and
/// unregistered here when their last handle closes (not by fuser's `BackingId`, whose id cannot be
/// read back): the ids are kept with the handles, so that a successor process (a handover, or
/// recovery after a crash) goes on using them. The kernel requires every open of an inode that is
/// open through passthrough to name the same backing file.
#[derive(Debug, Default)]
struct Passthrough {
    /// Asked for, and not refused by the kernel so far.
    enabled: AtomicBool,
    /// The connection's `/dev/fuse` (a duplicate), when Ferry mounted it itself.
    dev: std::sync::OnceLock<std::os::fd::OwnedFd>,
    /// Backing files registered with this connection, by inode, with how many handles use them
    /// (the kernel wants one backing file per inode; it is unregistered when the last closes).
    backing: Mutex<HashMap<u64, (u32, usize)>>,
    /// Passthrough handles and their inodes.
    handles: Mutex<HashMap<u64, u64>>,
}

impl Passthrough {
    /// The backing id of `ino` if one is registered (counting `fh` as one more user).
    fn existing(&self, ino: u64, fh: u64) -> Option<u32> {
        let mut backing = self.backing.lock().expect("backing lock");
        let (id, users) = backing.get_mut(&ino)?;
        *users += 1;
        self.handles.lock().expect("handles lock").insert(fh, ino);
        Some(*id)
    }

    /// The inode's backing id: the one in use, or `file` registered now, for handle `fh`.
    fn backing_for(&self, ino: u64, fh: u64, file: &std::fs::File) -> std::io::Result<u32> {
        let mut backing = self.backing.lock().expect("backing lock");
        let id = match backing.get_mut(&ino) {
            Some((id, users)) => {
                *users += 1;
                *id
            }
            None => {
                let dev = self
                    .dev
                    .get()
                    .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EPERM))?;
                let id = BackingId::create_raw(dev, file)?;
                backing.insert(ino, (id, 1));
                id
            }
        };
        self.handles.lock().expect("handles lock").insert(fh, ino);
        Ok(id)
    }

    /// Takes over passthrough handles another process opened (`None`: its id is unknown).
    fn inherit(&self, handles: Vec<(u64, u64, Option<u32>)>) {
        let mut backing = self.backing.lock().expect("backing lock");
        let mut by_fh = self.handles.lock().expect("handles lock");
        for (fh, ino, id) in handles {
            match id {
                Some(id) => {
                    backing.entry(ino).or_insert((id, 0)).1 += 1;
                    by_fh.insert(fh, ino);
                }
                None => tracing::warn!(
                    ino,
                    "a handle reads through a backing file whose id was not recorded: other opens of the file fail until it is closed"
                ),
            }
        }
    }

    fn closed(&self, fh: u64) {
        let Some(ino) = self.handles.lock().expect("handles lock").remove(&fh) else {
            return;
        };
        let mut backing = self.backing.lock().expect("backing lock");
        if let Some((id, users)) = backing.get_mut(&ino) {
            *users -= 1;
            if *users == 0 {
                let id = *id;
                backing.remove(&ino);
                if let Some(dev) = self.dev.get() {
                    if let Err(e) = crate::handover::close_backing_id(dev.as_fd(), id) {
                        tracing::debug!(id, error = %e, "unregistering a backing file");
                    }
                }
            }
        }
    }
}

impl FuseAdapter {
    /// The adapter of `fs`; `passthrough`: hand whole cached objects to the kernel when it
    /// supports FUSE passthrough.
    pub fn new(fs: Arc<Fs>, rt: Handle, passthrough: bool) -> Self {
        let pt = Passthrough {
            enabled: AtomicBool::new(passthrough && fs.uses_cache()),
            ..Default::default()
        };
        // A successor goes on with the backing files its predecessor registered.
        pt.inherit(fs.passthrough_handles());
        FuseAdapter {
            fs,
            rt,
            pt: Arc::new(pt),
            gate: Arc::default(),
            kernel: Arc::default(),
        }
    }

    /// The connection's `/dev/fuse` descriptor (a duplicate): passthrough needs it (without one,
    /// when fusermount3 mounted, nothing is read through passthrough).
    pub fn with_device(self, dev: std::os::fd::OwnedFd) -> Self {
        let _ = self.pt.dev.set(dev);
        self
    }

    /// The gate requests pass (for a handover).
    pub fn gate(&self) -> Arc<Gate> {
        self.gate.clone()
    }

    /// Where `init` records what the kernel offered.
    pub fn kernel_init(&self) -> Arc<Mutex<Option<KernelInit>>> {
        self.kernel.clone()
    }

    /// Runs operation `op` on the runtime; once replied to, it is counted by outcome and timed
    /// in `ferry_fuse_operations_total` / `ferry_fuse_operation_duration_seconds`.
    fn spawn<F, Fut>(&self, op: &'static str, f: F)
    where
        F: FnOnce(Arc<Fs>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.run(op, false, f)
    }

    /// [`Self::spawn`] for an operation that rarely waits and never copies file data: it is
    /// polled once on the session thread first, and one answered from memory (a cached lookup,
    /// an open pinning a cached ETag, a read handle's release) replies from here, saving the hop
    /// to a runtime worker. One that has to wait goes on to the runtime as it is (a future may
    /// be polled with one waker and then another). Not for `read`: the session thread would
    /// then copy every reader's data (P7 fell from ~790 to ~320 MiB/s).
    fn serve<F, Fut>(&self, op: &'static str, f: F)
    where
        F: FnOnce(Arc<Fs>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.run(op, true, f)
    }

    fn run<F, Fut>(&self, op: &'static str, poll_here: bool, f: F)
    where
        F: FnOnce(Arc<Fs>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        // Parks here while the mount is being handed over (the request is then the successor's).
        let pass = self.gate.enter();
        let timer = OpTimer::start(op);
        let mut fut = Box::pin(f(self.fs.clone()));
        if poll_here {
            let _rt = self.rt.enter();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if fut.as_mut().poll(&mut cx).is_ready() {
                drop(timer);
                drop(pass);
                return;
            }
        }
        self.rt.spawn(async move {
            fut.await;
            drop(timer);
            drop(pass);
        });
    }
}

thread_local! {
    /// The operation and errno [`errno`] last answered on this thread: the outcome of that
    /// request, taken by its [`OpTimer`], which drops right after the reply on the same thread.
    static ANSWERED: std::cell::Cell<Option<(&'static str, i32)>> = const { std::cell::Cell::new(None) };
}

/// Counts one FUSE operation by outcome and times it from the request to its reply
/// (`ferry_fuse_operations_total`, `ferry_fuse_operation_duration_seconds`), when dropped.
struct OpTimer {
    op: &'static str,
    start: std::time::Instant,
}

impl OpTimer {
    fn start(op: &'static str) -> Self {
        OpTimer {
            op,
            start: std::time::Instant::now(),
        }
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        let errno = ANSWERED
            .take()
            .filter(|&(op, _)| op == self.op)
            .map(|(_, code)| code);
        ferry_metrics::record_fuse_op(self.op, errno, self.start.elapsed());
    }
}

/// The errno for `e`, through the one mapping ([`FsError::errno`]); logged by severity.
fn errno(op: &'static str, e: &FsError) -> Errno {
    let code = e.errno();
    ANSWERED.set(Some((op, code)));
    if code == libc::EIO || code == libc::ESTALE || code == libc::EACCES {
        tracing::warn!(op, error = %e, "request failed");
    } else {
        tracing::debug!(op, error = %e, "request refused");
    }
    Errno::from_i32(code)
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: a.blksize,
        flags: 0,
    }
}

/// The open's flags: keep the page cache when the version is the same, and for a read handle no
/// `FLUSH` at `close` (it has nothing to flush; one request fewer per file read).
fn fopen_flags(o: Opened, read_only: bool) -> FopenFlags {
    let mut flags = FopenFlags::empty();
    if o.keep_cache {
        flags |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if read_only {
        flags |= FopenFlags::FOPEN_NOFLUSH;
    }
    flags
}

/// Whether the kernel re-sent `req` after a takeover (`FUSE_NOTIFY_RESEND`): a process that died
/// may have carried it out already without answering, so a remove that finds nothing, or a
/// `mkdir` that finds the directory, succeeded then. (A handover re-sends only requests the
/// previous process never started.)
fn resent(req: &Request) -> bool {
    req.unique().0 & crate::handover::FUSE_UNIQUE_RESEND != 0
}

/// `req`'s `unique` as the kernel first sent it (without the re-send bit): the same when it is
/// re-sent to a successor, which tells from it the handle a dead process opened for it.
fn request_id(req: &Request) -> u64 {
    req.unique().0 & !crate::handover::FUSE_UNIQUE_RESEND
}

/// Answers an open with passthrough through the connection's backing file `id` (which stays
/// registered: [`Passthrough`] unregisters it).
fn opened_passthrough(reply: ReplyOpen, fh: u64, id: u32) {
    // SAFETY: `id` is a backing id registered on this connection and kept registered while a
    // handle uses it; `into_raw` below keeps fuser from unregistering it.
    let backing = unsafe { reply.wrap_backing(id) };
    reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &backing);
    let _ = backing.into_raw();
}

/// FUSE reports the calling thread; uploads belong to processes (thread groups). Falls back to
/// the raw id (e.g. 0 for a process outside our pid namespace).
fn tgid(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(pid)
}

/// Whether thread `pid` is exiting on a fatal signal (`kill -9`, an OOM kill, a crash, the
/// default action of SIGTERM): `/proc/<pid>/stat` shows the kernel's `PF_EXITING` and an exit
/// code that is a signal number (set before the kernel closes the dying process's files; a normal
/// `exit(n)` is `n << 8`). `false` when the thread cannot be seen (pid 0: outside the mount's pid
/// namespace), is gone, or does not answer in time ([`read_proc`]).
fn killed(pid: u32) -> bool {
    pid != 0
        && read_proc(move || {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| killed_by_stat(&s))
        })
        .unwrap_or(false)
}

/// What the opener's close of file `ino` (being written on the mount named `fs_name`, `written`
/// bytes so far) is, for [`Fs::flush_by`]: [`Closing::Killed`] as [`killed`] tells; else
/// [`Closing::StillHeld`] when the process still holds the file open for writing at another
/// descriptor ([`holds_file`]: a shell builtin's `echo x >&2` `dup2`s over a descriptor and puts
/// it back, which closes one copy); else [`Closing::Last`]. Whatever cannot be read in time is
/// [`Closing::Last`]: the upload completes, as a close of the last descriptor would.
fn closing(pid: u32, ino: u64, written: u64, fs_name: String) -> Closing {
    if pid == 0 {
        return Closing::Last;
    }
    read_proc(move || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"));
        if stat.is_ok_and(|s| killed_by_stat(&s)) {
            Closing::Killed
        } else if holds_file(pid, ino, written, &fs_name) {
            Closing::StillHeld
        } else {
            Closing::Last
        }
    })
    .unwrap_or(Closing::Last)
}

/// Runs `read` (of `/proc`) on a thread of its own and waits [`PROC_WAIT`] at most; `None` past
/// that. A task in `execve` closes its close-on-exec files (a `flush` to this mount) while it
/// holds a lock that reading its `/proc` files waits for, so a read on the thread that must
/// answer that flush would never return. The caller is then taken as alive and done with the
/// file; the read ends once the flush is answered and the `execve` goes on.
fn read_proc<T: Send + 'static>(read: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("ferry-proc".into())
        .spawn(move || {
            let _ = tx.send(read());
        })
        .ok()?;
    rx.recv_timeout(PROC_WAIT).ok()
}

/// How long [`read_proc`] waits.
const PROC_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Descriptors of a process looked at, at most, by [`holds_file`].
const FDS_MAX: usize = 16_384;

/// Whether thread `pid`'s descriptor table holds inode `ino` of the mount named `fs_name` open
/// for writing at position `pos`: `/proc/<pid>/fdinfo/*` gives each descriptor's position, access
/// mode, mount id and inode number (the inode only since Linux 5.14: before, nothing is found);
/// the process's `mountinfo` tells which mount ids are this file system (other file systems have
/// the same inode numbers). The position tells this open file from an older one of the same
/// path the process still holds (writes are sequential: the file being written is at its end).
/// The descriptor being closed has left the table by the time its `flush` is sent, and an
/// exiting process's table is empty.
fn holds_file(pid: u32, ino: u64, pos: u64, fs_name: &str) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return false;
    };
    let mounts: Vec<u64> = fds
        .take(FDS_MAX)
        .flatten()
        .filter_map(|fd| std::fs::read_to_string(fd.path()).ok())
        .filter_map(|info| writer_of(&info, ino, pos))
        .collect();
    if mounts.is_empty() {
        return false;
    }
    let Ok(mountinfo) = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")) else {
        return false;
    };
    crate::mountinfo::parse(&mountinfo)
        .iter()
        .any(|m| mounts.contains(&m.id) && m.is_ferry() && m.source == fs_name)
}

/// The mount id of a descriptor (the text of its `fdinfo`) open for writing on inode `ino`, at
/// position `pos`.
fn writer_of(fdinfo: &str, ino: u64, pos: u64) -> Option<u64> {
    let field = |name: &str| {
        fdinfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
    };
    let flags = u32::from_str_radix(field("flags")?, 8).ok()?;
    let writes = flags & libc::O_ACCMODE as u32 != libc::O_RDONLY as u32;
    let this =
        field("ino")?.parse::<u64>().ok()? == ino && field("pos")?.parse::<u64>().ok()? == pos;
    (writes && this).then_some(())?;
    field("mnt_id")?.parse().ok()
}

/// [`killed`] from the text of `/proc/<pid>/stat`: the fields after the command name (which may
/// hold spaces and parentheses) are state (3), ..., flags (9), ..., exit_code (52).
fn killed_by_stat(stat: &str) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    match (field(9), field(52)) {
        (Some(flags), Some(exit_code)) => flags & PF_EXITING != 0 && exit_code & 0x7f != 0,
        _ => false,
    }
}

struct PlainSink<'a>(&'a mut ReplyDirectory);

impl DirSink for PlainSink<'_> {
    fn add(&mut self, e: &DirEntry<'_>) -> bool {
        self.0
            .add(INodeNo(e.ino), e.offset, file_type(e.kind), e.name)
    }
}

struct PlusSink<'a>(&'a mut ReplyDirectoryPlus);

impl DirSink for PlusSink<'_> {
    fn add(&mut self, e: &DirEntry<'_>) -> bool {
        self.0.add(
            INodeNo(e.ino),
            e.offset,
            e.name,
            &e.ttl,
            &file_attr(e.attr),
            Generation(0),
        )
    }
}

/// How long the end of a session waits for [`Fs::teardown`] (its S3 requests) before going on.
const TEARDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

impl Filesystem for FuseAdapter {
    /// The session ended: settles the handles the kernel never released ([`Fs::teardown`]), on the
    /// runtime, waiting for it a bounded time (in a node plugin the task finishes anyway).
    fn destroy(&mut self) {
        if self.gate.is_handed_over() {
            // Another process serves the connection now; its handles are its own.
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let fs = self.fs.clone();
        self.rt.spawn(async move {
            fs.teardown().await;
            let _ = tx.send(());
        });
        if rx.recv_timeout(TEARDOWN_WAIT).is_err() {
            tracing::warn!(
                "the handles left at unmount are still being settled; not waiting longer"
            );
        }
    }

    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let abi = config.kernel_abi();
        let offered = KernelInit {
            major: abi.0,
            minor: abi.1,
            max_readahead: READAHEAD,
            flags: config.capabilities().bits(),
        };
        for cap in [
            // Attributes come with the listing: `ls -l` needs no lookup per entry.
            InitFlags::FUSE_DO_READDIRPLUS,
            // O_TRUNC arrives with open (so "open for write without O_TRUNC" can be refused).
            InitFlags::FUSE_ATOMIC_O_TRUNC,
            // Lookups in one directory run concurrently.
            InitFlags::FUSE_PARALLEL_DIROPS,
        ] {
            if let Err(missing) = config.add_capabilities(cap) {
                tracing::debug!(?missing, "kernel lacks a FUSE capability");
            }
        }
        // Let the kernel read ahead as far as it allows (Ferry prefetches further itself) and keep
        // many reads of many files in flight at once. max_write stays fuser's 16 MiB, from which
        // it derives max_pages (the kernel caps it: 1 MiB reads and writes on most kernels).
        let mut offered = offered;
        if let Err(max) = config.set_max_readahead(READAHEAD) {
            let _ = config.set_max_readahead(max);
            offered.max_readahead = max;
        }
        *self.kernel.lock().expect("kernel init lock") = Some(offered);
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
        if self.pt.enabled.load(Ordering::Relaxed) {
            // Backing files live on a local filesystem (depth 0), so this mount is depth 1.
            let ok = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !ok {
                self.pt.enabled.store(false, Ordering::Relaxed);
                tracing::info!(
                    "the kernel offers no FUSE passthrough: cached objects are read through Ferry"
                );
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_owned();
        self.serve("lookup", move |fs| async move {
            match fs.lookup(parent.0, &name).await {
                Ok(e) => reply.entry(&e.ttl, &file_attr(&e.attr), Generation(0)),
                Err(e) => reply.error(errno("lookup", &e)),
            }
        });
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let _pass = self.gate.enter();
        let _timer = OpTimer::start("forget");
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.serve("getattr", move |fs| async move {
            match fs.getattr(ino.0).await {
                Ok(e) => reply.attr(&e.ttl, &file_attr(&e.attr)),
                Err(e) => reply.error(errno("getattr", &e)),
            }
        });
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let req = SetAttr {
            size,
            mode,
            uid,
            gid,
            times: atime.is_some() || mtime.is_some(),
            fh: fh.map(|f| f.0),
        };
        self.spawn("setattr", move |fs| async move {
            match fs.setattr(ino.0, req).await {
                Ok(e) => reply.attr(&e.ttl, &file_attr(&e.attr)),
                Err(e) => reply.error(errno("setattr", &e)),
            }
        });
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        let _timer = OpTimer::start("mknod");
        let e = match self.fs.config().read_only {
            true => FsError::ReadOnly,
            false => FsError::NotPermitted("only regular files and directories"),
        };
        reply.error(errno("mknod", &e));
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let name = name.to_owned();
        let resent = resent(req);
        self.spawn("mkdir", move |fs| async move {
            let made = match fs.mkdir(parent.0, &name).await {
                // The process that died may have made it before it could answer.
                Err(FsError::Exists) if resent => match fs.lookup(parent.0, &name).await {
                    Ok(e) if e.attr.kind == Kind::Dir => Ok(e),
                    _ => Err(FsError::Exists),
                },
                other => other,
            };
            match made {
                Ok(e) => reply.entry(&e.ttl, &file_attr(&e.attr), Generation(0)),
                Err(e) => reply.error(errno("mkdir", &e)),
            }
        });
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        let resent = resent(req);
        self.spawn("unlink", move |fs| async move {
            match fs.unlink(parent.0, &name).await {
                Ok(()) => reply.ok(),
                // Removed by the process that died before it could answer.
                Err(FsError::NotFound) if resent => reply.ok(),
                Err(e) => reply.error(errno("unlink", &e)),
            }
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_owned();
        let resent = resent(req);
        self.spawn("rmdir", move |fs| async move {
            match fs.rmdir(parent.0, &name).await {
                Ok(()) => reply.ok(),
                Err(FsError::NotFound) if resent => reply.ok(),
                Err(e) => reply.error(errno("rmdir", &e)),
            }
        });
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &Path,
        reply: ReplyEntry,
    ) {
        let _timer = OpTimer::start("symlink");
        let e = match self.fs.config().read_only {
            true => FsError::ReadOnly,
            false => FsError::NotPermitted("no symlinks in S3"),
        };
        reply.error(errno("symlink", &e));
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let _timer = OpTimer::start("rename");
        match self.fs.rename() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rename", &e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let _timer = OpTimer::start("link");
        let e = match self.fs.config().read_only {
            true => FsError::ReadOnly,
            false => FsError::NotPermitted("no hard links in S3"),
        };
        reply.error(errno("link", &e));
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let pid = req.pid();
        let pt = self.pt.clone();
        let read_only = flags.0 & libc::O_ACCMODE == libc::O_RDONLY && flags.0 & libc::O_TRUNC == 0;
        if !read_only && flags.0 & libc::O_DSYNC != 0 {
            return reply.error(errno("open", &SYNC_WRITES));
        }
        let (request, again) = (request_id(req), resent(req));
        self.serve("open", move |fs| async move {
            if again {
                // A handle a dead process opened for it never reached the kernel.
                if let Some(fh) = fs.forget_unanswered(request).await {
                    pt.closed(fh);
                }
            }
            // Only a write handle keeps its process (reading /proc costs more than the open).
            let owner = if read_only { pid } else { tgid(pid) };
            let o = match fs.open_for(ino.0, flags.0, owner, Some(request)).await {
                Ok(o) => o,
                Err(e) => return reply.error(errno("open", &e)),
            };
            // The inode is open through passthrough already (here or in the process before): the
            // kernel admits this open only through the same backing file.
            if read_only {
                if let Some(id) = pt.existing(ino.0, o.fh) {
                    if fs.join_passthrough(o.fh, id) {
                        return opened_passthrough(reply, o.fh, id);
                    }
                    pt.closed(o.fh);
                }
            }
            if read_only && pt.enabled.load(Ordering::Relaxed) && fs.may_passthrough(o.fh) {
                let f = fs.clone();
                let file = tokio::task::spawn_blocking(move || f.passthrough_file(o.fh))
                    .await
                    .ok()
                    .flatten();
                if let Some(file) = file {
                    match pt.backing_for(ino.0, o.fh, &file) {
                        Ok(id) => {
                            fs.set_backing_id(o.fh, id);
                            return opened_passthrough(reply, o.fh, id);
                        }
                        Err(e) => {
                            // EPERM (no CAP_SYS_ADMIN), ENOTTY/EINVAL (not offered): stop asking.
                            if pt.enabled.swap(false, Ordering::Relaxed) {
                                tracing::warn!(error = %e, "FUSE passthrough refused; cached objects are read through Ferry from now on");
                            }
                            fs.passthrough_failed(o.fh);
                        }
                    }
                }
            }
            reply.opened(FileHandle(o.fh), fopen_flags(o, read_only))
        });
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        self.spawn("read", move |fs| async move {
            match fs.read(fh.0, offset, size).await {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(errno("read", &e)),
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let data = data.to_vec();
        self.spawn("write", move |fs| async move {
            match fs.write(fh.0, offset, &data).await {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(errno("write", &e)),
            }
        });
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let pid = req.pid();
        self.serve("flush", move |fs| async move {
            let fs_name = || fs.config().fs_name.clone();
            let closing = |written| closing(pid, ino.0, written, fs_name());
            match fs.flush_by(fh.0, || tgid(pid), closing).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("flush", &e)),
            }
        });
    }

    fn release(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let pt = self.pt.clone();
        let pid = req.pid();
        self.serve("release", move |fs| async move {
            pt.closed(fh.0);
            match fs.release_by(fh.0, || killed(pid)).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("release", &e)),
            }
        });
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.spawn("fsync", move |fs| async move {
            match fs.fsync(fh.0).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("fsync", &e)),
            }
        });
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // It changes the handle table: not while the mount is frozen for a handover.
        let _pass = self.gate.enter();
        let _timer = OpTimer::start("opendir");
        match self.fs.opendir(ino.0) {
            Ok(o) => {
                let mut flags = FopenFlags::empty();
                if o.cache_dir {
                    flags |= FopenFlags::FOPEN_CACHE_DIR;
                }
                if o.keep_cache {
                    flags |= FopenFlags::FOPEN_KEEP_CACHE;
                }
                reply.opened(FileHandle(o.fh), flags)
            }
            Err(e) => reply.error(errno("opendir", &e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.spawn("readdir", move |fs| async move {
            match fs
                .readdir(ino.0, fh.0, offset, false, &mut PlainSink(&mut reply))
                .await
            {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("readdir", &e)),
            }
        });
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        self.spawn("readdirplus", move |fs| async move {
            match fs
                .readdir(ino.0, fh.0, offset, true, &mut PlusSink(&mut reply))
                .await
            {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno("readdirplus", &e)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        // It changes the handle table: not while the mount is frozen for a handover.
        let _pass = self.gate.enter();
        let _timer = OpTimer::start("releasedir");
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _timer = OpTimer::start("fsyncdir");
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let _timer = OpTimer::start("statfs");
        let s = self.fs.statfs();
        reply.statfs(
            s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let _timer = OpTimer::start("setxattr");
        reply.error(errno("setxattr", &FsError::NotImplemented));
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        let _timer = OpTimer::start("getxattr");
        reply.error(errno("getxattr", &FsError::NotImplemented));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: ReplyXattr) {
        let _timer = OpTimer::start("listxattr");
        reply.error(errno("listxattr", &FsError::NotImplemented));
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        let _timer = OpTimer::start("removexattr");
        reply.error(errno("removexattr", &FsError::NotImplemented));
    }

    // The operations below are not supported. fuser's defaults would answer the same errno but
    // log a warning per call; everyday programs send some of them on every file (Python's `open`
    // asks `TCGETS`, `cp` tries `copy_file_range` and `SEEK_DATA`), so they are refused quietly.
    // For ENOSYS the kernel stops asking for the rest of the mount's life.

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        let _timer = OpTimer::start("ioctl");
        reply.error(errno("ioctl", &FsError::NoIoctl));
    }

    fn poll(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        let _timer = OpTimer::start("poll");
        reply.error(errno("poll", &FsError::NotImplemented));
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        let _timer = OpTimer::start("fallocate");
        reply.error(errno("fallocate", &FsError::NotImplemented));
    }

    fn lseek(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: i64,
        _whence: i32,
        reply: ReplyLseek,
    ) {
        let _timer = OpTimer::start("lseek");
        reply.error(errno("lseek", &FsError::NotImplemented));
    }

    fn copy_file_range(
        &self,
        _req: &Request,
        _ino_in: INodeNo,
        _fh_in: FileHandle,
        _offset_in: u64,
        _ino_out: INodeNo,
        _fh_out: FileHandle,
        _offset_out: u64,
        _len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        let _timer = OpTimer::start("copy_file_range");
        reply.error(errno("copy_file_range", &FsError::NotImplemented));
    }

    fn readlink(&self, _req: &Request, _ino: INodeNo, reply: ReplyData) {
        let _timer = OpTimer::start("readlink");
        // Ferry shows no symlinks, so the kernel never asks; a file is not a link.
        reply.error(errno(
            "readlink",
            &FsError::InvalidArgument("not a symbolic link"),
        ));
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        let _timer = OpTimer::start("access");
        // With default_permissions the kernel checks modes itself and does not call this.
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        if flags & libc::O_DSYNC != 0 {
            return reply.error(errno("create", &SYNC_WRITES));
        }
        let name = name.to_owned();
        let pid = req.pid();
        let (request, again) = (request_id(req), resent(req));
        self.spawn("create", move |fs| async move {
            if again {
                // A handle a dead process opened for it never reached the kernel.
                fs.forget_unanswered(request).await;
            }
            match fs
                .create_for(parent.0, &name, tgid(pid), Some(request))
                .await
            {
                Ok((e, o)) => reply.created(
                    &e.ttl,
                    &file_attr(&e.attr),
                    Generation(0),
                    FileHandle(o.fh),
                    fopen_flags(o, false),
                ),
                Err(e) => reply.error(errno("create", &e)),
            }
        });
    }
}

#[cfg(test)]
mod killed_tests {
    use super::{killed_by_stat, writer_of};

    /// `/proc/<pid>/stat` of a thread: pid, (comm), state, ppid, ..., flags (9), ..., exit_code
    /// (52), with a command name that holds a space and a parenthesis.
    fn stat(flags: u64, exit_code: u64) -> String {
        let mut fields = vec!["R".to_owned()];
        fields.extend((4..=52).map(|n| match n {
            9 => flags.to_string(),
            52 => exit_code.to_string(),
            _ => "0".to_owned(),
        }));
        format!("4242 (a (b) c) {}\n", fields.join(" "))
    }

    /// `fdinfo` of a descriptor at position 4: access mode (octal flags), mount id, inode.
    fn fdinfo(flags: &str, mnt: u64, ino: u64) -> String {
        format!("pos:\t4\nflags:\t{flags}\nmnt_id:\t{mnt}\nino:\t{ino}\n")
    }

    #[test]
    fn only_a_descriptor_writing_the_inode_at_its_end_is_a_writer() {
        assert_eq!(
            writer_of(&fdinfo("0100001", 41, 7), 7, 4),
            Some(41),
            "O_WRONLY"
        );
        assert_eq!(
            writer_of(&fdinfo("02100002", 41, 7), 7, 4),
            Some(41),
            "O_RDWR"
        );
        assert_eq!(writer_of(&fdinfo("0100000", 41, 7), 7, 4), None, "O_RDONLY");
        assert_eq!(
            writer_of(&fdinfo("0100001", 41, 8), 7, 4),
            None,
            "another inode"
        );
        assert_eq!(
            writer_of(&fdinfo("0100001", 41, 7), 7, 9),
            None,
            "an older open file of the path"
        );
        assert_eq!(
            writer_of("pos:\t4\nflags:\t01\n", 7, 4),
            None,
            "no ino (before 5.14)"
        );
    }

    #[test]
    fn only_a_thread_exiting_on_a_signal_is_killed() {
        const PF_EXITING: u64 = 0x4;
        assert!(killed_by_stat(&stat(PF_EXITING | 0x400000, 9)), "SIGKILL");
        assert!(killed_by_stat(&stat(PF_EXITING, 15)), "SIGTERM's default");
        assert!(
            killed_by_stat(&stat(PF_EXITING, 0x80 | 11)),
            "SIGSEGV, core"
        );
        assert!(!killed_by_stat(&stat(PF_EXITING, 0)), "exit(0)");
        assert!(!killed_by_stat(&stat(PF_EXITING, 1 << 8)), "exit(1)");
        assert!(!killed_by_stat(&stat(0x400000, 0)), "running");
        assert!(!killed_by_stat("4242 (cut short) R 1"), "malformed");
    }
}
