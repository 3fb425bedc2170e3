// Speculative decoding, per engine step:
//   1. budget   each decoding request gets a draft budget: per request from its recent
//               acceptance, per step from the measured cost of a step of T tokens, so the
//               expected tokens per second of the whole step is highest (zero when drafts do
//               not pay, e.g. a large batch that is no longer memory-bound);
//   2. draft    lookahead (n-gram trees), a draft model or self-speculation propose tokens;
//   3. verify   one target forward over [last token, draft tree] with tree attention;
//               at each node the target's token is drawn exactly as without speculation and the
//               walk descends into the child holding it (VerifyDraftTree), so greedy output is
//               identical and sampled output has the target's distribution;
//   4. compact  the accepted path's K/V move to the sequence's next slots; unused blocks go.
// LlmEngine drives these; this file holds the policy, drafting and bookkeeping.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/kv/block_manager.h"
#include "engine/model_executor.h"
#include "engine/request.h"
#include "engine/speculation/draft_model.h"
#include "engine/speculation/lookahead_cache.h"
#include "frontend/tokenizer/tokenizer.h"

namespace duet {

struct SpeculationConfig {
  SpeculationMode default_mode = SpeculationMode::kNone;  // for requests that do not choose
  std::string draft_model_dir;   // enables mode draft
  int32_t self_spec_layers = 0;  // layers of the target that draft in mode self; 0: half of them
  int32_t max_draft_tokens = 8;  // per request and step
  // Off: every request drafts max_draft_tokens every step (tests exercise verification).
  bool adaptive = true;
  LookaheadOptions lookahead;
};

// vLLM's spec-decode counters (cumulative).
struct SpecDecodeStats {
  int64_t num_drafts = 0;           // verified proposals (one per request and step)
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  std::vector<int64_t> accepted_per_pos;  // [depth - 1]: accepted draft tokens at that depth
};

// The walk over a verified draft tree. `tokens`/`parents` are the verification chunk (token 0 is
// the root, parents[0] = -1). From the root, `draw(node)` gives the target's token after `node`
// (sampled from that node's logits, as without speculation); `emit(token)` appends it and
// returns false when the request has finished. The walk descends into the child holding the
// drawn token and stops when none does. Returns the accepted nodes, root excluded; every drawn
// token was emitted.
std::vector<int32_t> VerifyDraftTree(absl::Span<const int32_t> tokens, absl::Span<const int32_t> parents,
                                     const std::function<int32_t(int32_t node)>& draw,
                                     const std::function<bool(int32_t token)>& emit);

// Cuts request r's draft tree to the paths its grammar allows (no-op without a grammar): a node
// goes, with its subtree, when the grammar rejects its token after the node's ancestors (the
// token mask the target samples under would never let it be accepted), and so do the children
// of a node that ends the output (EOS, or a grammar that allows nothing more). Kept nodes keep
// their order, so a best-first tree stays best first. Lookahead's trees pass through it; model
// drafts walk the grammar as they are drafted (ModelDrafter::Job::grammar).
void CutDraftToGrammar(const Request& r, DraftTree& tree);

// Seconds of one forward step of T tokens, in buckets of T (every T up to 16, then steps of
// about 1/8). Buckets are measured up front (MeasureUpTo: a scratch forward of one-token chunks,
// best of three; never while serving, where a measurement would stall the whole batch) and then
// follow the real steps: a real step of T tokens moves the buckets around T towards what it
// took (a running geometric mean). A measured bucket no real step has reached yet is scaled by
// how far real steps were from their measurements at the nearest buckets they reached (context
// length, cache state and the machine's load are in the real steps; the scratch measurement has
// none of them): the table gives the shape, real steps the scale. Between buckets the cost is
// interpolated; past the largest it grows in proportion to T, which
// errs high (a step's cost per token falls as T grows).
class StepCostModel {
 public:
  // Runs a representative forward of `num_tokens` tokens and returns its seconds; nullopt when
  // it cannot run now (no free KV blocks).
  using Measure = std::function<std::optional<double>(int64_t num_tokens)>;
  explicit StepCostModel(Measure measure) : measure_(std::move(measure)) {}

  double Seconds(int64_t num_tokens) const;
  // Whether real steps of about `num_tokens` tokens were seen (Seconds is then their own cost).
  bool Observed(int64_t num_tokens) const;
  void Observe(int64_t num_tokens, double seconds);
  // Measures the buckets up to `max_tokens`, smallest first, until `budget_seconds` are spent
  // or a measurement cannot run.
  void MeasureUpTo(int64_t max_tokens, double budget_seconds);

