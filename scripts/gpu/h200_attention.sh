#!/usr/bin/env bash
# The attention kernels on the GPU machine, in one call: their tests and the CUDA backend's (twice
# each), attention_bench (decode at the serving shapes, prefill at every planned tiling), and
# cuda_llama_bench on a random-weight Llama-3-8B-shaped checkpoint (prefill of short prompts and
# the decode step). Logs under $OUT, the tables last.
#
#   here:       TARGETS="kernels_tests llama_cuda_tests attention_bench cuda_llama_bench" scripts/gpu/make_bundle.sh
#               (carry .devbundle; models/tiny-code-llama must travel, the draft model need not)
#   device run: [PREFILL=512,1024,2048] [BATCH=8,32,64] [CONTEXT=576] [MIXED=256,512] bash scripts/gpu/h200_attention.sh
#   MIXED: also time steps carrying a prompt chunk of each length beside the batch's decode rows
#   (cuda_llama_bench --mixed-prompt), against the decode step and the prompt apart.
set -uo pipefail
prefill=${PREFILL:-512,1024,2048} batch=${BATCH:-8,32,64} context=${CONTEXT:-576} mixed=${MIXED:-none}
source scripts/gpu/devbundle_prologue.sh
export DUET_MODELS_DIR=$PWD/models
start_checkpoint
for run in 1 2; do
  section "tests, run $run"
  kernels_tests --gtest_filter='PrefillAttention*:PagedDecode*:PagedAttention*' > "$OUT/kernels_tests_$run.log" 2>&1
  echo "kernels_tests (attention): exit $?, $(grep -c '^\[       OK' "$OUT/kernels_tests_$run.log") passed"
  llama_cuda_tests --gtest_filter='-*DraftModel*:*EveryGpu*:*OverNccl*' > "$OUT/llama_cuda_tests_$run.log" 2>&1
  echo "llama_cuda_tests: exit $?, $(grep -c '^\[       OK' "$OUT/llama_cuda_tests_$run.log") passed"
  grep -E "FAILED|Failure" "$OUT/kernels_tests_$run.log" "$OUT/llama_cuda_tests_$run.log" | head -12
done
section "attention_bench"
attention_bench > "$OUT/attention_bench.log" 2>&1; echo "exit $?"
await_checkpoint
section "cuda_llama_bench"
cuda_llama_bench --model /tmp/llama8b --prefill "$prefill" --batch "$batch" --context "$context" --mixed-prompt "$mixed" \
  > "$OUT/llama_bench.log" 2>&1
echo "exit $?"
grep -E "^ *(batch|[0-9]+ )" "$OUT/attention_bench.log" | grep -E "^ *(batch| *(32|64) +(576|1024) )" | head -12
grep -A22 "^prefill attention" "$OUT/attention_bench.log" | tail -n +2
grep -B1 -A4 "^prefill " "$OUT/llama_bench.log"
grep -A4 "^batch" "$OUT/llama_bench.log"
grep -A30 "^mixed steps" "$OUT/llama_bench.log"
