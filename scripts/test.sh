#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls this):
#   1. installs what it needs (scripts/setup.sh);
#   2. gates: cargo fmt --check, cargo clippy --all-targets -D warnings, the fuzz crate's lock file
#      current, the Helm chart's lint/render check;
#   3. cargo test --workspace: unit tests on the in-memory store, property tests, and integration
#      tests against a real S3 server (versitygw on loopback) through real FUSE mounts;
#   4. live mounts across node plugin replacements (`ferry-harness takeover`: under load, 20 graceful
#      upgrades and 20 `kill -9` restarts with 0 failed reads, and the refusal of an unreadable state
#      format; `restart`: a stop with no successor, and the whole plugin pod gone), and driver- and
#      pod-level IRSA (moto's STS and S3 with IAM enforced; trace-level logs searched for secrets),
#      through the real binaries;
#   5. csi-sanity v5.4.0 against ferry-controller and ferry-node on unix sockets, with test volumes
#      on the real S3 server; then `promtool check metrics` (Prometheus 3.16.0) on both binaries'
#      /metrics after they did real work (S3 requests, the node cache, FUSE operations);
#   6. the Kubernetes-level e2e (`ferry-harness kube`): etcd, kube-apiserver and
#      kube-controller-manager on loopback, the chart (charts/ferry) rendered and applied,
#      csi-provisioner against ferry-controller, PVCs bound and published as kubelet would;
#   7. the real-node e2e (`ferry-harness node`): kube-scheduler, containerd + kubelet on loopback,
#      images built without Docker, `helm install charts/ferry`, real pods reading and writing
#      through PVCs, kubelet restarted and the node DaemonSet rolled under a reading pod; then the
#      same cluster taken as an existing one (`ferry-harness node --kubeconfig`'s path);
#   8. the fuzz smoke (scripts/fuzz.sh smoke): the fuzz crate built with coverage instrumentation on
#      the stable toolchain, every kept corpus and crash input replayed, each target fuzzed 15 s.
# Must run as root (FUSE mounts). Exits non-zero on the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
export FERRY_TOOLS=${FERRY_TOOLS:-$HOME/.cache/ferry-tools/bin}
export PATH="$FERRY_TOOLS:$PATH"

step() { printf '\n\033[1m==> %s\033[0m\n' "$*" >&2; }
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
# Disk is the scarce thing on CI machines (a cold run once hit "No space left on device" while linking):
# no incremental caches for a one-shot build, and the free space is printed before and after the builds.
export CARGO_INCREMENTAL=0
disk() { mkdir -p "$target" && printf '[disk] %s: %s free, target %s\n' "$1" \
  "$(df -h --output=avail "$target" | tail -1 | tr -d ' ')" "$(du -sh "$target" 2>/dev/null | cut -f1)" >&2; }
disk "before the build"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The fuzz crate has a lock file of its own, built with --locked at the end; a dependency added to
# a crate it fuzzes changes that lock file too. Checked here, in seconds, not after the tests.
(cd fuzz && cargo fetch --locked --target "$(rustc -vV | sed -n 's/^host: //p')" --quiet) ||
  { echo "fuzz/Cargo.lock is out of date: run \`cargo update --workspace\` in fuzz/ and commit it" >&2; exit 1; }

step "Helm chart: helm lint --strict (v4, v3), helm template (defaults, all features, minimal)"
./scripts/chart-check.sh

step "cargo test --workspace"
cargo test --workspace --locked --no-fail-fast

cargo build --locked --workspace --bins
disk "after the build"

step "live mounts across 20 graceful upgrades and 20 kill -9 restarts of ferry-node, under load (real binaries)"
"$target/debug/ferry-harness" takeover

step "node plugin stopped with no successor; the whole plugin pod gone (real binaries)"
"$target/debug/ferry-harness" restart

step "driver- and pod-level IRSA (real binaries, moto, kube-apiserver)"
"$target/debug/ferry-harness" driver-irsa

step "csi-sanity $(cat "$FERRY_TOOLS/.csi-sanity.version" 2>/dev/null)"
"$target/debug/ferry-harness" sanity

step "promtool $(cat "$FERRY_TOOLS/.promtool.version" 2>/dev/null) check metrics on both binaries' /metrics after real work (real binaries)"
"$target/debug/ferry-harness" metrics

step "Kubernetes e2e: real kube-apiserver $(cat "$FERRY_TOOLS/.kube-apiserver.version" 2>/dev/null), csi-provisioner $(cat "$FERRY_TOOLS/.csi-provisioner.version" 2>/dev/null)"
"$target/debug/ferry-harness" kube

step "Kubernetes on a real node: kubelet $(cat "$FERRY_TOOLS/.kubelet.version" 2>/dev/null) + containerd $(containerd --version 2>/dev/null | awk '{print $3}'), helm install, real pods"
"$target/debug/ferry-harness" node

step "fuzz smoke: every corpus and regression input replayed, then each libFuzzer target for 15 s (fuzz/README.md)"
CARGO_TARGET_DIR="$target/fuzz" ./scripts/fuzz.sh smoke 15
