#include "engine/sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace duet {

const char* SpeculationModeName(SpeculationMode mode) {
  switch (mode) {
    case SpeculationMode::kNone: return "none";
    case SpeculationMode::kLookahead: return "lookahead";
    case SpeculationMode::kDraft: return "draft";
    case SpeculationMode::kSelf: return "self";
  }
  return "none";
}

absl::StatusOr<SpeculationMode> ParseSpeculationMode(const std::string& name) {
  for (SpeculationMode mode : {SpeculationMode::kNone, SpeculationMode::kLookahead, SpeculationMode::kDraft,
                               SpeculationMode::kSelf}) {
    if (name == SpeculationModeName(mode)) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("speculation must be none, lookahead, draft or self, got '", name, "'"));
}

absl::Status SamplingParams::Validate() const {
  auto bad = [](const char* field, auto value, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be ", want, ", got ", value));
  };
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) return bad("temperature", temperature, ">= 0");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return bad("top_p", top_p, "in (0, 1]");
  if (top_k < -1) return bad("top_k", top_k, "-1, 0 (disabled) or positive");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return bad("min_p", min_p, "in [0, 1]");
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return bad("repetition_penalty", repetition_penalty, "> 0");
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return bad("presence_penalty", presence_penalty, "in [-2, 2]");
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return bad("frequency_penalty", frequency_penalty, "in [-2, 2]");
  }
  if (max_tokens < 1) return bad("max_tokens", max_tokens, ">= 1");
  if (cache_salt.size() > kMaxCacheSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_salt is ", cache_salt.size(), " bytes; at most ", kMaxCacheSaltBytes, " are allowed"));
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) return bad("logprobs", logprobs, "in [0, 20]");
  if (prompt_logprobs < -1 || prompt_logprobs > kMaxLogprobs) {
    return bad("prompt_logprobs", prompt_logprobs, "in [0, 20]");
  }
  for (const std::string& s : stop) {
    if (s.empty()) return absl::InvalidArgumentError("stop strings must not be empty");
  }
  for (int32_t id : stop_token_ids) {
    if (id < 0) return bad("stop_token_ids", id, "non-negative");
  }
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto& [id, bias] = logit_bias[i];
    if (id < 0) return bad("logit_bias", id, "a non-negative token id");
    if (i > 0 && id <= logit_bias[i - 1].first) return absl::InvalidArgumentError("logit_bias: token ids must be sorted and unique");
    if (!(bias >= -100.0f && bias <= 100.0f)) return bad("logit_bias", bias, "in [-100, 100]");
  }
  return absl::OkStatus();
}

