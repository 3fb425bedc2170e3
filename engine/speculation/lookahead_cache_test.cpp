#include "engine/speculation/lookahead_cache.h"

#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

void ExpectValidTree(const DraftTree& tree) {
  ASSERT_EQ(tree.tokens.size(), tree.parents.size());
  for (int32_t i = 0; i < tree.size(); ++i) {
    EXPECT_GE(tree.parents[size_t(i)], -1);
    EXPECT_LT(tree.parents[size_t(i)], i);
  }
}

TEST(LookaheadCacheTest, ProposesTheRepeatedContinuationFirst) {
  LookaheadCache cache(LookaheadOptions{});
  // "a b c d e" three times, then "a b": the continuation is "c d e a b ...".
  std::vector<int32_t> seq;
  for (int i = 0; i < 3; ++i) for (int32_t t : {10, 11, 12, 13, 14}) seq.push_back(t);
  seq.push_back(10);
  seq.push_back(11);
  DraftTree tree = cache.Propose({seq, {}}, 4);
  ExpectValidTree(tree);
  ASSERT_EQ(tree.size(), 4);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{12, 13, 14, 10}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0, 1, 2}));
}

TEST(LookaheadCacheTest, BranchesWhereHistoryDiverges) {
  LookaheadCache cache(LookaheadOptions{});
  // After "1 2": "3" twice, "4" once.
  std::vector<int32_t> seq = {1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2};
  DraftTree tree = cache.Propose({seq, {}}, 8);
  ExpectValidTree(tree);
  int roots = 0;
  for (int32_t p : tree.parents) roots += p == -1;
  EXPECT_EQ(roots, 2);
  EXPECT_EQ(tree.tokens[0], 3);  // the more frequent branch first
  EXPECT_LE(tree.size(), 8);
}

TEST(LookaheadCacheTest, OtherOutputsDraftForNewRequests) {
  LookaheadCache cache(LookaheadOptions{});
  const std::vector<int32_t> prompt = {1, 5, 6};
  cache.AddOutput(std::vector<int32_t>{5, 6, 7, 8, 9});
  EXPECT_TRUE(cache.Propose({prompt, {}}, 3).empty());  // queued, not indexed yet
  EXPECT_FALSE(cache.IndexQueued(100));
  DraftTree tree = cache.Propose({prompt, {}}, 3);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0, 1}));
  EXPECT_TRUE(cache.Propose({prompt, {}}, 0).empty());
  EXPECT_TRUE(cache.Propose({std::vector<int32_t>{1, 42}, {}}, 3).empty());  // nothing matches
}

TEST(LookaheadCacheTest, OwnTextOutweighsOtherOutputs) {
  LookaheadCache cache(LookaheadOptions{});
  for (int i = 0; i < 3; ++i) cache.AddOutput(std::vector<int32_t>{3, 4, 20});
  cache.IndexQueued(1 << 10);
  // The request's prompt continued "3 4" with 30 once; three other outputs with 20.
  const std::vector<int32_t> prompt = {3, 4, 30, 3}, output = {4};
  // 30 takes 0.7 of the mass against 20's 0.3, and its path (to the end of the text) stays ahead.
  DraftTree tree = cache.Propose({prompt, output}, 4);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{30, 3, 4, 20}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0, 1, -1}));
}

TEST(LookaheadCacheTest, QueuedOutputsAreIndexedInSlicesAndBounded) {
  LookaheadOptions options;
  options.max_queued_tokens = 8;
  LookaheadCache cache(options);
  cache.AddOutput(std::vector<int32_t>{1, 2, 3, 4, 5});
  cache.AddOutput(std::vector<int32_t>{6, 7, 8, 9, 10});
  cache.AddOutput(std::vector<int32_t>{11, 12, 13, 14, 15});  // past the bound: the second goes
  EXPECT_TRUE(cache.IndexQueued(2));
  EXPECT_EQ(cache.global_index().num_tokens(), 2);
  EXPECT_FALSE(cache.IndexQueued(100));
  EXPECT_FALSE(cache.has_queued());
  EXPECT_EQ(cache.global_index().num_tokens(), 12);  // two outputs and their separators
  EXPECT_TRUE(cache.Propose({std::vector<int32_t>{6, 7}, {}}, 2).empty());
  EXPECT_EQ(cache.Propose({std::vector<int32_t>{1, 2}, {}}, 2).tokens, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(cache.Propose({std::vector<int32_t>{11, 12}, {}}, 2).tokens, (std::vector<int32_t>{13, 14}));
}

}  // namespace
}  // namespace duet
