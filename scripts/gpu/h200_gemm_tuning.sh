#!/usr/bin/env bash
# The load-time GEMM tuning (backends/cuda/gemm_tuning.h) on the GPU machine, in one call:
# gemm_tuning_tests and the CUDA backend's tests, twice each; then cuda_llama_bench (random
# Llama-3-8B shape: 512-token prefill, decode at 64 × 576, mixed steps of 64 decode rows + a prompt
# chunk) with the tuning up to 1024 rows and without it, alternating, ROUNDS rounds. The first
# tuned run prints the tuning's table (cuBLAS's default against cuBLASLt's fastest candidate, per
# shape). Logs under $OUT, the tables last.
#
#   here:       TARGETS="gemm_tuning_tests llama_cuda_tests kernels_tests cuda_llama_bench" scripts/gpu/make_bundle.sh
#               (carry .devbundle; the draft model need not travel), or the cluster pack with
#               EXTRA_TARGETS="gemm_tuning_tests llama_cuda_tests cuda_llama_bench" scripts/gpu/make_cluster_bundle.sh
#               (carry .devcluster; run with BUNDLE=.devcluster/bundle.tar.xz)
#   device run: [MIXED=...] [ROUNDS=2] [TESTS=0] bash scripts/gpu/h200_gemm_tuning.sh
set -uo pipefail
mixed=${MIXED:-320,256@256,384@128} rounds=${ROUNDS:-2}
source scripts/gpu/devbundle_prologue.sh
export DUET_MODELS_DIR=$PWD/models
start_checkpoint
if [[ ${TESTS:-1} != 0 ]]; then
  for run in 1 2; do
    section "gemm_tuning_tests, run $run"
    timeout 120 gemm_tuning_tests > "$OUT/gemm_tuning_tests_$run.log" 2>&1
    echo "gemm_tuning_tests: exit $?, $(grep -c '^\[       OK' "$OUT/gemm_tuning_tests_$run.log") passed"
    grep -hE "^\[  FAILED|Failure$" "$OUT/gemm_tuning_tests_$run.log" | head -8
  done
  kernel_and_backend_tests 'FillRandomBf16*'  # the tuning's random input; the CUDA backend's tests
fi
await_checkpoint
for round in $(seq 1 "$rounds"); do
  for tuning in 1024 0; do
    section "round $round: --gemm-tuning-max-rows $tuning"
    clock_mark
    timeout 150 cuda_llama_bench --model /tmp/llama8b --batch 64 --context 576 --prefill 512 --mixed-prompt "$mixed" \
      --gemm-tuning-max-rows "$tuning" > "$OUT/bench_${tuning}_$round.log" 2>&1 || echo "exit $?"
    clock_summary "  clocks" | tee "$OUT/bench_${tuning}_${round}_clocks.txt"
  done
done
sed -n '/^GEMM tuning/,/^read ceiling/p' "$OUT/bench_1024_1.log" | grep -v "^read ceiling"
for round in $(seq 1 "$rounds"); do
  for tuning in 1024 0; do
    log=$OUT/bench_${tuning}_$round.log
    echo "--- round $round, tuning up to $tuning rows ($(grep '^load' "$log"))"
    grep -A1 "^prefill " "$log" | tail -1
    grep -A2 "^decode floor" "$log" | tail -1
    grep -A8 "^mixed steps" "$log" | tail -n +3
  done
done
# At most 8 files come back from a call: the logs in one archive.
kill "$clock_sampler_pid" 2>/dev/null
tar -C "$OUT" -czf /tmp/gemm_tuning_logs.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/gemm_tuning_logs.tgz "$OUT/"
