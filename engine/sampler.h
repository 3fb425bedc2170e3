// Turns one row of logits into the next token: logit bias, penalties, temperature, min-p, top-k, top-p,
// then a greedy pick or a draw from the request's own random stream. Also reports logprobs
// (of the model's raw distribution, as vLLM does by default).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "engine/sampling_params.h"

namespace duet {

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
};

struct SampledToken {
  int32_t token = -1;
  float logprob = 0.0f;                   // under the raw (unprocessed) distribution
  std::vector<TokenLogprob> top_logprobs; // params.logprobs entries, most likely first
};

// A token the model was given rather than sampled (a prompt token, vLLM's prompt_logprobs),
// scored under the raw distribution of the position before it.
struct ScoredToken {
  float logprob = 0.0f;
  int32_t rank = 0;              // 1: the most likely token (1 + the tokens more likely than it)
  std::vector<TokenLogprob> top; // the distribution's top-K, most likely first
};

// A request's random stream: seeded for reproducibility, else distinct per request (one draw from
// the OS entropy source per process, then a counter mixed through splitmix64: opening the entropy
// source for each request took ~3% of the engine's host time in bench/engine_host_overhead).
class SamplerRng {
 public:
  explicit SamplerRng(std::optional<uint64_t> seed);
  double Uniform();  // [0, 1), 53 random bits
 private:
  std::mt19937_64 engine_;
};

class Sampler {
 public:
  // `logits` is modified in place. `prompt` and `output` feed the penalties. `allowed`, when not
  // empty, is a bitmask (bit t of word t/32) of the tokens a grammar allows; it must allow one.
  // Logprobs stay those of the raw distribution.
  static SampledToken Sample(absl::Span<float> logits, const SamplingParams& params,
                             absl::Span<const int32_t> prompt, absl::Span<const int32_t> output,
                             SamplerRng& rng, absl::Span<const uint32_t> allowed = {});

  // The steps of Sample, exposed for tests and for speculative verification.
  static void ApplyLogitBias(absl::Span<float> logits, const SamplingParams& params);
  static void ApplyPenalties(absl::Span<float> logits, const SamplingParams& params,
                             absl::Span<const int32_t> prompt, absl::Span<const int32_t> output);
  // Temperature, min-p, top-k, top-p → the probability of every token (zero where filtered).
  static std::vector<float> Probabilities(absl::Span<const float> logits, const SamplingParams& params);
  // Sets the logit of every token whose bit in `allowed` is clear to -infinity.
  static void ApplyTokenMask(absl::Span<float> logits, absl::Span<const uint32_t> allowed);
  static int32_t Argmax(absl::Span<const float> logits);
  static std::vector<TokenLogprob> LogSoftmaxTopN(absl::Span<const float> logits, int32_t chosen,
                                                  int32_t n, float* chosen_logprob);
  // `token`'s logprob (log-softmax at temperature 1 of the raw logits), rank, and the top `k`.
  static ScoredToken ScoreToken(absl::Span<const float> logits, int32_t token, int32_t k);
};

}  // namespace duet
