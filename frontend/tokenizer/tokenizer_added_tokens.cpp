#include "frontend/tokenizer/tokenizer_added_tokens.h"

#include <algorithm>

#include "common/check.h"
#include "frontend/tokenizer/tokenizer_unicode.h"

namespace duet {
namespace {

TokenizerRegex WordCharRegex() {
  auto regex = TokenizerRegex::Compile(R"(\w)");
  DUET_CHECK(regex.ok());
  return *std::move(regex);
}

// The character of `text` that ends at byte `end`.
std::string_view CharEndingAt(std::string_view text, size_t end) {
  size_t start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  return text.substr(start, end - start);
}

std::string_view CharStartingAt(std::string_view text, size_t start) {
  return text.substr(start, unicode::Utf8SequenceLength(static_cast<unsigned char>(text[start])));
}

}  // namespace

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)), trie_(1), word_char_(WordCharRegex()) {
  DUET_CHECK(tokens_.size() == patterns.size());
  for (size_t i = 0; i < patterns.size(); ++i) {
    const std::string& pattern = patterns[i];
    if (pattern.empty()) continue;  // an empty pattern never matches
    int32_t node = 0;
    for (char c : pattern) {
      const auto byte = static_cast<unsigned char>(c);
      auto& children = trie_[node].children;
      auto it = std::find_if(children.begin(), children.end(),
                             [byte](const auto& child) { return child.first == byte; });
      if (it != children.end()) {
        node = it->second;
      } else {
        const auto child = static_cast<int32_t>(trie_.size());
        trie_[node].children.emplace_back(byte, child);
        trie_.emplace_back();
        node = child;
      }
    }
    // For duplicate patterns the first token listed wins.
    if (trie_[node].token_index == -1) trie_[node].token_index = static_cast<int32_t>(i);
    first_bytes_[static_cast<unsigned char>(pattern[0])] = true;
  }
}

std::optional<std::pair<int32_t, size_t>> AddedTokenMatcher::LongestMatchAt(std::string_view text,
                                                                             size_t pos) const {
  std::optional<std::pair<int32_t, size_t>> best;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto& children = trie_[node].children;
    auto it = std::find_if(children.begin(), children.end(),
                           [byte](const auto& child) { return child.first == byte; });
    if (it == children.end()) break;
    node = it->second;
    if (trie_[node].token_index != -1) best = {{trie_[node].token_index, i + 1 - pos}};
  }
  return best;
}

std::vector<TextSegment> AddedTokenMatcher::Split(std::string_view text) const {
  std::vector<TextSegment> segments;
  size_t segment_start = 0;  // end of the previous added token
  for (size_t pos = 0; pos < text.size();) {
    if (!first_bytes_[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    const auto match = LongestMatchAt(text, pos);
    if (!match) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[match->first];
    size_t start = pos, stop = pos + match->second;
    pos = stop;  // matches never overlap, even when one is discarded below
    if (token.single_word) {
      const bool word_before = start > 0 && !word_char_.FindAll(CharEndingAt(text, start)).empty();
      const bool word_after =
          stop < text.size() && !word_char_.FindAll(CharStartingAt(text, stop)).empty();
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      while (start > segment_start) {
        const std::string_view previous = CharEndingAt(text, start);
        size_t char_pos = 0;
        if (!unicode::IsWhitespace(unicode::DecodeUtf8(previous, char_pos))) break;
        start -= previous.size();
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        const std::string_view next = CharStartingAt(text, stop);
        size_t char_pos = 0;
        if (!unicode::IsWhitespace(unicode::DecodeUtf8(next, char_pos))) break;
        stop += next.size();
      }
      pos = std::max(pos, stop);
    }
    start = std::max(start, segment_start);
    if (segment_start < start) segments.push_back({segment_start, start, std::nullopt});
    segments.push_back({start, stop, token.id});
    segment_start = stop;
  }
  if (segment_start < text.size()) segments.push_back({segment_start, text.size(), std::nullopt});
  return segments;
}

}  // namespace duet
