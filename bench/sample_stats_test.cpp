#include "bench/sample_stats.h"

#include <vector>

#include <gtest/gtest.h>

namespace duet::bench {
namespace {

TEST(Percentile, InterpolatesLikeNumpy) {
  const std::vector<double> v = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 5.5);   // numpy.percentile(range(1, 11), 50)
  EXPECT_DOUBLE_EQ(Percentile(v, 90), 9.1);
  EXPECT_DOUBLE_EQ(Percentile(v, 99), 9.91);
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 10);
  EXPECT_DOUBLE_EQ(Percentile({4}, 99), 4);
}

TEST(SummarizeTest, OddCountMedianIsTheMiddleSample) {
  const SampleStats s = Summarize({5, 1, 4, 2, 3});
  EXPECT_DOUBLE_EQ(s.median, 3);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 5);
}

TEST(SummarizeTest, EvenCountMedianIsTheMeanOfTheMiddleTwo) {
  EXPECT_DOUBLE_EQ(Summarize({4, 1, 3, 2}).median, 2.5);
}

TEST(SummarizeTest, PercentilesOfEvenlySpacedSamples) {
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
