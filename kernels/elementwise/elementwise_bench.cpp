// Times the elementwise and sampling kernels at Llama-3-8B shapes (CUDA events, averaged over
// many launches after a warm-up) and prints microseconds per call and effective DRAM bandwidth.
//   elementwise_bench [iterations]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/activation.h"
#include "kernels/elementwise/gather_rows.h"
#include "kernels/elementwise/norm.h"
#include "kernels/elementwise/rope.h"
#include "kernels/sampling/sampling.h"

namespace duet::kernels {
namespace {

constexpr int kDim = 4096, kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kInter = 14336, kVocab = 128256;
constexpr int kBlockSize = 16, kMaxPositions = 8192;

template <typename T>
T* DeviceFill(size_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<T> host(n);
  for (T& x : host) x = T(dist(rng));
  T* d = nullptr;
  DUET_CUDA_CHECK(cudaMalloc(&d, n * sizeof(T)));
  DUET_CUDA_CHECK(cudaMemcpy(d, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  T* d = nullptr;
  DUET_CUDA_CHECK(cudaMalloc(&d, host.size() * sizeof(T)));
  DUET_CUDA_CHECK(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Mean microseconds per launch over `iterations` launches after 5 warm-up launches.
double TimeMicros(const std::function<void(cudaStream_t)>& launch, cudaStream_t stream, int iterations) {
  for (int i = 0; i < 5; ++i) launch(stream);
  cudaEvent_t start, stop;
  DUET_CUDA_CHECK(cudaEventCreate(&start));
  DUET_CUDA_CHECK(cudaEventCreate(&stop));
  DUET_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iterations; ++i) launch(stream);
  DUET_CUDA_CHECK(cudaEventRecord(stop, stream));
  DUET_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  DUET_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  DUET_CUDA_CHECK(cudaEventDestroy(start));
  DUET_CUDA_CHECK(cudaEventDestroy(stop));
  return 1000.0 * ms / iterations;
}

void Report(const char* kernel, const char* shape, int rows, double micros, double bytes) {
  std::printf("%-16s %-34s rows %5d  %9.2f us  %8.1f GB/s\n", kernel, shape, rows, micros, bytes / (micros * 1e3));
}

void Run(int iterations) {
  cudaStream_t stream;
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int max_rows = 4096;

  float* residual = DeviceFill<float>(size_t(max_rows) * kDim, -2.f, 2.f, 1);
  auto* delta = DeviceFill<__nv_bfloat16>(size_t(max_rows) * kDim, -1.f, 1.f, 2);
  auto* weight = DeviceFill<__nv_bfloat16>(kDim, 0.5f, 1.5f, 3);
  auto* normed = DeviceFill<__nv_bfloat16>(size_t(max_rows) * kDim, 0.f, 0.f, 4);
  for (int rows : {1, 32, 256, 4096}) {
    const RmsNormParams p{residual, delta, weight, nullptr, normed, rows, kDim, 1e-5f};
    const double us = TimeMicros([&](cudaStream_t s) { FusedAddRmsNorm(p, s); }, stream, iterations);
    // residual read + write (fp32), delta read, out write (bf16).
    Report("FusedAddRmsNorm", "dim 4096, with delta", rows, us, double(rows) * kDim * (4 + 4 + 2 + 2));
  }

  const int qkv_width = (kQHeads + 2 * kKvHeads) * kHeadDim;
  auto* qkv = DeviceFill<__nv_bfloat16>(size_t(max_rows) * qkv_width, -1.f, 1.f, 5);
  std::vector<int32_t> positions(max_rows), slots(max_rows);
  for (int i = 0; i < max_rows; ++i) positions[i] = slots[i] = i;
  int32_t* d_positions = DeviceCopy(positions);
  int32_t* d_slots = DeviceCopy(slots);
  std::vector<float> inv_freq(kHeadDim / 2);
  for (int i = 0; i < kHeadDim / 2; ++i) inv_freq[i] = float(std::pow(500000.0, -2.0 * i / kHeadDim));
  float2* table = DeviceCopy(BuildRopeTable(inv_freq, kMaxPositions));
  auto* q_out = DeviceFill<__nv_bfloat16>(size_t(max_rows) * kQHeads * kHeadDim, 0.f, 0.f, 6);
  auto* k_cache = DeviceFill<__nv_bfloat16>(size_t(max_rows) * kKvHeads * kHeadDim, 0.f, 0.f, 7);
  auto* v_cache = DeviceFill<__nv_bfloat16>(size_t(max_rows) * kKvHeads * kHeadDim, 0.f, 0.f, 8);
  for (int rows : {1, 32, 256, 4096}) {
    const RopeKvWriteParams p{qkv,  d_positions, d_slots, table, q_out, {k_cache, v_cache, kKvHeads, kBlockSize, kHeadDim},
                              rows, kQHeads};
    const double us = TimeMicros([&](cudaStream_t s) { RopeAndWriteKv(p, s); }, stream, iterations);
    // qkv read, q/k/v written, rope table rows read (fp32 pairs).
    Report("RopeAndWriteKv", "32/8 heads, head_dim 128", rows, us,
           double(rows) * (2.0 * qkv_width * 2 + kHeadDim / 2 * 8));
  }

  auto* mlp_in = DeviceFill<__nv_bfloat16>(size_t(max_rows) * 2 * kInter, -3.f, 3.f, 9);
  auto* mlp_out = DeviceFill<__nv_bfloat16>(size_t(max_rows) * kInter, 0.f, 0.f, 10);
  for (int rows : {1, 32, 256, 4096}) {
    const double us = TimeMicros([&](cudaStream_t s) { SiluAndMul(mlp_in, mlp_out, rows, kInter, s); }, stream, iterations);
    Report("SiluAndMul", "inter 14336", rows, us, double(rows) * kInter * (2 * 2 + 2));
  }

  const int table_rows = 32000;  // a slice of the vocabulary is enough for a gather
  auto* embeddings = DeviceFill<__nv_bfloat16>(size_t(table_rows) * kDim, -1.f, 1.f, 11);
  std::vector<int32_t> tokens(max_rows);
  for (int i = 0; i < max_rows; ++i) tokens[i] = (i * 7919) % table_rows;
  int32_t* d_tokens = DeviceCopy(tokens);
  for (int rows : {1, 32, 256, 4096}) {
    const double us =
        TimeMicros([&](cudaStream_t s) { EmbeddingGather(d_tokens, embeddings, residual, rows, kDim, s); }, stream, iterations);
    Report("EmbeddingGather", "dim 4096", rows, us, double(rows) * kDim * (2 + 4));
  }

  // Sampling: LLM-like logits (normal, stddev 2.5) over the Llama-3 vocabulary.
  const int max_sample_rows = 256;
  std::vector<float> logits(size_t(max_sample_rows) * kVocab);
  {
    std::mt19937_64 rng(12);
    std::normal_distribution<float> dist(0.f, 2.5f);
    for (float& x : logits) x = dist(rng);
  }
  float* d_logits = DeviceCopy(logits);
  int32_t* sampled = DeviceFill<int32_t>(max_sample_rows, 0.f, 0.f, 13);
  float* logprobs = DeviceFill<float>(max_sample_rows, 0.f, 0.f, 14);
  std::vector<uint64_t> offsets(max_sample_rows);
  for (int i = 0; i < max_sample_rows; ++i) offsets[i] = uint64_t(i);
  uint64_t* d_seeds = DeviceCopy(std::vector<uint64_t>(max_sample_rows, 1));
  uint64_t* d_offsets = DeviceCopy(offsets);
  struct Setting {
    const char* name;
    float temperature;
    int top_k;
    float top_p, min_p;
  };
  const Setting settings[] = {{"greedy", 0.f, 0, 1.f, 0.f},
                              {"temperature 1", 1.f, 0, 1.f, 0.f},
                              {"top_k 50", 1.f, 50, 1.f, 0.f},
                              {"top_p 0.9", 1.f, 0, 0.9f, 0.f},
                              {"min_p 0.05", 1.f, 0, 1.f, 0.05f},
                              {"top_k 50 top_p 0.9 min_p 0.05", 0.8f, 50, 0.9f, 0.05f},
                              {"top_k 40000 (bisection path)", 1.f, 40000, 1.f, 0.f}};
  for (const Setting& setting : settings) {
    float* temperature = DeviceCopy(std::vector<float>(max_sample_rows, setting.temperature));
    int32_t* top_k = DeviceCopy(std::vector<int32_t>(max_sample_rows, setting.top_k));
    float* top_p = DeviceCopy(std::vector<float>(max_sample_rows, setting.top_p));
    float* min_p = DeviceCopy(std::vector<float>(max_sample_rows, setting.min_p));
    for (int rows : {1, 8, 64, 256}) {
      const SamplingParams p{d_logits, rows, kVocab, temperature, top_k, top_p, min_p, d_seeds, d_offsets, sampled, logprobs};
      const double us = TimeMicros([&](cudaStream_t s) { SampleTokens(p, s); }, stream, iterations);
      Report("SampleTokens", setting.name, rows, us, double(rows) * kVocab * 4);
    }
    DUET_CUDA_CHECK(cudaFree(temperature));
    DUET_CUDA_CHECK(cudaFree(top_k));
    DUET_CUDA_CHECK(cudaFree(top_p));
    DUET_CUDA_CHECK(cudaFree(min_p));
  }
  DUET_CUDA_CHECK(cudaStreamDestroy(stream));
  // The process exits next; the device allocations go with it.
}

}  // namespace
}  // namespace duet::kernels

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "elementwise_bench: no CUDA device\n");
    return 1;
  }
  duet::kernels::Run(argc > 1 ? std::atoi(argv[1]) : 100);
  return 0;
}
