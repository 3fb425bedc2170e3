#include "parallel/zigzag.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet::parallel {
namespace {

using ::testing::ElementsAre;

// The causal attention work of a rank: each query at position p sees p + 1 keys.
int64_t CausalWork(const std::vector<int64_t>& positions) {
  int64_t work = 0;
  for (int64_t p : positions) work += p + 1;
  return work;
}

TEST(ZigzagTest, ChunksOfTheExample) {
  EXPECT_THAT(ZigzagChunks(16, 2), ElementsAre(TokenChunk{0, 4}, TokenChunk{4, 8},
                                                TokenChunk{8, 12}, TokenChunk{12, 16}));
  EXPECT_THAT(RankPositions(16, 0, 2),
              ElementsAre(0, 1, 2, 3, 12, 13, 14, 15));
  EXPECT_THAT(RankPositions(16, 1, 2), ElementsAre(4, 5, 6, 7, 8, 9, 10, 11));
}

TEST(ZigzagTest, ChunkOfRank) {
  EXPECT_THAT(ChunksOfRank(0, 1), ElementsAre(0, 1));
  EXPECT_THAT(ChunksOfRank(0, 4), ElementsAre(0, 7));
  EXPECT_THAT(ChunksOfRank(1, 4), ElementsAre(1, 6));
  EXPECT_THAT(ChunksOfRank(3, 4), ElementsAre(3, 4));
}

TEST(ZigzagTest, FirstChunksTakeTheRemainder) {
  // 11 tokens in 6 chunks: 11 = 6 * 1 + 5, so the first five chunks hold 2.
  EXPECT_THAT(ZigzagChunks(11, 3),
              ElementsAre(TokenChunk{0, 2}, TokenChunk{2, 4}, TokenChunk{4, 6}, TokenChunk{6, 8},
                          TokenChunk{8, 10}, TokenChunk{10, 11}));
}

TEST(ZigzagTest, ChunksTileThePromptAndDifferByAtMostOne) {
  for (int size = 1; size <= 8; ++size) {
    for (int64_t tokens = 0; tokens <= 70; ++tokens) {
      const std::vector<TokenChunk> chunks = ZigzagChunks(tokens, size);
      ASSERT_EQ(chunks.size(), 2u * size);
      int64_t next = 0;
      for (size_t i = 0; i < chunks.size(); ++i) {
        EXPECT_EQ(chunks[i].begin, next) << tokens << " tokens, size " << size;
        EXPECT_GE(chunks[i].size(), 0);
        next = chunks[i].end;
        // Sizes never grow along the prompt, and span at most one token.
        if (i > 0) {
          EXPECT_LE(chunks[i].size(), chunks[i - 1].size());
        }
        EXPECT_LE(chunks.front().size() - chunks[i].size(), 1);
      }
      EXPECT_EQ(next, tokens);
    }
  }
}

TEST(ZigzagTest, EveryPositionOnExactlyOneRank) {
  for (int size = 1; size <= 8; ++size) {
    for (int64_t tokens : {0, 1, 5, 15, 16, 17, 63, 64, 100, 1001}) {
      std::vector<int> owners(tokens, 0);
      for (int rank = 0; rank < size; ++rank) {
        const std::vector<int64_t> positions = RankPositions(tokens, rank, size);
        // Local order: each of the two chunks ascends, and the second lies after the first.
        EXPECT_TRUE(std::is_sorted(positions.begin(), positions.end()));
        for (int64_t p : positions) {
          ASSERT_GE(p, 0);
          ASSERT_LT(p, tokens);
          ++owners[p];
        }
      }
      EXPECT_EQ(std::count(owners.begin(), owners.end(), 1), tokens)
          << tokens << " tokens, size " << size;
    }
  }
}

TEST(ZigzagTest, SizeOneHoldsThePromptInOrder) {
  std::vector<int64_t> all(9);
  for (int64_t p = 0; p < 9; ++p) all[p] = p;
  EXPECT_EQ(RankPositions(9, 0, 1), all);
}

TEST(ZigzagTest, CausalWorkIsEqualWhenChunksAreEqual) {
  for (int size = 1; size <= 8; ++size) {
    for (int64_t chunk : {1, 2, 7, 64, 1000}) {
      const int64_t tokens = 2 * size * chunk;
      const int64_t work0 = CausalWork(RankPositions(tokens, 0, size));
      for (int rank = 1; rank < size; ++rank) {
        EXPECT_EQ(CausalWork(RankPositions(tokens, rank, size)), work0)
            << tokens << " tokens, rank " << rank << " of " << size;
      }
    }
  }
}

TEST(ZigzagTest, CausalWorkNearlyEqualOtherwise) {
  // With a remainder, chunk sizes differ by one token, and the spread of causal work across
  // ranks stays within 2 * tokens (at most ~1.5 * tokens seen for tokens < 3000, size <= 8): one
  // or two queries' worth, small next to a rank's ~tokens^2 / (2 * size).
  for (int size = 2; size <= 8; ++size) {
    for (int64_t tokens = 2 * size; tokens <= 300; ++tokens) {
      int64_t least = INT64_MAX;
      int64_t most = 0;
      for (int rank = 0; rank < size; ++rank) {
        const int64_t work = CausalWork(RankPositions(tokens, rank, size));
        least = std::min(least, work);
        most = std::max(most, work);
      }
      EXPECT_LE(most - least, 2 * tokens) << tokens << " tokens, size " << size;
    }
  }
}

TEST(ZigzagTest, FewerTokensThanChunksLeavesTrailingChunksEmpty) {
  // 3 tokens over 4 ranks: chunks 0..2 hold one token each, chunks 3..7 none.
  const std::vector<TokenChunk> chunks = ZigzagChunks(3, 4);
  ASSERT_EQ(chunks.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(chunks[i].size(), i < 3 ? 1 : 0) << "chunk " << i;
  }
  EXPECT_THAT(RankPositions(3, 0, 4), ElementsAre(0));
  EXPECT_THAT(RankPositions(3, 2, 4), ElementsAre(2));
  EXPECT_TRUE(RankPositions(3, 3, 4).empty());
  EXPECT_TRUE(RankPositions(0, 0, 1).empty());
}

}  // namespace
}  // namespace duet::parallel
