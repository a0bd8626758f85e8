# Shared by the scripts that put prefixlb beside HAProxy (load_vs_haproxy.sh,
# instructions_per_request.sh): the engines, both proxies' configurations and the
# chat bodies, so that every comparison measures the same setup. Sourced; expects
# WORK, ENGINES (nginx|mock), BIN, LANES and LOAD_FACTOR set; ROUTING_EXTRA adds lines
# to prefixlb's [routing] (e.g. 'tenant_header = "x-tenant"'), SERVER_EXTRA to its
# [server] (e.g. 'request_ids = false'). Every process started is put in PIDS and
# stopped on exit.

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# Installs a Debian package for a missing command.
need() {
    command -v "$1" >/dev/null && return
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$2" >/dev/null
}

# HAProxy, and nginx when the engines are nginx.
need_proxies() {
    need haproxy haproxy
    if [ "$ENGINES" = nginx ]; then need nginx nginx-light; fi
}

# Two engines on 127.0.0.1:19200 and :19201 (their pids appended to PIDS). With
# ENGINE_THREADS, each mock engine runs that many tokio workers.
start_engines() {
    for i in 0 1; do
        if [ "$ENGINES" = nginx ]; then
            mkdir -p "$WORK/nginx$i"
            cat >"$WORK/nginx$i/nginx.conf" <<EOF
worker_processes 1;
daemon off;
pid $PWD/$WORK/nginx$i/nginx.pid;
error_log /dev/null crit;
events { worker_connections 4096; }
http {
    access_log off;
    client_body_temp_path $PWD/$WORK/nginx$i;
    client_max_body_size 64m;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:1920$i;
        location / {
            default_type application/json;
            return 200 '{"id":"cmpl-$i","object":"chat.completion","model":"mock","choices":[{"index":0,"message":{"role":"assistant","content":" the"},"finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":0}}}';
        }
    }
}
EOF
            nginx -p "$PWD/$WORK/nginx$i" -c "$PWD/$WORK/nginx$i/nginx.conf" >/dev/null 2>&1 &
        else
            env ${ENGINE_THREADS:+TOKIO_WORKER_THREADS=$ENGINE_THREADS} "$BIN" mock-engine --listen "127.0.0.1:1920$i" --id "e$i" \
                --decode-ms-per-token 0 --prefill-us-per-token 0 >/dev/null 2>&1 &
        fi
        PIDS+=($!)
    done
}

# A self-signed certificate for 127.0.0.1 ($WORK/tls/cert.pem, key.pem, and both in
# combined.pem for HAProxy), made with openssl.
write_certificate() {
    mkdir -p "$WORK/tls"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 7 \
        -keyout "$WORK/tls/key.pem" -out "$WORK/tls/cert.pem" -subj /CN=127.0.0.1 \
        -addext "subjectAltName=IP:127.0.0.1" 2>/dev/null
    cat "$WORK/tls/cert.pem" "$WORK/tls/key.pem" >"$WORK/tls/combined.pem"
}

# prefixlb's configuration ($WORK/prefixlb.toml, listening on 19180, admin on 19190)
# and HAProxy's ($WORK/haproxy.cfg, listening on 19181), over the two engines. With
# TLS=1 both terminate TLS on their client port (write_certificate's pair).
write_configs() {
    if [ "$LOAD_FACTOR" = off ]; then RELATIVE=""; else RELATIVE="load_factor = $LOAD_FACTOR"; fi
    # A count as is; "auto" (the balancer's default) as a TOML string.
    if [[ "$LANES" =~ ^[0-9]+$ ]]; then LANES_TOML=$LANES; else LANES_TOML="\"$LANES\""; fi
    # YIELD_AFTER: server.yield_after (unset: the balancer's default).
    local YIELD=""
    if [ -n "${YIELD_AFTER:-}" ]; then YIELD="yield_after = \"$YIELD_AFTER\""; fi
    local LB_TLS="" HA_TLS=""
    if [ "${TLS:-0}" = 1 ]; then
        write_certificate
        LB_TLS="tls_cert_file = \"$PWD/$WORK/tls/cert.pem\"
tls_key_file = \"$PWD/$WORK/tls/key.pem\""
        HA_TLS=" ssl crt $PWD/$WORK/tls/combined.pem alpn http/1.1"
    fi
    cat >"$WORK/prefixlb.toml" <<EOF
[server]
listen = "127.0.0.1:19180"
admin_listen = "127.0.0.1:19190"
lanes = $LANES_TOML
$YIELD
$LB_TLS
${SERVER_EXTRA:-}
[routing]
# High enough never to bind: this measures the proxy, not bounded loads.
max_in_flight = 100000
${ROUTING_EXTRA:-}
# HAProxy's hash-balance-factor 125 (unless LOAD_FACTOR=off).
$RELATIVE
[[pools]]
name = "mock"
models = ["mock"]
[[pools.nodes]]
id = "e0"
url = "http://127.0.0.1:19200"
[[pools.nodes]]
id = "e1"
url = "http://127.0.0.1:19201"
EOF
    # HAPROXY_PIN=1 pins HAProxy's two threads to CPUs 0 and 1, as prefixlb pins its
    # serving threads by default (`server.pin_threads`): the two compared both pinned.
    local PIN=""
    if [ "${HAPROXY_PIN:-0}" = 1 ]; then PIN="    cpu-map auto:1/1-2 0-1"; fi
    cat >"$WORK/haproxy.cfg" <<EOF
global
    maxconn 4096
    nbthread 2
$PIN
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    option http-keep-alive
frontend fe
    bind 127.0.0.1:19181$HA_TLS
    option http-buffer-request
    default_backend engines
backend engines
    balance hash req.body,bytes(0,1024)
    hash-type consistent
    hash-balance-factor 125
    http-reuse always
    server e0 127.0.0.1:19200 maxconn 10000
    server e1 127.0.0.1:19201 maxconn 10000
EOF
}

# Two bodies as wrk scripts ($WORK/1k.lua, $WORK/18k.lua): ~1 KB and ~18 KB of chat
# (a system prompt, turns), non-streaming.
write_bodies() {
    python3 - "$WORK" <<'EOF'
import json, sys
work = sys.argv[1]
def body(n_turns, words):
    msgs = [{"role": "system", "content": "You are a helpful assistant for GPU operators. " * 4}]
    for i in range(n_turns):
        msgs.append({"role": "user", "content": f"turn {i}: " + "tell me about prefix caching " * words})
        msgs.append({"role": "assistant", "content": "It keeps the KV blocks of shared prefixes. " * words})
    msgs.append({"role": "user", "content": "and then?"})
    return json.dumps({"model": "mock", "messages": msgs, "max_tokens": 1})
for name, (turns, words) in {"1k": (1, 8), "18k": (13, 18)}.items():
    b = body(turns, words)
    with open(f"{work}/{name}.lua", "w") as f:
        f.write('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n')
        f.write("wrk.body = " + json.dumps(b) + "\n")
    print(f"{name}: {len(b)} bytes", file=sys.stderr)
EOF
}
