# Sourced by the GPU scripts that run a bundle of scripts/gpu/make_bundle.sh (carried as
# .devbundle/bundle.tar.xz): $OUT, the bundle's programs and libraries on the path, NVLink
# multicast off for NCCL, section() for timed headings, the GPU's name in $OUT/gpu.txt, and
# start_checkpoint / await_checkpoint: the random-weight Llama-3-8B-shaped checkpoint made in
# /tmp/llama8b in the background while the tests run; kernel_and_backend_tests; the clock sampler
# of clocks.sh (clock_mark, clock_summary).
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
tar -xJf "${BUNDLE:-.devbundle/bundle.tar.xz}" -C /tmp || exit 1  # BUNDLE=.devcluster/bundle.tar.xz: the cluster pack
source /tmp/devbundle/env.sh
export NCCL_NVLS_ENABLE=0
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source scripts/gpu/clocks.sh
start_checkpoint() {  # kept from an earlier call on the machine where it is there
  section "checkpoint (background, during the tests)"
  if [[ -f /tmp/llama8b/config.json ]]; then true & else
    python3 scripts/gpu/hf_reference.py --out /tmp/llama8b --checkpoint-only > "$OUT/checkpoint.log" 2>&1 &
  fi
  checkpoint_pid=$!
}
await_checkpoint() {
  section "waiting for the checkpoint"
  wait "$checkpoint_pid"
  [[ -f /tmp/llama8b/config.json ]] || { tail "$OUT/checkpoint.log"; exit 1; }
}
# The kernel tests matching $1 (default: the GEMM kernels, WideGemm and SkinnyGemm) and the CUDA
# backend's, twice, logs under $OUT.
kernel_and_backend_tests() {
  local filter=${1:-'WideGemm*:SkinnyGemm*'}
  for run in 1 2; do
    section "tests, run $run"
    timeout 200 kernels_tests --gtest_filter="$filter" > "$OUT/kernels_tests_$run.log" 2>&1
    echo "kernels_tests ($filter): exit $?, $(grep -c '^\[       OK' "$OUT/kernels_tests_$run.log") passed"
    timeout 200 llama_cuda_tests --gtest_filter='-*DraftModel*:*EveryGpu*:*OverNccl*' > "$OUT/llama_cuda_tests_$run.log" 2>&1
    echo "llama_cuda_tests: exit $?, $(grep -c '^\[       OK' "$OUT/llama_cuda_tests_$run.log") passed"
    grep -hE "^\[  FAILED|Failure$" "$OUT/kernels_tests_$run.log" "$OUT/llama_cuda_tests_$run.log" | head -8
  done
}
