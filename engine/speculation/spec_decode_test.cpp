#include "engine/speculation/spec_decode.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "backends/cpu/llama_cpu.h"
#include "backends/executor_factory.h"
#include "engine/grammar/structured_output.h"
#include "engine/llm_engine.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr char kDraftModel[] = DUET_MODELS_DIR "/tiny-code-llama-draft";

// ---- The acceptance routine -------------------------------------------------------------

// A toy target over 4 tokens whose next-token distribution depends on the whole path.
std::vector<double> ToyTarget(const std::vector<int32_t>& path) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : path) h = (h ^ uint64_t(t + 1)) * 1099511628211ull;
  std::vector<double> p(4);
  double sum = 0;
  for (int i = 0; i < 4; ++i) sum += p[size_t(i)] = 0.2 + double((h >> (8 * i)) & 0xff) / 255.0;
  for (double& x : p) x /= sum;
  return p;
}

int32_t Draw(const std::vector<double>& p, std::mt19937_64& rng) {
  double u = std::uniform_real_distribution<double>(0, 1)(rng), c = 0;
  for (size_t i = 0; i < p.size(); ++i) if (u < (c += p[i])) return int32_t(i);
  return int32_t(p.size()) - 1;
}

// Speculative sampling through VerifyDraftTree draws the target's exact distribution: the first
// three emitted tokens (64 outcomes) over many draws, chi-square against the exact probabilities.
TEST(VerifyDraftTreeTest, SampledSequencesFollowTheTargetDistribution) {
  // Root, then branches 0 -> {1, 2}, 0 -> 3 -> 3, as a lookahead tree might draft them.
  const std::vector<int32_t> tokens = {0, 0, 1, 2, 3, 3};
  const std::vector<int32_t> parents = {-1, 0, 1, 1, 0, 4};
  std::mt19937_64 rng(7);
  constexpr int kDraws = 200000;
  std::map<std::vector<int32_t>, int> counts;
  int64_t accepted_total = 0;
  for (int n = 0; n < kDraws; ++n) {
    std::vector<int32_t> emitted;
    auto path_of = [&](int32_t node) {  // tokens from the root's child down to `node`
      std::vector<int32_t> path;
      for (int32_t a = node; a > 0; a = parents[size_t(a)]) path.insert(path.begin(), tokens[size_t(a)]);
      return path;
    };
    auto draw = [&](int32_t node) { return Draw(ToyTarget(path_of(node)), rng); };
    auto emit = [&](int32_t t) {
      emitted.push_back(t);
      return true;
    };
    const std::vector<int32_t> accepted = VerifyDraftTree(tokens, parents, draw, emit);
    accepted_total += int64_t(accepted.size());
    ASSERT_EQ(emitted.size(), accepted.size() + 1);
    while (emitted.size() < 3) emitted.push_back(Draw(ToyTarget(emitted), rng));  // plain decoding onwards
    emitted.resize(3);
    ++counts[emitted];
  }
  EXPECT_GT(accepted_total, kDraws / 4);  // the tree is actually used
  double chi2 = 0;
  for (int32_t a = 0; a < 4; ++a) {
    for (int32_t b = 0; b < 4; ++b) {
      for (int32_t c = 0; c < 4; ++c) {
        const double p = ToyTarget({})[size_t(a)] * ToyTarget({a})[size_t(b)] * ToyTarget({a, b})[size_t(c)];
        const double expected = p * kDraws;
        const double observed = counts[{a, b, c}];
        chi2 += (observed - expected) * (observed - expected) / expected;
      }
    }
  }
  EXPECT_LT(chi2, 110.0);  // 63 degrees of freedom: p < 0.0003 of a false alarm
}

TEST(VerifyDraftTreeTest, StopsWhenTheRequestFinishes) {
  const std::vector<int32_t> tokens = {5, 6, 7, 8};
  const std::vector<int32_t> parents = {-1, 0, 1, 2};
  int emitted = 0;
  const std::vector<int32_t> accepted = VerifyDraftTree(
      tokens, parents, [&](int32_t node) { return tokens[size_t(node) + 1]; },
      [&](int32_t) { return ++emitted < 2; });
  EXPECT_EQ(emitted, 2);
  EXPECT_EQ(accepted, (std::vector<int32_t>{1}));
}

// ---- Drafts under a grammar ------------------------------------------------------------------

// A request constrained by `regex` over a toy vocabulary: 0 is EOS, then "a" "b" "c" "d" "ab" "x" "bc".
std::unique_ptr<Request> ConstrainedRequest(const std::string& regex, bool ignore_eos) {
  static const auto vocab = grammar::TokenVocabulary::FromTokenStrings(
      {std::nullopt, "a", "b", "c", "d", "ab", "x", "bc"}, {0});
  static grammar::GrammarCompiler compiler(vocab);
  SamplingParams p;
  p.ignore_eos = ignore_eos;
  auto r = std::make_unique<Request>("r", 1, std::vector<int32_t>{1}, p);
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> g =
      compiler.Compile({grammar::StructuredOutput::Kind::kRegex, regex, {}});
  EXPECT_TRUE(g.ok()) << g.status();
  r->grammar = std::make_unique<grammar::GrammarMatcher>(*g);
  return r;
}

