// SkinnyGemm vs cuBLAS (cublasGemmEx, as CublasLinear calls it: rows rounded up to 64) at the Llama-3-8B projection
// shapes for decode-sized row counts: microseconds, the weight-read bandwidth each reaches, and
// that over the device's streaming-read bandwidth measured in the same run. Random bf16 data,
// weights rotated over copies larger than L2, timed with events over --chain launches back to
// back (per launch), median of 30.
// Before timing, each shape's output is checked against cuBLAS's.
//
//   skinny_gemm_bench [--rows 4,8,16,32,64] [--layers 32] [--chain 8 (1: each launch alone)]
//                     [--splits N (override the plan's K split where it splits)]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "kernels/cuda_check.h"
#include "kernels/gemm/gemm_bench_util.cuh"
#include "kernels/gemm/skinny_gemm.h"

namespace {

using duet::kernels::FillRandomBf16;
using duet::kernels::bench::MedianMs;
using duet::kernels::bench::RelativeError;

// Streams `n` 16-byte words once (no reuse), so its rate is the read ceiling a weight stream meets.
__global__ void ReadOnce(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

}  // namespace

int main(int argc, char** argv) {
  const duet::kernels::bench::Args args = duet::kernels::bench::ParseArgs(argc, argv, {4, 8, 16, 32, 64});
  const std::vector<int>& row_counts = args.rows;
  const int layers = args.layers, chain = args.chain, splits = args.splits;
  cudaDeviceProp prop{};
  DUET_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));

  const size_t read_bytes = size_t(2) << 30;
  void* big;
  unsigned* sink;
  DUET_CUDA_CHECK(cudaMalloc(&big, read_bytes));
  DUET_CUDA_CHECK(cudaMalloc(&sink, sizeof(unsigned)));
  DUET_CUDA_CHECK(cudaMemset(big, 0x5a, read_bytes));
  const float read_ms = MedianMs([&] {
    ReadOnce<<<prop.multiProcessorCount * 8, 512>>>(static_cast<const uint4*>(big), read_bytes / 16, sink);
  });
  const float copy_ms =
      MedianMs([&] { cudaMemcpyAsync(static_cast<char*>(big) + read_bytes / 2, big, read_bytes / 2, cudaMemcpyDefault); });
  const double read_gbs = read_bytes / read_ms / 1e6, copy_gbs = read_bytes / copy_ms / 1e6;
  std::printf("%s, %d SMs: streaming read %.0f GB/s, device copy %.0f GB/s (read + write); %d launches back to back\n",
              prop.name, prop.multiProcessorCount, read_gbs, copy_gbs, chain);
  DUET_CUDA_CHECK(cudaFree(big));

  cublasHandle_t handle;
  cublasCreate(&handle);

  struct Shape { const char* name; int in, out; bool per_layer; };
  const Shape shapes[] = {{"qkv", 4096, 6144, true}, {"o", 4096, 4096, true}, {"gate_up", 4096, 28672, true},
                          {"down", 14336, 4096, true}, {"lm_head", 4096, 128256, false}};
  const int max_rows = *std::max_element(row_counts.begin(), row_counts.end());
  std::vector<double> layer_skinny(row_counts.size()), layer_cublas(row_counts.size());
  std::printf("%-8s %5s %6s %10s %9s %6s %10s %9s %8s %9s\n", "shape", "rows", "splits", "skinny_us", "GB/s",
              "%read", "cublas_us", "GB/s", "speedup", "rel_err");
  for (const Shape& s : shapes) {
    const size_t wbytes = size_t(s.in) * s.out * 2;
    const std::vector<__nv_bfloat16*> w = duet::kernels::bench::RotatedWeights(s.in, s.out, prop.l2CacheSize);
    const int copies = int(w.size());
    __nv_bfloat16 *x, *y, *y_ref;
    const int padded_rows = (max_rows + 63) / 64 * 64;
    DUET_CUDA_CHECK(cudaMalloc(&x, size_t(padded_rows) * s.in * 2));
    DUET_CUDA_CHECK(cudaMalloc(&y, size_t(padded_rows) * s.out * 2));
    DUET_CUDA_CHECK(cudaMalloc(&y_ref, size_t(padded_rows) * s.out * 2));
    FillRandomBf16(x, size_t(padded_rows) * s.in, 7, 1.0f, nullptr);
    duet::kernels::SkinnyGemmPlan plan = duet::kernels::PlanSkinnyGemm(s.in, s.out, prop.multiProcessorCount);
    if (splits > 0 && plan.splits > 1) {  // an experiment: another split for the shapes the plan splits
      plan.splits = splits;
      plan.k_blocks_per_split = ((s.in + 63) / 64 + splits - 1) / splits;
    }
    for (size_t ri = 0; ri < row_counts.size(); ++ri) {
      const int rows = row_counts[ri];
      const float alpha = 1, beta = 0;
      const int cublas_rows = (rows + 63) / 64 * 64;  // as CublasLinear rounds them (kCublasRowQuantum)
      int i = 0;
      auto skinny = [&] {
        duet::kernels::SkinnyGemm({x, w[i++ % copies], y, rows, s.in, s.out, false}, plan, nullptr);
      };
      auto cublas = [&] {
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.out, cublas_rows, s.in, &alpha, w[i++ % copies],
                     CUDA_R_16BF, s.in, x, CUDA_R_16BF, s.in, &beta, y_ref, CUDA_R_16BF, s.out, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
      };
      DUET_CUDA_CHECK(cudaMemset(y, 0xFF, size_t(rows) * s.out * 2));
      i = 0, skinny();
      i = 0, cublas();
      DUET_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<__nv_bfloat16> got(size_t(rows) * s.out), want(got.size());
      DUET_CUDA_CHECK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
      DUET_CUDA_CHECK(cudaMemcpy(want.data(), y_ref, want.size() * 2, cudaMemcpyDeviceToHost));
      const double err = RelativeError(got, want);
      const float skinny_ms = MedianMs(skinny, chain), cublas_ms = MedianMs(cublas, chain);
      std::printf("%-8s %5d %6d %10.1f %9.0f %5.0f%% %10.1f %9.0f %7.2fx %9.1e%s\n", s.name, rows, plan.splits,
                  skinny_ms * 1e3, wbytes / skinny_ms / 1e6, 100.0 * wbytes / skinny_ms / 1e6 / read_gbs,
                  cublas_ms * 1e3, wbytes / cublas_ms / 1e6, cublas_ms / skinny_ms, err,
                  err < 1e-2 ? "" : "  MISMATCH");
      if (err >= 1e-2) return 1;
      if (s.per_layer) {
        layer_skinny[ri] += skinny_ms;
        layer_cublas[ri] += cublas_ms;
      }
    }
    for (__nv_bfloat16* p : w) cudaFree(p);
    cudaFree(x);
    cudaFree(y);
    cudaFree(y_ref);
  }
  const double layer_bytes = 2.0 * 4096 * (6144 + 4096 + 28672) + 2.0 * 14336 * 4096;
  std::printf("\nthe four projections x %d layers (ms) at the read ceiling: %.2f\n", layers,
              layers * layer_bytes / read_gbs / 1e6);
  std::printf("%5s %10s %10s %8s %8s\n", "rows", "skinny_ms", "cublas_ms", "speedup", "%read");
  for (size_t ri = 0; ri < row_counts.size(); ++ri) {
    std::printf("%5d %10.2f %10.2f %7.2fx %7.0f%%\n", row_counts[ri], layers * layer_skinny[ri],
                layers * layer_cublas[ri], layer_cublas[ri] / layer_skinny[ri],
                100.0 * layer_bytes / (layer_skinny[ri] * 1e6) / read_gbs);
  }
  cublasDestroy(handle);
  return 0;
}
