#include "frontend/tokenizer/tokenizer_pretokenize.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/check.h"
#include "frontend/tokenizer/tokenizer_pattern.h"
#include "frontend/tokenizer/tokenizer_unicode.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// `ranges` with matches inverted when `invert`, covering the whole piece.
std::vector<MatchedRange> CoverWithMatches(std::string_view text,
                                           const std::vector<std::pair<size_t, size_t>>& matches,
                                           bool invert) {
  std::vector<MatchedRange> ranges;
  if (text.empty()) return {{0, 0, invert}};
  size_t previous_end = 0;
  for (const auto& [begin, end] : matches) {
    if (previous_end != begin) ranges.push_back({previous_end, begin, invert});
    ranges.push_back({begin, end, !invert});
    previous_end = end;
  }
  if (previous_end != text.size()) ranges.push_back({previous_end, text.size(), invert});
  return ranges;
}

absl::StatusOr<SplitBehavior> ParseBehavior(const std::string& name) {
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return absl::InvalidArgumentError(absl::StrCat("unknown Split behavior '", name, "'"));
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> MakeSplit(std::string_view pattern,
                                                        SplitBehavior behavior, bool invert) {
  auto regex = TokenizerRegex::Compile(pattern);
  if (!regex.ok()) return regex.status();
  return std::make_unique<SplitPreTokenizer>(*std::move(regex), behavior, invert);
}

}  // namespace

void SplitPiece(const PreToken& piece, const std::vector<MatchedRange>& ranges,
                SplitBehavior behavior, std::vector<PreToken>& out) {
  // (begin, end, remove) in order, following HF NormalizedString::split.
  std::vector<MatchedRange> splits;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& range : ranges) splits.push_back({range.begin, range.end, false});
      break;
    case SplitBehavior::kRemoved:
      splits = ranges;
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const auto& range : ranges) {
        if (range.is_match == previous_match && !splits.empty()) {
          splits.back().end = range.end;
        } else {
          splits.push_back({range.begin, range.end, false});
        }
        previous_match = range.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const auto& range : ranges) {
        if (range.is_match && !previous_match && !splits.empty()) {
          splits.back().end = range.end;
        } else {
          splits.push_back({range.begin, range.end, false});
        }
        previous_match = range.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
        if (it->is_match && !previous_match && !splits.empty()) {
          splits.back().begin = it->begin;
        } else {
          splits.push_back({it->begin, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(splits.begin(), splits.end());
      break;
    }
  }
  bool first = true;
  for (const auto& split : splits) {
    if (split.is_match || split.end == split.begin) continue;  // is_match here means "remove"
    out.push_back({piece.text.substr(split.begin, split.end - split.begin),
                   piece.at_text_start && first && split.begin == 0});
    first = false;
  }
}

void SplitPreTokenizer::PreTokenize(std::vector<PreToken>& pieces) const {
  std::vector<PreToken> out;
  out.reserve(pieces.size());
  for (const auto& piece : pieces) {
    SplitPiece(piece, CoverWithMatches(piece.text, pattern_.FindAll(piece.text), invert_),
               behavior_, out);
  }
  pieces = std::move(out);
}

const std::vector<std::string>& ByteLevelAlphabet() {
  static const std::vector<std::string> alphabet = [] {
    std::vector<std::string> table(256);
    char32_t next_unprintable = 256;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) ||
                             (byte >= 0xAE && byte <= 0xFF);
      unicode::AppendUtf8(printable ? static_cast<char32_t>(byte) : next_unprintable++, table[byte]);
    }
    return table;
  }();
  return alphabet;
}

ByteLevelPreTokenizer::ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
    : add_prefix_space_(add_prefix_space) {
  if (use_regex) {
    auto regex = TokenizerRegex::Compile(kGpt2Pattern);
    DUET_CHECK(regex.ok());
    gpt2_split_ = std::make_unique<SplitPreTokenizer>(*std::move(regex), SplitBehavior::kIsolated,
                                                      /*invert=*/false);
  }
}