 private:
  struct Bucket {
    double measured = 0;  // scratch forward (0: none)
    double observed = 0;  // running geometric mean of real steps, scaled to the bucket's T
    bool has_observed = false;
  };
  static int64_t BucketAtOrAbove(int64_t num_tokens);
  static int64_t BucketBelow(int64_t num_tokens);
  double BucketSeconds(int64_t bucket, const Bucket& b) const;

  Measure measure_;
  std::map<int64_t, Bucket> buckets_;
  std::map<int64_t, double> observed_;  // measured buckets real steps reached: bucket -> observed
  double log_real_over_measured_ = 0;  // running mean of log(real step / scratch measurement)
};

// One decoding request as the budget planner sees it.
struct BudgetRequest {
  SpeculationMode mode = SpeculationMode::kNone;
  double acceptance = 0.0;  // estimated probability that each further draft token is accepted
  int32_t cap = 0;          // most draft tokens it may take
  // Lookahead trees: depth of the tree cut to its first c + 1 tokens (best first), [cap].
  // Empty for a chain (c + 1 tokens reach depth c + 1).
  std::vector<int32_t> depth_of_first;
};

// What a plan maximizes. With requests waiting for a batch slot, the step's throughput: every
// extra token served brings a waiting request's turn closer. With none waiting, the running
// requests are all there is to serve, and each one's time per token is what its user sees: the
// plan minimizes their mean (a step made dearer by others' drafts slows a request whose own
// guesses miss; throughput would take that whenever the others gain more tokens than it loses,
// which on a fixed batch makes its slowest requests, and so the batch, finish later).
enum class PlanObjective { kThroughput, kLatency };

// Draft tokens per request maximizing expected tokens per second of the step (kThroughput):
//   (base_samples + sum_r sum_{d <= depth_r(k_r)} acceptance_r^d)
//     / (verify(base_tokens + sum_r k_r) + drafting rounds of modes draft/self)
// against plain(base_tokens) without drafts (a verification step may cost more than a plain
// step of as many tokens: on the GPU it takes the prefill attention path). The plan must beat no
// drafts after also paying `overhead_seconds` (planning, which a step that does not speculate
// skips); the choice of budgets leaves it out (the step has paid it already).
// by coordinate ascent over the requests (a step's cost is not convex in T on every backend).
// kLatency maximizes instead requests / (step seconds · sum_r 1 / (1 + expected_r)): the inverse
// of the requests' mean seconds per token.
// A plan with drafts must beat no drafts by `min_gain` (estimates are noisy; a wrong guess costs
// the whole batch), otherwise every budget is zero.
using CostFn = std::function<double(int64_t num_tokens)>;
inline constexpr double kDefaultMinGain = 1.10;
std::vector<int32_t> PlanDraftBudgets(absl::Span<const BudgetRequest> requests, int64_t base_tokens,
                                      int64_t base_samples, const CostFn& plain_cost, const CostFn& verify_cost,
                                      const CostFn& draft_cost,
                                      const CostFn& self_cost, double min_gain = kDefaultMinGain,
                                      double overhead_seconds = 0,
                                      PlanObjective objective = PlanObjective::kThroughput);

class SpeculativeDecoder {
 public:
  // `executor`, `blocks` and `cache` are the engine's; they must outlive this object.
  // `load_draft` loads the draft model (config.draft_model_dir) on the engine's backend.
  static absl::StatusOr<std::unique_ptr<SpeculativeDecoder>> Create(const SpeculationConfig& config,
                                                                   ModelExecutor& executor, BlockManager& blocks,
                                                                   KvCache& cache, const Tokenizer& tokenizer,
                                                                   const ModelDrafter::ExecutorLoader& load_draft);

  // The mode `requested` runs in: kNone when the executor cannot verify trees; InvalidArgument
  // for a mode this engine was not started with.
  absl::StatusOr<SpeculationMode> Resolve(std::optional<SpeculationMode> requested) const;

