#include "engine/ngram_trie.h"

#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(NgramTrieTest, CountsEveryNgramOnce) {
  NgramTrie trie(3, 1000);
  const std::vector<int32_t> seq = {1, 2, 3, 1, 2, 4};
  trie.AddSequence(seq);
  EXPECT_EQ(trie.Count(trie.Find(std::vector<int32_t>{1})), 2);
  EXPECT_EQ(trie.Count(trie.Find(std::vector<int32_t>{1, 2})), 2);
  EXPECT_EQ(trie.Count(trie.Find(std::vector<int32_t>{1, 2, 3})), 1);
  EXPECT_EQ(trie.Count(trie.Find(std::vector<int32_t>{1, 2, 4})), 1);
  EXPECT_EQ(trie.Find(std::vector<int32_t>{2, 1}), NgramTrie::kNoNode);
  EXPECT_EQ(trie.Find(std::vector<int32_t>{3, 1, 2, 4}), NgramTrie::kNoNode);  // longer than max_ngram
  // Continuations of "1 2" with their frequencies.
  const int32_t node = trie.Find(std::vector<int32_t>{1, 2});
  EXPECT_EQ(trie.Children(node).size(), 2u);
  EXPECT_EQ(trie.ChildCount(node), 2);
}

TEST(NgramTrieTest, IncrementalEqualsWhole) {
  const std::vector<int32_t> seq = {5, 6, 5, 6, 5, 7, 5, 6};
  NgramTrie whole(4, 1000), incremental(4, 1000);
  whole.AddSequence(seq);
  for (size_t n = 1; n <= seq.size(); ++n) incremental.AddLastToken(absl::MakeConstSpan(seq.data(), n));
  EXPECT_EQ(whole.num_nodes(), incremental.num_nodes());
  for (size_t i = 0; i + 2 <= seq.size(); ++i) {
    absl::Span<const int32_t> gram(seq.data() + i, 2);
    EXPECT_EQ(whole.Count(whole.Find(gram)), incremental.Count(incremental.Find(gram)));
  }
}

// Appending token by token (the decode path) counts what a walk from the root per n-gram does,
// for every n-gram length up to max_ngram.
TEST(NgramTrieTest, AppendTokenEqualsAddLastToken) {
  const std::vector<int32_t> seq = {5, 6, 5, 6, 5, 7, 5, 6, 8, 5, 6, 5, 7, 7, 7};
  NgramTrie walked(4, 1000), appended(4, 1000);
  EXPECT_FALSE(appended.AppendToken(5));  // no earlier call to continue
  for (size_t n = 1; n <= seq.size(); ++n) walked.AddLastToken(absl::MakeConstSpan(seq.data(), n));
  appended.AddSequence(absl::MakeConstSpan(seq.data(), 3));
  for (size_t i = 3; i < seq.size(); ++i) EXPECT_TRUE(appended.AppendToken(seq[i]));
  EXPECT_EQ(walked.num_nodes(), appended.num_nodes());
  for (size_t len = 1; len <= 4; ++len) {
    for (size_t i = 0; i + len <= seq.size(); ++i) {
      absl::Span<const int32_t> gram(seq.data() + i, len);
      EXPECT_EQ(walked.Count(walked.Find(gram)), appended.Count(appended.Find(gram))) << "n-gram at " << i << " of " << len;
    }
  }
}

TEST(NgramTrieTest, EvictionBoundsMemoryAndKeepsFrequentNgrams) {
  NgramTrie trie(4, 200);
  std::vector<int32_t> seq;
  for (int i = 0; i < 2000; ++i) {
    seq.push_back(i % 3 == 0 ? 7 : 1000 + i);  // token 7 is frequent, the others unique
    trie.AddLastToken(seq);
    ASSERT_LE(trie.num_nodes(), 200);
  }
  EXPECT_NE(trie.Find(std::vector<int32_t>{7}), NgramTrie::kNoNode);
  EXPECT_EQ(trie.Find(std::vector<int32_t>{1001}), NgramTrie::kNoNode);
}

}  // namespace
}  // namespace duet
