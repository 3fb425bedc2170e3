#include "kernels/sampling/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/graph_test_util.h"
#include "kernels/kernel_test_util.h"
#include "kernels/sampling/sampling_reference.h"

namespace duet::kernels {
namespace {


constexpr int kLlamaVocab = 128256;
constexpr int kTinyVocab = 8192;

struct Filters {
  float temperature = 1.f;
  int top_k = 0;
  float top_p = 1.f;
  float min_p = 0.f;
};

std::vector<float> NormalLogits(size_t n, uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Distinct logits: a random permutation of lo + (hi - lo) * i / n (no ties anywhere).
std::vector<float> DistinctLogits(int n, uint64_t seed, float lo, float hi) {
  std::vector<int> ids(n);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = lo + (hi - lo) * float(ids[i]) / float(n);
  return v;
}

std::vector<float> Repeat(const std::vector<float>& row, int rows) {
  std::vector<float> all;
  all.reserve(row.size() * rows);
  for (int r = 0; r < rows; ++r) all.insert(all.end(), row.begin(), row.end());
  return all;
}

struct SampleOutput {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

// Grammar masks for SampleTokens: `bitmask` [masks, words], `index` [rows] (-1: none).
struct Masks {
  int words = 0;
  std::vector<uint32_t> bitmask;
  std::vector<int32_t> index;
};

// A mask allowing each token with probability `density` (and token `always`, so it allows one).
std::vector<uint32_t> RandomMask(int vocab, double density, uint64_t seed, int always) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution allow(density);
  std::vector<uint32_t> mask((vocab + 31) / 32, 0);
  for (int t = 0; t < vocab; ++t) {
    if (allow(rng) || t == always) mask[t / 32] |= 1u << (t % 32);
  }
  return mask;
}
bool Allowed(const std::vector<uint32_t>& mask, int t) { return (mask[t / 32] >> (t % 32)) & 1; }
// The row as the kernel should see it under `mask`: disallowed logits at -infinity.
std::vector<float> MaskedRow(const float* row, int vocab, const std::vector<uint32_t>& mask) {
  std::vector<float> out(row, row + vocab);
  for (int t = 0; t < vocab; ++t) {
    if (!Allowed(mask, t)) out[t] = -INFINITY;
  }
  return out;
}

// SampleTokens over device logits [rows, vocab] with one Filters per row, seed `seed` for every
// row and offsets first_offset + r, and grammar masks when given.
SampleOutput Sample(const float* logits, int vocab, const std::vector<Filters>& filters, uint64_t seed,
                    uint64_t first_offset, const Masks* masks = nullptr) {
  const int rows = int(filters.size());
  std::vector<float> temperature(rows), top_p(rows), min_p(rows);
  std::vector<int32_t> top_k(rows);
  std::vector<uint64_t> seeds(rows, seed), offsets(rows);
  for (int r = 0; r < rows; ++r) {
    temperature[r] = filters[r].temperature;
    top_k[r] = filters[r].top_k;
    top_p[r] = filters[r].top_p;
    min_p[r] = filters[r].min_p;
    offsets[r] = first_offset + r;
  }
  DeviceBuffer<float> d_temperature(temperature), d_top_p(top_p), d_min_p(min_p);
  DeviceBuffer<int32_t> d_top_k(top_k);
  DeviceBuffer<uint64_t> d_seeds(seeds), d_offsets(offsets);
  DeviceBuffer<int32_t> d_tokens(rows);
  DeviceBuffer<float> d_logprobs(rows);
  d_tokens.Poison();
  d_logprobs.Poison();
  SamplingParams p{logits,        rows,          vocab,           d_temperature.get(), d_top_k.get(), d_top_p.get(),
                   d_min_p.get(), d_seeds.get(), d_offsets.get(), d_tokens.get(),      d_logprobs.get()};
  std::optional<DeviceBuffer<uint32_t>> d_bitmask;
  std::optional<DeviceBuffer<int32_t>> d_index;
  if (masks != nullptr) {
    d_bitmask.emplace(masks->bitmask);
    d_index.emplace(masks->index);
    p.token_bitmask = d_bitmask->get();
    p.bitmask_index = d_index->get();
    p.bitmask_words = masks->words;
  }
  SampleTokens(p, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  return {d_tokens.Download(), d_logprobs.Download()};
}
SampleOutput Sample(const std::vector<float>& logits, int vocab, const std::vector<Filters>& filters, uint64_t seed,
                    uint64_t first_offset, const Masks* masks = nullptr) {
  const DeviceBuffer<float> d_logits(logits);
  return Sample(d_logits.get(), vocab, filters, seed, first_offset, masks);
}

// Draws `draws` tokens from copies of one row (seed 77, offsets 0 .. draws - 1), uploading at
// most `rows_per_launch` copies once.
std::vector<int32_t> DrawMany(const std::vector<float>& row, const Filters& f, int draws, int rows_per_launch) {
  const int vocab = int(row.size());
  const DeviceBuffer<float> copies(Repeat(row, std::min(draws, rows_per_launch)));
  std::vector<int32_t> tokens;
  for (int first = 0; first < draws; first += rows_per_launch) {
    const int rows = std::min(rows_per_launch, draws - first);
    const SampleOutput out = Sample(copies.get(), vocab, std::vector<Filters>(rows, f), 77, uint64_t(first));
    tokens.insert(tokens.end(), out.tokens.begin(), out.tokens.end());
  }
  return tokens;
}

std::vector<double> Reference(const std::vector<float>& row, const Filters& f) {
  return reference::FilteredDistribution(row.data(), int(row.size()), f.temperature, f.top_k, f.top_p, f.min_p);
}

// The reference with its min_p / top_p boundaries moved by `slack` (1e-4: far more than the
// kernel's float rounding): slack > 0 keeps a superset, slack < 0 a subset of the exact set.
std::vector<double> Loosened(const std::vector<float>& row, const Filters& f, double slack) {
  const float top_p = f.top_p < 1.f ? float(std::min(1.0, f.top_p + slack)) : 1.f;
  return reference::FilteredDistribution(row.data(), int(row.size()), f.temperature, f.top_k, top_p,
                                         float(f.min_p * (1 - slack)));
}
// Every token the kernel may draw (a superset of the exact reference set).
std::vector<double> Support(const std::vector<float>& row, const Filters& f) { return Loosened(row, f, 1e-4); }

// True when float rounding can move a min_p / top_p boundary only across tokens of negligible
// mass (< 1e-3 together), so that the exact reference is a fair chi-square target.
bool WellConditioned(const std::vector<float>& row, const Filters& f) {
  const std::vector<double> exact = Reference(row, f), loose = Loosened(row, f, 1e-4), tight = Loosened(row, f, -1e-4);
  double extra = 0, missing = 0;
  for (size_t t = 0; t < row.size(); ++t) {
    if (exact[t] == 0) extra += loose[t];
    if (tight[t] == 0) missing += exact[t];
  }
  return extra < 1e-3 && missing < 1e-3;
}

// The upper 0.001 quantile of chi-square with df degrees of freedom (Wilson-Hilferty).
double ChiSquareCritical(int df) {
  const double z = 3.090232;  // standard normal upper 0.001 quantile
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

// Checks that `tokens` stay inside `support` (default: where probs > 0) and pass a chi-square
// goodness-of-fit test (alpha 0.001) against `probs`; categories expecting fewer than 5 draws are pooled.
void ExpectDistribution(const std::vector<int32_t>& tokens, const std::vector<double>& probs,
                        const std::vector<double>* support = nullptr) {
  const int vocab = int(probs.size());
  std::vector<int64_t> counts(vocab, 0);
  for (int32_t t : tokens) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, vocab);
    ++counts[t];
  }
  for (int t = 0; t < vocab; ++t) {
    if ((support != nullptr ? (*support)[t] : probs[t]) == 0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " is outside the filtered set";
    }
  }
  const double n = double(tokens.size());
  double chi2 = 0, pooled_expected = 0, pooled_observed = 0;
  int categories = 0;
  for (int t = 0; t < vocab; ++t) {
    const double expected = probs[t] * n;
    if (expected < 5) {
      pooled_expected += expected;
      pooled_observed += double(counts[t]);
      continue;
    }
    chi2 += (counts[t] - expected) * (counts[t] - expected) / expected;
    ++categories;
  }
  if (pooled_expected >= 5) {
    chi2 += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) / pooled_expected;
    ++categories;
  }
  if (categories < 2) return;  // one category: nothing to test beyond the support
  EXPECT_LT(chi2, ChiSquareCritical(categories - 1)) << categories << " categories";
}

// ---------------------------------------------------------------------------------------------
// The CPU reference itself (runs without a GPU).

TEST(SamplingReference, Fp32FiltersInVllmOrder) {
  // Weights relative to the max at temperature 1: exp(0), exp(-1), exp(-2), exp(-3).
  const std::vector<float> logits = {-1.f, 0.f, -3.f, -2.f};
  const double e1 = std::exp(-1.0), e2 = std::exp(-2.0), e3 = std::exp(-3.0);
  auto probs = [&](Filters f) { return Reference(logits, f); };

  std::vector<double> p = probs({});
  const double z = 1 + e1 + e2 + e3;
  EXPECT_NEAR(p[1], 1 / z, 1e-12);
  EXPECT_NEAR(p[2], e3 / z, 1e-12);

  p = probs({1.f, /*top_k=*/2});
  EXPECT_NEAR(p[1], 1 / (1 + e1), 1e-12);
  EXPECT_NEAR(p[0], e1 / (1 + e1), 1e-12);
  EXPECT_EQ(p[2], 0);
  EXPECT_EQ(p[3], 0);

  // min_p 0.2 keeps weights >= 0.2: exp(0), exp(-1) (0.37); exp(-2) = 0.135 goes.
  p = probs({1.f, 0, 1.f, /*min_p=*/0.2f});
  EXPECT_EQ(p[3], 0);
  EXPECT_NEAR(p[1], 1 / (1 + e1), 1e-12);

  // top_p 0.7: the max alone holds 1/z = 0.64 < 0.7, so two tokens.
  p = probs({1.f, 0, /*top_p=*/0.7f});
  EXPECT_GT(p[0], 0);
  EXPECT_EQ(p[3], 0);
  p = probs({1.f, 0, /*top_p=*/0.6f});
  EXPECT_NEAR(p[1], 1.0, 1e-12);

  // top_p over the top_k survivors' renormalized mass: with top_k 2 the max holds 1/(1+e1) = 0.73.
  p = probs({1.f, 2, 0.72f});
  EXPECT_NEAR(p[1], 1.0, 1e-12);

  // Temperature 0.5 doubles the logit gaps: exp(-2) relative weight for token 0.
  p = probs({0.5f});
  EXPECT_NEAR(p[0] / p[1], e2, 1e-12);
}

TEST(SamplingReference, Fp32TiesKeptByLowestId) {
  const std::vector<float> logits = {1.f, 2.f, 2.f, 2.f};
  const std::vector<double> p = reference::FilteredDistribution(logits.data(), 4, 1.f, 2, 1.f, 0.f);
  EXPECT_NEAR(p[1], 0.5, 1e-12);
  EXPECT_NEAR(p[2], 0.5, 1e-12);
  EXPECT_EQ(p[3], 0);
  EXPECT_EQ(reference::Argmax(logits.data(), 4), 1);
  EXPECT_NEAR(reference::LogSoftmax(logits.data(), 4, 0), 1 - std::log(std::exp(1.0) + 3 * std::exp(2.0)), 1e-12);
}

TEST(SamplingReference, Fp32ChiSquareCriticalValues) {
  // Tabulated upper 0.001 quantiles.
  EXPECT_NEAR(ChiSquareCritical(10), 29.588, 0.3);
  EXPECT_NEAR(ChiSquareCritical(30), 59.703, 0.3);
  EXPECT_NEAR(ChiSquareCritical(63), 103.442, 0.5);
}

// ---------------------------------------------------------------------------------------------
// Greedy.

void CheckGreedy(int rows, int vocab, uint64_t seed) {
  std::vector<float> logits = NormalLogits(size_t(rows) * vocab, seed, 3.f);
  // Row 0: the max repeated at three places; the lowest index must win.
  if (vocab >= 100) {
    for (int i : {vocab - 1, 97, 42}) logits[i] = 50.f;
  }
  const SampleOutput out = Sample(logits, vocab, std::vector<Filters>(rows, Filters{0.f, 5, 0.5f, 0.1f}), 1, 0);
  for (int r = 0; r < rows; ++r) {
    const float* row = logits.data() + size_t(r) * vocab;
    const int32_t expected = reference::Argmax(row, vocab);
    EXPECT_EQ(out.tokens[r], expected) << "row " << r;
    EXPECT_NEAR(out.logprobs[r], reference::LogSoftmax(row, vocab, expected), 2e-4) << "row " << r;
  }
  if (vocab >= 100) {
    EXPECT_EQ(out.tokens[0], 42);
  }
}

TEST(SampleTokens, Fp32GreedyMatchesArgmaxLlama8bVocab) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGreedy(/*rows=*/7, kLlamaVocab, 1);
}

TEST(SampleTokens, Fp32GreedyMatchesArgmaxTinyVocab) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGreedy(/*rows=*/33, kTinyVocab, 2);
  CheckGreedy(/*rows=*/1, kTinyVocab, 3);
}

