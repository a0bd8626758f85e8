#!/usr/bin/env bash
# Conversations chained by the Responses API's `previous_response_id` through prefixlb,
# SGLang's router (the `sglang-router` wheel from PyPI, policy cache_aware), vLLM's
# router (the `vllm-router` wheel, its default cache_aware) and round robin, each in
# front of NODES fresh `prefixlb mock-engine`s, which keep every response in their own
# memory as vLLM does (an engine that does not hold a response answers 404).
# CONVS conversations of TURNS turns, CONC at a time, each turn's input its own random
# text. A conversation ends at its first error. Prints, per router: turns served,
# conversations lost (and the statuses that lost them), and the share of prompt tokens
# the engines found cached.
#
# Usage: scripts/stored_responses.sh   (builds prefixlb, installs the peers in venvs)
#   ROUTERS="prefixlb sglang vllm round-robin" SEEDS="1 2 3" CONVS=32 TURNS=6 CONC=8 NODES=4
#   B=path/to/prefixlb runs another build as the router (the engines stay this
#   checkout's: an older build's mock-engine has no Responses API).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUTERS=${ROUTERS:-"prefixlb sglang vllm round-robin"}
SEEDS=${SEEDS:-"1 2 3"}
CONVS=${CONVS:-32}
TURNS=${TURNS:-6}
CONC=${CONC:-8}
NODES=${NODES:-4}
BASE_PORT=${BASE_PORT:-19600}
cargo build --release --bin prefixlb >/dev/null
E=target/release/prefixlb
B=${B:-$E}
# shellcheck source=scripts/lib/routers.sh
. scripts/lib/routers.sh
begin

router() { # NAME: start a router in front of the engines; sets URLS (the client's targets)
  URLS="http://127.0.0.1:$((BASE_PORT + 90))"
  case $1 in
    round-robin) URLS=$(engine_urls) ;;
    prefixlb) start_prefixlb ;;
    sglang) start_sglang ;;
    vllm) start_vllm cache_aware ;;
  esac
}

cat > "$WORK/chain.py" <<'EOF'
# CONVS conversations chained by previous_response_id, CONC at a time; round robin
# over the URLs given (one URL: a router).
import itertools, json, random, sys, threading, urllib.error, urllib.request
urls, seed, convs, turns, conc = sys.argv[1].split(), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rotation = itertools.cycle(urls)
lock = threading.Lock()
st = {"served": 0, "lost": 0, "cached": 0, "prompt": 0, "statuses": {}}
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

def post(body):
    with lock:
        url = next(rotation)
    req = urllib.request.Request(url + "/v1/responses", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return 200, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None

def conversation(n):
    rnd = random.Random(seed * 100_000 + n)
    previous = None
    for _ in range(turns):
        body = {"model": "mock", "input": " ".join(rnd.choice(words) for _ in range(120)),
                "max_output_tokens": 4}
        if previous:
            body["previous_response_id"] = previous
        status, r = post(body)
        with lock:
            if status != 200:
                st["lost"] += 1
                st["statuses"][status] = st["statuses"].get(status, 0) + 1
                return
            st["served"] += 1
            st["prompt"] += r["usage"]["input_tokens"]
            st["cached"] += r["usage"]["input_tokens_details"]["cached_tokens"]
        previous = r["id"]

for start in range(0, convs, conc):
    ts = [threading.Thread(target=conversation, args=(n,)) for n in range(start, min(convs, start + conc))]
    for t in ts: t.start()
    for t in ts: t.join()
print(json.dumps(st))
EOF

printf '%-12s %5s %14s %20s %8s\n' router seed "turns served" "conversations lost" cached
for seed in $SEEDS; do
  for r in $ROUTERS; do
    engines --decode-ms-per-token 2
    router "$r"
    out=$(python3 "$WORK/chain.py" "$URLS" "$seed" "$CONVS" "$TURNS" "$CONC")
    stop
    python3 -c '
import json, sys
s = json.loads(sys.argv[1]); total = int(sys.argv[4]) * int(sys.argv[5])
lost = "%d %s" % (s["lost"], s["statuses"] or "")
print("%-12s %5s %14s %20s %7.1f%%" % (sys.argv[2], sys.argv[3], "%d/%d" % (s["served"], total),
      lost, 100 * s["cached"] / max(s["prompt"], 1)))' "$out" "$r" "$seed" "$CONVS" "$TURNS"
  done
done