DraftTree Tree(std::vector<std::pair<int32_t, int32_t>> nodes) {  // (token, parent)
  DraftTree t;
  for (const auto& [token, parent] : nodes) t.Add(token, parent);
  return t;
}

enum Toy : int32_t { kEos = 0, kA, kB, kC, kD, kAB, kX, kBC };

TEST(CutDraftToGrammarTest, CutsEveryPathAtItsFirstDisallowedToken) {
  const std::unique_ptr<Request> r = ConstrainedRequest("ab(c|d)", false);
  DraftTree tree = Tree({{kA, -1},  // 0 kept
                         {kX, -1},  // 1 disallowed: cut with its subtree
                         {kB, 0},   // 2 "ab"
                         {kA, 1},   // 3 under a cut node
                         {kC, 2},   // 4 "abc": the grammar is complete and allows nothing more
                         {kD, 2},   // 5 "abd"
                         {kEos, 4}, // 6 after the end: nothing is verified there
                         {kAB, -1}, // 7 "ab"
                         {kX, 7},   // 8 "abx" disallowed
                         {kC, 7},   // 9 "abc"
                         {kBC, 0}}); // 10 "abc"
  CutDraftToGrammar(*r, tree);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{kA, kB, kC, kD, kAB, kC, kBC}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0, 1, 1, -1, 4, 0}));
  // The request's own matcher did not move: "a" is still the only way to start.
  EXPECT_FALSE(r->grammar->CanEnd());
  EXPECT_TRUE(r->grammar->AcceptToken(kA));
}

TEST(CutDraftToGrammarTest, EosOnlyWhereTheGrammarMayEndAndNotWithIgnoreEos) {
  const DraftTree draft = Tree({{kEos, -1}, {kA, -1}, {kEos, 1}, {kA, 2}, {kA, 1}});
  DraftTree tree = draft;
  CutDraftToGrammar(*ConstrainedRequest("a+", false), tree);
  // EOS at the root is rejected (nothing matched yet); after "a" it ends the output there.
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{kA, kEos, kA}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0, 0}));
  tree = draft;
  CutDraftToGrammar(*ConstrainedRequest("a+", true), tree);
  EXPECT_EQ(tree.tokens, (std::vector<int32_t>{kA, kA}));
  EXPECT_EQ(tree.parents, (std::vector<int32_t>{-1, 0}));
}

TEST(CutDraftToGrammarTest, UnconstrainedDraftsStayWhole) {
  Request r("r", 1, {1}, SamplingParams{});
  DraftTree tree = Tree({{kX, -1}, {kEos, 0}, {kA, 1}});
  CutDraftToGrammar(r, tree);
  EXPECT_EQ(tree.size(), 3);
}

// A model drafter walks a constrained request's grammar as it drafts: its tokens are the best
// ones the grammar allows (the context alone would draft code, not digits), and it stops where
// the output ends however much budget is left.
TEST(ModelDrafterTest, ConstrainedDraftsFollowTheGrammarAndStopAtItsEnd) {
  absl::StatusOr<std::unique_ptr<LlamaCpu>> target = LlamaCpu::Load(kModel);
  ASSERT_TRUE(target.ok()) << target.status();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(kModel);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::vector<std::optional<std::string>> strings(static_cast<size_t>((*tokenizer)->vocab_size()));
  for (int32_t id = 0; id < (*tokenizer)->vocab_size(); ++id) {
    if (!(*tokenizer)->IsSpecial(id)) strings[size_t(id)] = (*tokenizer)->IdToToken(id);
  }
  grammar::GrammarCompiler compiler(grammar::TokenVocabulary::FromTokenStrings(strings, {1}));
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> digits =
      compiler.Compile({grammar::StructuredOutput::Kind::kRegex, "[0-9]{3}", {}});
  ASSERT_TRUE(digits.ok()) << digits.status();

  std::unique_ptr<KvCache> cache = *(*target)->CreateKvCache(8, 16);
  const std::vector<int32_t> context = (*tokenizer)->Encode("def area(width, height):\n    return");
  const std::vector<int32_t> table_a = {0, 1, 2}, table_b = {3, 4, 5};
  std::vector<float> logits;
  const absl::Span<const int32_t> known(context.data(), context.size() - 1);  // the target's K/V
  std::vector<SequenceChunk> prefill = {{known, 0, table_a, 1, 0}, {known, 0, table_b, 2, 0}};
  ASSERT_TRUE((*target)->Forward(prefill, *cache, logits).ok());
  absl::StatusOr<std::unique_ptr<ModelDrafter>> self = ModelDrafter::SelfSpeculation(**target, 2);
  ASSERT_TRUE(self.ok()) << self.status();

  ModelDrafter::Job jobs[2] = {{1, context, table_a, 6}, {2, context, table_b, 6}};
  jobs[1].grammar.emplace(*digits);
  ASSERT_TRUE((*self)->Propose(jobs, *cache).ok());
  const std::vector<int32_t>& free_draft = jobs[0].draft;
  const std::vector<int32_t>& constrained = jobs[1].draft;
  ASSERT_EQ(free_draft.size(), 6u);
  EXPECT_FALSE(grammar::GrammarMatcher(*digits).AcceptToken(free_draft[0])) << "the unconstrained draft is not digits";
  ASSERT_FALSE(constrained.empty());
  EXPECT_LT(constrained.size(), 6u);
  grammar::GrammarMatcher check(*digits);
  for (int32_t token : constrained) EXPECT_TRUE(check.AcceptToken(token)) << token;
  EXPECT_TRUE(check.IsTerminated());
}

