#!/usr/bin/env bash
# Installs the mounters ferry-bench compares Ferry with, idempotently, outside the repository:
#   - Debian packages: s3fs, rclone (+ fuse3 for its mount), fio (P6), cmake/clang/libfuse3-dev
#     (to build Mountpoint's CRT and FUSE bindings);
#   - mount-s3-bench: our own small main on Mountpoint's library crates (crates.io has no mount-s3
#     CLI), a throwaway crate in $FERRY_TOOLS_ROOT/src/mountpoint-bench, installed into bin/;
#   - s3s-fs (a third S3 server for `ferry-bench --server s3s-fs`: the s3s project's server over
#     a directory, written in Rust) from crates.io;
#   - rclone-s3 (a fourth, for `ferry-bench --server rclone`: rclone 1.75's `serve s3`) from the
#     Go module proxy;
#   - geesefs and goofys from the Go module proxy (a wrapper module for geesefs, which needs its
#     fork replaces). Where a peer cannot be had, the script says why and goes on; ferry-bench then
#     marks its column n/a.
# Safe to run again: a peer already installed at the pinned version is kept.
set -uo pipefail

ROOT=${FERRY_TOOLS_ROOT:-$HOME/.cache/ferry-tools}
BIN=$ROOT/bin
SRC=$ROOT/src
MOUNTPOINT_FS_VERSION=0.11.0
MOUNTPOINT_CLIENT_VERSION=0.22.0
# 0.14.1: the newest s3s-fs that builds with the repository's Rust (1.95; 0.17 needs 1.96).
S3S_FS_VERSION=0.14.1
RCLONE_S3_VERSION=v1.75.0
GEESEFS_VERSION=v0.43.8-0.20260629110924-6e2bbab58e82
GOOFYS_VERSION=v0.24.1-0.20230621224748-350ff312abaa
mkdir -p "$BIN" "$SRC"
HERE=$(cd "$(dirname "$0")" && pwd)

log() { printf '\033[1m[setup-peers]\033[0m %s\n' "$*" >&2; }
failed=()

if [ "$(id -u)" -ne 0 ]; then
  echo "setup-peers: run as root (apt-get, FUSE): sudo $0" >&2
  exit 1
fi

# --- Debian packages -------------------------------------------------------------------------
missing=()
command -v s3fs >/dev/null || missing+=(s3fs)
command -v rclone >/dev/null || missing+=(rclone)
command -v fusermount3 >/dev/null || missing+=(fuse3)
command -v fio >/dev/null || missing+=(fio)
command -v cmake >/dev/null || missing+=(cmake)
command -v clang >/dev/null || missing+=(clang libclang-dev)
pkg-config --exists fuse3 2>/dev/null || missing+=(libfuse3-dev pkg-config)
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" \
    || failed+=("apt-get install ${missing[*]}")
fi

