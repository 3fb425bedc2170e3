#include "engine/speculation/lookahead_cache.h"

#include <algorithm>
#include <queue>

namespace duet {
namespace {

// A tree node (or the root) is where its path occurred: a range of positions in each text's
// arena (the last position of each occurrence). Its children are the tokens after them.
struct Range {
  size_t begin = 0, end = 0;
  bool empty() const { return begin == end; }
  size_t size() const { return end - begin; }
};

// Propose's best-first search over the continuations of the matched occurrences, in the
// request's own text (local) and in the other outputs (global).
class DraftTreeBuilder {
 public:
  // The arenas hold the matched occurrences' last positions; groups append to them.
  DraftTreeBuilder(const TokenText& text, const OutputNgramIndex& global, std::vector<int64_t>& local_arena,
                   std::vector<int64_t>& global_arena, int32_t budget)
      : text_(text), global_(global), local_arena_(local_arena), global_arena_(global_arena), budget_(budget) {}

  DraftTree Build() {
    DraftTree tree;
    Expand({0, local_arena_.size()}, {0, global_arena_.size()}, -1, 1.0);
    while (tree.size() < budget_ && !frontier_.empty()) {
      const Candidate c = frontier_.top();
      frontier_.pop();
      const int32_t index = tree.size();
      tree.Add(c.token, c.parent);
      if (tree.size() < budget_) Expand(c.local, c.global, index, c.score);
    }
    return tree;
  }

 private:
  struct Candidate {
    double score;  // estimated probability of the whole path
    int32_t token;
    int32_t parent;  // tree index, -1 for the root
    Range local, global;
    bool operator<(const Candidate& o) const { return score < o.score; }
  };
  struct Group {
    int32_t token;
    Range range;
  };
  struct Continuation {
    int32_t token;
    double probability;
    Range local, global;
  };

  // The continuations of `range`, grouped by token (ascending), each group's positions appended
  // to `arena`; returns how many occurrences continue.
  template <typename NextToken>
  size_t GroupContinuations(std::vector<int64_t>& arena, Range range, const NextToken& next,
                            std::vector<Group>& groups) {
    pairs_.clear();
    for (size_t i = range.begin; i < range.end; ++i) {
      const int32_t token = next(arena[i]);
      if (token >= 0) pairs_.emplace_back(token, arena[i] + 1);
    }
    std::sort(pairs_.begin(), pairs_.end());
    groups.clear();
    for (size_t i = 0; i < pairs_.size(); ++i) {
      if (i == 0 || pairs_[i].first != pairs_[i - 1].first) {
        groups.push_back({pairs_[i].first, {arena.size(), arena.size()}});
      }
      arena.push_back(pairs_[i].second);
      groups.back().range.end = arena.size();
    }
    return pairs_.size();
  }

  // Adds the best continuations of a node (its occurrences `local` and `global`) to the frontier.
  void Expand(Range local, Range global, int32_t parent, double score) {
    const double local_total =
        double(GroupContinuations(local_arena_, local, [this](int64_t p) { return text_.Next(p); }, local_groups_));
    const double global_total =
        double(GroupContinuations(global_arena_, global, [this](int64_t p) { return global_.Next(p); }, global_groups_));
    // The request's own history predicts it best; the other outputs fill in.
    const bool both = !local.empty() && !global.empty();
    MergeGroups(both ? 0.7 : 1.0, local_total, both ? 0.3 : 1.0, global_total);
    // The tree takes at most `budget` nodes: more continuations of one node cannot be used.
    if (next_.size() > size_t(budget_)) {
      std::nth_element(next_.begin(), next_.begin() + budget_, next_.end(),
                       [](const Continuation& a, const Continuation& b) { return a.probability > b.probability; });
      next_.resize(size_t(budget_));
    }
    for (const Continuation& n : next_) frontier_.push({score * n.probability, n.token, parent, n.local, n.global});
  }

  // next_ = the local and global groups merged by token, each with its share of its text's
  // occurrences, weighted.
  void MergeGroups(double local_weight, double local_total, double global_weight, double global_total) {
    auto global_only = [&](const Group& g) {
      return Continuation{g.token, global_weight * double(g.range.size()) / global_total, {}, g.range};
    };
    next_.clear();
    size_t g = 0;
    for (const Group& l : local_groups_) {
      for (; g < global_groups_.size() && global_groups_[g].token < l.token; ++g) {
        next_.push_back(global_only(global_groups_[g]));
      }
      Continuation& n =
          next_.emplace_back(Continuation{l.token, local_weight * double(l.range.size()) / local_total, l.range, {}});
      if (g < global_groups_.size() && global_groups_[g].token == l.token) {
        n.probability += global_weight * double(global_groups_[g].range.size()) / global_total;
        n.global = global_groups_[g++].range;
      }
    }
    for (; g < global_groups_.size(); ++g) next_.push_back(global_only(global_groups_[g]));
  }

  const TokenText& text_;
  const OutputNgramIndex& global_;
  std::vector<int64_t>& local_arena_;
  std::vector<int64_t>& global_arena_;
  const int32_t budget_;
  std::priority_queue<Candidate> frontier_;
  // Scratch, reused across expansions.
  std::vector<std::pair<int32_t, int64_t>> pairs_;
  std::vector<Group> local_groups_, global_groups_;
  std::vector<Continuation> next_;
};

}  // namespace

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
  if (budget <= 0 || text.size() < 2) return DraftTree();
  MatchSuffix(text, options_.max_match, options_.local_max_scan, options_.max_occurrences, local_positions_);
  std::vector<int32_t> context;
  for (int64_t i = std::max<int64_t>(0, text.size() - options_.max_match); i < text.size(); ++i) {
    context.push_back(text.at(i));
  }
  global_.Match(context, options_.max_match, options_.max_occurrences, global_positions_);
  if (local_positions_.empty() && global_positions_.empty()) return DraftTree();
  return DraftTreeBuilder(text, global_, local_positions_, global_positions_, budget).Build();
}

}  // namespace duet
