#!/usr/bin/env bash
# README command 2 (and CI): install everything, build, run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
# Node packages for the real-client and reference-implementation tests.
if [ -f tests/node/package-lock.json ]; then
  (cd tests/node && npm ci --no-audit --no-fund --loglevel=error)
fi
scripts/build.sh
cd "${BUILD_DIR:-build}"
# ctest already runs a test per core: one compute thread per process (the CPU backend's pool
# would otherwise spin on cores the other tests need).
export DUET_CPU_THREADS=${DUET_CPU_THREADS:-1}
# The chaos benchmark's short run (label chaos, bench/chaos, ~30 s alone) runs too; DUET_TEST_CHAOS=0
# leaves it out.
exclude=()
if [ "${DUET_TEST_CHAOS:-1}" = 0 ]; then exclude=(-LE '^chaos$'); fi
ctest --output-on-failure -j "${JOBS:-$(nproc)}" --timeout 600 "${exclude[@]}" "$@"
