// What the GEMM benchmarks (skinny_gemm_bench, wide_gemm_bench) share: launch timing, random
// bf16 data on the device, their --rows lists, and the error against cuBLAS's output.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/random_fill.h"

namespace duet::kernels::bench {

// Median over `reps` timings of `chain` back-to-back launches, per launch (after 5 untimed): in a
// step the projections run back to back, each launch's start overlapping the previous one's end.
template <typename F>
float MedianMs(F&& launch, int chain = 1, int reps = 30) {
  cudaEvent_t a, b;
  DUET_CUDA_CHECK(cudaEventCreate(&a));
  DUET_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps + 5; ++i) {
    DUET_CUDA_CHECK(cudaEventRecord(a));
    for (int c = 0; c < chain; ++c) launch();
    DUET_CUDA_CHECK(cudaEventRecord(b));
    DUET_CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    DUET_CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    if (i >= 5) ms.push_back(t / chain);
  }
  DUET_CUDA_CHECK(cudaEventDestroy(a));
  DUET_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Copies of a random [out, in] bf16 weight, together four times the L2 (and at least two): a
// launch that takes the next copy streams its weights from device memory, as a step's does.
inline std::vector<__nv_bfloat16*> RotatedWeights(int in, int out, size_t l2_bytes) {
  const size_t bytes = size_t(in) * out * sizeof(__nv_bfloat16);
  std::vector<__nv_bfloat16*> w(std::max<size_t>(2, (l2_bytes * 4 + bytes - 1) / bytes));
  for (size_t c = 0; c < w.size(); ++c) {
    DUET_CUDA_CHECK(cudaMalloc(&w[c], bytes));
    FillRandomBf16(w[c], bytes / 2, 11 + c, 0.05f, nullptr);
  }
  return w;
}

// "4,8,16" -> {4, 8, 16}.
inline std::vector<int> ParseList(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

// Their flags: --rows 4,8,... --layers N --chain N (launches timed back to back; 1: each alone)
// --splits N (0: the plan's K split) --row-tile N (wide_gemm_bench; 0: the plan's).
struct Args {
  std::vector<int> rows;
  int layers = 32, chain = 8, splits = 0, row_tile = 0;
};
inline Args ParseArgs(int argc, char** argv, std::vector<int> default_rows) {
  Args args;
  args.rows = std::move(default_rows);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--rows")) args.rows = ParseList(argv[i + 1]);
    if (!std::strcmp(argv[i], "--layers")) args.layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--chain")) args.chain = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--splits")) args.splits = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--row-tile")) args.row_tile = std::atoi(argv[i + 1]);
  }
  return args;
}

// Relative L2 error of a against b.
inline double RelativeError(const std::vector<__nv_bfloat16>& a, const std::vector<__nv_bfloat16>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace duet::kernels::bench
