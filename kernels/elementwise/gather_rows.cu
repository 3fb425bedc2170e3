#include "kernels/elementwise/gather_rows.h"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;

constexpr int kThreads = 256;

// Grid-stride over 8-element chunks of dst: one 16-byte bf16 load; one 16-byte bf16 store, or
// two 16-byte fp32 stores.
template <typename Out>
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const __nv_bfloat16* __restrict__ src, const int32_t* __restrict__ row_index,
                     Out* __restrict__ dst, int width, int64_t chunks) {
  launch_detail::EnterDependentKernel();
  const int chunks_per_row = width / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = int(i % chunks_per_row) * 8;
    const uint4 chunk = *reinterpret_cast<const uint4*>(src + int64_t(row_index[row]) * width + col);
    if constexpr (std::is_same_v<Out, float>) {
      float x[8];
      Bf16x8ToFloat(chunk, x);
      float4* out = reinterpret_cast<float4*>(dst + row * width + col);
      out[0] = make_float4(x[0], x[1], x[2], x[3]);
      out[1] = make_float4(x[4], x[5], x[6], x[7]);
    } else {
      *reinterpret_cast<uint4*>(dst + row * width + col) = chunk;
    }
  }
}

template <typename Out>
void LaunchGatherRows(const __nv_bfloat16* src, const int32_t* row_index, Out* dst, int rows, int width,
                      cudaStream_t stream) {
  DUET_KERNEL_CHECK(rows >= 0 && width > 0 && width % 8 == 0);
  DUET_KERNEL_CHECK(src != nullptr && row_index != nullptr && dst != nullptr);
  DUET_KERNEL_CHECK(IsAligned(src, 16) && IsAligned(dst, 16));
  const int64_t chunks = int64_t(rows) * (width / 8);
  if (chunks == 0) return;
  const int64_t blocks = std::min<int64_t>((chunks + kThreads - 1) / kThreads, 1 << 16);
  launch_detail::LaunchKernel(GatherRowsKernel<Out>, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, src,
                              row_index, dst, width, chunks);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void EmbeddingGather(const int32_t* tokens, const __nv_bfloat16* table, float* residual, int rows, int dim,
                     cudaStream_t stream) {
  LaunchGatherRows(table, tokens, residual, rows, dim, stream);
}

void GatherRows(const __nv_bfloat16* src, const int32_t* row_index, __nv_bfloat16* dst, int rows, int width,
                cudaStream_t stream) {
  DUET_KERNEL_CHECK(src != dst);
  LaunchGatherRows(src, row_index, dst, rows, width, stream);
}

}  // namespace duet::kernels
