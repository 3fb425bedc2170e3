#!/usr/bin/env bash
# One short call on the GPU machine for the KV transport: the device KV tests (CUDA IPC between
# processes, killed peers; device cache staging; the range copy kernel) twice, then
# kv_transfer_bench (UCX tcp / shm vs memcpy, and device to device over CUDA IPC vs the device copy
# bandwidth) BENCH_ROUNDS times. With the build before a change in the bundle
# (make_cluster_bundle.sh BEFORE_DIR=... holding bin/kv_transfer_bench and lib/), the bench
# alternates between the two builds.
#
#   here:   scripts/gpu/make_cluster_bundle.sh; move the tiny models' weights out (docs/BENCHMARKS.md)
#   device: [TESTS="... llama_cuda_tests"] [BENCH_ROUNDS=2] bash scripts/gpu/h200_kv.sh   (carry .devcluster)
set -uo pipefail
OUT=${OUT:-/tmp/duet-kv-out}
TESTS=${TESTS:-"cuda_ipc_transport_tests device_kv_cache_tests kernels_tests=RangeCopy*"}
source scripts/gpu/devcluster_prologue.sh
MAKE_CHECKPOINT=0 run_bundled_tests
before=/tmp/devbundle/before
for round in $(seq 1 "${BENCH_ROUNDS:-2}"); do
  echo "== kv_transfer_bench, this build, round $round"
  timeout 180 kv_transfer_bench --runs=7 2>> "$OUT/kv_transfer_bench.log" | tee -a "$OUT/kv_transfer_bench.txt"
  [[ -x $before/bin/kv_transfer_bench ]] || continue
  echo "== kv_transfer_bench, the build before, round $round"
  LD_LIBRARY_PATH=$before/lib:$LD_LIBRARY_PATH timeout 180 "$before/bin/kv_transfer_bench" --runs=7 \
    2>> "$OUT/kv_transfer_bench.log" | tee -a "$OUT/kv_transfer_bench_before.txt"
done
finish_out
