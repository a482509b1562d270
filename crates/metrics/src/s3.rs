//! S3 metrics' label values, and [`record_s3_attempt`]: one HTTP attempt by operation and status.

use std::borrow::Cow;
use std::time::Duration;

use crate::global::{metrics, Labels};

/// The `op` label of every S3 metric (the last one for an operation not listed).
pub const OPS: [&str; 13] = [
    "head_bucket",
    "list",
    "head",
    "get",
    "put",
    "create_multipart",
    "upload_part",
    "complete_multipart",
    "abort_multipart",
    "list_uploads",
    "delete",
    "delete_many",
    "other",
];

/// The `result` label of `ferry_s3_requests_total`: `ok` or the store error's kind.
pub(crate) const RESULTS: [&str; 12] = [
    "ok",
    "not_found",
    "no_such_bucket",
    "access_denied",
    "precondition_failed",
    "invalid_request",
    "throttled",
    "transient",
    "corrupt",
    "credentials",
    "credentials_unavailable",
    "other",
];

/// Cells per operation of `ferry_s3_attempts_total`: no response, 100..=599, anything else.
pub(crate) const STATUS_SLOTS: usize = 502;

/// The index of `op` in [`OPS`]: Ferry's names, or the S3 API's operation names.
pub(crate) fn op_index(op: &str) -> usize {
    match op {
        "head_bucket" | "HeadBucket" => 0,
        "list" | "ListObjectsV2" | "ListObjects" => 1,
        "head" | "HeadObject" => 2,
        "get" | "GetObject" => 3,
        "put" | "PutObject" => 4,
        "create_multipart" | "CreateMultipartUpload" => 5,
        "upload_part" | "UploadPart" => 6,
        "complete_multipart" | "CompleteMultipartUpload" => 7,
        "abort_multipart" | "AbortMultipartUpload" => 8,
        "list_uploads" | "ListMultipartUploads" => 9,
        "delete" | "DeleteObject" => 10,
        "delete_many" | "DeleteObjects" => 11,
        _ => 12,
    }
}

fn op_label(op: usize) -> Labels {
    vec![("op", Cow::Borrowed(OPS[op]))]
}

fn status_slot(status: Option<u16>) -> usize {
    match status {
        None => 0,
        Some(s @ 100..=599) => usize::from(s) - 99,
        Some(_) => STATUS_SLOTS - 1,
    }
}

fn status_label(slot: usize) -> Cow<'static, str> {
    match slot {
        0 => Cow::Borrowed("no_response"),
        s if s == STATUS_SLOTS - 1 => Cow::Borrowed("other"),
        s => Cow::Owned((s + 99).to_string()),
    }
}

/// Records one S3 HTTP attempt: `op` (Ferry's name, e.g. `get`, or the API's, e.g. `GetObject`),
/// its HTTP status (`None`: no response, i.e. a connect error or a timeout) and how long it took.
/// Every retry is an attempt of its own. No lock, no allocation (but the first time an operation
/// sees a status).
pub fn record_s3_attempt(op: &'static str, status: Option<u16>, elapsed: Duration) {
    let s3 = &metrics().s3;
    let op = op_index(op);
    let slot = status_slot(status);
    s3.attempts
        .get(op * STATUS_SLOTS + slot, || {
            vec![
                ("op", Cow::Borrowed(OPS[op])),
                ("status", status_label(slot)),
            ]
        })
        .inc();
    s3.attempt_seconds.get(op, || op_label(op)).observe(elapsed);
}

/// Records one logical S3 request (a call of the store): `op` an entry of [`OPS`], `result` an
/// index into [`RESULTS`].
pub(crate) fn record_request(op: usize, result: usize, elapsed: Duration) {
    let s3 = &metrics().s3;
    s3.requests
        .get(op * RESULTS.len() + result, || {
            vec![
                ("op", Cow::Borrowed(OPS[op])),
                ("result", Cow::Borrowed(RESULTS[result])),
            ]
        })
        .inc();
    s3.request_seconds.get(op, || op_label(op)).observe(elapsed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempts_are_counted_by_op_and_status() {
        record_s3_attempt("GetObject", Some(503), Duration::from_millis(2));
        record_s3_attempt("get", Some(503), Duration::from_millis(2));
        record_s3_attempt("get", Some(200), Duration::from_millis(2));
        record_s3_attempt("put", None, Duration::from_secs(1));
        record_s3_attempt("SelectObjectContent", Some(1000), Duration::ZERO);
        record_s3_attempt("ListMultipartUploads", Some(200), Duration::ZERO);
        let text = crate::registry().encode_text();
        for want in [
            "ferry_s3_attempts_total{op=\"get\",status=\"503\"} 2\n",
            "ferry_s3_attempts_total{op=\"get\",status=\"200\"} 1\n",
            "ferry_s3_attempts_total{op=\"put\",status=\"no_response\"} 1\n",
            "ferry_s3_attempts_total{op=\"other\",status=\"other\"} 1\n",
            "ferry_s3_attempts_total{op=\"list_uploads\",status=\"200\"} 1\n",
            "ferry_s3_attempt_duration_seconds_bucket{op=\"put\",le=\"1\"} 1\n",
        ] {
            assert!(text.contains(want), "{want} missing from\n{text}");
        }
    }

    #[test]
    fn every_status_has_its_cell() {
        assert_eq!(status_slot(None), 0);
        assert_eq!(status_label(status_slot(Some(100))), "100");
        assert_eq!(status_label(status_slot(Some(599))), "599");
        assert_eq!(status_label(status_slot(Some(600))), "other");
        assert_eq!(status_slot(Some(599)), STATUS_SLOTS - 2);
    }
}
