#include "kernels/copy/range_copy.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

// Host reference of the same copies.
void CopyOnHost(const std::vector<ByteRange>& ranges, const std::vector<std::vector<char>>& src,
                std::vector<std::vector<char>>& dst) {
  for (int b = 0; b < 2; ++b) {
    for (const ByteRange& r : ranges) std::memcpy(dst[b].data() + r.dst_offset, src[b].data() + r.src_offset, r.bytes);
  }
}

// Random non-overlapping ranges of `unit`-multiple sizes and offsets in buffers of `size` bytes.
void RunCase(size_t size, uint64_t unit, int num_ranges, uint64_t max_units, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<char>> src(2, std::vector<char>(size)), want(2, std::vector<char>(size, 0));
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

  char* device[4];
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(cudaMalloc(&device[i], size), cudaSuccess);
    ASSERT_EQ(cudaMemset(device[i], 0, size), cudaSuccess);
  }
  const char* from[2] = {device[0], device[1]};
  char* to[2] = {device[2], device[3]};
  for (int b = 0; b < 2; ++b) {
    ASSERT_EQ(cudaMemcpy(device[b], src[b].data(), size, cudaMemcpyHostToDevice), cudaSuccess);
  }
  CopyRanges(from, to, ranges.data(), ranges.size(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int b = 0; b < 2; ++b) {
    std::vector<char> got(size);
    ASSERT_EQ(cudaMemcpy(got.data(), device[2 + b], size, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), want[b].data(), size), 0) << "buffer " << b;
  }
  for (char* d : device) cudaFree(d);
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

TEST(RangeCopyTest, OneLongRange) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(32 << 20, 1 << 20, 1, 16, 4);
}

}  // namespace
}  // namespace duet::kernels
