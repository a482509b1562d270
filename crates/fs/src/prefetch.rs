//! Read-ahead machinery: ranged GETs running as tasks on the runtime ([`Part`]), the per-handle
//! sequential window ([`Prefetch`]) and the per-mount cache of small objects fetched ahead of a
//! reader that opens a directory's files in listing order ([`SmallObjects`]).
//!
//! Every GET carries the ETag pinned at open and must return exactly the asked length; a short
//! body is retried once, then is an error ([`StoreError::Corrupt`], so `EIO`). Prefetched bytes
//! are charged to the node's [`MemoryBudget`] from the moment the request starts until the data
//! is consumed or dropped; a [`Part`] that is dropped before it completed aborts its request.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use ferry_store::{ObjectStore, StoreError};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::budget::{MemoryBudget, PrefetchConfig, Reservation};

/// One ranged GET of `range`, retried once if the body is short.
pub async fn fetch_exact(
    store: &dyn ObjectStore,
    bucket: &str,
    key: &str,
    range: Range<u64>,
    etag: Option<&str>,
) -> Result<Bytes, StoreError> {
    let want = range.end - range.start;
    let mut last = 0;
    for _ in 0..2 {
        let data = store.get_range(bucket, key, range.clone(), etag).await?;
        if data.len() as u64 == want {
            return Ok(data);
        }
        last = data.len();
        tracing::debug!(key, got = last, want, "short GET body; retrying once");
    }
    Err(StoreError::Corrupt(format!(
        "{key}: GET {}..{} returned {last} of {want} bytes",
        range.start, range.end
    )))
}

/// Where a GET to read from lives.
#[derive(Debug, Clone)]
pub struct Source {
    pub store: Arc<dyn ObjectStore>,
    pub bucket: String,
    pub key: String,
    pub etag: Option<String>,
}

enum PartState {
    Pending(JoinHandle<Result<Bytes, StoreError>>),
    Ready(Bytes),
    Failed(StoreError),
}

/// Bytes `start..end` of one object version: being fetched by a task, or fetched.
pub struct Part {
    pub start: u64,
    pub end: u64,
    state: PartState,
    /// Budget held for the part's bytes from request start until the part is dropped.
    _reservation: Option<Reservation>,
}

impl fmt::Debug for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            PartState::Pending(_) => "pending",
            PartState::Ready(_) => "ready",
            PartState::Failed(_) => "failed",
        };
        write!(f, "Part({}..{}, {state})", self.start, self.end)
    }
}

impl Part {
    /// Starts fetching `range` of `src` on the current runtime.
    pub fn spawn(src: &Source, range: Range<u64>, reservation: Option<Reservation>) -> Part {
        let src = src.clone();
        let (start, end) = (range.start, range.end);
        let task = tokio::spawn(async move {
            fetch_exact(
                &*src.store,
                &src.bucket,
                &src.key,
                range,
                src.etag.as_deref(),
            )
            .await
        });
        Part {
            start,
            end,
            state: PartState::Pending(task),
            _reservation: reservation,
        }
    }

    /// The part's bytes, waiting for the request if it is still running.
    pub async fn data(&mut self) -> Result<Bytes, StoreError> {
        if let PartState::Pending(task) = &mut self.state {
            self.state = match task.await {
                Ok(Ok(data)) => PartState::Ready(data),
                Ok(Err(e)) => PartState::Failed(e),
                Err(e) => PartState::Failed(StoreError::Other(format!("prefetch task: {e}"))),
            };
        }
        match &self.state {
            PartState::Ready(data) => Ok(data.clone()),
            PartState::Failed(e) => Err(e.clone()),
            PartState::Pending(_) => unreachable!("awaited above"),
        }
    }

    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        if let PartState::Pending(task) = &self.state {
            task.abort();
        }
    }
}

/// A read handle's sequential read-ahead: contiguous parts ahead of the reader and a window
/// (bytes to keep in flight ahead of it) that doubles each time the reader finishes a part, up to
/// [`PrefetchConfig::max_window`]. Not carried over a process handover (cloning gives an empty one).
#[derive(Debug, Default)]
pub struct Prefetch {
    /// Contiguous, ascending.
    pub parts: VecDeque<Part>,
    /// Bytes to keep fetched or in flight ahead of the reader; 0 = not sequential yet.
    pub window: u64,
}

