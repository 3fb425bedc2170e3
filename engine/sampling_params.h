// Per-request generation settings, with the meanings vLLM gives them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/grammar/structured_output.h"

namespace duet {

// How a request guesses tokens ahead for the target to verify (lossless in every mode).
enum class SpeculationMode {
  kNone,       // one token per step
  kLookahead,  // n-gram matches in the request's own tokens and in recent outputs
  kDraft,      // a separate small model with the same tokenizer
  kSelf,       // the target's first layers (plus final norm and LM head)
};
const char* SpeculationModeName(SpeculationMode mode);  // "none", "lookahead", "draft", "self"
// InvalidArgument naming the accepted values for anything else.
absl::StatusOr<SpeculationMode> ParseSpeculationMode(const std::string& name);

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy
  float top_p = 1.0f;               // (0, 1]
  int32_t top_k = 0;                // 0 or -1: disabled
  float min_p = 0.0f;               // [0, 1]
  float repetition_penalty = 1.0f;  // > 0; over prompt and output tokens
  float presence_penalty = 0.0f;    // [-2, 2]; over output tokens
  float frequency_penalty = 0.0f;   // [-2, 2]; over output tokens
  std::optional<uint64_t> seed;
  int32_t max_tokens = 16;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // (token id, bias) added to that token's logit before penalties (OpenAI's logit_bias), sorted
  // by id, each id once, biases in [-100, 100].
  std::vector<std::pair<int32_t, float>> logit_bias;
  int32_t logprobs = -1;  // -1: none; N >= 0: chosen token's logprob plus top-N
  // vLLM's prompt_logprobs. -1: none; K >= 0: every prompt token after the first gets its
  // logprob, rank and the top-K of the distribution before it (Request::prompt_logprobs). The
  // prompt is then computed whole: a cached prefix has no logits.
  int32_t prompt_logprobs = -1;
  static constexpr int32_t kMaxLogprobs = 20;  // for both, as vLLM's default max_logprobs
  std::optional<SpeculationMode> speculation;  // unset: the server's default
  // Grammar-constrained decoding (JSON schema, regex, choice, GBNF). A constrained request never
  // speculates: drafts are not checked against the grammar yet.
  grammar::StructuredOutput structured_output;
  // Prefix caching: KV is shared only among requests with the same salt.
  std::string cache_salt;
  static constexpr size_t kMaxCacheSaltBytes = 256;

  bool greedy() const { return temperature == 0.0f; }
  // InvalidArgument naming the field for out-of-range values.
  absl::Status Validate() const;
};

}  // namespace duet
