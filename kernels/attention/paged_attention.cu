#include "kernels/attention/paged_attention.h"

#include <algorithm>

#include "kernels/attention/paged_decode_block.cuh"
#include "kernels/cuda_check.h"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace decode_detail;

// grid: x = num_kv_heads * head_chunks, y = sequence, z = split.
template <int kHeadDim>
__global__ void __launch_bounds__(kThreads) PagedDecodeKernel(const __grid_constant__ PagedDecodeAttentionParams p,
                                                              int num_splits, int max_tokens_per_split,
                                                              int head_chunks, int block_size_log2, float scale_log2) {
  extern __shared__ __align__(128) unsigned char smem[];
  PagedDecodeBlock<kHeadDim>(p, num_splits, max_tokens_per_split, head_chunks, block_size_log2, scale_log2,
                             int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), int(gridDim.x), smem);
}

template <int kHeadDim>
void Launch(const PagedDecodeAttentionParams& p, const PagedDecodeAttentionPlan& plan, cudaStream_t stream) {
  const int head_chunks = HeadChunks(p);
  constexpr int smem = SmemBytes<kHeadDim>();
  DUET_CUDA_CHECK(cudaFuncSetAttribute(PagedDecodeKernel<kHeadDim>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(p.kv.num_kv_heads * head_chunks, p.num_seqs, plan.num_splits);
  launch_detail::LaunchKernel(PagedDecodeKernel<kHeadDim>, grid, dim3(kThreads), smem, stream, p, plan.num_splits,
                              plan.tokens_per_split, head_chunks, Log2OfPowerOfTwo(p.kv.block_size),
                              p.scale * kLog2e);
}

}  // namespace

PagedDecodeAttentionPlan PlanPagedDecodeAttention(int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                                  int max_context_len, int num_sms) {
  DUET_KERNEL_CHECK(num_seqs > 0 && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && num_sms > 0);
  DUET_KERNEL_CHECK(head_dim == 64 || head_dim == 128);
  const int max_tiles = std::max(1, (max_context_len + kTileTokens - 1) / kTileTokens);
  const int head_chunks = (num_q_heads / num_kv_heads + kHeadsPerCta - 1) / kHeadsPerCta;
  const int ctas = num_seqs * num_kv_heads * head_chunks;
  const int resident = num_sms * (head_dim == 128 ? CtasPerSm<128>() : CtasPerSm<64>());
  // Enough splits to fill one wave of resident CTAs (never more: a partial second wave costs
  // a whole one), each split at least kMinTilesPerSplit tiles.
  int splits = std::max(1, resident / ctas);
  splits = std::min(splits, std::max(1, max_tiles / kMinTilesPerSplit));
  const int tiles_per_split = (max_tiles + splits - 1) / splits;
  splits = (max_tiles + tiles_per_split - 1) / tiles_per_split;
  PagedDecodeAttentionPlan plan;
  plan.num_splits = splits;
  plan.tokens_per_split = tiles_per_split * kTileTokens;
  plan.workspace_bytes = WorkspaceBytes(num_seqs, num_q_heads, head_dim, splits);
  plan.num_split_counters = splits > 1 ? ctas : 0;
  return plan;
}

void PagedDecodeAttention(const PagedDecodeAttentionParams& p, const PagedDecodeAttentionPlan& plan,
                          cudaStream_t stream) {
  CheckPagedDecodeAttentionParams(p, plan);
  if (p.num_seqs == 0) return;
  p.kv.head_dim == 64 ? Launch<64>(p, plan, stream) : Launch<128>(p, plan, stream);
}

}  // namespace duet::kernels
