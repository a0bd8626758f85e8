#!/usr/bin/env python3
"""Every panel of grafana/prefixlb.json evaluated by a real Prometheus.

    python3 scripts/dashboard_check.py [target/debug/prefixlb]

Starts four mock engines, a balancer in front of them (hybrid keys, caps of 2, a queue,
two priority classes, a rate-limited tenant, SSE keep-alives on, a client certificate
for the engines) and a Prometheus server (Debian's
`prometheus`) scraping the balancer's /metrics every second. Drives demo-like traffic
through it for about 30 s: `prefixlb bench` (multi-turn, streaming, more requests than
the caps hold, so some spill and some queue), a tenant over its rate limit, Responses
API turns chained by `previous_response_id` (and some naming a response no engine
holds), and an engine that fails for a few seconds (failovers, interrupted streams, a
breaker and health changes). Then asks Prometheus for every target of every panel, with
`$__rate_interval` as Grafana would set it for a 1 s scrape (20s here), and requires
each target to return series and each panel at least one finite value. Prints one line
per target; exits 1 if any panel shows nothing. The same Prometheus loads the alerting
rules (deploy/prometheus/alerts.yaml): every rule must evaluate without error on the
balancer's real series, and the failing engine's breaker must put
PrefixlbBreakerNotClosed in `pending` for its node. Needs only the standard library.
"""

import itertools
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/debug/prefixlb"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "grafana", "prefixlb.json")
ALERTS = os.path.join(ROOT, "deploy", "prometheus", "alerts.yaml")
RATE_INTERVAL = "20s"
TRAFFIC_SECS = 30
procs = []


def start(args, env=None):
    """Starts a prefixlb process; returns it and the addresses on its first line."""
    p = subprocess.Popen(
        [BIN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "error", **(env or {})},
        text=True,
    )
    procs.append(p)
    line = p.stdout.readline()
    addrs = re.findall(r"http://([0-9.]+:[0-9]+)", line)
    if not addrs:
        raise SystemExit(f"{args[0]}: no address in {line!r}")
    return p, addrs


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, headers=None, timeout=10):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def panels():
    with open(DASHBOARD) as f:
        d = json.load(f)
    for p in d["panels"]:
        yield p["id"], p["title"], [t["expr"] for t in p.get("targets", [])]


