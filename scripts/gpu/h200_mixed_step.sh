#!/usr/bin/env bash
# The mixed step (a batch's decode rows beside a prompt chunk) on the GPU machine, in one call:
# the attention and GEMM kernels' tests and the CUDA backend's, twice each; then cuda_llama_bench's
# prefill and mixed steps (fresh and continuing prompt chunks: N@S is N tokens from position S, as
# chunked prefill sends a prompt's later chunks) with the mixed step's attention in one launch and
# in two (--no-mixed-launch), alternating, ROUNDS rounds; the SM clock and power over each run;
# optionally gemm_shapes_bench --search at a mixed step's row counts (cuBLAS's default against
# every configuration cuBLASLt accepts). Logs under $OUT, the tables last.
#
#   here:       TARGETS="kernels_tests llama_cuda_tests cuda_llama_bench gemm_shapes_bench" \
#                 scripts/gpu/make_bundle.sh    (carry .devbundle; the draft model need not travel)
#   device run: [MIXED=...] [ROUNDS=2] [TESTS=0] [SEARCH_ROWS=320,576] [SEARCH_SECONDS=150] bash scripts/gpu/h200_mixed_step.sh
# TESTS=0 skips the tests (they need models/tiny-code-llama in the tree).
set -uo pipefail
mixed=${MIXED:-256,512,256@256,192@320} rounds=${ROUNDS:-2}
search_rows=${SEARCH_ROWS:-none} search_seconds=${SEARCH_SECONDS:-150}
source scripts/gpu/devbundle_prologue.sh
export DUET_MODELS_DIR=$PWD/models
start_checkpoint
[[ ${TESTS:-1} == 0 ]] || kernel_and_backend_tests '*Attention*:WideGemm*:SkinnyGemm*'
await_checkpoint
for round in $(seq 1 "$rounds"); do
  for launch in one two; do
    section "round $round: mixed attention in $launch launch(es)"
    flag=(); [[ $launch == two ]] && flag=(--no-mixed-launch)
    clock_mark
    timeout 120 cuda_llama_bench --model /tmp/llama8b --batch 64 --context 576 --prefill 512 --mixed-prompt "$mixed" \
      "${flag[@]}" > "$OUT/mixed_${launch}_$round.log" 2>&1 || echo "exit $?"
    clock_summary "  clocks" | tee "$OUT/mixed_${launch}_${round}_clocks.txt"
  done
done
if [[ $search_rows != none ]]; then
  section "cuBLASLt configurations at $search_rows rows"
  timeout "$search_seconds" gemm_shapes_bench --rows "$search_rows" --reps 10 --search > "$OUT/search.log" 2>&1 ||
    echo "exit $?"
fi
for round in $(seq 1 "$rounds"); do
  for launch in one two; do
    log=$OUT/mixed_${launch}_$round.log
    echo "--- round $round, attention in $launch launch(es)"
    grep -A1 "^prefill " "$log" | tail -1
    grep -A2 "^decode floor" "$log" | tail -1
    grep -A8 "^mixed steps" "$log" | tail -n +3
  done
done
if [[ -f $OUT/search.log ]]; then cat "$OUT/search.log"; fi
