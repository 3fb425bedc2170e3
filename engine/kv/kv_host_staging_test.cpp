#include "engine/kv/kv_host_staging.h"

#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

using ::testing::ElementsAre;

KvCacheShape SmallShape() {
  return KvCacheShape{/*num_layers=*/3, /*num_blocks=*/10, /*num_kv_heads=*/2, /*block_size=*/4, /*head_dim=*/8,
                      KvDtype::kFloat32};
}

std::unique_ptr<HostKvCache> SmallCache() { return std::move(HostKvCache::Create(SmallShape())).value(); }

void FillRandom(HostKvCache& cache, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int64_t n = cache.shape().num_blocks * cache.shape().block_elems();
  for (int64_t layer = 0; layer < cache.shape().num_layers; ++layer) {
    for (int64_t i = 0; i < n; ++i) {
      cache.keys(layer)[i] = dist(rng);
      cache.values(layer)[i] = dist(rng);
    }
  }
}

std::vector<float> Block(HostKvCache& cache, bool keys, int64_t layer, int32_t block) {
  const int64_t n = cache.shape().block_elems();
  const float* pool = keys ? cache.keys(layer) : cache.values(layer);
  return std::vector<float>(pool + block * n, pool + (block + 1) * n);
}

TEST(KvHostStagingTest, BlocksTravelThroughStagingUnchanged) {
  const std::unique_ptr<HostKvCache> sender = SmallCache();
  const std::unique_ptr<HostKvCache> receiver = SmallCache();
  FillRandom(*sender, 1);
  FillRandom(*receiver, 2);
  auto out = KvHostStaging::Create(*sender, 6);
  auto in = KvHostStaging::Create(*receiver, 6);
  ASSERT_TRUE(out.ok() && in.ok());

  const std::vector<int32_t> src_blocks = {7, 2, 3};
  const std::vector<int32_t> dst_blocks = {0, 9, 4};
  absl::StatusOr<std::vector<int32_t>> staged = (*out)->Allocate(3);
  ASSERT_TRUE(staged.ok());
  EXPECT_THAT(*staged, ElementsAre(0, 1, 2));  // ascending, so runs coalesce
  for (int64_t layer = 0; layer < 3; ++layer) {
    ASSERT_TRUE((*out)->StageLayer(layer, src_blocks, *staged).ok());
  }
  // The transport's part: the staging bytes reach the receiver's staging blocks.
  absl::StatusOr<std::vector<int32_t>> landing = (*in)->Allocate(3);
  ASSERT_TRUE(landing.ok());
  const size_t block_bytes = size_t(SmallShape().block_elems()) * sizeof(float);
  for (int64_t layer = 0; layer < 3; ++layer) {
    for (size_t i = 0; i < 3; ++i) {
      std::memcpy(static_cast<char*>((*in)->pools().keys[layer]) + (*landing)[i] * block_bytes,
                  static_cast<char*>((*out)->pools().keys[layer]) + (*staged)[i] * block_bytes, block_bytes);
      std::memcpy(static_cast<char*>((*in)->pools().values[layer]) + (*landing)[i] * block_bytes,
                  static_cast<char*>((*out)->pools().values[layer]) + (*staged)[i] * block_bytes, block_bytes);
    }
  }
  ASSERT_TRUE((*in)->Unstage(*landing, dst_blocks).ok());
  for (int64_t layer = 0; layer < 3; ++layer) {
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(Block(*receiver, true, layer, dst_blocks[i]), Block(*sender, true, layer, src_blocks[i]));
      EXPECT_EQ(Block(*receiver, false, layer, dst_blocks[i]), Block(*sender, false, layer, src_blocks[i]));
    }
  }
  // Blocks outside the copy are untouched.
  const std::unique_ptr<HostKvCache> reference = SmallCache();
  FillRandom(*reference, 2);
  EXPECT_EQ(Block(*receiver, true, 1, 5), Block(*reference, true, 1, 5));
}

TEST(KvHostStagingTest, AllocationIsBoundedAndFreedBlocksComeBack) {
  const std::unique_ptr<HostKvCache> cache = SmallCache();
  auto staging = KvHostStaging::Create(*cache, 4);
  ASSERT_TRUE(staging.ok());
  absl::StatusOr<std::vector<int32_t>> a = (*staging)->Allocate(3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*staging)->num_free_blocks(), 1);
  EXPECT_EQ((*staging)->Allocate(2).status().code(), absl::StatusCode::kResourceExhausted);
  (*staging)->Free(*a);
  EXPECT_EQ((*staging)->num_free_blocks(), 4);
  absl::StatusOr<std::vector<int32_t>> b = (*staging)->Allocate(4);
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(0, 1, 2, 3));
}

TEST(KvHostStagingTest, BadBlockIdsAreRefused) {
  const std::unique_ptr<HostKvCache> cache = SmallCache();
  auto staging = KvHostStaging::Create(*cache, 4);
  ASSERT_TRUE(staging.ok());
  const std::vector<int32_t> cache_blocks = {1, 2};
  EXPECT_EQ((*staging)->StageLayer(0, cache_blocks, std::vector<int32_t>{0, 4}).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*staging)->StageLayer(0, std::vector<int32_t>{1, 10}, std::vector<int32_t>{0, 1}).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*staging)->StageLayer(3, cache_blocks, std::vector<int32_t>{0, 1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*staging)->Unstage(std::vector<int32_t>{0}, cache_blocks).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvHostStaging::Create(*cache, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace duet
