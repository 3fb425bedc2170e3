#include "kvtransfer/layer_copy_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "kvtransfer/testing_pools.h"

namespace duet::kvtransfer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Applies a plan with memcpy, as the RMA puts would.
void ApplyPlan(const std::vector<CopyRange>& plan, const uint8_t* src, uint8_t* dst) {
  for (const CopyRange& range : plan) {
    std::memcpy(dst + range.dst_offset, src + range.src_offset, range.bytes);
  }
}

TEST(LayerCopyPlanTest, SameShapeCopiesWholeBlocksAndMergesRuns) {
  const KvLayout layout{1, 4, 2, 8, KvDtype::kFloat32};
  const uint64_t bb = layout.BlockBytes();
  const std::vector<uint32_t> src = {3, 4, 5, 9};
  const std::vector<uint32_t> dst = {10, 11, 12, 0};
  absl::StatusOr<std::vector<CopyRange>> plan = PlanLayerCopy(layout, src, layout, dst, 14);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(*plan, ElementsAre(CopyRange{3 * bb, 10 * bb, 3 * bb}, CopyRange{9 * bb, 0, bb}));
}

TEST(LayerCopyPlanTest, ValidateBlockIdsExplainsProblems) {
  const KvLayout layout{1, 16, 1, 8, KvDtype::kFloat32};
  const std::vector<uint32_t> two = {0, 1};
  EXPECT_TRUE(ValidateBlockIds(layout, two, 17, 4, "source").ok());
  EXPECT_THAT(ValidateBlockIds(layout, two, 40, 4, "source").message(),
              HasSubstr("source block list has 2 ids but 40 tokens at block size 16 need 3"));
  EXPECT_EQ(ValidateBlockIds(layout, two, 17, 1, "destination").code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_FALSE(ValidateBlockIds(layout, two, 0, 4, "source").ok());
  const std::vector<uint32_t> repeated = {2, 2};
  EXPECT_THAT(ValidateBlockIds(layout, repeated, 20, 4, "destination").message(),
              HasSubstr("destination block id 2 appears more than once"));
}

struct ReblockCase {
  uint32_t src_block;
  uint32_t dst_block;
  uint32_t num_tokens;
};

class ReblockTest : public ::testing::TestWithParam<ReblockCase> {};

TEST_P(ReblockTest, CopiedTensorMatchesAndHashesAgree) {
  const ReblockCase c = GetParam();
  const KvLayout src_layout{1, c.src_block, 3, 16, KvDtype::kBFloat16};
  KvLayout dst_layout = src_layout;
  dst_layout.block_size = c.dst_block;
  HostKvPools src(src_layout, 64, /*seed=*/7);
  HostKvPools dst(dst_layout, 64, /*seed=*/0);
  // Distinct, non-contiguous ids on both sides (5 and 3 are coprime with the 64 blocks).
  std::vector<uint32_t> src_ids, dst_ids;
  for (uint32_t i = 0; i * c.src_block < c.num_tokens; ++i) src_ids.push_back((63 + 5 * i) % 64);
  for (uint32_t i = 0; i * c.dst_block < c.num_tokens; ++i) dst_ids.push_back((5 + 3 * i) % 64);

  absl::StatusOr<std::vector<CopyRange>> plan =
      PlanLayerCopy(src_layout, src_ids, dst_layout, dst_ids, c.num_tokens);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ApplyPlan(*plan, src.key(0), dst.key(0));

  EXPECT_EQ(src.Gather(src.key(0), src_ids, c.num_tokens),
            dst.Gather(dst.key(0), dst_ids, c.num_tokens));
  EXPECT_EQ(HashLayerTokens(src_layout, src.key(0), src_ids, c.num_tokens),
            HashLayerTokens(dst_layout, dst.key(0), dst_ids, c.num_tokens));
  // And the hash does see the data: another layer's bytes hash differently.
  EXPECT_NE(HashLayerTokens(src_layout, src.key(0), src_ids, c.num_tokens),
            HashLayerTokens(src_layout, src.value(0), src_ids, c.num_tokens));
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, ReblockTest,
                         ::testing::Values(ReblockCase{16, 32, 100}, ReblockCase{32, 16, 100},
                                           ReblockCase{16, 16, 37}, ReblockCase{1, 16, 33},
                                           ReblockCase{16, 1, 20}, ReblockCase{12, 20, 61}));

}  // namespace
}  // namespace duet::kvtransfer
