#include "kernels/elementwise/gather_rows.h"

#include <algorithm>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;

constexpr int kThreads = 256;

// Grid-stride over 8-element (16-byte) chunks of the output.
__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const __nv_bfloat16* __restrict__ src, const int32_t* __restrict__ row_index,
                     __nv_bfloat16* __restrict__ dst, int width, int64_t chunks) {
  launch_detail::EnterDependentKernel();
  const int chunks_per_row = width / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = int(i % chunks_per_row) * 8;
    *reinterpret_cast<uint4*>(dst + row * width + col) =
        *reinterpret_cast<const uint4*>(src + int64_t(row_index[row]) * width + col);
  }
}

}  // namespace

void GatherRows(const __nv_bfloat16* src, const int32_t* row_index, __nv_bfloat16* dst, int rows, int width,
                cudaStream_t stream) {
  DUET_KERNEL_CHECK(rows >= 0 && width > 0 && width % 8 == 0);
  DUET_KERNEL_CHECK(src != nullptr && row_index != nullptr && dst != nullptr && src != dst);
  DUET_KERNEL_CHECK(IsAligned(src, 16) && IsAligned(dst, 16));
  const int64_t chunks = int64_t(rows) * (width / 8);
  if (chunks == 0) return;
  const int64_t blocks = std::min<int64_t>((chunks + kThreads - 1) / kThreads, 1 << 16);
  launch_detail::LaunchKernel(GatherRowsKernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, src, row_index, dst,
                              width, chunks);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
