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
#   QUICK=1: no generate comparison, only the closed-loop 1 and 64 runs and the unbounded rate
#            (a short call).
#   SHARING="timeslice mps": how the workers share the GPU, one cluster run per mode (see below);
#            default mps-local1024-decodebudget1024-mixed384, the one-GPU configuration that serves
#            this workload fastest (docs/BENCHMARKS.md), with the engine alone on the same budgets
#            (ENGINE_BUDGET=1024 ENGINE_MIXED=384).
#   CONC64_PROMPTS=N: conc64's requests, and the engine alone's (default 1024, 16 a stream: a
#            sustained load, where the ramp of the first 64 prompts and the drain of the last 64
#            requests weigh a quarter of what they do at 256). The table also gives both runs' steady
#            window, from the first request's end to the last one's send (duet-bench's
#            steady_output_throughput), where every stream is busy.
#   DUET_WIDE_GEMM_MIN_ROWS=64: every process (engine alone and cluster) sends bf16 products of 64+
#            rows to WideGemm (kernels/gemm/wide_gemm.h; default off).
#   TESTS="gemm_tuning_tests llama_cuda_tests": those GPU test programs (bundled with
#            EXTRA_TARGETS="..." scripts/gpu/make_cluster_bundle.sh) run twice before the cluster.
#            Where the tiny model's weights stayed here (models/tiny-code-llama/*.safetensors moved
#            out, so that tree + bundle fit the carry), random weights are made from its config and
#            the tests against the Hugging Face reference are left out (TEST_FILTER).
#   Every prompt disaggregated, against the default:
#     SHARING="mps mps-local1024-decodebudget1024-mixed384" bash scripts/gpu/h200_cluster.sh
set -uo pipefail
QUICK=${QUICK:-0}
OUT=${OUT:-/tmp/duet-cluster-out}
source scripts/gpu/devcluster_prologue.sh

[[ -n ${TESTS:-} ]] && run_bundled_tests

[[ $QUICK == 1 ]] || {
echo "== device KV cache <-> pinned staging copies"
device_kv_cache_tests > "$OUT/device_kv_cache_tests.log" 2>&1; echo "device_kv_cache_tests exit $?"
grep -E "^\[  (PASSED|FAILED) |Failure" "$OUT/device_kv_cache_tests.log" | head
}

echo "== checkpoint (transformers, random weights; kept from an earlier run on this machine)"
llama8b_checkpoint

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
# ENGINE_BUDGET: the engine alone's --max-num-batched-tokens (give it a mode's decodebudget, so the
# engine alone mixes prompts into its decode steps as that mode's decode worker does); ENGINE_MIXED
# its --max-num-mixed-tokens (a mode's mixedN).
ENGINE_FLAGS=(--model "$MODEL" --backend cuda --gpu-memory-utilization 0.9 --max-model-len 4096
              --max-num-batched-tokens "${ENGINE_BUDGET:-1024}" --max-num-mixed-tokens "${ENGINE_MIXED:-384}")
ENGINE_SEQS=64
ENGINE_REQUESTS=${CONC64_PROMPTS:-1024}; PREFILL_REQUESTS=8
[[ $QUICK == 1 ]] && PREFILL_REQUESTS=4
echo "== engine alone (duet generate --backend cuda) on duet-bench's requests"
duet-bench "${BENCH_WORKLOAD[@]}" --seed 1 --num-prompts $ENGINE_REQUESTS --save-requests "$OUT/requests.jsonl" \
  2>> "$OUT/engine.log" || echo "duet-bench --save-requests exit $?"
head -n $PREFILL_REQUESTS "$OUT/requests.jsonl" > /tmp/prefill_in.jsonl
# Steps one at a time here: with async scheduling a request is admitted while the one before it
# still runs its last step, so its scheduled-to-first-token time would include that step.
duet generate "${ENGINE_FLAGS[@]}" --max-num-seqs 1 --warmup 1 --no-async-scheduling --input /tmp/prefill_in.jsonl \
  --output "$OUT/engine_prefill.jsonl" 2>> "$OUT/engine.log" || echo "generate (prefill) exit $?"
