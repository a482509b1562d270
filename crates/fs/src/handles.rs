//! Open handles: read handles (ETag pinned at open, bounded sequential read-ahead buffer), write
//! handles (sequential upload state) and directory handles (the listing snapshot readdir offsets
//! index into). Plain data behind per-handle async locks; serde-able for a process handover.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use crate::inode::Ino;
use crate::names::ListedEntry;

/// Size of every multipart part but the last; files up to this size are one PUT.
pub const PART_SIZE: usize = 8 * 1024 * 1024;
/// S3's limit on the number of parts.
pub const MAX_PARTS: usize = 10_000;
/// First GET size once a read looks sequential; doubled on each sequential GET.
pub const READ_WINDOW_INITIAL: u64 = 1024 * 1024;
/// Largest sequential GET, and so the most a handle buffers.
pub const READ_WINDOW_MAX: u64 = 8 * 1024 * 1024;

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
    /// Every GET carries `If-Match: etag` (none if S3 gave no ETag).
    pub etag: Option<String>,
    /// The object's size at open.
    pub size: u64,
    /// Where a sequential reader's next read starts.
    pub next_offset: u64,
    /// The next sequential GET's size.
    pub window: u64,
    /// Bytes fetched ahead of the reader (at most [`READ_WINDOW_MAX`]); not carried over.
    #[serde(skip)]
    pub buffer: Option<ReadBuffer>,
}

/// A contiguous range of the object, starting at `start`.
#[derive(Debug, Clone)]
pub struct ReadBuffer {
    pub start: u64,
    pub data: Bytes,
}

impl ReadBuffer {
    pub fn end(&self) -> u64 {
        self.start + self.data.len() as u64
    }
}

impl ReadHandle {
    pub fn new(ino: Ino, key: String, etag: Option<String>, size: u64) -> Self {
        ReadHandle {
            ino,
            key,
            etag,
            size,
            next_offset: 0,
            window: READ_WINDOW_INITIAL,
            buffer: None,
        }
    }

    /// The bytes `start..end` if the buffer holds all of them.
    pub fn buffered(&self, start: u64, end: u64) -> Option<Bytes> {
        let buf = self.buffer.as_ref()?;
        (buf.start <= start && end <= buf.end()).then(|| {
            buf.data
                .slice((start - buf.start) as usize..(end - buf.start) as usize)
        })
    }

    /// Whether a read at `offset` continues a sequential stream: it starts where the last one
    /// ended, or within (or a little past) the buffer, which tolerates the kernel's concurrent,
    /// slightly reordered read-ahead requests.
    pub fn is_sequential(&self, offset: u64) -> bool {
        if offset == self.next_offset {
            return true;
        }
        self.buffer
            .as_ref()
            .is_some_and(|b| b.start <= offset && offset <= b.end() + self.window)
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
    /// Accepted bytes not yet in an uploaded part (< [`PART_SIZE`] between calls).
    pub pending: Vec<u8>,
    pub upload: Option<MultipartState>,
    pub status: WriteStatus,
}

/// An open directory: the listing snapshot taken at the first `readdir` (again after a rewind).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DirHandle {
    pub ino: Ino,
    /// Entries after `.` and `..`; offset `n` is index `n - 2`.
    pub snapshot: Option<Vec<ListedEntry>>,
    /// When the snapshot was listed (its entries' validity starts there); not carried over.
    #[serde(skip)]
    pub listed_at: Option<Instant>,
    /// A `readdir` has been answered from this snapshot (so offset 0 again means rewind).
    pub served: bool,
}

/// Open handles by number.
#[derive(Debug, Default)]
pub struct HandleTable {
    next_fh: u64,
    handles: HashMap<u64, Arc<AsyncMutex<Handle>>>,
}

impl HandleTable {
    pub fn insert(&mut self, handle: Handle) -> u64 {
        self.next_fh += 1;
        let fh = self.next_fh;
        self.handles.insert(fh, Arc::new(AsyncMutex::new(handle)));
        fh
    }

    /// The number the next [`HandleTable::insert`] will return.
    pub fn peek_next(&self) -> u64 {
        self.next_fh + 1
    }

    pub fn get(&self, fh: u64) -> Option<Arc<AsyncMutex<Handle>>> {
        self.handles.get(&fh).cloned()
    }

    pub fn remove(&mut self, fh: u64) -> Option<Arc<AsyncMutex<Handle>>> {
        self.handles.remove(&fh)
    }

    pub fn len(&self) -> usize {
        self.handles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Every handle, for snapshots.
    pub fn entries(&self) -> Vec<(u64, Arc<AsyncMutex<Handle>>)> {
        let mut v: Vec<_> = self.handles.iter().map(|(k, h)| (*k, h.clone())).collect();
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
                .map(|(fh, h)| (fh, Arc::new(AsyncMutex::new(h))))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_detection() {
        let mut h = ReadHandle::new(2, "k".into(), None, 100 << 20);
        assert!(h.is_sequential(0));
        assert!(!h.is_sequential(4096));
        h.buffer = Some(ReadBuffer {
            start: 0,
            data: Bytes::from(vec![7u8; 1 << 20]),
        });
        h.next_offset = 128 << 10;
        assert!(
            h.is_sequential(256 << 10),
            "reordered read-ahead inside the buffer"
        );
        assert!(h.is_sequential(1 << 20));
        assert!(!h.is_sequential(50 << 20));
        assert_eq!(h.buffered(10, 20).unwrap().len(), 10);
        assert!(h.buffered(10, (1 << 20) + 1).is_none());
    }
}
