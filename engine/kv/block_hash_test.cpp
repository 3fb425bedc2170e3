#include "engine/kv/block_hash.h"

#include <numeric>
#include <unordered_set>

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(BlockHash, ChainsOverFullBlocksOnly) {
  std::vector<int32_t> tokens(37);
  std::iota(tokens.begin(), tokens.end(), 100);
  const BlockHash seed = PrefixSeed("model", "");
  const std::vector<BlockHash> hashes = FullBlockHashes(seed, tokens, 16);
  ASSERT_EQ(hashes.size(), 2u);
  EXPECT_EQ(hashes[0], HashBlock(seed, absl::MakeConstSpan(tokens).subspan(0, 16)));
  EXPECT_EQ(hashes[1], HashBlock(hashes[0], absl::MakeConstSpan(tokens).subspan(16, 16)));
}

TEST(BlockHash, SamePrefixSameHashesThenDiverges) {
  std::vector<int32_t> a(64), b(64);
  std::iota(a.begin(), a.end(), 0);
  b = a;
  b[40] = 9999;  // inside block 2
  const BlockHash seed = PrefixSeed("model", "");
  const std::vector<BlockHash> ha = FullBlockHashes(seed, a, 16), hb = FullBlockHashes(seed, b, 16);
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_EQ(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  EXPECT_NE(ha[3], hb[3]);  // every later block differs too: the chain carries the change
}

TEST(BlockHash, SeedSeparatesModelsAndSalts) {
  const std::vector<int32_t> tokens(16, 7);
  const BlockHash plain = HashBlock(PrefixSeed("m", ""), tokens);
  EXPECT_NE(plain, HashBlock(PrefixSeed("m", "user-1"), tokens));
  EXPECT_NE(plain, HashBlock(PrefixSeed("other", ""), tokens));
  // Model and salt are length-delimited: ("ab", "c") is not ("a", "bc").
  EXPECT_NE(PrefixSeed("ab", "c"), PrefixSeed("a", "bc"));
}

TEST(BlockHash, StableAcrossProcesses) {
  // A fixed function: the router and the workers must agree. Pinned value for this input.
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  EXPECT_EQ(HashBlock(PrefixSeed("m", ""), tokens), 9501609154370145243ull);
}

TEST(BlockHash, NoCollisionsAmongNeighbouringBlocks) {
  // Blocks that differ in one token id, in one position, or in order all hash apart.
  std::unordered_set<BlockHash> seen;
  const BlockHash seed = PrefixSeed("m", "");
  std::vector<int32_t> block(16, 0);
  for (int pos = 0; pos < 16; ++pos) {
    for (int32_t v = 1; v <= 2000; ++v) {
      block.assign(16, 0);
      block[size_t(pos)] = v;
      EXPECT_TRUE(seen.insert(HashBlock(seed, block)).second) << pos << " " << v;
    }
  }
}

}  // namespace
}  // namespace duet
