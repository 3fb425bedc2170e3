// The paged decode attention kernel's work for one CTA, as a device function: PagedDecodeKernel
// (paged_attention.cu) runs one per CTA of its grid, and MixedAttentionKernel (mixed_attention.cu)
// runs it beside prefill CTAs in one launch. The layout and the algorithm are paged_attention.h's.
#pragma once

#include <cmath>
#include <cstddef>

#include "kernels/attention/attention_common.cuh"
#include "kernels/attention/paged_attention.h"
#include "kernels/launch.cuh"

namespace duet::kernels::decode_detail {

using namespace attention_detail;
using launch_detail::LetDependentsLaunch;
using launch_detail::WaitForPriorKernels;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 64;                      // tokens per pipeline stage; 16 per warp
constexpr int kStages = 3;                           // cp.async pipeline depth
constexpr int kHeadsPerCta = 16;                     // query heads in one MMA row tile
constexpr int kMinTilesPerSplit = 2;                 // below this a split's merge costs more than it hides

// Tokens per split of a sequence of `context_len` tokens under a plan of `num_splits` splits:
// the context spread evenly over the splits, in whole tiles, so a short context in a plan made
// for a long one (a CUDA graph's) still uses as many CTAs as it can.
__device__ __forceinline__ int SplitTokens(int context_len, int num_splits) {
  const int per_split = (context_len + num_splits - 1) / num_splits;
  return max(kTileTokens, (per_split + kTileTokens - 1) / kTileTokens * kTileTokens);
}

template <int kHeadDim>
constexpr int SmemBytes() {
  return kStages * 2 * kTileTokens * kHeadDim * int(sizeof(__nv_bfloat16));
}
template <int kHeadDim>
constexpr int CtasPerSm() {
  return kHeadDim == 128 ? 2 : 4;  // what the shared memory of SmemBytes() allows
}

static_assert(SmemBytes<64>() >= (kWarps * kHeadsPerCta * (64 + 4 + 2)) * int(sizeof(float)) &&
                  SmemBytes<128>() >= (kWarps * kHeadsPerCta * (128 + 4 + 2)) * int(sizeof(float)),
              "the warps' merge buffer must fit the pipeline's shared memory");

inline size_t WorkspaceBytes(int num_seqs, int num_q_heads, int head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  return size_t(num_seqs) * num_q_heads * num_splits * (head_dim + 1) * sizeof(float);
}

// CTAs per KV head: its query heads, kHeadsPerCta at a time.
inline int HeadChunks(const PagedDecodeAttentionParams& p) {
  return (p.num_q_heads / p.kv.num_kv_heads + kHeadsPerCta - 1) / kHeadsPerCta;
}

// The arguments' contract (paged_attention.h); aborts on a violation.
inline void CheckPagedDecodeAttentionParams(const PagedDecodeAttentionParams& p, const PagedDecodeAttentionPlan& plan) {
  DUET_KERNEL_CHECK(p.kv.num_kv_heads > 0 && p.num_q_heads % p.kv.num_kv_heads == 0);
  DUET_KERNEL_CHECK(p.kv.block_size >= 1 && p.max_blocks_per_seq >= 1);
  DUET_KERNEL_CHECK(p.kv.head_dim == 64 || p.kv.head_dim == 128);
  DUET_KERNEL_CHECK(KvBlockBytesFit(p.kv));  // the tile loader counts a block's bytes in 32 bits
  DUET_KERNEL_CHECK(plan.num_splits >= 1 && plan.tokens_per_split > 0 && plan.tokens_per_split % kTileTokens == 0);
  DUET_KERNEL_CHECK(plan.num_splits == 1 || (p.workspace != nullptr && p.split_counters != nullptr));
  // The merging CTA keeps one weight per (query head, split) in its shared memory.
  DUET_KERNEL_CHECK(size_t(kHeadsPerCta) * plan.num_splits * sizeof(float) <= size_t(SmemBytes<64>()));
  DUET_KERNEL_CHECK(plan.workspace_bytes >= WorkspaceBytes(p.num_seqs, p.num_q_heads, p.kv.head_dim, plan.num_splits));
}

// One CTA's work: x = KV head * head_chunks + chunk (query heads of one KV head, 16 at a time),
// sequence `seq`, split `split`; `grid_x` is the extent of x (it indexes the split counters).
// Warp w of the CTA takes tokens [16w, 16w + 16) of every 64-token tile of its split, keeps its
// own online softmax state, and the 4 warps merge through shared memory at the end.
// MMA rows are query heads (rows past the group get zero queries and are never written).
// With splits, each CTA writes its normalized partial output and log-sum-exp to the workspace;
// the last CTA of a (sequence, x) to finish (counted in split_counters) merges them into out.
// Launched with programmatic dependent launch: the K/V of every token but the newest (which the
// kernel before this one writes) are older than the step, so a CTA whose first tiles hold only
// such tokens starts loading them before it waits for that kernel. `smem`: the CTA's dynamic
// shared memory, SmemBytes() of it.
template <int kHeadDim>
__device__ __forceinline__ void PagedDecodeBlock(const PagedDecodeAttentionParams& p, int num_splits,
                                                 int max_tokens_per_split, int head_chunks, int block_size_log2,
                                                 float scale_log2, int x, int seq, int split, int grid_x,
                                                 unsigned char* smem) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kKSteps = kHeadDim / 16;  // MMA k-steps over head_dim for Q.K
  constexpr int kDTiles = kHeadDim / 8;   // MMA n-tiles over head_dim for P.V
  constexpr uint32_t kTileBytes = kTileTokens * kHeadDim * sizeof(__nv_bfloat16);

  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int group = lane / 4, quad = lane % 4;

