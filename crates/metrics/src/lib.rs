//! Ferry's Prometheus metrics.
//!
//! - [`names`]: every metric name, as constants;
//! - [`Registry`]: counters, gauges and histograms with labels, rendered in Prometheus' text format
//!   (one process-wide registry: [`global`]);
//! - [`serve`]: the `/metrics` HTTP endpoint;
//! - [`InstrumentedStore`]: an [`ferry_store::ObjectStore`] wrapper that counts S3 requests,
//!   outcomes, bytes and latency.

pub mod names;
mod registry;
mod server;
mod store;

pub use registry::{global, Counter, Gauge, Histogram, Registry};
pub use server::{serve, start};
pub use store::InstrumentedStore;
