#include "backends/cpu/cpu_gemv.h"

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

std::vector<float> Random(int64_t size, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(size));
  for (float& f : v) f = dist(rng);
  return v;
}

// The same values rounded to bfloat16 (to nearest even), as a bf16 checkpoint's weights are.
std::vector<float> RoundedToBFloat16(std::vector<float> v) {
  for (float& f : v) {
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    f = std::bit_cast<float>((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
  }
  return v;
}

// The same values rounded to float16, as an fp16 checkpoint's weights are.
std::vector<float> RoundedToFloat16(std::vector<float> v) {
  for (float& f : v) f = float(_Float16(f));
  return v;
}

using Storage = PackedWeights::Storage;

// Random weights whose values `storage` holds exactly (so PackedWeights picks it).
std::vector<float> RandomWeights(int64_t size, Storage storage, std::mt19937& rng) {
  std::vector<float> w = Random(size, rng);
  if (storage == Storage::kBFloat16) return RoundedToBFloat16(std::move(w));
  if (storage == Storage::kFloat16) return RoundedToFloat16(std::move(w));
  return w;
}

const char* Name(Storage storage) {
  return storage == Storage::kFloat32 ? " f32" : storage == Storage::kBFloat16 ? " bf16" : " fp16";
}

constexpr Storage kAllStorages[] = {Storage::kFloat32, Storage::kBFloat16, Storage::kFloat16};

// float32 sums of k products of values in [-1, 1]: error grows about like sqrt(k)·eps·|terms|.
void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, int64_t k) {
  ASSERT_EQ(got.size(), want.size());
  const float tolerance = 4e-6f * float(k);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], tolerance) << "element " << i;
}

// y[r, j] = fma(x[r, c], w[j, c], y[r, j]) from 0 for c = 0, 1, …, k - 1, in T. In float: the
// product as BatchedGemv defines it, whose bits both kernels must give. In double: the reference
// those chains must be near.
template <typename T>
std::vector<float> FmaChains(const std::vector<float>& x, const std::vector<float>& w, int64_t rows, int64_t n,
                             int64_t k) {
  std::vector<float> y(size_t(rows * n));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      T sum = 0;
      for (int64_t c = 0; c < k; ++c) sum = std::fma(T(x[size_t(r * k + c)]), T(w[size_t(j * k + c)]), sum);
      y[size_t(r * n + j)] = float(sum);
    }
  }
  return y;
}

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
}

struct Shape {
  int64_t rows, n, k;
};

TEST(BatchedGemvTest, PackedWeightsKeepEveryRow) {
  std::mt19937 rng(2);
  for (const int64_t n : {1, 15, 16, 17, 37}) {
    const int64_t k = 19;
    const std::vector<float> w = Random(n * k, rng);
    const PackedWeights packed(w.data(), n, k);
    ASSERT_EQ(packed.num_panels(), (n + 15) / 16);
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t j = 0; j < n; ++j) {
      packed.CopyRow(j, row.data());
      for (int64_t c = 0; c < k; ++c) ASSERT_EQ(row[size_t(c)], w[size_t(j * k + c)]) << "n " << n << " j " << j;
    }
  }
}

TEST(BatchedGemvTest, SixteenBitWeightsAreStoredSoAndKeepEveryRow) {
  std::mt19937 rng(11);
  for (const Storage storage : {Storage::kBFloat16, Storage::kFloat16}) {
    for (const int64_t n : {1, 15, 16, 17, 37}) {
      const int64_t k = 19;
      SCOPED_TRACE(testing::Message() << "n " << n << Name(storage));
      const std::vector<float> w = RandomWeights(n * k, storage, rng);
      const PackedWeights packed(w.data(), n, k);
      ASSERT_EQ(packed.storage(), storage);
      std::vector<float> row(static_cast<size_t>(k));
      for (int64_t j = 0; j < n; ++j) {
        packed.CopyRow(j, row.data());
        for (int64_t c = 0; c < k; ++c) ASSERT_EQ(row[size_t(c)], w[size_t(j * k + c)]) << "j " << j;
      }
    }
  }
}

TEST(BatchedGemvTest, StorageIsTheNarrowestThatHoldsEveryValueExactly) {
  auto storage = [](std::vector<float> w) { return PackedWeights(w.data(), 1, int64_t(w.size())).storage(); };
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(storage({1.0f, -0.0f, 0.5f, 3.0f, -inf}), Storage::kBFloat16);
  // float16 values that are no bfloat16: 11 significant bits, the largest finite, subnormals
  // (the smallest, 2^-24, and 2^-24 · 1023).
  EXPECT_EQ(storage({1.0f + 1.0f / 1024, 65504.0f, std::ldexp(1.0f, -24), 1023 * std::ldexp(1.0f, -24), inf}),
            Storage::kFloat16);
  // Not float16: 12 significant bits, past the largest finite, below the smallest subnormal,
  // a subnormal's bit below its last, NaN.
  EXPECT_EQ(storage({1.0f + 1.0f / 2048}), Storage::kFloat32);
  EXPECT_EQ(storage({1.0f + 1.0f / 1024, 65520.0f}), Storage::kFloat32);
  EXPECT_EQ(storage({1.0f + 1.0f / 1024, std::ldexp(1.0f, -25)}), Storage::kFloat32);
  EXPECT_EQ(storage({1.0f + 1.0f / 1024, std::ldexp(3.0f, -25)}), Storage::kFloat32);
  EXPECT_EQ(storage({1.0f + 1.0f / 1024, std::numeric_limits<float>::quiet_NaN()}), Storage::kFloat32);
  // Every float16 bit pattern but NaN's is a float16 value, stored as itself.
  std::vector<float> every;
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const _Float16 h = std::bit_cast<_Float16>(uint16_t(bits));
    if (h == h) every.push_back(float(h));
  }
  const PackedWeights packed(every.data(), 1, int64_t(every.size()));
  ASSERT_EQ(packed.storage(), Storage::kFloat16);
  std::vector<float> row(every.size());
  packed.CopyRow(0, row.data());
  for (size_t i = 0; i < every.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(row[i]), std::bit_cast<uint32_t>(every[i])) << i;
  }
}

