#!/usr/bin/env bash
# Builds the GPU programs here (CUDA on) and packs them, with the shared libraries the GPU
# machine lacks, into $BUNDLE_DIR/bundle.tar.xz (default .devbundle; git-ignored; carry that
# folder to the run, and give h200_run.sh the same BUNDLE_DIR).
#
#   [BUILD_DIR=build] [BUNDLE_DIR=.devbundle] [TARGETS="..."] scripts/gpu/make_bundle.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build}
bundle=${BUNDLE_DIR:-.devbundle}
targets=${TARGETS:-"kernels_tests llama_cuda_tests cuda_llama_bench cuda_logits_check attention_bench elementwise_bench gemv_bench"}
cmake --build "$build" --target $targets -j"$(nproc)"
stage=$(mktemp -d)/devbundle
# ../shared lies beside the main checkout, which a worktree's git common folder names.
shared=$(cd "$(git rev-parse --git-common-dir)/../.." && pwd)/shared
bash "$shared/device/bundle.sh" "$stage" $(for t in $targets; do echo "$build/bin/$t"; done) >/dev/null
strip "$stage"/bin/* "$stage"/lib/* 2>/dev/null || true
mkdir -p "$bundle"
tar -C "$(dirname "$stage")" -cJf "$bundle/bundle.tar.xz" devbundle
du -h "$bundle/bundle.tar.xz"
scripts/gpu/carry_size.sh "$bundle" || true  # what a call carrying it would carry
