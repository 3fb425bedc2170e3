#!/usr/bin/env bash
# The mixed step (a batch's decode rows beside a prompt chunk) on the GPU machine, in one call:
# the GEMM kernels' tests and the CUDA backend's, twice each; cuda_llama_bench's mixed steps with
# fresh and continuing prompt chunks (N@S: N tokens from position S, as chunked prefill sends a
# prompt's later chunks), the decode step with and without CUDA graphs (mixed steps run eagerly),
# and gemm_shapes_bench --search at a mixed step's row counts (cuBLAS's default against every
# configuration cuBLASLt accepts). Each part has a time limit, so the call ends within ~7 minutes.
# Logs under $OUT, the tables last.
#
#   here:       TARGETS="kernels_tests llama_cuda_tests cuda_llama_bench wide_gemm_bench gemm_shapes_bench" \
#                 scripts/gpu/make_bundle.sh    (carry .devbundle; the draft model need not travel)
#   device run: [MIXED=...] [SEARCH_ROWS=320,576|none] [SEARCH_SECONDS=150] bash scripts/gpu/h200_mixed_step.sh
set -uo pipefail
mixed=${MIXED:-256,512,256@256,192@320,320@192} search_rows=${SEARCH_ROWS:-320,576} search_seconds=${SEARCH_SECONDS:-150}
source scripts/gpu/devbundle_prologue.sh
export DUET_MODELS_DIR=$PWD/models
start_checkpoint
gemm_and_backend_tests
await_checkpoint
section "mixed steps"
timeout 150 cuda_llama_bench --model /tmp/llama8b --batch 64 --context 576 --prefill 512 --mixed-prompt "$mixed" \
  > "$OUT/mixed.log" 2>&1 || echo "exit $?"
section "decode without graphs"
timeout 90 cuda_llama_bench --model /tmp/llama8b --batch 64 --context 576 --prefill none --no-cuda-graphs \
  > "$OUT/eager.log" 2>&1 || echo "exit $?"
if [[ $search_rows != none ]]; then
  section "cuBLASLt configurations at $search_rows rows"
  timeout "$search_seconds" gemm_shapes_bench --rows "$search_rows" --reps 10 --search > "$OUT/search.log" 2>&1 ||
    echo "exit $?"
fi
grep -B1 -A3 "^prefill " "$OUT/mixed.log"
grep -A2 "^decode floor" "$OUT/mixed.log"
grep -A10 "^mixed steps" "$OUT/mixed.log"
echo "--- without graphs"; grep -A2 "^decode floor" "$OUT/eager.log" | tail -1
[[ -f $OUT/search.log ]] && cat "$OUT/search.log"