TEST(SampleTokens, Fp32GreedyMatchesArgmaxOddVocab) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGreedy(/*rows=*/3, /*vocab=*/1001, 4);  // not a multiple of 4: scalar loads
  CheckGreedy(/*rows=*/2, /*vocab=*/7, 5);
}

TEST(SampleTokens, Fp32GreedyAllEqualLogitsPicksZero) {
  DUET_SKIP_WITHOUT_GPU();
  const SampleOutput out = Sample(std::vector<float>(kTinyVocab, 0.25f), kTinyVocab, {Filters{0.f}}, 1, 0);
  EXPECT_EQ(out.tokens[0], 0);
  EXPECT_NEAR(out.logprobs[0], -std::log(double(kTinyVocab)), 1e-4);
}

// ---------------------------------------------------------------------------------------------
// Seeded draws.

TEST(SampleTokens, Fp32SeededDrawsReproducible) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 64;
  const std::vector<float> logits = NormalLogits(size_t(rows) * kTinyVocab, 6, 2.f);
  for (const Filters& f : {Filters{1.f}, Filters{0.8f, 50, 0.9f}, Filters{1.2f, 0, 1.f, 0.05f}}) {
    const std::vector<Filters> filters(rows, f);
    const SampleOutput a = Sample(logits, kTinyVocab, filters, 1234, 0);
    const SampleOutput b = Sample(logits, kTinyVocab, filters, 1234, 0);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.logprobs, b.logprobs);
    // A different seed or offset draws differently somewhere among 64 rows.
    EXPECT_NE(Sample(logits, kTinyVocab, filters, 1235, 0).tokens, a.tokens);
    EXPECT_NE(Sample(logits, kTinyVocab, filters, 1234, 1000).tokens, a.tokens);
  }
}

