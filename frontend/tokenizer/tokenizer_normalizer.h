// Normalizers applied to text before pre-tokenization (NFC, Lowercase, Prepend, Replace, Strip,
// Sequence), as HF tokenizers.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace duet {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string Normalize(std::string text) const = 0;  // text is valid UTF-8

  // Builds from a tokenizer.json "normalizer" object (not null). May throw nlohmann::json
  // exceptions on malformed input; the caller converts them.
  static absl::StatusOr<std::unique_ptr<Normalizer>> FromJson(const nlohmann::json& config);
};

}  // namespace duet
