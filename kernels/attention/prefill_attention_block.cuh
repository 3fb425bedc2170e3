// The prefill attention kernel's work for one CTA, as a device function: PrefillKernel
// (prefill_attention.cu) runs one per CTA of its grid, and MixedAttentionKernel
// (mixed_attention.cu) runs it beside paged decode CTAs in one launch. The layout and the
// algorithm are prefill_attention.h's.
#pragma once

#include <climits>
#include <cmath>

#include "kernels/attention/attention_common.cuh"
#include "kernels/attention/prefill_attention.h"
#include "kernels/launch.cuh"

namespace duet::kernels::prefill_detail {

using namespace attention_detail;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
// Query rows per CTA. 64 (16 a warp) against 128 (32 a warp, each K/V fragment feeding 2 MMAs):
// twice the CTAs, so short prompts fill the GPU, and more warps an SM; measured faster on H200
// at every prompt length from 512 to 8192 tokens (attention_bench, 2026-12-04).
constexpr int kBlockM = 64;
constexpr int kMTiles = 1;  // 16-row MMA tiles per warp
static_assert(kWarps * kMTiles * 16 == kBlockM);
constexpr int kDefaultKeyTile = 32;  // measured faster on H200 at head_dim 128 (no spills)

// kBlockN: keys per K/V tile (64 halves the per-tile overhead, 32 halves the score registers).
// K/V pipeline depth: 3 stages where 2 CTAs still fit an SM's shared memory, else 2. With the
// default 32-key tiles a CTA takes 64 KB: 3 fit an SM (the launch bounds ask for that).
template <int kHeadDim, int kBlockN>
constexpr int KvStages() {
  return (kBlockM + 3 * 2 * kBlockN) * kHeadDim * int(sizeof(__nv_bfloat16)) <= 112 * 1024 ? 3 : 2;
}
template <int kHeadDim, int kBlockN>
constexpr int SmemBytes() {  // Q tile + stages of (K tile, V tile)
  return (kBlockM + KvStages<kHeadDim, kBlockN>() * 2 * kBlockN) * kHeadDim * int(sizeof(__nv_bfloat16));
}

// The arguments' contract (prefill_attention.h); aborts on a violation.
inline void CheckPrefillAttentionParams(const PrefillAttentionParams& p) {
  DUET_KERNEL_CHECK(p.kv.num_kv_heads > 0 && p.num_q_heads % p.kv.num_kv_heads == 0);
  DUET_KERNEL_CHECK(p.kv.block_size >= 1 && p.max_blocks_per_seq >= 1);
  DUET_KERNEL_CHECK(p.kv.head_dim == 64 || p.kv.head_dim == 128);
  DUET_KERNEL_CHECK(KvBlockBytesFit(p.kv));  // the tile loader counts a block's bytes in 32 bits
  DUET_KERNEL_CHECK(p.state_out == nullptr || p.state_lse != nullptr);
}

// Query blocks per sequence: the grid's y extent.
inline int NumMBlocks(const PrefillAttentionParams& p) { return (p.max_q_len + kBlockM - 1) / kBlockM; }

// The epilogue that writes (or merges into) the fp32 attention state of PrefillAttentionParams:
// this thread's rows group, group + 8 of each 16-row tile, columns quad * 2 + 8n + {0, 1}.
template <int kHeadDim>
__device__ __forceinline__ void WriteAttentionState(const PrefillAttentionParams& p,
                                                    const float (&acc)[kMTiles][kHeadDim / 8][4],
                                                    const float (&row_max)[kMTiles][2],
                                                    const float (&row_sum)[kMTiles][2], int q_begin, int q_len,
                                                    int warp_row0, int head, int group, int quad) {
  constexpr int kDTiles = kHeadDim / 8;
  // Every lane of a quad reads the old log-sum-exp of its rows before lane 0 overwrites it.
  float old_lse[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + mt * 16 + group + half * 8;
      old_lse[mt][half] = p.merge_state && row < q_len ? p.state_lse[size_t(q_begin + row) * p.num_q_heads + head]
                                                        : -INFINITY;
    }
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + mt * 16 + group + half * 8;
      const float sum = QuadSum(row_sum[mt][half]);
      if (row >= q_len) continue;
      const float lse = sum > 0.f ? row_max[mt][half] * p.scale + logf(sum) : -INFINITY;
      const float merged = fmaxf(old_lse[mt][half], lse);
      // Weights of the old state and of this call's (normalized) output; both 0 when no key was seen.
      float w_old = 0.f, w_new = 0.f, merged_lse = -INFINITY;
      if (merged != -INFINITY) {
        const float e_old = __expf(old_lse[mt][half] - merged), e_new = __expf(lse - merged);
        w_old = e_old / (e_old + e_new);
        w_new = sum > 0.f ? e_new / ((e_old + e_new) * sum) : 0.f;  // folds this call's 1 / sum in
        merged_lse = merged + logf(e_old + e_new);
      }
      const size_t row_head = size_t(q_begin + row) * p.num_q_heads + head;
      float* dst = p.state_out + row_head * kHeadDim + quad * 2;
#pragma unroll
      for (int n = 0; n < kDTiles; ++n) {
        float2 o = p.merge_state ? *reinterpret_cast<const float2*>(dst + n * 8) : make_float2(0.f, 0.f);
        o.x = o.x * w_old + acc[mt][n][half * 2] * w_new;
        o.y = o.y * w_old + acc[mt][n][half * 2 + 1] * w_new;
        *reinterpret_cast<float2*>(dst + n * 8) = o;
      }
      if (quad == 0) p.state_lse[row_head] = merged_lse;
    }
  }
}

