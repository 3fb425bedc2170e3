# Sourced by the GPU scripts that run a bundle of scripts/gpu/make_bundle.sh (carried as
# .devbundle/bundle.tar.xz): $OUT, the bundle's programs and libraries on the path, NVLink
# multicast off for NCCL, section() for timed headings, and the GPU's name in $OUT/gpu.txt.
OUT=${OUT:-/tmp/duet-gpu-out}
mkdir -p "$OUT"
tar -xJf .devbundle/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
export NCCL_NVLS_ENABLE=0
section() { echo "== [${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
