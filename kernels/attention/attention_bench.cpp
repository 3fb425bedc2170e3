// Attention kernel figures on the current GPU:
//   - device-to-device copy bandwidth (the decode kernel's ceiling), measured in this run;
//   - paged decode attention (Llama-3-8B shape: 32 q heads, 8 KV heads, head_dim 128, block 16)
//     at batch 1/8/32/128 x context 1k/4k/32k: time, KV bytes read per second, % of copy; planned
//     for that context, and at batch <= 8 also planned for 8k (as a CUDA graph plans for its
//     maximum context);
//   - prefill attention (same shape, one causal sequence of 1k/4k/8k tokens): TFLOP/s with the
//     causal FLOPs counted as half of full (4 * L^2 * head_dim * heads / 2), for both K/V tiles.
// Each figure is the median of many CUDA-event-timed launches after warm-up; L2 is flushed
// before each decode launch so small caches are read from HBM, as in a real decode step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/decode_attention_bench_util.h"
#include "kernels/attention/prefill_attention.h"
#include "kernels/elementwise/random_fill.h"
#include "kernels/cuda_check.h"

namespace duet::kernels {
namespace {

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlockSize = 16;

void FillRandom(__nv_bfloat16* data, size_t n, uint32_t seed) { FillRandomBf16(data, n, seed, 1.f, nullptr); }

// Median milliseconds of `reps` timed calls of `launch` (after `warmup` untimed ones);
// `between` runs untimed before each call.
template <typename Launch, typename Between>
float MedianMs(int warmup, int reps, Launch launch, Between between) {
  cudaEvent_t start, stop;
  DUET_CUDA_CHECK(cudaEventCreate(&start));
  DUET_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) launch();
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    between();
    DUET_CUDA_CHECK(cudaEventRecord(start));
    launch();
    DUET_CUDA_CHECK(cudaEventRecord(stop));
    DUET_CUDA_CHECK(cudaEventSynchronize(stop));
    DUET_CUDA_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
  }
  DUET_CUDA_CHECK(cudaEventDestroy(start));
  DUET_CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[reps / 2];
}

double CopyBandwidthGBs() {
  const size_t bytes = size_t(2) << 30;
  void *src, *dst;
  DUET_CUDA_CHECK(cudaMalloc(&src, bytes));
  DUET_CUDA_CHECK(cudaMalloc(&dst, bytes));
  DUET_CUDA_CHECK(cudaMemset(src, 1, bytes));
  const float ms = MedianMs(3, 20, [&] { DUET_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); },
                            [] {});
  DUET_CUDA_CHECK(cudaFree(src));
  DUET_CUDA_CHECK(cudaFree(dst));
  return 2.0 * bytes / (ms * 1e-3) / 1e9;  // read + write
}

void BenchDecode(double copy_gbs, int num_sms) {
  const std::vector<int> batches = {1, 8, 32, 64, 128};
  const std::vector<int> contexts = {576, 1024, 4096, 32768};
  bench::RandomPagedDecode decode(batches.back(), contexts.back(), kQHeads, kKvHeads, kHeadDim, kBlockSize);
  const size_t flush_bytes = size_t(256) << 20;  // several times L2
  void* flush;
  DUET_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));

  std::printf("\npaged decode attention, %d q heads / %d kv heads, head_dim %d, block %d, bf16 (L2 flushed)\n",
              kQHeads, kKvHeads, kHeadDim, kBlockSize);
  std::printf("%6s %8s %8s %7s %10s %12s %10s %8s\n", "batch", "context", "planned", "splits", "time_us", "KV_MB",
              "GB/s", "%copy");
  constexpr int kGraphPlanContext = 8192;
  for (int batch : batches) {
    for (int context : contexts) {
      std::vector<int> planned_contexts = {context};
      if (batch <= 8 && context < kGraphPlanContext) planned_contexts.push_back(kGraphPlanContext);
      for (int planned : planned_contexts) {
        decode.Prepare(batch, context, planned, num_sms);
        const float ms = MedianMs(
            3, 30, [&] { decode.Launch(nullptr); },
            [&] { DUET_CUDA_CHECK(cudaMemsetAsync(flush, batch, flush_bytes)); });
        const double gbs = decode.KvBytes() / (ms * 1e-3) / 1e9;
        std::printf("%6d %8d %8d %7d %10.1f %12.1f %10.0f %7.1f%%\n", batch, context, planned, decode.plan().num_splits,
                    ms * 1e3, decode.KvBytes() / 1e6, gbs, 100.0 * gbs / copy_gbs);
      }
    }
  }
  DUET_CUDA_CHECK(cudaFree(flush));
}

