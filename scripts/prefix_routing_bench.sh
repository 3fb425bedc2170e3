#!/usr/bin/env bash
# Least-loaded vs prefix-aware routing on the local CPU cluster (docs/BENCHMARKS.md): 1 decode
# worker, 2 prefill workers and the router as separate processes with the bundled model, one
# duet-bench run, then one summary line: duet-bench's figures, each prefill worker's prompt
# tokens and the router's predicted hit rate per worker role (the deltas of
# duet:routed_prompt_blocks_cached_total / duet:routed_prompt_blocks_total over the run, the
# warm-up request included) and, where the workers export them, their
# duet:prefix_cache_hits_total / duet:prefix_cache_queries_total.
#
#   scripts/prefix_routing_bench.sh POLICY PREFILL_KV_BLOCKS [duet-bench flags...]
# POLICY: least-loaded or prefix-aware; PREFILL_KV_BLOCKS: the prefill workers' --num-kv-blocks
# (0: their default). PREFIX_AFFINITY sets the router's --prefix-affinity; WORKER_FLAGS adds flags
# to every worker (e.g. --no-enable-prefix-caching, --host-kv-cache-gib 0.05). Needs
# build/bin/duet and build/bin/duet-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
POLICY=$1 BLOCKS=$2
shift 2
MODEL=models/tiny-code-llama
OUT=$(mktemp -d)
PIDS=()
stop() { for pid in "${PIDS[@]}"; do kill -INT "$pid" 2>/dev/null || true; done; wait || true; rm -rf "$OUT"; }
trap stop EXIT

# Starts a role with its log in $OUT/$name.log.
start() {
  local name=$1
  shift
  build/bin/duet "$@" >"$OUT/$name.log" 2>&1 &
  PIDS+=($!)
}
# The port a role announced with `$2 port=N`.
announced() {
  for _ in $(seq 1 600); do
    local port
    port=$(grep -o "$2 port=[0-9]*" "$OUT/$1.log" | head -1 | cut -d= -f2 || true)
    [ -n "$port" ] && { echo "$port"; return; }
    sleep 0.2
  done
  echo "prefix_routing_bench: $1 did not start" >&2
  exit 1
}
kv=()
[ "$BLOCKS" != 0 ] && kv=(--num-kv-blocks "$BLOCKS")
read -r -a extra <<< "${WORKER_FLAGS:-}"
start decode decode-worker --model $MODEL --backend cpu --port 0 --metrics-port 0 "${extra[@]}"
start prefill0 prefill-worker --model $MODEL --backend cpu --port 0 --metrics-port 0 "${kv[@]}" "${extra[@]}"
start prefill1 prefill-worker --model $MODEL --backend cpu --port 0 --metrics-port 0 "${kv[@]}" "${extra[@]}"
workers=(decode prefill0 prefill1)
declare -A port metrics
for w in "${workers[@]}"; do
  port[$w]=$(announced "$w" DUET_READY)
  metrics[$w]=$(announced "$w" DUET_METRICS_READY)
done
start router router --model $MODEL --port 0 --http-port 0 --routing-policy "$POLICY" \
  ${PREFIX_AFFINITY:+--prefix-affinity "$PREFIX_AFFINITY"} \
  --prefill "127.0.0.1:${port[prefill0]},127.0.0.1:${port[prefill1]}" --decode "127.0.0.1:${port[decode]}"
router_http=$(announced router DUET_HTTP_READY)
router_grpc=$(announced router DUET_READY)

# Every duet:* sample of the router and the workers, as "process name{labels} value" lines.
scrape() {
  curl -s "http://127.0.0.1:$router_http/metrics" | grep '^duet:' | sed 's/^/router /'
  for w in "${workers[@]}"; do curl -s "http://127.0.0.1:${metrics[$w]}/metrics" | grep '^duet:' | sed "s/^/$w /"; done
}
scrape >"$OUT/before"
build/bin/duet-bench --backend duet-grpc --base-url "127.0.0.1:$router_grpc" --tokenizer $MODEL "$@" \
  --result-json "$OUT/result.json" >"$OUT/bench.txt"
scrape >"$OUT/after"
python3 - "$OUT" "$POLICY" <<'PY'
import json, re, sys
out, policy = sys.argv[1], sys.argv[2]
def samples(path):
    values = {}
    for line in open(path):
        process, series, value = line.split(' ')
        values[(process, series)] = float(value)
    return values
before, after = samples(f'{out}/before'), samples(f'{out}/after')
def delta(process, name, labels=''):
    return sum(v - before.get(k, 0) for k, v in after.items()
               if k[0] == process and k[1].startswith(name + '{') and labels in k[1])
r = json.load(open(f'{out}/result.json'))
line = (f"{policy}: {r['completed']}/{r['num_prompts']} ok, {r['request_throughput']:.2f} req/s, "
        f"TTFT p50/p99 {r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms")
if 'median_ttft_first_turn_ms' in r:
    line += (f" (first turns {r['median_ttft_first_turn_ms']:.0f}/{r['p99_ttft_first_turn_ms']:.0f},"
             f" later {r['median_ttft_later_turns_ms']:.0f}/{r['p99_ttft_later_turns_ms']:.0f})")
line += f"; prefill prompt tokens {delta('prefill0', 'duet:prompt_tokens_total'):.0f} / {delta('prefill1', 'duet:prompt_tokens_total'):.0f}"
for role in ('prefill', 'decode'):
    routed = delta('router', 'duet:routed_prompt_blocks_total', f'worker_role="{role}"')
    cached = delta('router', 'duet:routed_prompt_blocks_cached_total', f'worker_role="{role}"')
    line += f"; predicted hit rate {role} {cached / max(routed, 1):.3f} ({cached:.0f}/{routed:.0f} blocks)"
for process in ('prefill0', 'prefill1', 'decode'):
    queries = delta(process, 'duet:prefix_cache_queries_total')
    if queries > 0:
        line += f"; {process} cache hit rate {delta(process, 'duet:prefix_cache_hits_total') / queries:.3f}"
print(line)
PY
