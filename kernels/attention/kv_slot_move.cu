#include "kernels/attention/kv_slot_move.h"

#include "kernels/cuda_check.h"

namespace duet::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 128;
constexpr int kChunkElems = 8;  // 16 bytes per load
constexpr int kMaxChunksPerThread = kMaxKvSlotMoves * (kMaxHeadDim / kChunkElems) / kThreads;

// grid: x = pool (layer, K or V), y = KV head. Each CTA loads every move's row of its head into
// registers, synchronizes, then stores them.
__global__ void __launch_bounds__(kThreads) KvSlotMoveKernel(const KvSlotMoveParams p) {
  __nv_bfloat16* pool = p.pools + int64_t(blockIdx.x) * p.pool_elems;
  const int head = int(blockIdx.y);
  const int chunks_per_row = p.head_dim / kChunkElems;
  const int num_chunks = p.num_moves * chunks_per_row;
  auto row = [&](int32_t slot) {
    const int64_t block = slot / p.block_size, offset = slot % p.block_size;
    return pool + ((block * p.num_kv_heads + head) * p.block_size + offset) * p.head_dim;
  };
  uint4 data[kMaxChunksPerThread];
#pragma unroll
  for (int i = 0; i < kMaxChunksPerThread; ++i) {
    const int c = i * kThreads + int(threadIdx.x);
    if (c < num_chunks) {
      data[i] = reinterpret_cast<const uint4*>(row(p.from[c / chunks_per_row]))[c % chunks_per_row];
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kMaxChunksPerThread; ++i) {
    const int c = i * kThreads + int(threadIdx.x);
    if (c < num_chunks) reinterpret_cast<uint4*>(row(p.to[c / chunks_per_row]))[c % chunks_per_row] = data[i];
  }
}

}  // namespace

void MoveKvSlots(const KvSlotMoveParams& p, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.num_moves >= 0 && p.num_moves <= kMaxKvSlotMoves);
  DUET_KERNEL_CHECK(p.head_dim % kChunkElems == 0 && p.head_dim <= kMaxHeadDim);
  if (p.num_moves == 0 || p.num_pools == 0) return;
  KvSlotMoveKernel<<<dim3(p.num_pools, p.num_kv_heads), kThreads, 0, stream>>>(p);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