// One CTA's work: query head `head`, the kBlockM-row query block `block_from_end` counted from
// the end (the longest causal rows start first), sequence `seq`. Warp w owns query rows
// [16w, 16w + 16) of the block. `smem`: the CTA's dynamic shared memory, SmemBytes() of it.
// Programmatic dependent launch: q and this step's K/V come from the kernels before, so the CTA
// waits for them before anything else.
template <int kHeadDim, int kBlockN>
__device__ __forceinline__ void PrefillAttentionBlock(const PrefillAttentionParams& p, int block_size_log2,
                                                      int num_m_blocks, float scale_log2, int head,
                                                      int block_from_end, int seq, unsigned char* smem) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kKSteps = kHeadDim / 16;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kNTiles = kBlockN / 8;  // MMA n-tiles of S per row tile
  constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(__nv_bfloat16);
  constexpr uint32_t kKvTileBytes = kBlockN * kHeadDim * sizeof(__nv_bfloat16);

  launch_detail::EnterDependentKernel();
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int group = lane / 4, quad = lane % 4;

  const int q_len = p.q_start[seq + 1] - p.q_start[seq];
  const int q_begin = p.q_rows != nullptr ? p.q_rows[seq] : p.q_start[seq];
  const int row0 = (num_m_blocks - 1 - block_from_end) * kBlockM;
  if (row0 >= q_len) return;
  const int context_len = p.context_lens[seq];
  const int pos_offset = context_len - q_len;  // cache position of query row 0
  const int kv_head = head / (p.num_q_heads / p.kv.num_kv_heads);
  const int kv_limit = p.kv_lens != nullptr ? p.kv_lens[seq] : INT_MAX;  // keys [kv_limit, ...) do not exist
  const int kv_end = min(pos_offset + min(row0 + kBlockM, q_len), kv_limit);  // keys [0, kv_end) are visible to some row
  const int num_tiles = (kv_end + kBlockN - 1) / kBlockN;
  const int32_t* block_table = p.block_tables + size_t(seq) * p.max_blocks_per_seq;

  const uint32_t q_smem = SmemAddress(smem);
  const uint32_t kv_smem = q_smem + kQBytes;
  {
    constexpr int kChunks = kBlockM * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < kChunks / kThreads; ++i) {
      const int chunk_id = i * kThreads + int(threadIdx.x);
      const int row = chunk_id / kChunksPerRow, chunk = chunk_id % kChunksPerRow;
      const bool valid = row0 + row < q_len;
      const __nv_bfloat16* src =
          valid ? p.q + (size_t(q_begin + row0 + row) * p.num_q_heads + head) * kHeadDim + chunk * 8 : p.q;
      CpAsync16(q_smem + SwizzledOffset<kChunksPerRow>(row, chunk), src, valid);
    }
  }
  PagedKvTileLoader<kHeadDim, kBlockN, kThreads> loader(p.kv.k, p.kv.v, block_table, kv_end, kv_head,
                                                        p.kv.num_kv_heads, block_size_log2);
  constexpr int kStages = KvStages<kHeadDim, kBlockN>();
  auto issue_tile = [&](int tile) {
    const uint32_t stage = kv_smem + uint32_t(tile % kStages) * 2 * kKvTileBytes;
    loader.Issue(stage, stage + kKvTileBytes, tile * kBlockN);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {  // the first group also carries the Q tile
    loader.Prefetch(s * kBlockN);
    if (s < num_tiles) issue_tile(s);
    CpAsyncCommit();
  }
  loader.Prefetch((kStages - 1) * kBlockN);

  // Per-lane ldmatrix offsets. A fragment's row is (multiple of 8) + lane part and its chunk is
  // (even step) + lane bit, so its swizzled offset is lane_offset ^ (step chunk << 4) plus a row
  // step: one XOR per load instead of a register per (row, chunk) pair.
  constexpr int kRowBytes = kHeadDim * int(sizeof(__nv_bfloat16));
  const uint32_t q_lane = SwizzledOffset<kChunksPerRow>(warp * kMTiles * 16 + (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
  const uint32_t k_lane = SwizzledOffset<kChunksPerRow>((lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t v_lane = SwizzledOffset<kChunksPerRow>((lane % 8) + ((lane / 8) % 2) * 8, lane / 16);

  const int warp_row0 = row0 + warp * kMTiles * 16;
  const bool warp_has_rows = warp_row0 < q_len;
  const int warp_first_pos = pos_offset + warp_row0;
  const int warp_last_pos = pos_offset + min(warp_row0 + kMTiles * 16, q_len) - 1;

  // Tree attention: each of the thread's four rows' masks of this step's first 64 keys.
  uint64_t row_mask[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + mt * 16 + group + half * 8;
      row_mask[mt][half] = p.tree_masks != nullptr && row < q_len ? p.tree_masks[q_begin + row] : ~uint64_t{0};
    }
  // Tiles holding this step's keys need the mask on every row, not only past the warp's first.
  const int mask_from = p.tree_masks != nullptr ? pos_offset : warp_first_pos + 1;

  float acc[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int n = 0; n < kDTiles; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.f;
  float row_max[kMTiles][2];  // raw (unscaled) score maxima of rows group, group + 8
  float row_sum[kMTiles][2];  // this thread's share; quad-reduced at the end
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();  // tile ready for all; every warp is done with the stage refilled below
    if (tile + kStages - 1 < num_tiles) issue_tile(tile + kStages - 1);
    CpAsyncCommit();
    loader.Prefetch((tile + kStages) * kBlockN);  // its block ids arrive during this tile's math

    const int tile_start = tile * kBlockN;
    if (warp_has_rows && tile_start <= warp_last_pos) {
      const uint32_t k_tile = kv_smem + uint32_t(tile % kStages) * 2 * kKvTileBytes;
      const uint32_t v_tile = k_tile + kKvTileBytes;

      // S = Q K^T for this warp's rows x kBlockN keys.
      float s[kMTiles][kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          LdMatrixX4(q_smem + (q_lane ^ (kk << 5)) + mt * 16 * kRowBytes, a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
        }
#pragma unroll
        for (int np = 0; np < kNTiles / 2; ++np) {
          uint32_t b0, b1, b2, b3;
          LdMatrixX4(k_tile + (k_lane ^ (kk << 5)) + np * 16 * kRowBytes, b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            MmaBf16(s[mt][2 * np], a[mt], b0, b1);
            MmaBf16(s[mt][2 * np + 1], a[mt], b2, b3);
          }
        }
      }

      // Causal and tree masks (only tiles that reach past the warp's first position, or into this
      // step's keys with trees) and online softmax.
      const bool needs_mask = tile_start + kBlockN - 1 >= mask_from || tile_start + kBlockN > kv_limit;
      float rescale[kMTiles][2];
      bool any_rescale = false;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pos = warp_first_pos + mt * 16 + group + half * 8;
          const int last_key = min(pos, kv_limit - 1);
          float tile_max = -INFINITY;
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[mt][n][half * 2 + e];
              const int key = tile_start + n * 8 + quad * 2 + e;
              const unsigned step_key = unsigned(key - pos_offset);  // this step's key index (wraps below 0)
              if (needs_mask && (key > last_key || (step_key < 64u && !((row_mask[mt][half] >> step_key) & 1u)))) {
                x = -INFINITY;
              }
              tile_max = fmaxf(tile_max, x);
            }
          }
          tile_max = QuadMax(tile_max);
          const float new_max = fmaxf(row_max[mt][half], tile_max);
          const float base = new_max == -INFINITY ? 0.f : new_max * scale_log2;
          rescale[mt][half] = Exp2(row_max[mt][half] * scale_log2 - base);
          any_rescale |= rescale[mt][half] != 1.f;
          row_max[mt][half] = new_max;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float& x = s[mt][n][half * 2 + e];
              x = Exp2(fmaf(x, scale_log2, -base));
              sum += x;
            }
          }
          row_sum[mt][half] = row_sum[mt][half] * rescale[mt][half] + sum;
        }
      }
      // Row maxima settle after the first tiles: skip rescaling O when no row of the warp moved.
      if (__any_sync(0xffffffffu, any_rescale)) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int n = 0; n < kDTiles; ++n) {
            acc[mt][n][0] *= rescale[mt][0];
            acc[mt][n][1] *= rescale[mt][0];
            acc[mt][n][2] *= rescale[mt][1];
            acc[mt][n][3] *= rescale[mt][1];
          }
        }
      }

      // O += P V, P's accumulator fragments reused as bf16 A-fragments (16 keys per k-step).
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t pa[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          pa[mt][0] = PackBf16(s[mt][2 * ks][0], s[mt][2 * ks][1]);
          pa[mt][1] = PackBf16(s[mt][2 * ks][2], s[mt][2 * ks][3]);
          pa[mt][2] = PackBf16(s[mt][2 * ks + 1][0], s[mt][2 * ks + 1][1]);
          pa[mt][3] = PackBf16(s[mt][2 * ks + 1][2], s[mt][2 * ks + 1][3]);
        }
#pragma unroll
        for (int c = 0; c < kDTiles; c += 2) {
          uint32_t b0, b1, b2, b3;
          LdMatrixX4Trans(v_tile + (v_lane ^ (c << 4)) + ks * 16 * kRowBytes, b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            MmaBf16(acc[mt][c], pa[mt], b0, b1);
            MmaBf16(acc[mt][c + 1], pa[mt], b2, b3);
          }
        }
      }
    }
  }

  if (p.state_out != nullptr) {
    WriteAttentionState<kHeadDim>(p, acc, row_max, row_sum, q_begin, q_len, warp_row0, head, group, quad);
    return;
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_row0 + mt * 16 + group + half * 8;
      const float sum = QuadSum(row_sum[mt][half]);
      if (row >= q_len) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      __nv_bfloat16* dst = p.out + (size_t(q_begin + row) * p.num_q_heads + head) * kHeadDim + quad * 2;
#pragma unroll
      for (int n = 0; n < kDTiles; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(dst + n * 8) =
            __floats2bfloat162_rn(acc[mt][n][half * 2] * inv, acc[mt][n][half * 2 + 1] * inv);
      }
    }
  }
}

}  // namespace duet::kernels::prefill_detail
