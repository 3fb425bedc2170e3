#!/usr/bin/env bash
# One short call on the GPU machine for the KV transport: the device KV tests (CUDA IPC between
# processes, killed peers; device cache staging; the range copy kernel) RUNS times in a row, then kv_transfer_bench
# (UCX tcp / shm vs memcpy, and device to device over CUDA IPC vs the device copy bandwidth).
#
#   here:   scripts/gpu/make_cluster_bundle.sh; mv models /tmp/duet-models-hold
#   device: bash scripts/gpu/h200_kv.sh          (carry .devcluster)
#   here:   mv /tmp/duet-models-hold models
set -uo pipefail
OUT=${OUT:-/tmp/duet-kv-out}
RUNS=${RUNS:-2}
mkdir -p "$OUT"
tar -xJf .devcluster/bundle.tar.xz -C /tmp || exit 1
source /tmp/devbundle/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for run in $(seq 1 "$RUNS"); do
  for t in cuda_ipc_transport_tests device_kv_cache_tests "kernels_tests --gtest_filter=RangeCopy*"; do
    timeout 120 $t >> "$OUT/${t%% *}.log" 2>&1; rc=$?
    (( rc != 0 )) && status=1
    echo "run $run $t: exit $rc, $(grep -E '^\[  PASSED  \]' "$OUT/${t%% *}.log" | tail -1)"
    grep -E "^\[  FAILED  \]|Failure" "$OUT/${t%% *}.log" | head -5
  done
done
timeout 180 kv_transfer_bench --runs=7 2>> "$OUT/kv_transfer_bench.log" | tee "$OUT/kv_transfer_bench.txt"
exit $status