def main():
    prometheus = shutil.which("prometheus")
    if not prometheus:
        raise SystemExit("no prometheus on this machine (Debian's package: prometheus)")
    engines = [
        start(["mock-engine", "--listen", "127.0.0.1:0", "--id", f"e{i}",
               "--decode-ms-per-token", "3", "--prefill-us-per-token", "20"])[1][0]
        for i in range(4)
    ]
    tmp = tempfile.mkdtemp(prefix="prefixlb-dashboard-")
    # A client certificate for the engines (they are plain HTTP, which does not
    # matter): its expiry is what the certificate panel shows, 90 days out.
    if not shutil.which("openssl"):
        raise SystemExit("no openssl on this machine (Debian's package: openssl)")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", os.path.join(tmp, "client-key.pem"),
         "-out", os.path.join(tmp, "client.pem"), "-days", "90",
         "-subj", "/CN=prefixlb-dashboard-check"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    nodes = "".join(f'[[pools.nodes]]\nid = "n{i}"\nurl = "http://{a}"\n' for i, a in enumerate(engines))
    config = os.path.join(tmp, "prefixlb.toml")
    with open(config, "w") as f:
        f.write(
            '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
            'sse_keepalive = "100ms"\n'
            '[tls]\nclient_cert_file = "client.pem"\nclient_key_file = "client-key.pem"\n'
            '[routing]\nkey = "hybrid"\nmax_in_flight = 2\nwhen_saturated = "queue"\n'
            'tenant_header = "x-tenant"\n'
            '[health]\ninterval = "1s"\nunhealthy_after = 1\nhealthy_after = 1\n'
            '[breaker]\nopen_for = "3s"\n'
            '[[priorities]]\nname = "interactive"\n[[priorities]]\nname = "batch"\n'
            '[[tenants]]\nname = "capped"\npriority = "batch"\nrequests_per_minute = 6\n'
            f'[[pools]]\nname = "chat"\nmodels = ["mock"]\nfirst_token_timeout = "2s"\n{nodes}'
        )
    _, (lb, admin) = start(["serve", "--config", config])

    port = free_port()
    prom_config = os.path.join(tmp, "prometheus.yml")
    with open(prom_config, "w") as f:
        f.write(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: ['{ALERTS}']\n"
            "scrape_configs:\n  - job_name: prefixlb\n    static_configs:\n"
            f"      - targets: ['{admin}']\n"
        )
    procs.append(subprocess.Popen(
        [prometheus, f"--config.file={prom_config}", f"--storage.tsdb.path={tmp}/tsdb",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ))
    prom = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if http("GET", f"{prom}/-/ready")[0] == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    else:
        raise SystemExit("prometheus did not become ready")

    # Traffic: the benchmark's conversations, more at once than the caps hold.
    bench = subprocess.Popen(
        [BIN, "bench", "--target", f"http://{lb}", "--workload", "multi-turn", "--stream",
         "--concurrency", "12", "--scale", "8", "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    procs.append(bench)
    stop = threading.Event()

    def capped_tenant():
        while not stop.is_set():
            try:
                http("POST", f"http://{lb}/v1/chat/completions",
                     {"model": "mock", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                     {"x-tenant": "capped"}, timeout=60)
            except OSError:
                pass
            time.sleep(0.5)

    threading.Thread(target=capped_tenant, daemon=True).start()

    def chained_responses():
        # Responses API conversations chained by previous_response_id (`known`), and
        # now and then one naming a response no engine holds (`missing`).
        previous = None
        for turn in itertools.count():
            if stop.is_set():
                return
            body = {"model": "mock", "input": f"turn {turn}", "max_output_tokens": 2}
            lost = turn % 5 == 4
            if lost:
                body["previous_response_id"] = "resp_nowhere"
            elif previous:
                body["previous_response_id"] = previous
            try:
                status, answer = http("POST", f"http://{lb}/v1/responses", body, timeout=60)
                if not lost:
                    previous = json.loads(answer)["id"] if status == 200 else None
            except (OSError, ValueError, KeyError):
                previous = None
            time.sleep(0.5)

    threading.Thread(target=chained_responses, daemon=True).start()
    # One engine misbehaves for a while: breaks streams mid-way, then answers 500s.
    time.sleep(6)
    fault = f"http://{engines[3]}/mock/fault"
    http("POST", fault, {"mode": "reset", "ttft_ms": 0})
    time.sleep(3)
    http("POST", fault, {"mode": "error", "ttft_ms": 0})
    # Its breaker opens: the alert on it goes pending (it fires after its `for`).
    pending = set()
    for _ in range(20):
        alerts = json.loads(http("GET", f"{prom}/api/v1/alerts")[1])["data"]["alerts"]
        pending |= {(a["labels"]["alertname"], a["labels"].get("node"), a["state"]) for a in alerts}
        time.sleep(0.2)
    http("POST", fault, {"mode": "ok", "ttft_ms": 0})
    time.sleep(TRAFFIC_SECS - 13)

    failed = []
    print(f"{'panel':<44} {'series':>6} {'finite':>6}  expr")
    for pid, title, exprs in panels():
        finite_in_panel = 0
        for expr in exprs:
            q = expr.replace("$__rate_interval", RATE_INTERVAL)
            status, body = http("GET", f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}))
            answer = json.loads(body)
            if status != 200 or answer.get("status") != "success":
                failed.append(f"panel {pid} {title}: {expr}: {answer.get('error', status)}")
                continue
            series = answer["data"]["result"]
            finite = sum(1 for s in series if math.isfinite(float(s["value"][1])))
            finite_in_panel += finite
            print(f"{pid:>2} {title[:41]:<41} {len(series):>6} {finite:>6}  {expr[:90]}")
            if not series:
                failed.append(f"panel {pid} {title}: no series for {expr}")
        if finite_in_panel == 0:
            failed.append(f"panel {pid} {title}: no finite value in any target")
    # Two panels whose values the traffic above fixes: queued streams were kept alive,
    # and the certificate expires in 90 days.
    for what, q, low, high in [
        ("keep-alives while waiting", 'sum(prefixlb_sse_keepalives_total{when="waiting"})', 1, math.inf),
        ("days until the client certificate expires",
         'min by (certificate) (prefixlb_tls_certificate_expiry_timestamp_seconds - time()) / 86400',
         89, 90.01),
    ]:
        series = json.loads(http("GET", f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}))[1])["data"]["result"]
        value = float(series[0]["value"][1]) if series else math.nan
        print(f"{what}: {value:.2f}")
        if not low <= value <= high:
            failed.append(f"{what}: {value} (want {low}..{high}) from {q}")
    stop.set()
    print(f"\n{'alerting rule':<44} {'health':>6}  state")
    groups = json.loads(http("GET", f"{prom}/api/v1/rules")[1])["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    if len(rules) < 10:
        failed.append(f"only {len(rules)} alerting rules loaded from {ALERTS}")
    for r in rules:
        print(f"{r['name']:<44} {r['health']:>6}  {r.get('state', '')}")
        if r["health"] != "ok":
            failed.append(f"alerting rule {r['name']}: {r['health']} {r.get('lastError', '')}")
    if ("PrefixlbBreakerNotClosed", "n3", "pending") not in pending:
        failed.append(f"PrefixlbBreakerNotClosed was not pending for n3 while its engine failed: {sorted(pending)}")
    if failed:
        print("\nFAILED:\n  " + "\n  ".join(failed))
        return 1
    print(f"\nevery panel returned data ({sum(1 for _ in panels())} panels, Prometheus at {prom})")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
    sys.exit(code)
