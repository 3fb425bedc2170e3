#include "engine/lookahead_cache.h"

#include <algorithm>
#include <queue>

namespace duet {

LookaheadCache::LookaheadCache(const LookaheadOptions& options)
    : options_(options), global_(options.max_ngram, options.global_max_nodes) {}

int32_t LookaheadCache::LongestMatch(const NgramTrie& trie, absl::Span<const int32_t> context) const {
  const size_t longest = std::min<size_t>(context.size(), size_t(std::min(options_.max_match, trie.max_ngram() - 1)));
  for (size_t m = longest; m >= 1; --m) {
    const int32_t node = trie.Find(context.subspan(context.size() - m));
    if (node != NgramTrie::kNoNode && !trie.Children(node).empty()) return node;
  }
  return NgramTrie::kNoNode;
}

DraftTree LookaheadCache::Propose(const NgramTrie& local, absl::Span<const int32_t> context, int32_t budget) const {
  DraftTree tree;
  if (budget <= 0 || context.empty()) return tree;

  // A candidate continues a tree node (or the context) in the local and/or global trie.
  struct Candidate {
    double score;        // estimated probability of the whole path
    int32_t token;
    int32_t parent;      // tree index, -1 for the context
    int32_t local_node;  // the candidate's node in each trie, kNoNode where it is absent
    int32_t global_node;
    bool operator<(const Candidate& o) const { return score < o.score; }
  };
  std::priority_queue<Candidate> frontier;

  // Pushes the continuations of (local, global) after tree node `parent` whose path has
  // probability `score`, merging tokens that both tries know.
  auto expand = [&](int32_t local_node, int32_t global_node, int32_t parent, double score) {
    struct Next {
      double p_local = 0, p_global = 0;
      int32_t local_node = NgramTrie::kNoNode, global_node = NgramTrie::kNoNode;
    };
    std::vector<std::pair<int32_t, Next>> next;
    if (local_node != NgramTrie::kNoNode && local.ChildCount(local_node) > 0) {
      for (int32_t child : local.Children(local_node)) {
        Next& n = next.emplace_back(local.Token(child), Next{}).second;
        n.p_local = double(local.Count(child)) / double(local.ChildCount(local_node));
        n.local_node = child;
      }
    }
    const size_t num_local = next.size();  // a node's children hold distinct tokens
    if (global_node != NgramTrie::kNoNode && global_.ChildCount(global_node) > 0) {
      for (int32_t child : global_.Children(global_node)) {
        const int32_t token = global_.Token(child);
        auto it = std::find_if(next.begin(), next.begin() + std::ptrdiff_t(num_local),
                               [token](const auto& e) { return e.first == token; });
        Next& n = it != next.begin() + std::ptrdiff_t(num_local) ? it->second : next.emplace_back(token, Next{}).second;
        n.p_global = double(global_.Count(child)) / double(global_.ChildCount(global_node));
        n.global_node = child;
      }
    }
    const bool both = local_node != NgramTrie::kNoNode && global_node != NgramTrie::kNoNode;
    auto probability = [both](const Next& n) {
      // The request's own history predicts it best; earlier outputs fill in.
      return both ? 0.7 * n.p_local + 0.3 * n.p_global : n.p_local + n.p_global;
    };
    // The tree takes at most `budget` nodes: more continuations of one node cannot be used.
    if (next.size() > size_t(budget)) {
      std::nth_element(next.begin(), next.begin() + budget, next.end(), [&](const auto& a, const auto& b) {
        return probability(a.second) > probability(b.second);
      });
      next.resize(size_t(budget));
    }
    for (const auto& [token, n] : next) {
      const double p = probability(n);
      if (p > 0) frontier.push({score * p, token, parent, n.local_node, n.global_node});
    }
  };

  expand(LongestMatch(local, context), LongestMatch(global_, context), -1, 1.0);
  while (tree.size() < budget && !frontier.empty()) {
    const Candidate c = frontier.top();
    frontier.pop();
    const int32_t index = tree.size();
    tree.Add(c.token, c.parent);
    expand(c.local_node, c.global_node, index, c.score);
  }
  return tree;
}

}  // namespace duet
