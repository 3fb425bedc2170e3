#include "engine/speculation/spec_decode.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace duet {
namespace {

// Throughputs within this factor are a tie, which the plan with fewer drafts wins.
constexpr double kPlanTie = 1.0001;

}  // namespace

void CutDraftToGrammar(const Request& r, DraftTree& tree) {
  if (r.grammar == nullptr || tree.empty()) return;
  const std::vector<int32_t>& eos = r.grammar->compiled().vocab().eos_ids();
  // Per kept node, the grammar's state after it (nullopt: the output ends there); [0] the root's.
  std::vector<std::optional<grammar::GrammarMatcher>> after{*r.grammar};
  std::vector<int32_t> kept_index(tree.tokens.size(), -1);  // node -> its index in the cut tree
  DraftTree cut;
  for (size_t j = 0; j < tree.tokens.size(); ++j) {
    const int32_t parent = tree.parents[j];
    const int32_t parent_kept = parent < 0 ? -1 : kept_index[size_t(parent)];
    if (parent >= 0 && parent_kept < 0) continue;  // its parent was cut
    const std::optional<grammar::GrammarMatcher>& state = after[size_t(parent_kept + 1)];
    if (!state.has_value()) continue;
    const int32_t token = tree.tokens[j];
    const bool is_eos = std::find(eos.begin(), eos.end(), token) != eos.end();
    if (is_eos && r.params.ignore_eos) continue;  // masked out, as FillTokenMask does
    grammar::GrammarMatcher next = *state;  // a copy is a fork
    if (!next.AcceptToken(token)) continue;
    kept_index[j] = cut.size();
    cut.Add(token, parent_kept);
    if (is_eos || next.IsTerminated()) {
      after.emplace_back(std::nullopt);
    } else {
      after.emplace_back(std::move(next));
    }
  }
  tree = std::move(cut);
}

std::vector<int32_t> VerifyDraftTree(absl::Span<const int32_t> tokens, absl::Span<const int32_t> parents,
                                     const std::function<int32_t(int32_t node)>& draw,
                                     const std::function<bool(int32_t token)>& emit) {
  DUET_CHECK(!tokens.empty() && parents.size() == tokens.size() && parents[0] == -1);
  std::vector<int32_t> accepted;
  int32_t node = 0;
  while (true) {
    const int32_t token = draw(node);
    if (!emit(token)) break;
    int32_t next = -1;
    for (size_t j = size_t(node) + 1; j < tokens.size(); ++j) {
      if (parents[j] == node && tokens[j] == token) {
        next = int32_t(j);
        break;
      }
    }
    if (next < 0) break;
    accepted.push_back(next);
    node = next;
  }
  return accepted;
}

// Buckets: every T up to 16, then steps of about 1/8.
int64_t StepCostModel::BucketAtOrAbove(int64_t num_tokens) {
  if (num_tokens <= 16) return std::max<int64_t>(num_tokens, 1);
  int64_t b = 16;
  while (b < num_tokens) b += std::max<int64_t>(1, b / 8);
  return b;
}

int64_t StepCostModel::BucketBelow(int64_t num_tokens) {
  if (num_tokens <= 17) return std::max<int64_t>(num_tokens - 1, 1);
  int64_t b = 16;
  while (b + std::max<int64_t>(1, b / 8) < num_tokens) b += std::max<int64_t>(1, b / 8);
  return b;
}

double StepCostModel::BucketSeconds(int64_t bucket, const Bucket& b) const {
  if (b.has_observed) return b.observed;
  // The scratch table gives the shape; real steps give the scale: the ratio of real to measured
  // of the nearest observed buckets around this one (interpolated in log space), else the
  // running ratio of all real steps.
  double log_ratio = log_real_over_measured_;
  auto hi = observed_.lower_bound(bucket);
  const bool has_hi = hi != observed_.end(), has_lo = hi != observed_.begin();
  auto log_ratio_at = [this](std::map<int64_t, double>::const_iterator it) {
    return std::log(it->second / buckets_.at(it->first).measured);
  };
  if (has_lo && has_hi) {
    auto lo = std::prev(hi);
    const double f = double(bucket - lo->first) / double(hi->first - lo->first);
    log_ratio = (1 - f) * log_ratio_at(lo) + f * log_ratio_at(hi);
  } else if (has_lo) {
    log_ratio = log_ratio_at(std::prev(hi));
  } else if (has_hi) {
    log_ratio = log_ratio_at(hi);
  }
  return b.measured * std::exp(log_ratio);
}

