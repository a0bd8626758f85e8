#!/usr/bin/env bash
# A disaggregated fleet: PREFILL prefill engines and DECODE decode engines (fresh
# `prefixlb mock-engine`s: a 30,000-token cache each, 50 µs a prefilled token),
# driven by `prefixlb bench` (WORKLOADS, streaming, concurrency 16, answers of 16
# tokens). PD=vllm (the default): the engines speak vLLM's KV-connector params, and
# the routers are
#   prefixlb       a pool with `disaggregation = "vllm"` and the shipped defaults (each
#                  decode engine capped at routing.max_in_flight, 4, like every node)
#   prefixlb-decode64  the same with `decode_max_in_flight = 64`
#   vllm           vLLM's router, `--vllm-pd-disaggregation`, cache_aware (its default)
#   vllm-session   the same, consistent_hash, bench sending each conversation's id in
#                  x-session-id
#   vllm-rr        the same, round_robin
# PD=sglang: the engines run `--disaggregation-mode prefill|decode` (SGLang's
# bootstrap rooms: a decode engine pulls the KV cache from the room its prefill engine
# keeps once it has prefilled), and the routers are
#   prefixlb, prefixlb-decode64  as above, with `disaggregation = "sglang"`
#   sglang         SGLang's router, `--pd-disaggregation`, cache_aware
#   sglang-rr      the same, round_robin
# Prints, per router and seed, the prefill engines' hit rate (prompt tokens their
# prefix caches served, read from their /metrics: where the prefix cache pays in a
# disaggregated fleet), TTFT p50/p99 as the client saw it (prefill, transfer and the
# first decoded token) and errors; then each decode engine's pulls, to show every
# request was decoded with params a prefill engine answered.
#
# Usage: scripts/disaggregated.sh   (builds prefixlb; installs vllm-router in a venv)
#   PREFILL=4 DECODE=2 WORKLOADS="multi-turn doc-qa" SEEDS="1 2"
#   ROUTERS="prefixlb prefixlb-decode64 vllm vllm-session vllm-rr"
#   PD=sglang ROUTERS="prefixlb prefixlb-decode64 sglang sglang-rr"
set -euo pipefail
cd "$(dirname "$0")/.."
PD=${PD:-vllm}
PREFILL=${PREFILL:-4}
DECODE=${DECODE:-2}
WORKLOADS=${WORKLOADS:-"multi-turn doc-qa"}
SEEDS=${SEEDS:-"1"}
case $PD in
  vllm) ROUTERS=${ROUTERS:-"prefixlb prefixlb-decode64 vllm vllm-session vllm-rr"} ;;
  sglang) ROUTERS=${ROUTERS:-"prefixlb prefixlb-decode64 sglang sglang-rr"} ;;
  *) echo "PD=$PD: vllm or sglang" >&2; exit 2 ;;
esac
BASE_PORT=${BASE_PORT:-19800}
NODES=$PREFILL
if [ -z "${B:-}" ]; then
  cargo build --release --bin prefixlb >/dev/null
  B=target/release/prefixlb
fi
E=$B
# shellcheck source=scripts/lib/routers.sh
. scripts/lib/routers.sh
begin
port=$((BASE_PORT + 90))
prefill_url() { echo "http://127.0.0.1:$((BASE_PORT + $1))"; }
decode_url() { echo "http://127.0.0.1:$((BASE_PORT + 50 + $1))"; }

fleet() { # fresh prefill and decode engines
  local flags=(--cache-tokens 30000 --prefill-us-per-token 50) p=() d=()
  if [ "$PD" = sglang ]; then
    p=(--disaggregation-mode prefill)
    d=(--disaggregation-mode decode)
  fi
  for i in $(seq 0 $((PREFILL - 1))); do
    $E mock-engine --listen "127.0.0.1:$((BASE_PORT + i))" --id "p$i" "${flags[@]}" "${p[@]}" >/dev/null 2>&1 &
    pids+=($!)
  done
  for j in $(seq 0 $((DECODE - 1))); do
    $E mock-engine --listen "127.0.0.1:$((BASE_PORT + 50 + j))" --id "d$j" "${flags[@]}" "${d[@]}" >/dev/null 2>&1 &
    pids+=($!)
  done
  for i in $(seq 0 $((PREFILL - 1))); do wait_http "$(prefill_url "$i")/health"; done
  for j in $(seq 0 $((DECODE - 1))); do wait_http "$(decode_url "$j")/health"; done
}

