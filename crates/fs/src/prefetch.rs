//! Read-ahead machinery: ranged GETs running as tasks on the runtime ([`Part`]), the per-handle
//! sequential window ([`Prefetch`]) and the per-mount cache of small objects fetched ahead of a
//! reader that opens a directory's files in listing order ([`SmallObjects`]).
//!
//! Every GET is pinned to the version seen at open (its ETag; without one, its Last-Modified and
//! size) and must return exactly the asked length; a short body is retried once, then is an error
//! ([`StoreError::Corrupt`], so `EIO`). Prefetched bytes are charged to the node's [`MemoryBudget`] from the moment the request starts until the data
//! is consumed or dropped; a [`Part`] that is dropped before it completed aborts its request.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytes::Bytes;
use ferry_cache::{BlockCache, BlockKey, Reader};
use ferry_store::{get_version, ObjectStore, StoreError, Version};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::budget::{MemoryBudget, PrefetchConfig, Reservation, StreamSlot};
use crate::proofs::Proofs;

/// One ranged GET of `range` of `version`, retried once if the body is short.
pub async fn fetch_exact(
    store: &dyn ObjectStore,
    bucket: &str,
    key: &str,
    range: Range<u64>,
    version: Version<'_>,
) -> Result<Bytes, StoreError> {
    let mut body = whole_body(key, &range, || async {
        get_version(store, bucket, key, range.clone(), version)
            .await
            .map(|b| vec![b])
    })
    .await?;
    Ok(body.pop().unwrap_or_default())
}

/// Bytes `range` of version `etag` in pieces of `block` bytes, each in its own buffer, retried
/// once if the body is short.
async fn fetch_pieces(
    store: &dyn ObjectStore,
    bucket: &str,
    key: &str,
    range: Range<u64>,
    etag: &str,
    block: u64,
) -> Result<Vec<Bytes>, StoreError> {
    whole_body(key, &range, || {
        store.get_range_pieces(bucket, key, range.clone(), Some(etag), block)
    })
    .await
}

/// Runs `get` (a GET of `range`, its body in one or more buffers) until the body is all of
/// `range`: a short one is asked for once more, then is [`StoreError::Corrupt`].
async fn whole_body<F, Fut>(
    key: &str,
    range: &Range<u64>,
    mut get: F,
) -> Result<Vec<Bytes>, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Vec<Bytes>, StoreError>>,
{
    let want = range.end - range.start;
    let mut last = 0;
    for _ in 0..2 {
        let body = get().await?;
        let got: u64 = body.iter().map(|b| b.len() as u64).sum();
        if got == want {
            return Ok(body);
        }
        last = got;
        tracing::debug!(key, got, want, "short GET body; retrying once");
    }
    Err(StoreError::Corrupt(format!(
        "{key}: GET {}..{} returned {last} of {want} bytes",
        range.start, range.end
    )))
}

/// The node cache as one mount uses it.
#[derive(Debug, Clone)]
pub struct CacheUse {
    pub cache: Arc<BlockCache>,
    /// The mount's endpoint (part of every block key).
    pub endpoint: String,
    /// This mount's credentials have shown access to the source's version (a HEAD or GET with
    /// them returned its ETag within the proof's lifetime). When `false`, [`fetch`] proves it.
    pub proven: bool,
    /// Where [`fetch`] records a proof (the mount's store's [`Proofs`]).
    pub proofs: Arc<Proofs>,
}

/// Where a GET to read from lives.
#[derive(Debug, Clone)]
pub struct Source {
    pub store: Arc<dyn ObjectStore>,
    pub bucket: String,
    pub key: String,
    pub etag: Option<String>,
    /// The object's Last-Modified at open: with `size`, what reads are pinned to when the server
    /// gave no ETag.
    pub last_modified: Option<std::time::SystemTime>,
    /// The object's size (blocks are clipped to it).
    pub size: u64,
    /// Read through the node cache (only with an ETag).
    pub cache: Option<CacheUse>,
}