double StepCostModel::Seconds(int64_t num_tokens) const {
  num_tokens = std::max<int64_t>(num_tokens, 1);
  // Nothing known: a second per token (no plan pays for that).
  if (buckets_.empty()) return double(num_tokens);
  auto hi = buckets_.lower_bound(num_tokens);
  if (hi != buckets_.end() && (hi->first == num_tokens || hi == buckets_.begin())) {
    return BucketSeconds(hi->first, hi->second);
  }
  auto lo = std::prev(hi);
  const double lo_seconds = BucketSeconds(lo->first, lo->second);
  if (hi == buckets_.end()) return lo_seconds * double(num_tokens) / double(lo->first);
  const double f = double(num_tokens - lo->first) / double(hi->first - lo->first);
  return (1 - f) * lo_seconds + f * BucketSeconds(hi->first, hi->second);
}

bool StepCostModel::Observed(int64_t num_tokens) const {
  num_tokens = std::max<int64_t>(num_tokens, 1);
  const int64_t hi = BucketAtOrAbove(num_tokens), lo = hi == num_tokens ? hi : BucketBelow(num_tokens);
  for (int64_t bucket : {lo, hi}) {
    auto it = buckets_.find(bucket);
    if (it == buckets_.end() || !it->second.has_observed) return false;
  }
  return true;
}

void StepCostModel::MeasureUpTo(int64_t max_tokens, double budget_seconds) {
  const auto start = std::chrono::steady_clock::now();
  auto spent = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  if (!measure_(1)) return;  // a first forward pays for cold caches and threads starting
  const int64_t last = BucketAtOrAbove(max_tokens);
  // Doubling sizes first (the whole range, coarsely, where the budget is short), then the buckets
  // between them, smallest first.
  std::vector<int64_t> order;
  for (int64_t t = 1; t < last; t *= 2) order.push_back(BucketAtOrAbove(t));
  order.push_back(last);
  for (int64_t b = 1; b <= last; b = BucketAtOrAbove(b + 1)) {
    if (std::find(order.begin(), order.end(), b) == order.end()) order.push_back(b);
  }
  int64_t cannot_run = last + 1;  // the smallest size that could not run (larger ones cannot either)
  for (int64_t b : order) {
    if (spent() > budget_seconds) return;
    if (b >= cannot_run || (buckets_.count(b) && buckets_[b].measured > 0)) continue;
    // Best of three runs: the step's own cost, not a neighbour's interference.
    std::optional<double> best;
    for (int i = 0; i < 3; ++i) {
      std::optional<double> s = measure_(b);
      if (!s) break;
      best = best ? std::min(*best, *s) : *s;
    }
    if (best) {
      buckets_[b].measured = *best;
    } else {
      cannot_run = b;
    }
  }
}

void StepCostModel::Observe(int64_t num_tokens, double seconds) {
  num_tokens = std::max<int64_t>(num_tokens, 1);
  if (!(seconds > 0)) return;
  const int64_t hi = BucketAtOrAbove(num_tokens), lo = hi == num_tokens ? hi : BucketBelow(num_tokens);
  const double f = hi == lo ? 1.0 : double(num_tokens - lo) / double(hi - lo);
  // About the last ten real steps (a step's time moves with the load on a shared machine).
  constexpr double kWeight = 0.2;
  // Where the scratch table covers T, the step teaches how far real steps are from it, and it
  // scales to the neighbouring buckets as their measurements do; elsewhere in proportion to T.
  const Bucket* lo_b = buckets_.count(lo) ? &buckets_[lo] : nullptr;
  const Bucket* hi_b = buckets_.count(hi) ? &buckets_[hi] : nullptr;
  double measured = 0;
  if (lo_b != nullptr && hi_b != nullptr && lo_b->measured > 0 && hi_b->measured > 0) {
    measured = (1 - f) * lo_b->measured + f * hi_b->measured;
    log_real_over_measured_ += kWeight * (std::log(seconds / measured) - log_real_over_measured_);
  }
  for (auto [bucket, share] : {std::pair{lo, 1 - f}, std::pair{hi, f}}) {
    if (share <= 0) continue;
    Bucket& b = buckets_[bucket];
    const double real = measured > 0 ? b.measured * seconds / measured : seconds * double(bucket) / double(num_tokens);
    if (!b.has_observed) {
      b.observed = real;
      b.has_observed = true;
    } else {
      b.observed *= std::exp(kWeight * share * (std::log(real) - std::log(b.observed)));
    }
    if (b.measured > 0) observed_[bucket] = b.observed;
  }
}

namespace {

// A cost function asked for many times per plan (every request × every candidate) runs once per
// token count: counts are below `size`.
class MemoizedCost {
 public:
  MemoizedCost(const CostFn& fn, size_t size) : fn_(fn), cache_(size, -1.0) {}
  double operator()(int64_t num_tokens) {
    double& c = cache_[size_t(num_tokens)];
    if (c < 0) c = fn_(num_tokens);
    return c;
  }

