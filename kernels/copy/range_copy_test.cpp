#include "kernels/copy/range_copy.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

// Host reference of the same copies.
void CopyOnHost(const std::vector<ByteRange>& ranges, const std::vector<std::vector<char>>& src,
                std::vector<std::vector<char>>& dst) {
  for (size_t b = 0; b < src.size(); ++b) {
    for (const ByteRange& r : ranges) std::memcpy(dst[b].data() + r.dst_offset, src[b].data() + r.src_offset, r.bytes);
  }
}

// Random non-overlapping ranges of `unit`-multiple sizes and offsets in `num_buffers` buffers of
// `size` bytes (2: one layer's K and V).
void RunCase(size_t size, uint64_t unit, int num_ranges, uint64_t max_units, uint32_t seed, size_t num_buffers = 2) {
  std::mt19937 rng(seed);
  std::vector<std::vector<char>> src(num_buffers, std::vector<char>(size));
  std::vector<std::vector<char>> want(num_buffers, std::vector<char>(size, 0));
  for (auto& s : src) {
    for (char& c : s) c = char(rng());
  }
  std::vector<ByteRange> ranges(static_cast<size_t>(num_ranges));
  // Destinations tile the buffer in a shuffled order; sources anywhere.
  std::vector<uint64_t> slots(size / (unit * max_units));
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = i * unit * max_units;
  std::shuffle(slots.begin(), slots.end(), rng);
  ASSERT_LE(size_t(num_ranges), slots.size());
  for (ByteRange& r : ranges) {
    r.bytes = unit * (1 + rng() % max_units);
    r.dst_offset = slots[size_t(&r - ranges.data())];
    r.src_offset = unit * (rng() % ((size - r.bytes) / unit));
  }
  CopyOnHost(ranges, src, want);

  std::deque<DeviceBuffer<char>> from, to;  // neither copied nor moved
  std::vector<BufferPair> buffers;
  for (size_t b = 0; b < num_buffers; ++b) {
    from.emplace_back(src[b]);
    to.emplace_back(std::vector<char>(size, 0));
    buffers.push_back({from.back().get(), to.back().get()});
  }
  CopyRanges(buffers.data(), buffers.size(), ranges.data(), ranges.size(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t b = 0; b < num_buffers; ++b) {
    EXPECT_EQ(std::memcmp(to[b].Download().data(), want[b].data(), size), 0) << "buffer " << b;
  }
}

TEST(RangeCopyTest, WholeBlocksOf32KiB) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(64 << 20, 32 << 10, 300, 4, 1);
}

TEST(RangeCopyTest, ManySmallTokenRunsOverSeveralLaunches) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(4 << 20, 256, 1300, 3, 2);
}

TEST(RangeCopyTest, AFewRanges) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(8 << 20, 64 << 10, 5, 2, 5);
}

TEST(RangeCopyTest, UnalignedBytesTakeTheByteLoop) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(1 << 20, 12, 500, 5, 3);
}

TEST(RangeCopyTest, ThirtyTwoLayersInOneLaunch) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(1 << 20, 32 << 10, 24, 1, 6, /*num_buffers=*/64);
}

TEST(RangeCopyTest, MoreBuffersThanOneLaunchTakes) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(256 << 10, 4 << 10, 40, 1, 7, /*num_buffers=*/130);
}

TEST(RangeCopyTest, OneLongRange) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(32 << 20, 1 << 20, 1, 16, 4);
}

}  // namespace
}  // namespace duet::kernels
