#include "kernels/elementwise/bias.h"

#include <cstdint>

#include "kernels/cuda_check.h"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

// One thread per 8 contiguous elements (one 16-byte load of x and of bias).
__global__ void AddBiasKernel(__nv_bfloat16* x, const __nv_bfloat16* bias, int64_t rows, int cols) {
  launch_detail::EnterDependentKernel();
  const int64_t vec_per_row = cols / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * vec_per_row) return;
  const int64_t c = (i % vec_per_row) * 8;
  uint4 xv = reinterpret_cast<uint4*>(x)[i];
  const uint4 bv = reinterpret_cast<const uint4*>(bias + c)[0];
  auto* xh = reinterpret_cast<__nv_bfloat162*>(&xv);
  const auto* bh = reinterpret_cast<const __nv_bfloat162*>(&bv);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = __bfloat1622float2(xh[k]), b = __bfloat1622float2(bh[k]);
    xh[k] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
  }
  reinterpret_cast<uint4*>(x)[i] = xv;
}

}  // namespace

void AddBias(__nv_bfloat16* x, const __nv_bfloat16* bias, int rows, int cols, cudaStream_t stream) {
  if (rows <= 0) return;
  DUET_KERNEL_CHECK(cols % 8 == 0);
  const int64_t n = int64_t(rows) * (cols / 8);
  const int threads = 256;
  launch_detail::LaunchKernel(AddBiasKernel, dim3(unsigned((n + threads - 1) / threads)), dim3(threads), 0, stream, x, bias, int64_t(rows), cols);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
