#include "kernels/elementwise/embedding.h"

#include <algorithm>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;

constexpr int kThreads = 256;

// Grid-stride over 8-element chunks: one 16-byte bf16 load, two 16-byte fp32 stores.
__global__ void __launch_bounds__(kThreads)
    EmbeddingGatherKernel(const int32_t* __restrict__ tokens, const __nv_bfloat16* __restrict__ table,
                          float* __restrict__ residual, int dim, int64_t chunks) {
  launch_detail::EnterDependentKernel();
  const int chunks_per_row = dim / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = int(i % chunks_per_row) * 8;
    float x[8];
    Bf16x8ToFloat(*reinterpret_cast<const uint4*>(table + int64_t(tokens[row]) * dim + col), x);
    float4* dst = reinterpret_cast<float4*>(residual + row * dim + col);
    dst[0] = make_float4(x[0], x[1], x[2], x[3]);
    dst[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

}  // namespace

void EmbeddingGather(const int32_t* tokens, const __nv_bfloat16* table, float* residual, int rows, int dim,
                     cudaStream_t stream) {
  DUET_KERNEL_CHECK(rows >= 0 && dim > 0 && dim % 8 == 0);
  DUET_KERNEL_CHECK(tokens != nullptr && table != nullptr && residual != nullptr);
  DUET_KERNEL_CHECK(IsAligned(table, 16) && IsAligned(residual, 16));
  const int64_t chunks = int64_t(rows) * (dim / 8);
  if (chunks == 0) return;
  const int64_t blocks = std::min<int64_t>((chunks + kThreads - 1) / kThreads, 1 << 16);
  launch_detail::LaunchKernel(EmbeddingGatherKernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, tokens, table, residual, dim, chunks);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
