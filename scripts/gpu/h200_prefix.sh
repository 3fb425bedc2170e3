#!/usr/bin/env bash
# One call on the GPU machine: prefix caching in the cluster (router + prefill + decode workers on
# the one GPU) on a random-weight Llama-3-8B-shaped bf16 checkpoint, with duet-bench's
# shared-prefix workload (16 system prompts of 2,048 tokens, 256-token questions: 89% shared) and,
# when this build has them, the multi-turn workload and --routing-policy. Runs:
#   off          --no-enable-prefix-caching
#   on           prefix caching, the whole GPU share as cache
#   small        a KV cache too small for the prefixes (3,000 blocks per worker): evictions
#   small+host   the same with an 8 GiB host tier per worker
#   big / big+host  64 system prompts (8,192 blocks of prefix) on 3,000 device blocks, without and
#                with a 20 GiB host tier per worker
#   ll2 / pa2    2 prefill workers, least-loaded vs prefix-aware routing (if --routing-policy exists)
#   ll2big / pa2big  the same with 96 system prompts, more than one prefill worker's cache holds
# Each run prints duet-bench's TTFT p50/p99 and output tok/s and the workers' prefix-cache hit
# rate from /metrics; the table is last. Logs and result JSON under $OUT (one archive).
#
#   here:   scripts/gpu/make_cluster_bundle.sh; mv models /tmp/duet-models-hold
#   device: bash scripts/gpu/h200_prefix.sh          (carry .devcluster)
#   here:   mv /tmp/duet-models-hold models
#   RUNS="off on" limits the runs.
set -uo pipefail
OUT=${OUT:-/tmp/duet-prefix-out}
RUNS=${RUNS:-"off on small small+host big big+host ll2 pa2 ll2big pa2big"}
mkdir -p "$OUT"
tar -xJf .devcluster/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
MODEL=/tmp/llama8b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== checkpoint (transformers, random weights)"
[[ -f $MODEL/tokenizer_config.json ]] || python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', 32)" 2>&1 | grep -v Warning | tail -2
cp /tmp/devbundle/tokenizer.json /tmp/devbundle/tokenizer_config.json "$MODEL/"

WORKLOAD=(--dataset shared-prefix --tokenizer "$MODEL" --num-prefix-groups 16 --prefix-len 2048 --input-len 256
          --output-len 64 --ignore-eos --seed 1 --num-prompts 256 --max-concurrency 16)
# (Whole help texts first: grep -q closing the pipe early would fail the pipeline.)
has_routing=0; [[ $(duet serve --help 2>&1) == *--routing-policy* ]] && has_routing=1
has_multiturn=0; [[ $(duet-bench --help 2>&1) == *multi-turn* ]] && has_multiturn=1

# Sums a counter family over every worker's /metrics (ROLE=prefill|decode: that role's only).
scrape() {  # family, ports...
  local family=$1; shift
  for p in "$@"; do curl -s "127.0.0.1:$p/metrics"; done |
    awk -v f="$family" -v r="${ROLE:-}" '($1 ~ "^"f"[{ ]" || $1 == f) && (r == "" || $1 ~ "role=\""r"\"") {s += $2}
                                          END {printf "%.0f", s}'
}

run() {  # name, serve flags...
  local name=$1; shift
  echo "== $name: duet serve $*"
  duet serve --model "$MODEL" --backend cuda --gpu-memory-utilization 0.9 --max-model-len 8192 --max-num-seqs 64 \
    --max-num-batched-tokens 8192 --grpc-port 0 --http-port -1 --metrics-port 0 --max-concurrent-requests 1024 "$@" \
    > "$OUT/$name.serve.out" 2> "$OUT/$name.serve.log" &
  local pid=$! port=""
  for _ in $(seq 1 240); do
    port=$(sed -n 's/^DUET_READY grpc_port=//p' "$OUT/$name.serve.out")
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if [[ -z $port ]]; then echo "$name: serve did not start"; tail -5 "$OUT/$name.serve.log"; kill $pid 2>/dev/null; return; fi
  local metrics_ports
  metrics_ports=$(grep -o 'metrics on 127.0.0.1:[0-9]*\|metrics_port=[0-9]*' "$OUT/$name.serve.out" "$OUT/$name.serve.log" 2>/dev/null |
                  grep -o '[0-9]*$' | sort -u | tr '\n' ' ')
  # Graphs and allocator warm-up on unrelated prompts (no shared prefix).
  duet-bench --backend duet-grpc --base-url 127.0.0.1:$port --dataset random --tokenizer "$MODEL" --input-len 256 \
    --output-len 16 --num-prompts 8 --max-concurrency 8 --seed 99 > "$OUT/$name.warmup.log" 2>&1
  local q0 h0 pq0 ph0
  q0=$(scrape duet:prefix_cache_queries_total $metrics_ports); h0=$(scrape duet:prefix_cache_hits_total $metrics_ports)
  pq0=$(ROLE=prefill scrape duet:prefix_cache_queries_total $metrics_ports)
  ph0=$(ROLE=prefill scrape duet:prefix_cache_hits_total $metrics_ports)
  duet-bench --backend duet-grpc --base-url 127.0.0.1:$port "${WORKLOAD[@]}" --result-json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || echo "$name: duet-bench exit $?"
  if [[ $has_multiturn == 1 ]]; then
    duet-bench --backend duet-grpc --base-url 127.0.0.1:$port --dataset multi-turn --tokenizer "$MODEL" \
      --num-sessions 16 --num-turns 4 --num-prefix-groups 4 --prefix-len 1024 --input-len 128 \
      --output-len 64 --ignore-eos --seed 1 --result-json "$OUT/$name.mt.json" \
      > "$OUT/$name.mt.log" 2>&1 || echo "$name: multi-turn duet-bench exit $?"
  fi
  local q1 h1 pq1 ph1
  q1=$(scrape duet:prefix_cache_queries_total $metrics_ports); h1=$(scrape duet:prefix_cache_hits_total $metrics_ports)
  pq1=$(ROLE=prefill scrape duet:prefix_cache_queries_total $metrics_ports)
  ph1=$(ROLE=prefill scrape duet:prefix_cache_hits_total $metrics_ports)
  echo "$name queries $((q1 - q0)) hits $((h1 - h0)) host_hits $(scrape duet:host_kv_cache_hit_blocks_total $metrics_ports) evictions $(scrape duet:kv_cache_evictions_total $metrics_ports) prefill_queries $((pq1 - pq0)) prefill_hits $((ph1 - ph0))" | tee -a "$OUT/cache.txt"
  grep -h -E "TTFT|Output token throughput" "$OUT/$name.log" | head -4
  kill -INT $pid; wait $pid
}

