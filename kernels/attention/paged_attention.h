// Paged decode attention: one new query token per sequence against its paged KV cache.
//
// GQA-aware (each CTA serves up to 16 query heads of one KV head, so every KV block is read once
// for all of them), split-KV ("flash-decoding") with a log-sum-exp merge for long contexts and
// small batches, cp.async triple-buffered 64-token tiles, bf16 tensor-core math, fp32 softmax and
// accumulation. head_dim 64 or 128; block_size any power of two. One kernel: the last split of a
// sequence to finish merges the others' partial outputs. Launched with programmatic dependent
// launch (kernels/launch.cuh); K/V of all but each sequence's newest token may be read before the
// previous kernel (which writes the newest token's K/V) has finished.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_kv.h"

namespace duet::kernels {

struct PagedDecodeAttentionParams {
  const __nv_bfloat16* q;        // [num_seqs, num_q_heads, kv.head_dim] (one new token per sequence, RoPE applied)
  PagedKvView kv;                // the layer's cache (read only)
  const int32_t* block_tables;   // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens;   // [num_seqs] tokens in the cache incl. the new one (its K/V already written)
  __nv_bfloat16* out;            // [num_seqs, num_q_heads, kv.head_dim]
  int num_seqs, num_q_heads, max_blocks_per_seq;
  float scale;                   // usually 1/sqrt(head_dim)
  float* workspace;              // split-KV partial outputs + log-sum-exp; size from the plan
  int32_t* split_counters;       // split plans: plan.num_split_counters zeros (each launch leaves them zero)
};

// How a decode launch splits each sequence's context. Valid for every batch of at most the
// planned num_seqs whose context_lens are all <= the planned max_context_len (so the launch can
// be captured once in a CUDA graph): each sequence's context is spread evenly over the splits in
// whole 64-token tiles (a short context in a long plan still uses many CTAs), splits past its end
// exit at once and the merge reads only the splits it has. A sequence with context_len 0 gets zeros.
struct PagedDecodeAttentionPlan {
  int num_splits;          // CTAs along each sequence's context (1: no workspace, no merge)
  int tokens_per_split;    // the most tokens a split takes: a multiple of the 64-token tile
  size_t workspace_bytes;  // float partials [num_seqs, num_q_heads, num_splits, head_dim] + LSE
  int num_split_counters;  // int32 counters [num_seqs, CTAs per sequence] the split merge needs (0 without splits)
};

PagedDecodeAttentionPlan PlanPagedDecodeAttention(int num_seqs, int num_q_heads, int num_kv_heads, int head_dim,
                                                  int max_context_len, int num_sms);

// Enqueues the attention (and, for num_splits > 1, the merge) on `stream`. Aborts on arguments
// that break the contract above (unsupported head_dim, block_size not a power of two, missing
// workspace); a context_len beyond the plan traps the kernel.
void PagedDecodeAttention(const PagedDecodeAttentionParams& params, const PagedDecodeAttentionPlan& plan,
                          cudaStream_t stream);

}  // namespace duet::kernels
