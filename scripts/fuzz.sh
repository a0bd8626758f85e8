#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 300). Needs the
# nightly toolchain (rustup toolchain install nightly) and cargo-fuzz (installed here
# if absent). Not part of .ci/run. Crashes land in fuzz/artifacts/TARGET/; add each as
# a regression test in tests/fuzz_regressions.rs.
#   scripts/fuzz.sh              # all targets, 5 minutes each
#   SECONDS_EACH=60 scripts/fuzz.sh sse_scanner
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${SECONDS_EACH:-300}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=(routing_key sse_scanner body_edit config multipart_form)
fi
mkdir -p fuzz/corpus
failed=()
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    # Seed the corpus with real bodies and configs.
    case $t in
        routing_key|body_edit) cp tests/fixtures/fuzz/*.json "fuzz/corpus/$t/" 2>/dev/null || true ;;
        config) cp config/prefixlb.toml "fuzz/corpus/$t/shipped.toml" ;;
        multipart_form) cp tests/fixtures/fuzz/*.form "fuzz/corpus/$t/" ;;
    esac
    echo "== $t for ${SECONDS_EACH}s"
    if (cd fuzz && cargo +nightly fuzz run "$t" -- -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048) >"fuzz/$t.log" 2>&1; then
        grep -E "^Done" "fuzz/$t.log" || true
    else
        failed+=("$t")
        grep -E "panicked|assertion|SUMMARY|Test unit written" "fuzz/$t.log" | head -5
    fi
    echo "corpus: $(ls "fuzz/corpus/$t" | wc -l) inputs"
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "crashes in: ${failed[*]} (inputs in fuzz/artifacts/)"
    exit 1
fi
