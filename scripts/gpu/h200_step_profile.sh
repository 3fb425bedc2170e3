#!/usr/bin/env bash
# Where a decode step's and a prefill's GPU time goes, kernel by kernel, on the GPU machine: Nsight
# Compute times every kernel of `cuda_llama_bench` run eagerly (each kernel alone, so PDL overlap is
# not in these figures) on a random-weight Llama-3-8B-shaped checkpoint; kernel_profile.py sums the
# last decode step and the last prefill by kernel. The same bench with CUDA graphs gives the step
# time as the engine runs it.
#
# CACHE=none times each kernel with the caches as the kernels before it left them (default: all,
# flushed before each). MIXED=256[,192@320,...] adds mixed steps: the batch's decode rows beside a
# prompt chunk (N tokens, or N@S: from position S), as the engine runs them (eagerly); the bench
# times each and Nsight Compute profiles the first (h200_mixed_step.sh times them without ncu).
# GEMM_ROWS=8,64 adds a throughput breakdown (DRAM, L2, L1, SM, as % of peak) of SkinnyGemm and
# cuBLAS at those row counts (skinny_gemm_bench must be in the bundle).
#
#   here:       TARGETS="cuda_llama_bench skinny_gemm_bench" scripts/gpu/make_bundle.sh     (carry .devbundle)
# SEARCH_ROWS=64,320,576: gemm_shapes_bench --search at those rows (cuBLAS's default against every
# configuration cuBLASLt accepts; gemm_shapes_bench must be in the bundle).
# DETAIL=regex: instead of the step tables, Nsight Compute's full sections (throughput, memory,
# occupancy, warp stall reasons) for one decode-step launch of the kernel that matches.
#
#   device run: [BATCH=64] [CONTEXT=576] [PREFILL=512] [CACHE=all|none] [MIXED=256] [GEMM_ROWS=8,64] [SEARCH_ROWS=64,320] [DETAIL=regex]
#               bash scripts/gpu/h200_step_profile.sh
set -uo pipefail
batch=${BATCH:-64} context=${CONTEXT:-576} prefill=${PREFILL:-512} cache=${CACHE:-all}
source scripts/gpu/devbundle_prologue.sh
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
section "checkpoint"
[[ -f /tmp/llama8b/config.json ]] ||  # an earlier script of the same call may have made it
  python3 scripts/gpu/hf_reference.py --out /tmp/llama8b --checkpoint-only > "$OUT/checkpoint.log" 2>&1 ||
  { tail "$OUT/checkpoint.log"; exit 1; }
section "decode and prefill with CUDA graphs"
mixed_args=(); [[ -n ${MIXED:-} ]] && mixed_args=(--mixed-prompt "$MIXED")
clock_mark
cuda_llama_bench --model /tmp/llama8b --batch "$batch" --context "$context" --prefill "$prefill" "${mixed_args[@]}" 2>&1 |
  tee "$OUT/bench.log" | tail -16
clock_summary "the bench with graphs"
profile() {  # name, bench args...
  local name=$1; shift
  section "ncu: $name"
  "$ncu" --clock-control none --cache-control "$cache" --metrics gpu__time_duration.sum --csv --print-units base \
    cuda_llama_bench --model /tmp/llama8b --no-cuda-graphs --steps 5 "$@" > "$OUT/$name.csv" 2> "$OUT/$name.err"
  echo "exit $?, $(grep -c gpu__time_duration "$OUT/$name.csv") kernels"
}
if [[ -n ${DETAIL:-} ]]; then
  section "ncu: $DETAIL in a decode step, full sections"
  "$ncu" --clock-control none --cache-control none -k "regex:$DETAIL" --launch-skip 64 --launch-count 1 --set full \
    cuda_llama_bench --model /tmp/llama8b --no-cuda-graphs --steps 5 --batch "$batch" --context "$context" \
    --prefill none > "$OUT/detail.txt" 2>&1
  echo "exit $?"
  grep -E "^    [A-Z][A-Za-z /()%.-]+ {2,}[a-zA-Z/%]* +[0-9.,]+$" "$OUT/detail.txt" | head -120
  exit 0
fi
profile decode --batch "$batch" --context "$context" --prefill none
profile prefill --batch 1 --context 16 --prefill "$prefill"
python3 scripts/gpu/kernel_profile.py "$OUT/decode.csv" --last-step 2>&1 | tee "$OUT/decode_table.txt"
if [[ -n ${MIXED:-} ]]; then  # the bench times the decode-first mixed step last, so it is the run's tail
  profile mixed --batch "$batch" --context "$context" --prefill none --mixed-prompt "${MIXED%%,*}"
  python3 scripts/gpu/kernel_profile.py "$OUT/mixed.csv" --last-step 2>&1 | tee "$OUT/mixed_table.txt"
fi
python3 scripts/gpu/kernel_profile.py "$OUT/prefill.csv" 2>&1 | tee "$OUT/prefill_table.txt"
if [[ -n ${GEMM_ROWS:-} ]]; then
  for rows in ${GEMM_ROWS//,/ }; do
    section "ncu: GEMM throughput at $rows rows"
    "$ncu" --clock-control none --cache-control none -k 'regex:SkinnyGemm|nvjet|gemm' --launch-count 400 --csv \
      --print-units base --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
l1tex__throughput.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed \
      skinny_gemm_bench --rows "$rows" --chain 1 > "$OUT/gemm_$rows.csv" 2> "$OUT/gemm_$rows.err"
    echo "exit $?"
    python3 scripts/gpu/kernel_profile.py "$OUT/gemm_$rows.csv" --by-kernel 2>&1 | tee "$OUT/gemm_${rows}_table.txt"
  done
fi
if [[ -n ${SEARCH_ROWS:-} ]]; then
  section "cuBLASLt configurations at $SEARCH_ROWS rows"
  timeout 400 gemm_shapes_bench --rows "$SEARCH_ROWS" --reps 20 --search > "$OUT/gemm_search.log" 2>&1
  echo "exit $?"; cat "$OUT/gemm_search.log"
fi
