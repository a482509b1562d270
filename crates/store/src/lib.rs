//! The object-store seam every other Ferry crate talks to, free of any S3 SDK.
//!
//! [`ObjectStore`] is the only way Ferry reaches S3. `ferry_s3::S3Store` (crate `ferry-s3`)
//! implements it with aws-sdk-s3, the only crate that names the SDK. With the `test-util` feature,
//! `memory::MemoryStore` keeps buckets in memory for tests and `faulty::FaultyStore` wraps any
//! store to inject failures; the binaries users run are built without them.

use std::fmt::Debug;
use std::ops::Range;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

#[cfg(any(test, feature = "test-util"))]
pub mod faulty;
pub mod listing;
#[cfg(any(test, feature = "test-util"))]
pub mod memory;

#[cfg(any(test, feature = "test-util"))]
pub use faulty::{FaultStats, FaultyStore};
pub use listing::{list_all, list_pages, ListAll, Listed};
#[cfg(any(test, feature = "test-util"))]
pub use memory::{MemoryStore, StoreStats};

/// One object as a LIST or HEAD response describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The full key, bucket-relative.
    pub key: String,
    pub size: u64,
    /// The ETag as the server sent it, quotes included. `None` where the server omitted it from a LIST.
    pub etag: Option<String>,
    pub last_modified: Option<SystemTime>,
}

/// What [`ObjectStore::head_readable`] found: the object, and whether its bytes were read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probed {
    pub info: ObjectInfo,
    /// `false`: the HEAD was answered, the GET refused (403).
    pub readable: bool,
}

impl Probed {
    pub fn read(info: ObjectInfo) -> Self {
        Probed {
            info,
            readable: true,
        }
    }

    pub fn not_read(info: ObjectInfo) -> Self {
        Probed {
            info,
            readable: false,
        }
    }
}

/// One page of a ListObjectsV2 response.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListPage {
    pub objects: Vec<ObjectInfo>,
    /// Common prefixes (with the trailing delimiter) when a delimiter was given.
    pub common_prefixes: Vec<String>,
    /// Continuation token for the next page, `None` on the last page.
    pub next_token: Option<String>,
}

/// What a LIST asks for.
#[derive(Debug, Clone, Default)]
pub struct ListRequest<'a> {
    pub prefix: &'a str,
    /// `Some("/")` for a directory-style listing; `None` lists every key under the prefix.
    pub delimiter: Option<&'a str>,
    pub continuation: Option<String>,
    /// Upper bound on keys + prefixes in the page (the server may return fewer); `None` = server default.
    pub max_keys: Option<u32>,
    /// List keys strictly after this one (ListObjectsV2 `StartAfter`).
    pub start_after: Option<&'a str>,
}

impl<'a> ListRequest<'a> {
    /// Every key under `prefix` (no delimiter), in pages as large as S3 makes them.
    pub fn keys_under(prefix: &'a str) -> Self {
        ListRequest {
            prefix,
            delimiter: None,
            continuation: None,
            max_keys: Some(MAX_LIST_KEYS),
            start_after: None,
        }
    }
}

/// A multipart upload in progress (started, neither completed nor aborted), as
/// ListMultipartUploads names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Upload {
    pub key: String,
    pub upload_id: String,
}

/// Where a ListMultipartUploads page starts: after this key (`key-marker`) and, with an upload id
/// (`upload-id-marker`), after that upload of the key; without one, after every upload of the key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct UploadsMarker {
    pub key: String,
    pub upload_id: Option<String>,
}

/// What a ListMultipartUploads asks for: the uploads whose keys start with `prefix`, in key order
/// (and, for one key, in the order they were started), after `after`.
#[derive(Debug, Clone, Default)]
pub struct UploadsRequest<'a> {
    pub prefix: &'a str,
    /// `None`: from the first upload; else the previous page's [`UploadsPage::next`].
    pub after: Option<UploadsMarker>,
    /// Upper bound on the uploads in the page (the server may return fewer); clipped to
    /// [`MAX_LIST_KEYS`]; `None` = the server's default (1000 on S3).
    pub max_uploads: Option<u32>,
}

