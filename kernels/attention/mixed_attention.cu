#include "kernels/attention/mixed_attention.h"

#include <algorithm>

#include "kernels/attention/paged_decode_block.cuh"
#include "kernels/attention/prefill_attention_block.cuh"
#include "kernels/cuda_check.h"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

constexpr int kThreads = decode_detail::kThreads;
static_assert(prefill_detail::kThreads == kThreads, "both kinds of CTA run in one launch");
constexpr int kPrefillKeyTile = prefill_detail::kDefaultKeyTile;

// What the CTAs need to find their work: prefill CTAs are blocks [0, prefill_ctas) in the prefill
// kernel's grid order (head fastest, then query block from the end, then sequence); the decode
// CTAs follow in the decode kernel's (x, sequence, split).
struct MixedGrid {
  int prefill_ctas, num_m_blocks;
  int decode_grid_x, num_splits, tokens_per_split, head_chunks;
  int block_size_log2;
  float decode_scale_log2, prefill_scale_log2;
};

// The prompt chunks' CTAs come first: their causal blocks are the longest chains of dependent
// work, and the decode CTAs fill the SMs around them.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads, 2)
    MixedAttentionKernel(const __grid_constant__ PagedDecodeAttentionParams decode,
                         const __grid_constant__ PrefillAttentionParams prefill, const MixedGrid g) {
  extern __shared__ __align__(128) unsigned char smem[];
  int b = int(blockIdx.x);
  if (b < g.prefill_ctas) {
    const int head = b % prefill.num_q_heads, rest = b / prefill.num_q_heads;
    prefill_detail::PrefillAttentionBlock<kHeadDim, kPrefillKeyTile>(prefill, g.block_size_log2, g.num_m_blocks,
                                                                     g.prefill_scale_log2, head,
                                                                     rest % g.num_m_blocks, rest / g.num_m_blocks, smem);
    return;
  }
  b -= g.prefill_ctas;
  const int x = b % g.decode_grid_x, rest = b / g.decode_grid_x;
  decode_detail::PagedDecodeBlock<kHeadDim>(decode, g.num_splits, g.tokens_per_split, g.head_chunks,
                                            g.block_size_log2, g.decode_scale_log2, x, rest % decode.num_seqs,
                                            rest / decode.num_seqs, g.decode_grid_x, smem);
}

template <int kHeadDim>
void Launch(const PagedDecodeAttentionParams& decode, const PagedDecodeAttentionPlan& plan,
            const PrefillAttentionParams& prefill, cudaStream_t stream) {
  constexpr int smem =
      std::max(decode_detail::SmemBytes<kHeadDim>(), prefill_detail::SmemBytes<kHeadDim, kPrefillKeyTile>());
  DUET_CUDA_CHECK(
      cudaFuncSetAttribute(MixedAttentionKernel<kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MixedGrid g{};
  g.num_m_blocks = prefill_detail::NumMBlocks(prefill);
  g.prefill_ctas = prefill.num_q_heads * g.num_m_blocks * prefill.num_seqs;
  g.head_chunks = decode_detail::HeadChunks(decode);
  g.decode_grid_x = decode.kv.num_kv_heads * g.head_chunks;
  g.num_splits = plan.num_splits;
  g.tokens_per_split = plan.tokens_per_split;
  g.block_size_log2 = attention_detail::Log2OfPowerOfTwo(decode.kv.block_size);
  g.decode_scale_log2 = decode.scale * attention_detail::kLog2e;
  g.prefill_scale_log2 = prefill.scale * attention_detail::kLog2e;
  const int ctas = g.prefill_ctas + g.decode_grid_x * decode.num_seqs * plan.num_splits;
  launch_detail::LaunchKernel(MixedAttentionKernel<kHeadDim>, dim3(ctas), dim3(kThreads), smem, stream, decode, prefill,
                              g);
}

}  // namespace

void MixedAttention(const PagedDecodeAttentionParams& decode, const PagedDecodeAttentionPlan& plan,
                    const PrefillAttentionParams& prefill, cudaStream_t stream) {
  if (prefill.num_seqs == 0 || prefill.max_q_len == 0) return PagedDecodeAttention(decode, plan, stream);
  if (decode.num_seqs == 0) return PrefillAttention(prefill, stream);
  decode_detail::CheckPagedDecodeAttentionParams(decode, plan);
  prefill_detail::CheckPrefillAttentionParams(prefill);
  DUET_KERNEL_CHECK(prefill.state_out == nullptr);
  DUET_KERNEL_CHECK(decode.kv.head_dim == prefill.kv.head_dim && decode.kv.block_size == prefill.kv.block_size);
  decode.kv.head_dim == 64 ? Launch<64>(decode, plan, prefill, stream) : Launch<128>(decode, plan, prefill, stream);
}

}  // namespace duet::kernels