TEST(BatchedGemvTest, BothKernelsAreTheFmaChainsAtSeveralRowCountsAndOddShapes) {
  std::mt19937 rng(3);
  // Row counts that end in every tile height (1-6 rows of the 6-row tile) and a prefill-sized
  // one over two row blocks (192 rows) that ends in a short tile; n around and off the
  // 16-feature panel; k off the 8-lane vector and around the 256-column blocks (and tiny shapes).
  const std::vector<Shape> shapes = {
      {1, 1, 1},      {1, 3, 7},     {2, 5, 9},      {3, 4, 8},      {1, 64, 512},   {2, 67, 515},
      {4, 16, 256},   {5, 130, 64},  {6, 17, 257},   {7, 33, 1409},  {8, 15, 255},   {9, 1024, 512},
      {10, 48, 300},  {11, 31, 17},  {15, 31, 17},   {16, 257, 264}, {17, 9, 40},    {32, 12, 100},
      {197, 20, 513}, {301, 67, 515}};
  for (const Shape& s : shapes) {
    for (const Storage storage : kAllStorages) {
      SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n << " k " << s.k << Name(storage));
      const std::vector<float> x = Random(s.rows * s.k, rng), w = RandomWeights(s.n * s.k, storage, rng);
      const PackedWeights packed(w.data(), s.n, s.k);
      ASSERT_EQ(packed.storage(), storage);
      const std::vector<float> want = FmaChains<float>(x, w, s.rows, s.n, s.k);
      ExpectNear(want, FmaChains<double>(x, w, s.rows, s.n, s.k), s.k);
      std::vector<float> y(size_t(s.rows * s.n), NAN);
      BatchedGemv(x.data(), packed, y.data(), s.rows);
      ExpectSameBits(y, want);
      std::fill(y.begin(), y.end(), NAN);
      BatchedGemvPortable(x.data(), packed, y.data(), s.rows);
      ExpectSameBits(y, want);
    }
  }
}

TEST(BatchedGemvTest, EachRowIsTheSameWhateverTheRowCount) {
  // A token's logits must not depend on how many tokens share its step: bitwise equal. Decode-
  // sized steps (up to 6 rows every chain runs through k at once, above in 256-column blocks),
  // and prefill-sized ones over several column blocks and row blocks of 192.
  std::mt19937 rng(5);
  for (const Shape& s : std::vector<Shape>{{16, 37, 203}, {40, 13, 4096}, {200, 70, 700}, {400, 20, 300}}) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n << " k " << s.k);
    const std::vector<float> x = Random(s.rows * s.k, rng), w = Random(s.n * s.k, rng);
    const PackedWeights packed(w.data(), s.n, s.k);
    std::vector<float> all(size_t(s.rows * s.n));
    BatchedGemv(x.data(), packed, all.data(), s.rows);
    for (int64_t rows = 1; rows < s.rows; ++rows) {
      for (int64_t first = 0; first + rows <= s.rows; first += rows) {
        std::vector<float> part(size_t(rows * s.n));
        BatchedGemv(x.data() + first * s.k, packed, part.data(), rows);
        for (int64_t i = 0; i < rows * s.n; ++i) {
          ASSERT_EQ(part[size_t(i)], all[size_t(first * s.n + i)]) << "rows " << rows << " first " << first << " i " << i;
        }
      }
    }
  }
}

TEST(BatchedGemvTest, ThreadsGiveTheSameBitsAsOne) {
  // Split across pools (every shape, some below the size that splits; panels that do not
  // divide evenly, a last panel short of 16 features; float32, bfloat16 and float16 panels),
  // bitwise the single thread's result: each y[r, j] is one thread's chain.
  std::mt19937 rng(7);
  ParallelFor pool2(2), pool3(3);
  for (const Shape& s : std::vector<Shape>{{1, 8192, 512},
                                           {9, 1408, 512},
                                           {16, 515, 257},
                                           {2, 5, 9},
                                           {3, 13, 4096},
                                           {300, 1408, 512},
                                           {200, 1000, 300}}) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " n " << s.n << " k " << s.k);
    const std::vector<float> x = Random(s.rows * s.k, rng), w = Random(s.n * s.k, rng);
    for (const PackedWeights& packed : {PackedWeights(w.data(), s.n, s.k),
                                        PackedWeights(RoundedToBFloat16(w).data(), s.n, s.k),
                                        PackedWeights(RoundedToFloat16(w).data(), s.n, s.k)}) {
      std::vector<float> one(size_t(s.rows * s.n));
      BatchedGemv(x.data(), packed, one.data(), s.rows);
      for (ParallelFor* pool : {&pool2, &pool3}) {
        std::vector<float> split(size_t(s.rows * s.n), NAN);
        BatchedGemv(x.data(), packed, split.data(), s.rows, pool);
        ExpectSameBits(split, one);
      }
    }
  }
}

}  // namespace
}  // namespace duet
