#!/usr/bin/env bash
# A change to the kernels library against the build before it, on one card in one call: the GPU
# tests of the new build (TESTS, twice), then attention_bench and cuda_llama_bench's decode step
# (BATCH sequences at CONTEXT tokens, a CUDA graph) and mixed step (the decode rows and a
# MIXED-token prompt chunk, eager) with the new library and the old one, alternating, ROUNDS
# rounds. Both builds are the same programs; only libduet_kernels.so differs (LD_LIBRARY_PATH).
# The tables last.
#
#   here:   mkdir -p /tmp/before/bin /tmp/before/lib; (the build before: cp its libduet_kernels.so
#           to /tmp/before/lib and its duet to /tmp/before/bin)
#           BEFORE_DIR=/tmp/before EXTRA_TARGETS="llama_cuda_tests attention_bench cuda_llama_bench" \
#             scripts/gpu/make_cluster_bundle.sh                    (carry .devcluster; tiny weights out)
#   device: [TESTS="kernels_tests llama_cuda_tests"] [BATCH=64] [CONTEXT=576] [MIXED=320] [ROUNDS=2] \
#             bash scripts/gpu/h200_kernels_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/duet-kernels-ab-out}
batch=${BATCH:-64} context=${CONTEXT:-576} mixed=${MIXED:-320} rounds=${ROUNDS:-2}
export TESTS=${TESTS:-kernels_tests llama_cuda_tests}
source scripts/gpu/devcluster_prologue.sh
run_bundled_tests
llama8b_checkpoint > "$OUT/checkpoint.log" 2>&1
before=/tmp/devbundle/before
[[ -f $before/lib/libduet_kernels.so ]] || { echo "no build before in the bundle (BEFORE_DIR)"; finish_out; exit 1; }
for round in $(seq 1 "$rounds"); do
  for build in new old; do
    lib=(); [[ $build == old ]] && lib=("LD_LIBRARY_PATH=$before/lib:$LD_LIBRARY_PATH")
    env "${lib[@]}" timeout 120 attention_bench > "$OUT/attention_${build}_$round.log" 2>&1 ||
      echo "attention_bench $build $round: exit $?"
    clock_mark
    env "${lib[@]}" timeout 150 cuda_llama_bench --model "$MODEL" --batch "$batch" --context "$context" --prefill none \
      --mixed-prompt "$mixed" > "$OUT/step_${build}_$round.log" 2>&1 || echo "cuda_llama_bench $build $round: exit $?"
    clock_summary "round $round $build" | tee -a "$OUT/clocks_summary.txt"
  done
done
echo "== paged decode attention (attention_bench, Llama-3-8B shape): us at batch x context"
printf '%-6s %-5s' round build; for s in "1 576" "64 576" "128 576" "64 1024" "8 4096" "32 32768"; do printf ' %9s' "${s/ /x}"; done; echo
for round in $(seq 1 "$rounds"); do
  for build in new old; do
    printf '%-6s %-5s' "$round" "$build"
    for s in "1 576" "64 576" "128 576" "64 1024" "8 4096" "32 32768"; do
      set -- $s
      us=$(awk -v b="$1" -v c="$2" '$1 == b && $2 == c && $3 == c {print $5; exit}' "$OUT/attention_${build}_$round.log")
      printf ' %9s' "${us:-?}"
    done
    echo
  done
done
echo "== cuda_llama_bench ms/step: decode (batch $batch, context $context, graph) and mixed (+ $mixed prompt tokens, eager)"
step_table "$rounds" "$batch" build new old
finish_out
