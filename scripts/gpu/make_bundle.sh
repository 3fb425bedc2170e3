#!/usr/bin/env bash
# Builds the GPU programs here (CUDA on) and packs them, with the shared libraries the GPU
# machine lacks, into .devbundle/bundle.tar.xz (git-ignored; carry `.devbundle` to the run).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build}
targets=${TARGETS:-"kernels_tests llama_cuda_tests cuda_llama_bench cuda_logits_check attention_bench elementwise_bench gemv_bench"}
cmake --build "$build" --target $targets -j"$(nproc)"
stage=$(mktemp -d)/devbundle
bash ../shared/device/bundle.sh "$stage" $(for t in $targets; do echo "$build/bin/$t"; done) >/dev/null
strip "$stage"/bin/* "$stage"/lib/* 2>/dev/null || true
mkdir -p .devbundle
tar -C "$(dirname "$stage")" -cJf .devbundle/bundle.tar.xz devbundle
du -h .devbundle/bundle.tar.xz
