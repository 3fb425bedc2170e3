// WideGemm vs cuBLAS at the Llama-3-8B projection shapes for prompt-sized and mixed-step row
// counts: microseconds and TFLOP/s per product, and the four products x 32 layers. cuBLAS runs as
// CublasLinear calls it (cublasGemmEx, rows rounded up to 64); its gate_up is followed by the
// SiLU·mul kernel, which WideGemm fuses. Random bf16 data, weights rotated over copies larger than
// L2, timed with events over --chain launches back to back (per launch), median of 30.
// Before timing, each shape's output is checked against cuBLAS's.
//
//   wide_gemm_bench [--rows 128,256,320,384,576,1024] [--layers 32] [--chain 8]
//                   [--splits N (every shape split N ways: 1, 2 or 4, instead of the plan's)]
//                   [--row-tile N (64-192, a multiple of 32, instead of the plan's)]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include <cublas_v2.h>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/activation.h"
#include "kernels/gemm/gemm_bench_util.cuh"
#include "kernels/gemm/wide_gemm.h"

namespace {

using duet::kernels::FillRandomBf16;
using duet::kernels::bench::MedianMs;

// Relative L2 error of a's first n elements against b's (both on the device).
double RelativeError(const __nv_bfloat16* a_dev, const __nv_bfloat16* b_dev, size_t n) {
  std::vector<__nv_bfloat16> a(n), b(n);
  DUET_CUDA_CHECK(cudaMemcpy(a.data(), a_dev, n * 2, cudaMemcpyDeviceToHost));
  DUET_CUDA_CHECK(cudaMemcpy(b.data(), b_dev, n * 2, cudaMemcpyDeviceToHost));
  return duet::kernels::bench::RelativeError(a, b);
}

}  // namespace

