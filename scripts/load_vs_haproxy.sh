#!/usr/bin/env bash
# prefixlb vs HAProxy, same load, same machine, one run: 2 zero-latency mock engines
# behind each, `wrk` POSTing chat bodies of ~1 KB and ~18 KB with 32 and 256
# connections, the two proxies alternating, ROUNDS rounds. Prints requests/s, p50/p99
# latency and proxy CPU seconds per 1,000 requests (from /proc), and the ratios.
#   scripts/load_vs_haproxy.sh                  # 3 rounds of 10 s per cell
#   ROUNDS=1 DURATION=5 scripts/load_vs_haproxy.sh
#   ROUNDS=12 DURATION=3 scripts/load_vs_haproxy.sh   # more, shorter rounds: steadier ratios
#   LOAD_FACTOR=off scripts/load_vs_haproxy.sh        # prefixlb without the relative bound
#   BODIES=1k CONNS=32 ROUNDS=30 DURATION=3 scripts/load_vs_haproxy.sh   # one cell, many rounds
#   ENGINES=nginx ROUNDS=12 DURATION=3 scripts/load_vs_haproxy.sh      # engines that cost nothing
#   SGLANG=1 scripts/load_vs_haproxy.sh         # SGLang's router (cache_aware) as a third column
#   BARE=1 scripts/load_vs_haproxy.sh           # the floor as a third column: hyper's server
#     and client with nothing of ours between them (examples/bare_proxy.rs, two lanes)
#   LANES=0 scripts/load_vs_haproxy.sh          # prefixlb with server.lanes = 0 (default "auto")
#   YIELD_AFTER=0s scripts/load_vs_haproxy.sh   # prefixlb with server.yield_after = "0s" (default "750us")
#   HAPROXY_PIN=1 scripts/load_vs_haproxy.sh    # HAProxy's threads pinned too (cpu-map),
#     as prefixlb pins its serving threads by default (server.pin_threads = "auto")
#   ENGINE_THREADS=1 scripts/load_vs_haproxy.sh  # each mock engine on one tokio worker
#     (TOKIO_WORKER_THREADS; unset: one per CPU), an engine with one event loop
#   TLS=1 scripts/load_vs_haproxy.sh            # both proxies terminate HTTPS (a self-signed
#     P-256 certificate; server.tls_cert_file, HAProxy's `ssl crt`); wrk speaks TLS
# ENGINES=mock (the default): two zero-latency `mock-engine`s, which parse JSON and
# build answers on the same cores (every ratio is squeezed toward 1). ENGINES=nginx:
# two nginx servers (one worker each, no access log) answering every POST with a
# fixed chat completion, so the proxies' own cost shows (nginx-light is installed
# from Debian's packages if absent).
# HAProxy is configured as its users would for prefix affinity: the whole body
# buffered, hashed on its first 1,024 bytes, consistent hashing with bounded loads
# (`hash-balance-factor 125`). prefixlb gets the same bound, `load_factor = 1.25`, so
# that both spread the one hot key over both engines the same way; with
# `LOAD_FACTOR=off` prefixlb sends all of it to one engine (the cap never binds).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10}
THREADS=${THREADS:-2}
LOAD_FACTOR=${LOAD_FACTOR:-1.25}
ENGINES=${ENGINES:-mock}
SGLANG=${SGLANG:-0}
BARE=${BARE:-0}
THIRD=""
SCHEME=http
if [ "${TLS:-0}" = 1 ]; then
    if [ "$SGLANG" = 1 ] || [ "$BARE" = 1 ]; then echo "TLS=1 compares prefixlb and HAProxy alone" >&2; exit 2; fi
    SCHEME=https
fi
if [ "$SGLANG" = 1 ]; then THIRD=sglang; fi
if [ "$BARE" = 1 ]; then
    if [ -n "$THIRD" ]; then echo "SGLANG=1 and BARE=1: one third column at a time" >&2; exit 2; fi
    THIRD=bare
fi
LANES=${LANES:-auto}
VENV=${VENV:-target/sglang-venv}
BODIES=${BODIES:-1k 18k}
CONNS=${CONNS:-32 256}
WORK=${WORK:-target/load}
mkdir -p "$WORK"
# shellcheck source=scripts/lib/proxies.sh
. scripts/lib/proxies.sh

need_proxies
need wrk wrk

