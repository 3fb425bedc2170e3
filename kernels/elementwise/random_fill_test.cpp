#include "kernels/elementwise/random_fill.h"

#include <cmath>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::ToFloat;

std::vector<float> Fill(size_t n, uint64_t seed, float scale) {
  DeviceBuffer<__nv_bfloat16> d(n);
  d.Poison();
  FillRandomBf16(d.get(), n, seed, scale, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  return ToFloat(d.Download());
}

TEST(FillRandomBf16, Bf16ValuesAreSpreadOverTheRangeAndFollowTheSeed) {
  DUET_SKIP_WITHOUT_GPU();
  const size_t n = 1 << 20;  // more elements than the grid's threads: every stride is written
  const std::vector<float> a = Fill(n, 7, 0.5f);
  double sum = 0, sum_squares = 0;
  for (float v : a) {
    ASSERT_TRUE(std::isfinite(v));
    ASSERT_GE(v, -0.5f);
    ASSERT_LE(v, 0.5f);  // bf16 rounding may reach the bound
    sum += v;
    sum_squares += double(v) * v;
  }
  // Uniform on [-0.5, 0.5): mean 0, variance 1/12.
  EXPECT_NEAR(sum / double(n), 0.0, 2e-3);
  EXPECT_NEAR(sum_squares / double(n), 1.0 / 12.0, 2e-3);
  EXPECT_GT(std::set<float>(a.begin(), a.end()).size(), size_t(1000));  // not a few repeated values
  EXPECT_EQ(Fill(n, 7, 0.5f), a);
  const std::vector<float> b = Fill(n, 8, 0.5f);
  size_t same = 0;
  for (size_t i = 0; i < n; ++i) same += a[i] == b[i] ? 1 : 0;
  EXPECT_LT(same, n / 50);  // another seed: other values (equal ones only by chance)
}

TEST(FillRandomBf16, Bf16EmptyIsANoOp) {
  DUET_SKIP_WITHOUT_GPU();
  FillRandomBf16(nullptr, 0, 1, 1.f, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace duet::kernels
