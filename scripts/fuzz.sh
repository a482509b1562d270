#!/usr/bin/env bash
# Coverage-guided fuzzing of Ferry's parsers of untrusted input (fuzz/README.md), with libFuzzer
# on the stable toolchain: the fuzz crate is built with the flags cargo-fuzz passes, minus the
# nightly-only sanitizer.
#
#   scripts/fuzz.sh build                 build every target
#   scripts/fuzz.sh list                  the targets
#   scripts/fuzz.sh run TARGET SECONDS [libFuzzer flags…]
#                                         fuzz TARGET, new inputs into fuzz/corpus/TARGET
#   scripts/fuzz.sh replay [TARGET…]      run every corpus and regression file once
#   scripts/fuzz.sh smoke [SECONDS]       replay, then every target for SECONDS (default 15)
#   scripts/fuzz.sh merge TARGET DIR…     minimise DIR… into fuzz/corpus/TARGET
#
# Any crash fails the command; libFuzzer leaves the input in fuzz/artifacts/TARGET/ (`run`, `replay`,
# `merge`) or $CARGO_TARGET_DIR/crash-TARGET-* (`smoke`, which leaves the tree clean). Environment:
# CARGO_TARGET_DIR (default target/fuzz under the repository).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
fuzz="$root/fuzz"
# Absolute: the build runs in fuzz/ and the logs are written from the caller's directory, so a
# relative CARGO_TARGET_DIR (the test command passes target/fuzz on a clean checkout) would name two
# different places.
CARGO_TARGET_DIR=$(realpath -m "${CARGO_TARGET_DIR:-$root/target/fuzz}")
export CARGO_TARGET_DIR
mkdir -p "$CARGO_TARGET_DIR"
triple=$(rustc -vV | sed -n 's/^host: //p')
bin="$CARGO_TARGET_DIR/$triple/release"

# cargo-fuzz's flags (project.rs), those a stable rustc takes: SanitizerCoverage's 8-bit counters,
# PC table and comparison tracing for libFuzzer, `cfg(fuzzing)`, debug assertions and overflow
# checks. No `-Zsanitizer=address` (nightly only): Ferry's parsers are safe Rust. `--target`
# keeps the flags off build scripts and proc macros, which are not linked with libFuzzer.
flags=(
    --cfg fuzzing
    -Cpasses=sancov-module
    -Cllvm-args=-sanitizer-coverage-level=4
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters
    -Cllvm-args=-sanitizer-coverage-pc-table
    -Cllvm-args=-sanitizer-coverage-trace-compares
    -Cllvm-args=-sanitizer-coverage-stack-depth
    -Cdebug-assertions
    -Coverflow-checks
)

# libFuzzer's limits for every target: inputs up to 64 KiB (a LIST page of 1000 keys is ~300 KiB,
# but what a parser does with 64 KiB shows what it does with more), 2 GiB of memory, and a single
# input taking over 10 s is a hang.
limits=(-max_len=65536 -rss_limit_mb=2048 -timeout=10)

targets() {
    sed -n 's/^name = "\(.*\)"$/\1/p' "$fuzz/Cargo.toml" | grep -v '^ferry-fuzz$'
}

build() {
    (cd "$fuzz" && RUSTFLAGS="${flags[*]}" CARGO_INCREMENTAL=0 \
        cargo build --release --locked --target "$triple" --bins)
}

# Every file of the target's corpus and regressions, run once (libFuzzer runs file arguments);
# a failing input is written to ARTIFACT_PREFIX* (default fuzz/artifacts/TARGET/).
replay() {
    local t=$1 prefix=${2:-$fuzz/artifacts/$1/} files=()
    for d in "$fuzz/corpus/$t" "$fuzz/regressions/$t"; do
        [[ -d $d ]] && while IFS= read -r -d '' f; do files+=("$f"); done \
            < <(find "$d" -type f -print0)
    done
    if ((${#files[@]} == 0)); then
        echo "fuzz: $t: no corpus" >&2
        return 0
    fi
    # xargs: a corpus of thousands of files stays under the argument limit.
    mkdir -p "$(dirname "$prefix.")"
    printf '%s\0' "${files[@]}" | xargs -0 "$bin/$t" "${limits[@]}" -artifact_prefix="$prefix" 2>"$CARGO_TARGET_DIR/replay-$t.log" >/dev/null \
        || { tail -50 "$CARGO_TARGET_DIR/replay-$t.log" >&2; echo "fuzz: $t: a corpus or regression input fails" >&2; return 1; }
    echo "fuzz: $t: replayed ${#files[@]} inputs"
}

run() {
    local t=$1 secs=$2
    shift 2
    mkdir -p "$fuzz/corpus/$t" "$fuzz/artifacts/$t"
    local seeds=()
    [[ -d $fuzz/regressions/$t ]] && seeds+=("$fuzz/regressions/$t")
    "$bin/$t" "${limits[@]}" -max_total_time="$secs" -print_final_stats=1 \
        -artifact_prefix="$fuzz/artifacts/$t/" "$@" "$fuzz/corpus/$t" "${seeds[@]}"
}

cmd=${1:-smoke}
shift || true
case $cmd in
    build) build ;;
    list) targets ;;
    run)
        (($# >= 2)) || { echo "usage: $0 run TARGET SECONDS [libFuzzer flags…]" >&2; exit 2; }
        build
        run "$@"
        ;;
    replay)
        build
        (($# > 0)) || set -- $(targets)
        for t in "$@"; do replay "$t"; done
        ;;
    merge)
        (($# >= 2)) || { echo "usage: $0 merge TARGET DIR…" >&2; exit 2; }
        build
        t=$1
        shift
        mkdir -p "$fuzz/corpus/$t" "$fuzz/artifacts/$t"
        "$bin/$t" "${limits[@]}" -artifact_prefix="$fuzz/artifacts/$t/" -merge=1 "$fuzz/corpus/$t" "$@"
        ;;
    smoke)
        secs=${1:-15}
        build
        for t in $(targets); do replay "$t" "$CARGO_TARGET_DIR/crash-$t-"; done
        for t in $(targets); do
            # Fuzzing adds to a scratch copy of the corpus: a smoke run leaves the tree clean.
            scratch=$(mktemp -d)
            cp -r "$fuzz/corpus/$t/." "$scratch/" 2>/dev/null || true
            "$bin/$t" "${limits[@]}" -max_total_time="$secs" \
                -artifact_prefix="$CARGO_TARGET_DIR/crash-$t-" "$scratch" \
                >/dev/null 2>"$CARGO_TARGET_DIR/smoke-$t.log" \
                || { tail -50 "$CARGO_TARGET_DIR/smoke-$t.log" >&2; rm -rf "$scratch"; echo "fuzz: $t crashed (input in $CARGO_TARGET_DIR/crash-$t-*)" >&2; exit 1; }
            rm -rf "$scratch"
            echo "fuzz: $t: $secs s, $(grep -o 'cov: [0-9]*' "$CARGO_TARGET_DIR/smoke-$t.log" | tail -1), no crash"
        done
        ;;
    *) echo "usage: $0 [build|list|run|replay|smoke|merge] …" >&2; exit 2 ;;
esac
