#include "engine/sampler.h"

#include <cmath>
#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "gtest/gtest.h"

namespace duet {
namespace {

std::vector<float> Logits() { return {1.0f, 2.5f, 0.3f, -1.0f, 2.0f, 0.0f, 1.7f, -0.5f}; }

// Pearson chi-square statistic of observed counts against expected probabilities; tokens with
// zero expected probability must never be drawn.
double ChiSquare(const std::vector<int>& counts, const std::vector<float>& probs, int n, int* dof) {
  double chi = 0.0;
  *dof = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] == 0.0f) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " was filtered but drawn";
      continue;
    }
    const double expected = probs[i] * n;
    chi += (counts[i] - expected) * (counts[i] - expected) / expected;
    ++*dof;
  }
  return chi;
}

std::vector<float> Softmax(std::vector<float> l, float temperature) {
  float m = *std::max_element(l.begin(), l.end());
  double sum = 0;
  for (float& x : l) { x = std::exp((x - m) / temperature); sum += x; }
  for (float& x : l) x = float(x / sum);
  return l;
}

TEST(SamplerTest, GreedyPicksFirstMaximum) {
  std::vector<float> l = {0.5f, 3.0f, 3.0f, 1.0f};
  SamplingParams p;
  p.temperature = 0.0f;
  SamplerRng rng(1);
  EXPECT_EQ(Sampler::Sample(absl::MakeSpan(l), p, {}, {}, rng).token, 1);
}

TEST(SamplerTest, SeededSamplingIsDeterministic) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.9f;
  std::vector<int32_t> a, b;
  SamplerRng r1(42), r2(42);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l1 = Logits(), l2 = Logits();
    a.push_back(Sampler::Sample(absl::MakeSpan(l1), p, {}, {}, r1).token);
    b.push_back(Sampler::Sample(absl::MakeSpan(l2), p, {}, {}, r2).token);
  }
  EXPECT_EQ(a, b);
  SamplerRng r3(43);
  std::vector<int32_t> c;
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l = Logits();
    c.push_back(Sampler::Sample(absl::MakeSpan(l), p, {}, {}, r3).token);
  }
  EXPECT_NE(a, c);
}

// Requests without a seed each get their own stream (no two of many start alike).
TEST(SamplerTest, UnseededStreamsDiffer) {
  std::set<uint64_t> firsts;
  for (int i = 0; i < 1000; ++i) {
    SamplerRng rng(std::nullopt);
    firsts.insert(uint64_t(rng.Uniform() * 0x1.0p53));
  }
  EXPECT_EQ(firsts.size(), 1000u);
}

TEST(SamplerTest, TopKTopPMinPFilterAsSpecified) {
  const std::vector<float> full = Softmax(Logits(), 1.0f);
  SamplingParams p;
  p.top_k = 3;
  std::vector<float> probs = Sampler::Probabilities(Logits(), p);
  int kept = 0;
  for (float x : probs) kept += x > 0;
  EXPECT_EQ(kept, 3);
  EXPECT_GT(probs[1], 0); EXPECT_GT(probs[4], 0); EXPECT_GT(probs[6], 0);

  p = SamplingParams();
  p.top_p = 0.5f;  // sorted: 2.5 (p≈.33), 2.0 (≈.20) → crosses 0.5 at the second
  probs = Sampler::Probabilities(Logits(), p);
  EXPECT_GT(probs[1], 0); EXPECT_GT(probs[4], 0);
  EXPECT_EQ(probs[6], 0);
  EXPECT_NEAR(probs[1], full[1] / (full[1] + full[4]), 1e-6);

  p = SamplingParams();
  p.min_p = 0.5f;  // keep tokens with p >= 0.5 · p_max
  probs = Sampler::Probabilities(Logits(), p);
  for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(probs[i] > 0, full[i] >= 0.5f * full[1]) << i;
}

TEST(SamplerTest, PenaltiesFollowVllmSemantics) {
  std::vector<float> l = {2.0f, -2.0f, 1.0f, 1.0f};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  std::vector<int32_t> prompt = {0, 1};
  std::vector<int32_t> output = {2, 2};
  Sampler::ApplyPenalties(absl::MakeSpan(l), p, prompt, output);
  EXPECT_FLOAT_EQ(l[0], 1.0f);    // positive: divided
  EXPECT_FLOAT_EQ(l[1], -4.0f);   // negative: multiplied
  EXPECT_FLOAT_EQ(l[2], 0.5f - 2 * 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(l[3], 1.0f);
}

TEST(SamplerTest, LogprobsAreOfTheRawDistribution) {
  std::vector<float> l = Logits();
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = 2;
  SamplerRng rng(0);
  SampledToken t = Sampler::Sample(absl::MakeSpan(l), p, {}, {}, rng);
  const std::vector<float> probs = Softmax(Logits(), 1.0f);
  EXPECT_EQ(t.token, 1);
  EXPECT_NEAR(t.logprob, std::log(probs[1]), 1e-5);
  ASSERT_EQ(t.top_logprobs.size(), 2u);
  EXPECT_EQ(t.top_logprobs[0].token, 1);
  EXPECT_EQ(t.top_logprobs[1].token, 4);
  EXPECT_NEAR(t.top_logprobs[1].logprob, std::log(probs[4]), 1e-5);
}

// OpenAI's logit_bias: added to the logits before penalties and sampling; logprobs stay raw.
TEST(SamplerTest, LogitBiasShiftsTheChoiceAndKeepsRawLogprobs) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = 0;
  p.logit_bias = {{1, -100.0f}, {3, 4.0f}};  // the argmax (1, logit 2.5) out; 3 (-1 + 4 = 3) wins
  ASSERT_TRUE(p.Validate().ok());
  std::vector<float> l = Logits();
  SamplerRng rng(0);
  const SampledToken t = Sampler::Sample(absl::MakeSpan(l), p, {}, {}, rng);
  EXPECT_EQ(t.token, 3);
  EXPECT_NEAR(t.logprob, std::log(Softmax(Logits(), 1.0f)[3]), 1e-5);
  // Sampled: a -100 bias takes a token out of any draw.
  p.temperature = 1.0f;
  p.logit_bias = {{1, -100.0f}, {4, -100.0f}};
  for (int i = 0; i < 200; ++i) {
    std::vector<float> row = Logits();
    const int32_t token = Sampler::Sample(absl::MakeSpan(row), p, {}, {}, rng).token;
    EXPECT_TRUE(token != 1 && token != 4) << token;
  }
}

