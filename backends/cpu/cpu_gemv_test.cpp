#include "backends/cpu/cpu_gemv.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

// y[r, j] = Σ_c x[r, c] · w[j, c], summed in double: the reference both kernels must be near.
std::vector<float> Reference(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t n,
                             int64_t k) {
  std::vector<float> y(size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t c = 0; c < k; ++c) sum += double(x[size_t(r * k + c)]) * w[size_t(j * k + c)];
      y[size_t(r * n + j)] = float(sum);
    }
  }
  return y;
}

std::vector<float> Random(int64_t size, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(size));
  for (float& f : v) f = dist(rng);
  return v;
}

// float32 sums of k products of values in [-1, 1]: error grows about like sqrt(k)·eps·|terms|.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, int64_t k) {
  ASSERT_EQ(got.size(), want.size());
  const float tolerance = 4e-6f * float(k);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tolerance) << "element " << i;
}

struct Shape {
  int64_t rows, n, k;
};

TEST(BatchedGemvTest, MatchesTheReferenceAtSeveralRowCountsAndOddShapes) {
  std::mt19937 rng(3);
  // Row counts around the kernel's groups of 3 rows and a prefill-sized one over several L2
  // panels; n not a multiple of the 4-row weight block; k not a multiple of the 8-lane vector
  // (tails), and tiny shapes.
  const std::vector<Shape> shapes = {{1, 1, 1},   {1, 3, 7},    {2, 5, 9},     {3, 4, 8},    {1, 64, 512},
                                     {2, 67, 515}, {5, 130, 64}, {7, 33, 1409}, {9, 1024, 512}, {15, 31, 17},
                                     {16, 257, 264}, {17, 9, 40}, {32, 12, 100}, {301, 67, 515}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n << " k " << s.k);
    const std::vector<float> x = Random(s.rows * s.k, rng), w = Random(s.n * s.k, rng);
    const std::vector<float> want = Reference(x, w, s.rows, s.n, s.k);
    std::vector<float> y(size_t(s.rows * s.n), NAN);
    BatchedGemv(x.data(), w.data(), y.data(), s.rows, s.n, s.k);
    ExpectNear(y, want, s.k);
    std::fill(y.begin(), y.end(), NAN);
    BatchedGemvPortable(x.data(), w.data(), y.data(), s.rows, s.n, s.k);
    ExpectNear(y, want, s.k);
  }
}

TEST(BatchedGemvTest, EachRowIsTheSameWhateverTheRowCount) {
  // A token's logits must not depend on how many tokens share its step: bitwise equal. Decode-
  // sized steps, and prefill-sized ones whose rows span several L2 panels (k = 4096: 6 rows a
  // panel; k = 700: 45).
  std::mt19937 rng(5);
  for (const Shape& s : std::vector<Shape>{{16, 37, 203}, {40, 13, 4096}, {200, 70, 700}}) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n << " k " << s.k);
    const std::vector<float> x = Random(s.rows * s.k, rng), w = Random(s.n * s.k, rng);
    std::vector<float> all(size_t(s.rows * s.n));
    BatchedGemv(x.data(), w.data(), all.data(), s.rows, s.n, s.k);
    for (int64_t rows = 1; rows < s.rows; ++rows) {
      for (int64_t first = 0; first + rows <= s.rows; first += rows) {
        std::vector<float> part(size_t(rows * s.n));
        BatchedGemv(x.data() + first * s.k, w.data(), part.data(), rows, s.n, s.k);
        for (int64_t i = 0; i < rows * s.n; ++i) {
          ASSERT_EQ(part[size_t(i)], all[size_t(first * s.n + i)]) << "rows " << rows << " first " << first << " i " << i;
        }
      }
    }
  }
}

TEST(BatchedGemvTest, ThreadsGiveTheSameBitsAsOne) {
  // Split across a pool (every shape, some below the size that splits), bitwise the single
  // thread's result: each y[r, j] is one thread's sum in the same order.
  std::mt19937 rng(7);
  ParallelFor pool(3);
  for (const Shape& s : std::vector<Shape>{
           {1, 8192, 512}, {9, 1408, 512}, {16, 515, 257}, {2, 5, 9}, {3, 13, 4096}, {300, 1408, 512}}) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n << " k " << s.k);
    const std::vector<float> x = Random(s.rows * s.k, rng), w = Random(s.n * s.k, rng);
    std::vector<float> one(size_t(s.rows * s.n)), split(size_t(s.rows * s.n), NAN);
    BatchedGemv(x.data(), w.data(), one.data(), s.rows, s.n, s.k);
    BatchedGemv(x.data(), w.data(), split.data(), s.rows, s.n, s.k, &pool);
    for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(split[i], one[i]) << "i " << i;
  }
}

}  // namespace
}  // namespace duet
