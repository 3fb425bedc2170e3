#include "kernels/attention/kv_slot_move.h"

#include "kernels/cuda_check.h"

namespace duet::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 128;
constexpr int kChunkElems = 8;  // 16 bytes per load
constexpr int kMaxChunksPerThread = kMaxKvSlotMoves * (kMaxHeadDim / kChunkElems) / kThreads;

// grid: x = pool (layer * 2 + 0 for K, 1 for V), y = KV head. Each CTA loads every move's row of
// its head into registers, synchronizes, then stores them.
__global__ void __launch_bounds__(kThreads) KvSlotMoveKernel(const KvSlotMoveParams p) {
  const PagedKvView& kv = p.first_layer;
  __nv_bfloat16* pool = (blockIdx.x % 2 == 0 ? kv.k : kv.v) + int64_t(blockIdx.x / 2) * p.layer_stride;
  const int head = int(blockIdx.y);
  const int chunks_per_row = kv.head_dim / kChunkElems;
  const int num_chunks = p.num_moves * chunks_per_row;
  auto row = [&](int32_t slot) { return pool + kv.RowOffset(slot, head); };
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
  DUET_KERNEL_CHECK(p.first_layer.head_dim % kChunkElems == 0 && p.first_layer.head_dim <= kMaxHeadDim);
  if (p.num_moves == 0 || p.num_layers == 0) return;
  KvSlotMoveKernel<<<dim3(2 * p.num_layers, p.first_layer.num_kv_heads), kThreads, 0, stream>>>(p);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
