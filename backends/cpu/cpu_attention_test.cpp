#include "backends/cpu/cpu_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace duet {
namespace {

// A context of `n` slots in one run; keys then values, [n, head_dim] each.
struct Context {
  Context(int64_t n, int64_t head_dim, uint32_t seed) : keys(size_t(n * head_dim)), values(size_t(n * head_dim)) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : keys) x = normal(gen);
    for (float& x : values) x = normal(gen);
  }
  std::vector<float> keys, values;
};

std::vector<float> Query(int64_t head_dim, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(head_dim));
  for (float& x : q) x = normal(gen);
  return q;
}

// softmax(scale · q·Kᵀ) · V in double precision.
std::vector<double> Reference(const std::vector<float>& q, const Context& c, int64_t n, int64_t head_dim,
                              float scale) {
  std::vector<double> s(static_cast<size_t>(n));
  double max_s = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    double dot = 0;
    for (int64_t d = 0; d < head_dim; ++d) dot += double(q[d]) * c.keys[size_t(i * head_dim + d)];
    s[size_t(i)] = dot * scale;
    max_s = std::max(max_s, s[size_t(i)]);
  }
  double denom = 0;
  for (double& x : s) denom += (x = std::exp(x - max_s));
  std::vector<double> out(static_cast<size_t>(head_dim), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t d = 0; d < head_dim; ++d) out[size_t(d)] += s[size_t(i)] / denom * c.values[size_t(i * head_dim + d)];
  }
  return out;
}

TEST(AttendHeadTest, Fp32MatchesADoublePrecisionReference) {
  for (int64_t head_dim : {8, 64, 72, 128, 12}) {
    for (int64_t n : {1, 3, 17, 333}) {
      const Context c(n, head_dim, uint32_t(n * 7 + head_dim));
      const std::vector<float> q = Query(head_dim, uint32_t(head_dim));
      const float scale = 1.0f / std::sqrt(float(head_dim));
      const std::vector<KvRun> runs = {{c.keys.data(), c.values.data(), n}};
      std::vector<float> scores(static_cast<size_t>(n)), out(static_cast<size_t>(head_dim)), portable(static_cast<size_t>(head_dim));
      AttendHead(q.data(), runs, head_dim, scale, scores.data(), out.data());
      AttendHeadPortable(q.data(), runs, head_dim, scale, scores.data(), portable.data());
      const std::vector<double> want = Reference(q, c, n, head_dim, scale);
      for (int64_t d = 0; d < head_dim; ++d) {
        EXPECT_NEAR(out[size_t(d)], want[size_t(d)], 1e-5) << "head_dim " << head_dim << " n " << n << " d " << d;
        EXPECT_NEAR(portable[size_t(d)], want[size_t(d)], 1e-5) << "head_dim " << head_dim << " n " << n;
      }
    }
  }
}

TEST(AttendHeadTest, Fp32SplittingTheContextIntoRunsChangesNoBit) {
  // The same 50 slots as one run, as blocks of 16 and as single slots: bitwise the same output
  // (a tree token's ancestors come as single slots, its context as blocks).
  const int64_t head_dim = 64, n = 50;
  const Context c(n, head_dim, 3);
  const std::vector<float> q = Query(head_dim, 4);
  const float scale = 0.125f;
  auto attend = [&](int64_t run_length) {
    std::vector<KvRun> runs;
    for (int64_t first = 0; first < n; first += run_length) {
      runs.push_back({c.keys.data() + first * head_dim, c.values.data() + first * head_dim,
                      std::min(run_length, n - first)});
    }
    std::vector<float> scores(static_cast<size_t>(n)), out(static_cast<size_t>(head_dim));
    AttendHead(q.data(), runs, head_dim, scale, scores.data(), out.data());
    return out;
  };
  const std::vector<float> whole = attend(n);
  EXPECT_EQ(attend(16), whole);
  EXPECT_EQ(attend(1), whole);
  EXPECT_EQ(attend(3), whole);
}

}  // namespace
}  // namespace duet
