// Where n-grams occurred in token text, for training-free drafting (lookahead cache).
//
// An n-gram trie would keep a node per n-gram with its count; here the text itself is the trie:
// an n-gram's node is the set of places where it occurred (its count is their number) and its
// children are the tokens that followed there. Appending a token costs one hash update (the
// engine-wide index) or nothing at all (a request's own tokens, searched directly), so keeping
// the lookahead cache current costs next to nothing per generated token, while a trie pays a
// node per n-gram length for every token.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace duet {

// A request's tokens: its prompt followed by its output, read as one sequence.
struct TokenText {
  absl::Span<const int32_t> prompt;
  absl::Span<const int32_t> output;

  int64_t size() const { return int64_t(prompt.size() + output.size()); }
  int32_t at(int64_t i) const {
    return i < int64_t(prompt.size()) ? prompt[size_t(i)] : output[size_t(i - int64_t(prompt.size()))];
  }
  // The token after position `i`, or -1 at the end.
  int32_t Next(int64_t i) const { return i + 1 < size() ? at(i + 1) : -1; }
};

// The occurrences of the longest suffix of `text` (of at most `max_match` tokens) found earlier
// in `text` with a token after it, newest first, looking back at most `max_scan` tokens.
// `positions` gets (up to `max_positions` of) the occurrences' last positions; returns the suffix's
// length (0: none).
int32_t MatchSuffix(const TokenText& text, int32_t max_match, int64_t max_scan, int32_t max_positions,
                    std::vector<int64_t>& positions);

// Recent outputs of every request, in a ring of `capacity` tokens (the oldest go first), each
// bigram's occurrences chained newest first.
class OutputNgramIndex {
 public:
  explicit OutputNgramIndex(int64_t capacity);

  // Appends tokens of the current output; EndOutput closes it (outputs never run into each
  // other). Add is both.
  void Append(absl::Span<const int32_t> tokens);
  void EndOutput();
  void Add(absl::Span<const int32_t> output) {
    Append(output);
    EndOutput();
  }

  // The occurrences of the longest suffix of `context` (2 to `max_match` tokens: one token says
  // little about another request's text) that have a token after them, like MatchSuffix; looks
  // at the newest `max_walk` occurrences of the last bigram.
  int32_t Match(absl::Span<const int32_t> context, int32_t max_match, int32_t max_walk,
                std::vector<int64_t>& positions) const;
  // The token after `position` in the same output, or -1.
  int32_t Next(int64_t position) const;

  int64_t num_tokens() const { return end_ < capacity_ ? end_ : capacity_; }  // held now
  int64_t num_keys() const { return int64_t(newest_.size()); }

 private:
  static constexpr int32_t kSeparator = -1;
  static uint64_t Key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  bool Held(int64_t position) const { return position >= end_ - capacity_ && position >= 0 && position < end_; }
  int32_t At(int64_t position) const { return tokens_[size_t(position % capacity_)]; }
  void Put(int32_t token);
  // Drops the keys whose newest occurrence left the ring (keeps the map's size bounded).
  void DropEvictedKeys();

  int64_t capacity_;
  int64_t end_ = 0;              // positions ever written; [end_ - capacity_, end_) are held
  std::vector<int32_t> tokens_;  // [capacity_] ring
  std::vector<int64_t> older_;   // [capacity_] ring: the previous occurrence of the bigram ending here
  absl::flat_hash_map<uint64_t, int64_t> newest_;  // bigram -> its newest occurrence's last position
};

}  // namespace duet