/// Bytes `range` of `src`: through the node cache when the source uses it (a block on disk gives
/// the pieces that hold the range; one that is not is fetched whole, from S3 at most once at a
/// time node-wide, with this mount's credentials and `If-Match`), else one [`fetch_exact`].
///
/// A cached block is served only to a mount whose own credentials showed access to this object
/// version. If the source is not `proven`: when every block is on disk, a HEAD with the mount's
/// store must return the same ETag first (a denied HEAD is the caller's `EACCES`, another ETag
/// `ESTALE`); otherwise the blocks are fetched with the mount's own store, joining only fetches
/// of the same credentials, those GETs are the proof, and the blocks go to the cache behind
/// them. A first read thus costs no round trip more than without the cache.
pub async fn fetch(src: &Source, range: Range<u64>) -> Result<Bytes, StoreError> {
    fetch_shared(src, range, None, None).await
}

/// [`fetch`] for a caller that holds `held` for the range's bytes (a directory sweep's read-ahead
/// reservation): a block fetched whole for it is written under that charge, not a second one.
pub async fn fetch_held(
    src: &Source,
    range: Range<u64>,
    held: &Arc<Reservation>,
) -> Result<Bytes, StoreError> {
    fetch_shared(src, range, None, Some(&Arc::downgrade(held))).await
}

/// One GET shared by consecutive blocks that [`Prefetch::fill`] fetches ahead through the node
/// cache: each block keeps its own single flight and cache file, but the blocks the GET spans
/// that are fetched at all come from one request (started by the first that needs it). The body
/// arrives in one buffer per block ([`ObjectStore::get_range_pieces`]): a block kept in the
/// cache's write queue keeps no neighbour alive, and no byte is copied more than with one GET per
/// block. On a server whose every GET costs a fixed price (moto reads the whole object for a
/// ranged GET; every server has a first-byte latency), a run of two blocks costs one price, not
/// two.
#[derive(Clone)]
pub struct SharedGet {
    range: Range<u64>,
    block: u64,
    get: PiecesGet,
}

/// A GET of a run's blocks, awaited by each of them.
type PiecesGet = futures::future::Shared<
    futures::future::BoxFuture<'static, Result<Arc<Vec<Bytes>>, StoreError>>,
>;

impl SharedGet {
    /// `range` starts at a block's start.
    fn new(src: &Source, etag: &str, range: Range<u64>, block: u64) -> Self {
        use futures::FutureExt;
        let (store, bucket, key, etag) = (
            src.store.clone(),
            src.bucket.clone(),
            src.key.clone(),
            etag.to_owned(),
        );
        let r = range.clone();
        let get = async move {
            fetch_pieces(&*store, &bucket, &key, r, &etag, block)
                .await
                .map(Arc::new)
        }
        .boxed()
        .shared();
        Self { range, block, get }
    }

    /// Block `range` (within the shared range), as the GET read it; checked before the cache
    /// may store it.
    async fn block(&self, range: Range<u64>) -> Result<Bytes, StoreError> {
        let pieces = self.get.clone().await?;
        let i = ((range.start - self.range.start) / self.block) as usize;
        let piece = pieces.get(i).cloned().unwrap_or_default();
        if piece.len() as u64 != range.end - range.start {
            return Err(StoreError::Corrupt(format!(
                "a shared GET of {}..{} gave {} bytes for block {}..{}",
                self.range.start,
                self.range.end,
                piece.len(),
                range.start,
                range.end
            )));
        }
        Ok(piece)
    }

    fn covers(&self, range: &Range<u64>) -> bool {
        self.range.start <= range.start
            && range.end <= self.range.end
            && (range.start - self.range.start).is_multiple_of(self.block)
    }
}

impl fmt::Debug for SharedGet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedGet({}..{})", self.range.start, self.range.end)
    }
}