# B=path/to/prefixlb measures another build (e.g. the one before a change).
if [ -z "${B:-}" ]; then cargo build --release --quiet; fi
if [ "$THIRD" = bare ]; then cargo build --release --quiet --example bare_proxy; fi
BIN=${B:-target/release/prefixlb}

start_engines

write_configs
write_bodies
RUST_LOG=warn "$BIN" serve --config "$WORK/prefixlb.toml" >/dev/null 2>&1 &
LB_PID=$!
PIDS+=($LB_PID)

haproxy -f "$WORK/haproxy.cfg" -db >/dev/null 2>&1 &
HA_PID=$!
PIDS+=($HA_PID)
if [ "$SGLANG" = 1 ]; then
    # SGLang's router (the sglang-router wheel, Rust) as its users run it for prefix
    # affinity: policy cache_aware over the same two engines.
    if ! [ -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
    "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null ||
        "$VENV/bin/pip" install -q --disable-pip-version-check sglang-router
    "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port 19182 \
        --worker-urls http://127.0.0.1:19200 http://127.0.0.1:19201 --policy cache_aware \
        --log-level warn >"$WORK/sglang.log" 2>&1 &
    THIRD_PID=$!
    PIDS+=($THIRD_PID)
    for _ in $(seq 1 300); do
        curl -fsS -o /dev/null http://127.0.0.1:19182/health 2>/dev/null && break
        sleep 0.1
    done
    # The router's own process (python execs into its Rust extension: same pid).
elif [ "$THIRD" = bare ]; then
    target/release/examples/bare_proxy 127.0.0.1:19182 127.0.0.1:19200 127.0.0.1:19201 &
    THIRD_PID=$!
    PIDS+=($THIRD_PID)
fi
sleep 1

cpu_s() { # utime + stime of a pid, in seconds
    awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$1/stat"
}

run() { # proxy-name port pid body conns -> "rps p50_ms p99_ms cpu_per_1k"
    local before after out rps p50 p99 reqs
    before=$(cpu_s "$3")
    out=$(wrk -t"$THREADS" -c"$5" -d"${DURATION}s" --latency -s "$WORK/$4.lua" "$SCHEME://127.0.0.1:$2/v1/chat/completions")
    after=$(cpu_s "$3")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    reqs=$(echo "$out" | awk '/requests in/ {print $1}')
    p50=$(echo "$out" | awk '$1 == "50%" {print $2}')
    p99=$(echo "$out" | awk '$1 == "99%" {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $4}')
    python3 - "$rps" "$p50" "$p99" "$before" "$after" "$reqs" "${non2xx:-0}" <<'EOF'
import sys
def ms(v):
    for unit, f in (("us", 0.001), ("ms", 1.0), ("s", 1000.0)):
        if v.endswith(unit):
            return float(v[: -len(unit)]) * f
    return float(v)
rps, p50, p99, before, after, reqs, bad = sys.argv[1:]
print(f"{float(rps):.0f} {ms(p50):.2f} {ms(p99):.2f} {(float(after) - float(before)) / max(int(reqs), 1) * 1000:.3f} {bad}")
EOF
}

echo
echo "engines: $ENGINES, clients over $SCHEME"
echo "round body conns | prefixlb rps p50 p99 cpu/1k | haproxy rps p50 p99 cpu/1k$([ -n "$THIRD" ] && echo " | $THIRD rps p50 p99 cpu/1k")"
for round in $(seq "$ROUNDS"); do
    for body in $BODIES; do
        for conns in $CONNS; do
            # Who goes first alternates by round, so neither always follows the other.
            if (( round % 2 )); then
                a=$(run prefixlb 19180 "$LB_PID" "$body" "$conns")
                b=$(run haproxy 19181 "$HA_PID" "$body" "$conns")
            else
                b=$(run haproxy 19181 "$HA_PID" "$body" "$conns")
                a=$(run prefixlb 19180 "$LB_PID" "$body" "$conns")
            fi
            if [ -n "$THIRD" ]; then
                c=$(run "$THIRD" 19182 "$THIRD_PID" "$body" "$conns")
                echo "$round $body $conns | $a | $b | $c" | tee -a "$WORK/rows.txt"
            else
                echo "$round $body $conns | $a | $b" | tee -a "$WORK/rows.txt"
            fi
        done
    done
done

echo
echo "== medians over $ROUNDS rounds (rps, p50 ms, p99 ms, CPU s per 1,000 requests; ratio = prefixlb / haproxy)"
CELLS=$(( ROUNDS * $(echo $BODIES | wc -w) * $(echo $CONNS | wc -w) ))
python3 - "$WORK/rows.txt" "$CELLS" "$THIRD" <<'EOF'
import math, statistics, sys
rows = [l.split() for l in open(sys.argv[1]).read().splitlines()][-int(sys.argv[2]):]

def median_range(xs):
    # A distribution-free 95 % interval for the median: the k-th smallest and k-th
    # largest of n values, k the largest rank with P(Binomial(n, 1/2) < k) <= 2.5 %
    # (n = 12: the 3rd and the 10th, 96 % coverage). Too few rounds: the whole range.
    xs, n = sorted(xs), len(xs)
    k, below = 0, 0.0
    while below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]

