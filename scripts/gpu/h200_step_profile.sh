#!/usr/bin/env bash
# Where a decode step's and a prefill's GPU time goes, kernel by kernel, on the GPU machine: Nsight
# Compute times every kernel of `cuda_llama_bench` run eagerly (each kernel alone, so PDL overlap is
# not in these figures) on a random-weight Llama-3-8B-shaped checkpoint; kernel_profile.py sums the
# last decode step and the last prefill by kernel. The same bench with CUDA graphs gives the step
# time as the engine runs it.
#
#   here:       TARGETS=cuda_llama_bench scripts/gpu/make_bundle.sh     (carry .devbundle)
#   device run: [BATCH=64] [CONTEXT=576] [PREFILL=512] bash scripts/gpu/h200_step_profile.sh
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
batch=${BATCH:-64} context=${CONTEXT:-576} prefill=${PREFILL:-512}
tar -xJf .devbundle/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
export NCCL_NVLS_ENABLE=0
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
section "checkpoint"
python3 -c "import sys; sys.path.insert(0, 'scripts/gpu'); import hf_reference as h; h.make_checkpoint('/tmp/llama8b', 32)" \
  > "$OUT/checkpoint.log" 2>&1 || { tail "$OUT/checkpoint.log"; exit 1; }
section "decode and prefill with CUDA graphs"
cuda_llama_bench --model /tmp/llama8b --batch "$batch" --context "$context" --prefill "$prefill" 2>&1 | tee "$OUT/bench.log" | tail -8
profile() {  # name, bench args...
  local name=$1; shift
  section "ncu: $name"
  "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    cuda_llama_bench --model /tmp/llama8b --no-cuda-graphs --steps 5 "$@" > "$OUT/$name.csv" 2> "$OUT/$name.err"
  echo "exit $?, $(grep -c gpu__time_duration "$OUT/$name.csv") kernels"
}
profile decode --batch "$batch" --context "$context" --prefill none
profile prefill --batch 1 --context 16 --prefill "$prefill"
python3 scripts/gpu/kernel_profile.py "$OUT/decode.csv" --last-step 2>&1 | tee "$OUT/decode_table.txt"
python3 scripts/gpu/kernel_profile.py "$OUT/prefill.csv" 2>&1 | tee "$OUT/prefill_table.txt"
