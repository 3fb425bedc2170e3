#!/usr/bin/env bash
# One call on the GPU machine (see docs/BENCHMARKS.md): kernel and CUDA-backend tests, a
# random-weight Llama-3-8B-shaped bf16 checkpoint made with transformers, the CUDA logits against
# transformers' float32 forward, then Duet's decode/prefill benchmark and (with --timings)
# transformers' own figures in the same run. Logs go to $OUT.
#
#   scripts/gpu/make_bundle.sh                     # here: builds and packs .devbundle/
#   device run: bash scripts/gpu/h200_run.sh [--timings]   (carry .devbundle)
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
timings=""
[[ ${1:-} == --timings ]] && timings="--timings"
tar -xJf .devbundle/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
export DUET_MODELS_DIR=$PWD/models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

echo "== kernel tests"
kernels_tests 2>&1 > "$OUT/kernels_tests.log"; echo "kernels_tests exit $?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/kernels_tests.log" | head -20
echo "== kernel benchmarks"
for b in attention_bench elementwise_bench gemv_bench; do
  command -v $b >/dev/null && { $b > "$OUT/$b.log" 2>&1; grep -v SampleTokens "$OUT/$b.log" | tail -25; }
done
echo "== CUDA backend tests (tiny-code-llama)"
llama_cuda_tests 2>&1 > "$OUT/llama_cuda_tests.log"; echo "llama_cuda_tests exit $?"
grep -E "relative error|CUDA greedy|diverges|^\[  (PASSED|FAILED) |FAILED  \]|Failure|error:" "$OUT/llama_cuda_tests.log" | head -30

echo "== transformers: checkpoint + float32 reference ${timings}"
PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_reference.py --out /tmp/llama8b $timings 2>&1 | grep -v Warning | tee "$OUT/hf.log" | tail -5
echo "== CUDA logits vs transformers float32 (Llama-3-8B shape, random weights)"
cuda_logits_check --model /tmp/llama8b --tokens /tmp/llama8b/tokens.json --logits /tmp/llama8b/logits.f32 --baseline-logits /tmp/llama8b/logits_bf16.f32 2>&1 | tee "$OUT/logits_check.log"
echo "== Duet CUDA benchmark"
cuda_llama_bench --model /tmp/llama8b 2>&1 | tee "$OUT/bench.log"
[[ -f /tmp/llama8b/timings.json ]] && cp /tmp/llama8b/timings.json "$OUT/" && cat /tmp/llama8b/timings.json
