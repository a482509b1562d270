//! [`MemoryStore`]: an in-memory, multi-bucket [`ObjectStore`] that follows S3's semantics, for tests.
//!
//! What it reproduces from S3 (and what `ferry_s3::S3Store` sees from a real server):
//! - ListObjectsV2: `prefix`, any `delimiter` (common prefixes include it), byte-wise lexicographic
//!   order, `max_keys` (clipped to 1000; a common prefix counts as one entry), opaque continuation
//!   tokens, `start_after` (ignored when a continuation token is given, as S3 does).
//! - ETags are S3's: `"<md5 hex>"` for a PUT, `"<md5 of the parts' md5s>-<parts>"` for a multipart
//!   upload; LIST and HEAD return the same ETag.
//! - `last_modified` has whole-second precision (what HEAD's `Last-Modified` header carries).
//! - `get_range` is clipped at the object's end; a start at or past the end is
//!   [`StoreError::InvalidRequest`] (S3: 416 InvalidRange); `if_match` mismatch is
//!   [`StoreError::PreconditionFailed`] (checked before the range, as HTTP requires).
//! - Multipart: part numbers 1..=10000, re-uploading a part replaces it, complete needs ascending
//!   part numbers with matching ETags and every part but the last ≥ [`MIN_PART_SIZE`] (adjustable
//!   with [`MemoryStore::set_min_part_size`]), unknown upload ids are [`StoreError::NotFound`].
//! - ListMultipartUploads: uploads in progress by key, then (for one key) in the order they were
//!   started; `max_uploads` clipped to 1000; the next page starts after the last upload's key and
//!   upload id (`key-marker`, `upload-id-marker`), or after every upload of the key without an id.
//! - Deleting a missing key succeeds; an unknown bucket is [`StoreError::NoSuchBucket`].
//!
//! Every call is counted in [`StoreStats`] (also the failed ones), readable with
//! [`MemoryStore::stats`].

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::{Bound, Range};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};

use crate::{
    CompletedPart, ListPage, ListRequest, ObjectInfo, ObjectStore, Op, PutResult, Result,
    StoreError, UploadsMarker, UploadsPage, UploadsRequest, MAX_DELETE_BATCH, MAX_LIST_KEYS,
    MAX_PART_NUMBER, MIN_PART_SIZE,
};

/// Request counters of a [`MemoryStore`]: one per operation, plus payload bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    pub head_bucket: u64,
    pub list: u64,
    pub head: u64,
    /// `get_range` calls.
    pub get: u64,
    /// Bytes returned by successful `get_range` calls.
    pub get_bytes: u64,
    pub put: u64,
    /// Bytes received by successful `put` and `upload_part` calls.
    pub put_bytes: u64,
    pub create_multipart: u64,
    pub upload_part: u64,
    pub complete_multipart: u64,
    pub abort_multipart: u64,
    pub list_uploads: u64,
    pub delete: u64,
    pub delete_many: u64,
}

impl StoreStats {
    /// The number of requests of one kind.
    pub fn requests(&self, op: Op) -> u64 {
        match op {
            Op::HeadBucket => self.head_bucket,
            Op::List => self.list,
            Op::Head => self.head,
            Op::Get => self.get,
            Op::Put => self.put,
            Op::CreateMultipart => self.create_multipart,
            Op::UploadPart => self.upload_part,
            Op::CompleteMultipart => self.complete_multipart,
            Op::AbortMultipart => self.abort_multipart,
            Op::ListUploads => self.list_uploads,
            Op::Delete => self.delete,
            Op::DeleteMany => self.delete_many,
        }
    }

    /// Every request of every kind.
    pub fn total_requests(&self) -> u64 {
        Op::ALL.iter().map(|&op| self.requests(op)).sum()
    }

    fn count(&mut self, op: Op) {
        let slot = match op {
            Op::HeadBucket => &mut self.head_bucket,
            Op::List => &mut self.list,
            Op::Head => &mut self.head,
            Op::Get => &mut self.get,
            Op::Put => &mut self.put,
            Op::CreateMultipart => &mut self.create_multipart,
            Op::UploadPart => &mut self.upload_part,
            Op::CompleteMultipart => &mut self.complete_multipart,
            Op::AbortMultipart => &mut self.abort_multipart,
            Op::ListUploads => &mut self.list_uploads,
            Op::Delete => &mut self.delete,
            Op::DeleteMany => &mut self.delete_many,
        };
        *slot += 1;
    }
}

/// An in-memory S3. Cheap to clone: clones share the same buckets and counters.
#[derive(Clone)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

struct State {
    buckets: BTreeMap<String, Bucket>,
    stats: StoreStats,
    next_upload: u64,
    min_part_size: u64,
    /// Most keys and prefixes one LIST page returns, whatever `max_keys` asks.
    list_page_max: u32,
}

#[derive(Default)]
struct Bucket {
    objects: BTreeMap<String, Object>,
    uploads: HashMap<String, Upload>,
}

#[derive(Clone)]
struct Object {
    data: Bytes,
    etag: String,
    last_modified: SystemTime,
}

