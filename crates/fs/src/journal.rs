//! The mount's journal: an append-only record of the state the kernel depends on (the inode
//! numbers it knows, the file handles it holds open), so that a process taking over a live FUSE
//! connection after the node plugin was killed (`kill -9`, no chance to snapshot) can rebuild it.
//!
//! The file is the caller's: in production a memfd kept alive by a holder process next to the
//! `/dev/fuse` fd, in tests a tempfile. It must not be opened with `O_APPEND` (a broken journal is
//! marked by overwriting its magic). Every record is one `write_all` on the unbuffered file, so a
//! killed process leaves at most one torn record, at the end, which the CRC catches. There is no
//! fsync: the journal outlives the process, not the kernel (the FUSE connection does not either).
//!
//! Format, version [`JOURNAL_VERSION`]: the magic `FERRYJNL`, the version (u32 LE), then records,
//! each a u32 LE payload length, a u32 LE crc32c of the payload and the payload (JSON of one
//! [`Record`]). A journal starts with `Start` and the live set (compaction semantics), ended by
//! `Ready`; later records are upserts and removals. Only live state is journaled (identities and
//! pins, not metadata caches or upload data): what is not there is re-learned from S3.
//!
//! A handle is journaled as it is opened, before the kernel gets the reply, with the kernel
//! request that opened it: a successor the kernel re-sends that request to (it was never
//! answered) drops the handle, which the kernel never knew ([`crate::Fs::forget_unanswered`]).
//!
//! Handing a journal over: [`Journal::compact_into`] writes a complete journal into a new file
//! and then marks the old one `Superseded`. A holder keeps the old file until the new one is
//! handed to it, and recovery tries the newest first: a new file cut off before `Ready` is
//! refused as incomplete, and the old one, to which nothing was appended since, is then right.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::config::MountConfig;
use crate::fs::FsSnapshot;
use crate::handles::{DirHandle, Handle, HandleTable, ReadHandle, WriteHandle, WriteStatus};
use crate::inode::{Ino, Inode, InodeTable, ROOT_INO};
use crate::names::Kind;

/// The first eight bytes of a journal.
pub const JOURNAL_MAGIC: &[u8; 8] = b"FERRYJNL";
/// Overwrites the magic of a journal that stopped being written: refused by [`replay`].
const BROKEN_MAGIC: &[u8; 8] = b"FERRYBRK";
/// The format this build writes and reads.
pub const JOURNAL_VERSION: u32 = 1;
/// Bytes before the first record: magic and version.
const FILE_HEADER_LEN: usize = 12;
/// Largest payload written (real records are a few KiB at most: paths and keys are ≤ 1 KiB). A
/// larger length is corruption, not a torn write, even when it runs past the end of the file.
const MAX_RECORD: usize = 1 << 20;

/// What the journal knows about the mount besides its tables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalHeader {
    pub config: MountConfig,
    pub mount_time: SystemTime,
    /// The node plugin's own data about the mount (volume id, target path, …), opaque here.
    /// Never secrets: the journal is not protected like a credential.
    pub extra: serde_json::Value,
}

/// A live inode's identity: what the kernel's inode number stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InodeRecord {
    pub ino: Ino,
    pub parent: Ino,
    pub name: String,
    pub path: String,
    pub kind: Kind,
    /// A directory made by `mkdir` (or kept after its last entry went) that S3 does not know.
    pub local_dir: bool,
}

impl InodeRecord {
    pub(crate) fn of(inode: &Inode) -> Self {
        InodeRecord {
            ino: inode.ino,
            parent: inode.parent,
            name: inode.name.clone(),
            path: inode.path.clone(),
            kind: inode.kind,
            local_dir: inode.state == crate::inode::InodeState::LocalDir,
        }
    }
}

