#include "router/prefix_index.h"

#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "router/worker_registry.h"

namespace duet::router {
namespace {

constexpr int64_t kBlockSize = 4;

// Tokens first, first+1, ... (`count` of them).
std::vector<int32_t> Tokens(int32_t first, int count) {
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

std::vector<BlockHash> Chain(const std::vector<int32_t>& tokens, std::string_view salt = "") {
  return FullBlockHashes(PrefixSeed("tiny", salt), tokens, kBlockSize);
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Workers at addresses nothing listens on (the registry is never started): only their identity
// matters to the index.
class PrefixIndexTest : public ::testing::Test {
 protected:
  PrefixIndexTest() : registry_({"127.0.0.1:1", "127.0.0.1:2"}, {"127.0.0.1:3"}) {}
  const Worker* worker(int i) { return registry_.prefill_workers()[size_t(i)]; }

  WorkerRegistry registry_;
  PrefixIndex index_;
};

TEST(BlockHashChainTest, HashesFullBlocksOncePerBlockSize) {
  const std::vector<int32_t> tokens = Tokens(1, 10);
  BlockHashChain chain(PrefixSeed("tiny", ""), tokens);
  const absl::Span<const BlockHash> four = chain.ForBlockSize(4);
  EXPECT_EQ(std::vector<BlockHash>(four.begin(), four.end()), FullBlockHashes(PrefixSeed("tiny", ""), tokens, 4));
  EXPECT_EQ(four.size(), 2u);  // the partial third block has no hash
  EXPECT_EQ(chain.ForBlockSize(4).data(), four.data());  // computed once
  EXPECT_EQ(chain.ForBlockSize(3).size(), 3u);
  EXPECT_EQ(chain.ForBlockSize(16).size(), 0u);
}

TEST_F(PrefixIndexTest, MatchesTheLongestInsertedPrefix) {
  const std::vector<int32_t> prompt = Tokens(1, 16);  // 4 blocks
  EXPECT_EQ(index_.Insert(worker(0), Chain(prompt), 100), 0);
  EXPECT_EQ(index_.Match(worker(0), Chain(prompt)), 4);
  // The same first 9 tokens, then other ones: the first two blocks match, the third diverges.
  EXPECT_EQ(index_.Match(worker(0), Chain(Concat(Tokens(1, 9), Tokens(500, 7)))), 2);
  // A longer prompt that extends it (the next chat turn): its first 4 blocks match.
  EXPECT_EQ(index_.Match(worker(0), Chain(Concat(prompt, Tokens(900, 12)))), 4);
  // A prompt whose first block differs matches nothing, even where later tokens agree (the hashes
  // chain).
  std::vector<int32_t> other_start = prompt;
  other_start[0] = 77;
  EXPECT_EQ(index_.Match(worker(0), Chain(other_start)), 0);
  // Another cache salt, another worker: nothing.
  EXPECT_EQ(index_.Match(worker(0), Chain(prompt, "tenant-b")), 0);
  EXPECT_EQ(index_.Match(worker(1), Chain(prompt)), 0);
  // Insert reports what matched before it.
  EXPECT_EQ(index_.Insert(worker(0), Chain(Concat(prompt, Tokens(900, 12))), 100), 4);
  EXPECT_EQ(index_.NumBlocks(worker(0)), 7);
}

TEST_F(PrefixIndexTest, EvictsLeastRecentlyUsedBlocksBeyondTheCapacity) {
  const std::vector<int32_t> a = Tokens(1, 12), b = Tokens(100, 12), c = Tokens(200, 12);  // 3 blocks each
  index_.Insert(worker(0), Chain(a), 6);
  index_.Insert(worker(0), Chain(b), 6);
  EXPECT_EQ(index_.NumBlocks(worker(0)), 6);
  index_.Insert(worker(0), Chain(a), 6);  // a is used again: b is now the oldest
  index_.Insert(worker(0), Chain(c), 6);
  EXPECT_EQ(index_.NumBlocks(worker(0)), 6);
  EXPECT_EQ(index_.Match(worker(0), Chain(a)), 3);
  EXPECT_EQ(index_.Match(worker(0), Chain(b)), 0);
  EXPECT_EQ(index_.Match(worker(0), Chain(c)), 3);
}

TEST_F(PrefixIndexTest, EvictsAChainFromItsEndSoItsPrefixStaysUsable) {
  const std::vector<int32_t> system = Tokens(1, 8);  // 2 blocks every prompt shares
  const std::vector<int32_t> a = Concat(system, Tokens(100, 8)), b = Concat(system, Tokens(200, 8));
  index_.Insert(worker(0), Chain(a), 5);
  index_.Insert(worker(0), Chain(b), 5);  // 6 distinct blocks: a's last block goes, not the shared ones
  EXPECT_EQ(index_.NumBlocks(worker(0)), 5);
  EXPECT_EQ(index_.Match(worker(0), Chain(a)), 3);
  EXPECT_EQ(index_.Match(worker(0), Chain(b)), 4);
  // A chain longer than the capacity keeps its first blocks.
  index_.Insert(worker(1), Chain(Tokens(1, 40)), 3);
  EXPECT_EQ(index_.Match(worker(1), Chain(Tokens(1, 40))), 3);
  EXPECT_EQ(index_.NumBlocks(worker(1)), 3);
}

TEST_F(PrefixIndexTest, CapacityIsBoundedByTheOptions) {
  PrefixIndex small({.max_blocks_per_worker = 2});
  small.Insert(worker(0), Chain(Tokens(1, 40)), 1000);
  EXPECT_EQ(small.NumBlocks(worker(0)), 2);
  small.Insert(worker(0), Chain(Tokens(1, 40)), 0);  // a worker with no KV blocks holds nothing
  EXPECT_EQ(small.NumBlocks(worker(0)), 0);
}

TEST_F(PrefixIndexTest, ForgetsRemovedWorkers) {
  const std::vector<BlockHash> chain = Chain(Tokens(1, 16));
  index_.Insert(worker(0), chain, 100);
  index_.Insert(worker(1), chain, 100);
  index_.Remove(worker(0));
  EXPECT_EQ(index_.Match(worker(0), chain), 0);
  EXPECT_EQ(index_.Match(worker(1), chain), 4);
  index_.Insert(worker(0), chain, 100);
  Worker* const keep[] = {registry_.prefill_workers()[0]};
  index_.RetainOnly(keep);
  EXPECT_EQ(index_.Match(worker(0), chain), 4);
  EXPECT_EQ(index_.Match(worker(1), chain), 0);
  EXPECT_EQ(index_.NumBlocks(worker(1)), 0);
}

}  // namespace
}  // namespace duet::router
