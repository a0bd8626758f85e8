"""What the client checks share: prefixlb processes (mock engines and a balancer) on
loopback ports the OS chooses, one line per passed check, and a run that kills them all
and exits non-zero on the first failure."""

import os
import re
import subprocess
import sys
import tempfile

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/debug/prefixlb"
procs = []


def start(args, env=None):
    """Starts a prefixlb process and returns the addresses on its 'listening' line."""
    p = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env={**os.environ, "RUST_LOG": "warn", **(env or {})}, text=True)
    procs.append(p)
    line = p.stdout.readline()
    addrs = re.findall(r"http://([0-9.]+:[0-9]+)", line)
    assert addrs, f"no address in {line!r}"
    return addrs


def balancer(engines, keys_env, key):
    """A balancer (cap 1 per node, saturation refused, API keys from `keys_env`) over
    one pool `mock` of the given engine addresses; returns its address."""
    nodes = "".join(f'[[pools.nodes]]\nid = "n{i}"\nurl = "http://{a}"\n' for i, a in enumerate(engines))
    config = (
        '[server]\nlisten = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\n'
        '[routing]\nmax_in_flight = 1\nwhen_saturated = "reject"\n'
        f'[auth]\napi_keys_env = "{keys_env}"\n'
        f'[[pools]]\nname = "mock"\nmodels = ["mock"]\n{nodes}'
    )
    path = os.path.join(tempfile.mkdtemp(), "prefixlb.toml")
    with open(path, "w") as f:
        f.write(config)
    return start(["serve", "--config", path], env={keys_env: key})[0]


def engines(n):
    return [start(["mock-engine", "--listen", "127.0.0.1:0", "--id", f"e{i}",
                   "--decode-ms-per-token", "5"])[0] for i in range(n)]


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok  {name}")


def run(main):
    try:
        main()
    except Exception as e:  # noqa: BLE001 - any failure fails the check
        print(f"FAILED: {e!r}", file=sys.stderr)
        sys.exit(1)
    finally:
        for p in procs:
            p.kill()