/// What an open handle stands for: enough to serve the kernel's next call on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JournaledHandle {
    /// Reads of one pinned version of one object.
    Read {
        ino: Ino,
        key: String,
        etag: Option<String>,
        last_modified: Option<SystemTime>,
        size: u64,
        cached: bool,
        /// Read by the kernel straight from a backing file (FUSE passthrough): a successor must
        /// open the inode only through the same backing id while it is open.
        passthrough: bool,
        /// That backing file's id on the connection (when registered).
        #[serde(default)]
        backing_id: Option<u32>,
    },
    Dir {
        ino: Ino,
    },
    /// A file being written. Its data is not journaled: after a crash it comes back failed.
    Write {
        ino: Ino,
        parent: Ino,
        name: String,
        key: String,
        pid: u32,
        replaces: bool,
    },
}

impl JournaledHandle {
    /// The pin of a handle as it is at open.
    pub(crate) fn of(handle: &Handle) -> Self {
        match handle {
            Handle::Read(r) => JournaledHandle::Read {
                ino: r.ino,
                key: r.key.clone(),
                etag: r.etag.clone(),
                last_modified: r.last_modified,
                size: r.size,
                cached: r.cached,
                passthrough: r.passthrough,
                backing_id: r.backing_id,
            },
            Handle::Dir(d) => JournaledHandle::Dir { ino: d.ino },
            Handle::Write(w) => JournaledHandle::Write {
                ino: w.ino,
                parent: w.parent,
                name: w.name.clone(),
                key: w.key.clone(),
                pid: w.pid,
                replaces: w.replaces,
            },
        }
    }

    /// The handle a successor serves: a read keeps its pin; a directory lists afresh at its next
    /// `readdir`; a write has lost its data with the process, so it is failed (`EIO` on the
    /// writer's next write, flush or close) and the object is not created (or not replaced).
    pub fn into_handle(self) -> Handle {
        match self {
            JournaledHandle::Read {
                ino,
                key,
                etag,
                last_modified,
                size,
                cached,
                passthrough,
                backing_id,
            } => {
                let mut r = ReadHandle::new(ino, key, etag, size);
                r.last_modified = last_modified;
                r.cached = cached;
                r.passthrough = passthrough;
                r.backing_id = backing_id;
                Handle::Read(r)
            }
            JournaledHandle::Dir { ino } => Handle::Dir(DirHandle::new(ino)),
            JournaledHandle::Write {
                ino,
                parent,
                name,
                key,
                pid,
                replaces,
            } => Handle::Write(WriteHandle {
                ino,
                parent,
                name,
                key,
                pid,
                written: 0,
                pending: Vec::new(),
                upload: None,
                status: WriteStatus::Failed,
                replaces,
                memory: Default::default(),
                last_write: None,
            }),
        }
    }
}

/// One journal record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum Record {
    /// The first record: the journal's mount.
    Start {
        header: JournalHeader,
    },
    /// The live set written after `Start` is complete.
    Ready,
    /// An inode was installed, re-attached to its parent, or its identity changed (upsert).
    /// `attached`: its parent's directory shows it under its name (else a child of the other
    /// kind replaced it there, and it lives on only for the kernel's references).
    Inode {
        inode: InodeRecord,
        attached: bool,
    },
    Removed {
        ino: Ino,
    },
    /// A handle was opened, or its pin changed (upsert).
    Opened {
        fh: u64,
        handle: JournaledHandle,
        /// The kernel request that opened it (its `unique`), when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        request: Option<u64>,
    },
    Closed {
        fh: u64,
    },
    /// The journal continues in another file ([`Journal::compact_into`]).
    Superseded,
    /// A write failed: later changes are missing.
    Broken {
        reason: String,
    },
}

/// Why a journal cannot be replayed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("reading the journal: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a Ferry journal (bad magic)")]
    BadMagic,
    #[error("journal format version {found} is not supported (this build reads version {JOURNAL_VERSION})")]
    UnsupportedVersion { found: u32 },
    #[error("corrupt journal record at byte offset {offset}: {reason}")]
    Corrupt { offset: u64, reason: String },
    #[error("incomplete journal: {0}")]
    Incomplete(String),
    #[error("the journal was superseded by a compacted one")]
    Superseded,
}

