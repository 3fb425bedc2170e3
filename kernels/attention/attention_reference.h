// CPU references for the attention kernels: plain softmax(q.k * scale) . v with double
// accumulation, reading K/V through the same paged layout and block tables as the kernels.
// Inputs are floats that the tests have already rounded to bf16, so the reference sees exactly
// the values the kernel sees.
#pragma once

#include <cstdint>
#include <vector>

namespace duet::kernels::reference {

// A paged KV cache of one layer: k and v are [num_blocks, num_kv_heads, block_size, head_dim].
struct PagedKv {
  const std::vector<float>& k;
  const std::vector<float>& v;
  const std::vector<int32_t>& block_tables;  // [num_seqs, max_blocks_per_seq]
  int num_kv_heads, head_dim, block_size, max_blocks_per_seq;
};

// q: [num_seqs, num_q_heads, head_dim], one query per sequence at position context_lens[s] - 1.
// Returns [num_seqs, num_q_heads, head_dim]; a sequence with context_len 0 gets zeros.
std::vector<float> PagedDecodeAttention(const std::vector<float>& q, const PagedKv& kv,
                                        const std::vector<int32_t>& context_lens, int num_q_heads, float scale);

// q: [num_q_tokens, num_q_heads, head_dim], packed by q_start ([num_seqs + 1]); query i of
// sequence s sits at position context_lens[s] - q_len + i and sees positions [0, that position]
// (with `tree_masks`, [num_q_tokens] or empty, as PrefillAttentionParams::tree_masks says).
// Returns [num_q_tokens, num_q_heads, head_dim].
std::vector<float> PrefillAttention(const std::vector<float>& q, const PagedKv& kv, const std::vector<int32_t>& q_start,
                                    const std::vector<int32_t>& context_lens, int num_q_heads, float scale,
                                    const std::vector<uint64_t>& tree_masks = {});

// PrefillAttention without tree masks, limited to cache positions below kv_lens[s], also giving
// each row's log-sum-exp `lse` ([num_q_tokens, num_q_heads], -inf where a row sees no key): the
// attention state of PrefillAttentionParams::state_out / state_lse.
std::vector<float> PrefillAttentionState(const std::vector<float>& q, const PagedKv& kv,
                                         const std::vector<int32_t>& q_start, const std::vector<int32_t>& context_lens,
                                         const std::vector<int32_t>& kv_lens, int num_q_heads, float scale,
                                         std::vector<float>& lse);

}  // namespace duet::kernels::reference