/// [`fetch`], with the blocks `shared` covers taken from that one GET when they are fetched.
/// `held`: the budget the caller holds for the range's bytes, if any (a prefetched part's): the
/// node cache's write of a block fetched here holds it too if the part is still there when the
/// block is handed over, so the buffer, which the write keeps alive, stays charged once until
/// both are done with it (a part dropped before that gives its budget back at once).
async fn fetch_shared(
    src: &Source,
    range: Range<u64>,
    shared: Option<&SharedGet>,
    held: Option<&Weak<Reservation>>,
) -> Result<Bytes, StoreError> {
    let (Some(c), Some(etag)) = (&src.cache, src.etag.as_deref()) else {
        let version = Version::of(src.etag.as_deref(), src.last_modified, src.size);
        return fetch_exact(&*src.store, &src.bucket, &src.key, range, version).await;
    };
    if range.start >= range.end || range.end > src.size {
        return fetch_exact(
            &*src.store,
            &src.bucket,
            &src.key,
            range,
            Version::ETag(etag),
        )
        .await;
    }
    let bs = c.cache.block_size();
    let (first, last) = (range.start / bs, (range.end - 1) / bs);
    // The credentials' identity: their proofs, shared by the mounts of one store.
    let owner = c.proofs.id();
    let mut reader = Reader::Proven { owner };
    if !c.proven {
        let on_disk = (first..=last).all(|i| c.cache.contains(&block_key(src, c, etag, i)));
        if on_disk {
            // Only a read proves access to the bytes (a HEAD is answered where the GET is
            // refused: an SSE-KMS object without `kms:Decrypt`, an archived one): the first
            // byte of this version (a changed object: PreconditionFailed).
            if let Err(e) = src
                .store
                .get_range(&src.bucket, &src.key, 0..1, Some(etag))
                .await
            {
                if matches!(e, StoreError::AccessDenied(_)) {
                    c.cache.note_denied();
                }
                return Err(e);
            }
            c.proofs.prove(&src.bucket, &src.key, etag);
        } else {
            reader = Reader::Unproven { owner };
        }
    }
    // Of each block only the bytes the range covers: a hit reads and checks only the pieces
    // of the block file that hold them.
    let parts = futures::future::try_join_all((first..=last).map(|i| {
        let within = range.start.max(i * bs) - i * bs..range.end.min((i + 1) * bs) - i * bs;
        cached_block(src, c, etag, i, within, reader, shared, held)
    }))
    .await?;
    if matches!(reader, Reader::Unproven { .. }) {
        c.proofs.prove(&src.bucket, &src.key, etag);
    }
    if let [part] = parts.as_slice() {
        return Ok(part.clone());
    }
    let mut out = bytes::BytesMut::with_capacity((range.end - range.start) as usize);
    for part in &parts {
        out.extend_from_slice(part);
    }
    Ok(out.freeze())
}

/// Whether every block of `src`'s object is in the node cache (whole or as blocks).
pub fn is_cached(src: &Source) -> bool {
    let (Some(c), Some(etag)) = (&src.cache, src.etag.as_deref()) else {
        return false;
    };
    let blocks = src.size.div_ceil(c.cache.block_size());
    (0..blocks).all(|i| c.cache.contains(&block_key(src, c, etag, i)))
}

fn block_key(src: &Source, c: &CacheUse, etag: &str, index: u64) -> BlockKey {
    BlockKey {
        endpoint: c.endpoint.clone(),
        bucket: src.bucket.clone(),
        key: src.key.clone(),
        etag: etag.to_owned(),
        index,
    }
}

