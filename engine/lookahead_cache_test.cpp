#include "engine/lookahead_cache.h"

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
  NgramTrie local = cache.NewLocalTrie();
  // "a b c d e" three times, then "a b": the continuation is "c d e a b ...".
  std::vector<int32_t> seq;
  for (int i = 0; i < 3; ++i) for (int32_t t : {10, 11, 12, 13, 14}) seq.push_back(t);
  seq.push_back(10);
  seq.push_back(11);
  local.AddSequence(seq);
  DraftTree tree = cache.Propose(local, seq, 4);
  ExpectValidTree(tree);
  ASSERT_EQ(tree.size(), 4);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{12, 13, 14, 10}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0, 1, 2}));
}

TEST(LookaheadCacheTest, BranchesWhereHistoryDiverges) {
  LookaheadCache cache(LookaheadOptions{});
  NgramTrie local = cache.NewLocalTrie();
  // After "1 2": "3" twice, "4" once.
  std::vector<int32_t> seq = {1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2};
  local.AddSequence(seq);
  DraftTree tree = cache.Propose(local, seq, 8);
  ExpectValidTree(tree);
  int roots = 0;
  for (int32_t p : tree.parents) roots += p == -1;
  EXPECT_EQ(roots, 2);
  EXPECT_EQ(tree.tokens[0], 3);  // the more frequent branch first
  EXPECT_LE(tree.size(), 8);
}

TEST(LookaheadCacheTest, GlobalTrieDraftsForNewRequests) {
  LookaheadCache cache(LookaheadOptions{});
  cache.AddOutput(std::vector<int32_t>{5, 6, 7, 8, 9});
  NgramTrie local = cache.NewLocalTrie();
  std::vector<int32_t> prompt = {1, 5, 6};
  local.AddSequence(prompt);
  DraftTree tree = cache.Propose(local, prompt, 3);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_TRUE(cache.Propose(local, prompt, 0).empty());
  EXPECT_TRUE(cache.Propose(local, std::vector<int32_t>{42}, 3).empty());  // nothing matches
}

}  // namespace
}  // namespace duet
