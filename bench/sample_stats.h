// Order statistics of repeated measurements: the benchmarks report a median with its spread
// (p10-p90 over many repeats, min-max over a few), never a best-of-N.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace duet::bench {

// Linear interpolation between closest ranks, as numpy.percentile; `sorted` ascending, not empty.
inline double Percentile(const std::vector<double>& sorted, double percent) {
  const double rank = percent / 100.0 * double(sorted.size() - 1);
  const size_t below = size_t(std::floor(rank));
  const size_t above = std::min(below + 1, sorted.size() - 1);
  return sorted[below] + (rank - double(below)) * (sorted[above] - sorted[below]);
}

struct SampleStats {
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0;
};

// Percentiles as Percentile: the median of an even count is the mean of the middle two.
inline SampleStats Summarize(std::vector<double> samples) {
  SampleStats s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  s.median = Percentile(samples, 50);
  s.p10 = Percentile(samples, 10);
  s.p90 = Percentile(samples, 90);
  s.min = samples.front();
  s.max = samples.back();
  return s;
}

}  // namespace duet::bench
