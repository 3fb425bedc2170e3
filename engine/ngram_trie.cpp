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
  const size_t first = end > size_t(max_ngram_) ? end - size_t(max_ngram_) : 0;
  for (size_t start = first; start < end; ++start) {
    int32_t node = kRoot;
    for (size_t i = start; i < end; ++i) node = ChildOrNew(node, tokens[i]);
    Increment(node, 1);
  }
  if (num_nodes() > max_nodes_) Evict();
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