struct Upload {
    key: String,
    /// part number → (data, quoted ETag)
    parts: BTreeMap<i32, (Bytes, String)>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("MemoryStore")
            .field("buckets", &state.buckets.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// A ranged GET whose object must pass `check` first (its preconditions).
    fn get_checked(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        check: impl FnOnce(&Object) -> Result<()>,
    ) -> Result<Bytes> {
        self.with_bucket(Op::Get, bucket, |b, stats, _| {
            if range.start >= range.end {
                return Err(StoreError::InvalidRequest(format!(
                    "empty range {range:?} of {key}"
                )));
            }
            let object = b
                .objects
                .get(key)
                .ok_or_else(|| StoreError::NotFound(key.to_owned()))?;
            check(object)?;
            let size = object.data.len() as u64;
            if range.start >= size {
                return Err(StoreError::InvalidRequest(format!(
                    "range {range:?} of {key} starts at or past its end ({size} bytes)"
                )));
            }
            let end = range.end.min(size);
            let data = object.data.slice(range.start as usize..end as usize);
            stats.get_bytes += data.len() as u64;
            Ok(data)
        })
    }
    /// An empty store without buckets.
    pub fn new() -> Self {
        MemoryStore {
            state: Arc::new(Mutex::new(State {
                buckets: BTreeMap::new(),
                stats: StoreStats::default(),
                next_upload: 1,
                min_part_size: MIN_PART_SIZE,
                list_page_max: MAX_LIST_KEYS,
            })),
        }
    }

    /// Creates a bucket; creating an existing one is a no-op.
    pub fn create_bucket(&self, name: &str) {
        self.lock().buckets.entry(name.to_owned()).or_default();
    }

    /// Stores an object (creating the bucket if needed) without counting a request, and returns its
    /// quoted ETag.
    pub fn insert(&self, bucket: &str, key: &str, data: impl Into<Bytes>) -> String {
        self.insert_with_mtime(bucket, key, data, now())
    }

    /// [`MemoryStore::insert`] with a chosen `last_modified` (truncated to whole seconds).
    pub fn insert_with_mtime(
        &self,
        bucket: &str,
        key: &str,
        data: impl Into<Bytes>,
        last_modified: SystemTime,
    ) -> String {
        let object = Object::new(data.into(), truncate_to_secs(last_modified));
        let etag = object.etag.clone();
        self.lock()
            .buckets
            .entry(bucket.to_owned())
            .or_default()
            .objects
            .insert(key.to_owned(), object);
        etag
    }

    /// The bytes of an object, without counting a request.
    pub fn get_object(&self, bucket: &str, key: &str) -> Option<Bytes> {
        let state = self.lock();
        Some(state.buckets.get(bucket)?.objects.get(key)?.data.clone())
    }

    /// Every key of a bucket in list order (empty for an unknown bucket), without counting a request.
    pub fn keys(&self, bucket: &str) -> Vec<String> {
        self.lock()
            .buckets
            .get(bucket)
            .map(|b| b.objects.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// The number of multipart uploads started and neither completed nor aborted in `bucket`.
    pub fn pending_uploads(&self, bucket: &str) -> usize {
        self.lock()
            .buckets
            .get(bucket)
            .map_or(0, |b| b.uploads.len())
    }

    /// The (key, upload id) of every multipart upload in progress in `bucket`, in
    /// ListMultipartUploads' order, without counting a request.
    pub fn uploads(&self, bucket: &str) -> Vec<(String, String)> {
        let mut all: Vec<(String, String)> = self
            .lock()
            .buckets
            .get(bucket)
            .map(|b| {
                b.uploads
                    .iter()
                    .map(|(id, u)| (u.key.clone(), id.clone()))
                    .collect()
            })
            .unwrap_or_default();
        all.sort();
        all
    }

    /// Changes the minimum size of every part but the last (default [`MIN_PART_SIZE`], as S3), so
    /// unit tests can exercise multipart code paths with small parts.
    pub fn set_min_part_size(&self, bytes: u64) {
        self.lock().min_part_size = bytes;
    }

    /// Caps every LIST page at `n` entries (default 1,000, as S3; S3 may also return fewer than
    /// asked), so tests can exercise many-page listings with a few keys.
    pub fn set_list_page_max(&self, n: u32) {
        self.lock().list_page_max = n.clamp(1, MAX_LIST_KEYS);
    }

    /// A snapshot of the request counters.
    pub fn stats(&self) -> StoreStats {
        self.lock().stats.clone()
    }

    /// Zeroes the request counters.
    pub fn reset_stats(&self) {
        self.lock().stats = StoreStats::default();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (every mutation is one step).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts the request and hands the bucket to `f`.
    /// PutObject; `if_absent`: refused (PreconditionFailed) when an object has the key.
    fn put_object(
        &self,
        bucket: &str,
        key: &str,
        body: Bytes,
        if_absent: bool,
    ) -> Result<PutResult> {
        self.with_bucket(Op::Put, bucket, |b, stats, _| {
            check_key(key)?;
            if if_absent && b.objects.contains_key(key) {
                return Err(StoreError::PreconditionFailed(format!(
                    "{key}: an object has the key (If-None-Match: *)"
                )));
            }
            stats.put_bytes += body.len() as u64;
            let object = Object::new(body, now());
            let etag = object.etag.clone();
            b.objects.insert(key.to_owned(), object);
            Ok(PutResult { etag: Some(etag) })
        })
    }

    /// CompleteMultipartUpload; `if_absent`: refused (PreconditionFailed, the upload kept) when
    /// an object has the key.
    fn complete(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
        if_absent: bool,
    ) -> Result<PutResult> {
        self.with_bucket(Op::CompleteMultipart, bucket, |b, _, min_part| {
            let exists = b.objects.contains_key(key);
            let upload = find_upload(b, key, upload_id)?;
            if if_absent && exists {
                return Err(StoreError::PreconditionFailed(format!(
                    "completing {key}: an object has the key (If-None-Match: *)"
                )));
            }
            if parts.is_empty() {
                return Err(StoreError::InvalidRequest(format!(
                    "completing {key}: no parts given (MalformedXML)"
                )));
            }
            if parts.windows(2).any(|w| w[0].part_number >= w[1].part_number) {
                return Err(StoreError::InvalidRequest(format!(
                    "completing {key}: part numbers must ascend (InvalidPartOrder)"
                )));
            }
            let mut chosen = Vec::with_capacity(parts.len());
            for (i, part) in parts.iter().enumerate() {
                let (data, etag) = upload
                    .parts
                    .get(&part.part_number)
                    .filter(|(_, etag)| etag_matches(&part.etag, etag))
                    .ok_or_else(|| {
                        StoreError::InvalidRequest(format!(
                            "completing {key}: part {} with ETag {} was not uploaded (InvalidPart)",
                            part.part_number, part.etag
                        ))
                    })?;
                if i + 1 < parts.len() && (data.len() as u64) < min_part {
                    return Err(StoreError::InvalidRequest(format!(
                        "completing {key}: part {} is {} bytes, below the {min_part}-byte minimum (EntityTooSmall)",
                        part.part_number,
                        data.len()
                    )));
                }
                chosen.push((data.clone(), etag.clone()));
            }
            let total: usize = chosen.iter().map(|(d, _)| d.len()).sum();
            let mut body = BytesMut::with_capacity(total);
            let mut digests = Vec::with_capacity(chosen.len() * 16);
            for (data, _) in &chosen {
                body.extend_from_slice(data);
                digests.extend_from_slice(&md5_digest(data));
            }
            let etag = format!(
                "\"{}-{}\"",
                hex(&md5_digest(&digests)),
                chosen.len()
            );
            b.uploads.remove(upload_id);
            b.objects.insert(
                key.to_owned(),
                Object {
                    data: body.freeze(),
                    etag: etag.clone(),
                    last_modified: now(),
                },
            );
            Ok(PutResult { etag: Some(etag) })
        })
    }

    fn with_bucket<T>(
        &self,
        op: Op,
        bucket: &str,
        f: impl FnOnce(&mut Bucket, &mut StoreStats, u64) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.stats.count(op);
        let min_part = state.min_part_size;
        let b = state
            .buckets
            .get_mut(bucket)
            .ok_or_else(|| StoreError::NoSuchBucket(bucket.to_owned()))?;
        f(b, &mut state.stats, min_part)
    }
}

impl Object {
    fn new(data: Bytes, last_modified: SystemTime) -> Self {
        let etag = format!("\"{}\"", hex(&md5_digest(&data)));
        Object {
            data,
            etag,
            last_modified,
        }
    }

    fn info(&self, key: &str) -> ObjectInfo {
        ObjectInfo {
            key: key.to_owned(),
            size: self.data.len() as u64,
            etag: Some(self.etag.clone()),
            last_modified: Some(self.last_modified),
        }
    }
}

/// MD5 of `data`, as S3's ETags use it (RustCrypto's md-5).
fn md5_digest(data: &[u8]) -> [u8; 16] {
    use md5::Digest;
    md5::Md5::digest(data).into()
}

/// Lower-case hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn now() -> SystemTime {
    truncate_to_secs(SystemTime::now())
}

fn truncate_to_secs(t: SystemTime) -> SystemTime {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => UNIX_EPOCH + Duration::from_secs(d.as_secs()),
        Err(_) => t,
    }
}

/// Compares ETags ignoring surrounding quotes (S3 accepts `If-Match` with or without them).
fn etag_matches(want: &str, have: &str) -> bool {
    let want = want.trim();
    want == "*" || want.trim_matches('"') == have.trim_matches('"')
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > 1024 {
        return Err(StoreError::InvalidRequest(format!(
            "object keys must be 1 to 1024 bytes long, got {}",
            key.len()
        )));
    }
    Ok(())
}

/// Where a listing resumes: after a key, or after every key under a common prefix.
enum Resume {
    AfterKey(String),
    AfterPrefix(String),
}

fn encode_token(resume: &Resume) -> String {
    let (tag, s) = match resume {
        Resume::AfterKey(k) => ('k', k),
        Resume::AfterPrefix(p) => ('p', p),
    };
    format!("mem1{tag}{}", hex(s.as_bytes()))
}

fn decode_token(token: &str) -> Result<Resume> {
    let bad = || StoreError::InvalidRequest(format!("invalid continuation token {token:?}"));
    let rest = token.strip_prefix("mem1").ok_or_else(bad)?;
    let (tag, hex) = rest.split_at_checked(1).ok_or_else(bad)?;
    if hex.len() % 2 != 0 {
        return Err(bad());
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(bad)?;
    let s = String::from_utf8(bytes).map_err(|_| bad())?;
    match tag {
        "k" => Ok(Resume::AfterKey(s)),
        "p" => Ok(Resume::AfterPrefix(s)),
        _ => Err(bad()),
    }
}

fn list_objects(objects: &BTreeMap<String, Object>, req: &ListRequest<'_>) -> Result<ListPage> {
    let prefix = req.prefix;
    let delimiter = req.delimiter.filter(|d| !d.is_empty());
    let max = req.max_keys.unwrap_or(MAX_LIST_KEYS).min(MAX_LIST_KEYS) as usize;
    let resume = match &req.continuation {
        Some(token) => Some(decode_token(token)?),
        None => req.start_after.map(|s| Resume::AfterKey(s.to_owned())),
    };
    let mut page = ListPage::default();
    if max == 0 {
        return Ok(page);
    }
    let (lower, mut skip_prefix) = match &resume {
        Some(Resume::AfterKey(k)) => (Bound::Excluded(k.as_str()), None),
        Some(Resume::AfterPrefix(p)) => (Bound::Excluded(p.as_str()), Some(p.clone())),
        None => (Bound::Included(prefix), None),
    };
    let mut entries = 0usize;
    let mut last: Option<Resume> = None;
    for (key, object) in objects.range::<str, _>((lower, Bound::Unbounded)) {
        if key.as_str() < prefix {
            continue;
        }
        if !key.starts_with(prefix) {
            break; // keys under a prefix are contiguous; we are past them
        }
        if skip_prefix
            .as_ref()
            .is_some_and(|p| key.starts_with(p.as_str()))
        {
            continue;
        }
        if entries == max {
            page.next_token = last.as_ref().map(encode_token);
            break;
        }
        let common = delimiter.and_then(|d| {
            key[prefix.len()..]
                .find(d)
                .map(|i| &key[..prefix.len() + i + d.len()])
        });
        match common {
            Some(cp) => {
                page.common_prefixes.push(cp.to_owned());
                skip_prefix = Some(cp.to_owned());
                last = Some(Resume::AfterPrefix(cp.to_owned()));
            }
            None => {
                page.objects.push(object.info(key));
                last = Some(Resume::AfterKey(key.clone()));
            }
        }
        entries += 1;
    }
    Ok(page)
}

#[async_trait]
impl ObjectStore for MemoryStore {
    async fn head_bucket(&self, bucket: &str) -> Result<()> {
        self.with_bucket(Op::HeadBucket, bucket, |_, _, _| Ok(()))
    }

    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
        let page_max = self.lock().list_page_max;
        let max_keys = Some(req.max_keys.unwrap_or(MAX_LIST_KEYS).min(page_max));
        let req = ListRequest { max_keys, ..req };
        self.with_bucket(Op::List, bucket, |b, _, _| list_objects(&b.objects, &req))
    }

    async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
        self.with_bucket(Op::Head, bucket, |b, _, _| {
            b.objects
                .get(key)
                .map(|o| o.info(key))
                .ok_or_else(|| StoreError::NotFound(key.to_owned()))
        })
    }

    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes> {
        self.get_checked(bucket, key, range, |object| match if_match {
            Some(want) if !etag_matches(want, &object.etag) => Err(StoreError::PreconditionFailed(
                format!("{key}: If-Match {want} but the ETag is {}", object.etag),
            )),
            _ => Ok(()),
        })
    }

    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<SystemTime>,
        size: u64,
    ) -> Result<Bytes> {
        self.get_checked(bucket, key, range, |object| {
            let now = (object.last_modified, object.data.len() as u64);
            if last_modified.is_some_and(|t| t != now.0) || size != now.1 {
                return Err(StoreError::PreconditionFailed(format!(
                    "{key}: pinned at {last_modified:?} and {size} bytes, now {:?} and {} bytes",
                    now.0, now.1
                )));
            }
            Ok(())
        })
    }

    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        self.put_object(bucket, key, body, false)
    }

    async fn put_if_absent(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        self.put_object(bucket, key, body, true)
    }

    async fn create_multipart(&self, bucket: &str, key: &str) -> Result<String> {
        let mut guard = self.lock();
        let state = &mut *guard;
        state.stats.count(Op::CreateMultipart);
        let b = state
            .buckets
            .get_mut(bucket)
            .ok_or_else(|| StoreError::NoSuchBucket(bucket.to_owned()))?;
        check_key(key)?;
        let id = format!("mem-upload-{:016x}", state.next_upload);
        state.next_upload += 1;
        b.uploads.insert(
            id.clone(),
            Upload {
                key: key.to_owned(),
                parts: BTreeMap::new(),
            },
        );
        Ok(id)
    }

    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<CompletedPart> {
        self.with_bucket(Op::UploadPart, bucket, |b, stats, _| {
            if !(1..=MAX_PART_NUMBER).contains(&part_number) {
                return Err(StoreError::InvalidRequest(format!(
                    "part number {part_number} is not in 1..={MAX_PART_NUMBER}"
                )));
            }
            let upload = find_upload(b, key, upload_id)?;
            stats.put_bytes += body.len() as u64;
            let etag = format!("\"{}\"", hex(&md5_digest(&body)));
            upload.parts.insert(part_number, (body, etag.clone()));
            Ok(CompletedPart { part_number, etag })
        })
    }

    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        self.complete(bucket, key, upload_id, parts, false)
    }

    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        self.complete(bucket, key, upload_id, parts, true)
    }

    async fn abort_multipart(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        self.with_bucket(Op::AbortMultipart, bucket, |b, _, _| {
            find_upload(b, key, upload_id)?;
            b.uploads.remove(upload_id);
            Ok(())
        })
    }

    async fn list_uploads(&self, bucket: &str, req: UploadsRequest<'_>) -> Result<UploadsPage> {
        self.with_bucket(Op::ListUploads, bucket, |b, _, _| {
            Ok(list_uploads(&b.uploads, &req))
        })
    }

    async fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        self.with_bucket(Op::Delete, bucket, |b, _, _| {
            b.objects.remove(key);
            Ok(())
        })
    }

    async fn delete_many(&self, bucket: &str, keys: &[String]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        self.with_bucket(Op::DeleteMany, bucket, |b, _, _| {
            if keys.len() > MAX_DELETE_BATCH {
                return Err(StoreError::InvalidRequest(format!(
                    "{} keys in one DeleteObjects, at most {MAX_DELETE_BATCH} allowed",
                    keys.len()
                )));
            }
            for key in keys {
                b.objects.remove(key);
            }
            Ok(())
        })
    }
}

