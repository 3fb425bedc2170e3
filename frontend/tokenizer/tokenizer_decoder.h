// Decoders turning token strings back into text (ByteLevel, Metaspace, Replace, ByteFallback, Fuse,
// Strip, Sequence), as HF tokenizers' decode_chain.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace duet {

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Transforms the token strings in place; the decoded text is their concatenation.
  virtual void DecodeChain(std::vector<std::string>& tokens) const = 0;

  // Builds from a tokenizer.json "decoder" object (not null). May throw nlohmann::json exceptions
  // on malformed input; the caller converts them.
  static absl::StatusOr<std::unique_ptr<Decoder>> FromJson(const nlohmann::json& config);
};

}  // namespace duet
