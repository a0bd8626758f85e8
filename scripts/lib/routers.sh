# Shared by the scripts that put prefixlb beside SGLang's and vLLM's routers over mock
# engines (vs_sglang_router.sh, stored_responses.sh, data_parallel.sh,
# follow_conversation.sh): the routers' venvs, fresh engines, every router started the
# same way, and the cleanup between runs. Sourced; expects B (the prefixlb binary), E
# (the binary the engines run), NODES and BASE_PORT set; VENV (SGLang's router) and
# VLLM_VENV (vLLM's) default to venvs under target/. `begin` makes WORK, installs the
# peers ROUTERS names and ends every process and WORK on exit. Engines listen on
# BASE_PORT + i, the router on BASE_PORT + 90 (prefixlb's admin on + 91, a peer's
# Prometheus on + 92). Every process started is put in pids; `stop` ends them all.

VENV=${VENV:-target/sglang-venv}
VLLM_VENV=${VLLM_VENV:-target/vllm-router-venv}
pids=()

begin() { # a scratch directory in WORK, the peers installed, everything ended on exit
  WORK=$(mktemp -d)
  need_routers
  trap 'stop; rm -rf "$WORK"' EXIT
}

# SGLang's router (the `sglang-router` wheel), installed in VENV if absent.
need_sglang_router() {
  if ! [ -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null ||
    "$VENV/bin/pip" install -q --disable-pip-version-check sglang-router
  echo "sglang-router $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang-router"))')"
}

# vLLM's router (the `vllm-router` wheel: Rust, forked from SGLang's), installed in
# VLLM_VENV if absent.
need_vllm_router() {
  if ! [ -x "$VLLM_VENV/bin/python" ]; then
    python3 -m venv "$VLLM_VENV"
  fi
  [ -x "$VLLM_VENV/bin/vllm-router" ] ||
    "$VLLM_VENV/bin/pip" install -q --disable-pip-version-check vllm-router
  echo "vllm-router $("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-router"))')"
}

# Installs the peers that ROUTERS names.
need_routers() {
  case " $ROUTERS " in *" sglang "*) need_sglang_router ;; esac
  case " $ROUTERS " in *" vllm"*) need_vllm_router ;; esac
}

stop() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
  # Nothing may still hold a port when the next run starts.
  for _ in $(seq 1 50); do
    ss -ltn 2>/dev/null | grep -q ":$((BASE_PORT + 90)) " || break
    sleep 0.1
  done
}

wait_http() { # URL: until it answers
  for _ in $(seq 1 200); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "no answer from $1" >&2
  return 1
}

engines() { # FLAGS...: start NODES fresh mock engines with these flags
  for i in $(seq 0 $((NODES - 1))); do
    $E mock-engine --listen "127.0.0.1:$((BASE_PORT + i))" --id "e$i" "$@" >/dev/null 2>&1 &
    pids+=($!)
  done
  for i in $(seq 0 $((NODES - 1))); do wait_http "http://127.0.0.1:$((BASE_PORT + i))/health"; done
}

engine_urls() { # the engines' base URLs, one per word
  for i in $(seq 0 $((NODES - 1))); do printf 'http://127.0.0.1:%s ' $((BASE_PORT + i)); done
}

start_prefixlb() { # [ROUTING]: prefixlb with its shipped defaults (a config naming only
  # the pool and nodes), or with ROUTING's lines as its [routing] section
  local port=$((BASE_PORT + 90))
  {
    printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "$port" $((port + 1))
    [ -z "${1:-}" ] || printf '[routing]\n%s\n' "$1"
    printf '[[pools]]\nname = "mock"\nmodels = ["mock"]\n'
    for i in $(seq 0 $((NODES - 1))); do
      printf '[[pools.nodes]]\nid = "e%s"\nurl = "http://127.0.0.1:%s"\n' "$i" $((BASE_PORT + i))
    done
  } > "$WORK/prefixlb.toml"
  $B serve --config "$WORK/prefixlb.toml" > "$WORK/prefixlb.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$((port + 1))/readyz"
}

start_sglang() { # SGLang's router, policy cache_aware
  local port=$((BASE_PORT + 90))
  # shellcheck disable=SC2046
  "$VENV/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$port" \
    --worker-urls $(engine_urls) --policy cache_aware --log-level warn \
    --prometheus-port $((BASE_PORT + 92)) > "$WORK/sglang.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health"
}

start_vllm() { # POLICY: vLLM's router (cache_aware is its default)
  local port=$((BASE_PORT + 90))
  # shellcheck disable=SC2046
  "$VLLM_VENV/bin/vllm-router" --host 127.0.0.1 --port "$port" \
    --worker-urls $(engine_urls) --policy "$1" --log-level warning \
    --prometheus-port $((BASE_PORT + 92)) > "$WORK/vllm.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health"
}