 private:
  const CostFn& fn_;
  std::vector<double> cache_;
};

// PlanDraftBudgets' search: a plan (draft tokens per request) and its totals, kept up to date as
// one request's budget changes, scored by the step's cost model.
class DraftBudgetPlanner {
 public:
  DraftBudgetPlanner(absl::Span<const BudgetRequest> requests, int64_t base_tokens, int64_t base_samples,
                     const CostFn& plain_cost, const CostFn& verify_cost, const CostFn& draft_cost,
                     const CostFn& self_cost, PlanObjective objective, int32_t max_cap, int64_t total_cap)
      : requests_(requests),
        objective_(objective),
        base_tokens_(base_tokens),
        max_cap_(max_cap),
        verify_(verify_cost, size_t(base_tokens + total_cap + 1)),
        draft_(draft_cost, 2 * requests.size() + 1),
        self_(self_cost, requests.size() + 1),
        plain_seconds_(plain_cost(base_tokens)),
        any_model_drafts_(std::any_of(requests.begin(), requests.end(),
                                      [](const BudgetRequest& r) {
                                        return r.mode == SpeculationMode::kDraft || r.mode == SpeculationMode::kSelf;
                                      })),
        k_(requests.size(), 0),
        tokens_(base_tokens),
        expected_(double(base_samples)),
        draft_rounds_(size_t(max_cap), 0),
        self_rounds_(size_t(max_cap), 0),
        gains_(requests.size(), 0.0),
        seconds_per_token_sum_(double(requests.size())) {}

  const std::vector<int32_t>& plan() const { return k_; }

  // Gives request i `drafts` draft tokens.
  void Set(size_t i, int32_t drafts) {
    std::vector<int64_t>* rounds = requests_[i].mode == SpeculationMode::kDraft  ? &draft_rounds_
                                   : requests_[i].mode == SpeculationMode::kSelf ? &self_rounds_
                                                                                  : nullptr;
    if (rounds != nullptr) {
      for (int32_t d = drafts; d < k_[i]; ++d) --(*rounds)[size_t(d)];
      for (int32_t d = k_[i]; d < drafts; ++d) ++(*rounds)[size_t(d)];
    }
    tokens_ += drafts - k_[i];
    const double g = Gain(i, drafts);
    expected_ += g - gains_[i];
    seconds_per_token_sum_ += 1.0 / (1.0 + g) - 1.0 / (1.0 + gains_[i]);
    gains_[i] = g;
    k_[i] = drafts;
  }

  void SetAll(const std::vector<int32_t>& plan) {
    for (size_t i = 0; i < plan.size(); ++i) Set(i, plan[i]);
  }

  // The plan's score (higher is better) with `extra` seconds added to the step.
  double Score(double extra = 0) {
    const double seconds = StepSeconds() + extra;
    return objective_ == PlanObjective::kThroughput ? expected_ / seconds
                                                    : double(requests_.size()) / (seconds * seconds_per_token_sum_);
  }

  // Coordinate ascent from the current plan, requests in `order`: each in turn takes its best
  // budget given the others'; returns the final score.
  double Ascend(const std::vector<size_t>& order) {
    for (int pass = 0; pass < 2; ++pass) {
      bool changed = false;
      for (size_t i : order) {
        const int32_t before = k_[i];
        const int32_t best_k = BestBudget(i);
        Set(i, best_k);
        changed |= best_k != before;
      }
      if (!changed) break;  // e.g. nobody's drafts pay: one pass decides
    }
    return Score();
  }

 private:
  // Expected accepted tokens of request i with `drafts` drafts: sum_{d=1..depth} a^d, where a
  // chain of k tokens is k deep and a tree of k tokens as deep as its first k tokens reach.
  double Gain(size_t i, int32_t drafts) const {
    const BudgetRequest& r = requests_[i];
    const int32_t depth = drafts == 0 || r.depth_of_first.empty() ? drafts : r.depth_of_first[size_t(drafts - 1)];
    double g = 0, p = 1;
    for (int32_t d = 0; d < depth; ++d) g += (p *= r.acceptance);
    return g;
  }

  double StepSeconds() {
    double seconds = tokens_ == base_tokens_ ? plain_seconds_ : verify_(tokens_);
    for (int32_t d = 0; any_model_drafts_ && d < max_cap_; ++d) {
      // The first draft round also catches the draft model up on the last step's tokens.
      if (draft_rounds_[size_t(d)] > 0) seconds += draft_(draft_rounds_[size_t(d)] * (d == 0 ? 2 : 1));
      if (self_rounds_[size_t(d)] > 0) seconds += self_(self_rounds_[size_t(d)]);
    }
    return seconds;
  }

  // Request i's best budget with the others' as they are (leaves it at its cap).
  int32_t BestBudget(size_t i) {
    int32_t best_k = 0;
    double best = -1;
    for (int32_t c = 0; c <= requests_[i].cap; ++c) {
      Set(i, c);
      const double t = Score();
      if (t > best * kPlanTie) {  // ties keep fewer drafts
        best = t;
        best_k = c;
      }
    }
    return best_k;
  }

