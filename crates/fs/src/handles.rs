//! Open handles: read handles (ETag pinned at open, sequential read-ahead parts), write
//! handles (sequential upload state) and directory handles (the listing snapshot readdir offsets
//! index into). Plain data behind per-handle async locks; serde-able for a process handover.
//! Each handle's pin (what it stands for, [`JournaledHandle`]) is kept beside it, outside its
//! lock, so an attached [`Journal`] can be written (and compacted) without waiting for a handle
//! busy with S3.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::inode::Ino;
use crate::journal::{Journal, JournalLink, JournaledHandle};
use crate::names::ListedEntry;
use crate::prefetch::Prefetch;

/// Size of every multipart part but the last; files up to this size are one PUT.
pub const PART_SIZE: usize = 8 * 1024 * 1024;
/// S3's limit on the number of parts.
pub const MAX_PARTS: usize = 10_000;
/// An open file or directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Handle {
    Read(ReadHandle),
    Write(WriteHandle),
    Dir(DirHandle),
}

/// A file opened for reading: one version of one object.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReadHandle {
    pub ino: Ino,
    pub key: String,
    /// Every GET carries `If-Match: etag`.
    pub etag: Option<String>,
    /// The object's Last-Modified at open: without an ETag, GETs are pinned to it and `size`.
    #[serde(default)]
    pub last_modified: Option<std::time::SystemTime>,
    /// The object's size at open.
    pub size: u64,
    /// Where a sequential reader's next read starts.
    pub next_offset: u64,
    /// Reads go through the node cache (the mount has one and the version an ETag). A read is
    /// served cached bytes only while this mount's proofs show access to the version; otherwise
    /// it proves access first (`prefetch::fetch`).
    #[serde(default)]
    pub cached: bool,
    /// The kernel reads this handle straight from the node cache's whole file (FUSE
    /// passthrough): no read reaches Ferry.
    #[serde(default)]
    pub passthrough: bool,
    /// The connection's id of that backing file (every open of the inode must name it while one
    /// is open).
    #[serde(default)]
    pub backing_id: Option<u32>,
    /// Parts fetched or being fetched ahead of the reader; not carried over.
    #[serde(skip)]
    pub prefetch: Prefetch,
    /// Until when this mount's proof of access to the version holds, as last looked up (so a
    /// read does not look it up again); not carried over.
    #[serde(skip)]
    pub proven_until: Option<tokio::time::Instant>,
}

impl ReadHandle {
    pub fn new(ino: Ino, key: String, etag: Option<String>, size: u64) -> Self {
        ReadHandle {
            ino,
            key,
            etag,
            last_modified: None,
            size,
            next_offset: 0,
            cached: false,
            passthrough: false,
            backing_id: None,
            prefetch: Prefetch::default(),
            proven_until: None,
        }
    }

    /// Whether a read at `offset` continues a sequential stream: it starts where the last one
    /// ended, or within (or up to a window past) the fetched parts, which tolerates the kernel's
    /// concurrent, slightly reordered read-ahead requests.
    pub fn is_sequential(&self, offset: u64) -> bool {
        if offset == self.next_offset {
            return true;
        }
        self.prefetch
            .span()
            .is_some_and(|(start, end)| start <= offset && offset <= end + self.prefetch.window)
    }

    /// Whether a read at `offset` that is not [sequential](Self::is_sequential) is one the kernel
    /// issued out of order a little behind a running sequential stream (its concurrent read-ahead
    /// requests can arrive reordered): within `slack`, or the window, behind the stream's end.
    /// Such a read is served on its own and must not reset the stream.
    pub fn is_reordered(&self, offset: u64, slack: u64) -> bool {
        self.prefetch.window > 0
            && offset < self.next_offset
            && self.next_offset - offset <= slack.max(self.prefetch.window)
    }
}

/// Where a write handle's upload stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteStatus {
    /// Accepting sequential writes.
    Open,
    /// The object is in S3; more writes are `EBADF`.
    Completed,
    /// An upload call failed; the object was not created; more writes are `EIO`.
    Failed,
}

/// One uploaded part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartRecord {
    pub number: i32,
    pub etag: String,
}

/// A multipart upload in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MultipartState {
    pub upload_id: String,
    pub parts: Vec<PartRecord>,
}

