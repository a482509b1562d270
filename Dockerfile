# syntax=docker/dockerfile:1
# One image with Ferry's binaries, ferry-controller, ferry-node and ferry-fd-holder, for the Helm chart
# in charts/ferry (the controller Deployment runs ferry-controller, the node DaemonSet ferry-node;
# ferry-fd-holder, which keeps the fds of live mounts across restarts of ferry-node, is its sidecar).
#
#   docker build -t ghcr.io/ferry-csi/ferry:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 -t ghcr.io/ferry-csi/ferry:0.1.0 --push .
#
# The build needs no protoc (the CSI proto is compiled by protox, in Rust) and no libfuse (fuser is
# built without it: the node plugin runs as root and calls mount(2) itself).

ARG RUST_VERSION=1.95.0
ARG DEBIAN_RELEASE=trixie

# ---- builder: the workspace, release profile, the binaries only ----
FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS builder
ARG RUST_VERSION
# rust-toolchain.toml pins the same version but also asks for rustfmt and clippy; naming the
# installed toolchain here keeps rustup from fetching components the build does not use.
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION} \
    CARGO_TERM_COLOR=never
# cmake and a C/C++ toolchain for aws-lc-sys (the TLS crypto of the AWS SDK).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target dir between builds (BuildKit); the binaries are copied
# out of the cached target dir because it is not part of the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p ferry-controller -p ferry-node -p ferry-holder \
 && mkdir -p /out \
 && cp target/release/ferry-controller target/release/ferry-node target/release/ferry-fd-holder /out/

# ---- runtime: Debian slim with FUSE userspace and CA certificates ----
FROM debian:${DEBIAN_RELEASE}-slim
# fuse3: fusermount3 and /etc/fuse.conf, for mounts made without root (`ferry-node mount` run by a
# user); ca-certificates: TLS to S3 and STS; tini is not needed (every binary handles SIGTERM).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      fuse3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/ferry-controller /out/ferry-node /out/ferry-fd-holder /usr/local/bin/
LABEL org.opencontainers.image.title="ferry" \
      org.opencontainers.image.description="Ferry CSI driver: S3 prefixes as Kubernetes volumes (ferry-controller, ferry-node, ferry-fd-holder)" \
      org.opencontainers.image.source="https://github.com/ferry-csi/ferry" \
      org.opencontainers.image.licenses="Apache-2.0"
# The chart picks the binary with `command`. The node plugin runs as root (privileged, for FUSE);
# the chart runs the controller as UID 65532, which needs nothing from the filesystem but /csi.
CMD ["ferry-node", "--help"]