  const absl::Span<const BudgetRequest> requests_;
  const PlanObjective objective_;
  const int64_t base_tokens_;
  const int32_t max_cap_;
  MemoizedCost verify_, draft_, self_;
  const double plain_seconds_;
  const bool any_model_drafts_;

  // The plan and its totals.
  std::vector<int32_t> k_;
  int64_t tokens_;
  double expected_;
  std::vector<int64_t> draft_rounds_, self_rounds_;  // requests drafting in each round
  std::vector<double> gains_;
  double seconds_per_token_sum_;  // sum_r 1 / (1 + gains_[r]), times the step's seconds
};

}  // namespace

std::vector<int32_t> PlanDraftBudgets(absl::Span<const BudgetRequest> requests, int64_t base_tokens,
                                      int64_t base_samples, const CostFn& plain_cost, const CostFn& verify_cost,
                                      const CostFn& draft_cost,
                                      const CostFn& self_cost, double min_gain, double overhead_seconds,
                                      PlanObjective objective) {
  const size_t n = requests.size();
  int32_t max_cap = 0;
  int64_t total_cap = 0;
  for (const BudgetRequest& r : requests) {
    max_cap = std::max(max_cap, r.cap);
    total_cap += std::max(r.cap, 0);
  }
  if (max_cap == 0) return std::vector<int32_t>(n, 0);

  DraftBudgetPlanner planner(requests, base_tokens, base_samples, plain_cost, verify_cost, draft_cost, self_cost,
                             objective, max_cap, total_cap);
  const double without_drafts = planner.Score();
  // The most promising requests choose first.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return requests[a].acceptance > requests[b].acceptance; });
  // From no drafts, then from every request drafting all it may: when the first draft of a step
  // costs a jump (a verification step is dearer than a plain one, as on the GPU), no single
  // request's drafts pay for it and the ascent from none stops there.
  double best = planner.Ascend(order);
  std::vector<int32_t> best_plan = planner.plan();
  for (size_t i = 0; i < n; ++i) planner.Set(i, requests[i].cap);
  if (const double from_all = planner.Ascend(order); from_all > best * kPlanTie) {
    best = from_all;
    best_plan = planner.plan();
  }
  // Worth it only when it beats no drafts by the margin after paying the overhead too (which the
  // choice above leaves out: this step has paid it already).
  planner.SetAll(best_plan);
  if (planner.Score(overhead_seconds) < min_gain * without_drafts) {
    std::fill(best_plan.begin(), best_plan.end(), 0);
  }
  return best_plan;
}

absl::StatusOr<std::unique_ptr<SpeculativeDecoder>> SpeculativeDecoder::Create(const SpeculationConfig& config,
                                                                              ModelExecutor& executor,
                                                                              BlockManager& blocks, KvCache& cache,
                                                                              const Tokenizer& tokenizer,
                                                                              const ModelDrafter::ExecutorLoader& load_draft) {
  // A verified tree (root + drafts) is at most 64 tokens: the CUDA backend's ancestor masks.
  if (config.max_draft_tokens < 0 || config.max_draft_tokens > 63) {
    return absl::InvalidArgumentError("max_draft_tokens must be in [0, 63]");
  }
  std::unique_ptr<ModelDrafter> draft, self;
  if (executor.SupportsTreeAttention()) {
    if (!config.draft_model_dir.empty()) {
      absl::StatusOr<std::unique_ptr<ModelDrafter>> d = ModelDrafter::LoadDraftModel(
          config.draft_model_dir, load_draft, executor.config(), tokenizer, blocks.num_blocks(), blocks.block_size());
      if (!d.ok()) return d.status();
      draft = std::move(*d);
    }
    const int64_t layers = config.self_spec_layers > 0 ? config.self_spec_layers
                                                       : std::max<int64_t>(1, executor.config().num_layers / 2);
    absl::StatusOr<std::unique_ptr<ModelDrafter>> s = ModelDrafter::SelfSpeculation(executor, layers);
    if (s.ok()) {
      self = std::move(*s);
    } else if (config.self_spec_layers > 0) {
      return s.status();
    }
  }
  if (config.default_mode == SpeculationMode::kDraft && draft == nullptr && executor.SupportsTreeAttention()) {
    return absl::InvalidArgumentError("speculation 'draft' needs a draft model (--draft-model)");
  }
  // A server that speculates by default verifies from its first steps: prepare the target (and
  // the default mode's drafter, which decodes without drafts of its own) now.
  if (config.default_mode != SpeculationMode::kNone && executor.SupportsTreeAttention()) {
    if (absl::Status s = executor.WarmUpVerification(cache, config.max_draft_tokens); !s.ok()) return s;
    if (config.default_mode == SpeculationMode::kDraft && draft != nullptr) {
      if (absl::Status s = draft->executor().WarmUpVerification(*draft->own_cache(), 0); !s.ok()) return s;
    }
    if (config.default_mode == SpeculationMode::kSelf && self != nullptr) {
      if (absl::Status s = self->executor().WarmUpVerification(cache, 0); !s.ok()) return s;
    }
  }
  return std::unique_ptr<SpeculativeDecoder>(
      new SpeculativeDecoder(config, executor, blocks, cache, std::move(draft), std::move(self)));
}

