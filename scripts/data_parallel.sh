#!/usr/bin/env bash
# One engine server running RANKS data-parallel ranks behind one URL (a fresh
# `prefixlb mock-engine --data-parallel-size RANKS`: a 30,000-token cache per rank,
# ranks taken in turn by requests that name none, as a server's own balancer ignores
# the cache), driven by `prefixlb bench` (WORKLOAD, streaming, concurrency 16, answers
# of 16 tokens) through:
#   prefixlb-split   the node with `data_parallel_size = RANKS`: a node per rank, each
#                    request naming its rank in `x-data-parallel-rank`
#   prefixlb-one     the server as one node of `weight = RANKS` (the same total cap)
#   vllm-session     vLLM's router, `--intra-node-data-parallel-size RANKS`,
#                    consistent_hash, bench sending each conversation's id in x-session-id
#   vllm             vLLM's router, `--intra-node-data-parallel-size RANKS`, cache_aware
# Prints the hit rate the engine reports and TTFT p50/p99 per router and seed.
#
# Usage: scripts/data_parallel.sh   (builds prefixlb; installs vllm-router in a venv)
#   RANKS=8 WORKLOAD=multi-turn SEEDS="1 2" ROUTERS="prefixlb-split prefixlb-one vllm-session vllm"
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${RANKS:-8}
WORKLOAD=${WORKLOAD:-multi-turn}
SEEDS=${SEEDS:-"1 2"}
ROUTERS=${ROUTERS:-"prefixlb-split prefixlb-one vllm-session vllm"}
NODES=1
BASE_PORT=${BASE_PORT:-19700}
cargo build --release --bin prefixlb >/dev/null
B=target/release/prefixlb
E=$B
# shellcheck source=scripts/lib/routers.sh
. scripts/lib/routers.sh
begin
port=$((BASE_PORT + 90))

start_prefixlb_with() { # NODE_LINE: prefixlb's defaults, the one node with this line
  {
    printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "$port" $((port + 1))
    printf '[[pools]]\nname = "mock"\nmodels = ["mock"]\n'
    printf '[[pools.nodes]]\nid = "e0"\nurl = "http://127.0.0.1:%s"\n%s\n' "$BASE_PORT" "$1"
  } > "$WORK/prefixlb.toml"
  $B serve --config "$WORK/prefixlb.toml" > "$WORK/prefixlb.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$((port + 1))/readyz"
}

start_vllm_ranks() { # POLICY: vLLM's router, aware of the server's ranks
  "$VLLM_VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" \
    --worker-urls "http://127.0.0.1:$BASE_PORT" --intra-node-data-parallel-size "$RANKS" \
    --policy "$1" --log-level warning --prometheus-port $((BASE_PORT + 92)) > "$WORK/vllm.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health"
}

printf '%-15s %5s %9s %7s %8s %8s\n' router seed errors hit "p50 ms" "p99 ms"
for seed in $SEEDS; do
  for r in $ROUTERS; do
    engines --cache-tokens 30000 --prefill-us-per-token 50 --data-parallel-size "$RANKS" \
      --max-num-seqs 512
    SESSION=()
    case $r in
      prefixlb-split) start_prefixlb_with "data_parallel_size = $RANKS" ;;
      prefixlb-one) start_prefixlb_with "weight = $RANKS" ;;
      vllm-session)
        start_vllm_ranks consistent_hash
        SESSION=(--session-header x-session-id)
        ;;
      vllm) start_vllm_ranks cache_aware ;;
    esac
    out=$($B bench --target "http://127.0.0.1:$port" --workload "$WORKLOAD" --concurrency 16 \
      --stream --max-tokens 16 --seed "$seed" "${SESSION[@]}" --json 2>/dev/null)
    stop
    python3 -c '
import json, sys
r = json.loads(sys.argv[1])
print("%-15s %5s %9d %6.1f%% %8.0f %8.0f" % (sys.argv[2], sys.argv[3], r["errors"],
      100 * r["hit_rate"], r["ttft_p50_ms"], r["ttft_p99_ms"]))' "$out" "$r" "$seed"
  done
done