impl Clone for Prefetch {
    fn clone(&self) -> Self {
        Prefetch::default()
    }
}

impl Prefetch {
    /// Drops every part (aborting requests in flight) and resets the window.
    pub fn reset(&mut self) {
        self.parts.clear();
        self.window = 0;
    }

    /// Where the parts start and end, if there are any.
    pub fn span(&self) -> Option<(u64, u64)> {
        Some((self.parts.front()?.start, self.parts.back()?.end))
    }

    /// Drops the parts wholly before `offset` (consumed); returns how many.
    pub fn consume_before(&mut self, offset: u64) -> usize {
        let mut n = 0;
        while self.parts.front().is_some_and(|p| p.end <= offset) {
            self.parts.pop_front();
            n += 1;
        }
        n
    }

    /// Once less than half the window is left ahead of `reader`, starts GETs (of at most a part
    /// each) until `window` bytes from `reader` on are covered, or the object ends, or the budget
    /// is exhausted (then fewer; none at all is fine: reads then fetch what they need).
    pub fn fill(
        &mut self,
        src: &Source,
        size: u64,
        reader: u64,
        cfg: &PrefetchConfig,
        budget: &MemoryBudget,
    ) {
        let mut next = self.span().map_or(reader, |(_, end)| end).max(reader);
        // Top up only once less than half the window is left ahead, so GETs stay large and at
        // most a window is fetched or in flight ahead of the reader.
        if next.saturating_sub(reader) > self.window / 2 {
            return;
        }
        let target = size.min(reader.saturating_add(self.window));
        while next < target {
            let len = cfg.part_size.min(target - next);
            let Some(reservation) = budget.try_reserve(len) else {
                tracing::trace!(key = %src.key, "memory budget exhausted: prefetch shrinks");
                break;
            };
            self.parts
                .push_back(Part::spawn(src, next..next + len, Some(reservation)));
            next += len;
        }
    }
}

/// A small object fetched (or being fetched) whole ahead of its open.
#[derive(Debug)]
struct SmallEntry {
    part: Part,
    added: Instant,
}

/// Per-mount cache of small objects fetched ahead, by (key, ETag): an open that pins the same
/// ETag takes the entry (so it is used once); entries not taken within the TTL are dropped by a
/// timer, so an idle mount does not keep prefetched bytes charged to the node's budget.
#[derive(Debug, Default)]
pub struct SmallObjects {
    entries: Arc<Mutex<HashMap<(String, String), SmallEntry>>>,
}

type Entries = HashMap<(String, String), SmallEntry>;

fn lock_entries(m: &Mutex<Entries>) -> MutexGuard<'_, Entries> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn drop_expired(entries: &mut Entries, ttl: std::time::Duration) {
    let now = Instant::now();
    entries.retain(|_, e| now.duration_since(e.added) < ttl);
}

impl SmallObjects {
    pub fn contains(&self, key: &str, etag: &str) -> bool {
        lock_entries(&self.entries).contains_key(&(key.to_owned(), etag.to_owned()))
    }

    /// Adds an entry and starts its timer (on the current runtime): it is dropped once `ttl` has
    /// passed unless taken first. The timer holds no reference to the cache, only a weak one.
    pub fn insert(&mut self, key: String, etag: String, part: Part, ttl: std::time::Duration) {
        let added = Instant::now();
        lock_entries(&self.entries).insert((key, etag), SmallEntry { part, added });
        let weak = Arc::downgrade(&self.entries);
        tokio::spawn(async move {
            tokio::time::sleep_until(added + ttl).await;
            if let Some(entries) = weak.upgrade() {
                drop_expired(&mut lock_entries(&entries), ttl);
            }
        });
    }

    /// Takes the entry for `key` at `etag`, if any.
    pub fn take(&mut self, key: &str, etag: &str) -> Option<Part> {
        lock_entries(&self.entries)
            .remove(&(key.to_owned(), etag.to_owned()))
            .map(|e| e.part)
    }

    /// Drops entries older than `ttl` (aborting their requests).
    pub fn expire(&mut self, ttl: std::time::Duration) {
        drop_expired(&mut lock_entries(&self.entries), ttl);
    }

    pub fn len(&self) -> usize {
        lock_entries(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        lock_entries(&self.entries).is_empty()
    }
}