SpeculativeDecoder::SpeculativeDecoder(const SpeculationConfig& config, ModelExecutor& executor,
                                       BlockManager& blocks, KvCache& cache, std::unique_ptr<ModelDrafter> draft,
                                       std::unique_ptr<ModelDrafter> self)
    : config_(config),
      executor_(executor),
      blocks_(blocks),
      cache_(cache),
      lookahead_(config.lookahead),
      draft_(std::move(draft)),
      self_(std::move(self)),
      target_cost_([this](int64_t t) { return MeasureForward(executor_, blocks_, cache_, t, 1); }),
      verify_cost_([this](int64_t t) {
        return MeasureForward(executor_, blocks_, cache_, t, std::min<int64_t>(t, 1 + config_.max_draft_tokens));
      }) {
  if (draft_) {
    draft_cost_.emplace(
        [this](int64_t t) { return MeasureForward(draft_->executor(), *draft_->own_blocks(), *draft_->own_cache(), t, 1); });
  }
  if (self_) {
    self_cost_.emplace([this](int64_t t) { return MeasureForward(self_->executor(), blocks_, cache_, t, 1); });
  }
}

void SpeculativeDecoder::WarmUpCosts(int64_t max_decoding) {
  if (costs_measured_) return;
  costs_measured_ = true;
  Excluded([&] {
    MeasureCosts(max_decoding);
    return 0;
  });
}

void SpeculativeDecoder::MeasureCosts(int64_t max_decoding) {
  constexpr double kBudgetSeconds = 0.5;  // per cost model
  target_cost_.MeasureUpTo(max_decoding, kBudgetSeconds);
  verify_cost_.MeasureUpTo(max_decoding * (1 + config_.max_draft_tokens), kBudgetSeconds);
  if (draft_cost_) draft_cost_->MeasureUpTo(2 * max_decoding, kBudgetSeconds);
  if (self_cost_) self_cost_->MeasureUpTo(max_decoding, kBudgetSeconds);
}

void SpeculativeDecoder::BeginStep() {
  step_start_ = std::chrono::steady_clock::now();
  step_excluded_seconds_ = 0;
}

void SpeculativeDecoder::EndStep(int64_t num_tokens, bool verification) {
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start_).count() - step_excluded_seconds_;
  (verification ? verify_cost_ : target_cost_).Observe(num_tokens, seconds);
}

std::optional<double> SpeculativeDecoder::MeasureForward(ModelExecutor& executor, BlockManager& blocks,
                                                         KvCache& cache, int64_t num_tokens, int64_t chunk_tokens) {
  // Chunks after a one-token context on scratch sequences (ids no request uses): one token each
  // like a decode batch, or chains verified as draft trees.
  constexpr SequenceId kScratchBase = ~SequenceId{0} - (SequenceId{1} << 20);
  const int64_t num_seqs = (num_tokens + chunk_tokens - 1) / chunk_tokens;
  const int64_t blocks_per_seq = (chunk_tokens + 1 + blocks.block_size() - 1) / blocks.block_size();
  if (num_seqs * blocks_per_seq > blocks.num_free_blocks()) return std::nullopt;
  std::vector<int32_t> ids(size_t(num_tokens), 0);
  std::vector<int32_t> chain(static_cast<size_t>(chunk_tokens));
  for (int64_t j = 0; j < chunk_tokens; ++j) chain[size_t(j)] = int32_t(j) - 1;
  std::vector<SequenceChunk> chunks;
  for (int64_t t = 0; t < num_tokens; t += chunk_tokens) {
    const SequenceId seq = kScratchBase + SequenceId(chunks.size());
    DUET_CHECK(blocks.Reserve(seq, chunk_tokens + 1, 0, nullptr).ok());
    const int64_t n = std::min(chunk_tokens, num_tokens - t);
    SequenceChunk& c = chunks.emplace_back(SequenceChunk{absl::MakeConstSpan(&ids[size_t(t)], size_t(n)), 1,
                                                         blocks.BlockTable(seq), seq, int32_t(n)});
    if (n > 1) c.tree_parents = absl::MakeConstSpan(chain.data(), size_t(n));
  }
  // As real steps run: sampling on the device where the executor can (the same graphs).
  std::vector<float> logits;
  std::vector<DeviceSample> samples;
  const std::vector<DeviceSamplingRow> greedy(static_cast<size_t>(num_tokens));
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = executor.CanSampleOnDevice() ? executor.ForwardSample(chunks, cache, greedy, samples)
                                                      : executor.Forward(chunks, cache, logits);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int64_t i = 0; i < num_seqs; ++i) blocks.Free(kScratchBase + SequenceId(i));
  if (!s.ok()) return std::nullopt;
  return seconds;
}

