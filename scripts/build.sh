#!/usr/bin/env bash
# Configures and builds Duet with ccache into build/ (override with BUILD_DIR).
# CUDA follows DUET_CUDA (ON/OFF); by default it is on when nvcc is found.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.cache/ccache}
export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-5G}
if [ -z "${DUET_CUDA:-}" ]; then
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then DUET_CUDA=ON; else DUET_CUDA=OFF; fi
fi
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${BUILD_TYPE:-RelWithDebInfo} -DDUET_CUDA="$DUET_CUDA" >/dev/null
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}"