/// One page of a ListMultipartUploads response.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UploadsPage {
    pub uploads: Vec<Upload>,
    /// Where the next page starts (`NextKeyMarker`, `NextUploadIdMarker`); `None` on the last page.
    pub next: Option<UploadsMarker>,
}

/// The version of an object that reads are pinned to, so that one handle never mixes two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version<'a> {
    /// By ETag: every GET carries `If-Match`.
    ETag(&'a str),
    /// The server sent no ETag: by `Last-Modified` and size ([`ObjectStore::get_range_unmodified`]).
    Unmodified {
        last_modified: Option<SystemTime>,
        size: u64,
    },
}

impl<'a> Version<'a> {
    /// The pin for what a HEAD or LIST said: the ETag when there is one.
    pub fn of(etag: Option<&'a str>, last_modified: Option<SystemTime>, size: u64) -> Self {
        match etag {
            Some(etag) => Version::ETag(etag),
            None => Version::Unmodified {
                last_modified,
                size,
            },
        }
    }
}

/// Bytes `range` of `version` of the object: [`ObjectStore::get_range`] with `If-Match`, or
/// [`ObjectStore::get_range_unmodified`].
pub async fn get_version(
    store: &dyn ObjectStore,
    bucket: &str,
    key: &str,
    range: Range<u64>,
    version: Version<'_>,
) -> Result<Bytes> {
    match version {
        Version::ETag(etag) => store.get_range(bucket, key, range, Some(etag)).await,
        Version::Unmodified {
            last_modified,
            size,
        } => {
            store
                .get_range_unmodified(bucket, key, range, last_modified, size)
                .await
        }
    }
}

/// The result of a completed upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutResult {
    pub etag: Option<String>,
}

/// A part of a multipart upload, as CompleteMultipartUpload needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedPart {
    pub part_number: i32,
    pub etag: String,
}

/// Every way a store call can fail. Callers map these to gRPC statuses or errnos in one place each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("no such key: {0}")]
    NotFound(String),
    #[error("no such bucket: {0}")]
    NoSuchBucket(String),
    #[error("access denied: {0}")]
    AccessDenied(String),
    #[error("precondition failed (object changed): {0}")]
    PreconditionFailed(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("throttled: {0}")]
    Throttled(String),
    #[error("transient error: {0}")]
    Transient(String),
    #[error("response body did not match: {0}")]
    Corrupt(String),
    /// Definitive: the identity provider refused (AccessDenied, an invalid or expired token, a pod
    /// not associated with a role) or no credentials are configured. Retrying will not help.
    #[error("credentials: {0}")]
    Credentials(String),
    /// Transient: no credentials could be had for now (the identity provider — STS, the EKS Pod
    /// Identity agent, IMDS — unreachable, timing out, throttling or failing). Nothing was sent
    /// to S3; a later request may work.
    #[error("credentials unavailable: {0}")]
    CredentialsUnavailable(String),
    #[error("{0}")]
    Other(String),
}