absl::StatusOr<SpeculationMode> SpeculativeDecoder::Resolve(std::optional<SpeculationMode> requested) const {
  const SpeculationMode mode = requested.value_or(config_.default_mode);
  if (mode == SpeculationMode::kNone || !executor_.SupportsTreeAttention()) return SpeculationMode::kNone;
  if (mode == SpeculationMode::kDraft && draft_ == nullptr) {
    return absl::InvalidArgumentError("speculation 'draft' needs the server started with a draft model (--draft-model)");
  }
  if (mode == SpeculationMode::kSelf && self_ == nullptr) {
    return absl::InvalidArgumentError("speculation 'self' is not available for this model");
  }
  return mode;
}

double SpeculativeDecoder::AcceptancePrior(SpeculationMode mode) const {
  // Optimistic (0.8) while the engine has no outcomes of the mode, so its first drafts get tried.
  const AcceptanceCounts& c = mode_acceptance_[size_t(mode)];
  return (c.accepted + 0.8) / (c.trials + 1.0);
}

bool SpeculativeDecoder::IndexQueuedOutputs(int64_t max_tokens) { return lookahead_.IndexQueued(max_tokens); }

void SpeculativeDecoder::OnFinished(Request& r) {
  if (r.spec.mode == SpeculationMode::kLookahead) lookahead_.AddOutput(r.output);
  if (draft_) draft_->Release(r.seq_id);
}

double SpeculativeDecoder::VerifySeconds(int64_t num_tokens) const {
  constexpr double kUnseenFactor = 1.2;
  return verify_cost_.Seconds(num_tokens) * (verify_cost_.Observed(num_tokens) ? 1.0 : kUnseenFactor);
}

bool SpeculativeDecoder::DraftsCanPay(absl::Span<Request* const> decoding) {
  // About the best the planner could find: the r most promising requests draft a chain of c
  // tokens each (drafting itself free), the step also paying for the planning that a step
  // without speculation skips. If no such plan beats no drafts by the planner's margin, no
  // real plan does.
  std::vector<double> acceptance;
  for (const Request* r : decoding) {
    if (r->spec.mode != SpeculationMode::kNone) acceptance.push_back(r->spec.acceptance(AcceptancePrior(r->spec.mode)));
  }
  std::sort(acceptance.begin(), acceptance.end(), std::greater<double>());
  const int64_t n = int64_t(decoding.size()), speculating = int64_t(acceptance.size());
  if (speculating == 0) return false;
  const double without = double(n) / target_cost_.Seconds(n);
  const double overhead = plan_seconds_per_request_ * double(n);
  // gain[i]: request i's expected accepted tokens from a c-token chain, for the c at hand;
  // best[r]: the sum over the r most promising requests.
  std::vector<double> gain(size_t(speculating), 0.0), power(size_t(speculating), 1.0), best(size_t(speculating) + 1);
  for (int32_t c = 1; c <= config_.max_draft_tokens; ++c) {
    for (size_t i = 0; i < gain.size(); ++i) {
      gain[i] += (power[i] *= acceptance[i]);
      best[i + 1] = best[i] + gain[i];
    }
    for (int64_t r = 1;; r = std::min(speculating, 2 * r)) {
      if (double(n) + best[size_t(r)] > kDefaultMinGain * without * (VerifySeconds(n + r * c) + overhead)) {
        return true;
      }
      if (r == speculating) break;
    }
  }
  return false;
}

void SpeculativeDecoder::Plan(absl::Span<Request* const> decoding, int64_t max_model_len, bool requests_waiting) {
  // Planning (proposing trees, the budget search) is work that only speculation does: it stays
  // out of the steps' observed costs and is charged to plans with drafts instead, per request.
  const auto start = std::chrono::steady_clock::now();
  const bool planned = PlanRequests(decoding, max_model_len,
                                    requests_waiting ? PlanObjective::kThroughput : PlanObjective::kLatency);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  step_excluded_seconds_ += seconds;
  if (planned && !decoding.empty()) {
    constexpr double kWeight = 0.2;
    plan_seconds_per_request_ += kWeight * (seconds / double(decoding.size()) - plan_seconds_per_request_);
  }
}

