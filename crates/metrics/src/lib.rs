//! Ferry's Prometheus metrics, on prometheus-client.
//!
//! - [`names`]: every metric name, as constants;
//! - [`metrics`]: the process-wide metrics, created once; hot paths record on their handles
//!   (an atomic add: no lock, no allocation); [`registry`] is what `/metrics` serves;
//! - [`record_s3_attempt`] (one S3 HTTP attempt, by operation and status) and
//!   [`record_fuse_op`] (one answered FUSE operation, by operation and outcome);
//! - [`serve`] / [`start`]: the `/metrics` HTTP endpoint;
//! - [`health`]: the `/healthz` endpoint (its own listener, so it does not need metrics on);
//! - [`InstrumentedStore`]: an [`ferry_store::ObjectStore`] wrapper that counts S3 requests,
//!   outcomes, bytes and latency per call of the store.

mod fuse;
mod global;
pub mod health;
pub mod names;
mod registry;
mod s3;
mod server;
mod store;

pub use fuse::record_fuse_op;
pub use global::{
    metrics, registry, CacheMetrics, FuseMetrics, Metrics, NodeMetrics, S3Metrics, MEMORY_KINDS,
};
pub use prometheus_client::metrics::counter::Counter;
pub use prometheus_client::metrics::gauge::Gauge;
pub use registry::{
    AlreadyRegistered, Histogram, Registry, OPENMETRICS_CONTENT_TYPE, TEXT_CONTENT_TYPE,
};
pub use s3::record_s3_attempt;
pub use server::{serve, start};
pub use store::InstrumentedStore;

/// Label values of the metrics: what a dashboard can expect in `op`.
pub mod labels {
    pub use crate::fuse::OPS as FUSE_OPS;
    pub use crate::s3::OPS as S3_OPS;
}

/// The process-wide registry in Prometheus' text format (what a plain scrape returns).
pub fn render() -> String {
    registry().encode_text()
}
