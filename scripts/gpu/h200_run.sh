#!/usr/bin/env bash
# One call on the GPU machine (see docs/BENCHMARKS.md): kernel and CUDA-backend tests, a
# random-weight Llama-3-8B-shaped bf16 checkpoint made with transformers, the CUDA logits against
# transformers' float32 forward, then Duet's decode/prefill benchmark and (with --timings)
# transformers' own figures in the same run. Logs go to $OUT.
#
#   scripts/gpu/make_bundle.sh                     # here: builds and packs $BUNDLE_DIR (default .devbundle)
#   device run: [BUNDLE_DIR=.devbundle] bash scripts/gpu/h200_run.sh [--timings] [--compare]
#
#   --timings  also time transformers (eager, sdpa) in the same run
#   --compare  decode only (no prefill figures), Duet's benchmark four times: as built and with
#              one early GEMV group (--early-groups 1, as before) at every batch size, then both
#              again at batch 1 (the spread of the repeats is the noise); a decode table of all four
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle}
mkdir -p "$OUT"
timings="" compare=0
for arg in "$@"; do
  case $arg in
    --timings) timings="--timings" ;;
    --compare) compare=1 ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
source /tmp/devbundle/env.sh
export DUET_MODELS_DIR=$PWD/models
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# The checkpoint is made on the GPU while the tests run.
section "transformers: checkpoint + float32 reference ${timings} (background)"
(PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_reference.py --out /tmp/llama8b $timings 2>&1 | grep -v Warning > "$OUT/hf.log") &
hf_pid=$!

section "kernel tests"
kernels_tests 2>&1 > "$OUT/kernels_tests.log"; echo "kernels_tests exit $?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/kernels_tests.log" | head -20
section "kernel benchmarks"
for b in attention_bench elementwise_bench gemv_bench; do
  command -v $b >/dev/null && { $b > "$OUT/$b.log" 2>&1; grep -v SampleTokens "$OUT/$b.log" | tail -25; }
done
section "CUDA backend tests (tiny-code-llama)"
llama_cuda_tests 2>&1 > "$OUT/llama_cuda_tests.log"; echo "llama_cuda_tests exit $?"
grep -E "relative error|CUDA greedy|diverges|^\[  (PASSED|FAILED) |FAILED  \]|Failure|error:" "$OUT/llama_cuda_tests.log" | head -30

section "waiting for the checkpoint"
wait $hf_pid
tail -5 "$OUT/hf.log"
section "CUDA logits vs transformers float32 (Llama-3-8B shape, random weights)"
cuda_logits_check --model /tmp/llama8b --tokens /tmp/llama8b/tokens.json --logits /tmp/llama8b/logits.f32 --baseline-logits /tmp/llama8b/logits_bf16.f32 2>&1 | tee "$OUT/logits_check.log"
section "Duet CUDA benchmark"
if (( compare )); then
  before="--early-groups 1"
  bench() { local log=$1; shift; cuda_llama_bench --model /tmp/llama8b --prefill none "$@" 2>&1 | tee "$OUT/$log.log"; }
  bench bench
  bench bench_before $before
  bench bench_again --batch 1
  bench bench_before_again --batch 1 $before
  section "decode ms/step by batch size"
  for log in bench bench_before bench_again bench_before_again; do
    printf "%-20s " "$log"
    awk '/^batch/ {on = 1; next} on && NF == 6 {printf "b%s=%s ", $1, $2} END {print ""}' "$OUT/$log.log"
  done
else
  cuda_llama_bench --model /tmp/llama8b 2>&1 | tee "$OUT/bench.log"
fi
[[ -f /tmp/llama8b/timings.json ]] && cp /tmp/llama8b/timings.json "$OUT/" && cat /tmp/llama8b/timings.json