TEST(SampleTokens, Fp32LogprobIsRawLogSoftmax) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 16;
  const std::vector<float> logits = NormalLogits(size_t(rows) * kLlamaVocab, 7, 3.f);
  const SampleOutput out = Sample(logits, kLlamaVocab, std::vector<Filters>(rows, Filters{0.7f, 40, 0.9f}), 9, 0);
  for (int r = 0; r < rows; ++r) {
    const float* row = logits.data() + size_t(r) * kLlamaVocab;
    EXPECT_NEAR(out.logprobs[r], reference::LogSoftmax(row, kLlamaVocab, out.tokens[r]), 2e-4) << "row " << r;
  }
}

// ---------------------------------------------------------------------------------------------
// Distribution.

// Draws `draws` tokens from copies of `row` under `f` (in launches of at most `rows_per_launch`
// rows) and compares them with the reference distribution. The logits are re-drawn (seed + 1,
// ...) until no float rounding can move a min_p / top_p boundary.
void CheckDistribution(int vocab, float stddev, const Filters& f, int draws, uint64_t seed, int rows_per_launch = 50000) {
  std::vector<float> row = NormalLogits(vocab, seed, stddev);
  for (int tries = 0; !WellConditioned(row, f); ++tries) {
    ASSERT_LT(tries, 100);
    row = NormalLogits(vocab, ++seed, stddev);
  }
  const std::vector<double> support = Support(row, f);
  ExpectDistribution(DrawMany(row, f, draws, rows_per_launch), Reference(row, f), &support);
}