/// A page of the uploads in progress under `req.prefix`, after `req.after`. Upload ids are
/// numbered in the order the uploads were started, so (key, id) order is S3's.
fn list_uploads(uploads: &HashMap<String, Upload>, req: &UploadsRequest<'_>) -> UploadsPage {
    let max = req.max_uploads.unwrap_or(MAX_LIST_KEYS).min(MAX_LIST_KEYS) as usize;
    let after = |key: &str, id: &str| match &req.after {
        None => true,
        Some(UploadsMarker {
            key: mk,
            upload_id: Some(mid),
        }) => (key, id) > (mk.as_str(), mid.as_str()),
        Some(UploadsMarker {
            key: mk,
            upload_id: None,
        }) => key > mk.as_str(),
    };
    let mut found: Vec<crate::Upload> = uploads
        .iter()
        .filter(|(id, u)| u.key.starts_with(req.prefix) && after(&u.key, id))
        .map(|(id, u)| crate::Upload {
            key: u.key.clone(),
            upload_id: id.clone(),
        })
        .collect();
    found.sort();
    let next = (found.len() > max && max > 0).then(|| {
        let last = &found[max - 1];
        UploadsMarker {
            key: last.key.clone(),
            upload_id: Some(last.upload_id.clone()),
        }
    });
    found.truncate(max);
    UploadsPage {
        uploads: found,
        next,
    }
}