clock_mark
duet generate "${ENGINE_FLAGS[@]}" --max-num-seqs $ENGINE_SEQS --warmup 16 --input "$OUT/requests.jsonl" \
  --output "$OUT/engine_batch.jsonl" 2>> "$OUT/engine.log" || echo "generate (batch) exit $?"
grep -h "tok/s" "$OUT/engine.log" | sed 's/^.*\] /  /'
clock_summary "  engine alone (load, warm-up and the batch)"
grep -h "GEMM tuning:" "$OUT/engine.log" | head -1 | sed 's/^.*\] /  engine alone: /'

# How the two worker processes share the GPU: "timeslice" (the driver's default: one process's
# kernels at a time), "mps" (an MPS control daemon of this script's own, private pipe and log
# directories, stopped at the end: the workers' kernels run side by side, the prefill worker's at
# below-normal priority as duet serve sets it), "mps-equal" (MPS, both at normal priority) or
# "mps-prefillN" (MPS, the prefill worker on N% of the SMs: duet serve --prefill-gpu-percent N),
# "mps-decodeN" (the decode worker on N%: --decode-gpu-percent N) or "mps-prefillN-decodeM" (both).
# A mode may end in "-budgetT": the workers' --max-num-batched-tokens T instead of 8192.
# A mode with "sequential" in its name: the router sends Prefill after the KV reservation instead
# of beside it (duet serve --sequential-kv-reservation), as before late targets. With "checksums":
# every layer's K/V checksummed by the prefill worker and verified by the decode worker
# (--kv-checksums; a correctness check of the bytes moved, slower on the device path).
# With "localN": conditional disaggregation, prompts of at most N tokens prefilled by the decode
# worker itself while the prefill worker is busy (--local-prefill-max-tokens N); "queueQ" sets
# how busy: Q prompt tokens reserving, prefilling or waiting for it (--local-prefill-queue-tokens Q;
# without it 0: every prompt of at most N tokens). With "decodebudgetT": the decode worker's
# --max-num-batched-tokens T (how much prompt rides along with a decode step). With "mixedM": the
# workers' --max-num-mixed-tokens M (a step in which requests decode takes at most M tokens; one with
# nothing decoding, the whole budget), e.g. SHARING=mps-local1024-decodebudget1024-mixed384
# ENGINE_BUDGET=1024 ENGINE_MIXED=384. With "nolate": the workers plan each step as soon as the one
# before is launched (--no-late-scheduling).
# SHARING lists the modes to run, each a whole cluster run of its own under $OUT/<mode>.
SHARING=${SHARING:-mps-local1024-decodebudget1024-mixed384}
mps_dir=/tmp/duet-mps
start_mps() {
  command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control on this machine"; return 1; }
  mkdir -p "$mps_dir/pipe" "$mps_dir/log"
  export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
  nvidia-cuda-mps-control -d || { echo "MPS control daemon did not start"; return 1; }
  echo "MPS control daemon started (pipe $mps_dir/pipe)"
}
stop_mps() {
  [[ -n ${CUDA_MPS_PIPE_DIRECTORY:-} ]] || return 0
  echo quit | nvidia-cuda-mps-control; sleep 1
  cp -r "$mps_dir/log" "$OUT/mps_log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
trap 'stop_mps; kill $clock_sampler_pid 2>/dev/null' EXIT

run_cluster() {  # MODE: the cluster's runs under $OUT/MODE
local mode=$1 dir=$OUT/$1
mkdir -p "$dir"
cp "$OUT"/engine_batch.jsonl "$OUT"/engine_prefill.jsonl "$dir/" 2>/dev/null
if [[ $mode == mps* ]]; then start_mps || return 1; fi
echo "== duet serve --backend cuda (1 prefill + 1 decode worker on one GPU, sharing: $mode)"
local priority=() share=()  # serve runs prefill workers at MPS client priority 1 unless told otherwise
[[ $mode == mps-equal ]] && priority=(env CUDA_MPS_CLIENT_PRIORITY=0)
[[ $mode =~ prefill([0-9]+) ]] && share+=(--prefill-gpu-percent "${BASH_REMATCH[1]}")
[[ $mode =~ decode([0-9]+) ]] && share+=(--decode-gpu-percent "${BASH_REMATCH[1]}")
[[ $mode =~ sequential ]] && share+=(--sequential-kv-reservation)
[[ $mode =~ checksums ]] && share+=(--kv-checksums)
[[ $mode =~ local([0-9]+) ]] && share+=(--local-prefill-max-tokens "${BASH_REMATCH[1]}")
[[ $mode =~ queue([0-9]+) ]] && share+=(--local-prefill-queue-tokens "${BASH_REMATCH[1]}")
[[ $mode =~ decodebudget([0-9]+) ]] && share+=(--decode-max-num-batched-tokens "${BASH_REMATCH[1]}")
[[ $mode =~ mixed([0-9]+) ]] && share+=(--max-num-mixed-tokens "${BASH_REMATCH[1]}")
[[ $mode =~ nolate ]] && share+=(--no-late-scheduling)
local budget=8192
[[ $mode =~ (^|-)budget([0-9]+) ]] && budget=${BASH_REMATCH[2]}
"${priority[@]}" duet serve "${share[@]}" --model "$MODEL" --backend cuda --gpu-memory-utilization 0.9 --prefill-workers 1 \
  --decode-workers 1 --max-model-len 4096 --max-num-seqs 128 --max-num-batched-tokens $budget --grpc-port 0 \
  --http-port 0 --metrics-port 0 --max-concurrent-requests 1024 > "$dir/serve.out" 2> "$dir/serve.log" &
serve_pid=$!
port=$(serve_port "$dir/serve.out" $serve_pid)
if [[ -z $port ]]; then echo "serve did not start"; tail -20 "$dir/serve.log"; kill $serve_pid; stop_mps; return 1; fi
echo "router on port $port"
http_port=$(sed -n 's/^DUET_HTTP_READY port=//p' "$dir/serve.out")
prefill_metrics=$(sed -n 's/^DUET_WORKER role=prefill .*metrics_port=//p' "$dir/serve.out" | head -1)
decode_metrics=$(sed -n 's/^DUET_WORKER role=decode .*metrics_port=//p' "$dir/serve.out" | head -1)

echo "== cluster vs duet generate (greedy, 32 tokens)"
same=0
for i in "${!PROMPTS[@]}"; do
  duet complete --address 127.0.0.1:$port --prompt "${PROMPTS[$i]}" --max-tokens 32 --temperature 0 \
    > /tmp/complete_$i.txt 2>> "$dir/complete.log"
  python3 - "$i" "$OUT/generate.jsonl" /tmp/complete_$i.txt <<'PY' > /tmp/compare_$i.txt && same=$((same + 1))
import json, sys
i, gen, got = sys.argv[1], sys.argv[2], open(sys.argv[3]).read()
want = {json.loads(l)["id"]: json.loads(l)["text"] for l in open(gen)}["p" + i]
first = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
print(f"prompt {i}: {'same' if got == want else f'DIFFERENT from char {first}'} ({len(want)} chars)")
print("  generate:", repr(want[:70])); print("  cluster: ", repr(got[:70]))
sys.exit(0 if got == want else 1)
PY
  tee -a "$dir/compare.txt" < /tmp/compare_$i.txt
done
echo "cluster output equals duet generate for $same of ${#PROMPTS[@]} prompts" | tee -a "$dir/compare.txt"

echo "== duet-bench (random 512 in / 128 out, ignore_eos)"
bench warmup 100 --input-len 512 --num-prompts 8 --max-concurrency 8
# 16-token prompts: what disaggregation adds to the time to first token, with little compute.
bench conc1_short 101 --input-len 16 --num-prompts 16 --max-concurrency 1
for c in "${CONCURRENCY[@]}"; do
  clock_mark
  bench conc$c $((c == 64 ? 1 : 1000 + c)) --input-len 512 --num-prompts $((c < 8 ? 16 : c == 64 ? ENGINE_REQUESTS : 4 * c)) \
    --max-concurrency $c
  [[ $c == 64 ]] && clock_summary "  $mode conc64" | tee "$dir/conc64_clocks.txt"
done
for i in "${!RATES[@]}"; do
  bench rate${RATES[$i]} $((2000 + i)) --input-len 512 --num-prompts 256 --request-rate ${RATES[$i]}
done

echo "late KV targets (when each came against its prefill's forward pass):"
curl -s "127.0.0.1:$prefill_metrics/metrics" | grep '^duet:kv_late_targets_total' | sed 's/.*arrived="\([a-z_]*\)"} /  \1 /'
curl -s "127.0.0.1:$prefill_metrics/metrics" | grep "^duet:kv_transfer_failures_total" | sed "s/^/  /"
echo "prefills by the worker that ran them (conditional disaggregation: decode):"
curl -s "127.0.0.1:$http_port/metrics" | grep '^duet:router_prefills_total' | sed 's/.*worker_role="\([a-z]*\)"} /  \1 /'
echo "decode worker's engine, the last stats line of the run:"
grep -h "decode.*Steps:" "$dir/serve.log" | grep -v "generation throughput: 0.0" | tail -1 | sed 's/.*Steps:/  Steps:/'
kill -INT $serve_pid; wait $serve_pid; echo "serve exit $?"
grep -h "KV peer" "$dir/serve.log" | sed "s/.*\] //" | sort | uniq -c | head -4
grep -h "GEMM tuning:" "$dir/serve.log" | sed "s/.*\] /  workers' /"  # each worker's load-time tuning
grep -i -E "error|fail|warn" "$dir/serve.log" | head -5
if [[ $mode == mps* ]]; then stop_mps; fi
}

snapshot() {  # DIR: the three roles' /metrics, for scripts/gpu/ttft_breakdown.py
  mkdir -p "$1"
  curl -s "127.0.0.1:$http_port/metrics" > "$1/router.prom"
  curl -s "127.0.0.1:$prefill_metrics/metrics" > "$1/prefill.prom"
  curl -s "127.0.0.1:$decode_metrics/metrics" > "$1/decode.prom"
}
bench() {  # name, seed, extra flags... (run_cluster's $dir, $port)
  local name=$1 seed=$2; shift 2
  snapshot "$dir/metrics_before_$name"
  duet-bench --backend duet-grpc --base-url 127.0.0.1:$port "${BENCH_COMMON[@]}" --seed "$seed" --result-json "$dir/$name.json" "$@" \
    > "$dir/$name.log" 2>&1 || echo "$name: duet-bench exit $?"
  snapshot "$dir/metrics_after_$name"
}
CONCURRENCY=(1 8 32 64); RATES=(4 16 64 inf)
[[ $QUICK == 1 ]] && { CONCURRENCY=(1 64); RATES=(inf); }
for mode in $SHARING; do run_cluster "$mode"; done

for mode in $SHARING; do
  echo "== $mode: the cluster and the engine alone (random 512 in / 128 out, ignore_eos; conc64 and the engine: the same requests)"
  python3 scripts/gpu/cluster_table.py "$OUT/$mode" $ENGINE_SEQS
  for name in conc1_short conc1 conc64; do
    echo "== $mode: time to first token, in parts: $name"
    python3 scripts/gpu/ttft_breakdown.py "$OUT/$mode/metrics_before_$name" "$OUT/$mode/metrics_after_$name" \
      "$OUT/$mode/$name.json"
  done
done
# At most 8 files come back: keep the table's inputs and logs in one archive.
kill "$clock_sampler_pid" 2>/dev/null
(cd "$OUT" && tar -czf /tmp/cluster_logs.tgz ./* && rm -rf ./* && mv /tmp/cluster_logs.tgz .)
