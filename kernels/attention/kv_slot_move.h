// Moves single tokens' K/V between slots of the paged cache in every layer: after speculative
// verification, the accepted path of a draft tree moves to the slots right after the context.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

inline constexpr int kMaxKvSlotMoves = 64;  // per launch (the moves travel in the parameters)

struct KvSlotMoveParams {
  // num_pools pools of [num_blocks, num_kv_heads, block_size, head_dim] bf16, pool_elems apart
  // (the cache's per-layer K and V pools).
  __nv_bfloat16* pools;
  int64_t pool_elems;
  int num_pools, num_kv_heads, block_size, head_dim;
  int num_moves;  // <= kMaxKvSlotMoves
  // Slots are block_id * block_size + offset in the block.
  int32_t from[kMaxKvSlotMoves];
  int32_t to[kMaxKvSlotMoves];
};

// Every move reads its source before any move of the launch writes, so the result equals
// applying the moves in order whenever no move reads a slot an earlier one wrote (the contract
// of ModelExecutor::MoveKvSlots). head_dim a multiple of 8, at most 128.
void MoveKvSlots(const KvSlotMoveParams& params, cudaStream_t stream);

}  // namespace duet::kernels