void BenchPrefill() {
  std::printf("\nprefill attention, one causal sequence, %d q heads / %d kv heads, head_dim %d, block %d, bf16\n",
              kQHeads, kKvHeads, kHeadDim, kBlockSize);
  std::printf("%8s %8s %10s %10s %16s\n", "tokens", "key_tile", "time_ms", "TFLOP/s", "32_layers_ms");
  for (int tokens : {512, 1024, 2048, 4096, 8192}) {
    const int blocks = tokens / kBlockSize;
    const size_t cache_elems = size_t(blocks) * kKvHeads * kBlockSize * kHeadDim;
    const size_t q_elems = size_t(tokens) * kQHeads * kHeadDim;
    __nv_bfloat16 *k, *v, *q, *out;
    DUET_CUDA_CHECK(cudaMalloc(&k, cache_elems * sizeof(__nv_bfloat16)));
    DUET_CUDA_CHECK(cudaMalloc(&v, cache_elems * sizeof(__nv_bfloat16)));
    DUET_CUDA_CHECK(cudaMalloc(&q, q_elems * sizeof(__nv_bfloat16)));
    DUET_CUDA_CHECK(cudaMalloc(&out, q_elems * sizeof(__nv_bfloat16)));
    FillRandom(k, cache_elems, 11);
    FillRandom(v, cache_elems, 12);
    FillRandom(q, q_elems, 13);
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(tokens));
    const std::vector<int32_t> q_start = {0, tokens}, lens = {tokens};
    int32_t *d_tables, *d_q_start, *d_lens;
    DUET_CUDA_CHECK(cudaMalloc(&d_tables, blocks * sizeof(int32_t)));
    DUET_CUDA_CHECK(cudaMalloc(&d_q_start, 2 * sizeof(int32_t)));
    DUET_CUDA_CHECK(cudaMalloc(&d_lens, sizeof(int32_t)));
    DUET_CUDA_CHECK(cudaMemcpy(d_tables, ids.data(), blocks * sizeof(int32_t), cudaMemcpyHostToDevice));
    DUET_CUDA_CHECK(cudaMemcpy(d_q_start, q_start.data(), 2 * sizeof(int32_t), cudaMemcpyHostToDevice));
    DUET_CUDA_CHECK(cudaMemcpy(d_lens, lens.data(), sizeof(int32_t), cudaMemcpyHostToDevice));
    PrefillAttentionParams p{};
    p.q = q;
    p.kv = {k, v, kKvHeads, kBlockSize, kHeadDim};
    p.block_tables = d_tables;
    p.q_start = d_q_start;
    p.context_lens = d_lens;
    p.out = out;
    p.num_seqs = 1;
    p.num_q_tokens = tokens;
    p.max_q_len = tokens;
    p.num_q_heads = kQHeads;
    p.max_blocks_per_seq = blocks;
    p.scale = 1.f / std::sqrt(float(kHeadDim));
    const double flops = 4.0 * double(tokens) * tokens * kHeadDim * kQHeads / 2;
    for (int key_tile : {32, 64}) {
      const float ms = MedianMs(
          3, 20, [&] { internal::PrefillAttentionWithKeyTile(p, key_tile, nullptr); }, [] {});
      std::printf("%8d %8d %10.3f %10.1f %16.2f\n", tokens, key_tile, ms, flops / (ms * 1e-3) / 1e12, 32 * ms);
    }
    for (void* ptr : {(void*)k, (void*)v, (void*)q, (void*)out, (void*)d_tables, (void*)d_q_start, (void*)d_lens}) {
      DUET_CUDA_CHECK(cudaFree(ptr));
    }
  }
}

}  // namespace
}  // namespace duet::kernels

int main() {
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop;
  DUET_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = duet::kernels::CopyBandwidthGBs();
  std::printf("%s, %d SMs, L2 %d MB; device copy %.0f GB/s (read + write)\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, copy_gbs);
  duet::kernels::BenchDecode(copy_gbs, prop.multiProcessorCount);
  duet::kernels::BenchPrefill();
  return 0;
}
