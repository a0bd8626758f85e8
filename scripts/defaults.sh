#!/usr/bin/env bash
# Regenerates the tables of docs/evidence.md ("Why these defaults"): the hit rate and TTFT p50 of
# prefixlb (one routing setting changed from the defaults per row) and of the reference
# policies, per workload, on 8 engines with 30,000 cached tokens each (--cache-tokens to
# change), each number the mean over workload seeds 1, 2 and 3.
# Usage: cargo build --release && ./scripts/defaults.sh [CACHE_TOKENS]
set -euo pipefail
B=${B:-./target/release/prefixlb}
CACHE=${1:-30000}
SEEDS=(1 2 3)
WORKLOADS=(multi-turn shared-prefix rag agentic multi-tenant)
variants=(
  '(defaults: key = "hybrid", max_in_flight = 16)'
  'key = "conversation"'
  'key = "prefix"'
  'prefix_chars = 256'
  'prefix_chars = 4096'
  'max_in_flight = 4'
  'max_in_flight = 8'
  'max_in_flight = 32'
  'load_factor = 1.25'
  'vnodes = 40'
  'vnodes = 640'
)

# mean "hit% / TTFT p50 ms" of one policy over the seeds
cell() {
  local config=$1 workload=$2 policy=$3
  for seed in "${SEEDS[@]}"; do
    $B simulate --config "$config" --workload "$workload" --nodes 8 --cache-tokens "$CACHE" \
      --seed "$seed" --policies "$policy" --json
  done | python3 -c '
import json, sys
text, dec, runs, at = sys.stdin.read(), json.JSONDecoder(), [], 0
while text[at:].strip():
    doc, at = dec.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
    runs.append(doc["policies"][0])
hit = sum(r["hit_rate"] for r in runs) / len(runs)
ttft = sum(r["ttft_p50_ms"] for r in runs) / len(runs)
print("%.1f%% / %.0f ms" % (100 * hit, ttft))'
}

config_with() {
  local f
  f=$(mktemp)
  case $1 in
    \(*) printf '[[pools]]\nname = "sim"\nnodes = [{ id = "a", url = "http://127.0.0.1:1" }]\n' > "$f" ;;
    *) printf '[routing]\n%s\n[[pools]]\nname = "sim"\nnodes = [{ id = "a", url = "http://127.0.0.1:1" }]\n' "$1" > "$f" ;;
  esac
  echo "$f"
}

printf "| routing | %s |\n|---|---|---|---|---|---|\n" "$(IFS='|'; echo "${WORKLOADS[*]}" | sed 's/|/ | /g')"
for v in "${variants[@]}"; do
  f=$(config_with "$v")
  row="| \`$v\` |"
  [[ $v == \(* ]] && row="| $v |"
  for w in "${WORKLOADS[@]}"; do row="$row $(cell "$f" "$w" prefixlb) |"; done
  echo "$row"
  rm -f "$f"
done
f=$(config_with '(defaults)')
for p in round_robin least_loaded consistent_hash chwbl cache_aware oracle; do
  row="| policy \`$p\` |"
  for w in "${WORKLOADS[@]}"; do row="$row $(cell "$f" "$w" "$p") |"; done
  echo "$row"
done
rm -f "$f"