/// A new (or truncated) file being written sequentially.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WriteHandle {
    pub ino: Ino,
    pub parent: Ino,
    pub name: String,
    pub key: String,
    /// The process (thread group) that opened it: only its `flush` completes the upload.
    pub pid: u32,
    /// Bytes accepted so far (the file's size).
    pub written: u64,
    /// Accepted bytes not yet in an uploaded part (< [`PART_SIZE`] between calls). Base64 in a
    /// handover's JSON (a third larger, where an array of numbers is up to four times).
    #[serde(with = "base64_bytes")]
    pub pending: Vec<u8>,
    pub upload: Option<MultipartState>,
    pub status: WriteStatus,
    /// It replaces an existing object (opened with `O_TRUNC`), rather than creating a new one.
    #[serde(default)]
    pub replaces: bool,
    /// What `pending` (and a part on its way to S3) holds of the node's memory budget; not carried
    /// over (a successor charges a recovered buffer at its next write).
    #[serde(skip)]
    pub memory: crate::budget::BufferCharge,
    /// When the last write was accepted ([`crate::fs::Fs::shrink_idle_writers`]); not carried
    /// over.
    #[serde(skip)]
    pub last_write: Option<Instant>,
}

/// A directory handle's entries: shared with the directory's kept listing when nothing local
/// is merged in, so an `opendir` of a large directory copies nothing.
pub type Snapshot = std::sync::Arc<Vec<ListedEntry>>;

/// An open directory: the listing snapshot taken at the first `readdir` (again after a rewind).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DirHandle {
    pub ino: Ino,
    /// Entries after `.` and `..`; offset `n` is index `n - 2`. Often the directory's kept
    /// listing itself, shared (see [`Snapshot`]).
    pub snapshot: Option<Snapshot>,
    /// When the snapshot was listed (its entries' validity starts there); not carried over.
    #[serde(skip)]
    pub listed_at: Option<Instant>,
    /// A `readdir` has been answered from this snapshot (so offset 0 again means rewind).
    pub served: bool,
    /// The snapshot is a directory's first page, served while the rest is listed: past its end,
    /// the rest of the listing joins it.
    #[serde(default)]
    pub partial: bool,
    /// The snapshot's tag in the offsets this handle gives (0: untagged; see `fs::kdir`).
    #[serde(default)]
    pub tag: u32,
    /// Counted among its directory's handles that started a listing in this process
    /// (`KernelDir::active`); a successor counts every handle it takes over.
    #[serde(skip)]
    pub counted: bool,
}

impl DirHandle {
    /// A handle of directory `ino` whose listing is taken at its first `readdir`.
    pub fn new(ino: Ino) -> Self {
        DirHandle {
            ino,
            snapshot: None,
            listed_at: None,
            served: false,
            partial: false,
            tag: 0,
            counted: false,
        }
    }
}

/// Open handles by number.
#[derive(Debug, Default)]
pub struct HandleTable {
    next_fh: u64,
    handles: HashMap<u64, Slot>,
    journal: JournalLink,
}

#[derive(Debug)]
struct Slot {
    handle: Arc<AsyncMutex<Handle>>,
    pin: JournaledHandle,
    /// The kernel's request that opened it (its `unique`), when known: journaled with it, so
    /// that a successor the kernel re-sends that request to knows the handle's number never
    /// reached the kernel ([`HandleTable::unanswered`]).
    request: Option<u64>,
}

impl Slot {
    fn new(handle: Handle, request: Option<u64>) -> Self {
        Slot {
            pin: JournaledHandle::of(&handle),
            handle: Arc::new(AsyncMutex::new(handle)),
            request,
        }
    }
}

impl HandleTable {
    pub fn insert(&mut self, handle: Handle) -> u64 {
        self.insert_for(handle, None)
    }

    /// [`HandleTable::insert`] of the handle the kernel's request `request` (its `unique`, without
    /// the re-send bit) opens.
    pub(crate) fn insert_for(&mut self, handle: Handle, request: Option<u64>) -> u64 {
        self.next_fh += 1;
        let fh = self.next_fh;
        let slot = Slot::new(handle, request);
        if let Some(j) = self.journal.get() {
            j.opened(fh, &slot.pin, request);
        }
        self.handles.insert(fh, slot);
        fh
    }

