//! CSI plumbing shared by `ferry-controller` and `ferry-node`.
//!
//! - [`endpoint`]: parse `unix:///path` and bind the socket;
//! - [`log`]: one tower layer that logs every RPC with its status code and duration;
//! - [`identity`]: the Identity service both binaries serve;
//! - [`error`]: the one place where Ferry errors become gRPC statuses;
//! - [`capability`]: volume capability checks both services share;
//! - [`inflight`]: one operation per volume or target at a time;
//! - [`kube_api`]: Kubernetes object names and API errors, for the controller's and node's reads;
//! - [`stores`]: one S3 client per endpoint a volume names.

pub mod capability;
pub mod endpoint;
pub mod error;
pub mod identity;
pub mod inflight;
pub mod kube_api;
pub mod log;
pub mod stores;

pub use error::CsiError;
pub use ferry_proto::csi::v1 as pb;

/// The plugin version reported by GetPluginInfo.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