bool SpeculativeDecoder::PlanRequests(absl::Span<Request* const> decoding, int64_t max_model_len,
                                      PlanObjective objective) {
  // Finished outputs join the engine-wide index a slice per step (faster than lookahead requests
  // produce tokens), the rest when the engine idles (IndexQueuedOutputs).
  lookahead_.IndexQueued(std::max<int64_t>(kIndexedPerStep, 2 * int64_t(decoding.size())));
  for (Request* r : decoding) {
    r->spec.tree.Clear();
    r->spec.lookahead_slots = 0;
  }
  // A step where no draft can pay (a large batch on the CPU, guesses that keep missing): skip
  // proposing, but probe now and then (lookahead's guesses keep its acceptance estimates current
  // even when nothing is drafted).
  // Once nothing paid, the next steps of the same batch size skip even that check.
  bool can_pay = true;
  if (config_.adaptive) {
    const int64_t n = int64_t(decoding.size());
    if (skip_steps_left_ > 0 && n == skip_batch_size_) {
      // Every 4th skipped step, lookahead requests still guess one token (no draft): whether
      // the guess comes true keeps their acceptance estimates current, so drafting resumes when
      // their guesses get good.
      if (--skip_steps_left_ % 4 == 0) {
        for (Request* r : decoding) {
          if (r->spec.mode == SpeculationMode::kLookahead) {
            r->spec.tree = lookahead_.Propose({r->prompt, r->output}, 1);
            CutDraftToGrammar(*r, r->spec.tree);
          }
        }
      }
      return false;
    }
    can_pay = DraftsCanPay(decoding);
    if (!can_pay) {
      SkipAfterFruitlessPlan(n);
      const bool any_lookahead = std::any_of(decoding.begin(), decoding.end(), [](const Request* r) {
        return r->spec.mode == SpeculationMode::kLookahead;
      });
      if (!any_lookahead) return false;
      // A probe: lookahead proposes (its guesses are scored without drafting) but drafts nothing.
    }
  }
  std::vector<BudgetRequest> budget;
  for (Request* r : decoding) {
    SpeculationState& s = r->spec;
    // Never draft past max_tokens or the context limit (the bonus token takes one more).
    const int64_t room = std::min<int64_t>(int64_t(r->params.max_tokens) - int64_t(r->output.size()),
                                           max_model_len - r->num_tokens()) - 1;
    int32_t cap = int32_t(std::clamp<int64_t>(room, 0, config_.max_draft_tokens));
    if (s.mode == SpeculationMode::kLookahead && cap > 0) {
      s.tree = lookahead_.Propose({r->prompt, r->output}, cap);
      CutDraftToGrammar(*r, s.tree);  // before the budget: room only for tokens that can be accepted
      cap = s.tree.size();
    }
    if (s.mode == SpeculationMode::kNone) cap = 0;
    BudgetRequest& b = budget.emplace_back(BudgetRequest{s.mode, s.acceptance(AcceptancePrior(s.mode)), cap, {}});
    if (s.mode == SpeculationMode::kLookahead) {
      std::vector<int32_t> depth(static_cast<size_t>(cap));
      for (int32_t j = 0; j < cap; ++j) {
        const int32_t parent = s.tree.parents[size_t(j)];
        depth[size_t(j)] = parent < 0 ? 1 : depth[size_t(parent)] + 1;
        b.depth_of_first.push_back(std::max(depth[size_t(j)], j > 0 ? b.depth_of_first.back() : 0));
      }
    }
  }
  std::vector<int32_t> k;
  if (!can_pay) {
    k.assign(decoding.size(), 0);
  } else if (config_.adaptive) {
    auto plain = [this](int64_t t) { return target_cost_.Seconds(t); };
    auto verify = [this](int64_t t) { return VerifySeconds(t); };
    auto draft = [this](int64_t t) { return draft_cost_ ? draft_cost_->Seconds(t) : 0.0; };
    auto self = [this](int64_t t) { return self_cost_ ? self_cost_->Seconds(t) : 0.0; };
    k = PlanDraftBudgets(budget, int64_t(decoding.size()), int64_t(decoding.size()), plain, verify, draft, self,
                         kDefaultMinGain, plan_seconds_per_request_ * double(decoding.size()), objective);
  } else {
    for (const BudgetRequest& b : budget) k.push_back(b.cap);
  }
  for (size_t i = 0; i < decoding.size(); ++i) decoding[i]->spec.lookahead_slots = k[i];
  if (can_pay && config_.adaptive) {
    // Fruitless: there were candidates (not only guess-less lookahead requests) and none paid.
    const bool candidates = std::any_of(budget.begin(), budget.end(), [](const BudgetRequest& b) { return b.cap > 0; });
    if (candidates && std::all_of(k.begin(), k.end(), [](int32_t x) { return x == 0; })) {
      SkipAfterFruitlessPlan(int64_t(decoding.size()));
    } else if (candidates) {
      fruitless_plans_ = 0;
    }
  }
  return true;
}