    /// The handle request `request` opened: when the kernel re-sends that request (after a
    /// crash), its reply never reached the kernel, which therefore never uses (nor releases)
    /// that handle.
    pub(crate) fn unanswered(&self, request: u64) -> Option<u64> {
        self.handles
            .iter()
            .find(|(_, s)| s.request == Some(request))
            .map(|(fh, _)| *fh)
    }

    /// The requests that opened handles, as (handle, request).
    pub(crate) fn requests(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<_> = self
            .handles
            .iter()
            .filter_map(|(fh, s)| Some((*fh, s.request?)))
            .collect();
        v.sort();
        v
    }

    /// From now on, opens and closes are appended to `journal`.
    pub(crate) fn attach_journal(&mut self, journal: Arc<Journal>) {
        self.journal = JournalLink(Some(journal));
    }

    /// Every handle's pin and opening request, by number.
    pub(crate) fn journaled(&self) -> Vec<(u64, &JournaledHandle, Option<u64>)> {
        let mut v: Vec<_> = self
            .handles
            .iter()
            .map(|(k, s)| (*k, &s.pin, s.request))
            .collect();
        v.sort_by_key(|(k, _, _)| *k);
        v
    }

    /// Read handle `fh` reads through FUSE passthrough with backing id `id` (`Some(0)`: not yet
    /// known), or no longer does (`None`): journaled, since a successor must open its inode only
    /// through the same backing id meanwhile.
    pub(crate) fn set_passthrough(&mut self, fh: u64, id: Option<u32>) {
        let Some(slot) = self.handles.get_mut(&fh) else {
            return;
        };
        if let JournaledHandle::Read {
            passthrough,
            backing_id,
            ..
        } = &mut slot.pin
        {
            *passthrough = id.is_some();
            *backing_id = id.filter(|&i| i != 0);
            if let Some(j) = self.journal.get() {
                j.opened(fh, &slot.pin, slot.request);
            }
        }
    }

    /// The number the next [`HandleTable::insert`] will return.
    pub fn peek_next(&self) -> u64 {
        self.next_fh + 1
    }

    pub fn get(&self, fh: u64) -> Option<Arc<AsyncMutex<Handle>>> {
        self.handles.get(&fh).map(|s| s.handle.clone())
    }

    pub fn remove(&mut self, fh: u64) -> Option<Arc<AsyncMutex<Handle>>> {
        let slot = self.handles.remove(&fh)?;
        if let Some(j) = self.journal.get() {
            j.closed(fh);
        }
        Some(slot.handle)
    }

    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The write handles (told by their pins, without locking any handle: a reader's handle is
    /// never held up by a look at the writers).
    pub fn writers(&self) -> Vec<Arc<AsyncMutex<Handle>>> {
        self.handles
            .values()
            .filter(|s| matches!(s.pin, JournaledHandle::Write { .. }))
            .map(|s| s.handle.clone())
            .collect()
    }

    /// Every handle, for snapshots.
    pub fn entries(&self) -> Vec<(u64, Arc<AsyncMutex<Handle>>)> {
        let mut v: Vec<_> = self
            .handles
            .iter()
            .map(|(k, s)| (*k, s.handle.clone()))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    pub fn next_fh(&self) -> u64 {
        self.next_fh
    }

    /// Rebuilds a table from a snapshot.
    pub fn restore(next_fh: u64, handles: Vec<(u64, Handle)>) -> Self {
        HandleTable {
            next_fh,
            handles: handles
                .into_iter()
                .map(|(fh, h)| (fh, Slot::new(h, None)))
                .collect(),
            journal: JournalLink::default(),
        }
    }

    /// The table with the requests that opened its handles (see [`HandleTable::requests`]).
    pub(crate) fn with_requests(mut self, requests: &[(u64, u64)]) -> Self {
        for (fh, request) in requests {
            if let Some(slot) = self.handles.get_mut(fh) {
                slot.request = Some(*request);
            }
        }
        self
    }
}

mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        STANDARD
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_detection() {
        let h = ReadHandle::new(2, "k".into(), None, 100 << 20);
        assert!(h.is_sequential(0));
        assert!(!h.is_sequential(4096));
    }
}
