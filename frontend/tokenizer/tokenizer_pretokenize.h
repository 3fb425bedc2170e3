// Pre-tokenizers: split normalized text into the pieces the model tokenizes independently
// (Split, ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit, Sequence), as HF tokenizers.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "frontend/tokenizer/tokenizer_regex.h"
#include "nlohmann/json_fwd.hpp"

namespace duet {

struct PreToken {
  std::string text;
  bool at_text_start = false;  // starts at offset 0 of the original input (Metaspace "first")
};

// What a Split does with the pieces its pattern matches (HF SplitDelimiterBehavior).
enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

// A range [begin, end) of a piece and whether the pattern matched it.
struct MatchedRange {
  size_t begin;
  size_t end;
  bool is_match;
};

// Splits `piece` at `ranges` (which cover it in order) according to `behavior`. Empty results
// are dropped; the first result inherits `piece.at_text_start`.
void SplitPiece(const PreToken& piece, const std::vector<MatchedRange>& ranges,
                SplitBehavior behavior, std::vector<PreToken>& out);

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their pre-tokenization.
  virtual void PreTokenize(std::vector<PreToken>& pieces) const = 0;

  // Builds from a tokenizer.json "pre_tokenizer" object (not null). May throw nlohmann::json
  // exceptions on malformed input; the caller converts them.
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> FromJson(const nlohmann::json& config);
};

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(TokenizerRegex pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void PreTokenize(std::vector<PreToken>& pieces) const override;

 private:
  TokenizerRegex pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2 byte-level: optional prefix space, optional GPT-2 regex split, then every byte mapped to
// its printable stand-in character.
class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex);
  void PreTokenize(std::vector<PreToken>& pieces) const override;

 private:
  bool add_prefix_space_;
  std::unique_ptr<SplitPreTokenizer> gpt2_split_;  // null without use_regex
};

enum class PrependScheme { kAlways, kFirst, kNever };

// SentencePiece-style: spaces become `replacement` (▁), which is prepended per `prepend_scheme`;
// with `split`, pieces start at each replacement.
class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme prepend_scheme, bool split)
      : replacement_(std::move(replacement)), prepend_scheme_(prepend_scheme), split_(split) {}
  void PreTokenize(std::vector<PreToken>& pieces) const override;

 private:
  std::string replacement_;
  PrependScheme prepend_scheme_;
  bool split_;
};

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  void PreTokenize(std::vector<PreToken>& pieces) const override;

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// The GPT-2 byte -> printable character table (bytes_to_unicode), as UTF-8 strings.
const std::vector<std::string>& ByteLevelAlphabet();

}  // namespace duet
