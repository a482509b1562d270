//! Generates the CSI v1 bindings from `csi.proto` and kubelet's plugin registration bindings from
//! `pluginregistration.proto`.
//!
//! The proto is parsed by `protox` (pure Rust, bundles the
//! `google/protobuf/*.proto` well-known imports), so no `protoc` binary is
//! needed; the resulting descriptor set is handed to `tonic-prost-build`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let protos = [
        manifest_dir.join("csi.proto"),
        manifest_dir.join("pluginregistration.proto"),
    ];
    println!("cargo:rerun-if-changed=csi.proto");
    println!("cargo:rerun-if-changed=pluginregistration.proto");
    println!("cargo:rerun-if-changed=build.rs");

    let fds = protox::compile(&protos, [&manifest_dir])?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;

    Ok(())
}