cells = {}
for r in rows:
    key = (r[1], int(r[2]))
    a = [float(x) for x in r[4:8]]
    b = [float(x) for x in r[10:14]]
    c = [float(x) for x in r[16:20]] if len(r) >= 20 else None
    cells.setdefault(key, []).append((a, b, c))
print(f"{'body':>5} {'conns':>5} | {'prefixlb rps':>12} {'p50':>7} {'p99':>7} {'cpu/1k':>7} | {'haproxy rps':>11} {'p50':>7} {'p99':>7} {'cpu/1k':>7} | {'rps x':>6} {'p99 x':>6} | {'paired':>6} {'95% range':>11} {'won':>5}")
for (body, conns), runs in sorted(cells.items()):
    med = lambda side, i: statistics.median(r[side][i] for r in runs)
    a = [med(0, i) for i in range(4)]
    b = [med(1, i) for i in range(4)]
    # Each round's two cells ran back to back: their ratio cancels the machine's
    # slower spells better than the ratio of the medians does.
    ratios = [r[0][0] / r[1][0] for r in runs]
    paired = statistics.median(ratios)
    lo, hi = median_range(ratios)
    won = sum(r[0][0] > r[1][0] for r in runs)
    print(f"{body:>5} {conns:>5} | {a[0]:>12.0f} {a[1]:>7.2f} {a[2]:>7.2f} {a[3]:>7.3f} | {b[0]:>11.0f} {b[1]:>7.2f} {b[2]:>7.2f} {b[3]:>7.3f} | {a[0] / b[0]:>6.2f} {a[2] / b[2]:>6.2f} | {paired:>6.2f} {lo:>5.2f}-{hi:<5.2f} {won:>2}/{len(runs):<2}")
print("paired: the median of the rounds' prefixlb/haproxy throughput ratios; 95% range: where that median")
print("lies, from the rounds alone (a range holding 1.00 cannot tell the two apart); won: rounds prefixlb was faster")
if all(r[2] for runs in cells.values() for r in runs):
    print()
    third = sys.argv[3]
    print(f"{'body':>5} {'conns':>5} | {third + ' rps':>10} {'p50':>7} {'p99':>7} {'cpu/1k':>7} | {'prefixlb/' + third:>15} {'95% range':>11} {'won':>5}")
    for (body, conns), runs in sorted(cells.items()):
        c = [statistics.median(r[2][i] for r in runs) for i in range(4)]
        ratios = [r[0][0] / r[2][0] for r in runs]
        paired = statistics.median(ratios)
        lo, hi = median_range(ratios)
        won = sum(r[0][0] > r[2][0] for r in runs)
        print(f"{body:>5} {conns:>5} | {c[0]:>10.0f} {c[1]:>7.2f} {c[2]:>7.2f} {c[3]:>7.3f} | {paired:>15.2f} {lo:>5.2f}-{hi:<5.2f} {won:>2}/{len(runs):<2}")
    what = {
        "sglang": "SGLang's router, policy cache_aware",
        "bare": "hyper's server and client with nothing of prefixlb's between them (examples/bare_proxy.rs)",
    }[third]
    print(f"{third}: {what}; prefixlb/{third}: the median of the rounds' throughput ratios")
EOF
echo "prefixlb's requests per engine (HAProxy's split the same hot key by the same rule):"
curl -s "http://127.0.0.1:19190/metrics" | awk -F'[{}" ]' '/^prefixlb_requests_total\{node="e/ {print "  " $3 ": " $NF}'