namespace {

uint64_t UnseededRequestSeed() {
  static const uint64_t process_seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  static std::atomic<uint64_t> requests{0};
  uint64_t z = process_seed + requests.fetch_add(1, std::memory_order_relaxed) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

SamplerRng::SamplerRng(std::optional<uint64_t> seed) : engine_(seed.has_value() ? *seed : UnseededRequestSeed()) {}

double SamplerRng::Uniform() { return double(engine_() >> 11) * 0x1.0p-53; }

void Sampler::ApplyLogitBias(absl::Span<float> logits, const SamplingParams& params) {
  for (const auto& [id, bias] : params.logit_bias) {
    if (id >= 0 && size_t(id) < logits.size()) logits[size_t(id)] += bias;  // ids past the vocabulary: none
  }
}

void Sampler::ApplyPenalties(absl::Span<float> logits, const SamplingParams& params,
                             absl::Span<const int32_t> prompt, absl::Span<const int32_t> output) {
  const int64_t vocab = int64_t(logits.size());
  if (params.repetition_penalty != 1.0f) {
    // Hugging Face / vLLM: shrink the logit of every token already seen, in prompt or output.
    std::vector<bool> seen(size_t(vocab), false);
    for (int32_t t : prompt) if (t >= 0 && t < vocab) seen[size_t(t)] = true;
    for (int32_t t : output) if (t >= 0 && t < vocab) seen[size_t(t)] = true;
    for (int64_t t = 0; t < vocab; ++t) {
      if (!seen[size_t(t)]) continue;
      float& l = logits[size_t(t)];
      l = l > 0 ? l / params.repetition_penalty : l * params.repetition_penalty;
    }
  }
  if (params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f) {
    // OpenAI: logit -= count · frequency_penalty + (count > 0) · presence_penalty, output only.
    std::unordered_map<int32_t, int32_t> counts;
    for (int32_t t : output) if (t >= 0 && t < vocab) ++counts[t];
    for (const auto& [t, n] : counts) {
      logits[size_t(t)] -= float(n) * params.frequency_penalty + params.presence_penalty;
    }
  }
}

int32_t Sampler::Argmax(absl::Span<const float> logits) {
  DUET_CHECK(!logits.empty());
  // First maximum wins ties, as torch.argmax does.
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

std::vector<float> Sampler::Probabilities(absl::Span<const float> logits, const SamplingParams& params) {
  const size_t vocab = logits.size();
  const float temperature = params.temperature > 0.0f ? params.temperature : 1.0f;
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<float> probs(vocab);
  double sum = 0.0;
  for (size_t t = 0; t < vocab; ++t) {
    probs[t] = std::exp((logits[t] - max_logit) / temperature);
    sum += probs[t];
  }
  for (float& p : probs) p = float(p / sum);

  if (params.min_p > 0.0f) {
    // The most likely token has probability exp(0)/sum; keep tokens within min_p of it.
    const float threshold = params.min_p * *std::max_element(probs.begin(), probs.end());
    for (float& p : probs) if (p < threshold) p = 0.0f;
  }
  const bool use_top_k = params.top_k > 0 && size_t(params.top_k) < vocab;
  if (use_top_k || params.top_p < 1.0f) {
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    // Descending probability; ties broken by token id so the result is deterministic.
    auto by_prob = [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
    std::sort(order.begin(), order.end(), by_prob);
    size_t keep = use_top_k ? size_t(params.top_k) : vocab;
    if (params.top_p < 1.0f) {
      double total = 0.0;
      for (size_t i = 0; i < keep; ++i) total += probs[order[i]];
      // Smallest prefix whose mass reaches top_p of the (top-k) mass; always at least one token.
      double cumulative = 0.0;
      size_t n = 0;
      while (n < keep) {
        cumulative += probs[order[n]];
        ++n;
        if (cumulative >= params.top_p * total) break;
      }
      keep = std::max<size_t>(n, 1);
    }
    for (size_t i = keep; i < vocab; ++i) probs[order[i]] = 0.0f;
  }
  double kept = 0.0;
  for (float p : probs) kept += p;
  for (float& p : probs) p = float(p / kept);
  return probs;
}

std::vector<TokenLogprob> Sampler::LogSoftmaxTopN(absl::Span<const float> logits, int32_t chosen,
                                                  int32_t n, float* chosen_logprob) {
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float l : logits) sum += std::exp(double(l - max_logit));
  const float log_norm = max_logit + float(std::log(sum));
  if (chosen_logprob != nullptr) *chosen_logprob = logits[size_t(chosen)] - log_norm;
  std::vector<TokenLogprob> top;
  if (n <= 0) return top;
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const size_t count = std::min<size_t>(size_t(n), order.size());
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (size_t i = 0; i < count; ++i) top.push_back({order[i], logits[size_t(order[i])] - log_norm});
  return top;
}

ScoredToken Sampler::ScoreToken(absl::Span<const float> logits, int32_t token, int32_t k) {
  DUET_CHECK(token >= 0 && size_t(token) < logits.size());
  ScoredToken scored;
  scored.top = LogSoftmaxTopN(logits, token, k, &scored.logprob);
  const float own = logits[size_t(token)];
  scored.rank = 1 + int32_t(std::count_if(logits.begin(), logits.end(), [own](float l) { return l > own; }));
  return scored;
}

void Sampler::ApplyTokenMask(absl::Span<float> logits, absl::Span<const uint32_t> allowed) {
  const size_t vocab = logits.size();
  DUET_CHECK(allowed.size() * 32 >= vocab);
  for (size_t w = 0; w * 32 < vocab; ++w) {
    const uint32_t bits = allowed[w];
    if (bits == ~0u) continue;
    const size_t end = std::min(vocab, w * 32 + 32);
    for (size_t t = w * 32; t < end; ++t) {
      if (!((bits >> (t - w * 32)) & 1)) logits[t] = -std::numeric_limits<float>::infinity();
    }
  }
}

SampledToken Sampler::Sample(absl::Span<float> logits, const SamplingParams& params,
                             absl::Span<const int32_t> prompt, absl::Span<const int32_t> output,
                             SamplerRng& rng, absl::Span<const uint32_t> allowed) {
  SampledToken result;
  std::vector<float> raw;
  if (params.logprobs >= 0) raw.assign(logits.begin(), logits.end());
  // The bias first (as vLLM); the mask last so that nothing can lift a disallowed token off -infinity.
  ApplyLogitBias(logits, params);
  ApplyPenalties(logits, params, prompt, output);
  if (!allowed.empty()) ApplyTokenMask(logits, allowed);
  if (params.greedy()) {
    result.token = Argmax(logits);
  } else {
    const std::vector<float> probs = Probabilities(logits, params);
    const double u = rng.Uniform();
    double cumulative = 0.0;
    result.token = -1;
    for (size_t t = 0; t < probs.size(); ++t) {
      if (probs[t] <= 0.0f) continue;
      cumulative += probs[t];
      result.token = static_cast<int32_t>(t);
      if (u < cumulative) break;
    }
    DUET_CHECK(result.token >= 0);
  }
  if (params.logprobs >= 0) {
    result.top_logprobs = LogSoftmaxTopN(raw, result.token, params.logprobs, &result.logprob);
  }
  return result;
}

}  // namespace duet