  // Before scheduling: proposes lookahead trees and sets every decoding request's
  // spec.lookahead_slots (the scheduler reserves that much room, or none under pressure).
  // `decoding` are the running requests whose next chunk is their last token; `requests_waiting`:
  // whether any request waits for a batch slot (see PlanObjective).
  void Plan(absl::Span<Request* const> decoding, int64_t max_model_len, bool requests_waiting);
  // After scheduling: fills spec.tree for the requests that got slots (spec.lookahead_slots > 0).
  absl::Status Draft(absl::Span<Request* const> scheduled);
  // After verification: `accepted` draft tokens of a `tree_size`-token tree; `missed` when the
  // walk stopped at a node that had drafted children (a wrong guess, not a short tree).
  void OnVerified(Request& r, int32_t tree_size, absl::Span<const int32_t> accepted_depths, bool missed);
  void OnFinished(Request& r);
  // Idle-time work: indexes up to `max_tokens` tokens of finished outputs for lookahead;
  // returns whether more remain.
  bool IndexQueuedOutputs(int64_t max_tokens);
  // Measures step costs once (within about two seconds) for steps of up to `max_decoding`
  // decoding requests: at start when the server speculates by default, else before the first
  // speculating step. Serving only refines them (it never stops the batch to measure).
  void WarmUpCosts(int64_t max_decoding);
  // An engine step's bounds. The step's wall time, less the drafting and planning (speculation's
  // own work, charged to plans with drafts instead), refines the cost model of its kind (`verification`: it held draft
  // trees) for its `num_tokens` tokens: what a step really costs, host work included.
  void BeginStep();
  void EndStep(int64_t num_tokens, bool verification);

  const SpecDecodeStats& stats() const { return stats_; }

 private:
  SpeculativeDecoder(const SpeculationConfig& config, ModelExecutor& executor, BlockManager& blocks,
                     KvCache& cache, std::unique_ptr<ModelDrafter> draft, std::unique_ptr<ModelDrafter> self);
  // Seconds of `executor` running `num_tokens` tokens on scratch sequences of `blocks`, in chunks
  // of `chunk_tokens` (above 1: chains verified as draft trees).
  static std::optional<double> MeasureForward(ModelExecutor& executor, BlockManager& blocks, KvCache& cache,
                                              int64_t num_tokens, int64_t chunk_tokens);
  absl::Status DraftRequests(absl::Span<Request* const> scheduled);
  void MeasureCosts(int64_t max_decoding);
  // Runs `fn`, leaving its time out of the step's observed cost.
  template <typename Fn>
  auto Excluded(Fn fn) {
    const auto start = std::chrono::steady_clock::now();
    auto result = fn();
    step_excluded_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return result;
  }
  // Plan's work; false when it skipped proposing (nothing can pay).
  bool PlanRequests(absl::Span<Request* const> decoding, int64_t max_model_len, PlanObjective objective);
  // A verification step's cost as plans see it: dearer while no real step of its size was seen
  // (scratch forwards miss the real contexts, and a plan that guesses wrong costs the batch).
  double VerifySeconds(int64_t num_tokens) const;
  // A new request's acceptance estimate in `mode`: the engine's recent outcomes of the mode.
  double AcceptancePrior(SpeculationMode mode) const;
  // Whether any draft could pay in a step of these decoding requests.
  bool DraftsCanPay(absl::Span<Request* const> decoding);

  SpeculationConfig config_;
  ModelExecutor& executor_;
  BlockManager& blocks_;
  KvCache& cache_;
  LookaheadCache lookahead_;
  std::unique_ptr<ModelDrafter> draft_;  // mode draft (null without a draft model)
  std::unique_ptr<ModelDrafter> self_;   // mode self
  StepCostModel target_cost_;  // plain steps (one token per decoding request)
  StepCostModel verify_cost_;  // steps that verify draft trees
  std::optional<StepCostModel> draft_cost_;
  std::optional<StepCostModel> self_cost_;
  SpecDecodeStats stats_;
  struct AcceptanceCounts {
    double accepted = 0;  // decayed accepted draft tokens
    double trials = 0;    // decayed accepted tokens plus misses
  };
  std::array<AcceptanceCounts, 4> mode_acceptance_;  // by SpeculationMode
  static constexpr int64_t kIndexedPerStep = 64;  // finished outputs' tokens indexed per step, at least
  // After a step where nothing could pay: steps of the same batch size that skip planning.
  static constexpr int kRecheckEvery = 16;
  void SkipAfterFruitlessPlan(int64_t batch_size);
  int fruitless_plans_ = 0;  // in a row
  int skip_steps_left_ = 0;
  int64_t skip_batch_size_ = 0;
  double plan_seconds_per_request_ = 0;  // running mean of Plan's time per decoding request
  bool costs_measured_ = false;
  std::chrono::steady_clock::time_point step_start_;
  double step_excluded_seconds_ = 0;  // drafting and planning during the step
};

}  // namespace duet
