#include "engine/speculation/lookahead_cache.h"

#include <algorithm>
#include <queue>

namespace duet {

LookaheadCache::LookaheadCache(const LookaheadOptions& options)
    : options_(options), global_(options.global_max_tokens) {}

void LookaheadCache::AddOutput(absl::Span<const int32_t> output) {
  if (output.empty()) return;
  queued_.emplace_back(output.begin(), output.end());
  queued_tokens_ += int64_t(output.size());
  // A backlog past the bound drops its oldest outputs (the ring would evict them first anyway).
  while (queued_tokens_ > options_.max_queued_tokens && queued_.size() > 2) {
    // Not the front: its indexing has begun.
    queued_tokens_ -= int64_t(queued_[1].size());
    queued_.erase(queued_.begin() + 1);
  }
}

bool LookaheadCache::IndexQueued(int64_t max_tokens) {
  while (!queued_.empty() && max_tokens > 0) {
    const std::vector<int32_t>& output = queued_.front();
    const size_t n = std::min(output.size() - front_indexed_, size_t(max_tokens));
    global_.Append(absl::MakeConstSpan(output).subspan(front_indexed_, n));
    front_indexed_ += n;
    max_tokens -= int64_t(n);
    queued_tokens_ -= int64_t(n);
    if (front_indexed_ == output.size()) {
      global_.EndOutput();
      queued_.pop_front();
      front_indexed_ = 0;
    }
  }
  return !queued_.empty();
}

DraftTree LookaheadCache::Propose(const TokenText& text, int32_t budget) {
  DraftTree tree;
  if (budget <= 0 || text.size() < 2) return tree;
  MatchSuffix(text, options_.max_match, options_.local_max_scan, options_.max_occurrences, local_positions_);
  std::vector<int32_t> context;
  for (int64_t i = std::max<int64_t>(0, text.size() - options_.max_match); i < text.size(); ++i) {
    context.push_back(text.at(i));
  }
  global_.Match(context, options_.max_match, options_.max_occurrences, global_positions_);
  if (local_positions_.empty() && global_positions_.empty()) return tree;

  // A tree node (or the root) is where its path occurred: a range of positions in each text's
  // arena (the last position of each occurrence). Its children are the tokens after them.
  struct Range {
    size_t begin = 0, end = 0;
    bool empty() const { return begin == end; }
    size_t size() const { return end - begin; }
  };
  std::vector<int64_t>& local_arena = local_positions_;  // ranges index these; groups append
  std::vector<int64_t>& global_arena = global_positions_;
  struct Candidate {
    double score;  // estimated probability of the whole path
    int32_t token;
    int32_t parent;  // tree index, -1 for the root
    Range local, global;
    bool operator<(const Candidate& o) const { return score < o.score; }
  };
  std::priority_queue<Candidate> frontier;

  // The continuations of `range`, grouped by token (ascending), each group's positions appended
  // to `arena`; returns how many occurrences continue.
  struct Group {
    int32_t token;
    Range range;
  };
  std::vector<std::pair<int32_t, int64_t>> pairs;
  auto group = [&pairs](std::vector<int64_t>& arena, Range range, const auto& next, std::vector<Group>& groups) {
    pairs.clear();
    for (size_t i = range.begin; i < range.end; ++i) {
      const int32_t token = next(arena[i]);
      if (token >= 0) pairs.emplace_back(token, arena[i] + 1);
    }
    std::sort(pairs.begin(), pairs.end());
    groups.clear();
    for (size_t i = 0; i < pairs.size(); ++i) {
      if (i == 0 || pairs[i].first != pairs[i - 1].first) groups.push_back({pairs[i].first, {arena.size(), arena.size()}});
      arena.push_back(pairs[i].second);
      groups.back().range.end = arena.size();
    }
    return pairs.size();
  };
  auto local_next = [&text](int64_t p) { return text.Next(p); };
  auto global_next = [this](int64_t p) { return global_.Next(p); };
  std::vector<Group> local_groups, global_groups;
  struct Next {
    int32_t token;
    double probability;
    Range local, global;
  };
  std::vector<Next> next;

  auto expand = [&](Range local, Range global, int32_t parent, double score) {
    const double local_total = double(group(local_arena, local, local_next, local_groups));
    const double global_total = double(group(global_arena, global, global_next, global_groups));
    // The request's own history predicts it best; the other outputs fill in.
    const bool both = !local.empty() && !global.empty();
    const double local_weight = both ? 0.7 : 1.0, global_weight = both ? 0.3 : 1.0;
    next.clear();
    size_t g = 0;
    for (const Group& l : local_groups) {
      for (; g < global_groups.size() && global_groups[g].token < l.token; ++g) {
        next.push_back({global_groups[g].token, global_weight * double(global_groups[g].range.size()) / global_total,
                        {}, global_groups[g].range});
      }
      Next& n = next.emplace_back(Next{l.token, local_weight * double(l.range.size()) / local_total, l.range, {}});
      if (g < global_groups.size() && global_groups[g].token == l.token) {
        n.probability += global_weight * double(global_groups[g].range.size()) / global_total;
        n.global = global_groups[g++].range;
      }
    }
    for (; g < global_groups.size(); ++g) {
      next.push_back({global_groups[g].token, global_weight * double(global_groups[g].range.size()) / global_total,
                      {}, global_groups[g].range});
    }
    // The tree takes at most `budget` nodes: more continuations of one node cannot be used.
    if (next.size() > size_t(budget)) {
      std::nth_element(next.begin(), next.begin() + budget, next.end(),
                       [](const Next& a, const Next& b) { return a.probability > b.probability; });
      next.resize(size_t(budget));
    }
    for (const Next& n : next) frontier.push({score * n.probability, n.token, parent, n.local, n.global});
  };

  expand({0, local_arena.size()}, {0, global_arena.size()}, -1, 1.0);
  while (tree.size() < budget && !frontier.empty()) {
    const Candidate c = frontier.top();
    frontier.pop();
    const int32_t index = tree.size();
    tree.Add(c.token, c.parent);
    if (tree.size() < budget) expand(c.local, c.global, index, c.score);
  }
  return tree;
}

}  // namespace duet