fn find_upload<'a>(b: &'a mut Bucket, key: &str, upload_id: &str) -> Result<&'a mut Upload> {
    b.uploads
        .get_mut(upload_id)
        .filter(|u| u.key == key)
        .ok_or_else(|| StoreError::NotFound(format!("no such upload {upload_id} for {key}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;

    const B: &str = "bucket";

    fn store() -> MemoryStore {
        let s = MemoryStore::new();
        s.create_bucket(B);
        s
    }

    fn req(prefix: &str) -> ListRequest<'_> {
        ListRequest {
            prefix,
            ..Default::default()
        }
    }

    fn keys(page: &ListPage) -> Vec<&str> {
        page.objects.iter().map(|o| o.key.as_str()).collect()
    }

    /// Lists every page and returns (keys, common prefixes, pages).
    async fn list_all(
        s: &MemoryStore,
        prefix: &str,
        delimiter: Option<&str>,
        max_keys: Option<u32>,
    ) -> (Vec<String>, Vec<String>, usize) {
        let req = ListRequest {
            prefix,
            delimiter,
            continuation: None,
            max_keys,
            start_after: None,
        };
        crate::list_pages(s, B, req)
            .try_fold(
                (vec![], vec![], 0),
                |(mut ks, mut cps, pages), page| async move {
                    ks.extend(page.objects.into_iter().map(|o| o.key));
                    cps.extend(page.common_prefixes);
                    Ok((ks, cps, pages + 1))
                },
            )
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn unknown_bucket_is_no_such_bucket() {
        let s = store();
        let e = s.head_bucket("nope").await.unwrap_err();
        assert!(
            matches!(e, StoreError::NoSuchBucket(ref b) if b == "nope"),
            "{e:?}"
        );
        assert!(matches!(
            s.list("nope", req("")).await,
            Err(StoreError::NoSuchBucket(_))
        ));
        assert!(matches!(
            s.head("nope", "k").await,
            Err(StoreError::NoSuchBucket(_))
        ));
        assert!(matches!(
            s.get_range("nope", "k", 0..1, None).await,
            Err(StoreError::NoSuchBucket(_))
        ));
        assert!(matches!(
            s.put("nope", "k", Bytes::new()).await,
            Err(StoreError::NoSuchBucket(_))
        ));
        assert!(matches!(
            s.delete("nope", "k").await,
            Err(StoreError::NoSuchBucket(_))
        ));
        assert!(matches!(
            s.create_multipart("nope", "k").await,
            Err(StoreError::NoSuchBucket(_))
        ));
        s.head_bucket(B).await.unwrap();
    }

    #[tokio::test]
    async fn list_is_in_byte_order() {
        let s = store();
        for k in ["b", "a", "B", "a/b", "a-b", "é", "z", "a0", "~"] {
            s.insert(B, k, "x");
        }
        let page = s.list(B, req("")).await.unwrap();
        // '-' (0x2d) < '/' (0x2f) < '0' (0x30) < 'B' < 'a' < ... < '~' < 'é' (0xc3 0xa9)
        assert_eq!(
            keys(&page),
            ["B", "a", "a-b", "a/b", "a0", "b", "z", "~", "é"]
        );
        assert_eq!(page.next_token, None);
        assert!(page.common_prefixes.is_empty());
    }

    #[tokio::test]
    async fn list_prefix() {
        let s = store();
        for k in ["a", "ab/1", "ab/2", "abc", "b/1", "a/x"] {
            s.insert(B, k, "x");
        }
        assert_eq!(
            keys(&s.list(B, req("ab")).await.unwrap()),
            ["ab/1", "ab/2", "abc"]
        );
        assert_eq!(
            keys(&s.list(B, req("ab/")).await.unwrap()),
            ["ab/1", "ab/2"]
        );
        assert!(s.list(B, req("zz")).await.unwrap().objects.is_empty());
    }

    #[tokio::test]
    async fn list_delimiter_groups_common_prefixes() {
        let s = store();
        for k in [
            "data/a.txt",
            "data/sub/1",
            "data/sub/2",
            "data/sub/deeper/3",
            "data/sub2/x",
            "data/z.txt",
            "data/",
            "other/1",
            "top",
        ] {
            s.insert(B, k, "x");
        }
        let page = s
            .list(
                B,
                ListRequest {
                    prefix: "data/",
                    delimiter: Some("/"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        // "data/" itself is a key equal to the prefix: it is listed as an object.
        assert_eq!(keys(&page), ["data/", "data/a.txt", "data/z.txt"]);
        assert_eq!(page.common_prefixes, ["data/sub/", "data/sub2/"]);

        let root = s
            .list(
                B,
                ListRequest {
                    prefix: "",
                    delimiter: Some("/"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(keys(&root), ["top"]);
        assert_eq!(root.common_prefixes, ["data/", "other/"]);
    }

    #[tokio::test]
    async fn list_multichar_delimiter_and_empty_delimiter() {
        let s = store();
        for k in ["a::b::c", "a::d", "a:e"] {
            s.insert(B, k, "x");
        }
        let page = s
            .list(
                B,
                ListRequest {
                    prefix: "",
                    delimiter: Some("::"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(keys(&page), ["a:e"]);
        assert_eq!(page.common_prefixes, ["a::"]);
        let page = s
            .list(
                B,
                ListRequest {
                    prefix: "",
                    delimiter: Some(""),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.objects.len(), 3, "an empty delimiter is no delimiter");
    }

    #[tokio::test]
    async fn list_pagination_with_continuation_tokens() {
        let s = store();
        let all: Vec<String> = (0..25).map(|i| format!("k/{i:03}")).collect();
        for k in &all {
            s.insert(B, k, "x");
        }
        let page = s
            .list(
                B,
                ListRequest {
                    prefix: "k/",
                    max_keys: Some(10),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.objects.len(), 10);
        assert!(page.next_token.is_some());
        let (ks, cps, pages) = list_all(&s, "k/", None, Some(10)).await;
        assert_eq!(ks, all);
        assert!(cps.is_empty());
        assert_eq!(pages, 3);
        // An exact multiple of the page size must not leave an empty trailing page.
        let (ks, _, pages) = list_all(&s, "k/", None, Some(5)).await;
        assert_eq!((ks.len(), pages), (25, 5));
    }

    #[tokio::test]
    async fn list_pagination_counts_common_prefixes() {
        let s = store();
        for d in 0..5 {
            for f in 0..3 {
                s.insert(B, &format!("d{d}/f{f}"), "x");
            }
            s.insert(B, &format!("f{d}"), "x");
        }
        let (ks, cps, pages) = list_all(&s, "", Some("/"), Some(2)).await;
        assert_eq!(cps, ["d0/", "d1/", "d2/", "d3/", "d4/"]);
        assert_eq!(ks, ["f0", "f1", "f2", "f3", "f4"]);
        assert_eq!(pages, 5);
        // A page boundary right after a common prefix must not repeat it.
        let (_, cps, _) = list_all(&s, "", Some("/"), Some(1)).await;
        assert_eq!(cps.len(), 5);
    }

    #[tokio::test]
    async fn list_max_keys_is_clipped_to_1000_and_zero_is_empty() {
        let s = store();
        for i in 0..1005 {
            s.insert(B, &format!("{i:05}"), "");
        }
        let page = s.list(B, req("")).await.unwrap();
        assert_eq!(page.objects.len(), 1000);
        assert!(page.next_token.is_some());
        let page = s
            .list(
                B,
                ListRequest {
                    max_keys: Some(5000),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.objects.len(), 1000);
        let page = s
            .list(
                B,
                ListRequest {
                    max_keys: Some(0),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(page.objects.is_empty() && page.next_token.is_none());
    }

    #[tokio::test]
    async fn list_start_after() {
        let s = store();
        for k in ["a/1", "a/2", "b", "c"] {
            s.insert(B, k, "x");
        }
        let page = s
            .list(
                B,
                ListRequest {
                    start_after: Some("a/2"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(keys(&page), ["b", "c"]);
        // start_after before the prefix: the prefix wins.
        let page = s
            .list(
                B,
                ListRequest {
                    prefix: "b",
                    start_after: Some("a"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(keys(&page), ["b"]);
        // start_after inside a common prefix still reports the prefix (later keys are in it).
        let page = s
            .list(
                B,
                ListRequest {
                    delimiter: Some("/"),
                    start_after: Some("a/1"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.common_prefixes, ["a/"]);
        assert_eq!(keys(&page), ["b", "c"]);
        // A continuation token overrides start_after.
        let first = s
            .list(
                B,
                ListRequest {
                    max_keys: Some(1),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let page = s
            .list(
                B,
                ListRequest {
                    continuation: first.next_token,
                    start_after: Some("b"),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(keys(&page), ["a/2", "b", "c"]);
    }

    #[tokio::test]
    async fn list_bad_token_is_invalid_request() {
        let s = store();
        for t in ["garbage", "mem1k0", "mem1kzz", "mem1x00"] {
            let e = s
                .list(
                    B,
                    ListRequest {
                        continuation: Some(t.into()),
                        ..Default::default()
                    },
                )
                .await
                .unwrap_err();
            assert!(matches!(e, StoreError::InvalidRequest(_)), "{t}: {e:?}");
        }
    }

    #[tokio::test]
    async fn list_survives_deletes_between_pages() {
        let s = store();
        for i in 0..10 {
            s.insert(B, &format!("{i}"), "x");
        }
        let first = s
            .list(
                B,
                ListRequest {
                    max_keys: Some(4),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let listed: Vec<String> = first.objects.iter().map(|o| o.key.clone()).collect();
        s.delete_many(B, &listed).await.unwrap();
        let second = s
            .list(
                B,
                ListRequest {
                    continuation: first.next_token,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(keys(&second), ["4", "5", "6", "7", "8", "9"]);
    }

    #[tokio::test]
    async fn head_and_etags() {
        let s = store();
        let put = s.put(B, "k", Bytes::from_static(b"abc")).await.unwrap();
        // S3's ETag of a single PUT is the quoted MD5 of the content.
        assert_eq!(
            put.etag.as_deref(),
            Some("\"900150983cd24fb0d6963f7d28e17f72\"")
        );
        let info = s.head(B, "k").await.unwrap();
        assert_eq!(info.key, "k");
        assert_eq!(info.size, 3);
        assert_eq!(info.etag, put.etag);
        let lm = info.last_modified.unwrap();
        assert_eq!(
            lm.duration_since(UNIX_EPOCH).unwrap().subsec_nanos(),
            0,
            "whole seconds"
        );
        assert!(lm <= SystemTime::now());
        let listed = s.list(B, req("")).await.unwrap();
        assert_eq!(listed.objects, std::slice::from_ref(&info));

        let put2 = s.put(B, "k", Bytes::from_static(b"abd")).await.unwrap();
        assert_ne!(put2.etag, put.etag, "new content, new ETag");
        let same = s.put(B, "k2", Bytes::from_static(b"abd")).await.unwrap();
        assert_eq!(same.etag, put2.etag, "ETags are content hashes");

        assert!(matches!(
            s.head(B, "missing").await,
            Err(StoreError::NotFound(k)) if k == "missing"
        ));
        assert!(matches!(
            s.head(B, "k/").await,
            Err(StoreError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn insert_with_mtime() {
        let s = MemoryStore::new();
        let t = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let etag = s.insert_with_mtime("new", "k", "v", t);
        let info = s.head("new", "k").await.unwrap();
        assert_eq!(info.etag.as_deref(), Some(etag.as_str()));
        assert_eq!(
            info.last_modified,
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(s.get_object("new", "k").unwrap(), "v");
        assert_eq!(s.keys("new"), ["k"]);
    }

    #[tokio::test]
    async fn get_range_clips_and_refuses_out_of_range() {
        let s = store();
        s.insert(B, "k", "0123456789");
        assert_eq!(
            s.get_range(B, "k", 0..10, None).await.unwrap(),
            "0123456789"
        );
        assert_eq!(s.get_range(B, "k", 2..5, None).await.unwrap(), "234");
        assert_eq!(s.get_range(B, "k", 8..100, None).await.unwrap(), "89");
        assert_eq!(s.get_range(B, "k", 9..10, None).await.unwrap(), "9");
        for r in [10..11, 11..20] {
            let e = s.get_range(B, "k", r.clone(), None).await.unwrap_err();
            assert!(matches!(e, StoreError::InvalidRequest(_)), "{r:?}: {e:?}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        for r in [3..3, 5..2] {
            let e = s.get_range(B, "k", r.clone(), None).await.unwrap_err();
            assert!(matches!(e, StoreError::InvalidRequest(_)), "{r:?}: {e:?}");
        }
        s.insert(B, "empty", "");
        assert!(matches!(
            s.get_range(B, "empty", 0..1, None).await,
            Err(StoreError::InvalidRequest(_))
        ));
        assert!(matches!(
            s.get_range(B, "missing", 0..1, None).await,
            Err(StoreError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn get_range_if_match() {
        let s = store();
        let etag = s.insert(B, "k", "hello");
        assert_eq!(
            s.get_range(B, "k", 0..5, Some(&etag)).await.unwrap(),
            "hello"
        );
        // Unquoted is accepted too.
        let bare = etag.trim_matches('"').to_owned();
        assert_eq!(s.get_range(B, "k", 0..2, Some(&bare)).await.unwrap(), "he");
        s.insert(B, "k", "HELLO");
        let e = s.get_range(B, "k", 0..5, Some(&etag)).await.unwrap_err();
        assert!(matches!(e, StoreError::PreconditionFailed(_)), "{e:?}");
        // The precondition is evaluated before the range.
        let e = s.get_range(B, "k", 50..60, Some(&etag)).await.unwrap_err();
        assert!(matches!(e, StoreError::PreconditionFailed(_)), "{e:?}");
    }

    #[tokio::test]
    async fn multipart_assembles_parts_in_order() {
        let s = store();
        s.set_min_part_size(4);
        let id = s.create_multipart(B, "big").await.unwrap();
        assert_eq!(s.pending_uploads(B), 1);
        // Upload out of order, and replace part 2.
        let p3 = s.upload_part(B, "big", &id, 3, "cc".into()).await.unwrap();
        let _old = s
            .upload_part(B, "big", &id, 2, "XXXX".into())
            .await
            .unwrap();
        let p2 = s
            .upload_part(B, "big", &id, 2, "bbbb".into())
            .await
            .unwrap();
        let p1 = s
            .upload_part(B, "big", &id, 1, "aaaa".into())
            .await
            .unwrap();
        assert!(s.head(B, "big").await.is_err(), "invisible before complete");
        let done = s
            .complete_multipart(B, "big", &id, vec![p1, p2, p3])
            .await
            .unwrap();
        assert_eq!(s.get_object(B, "big").unwrap(), "aaaabbbbcc");
        assert_eq!(s.pending_uploads(B), 0);
        // S3: md5 of the concatenated binary part digests, then "-<count>".
        let mut digests = Vec::new();
        for p in ["aaaa", "bbbb", "cc"] {
            digests.extend_from_slice(&md5_digest(p.as_bytes()));
        }
        let want = format!("\"{}-3\"", hex(&md5_digest(&digests)));
        assert_eq!(done.etag.as_deref(), Some(want.as_str()));
        assert_eq!(s.head(B, "big").await.unwrap().etag, done.etag);
        // The upload is gone after completing.
        assert!(matches!(
            s.upload_part(B, "big", &id, 4, "x".into()).await,
            Err(StoreError::NotFound(_))
        ));
    }

    #[tokio::test]
    async fn multipart_may_skip_uploaded_parts() {
        let s = store();
        s.set_min_part_size(1);
        let id = s.create_multipart(B, "k").await.unwrap();
        let p1 = s.upload_part(B, "k", &id, 1, "a".into()).await.unwrap();
        let _p2 = s.upload_part(B, "k", &id, 2, "b".into()).await.unwrap();
        let p5 = s.upload_part(B, "k", &id, 5, "c".into()).await.unwrap();
        let done = s
            .complete_multipart(B, "k", &id, vec![p1, p5])
            .await
            .unwrap();
        assert!(done.etag.unwrap().ends_with("-2\""));
        assert_eq!(s.get_object(B, "k").unwrap(), "ac");
    }

    #[tokio::test]
    async fn multipart_errors() {
        let s = store();
        let id = s.create_multipart(B, "k").await.unwrap();
        for n in [0, -1, MAX_PART_NUMBER + 1] {
            assert!(matches!(
                s.upload_part(B, "k", &id, n, "x".into()).await,
                Err(StoreError::InvalidRequest(_))
            ));
        }
        assert!(matches!(
            s.upload_part(B, "k", "nope", 1, "x".into()).await,
            Err(StoreError::NotFound(_))
        ));
        assert!(matches!(
            s.upload_part(B, "other-key", &id, 1, "x".into()).await,
            Err(StoreError::NotFound(_))
        ));
        let p1 = s.upload_part(B, "k", &id, 1, "small".into()).await.unwrap();
        let p2 = s.upload_part(B, "k", &id, 2, "last".into()).await.unwrap();
        let invalid = |r: Result<PutResult>| matches!(r, Err(StoreError::InvalidRequest(_)));
        assert!(invalid(s.complete_multipart(B, "k", &id, vec![]).await));
        // Out of order.
        assert!(invalid(
            s.complete_multipart(B, "k", &id, vec![p2.clone(), p1.clone()])
                .await
        ));
        // Wrong ETag.
        let mut wrong = p1.clone();
        wrong.etag = "\"00\"".into();
        assert!(invalid(
            s.complete_multipart(B, "k", &id, vec![wrong, p2.clone()])
                .await
        ));
        // Non-last part under 5 MiB.
        assert!(invalid(
            s.complete_multipart(B, "k", &id, vec![p1.clone(), p2.clone()])
                .await
        ));
        // A single small part is fine (it is the last).
        s.complete_multipart(B, "k", &id, vec![p2]).await.unwrap();
        assert_eq!(s.get_object(B, "k").unwrap(), "last");
    }

    #[tokio::test]
    async fn multipart_with_real_part_sizes() {
        let s = store();
        let id = s.create_multipart(B, "k").await.unwrap();
        let big = Bytes::from(vec![7u8; MIN_PART_SIZE as usize]);
        let p1 = s.upload_part(B, "k", &id, 1, big.clone()).await.unwrap();
        let p2 = s.upload_part(B, "k", &id, 2, "tail".into()).await.unwrap();
        s.complete_multipart(B, "k", &id, vec![p1, p2])
            .await
            .unwrap();
        assert_eq!(s.head(B, "k").await.unwrap().size, MIN_PART_SIZE + 4);
    }

    #[tokio::test]
    async fn multipart_abort() {
        let s = store();
        let id = s.create_multipart(B, "k").await.unwrap();
        s.upload_part(B, "k", &id, 1, "x".into()).await.unwrap();
        s.abort_multipart(B, "k", &id).await.unwrap();
        assert_eq!(s.pending_uploads(B), 0);
        assert!(s.head(B, "k").await.is_err());
        assert!(matches!(
            s.abort_multipart(B, "k", &id).await,
            Err(StoreError::NotFound(_))
        ));
        let id2 = s.create_multipart(B, "k").await.unwrap();
        assert_ne!(id, id2, "upload ids are unique");
    }

    #[tokio::test]
    async fn delete_and_delete_many() {
        let s = store();
        for k in ["a", "b", "c"] {
            s.insert(B, k, "x");
        }
        s.delete(B, "a").await.unwrap();
        s.delete(B, "a").await.unwrap(); // missing is fine
        assert_eq!(s.keys(B), ["b", "c"]);
        s.delete_many(B, &["b".into(), "zz".into()]).await.unwrap();
        assert_eq!(s.keys(B), ["c"]);
        s.delete_many(B, &[]).await.unwrap();
        let too_many: Vec<String> = (0..1001).map(|i| i.to_string()).collect();
        assert!(matches!(
            s.delete_many(B, &too_many).await,
            Err(StoreError::InvalidRequest(_))
        ));
    }

    #[tokio::test]
    async fn put_rejects_bad_keys() {
        let s = store();
        assert!(matches!(
            s.put(B, "", Bytes::new()).await,
            Err(StoreError::InvalidRequest(_))
        ));
        assert!(matches!(
            s.put(B, &"x".repeat(1025), Bytes::new()).await,
            Err(StoreError::InvalidRequest(_))
        ));
        s.put(B, &"x".repeat(1024), Bytes::new()).await.unwrap();
    }

    #[tokio::test]
    async fn stats_count_requests_and_bytes() {
        let s = store();
        s.insert(B, "k", "0123456789"); // not counted
        assert_eq!(s.stats(), StoreStats::default());
        s.get_range(B, "k", 0..4, None).await.unwrap();
        s.get_range(B, "k", 8..100, None).await.unwrap();
        let _ = s.get_range(B, "k", 50..60, None).await; // counted, no bytes
        s.head(B, "k").await.unwrap();
        let _ = s.head(B, "nope").await;
        s.list(B, req("")).await.unwrap();
        s.put(B, "p", "abc".into()).await.unwrap();
        s.delete(B, "p").await.unwrap();
        s.delete_many(B, &["k".into()]).await.unwrap();
        let st = s.stats();
        assert_eq!(st.get, 3);
        assert_eq!(st.get_bytes, 6);
        assert_eq!(st.head, 2);
        assert_eq!(st.list, 1);
        assert_eq!(st.put, 1);
        assert_eq!(st.put_bytes, 3);
        assert_eq!(st.delete, 1);
        assert_eq!(st.delete_many, 1);
        assert_eq!(st.requests(Op::Get), 3);
        assert_eq!(st.total_requests(), 9);
        s.reset_stats();
        assert_eq!(s.stats().total_requests(), 0);
    }

    #[tokio::test]
    async fn clones_share_state() {
        let s = store();
        let t = s.clone();
        t.insert(B, "k", "v");
        assert_eq!(s.get_object(B, "k").unwrap(), "v");
        assert!(format!("{s:?}").contains("bucket"));
    }

    #[tokio::test]
    async fn the_access_check_is_one_list_of_the_prefix() {
        let s = store();
        s.insert(B, "vol1/a", "x");
        crate::check_prefix_access(&s, B, "vol1/").await.unwrap();
        // An empty prefix (a volume of the whole bucket) is a LIST too.
        crate::check_prefix_access(&s, B, "").await.unwrap();
        assert_eq!((s.stats().list, s.stats().head), (2, 0));
        assert!(matches!(
            crate::check_prefix_access(&s, "no-such-bucket", "vol1/").await,
            Err(StoreError::NoSuchBucket(_))
        ));
    }

    #[tokio::test]
    async fn list_uploads_by_key_then_start_in_pages() {
        let s = store();
        let mut started = Vec::new();
        for key in ["vol1/b", "vol1/a", "vol10/x", "vol1/b", "vol1", "vol0/y"] {
            started.push((key, s.create_multipart(B, key).await.unwrap()));
        }
        let under = |prefix: &str| -> Vec<(String, String)> {
            let mut want: Vec<_> = started
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(k, id)| (k.to_string(), id.clone()))
                .collect();
            want.sort();
            want
        };
        let pairs = |page: &crate::UploadsPage| -> Vec<(String, String)> {
            page.uploads
                .iter()
                .map(|u| (u.key.clone(), u.upload_id.clone()))
                .collect()
        };
        // One page: by key, and the two uploads of vol1/b in the order they were started.
        let all = s
            .list_uploads(B, crate::UploadsRequest::default())
            .await
            .unwrap();
        assert_eq!(pairs(&all), under(""));
        assert_eq!(all.next, None);
        assert_eq!(s.uploads(B), under(""));
        let b_ids: Vec<_> = started.iter().filter(|(k, _)| *k == "vol1/b").collect();
        assert!(b_ids[0].1 < b_ids[1].1, "{b_ids:?}");
        // Pages of two under `vol1/`: the markers carry the key and the upload id, so the two
        // uploads of one key may fall on two pages.
        let mut got = Vec::new();
        let mut after = None;
        let mut pages = 0;
        loop {
            let req = crate::UploadsRequest {
                prefix: "vol1/",
                after: after.take(),
                max_uploads: Some(2),
            };
            let page = s.list_uploads(B, req).await.unwrap();
            pages += 1;
            assert!(page.uploads.len() <= 2);
            got.extend(pairs(&page));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(got, under("vol1/"));
        assert_eq!(pages, 2);
        // A marker without an upload id starts after every upload of its key.
        let req = crate::UploadsRequest {
            prefix: "vol1",
            after: Some(crate::UploadsMarker {
                key: "vol1/a".into(),
                upload_id: None,
            }),
            max_uploads: None,
        };
        let page = s.list_uploads(B, req).await.unwrap();
        let keys: Vec<_> = page.uploads.iter().map(|u| u.key.as_str()).collect();
        assert_eq!(keys, ["vol1/b", "vol1/b", "vol10/x"]);
        // Completed and aborted uploads are no longer listed.
        s.abort_multipart(B, "vol0/y", &started[5].1).await.unwrap();
        let p = s.upload_part(B, "vol1", &started[4].1, 1, "x".into()).await;
        s.complete_multipart(B, "vol1", &started[4].1, vec![p.unwrap()])
            .await
            .unwrap();
        let left = s
            .list_uploads(B, crate::UploadsRequest::default())
            .await
            .unwrap();
        assert_eq!(
            pairs(&left),
            under("vol1/")
                .into_iter()
                .chain(under("vol10"))
                .collect::<Vec<_>>()
        );
        assert_eq!(s.stats().list_uploads, 5);
        assert!(matches!(
            s.list_uploads("nope", crate::UploadsRequest::default())
                .await,
            Err(StoreError::NoSuchBucket(_))
        ));
    }

    #[tokio::test]
    async fn delete_prefix_only_touches_the_prefix() {
        let s = store();
        for i in 0..2500 {
            s.insert(B, &format!("vol1/{i:05}"), "x");
        }
        s.insert(B, "vol10/keep", "x");
        s.insert(B, "vol1", "x"); // equal to the prefix without the slash
        s.insert(B, "vol0/keep", "x");
        let n = crate::delete_prefix(&s, B, "vol1/").await.unwrap();
        assert_eq!(n.objects, 2500);
        assert_eq!(n.uploads, 0);
        assert_eq!(s.keys(B), ["vol0/keep", "vol1", "vol10/keep"]);
        assert_eq!(s.stats().delete_many, 3, "batches of at most 1000");
        assert!(matches!(
            crate::delete_prefix(&s, B, "").await,
            Err(StoreError::InvalidRequest(_))
        ));
    }

    /// DeleteVolume of a `deletePolicy: delete` volume left its multipart uploads in progress:
    /// S3 keeps (and bills) their parts until they are aborted, and nothing would ever complete
    /// them once the volume is gone. Now every upload under the prefix is aborted, over more than
    /// one page of ListMultipartUploads, and none outside it.
    #[tokio::test]
    async fn delete_prefix_aborts_the_prefix_uploads_and_no_other() {
        let s = store();
        s.insert(B, "vol1/done", "x");
        for i in 0..1001 {
            let key = format!("vol1/big{:02}", i % 7);
            let id = s.create_multipart(B, &key).await.unwrap();
            s.upload_part(B, &key, &id, 1, "part".into()).await.unwrap();
        }
        let mut kept = Vec::new();
        for key in ["vol10/x", "vol1", "vol0/y"] {
            kept.push((key.to_owned(), s.create_multipart(B, key).await.unwrap()));
        }
        kept.sort();
        let n = crate::delete_prefix(&s, B, "vol1/").await.unwrap();
        assert_eq!(
            n,
            crate::PrefixDeleted {
                objects: 1,
                uploads: 1001
            }
        );
        assert_eq!(s.uploads(B), kept);
        assert_eq!(
            s.stats().list_uploads,
            2,
            "a full page of 1000, then the one left"
        );
        assert_eq!(s.stats().abort_multipart, 1001);
        // Nothing left: a second pass aborts nothing.
        let again = crate::delete_prefix(&s, B, "vol1/").await.unwrap();
        assert_eq!(again, crate::PrefixDeleted::default());
        assert!(matches!(
            crate::abort_uploads(&s, B, "").await,
            Err(StoreError::InvalidRequest(_))
        ));
        assert_eq!(s.uploads(B), kept);
    }

    /// An upload that is gone when its abort arrives (completed or aborted meanwhile: S3's 404
    /// NoSuchUpload) is no error and not counted; any other failure of an abort is.
    #[tokio::test]
    async fn delete_prefix_passes_over_an_upload_gone_meanwhile() {
        let mem = store();
        for key in ["vol1/a", "vol1/b", "vol1/c"] {
            mem.create_multipart(B, key).await.unwrap();
        }
        let s = crate::FaultyStore::new(mem.clone(), 1);
        s.fail_next(
            Op::AbortMultipart,
            1,
            StoreError::NotFound("NoSuchUpload".into()),
        );
        let n = crate::delete_prefix(&s, B, "vol1/").await.unwrap();
        assert_eq!(
            n,
            crate::PrefixDeleted {
                objects: 0,
                uploads: 2
            }
        );
        assert_eq!(mem.uploads(B).len(), 1, "the one whose abort was lost");
        // A policy without the uploads' permissions: the objects go, and the refusal says so
        // and names what is missing.
        mem.insert(B, "vol1/obj", "x");
        s.fail_next(Op::AbortMultipart, 1, StoreError::AccessDenied("no".into()));
        match crate::delete_prefix(&s, B, "vol1/").await {
            Err(StoreError::AccessDenied(m)) => {
                assert!(m.contains("1 objects are deleted"), "{m}");
                assert!(m.contains("s3:ListBucketMultipartUploads"), "{m}");
                assert!(m.contains("s3:AbortMultipartUpload"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        assert!(
            mem.get_object(B, "vol1/obj").is_none(),
            "the objects go first"
        );
        assert_eq!(
            crate::delete_prefix(&s, B, "vol1/").await.unwrap().uploads,
            1
        );
        assert!(mem.uploads(B).is_empty());
    }
}
