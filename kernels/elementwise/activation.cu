#include "kernels/elementwise/activation.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;

constexpr int kThreads = 256;

// Grid-stride over 8-element output chunks; each chunk is one 16-byte load of gate, one of up,
// one 16-byte store.
__global__ void __launch_bounds__(kThreads)
    SiluAndMulKernel(const __nv_bfloat16* __restrict__ in, __nv_bfloat16* __restrict__ out, int inter, int64_t chunks) {
  launch_detail::EnterDependentKernel();
  const int chunks_per_row = inter / 8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < chunks; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks_per_row;
    const int col = int(i % chunks_per_row) * 8;
    const __nv_bfloat16* gate_ptr = in + row * 2 * inter + col;
    float gate[8], up[8], y[8];
    Bf16x8ToFloat(*reinterpret_cast<const uint4*>(gate_ptr), gate);
    Bf16x8ToFloat(*reinterpret_cast<const uint4*>(gate_ptr + inter), up);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = gate[j] / (1.f + __expf(-gate[j])) * up[j];
    *reinterpret_cast<uint4*>(out + row * inter + col) = FloatToBf16x8(y);
  }
}

}  // namespace

void SiluAndMul(const __nv_bfloat16* in, __nv_bfloat16* out, int rows, int inter, cudaStream_t stream) {
  DUET_KERNEL_CHECK(rows >= 0 && inter > 0 && inter % 8 == 0);
  DUET_KERNEL_CHECK(in != nullptr && out != nullptr && IsAligned(in, 16) && IsAligned(out, 16));
  const int64_t chunks = int64_t(rows) * (inter / 8);
  if (chunks == 0) return;
  // Enough CTAs to fill the GPU many times over; the grid-stride loop covers the rest.
  const int64_t blocks = std::min<int64_t>((chunks + kThreads - 1) / kThreads, 1 << 16);
  launch_detail::LaunchKernel(SiluAndMulKernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream, in, out, inter, chunks);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