  const int kv_head = x / head_chunks;
  const int heads_per_kv = p.num_q_heads / p.kv.num_kv_heads;
  const int first_head_in_group = (x % head_chunks) * kHeadsPerCta;
  const int num_rows = min(kHeadsPerCta, heads_per_kv - first_head_in_group);
  const int first_head = kv_head * heads_per_kv + first_head_in_group;
  const int context_len = p.context_lens[seq];  // step metadata: copied in before the step
  if (context_len > num_splits * max_tokens_per_split || context_len > p.max_blocks_per_seq << block_size_log2) {
    __trap();  // the plan (or the block table) does not cover this context
  }
  const int tokens_per_split = SplitTokens(context_len, num_splits);
  const int split_begin = split * tokens_per_split;
  if (split_begin >= context_len) {
    WaitForPriorKernels();
    LetDependentsLaunch();
    if (split == 0 && (num_splits == 1 || context_len == 0)) {  // empty sequence: zeros
      for (int i = int(threadIdx.x); i < num_rows * kHeadDim; i += kThreads) {
        p.out[(size_t(seq) * p.num_q_heads + first_head + i / kHeadDim) * kHeadDim + i % kHeadDim] =
            __float2bfloat16(0.f);
      }
    }
    return;
  }
  const int split_end = min(context_len, split_begin + tokens_per_split);
  const int num_tiles = (split_end - split_begin + kTileTokens - 1) / kTileTokens;
  const int32_t* block_table = p.block_tables + size_t(seq) * p.max_blocks_per_seq;
  const uint32_t smem_base = SmemAddress(smem);

  PagedKvTileLoader<kHeadDim, kTileTokens, kThreads> loader(p.kv.k, p.kv.v, block_table, split_end, kv_head,
                                                            p.kv.num_kv_heads, block_size_log2);
  auto tile_first_token = [&](int tile) { return split_begin + tile * kTileTokens; };
  auto issue_tile = [&](int tile) {
    const uint32_t stage = smem_base + uint32_t(tile % kStages) * 2 * kTileBytes;
    loader.Issue(stage, stage + kTileBytes, tile_first_token(tile));
  };
  // The newest token's K/V (position context_len - 1) comes from the previous kernel; the
  // prologue reads tokens [split_begin, min(split_end, split_begin + (kStages - 1) * kTileTokens)).
  const bool prologue_before_wait = context_len - 1 >= min(split_end, split_begin + (kStages - 1) * kTileTokens);
  if (!prologue_before_wait) {
    WaitForPriorKernels();
    LetDependentsLaunch();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    loader.Prefetch(tile_first_token(s));
    if (s < num_tiles) issue_tile(s);
    CpAsyncCommit();
  }
  loader.Prefetch(tile_first_token(kStages - 1));
  if (prologue_before_wait) {
    WaitForPriorKernels();  // q and the tiles issued in the loop below
    LetDependentsLaunch();
  }