start_prefixlb_pd() { # [POOL_LINE]: the shipped defaults, or with this line in the pool
  {
    printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "$port" $((port + 1))
    printf '[[pools]]\nname = "mock"\nmodels = ["mock"]\ndisaggregation = "%s"\n%s\n' "$PD" "${1:-}"
    for i in $(seq 0 $((PREFILL - 1))); do
      printf '[[pools.nodes]]\nid = "p%s"\nurl = "%s"\nrole = "prefill"\n' "$i" "$(prefill_url "$i")"
      # A mock engine's bootstrap server is its HTTP port.
      [ "$PD" = sglang ] && printf 'bootstrap_port = %s\n' $((BASE_PORT + i))
    done
    for j in $(seq 0 $((DECODE - 1))); do
      printf '[[pools.nodes]]\nid = "d%s"\nurl = "%s"\nrole = "decode"\n' "$j" "$(decode_url "$j")"
    done
  } > "$WORK/prefixlb.toml"
  $B serve --config "$WORK/prefixlb.toml" > "$WORK/prefixlb.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$((port + 1))/readyz"
}

start_vllm_pd() { # POLICY
  local args=()
  for i in $(seq 0 $((PREFILL - 1))); do args+=(--prefill "$(prefill_url "$i")"); done
  for j in $(seq 0 $((DECODE - 1))); do args+=(--decode "$(decode_url "$j")"); done
  "$VLLM_VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" --vllm-pd-disaggregation \
    "${args[@]}" --policy "$1" --log-level warning \
    --prometheus-port $((BASE_PORT + 92)) > "$WORK/vllm.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health"
}

start_sglang_pd() { # POLICY
  local args=()
  for i in $(seq 0 $((PREFILL - 1))); do args+=(--prefill "$(prefill_url "$i")" $((BASE_PORT + i))); done
  for j in $(seq 0 $((DECODE - 1))); do args+=(--decode "$(decode_url "$j")"); done
  "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$port" \
    --pd-disaggregation "${args[@]}" --policy "$1" --log-level warn \
    --prometheus-port $((BASE_PORT + 92)) > "$WORK/sglang.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health"
}

metric_sum() { # NAME URL...: the sum of a counter over engines' /metrics
  local name=$1 total=0 v
  shift
  for u in "$@"; do
    v=$(curl -fsS "$u/metrics" | awk -v n="$name" '$1 ~ "^"n"({|$)" {s += $2} END {print s + 0}')
    total=$(python3 -c "print($total + $v)")
  done
  echo "$total"
}

printf '%-12s %-17s %5s %9s %7s %12s %8s %8s %7s\n' workload router seed requests errors "prefill hit" "p50 ms" "p99 ms" pulls
for w in $WORKLOADS; do
  for seed in $SEEDS; do
    for r in $ROUTERS; do
      fleet
      SESSION=()
      case $r in
        prefixlb) start_prefixlb_pd ;;
        prefixlb-decode64) start_prefixlb_pd 'decode_max_in_flight = 64' ;;
        vllm) start_vllm_pd cache_aware ;;
        vllm-session)
          start_vllm_pd consistent_hash
          SESSION=(--session-header x-session-id)
          ;;
        vllm-rr) start_vllm_pd round_robin ;;
        sglang) start_sglang_pd cache_aware ;;
        sglang-rr) start_sglang_pd round_robin ;;
      esac
      out=$($B bench --target "http://127.0.0.1:$port" --workload "$w" --concurrency 16 --stream \
        --max-tokens 16 --seed "$seed" "${SESSION[@]}" --json 2>/dev/null)
      prefills=()
      for i in $(seq 0 $((PREFILL - 1))); do prefills+=("$(prefill_url "$i")"); done
      hits=$(metric_sum 'vllm:prefix_cache_hits_total' "${prefills[@]}")
      queries=$(metric_sum 'vllm:prefix_cache_queries_total' "${prefills[@]}")
      pulls=0
      for j in $(seq 0 $((DECODE - 1))); do
        n=$(curl -fsS "$(decode_url "$j")/mock/kv_transfers" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["consumed"]))')
        pulls=$((pulls + n))
      done
      stop
      python3 -c '
import json, sys
r = json.loads(sys.argv[1])
hits, queries = float(sys.argv[5]), float(sys.argv[6])
print("%-12s %-17s %5s %9d %7d %11.1f%% %8.0f %8.0f %7s" % (sys.argv[2], sys.argv[3], sys.argv[4],
      r["requests"], r["errors"], 100 * hits / max(queries, 1), r["ttft_p50_ms"], r["ttft_p99_ms"], sys.argv[7]))' \
        "$out" "$w" "$r" "$seed" "$hits" "$queries" "$pulls"
    done
  done
done
