// The work of zigzag ring attention over the `size` ranks of a sequence-parallel group, step by
// step, as calls of a varlen prefill-attention kernel (kernels/attention/prefill_attention.h:
// q_len, context_len, kv_len per sequence).
//
// Tokens sit in rank-major order: rank r's rows are [rank_rows[r], rank_rows[r + 1]), holding
// its zigzag chunks r and 2*size-1-r (parallel/zigzag.h) in that order. At step k every rank r
// holds the K/V block of rank (r - k) mod size (its own at step 0; the ring passes blocks on by
// one rank per step) and attends to it:
//
//   step 0, own block [a | b]:   chunk a causally (q_len |a|, context |a|), and chunk b over a
//                                and itself causally (q_len |b|, context |a| + |b|)
//   a block from a lower rank s: both chunks see the block's chunk s whole (chunk 2*size-1-s
//                                lies after both): q = a|b, kv_len |s|, context kv_len + q_len
//   a block from a higher rank:  chunk a sees nothing; chunk b sees the whole block (both of
//                                its chunks lie between a and b): q = b, kv_len the block's size
//
// Over all steps every (query, key) pair with key position <= query position is attended
// exactly once and no other pair (ring_schedule_test checks it), so merging the steps' partial
// results by the log-sum-exp rule gives causal attention over the whole prompt.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/zigzag.h"

namespace duet::parallel {

// One sequence of a step's attention call: queries rows [q_row, q_row + q_len) (rank-major
// order) against keys [0, kv_len) of the block the rank holds, the query i at key position
// context_len - q_len + i seeing keys up to it.
struct RingAttentionCall {
  int rank = 0;
  int source = 0;  // whose K/V block it is
  int64_t q_row = 0;
  int64_t q_len = 0;
  int64_t context_len = 0;
  int64_t kv_len = 0;
  bool operator==(const RingAttentionCall&) const = default;
};

struct RingAttentionSchedule {
  int size = 1;
  int64_t num_tokens = 0;
  std::vector<int64_t> rank_rows;                     // [size + 1] first row of each rank
  std::vector<std::vector<RingAttentionCall>> steps;  // [size]; calls of one step touch disjoint rows

  // The rank whose block rank `rank` holds at `step`.
  int SourceOf(int rank, int step) const { return ((rank - step) % size + size) % size; }
  // Prompt position of every row, rank-major (the zigzag order).
  std::vector<int64_t> RowPositions() const;
};

// size >= 1; num_tokens >= 2 * size (every chunk holds a token).
RingAttentionSchedule PlanRingAttention(int64_t num_tokens, int size);

}  // namespace duet::parallel
