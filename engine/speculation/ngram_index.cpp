#include "engine/speculation/ngram_index.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "common/check.h"

namespace duet {
namespace {

// Keeps the occurrences of the longest match seen so far (newest first: callers offer them so).
class BestMatches {
 public:
  BestMatches(int32_t max_positions, std::vector<int64_t>& positions)
      : max_positions_(max_positions), positions_(positions) {
    positions_.clear();
  }
  void Offer(int64_t position, int32_t length) {
    if (length > length_) {
      length_ = length;
      positions_.clear();
    }
    if (length == length_ && int32_t(positions_.size()) < max_positions_) positions_.push_back(position);
  }
  // Nothing newer can change the result: the longest possible match has all its positions.
  bool Full(int32_t max_match) const { return length_ == max_match && int32_t(positions_.size()) == max_positions_; }
  int32_t length() const { return length_; }

 private:
  int32_t max_positions_;
  std::vector<int64_t>& positions_;
  int32_t length_ = 0;
};

}  // namespace

int32_t MatchSuffix(const TokenText& text, int32_t max_match, int64_t max_scan, int32_t max_positions,
                    std::vector<int64_t>& positions) {
  BestMatches best(max_positions, positions);
  const int64_t n = text.size();
  if (n < 2 || max_match < 1 || max_positions < 1) return 0;
  const int32_t last = text.at(n - 1);
  // Candidates end at i <= n - 2 (so a token follows), newest first; the scan compares raw spans.
  const int64_t lowest = std::max<int64_t>(0, n - 1 - max_scan);
  auto consider = [&](int64_t i) {
    int32_t length = 1;
    while (length < max_match && i - length >= 0 && text.at(i - length) == text.at(n - 1 - length)) ++length;
    best.Offer(i, length);
    return !best.Full(max_match);
  };
  const int64_t prompt_size = int64_t(text.prompt.size());
  for (int64_t i = n - 2; i >= std::max(lowest, prompt_size); --i) {
    if (text.output[size_t(i - prompt_size)] == last && !consider(i)) return best.length();
  }
  for (int64_t i = std::min(n - 2, prompt_size - 1); i >= lowest; --i) {
    if (text.prompt[size_t(i)] == last && !consider(i)) return best.length();
  }
  return best.length();
}

OutputNgramIndex::OutputNgramIndex(int64_t capacity)
    : capacity_(capacity), tokens_(size_t(capacity), kSeparator), older_(size_t(capacity), -1) {
  DUET_CHECK(capacity >= 2);
}

void OutputNgramIndex::Put(int32_t token) {
  const size_t slot = size_t(end_ % capacity_);
  tokens_[slot] = token;
  older_[slot] = -1;
  if (token != kSeparator && Held(end_ - 1) && At(end_ - 1) != kSeparator) {
    auto [it, inserted] = newest_.try_emplace(Key(At(end_ - 1), token), end_);
    if (!inserted) {
      older_[slot] = it->second;
      it->second = end_;
    }
  }
  ++end_;
}

void OutputNgramIndex::Append(absl::Span<const int32_t> tokens) {
  for (int32_t token : tokens) {
    DUET_CHECK(token >= 0);
    Put(token);
  }
}

void OutputNgramIndex::EndOutput() {
  Put(kSeparator);
  // Keys of evicted text pile up; past twice the ring's worth they are dropped (amortized: at
  // most `capacity_` survive, so the next drop is `capacity_` keys away).
  if (num_keys() > 2 * capacity_) DropEvictedKeys();
}

void OutputNgramIndex::DropEvictedKeys() {
  absl::erase_if(newest_, [this](const auto& entry) { return !Held(entry.second); });
}

int32_t OutputNgramIndex::Next(int64_t position) const {
  return Held(position) && Held(position + 1) ? At(position + 1) : -1;  // a separator is -1 too
}

int32_t OutputNgramIndex::Match(absl::Span<const int32_t> context, int32_t max_match, int32_t max_walk,
                                std::vector<int64_t>& positions) const {
  BestMatches best(max_walk, positions);
  const int64_t c = int64_t(context.size());
  if (c < 2 || max_match < 2) return 0;
  auto it = newest_.find(Key(context[size_t(c - 2)], context[size_t(c - 1)]));
  if (it == newest_.end()) return 0;
  int64_t p = it->second;
  for (int32_t walked = 0; walked < max_walk && Held(p); ++walked, p = older_[size_t(p % capacity_)]) {
    if (Next(p) < 0) continue;
    int32_t length = 2;
    while (length < max_match && length < c && Held(p - length) &&
           At(p - length) == context[size_t(c - 1 - length)]) {
      ++length;
    }
    best.Offer(p, length);
    if (best.Full(max_match)) break;
  }
  return best.length();
}

}  // namespace duet