void SpeculativeDecoder::SkipAfterFruitlessPlan(int64_t batch_size) {
  // Backing off: 0, 1, 3, 7, then 15 steps skipped after consecutive fruitless plans.
  ++fruitless_plans_;
  skip_steps_left_ = std::min(kRecheckEvery, 1 << std::min(fruitless_plans_ - 1, 4)) - 1;
  skip_batch_size_ = batch_size;
}

absl::Status SpeculativeDecoder::Draft(absl::Span<Request* const> scheduled) {
  return Excluded([&] { return DraftRequests(scheduled); });
}

absl::Status SpeculativeDecoder::DraftRequests(absl::Span<Request* const> scheduled) {
  std::vector<ModelDrafter::Job> draft_jobs, self_jobs;
  std::vector<Request*> draft_requests, self_requests;
  std::vector<std::vector<int32_t>> all_tokens;
  all_tokens.reserve(scheduled.size());
  for (Request* r : scheduled) {
    SpeculationState& s = r->spec;
    const int32_t budget = s.lookahead_slots;
    if (s.mode == SpeculationMode::kLookahead) {
      // Best-first order: the first `budget` nodes are the best subtree.
      s.tree.tokens.resize(size_t(std::min(budget, s.tree.size())));
      s.tree.parents.resize(s.tree.tokens.size());
      continue;
    }
    s.tree.Clear();
    if (budget <= 0) continue;
    std::vector<int32_t>& tokens = all_tokens.emplace_back(r->prompt);
    tokens.insert(tokens.end(), r->output.begin(), r->output.end());
    ModelDrafter::Job job{r->seq_id, tokens, blocks_.BlockTable(r->seq_id), budget};
    if (r->grammar) job.grammar = *r->grammar;
    job.ignore_eos = r->params.ignore_eos;
    if (s.mode == SpeculationMode::kDraft) {
      draft_jobs.push_back(std::move(job));
      draft_requests.push_back(r);
    } else if (s.mode == SpeculationMode::kSelf) {
      self_jobs.push_back(std::move(job));
      self_requests.push_back(r);
    }
  }
  auto run = [&](ModelDrafter* drafter, std::vector<ModelDrafter::Job>& jobs, std::vector<Request*>& requests,
                 std::optional<StepCostModel>& cost) {
    if (jobs.empty()) return absl::OkStatus();
    auto observe = [&cost](int64_t num_tokens, double seconds) { cost->Observe(num_tokens, seconds); };
    if (absl::Status st = drafter->Propose(absl::MakeSpan(jobs), cache_, observe); !st.ok()) return st;
    for (size_t i = 0; i < jobs.size(); ++i) {
      DraftTree& tree = requests[i]->spec.tree;
      for (int32_t token : jobs[i].draft) tree.Add(token, tree.size() - 1);  // within the grammar (Job::grammar)
    }
    return absl::OkStatus();
  };
  if (absl::Status st = run(draft_.get(), draft_jobs, draft_requests, draft_cost_); !st.ok()) return st;
  return run(self_.get(), self_jobs, self_requests, self_cost_);
}

void SpeculativeDecoder::OnVerified(Request& r, int32_t tree_size, absl::Span<const int32_t> accepted_depths,
                                    bool missed) {
  SpeculationState& s = r.spec;
  constexpr double kDecay = 0.9;  // about the last ten steps
  s.accepted *= kDecay;
  s.trials *= kDecay;
  // The mode's engine-wide counts (about the last hundred outcomes): a new request's prior.
  constexpr double kModeDecay = 0.99;
  AcceptanceCounts& mode = mode_acceptance_[size_t(s.mode)];
  auto count = [&](double accepted, double trials) {
    s.accepted += accepted;
    s.trials += trials;
    mode.accepted = kModeDecay * mode.accepted + accepted;
    mode.trials = kModeDecay * mode.trials + trials;
  };
  if (tree_size == 0) {
    // Lookahead guessed without drafting (budget 0): whether its first guess would have been
    // accepted keeps the estimate honest for free. Other modes drift back to the prior, so
    // they are tried again now and then.
    if (s.mode == SpeculationMode::kLookahead && !s.tree.empty() && !accepted_depths.empty()) {
      count(1, 1);
    } else if (s.mode == SpeculationMode::kLookahead && !s.tree.empty() && missed) {
      count(0, 1);
    }
    return;
  }
  const int32_t accepted = int32_t(accepted_depths.size());
  count(accepted, accepted + (missed ? 1 : 0));
  ++stats_.num_drafts;
  stats_.num_draft_tokens += tree_size;
  stats_.num_accepted_tokens += accepted;
  for (int32_t depth : accepted_depths) {
    if (stats_.accepted_per_pos.size() < size_t(depth)) stats_.accepted_per_pos.resize(size_t(depth), 0);
    ++stats_.accepted_per_pos[size_t(depth - 1)];
  }
}

}  // namespace duet