TEST(SampleTokens, Fp32ChiSquareSmallVocab) {
  DUET_SKIP_WITHOUT_GPU();
  const std::vector<Filters> settings = {
      {1.f},                       // temperature only
      {0.7f, /*top_k=*/10},        //
      {1.3f, 0, /*top_p=*/0.8f},   //
      {1.f, 0, 1.f, /*min_p=*/0.1f},
      {0.9f, 20, 0.9f, 0.05f},     // all three
      {2.f, 5},                    //
      {0.5f, 0, 0.5f},             //
      {1.f, 1},                    // top_k 1: the argmax
  };
  for (size_t i = 0; i < settings.size(); ++i) {
    const Filters& f = settings[i];
    SCOPED_TRACE(::testing::Message() << "T " << f.temperature << " top_k " << f.top_k << " top_p " << f.top_p
                                      << " min_p " << f.min_p);
    CheckDistribution(/*vocab=*/48, /*stddev=*/1.5f, f, /*draws=*/40000, 100 + 10 * i);
  }
}

TEST(SampleTokens, Fp32ChiSquareOddVocab) {
  DUET_SKIP_WITHOUT_GPU();
  CheckDistribution(/*vocab=*/37, 1.f, {1.f, 12, 0.95f}, 40000, 300);
  CheckDistribution(/*vocab=*/64, 1.f, {0.8f}, 40000, 310);
}