/// A live inode at the end of a journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredInode {
    pub inode: InodeRecord,
    /// Its parent's directory shows it under its name. An inode replaced by one of the other
    /// kind (same name) stays live while the kernel references it, but detached.
    pub attached: bool,
}

/// The state a journal describes.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    pub header: JournalHeader,
    /// Every live inode but the root (always there), by number.
    pub inodes: Vec<RecoveredInode>,
    /// Open handles by number.
    pub handles: Vec<(u64, JournaledHandle)>,
    /// The kernel requests that opened them, as (handle, request `unique`): a request the kernel
    /// re-sends to a successor was never answered, and its handle never reached the kernel.
    pub requests: Vec<(u64, u64)>,
}

/// The live set while records are applied.
#[derive(Default)]
struct Live {
    inodes: BTreeMap<Ino, InodeRecord>,
    /// `(parent, name)` → the attached child.
    slots: HashMap<(Ino, String), Ino>,
    handles: BTreeMap<u64, JournaledHandle>,
    /// Handle → the request that opened it.
    requests: BTreeMap<u64, u64>,
}

/// Reads a journal from its start. A record cut off at the end of the file (length past the end,
/// or a bad CRC on the very last record) is a torn write from a killed process: the replay ends
/// before it, with a warning. Anything else that does not check out is an error.
pub fn replay(file: &mut File) -> Result<Recovered, JournalError> {
    let mut bytes = Vec::new();
    file.seek(SeekFrom::Start(0))?;
    file.read_to_end(&mut bytes)?;
    replay_bytes(&bytes)
}

