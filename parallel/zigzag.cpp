#include "parallel/zigzag.h"

#include "common/check.h"

namespace duet::parallel {

std::vector<TokenChunk> ZigzagChunks(int64_t num_tokens, int size) {
  DUET_CHECK(size >= 1);
  DUET_CHECK(num_tokens >= 0);
  const int64_t num_chunks = 2 * static_cast<int64_t>(size);
  const int64_t base = num_tokens / num_chunks;
  const int64_t longer = num_tokens % num_chunks;  // the first `longer` chunks hold base + 1
  std::vector<TokenChunk> chunks;
  chunks.reserve(num_chunks);
  int64_t begin = 0;
  for (int64_t i = 0; i < num_chunks; ++i) {
    const int64_t end = begin + base + (i < longer ? 1 : 0);
    chunks.push_back({begin, end});
    begin = end;
  }
  return chunks;
}

std::array<int, 2> ChunksOfRank(int rank, int size) {
  DUET_CHECK(size >= 1);
  DUET_CHECK(rank >= 0 && rank < size);
  return {rank, 2 * size - 1 - rank};
}

std::array<TokenChunk, 2> RankChunks(int64_t num_tokens, int rank, int size) {
  const std::array<int, 2> which = ChunksOfRank(rank, size);
  const std::vector<TokenChunk> chunks = ZigzagChunks(num_tokens, size);
  return {chunks[which[0]], chunks[which[1]]};
}

std::vector<int64_t> RankPositions(int64_t num_tokens, int rank, int size) {
  std::vector<int64_t> positions;
  const std::array<TokenChunk, 2> chunks = RankChunks(num_tokens, rank, size);
  positions.reserve(chunks[0].size() + chunks[1].size());
  for (const TokenChunk& chunk : chunks) {
    for (int64_t p = chunk.begin; p < chunk.end; ++p) positions.push_back(p);
  }
  return positions;
}

}  // namespace duet::parallel
