// Moves single tokens' K/V between slots of the paged cache in every layer: after speculative
// verification, the accepted path of a draft tree moves to the slots right after the context.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_kv.h"

namespace duet::kernels {

inline constexpr int kMaxKvSlotMoves = 64;  // per launch (the moves travel in the parameters)

struct KvSlotMoveParams {
  // Every layer's cache: layer i's is first_layer with both pools advanced by i * layer_stride
  // elements.
  PagedKvView first_layer;
  int64_t layer_stride;
  int num_layers;
  int num_moves;  // <= kMaxKvSlotMoves
  // Slots as in PagedKvView.
  int32_t from[kMaxKvSlotMoves];
  int32_t to[kMaxKvSlotMoves];
};

// Every move reads its source before any move of the launch writes, so the result equals
// applying the moves in order whenever no move reads a slot an earlier one wrote (the contract
// of ModelExecutor::MoveKvSlots). head_dim a multiple of 8, at most 128.
void MoveKvSlots(const KvSlotMoveParams& params, cudaStream_t stream);

}  // namespace duet::kernels
