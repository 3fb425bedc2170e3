#include "engine/ngram_trie.h"

#include <algorithm>

#include "common/check.h"

namespace duet {

NgramTrie::NgramTrie(int32_t max_ngram, int64_t max_nodes) : max_ngram_(max_ngram), max_nodes_(max_nodes) {
  DUET_CHECK(max_ngram >= 1 && max_nodes >= 2);
  nodes_.emplace_back();
}

int32_t NgramTrie::Child(int32_t node, int32_t token) const {
  auto it = edges_.find(EdgeKey(node, token));
  return it == edges_.end() ? kNoNode : it->second;
}

int32_t NgramTrie::ChildOrNew(int32_t node, int32_t token) {
  auto [it, inserted] = edges_.try_emplace(EdgeKey(node, token), int32_t(nodes_.size()));
  if (inserted) {
    Node child;
    child.token = token;
    child.parent = node;
    nodes_.push_back(std::move(child));
    nodes_[size_t(node)].children.push_back(it->second);
  }
  return it->second;
}

void NgramTrie::Increment(int32_t node, int64_t by) {
  nodes_[size_t(node)].count += by;
  nodes_[size_t(nodes_[size_t(node)].parent)].child_count += by;
}

void NgramTrie::AddLastToken(absl::Span<const int32_t> tokens) {
  if (tokens.empty()) return;
  const size_t end = tokens.size();
  const size_t n = std::min(end, size_t(max_ngram_));  // the n-grams ending here: lengths 1..n
  const int32_t token = tokens[end - 1];
  // When `tokens` continue the last call's tokens, the n-grams ending here are one step from
  // that call's suffix nodes: AppendToken (max_ngram lookups instead of a walk per length).
  bool continues = tail_nodes_.size() >= n && tail_tokens_.size() + 1 >= n && tail_tokens_.size() <= end - 1;
  for (size_t i = 0; continues && i < tail_tokens_.size(); ++i) {
    continues = tail_tokens_[tail_tokens_.size() - 1 - i] == tokens[end - 2 - i];
  }
  if (continues && AppendToken(token)) return;
  std::vector<int32_t>& nodes = scratch_nodes_;  // nodes[k]: the n-gram of the last k tokens
  nodes.assign(n + 1, kRoot);
  for (size_t k = 1; k <= n; ++k) {
    int32_t node = kRoot;
    for (size_t i = end - k; i < end; ++i) node = ChildOrNew(node, tokens[i]);
    nodes[k] = node;
    Increment(nodes[k], 1);
  }
  tail_nodes_.swap(nodes);
  tail_tokens_.assign(tokens.end() - std::ptrdiff_t(n), tokens.end());
  EvictIfFull();
}

void NgramTrie::EvictIfFull() {
  if (num_nodes() <= max_nodes_) return;
  Evict();
  tail_nodes_.clear();  // node ids changed
  tail_tokens_.clear();
}

bool NgramTrie::AppendToken(int32_t token) {
  if (tail_nodes_.empty()) return false;
  const size_t end = tail_tokens_.size() + 1;  // the window's length with `token`
  const size_t n = std::min(end, size_t(max_ngram_));
  std::vector<int32_t>& nodes = scratch_nodes_;
  nodes.assign(n + 1, kRoot);
  for (size_t k = 1; k <= n; ++k) {
    nodes[k] = ChildOrNew(tail_nodes_[k - 1], token);
    Increment(nodes[k], 1);
  }
  tail_nodes_.swap(nodes);
  tail_tokens_.push_back(token);
  if (tail_tokens_.size() > size_t(max_ngram_)) tail_tokens_.erase(tail_tokens_.begin());
  EvictIfFull();
  return true;
}

void NgramTrie::AddSequence(absl::Span<const int32_t> tokens) {
  for (size_t end = 1; end <= tokens.size(); ++end) AddLastToken(tokens.subspan(0, end));
}

int32_t NgramTrie::Find(absl::Span<const int32_t> path) const {
  int32_t node = kRoot;
  for (int32_t token : path) {
    node = Child(node, token);
    if (node == kNoNode) return kNoNode;
  }
  return node;
}

void NgramTrie::Evict() {
  while (num_nodes() > max_nodes_ * 3 / 4) {
    // Parents precede children in nodes_, so one forward pass sees a parent's fate first.
    std::vector<int32_t> remap(nodes_.size(), kNoNode);
    std::vector<Node> kept;
    kept.reserve(nodes_.size());
    remap[kRoot] = 0;
    kept.emplace_back();
    for (size_t i = 1; i < nodes_.size(); ++i) {
      Node& n = nodes_[i];
      const int64_t count = n.count / 2;
      const int32_t parent = remap[size_t(n.parent)];
      if (count == 0 || parent == kNoNode) continue;
      remap[i] = int32_t(kept.size());
      Node copy;
      copy.token = n.token;
      copy.parent = parent;
      copy.count = count;
      kept.push_back(std::move(copy));
    }
    edges_.clear();
    for (size_t i = 1; i < kept.size(); ++i) {
      Node& parent = kept[size_t(kept[i].parent)];
      parent.children.push_back(int32_t(i));
      parent.child_count += kept[i].count;
      edges_.emplace(EdgeKey(kept[i].parent, kept[i].token), int32_t(i));
    }
    nodes_ = std::move(kept);
  }
}

}  // namespace duet