// ---- The budget planner -------------------------------------------------------------------

TEST(PlanDraftBudgetsTest, DraftsWhenStepsAreMemoryBoundAndNotWhenComputeBound) {
  const std::vector<BudgetRequest> one = {{SpeculationMode::kLookahead, 0.8, 8}};
  auto memory_bound = [](int64_t t) { return 1.0 + 0.02 * double(t); };
  auto compute_bound = [](int64_t t) { return 0.01 + double(t); };
  auto none = [](int64_t) { return 0.0; };
  EXPECT_GE(PlanDraftBudgets(one, 1, 1, memory_bound, memory_bound, none, none)[0], 4);
  EXPECT_EQ(PlanDraftBudgets(one, 1, 1, compute_bound, compute_bound, none, none)[0], 0);
  // A poor guesser gets nothing even when steps are memory-bound and drafting costs something.
  const std::vector<BudgetRequest> poor = {{SpeculationMode::kDraft, 0.05, 8}};
  auto draft_cost = [](int64_t) { return 0.2; };
  EXPECT_EQ(PlanDraftBudgets(poor, 1, 1, memory_bound, memory_bound, draft_cost, none)[0], 0);
  // A large batch spends the headroom on the best guessers.
  std::vector<BudgetRequest> batch(64, {SpeculationMode::kLookahead, 0.3, 8});
  batch[0].acceptance = 0.95;
  auto ridge = [](int64_t t) { return std::max(1.0, double(t) / 80.0); };
  const std::vector<int32_t> k = PlanDraftBudgets(batch, 64, 64, ridge, ridge, none, none);
  EXPECT_GT(k[0], 0);
  int64_t total = 0;
  for (int32_t x : k) total += x;
  EXPECT_LE(64 + total, 90);
}

TEST(PlanDraftBudgetsTest, NoDraftsUnlessThePlanBeatsNoDraftsByTheMargin) {
  // One request, T = 1 + k costs 1 + 0.1 k: at acceptance 0.05 no draft earns its 10 % more
  // time, so nothing; at 0.9 they do.
  auto linear = [](int64_t t) { return 1.0 + 0.1 * double(t - 1); };
  auto none = [](int64_t) { return 0.0; };
  EXPECT_EQ(PlanDraftBudgets({{SpeculationMode::kLookahead, 0.05, 4, {}}}, 1, 1, linear, linear, none, none)[0], 0);
  EXPECT_GT(PlanDraftBudgets({{SpeculationMode::kLookahead, 0.9, 4, {}}}, 1, 1, linear, linear, none, none)[0], 0);
  // A plan only just better than none (one draft at acceptance 0.12 for 10 % more time:
  // +1.8 %) is below the default margin; without a margin it drafts.
  auto flat = [](int64_t t) { return t == 1 ? 1.0 : 1.1; };
  const std::vector<BudgetRequest> marginal = {{SpeculationMode::kLookahead, 0.12, 1, {}}};
  EXPECT_EQ(PlanDraftBudgets(marginal, 1, 1, flat, flat, none, none)[0], 0);
  EXPECT_EQ(PlanDraftBudgets(marginal, 1, 1, flat, flat, none, none, 1.0)[0], 1);
  const std::vector<BudgetRequest> good = {{SpeculationMode::kLookahead, 0.3, 1, {}}};
  EXPECT_EQ(PlanDraftBudgets(good, 1, 1, flat, flat, none, none, 1.0)[0], 1);
  EXPECT_EQ(PlanDraftBudgets(good, 1, 1, flat, flat, none, none)[0], 1);
}

TEST(PlanDraftBudgetsTest, TreeGainCountsDepthNotTokens) {
  // Four tokens as a chain reach depth 4; as four siblings they reach depth 1 only, so the tree
  // gains one level's worth and a cost that a chain would pay for does not pay for it.
  auto cost = [](int64_t t) { return 1.0 + 0.15 * double(t - 1); };
  auto none = [](int64_t) { return 0.0; };
  BudgetRequest chain{SpeculationMode::kLookahead, 0.8, 4, {1, 2, 3, 4}};
  BudgetRequest bush{SpeculationMode::kLookahead, 0.8, 4, {1, 1, 1, 1}};
  EXPECT_EQ(PlanDraftBudgets({chain}, 1, 1, cost, cost, none, none)[0], 4);
  EXPECT_LE(PlanDraftBudgets({bush}, 1, 1, cost, cost, none, none)[0], 1);
}

