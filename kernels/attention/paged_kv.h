// The paged KV cache as every kernel that reads or writes it sees it (decode and prefill
// attention, RoPE's and the fused projection's KV write, slot moves). One layer holds a K and a V
// pool of bf16, each laid out
//
//     [num_blocks, num_kv_heads, block_size, head_dim]   (row-major)
//
// and a token's slot is block_id * block_size + its offset in the block, so the head_dim
// elements of (slot, kv_head) are contiguous and a block's rows of one head are too.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace duet::kernels {

struct PagedKvView {
  __nv_bfloat16* k;  // [num_blocks, num_kv_heads, block_size, head_dim]
  __nv_bfloat16* v;  // same
  int num_kv_heads, block_size, head_dim;

  // Element offset of (slot, kv_head)'s head_dim elements in either pool.
  __host__ __device__ __forceinline__ int64_t RowOffset(int32_t slot, int kv_head) const {
    const int block = slot / block_size, in_block = slot % block_size;
    return ((int64_t(block) * num_kv_heads + kv_head) * block_size + in_block) * head_dim;
  }
};

}  // namespace duet::kernels