TEST(SampleTokens, Fp32ChiSquareLlama8bVocab) {
  DUET_SKIP_WITHOUT_GPU();
  // LLM-like rows: most mass on a few dozen tokens.
  for (const Filters& f : {Filters{1.f, 50}, Filters{0.8f, 0, 0.9f}, Filters{1.f, 0, 1.f, 0.02f}, Filters{1.f, 100, 0.95f, 0.01f}}) {
    SCOPED_TRACE(::testing::Message() << "T " << f.temperature << " top_k " << f.top_k << " top_p " << f.top_p
                                      << " min_p " << f.min_p);
    CheckDistribution(kLlamaVocab, /*stddev=*/2.5f, f, /*draws=*/4096, 400, /*rows_per_launch=*/512);
  }
}

TEST(SampleTokens, Fp32ChiSquareTinyVocab) {
  DUET_SKIP_WITHOUT_GPU();
  CheckDistribution(kTinyVocab, 2.5f, {1.f, 0, 0.95f}, 8192, 500, 4096);
  CheckDistribution(kTinyVocab, 2.5f, {0.6f, 20}, 8192, 510, 4096);
}

// Draws many rows from a flat distribution where the top_k / top_p set is far larger than the
// shared-memory candidate buffer (the bisection path); checks the support exactly and the
// distribution over ten groups of tokens ranked by logit.
void CheckLargeSet(const Filters& f, uint64_t seed) {
  const int vocab = kLlamaVocab;
  std::vector<float> row = DistinctLogits(vocab, seed, -0.5f, 0.5f);
  for (int tries = 0; !WellConditioned(row, f); ++tries) {
    ASSERT_LT(tries, 100);
    row = DistinctLogits(vocab, ++seed, -0.5f, 0.5f);
  }
  const std::vector<double> probs = Reference(row, f), support = Support(row, f);
  const std::vector<int32_t> tokens = DrawMany(row, f, /*draws=*/4096, /*rows_per_launch=*/512);
  // Groups: kept tokens ranked by logit, cut into 10 equal-count groups.
  std::vector<int32_t> kept;
  for (int t = 0; t < vocab; ++t) {
    if (probs[t] > 0) kept.push_back(t);
  }
  ASSERT_GT(kept.size(), 16384u) << "the case must exceed the candidate buffer";
  std::sort(kept.begin(), kept.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  std::vector<int> group(vocab, -1);
  std::vector<double> group_probs(10, 0.0);
  for (size_t i = 0; i < kept.size(); ++i) {
    group[kept[i]] = int(i * 10 / kept.size());
    group_probs[group[kept[i]]] += probs[kept[i]];
  }
  std::vector<int32_t> grouped;
  for (int32_t t : tokens) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, vocab);
    ASSERT_GT(support[t], 0) << "token " << t << " is outside the filtered set";
    grouped.push_back(group[t] >= 0 ? group[t] : 9);  // a boundary token rounding let in: the last group
  }
  ExpectDistribution(grouped, group_probs);
}

