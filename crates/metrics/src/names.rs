//! Every metric name Ferry exports, in one place.

/// S3 requests by operation (`op`) and outcome (`result`: `ok` or an error kind).
pub const S3_REQUESTS: &str = "ferry_s3_requests_total";
/// S3 request latency in seconds by operation.
pub const S3_REQUEST_SECONDS: &str = "ferry_s3_request_duration_seconds";
/// Bytes received from S3 (GET bodies).
pub const S3_BYTES_IN: &str = "ferry_s3_received_bytes_total";
/// Bytes sent to S3 (PUT and part bodies).
pub const S3_BYTES_OUT: &str = "ferry_s3_sent_bytes_total";
/// FUSE operations by operation (`op`) and outcome.
pub const FUSE_OPS: &str = "ferry_fuse_operations_total";
/// FUSE operation latency in seconds by operation.
pub const FUSE_OP_SECONDS: &str = "ferry_fuse_operation_duration_seconds";
/// Live FUSE mounts in this process.
pub const MOUNTS: &str = "ferry_mounts";
/// Bytes of the node-wide prefetch memory budget in use.
pub const MEMORY_BUDGET_USED: &str = "ferry_memory_budget_used_bytes";
/// The node-wide prefetch memory budget.
pub const MEMORY_BUDGET_LIMIT: &str = "ferry_memory_budget_limit_bytes";
/// Prefetched bytes later read by the application.
pub const PREFETCH_HIT_BYTES: &str = "ferry_prefetch_hit_bytes_total";
/// Prefetched bytes discarded unread.
pub const PREFETCH_WASTE_BYTES: &str = "ferry_prefetch_wasted_bytes_total";
