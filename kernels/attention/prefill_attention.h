// Prefill (and chunked-prefill) flash attention over the paged KV cache: packed variable-length
// queries, causal with a per-sequence offset, GQA. FA2-style: 128 query rows per CTA (32 per
// warp), 32-key K/V tiles in a 3-stage cp.async pipeline straight from the paged cache, bf16
// tensor-core MMA (mma.sync m16n8k16, ldmatrix), online softmax in fp32, causal tile skipping.
// head_dim 64 or 128; block_size any power of two.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_kv.h"

namespace duet::kernels {

struct PrefillAttentionParams {
  const __nv_bfloat16* q;        // [num_q_tokens, num_q_heads, kv.head_dim] (packed varlen, RoPE applied)
  PagedKvView kv;                // the layer's cache, this step's K/V already written (read only)
  const int32_t* block_tables;   // [num_seqs, max_blocks_per_seq]
  const int32_t* q_start;        // [num_seqs + 1] prefix sums of query tokens per sequence
  const int32_t* context_lens;   // [num_seqs] tokens in cache incl. this step's
  // Optional tree attention (speculative verification), [num_q_tokens]: bit j of row i's mask
  // says whether query i of its sequence may see that sequence's query j (this step's key at
  // cache position context_len - q_len + j). Null: plain causal. Only the first 64 queries of
  // a sequence are masked; a causal row uses ~0.
  const uint64_t* tree_masks;
  __nv_bfloat16* out;            // [num_q_tokens, num_q_heads, kv.head_dim]
  int num_seqs, num_q_tokens, max_q_len, num_q_heads, max_blocks_per_seq;
  float scale;
};

// Query i of sequence s (q_len = q_start[s+1] - q_start[s]) sits at position
// context_lens[s] - q_len + i and attends to cache positions [0, that position] (with tree
// masks: minus this step's keys j < 64 whose bit in the row's mask is clear).
// max_q_len must bound every sequence's q_len (it sizes the grid).
void PrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);

namespace internal {
// PrefillAttention with an explicit K/V tile of 32 or 64 keys, for the benchmark to compare.
void PrefillAttentionWithKeyTile(const PrefillAttentionParams& params, int key_tile, cudaStream_t stream);
}  // namespace internal

}  // namespace duet::kernels