TEST(PlanDraftBudgetsTest, VerificationStepsCostWhatTheyCostNotWhatPlainStepsDo) {
  // The GPU case: plain steps of any size cost the same, but a step that verifies trees costs
  // twice as much (another attention path, no graph). Good guesses (2.6 tokens per step) still
  // pay; mediocre ones (1.6 tokens per step) do not, though a plain step's cost says they would.
  auto plain = [](int64_t) { return 1.0; };
  auto verify = [](int64_t t) { return t == 1 ? 1.0 : 2.0; };
  auto none = [](int64_t) { return 0.0; };
  const std::vector<BudgetRequest> good = {{SpeculationMode::kLookahead, 0.95, 8, {}}};
  const std::vector<BudgetRequest> mediocre = {{SpeculationMode::kLookahead, 0.4, 8, {}}};
  EXPECT_GT(PlanDraftBudgets(good, 1, 1, plain, verify, none, none)[0], 0);
  EXPECT_EQ(PlanDraftBudgets(mediocre, 1, 1, plain, verify, none, none)[0], 0);
  EXPECT_GT(PlanDraftBudgets(mediocre, 1, 1, plain, plain, none, none)[0], 0);
}

TEST(PlanDraftBudgetsTest, FindsPlansWhereOnlyManyRequestsDraftingPays) {
  // 32 requests; a verification step costs twice a plain one whatever its size. One request's
  // drafts never pay for the jump; everyone's do (each expects about 1.5 accepted tokens).
  auto plain = [](int64_t) { return 1.0; };
  auto verify = [](int64_t) { return 2.0; };
  auto none = [](int64_t) { return 0.0; };
  const std::vector<BudgetRequest> batch(32, {SpeculationMode::kLookahead, 0.7, 4, {}});
  const std::vector<int32_t> k = PlanDraftBudgets(batch, 32, 32, plain, verify, none, none);
  for (int32_t x : k) EXPECT_GT(x, 0);
}

TEST(PlanDraftBudgetsTest, PlanningOverheadCanMakeDraftsNotWorthIt) {
  // Drafts add 30 % (1.3 tokens for the price of one step) but planning costs half a step.
  auto cost = [](int64_t) { return 1.0; };
  auto none = [](int64_t) { return 0.0; };
  const std::vector<BudgetRequest> one = {{SpeculationMode::kLookahead, 0.3, 1, {}}};
  EXPECT_EQ(PlanDraftBudgets(one, 1, 1, cost, cost, none, none, 1.1, 0.0)[0], 1);
  EXPECT_EQ(PlanDraftBudgets(one, 1, 1, cost, cost, none, none, 1.1, 0.5)[0], 0);
}

TEST(PlanDraftBudgetsTest, LatencyObjectiveDoesNotSlowUnpredictableRequestsForOthers) {
  // Two requests, one that guesses well (0.9) and one with nothing to draft; each token in the
  // step adds 20 %. Four drafts give the step 5.1 tokens for 1.8x the time: more throughput, but
  // the second request waits 1.8x as long for each of its tokens, and the mean time per token
  // of the two gets worse (1.8 (1/4.1 + 1) / 2 = 1.12 steps). Both guessing well, both gain.
  auto cost = [](int64_t t) { return 1.0 + 0.2 * double(t - 2); };
  auto none = [](int64_t) { return 0.0; };
  const std::vector<BudgetRequest> mixed = {{SpeculationMode::kLookahead, 0.9, 4, {}},
                                            {SpeculationMode::kLookahead, 0.0, 0, {}}};
  auto plan = [&](const std::vector<BudgetRequest>& requests, PlanObjective objective) {
    return PlanDraftBudgets(requests, 2, 2, cost, cost, none, none, kDefaultMinGain, 0.0, objective);
  };
  EXPECT_GT(plan(mixed, PlanObjective::kThroughput)[0], 0);
  EXPECT_EQ(plan(mixed, PlanObjective::kLatency)[0], 0);
  const std::vector<BudgetRequest> both(2, {SpeculationMode::kLookahead, 0.9, 4, {}});
  const std::vector<int32_t> k = plan(both, PlanObjective::kLatency);
  EXPECT_GT(k[0], 0);
  EXPECT_GT(k[1], 0);
  // One request alone: the two objectives are the same.
  const std::vector<BudgetRequest> one = {{SpeculationMode::kLookahead, 0.8, 8, {}}};
  auto single = [](int64_t t) { return 1.0 + 0.05 * double(t - 1); };
  EXPECT_EQ(PlanDraftBudgets(one, 1, 1, single, single, none, none, kDefaultMinGain, 0.0, PlanObjective::kLatency),
            PlanDraftBudgets(one, 1, 1, single, single, none, none));
}