TEST(SampleTokens, Fp32LargeTopKBeyondCandidateBuffer) {
  DUET_SKIP_WITHOUT_GPU();
  CheckLargeSet({1.f, /*top_k=*/60000}, 600);
}

TEST(SampleTokens, Fp32LargeTopPBeyondCandidateBuffer) {
  DUET_SKIP_WITHOUT_GPU();
  CheckLargeSet({1.f, 0, /*top_p=*/0.5f}, 610);
  CheckLargeSet({0.9f, 70000, 0.7f, /*min_p=*/0.4f}, 620);
}

TEST(SampleTokens, Fp32FiltersNeverLeakLlama8bVocab) {
  DUET_SKIP_WITHOUT_GPU();
  // Many different rows (fresh logits each), every draw inside the reference's kept set.
  const int rows = 128;
  for (const Filters& f : {Filters{1.f, 50}, Filters{1.f, 0, 0.9f}, Filters{0.7f, 0, 1.f, 0.1f},
                           Filters{1.5f, 1000, 0.95f}, Filters{1.f, 3}, Filters{1.f, 20000}}) {
    SCOPED_TRACE(::testing::Message() << "T " << f.temperature << " top_k " << f.top_k << " top_p " << f.top_p
                                      << " min_p " << f.min_p);
    std::vector<float> logits;
    uint64_t seed = 700;
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> row = NormalLogits(kLlamaVocab, seed++, 2.f);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    const SampleOutput out = Sample(logits, kLlamaVocab, std::vector<Filters>(rows, f), 3, 0);
    for (int r = 0; r < rows; ++r) {
      const std::vector<float> row(logits.begin() + size_t(r) * kLlamaVocab, logits.begin() + size_t(r + 1) * kLlamaVocab);
      ASSERT_GE(out.tokens[r], 0);
      ASSERT_LT(out.tokens[r], kLlamaVocab);
      EXPECT_GT(Support(row, f)[out.tokens[r]], 0) << "row " << r << " token " << out.tokens[r];
    }
  }
}

TEST(SampleTokens, Fp32MixedRowsInOneBatch) {
  DUET_SKIP_WITHOUT_GPU();
  // Greedy and differently filtered rows side by side; each row matches its own reference.
  const int vocab = 48, copies = 8000;
  const std::vector<Filters> kinds = {{0.f}, {1.f, 3}, {0.7f, 0, 0.6f}, {-1.f}};
  auto well_conditioned = [&](const std::vector<float>& row) {
    return std::all_of(kinds.begin(), kinds.end(), [&](const Filters& f) { return WellConditioned(row, f); });
  };
  uint64_t seed = 800;
  std::vector<float> row = NormalLogits(vocab, seed, 1.5f);
  while (!well_conditioned(row)) row = NormalLogits(vocab, ++seed, 1.5f);
  std::vector<Filters> filters;
  for (int i = 0; i < copies; ++i) filters.insert(filters.end(), kinds.begin(), kinds.end());
  const SampleOutput out = Sample(Repeat(row, int(filters.size())), vocab, filters, 11, 0);
  for (size_t k = 0; k < kinds.size(); ++k) {
    std::vector<int32_t> tokens;
    for (size_t r = k; r < filters.size(); r += kinds.size()) tokens.push_back(out.tokens[r]);
    if (kinds[k].temperature <= 0) {
      for (int32_t t : tokens) ASSERT_EQ(t, reference::Argmax(row.data(), vocab));
    } else {
      const std::vector<double> support = Support(row, kinds[k]);
      ExpectDistribution(tokens, Reference(row, kinds[k]), &support);
    }
  }
}

