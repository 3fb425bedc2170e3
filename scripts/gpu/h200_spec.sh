#!/usr/bin/env bash
# One call on the GPU machine for speculative decoding on the CUDA backend: the kernel tests
# (tree-masked prefill attention, KV slot moves), the CUDA backend tests (tree verification
# against the CPU backend, lossless greedy with every speculation mode), then spec_decode_bench
# on tiny-code-llama. Logs go to $OUT.
#
#   here:   BUNDLE_DIR=.devspec TARGETS="kernels_tests llama_cuda_tests spec_decode_bench" scripts/gpu/make_bundle.sh
#           XZ_OPT="-6 -T2" tar -cJf .devspec/models.tar.xz models   # the models compressed (58 -> 41 MB),
#           then move models/ out of the tree for the call: tree + bundle must stay under 64 MiB
#   device: BUNDLE_DIR=.devspec bash scripts/gpu/h200_spec.sh [--bench-only] [bench options...]
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devspec}
mkdir -p "$OUT"
tests=1
if [[ ${1:-} == --bench-only ]]; then tests=0; shift; fi
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
if [[ -f $BUNDLE_DIR/models.tar.xz ]]; then tar -xJf "$BUNDLE_DIR/models.tar.xz" || exit 1; fi
source /tmp/devbundle/env.sh
export DUET_MODELS_DIR=$PWD/models
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if (( tests )); then
  section "kernel tests"
  kernels_tests > "$OUT/kernels_tests.log" 2>&1; echo "kernels_tests exit $?"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/kernels_tests.log" | head -20
  section "CUDA backend tests (tiny-code-llama)"
  llama_cuda_tests > "$OUT/llama_cuda_tests.log" 2>&1; echo "llama_cuda_tests exit $?"
  grep -E "relative error|CUDA greedy|drafts,|diverges|^\[  (PASSED|FAILED) |FAILED  \]|Failure|error:" \
    "$OUT/llama_cuda_tests.log" | head -40
fi
section "spec_decode_bench --backend cuda"
spec_decode_bench --backend cuda --model "$PWD/models/tiny-code-llama" --draft-model "$PWD/models/tiny-code-llama-draft" \
  --source-root "$PWD" "$@" 2>&1 | tee "$OUT/spec_decode_bench.log"