# --- mount-s3-bench (Mountpoint's libraries + our main) --------------------------------------
stamp=$BIN/.mount-s3-bench.version
want="fs-$MOUNTPOINT_FS_VERSION client-$MOUNTPOINT_CLIENT_VERSION $(sha256sum "$HERE/mountpoint-bench/main.rs" | cut -c1-16)"
if [ -x "$BIN/mount-s3-bench" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  log "mount-s3-bench is up to date"
else
  log "building mount-s3-bench on mountpoint-s3-fs $MOUNTPOINT_FS_VERSION (the CRT build takes several minutes)"
  crate=$SRC/mountpoint-bench
  mkdir -p "$crate/src"
  cp "$HERE/mountpoint-bench/main.rs" "$crate/src/main.rs"
  cat >"$crate/Cargo.toml" <<EOF
[package]
name = "mountpoint-bench"
version = "0.0.0"
edition = "2024"
publish = false

[[bin]]
name = "mount-s3-bench"
path = "src/main.rs"

[dependencies]
mountpoint-s3-fs = "=$MOUNTPOINT_FS_VERSION"
mountpoint-s3-client = "=$MOUNTPOINT_CLIENT_VERSION"
anyhow = "1"

[profile.release]
debug = "line-tables-only"

[workspace]
EOF
  if (cd "$crate" && CARGO_TARGET_DIR="$ROOT/target" cargo build --release --jobs 2); then
    install -m 0755 "$ROOT/target/release/mount-s3-bench" "$BIN/mount-s3-bench"
    echo "$want" >"$stamp"
  else
    failed+=("mount-s3-bench (cargo build in $crate)")
  fi
fi

# --- s3s-fs (a third S3 server for ferry-bench --server s3s-fs) --------------------------------
stamp=$BIN/.s3s-fs.version
if [ -x "$BIN/s3s-fs" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$S3S_FS_VERSION" ]; then
  log "s3s-fs is up to date"
else
  log "building s3s-fs $S3S_FS_VERSION"
  if CARGO_TARGET_DIR="$ROOT/target" cargo install --locked "s3s-fs@$S3S_FS_VERSION" \
      --features binary --root "$ROOT/s3s-fs" --jobs 2; then
    install -m 0755 "$ROOT/s3s-fs/bin/s3s-fs" "$BIN/s3s-fs"
    echo "$S3S_FS_VERSION" >"$stamp"
  else
    failed+=("s3s-fs $S3S_FS_VERSION (cargo install)")
  fi
fi

# --- Go peers ----------------------------------------------------------------------------------
export GOFLAGS=-buildvcs=false
go_peer() { # name version module [wrapper]
  local name=$1 version=$2 module=$3 wrapper=${4:-}
  local stamp=$BIN/.$name.version
  if [ -x "$BIN/$name" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
    log "$name is up to date"; return 0
  fi
  if ! command -v go >/dev/null; then failed+=("$name (no go toolchain)"); return 0; fi
  log "building $name $version"
  if [ -z "$wrapper" ]; then
    if GOBIN=$BIN go install "$module@$version"; then echo "$version" >"$stamp"; return 0; fi
  else
    # go install refuses modules with replace directives: build through a wrapper module that
    # copies the upstream module's module->module replaces.
    local w=$SRC/$name-wrapper gomod
    rm -rf "$w" && mkdir -p "$w"
    if gomod=$(go mod download -json "$module@$version" 2>&1); then
      local modfile
      modfile=$(printf '%s' "$gomod" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
      (cd "$w" && go mod init "$name-wrapper" >/dev/null 2>&1 \
        && { grep -E '^\s*replace .*=> [^.][^ ]* v' "$modfile" | sed 's/^\s*//' >>go.mod || true; } \
        && go get -tool "$module@$version" && go build -o "$BIN/$name" "$module") \
        && { echo "$version" >"$stamp"; return 0; }
    else
      echo "$gomod" >&2
    fi
  fi
  failed+=("$name $version (see the go error above)")
}
go_peer geesefs "$GEESEFS_VERSION" github.com/yandex-cloud/geesefs wrapper
go_peer goofys "$GOOFYS_VERSION" github.com/kahing/goofys

# --- rclone-s3 (a fourth S3 server for ferry-bench --server rclone: `rclone serve s3`) ----------
# Installed under its own name: the rclone mounter column runs Debian's /usr/bin/rclone (1.60,
# which has no `serve s3`).
stamp=$BIN/.rclone-s3.version
if [ -x "$BIN/rclone-s3" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$RCLONE_S3_VERSION" ]; then
  log "rclone-s3 is up to date"
elif ! command -v go >/dev/null; then
  failed+=("rclone-s3 (no go toolchain)")
else
  log "building rclone $RCLONE_S3_VERSION (serve s3)"
  if GOBIN=$ROOT/rclone-s3 go install "github.com/rclone/rclone@$RCLONE_S3_VERSION"; then
    install -m 0755 "$ROOT/rclone-s3/rclone" "$BIN/rclone-s3"
    echo "$RCLONE_S3_VERSION" >"$stamp"
  else
    failed+=("rclone-s3 $RCLONE_S3_VERSION (go install)")
  fi
fi

if [ ${#failed[@]} -gt 0 ]; then
  log "not installed (ferry-bench marks these n/a):"
  for f in "${failed[@]}"; do log "  - $f"; done
fi
log "peers in $BIN: $(ls "$BIN" | tr '\n' ' ')"
exit 0
