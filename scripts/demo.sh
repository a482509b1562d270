#!/usr/bin/env bash
# The demo: a local S3 server (versitygw on loopback), ferry-controller and ferry-node; provisions a
# volume through CSI, uploads a small dataset, publishes the volume at a kubelet-style target path
# and shows the files through the FUSE mount. `scripts/demo.sh --keep` leaves it mounted until Ctrl-C.
# Must run as root (FUSE mounts).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --demo # fuse3 and the versitygw S3 server only; the test suite's tools are not built
export FERRY_TOOLS=${FERRY_TOOLS:-$HOME/.cache/ferry-tools/bin}
export PATH="$FERRY_TOOLS:$PATH"
# the demo runs ferry-harness, which starts ferry-controller, ferry-node and ferry-fd-holder
cargo build --locked -p ferry-e2e -p ferry-controller -p ferry-node -p ferry-holder --bins
exec "${CARGO_TARGET_DIR:-target}/debug/ferry-harness" demo "$@"
