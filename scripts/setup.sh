#!/usr/bin/env bash
# Installs what Ferry's demo or test suite needs on a Debian machine, idempotently.
#
#   scripts/setup.sh --demo   what scripts/demo.sh needs, nothing more (versitygw: ~2.5 min of CPU, once):
#     - Debian packages: fuse3 (fusermount3, /dev/fuse userspace), build essentials, CA certificates;
#     - versitygw (the local S3 server) built from the Go module proxy into $FERRY_TOOLS
#       (default ~/.cache/ferry-tools/bin).
#   scripts/setup.sh          everything the test suite needs (scripts/test.sh, CI), in addition:
#     - Debian packages: openssl (the test Kubernetes cluster's certificates), rsync (the SEMANTICS
#       test writes files the way users do), python3-venv, containerd, runc and
#       containernetworking-plugins (the e2e's one-node cluster runs real pods);
#     - csi-sanity (the CSI conformance suite), promtool (Prometheus' exposition checker: ~10
#       CPU-minutes cold, 15-30 min on 2 shared cores), and through scripts/kube-tools.sh etcd,
#       kube-apiserver, kube-controller-manager, csi-provisioner and helm (the Kubernetes-level e2e;
#       a cold build takes ~20 min on 2 cores);
#     - moto (S3 + IAM + STS with IAM enforcement, for the credentials tests) from PyPI into a venv
#       beside it ($FERRY_TOOLS/../venv, i.e. ~/.cache/ferry-tools/venv).
# Nothing is written into the repository. Safe to run again: present tools are kept.
set -euo pipefail

case "${1:-}" in
  --demo) demo=1 ;;
  "") demo=0 ;;
  *) echo "setup: unknown argument '$1' (expected --demo or nothing)" >&2; exit 2 ;;
esac

FERRY_TOOLS=${FERRY_TOOLS:-$HOME/.cache/ferry-tools/bin}
CSI_SANITY_VERSION=v5.4.0
VERSITYGW_VERSION=v1.7.0
# Prometheus 3.16.0: its Go module is tagged v0.316.0 (v3 tags are not Go-module versions).
PROMTOOL_VERSION=v0.316.0
mkdir -p "$FERRY_TOOLS"
# Go's build cache for these tools is several GB (kubernetes) and of no use once a tool is stamped:
# each run gets its own beside the tools (on the same disk, not a small /tmp), named by its PID and
# deleted when that run ends, so a setup ending early never removes the cache of another one still
# building. One a killed run left (no EXIT trap after SIGKILL) goes when the next run starts.
for stale in "$(dirname "$FERRY_TOOLS")"/go-build.*; do
  [ -d "$stale" ] || continue
  kill -0 "${stale##*.}" 2>/dev/null || rm -rf "$stale"
done
GOCACHE="$(dirname "$FERRY_TOOLS")/go-build.$$"
export GOCACHE
mkdir -p "$GOCACHE"
trap 'rm -rf "$GOCACHE"' EXIT

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: run as root (FUSE mounts and apt-get need it): sudo $0" >&2
    exit 1
  fi
}

install_debian_packages() {
  local missing=()
  command -v fusermount3 >/dev/null || missing+=(fuse3)
  command -v cc >/dev/null || missing+=(build-essential)
  command -v git >/dev/null || missing+=(git)
  command -v curl >/dev/null || missing+=(curl)
  [ -e /etc/ssl/certs/ca-certificates.crt ] || missing+=(ca-certificates)
  if [ "$demo" = 0 ]; then
    command -v openssl >/dev/null || missing+=(openssl)
    command -v rsync >/dev/null || missing+=(rsync) # the SEMANTICS test writes with rsync
    command -v c++ >/dev/null || missing+=(g++)     # libFuzzer, built by the fuzz smoke
    command -v python3 >/dev/null && python3 -c "import ensurepip" 2>/dev/null || missing+=(python3-venv)
    # the one-node cluster of the Kubernetes e2e: containerd + runc run kubelet's pods, the CNI
    # loopback plugin gives pods a network namespace with only lo
    command -v containerd >/dev/null || missing+=(containerd)
    command -v runc >/dev/null || missing+=(runc)
    [ -x /usr/lib/cni/loopback ] || missing+=(containernetworking-plugins)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    need_root
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  fi
  if [ ! -e /dev/fuse ]; then
    echo "setup: /dev/fuse is missing: load the fuse module (modprobe fuse) or run where FUSE is available" >&2
    exit 1
  fi
}

check_toolchains() {
  command -v cargo >/dev/null || { echo "setup: cargo (Rust 1.95) is required: https://rustup.rs" >&2; exit 1; }
  command -v go >/dev/null || { echo "setup: go (1.24+) is required to build versitygw (and the test suite's judges)" >&2; exit 1; }
}

# go_tool NAME VERSION MODULE_PATH: installs MODULE_PATH@VERSION as $FERRY_TOOLS/NAME unless that
# version is already there (a stamp file remembers which version the binary is).
go_tool() {
  local name=$1 version=$2 module=$3
  local stamp="$FERRY_TOOLS/.$name.version"
  if [ -x "$FERRY_TOOLS/$name" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
    return
  fi
  log "go install $module@$version (into $FERRY_TOOLS)"
  GOBIN="$FERRY_TOOLS" GOFLAGS=-buildvcs=false go install "$module@$version"
  echo "$version" >"$stamp"
}

# moto_venv: moto[server] $MOTO_VERSION in a venv outside the repository, unless already there.
MOTO_VERSION=5.2.5
moto_venv() {
  local venv
  venv="$(dirname "$FERRY_TOOLS")/venv"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$MOTO_VERSION')" 2>/dev/null; then
    return
  fi
  command -v python3 >/dev/null || { echo "setup: python3 (with venv) is required for moto" >&2; exit 1; }
  log "pip install moto[server]==$MOTO_VERSION (into $venv)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q "moto[server]==$MOTO_VERSION"
}

install_debian_packages
check_toolchains
go_tool versitygw "$VERSITYGW_VERSION" github.com/versity/versitygw/cmd/versitygw
if [ "$demo" = 1 ]; then
  log "demo tools ready in $FERRY_TOOLS"
  exit 0
fi
go_tool csi-sanity "$CSI_SANITY_VERSION" github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity
go_tool promtool "$PROMTOOL_VERSION" github.com/prometheus/prometheus/cmd/promtool
# etcd, kube-apiserver, kube-controller-manager, csi-provisioner, helm v4 and v3 (the chart check and
# the Kubernetes-level e2e)
FERRY_TOOLS="$FERRY_TOOLS" "$(dirname "$0")/kube-tools.sh"
moto_venv
log "tools ready in $FERRY_TOOLS"
