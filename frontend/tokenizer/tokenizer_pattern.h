// The "pattern" of Replace normalizers/decoders and Split pre-tokenizers: {"String": s} or
// {"Regex": r}.
#pragma once

#include "absl/status/statusor.h"
#include "frontend/tokenizer/tokenizer_regex.h"
#include "nlohmann/json.hpp"

namespace duet {

inline absl::StatusOr<TokenizerRegex> PatternFromJson(const nlohmann::json& pattern) {
  if (pattern.contains("Regex")) return TokenizerRegex::Compile(pattern.at("Regex").get<std::string>());
  return TokenizerRegex::Literal(pattern.at("String").get<std::string>());
}

}  // namespace duet
