#!/usr/bin/env bash
# Run every fuzz target (or the ones named) for SECONDS each (default 10).
#
#   fuzz/smoke.sh [SECONDS] [TARGET...]
#
# With a nightly toolchain and cargo-fuzz installed, this is real coverage-guided libFuzzer
# (`cargo +nightly fuzz run`, AddressSanitizer). Otherwise (or with FUZZ_MODE=stable) each
# target is built on the default toolchain as a plain binary that mutates seed inputs at
# random (see src/stable.rs): much weaker, but it runs anywhere and still catches decoder
# panics and roundtrip breaks. Exit status is non-zero if any target fails; crashing inputs
# are saved under fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")"

secs=${1:-10}
shift || true
if [ $# -gt 0 ]; then
    targets=("$@")
else
    targets=()
    for f in fuzz_targets/*.rs; do targets+=("$(basename "$f" .rs)"); done
fi

mode=${FUZZ_MODE:-auto}
if [ "$mode" = auto ]; then
    if rustup toolchain list 2>/dev/null | grep -q '^nightly' && cargo fuzz --version >/dev/null 2>&1; then
        mode=libfuzzer
    else
        mode=stable
    fi
fi

failed=()
if [ "$mode" = libfuzzer ]; then
    echo "smoke: libFuzzer via cargo +nightly fuzz, ${secs}s per target"
    for t in "${targets[@]}"; do
        mkdir -p "corpus/$t"
        # New inputs go to corpus/ (ignored by git); seeds/ holds the committed valid encodings.
        if ! cargo +nightly fuzz run "$t" "corpus/$t" "seeds/$t" -- -max_total_time="$secs" -print_final_stats=1 2>"artifacts-$t.log"; then
            tail -n 30 "artifacts-$t.log" >&2
            failed+=("$t")
        else
            grep -E 'stat::number_of_executed_units|Done [0-9]+ runs' "artifacts-$t.log" | tail -n 1 | sed "s/^/$t: /"
        fi
        rm -f "artifacts-$t.log"
    done
else
    echo "smoke: stable random-mutation driver (no coverage guidance), ${secs}s per target"
    cargo build --release --no-default-features --bins --quiet
    # Where cargo put them: CARGO_TARGET_DIR (absolute, or relative to fuzz/) or fuzz/target.
    bins=${CARGO_TARGET_DIR:-target}/release
    for t in "${targets[@]}"; do
        "$bins/$t" "$secs" || failed+=("$t")
    done
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "smoke: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "smoke: all ${#targets[@]} targets passed"
