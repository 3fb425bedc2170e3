#!/usr/bin/env bash
# The tensor-core skinny GEMM (kernels/gemm/skinny_gemm.h) on the GPU machine, in one call: its
# kernel tests and the CUDA backend's (twice each), the kernel against cuBLAS at the Llama-3-8B
# projection shapes, the CUDA logits of a random-weight Llama-3-8B-shaped checkpoint against
# transformers' float32, and the decode step with it at every batch up to 64 rows and without it
# (cuda_llama_bench --skinny-gemm-max-rows 64 / 0, alternating runs, so card and moment are the
# same for both). Logs under $OUT, the tables last.
#
#   here:       TARGETS="kernels_tests llama_cuda_tests cuda_llama_bench cuda_logits_check skinny_gemm_bench" \
#                 scripts/gpu/make_bundle.sh
#               (carry .devbundle; models/tiny-code-llama must travel, the draft model need not)
#   device run: [ROUNDS=2] [BATCH=1,4,8,16,24,32,48,64] [CONTEXT=576] bash scripts/gpu/h200_skinny_gemm.sh
set -uo pipefail
rounds=${ROUNDS:-2} batch=${BATCH:-1,4,8,16,24,32,48,64} context=${CONTEXT:-576}
source scripts/gpu/devbundle_prologue.sh
export DUET_MODELS_DIR=$PWD/models

section "checkpoint + float32 reference (background, during the tests)"
(PYTHONUNBUFFERED=1 python3 scripts/gpu/hf_reference.py --out /tmp/llama8b 2>&1 | grep -v Warning > "$OUT/hf.log") &
hf_pid=$!
for run in 1 2; do
  section "tests, run $run"
  kernels_tests --gtest_filter='SkinnyGemm*:Gemv*' > "$OUT/kernels_tests_$run.log" 2>&1
  echo "kernels_tests (SkinnyGemm, Gemv): exit $?"
  # The draft model does not travel (the carry limit); multi-GPU groups need several GPUs.
  llama_cuda_tests --gtest_filter='-*DraftModel*:*EveryGpu*:*OverNccl*' > "$OUT/llama_cuda_tests_$run.log" 2>&1
  echo "llama_cuda_tests: exit $?"
  grep -E "sequences: decode|FAILED|Failure" "$OUT/llama_cuda_tests_$run.log" | head -12
done
section "kernel: SkinnyGemm vs cuBLAS"
skinny_gemm_bench --rows 4,8,16,32,48,64 2>&1 | tee "$OUT/skinny_gemm_bench.log"
section "waiting for the checkpoint"
wait $hf_pid
[[ -f /tmp/llama8b/logits.f32 ]] || { tail "$OUT/hf.log"; echo "no checkpoint"; exit 1; }
cuda_logits_check --model /tmp/llama8b --tokens /tmp/llama8b/tokens.json --logits /tmp/llama8b/logits.f32 \
  --baseline-logits /tmp/llama8b/logits_bf16.f32 2>&1 | tee "$OUT/logits_check.log" | tail -4
for round in $(seq 1 "$rounds"); do
  for side in skinny cublas; do
    flag=(--skinny-gemm-max-rows 64); [[ $side == cublas ]] && flag=(--skinny-gemm-max-rows 0)
    section "decode, round $round, $side"
    cuda_llama_bench --model /tmp/llama8b --prefill none --batch "$batch" --context "$context" "${flag[@]}" \
      > "$OUT/decode_${side}_$round.log" 2>&1 || echo "exit $?"
  done
done
python3 - "$OUT" "$rounds" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for side in ("skinny", "cublas"):
    for r in range(1, rounds + 1):
        on = False
        for line in open(f"{out}/decode_{side}_{r}.log"):
            if line.startswith("batch"): on = True; continue
            m = re.match(r"^(\d+)\s+([\d.]+)\s", line)
            if on and m: rows.setdefault(int(m.group(1)), {}).setdefault(side, []).append(float(m.group(2)))
fmt = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
print(f"decode ms/step, median (min-max) of {rounds} runs each, alternating")
print(f"{'batch':>6} {'SkinnyGemm':>22} {'cuBLAS':>22} {'cuBLAS/Skinny':>14}")
for b, s in sorted(rows.items()):
    a, c = s.get("skinny", []), s.get("cublas", [])
    if a and c: print(f"{b:>6} {fmt(a):>22} {fmt(c):>22} {statistics.median(c) / statistics.median(a):>13.3f}x")
PY
grep -A12 "^batch" "$OUT/decode_skinny_1.log" | head -14
