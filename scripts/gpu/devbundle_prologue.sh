# Sourced by the GPU scripts that run a bundle of scripts/gpu/make_bundle.sh (carried as
# .devbundle/bundle.tar.xz): $OUT, the bundle's programs and libraries on the path, NVLink
# multicast off for NCCL, section() for timed headings, the GPU's name in $OUT/gpu.txt, and
# start_checkpoint / await_checkpoint: the random-weight Llama-3-8B-shaped checkpoint made in
# /tmp/llama8b in the background while the tests run.
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
tar -xJf .devbundle/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
export NCCL_NVLS_ENABLE=0
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
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