TEST(StepCostModelTest, MeasuresOnlyUpFront) {
  // Buckets above 8 cannot run (say the executor takes at most 8 sequences).
  int attempts = 0;
  StepCostModel model([&](int64_t t) -> std::optional<double> {
    ++attempts;
    if (t > 8) return std::nullopt;
    return 1e-3 * double(t);
  });
  EXPECT_GT(model.Seconds(1), 0.5);  // nothing known: too dear for any plan
  EXPECT_EQ(attempts, 0);
  model.MeasureUpTo(64, 10.0);
  // A warm-up run, best of three per bucket, one try of 16 (doubling sizes come first) and one
  // of 9 (the smallest between): no larger size is tried after a size failed.
  EXPECT_EQ(attempts, 1 + 8 * 3 + 2);
  EXPECT_NEAR(model.Seconds(8), 8e-3, 1e-12);
  EXPECT_NEAR(model.Seconds(5), 5e-3, 1e-12);
  for (int step = 0; step < 100; ++step) EXPECT_NEAR(model.Seconds(16), 16e-3, 1e-12);  // in proportion
  EXPECT_EQ(attempts, 1 + 8 * 3 + 2);
  EXPECT_FALSE(model.Observed(8));
}

TEST(StepCostModelTest, RealStepsCorrectTheScratchTable) {
  // Scratch forwards say 1 + 0.1 T ms; real steps take twice that (a loaded machine, longer
  // contexts). Buckets follow the real steps; buckets no real step reached scale with them.
  StepCostModel model([](int64_t t) -> std::optional<double> { return 1.0 + 0.1 * double(t); });
  model.MeasureUpTo(40, 10.0);
  EXPECT_DOUBLE_EQ(model.Seconds(8), 1.8);
  EXPECT_DOUBLE_EQ(model.Seconds(4), 1.4);
  for (int i = 0; i < 40; ++i) model.Observe(8, 3.6);
  EXPECT_TRUE(model.Observed(8));
  EXPECT_FALSE(model.Observed(4));
  EXPECT_NEAR(model.Seconds(8), 3.6, 1e-9);
  EXPECT_NEAR(model.Seconds(4), 2.8, 0.01);   // measured, never observed: scaled by 2
  EXPECT_NEAR(model.Seconds(40), 10.0, 0.1);
  // An odd real step does not move a bucket far.
  model.Observe(8, 36.0);
  EXPECT_LT(model.Seconds(8), 6.0);
}

TEST(StepCostModelTest, RealStepsTeachSizesNeverMeasured) {
  StepCostModel model([](int64_t t) -> std::optional<double> { return t <= 4 ? std::optional<double>(1.0) : std::nullopt; });
  model.MeasureUpTo(100, 10.0);
  EXPECT_DOUBLE_EQ(model.Seconds(40), 10.0);  // past the table: in proportion to T
  for (int i = 0; i < 40; ++i) model.Observe(40, 2.0);
  EXPECT_TRUE(model.Observed(40));
  EXPECT_NEAR(model.Seconds(40), 2.0, 0.05);
  EXPECT_GT(model.Seconds(20), 1.0);  // between the table and the real steps: interpolated
  EXPECT_LT(model.Seconds(20), 2.0);
}

TEST(StepCostModelTest, SizesNoRealStepReachedTakeTheScaleOfTheNearestThatDid) {
  // The scratch table says 2 + T; real steps of 4 and 9 tokens cost a sixth and 2/11 of that.
  // Sizes between them keep the table's shape at the real steps' scale (log-interpolated).
  StepCostModel model([](int64_t t) -> std::optional<double> { return 2.0 + double(t); });
  model.MeasureUpTo(64, 10.0);
  for (int i = 0; i < 20; ++i) {
    model.Observe(4, 1.0);
    model.Observe(9, 2.0);
  }
  EXPECT_FALSE(model.Observed(6));
  const double ratio6 = std::exp(0.6 * std::log(1.0 / 6.0) + 0.4 * std::log(2.0 / 11.0));
  EXPECT_NEAR(model.Seconds(6), 8.0 * ratio6, 1e-9);
  EXPECT_NEAR(model.Seconds(33), 35.0 * 2.0 / 11.0, 1e-9);  // above: the nearest below's scale
  EXPECT_NEAR(model.Seconds(2), 4.0 / 6.0, 1e-9);           // below: the nearest above's
}

// ---- Tree attention in the CPU executor ---------------------------------------------------

