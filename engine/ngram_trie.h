// A token n-gram trie with occurrence counts, for training-free drafting (lookahead cache).
//
// Node path = an n-gram (n <= max_ngram); node count = how often that n-gram occurred. The
// children of the node for the last tokens of a sequence are the continuations seen after them,
// with their frequencies. Memory is bounded: past max_nodes, every count is halved and the
// n-grams that fall to zero are evicted (rare ones go first, frequent ones decay slowly).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace duet {

class NgramTrie {
 public:
  static constexpr int32_t kRoot = 0;
  static constexpr int32_t kNoNode = -1;

  NgramTrie(int32_t max_ngram, int64_t max_nodes);

  // Counts the n-grams (n <= max_ngram) that end at the last token of `tokens`. Called once per
  // appended token, this counts every n-gram of the sequence exactly once.
  void AddLastToken(absl::Span<const int32_t> tokens);
  // AddLastToken for the last call's tokens plus `token`, without them: false (nothing counted)
  // when the trie no longer has that call's state (e.g. after an eviction).
  bool AppendToken(int32_t token);
  // Counts every n-gram of `tokens`.
  void AddSequence(absl::Span<const int32_t> tokens);

  // The node of n-gram `path`, or kNoNode when it was never seen (or was evicted).
  int32_t Find(absl::Span<const int32_t> path) const;
  absl::Span<const int32_t> Children(int32_t node) const { return nodes_[size_t(node)].children; }
  int32_t Token(int32_t node) const { return nodes_[size_t(node)].token; }
  int64_t Count(int32_t node) const { return nodes_[size_t(node)].count; }
  // Sum of the children's counts (the denominator of a continuation's frequency).
  int64_t ChildCount(int32_t node) const { return nodes_[size_t(node)].child_count; }

  int32_t max_ngram() const { return max_ngram_; }
  int64_t num_nodes() const { return int64_t(nodes_.size()); }

 private:
  struct Node {
    int32_t token = -1;
    int32_t parent = kNoNode;
    int64_t count = 0;
    int64_t child_count = 0;
    std::vector<int32_t> children;
  };
  static uint64_t EdgeKey(int32_t node, int32_t token) { return (uint64_t(uint32_t(node)) << 32) | uint32_t(token); }
  int32_t Child(int32_t node, int32_t token) const;
  int32_t ChildOrNew(int32_t node, int32_t token);
  void Increment(int32_t node, int64_t by);
  // Halves counts and drops zero-count n-grams until at most 3/4 of max_nodes remain.
  void Evict();
  // Evicts past max_nodes; the last call's suffix nodes are forgotten (their ids change).
  void EvictIfFull();

  int32_t max_ngram_;
  int64_t max_nodes_;
  std::vector<Node> nodes_;                        // nodes_[0] is the root (the empty n-gram)
  absl::flat_hash_map<uint64_t, int32_t> edges_;  // (node, token) -> child (open addressing: the lookups are the cost)
  // The last AddLastToken call: its last max_ngram tokens and the nodes of its suffixes
  // (tail_nodes_[k]: the last k tokens; [0] the root).
  std::vector<int32_t> tail_tokens_;
  std::vector<int32_t> tail_nodes_;
  std::vector<int32_t> scratch_nodes_;
};

}  // namespace duet
