// Training-free drafting: matches a request's last tokens against its own prompt and output so
// far and against the recent outputs of every request (n-gram indexes, ngram_index.h), and
// proposes a multi-branch draft TREE of likely continuations, best first by frequency, within a
// token budget.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/types/span.h"
#include "engine/speculation/ngram_index.h"

namespace duet {

// Draft tokens that continue a sequence. parents[i] is the index of token i's parent in
// `tokens` (always < i), or -1 when token i directly follows the sequence's last token.
struct DraftTree {
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;

  int32_t size() const { return int32_t(tokens.size()); }
  bool empty() const { return tokens.empty(); }
  void Add(int32_t token, int32_t parent) {
    tokens.push_back(token);
    parents.push_back(parent);
  }
  void Clear() {
    tokens.clear();
    parents.clear();
  }
};

struct LookaheadOptions {
  int32_t max_match = 4;                    // longest suffix of the sequence matched
  int32_t max_occurrences = 32;             // newest occurrences of a match followed
  int64_t local_max_scan = 1 << 14;         // a request's own tokens searched, newest first
  int64_t global_max_tokens = 1 << 19;      // the engine-wide ring of recent outputs
  int64_t max_queued_tokens = 1 << 16;      // finished outputs waiting to be indexed
};

// The lookahead cache: a request's own prompt and output, plus the recent outputs of every
// request (engine-wide), matched against the request's last tokens.
class LookaheadCache {
 public:
  explicit LookaheadCache(const LookaheadOptions& options);

  // Queues a finished request's output for the engine-wide index (IndexQueued adds it), so a
  // step that finishes many requests does not pay for indexing them all.
  void AddOutput(absl::Span<const int32_t> output);
  // Indexes up to `max_tokens` queued tokens, oldest outputs first; returns whether any remain.
  bool IndexQueued(int64_t max_tokens);
  bool has_queued() const { return !queued_.empty(); }

  // Up to `budget` draft tokens continuing `text`, as a tree: each branch is a continuation
  // seen after the longest matching suffix of `text`, expanded best first by its estimated
  // probability (its frequency among the occurrences, mixing the request's own text and the
  // other outputs where both match).
  DraftTree Propose(const TokenText& text, int32_t budget);

  const OutputNgramIndex& global_index() const { return global_; }

 private:
  LookaheadOptions options_;
  OutputNgramIndex global_;
  std::deque<std::vector<int32_t>> queued_;
  int64_t queued_tokens_ = 0;  // in queued_, less the front's indexed part
  size_t front_indexed_ = 0;    // tokens of queued_.front() already in global_
  // Propose's scratch (reused: it runs per request and step).
  std::vector<int64_t> local_positions_, global_positions_;
};

}  // namespace duet