  // Query A-fragments straight from global memory (rows = heads; rows past the group are 0).
  uint32_t q_frag[kKSteps][4];
  {
    const int row_lo = group, row_hi = group + 8;
    const __nv_bfloat16* q_seq = p.q + (size_t(seq) * p.num_q_heads + first_head) * kHeadDim;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int col = kk * 16 + quad * 2;
      auto load = [&](int row, int c) -> uint32_t {
        return row < num_rows ? *reinterpret_cast<const uint32_t*>(q_seq + row * kHeadDim + c) : 0u;
      };
      q_frag[kk][0] = load(row_lo, col);
      q_frag[kk][1] = load(row_hi, col);
      q_frag[kk][2] = load(row_lo, col + 8);
      q_frag[kk][3] = load(row_hi, col + 8);
    }
  }

  float acc[kDTiles][4];
#pragma unroll
  for (int n = 0; n < kDTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // rows group, group + 8 (log2 domain, scaled)
  float row_sum[2] = {0.f, 0.f};              // this thread's share; quad-reduced at the end

  for (int tile = 0; tile < num_tiles; ++tile) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // tile ready for all; every warp is done with the stage refilled below
    if (tile + kStages - 1 < num_tiles) issue_tile(tile + kStages - 1);
    CpAsyncCommit();
    loader.Prefetch(tile_first_token(tile + kStages));  // its block ids arrive during this tile's math

    const uint32_t k_tile = smem_base + uint32_t(tile % kStages) * 2 * kTileBytes;
    const uint32_t v_tile = k_tile + kTileBytes;
    const int warp_first_token = split_begin + tile * kTileTokens + warp * 16;
    if (warp_first_token >= split_end) continue;

    // S[16 heads x 16 tokens] = Q K^T as two n-tiles of 8 tokens.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t b0, b1, b2, b3;
      const int row = warp * 16 + (lane % 8) + (lane / 16) * 8;
      LdMatrixX4(k_tile + SwizzledOffset<kChunksPerRow>(row, 2 * kk + (lane / 8) % 2), b0, b1, b2, b3);
      MmaBf16(s[0], q_frag[kk], b0, b1);
      MmaBf16(s[1], q_frag[kk], b2, b3);
    }

    // Online softmax (base 2) over this warp's 16 tokens. Rows 8-15 hold heads only where a KV
    // head serves more than 8 query heads; otherwise (Llama's 4) their probabilities are zero
    // and their softmax is skipped.
    float rescale[2] = {1.f, 1.f};
    bool rescaled = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (half == 1 && num_rows <= 8) {
        s[0][2] = s[0][3] = s[1][2] = s[1][3] = 0.f;
        continue;
      }
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = warp_first_token + n * 8 + quad * 2 + e;
          float& x = s[n][half * 2 + e];
          x = token < split_end ? x * scale_log2 : -INFINITY;
          tile_max = fmaxf(tile_max, x);
        }
      }
      tile_max = QuadMax(tile_max);
      const float new_max = fmaxf(row_max[half], tile_max);
      const float base = new_max == -INFINITY ? 0.f : new_max;
      rescale[half] = Exp2(row_max[half] - base);
      rescaled |= rescale[half] != 1.f;
      row_max[half] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[n][half * 2 + e];
          x = Exp2(x - base);
          sum += x;
        }
      }
      row_sum[half] = row_sum[half] * rescale[half] + sum;
    }
    // Row maxima settle after the first tiles: O is rescaled only when one of the warp's moved.
    if (__any_sync(0xffffffffu, rescaled)) {
#pragma unroll
      for (int n = 0; n < kDTiles; ++n) {
        acc[n][0] *= rescale[0];
        acc[n][1] *= rescale[0];
        acc[n][2] *= rescale[1];
        acc[n][3] *= rescale[1];
      }
    }

    // O += P V: P (16 heads x 16 tokens) is one A-fragment; V rows are this warp's tokens.
    const uint32_t p_frag[4] = {PackBf16(s[0][0], s[0][1]), PackBf16(s[0][2], s[0][3]), PackBf16(s[1][0], s[1][1]),
                                PackBf16(s[1][2], s[1][3])};
