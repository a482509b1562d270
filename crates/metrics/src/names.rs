//! Every metric name Ferry exports, in one place: the names as a query sees them (a counter's
//! `_total` included; the registry strips it where prometheus-client wants the bare family name).

/// S3 requests by operation (`op`) and outcome (`result`: `ok` or an error kind): one per call of
/// the store, whatever the retries below it.
pub const S3_REQUESTS: &str = "ferry_s3_requests_total";
/// S3 request latency in seconds by operation, retries included.
pub const S3_REQUEST_SECONDS: &str = "ferry_s3_request_duration_seconds";
/// S3 HTTP attempts by operation (`op`) and HTTP status (`status`: `200`, `503`, ... or
/// `no_response` for a connect error or timeout): every retry is one more.
pub const S3_ATTEMPTS: &str = "ferry_s3_attempts_total";
/// S3 HTTP attempt latency in seconds by operation.
pub const S3_ATTEMPT_SECONDS: &str = "ferry_s3_attempt_duration_seconds";
/// Bytes received from S3 (GET bodies).
pub const S3_BYTES_IN: &str = "ferry_s3_received_bytes_total";
/// Bytes sent to S3 (PUT and part bodies).
pub const S3_BYTES_OUT: &str = "ferry_s3_sent_bytes_total";
/// FUSE operations answered, by operation (`op`) and outcome (`outcome`: `ok` or the errno's
/// name, e.g. `ENOENT`).
pub const FUSE_OPS: &str = "ferry_fuse_operations_total";
/// FUSE operation latency in seconds by operation.
pub const FUSE_OP_SECONDS: &str = "ferry_fuse_operation_duration_seconds";
/// Live FUSE mounts in this process.
pub const MOUNTS: &str = "ferry_mounts";
/// Inodes the mounts of this process keep for the kernel (outside the memory budget).
pub const INODES: &str = "ferry_inodes";
/// Bytes of the node-wide memory budget in use, by `kind`.
pub const MEMORY_BUDGET_USED: &str = "ferry_memory_budget_used_bytes";
/// The node-wide memory budget.
pub const MEMORY_BUDGET_LIMIT: &str = "ferry_memory_budget_limit_bytes";
/// Prefetched bytes later read by the application.
pub const PREFETCH_HIT_BYTES: &str = "ferry_prefetch_hit_bytes_total";
/// Prefetched bytes discarded unread.
pub const PREFETCH_WASTE_BYTES: &str = "ferry_prefetch_wasted_bytes_total";
/// Node cache: block lookups (each ends a hit, a miss or a single-flight join): the hit ratio is
/// `rate(ferry_cache_hits_total[5m]) / rate(ferry_cache_lookups_total[5m])`.
pub const CACHE_LOOKUPS: &str = "ferry_cache_lookups_total";
/// Node cache: blocks served from disk.
pub const CACHE_HITS: &str = "ferry_cache_hits_total";
/// Node cache: bytes served from disk.
pub const CACHE_HIT_BYTES: &str = "ferry_cache_hit_bytes_total";
/// Node cache: misses that fetched the block from S3.
pub const CACHE_MISSES: &str = "ferry_cache_misses_total";
/// Node cache: misses that waited for another reader's fetch of the same block (single flight).
pub const CACHE_JOINS: &str = "ferry_cache_single_flight_joins_total";
/// Node cache: fetched blocks written into the cache.
pub const CACHE_FILLS: &str = "ferry_cache_fills_total";
/// Node cache: block and whole-object files evicted (budget or free-space floor).
pub const CACHE_EVICTIONS: &str = "ferry_cache_evictions_total";
/// Node cache: block or whole-object files that failed their checksum or key check (deleted).
pub const CACHE_CORRUPT: &str = "ferry_cache_corrupt_blocks_total";
/// Node cache: fetched blocks not stored (no room, write failed, index not yet rebuilt).
pub const CACHE_SKIPPED: &str = "ferry_cache_store_skipped_total";
/// Node cache: bytes of block and whole-object files on disk.
pub const CACHE_BYTES: &str = "ferry_cache_bytes";
/// Node cache: block files on disk.
pub const CACHE_BLOCKS: &str = "ferry_cache_blocks";
/// Node cache: whole-object files on disk.
pub const CACHE_OBJECTS: &str = "ferry_cache_objects";
/// Node cache: objects whose blocks were joined into one whole-object file.
pub const CACHE_ASSEMBLED: &str = "ferry_cache_objects_assembled_total";
/// Node cache: opens served by handing the kernel a whole cached object (FUSE passthrough).
pub const CACHE_WHOLE_OPENS: &str = "ferry_cache_passthrough_opens_total";
/// Node cache: cache reads refused because the mount's credentials were denied the object.
pub const CACHE_DENIED: &str = "ferry_cache_access_denied_total";
/// Warm-up: bytes fetched into the node cache by volume warm-ups.
pub const CACHE_WARMUP_BYTES: &str = "ferry_cache_warmup_bytes_total";
/// Warm-up: warm-ups finished, by outcome (`result`).
pub const CACHE_WARMUPS: &str = "ferry_cache_warmups_total";
/// Mounts this process took over from a previous one, by how (`how`: `handover` from a live
/// process, `recovery` after one died), and those it could not (`how="failed"`).
pub const MOUNTS_TAKEN_OVER: &str = "ferry_mounts_taken_over_total";
/// How long the last takeover stopped the mounts, in seconds: from the moment the previous
/// process stopped serving (handover) or this one started (recovery) to serving again.
pub const TAKEOVER_PAUSE: &str = "ferry_takeover_pause_seconds";
