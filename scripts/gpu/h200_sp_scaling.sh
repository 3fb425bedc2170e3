#!/usr/bin/env bash
# One call on a machine with several H200s (issue 21): sequence-parallel prefill with one rank per
# GPU at 1, 2, 4 (and 8) ranks for 8k, 32k and 128k-token prompts, on a random-weight
# Llama-3-8B-shaped checkpoint with Llama-3.1 RoPE scaling (131,072 positions); then the cluster
# end to end (router, a prefill worker's group across GPUs, a decode worker on a GPU of its own)
# serving 128k-token prompts (scripts/gpu/sp_cluster_e2e.sh). Nothing is built there: the binaries
# come in the cluster bundle. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 here and set again by
# the programs themselves). On one GPU there is nothing to scale: only the cluster's dry run (a
# group of 2 on that GPU, 16k-token prompts) runs, to check the plumbing before a multi-GPU call.
#
#   here:   EXTRA_TARGETS="llama_cuda_tests ring_transport_tests sp_prefill_bench" scripts/gpu/make_cluster_bundle.sh
#           mkdir -p /tmp/hold; mv models/tiny-code-llama/*.safetensors models/tiny-code-llama/*.index.json \
#             models/tiny-code-llama-draft /tmp/hold/      (the tests remake the tiny model from its config)
#   device: bash scripts/gpu/h200_sp_scaling.sh     (carry .devcluster)
#   here:   mv the tiny model's files back
#   After h200_cluster.sh in the same call (one bundle with both scripts' EXTRA_TARGETS), its
#   checkpoint's weights are reused: `bash scripts/gpu/h200_cluster.sh; OUT=$OUT/sp bash scripts/gpu/h200_sp_scaling.sh`.
#
# Printed: the group tests on every GPU (the NCCL and peer transports, N ranks against one rank),
# then per transport the table of sp_prefill_bench --devices: TTFT (prefill to the last token's
# logits) per rank count, speed-up, scaling efficiency (1-rank time / (N x N-rank time)), the
# communication not hidden (how long the ranks' compute waited for ring blocks) and the output
# check (greedy token and logits against one rank); then the cluster's requests. Logs under $OUT.
#   TOKENS=8192,32768,131072 TRANSPORTS="nccl peer" REPEATS=2 LAYERS=32 (the defaults)
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/duet-sp-scaling-out}
source scripts/gpu/devcluster_prologue.sh
source scripts/gpu/sp_cluster_e2e.sh
MODEL=/tmp/llama8b-long
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
DEVICES=$(seq -s, 0 $((GPUS - 1)))
RANKS=""
for n in 2 4 8; do ((n <= GPUS)) && RANKS+="${RANKS:+,}$n"; done

echo "== checkpoint (transformers, random weights, ${LAYERS:-32} layers, Llama-3.1 RoPE scaling)"
# h200_cluster.sh's checkpoint, made earlier in the same call, has the same (seeded) weights: link
# them under the long-context config.
if [[ ! -f $MODEL/config.json && -f /tmp/llama8b/config.json && ${LAYERS:-32} == 32 ]]; then
  mkdir -p "$MODEL" && ln -sf /tmp/llama8b/*.safetensors /tmp/llama8b/*.json "$MODEL/" && rm "$MODEL/config.json" &&
    cp /tmp/llama8b/config.json "$MODEL/" &&
    python3 -c "import sys; sys.path.insert(0, 'scripts/gpu'); from hf_reference import make_long_context
make_long_context('$MODEL/config.json')" && echo "linked /tmp/llama8b's weights"
fi
llama8b_checkpoint "${LAYERS:-32}" True

if [[ -z $RANKS ]]; then
  echo "one GPU: nothing to scale (h200_sp.sh measures virtual ranks); the cluster's dry run only"
else
  remake_tiny_model
  export DUET_MODELS_DIR=$PWD/models
  echo "== group tests on $GPUS GPUs"
  for bin in ring_transport_tests llama_cuda_tests; do
    $bin --gtest_filter='RingTransport.*:*SequenceParallelGroup*:-*HuggingFace*' > "$OUT/$bin.log" 2>&1
    echo "$bin exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|ranks: " "$OUT/$bin.log" | head -20
  done
  for transport in ${TRANSPORTS:-nccl peer}; do
    echo "== sp_prefill_bench --devices $DEVICES --sp-transport $transport --ranks $RANKS"
    sp_prefill_bench --model "$MODEL" --devices "$DEVICES" --sp-transport "$transport" --ranks "$RANKS" \
      --tokens "${TOKENS:-8192,32768,131072}" --repeats "${REPEATS:-2}" 2>&1 | tee "$OUT/sp_scaling_$transport.txt"
  done
fi
sp_cluster_e2e "$GPUS"
finish_out
