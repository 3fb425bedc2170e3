#include "kernels/elementwise/gather_rows.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::DeviceBuffer;
using testing::RandomFloats;
using testing::ToBf16;

// Gathers `row_index` from a random [src_rows, width] matrix; a copy, so bit for bit.
void CheckGatherRows(const std::vector<int32_t>& row_index, int src_rows, int width, uint64_t seed) {
  const std::vector<__nv_bfloat16> src = ToBf16(RandomFloats(size_t(src_rows) * width, seed, -4.f, 4.f));
  DeviceBuffer<__nv_bfloat16> d_src(src);
  DeviceBuffer<int32_t> d_index(row_index);
  const int rows = int(row_index.size());
  DeviceBuffer<__nv_bfloat16> d_dst(size_t(rows) * width);
  d_dst.Poison();
  GatherRows(d_src.get(), d_index.get(), d_dst.get(), rows, width, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> got = d_dst.Download();
  for (int i = 0; i < rows; ++i) {
    EXPECT_EQ(std::memcmp(got.data() + size_t(i) * width, src.data() + size_t(row_index[size_t(i)]) * width,
                          size_t(width) * sizeof(__nv_bfloat16)),
              0)
        << "row " << i;
  }
}

TEST(GatherRows, Bf16Llama8bAttentionRows) {
  DUET_SKIP_WITHOUT_GPU();
  // A mixed step's logits rows: the decode rows, then each finished prompt's last row.
  std::vector<int32_t> rows;
  for (int i = 0; i < 64; ++i) rows.push_back(i);
  rows.push_back(383);
  CheckGatherRows(rows, /*src_rows=*/384, /*width=*/4096, 1);
}

TEST(GatherRows, Bf16UnorderedAndSingleRows) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGatherRows({16, 0, 9}, 17, 512, 2);
  CheckGatherRows({511}, 512, 4096, 3);
  CheckGatherRows({2}, 3, 8, 4);
}

TEST(GatherRows, Bf16NoRowsIsANoOp) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGatherRows({}, 4, 4096, 5);
}

}  // namespace
}  // namespace duet::kernels
