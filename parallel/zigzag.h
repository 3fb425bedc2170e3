// Zigzag sharding of one prompt over the `size` ranks of a sequence-parallel prefill group.
//
// Under a causal mask, a query at position p attends to p + 1 keys, so the last tokens of a
// prompt cost the most. Cutting the prompt into `size` contiguous pieces would give the last rank
// the most work; zigzag cuts it into 2 * size chunks and gives rank r chunks r and 2*size-1-r, one
// cheap and one dear, so every rank does about the same work:
//
//   T = 16, size = 2:   chunks [0,4) [4,8) [8,12) [12,16)
//                       rank 0: [0,4) + [12,16)      rank 1: [4,8) + [8,12)
//
// The chunk rule: with T tokens and C = 2 * size chunks, every chunk holds T / C tokens and the
// first T % C chunks one more. When T is a multiple of C, every rank's causal work (the sum over
// its query positions p of p + 1) is exactly equal. When T < C, the last chunks are empty (a rank
// may hold no tokens at all); callers must allow empty chunks.
//
// A rank keeps its tokens in local order: chunk r, then chunk 2*size-1-r.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace duet::parallel {

// Prompt positions [begin, end).
struct TokenChunk {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const TokenChunk&) const = default;
};

// The 2 * size chunks of a prompt of `num_tokens` tokens, in prompt order (see the rule above).
// size >= 1, num_tokens >= 0.
std::vector<TokenChunk> ZigzagChunks(int64_t num_tokens, int size);

// The indices of the two chunks rank `rank` holds, in its local order: {rank, 2*size-1-rank}.
std::array<int, 2> ChunksOfRank(int rank, int size);

// The two chunks rank `rank` holds, in its local order.
std::array<TokenChunk, 2> RankChunks(int64_t num_tokens, int rank, int size);

// The prompt positions rank `rank` holds, in its local order (chunk rank, then chunk
// 2*size-1-rank); with size 1, every position in order.
std::vector<int64_t> RankPositions(int64_t num_tokens, int rank, int size);

}  // namespace duet::parallel
