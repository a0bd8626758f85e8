#!/usr/bin/env bash
# prefixlb against SGLang's own router (the `sglang-router` wheel from PyPI, Rust,
# policy cache_aware) and vLLM's (the `vllm-router` wheel, Rust, forked from SGLang's),
# all in front of the same kind of fleet: 8 fresh `prefixlb mock-engine`s per run
# (30,000-token caches, PREFILL_US µs per uncached prompt token), driven by `prefixlb
# bench` (streaming, concurrency CONC, answers capped at MAX_TOKENS).
# Prints, per workload and router, the hit rate the engines report (cached_tokens over
# prompt_tokens) and TTFT p50/p90/p99. prefixlb runs with its shipped defaults (a config
# naming only the pool and its nodes).
#
# The routers (ROUTERS):
#   prefixlb       its shipped defaults
#   prefixlb-cap8  `max_in_flight = 8` instead of the design's 4 (these engines run up
#                  to 64 sequences each, a slowdown of 2 % for each other one)
#   sglang         SGLang's router, cache_aware
#   vllm           vLLM's router, cache_aware (its default policy)
#   vllm-session   vLLM's router, consistent_hash, with bench sending each
#                  conversation's id in `x-session-id` (the setup its docs recommend
#                  for chat; a client must have and send a session id for it)
#   round-robin    bench spreading requests over the engines itself
#
# Usage: scripts/vs_sglang_router.sh   (builds prefixlb, installs the peers in venvs)
#   WORKLOADS="multi-turn doc-qa agentic"
#   ROUTERS="prefixlb prefixlb-cap8 sglang vllm vllm-session round-robin"
#   SEEDS="1 2 3"
#   CONC=16 MAX_TOKENS=16 PREFILL_US=50 CACHE=30000 SCALE=1 REQUESTS=all NODES=8
#   DECODE_MS=  (the engines' decode ms per token; unset: mock-engine's default)
#   STREAM=1    (0: answers whole, TTFT then being the whole answer's time)
# A continuations workload replays as completions prompts: e.g.
#   WORKLOADS=continuations CACHE=2048000 SCALE=0.05 CONC=12 MAX_TOKENS=64
# and saturated, in its three forms (docs/evidence.md, "As token ids, and saturated"):
#   NODES=4 CACHE=200000 PREFILL_US=5 DECODE_MS=0 STREAM=0 CONC=16 REQUESTS=3000 \
#   WORKLOADS="continuations continuations-tokens continuations-generate" \
#   ROUTERS="prefixlb prefixlb-cap8 sglang" SEEDS="1 2" scripts/vs_sglang_router.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORKLOADS=${WORKLOADS:-"multi-turn doc-qa agentic"}
ROUTERS=${ROUTERS:-"prefixlb prefixlb-cap8 sglang vllm vllm-session round-robin"}
SCALE=${SCALE:-1}
REQUESTS=${REQUESTS:-all}
SEEDS=${SEEDS:-"1"}
CONC=${CONC:-16}
MAX_TOKENS=${MAX_TOKENS:-16}
PREFILL_US=${PREFILL_US:-50}
CACHE=${CACHE:-30000}
NODES=${NODES:-8}
DECODE_MS=${DECODE_MS:-}
STREAM=${STREAM:-1}
BASE_PORT=${BASE_PORT:-19500}
# B=path/to/prefixlb runs another build (an older one, to see what a change changed).
if [ -z "${B:-}" ]; then
  B=target/release/prefixlb
  cargo build --release --bin prefixlb >/dev/null
fi
E=$B
# shellcheck source=scripts/lib/routers.sh
. scripts/lib/routers.sh
begin

router() { # NAME: start a router in front of the engines; sets TARGETS (bench's flags)
  TARGETS="--target http://127.0.0.1:$((BASE_PORT + 90))"
  SESSION=()
  case $1 in
    round-robin)
      TARGETS=""
      for u in $(engine_urls); do TARGETS+="--target $u "; done
      ;;
    prefixlb) start_prefixlb ;;
    prefixlb-cap8) start_prefixlb 'max_in_flight = 8' ;;
    sglang) start_sglang ;;
    vllm) start_vllm cache_aware ;;
    vllm-session)
      start_vllm consistent_hash
      SESSION=(--session-header x-session-id)
      ;;
  esac
}

printf '%-14s %-13s %5s %9s %8s %8s %8s %8s\n' workload router seed requests errors hit "p50 ms" "p99 ms"
for w in $WORKLOADS; do
  for seed in $SEEDS; do
    for r in $ROUTERS; do
      decode=()
      [ -z "$DECODE_MS" ] || decode=(--decode-ms-per-token "$DECODE_MS")
      engines --cache-tokens "$CACHE" --prefill-us-per-token "$PREFILL_US" "${decode[@]}"
      router "$r"
      limit=()
      [ "$REQUESTS" = all ] || limit=(--requests "$REQUESTS")
      stream=()
      [ "$STREAM" = 0 ] || stream=(--stream)
      # shellcheck disable=SC2086
      out=$($B bench $TARGETS --workload "$w" --concurrency "$CONC" "${stream[@]}" --scale "$SCALE" \
        --max-tokens "$MAX_TOKENS" --seed "$seed" "${limit[@]}" "${SESSION[@]}" --json 2>/dev/null)
      stop
      python3 -c '
import json, sys
r = json.loads(sys.argv[1])
print("%-14s %-13s %5s %9d %8d %7.1f%% %8.0f %8.0f" % (sys.argv[2], sys.argv[3], sys.argv[4],
      r["requests"], r["errors"], 100 * r["hit_rate"], r["ttft_p50_ms"], r["ttft_p99_ms"]))
with open(sys.argv[5], "a") as f:
    f.write(json.dumps({"workload": sys.argv[2], "router": sys.argv[3], **r}) + "\n")' \
        "$out" "$w" "$r" "$seed" "$WORK/runs.jsonl"
    done
  done
done

# The same, as the README's markdown table: means over the seeds.
echo
python3 - "$WORK/runs.jsonl" "$SEEDS" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
seeds = sys.argv[2].split()
print(f"| workload | router | hit rate | TTFT p50 ms | TTFT p99 ms | errors |")
print("|---|---|---|---|---|---|")
order = []
for r in runs:
    if (r["workload"], r["router"]) not in order:
        order.append((r["workload"], r["router"]))
for w, router in order:
    mine = [r for r in runs if r["workload"] == w and r["router"] == router]
    mean = lambda k: statistics.mean(r[k] for r in mine)
    name = {"prefixlb-cap8": "prefixlb, max_in_flight = 8",
            "sglang": "SGLang router (cache_aware)", "vllm": "vLLM router (cache_aware)",
            "vllm-session": "vLLM router (consistent_hash, x-session-id)",
            "round-robin": "round robin"}.get(router, router)
    print(f"| {w} | {name} | {100 * mean('hit_rate'):.1f} % | {mean('ttft_p50_ms'):.0f} | "
          f"{mean('ttft_p99_ms'):.0f} | {sum(r['errors'] for r in mine)} |")
print(f"\nmeans over seeds {', '.join(seeds)}")
EOF
