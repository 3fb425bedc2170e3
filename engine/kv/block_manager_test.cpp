#include "engine/kv/block_manager.h"

#include <map>
#include <random>

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(BlockManagerTest, ReserveGrowsByWholeBlocks) {
  BlockManager bm(8, 4);
  ASSERT_TRUE(bm.Reserve(1, 5, 0, nullptr).ok());
  EXPECT_EQ(bm.BlockTable(1).size(), 2u);
  EXPECT_EQ(bm.num_free_blocks(), 6);
  ASSERT_TRUE(bm.Reserve(1, 8, 5, nullptr).ok());  // still fits in two blocks
  EXPECT_EQ(bm.BlockTable(1).size(), 2u);
  ASSERT_TRUE(bm.Reserve(1, 9, 8, nullptr).ok());
  EXPECT_EQ(bm.BlockTable(1).size(), 3u);
  EXPECT_EQ(bm.Capacity(1), 12);
  bm.Free(1);
  EXPECT_EQ(bm.num_free_blocks(), 8);
  EXPECT_FALSE(bm.HasSequence(1));
}

TEST(BlockManagerTest, ExhaustionLeavesStateUnchanged) {
  BlockManager bm(3, 4);
  ASSERT_TRUE(bm.Reserve(1, 8, 0, nullptr).ok());
  absl::Status s = bm.Reserve(2, 8, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(bm.HasSequence(2));
  EXPECT_EQ(bm.num_free_blocks(), 1);
  s = bm.Reserve(1, 16, 8, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(bm.BlockTable(1).size(), 2u);
}

TEST(BlockManagerTest, ForkSharesBlocksAndCopiesOnWrite) {
  BlockManager bm(8, 4);
  ASSERT_TRUE(bm.Reserve(1, 6, 0, nullptr).ok());  // blocks A (full), B (2 of 4 used)
  ASSERT_TRUE(bm.Fork(1, 2).ok());
  EXPECT_EQ(bm.BlockTable(1), bm.BlockTable(2));
  EXPECT_EQ(bm.RefCount(bm.BlockTable(1)[0]), 2);
  EXPECT_EQ(bm.BlocksNeeded(2, 7, 6), 1);  // the shared partial block needs a private copy

  std::vector<BlockCopy> copies;
  ASSERT_TRUE(bm.Reserve(2, 7, 6, &copies).ok());
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].src, bm.BlockTable(1)[1]);
  EXPECT_EQ(copies[0].dst, bm.BlockTable(2)[1]);
  EXPECT_EQ(bm.BlockTable(1)[0], bm.BlockTable(2)[0]);  // full prefix block stays shared
  EXPECT_NE(bm.BlockTable(1)[1], bm.BlockTable(2)[1]);
  EXPECT_EQ(bm.RefCount(bm.BlockTable(1)[1]), 1);

  // The parent now owns its partial block alone: no copy needed to append.
  copies.clear();
  ASSERT_TRUE(bm.Reserve(1, 7, 6, &copies).ok());
  EXPECT_TRUE(copies.empty());
  bm.Free(1);
  bm.Free(2);
  EXPECT_EQ(bm.num_free_blocks(), 8);
}

TEST(BlockManagerTest, ForkErrors) {
  BlockManager bm(4, 4);
  EXPECT_EQ(bm.Fork(1, 2).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(bm.Reserve(1, 1, 0, nullptr).ok());
  ASSERT_TRUE(bm.Reserve(2, 1, 0, nullptr).ok());
  EXPECT_EQ(bm.Fork(1, 2).code(), absl::StatusCode::kAlreadyExists);
}

// Random reserve/fork/free sequences: reference counts always equal the number of tables that
// hold a block, and everything returns to the free list at the end.
TEST(BlockManagerTest, RandomOperationsNeverLeak) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 20; ++trial) {
    BlockManager bm(64, 1 + trial % 5);
    std::map<SequenceId, int64_t> filled;  // tokens written per live sequence
    SequenceId next = 1;
    for (int op = 0; op < 2000; ++op) {
      const int kind = int(rng() % 4);
      if (kind == 0 || filled.empty()) {
        const int64_t n = 1 + rng() % 20;
        if (bm.Reserve(next, n, 0, nullptr).ok()) filled[next] = n;
        ++next;
      } else {
        auto it = filled.begin();
        std::advance(it, rng() % filled.size());
        if (kind == 1) {
          const int64_t n = it->second + 1 + rng() % 6;
          std::vector<BlockCopy> copies;
          if (bm.Reserve(it->first, n, it->second, &copies).ok()) it->second = n;
        } else if (kind == 2) {
          if (bm.Fork(it->first, next).ok()) filled[next] = it->second;
          ++next;
        } else {
          bm.Free(it->first);
          filled.erase(it);
        }
      }
      std::map<int32_t, int32_t> holders;
      for (const auto& [seq, n] : filled) {
        ASSERT_GE(bm.Capacity(seq), n);
        for (int32_t b : bm.BlockTable(seq)) ++holders[b];
      }
      int32_t used = 0;
      for (int32_t b = 0; b < bm.num_blocks(); ++b) {
        ASSERT_EQ(bm.RefCount(b), holders.count(b) ? holders[b] : 0) << "block " << b;
        used += bm.RefCount(b) > 0;
      }
      ASSERT_EQ(used, bm.num_used_blocks());
    }
    for (const auto& [seq, n] : filled) bm.Free(seq);
    EXPECT_EQ(bm.num_free_blocks(), bm.num_blocks());
  }
}

}  // namespace
}  // namespace duet
