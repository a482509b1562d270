//! [`InstrumentedStore`]: counts every S3 request by operation and outcome, with latency and bytes.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use ferry_store::{
    CompletedPart, ListPage, ListRequest, ObjectInfo, ObjectStore, PutResult, Result, StoreError,
    UploadsPage, UploadsRequest,
};

use crate::global::metrics;
use crate::s3::{op_index, record_request};

/// Wraps a store; every call is counted (`ferry_s3_requests_total`, by result) and timed
/// (`ferry_s3_request_duration_seconds`), retries included; GET and PUT bytes are counted too.
#[derive(Debug, Clone)]
pub struct InstrumentedStore {
    inner: Arc<dyn ObjectStore>,
}

impl InstrumentedStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        InstrumentedStore { inner }
    }
}

/// The index of an outcome in [`crate::s3::RESULTS`].
fn outcome<T>(r: &Result<T>) -> usize {
    match r {
        Ok(_) => 0,
        Err(e) => match e {
            StoreError::NotFound(_) => 1,
            StoreError::NoSuchBucket(_) => 2,
            StoreError::AccessDenied(_) => 3,
            StoreError::PreconditionFailed(_) => 4,
            StoreError::InvalidRequest(_) => 5,
            StoreError::Throttled(_) => 6,
            StoreError::Transient(_) => 7,
            StoreError::Corrupt(_) => 8,
            StoreError::Credentials(_) => 9,
            StoreError::CredentialsUnavailable(_) => 10,
            StoreError::Other(_) => 11,
        },
    }
}

async fn timed<T>(op: &'static str, fut: impl Future<Output = Result<T>>) -> Result<T> {
    let start = Instant::now();
    let r = fut.await;
    record_request(op_index(op), outcome(&r), start.elapsed());
    r
}

fn bytes_in(n: usize) {
    metrics().s3.received_bytes.inc_by(n as u64);
}

fn bytes_out(n: usize) {
    metrics().s3.sent_bytes.inc_by(n as u64);
}

#[async_trait]
impl ObjectStore for InstrumentedStore {
    async fn head_bucket(&self, bucket: &str) -> Result<()> {
        timed("head_bucket", self.inner.head_bucket(bucket)).await
    }

    async fn list(&self, bucket: &str, req: ListRequest<'_>) -> Result<ListPage> {
        timed("list", self.inner.list(bucket, req)).await
    }

    async fn head(&self, bucket: &str, key: &str) -> Result<ObjectInfo> {
        timed("head", self.inner.head(bucket, key)).await
    }

    /// Counted as a GET: on S3 it is one (of the first byte).
    async fn head_readable(&self, bucket: &str, key: &str) -> Result<ferry_store::Probed> {
        timed("get", self.inner.head_readable(bucket, key)).await
    }

    async fn get_range(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
    ) -> Result<Bytes> {
        let r = timed("get", self.inner.get_range(bucket, key, range, if_match)).await;
        if let Ok(b) = &r {
            bytes_in(b.len());
        }
        r
    }

    async fn get_range_pieces(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        piece: u64,
    ) -> Result<Vec<Bytes>> {
        let r = timed(
            "get",
            self.inner
                .get_range_pieces(bucket, key, range, if_match, piece),
        )
        .await;
        if let Ok(pieces) = &r {
            bytes_in(pieces.iter().map(Bytes::len).sum());
        }
        r
    }

    async fn get_range_unmodified(
        &self,
        bucket: &str,
        key: &str,
        range: Range<u64>,
        last_modified: Option<SystemTime>,
        size: u64,
    ) -> Result<Bytes> {
        let r = timed(
            "get",
            self.inner
                .get_range_unmodified(bucket, key, range, last_modified, size),
        )
        .await;
        if let Ok(b) = &r {
            bytes_in(b.len());
        }
        r
    }

    async fn put(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        let n = body.len();
        let r = timed("put", self.inner.put(bucket, key, body)).await;
        if r.is_ok() {
            bytes_out(n);
        }
        r
    }

    async fn put_if_absent(&self, bucket: &str, key: &str, body: Bytes) -> Result<PutResult> {
        let n = body.len();
        let r = timed("put", self.inner.put_if_absent(bucket, key, body)).await;
        if r.is_ok() {
            bytes_out(n);
        }
        r
    }

    async fn create_multipart(&self, bucket: &str, key: &str) -> Result<String> {
        timed("create_multipart", self.inner.create_multipart(bucket, key)).await
    }

    async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<CompletedPart> {
        let n = body.len();
        let r = timed(
            "upload_part",
            self.inner
                .upload_part(bucket, key, upload_id, part_number, body),
        )
        .await;
        if r.is_ok() {
            bytes_out(n);
        }
        r
    }

    async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        timed(
            "complete_multipart",
            self.inner.complete_multipart(bucket, key, upload_id, parts),
        )
        .await
    }

    async fn complete_multipart_if_absent(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: Vec<CompletedPart>,
    ) -> Result<PutResult> {
        timed(
            "complete_multipart",
            self.inner
                .complete_multipart_if_absent(bucket, key, upload_id, parts),
        )
        .await
    }

    async fn abort_multipart(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        timed(
            "abort_multipart",
            self.inner.abort_multipart(bucket, key, upload_id),
        )
        .await
    }

    async fn list_uploads(&self, bucket: &str, req: UploadsRequest<'_>) -> Result<UploadsPage> {
        timed("list_uploads", self.inner.list_uploads(bucket, req)).await
    }

    async fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        timed("delete", self.inner.delete(bucket, key)).await
    }

    async fn delete_many(&self, bucket: &str, keys: &[String]) -> Result<()> {
        timed("delete_many", self.inner.delete_many(bucket, keys)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::s3::RESULTS;
    use ferry_store::MemoryStore;

    #[test]
    fn outcome_names_line_up() {
        let r: Result<()> = Err(StoreError::Credentials("x".into()));
        assert_eq!(RESULTS[outcome(&r)], "credentials");
        let r: Result<()> = Err(StoreError::NotFound("x".into()));
        assert_eq!(RESULTS[outcome(&r)], "not_found");
    }

    #[tokio::test]
    async fn counts_requests_outcomes_and_bytes() {
        let mem = Arc::new(MemoryStore::new());
        mem.create_bucket("m");
        let s = InstrumentedStore::new(mem);
        let before_in = metrics().s3.received_bytes.get();
        s.put("m", "k", Bytes::from_static(b"hello")).await.unwrap();
        s.get_range("m", "k", 0..5, None).await.unwrap();
        assert!(s.head("m", "missing").await.is_err());
        let id = s.create_multipart("m", "big").await.unwrap();
        let page = s
            .list_uploads("m", ferry_store::UploadsRequest::default())
            .await
            .unwrap();
        assert_eq!(page.uploads[0].upload_id, id);
        assert!(metrics().s3.received_bytes.get() >= before_in + 5);
        let text = crate::registry().encode_text();
        for want in [
            "ferry_s3_requests_total{op=\"put\",result=\"ok\"}",
            "ferry_s3_requests_total{op=\"head\",result=\"not_found\"}",
            "ferry_s3_requests_total{op=\"list_uploads\",result=\"ok\"}",
            "ferry_s3_request_duration_seconds_bucket{op=\"get\"",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
    }
}
