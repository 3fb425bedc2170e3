#!/usr/bin/env bash
# The engine alone (`duet generate --backend cuda`, the cluster's decode engine without the cluster)
# on the cluster benchmark's workload (duet-bench's random 512-token prompts, 128 generated tokens,
# --ignore-eos, 256 requests 64 at a time, or NUM_PROMPTS) at several step budgets and kernel
# choices, alternating, ROUNDS rounds: which serves that closed loop fastest, each run's steps
# (count, ms each) and the SM clock and power it ran at. A budget is T (--max-num-batched-tokens T)
# or T/M (and --max-num-mixed-tokens M); a variant is "default" or the environment of its runs,
# VAR=VALUE[,VAR=VALUE...] (e.g. DUET_GEMM_TUNING_MAX_ROWS=0, backends/executor_factory.cpp), where
# weights=constant is no variable but runs a copy of the checkpoint whose every weight holds one
# value (constant_checkpoint.py: the same work drawing less power), build=before runs the bundle's
# build before a change (make_cluster_bundle.sh's BEFORE_DIR) instead of its own, and flag=F adds
# the flag F to `duet generate` (e.g. flag=--no-async-scheduling).
# One call, ~1 minute a run; the table last.
#
#   here:   scripts/gpu/make_cluster_bundle.sh; mv models /tmp/duet-models-hold    (carry .devcluster)
#   device: [BUDGETS="384 1024 1024/384"] [VARIANTS="default ..."] [ROUNDS=2] [NUM_PROMPTS=256] [TESTS="..."] \
#             bash scripts/gpu/h200_engine_budget.sh
#   here:   mv /tmp/duet-models-hold models
set -uo pipefail
budgets=${BUDGETS:-384 1024 1024/384} variants=${VARIANTS:-default} rounds=${ROUNDS:-2} num_prompts=${NUM_PROMPTS:-256}
OUT=${OUT:-/tmp/duet-engine-out}
source scripts/gpu/devcluster_prologue.sh
[[ -n ${TESTS:-} ]] && run_bundled_tests
llama8b_checkpoint
duet-bench --dataset random --tokenizer "$MODEL" --input-len 512 --output-len 128 --ignore-eos --seed 1 \
  --num-prompts "$num_prompts" --save-requests "$OUT/requests.jsonl" 2> "$OUT/bench.log" || echo "duet-bench exit $?"
before=/tmp/devbundle/before  # make_cluster_bundle.sh's BEFORE_DIR, unpacked
run_name() { echo "${1/\//-}_$(tr -c 'A-Za-z0-9_-' '_' <<< "$2")"; }  # budget, variant
for round in $(seq 1 "$rounds"); do
  for budget in $budgets; do
    for variant in $variants; do
      echo "== round $round, budget $budget, $variant"
      environment=() model=$MODEL program=duet kept=() flags=()
      [[ $variant != default ]] && IFS=, read -ra environment <<< "$variant"
      for e in "${environment[@]}"; do
        case $e in
          weights=constant)
            model=/tmp/llama8b-constant
            [[ -f $model/config.json ]] || python3 scripts/gpu/constant_checkpoint.py "$MODEL" "$model" ;;
          build=before) program=$before/bin/duet kept+=("LD_LIBRARY_PATH=$before/lib:$LD_LIBRARY_PATH") ;;
          flag=*) flags+=("${e#flag=}") ;;
          *) kept+=("$e") ;;
        esac
      done
      environment=("${kept[@]}")
      log=$OUT/engine_$(run_name "$budget" "$variant")_$round.log
      clock_mark
      env "${environment[@]}" "$program" generate --model "$model" --backend cuda --gpu-memory-utilization 0.9 \
        --max-model-len 4096 --max-num-batched-tokens "${budget%/*}" \
        --max-num-mixed-tokens "$([[ $budget == */* ]] && echo "${budget#*/}" || echo 0)" \
        --max-num-seqs 64 --warmup 16 "${flags[@]}" --input "$OUT/requests.jsonl" --output /tmp/engine_out.jsonl 2> "$log" ||
        echo "generate exit $?"
      clock_summary "  clocks" | tee "${log%.log}_clocks.txt"
    done
  done
done
echo "  budget round  out tok/s  steps  ms/step  TTFT median ms  variant"
for round in $(seq 1 "$rounds"); do
  for budget in $budgets; do
    for variant in $variants; do
      sed -n 's/.*tokens in [0-9.]* s (\([0-9.]*\) tok\/s), TTFT median \([0-9.]*\) ms.*, \([0-9]*\) steps of \([0-9.]*\) ms.*/\1 \3 \4 \2/p' \
        "$OUT/engine_$(run_name "$budget" "$variant")_$round.log" | tail -1 |
        while read -r toks steps ms ttft; do
          printf "%8s %5s %10s %6s %8s %15s  %s\n" "$budget" "$round" "$toks" "$steps" "$ms" "$ttft" "$variant"
        done
    done
  done
done
kill "$clock_sampler_pid" 2>/dev/null
finish_out