TEST(SampleTokens, Fp32NullArraysMeanGreedyAndNoFilters) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 5;
  const std::vector<float> logits = NormalLogits(size_t(rows) * kTinyVocab, 900, 2.f);
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<int32_t> d_tokens(rows);
  d_tokens.Poison();
  SamplingParams p{};
  p.logits = d_logits.get();
  p.rows = rows;
  p.vocab = kTinyVocab;
  p.tokens_out = d_tokens.get();
  SampleTokens(p, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<int32_t> tokens = d_tokens.Download();
  for (int r = 0; r < rows; ++r) EXPECT_EQ(tokens[r], reference::Argmax(logits.data() + size_t(r) * kTinyVocab, kTinyVocab));
}

// ---------------------------------------------------------------------------------------------
// Grammar masks.

TEST(SampleTokens, Fp32MaskedGreedyTakesTheBestAllowedToken) {
  DUET_SKIP_WITHOUT_GPU();
  // Rows 0-3 masked (sparse, dense, one token, the argmax disallowed), rows 4-5 not: one batch.
  const int rows = 6, vocab = kLlamaVocab;
  const std::vector<float> logits = NormalLogits(size_t(rows) * vocab, 1100, 3.f);
  Masks masks;
  masks.words = (vocab + 31) / 32;
  std::vector<std::vector<uint32_t>> each = {RandomMask(vocab, 0.01, 1, 5), RandomMask(vocab, 0.9, 2, 5),
                                             RandomMask(vocab, 0.0, 3, 127999), RandomMask(vocab, 0.5, 4, 7)};
  // The last mask disallows row 3's own argmax.
  const int argmax3 = reference::Argmax(logits.data() + 3 * size_t(vocab), vocab);
  each[3][argmax3 / 32] &= ~(1u << (argmax3 % 32));
  for (const auto& m : each) masks.bitmask.insert(masks.bitmask.end(), m.begin(), m.end());
  masks.index = {0, 1, 2, 3, -1, -1};
  const SampleOutput out = Sample(logits, vocab, std::vector<Filters>(rows, Filters{0.f}), 1, 0, &masks);
  for (int r = 0; r < rows; ++r) {
    const float* row = logits.data() + size_t(r) * vocab;
    const int expected = r < 4 ? reference::Argmax(MaskedRow(row, vocab, each[r]).data(), vocab)
                               : reference::Argmax(row, vocab);
    EXPECT_EQ(out.tokens[r], expected) << "row " << r;
    EXPECT_NEAR(out.logprobs[r], reference::LogSoftmax(row, vocab, out.tokens[r]), 2e-4) << "row " << r;
  }
  EXPECT_EQ(out.tokens[2], 127999);
  EXPECT_NE(out.tokens[3], argmax3);
}

TEST(SampleTokens, Fp32MaskedDrawsFollowTheMaskedDistribution) {
  DUET_SKIP_WITHOUT_GPU();
  // Chi-square against the reference over the masked row, for each filter kind, on a small vocabulary.
  const int vocab = 96, draws = 40000;
  const std::vector<Filters> settings = {{1.f}, {0.7f, 10}, {1.3f, 0, 0.8f}, {1.f, 0, 1.f, 0.05f}, {0.9f, 20, 0.9f, 0.01f}};
  for (size_t k = 0; k < settings.size(); ++k) {
    const Filters& f = settings[k];
    const std::vector<uint32_t> mask = RandomMask(vocab, 0.5, 10 + k, 0);
    // The kernel gets the raw logits (finite everywhere) and the mask; the reference the masked row.
    uint64_t seed = 1200 + 10 * k;
    std::vector<float> raw, row;
    for (int tries = 0;; ++tries) {
      ASSERT_LT(tries, 100);
      raw = NormalLogits(vocab, seed++, 1.5f);
      row = MaskedRow(raw.data(), vocab, mask);
      if (WellConditioned(row, f)) break;
    }
    Masks masks{(vocab + 31) / 32, mask, std::vector<int32_t>(draws, 0)};
    const SampleOutput out = Sample(Repeat(raw, draws), vocab, std::vector<Filters>(draws, f), 77, 0, &masks);
    for (int32_t t : out.tokens) ASSERT_TRUE(Allowed(mask, t)) << "setting " << k << " drew disallowed " << t;
    const std::vector<double> support = Support(row, f);
    ExpectDistribution(out.tokens, Reference(row, f), &support);
  }
}

