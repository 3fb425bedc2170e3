#!/usr/bin/env bash
# One call on the GPU machine: the whole cluster (router + prefill worker + decode worker as
# separate processes sharing the one GPU, KV through UCX and pinned host staging) on a
# random-weight Llama-3-8B-shaped bf16 checkpoint, checked against `duet generate --backend cuda`,
# then measured with duet-bench; before the cluster starts, the engine alone (`duet generate`) runs
# the same requests (duet-bench --save-requests) on the GPU by itself. The last lines are the table
# (scripts/gpu/cluster_table.py): the cluster's runs, the engine alone, and their ratios. Logs and
# result JSON go to $OUT, in one archive.
#
#   here:   scripts/gpu/make_cluster_bundle.sh; mv models /tmp/duet-models-hold
#   device: bash scripts/gpu/h200_cluster.sh          (carry .devcluster)
#   here:   mv /tmp/duet-models-hold models
#   QUICK=1: no generate comparison, the engine alone on 64 requests, only the closed-loop 1 and
#            64 runs (a short call).
set -uo pipefail
QUICK=${QUICK:-0}
OUT=${OUT:-/tmp/duet-cluster-out}
mkdir -p "$OUT"
tar -xJf .devcluster/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
MODEL=/tmp/llama8b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

[[ $QUICK == 1 ]] || {
echo "== device KV cache <-> pinned staging copies"
device_kv_cache_tests > "$OUT/device_kv_cache_tests.log" 2>&1; echo "device_kv_cache_tests exit $?"
grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/device_kv_cache_tests.log" | head
}

echo "== checkpoint (transformers, random weights)"
python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', 32)" 2>&1 | grep -v Warning | tail -2
cp /tmp/devbundle/tokenizer.json /tmp/devbundle/tokenizer_config.json "$MODEL/"

