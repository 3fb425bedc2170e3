// Device building blocks shared by the paged decode and prefill attention kernels: cp.async
// copies from the paged KV cache into swizzled shared-memory tiles, ldmatrix, and the bf16
// tensor-core MMA m16n8k16 (fp32 accumulate), as inline PTX for sm_80+.
//
// Shared-memory tiles hold rows of head_dim bf16 (head_dim / 8 chunks of 16 bytes). Chunk c of
// row r is stored at chunk c ^ (r % 8) so that the 8 row addresses of one ldmatrix 8x8 matrix
// (same logical chunk, 8 consecutive rows) hit 8 different bank groups.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_kv.h"
#include "kernels/cuda_check.h"


namespace duet::kernels::attention_detail {

constexpr float kLog2e = 1.4426950408889634f;

// Byte offset of (row, chunk) in a swizzled tile of `chunks_per_row` 16-byte chunks per row.
template <int kChunksPerRow>
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return uint32_t((row * kChunksPerRow + (chunk ^ (row & 7))) * 16);
}

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses L1; copies nothing and zero-fills when !valid
// (src must still be a valid address).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// d[4] += A(16x16, row-major bf16, a[4]) * B(16x8, col-major bf16, b[2]); fp32 accumulators.
// Fragment layout (lane = 4*group + quad): a0 (row g, k 2q..2q+1), a1 (row g+8), a2 (k+8),
// a3 (row g+8, k+8); b0 (k 2q..2q+1, col g), b1 (k+8); d0,d1 (row g, col 2q..2q+1), d2,d3 (row g+8).
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the special-function unit (the softmax's only transcendental); 2^-inf = 0.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Max/sum over the 4 lanes of a quad (the lanes that share one accumulator row).
__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Copies K and V tiles of `kTileTokens` consecutive tokens of one KV head from the paged caches
// ([num_blocks, num_kv_heads, block_size, head_dim]) into swizzled shared-memory tiles with
// cp.async, every thread of the block taking a share. Two phases, so that the block-table read
// of the next tile is in flight while the current one is computed: Prefetch(tile) turns the block
// ids of this thread's rows into byte offsets, Issue(tile) starts the copies. Tokens at or past
// `end_token` are zero-filled, so masked columns hold zeros (never NaN garbage that 0 * x would
// turn into NaN); their source address is block 0's, valid memory. A thread's column chunk and
// KV head are the same in every row it copies, so its byte offset inside a block is computed
// once: a row costs one 32-bit slot offset and two 64-bit adds (K and V share the offsets).
template <int kHeadDim, int kTileTokens, int kThreads>
struct PagedKvTileLoader {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static constexpr int kPasses = kTileTokens / kRowsPerPass;
  static constexpr int kRowBytesLog2 = kHeadDim == 128 ? 8 : 7;  // head_dim bf16
  static_assert(kThreads % kChunksPerRow == 0 && kTileTokens % kRowsPerPass == 0, "tile must split evenly");
  static_assert((1 << kRowBytesLog2) == kHeadDim * 2, "head_dim 64 or 128");
  // A pass moves the rows by a multiple of 8, so a row's swizzle (row % 8) is its first pass's.
  static_assert(kRowsPerPass % 8 == 0, "passes keep the swizzle");
  static constexpr uint32_t kPassBytes = kRowsPerPass * kChunksPerRow * 16;

  const char* __restrict__ k_bytes;
  const char* __restrict__ v_bytes;
  const int32_t* __restrict__ block_table;  // this sequence's row
  int end_token, block_size_log2;
  uint32_t slot_mask;     // block_size - 1
  int block_bytes;        // one block of every KV head
  uint32_t thread_bytes;  // this thread's KV head and column chunk within a block
  uint32_t thread_dst;    // this thread's first row and chunk in a tile (swizzled)
  int64_t block_offset[kPasses];  // byte offsets of the blocks of this thread's rows of the prefetched tile

  __device__ __forceinline__ PagedKvTileLoader(const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                                               const int32_t* table, int end, int kv_head, int num_kv_heads,
                                               int size_log2)
      : k_bytes(reinterpret_cast<const char*>(k_cache)),
        v_bytes(reinterpret_cast<const char*>(v_cache)),
        block_table(table),
        end_token(end),
        block_size_log2(size_log2),
        slot_mask((1u << size_log2) - 1),
        block_bytes((num_kv_heads << size_log2) << kRowBytesLog2),
        thread_bytes(uint32_t(((kv_head << size_log2) << kRowBytesLog2) + int(threadIdx.x) % kChunksPerRow * 16)),
        thread_dst(SwizzledOffset<kChunksPerRow>(int(threadIdx.x) / kChunksPerRow, int(threadIdx.x) % kChunksPerRow)) {}

  __device__ __forceinline__ void Prefetch(int first_token) {
    const int row0 = int(threadIdx.x) / kChunksPerRow;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int token = first_token + pass * kRowsPerPass + row0;
      const int32_t block = token < end_token ? block_table[token >> block_size_log2] : 0;
      block_offset[pass] = int64_t(block) * block_bytes;
    }
  }

  __device__ __forceinline__ void Issue(uint32_t k_tile, uint32_t v_tile, int first_token) const {
    const int row0 = int(threadIdx.x) / kChunksPerRow;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int token = first_token + pass * kRowsPerPass + row0;
      const int64_t offset = block_offset[pass] + (((uint32_t(token) & slot_mask) << kRowBytesLog2) + thread_bytes);
      const uint32_t dst = thread_dst + pass * kPassBytes;
      const bool valid = token < end_token;
      CpAsync16(k_tile + dst, k_bytes + offset, valid);
      CpAsync16(v_tile + dst, v_bytes + offset, valid);
    }
  }
};

// Whether one block of every KV head fits PagedKvTileLoader's 32-bit byte count.
inline bool KvBlockBytesFit(const PagedKvView& kv) {
  return int64_t(kv.num_kv_heads) * kv.block_size * kv.head_dim * int64_t(sizeof(__nv_bfloat16)) < (int64_t(1) << 31);
}

inline int Log2OfPowerOfTwo(int x) {
  int log2 = 0;
  while ((1 << log2) < x) ++log2;
  DUET_KERNEL_CHECK((1 << log2) == x);
  return log2;
}

}  // namespace duet::kernels::attention_detail
