#include "engine/speculation/ngram_index.h"

#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(MatchSuffixTest, FindsTheLongestSuffixNewestFirst) {
  // Suffix "7 1 2": "1 2" occurs at 0-1, 4-5 and 8-9, "7 1 2" only at 7-9.
  const std::vector<int32_t> prompt = {1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 4}, output = {7, 1, 2};
  std::vector<int64_t> positions;
  EXPECT_EQ(MatchSuffix({prompt, output}, 4, 1 << 10, 8, positions), 3);
  EXPECT_EQ(positions, (std::vector<int64_t>{9}));
  // Limited to two tokens: every "1 2" before the end, newest first.
  EXPECT_EQ(MatchSuffix({prompt, output}, 2, 1 << 10, 8, positions), 2);
  EXPECT_EQ(positions, (std::vector<int64_t>{9, 5, 1}));
  EXPECT_EQ(MatchSuffix({prompt, output}, 2, 1 << 10, 2, positions), 2);
  EXPECT_EQ(positions, (std::vector<int64_t>{9, 5}));  // at most max_positions
}

TEST(MatchSuffixTest, LooksBackAtMostMaxScanTokens) {
  const std::vector<int32_t> text = {5, 6, 0, 0, 0, 0, 5, 6};
  std::vector<int64_t> positions;
  EXPECT_EQ(MatchSuffix({text, {}}, 4, 3, 8, positions), 0);
  EXPECT_TRUE(positions.empty());
  EXPECT_EQ(MatchSuffix({text, {}}, 4, 7, 8, positions), 2);
  EXPECT_EQ(positions, (std::vector<int64_t>{1}));
}

TEST(MatchSuffixTest, NothingBeforeTheEnd) {
  std::vector<int64_t> positions;
  EXPECT_EQ(MatchSuffix({std::vector<int32_t>{1, 2, 3}, {}}, 4, 100, 8, positions), 0);
  EXPECT_EQ(MatchSuffix({std::vector<int32_t>{1}, {}}, 4, 100, 8, positions), 0);
  EXPECT_TRUE(positions.empty());
}

TEST(OutputNgramIndexTest, MatchesAcrossOutputsButNeverRunsIntoTheNext) {
  OutputNgramIndex index(64);
  index.Add(std::vector<int32_t>{1, 2, 3, 4});
  index.Add(std::vector<int32_t>{9, 2, 3, 5});
  index.Add(std::vector<int32_t>{7, 2, 3});  // ends with "2 3": no token after it
  std::vector<int64_t> positions;
  // "1 2 3" matches three tokens in the first output only; "2 3" matches both earlier outputs.
  EXPECT_EQ(index.Match(std::vector<int32_t>{1, 2, 3}, 4, 8, positions), 3);
  ASSERT_EQ(positions.size(), 1u);
  EXPECT_EQ(index.Next(positions[0]), 4);
  EXPECT_EQ(index.Next(positions[0] + 1), -1);  // the output ended
  EXPECT_EQ(index.Match(std::vector<int32_t>{8, 2, 3}, 4, 8, positions), 2);
  ASSERT_EQ(positions.size(), 2u);
  EXPECT_EQ(index.Next(positions[0]), 5);  // newest first
  EXPECT_EQ(index.Next(positions[1]), 4);
  EXPECT_EQ(index.Match(std::vector<int32_t>{3}, 4, 8, positions), 0);  // one token is not enough
  EXPECT_EQ(index.Match(std::vector<int32_t>{4, 9}, 4, 8, positions), 0);  // across outputs
}

TEST(OutputNgramIndexTest, TheRingEvictsTheOldestAndBoundsItsKeys) {
  OutputNgramIndex index(16);
  index.Add(std::vector<int32_t>{100, 101, 102});
  std::vector<int64_t> positions;
  EXPECT_EQ(index.Match(std::vector<int32_t>{100, 101}, 4, 8, positions), 2);
  for (int32_t i = 0; i < 200; ++i) index.Add(std::vector<int32_t>{i, i + 1, i + 2});
  EXPECT_EQ(index.Match(std::vector<int32_t>{100, 101}, 4, 8, positions), 0);  // evicted
  EXPECT_EQ(index.Match(std::vector<int32_t>{198, 199}, 4, 8, positions), 2);  // recent
  EXPECT_EQ(index.num_tokens(), 16);
  EXPECT_LE(index.num_keys(), 2 * 16);
}

}  // namespace
}  // namespace duet
