#!/usr/bin/env bash
# What running a step's kernels one launch at a time costs against its CUDA graph: cuda_llama_bench's
# decode step (BATCH sequences at CONTEXT tokens) as a graph and eagerly (--no-cuda-graphs),
# alternating, ROUNDS rounds, beside a mixed step (the decode rows and a MIXED-token prompt chunk,
# always eager). The eager decode step has the kernels of a mixed step's layers, so its extra time
# bounds what a mixed-step graph could save. Runs on the cluster bundle (cuda_llama_bench in
# EXTRA_TARGETS); the table last.
#
#   here:   EXTRA_TARGETS="cuda_llama_bench" scripts/gpu/make_cluster_bundle.sh
#   device: [BATCH=64] [CONTEXT=576] [MIXED=320] [ROUNDS=2] bash scripts/gpu/h200_eager_step.sh   (carry .devcluster)
set -uo pipefail
OUT=${OUT:-/tmp/duet-eager-out}
batch=${BATCH:-64} context=${CONTEXT:-576} mixed=${MIXED:-320} rounds=${ROUNDS:-2}
source scripts/gpu/devcluster_prologue.sh
llama8b_checkpoint > "$OUT/checkpoint.log" 2>&1
for round in $(seq 1 "$rounds"); do
  for mode in graph eager; do
    flag=(); [[ $mode == eager ]] && flag=(--no-cuda-graphs)
    clock_mark
    timeout 150 cuda_llama_bench --model "$MODEL" --batch "$batch" --context "$context" --prefill none \
      --mixed-prompt "$mixed" "${flag[@]}" > "$OUT/step_${mode}_$round.log" 2>&1 || echo "$mode $round: exit $?"
    clock_summary "round $round $mode" | tee -a "$OUT/clocks_summary.txt"
  done
done
echo "== decode ms/step (batch $batch, context $context) and the mixed step (+ $mixed prompt tokens, eager)"
step_table "$rounds" "$batch" mode graph eager
finish_out
