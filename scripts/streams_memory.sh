#!/usr/bin/env bash
# Memory per open stream (issue 28): the balancer's resident memory with no stream, with
# STREAMS streams open at once, and after they all end. Four mock engines at 40 ms per
# output token; each client opens a streamed chat of TOKENS output tokens through the
# balancer (its cap raised so none queues), all at once, reads it to the end and checks
# it is whole ("data: [DONE]"). Prints RSS (VmRSS) and the peak (VmHWM) of the
# balancer, and its in-flight count after.
#   scripts/streams_memory.sh                 # 1,000 streams of 100 tokens
#   STREAMS=2000 TOKENS=100 scripts/streams_memory.sh
#   GOAL_MB=50 (the default): exits 1 if the peak is above it, a stream is cut short or
#     a request is still in flight after
#   B=path/to/prefixlb scripts/streams_memory.sh     # another build
#   WRAP="heaptrack -o target/streams" B=… scripts/streams_memory.sh   # under a profiler
#     (a build without mimalloc, which heaptrack cannot see; RSS lines then read the
#     wrapper's, the profile has the balancer's)
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${STREAMS:-1000}
TOKENS=${TOKENS:-100}
GOAL_MB=${GOAL_MB:-50}
WORK=${WORK:-target/streams-memory}
mkdir -p "$WORK"
if [ -z "${B:-}" ]; then
    cargo build --release --quiet
    B=target/release/prefixlb
fi
BIN=$B
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
ulimit -n 65536 2>/dev/null || true

NODES=""
for i in 0 1 2 3; do
    "$BIN" mock-engine --listen "127.0.0.1:1930$i" --id "e$i" --decode-ms-per-token 40 \
        --max-num-seqs 1000 >/dev/null 2>&1 &
    PIDS+=($!)
    NODES+="[[pools.nodes]]
id = \"e$i\"
url = \"http://127.0.0.1:1930$i\"
"
done
cat >"$WORK/prefixlb.toml" <<EOF
[server]
listen = "127.0.0.1:19380"
admin_listen = "127.0.0.1:19390"
max_connections = 100000
[routing]
max_in_flight = 100000
[[pools]]
name = "mock"
models = ["mock"]
$NODES
EOF
RUST_LOG=warn ${WRAP:-} "$BIN" serve --config "$WORK/prefixlb.toml" >/dev/null 2>&1 &
LB=$!
PIDS+=($LB)
for _ in $(seq 100); do
    curl -sf http://127.0.0.1:19390/healthz >/dev/null && break
    sleep 0.1
done

mem() { awk '/^(VmRSS|VmHWM):/ {printf "%s %.1f MB  ", $1, $2 / 1024}' "/proc/$LB/status"; echo; }
echo "idle:        $(mem)"
python3 - "$STREAMS" "$TOKENS" "$LB" <<'EOF'
import asyncio, json, sys, time
n, tokens, lb = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

def rss():
    for l in open(f"/proc/{lb}/status"):
        if l.startswith("VmRSS:"):
            return int(l.split()[1]) / 1024

async def one(i, opened, peak):
    r, w = await asyncio.open_connection("127.0.0.1", 19380)
    body = json.dumps({"model": "mock", "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": f"stream {i}: " + "tell me more " * 20}]})
    w.write(f"POST /v1/chat/completions HTTP/1.1\r\nhost: lb\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}".encode())
    await w.drain()
    first = await r.read(1)
    opened.append(i)
    if len(opened) == n:
        peak.append(rss())
    data = first + await r.read()
    w.close()
    return b"data: [DONE]" in data

async def main():
    opened, peak = [], []
    t = time.time()
    ok = await asyncio.gather(*(one(i, opened, peak) for i in range(n)))
    print(f"all {n} streams open at once: RSS {peak[0] if peak else float('nan'):.1f} MB; "
          f"{sum(ok)} of {n} whole in {time.time() - t:.1f} s")
    sys.exit(0 if sum(ok) == n else 1)
asyncio.run(main())
EOF
sleep 1
echo "after:       $(mem)"
IN_FLIGHT=$(curl -s http://127.0.0.1:19390/metrics | awk '/^prefixlb_in_flight/ {s += $2} END {print s}')
echo "in flight:   $IN_FLIGHT"
PEAK_KB=$(awk '/^VmHWM:/ {print $2}' "/proc/$LB/status")
if [ "$IN_FLIGHT" != 0 ]; then echo "FAIL: $IN_FLIGHT still in flight"; exit 1; fi
if [ "$PEAK_KB" -gt $((GOAL_MB * 1024)) ]; then
    echo "FAIL: peak $((PEAK_KB / 1024)) MB is above the goal of $GOAL_MB MB"
    exit 1
fi
echo "ok: peak $((PEAK_KB / 1024)) MB, at most $GOAL_MB MB"
