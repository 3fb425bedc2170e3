// One line of `duet generate`'s input: {"id", "prompt" | "prompt_token_ids", "max_tokens",
// "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
// plus "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs"}.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/sampling_params.h"
#include "nlohmann/json.hpp"

namespace duet {

struct GenerateRequest {
  std::string id;
  std::optional<std::string> prompt;
  std::vector<int32_t> prompt_token_ids;  // when given directly
  SamplingParams params;
};

// Type- and range-checks every field; unknown fields are an error (a typo must not be ignored).
absl::StatusOr<GenerateRequest> ParseGenerateRequest(const nlohmann::json& row);

}  // namespace duet