// Each tree token's logits equal those of the same path run as a plain sequence.
TEST(TreeAttentionTest, EveryBranchMatchesSequentialDecoding) {
  absl::StatusOr<std::unique_ptr<LlamaCpu>> model = LlamaCpu::Load(kModel);
  ASSERT_TRUE(model.ok()) << model.status();
  const int64_t vocab = (*model)->config().vocab_size;
  std::unique_ptr<KvCache> cache = *(*model)->CreateKvCache(8, 16);
  const std::vector<int32_t> context = {0, 400, 401, 402, 403, 404};
  const std::vector<int32_t> table_a = {0, 1}, table_b = {2, 3};
  std::vector<float> logits;
  // Context into both sequences.
  std::vector<SequenceChunk> prefill = {{context, 0, table_a, 1, 0}, {context, 0, table_b, 2, 0}};
  ASSERT_TRUE((*model)->Forward(prefill, *cache, logits).ok());
  // Tree after the context: root 500 -> {600 -> 700, 601}.
  const std::vector<int32_t> tree = {500, 600, 601, 700};
  const std::vector<int32_t> parents = {-1, 0, 0, 1};
  SequenceChunk t{tree, int64_t(context.size()), table_a, 1, 4};
  t.tree_parents = parents;
  std::vector<float> tree_logits;
  ASSERT_TRUE((*model)->Forward({&t, 1}, *cache, tree_logits).ok());
  // Sequentially on sequence b: path 500 600 700, then 601 after 500 (overwriting slot).
  auto step = [&](int32_t token, int64_t pos) {
    std::vector<int32_t> one = {token};
    SequenceChunk c{one, pos, table_b, 2, 1};
    std::vector<float> out;
    EXPECT_TRUE((*model)->Forward({&c, 1}, *cache, out).ok());
    return out;
  };
  const int64_t p = int64_t(context.size());
  const std::vector<std::pair<int, std::vector<float>>> want = {
      {0, step(500, p)}, {1, step(600, p + 1)}, {3, step(700, p + 2)}, {2, step(601, p + 1)}};
  for (const auto& [node, row] : want) {
    for (int64_t v = 0; v < vocab; ++v) {
      ASSERT_NEAR(tree_logits[size_t(node * vocab + v)], row[size_t(v)], 1e-4f) << "node " << node;
    }
  }
  // Compacting path root -> 601 puts 601's K/V at the next slot: decoding on matches.
  ASSERT_TRUE((*model)->MoveKvSlots(*cache, table_a, std::vector<KvSlotMove>{{p + 2, p + 1}}).ok());
  std::vector<int32_t> next = {800};
  SequenceChunk ca{next, p + 2, table_a, 1, 1};
  std::vector<float> got;
  ASSERT_TRUE((*model)->Forward({&ca, 1}, *cache, got).ok());
  const std::vector<float> expected = step(800, p + 2);  // b holds 500 601 at p, p + 1
  for (int64_t v = 0; v < vocab; ++v) ASSERT_NEAR(got[size_t(v)], expected[size_t(v)], 1e-4f);
}

// ---- The engine: lossless greedy, sampling, limits ----------------------------------------

struct EngineOptions {
  SpeculationMode default_mode = SpeculationMode::kNone;
  int32_t max_num_seqs = 64;
  int32_t num_blocks = 512;
  int32_t block_size = 16;
  int32_t max_batched_tokens = 2048;
  bool adaptive = false;
};

std::unique_ptr<LlmEngine> NewEngine(const EngineOptions& o) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = o.num_blocks;
  config.block_size = o.block_size;
  config.scheduler.max_num_seqs = o.max_num_seqs;
  config.scheduler.max_num_batched_tokens = o.max_batched_tokens;
  config.speculation.default_mode = o.default_mode;
  config.speculation.draft_model_dir = kDraftModel;
  config.speculation.self_spec_layers = 2;
  config.speculation.max_draft_tokens = 5;
  config.speculation.adaptive = o.adaptive;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

void RunToCompletion(LlmEngine& e) {
  while (e.HasUnfinished()) ASSERT_TRUE(e.Step().ok());
}

struct ReferenceCase {
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
};

const std::vector<ReferenceCase>& ReferenceCases() {
  static const std::vector<ReferenceCase> cases = [] {
    std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    std::vector<ReferenceCase> out;
    for (const auto& c : j["cases"]) {
      out.push_back({c["prompt_ids"].get<std::vector<int32_t>>(), c["greedy_ids"].get<std::vector<int32_t>>()});
    }
    return out;
  }();
  return cases;
}

SamplingParams Greedy(std::optional<SpeculationMode> mode, int32_t max_tokens = 128) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.speculation = mode;
  return p;
}

// Runs every reference case, request i in modes[i % modes.size()], and checks the tokens.
void ExpectReference(const EngineOptions& options, const std::vector<SpeculationMode>& modes,
                     int32_t max_tokens = 128) {
  std::unique_ptr<LlmEngine> e = NewEngine(options);
  const auto& cases = ReferenceCases();
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(e->AddRequest("c" + std::to_string(i), cases[i].prompt, Greedy(modes[i % modes.size()], max_tokens)).ok());
  }
  RunToCompletion(*e);
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<int32_t> want(cases[i].greedy.begin(), cases[i].greedy.begin() + max_tokens);
    EXPECT_EQ(e->Find("c" + std::to_string(i))->output, want)
        << "case " << i << " mode " << SpeculationModeName(modes[i % modes.size()]);
  }
  const EngineStats stats = e->Stats();
  EXPECT_EQ(stats.num_free_kv_blocks, stats.num_kv_blocks);
  bool speculated = false;
  for (SpeculationMode m : modes) speculated |= m != SpeculationMode::kNone;
  if (speculated) {
    EXPECT_GT(stats.spec_decode.num_draft_tokens, 0);
    EXPECT_GT(stats.spec_decode.num_accepted_tokens, 0);
  }
}

