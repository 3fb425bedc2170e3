#include "kernels/elementwise/norm.h"

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;
using launch_detail::LaunchKernel;

constexpr int kMaxThreads = 512;

// One CTA per output row; thread t owns the 8-element chunks t, t + blockDim.x, ... and keeps
// them in registers between the sum of squares and the scaled write.
template <int kChunksPerThread>
__global__ void __launch_bounds__(kMaxThreads) FusedAddRmsNormKernel(RmsNormParams p) {
  __shared__ float scratch[kWarpSize + 1];
  launch_detail::EnterDependentKernel();
  const int row = blockIdx.x;
  const int src_row = p.row_index != nullptr ? p.row_index[row] : row;
  const int chunks = p.dim / 8;
  float4* residual = reinterpret_cast<float4*>(p.residual + int64_t(src_row) * p.dim);  // [chunks][2]
  const uint4* delta = p.delta != nullptr ? reinterpret_cast<const uint4*>(p.delta + int64_t(row) * p.dim) : nullptr;

  float x[kChunksPerThread][8];
  float sum_squares = 0.f;
#pragma unroll
  for (int k = 0; k < kChunksPerThread; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c >= chunks) continue;
    const float4 lo = residual[2 * c], hi = residual[2 * c + 1];
    x[k][0] = lo.x, x[k][1] = lo.y, x[k][2] = lo.z, x[k][3] = lo.w;
    x[k][4] = hi.x, x[k][5] = hi.y, x[k][6] = hi.z, x[k][7] = hi.w;
    if (delta != nullptr) {
      float d[8];
      Bf16x8ToFloat(delta[c], d);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[k][j] += d[j];
      residual[2 * c] = make_float4(x[k][0], x[k][1], x[k][2], x[k][3]);
      residual[2 * c + 1] = make_float4(x[k][4], x[k][5], x[k][6], x[k][7]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum_squares += x[k][j] * x[k][j];
  }
  sum_squares = BlockSum(sum_squares, scratch);
  const float inv_rms = rsqrtf(sum_squares / float(p.dim) + p.eps);

  const uint4* weight = reinterpret_cast<const uint4*>(p.weight);
  uint4* out = reinterpret_cast<uint4*>(p.out + int64_t(row) * p.dim);
#pragma unroll
  for (int k = 0; k < kChunksPerThread; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c >= chunks) continue;
    float w[8], y[8];
    Bf16x8ToFloat(weight[c], w);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = __bfloat162float(__float2bfloat16(x[k][j] * inv_rms)) * w[j];
    out[c] = FloatToBf16x8(y);
  }
}

}  // namespace

void FusedAddRmsNorm(const RmsNormParams& p, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.rows >= 0 && p.dim > 0 && p.dim % 8 == 0 && p.dim <= 8 * 8 * kMaxThreads);
  DUET_KERNEL_CHECK(p.residual != nullptr && p.weight != nullptr && p.out != nullptr);
  DUET_KERNEL_CHECK(IsAligned(p.residual, 16) && IsAligned(p.weight, 16) && IsAligned(p.out, 16) &&
                    (p.delta == nullptr || IsAligned(p.delta, 16)));
  if (p.rows == 0) return;
  const int chunks = p.dim / 8;
  const int threads = RoundUp(chunks < kMaxThreads ? chunks : kMaxThreads, kWarpSize);
  const int per_thread = (chunks + threads - 1) / threads;
  if (per_thread == 1) {
    LaunchKernel(FusedAddRmsNormKernel<1>, dim3(p.rows), dim3(threads), 0, stream, p);
  } else if (per_thread == 2) {
    LaunchKernel(FusedAddRmsNormKernel<2>, dim3(p.rows), dim3(threads), 0, stream, p);
  } else if (per_thread <= 4) {
    LaunchKernel(FusedAddRmsNormKernel<4>, dim3(p.rows), dim3(threads), 0, stream, p);
  } else {
    LaunchKernel(FusedAddRmsNormKernel<8>, dim3(p.rows), dim3(threads), 0, stream, p);
  }
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
