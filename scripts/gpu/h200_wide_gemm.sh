#!/usr/bin/env bash
# The tiled tensor-core GEMM for prompt-sized batches (kernels/gemm/wide_gemm.h) on the GPU
# machine, in one call: its kernel tests, SkinnyGemm's (they share the wgmma helpers) and the CUDA
# backend's, twice each; the kernel against cuBLAS at the Llama-3-8B projection shapes; and
# cuda_llama_bench on a random-weight Llama-3-8B-shaped checkpoint with it and without it
# (--wide-gemm-min-rows $WIDE_MIN, default 64, against 0, alternating runs): 512- and 2048-token
# prefill, the decode step (64 rows: WideGemm's smallest tile), and mixed steps of a prompt chunk
# beside the batch's decode rows. Logs under $OUT, the tables last.
#
#   here:       TARGETS="kernels_tests llama_cuda_tests cuda_llama_bench wide_gemm_bench" scripts/gpu/make_bundle.sh
#               (carry .devbundle/bundle.tar.xz; models/tiny-code-llama must travel, the draft model need not)
#   device run: [ROUNDS=2] [ROWS=...] [MIXED=256,512] [BATCH=64] [WIDE_MIN=64] bash scripts/gpu/h200_wide_gemm.sh
set -uo pipefail
rounds=${ROUNDS:-2} rows=${ROWS:-64,96,128,192,256,320,384,512,576,1024,2048} mixed=${MIXED:-256,512} batch=${BATCH:-64}
wide_min=${WIDE_MIN:-64}
source scripts/gpu/devbundle_prologue.sh
export DUET_MODELS_DIR=$PWD/models
start_checkpoint
kernel_and_backend_tests
section "wide_gemm_bench"
timeout 300 wide_gemm_bench --rows "$rows" > "$OUT/wide_gemm_bench.log" 2>&1; echo "exit $?"
for splits in 1 2 4; do  # the plan's choice against each fixed split
  timeout 300 wide_gemm_bench --rows 256,320,576 --splits $splits > "$OUT/wide_gemm_bench_splits$splits.log" 2>&1
  echo "--splits $splits: exit $?"
done
for tile in 128 192; do  # the plan's row tiles (160 at 320 rows) against others
  timeout 300 wide_gemm_bench --rows 320,576,1024 --row-tile $tile > "$OUT/wide_gemm_bench_tile$tile.log" 2>&1
  echo "--row-tile $tile: exit $?"
done
await_checkpoint
for round in $(seq 1 "$rounds"); do
  for side in wide cublas; do
    flag=(--wide-gemm-min-rows "$wide_min"); [[ $side == cublas ]] && flag=(--wide-gemm-min-rows 0)
    section "cuda_llama_bench, round $round, $side"
    timeout 300 cuda_llama_bench --model /tmp/llama8b --prefill 512,2048 --batch "$batch" --context 576 \
      --mixed-prompt "$mixed" "${flag[@]}" > "$OUT/llama_${side}_$round.log" 2>&1 || echo "exit $?"
  done
done
cat "$OUT/wide_gemm_bench.log"
for splits in 1 2 4; do echo "--- every shape split $splits ways"; grep -A4 "^ rows" "$OUT/wide_gemm_bench_splits$splits.log"; done
for tile in 128 192; do echo "--- row tile $tile"; grep -A4 "^ rows" "$OUT/wide_gemm_bench_tile$tile.log"; done
for side in wide cublas; do
  echo "--- $side, round 1"
  grep -A3 "^prefill " "$OUT/llama_${side}_1.log"
  grep -A2 "^decode floor" "$OUT/llama_${side}_1.log"
  grep -A12 "^mixed steps" "$OUT/llama_${side}_1.log"
done
for round in $(seq 2 "$rounds"); do
  for side in wide cublas; do
    echo "--- $side, round $round"
    grep -A3 "^prefill " "$OUT/llama_${side}_$round.log"
    grep -A2 "^decode floor" "$OUT/llama_${side}_$round.log" | tail -n +3
    grep -A12 "^mixed steps" "$OUT/llama_${side}_$round.log" | tail -n +2
  done
done
