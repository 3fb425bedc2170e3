// DeviceKvCache's copies to and from host staging (the path KV takes between GPU workers),
// on a real device: bytes out equal bytes in, scattered and consecutive block ids alike.
#include "backends/cuda/device_kv_cache.h"

#include <cstring>
#include <random>
#include <vector>

#include "engine/kv/host_kv_tier.h"
#include "engine/kv/kv_host_staging.h"
#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"

namespace duet::cuda {
namespace {

class DeviceKvCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DUET_SKIP_WITHOUT_GPU();
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    // [num_blocks=40, heads=4, block_size=16, head_dim=64] bf16 per layer and K/V, 3 layers.
    auto cache = DeviceKvCache::Create(KvCacheShape{3, 40, 4, 16, 64, KvDtype::kBFloat16}, arena_, stream_);
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    const KvCacheShape& s = cache_->shape();
    layer_bytes_ = size_t(s.num_blocks * s.block_elems()) * 2;
    block_bytes_ = size_t(s.block_elems()) * 2;
    // Random bytes in every pool (poisoned: no zeros to hide a missing copy).
    std::mt19937 rng(5);
    original_.resize(size_t(2 * s.num_layers) * layer_bytes_);
    for (auto& b : original_) b = uint8_t(1 + rng() % 255);
    for (int64_t layer = 0; layer < s.num_layers; ++layer) {
      ASSERT_EQ(cudaMemcpy(cache_->keys(layer), Pool(layer, 0), layer_bytes_, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(cache_->values(layer), Pool(layer, 1), layer_bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
    // Landed before the staging copies, which run on the cache's non-blocking copy stream.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void TearDown() override {
    cache_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  const uint8_t* Pool(int64_t layer, int kv) const { return original_.data() + size_t(2 * layer + kv) * layer_bytes_; }
  std::vector<uint8_t> DeviceBlock(int64_t layer, int kv, int32_t block) {
    std::vector<uint8_t> out(block_bytes_);
    const auto* base = reinterpret_cast<const uint8_t*>(kv == 0 ? cache_->keys(layer) : cache_->values(layer));
    EXPECT_EQ(cudaMemcpy(out.data(), base + size_t(block) * block_bytes_, block_bytes_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  std::unique_ptr<DeviceKvCache> cache_;
  std::vector<uint8_t> original_;
  size_t layer_bytes_ = 0, block_bytes_ = 0;
};

TEST_F(DeviceKvCacheTest, BlocksRoundTripThroughPinnedStaging) {
  auto staging = KvHostStaging::Create(*cache_, 12);
  ASSERT_TRUE(staging.ok()) << staging.status();
  // A run of consecutive ids (coalesced into one copy) and scattered ones.
  const std::vector<int32_t> src = {4, 5, 6, 7, 30, 2, 39, 11};
  absl::StatusOr<std::vector<int32_t>> staged = (*staging)->Allocate(int64_t(src.size()));
  ASSERT_TRUE(staged.ok());
  for (int64_t layer = 0; layer < 3; ++layer) ASSERT_TRUE((*staging)->StageLayer(layer, src, *staged).ok());
  for (int64_t layer = 0; layer < 3; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      const auto* host = static_cast<const uint8_t*>(kv == 0 ? (*staging)->pools().keys[layer]
                                                               : (*staging)->pools().values[layer]);
      for (size_t i = 0; i < src.size(); ++i) {
        EXPECT_EQ(std::memcmp(host + size_t((*staged)[i]) * block_bytes_, Pool(layer, kv) + size_t(src[i]) * block_bytes_,
                              block_bytes_), 0)
            << "layer " << layer << " kv " << kv << " block " << src[i];
      }
    }
  }
  // Back into other blocks (the decode side): every byte lands, nothing else moves.
  const std::vector<int32_t> dst = {20, 21, 22, 23, 0, 35, 1, 12};
  ASSERT_TRUE((*staging)->Unstage(*staged, dst).ok());
  for (int64_t layer = 0; layer < 3; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      for (size_t i = 0; i < dst.size(); ++i) {
        std::vector<uint8_t> got = DeviceBlock(layer, kv, dst[i]);
        EXPECT_EQ(std::memcmp(got.data(), Pool(layer, kv) + size_t(src[i]) * block_bytes_, block_bytes_), 0)
            << "layer " << layer << " kv " << kv << " block " << dst[i];
      }
      std::vector<uint8_t> untouched = DeviceBlock(layer, kv, 25);
      EXPECT_EQ(std::memcmp(untouched.data(), Pool(layer, kv) + 25 * block_bytes_, block_bytes_), 0);
    }
  }
}

// The host tier's copies are ordered on the GPU, not waited for: a block written by work still
// queued on the executor's stream is offloaded with those bytes, loaded back into another block
// before the stream's later work runs, and that later work (overwriting the first block) does not
// reach the host copy.
TEST_F(DeviceKvCacheTest, HostTierCopiesAreStreamOrdered) {
  auto tier = HostKvTier::Create(*cache_, int64_t(4) * cache_->shape().bytes_per_block());
  ASSERT_TRUE(tier.ok()) << tier.status();
  void* scratch = nullptr;  // a long memset ahead of the block's write: a copy that did not wait would race it
  const size_t scratch_bytes = size_t(1) << 30;
  ASSERT_EQ(cudaMalloc(&scratch, scratch_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(scratch, 1, scratch_bytes, stream_), cudaSuccess);
  const int32_t written = 7, loaded = 9;
  for (int64_t layer = 0; layer < 3; ++layer) {
    ASSERT_EQ(cudaMemsetAsync(cache_->keys(layer) + written * cache_->shape().block_elems(), 0x5A, block_bytes_, stream_),
              cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(cache_->values(layer) + written * cache_->shape().block_elems(), 0xA5, block_bytes_, stream_),
              cudaSuccess);
  }
  const std::vector<int32_t> tokens(size_t(cache_->shape().block_size), 3);
  (*tier)->Offload(written, /*hash=*/42, tokens);
  ASSERT_TRUE((*tier)->Flush(HostKvTier::FlushMode::kOrdered).ok());
  ASSERT_TRUE((*tier)->Hold(42, tokens));
  (*tier)->Load(42, loaded);
  ASSERT_TRUE((*tier)->Flush(HostKvTier::FlushMode::kOrdered).ok());
  for (int64_t layer = 0; layer < 3; ++layer) {  // later work on the stream: after the copies
    ASSERT_EQ(cudaMemsetAsync(cache_->keys(layer) + written * cache_->shape().block_elems(), 0, block_bytes_, stream_),
              cudaSuccess);
  }
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  cudaFree(scratch);
  for (int64_t layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(DeviceBlock(layer, 0, loaded), std::vector<uint8_t>(block_bytes_, 0x5A)) << "layer " << layer;
    EXPECT_EQ(DeviceBlock(layer, 1, loaded), std::vector<uint8_t>(block_bytes_, 0xA5)) << "layer " << layer;
    EXPECT_EQ(DeviceBlock(layer, 0, written), std::vector<uint8_t>(block_bytes_, 0)) << "layer " << layer;
  }
  // The copy back went from the host slot the offload filled: it still holds the block.
  ASSERT_TRUE((*tier)->Hold(42, tokens));
}

TEST_F(DeviceKvCacheTest, OutOfRangeBlocksAreRefused) {
  auto staging = KvHostStaging::Create(*cache_, 4);
  ASSERT_TRUE(staging.ok());
  EXPECT_EQ((*staging)->StageLayer(0, std::vector<int32_t>{40}, std::vector<int32_t>{0}).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*staging)->Unstage(std::vector<int32_t>{0}, std::vector<int32_t>{-1}).code(),
            absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace duet::cuda
