#!/usr/bin/env bash
# Does a router send a conversation's next turn to the engine that holds it, when that
# engine is not the least loaded? Through prefixlb, SGLang's router (cache_aware) and
# vLLM's router (its default cache_aware), each in front of NODES fresh `prefixlb
# mock-engine`s. TRIALS times, with a conversation of its own each time: a long request
# (256 output tokens, about 2.6 s) is sent first and keeps one engine busy; turn 1 of
# the conversation is sent while it runs; once it has ended (every engine idle), turn 2
# (turn 1, its answer and a new user message) is sent. Prints, per router, how many
# turn 2s went to turn 1's engine and the prompt tokens those engines found cached.
# A router that places by load alone sends turn 2 to whichever engine its tie-break
# names; one that follows the conversation sends it back.
#
# Usage: scripts/follow_conversation.sh   (builds prefixlb, installs the peers in venvs)
#   ROUTERS="prefixlb sglang vllm" TRIALS=8 NODES=4
#   SHOW_TRIALS=1 prints each trial's engines under its router's row
set -euo pipefail
cd "$(dirname "$0")/.."
ROUTERS=${ROUTERS:-"prefixlb sglang vllm"}
TRIALS=${TRIALS:-8}
NODES=${NODES:-4}
BASE_PORT=${BASE_PORT:-19500}
cargo build --release --bin prefixlb >/dev/null
B=target/release/prefixlb
E=$B
# shellcheck source=scripts/lib/routers.sh
. scripts/lib/routers.sh
begin

cat > "$WORK/follow.py" <<'EOF'
import json, sys, threading, time, urllib.request
url, trials = sys.argv[1], int(sys.argv[2])

def post(messages, max_tokens):
    body = {"model": "mock", "messages": messages, "max_tokens": max_tokens}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        v = json.load(r)
        return r.headers.get("x-engine-id"), v

def text(tag):
    return " ".join(f"{tag}w{i}" for i in range(100))

followed, cached = 0, 0
for t in range(trials):
    busy = threading.Thread(target=post, args=([{"role": "user", "content": text(f"busy{t}")}], 256))
    busy.start()
    time.sleep(0.3)
    messages = [{"role": "user", "content": text(f"t{t}a")}]
    first, v = post(messages, 4)
    busy.join()
    messages += [{"role": "assistant", "content": v["choices"][0]["message"]["content"]},
                 {"role": "user", "content": text(f"t{t}b")}]
    second, v = post(messages, 4)
    followed += first == second
    cached += v["usage"].get("prompt_tokens_details", {}).get("cached_tokens") or 0
    print(f"  trial {t}: turn 1 on {first}, turn 2 on {second}", file=sys.stderr)
print(f"{followed}/{trials} {cached}")
EOF

printf '%-10s %-22s %s\n' router "turn 2 on turn 1's" "turn 2s' cached prompt tokens"
for router in $ROUTERS; do
  engines
  case $router in
    prefixlb) start_prefixlb ;;
    sglang) start_sglang ;;
    vllm) start_vllm cache_aware ;;
    *) echo "unknown router $router" >&2; exit 2 ;;
  esac
  read -r followed cached < <(python3 "$WORK/follow.py" "http://127.0.0.1:$((BASE_PORT + 90))" "$TRIALS" 2>"$WORK/$router.trials")
  printf '%-10s %-22s %s\n' "$router" "$followed" "$cached"
  [ -z "${SHOW_TRIALS:-}" ] || cat "$WORK/$router.trials"
  stop
done
