//! Generates the CSI v1 bindings from `csi.proto`.
//!
//! The proto is parsed by `protox` (pure Rust, bundles the
//! `google/protobuf/*.proto` well-known imports), so no `protoc` binary is
//! needed; the resulting descriptor set is handed to `tonic-prost-build`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto = manifest_dir.join("csi.proto");
    println!("cargo:rerun-if-changed=csi.proto");
    println!("cargo:rerun-if-changed=build.rs");

    let fds = protox::compile([&proto], [&manifest_dir])?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;

    Ok(())
}
