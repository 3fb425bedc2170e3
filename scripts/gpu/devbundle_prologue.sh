# Sourced by the GPU scripts that run a bundle of scripts/gpu/make_bundle.sh (carried as
# .devbundle/bundle.tar.xz): $OUT, the bundle's programs and libraries on the path, NVLink
# multicast off for NCCL, section() for timed headings, the GPU's name in $OUT/gpu.txt, and
# start_checkpoint / await_checkpoint: the random-weight Llama-3-8B-shaped checkpoint made in
# /tmp/llama8b in the background while the tests run; kernel_and_backend_tests; the SM clock, power
# and throttle reasons sampled every 100 ms into $OUT/clocks.csv (clock_summary prints them).
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
tar -xJf .devbundle/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
export NCCL_NVLS_ENABLE=0
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader,nounits -lms 100 > "$OUT/clocks.csv" 2>&1 &
clock_sampler_pid=$!
trap 'kill $clock_sampler_pid 2>/dev/null' EXIT
# The sampled SM clock (MHz) and power (W) since clock_mark: whether sustained work ran below boost.
clock_mark() { clock_from=$(wc -l < "$OUT/clocks.csv"); }
clock_from=0
clock_summary() {  # label
  tail -n +"$((clock_from + 1))" "$OUT/clocks.csv" | python3 -c '
import sys, statistics
rows = [l.strip().split(", ") for l in sys.stdin if l.count(",") >= 4]
num = lambda v: v.replace(".", "", 1).isdigit()
clk = [float(r[1]) for r in rows if num(r[1])]
pw = [float(r[2]) for r in rows if num(r[2])]
if clk:
    print(f"{sys.argv[1]}: SM clock MHz min {min(clk):.0f}, median {statistics.median(clk):.0f}, max {max(clk):.0f}; "
          f"power W median {statistics.median(pw):.0f}, max {max(pw):.0f}; {len(clk)} samples; "
          f"event reasons {sorted({r[4] for r in rows})}")' "$1"
}
start_checkpoint() {
  section "checkpoint (background, during the tests)"
  python3 scripts/gpu/hf_reference.py --out /tmp/llama8b --checkpoint-only > "$OUT/checkpoint.log" 2>&1 &
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
