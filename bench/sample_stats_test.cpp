#include "bench/sample_stats.h"

#include <gtest/gtest.h>

namespace duet::bench {
namespace {

TEST(SummarizeTest, OddCountMedianIsTheMiddleSample) {
  const SampleStats s = Summarize({5, 1, 4, 2, 3});
  EXPECT_DOUBLE_EQ(s.median, 3);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 5);
}

TEST(SummarizeTest, EvenCountMedianIsTheMeanOfTheMiddleTwo) {
  EXPECT_DOUBLE_EQ(Summarize({4, 1, 3, 2}).median, 2.5);
}

TEST(SummarizeTest, PercentilesAreRoundedRanks) {
  std::vector<double> samples;
  for (int i = 20; i >= 0; --i) samples.push_back(i);  // 0..20, unsorted
  const SampleStats s = Summarize(samples);
  EXPECT_DOUBLE_EQ(s.p10, 2);
  EXPECT_DOUBLE_EQ(s.p90, 18);
  EXPECT_DOUBLE_EQ(s.median, 10);
}

TEST(SummarizeTest, NoSamplesGiveZeros) {
  const SampleStats s = Summarize({});
  EXPECT_EQ(s.median, 0);
  EXPECT_EQ(s.max, 0);
}

}  // namespace
}  // namespace duet::bench
