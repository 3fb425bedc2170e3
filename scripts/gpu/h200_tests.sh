#!/usr/bin/env bash
# The GPU test binaries on the GPU machine, each run RUNS times in a row (default 2: a race shows
# up as a test that passes once and fails the other time). One log per binary under $OUT (every
# run appended), a pass/fail table last; exits non-zero if any run failed.
#
#   here:       TARGETS="kernels_tests llama_cuda_tests device_kv_cache_tests" scripts/gpu/make_bundle.sh
#   device run: carry the bundle folder, then
#               [BUNDLE_DIR=.devbundle] [RUNS=2] [TESTS="kernels_tests ..."] [UNPACK_DIR=/tmp] \
#                 bash scripts/gpu/h200_tests.sh [gtest flags]
#
# Run it from the repository root: llama_cuda_tests reads models/tiny-code-llama from there.
set -uo pipefail
OUT=${OUT:-/tmp/duet-gpu-out}
BUNDLE_DIR=${BUNDLE_DIR:-.devbundle}
RUNS=${RUNS:-2}
TESTS=${TESTS:-"kernels_tests llama_cuda_tests device_kv_cache_tests"}
mkdir -p "$OUT"
UNPACK_DIR=${UNPACK_DIR:-/tmp}
mkdir -p "$UNPACK_DIR" && tar -xJf "$BUNDLE_DIR/bundle.tar.xz" -C "$UNPACK_DIR" || exit 1
source "$UNPACK_DIR/devbundle/env.sh"
export DUET_MODELS_DIR=$PWD/models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

table=()
status=0
for run in $(seq 1 "$RUNS"); do
  for test in $TESTS; do
    log="$OUT/$test.log"
    echo "===== run $run: $test $*" >> "$log"
    start=$SECONDS
    # By absolute path: gtest death tests re-execute argv[0] with execv (no PATH lookup).
    "$(command -v "$test")" "$@" >> "$log" 2>&1
    rc=$?
    # gtest's summary of this run: the last "[  PASSED  ] N tests" and the FAILED test names.
    summary=$(awk -v run="===== run $run: $test" 'index($0, run) == 1 {on = 1; passed = 0; skipped = 0; failed = ""; next}
      on && /^\[  PASSED  \] [0-9]+ test/ {passed = $4}
      on && /^\[  SKIPPED \] [0-9]+ test/ {skipped = $4}
      on && /^\[  FAILED  \] [A-Za-z0-9_\/.]+[,]? / && !/listed below/ {failed = failed " " $4}
      END {printf "%s|%s|%s", passed, skipped, failed}' "$log")
    IFS='|' read -r passed skipped failed <<< "$summary"
    (( rc != 0 )) && status=1
    table+=("$(printf '%-4s %-22s %-5s %6s %7s %5ss %s' "$run" "$test" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" \
      "${passed:-0}" "${skipped:-0}" "$((SECONDS - start))" "${failed:-}")")
    echo "run $run $test: exit $rc"
  done
done

echo
printf '%-4s %-22s %-5s %6s %7s %6s %s\n' run binary exit passed skipped time failed
printf '%s\n' "${table[@]}"
exit $status
