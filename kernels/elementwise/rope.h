// Rotary position embedding on the fused QKV projection, writing k and v into the paged KV cache.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_kv.h"

namespace duet::kernels {

// Rotary embedding (HF "rotate_half" layout: pairs (i, i + head_dim/2)) applied to q and k of a
// fused QKV projection, with k and v written into one layer's paged cache. Computed in fp32 from
// the bf16 inputs, rounded once to bf16. head_dim must be a multiple of 8; every position must be
// below the table's max_positions; pointers 16-byte aligned.
struct RopeKvWriteParams {
  // [num_tokens, (num_q_heads + 2 * kv.num_kv_heads) * kv.head_dim]: q heads, then k heads, then v heads
  const __nv_bfloat16* qkv;
  const int32_t* positions;      // [num_tokens]
  const int32_t* slot_mapping;   // [num_tokens]: the token's slot in kv; negative = do not write
  const float2* rope_table;      // [max_positions, head_dim/2]: (cos, sin) of position * inv_freq[i]
  __nv_bfloat16* q_out;          // [num_tokens, num_q_heads, kv.head_dim]
  PagedKvView kv;                // the layer's cache (its head_dim and num_kv_heads are the qkv's too)
  int num_tokens, num_q_heads;
};
void RopeAndWriteKv(const RopeKvWriteParams&, cudaStream_t);

// Host helper: the (cos, sin) table from per-pair inverse frequencies (llama3 scaling already
// applied by the caller); angle computed as float(position) * inv_freq[i] in fp32 like HF.
// Returns [max_positions, inv_freq.size()] row-major.
std::vector<float2> BuildRopeTable(const std::vector<float>& inv_freq, int max_positions);

}  // namespace duet::kernels
