// Added tokens (special and not) and how HF tokenizers finds them in text: leftmost-longest
// matches, with the single_word, lstrip and rstrip options.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "frontend/tokenizer/tokenizer_regex.h"

namespace duet {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// A range [begin, end) of the text, which is added token `id` or (without id) ordinary text.
struct TextSegment {
  size_t begin;
  size_t end;
  std::optional<int32_t> added_token_id;
};

class AddedTokenMatcher {
 public:
  // `patterns[i]` is the string that finds `tokens[i]` (its content, or its normalized content).
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);

  // Splits `text` into added-token and ordinary segments, covering all of it. Empty ordinary
  // segments are omitted.
  std::vector<TextSegment> Split(std::string_view text) const;
  bool empty() const { return tokens_.empty(); }

 private:
  struct TrieNode {
    std::vector<std::pair<unsigned char, int32_t>> children;  // (byte, node index)
    int32_t token_index = -1;
  };
  // Index into tokens_ of the longest pattern starting at text[pos] and its length, if any.
  std::optional<std::pair<int32_t, size_t>> LongestMatchAt(std::string_view text, size_t pos) const;

  std::vector<AddedToken> tokens_;
  std::vector<TrieNode> trie_;
  bool first_bytes_[256] = {};
  TokenizerRegex word_char_;
};

}  // namespace duet
