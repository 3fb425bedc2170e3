// Ring attention on the CPU: one rank's causal attention over a sequence-parallel group, its
// queries against every rank's keys and values without any rank holding them all at once.
//
// Each rank holds a shard of one prompt (zigzag: parallel/zigzag.h), i.e. a set of absolute
// positions, and its K/V [n_local, num_kv_heads, head_dim]. The ranks pass K/V blocks around
// the ring: at step s a rank attends its queries to the block it holds (its own at step 0, the
// block of rank - s after s exchanges) while the next block travels (double-buffered), masking
// causally by absolute position; the partial result of each block — output and log-sum-exp per
// (query, head) — merges into the running one with the log-sum-exp rule, in float32.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "parallel/communicator.h"

namespace duet {

struct AttentionShape {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // divides num_heads (grouped-query attention)
  int64_t head_dim = 0;
  float scale = 1.0f;        // usually 1 / sqrt(head_dim)
};

// One (query, head)'s attention over some keys: out = Σ softmax(s)·v over those keys and
// lse = log Σ exp(s), s = scale · q·k. No keys: lse = -inf and out = 0.
struct PartialAttention {
  std::vector<float> out;  // [num_queries, num_heads, head_dim]
  std::vector<float> lse;  // [num_queries, num_heads]
};

// Attention of `q` [nq, num_heads, head_dim] at `q_positions` to the keys/values `k`, `v`
// [nk, num_kv_heads, head_dim] at `k_positions` that are at or before each query's position.
PartialAttention AttendCausalBlock(const AttentionShape& shape, std::span<const float> q,
                                   std::span<const int64_t> q_positions, std::span<const float> k,
                                   std::span<const float> v, std::span<const int64_t> k_positions);

// acc := the attention over the union of acc's keys and part's keys (disjoint sets), by the
// log-sum-exp rule: lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse)·out_a + e^(lse_b - lse)·out_b.
void MergePartialAttention(const AttentionShape& shape, const PartialAttention& part, PartialAttention& acc);

// This rank's causal attention over the whole group's keys: `out` [n_local, num_heads,
// head_dim]. Every rank calls it with its own shard (sizes may differ by a few tokens); `comm`
// carries the ring.
absl::Status RingAttention(const AttentionShape& shape, std::span<const float> q, std::span<const float> k,
                           std::span<const float> v, std::span<const int64_t> positions,
                           parallel::Communicator& comm, std::span<float> out);

}  // namespace duet