/// [`replay`] of a journal's bytes.
pub fn replay_bytes(bytes: &[u8]) -> Result<Recovered, JournalError> {
    if bytes.len() < FILE_HEADER_LEN {
        return Err(JournalError::Incomplete("no header".into()));
    }
    match &bytes[..8] {
        m if m == JOURNAL_MAGIC => {}
        m if m == BROKEN_MAGIC => {
            return Err(JournalError::Incomplete(
                "a write failed; later changes are missing".into(),
            ))
        }
        _ => return Err(JournalError::BadMagic),
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != JOURNAL_VERSION {
        return Err(JournalError::UnsupportedVersion { found: version });
    }
    let mut offset = FILE_HEADER_LEN;
    let mut header = None;
    let mut ready = false;
    let mut live = Live::default();
    while offset < bytes.len() {
        let corrupt = |reason: String| JournalError::Corrupt {
            offset: offset as u64,
            reason,
        };
        let rest = &bytes[offset..];
        if rest.len() < 8 {
            tracing::warn!(offset, "journal ends in a torn record header; ignored");
            break;
        }
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        if len > MAX_RECORD {
            return Err(corrupt(format!("length {len} is over {MAX_RECORD}")));
        }
        if rest.len() - 8 < len {
            tracing::warn!(offset, "journal ends in a torn record; ignored");
            break;
        }
        let payload = &rest[8..8 + len];
        let last = rest.len() == 8 + len;
        if crc_fast::crc32_iscsi(payload) != crc {
            if last {
                tracing::warn!(
                    offset,
                    "journal's last record fails its CRC (torn); ignored"
                );
                break;
            }
            return Err(corrupt("CRC mismatch".into()));
        }
        let record: Record =
            serde_json::from_slice(payload).map_err(|e| corrupt(format!("undecodable: {e}")))?;
        match (record, header.is_some()) {
            (Record::Start { header: h }, false) => header = Some(h),
            (_, false) => return Err(corrupt("the first record is not Start".into())),
            (Record::Start { .. }, true) => return Err(corrupt("a second Start".into())),
            (Record::Ready, true) => ready = true,
            (Record::Superseded, true) => return Err(JournalError::Superseded),
            (Record::Broken { reason }, true) => {
                return Err(JournalError::Incomplete(format!(
                    "a write failed ({reason}); later changes are missing"
                )))
            }
            (record, true) => live.apply(record),
        }
        offset += 8 + len;
    }
    let header = header.ok_or_else(|| JournalError::Incomplete("no Start record".into()))?;
    if !ready {
        return Err(JournalError::Incomplete(
            "cut off while its live set was being written".into(),
        ));
    }
    let Live {
        inodes,
        slots,
        handles,
        requests,
    } = live;
    // Attached means shown in a live directory: under a parent that is gone, an inode lives on
    // only for the kernel's references (as the table rebuilt from it has it).
    let attached = |inode: &InodeRecord| {
        slots.get(&(inode.parent, inode.name.clone())) == Some(&inode.ino)
            && (inode.parent == ROOT_INO || inodes.contains_key(&inode.parent))
    };
    let inodes = inodes
        .values()
        .map(|inode| RecoveredInode {
            attached: attached(inode),
            inode: inode.clone(),
        })
        .collect();
    Ok(Recovered {
        header,
        inodes,
        handles: handles.into_iter().collect(),
        requests: requests.into_iter().collect(),
    })
}

impl Live {
    fn apply(&mut self, record: Record) {
        match record {
            Record::Inode { inode: r, attached } => {
                if let Some(old) = self.inodes.get(&r.ino) {
                    let key = (old.parent, old.name.clone());
                    if self.slots.get(&key) == Some(&r.ino) {
                        self.slots.remove(&key);
                    }
                }
                if attached {
                    self.slots.insert((r.parent, r.name.clone()), r.ino);
                }
                self.inodes.insert(r.ino, r);
            }
            Record::Removed { ino } => {
                if let Some(old) = self.inodes.remove(&ino) {
                    let key = (old.parent, old.name);
                    if self.slots.get(&key) == Some(&ino) {
                        self.slots.remove(&key);
                    }
                }
            }
            Record::Opened {
                fh,
                handle,
                request,
            } => {
                self.handles.insert(fh, handle);
                match request {
                    Some(r) => self.requests.insert(fh, r),
                    None => self.requests.remove(&fh),
                };
            }
            Record::Closed { fh } => {
                self.handles.remove(&fh);
                self.requests.remove(&fh);
            }
            Record::Start { .. } | Record::Ready | Record::Superseded | Record::Broken { .. } => {
                unreachable!("handled by replay")
            }
        }
    }
}

/// Writes a complete journal of `snap` to `file` (a memfd): what a process that received a
/// mount in a handover deposits with the descriptor holder before it answers, so that a crash
/// before it serves the mount still leaves it recoverable. Its write handles come back failed
/// (their buffered bytes are not journaled).
pub fn write_snapshot(
    file: File,
    snap: &FsSnapshot,
    extra: serde_json::Value,
) -> std::io::Result<()> {
    let journal = Journal::new(file, extra);
    let handles =
        HandleTable::restore(snap.next_fh, snap.handles.clone()).with_requests(&snap.requests);
    journal.begin(&snap.config, snap.mount_time, &snap.inodes, &handles);
    if journal.is_broken() {
        return Err(std::io::Error::other("writing the journal failed"));
    }
    Ok(())
}
/// The snapshot a successor process builds its [`crate::Fs`] from ([`crate::Fs::from_snapshot`]).
///
/// The kernel's lookup counts are not journaled (one record per lookup would be most of the
/// traffic), so every recovered inode gets [`crate::inode::RECOVERED_LOOKUPS`]: no `forget` brings
/// it to zero, and it stays for the mount's life. That is safe (a number the kernel knows never
/// goes away) and bounded by the live set at the crash. Metadata is re-learned from S3 (caches
/// start expired). Backing ids of passthrough handles stay in `rec.handles` for the adapter.
pub fn recovered_snapshot(rec: &Recovered) -> FsSnapshot {
    let inodes = InodeTable::recovered(
        rec.inodes
            .iter()
            .filter(|r| r.inode.ino != ROOT_INO)
            .map(|r| (r.inode.clone(), r.attached)),
    );
    FsSnapshot {
        config: rec.header.config.clone(),
        mount_time: rec.header.mount_time,
        inodes,
        next_fh: rec.handles.iter().map(|(fh, _)| *fh).max().unwrap_or(0),
        handles: rec
            .handles
            .iter()
            .map(|(fh, h)| (*fh, h.clone().into_handle()))
            .collect(),
        requests: rec.requests.clone(),
    }
}

/// The journal a live mount appends to. Writes happen under the filesystem's state lock (the
/// tables call it), so records are in the order of the changes.
pub struct Journal {
    inner: Mutex<Inner>,
    broken: AtomicBool,
}

struct Inner {
    file: File,
    /// The caller's data, until [`Journal::begin`] puts it in the header.
    extra: serde_json::Value,
    header: Option<JournalHeader>,
    len: u64,
    since_compaction: u64,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("len_bytes", &self.len_bytes())
            .field("broken", &self.is_broken())
            .finish_non_exhaustive()
    }
}

