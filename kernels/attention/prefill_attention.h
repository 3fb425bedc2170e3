// Prefill (and chunked-prefill) flash attention over the paged KV cache: packed variable-length
// queries, causal with a per-sequence offset, GQA. FA2-style: 64 query rows per CTA (16 per
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
  // Optional, [num_seqs]: the row of sequence s's first query in q and the outputs, so sequences
  // need not be packed (q_start still gives their lengths). Null: q_start[s].
  const int32_t* q_rows;
  const int32_t* context_lens;   // [num_seqs] tokens in cache incl. this step's
  // Optional tree attention (speculative verification), [num_q_tokens]: bit j of row i's mask
  // says whether query i of its sequence may see that sequence's query j (this step's key at
  // cache position context_len - q_len + j). Null: plain causal. Only the first 64 queries of
  // a sequence are masked; a causal row uses ~0.
  const uint64_t* tree_masks;
  // Optional, [num_seqs]: keys at cache positions >= kv_lens[s] do not exist for sequence s (a
  // query sees [0, min(its position, kv_lens[s] - 1)]). With context_lens[s] = kv_lens[s] + q_len
  // every query sees all kv_lens[s] keys: a ring-attention step over another rank's block.
  // Null: kv_lens = context_lens.
  const int32_t* kv_lens;
  __nv_bfloat16* out;            // [num_q_tokens, num_q_heads, kv.head_dim]; unused with `state`
  // Optional: write the attention state instead of `out`, for merging partial attention over
  // several key sets (ring attention):
  //   state_out [num_q_tokens, num_q_heads, kv.head_dim] fp32, normalized over this call's keys;
  //   state_lse [num_q_tokens, num_q_heads] fp32, natural log of sum(exp(scale * q.k)) over
  //             them (-inf where a row saw no key).
  // With merge_state, the rows this call covers are merged into the state already there by the
  // log-sum-exp rule; rows it does not cover are left as they are.
  float* state_out;
  float* state_lse;
  bool merge_state;
  int num_seqs, num_q_tokens, max_q_len, num_q_heads, max_blocks_per_seq;
  float scale;
};

// Query i of sequence s (q_len = q_start[s+1] - q_start[s]) sits at position
// context_lens[s] - q_len + i and attends to cache positions [0, that position] (with tree
// masks: minus this step's keys j < 64 whose bit in the row's mask is clear).
// max_q_len must bound every sequence's q_len (it sizes the grid).
void PrefillAttention(const PrefillAttentionParams& params, cudaStream_t stream);

// out[i] = bf16(state[i]) for i < n (n a multiple of 4): a merged attention state
// (PrefillAttentionParams::state_out) as the layer's attention output.
void AttentionStateToBf16(const float* state, int64_t n, __nv_bfloat16* out, cudaStream_t stream);

namespace internal {
// PrefillAttention with an explicit K/V tile of 32 or 64 keys, for the benchmark to compare.
void PrefillAttentionWithKeyTile(const PrefillAttentionParams& params, int key_tile, cudaStream_t stream);
}  // namespace internal

}  // namespace duet::kernels
