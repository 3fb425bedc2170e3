#include "kernels/attention/prefill_attention.h"

#include <algorithm>

#include "kernels/attention/prefill_attention_block.cuh"
#include "kernels/cuda_check.h"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace prefill_detail;

// grid: x = query head (heads of one KV head are neighbours, so their K/V reads meet in L2),
// y = kBlockM-row query block counted from the end, z = sequence.
template <int kHeadDim, int kBlockN>
__global__ void __launch_bounds__(kThreads, 3) PrefillKernel(const __grid_constant__ PrefillAttentionParams p,
                                                             int block_size_log2, int num_m_blocks, float scale_log2) {
  extern __shared__ __align__(128) unsigned char smem[];
  PrefillAttentionBlock<kHeadDim, kBlockN>(p, block_size_log2, num_m_blocks, scale_log2, int(blockIdx.x),
                                           int(blockIdx.y), int(blockIdx.z), smem);
}

template <int kHeadDim, int kBlockN>
void Launch(const PrefillAttentionParams& p, cudaStream_t stream) {
  constexpr int smem = SmemBytes<kHeadDim, kBlockN>();
  DUET_CUDA_CHECK(
      cudaFuncSetAttribute(PrefillKernel<kHeadDim, kBlockN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int num_m_blocks = NumMBlocks(p);
  const dim3 grid(p.num_q_heads, num_m_blocks, p.num_seqs);
  launch_detail::LaunchKernel(PrefillKernel<kHeadDim, kBlockN>, grid, dim3(kThreads), smem, stream, p,
                              Log2OfPowerOfTwo(p.kv.block_size), num_m_blocks, p.scale * kLog2e);
}

__global__ void StateToBf16Kernel(const float4* state, int64_t n4, __nv_bfloat162* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 x = state[i];
    out[2 * i] = __floats2bfloat162_rn(x.x, x.y);
    out[2 * i + 1] = __floats2bfloat162_rn(x.z, x.w);
  }
}

}  // namespace

void AttentionStateToBf16(const float* state, int64_t n, __nv_bfloat16* out, cudaStream_t stream) {
  DUET_KERNEL_CHECK(n % 4 == 0);
  if (n == 0) return;
  const int64_t n4 = n / 4;
  const int blocks = int(std::min<int64_t>((n4 + 255) / 256, 4096));
  StateToBf16Kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const float4*>(state), n4,
                                               reinterpret_cast<__nv_bfloat162*>(out));
  DUET_CUDA_CHECK(cudaGetLastError());
}

void PrefillAttention(const PrefillAttentionParams& p, cudaStream_t stream) {
  internal::PrefillAttentionWithKeyTile(p, kDefaultKeyTile, stream);
}

namespace internal {
void PrefillAttentionWithKeyTile(const PrefillAttentionParams& p, int key_tile, cudaStream_t stream) {
  CheckPrefillAttentionParams(p);
  DUET_KERNEL_CHECK(key_tile == 32 || key_tile == 64);
  if (p.num_seqs == 0 || p.max_q_len == 0) return;
  if (p.kv.head_dim == 64) {
    key_tile == 32 ? Launch<64, 32>(p, stream) : Launch<64, 64>(p, stream);
  } else {
    key_tile == 32 ? Launch<128, 32>(p, stream) : Launch<128, 64>(p, stream);
  }
}
}  // namespace internal

}  // namespace duet::kernels
