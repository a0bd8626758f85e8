#!/usr/bin/env bash
# User-space instructions per request of each proxy, counted by callgrind: the same
# engines, configurations and chat bodies as load_vs_haproxy.sh, each proxy run under
# valgrind twice (N1 and then N2 requests, from 4 keep-alive connections) and the
# difference divided by N2 - N1, so start-up and warm-up cancel out. Counts do not
# swing with the machine's load the way requests per second do: this is how a change
# to the request path is measured on a shared 2-core host. Instructions are not time
# (kernel work, cache misses and wake-ups are not in them): load_vs_haproxy.sh says
# what they buy.
#   scripts/instructions_per_request.sh                  # 1 KB body: prefixlb, HAProxy, bare hyper
#   BODIES="1k 18k" scripts/instructions_per_request.sh
#   PROXIES=prefixlb TOP=30 scripts/instructions_per_request.sh   # and prefixlb's 30 costliest functions
#   B=path/to/prefixlb PROXIES=prefixlb scripts/instructions_per_request.sh   # another build
#   LOG=info PROXIES=prefixlb scripts/instructions_per_request.sh   # with the request line
#   LOCKS=1 PROXIES=prefixlb TOP=20 scripts/instructions_per_request.sh   # and the
#     locked (atomic) instructions per request, by function (scripts/lib/locked_per_request.py)
#     (prefixlb's default level; the log goes to a file; the default here is warn)
# PROXIES: any of prefixlb (LANES=2 by default: what load_vs_haproxy.sh's "auto" starts on 2 cores), haproxy
# (2.6, the configuration of load_vs_haproxy.sh) and bare (examples/bare_proxy.rs:
# hyper's server and client with nothing of prefixlb's between them).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINES=${ENGINES:-nginx}
LANES=${LANES:-2}
LOAD_FACTOR=${LOAD_FACTOR:-1.25}
BODIES=${BODIES:-1k}
PROXIES=${PROXIES:-prefixlb haproxy bare}
N1=${N1:-300}
N2=${N2:-1300}
TOP=${TOP:-0}
LOCKS=${LOCKS:-0}
LOG=${LOG:-warn}
WORK=${WORK:-target/instructions}
mkdir -p "$WORK"
# shellcheck source=scripts/lib/proxies.sh
. scripts/lib/proxies.sh

need valgrind valgrind
need_proxies
if [ -z "${B:-}" ]; then cargo build --release --quiet; fi
cargo build --release --quiet --example bare_proxy
BIN=${B:-target/release/prefixlb}
start_engines
write_configs
write_bodies 2>/dev/null

# Exactly N POSTs of a body (a wrk script's), from 4 keep-alive connections; every
# answer must be a 200.
send() { # port body n
    python3 - "$1" "$WORK/$2.lua" "$3" <<'EOF'
import http.client, json, sys, threading
port, lua, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
body = json.loads(open(lua).read().split("wrk.body = ", 1)[1]).encode()
bad = []
def client(k):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(k):
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            bad.append(r.status)
threads = [threading.Thread(target=client, args=(n // 4,)) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
if bad:
    sys.exit(f"{len(bad)} answers were not 200: {sorted(set(bad))}")
EOF
}

# Runs a proxy under callgrind for n requests; prints the profile's path.
profile() { # proxy port body n
    local out="$WORK/$1.$3.$4.callgrind" pid
    case $1 in
        prefixlb) set -- "$@" "$BIN" serve --config "$WORK/prefixlb.toml" ;;
        haproxy) set -- "$@" haproxy -f "$WORK/haproxy.cfg" -db ;;
        bare) set -- "$@" target/release/examples/bare_proxy 127.0.0.1:19182 127.0.0.1:19200 127.0.0.1:19201 ;;
    esac
    local port=$2 body=$3 n=$4
    shift 4
    local dump=()
    if [ "$LOCKS" = 1 ]; then dump=(--dump-instr=yes); fi
    RUST_LOG=$LOG valgrind --tool=callgrind "${dump[@]}" --callgrind-out-file="$out" "$@" >"$out.log" 2>&1 &
    pid=$!
    # Ready once a request goes through.
    for _ in $(seq 1 300); do
        curl -fsS -o /dev/null -H 'content-type: application/json' \
            -d '{"model":"mock","messages":[{"role":"user","content":"hi"}]}' \
            "http://127.0.0.1:$port/v1/chat/completions" 2>/dev/null && break
        sleep 0.2
    done
    send "$port" "$body" "$n"
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
    echo "$out"
}

port_of() { case $1 in prefixlb) echo 19180 ;; haproxy) echo 19181 ;; bare) echo 19182 ;; esac; }
binary_of() { case $1 in prefixlb) echo "$BIN" ;; haproxy) command -v haproxy ;; bare) echo target/release/examples/bare_proxy ;; esac; }

echo "engines: $ENGINES; instructions per request = (total at $N2 requests - total at $N1) / $((N2 - N1))"
for body in $BODIES; do
    for proxy in $PROXIES; do
        a=$(profile "$proxy" "$(port_of "$proxy")" "$body" "$N1")
        b=$(profile "$proxy" "$(port_of "$proxy")" "$body" "$N2")
        python3 - "$proxy" "$body" "$a" "$b" "$((N2 - N1))" "$TOP" <<'EOF'
import re, subprocess, sys
proxy, body, a, b, n, top = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
def functions(path):
    out = subprocess.run(["callgrind_annotate", "--threshold=100", "--auto=no", path],
                         capture_output=True, text=True, check=True).stdout
    costs = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\([^)]*\)\s+(.*)", line)
        if m:
            name = re.sub(r"\s*\[.*\]$", "", re.sub(r"/root/\.cargo/registry/src/[^/]+/|/rustc/[0-9a-f]+/", "", m.group(2)))
            costs[name] = costs.get(name, 0) + int(m.group(1).replace(",", ""))
    return costs
fa, fb = functions(a), functions(b)
per = lambda k: (fb.get(k, 0) - fa.get(k, 0)) / n
print(f"{proxy:>9} {body:>4}: {per('PROGRAM TOTALS'):>9,.0f} instructions per request")
if top:
    rows = sorted(((per(k), k) for k in set(fa) | set(fb) if k != "PROGRAM TOTALS"), reverse=True)
    for v, k in rows[:top]:
        print(f"{v:>12,.0f}  {k[:140]}")
EOF
        if [ "$LOCKS" = 1 ]; then
            python3 scripts/lib/locked_per_request.py "$(binary_of "$proxy")" "$a" "$b" "$((N2 - N1))" "$TOP"
        fi
    done
done
