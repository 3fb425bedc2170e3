// Order statistics of repeated measurements: the benchmarks report a median with its spread
// (p10-p90 over many repeats, min-max over a few), never a best-of-N.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace duet::bench {

struct SampleStats {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
};

// p10 and p90: the samples at rank q·(n−1), rounded; the median of an even count is the mean of
// the middle two.
inline SampleStats Summarize(std::vector<double> samples) {
  SampleStats s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  auto rank = [&](double q) { return samples[std::min(n - 1, size_t(q * double(n - 1) + 0.5))]; };
  s.median = n % 2 == 1 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  s.p10 = rank(0.1);
  s.p90 = rank(0.9);
  s.min = samples.front();
  s.max = samples.back();
  return s;
}

}  // namespace duet::bench