// Draws many samples and checks the empirical distribution against the target with a
// chi-square test (critical values at p = 0.001, so a correct sampler fails 1 in 1000 runs per
// case; the seeds are fixed, so the outcome is reproducible).
TEST(SamplerTest, SamplingMatchesTargetDistributionChiSquare) {
  struct Case { float temperature, top_p, min_p; int32_t top_k; };
  const Case cases[] = {{1.0f, 1.0f, 0.0f, 0}, {0.7f, 1.0f, 0.0f, 0}, {1.3f, 1.0f, 0.0f, 4},
                        {1.0f, 0.8f, 0.0f, 0}, {0.9f, 0.9f, 0.0f, 5}, {1.0f, 1.0f, 0.2f, 0}};
  // chi-square critical values at alpha 0.001 for 1..7 degrees of freedom
  const double critical[] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32};
  const int n = 40000;
  uint64_t seed = 7;
  for (const Case& c : cases) {
    SamplingParams p;
    p.temperature = c.temperature;
    p.top_p = c.top_p;
    p.top_k = c.top_k;
    p.min_p = c.min_p;
    // Independent expectation: softmax with temperature, then the filters by hand.
    std::vector<float> expected = Softmax(Logits(), c.temperature);
    std::vector<int> order(expected.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return expected[a] > expected[b]; });
    std::vector<bool> keep(expected.size(), true);
    for (size_t i = 0; i < order.size(); ++i) {
      if (c.min_p > 0 && expected[order[i]] < c.min_p * expected[order[0]]) keep[order[i]] = false;
      if (c.top_k > 0 && int(i) >= c.top_k) keep[order[i]] = false;
    }
    double kept_mass = 0, cum = 0;
    for (int t : order) if (keep[t]) kept_mass += expected[t];
    bool reached = false;
    for (int t : order) {
      if (!keep[t]) continue;
      if (reached) { keep[t] = false; continue; }
      cum += expected[t];
      if (cum >= c.top_p * kept_mass) reached = true;
    }
    double z = 0;
    for (size_t t = 0; t < expected.size(); ++t) { if (!keep[t]) expected[t] = 0; z += expected[t]; }
    for (float& x : expected) x = float(x / z);

    SamplerRng rng(seed++);
    std::vector<int> counts(expected.size(), 0);
    for (int i = 0; i < n; ++i) {
      std::vector<float> l = Logits();
      ++counts[size_t(Sampler::Sample(absl::MakeSpan(l), p, {}, {}, rng).token)];
    }
    int dof = 0;
    const double chi = ChiSquare(counts, expected, n, &dof);
    ASSERT_GE(dof, 1);
    EXPECT_LT(chi, critical[dof]) << "temperature " << c.temperature << " top_p " << c.top_p
                                  << " top_k " << c.top_k << " min_p " << c.min_p;
  }
}

TEST(SamplerTest, TokenMaskLimitsEveryDrawAndKeepsRawLogprobs) {
  // 40 tokens, the most likely ones masked out; only 3 and 37 allowed.
  std::vector<uint32_t> allowed = {uint32_t(1) << 3, uint32_t(1) << (37 - 32)};
  SamplingParams p;
  p.temperature = 1.5f;
  p.presence_penalty = -2.0f;  // a penalty must not lift a masked token
  p.logprobs = 2;
  SamplerRng rng(3);
  std::set<int32_t> drawn;
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l(40, 0.0f);
    l[0] = 10.0f, l[1] = 9.0f, l[37] = 1.0f;
    const std::vector<int32_t> output = {0, 1};
    const SampledToken t = Sampler::Sample(absl::MakeSpan(l), p, {}, output, rng, allowed);
    drawn.insert(t.token);
    ASSERT_EQ(t.top_logprobs.size(), 2u);
    EXPECT_EQ(t.top_logprobs[0].token, 0);  // of the raw distribution
  }
  EXPECT_EQ(drawn, (std::set<int32_t>{3, 37}));
  p.temperature = 0.0f;
  std::vector<float> l(40, 0.0f);
  l[0] = 10.0f, l[37] = 1.0f;
  EXPECT_EQ(Sampler::Sample(absl::MakeSpan(l), p, {}, {}, rng, allowed).token, 37);
}

TEST(SamplerTest, ValidateRejectsOutOfRange) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.top_p = 0; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.top_k = -2; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.min_p = 1.5f; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.max_tokens = 0; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.stop = {""}; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.temperature = NAN; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.logit_bias = {{-1, 1.0f}}; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.logit_bias = {{1, 100.5f}}; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.logit_bias = {{2, 1.0f}, {1, 1.0f}}; EXPECT_FALSE(p.Validate().ok());
  p = SamplingParams(); p.logit_bias = {{1, NAN}}; EXPECT_FALSE(p.Validate().ok());
  EXPECT_TRUE(SamplingParams().Validate().ok());
}

}  // namespace
}  // namespace duet
