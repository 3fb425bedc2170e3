#!/usr/bin/env bash
# One call on the GPU machine for sequence-parallel prefill on virtual ranks of one H200: the GPU
# tests (ring-attention state kernels, the ring schedule, LlamaCuda's sequence-parallel prefill
# against the CPU backend and one CUDA rank), twice each; then a random-weight Llama-3-8B-shaped
# checkpoint with Llama-3.1 RoPE scaling (131,072 positions) and sp_prefill_bench on it: the output
# check and the projected multi-GPU prefill. The table is the last thing printed; logs under $OUT.
#
#   here:   TARGETS="kernels_tests parallel_tests llama_cuda_tests ring_transport_tests sp_prefill_bench" \
#             BUNDLE_DIR=.devbundle/sp scripts/gpu/make_bundle.sh
#           cp models/tiny-code-llama/config.json .devbundle/sp/tiny-config.json
#           mv models /tmp/duet-models-hold      (the tree and the bundle must fit 64 MiB)
#   device: BUNDLE_DIR=.devbundle/sp bash scripts/gpu/h200_sp.sh        (carry .devbundle/sp)
#   here:   mv /tmp/duet-models-hold models
# Without models/ on the device, the tests' tiny-code-llama is remade there with random weights
# in its shape (the tests compare CUDA with the CPU backend, not with stored outputs).
#   TOKENS=8192,32768,131072 RANKS=2,4,8 REPEATS=2 LAYERS=32 (the defaults); SKIP_TESTS=1
#   GROUP_DEVICES=0,0,0,0: the benchmark's group mode as well (one executor per rank, rank r on
#   the r-th device listed; on one GPU the group's code and numerics, not its speed-up), at
#   GROUP_TOKENS (default TOKENS) and GROUP_RANKS (default 2,4); SKIP_VIRTUAL=1 skips the
#   virtual-rank table.
set -uo pipefail
OUT=${OUT:-/tmp/duet-sp-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle/sp}
mkdir -p "$OUT"
if [[ ! -f models/tiny-code-llama/config.json ]]; then
  mkdir -p models/tiny-code-llama
  python3 scripts/gpu/random_tiny_model.py "$BUNDLE_DIR/tiny-config.json" "models/tiny-code-llama" 2>&1 | grep -v Warning | tail -2
fi
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  RUNS=2 TESTS="kernels_tests parallel_tests llama_cuda_tests ring_transport_tests" OUT=$OUT BUNDLE_DIR=$BUNDLE_DIR \
    bash scripts/gpu/h200_tests.sh --gtest_filter='PrefillAttention.*:Ring*:*SequenceParallel*:LlamaCuda.Bf16Prefill*' \
    2>&1 | tail -12
else
  tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
fi
source /tmp/devbundle/env.sh
MODEL=/tmp/llama8b-long
echo "== checkpoint (transformers, random weights, ${LAYERS:-32} layers, Llama-3.1 RoPE scaling)"
python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', ${LAYERS:-32}, long_context=True)" 2>&1 | grep -v Warning | tail -2
if [[ ${SKIP_VIRTUAL:-0} != 1 ]]; then
  echo "== sp_prefill_bench (virtual ranks)"
  sp_prefill_bench --model "$MODEL" --tokens "${TOKENS:-8192,32768,131072}" --ranks "${RANKS:-2,4,8}" \
    --repeats "${REPEATS:-2}" 2>&1 | tee "$OUT/sp_prefill_bench.txt" | tail -20
fi
if [[ -n ${GROUP_DEVICES:-} ]]; then
  echo "== sp_prefill_bench --devices $GROUP_DEVICES (a group of executors)"
  sp_prefill_bench --model "$MODEL" --devices "$GROUP_DEVICES" --tokens "${GROUP_TOKENS:-${TOKENS:-8192,32768,131072}}" \
    --ranks "${GROUP_RANKS:-2,4}" --repeats "${REPEATS:-2}" 2>&1 | tee "$OUT/sp_group_bench.txt" | tail -20
fi