int main(int argc, char** argv) {
  const duet::kernels::bench::Args args = duet::kernels::bench::ParseArgs(argc, argv, {128, 256, 320, 384, 576, 1024});
  const std::vector<int>& row_counts = args.rows;
  const int layers = args.layers, chain = args.chain, splits = args.splits, row_tile = args.row_tile;
  cudaDeviceProp prop{};
  DUET_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; %d launches back to back\n", prop.name, prop.multiProcessorCount, chain);
  cublasHandle_t handle;
  cublasCreate(&handle);
  duet::kernels::PrepareWideGemm();
  const duet::kernels::WideGemmCapacity capacity = duet::kernels::QueryWideGemmCapacity();
  std::printf("resident CTAs at split 1 / 2 / 4: %d / %d / %d\n", capacity.resident_ctas[0], capacity.resident_ctas[1],
              capacity.resident_ctas[2]);

  struct Shape { const char* name; int in, out; bool silu_mul; };
  const Shape shapes[] = {
      {"qkv", 4096, 6144, false}, {"o", 4096, 4096, false},
      {"gate_up", 4096, 28672, true}, {"down", 14336, 4096, false}};
  const int max_rows = (*std::max_element(row_counts.begin(), row_counts.end()) + 63) / 64 * 64;
  std::vector<double> layer_wide(row_counts.size()), layer_cublas(row_counts.size());
  std::printf("%-8s %5s %10s %9s %8s %9s %8s %8s %9s\n", "shape", "rows", "tile,split", "wide_us", "TFLOP/s",
              "cublas_us", "TFLOP/s", "speedup", "rel_err");
  for (const Shape& s : shapes) {
    const std::vector<__nv_bfloat16*> w = duet::kernels::bench::RotatedWeights(s.in, s.out, prop.l2CacheSize);
    const int copies = int(w.size());
    const int width = s.silu_mul ? s.out / 2 : s.out;
    __nv_bfloat16 *x, *y, *y_ref, *gate_up;
    DUET_CUDA_CHECK(cudaMalloc(&x, size_t(max_rows) * s.in * 2));
    DUET_CUDA_CHECK(cudaMalloc(&y, size_t(max_rows) * width * 2));
    DUET_CUDA_CHECK(cudaMalloc(&y_ref, size_t(max_rows) * width * 2));
    DUET_CUDA_CHECK(cudaMalloc(&gate_up, size_t(max_rows) * s.out * 2));
    FillRandomBf16(x, size_t(max_rows) * s.in, 7, 1.0f, nullptr);
    for (size_t ri = 0; ri < row_counts.size(); ++ri) {
      const int rows = row_counts[ri];
      duet::kernels::WideGemmPlan plan =
          duet::kernels::PlanWideGemm(rows, s.in, s.out, s.silu_mul, capacity);
      if (row_tile > 0) {  // an experiment: another row tile than the plan's
        plan.row_tile = row_tile;
        plan.row_tiles = (rows + row_tile - 1) / row_tile;
      }
      if (splits > 0) {  // an experiment: another split than the plan's
        plan.splits = splits;
        plan.k_blocks_per_split = ((s.in + 63) / 64 + splits - 1) / splits;
      }
      const float alpha = 1, beta = 0;
      const int cublas_rows = (rows + 63) / 64 * 64;  // as CublasLinear rounds them (kCublasRowQuantum)
      int i = 0;
      auto wide = [&] {
        duet::kernels::WideGemm({x, w[i++ % copies], y, rows, s.in, s.out, s.silu_mul}, plan, nullptr);
      };
      auto cublas = [&] {
        __nv_bfloat16* dst = s.silu_mul ? gate_up : y_ref;
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.out, cublas_rows, s.in, &alpha, w[i++ % copies],
                     CUDA_R_16BF, s.in, x, CUDA_R_16BF, s.in, &beta, dst, CUDA_R_16BF, s.out, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
        if (s.silu_mul) duet::kernels::SiluAndMul(gate_up, y_ref, rows, width, nullptr);
      };
      DUET_CUDA_CHECK(cudaMemset(y, 0xFF, size_t(rows) * width * 2));
      i = 0, wide();
      i = 0, cublas();
      DUET_CUDA_CHECK(cudaDeviceSynchronize());
      const double err = RelativeError(y, y_ref, size_t(rows) * width);
      const float wide_ms = MedianMs(wide, chain), cublas_ms = MedianMs(cublas, chain);
      const double flop = 2.0 * rows * s.in * s.out;
      std::printf("%-8s %5d %6d,%-3d %9.1f %8.0f %9.1f %8.0f %7.2fx %9.1e%s\n", s.name, rows, plan.row_tile,
                  plan.splits, wide_ms * 1e3, flop / wide_ms / 1e9, cublas_ms * 1e3, flop / cublas_ms / 1e9,
                  cublas_ms / wide_ms, err, err < 1e-2 ? "" : "  MISMATCH");
      if (err >= 1e-2) return 1;
      layer_wide[ri] += wide_ms;
      layer_cublas[ri] += cublas_ms;
    }
    for (__nv_bfloat16* p : w) cudaFree(p);
    cudaFree(x);
    cudaFree(y);
    cudaFree(y_ref);
    cudaFree(gate_up);
  }
  std::printf("\nthe four projections (gate_up with SiLU·mul) x %d layers, ms\n", layers);
  std::printf("%5s %9s %10s %8s %12s\n", "rows", "wide_ms", "cublas_ms", "speedup", "wide TFLOP/s");
  const double layer_flop_per_row = 2.0 * (4096.0 * (6144 + 4096 + 28672) + 14336.0 * 4096);
  for (size_t ri = 0; ri < row_counts.size(); ++ri) {
    std::printf("%5d %9.2f %10.2f %7.2fx %12.0f\n", row_counts[ri], layers * layer_wide[ri],
                layers * layer_cublas[ri], layer_cublas[ri] / layer_wide[ri],
                layer_flop_per_row * row_counts[ri] / layer_wide[ri] / 1e9);
  }
  cublasDestroy(handle);
  return 0;
}