TEST(SampleTokens, Fp32MaskedRowsNeverLeakLlama8bVocab) {
  DUET_SKIP_WITHOUT_GPU();
  // Every path of the kernel (threshold only, sorted candidates, bisection past the candidate
  // buffer) draws only allowed tokens; near-flat logits make top_p 0.999 exceed the buffer.
  const int rows = 64, vocab = kLlamaVocab;
  const std::vector<Filters> kinds = {{1.f}, {0.8f, 50}, {1.f, 0, 0.9f}, {1.f, 0, 0.999f}, {1.f, 60000}, {1.f, 0, 1.f, 0.1f}};
  for (size_t k = 0; k < kinds.size(); ++k) {
    const std::vector<float> logits = NormalLogits(size_t(rows) * vocab, 1300 + k, k >= 3 ? 0.05f : 3.f);
    Masks masks;
    masks.words = (vocab + 31) / 32;
    for (int r = 0; r < rows; ++r) {
      const std::vector<uint32_t> m = RandomMask(vocab, r % 2 ? 0.8 : 0.02, 50 * k + r, r);
      masks.bitmask.insert(masks.bitmask.end(), m.begin(), m.end());
      masks.index.push_back(r);
    }
    const SampleOutput out = Sample(logits, vocab, std::vector<Filters>(rows, kinds[k]), 5, 0, &masks);
    for (int r = 0; r < rows; ++r) {
      const int t = out.tokens[r];
      ASSERT_TRUE(t >= 0 && t < vocab);
      const uint32_t word = masks.bitmask[size_t(r) * masks.words + t / 32];
      EXPECT_TRUE((word >> (t % 32)) & 1) << "kind " << k << " row " << r << " drew disallowed " << t;
      EXPECT_NEAR(out.logprobs[r], reference::LogSoftmax(logits.data() + size_t(r) * vocab, vocab, t), 2e-4);
    }
  }
}

TEST(SampleTokens, Fp32GraphCaptureMatchesEager) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 8;
  const std::vector<float> logits = NormalLogits(size_t(rows) * kLlamaVocab, 1000, 2.f);
  const std::vector<Filters> filters = {{0.f}, {1.f}, {0.8f, 50}, {1.f, 0, 0.9f}, {1.f, 0, 1.f, 0.05f},
                                        {0.7f, 40, 0.95f, 0.02f}, {1.f, 60000}, {1.f, 0, 0.999f}};
  const SampleOutput eager = Sample(logits, kLlamaVocab, filters, 42, 7);

  std::vector<float> temperature, top_p, min_p;
  std::vector<int32_t> top_k;
  for (const Filters& f : filters) {
    temperature.push_back(f.temperature);
    top_k.push_back(f.top_k);
    top_p.push_back(f.top_p);
    min_p.push_back(f.min_p);
  }
  DeviceBuffer<float> d_logits(logits), d_temperature(temperature), d_top_p(top_p), d_min_p(min_p);
  DeviceBuffer<int32_t> d_top_k(top_k);
  DeviceBuffer<uint64_t> d_seeds(std::vector<uint64_t>(rows, 42));
  std::vector<uint64_t> offsets(rows);
  std::iota(offsets.begin(), offsets.end(), 7);
  DeviceBuffer<uint64_t> d_offsets(offsets);
  DeviceBuffer<int32_t> d_tokens(rows);
  DeviceBuffer<float> d_logprobs(rows);
  const SamplingParams p{d_logits.get(),  rows,          kLlamaVocab,     d_temperature.get(), d_top_k.get(), d_top_p.get(),
                         d_min_p.get(),   d_seeds.get(), d_offsets.get(), d_tokens.get(),      d_logprobs.get()};
  testing::CaptureAndReplay([&](cudaStream_t stream) { SampleTokens(p, stream); },
                            [&] {
                              d_tokens.Poison();
                              d_logprobs.Poison();
                            });
  EXPECT_EQ(d_tokens.Download(), eager.tokens);
  EXPECT_EQ(d_logprobs.Download(), eager.logprobs);
}

}  // namespace
}  // namespace duet::kernels
