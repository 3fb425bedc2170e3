// PCRE2 regular expressions (UTF + UCP, JIT when available) for pre-tokenizer Split patterns and
// Replace normalizers/decoders, with the semantics of the Oniguruma regexes HF tokenizers uses.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace duet {

class TokenizerRegex {
 public:
  static absl::StatusOr<TokenizerRegex> Compile(std::string_view pattern);
  // A regex matching `literal` exactly.
  static absl::StatusOr<TokenizerRegex> Literal(std::string_view literal);

  // Byte ranges [begin, end) of successive non-overlapping matches in valid UTF-8 `text`. After an
  // empty match the search resumes one character later.
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view text) const;
  // Replaces every match by `replacement` (taken literally).
  std::string ReplaceAll(std::string_view text, std::string_view replacement) const;

 private:
  struct Code;
  explicit TokenizerRegex(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  std::shared_ptr<const Code> code_;
};

}  // namespace duet
