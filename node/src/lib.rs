//! Ferry's CSI node plugin as a library, so tests can serve it in-process.
//!
//! - [`service`]: the Node service (NodePublishVolume mounts, NodeUnpublishVolume unmounts);
//! - [`fdpass`]: framed messages with file descriptors over a unix socket;
//! - [`holder`]: the fd holder's protocol and client (fds of live mounts kept across a restart);
//! - [`accounts`]: ServiceAccount reads through the Kubernetes API (pod-level credentials);
//! - [`mounts`]: the table of live mounts, one FUSE session each, all in this process;
//! - [`registration`]: kubelet plugin registration (the socket in `plugins_registry`), behind
//!   [`authority`], which makes kubelet's requests acceptable to h2;
//! - [`targetpath`]: kubelet target-path checks;
//! - [`warm`]: volume warm-ups (`prefetchOnMount`), run by one live mount that asked for each;
//! - [`size`]: byte sizes and the memory budget on the command line;
//! - [`mountinfo`] (from `ferry-fs`): what the kernel says is mounted where.

pub mod accounts;
pub mod authority;
pub mod handover;
pub mod keeper;
pub mod mounts;
pub mod registration;
pub mod service;
pub mod size;
pub mod targetpath;
pub mod warm;

pub use ferry_fs::{alloc, mountinfo};
/// The descriptor holder's client and framing (their own package: `ferry-fd-holder` links none of
/// the data path).
pub use ferry_holder::{self as holder, fdpass};
pub use service::{NodeConfig, NodeService, PodAuth};