impl StoreError {
    /// Whether retrying the same request may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Throttled(_) | StoreError::Transient(_) | StoreError::Corrupt(_)
        )
    }

    /// The message every variant carries, to add context to it.
    pub fn message_mut(&mut self) -> &mut String {
        match self {
            StoreError::NotFound(m)
            | StoreError::NoSuchBucket(m)
            | StoreError::AccessDenied(m)
            | StoreError::PreconditionFailed(m)
            | StoreError::InvalidRequest(m)
            | StoreError::Throttled(m)
            | StoreError::Transient(m)
            | StoreError::Corrupt(m)
            | StoreError::Credentials(m)
            | StoreError::CredentialsUnavailable(m)
            | StoreError::Other(m) => m,
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An S3-like object store. Bucket names are passed per call: one client serves every bucket that
/// one set of credentials and one endpoint reach.
#[async_trait]
pub trait ObjectStore: Send + Sync + Debug + 'static {
    /// Succeeds when the bucket exists and these credentials may use it.
    async fn head_bucket(&self, bucket: &str) -> Result<()>;

    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage>;

    async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo>;

    /// [`Self::head`], and whether these credentials may read the object's bytes: S3 answers a
    /// HEAD to credentials whose GET it refuses (an SSE-KMS object without `kms:Decrypt` on its
    /// key, an archived object), so only a read shows that. This default reads the first byte of
    /// the version the HEAD saw (pinned to its ETag); an empty object has no bytes to show.
    async fn head_readable(&self, bucket: &str, key: &str) -> Result<Probed> {
        let info = self.head(bucket, key).await?;
        if info.size == 0 {
            return Ok(Probed::read(info));
        }
        match self
            .get_range(bucket, key, 0..1, info.etag.as_deref())
            .await
        {
            Ok(_) => Ok(Probed::read(info)),
            Err(StoreError::AccessDenied(_)) => Ok(Probed::not_read(info)),
            Err(e) => Err(e),
        }
    }

    /// Bytes `range` of the object; the returned length is checked against the range (clipped to the
    /// object's end). With `if_match`, the server must refuse (PreconditionFailed) if the ETag changed.
    ///
    /// As with S3, a range that starts at or past the object's end (which includes every range of
    /// an empty object) is refused with [`StoreError::InvalidRequest`] (HTTP 416 InvalidRange), and
    /// so is an empty range (`start >= end`), which an HTTP `Range` header cannot express.
    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes>;

    /// [`Self::get_range`] in pieces of `piece` bytes (the last may be shorter), each in a buffer
    /// of its own, from one request: a caller that keeps the pieces apart (the node cache's
    /// blocks) keeps no neighbour alive through a shared buffer, and pays one request, not one
    /// per piece. This default copies the pieces out of one [`Self::get_range`]; a store that
    /// reads a body as it arrives (S3) fills each piece directly, with no copy more.
    async fn get_range_pieces(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        piece: u64,
    ) -> Result<Vec<Bytes>> {
        let data = self.get_range(bucket, key, range, if_match).await?;
        Ok(split_copied(&data, piece))
    }

    /// Bytes `range` of the version of an object that the server sent without an ETag, known by
    /// its `Last-Modified` time (if the server sent one) and its size. Sent with
    /// `If-Unmodified-Since`, and the response must say the same `Last-Modified` and total size,
    /// else [`StoreError::PreconditionFailed`]: so reads pinned to such a version never return
    /// another version's bytes (short of an overwrite of the same size within the same second,
    /// which `Last-Modified`'s one-second resolution cannot tell). Otherwise as [`Self::get_range`].
    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<SystemTime>,
        size: u64,
    ) -> Result<Bytes>;

    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult>;

    /// [`ObjectStore::put`] only if no object has the key (`If-None-Match: *`): PreconditionFailed
    /// if one does. A server that ignores the header replaces it, as `put` does.
    async fn put_if_absent(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult>;

    /// Starts a multipart upload and returns its upload id.
    async fn create_multipart(&self, bucket: &str, key: &str) -> Result<String>;
    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<CompletedPart>;
    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult>;
    /// [`ObjectStore::complete_multipart`] only if no object has the key, as
    /// [`ObjectStore::put_if_absent`]. Refused, the upload stays (to complete or abort).
    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult>;
    async fn abort_multipart(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()>;

    /// One page of the multipart uploads in progress under `req.prefix` (ListMultipartUploads, no
    /// delimiter). No default: a wrapper that did not forward it would hide uploads.
    async fn list_uploads(&self, bucket: &str, req: UploadsRequest<'_>) -> Result<UploadsPage>;

    /// Deletes one key; deleting a missing key succeeds (S3 semantics).
    async fn delete(&self, bucket: &str, key: &str) -> Result<()>;

    /// Deletes up to [`MAX_DELETE_BATCH`] keys in one request; fails if any key could not be
    /// deleted. Missing keys count as deleted; an empty `keys` succeeds without a request.
    async fn delete_many(&self, bucket: &str, keys: &[String]) -> Result<()>;
}

/// What stays unescaped when a key goes into a URL path: RFC 3986's unreserved characters
/// (letters, digits, `-._~`) and `/`; everything else is percent-encoded with
/// `percent_encoding::utf8_percent_encode`. S3 request paths (`ferry_s3`'s GETs) and Ferry's mount
/// source (`ferry_fs::fs_name`) use it.
pub const PATH_KEEP: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

/// The most keys one DeleteObjects request (and so [`ObjectStore::delete_many`]) may carry.
pub const MAX_DELETE_BATCH: usize = 1000;

/// The most keys one ListObjectsV2 page holds; larger `max_keys` are clipped to it.
pub const MAX_LIST_KEYS: u32 = 1000;

/// The smallest size S3 accepts for every part of a multipart upload but the last.
pub const MIN_PART_SIZE: u64 = 5 * 1024 * 1024;

/// The highest part number of a multipart upload (part numbers start at 1).
pub const MAX_PART_NUMBER: i32 = 10_000;

/// One kind of store request: what `memory::StoreStats` counts and `faulty::FaultyStore` targets
/// (with the `test-util` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    HeadBucket,
    List,
    Head,
    Get,
    Put,
    CreateMultipart,
    UploadPart,
    CompleteMultipart,
    AbortMultipart,
    ListUploads,
    Delete,
    DeleteMany,
}

impl Op {
    /// Every operation, in declaration order.
    pub const ALL: [Op; 12] = [
        Op::HeadBucket,
        Op::List,
        Op::Head,
        Op::Get,
        Op::Put,
        Op::CreateMultipart,
        Op::UploadPart,
        Op::CompleteMultipart,
        Op::AbortMultipart,
        Op::ListUploads,
        Op::Delete,
        Op::DeleteMany,
    ];
}

/// Whether these credentials may list `prefix` in `bucket`: a one-key LIST of it (delimiter `/`),
/// the check made before a volume is created, published or mounted. Not HeadBucket: IAM policies
/// that scope `s3:ListBucket` to a prefix allow this LIST and refuse HeadBucket.
pub async fn check_prefix_access(
    store: &dyn ObjectStore,
    bucket: &str,
    prefix: &str,
) -> Result<()> {
    let probe = ListRequest {
        prefix,
        delimiter: Some("/"),
        max_keys: Some(1),
        ..Default::default()
    };
    store.list(bucket, probe).await.map(|_| ())
}

/// What [`delete_prefix`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixDeleted {
    /// Objects deleted.
    pub objects: u64,
    /// Multipart uploads in progress aborted (their parts deleted).
    pub uploads: u64,
}

/// Deletes every key that starts with `prefix`, then aborts every multipart upload in progress
/// whose key starts with it ([`abort_uploads`]), and says how many of each.
///
/// Lists page by page (no delimiter) and deletes each page with one [`ObjectStore::delete_many`]
/// (at most [`MAX_DELETE_BATCH`] keys). Only keys that really start with `prefix` are deleted, even
/// if a server returned others. An empty `prefix` would empty the whole bucket and is refused with
/// [`StoreError::InvalidRequest`]. Note that `"vol1"` also matches `"vol10/x"`: pass `"vol1/"` to
/// mean a directory.
///
/// The deletes are plain (no version ids): in a versioned bucket each adds a delete marker and the
/// older versions stay until a lifecycle rule expires them.
pub async fn delete_prefix(
    store: &dyn ObjectStore,
    bucket: &str,
    prefix: &str,
) -> Result<PrefixDeleted> {
    refuse_empty_prefix("delete_prefix", prefix, "empty the bucket")?;
    let mut objects = 0u64;
    let pages = list_pages(store, bucket, ListRequest::keys_under(prefix));
    futures::pin_mut!(pages);
    while let Some(page) = pages.try_next().await? {
        let keys: Vec<String> = page
            .objects
            .into_iter()
            .map(|o| o.key)
            .filter(|k| k.starts_with(prefix))
            .collect();
        for batch in keys.chunks(MAX_DELETE_BATCH) {
            store.delete_many(bucket, batch).await?;
            objects += batch.len() as u64;
        }
    }
    let uploads = abort_uploads(store, bucket, prefix)
        .await
        .map_err(|e| after_objects_deleted(e, objects))?;
    Ok(PrefixDeleted { objects, uploads })
}

/// An error of [`abort_uploads`] once the objects are gone, saying so (a retry deletes no data
/// then) and, for a refusal, which permissions the uploads need: an IAM policy written before
/// Ferry aborted uploads grants neither.
fn after_objects_deleted(mut e: StoreError, objects: u64) -> StoreError {
    // A bucket gone meanwhile is kept as it is (the controller answers it with OK).
    if matches!(e, StoreError::NoSuchBucket(_)) {
        return e;
    }
    let hint = match e {
        StoreError::AccessDenied(_) => {
            " (listing and aborting them needs s3:ListBucketMultipartUploads on the bucket and \
             s3:AbortMultipartUpload)"
        }
        _ => "",
    };
    let m = e.message_mut();
    *m = format!(
        "the prefix's {objects} objects are deleted, its unfinished multipart uploads not: {m}{hint}"
    );
    e
}

/// Aborts every multipart upload in progress whose key starts with `prefix` (S3 then deletes its
/// parts, which it otherwise keeps, billed, for ever unless a lifecycle rule aborts them) and
/// returns how many were aborted.
///
/// Each page of [`ObjectStore::list_uploads`] is aborted, then the listing starts again from the
/// first page (what was aborted is gone from it), until a page is the last: no request names an
/// aborted upload as its marker (S3 may refuse an upload-id marker that names no upload), and no
/// request depends on a server's upload-id markers (versitygw refuses its own). A page holding only
/// uploads already tried (a server that lists an upload it acknowledged aborting) is gone past with
/// its markers, which must advance. Only uploads whose keys really start with `prefix` are aborted,
/// even if a server returned others; an upload gone by the time it is aborted (completed or
/// aborted meanwhile: [`StoreError::NotFound`], S3's NoSuchUpload) is not counted and is no error.
/// An empty `prefix` is refused as by [`delete_prefix`]. A page's uploads are aborted
/// [`ABORTS_AT_ONCE`] at a time (a prefix a crashed writer left thousands of uploads in is not
/// one round trip each); the first error other than `NotFound` ends it.
pub async fn abort_uploads(store: &dyn ObjectStore, bucket: &str, prefix: &str) -> Result<u64> {
    refuse_empty_prefix("abort_uploads", prefix, "abort every upload of the bucket")?;
    let mut aborted = 0u64;
    let mut tried = std::collections::HashSet::new();
    let mut markers = std::collections::HashSet::new();
    let mut after: Option<UploadsMarker> = None;
    loop {
        let req = UploadsRequest {
            prefix,
            after: after.clone(),
            max_uploads: None,
        };
        let page = store.list_uploads(bucket, req).await?;
        let fresh_uploads: Vec<Upload> = page
            .uploads
            .into_iter()
            .filter(|u| u.key.starts_with(prefix) && tried.insert(u.clone()))
            .collect();
        let fresh = fresh_uploads.len();
        let done: Vec<bool> = futures::stream::iter(fresh_uploads)
            .map(|u| async move {
                match store.abort_multipart(bucket, &u.key, &u.upload_id).await {
                    Ok(()) => Ok(true),
                    Err(StoreError::NotFound(_)) => Ok(false),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(ABORTS_AT_ONCE)
            .try_collect()
            .await?;
        aborted += done.iter().filter(|a| **a).count() as u64;
        match page.next {
            None => return Ok(aborted),
            Some(_) if fresh > 0 => after = None,
            // Markers name uploads in list order: one that goes back, or comes again, would
            // list for ever.
            Some(next)
                if !markers.insert(next.clone())
                    || after.as_ref().is_some_and(|a| next.key < a.key) =>
            {
                return Err(StoreError::Other(format!(
                    "ListMultipartUploads {bucket}/{prefix}: the next page would start at {next:?}, where a page already did or before (after {after:?})"
                )));
            }
            Some(next) => after = Some(next),
        }
    }
}

/// Aborts in flight at once in [`abort_uploads`].
pub const ABORTS_AT_ONCE: usize = 16;

/// An empty prefix is every key of the bucket: refused, with why (`it would ...`).
fn refuse_empty_prefix(what: &str, prefix: &str, it_would: &str) -> Result<()> {
    if prefix.is_empty() {
        return Err(StoreError::InvalidRequest(format!(
            "{what} refuses an empty prefix (it would {it_would})"
        )));
    }
    Ok(())
}

/// `data` in copies of `piece` bytes each (the last may be shorter; `piece` 0 counts as 1).
pub fn split_copied(data: &[u8], piece: u64) -> Vec<Bytes> {
    let piece = usize::try_from(piece).unwrap_or(usize::MAX).max(1);
    data.chunks(piece).map(Bytes::copy_from_slice).collect()
}

/// A shared store is a store: lets `Arc<dyn ObjectStore>` be wrapped (e.g. by `FaultyStore`).
#[async_trait]
impl<T: ObjectStore + ?Sized> ObjectStore for Arc<T> {
    async fn head_bucket(&self, bucket: &str) -> Result<()> {
        (**self).head_bucket(bucket).await
    }
    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
        (**self).list(bucket, req).await
    }
    async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
        (**self).head(bucket, key).await
    }
    async fn head_readable(&self, bucket: &str, key: &str) -> Result<Probed> {
        (**self).head_readable(bucket, key).await
    }
    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes> {
        (**self).get_range(bucket, key, range, if_match).await
    }
    async fn get_range_pieces(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        piece: u64,
    ) -> Result<Vec<Bytes>> {
        (**self)
            .get_range_pieces(bucket, key, range, if_match, piece)
            .await
    }
    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<SystemTime>,
        size: u64,
    ) -> Result<Bytes> {
        (**self)
            .get_range_unmodified(bucket, key, range, last_modified, size)
            .await
    }
    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        (**self).put(bucket, key, body).await
    }
    async fn put_if_absent(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        (**self).put_if_absent(bucket, key, body).await
    }
    async fn create_multipart(&self, bucket: &str, key: &str) -> Result<String> {
        (**self).create_multipart(bucket, key).await
    }
    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<CompletedPart> {
        (**self)
            .upload_part(bucket, key, upload_id, part_number, body)
            .await
    }
    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        (**self)
            .complete_multipart(bucket, key, upload_id, parts)
            .await
    }
    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        (**self)
            .complete_multipart_if_absent(bucket, key, upload_id, parts)
            .await
    }
    async fn abort_multipart(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        (**self).abort_multipart(bucket, key, upload_id).await
    }
    async fn list_uploads(&self, bucket: &str, req: UploadsRequest<'_>) -> Result<UploadsPage> {
        (**self).list_uploads(bucket, req).await
    }
    async fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        (**self).delete(bucket, key).await
    }
    async fn delete_many(&self, bucket: &str, keys: &[String]) -> Result<()> {
        (**self).delete_many(bucket, keys).await
    }
}