// Each mode alone: every case in that mode (batched, so the suite stays quick).
TEST(SpeculativeEngineTest, LookaheadIsLossless) { ExpectReference({}, {SpeculationMode::kLookahead}); }
TEST(SpeculativeEngineTest, DraftModelIsLossless) { ExpectReference({}, {SpeculationMode::kDraft}); }
TEST(SpeculativeEngineTest, SelfSpeculationIsLossless) { ExpectReference({}, {SpeculationMode::kSelf}); }
// Some requests speculating, some not, different modes together.
TEST(SpeculativeEngineTest, MixedModesInOneBatchAreLossless) {
  ExpectReference({}, {SpeculationMode::kNone, SpeculationMode::kLookahead, SpeculationMode::kDraft,
                       SpeculationMode::kSelf});
}
// Small cache and token budget: chunked prefill, preemption, and drafts squeezed out.
TEST(SpeculativeEngineTest, MixedModesUnderKvPressureAreLossless) {
  ExpectReference({.num_blocks = 100, .block_size = 8, .max_batched_tokens = 96},
                  {SpeculationMode::kLookahead, SpeculationMode::kDraft, SpeculationMode::kSelf}, 64);
}
// The adaptive budget drafts where drafts pay: one sequence at a time (a batch of eight on the
// CPU is a marginal case the planner may rightly decline).
TEST(SpeculativeEngineTest, AdaptiveBudgetIsLossless) {
  ExpectReference({.default_mode = SpeculationMode::kLookahead, .max_num_seqs = 1, .adaptive = true},
                  {SpeculationMode::kLookahead}, 64);
}

std::vector<int32_t> Prompt(const LlmEngine& e) {
  return e.tokenizer().Encode("import os\n\ndef read_config(path):\n    with open(path) as f:\n");
}

// Penalties, stop strings, stop ids and max_tokens end a request exactly where they would
// without speculation, even inside an accepted run of draft tokens.
TEST(SpeculativeEngineTest, LimitsAndPenaltiesBehaveAsWithoutSpeculation) {
  std::vector<SamplingParams> variants;
  SamplingParams stop = Greedy(std::nullopt, 64);
  stop.stop = {"    assert"};
  variants.push_back(stop);
  SamplingParams stop_id = Greedy(std::nullopt, 64);
  stop_id.stop_token_ids = {ReferenceCases()[0].greedy[20]};
  variants.push_back(stop_id);
  SamplingParams eos = Greedy(std::nullopt, 64);
  eos.ignore_eos = false;
  variants.push_back(eos);
  variants.push_back(Greedy(std::nullopt, 7));
  SamplingParams penalties = Greedy(std::nullopt, 48);
  penalties.repetition_penalty = 1.3f;
  penalties.frequency_penalty = 0.5f;
  penalties.logprobs = 2;
  variants.push_back(penalties);
  std::unique_ptr<LlmEngine> e = NewEngine({});
  for (size_t v = 0; v < variants.size(); ++v) {
    for (SpeculationMode m : {SpeculationMode::kNone, SpeculationMode::kLookahead, SpeculationMode::kDraft,
                              SpeculationMode::kSelf}) {
      SamplingParams p = variants[v];
      p.speculation = m;
      ASSERT_TRUE(e->AddRequest(absl::StrCat(v, "-", SpeculationModeName(m)), ReferenceCases()[0].prompt, p).ok());
    }
  }
  RunToCompletion(*e);
  for (size_t v = 0; v < variants.size(); ++v) {
    const Request* plain = e->Find(absl::StrCat(v, "-none"));
    for (const char* m : {"lookahead", "draft", "self"}) {
      const Request* spec = e->Find(absl::StrCat(v, "-", m));
      EXPECT_EQ(spec->output, plain->output) << v << " " << m;
      EXPECT_EQ(spec->text, plain->text) << v << " " << m;
      EXPECT_EQ(spec->finish_reason, plain->finish_reason) << v << " " << m;
      EXPECT_EQ(spec->output_logprobs.size(), plain->output_logprobs.size());
      for (size_t i = 0; i < spec->output_logprobs.size(); ++i) {
        EXPECT_NEAR(spec->output_logprobs[i], plain->output_logprobs[i], 1e-3f);
      }
    }
  }
}

