#!/usr/bin/env bash
# One call on a machine with several H200s (issue 21): sequence-parallel prefill with one rank per
# GPU at 1, 2, 4 (and 8) ranks for 8k, 32k and 128k-token prompts, on a random-weight
# Llama-3-8B-shaped checkpoint with Llama-3.1 RoPE scaling (131,072 positions). Nothing is built
# there: the binaries come in the bundle. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 here and
# set again by the programs themselves).
#
#   here:   TARGETS="llama_cuda_tests ring_transport_tests sp_prefill_bench" BUNDLE_DIR=.devbundle/sp \
#             scripts/gpu/make_bundle.sh
#           cp models/tiny-code-llama/config.json .devbundle/sp/tiny-config.json; mv models /tmp/duet-models-hold
#   device: BUNDLE_DIR=.devbundle/sp bash scripts/gpu/h200_sp_scaling.sh     (carry .devbundle/sp)
#   here:   mv /tmp/duet-models-hold models
#
# Printed: the group tests on every GPU (the NCCL and peer transports, N ranks against one rank),
# then per transport the table of sp_prefill_bench --devices: TTFT (prefill to the last token's
# logits) per rank count, speed-up, scaling efficiency (1-rank time / (N x N-rank time)), the
# communication not hidden (how long the ranks' compute waited for ring blocks) and the output
# check (greedy token and logits against one rank). Logs under $OUT.
#   TOKENS=8192,32768,131072 TRANSPORTS="nccl peer" REPEATS=2 LAYERS=32 (the defaults)
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/duet-sp-scaling-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle/sp}
mkdir -p "$OUT"
tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C /tmp || exit 1
source /tmp/devbundle/env.sh
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
DEVICES=$(seq -s, 0 $((GPUS - 1)))
RANKS=""
for n in 2 4 8; do ((n <= GPUS)) && RANKS+="${RANKS:+,}$n"; done
[[ -n $RANKS ]] || { echo "one GPU: nothing to scale (use h200_sp.sh for virtual ranks)"; exit 1; }

if [[ ! -f models/tiny-code-llama/config.json ]]; then
  mkdir -p models/tiny-code-llama
  python3 scripts/gpu/random_tiny_model.py "$BUNDLE_DIR/tiny-config.json" "models/tiny-code-llama" 2>&1 | grep -v Warning | tail -2
fi
export DUET_MODELS_DIR=$PWD/models
echo "== group tests on $GPUS GPUs"
for bin in ring_transport_tests llama_cuda_tests; do
  $bin --gtest_filter='RingTransport.*:*SequenceParallelGroup*' > "$OUT/$bin.log" 2>&1
  echo "$bin exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|ranks: " "$OUT/$bin.log" | head -20
done

MODEL=/tmp/llama8b-long
echo "== checkpoint (transformers, random weights, ${LAYERS:-32} layers, Llama-3.1 RoPE scaling)"
python3 -c "
import sys; sys.path.insert(0, 'scripts/gpu')
from hf_reference import make_checkpoint
make_checkpoint('$MODEL', ${LAYERS:-32}, long_context=True)" 2>&1 | grep -v Warning | tail -2
for transport in ${TRANSPORTS:-nccl peer}; do
  echo "== sp_prefill_bench --devices $DEVICES --sp-transport $transport --ranks $RANKS"
  sp_prefill_bench --model "$MODEL" --devices "$DEVICES" --sp-transport "$transport" --ranks "$RANKS" \
    --tokens "${TOKENS:-8192,32768,131072}" --repeats "${REPEATS:-2}" 2>&1 | tee "$OUT/sp_scaling_$transport.txt"
done