/// Bytes `within` (relative to the block's start) of block `index` of `src` from the node cache,
/// or the block fetched (and stored) on a miss; as `reader`. The block's write holds `held`.
#[allow(clippy::too_many_arguments)]
async fn cached_block(
    src: &Source,
    c: &CacheUse,
    etag: &str,
    index: u64,
    within: Range<u64>,
    reader: Reader,
    shared: Option<&SharedGet>,
    held: Option<&Weak<Reservation>>,
) -> Result<Bytes, StoreError> {
    let bs = c.cache.block_size();
    let start = index * bs;
    let end = src.size.min(start + bs);
    let key = block_key(src, c, etag, index);
    let shared = shared.filter(|g| g.covers(&(start..end)));
    let wanted = within.end - within.start;
    let part = ferry_cache::Part {
        len: end - start,
        within,
    };
    let charge = held.cloned().map(|part| {
        Box::new(move || {
            part.upgrade()
                .map(|r| Box::new(r) as ferry_cache::WriteCharge)
        }) as ferry_cache::HeldCharge
    });
    let data = c
        .cache
        .get_part_or_fetch_as(&key, part, reader, charge, |range| async move {
            // The whole block, or only the read's bytes when the budget cannot carry the block
            // until it is stored (then a GET of them, unless a shared one brings them anyway).
            match shared {
                Some(g) => Ok(g
                    .block(start..end)
                    .await?
                    .slice(range.start as usize..range.end as usize)),
                None => {
                    fetch_exact(
                        &*src.store,
                        &src.bucket,
                        &src.key,
                        start + range.start..start + range.end,
                        Version::ETag(etag),
                    )
                    .await
                }
            }
        })
        .await?;
    if data.len() as u64 != wanted {
        return Err(StoreError::Corrupt(format!(
            "{}: cached block {index} gave {} bytes of the {wanted} asked (the object's size \
             says the block has {})",
            src.key,
            data.len(),
            end - start
        )));
    }
    Ok(data)
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
    /// Budget held for the part's bytes from request start until the part is dropped (and the
    /// node cache has written the blocks fetched for it: [`fetch_shared`]).
    _reservation: Option<Arc<Reservation>>,
    /// Bytes of it handed to the reader (hits; the rest, if fetched, is waste when dropped).
    served: u64,
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
        Self::spawn_shared(src, range, reservation, None)
    }

    /// [`Part::spawn`], its blocks taken from `shared` when fetched.
    fn spawn_shared(
        src: &Source,
        range: Range<u64>,
        reservation: Option<Reservation>,
        shared: Option<SharedGet>,
    ) -> Part {
        let src = src.clone();
        let (start, end) = (range.start, range.end);
        let reservation = reservation.map(Arc::new);
        let held = reservation.as_ref().map(Arc::downgrade);
        let task =
            tokio::spawn(
                async move { fetch_shared(&src, range, shared.as_ref(), held.as_ref()).await },
            );
        Part {
            start,
            end,
            state: PartState::Pending(task),
            _reservation: reservation,
            served: 0,
        }
    }

    /// Records that `n` bytes of the part were handed to the reader.
    pub fn note_served(&mut self, n: u64) {
        self.served = self.served.saturating_add(n);
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
        let fetched = match &self.state {
            PartState::Pending(task) => {
                let done = task.is_finished();
                task.abort();
                done
            }
            PartState::Ready(_) => true,
            PartState::Failed(_) => false,
        };
        let hit = self.served.min(self.len());
        let m = &ferry_metrics::metrics().node;
        if hit > 0 {
            m.prefetch_hit_bytes.inc_by(hit);
        }
        if fetched && hit < self.len() {
            m.prefetch_wasted_bytes.inc_by(self.len() - hit);
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
    /// Where the stream started (the offset of its first sequential read).
    pub origin: u64,
    /// Counts this reader among the node's sequential readers while it has a window.
    pub slot: Option<StreamSlot>,
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
        self.slot = None;
    }

    /// Starts a sequential stream at `offset`: the initial window, counted among the node's
    /// streams.
    pub fn start(&mut self, offset: u64, cfg: &PrefetchConfig, budget: &MemoryBudget) {
        self.window = cfg.initial_window.max(1);
        self.origin = offset;
        self.slot = Some(budget.join_stream());
    }

    /// Doubles the window for each of `parts` consumed, up to the reader's share
    /// ([`PrefetchConfig::window_cap`]).
    pub fn grow(&mut self, parts: usize, cfg: &PrefetchConfig, budget: &MemoryBudget) {
        let cap = cfg.window_cap(budget.streams());
        for _ in 0..parts {
            self.window = (self.window * 2).min(cap);
        }
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
    ///
    /// The first GET of a stream is the initial window. Once the reader is half-way through it
    /// the stream is taken for a sequential read of the object, and the window is at least a part:
    /// from then on each GET is a whole part on a part boundary (the first one up to the next
    /// boundary), and the target is rounded down to a boundary, with at least one part started
    /// per top-up. A 128 MiB object read through takes 17 GETs (1 MiB, 7 MiB, then 8 MiB parts),
    /// not 22 of a window doubling from 1 MiB with GETs cut wherever it ended: every GET
    /// costs a round trip and a request charge, and on servers that read the whole object for a
    /// ranged GET (moto) far more.
    pub fn fill(
        &mut self,
        src: &Source,
        size: u64,
        reader: u64,
        cfg: &PrefetchConfig,
        budget: &MemoryBudget,
    ) {
        // Readers that started since the window grew shrink it to this reader's share.
        let cap = cfg.window_cap(budget.streams());
        self.window = self.window.min(cap);
        let part = cfg.part_size.max(1);
        if reader.saturating_sub(self.origin) >= cfg.initial_window / 2 {
            self.window = self.window.max(part.min(cap));
        }
        let mut next = self.span().map_or(reader, |(_, end)| end).max(reader);
        // Top up only once less than half the window is left ahead, so GETs stay large and at
        // most a window is fetched or in flight ahead of the reader.
        if next.saturating_sub(reader) > self.window / 2 {
            return;
        }
        let aligned = self.window >= part;
        let mut target = size.min(reader.saturating_add(self.window));
        if aligned && target < size {
            target = (target / part * part).max(next.saturating_add(1)).min(size);
        }
        // Through the node cache, a part is one block (or the rest of one): each block is then
        // read (and its checksum computed) once per reader, not by two neighbouring parts, and
        // handed on as it came, never copied into a part spanning two.
        let block = src.cache.as_ref().map(|c| c.cache.block_size());
        let mut planned = Vec::new();
        while next < target {
            let mut len = cfg.part_size.min(target - next);
            if let Some(bs) = block {
                len = (next + 1).next_multiple_of(bs).min(size) - next;
            } else if aligned {
                len = (next + 1).next_multiple_of(part).min(size) - next;
            }
            let Some(reservation) = budget.try_reserve(len) else {
                tracing::trace!(key = %src.key, "memory budget exhausted: prefetch shrinks");
                break;
            };
            planned.push((next..next + len, reservation));
            next += len;
        }
        let shared = match (&src.cache, src.etag.as_deref(), block) {
            (Some(c), Some(etag), Some(bs)) => {
                shared_gets(src, c, etag, bs, cfg.part_size, &planned)
            }
            _ => vec![None; planned.len()],
        };
        for ((range, reservation), shared) in planned.into_iter().zip(shared) {
            self.parts
                .push_back(Part::spawn_shared(src, range, Some(reservation), shared));
        }
    }
}

/// For each planned block part, the GET it shares: runs of consecutive parts whose blocks are not
/// in the cache, up to `part_size` bytes each and within one part of the object, share one (a
/// block on disk is read from there and breaks the run, so no GET fetches bytes the cache holds).
fn shared_gets(
    src: &Source,
    c: &CacheUse,
    etag: &str,
    bs: u64,
    part_size: u64,
    planned: &[(Range<u64>, Reservation)],
) -> Vec<Option<SharedGet>> {
    let per_get = (part_size / bs).max(1) as usize;
    let mut out = vec![None; planned.len()];
    let mut i = 0;
    while i < planned.len() {
        let missing = |k: usize| {
            !c.cache
                .contains(&block_key(src, c, etag, planned[k].0.start / bs))
        };
        // A run ends at a part boundary, so a stream's GETs are whole parts (as without the
        // cache) wherever its first block was.
        let mut j = i;
        while j < planned.len()
            && j - i < per_get
            && (j == i || !planned[j].0.start.is_multiple_of(part_size.max(1)))
            && missing(j)
        {
            j += 1;
        }
        if j - i > 1 {
            // From its first block's start: a block is always fetched whole, also when the
            // reader is in its middle (a top-up after a skip).
            let start = planned[i].0.start / bs * bs;
            let g = SharedGet::new(src, etag, start..planned[j - 1].0.end, bs);
            for slot in &mut out[i..j] {
                *slot = Some(g.clone());
            }
        }
        i = j.max(i + 1);
    }
    out
}

/// A small object fetched (or being fetched) whole ahead of its open.
#[derive(Debug)]
struct SmallEntry {
    part: Part,
    added: Instant,
}

/// Per-mount cache of small objects fetched ahead, by (key, ETag): an open that pins the same
/// ETag takes the entry (so it is used once); entries not taken within the TTL are dropped by a
/// timer, so an idle mount does not keep prefetched bytes charged to the node's budget. Versions
/// already opened (taken, or read without a prefetch) are remembered for the TTL, so readers
/// that move the listing-order frontier back (several readers at different speeds) never make
/// the prefetcher fetch them again.
#[derive(Debug, Default)]
pub struct SmallObjects {
    entries: Arc<Mutex<HashMap<(String, String), SmallEntry>>>,
    /// Versions opened, with when (the latest open).
    opened: HashMap<(String, String), Instant>,
    /// The same opens in the order they happened, so expiring old ones looks only at those: an
    /// open of a dataset of many small files must not scan every file opened within the TTL.
    opened_order: VecDeque<(Instant, (String, String))>,
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
    /// Whether `key` at `etag` is fetched (or being fetched) ahead, or was opened within the TTL.
    pub fn contains(&self, key: &str, etag: &str) -> bool {
        let k = (key.to_owned(), etag.to_owned());
        self.opened.contains_key(&k) || lock_entries(&self.entries).contains_key(&k)
    }

    /// Records that `key` at `etag` was opened (so it is not fetched ahead again).
    pub fn opened(&mut self, key: &str, etag: &str) {
        let (k, now) = ((key.to_owned(), etag.to_owned()), Instant::now());
        self.opened.insert(k.clone(), now);
        self.opened_order.push_back((now, k));
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

    /// Takes the entry for `key` at `etag`, if any, and records the open.
    pub fn take(&mut self, key: &str, etag: &str) -> Option<Part> {
        self.opened(key, etag);
        lock_entries(&self.entries)
            .remove(&(key.to_owned(), etag.to_owned()))
            .map(|e| e.part)
    }

    /// Drops entries older than `ttl` (aborting their requests) and forgets older opens.
    pub fn expire(&mut self, ttl: std::time::Duration) {
        drop_expired(&mut lock_entries(&self.entries), ttl);
        let now = Instant::now();
        while let Some((at, _)) = self.opened_order.front() {
            if now.duration_since(*at) < ttl {
                break;
            }
            let (at, k) = self.opened_order.pop_front().expect("front exists");
            // A later open of the same version keeps it (its own turn comes later).
            if self.opened.get(&k) == Some(&at) {
                self.opened.remove(&k);
            }
        }
    }

    pub fn len(&self) -> usize {
        lock_entries(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        lock_entries(&self.entries).is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn opened_versions_are_remembered_for_the_ttl_counted_from_the_latest_open() {
        let ttl = Duration::from_secs(10);
        let mut small = SmallObjects::default();
        small.opened("a", "e1");
        small.opened("b", "e1");
        tokio::time::advance(Duration::from_secs(6)).await;
        small.opened("a", "e1"); // opened again: remembered 10 s from now
        small.expire(ttl);
        assert!(small.contains("a", "e1") && small.contains("b", "e1"));
        assert!(
            !small.contains("a", "e2"),
            "another version is another object"
        );
        tokio::time::advance(Duration::from_secs(5)).await;
        small.expire(ttl);
        assert!(!small.contains("b", "e1"), "b's open is 11 s old");
        assert!(small.contains("a", "e1"), "a's latest open is 5 s old");
        tokio::time::advance(Duration::from_secs(5)).await;
        small.expire(ttl);
        assert!(!small.contains("a", "e1"));
        assert!(small.opened.is_empty() && small.opened_order.is_empty());
    }
}