void ByteLevelPreTokenizer::PreTokenize(std::vector<PreToken>& pieces) const {
  if (add_prefix_space_) {
    for (auto& piece : pieces) {
      if (!piece.text.starts_with(' ')) piece.text.insert(0, " ");
    }
  }
  if (gpt2_split_) gpt2_split_->PreTokenize(pieces);
  const auto& alphabet = ByteLevelAlphabet();
  for (auto& piece : pieces) {
    std::string mapped;
    mapped.reserve(piece.text.size() * 2);
    for (char c : piece.text) mapped += alphabet[static_cast<unsigned char>(c)];
    piece.text = std::move(mapped);
  }
}

void MetaspacePreTokenizer::PreTokenize(std::vector<PreToken>& pieces) const {
  std::vector<PreToken> out;
  out.reserve(pieces.size());
  for (auto& piece : pieces) {
    piece.text = absl::StrReplaceAll(piece.text, {{" ", replacement_}});
    const bool prepend = !piece.text.starts_with(replacement_) &&
                         (prepend_scheme_ == PrependScheme::kAlways ||
                          (prepend_scheme_ == PrependScheme::kFirst && piece.at_text_start));
    if (prepend) piece.text.insert(0, replacement_);
    if (!split_) {
      if (!piece.text.empty()) out.push_back(std::move(piece));
      continue;
    }
    std::vector<std::pair<size_t, size_t>> matches;
    for (size_t pos = piece.text.find(replacement_); pos != std::string::npos;
         pos = piece.text.find(replacement_, pos + replacement_.size())) {
      matches.emplace_back(pos, pos + replacement_.size());
    }
    SplitPiece(piece, CoverWithMatches(piece.text, matches, /*invert=*/false),
               SplitBehavior::kMergedWithNext, out);
  }
  pieces = std::move(out);
}

void SequencePreTokenizer::PreTokenize(std::vector<PreToken>& pieces) const {
  for (const auto& step : steps_) step->PreTokenize(pieces);
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(const nlohmann::json& config) {
  const std::string type = config.at("type").get<std::string>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const auto& step_config : config.at("pretokenizers")) {
      auto step = FromJson(step_config);
      if (!step.ok()) return step.status();
      steps.push_back(*std::move(step));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(steps));
  }
  if (type == "Split") {
    const auto& pattern = config.at("pattern");
    auto behavior = ParseBehavior(config.at("behavior").get<std::string>());
    if (!behavior.ok()) return behavior.status();
    const bool invert = config.value("invert", false);
    auto regex = PatternFromJson(pattern);
    if (!regex.ok()) return regex.status();
    return std::make_unique<SplitPreTokenizer>(*std::move(regex), *behavior, invert);
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(config.value("add_prefix_space", true),
                                                   config.value("use_regex", true));
  }
  if (type == "Metaspace") {
    std::string replacement = config.value("replacement", std::string("\xE2\x96\x81"));
    PrependScheme scheme =
        config.value("add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
    if (config.contains("prepend_scheme")) {
      const std::string name = config.at("prepend_scheme").get<std::string>();
      if (name == "always") {
        scheme = PrependScheme::kAlways;
      } else if (name == "first") {
        scheme = PrependScheme::kFirst;
      } else if (name == "never") {
        scheme = PrependScheme::kNever;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("unknown Metaspace prepend_scheme '", name, "'"));
      }
    }
    if (replacement.empty()) return absl::InvalidArgumentError("Metaspace replacement is empty");
    return std::make_unique<MetaspacePreTokenizer>(std::move(replacement), scheme,
                                                   config.value("split", true));
  }
  if (type == "Digits") {
    return MakeSplit(R"(\p{N})",
                     config.value("individual_digits", false) ? SplitBehavior::kIsolated
                                                              : SplitBehavior::kContiguous,
                     /*invert=*/false);
  }
  if (type == "Whitespace") return MakeSplit(R"(\w+|[^\w\s]+)", SplitBehavior::kRemoved, true);
  if (type == "WhitespaceSplit") return MakeSplit(R"(\s+)", SplitBehavior::kRemoved, false);
  return absl::UnimplementedError(absl::StrCat("unsupported pre_tokenizer type '", type, "'"));
}

}  // namespace duet