/// An error as a user reads it: its message and every message of its source chain, joined with
/// ": ", repeats left out ("connection refused" is not hidden behind "dispatch failure").
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let msg = e.to_string();
        if !out.contains(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryStore;

    const B: &str = "b";

    /// A server that answers ListMultipartUploads for the whole bucket whatever the prefix (or,
    /// `stuck`, hands out the same marker on every page).
    #[derive(Debug)]
    struct Sloppy {
        inner: MemoryStore,
        stuck: bool,
        /// Aborts in flight now, and the most at once.
        aborting: std::sync::atomic::AtomicUsize,
        most: std::sync::atomic::AtomicUsize,
    }

    impl Sloppy {
        fn new(inner: MemoryStore, stuck: bool) -> Self {
            Sloppy {
                inner,
                stuck,
                aborting: Default::default(),
                most: Default::default(),
            }
        }
    }

    #[async_trait]
    impl ObjectStore for Sloppy {
        async fn head_bucket(&self, b: &str) -> Result<()> {
            self.inner.head_bucket(b).await
        }
        async fn list(&self, b: &str, req: ListRequest<'_>) -> Result<ListPage> {
            self.inner.list(b, req).await
        }
        async fn head(&self, b: &str, k: &str) -> Result<ObjectInfo> {
            self.inner.head(b, k).await
        }
        async fn get_range(
            &self,
            b: &str,
            k: &str,
            r: Range<u64>,
            m: Option<&str>,
        ) -> Result<Bytes> {
            self.inner.get_range(b, k, r, m).await
        }
        async fn get_range_unmodified(
            &self,
            b: &str,
            k: &str,
            r: Range<u64>,
            t: Option<SystemTime>,
            n: u64,
        ) -> Result<Bytes> {
            self.inner.get_range_unmodified(b, k, r, t, n).await
        }
        async fn put(&self, b: &str, k: &str, body: Bytes) -> Result<PutResult> {
            self.inner.put(b, k, body).await
        }
        async fn put_if_absent(&self, b: &str, k: &str, body: Bytes) -> Result<PutResult> {
            self.inner.put_if_absent(b, k, body).await
        }
        async fn create_multipart(&self, b: &str, k: &str) -> Result<String> {
            self.inner.create_multipart(b, k).await
        }
        async fn upload_part(
            &self,
            b: &str,
            k: &str,
            u: &str,
            n: i32,
            body: Bytes,
        ) -> Result<CompletedPart> {
            self.inner.upload_part(b, k, u, n, body).await
        }
        async fn complete_multipart(
            &self,
            b: &str,
            k: &str,
            u: &str,
            parts: Vec<CompletedPart>,
        ) -> Result<PutResult> {
            self.inner.complete_multipart(b, k, u, parts).await
        }
        async fn complete_multipart_if_absent(
            &self,
            b: &str,
            k: &str,
            u: &str,
            parts: Vec<CompletedPart>,
        ) -> Result<PutResult> {
            self.inner
                .complete_multipart_if_absent(b, k, u, parts)
                .await
        }
        async fn abort_multipart(&self, b: &str, k: &str, u: &str) -> Result<()> {
            use std::sync::atomic::Ordering::SeqCst;
            let now = self.aborting.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            // Every other abort sent meanwhile is polled before this one answers.
            tokio::task::yield_now().await;
            let r = self.inner.abort_multipart(b, k, u).await;
            self.aborting.fetch_sub(1, SeqCst);
            r
        }
        async fn list_uploads(&self, b: &str, req: UploadsRequest<'_>) -> Result<UploadsPage> {
            let wide = UploadsRequest { prefix: "", ..req };
            let mut page = self.inner.list_uploads(b, wide).await?;
            if self.stuck {
                page.next = Some(UploadsMarker {
                    key: "vol1/a".into(),
                    upload_id: None,
                });
            }
            Ok(page)
        }
        async fn delete(&self, b: &str, k: &str) -> Result<()> {
            self.inner.delete(b, k).await
        }
        async fn delete_many(&self, b: &str, keys: &[String]) -> Result<()> {
            self.inner.delete_many(b, keys).await
        }
    }

    /// Only uploads whose keys really start with the prefix are aborted, whatever the server
    /// listed; a server whose pages do not advance ends the deletion with an error, not a loop.
    #[tokio::test]
    async fn uploads_outside_the_prefix_are_never_aborted_whatever_the_server_lists() {
        let inner = MemoryStore::new();
        inner.create_bucket(B);
        for key in ["vol0/x", "vol1/a", "vol1/b", "vol10/x", "vol1"] {
            inner.create_multipart(B, key).await.unwrap();
        }
        let s = Sloppy::new(inner.clone(), false);
        assert_eq!(abort_uploads(&s, B, "vol1/").await.unwrap(), 2);
        let left: Vec<String> = inner.uploads(B).into_iter().map(|(k, _)| k).collect();
        assert_eq!(left, ["vol0/x", "vol1", "vol10/x"]);

        let stuck = Sloppy::new(inner, true);
        let e = abort_uploads(&stuck, B, "vol10/").await.unwrap_err();
        assert!(
            matches!(e, StoreError::Other(ref m) if m.contains("already")),
            "{e:?}"
        );
        let left: Vec<String> = stuck.inner.uploads(B).into_iter().map(|(k, _)| k).collect();
        assert_eq!(left, ["vol0/x", "vol1"], "vol10/x aborted, nothing else");
    }

    /// A page's uploads are aborted several at once, never more than [`ABORTS_AT_ONCE`].
    #[tokio::test]
    async fn a_pages_uploads_are_aborted_at_once() {
        let inner = MemoryStore::new();
        inner.create_bucket(B);
        for i in 0..40 {
            inner
                .create_multipart(B, &format!("vol/{i:02}"))
                .await
                .unwrap();
        }
        let s = Sloppy::new(inner.clone(), false);
        assert_eq!(abort_uploads(&s, B, "vol/").await.unwrap(), 40);
        assert!(inner.uploads(B).is_empty());
        let most = s.most.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(most, ABORTS_AT_ONCE, "aborts in flight at once");
    }
}
