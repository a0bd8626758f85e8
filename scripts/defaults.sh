#!/usr/bin/env bash
# Regenerates the tables of docs/evidence.md ("Why these defaults"): the hit rate and TTFT
# p50 of prefixlb (one routing setting changed from the defaults per row; "replicas"
# rows run 2 balancer replicas, each with its own state; `key = "prefix"` rows at three
# hand-tuned prefix_chars, "a; b" setting two keys) and of the reference policies (also
# cache_aware and oracle under the cap of 16, beside prefixlb's max_in_flight = 16 row),
# per workload, on 8 engines with 30,000 cached tokens each (first argument to change),
# each number the mean over workload seeds 1, 2 and 3.
# Usage: cargo build --release && ./scripts/defaults.sh [CACHE_TOKENS] [WORKLOAD...]
# The default workloads are the five original ones; `production` stands for the long
# preambles inside the first user message and the completions-API chats; `continuations`
# for the production-shaped prompt strings and their variants (run it with a cache of
# 2048000: its prompts average 12,000 tokens).
# P99=1 adds each TTFT p99 (cells read "hit / p50 / p99 ms"); continuations sets it.
set -euo pipefail
B=${B:-./target/release/prefixlb}
P99=${P99:-0}
CACHE=${1:-30000}
shift || true
SEEDS=(1 2 3)
WORKLOADS=("$@")
if [[ ${#WORKLOADS[@]} -eq 0 ]]; then
  WORKLOADS=(multi-turn shared-prefix rag agentic multi-tenant)
elif [[ ${WORKLOADS[0]} == production ]]; then
  WORKLOADS=(long-preamble-512 long-preamble-2048 long-preamble-8192
    long-preamble-512-completions long-preamble-2048-completions
    long-preamble-8192-completions multi-turn-completions)
elif [[ ${WORKLOADS[0]} == continuations ]]; then
  WORKLOADS=(continuations continuations-no-preamble continuations-preamble-4096
    continuations-20 continuations-60 continuations-busy)
  P99=1
fi
variants=(
  '(defaults: key = "hybrid", max_in_flight = 4)'
  'replicas: 2, round-robin'
  'replicas: 2, random'
  'key = "conversation"'
  'key = "prefix"'
  'key = "prefix"; prefix_chars = 256'
  'key = "prefix"; prefix_chars = 4096'
  'key = "prefix"; prefix_chars = 16384'
  'prefix_chars = 256'
  'prefix_chars = 4096'
  'max_in_flight = 8'
  'max_in_flight = 16'
  'max_in_flight = 32'
  'load_factor = 1.25'
)

# mean "hit% / TTFT p50 ms" of one policy over the seeds
cell() {
  local config=$1 workload=$2 policy=$3
  shift 3
  for seed in "${SEEDS[@]}"; do
    $B simulate --config "$config" --workload "$workload" --nodes 8 --cache-tokens "$CACHE" \
      --seed "$seed" --policies "$policy" --json "$@"
  done | python3 -c '
import json, sys
text, dec, runs, at = sys.stdin.read(), json.JSONDecoder(), [], 0
while text[at:].strip():
    doc, at = dec.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
    runs.append(doc["policies"][0])
mean = lambda k: sum(r[k] for r in runs) / len(runs)
if sys.argv[1] == "1":
    print("%.1f%% / %.0f / %.0f ms" % (100 * mean("hit_rate"), mean("ttft_p50_ms"), mean("ttft_p99_ms")))
else:
    print("%.1f%% / %.0f ms" % (100 * mean("hit_rate"), mean("ttft_p50_ms")))' "$P99"
}

config_with() {
  local f
  f=$(mktemp)
  case $1 in
    \(* | replicas*) printf '[[pools]]\nname = "sim"\nnodes = [{ id = "a", url = "http://127.0.0.1:1" }]\n' > "$f" ;;
    # "a; b" sets two keys.
    *) printf '[routing]\n%s\n[[pools]]\nname = "sim"\nnodes = [{ id = "a", url = "http://127.0.0.1:1" }]\n' "${1//; /$'\n'}" > "$f" ;;
  esac
  echo "$f"
}

flags_of() {
  case $1 in
    'replicas: 2, round-robin') echo "--replicas 2 --spread round-robin" ;;
    'replicas: 2, random') echo "--replicas 2 --spread random" ;;
    *) echo "" ;;
  esac
}

header="| routing |"
rule="|---|"
for w in "${WORKLOADS[@]}"; do header="$header $w |"; rule="$rule---|"; done
echo "$header"
echo "$rule"
for v in "${variants[@]}"; do
  f=$(config_with "$v")
  row="| \`$v\` |"
  [[ $v == \(* || $v == replicas* ]] && row="| $v |"
  # shellcheck disable=SC2046
  for w in "${WORKLOADS[@]}"; do row="$row $(cell "$f" "$w" prefixlb $(flags_of "$v")) |"; done
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
# The references under the larger cap, for the max_in_flight = 16 row.
f=$(config_with 'max_in_flight = 16')
for p in cache_aware oracle; do
  row="| policy \`$p\`, \`max_in_flight = 16\` |"
  for w in "${WORKLOADS[@]}"; do row="$row $(cell "$f" "$w" "$p") |"; done
  echo "$row"
done
rm -f "$f"