for r in $RUNS; do
  case $r in
    off) run off --prefill-workers 1 --decode-workers 1 --no-enable-prefix-caching ;;
    on) run on --prefill-workers 1 --decode-workers 1 ;;
    small) run small --prefill-workers 1 --decode-workers 1 --num-kv-blocks 3000 ;;
    small+host) run small+host --prefill-workers 1 --decode-workers 1 --num-kv-blocks 3000 --host-kv-cache-gib 8 ;;
    # More system prompts than the device cache holds (64 x 2,048 tokens = 8,192 blocks vs 3,000):
    # without the host tier most prefixes are gone when they come back; with it they load from host.
    big|big+host)
      host=(); [[ $r == big+host ]] && host=(--host-kv-cache-gib 20)
      WORKLOAD=(--dataset shared-prefix --tokenizer "$MODEL" --num-prefix-groups 64 --prefix-len 2048 --input-len 256
                --output-len 32 --ignore-eos --seed 1 --num-prompts 512 --max-concurrency 16)
      has_multiturn=0 run $r --prefill-workers 1 --decode-workers 1 --num-kv-blocks 3000 "${host[@]}" ;;
    ll2) [[ $has_routing == 1 ]] && run ll2 --prefill-workers 2 --decode-workers 1 --routing-policy least-loaded ;;
    pa2) [[ $has_routing == 1 ]] && run pa2 --prefill-workers 2 --decode-workers 1 --routing-policy prefix-aware ;;
    # More system prompts than one prefill worker's cache holds (96 x 2,048 tokens vs 8,000
    # blocks = 128k tokens), half of them per worker: where routing decides the hit rate.
    ll2big|pa2big)
      policy=least-loaded; [[ $r == pa2big ]] && policy=prefix-aware
      WORKLOAD=(--dataset shared-prefix --tokenizer "$MODEL" --num-prefix-groups 96 --prefix-len 2048 --input-len 256
                --output-len 32 --ignore-eos --seed 1 --num-prompts 768 --max-concurrency 32)
      has_multiturn=0 run $r --prefill-workers 2 --decode-workers 1 --num-kv-blocks 8000 --routing-policy $policy ;;
  esac
done

echo "== prefix caching on the H200 (8B shape, 1 GPU; shared-prefix 16 x 2048 + 256, 64 out, 256 requests, 16 streams)"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
cache = {}
for line in open(os.path.join(out, "cache.txt")) if os.path.exists(os.path.join(out, "cache.txt")) else []:
    f = line.split()
    cache[f[0]] = (int(f[2]), int(f[4]), f[6], f[8], int(f[10]), int(f[12]))
print(f"{'run':<11} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'out tok/s':>10} {'hit rate':>8} {'prefill':>7}  host hits / evictions")
base = None
for name in ["off", "on", "small", "small+host", "big", "big+host", "ll2", "pa2", "ll2big", "pa2big"]:
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        continue
    j = json.load(open(p))
    q, h, hh, ev, pq, ph = cache.get(name, (0, 0, "-", "-", 0, 0))
    rate = f"{h / q:.2f}" if q else "-"
    prate = f"{ph / pq:.2f}" if pq else "-"
    ttft = j.get("median_ttft_ms", 0)
    base = base or ttft
    print(f"{name:<11} {ttft:>11.1f} {j.get('p99_ttft_ms', 0):>11.1f} {j.get('output_throughput', 0):>10.0f} {rate:>8} {prate:>7}  {hh} / {ev}"
          f"   (TTFT p50 {base / ttft if ttft else 0:.2f}x lower than off)")
    mt = os.path.join(out, name + ".mt.json")
    if os.path.exists(mt):
        m = json.load(open(mt))
        print(f"{'  multi-turn':<11} {m.get('median_ttft_ms', 0):>11.1f} {m.get('p99_ttft_ms', 0):>11.1f} {m.get('output_throughput', 0):>10.0f}")
PY
(cd "$OUT" && tar -czf /tmp/prefix_logs.tgz ./* && rm -rf ./* && mv /tmp/prefix_logs.tgz .)
