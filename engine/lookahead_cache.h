// Training-free drafting: matches a request's last tokens against n-gram tries (its own prompt
// and output so far, and the outputs of every earlier request) and proposes a multi-branch
// draft TREE of likely continuations, best first by frequency, within a token budget.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "engine/ngram_trie.h"

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
  int32_t max_ngram = 12;           // trie depth: match length + draft depth
  int32_t max_match = 4;            // longest suffix of the sequence matched against a trie
  int64_t local_max_nodes = 1 << 16;   // per request
  int64_t global_max_nodes = 1 << 19;  // per engine
};

class LookaheadCache {
 public:
  explicit LookaheadCache(const LookaheadOptions& options);

  // A fresh per-request trie (of the prompt and output so far; the caller feeds it tokens).
  NgramTrie NewLocalTrie() const { return NgramTrie(options_.max_ngram, options_.local_max_nodes); }
  // Adds a finished request's output to the engine-wide trie.
  void AddOutput(absl::Span<const int32_t> output) { global_.AddSequence(output); }

  // Up to `budget` draft tokens continuing `context`, as a tree: each branch is a continuation
  // seen after the longest matching suffix of `context`, expanded best first by its estimated
  // probability (frequency, mixing the local and global tries where both match).
  DraftTree Propose(const NgramTrie& local, absl::Span<const int32_t> context, int32_t budget) const;

  const NgramTrie& global_trie() const { return global_; }

 private:
  // The node of the longest suffix of `context` (up to max_match tokens) that has continuations.
  int32_t LongestMatch(const NgramTrie& trie, absl::Span<const int32_t> context) const;

  LookaheadOptions options_;
  NgramTrie global_;
};

}  // namespace duet
