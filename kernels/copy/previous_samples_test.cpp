#include "kernels/copy/previous_samples.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

// A step of `num_tokens` ids, a share of them placeholders for rows of a previous step's samples.
void RunCase(int num_tokens, int num_samples, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> samples(static_cast<size_t>(num_samples));
  for (int32_t& s : samples) s = int32_t(rng() % 128256);
  std::vector<int32_t> tokens(static_cast<size_t>(num_tokens)), want(static_cast<size_t>(num_tokens));
  for (int i = 0; i < num_tokens; ++i) {
    if (rng() % 3 == 0) {
      const int row = int(rng() % uint32_t(num_samples));
      tokens[size_t(i)] = -1 - row;
      want[size_t(i)] = samples[size_t(row)];
    } else {
      tokens[size_t(i)] = want[size_t(i)] = int32_t(rng() % 128256);
    }
  }
  DeviceBuffer<int32_t> d_tokens(tokens), d_samples(samples);
  ResolvePreviousStepSamples(d_tokens.get(), num_tokens, d_samples.get(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_tokens.Download(), want);
}

TEST(PreviousSamplesTest, DecodeBatchOfPlaceholders) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(64, 64, 1);
}

TEST(PreviousSamplesTest, MixedStepOverSeveralBlocks) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(1024, 256, 2);
}

TEST(PreviousSamplesTest, OneToken) {
  DUET_SKIP_WITHOUT_GPU();
  RunCase(1, 1, 3);
}

}  // namespace
}  // namespace duet::kernels
