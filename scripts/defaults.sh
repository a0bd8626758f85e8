#!/usr/bin/env bash
# Regenerates the README's "Why these defaults" table: prefixlb's hit rate (and TTFT p50) per
# routing variant and workload, 8 engines, 60,000 cached tokens each.
B=${B:-./target/release/prefixlb}
variants=(
  'key = "conversation"'
  'key = "conversation"\nprefix_chars = 256'
  'key = "conversation"\nprefix_chars = 4096'
  'key = "prefix"'
  'key = "prefix"\nprefix_chars = 4096'
  'key = "hybrid"'
  'max_in_flight = 8'
  'max_in_flight = 16'
  'load_factor = 1.25'
  'vnodes = 40'
  'vnodes = 640'
)
printf "| variant | multi-turn | shared-prefix | rag | agentic |\n|---|---|---|---|---|\n"
for v in "${variants[@]}"; do
  f=$(mktemp)
  printf "[routing]\n$v\n[[pools]]\nname = \"sim\"\nnodes = [{ id = \"a\", url = \"http://127.0.0.1:1\" }]\n" > $f
  row="| \`$(echo -e "$v" | tr '\n' ' ' | sed 's/ *$//')\` |"
  for w in multi-turn shared-prefix rag agentic; do
    r=$($B simulate --config $f --workload $w --nodes 8 --cache-tokens 60000 --policies prefixlb --json)
    row="$row $(echo "$r" | python3 -c 'import json,sys; p=json.load(sys.stdin)["policies"][0]; print("%.1f%% / %.0f ms" % (100*p["hit_rate"], p["ttft_p50_ms"]))') |"
  done
  echo "$row"
  rm -f $f
done
f=$(mktemp); printf "[[pools]]\nname = \"sim\"\nnodes = [{ id = \"a\", url = \"http://127.0.0.1:1\" }]\n" > $f
for p in round_robin cache_aware oracle; do
  row="| policy \`$p\` |"
  for w in multi-turn shared-prefix rag agentic; do
    r=$($B simulate --config $f --workload $w --nodes 8 --cache-tokens 60000 --policies $p --json)
    row="$row $(echo "$r" | python3 -c 'import json,sys; p=json.load(sys.stdin)["policies"][0]; print("%.1f%% / %.0f ms" % (100*p["hit_rate"], p["ttft_p50_ms"]))') |"
  done
  echo "$row"
done
rm -f $f