impl Journal {
    /// A journal that will be written to `file` (from its current position, normally an empty
    /// file) once attached with [`crate::Fs::with_journal`]. `extra` is the caller's data about
    /// the mount, returned by [`replay`] in [`JournalHeader::extra`].
    pub fn new(file: File, extra: serde_json::Value) -> Self {
        Journal {
            inner: Mutex::new(Inner {
                file,
                extra,
                header: None,
                len: 0,
                since_compaction: 0,
            }),
            broken: AtomicBool::new(false),
        }
    }

    /// A write failed: the journal lacks later changes and no longer describes the mount.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Bytes in the current file.
    pub fn len_bytes(&self) -> u64 {
        self.lock().len
    }

    /// Records appended since the last compaction (or the start): with the live set's size
    /// ([`crate::Fs::table_sizes`]), tells the caller when to compact.
    pub fn records_since_compaction(&self) -> u64 {
        self.lock().since_compaction
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every write leaves `Inner` consistent (a failed one breaks the journal).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the journal of a mount (`config`, `mount_time`) whose tables are these: `Start`,
    /// the live set, `Ready`.
    pub(crate) fn begin(
        &self,
        config: &MountConfig,
        mount_time: SystemTime,
        inodes: &InodeTable,
        handles: &HandleTable,
    ) {
        let mut inner = self.lock();
        let header = JournalHeader {
            config: config.clone(),
            mount_time,
            extra: std::mem::take(&mut inner.extra),
        };
        match write_fresh(&inner.file, &header, inodes, handles) {
            Ok(len) => {
                inner.len = len;
                inner.since_compaction = 0;
            }
            Err(e) => self.fail(&mut inner, e),
        }
        inner.header = Some(header);
    }

    /// Writes a complete journal of the current tables to `new_file` and appends there from now
    /// on; the old file gets a final `Superseded`. On an error the journal stays in the old
    /// file, which is still complete. The caller holds the filesystem's state lock (no change
    /// can happen between the live set's collection and the switch).
    pub(crate) fn compact_into(
        &self,
        new_file: File,
        inodes: &InodeTable,
        handles: &HandleTable,
    ) -> std::io::Result<()> {
        let mut inner = self.lock();
        if self.is_broken() {
            return Err(std::io::Error::other("the journal is broken"));
        }
        let Some(header) = inner.header.as_ref() else {
            return Err(std::io::Error::other("the journal was never started"));
        };
        let len = write_fresh(&new_file, header, inodes, handles)?;
        let old = std::mem::replace(&mut inner.file, new_file);
        inner.len = len;
        inner.since_compaction = 0;
        if let Err(e) = write_record(&old, &Record::Superseded) {
            // Harmless: the old file is complete, and nothing was appended to it since.
            tracing::warn!(error = %e, "marking the old journal superseded");
        }
        Ok(())
    }

    fn append(&self, record: &Record) {
        if self.is_broken() {
            return;
        }
        let mut inner = self.lock();
        match write_record(&inner.file, record) {
            Ok(n) => {
                inner.len += n;
                inner.since_compaction += 1;
            }
            Err(e) => self.fail(&mut inner, e),
        }
    }

    /// Marks the journal broken (once: later writes are skipped, so this logs once) and tells a
    /// later replay so: a `Broken` record if one still fits, and the magic overwritten in place
    /// (no allocation, so it works on a full file system too).
    fn fail(&self, inner: &mut Inner, e: std::io::Error) {
        if self.broken.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::error!(error = %e, "writing the mount's journal failed; this mount will not survive a crash of the node plugin");
        let _ = write_record(
            &inner.file,
            &Record::Broken {
                reason: e.to_string(),
            },
        );
        if let Err(e) = inner.file.write_at(BROKEN_MAGIC, 0) {
            tracing::error!(error = %e, "marking the journal broken failed");
        }
    }

    pub(crate) fn inode(&self, inode: &Inode, attached: bool) {
        self.append(&Record::Inode {
            inode: InodeRecord::of(inode),
            attached,
        });
    }

    pub(crate) fn removed(&self, ino: Ino) {
        self.append(&Record::Removed { ino });
    }

    pub(crate) fn opened(&self, fh: u64, handle: &JournaledHandle, request: Option<u64>) {
        self.append(&Record::Opened {
            fh,
            handle: handle.clone(),
            request,
        });
    }

    pub(crate) fn closed(&self, fh: u64) {
        self.append(&Record::Closed { fh });
    }
}

/// Header, `Start`, the live set and `Ready` to `file`; returns the bytes written.
fn write_fresh(
    mut file: &File,
    header: &JournalHeader,
    inodes: &InodeTable,
    handles: &HandleTable,
) -> std::io::Result<u64> {
    let mut head = Vec::with_capacity(FILE_HEADER_LEN);
    head.extend_from_slice(JOURNAL_MAGIC);
    head.extend_from_slice(&JOURNAL_VERSION.to_le_bytes());
    file.write_all(&head)?;
    let mut len = head.len() as u64;
    let mut put = |record: &Record| -> std::io::Result<()> {
        len += write_record(file, record)?;
        Ok(())
    };
    put(&Record::Start {
        header: header.clone(),
    })?;
    for inode in inodes.iter().filter(|i| i.ino != ROOT_INO) {
        put(&Record::Inode {
            inode: InodeRecord::of(inode),
            attached: inodes.is_attached(inode),
        })?;
    }
    for (fh, handle, request) in handles.journaled() {
        put(&Record::Opened {
            fh,
            handle: handle.clone(),
            request,
        })?;
    }
    put(&Record::Ready)?;
    Ok(len)
}

/// One record as one write; returns its size.
fn write_record(mut file: &File, record: &Record) -> std::io::Result<u64> {
    let payload = serde_json::to_vec(record)?;
    if payload.len() > MAX_RECORD {
        return Err(std::io::Error::other(format!(
            "a journal record of {} bytes is over {MAX_RECORD}",
            payload.len()
        )));
    }
    let mut buf = Vec::with_capacity(8 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&crc_fast::crc32_iscsi(&payload).to_le_bytes());
    buf.extend_from_slice(&payload);
    file.write_all(&buf)?;
    Ok(buf.len() as u64)
}

/// The journal a table writes to, if any. A clone is not attached: only the live tables write
/// (a snapshot's copy must not).
#[derive(Default)]
pub(crate) struct JournalLink(pub(crate) Option<Arc<Journal>>);

impl Clone for JournalLink {
    fn clone(&self) -> Self {
        JournalLink(None)
    }
}

impl std::fmt::Debug for JournalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "attached" } else { "none" })
    }
}

impl JournalLink {
    pub(crate) fn get(&self) -> Option<&Journal> {
        self.0.as_deref()
    }
}

#[cfg(test)]
#[path = "journal_tests.rs"]
mod tests;