#pragma unroll
    for (int c = 0; c < kDTiles; c += 2) {
      uint32_t b0, b1, b2, b3;
      const int row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
      LdMatrixX4Trans(v_tile + SwizzledOffset<kChunksPerRow>(row, c + lane / 16), b0, b1, b2, b3);
      MmaBf16(acc[c], p_frag, b0, b1);
      MmaBf16(acc[c + 1], p_frag, b2, b3);
    }
  }
  row_sum[0] = QuadSum(row_sum[0]);
  row_sum[1] = QuadSum(row_sum[1]);

  // Merge the 4 warps through shared memory (the pipeline buffers are free now).
  CpAsyncWait<0>();
  __syncthreads();
  // [kWarps][16 rows][kMergeStride]: rows padded by 4 floats, so the 8 rows a warp's store covers
  // fall in different banks.
  constexpr int kMergeStride = kHeadDim + 4;
  float* merge_acc = reinterpret_cast<float*>(smem);
  float* merge_max = merge_acc + kWarps * kHeadsPerCta * kMergeStride;  // [kWarps][16 rows]
  float* merge_sum = merge_max + kWarps * kHeadsPerCta;             // [kWarps][16 rows]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = group + half * 8;
    float* dst = merge_acc + (warp * kHeadsPerCta + row) * kMergeStride;
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) {
      *reinterpret_cast<float2*>(dst + n * 8 + quad * 2) = make_float2(acc[n][half * 2], acc[n][half * 2 + 1]);
    }
    if (quad == 0) {
      merge_max[warp * kHeadsPerCta + row] = row_max[half];
      merge_sum[warp * kHeadsPerCta + row] = row_sum[half];
    }
  }
  __syncthreads();

  const bool split_plan = num_splits > 1;
  float* lse_all = p.workspace + size_t(p.num_seqs) * p.num_q_heads * num_splits * kHeadDim;  // [seq, head, split]
  for (int i = int(threadIdx.x); i < num_rows * kHeadDim; i += kThreads) {
    const int row = i / kHeadDim, d = i % kHeadDim;
    float max_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) max_all = fmaxf(max_all, merge_max[w * kHeadsPerCta + row]);
    float sum = 0.f, value = 0.f;
    if (max_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = Exp2(merge_max[w * kHeadsPerCta + row] - max_all);
        sum += weight * merge_sum[w * kHeadsPerCta + row];
        value += weight * merge_acc[(w * kHeadsPerCta + row) * kMergeStride + d];
      }
    }
    const float normalized = sum > 0.f ? value / sum : 0.f;
    const size_t seq_head = size_t(seq) * p.num_q_heads + first_head + row;
    if (!split_plan) {
      p.out[seq_head * kHeadDim + d] = __float2bfloat16(normalized);
    } else {
      p.workspace[(seq_head * num_splits + split) * kHeadDim + d] = normalized;
      if (d == 0) lse_all[seq_head * num_splits + split] = sum > 0.f ? max_all + log2f(sum) : -INFINITY;
    }
  }
  if (!split_plan) return;

  // Count this CTA's partials in; the last of the sequence's splits to finish merges them all,
  // weighting split s by 2^(lse_s - lse_max).
  __shared__ bool merges;
  const int used_splits = (context_len + tokens_per_split - 1) / tokens_per_split;
  __threadfence();  // this thread's partials are visible before the count says so
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = p.split_counters + size_t(seq) * grid_x + x;
    merges = atomicAdd(counter, 1) == used_splits - 1;
    if (merges) atomicExch(counter, 0);  // every split has counted: ready for the next launch
  }
  __syncthreads();
  if (!merges) return;
  __threadfence();
  float* split_weight = merge_acc;  // [num_rows][used_splits]; the CTA's own merge is done with it
  for (int row = int(threadIdx.x); row < num_rows; row += kThreads) {
    const float* lse = lse_all + (size_t(seq) * p.num_q_heads + first_head + row) * num_splits;
    float lse_max = -INFINITY;
    for (int s = 0; s < used_splits; ++s) lse_max = fmaxf(lse_max, __ldcg(lse + s));
    float weight_sum = 0.f;
    for (int s = 0; s < used_splits; ++s) {
      const float weight = lse_max == -INFINITY ? 0.f : Exp2(__ldcg(lse + s) - lse_max);
      split_weight[row * used_splits + s] = weight;
      weight_sum += weight;
    }
    const float inv_sum = weight_sum > 0.f ? 1.f / weight_sum : 0.f;
    for (int s = 0; s < used_splits; ++s) split_weight[row * used_splits + s] *= inv_sum;
  }
  __syncthreads();
  for (int i = int(threadIdx.x); i < num_rows * kHeadDim; i += kThreads) {
    const int row = i / kHeadDim, d = i % kHeadDim;
    const size_t seq_head = size_t(seq) * p.num_q_heads + first_head + row;
    const float* partial = p.workspace + seq_head * num_splits * kHeadDim + d;
    float value = 0.f;
    for (int s = 0; s < used_splits; ++s) value += split_weight[row * used_splits + s] * __ldcg(partial + s * kHeadDim);
    p.out[seq_head * kHeadDim + d] = __float2bfloat16(value);
  }
}

}  // namespace duet::kernels::decode_detail
