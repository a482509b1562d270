//! Rust bindings for the Container Storage Interface (CSI) v1 gRPC API.
//!
//! The messages and the `Identity`, `Controller`, `GroupController` and
//! `Node` services are generated at build time from `proto/csi.proto`
//! (written from the CSI specification, see [`CSI_SPEC_VERSION`]) with
//! prost and tonic. Servers live in `csi::v1::{identity,controller,node}_server`,
//! clients in `csi::v1::*_client`.
//!
//! [`pluginregistration`] is kubelet's plugin registration API (v1), which `ferry-node` serves
//! on its socket in kubelet's `plugins_registry` directory.

/// The CSI specification version `csi.proto` was written from.
pub const CSI_SPEC_VERSION: &str = "1.11.0";

/// Generated code, namespaced like the protobuf package `csi.v1`.
pub mod csi {
    /// Package `csi.v1`.
    pub mod v1 {
        #![allow(
            missing_docs,
            clippy::all,
            clippy::pedantic,
            clippy::nursery,
            rustdoc::all
        )]
        tonic::include_proto!("csi.v1");
    }
}

pub use csi::v1;

/// Kubelet's plugin registration API, package `pluginregistration` (from
/// `proto/pluginregistration.proto`): the `Registration` server and client.
pub mod pluginregistration {
    #![allow(
        missing_docs,
        clippy::all,
        clippy::pedantic,
        clippy::nursery,
        rustdoc::all
    )]
    tonic::include_proto!("pluginregistration");
}

#[cfg(test)]
mod tests;