PROMPTS=("def fibonacci(n):" "The capital of France is" "import numpy as np
x = np.")
echo "== duet generate --backend cuda, one prompt at a time (the cluster decodes each at batch 1 too)"
[[ $QUICK == 1 ]] && PROMPTS=()
for i in "${!PROMPTS[@]}"; do
  python3 -c "import json,sys; print(json.dumps({'id': 'p$i', 'prompt': sys.argv[1], 'max_tokens': 32, 'temperature': 0}))" \
    "${PROMPTS[$i]}" > /tmp/gen_in_$i.jsonl
  duet generate --model "$MODEL" --backend cuda --input /tmp/gen_in_$i.jsonl --output /tmp/gen_out_$i.jsonl \
    >> "$OUT/generate.log" 2>&1 || echo "generate $i exit $?"
done
cat /tmp/gen_out_*.jsonl > "$OUT/generate.jsonl" 2>/dev/null

# The engine alone on the benchmark's own requests (the same duet-bench options and seed as the
# runs below, so the first requests are theirs), with the cluster's engine flags. The batch goes in
# at once, ENGINE_SEQS at a time as the 64 streams of conc64; the prefill figure comes from a run
# of one request at a time. --warmup keeps one-time start-up costs out of both.
# Every run below has a seed of its own (prompts of one run never repeat another's, so the prefix
# cache finds nothing); conc64 has the engine alone's seed 1, so both run the same requests.
BENCH_COMMON=(--dataset random --tokenizer "$MODEL" --output-len 128 --ignore-eos)
BENCH_WORKLOAD=("${BENCH_COMMON[@]}" --input-len 512)
ENGINE_FLAGS=(--model "$MODEL" --backend cuda --gpu-memory-utilization 0.9 --max-model-len 4096
              --max-num-batched-tokens 8192)
ENGINE_SEQS=64
ENGINE_REQUESTS=256; PREFILL_REQUESTS=8
[[ $QUICK == 1 ]] && { ENGINE_REQUESTS=64; PREFILL_REQUESTS=4; }
echo "== engine alone (duet generate --backend cuda) on duet-bench's requests"
duet-bench "${BENCH_WORKLOAD[@]}" --seed 1 --num-prompts $ENGINE_REQUESTS --save-requests "$OUT/requests.jsonl" \
  2>> "$OUT/engine.log" || echo "duet-bench --save-requests exit $?"
head -n $PREFILL_REQUESTS "$OUT/requests.jsonl" > /tmp/prefill_in.jsonl
duet generate "${ENGINE_FLAGS[@]}" --max-num-seqs 1 --warmup 1 --input /tmp/prefill_in.jsonl \
  --output "$OUT/engine_prefill.jsonl" 2>> "$OUT/engine.log" || echo "generate (prefill) exit $?"
duet generate "${ENGINE_FLAGS[@]}" --max-num-seqs $ENGINE_SEQS --warmup 16 --input "$OUT/requests.jsonl" \
  --output "$OUT/engine_batch.jsonl" 2>> "$OUT/engine.log" || echo "generate (batch) exit $?"
grep -h "tok/s" "$OUT/engine.log" | sed 's/^.*\] /  /'

echo "== duet serve --backend cuda (1 prefill + 1 decode worker on one GPU)"
duet serve --model "$MODEL" --backend cuda --gpu-memory-utilization 0.9 --prefill-workers 1 --decode-workers 1 \
  --max-model-len 4096 --max-num-seqs 128 --max-num-batched-tokens 8192 --grpc-port 0 --http-port 0 \
  --metrics-port 0 --max-concurrent-requests 1024 > "$OUT/serve.out" 2> "$OUT/serve.log" &
serve_pid=$!
port=""
for _ in $(seq 1 240); do
  port=$(sed -n 's/^DUET_READY grpc_port=//p' "$OUT/serve.out")
  [[ -n $port ]] && break
  kill -0 $serve_pid 2>/dev/null || break
  sleep 1
done
if [[ -z $port ]]; then echo "serve did not start"; tail -20 "$OUT/serve.log"; kill $serve_pid; exit 1; fi
echo "router on port $port"
http_port=$(sed -n 's/^DUET_HTTP_READY port=//p' "$OUT/serve.out")
prefill_metrics=$(sed -n 's/^DUET_WORKER role=prefill .*metrics_port=//p' "$OUT/serve.out" | head -1)
decode_metrics=$(sed -n 's/^DUET_WORKER role=decode .*metrics_port=//p' "$OUT/serve.out" | head -1)
snapshot() {  # DIR: the three roles' /metrics, for scripts/gpu/ttft_breakdown.py
  mkdir -p "$1"
  curl -s "127.0.0.1:$http_port/metrics" > "$1/router.prom"
  curl -s "127.0.0.1:$prefill_metrics/metrics" > "$1/prefill.prom"
  curl -s "127.0.0.1:$decode_metrics/metrics" > "$1/decode.prom"
}

echo "== cluster vs duet generate (greedy, 32 tokens)"
same=0
for i in "${!PROMPTS[@]}"; do
  duet complete --address 127.0.0.1:$port --prompt "${PROMPTS[$i]}" --max-tokens 32 --temperature 0 \
    > /tmp/complete_$i.txt 2>> "$OUT/complete.log"
  python3 - "$i" "$OUT/generate.jsonl" /tmp/complete_$i.txt <<'PY' && same=$((same + 1))
import json, sys
i, gen, got = sys.argv[1], sys.argv[2], open(sys.argv[3]).read()
want = {json.loads(l)["id"]: json.loads(l)["text"] for l in open(gen)}["p" + i]
first = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
print(f"prompt {i}: {'same' if got == want else f'DIFFERENT from char {first}'} ({len(want)} chars)")
print("  generate:", repr(want[:70])); print("  cluster: ", repr(got[:70]))
sys.exit(0 if got == want else 1)
PY
done
echo "cluster output equals duet generate for $same of ${#PROMPTS[@]} prompts"

echo "== duet-bench (random 512 in / 128 out, ignore_eos)"
bench() {  # name, seed, extra flags...
  local name=$1 seed=$2; shift 2
  snapshot "$OUT/metrics_before_$name"
  duet-bench --backend duet-grpc --base-url 127.0.0.1:$port "${BENCH_COMMON[@]}" --seed "$seed" --result-json "$OUT/$name.json" "$@" \
    > "$OUT/$name.log" 2>&1 || echo "$name: duet-bench exit $?"
  snapshot "$OUT/metrics_after_$name"
}
bench warmup 100 --input-len 512 --num-prompts 8 --max-concurrency 8
# 16-token prompts: what disaggregation adds to the time to first token, with little compute.
bench conc1_short 101 --input-len 16 --num-prompts 16 --max-concurrency 1
CONCURRENCY=(1 8 32 64); RATES=(4 16 64 inf)
[[ $QUICK == 1 ]] && { CONCURRENCY=(1 64); RATES=(); }
for c in "${CONCURRENCY[@]}"; do
  bench conc$c $((c == 64 ? 1 : 1000 + c)) --input-len 512 --num-prompts $((c < 8 ? 16 : 4 * c)) --max-concurrency $c
done
for i in "${!RATES[@]}"; do
  bench rate${RATES[$i]} $((2000 + i)) --input-len 512 --num-prompts 256 --request-rate ${RATES[$i]}
done

kill -INT $serve_pid; wait $serve_pid; echo "serve exit $?"
grep -h "KV peer" "$OUT/serve.log" | sed "s/.*\] //" | sort | uniq -c | head -4
grep -i -E "error|fail|warn" "$OUT/serve.log" | head -5
echo "== the cluster and the engine alone (random 512 in / 128 out, ignore_eos; conc64 and the engine: the same requests)"
python3 scripts/gpu/cluster_table.py "$OUT" $ENGINE_SEQS
for name in conc1_short conc1 conc64; do
  echo "== time to first token, in parts: $name"
  python3 scripts/gpu/ttft_breakdown.py "$OUT/metrics_before_$name" "$OUT/metrics_after_$name" "$OUT/$name.json"
done
# At most 8 files come back: keep the table's inputs and logs in one archive.
(cd "$OUT" && tar -czf /tmp/cluster_logs.tgz ./* && rm -rf ./* && mv /tmp/cluster_logs.tgz .)