// Each drawn token uses one number of the request's stream, as without speculation, so a seed
// gives the same sample with or without drafts.
TEST(SpeculativeEngineTest, SeededSamplingIsUnchangedBySpeculation) {
  std::unique_ptr<LlmEngine> e = NewEngine({});
  for (SpeculationMode m : {SpeculationMode::kNone, SpeculationMode::kLookahead, SpeculationMode::kDraft,
                            SpeculationMode::kSelf}) {
    SamplingParams p;
    p.temperature = 0.7f;
    p.top_k = 40;
    p.seed = 11;
    p.max_tokens = 64;
    p.ignore_eos = true;
    p.speculation = m;
    ASSERT_TRUE(e->AddRequest(SpeculationModeName(m), ReferenceCases()[1].prompt, p).ok());
  }
  RunToCompletion(*e);
  for (const char* m : {"lookahead", "draft", "self"}) EXPECT_EQ(e->Find(m)->output, e->Find("none")->output) << m;
  EXPECT_GT(e->Stats().spec_decode.num_accepted_tokens, 0);
}

// End to end on the tiny model: the 2nd and 3rd sampled tokens (drawn through verification)
// have the same distribution with and without speculation (independent seeds, two-sample
// chi-square over the joint outcomes).
TEST(SpeculativeEngineTest, SampledTokenFrequenciesMatchPlainSampling) {
  constexpr int kSamples = 300;
  auto run = [&](SpeculationMode mode, uint64_t seed_base) {
    std::unique_ptr<LlmEngine> e = NewEngine({.max_num_seqs = 256, .num_blocks = 1200});
    const std::vector<int32_t> prompt = Prompt(*e);
    for (int i = 0; i < kSamples; ++i) {
      SamplingParams p;
      p.temperature = 1.0f;
      p.top_k = 3;
      p.seed = seed_base + uint64_t(i);
      p.max_tokens = 3;
      p.ignore_eos = true;
      p.speculation = mode;
      EXPECT_TRUE(e->AddRequest(std::to_string(i), prompt, p).ok());
    }
    RunToCompletion(*e);
    std::map<std::pair<int32_t, int32_t>, int> counts;
    for (int i = 0; i < kSamples; ++i) {
      const std::vector<int32_t>& out = e->Find(std::to_string(i))->output;
      ++counts[{out[1], out[2]}];
    }
    EXPECT_GT(e->Stats().spec_decode.num_draft_tokens, mode == SpeculationMode::kNone ? -1 : 0);
    return counts;
  };
  const auto plain = run(SpeculationMode::kNone, 1);
  const auto spec = run(SpeculationMode::kSelf, 100000);
  // Pool rare outcomes so every cell expects at least ~5 per sample.
  std::map<std::pair<int32_t, int32_t>, int> total;
  for (const auto& [k, v] : plain) total[k] += v;
  for (const auto& [k, v] : spec) total[k] += v;
  double chi2 = 0;
  int cells = 0, rare_plain = 0, rare_spec = 0;
  auto count = [](const auto& m, const auto& k) { auto it = m.find(k); return it == m.end() ? 0 : it->second; };
  for (const auto& [k, n] : total) {
    if (n < 10) {
      rare_plain += count(plain, k);
      rare_spec += count(spec, k);
      continue;
    }
    const double a = count(plain, k), b = count(spec, k), e = (a + b) / 2;
    chi2 += (a - e) * (a - e) / e + (b - e) * (b - e) / e;
    ++cells;
  }
  if (rare_plain + rare_spec > 0) {
    const double e = (rare_plain + rare_spec) / 2.0;
    chi2 += (rare_plain - e) * (rare_plain - e) / e + (rare_spec - e) * (rare_spec - e) / e;
    ++cells;
  }
  ASSERT_GE(cells, 3);
  // df = cells - 1 (at most 9 for top-3 twice); 30 is beyond p = 0.0005 for df <= 9.
  EXPECT_LT(chi2, 30.0) << cells << " cells";
}

TEST(SpeculativeEngineTest, RejectsAnUnavailableModeAndAMismatchedDraftModel) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 64;
  std::unique_ptr<LlmEngine> e = std::move(*CreateEngine(config));  // no draft model
  absl::Status s = e->AddRequest("x", {1, 2, 3}, Greedy(SpeculationMode::kDraft));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--draft-model"), std::string::npos) << s;
  EXPECT_TRUE(e->AddRequest("y", {1, 2, 3}, Greedy(SpeculationMode::kSelf)).ok());

  // A draft model whose tokenizer differs at one id.
  const std::string dir = testing::TempDir() + "/bad-draft";
  std::filesystem::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer_config.json", "generation_config.json"}) {
    std::filesystem::copy_file(std::string(kDraftModel) + "/" + f, dir + "/" + f,
                               std::filesystem::copy_options::overwrite_existing);
  }
  std::ifstream in(std::string(kDraftModel) + "/tokenizer.json");
  nlohmann::json tok = nlohmann::json::parse(in);
  auto& vocab = tok["model"]["vocab"];
  // Swap the pieces of ids 300 and 301.
  std::string a, b;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (it.value() == 300) a = it.key();
    if (it.value() == 301) b = it.key();
  }
  vocab[a] = 301;
  vocab[b] = 300;
  std::ofstream(dir + "/tokenizer.json") << tok.dump();
  config.speculation.draft_model_dir = dir;
  absl::StatusOr<std::unique_ptr<LlmEngine>> bad = CreateEngine(config);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(bad.status().message().find("token id 300"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace duet
