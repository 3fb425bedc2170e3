// Prompt logprobs (SamplingParams::prompt_logprobs) against a direct log-softmax over one full
// forward of the prompt on the CPU backend: whole, with chunked prefill cutting the prompt
// mid-block, and with prefix caching (a cached prefix is computed again, so the numbers are
// complete and the same).
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "backends/executor_factory.h"
#include "engine/llm_engine.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr int32_t kTopK = 5;

// What a prompt position's logits say of the next prompt token, computed here from scratch.
struct Expected {
  double logprob = 0;
  int32_t rank = 0;
  std::vector<int32_t> top;  // token ids, most likely first
  std::vector<double> top_logprobs;
};

std::vector<int32_t> LongPrompt(const Tokenizer& tokenizer) {
  return tokenizer.Encode(
      "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
      "    config = {}\n    for line in lines:\n        key, value = line.split('=')\n"
      "        config[key.strip()] = value.strip()\n    return config\n",
      /*add_special_tokens=*/true);
}

// One forward of the whole prompt with every position's logits, log-softmax in double.
std::vector<Expected> FullForward(const std::vector<int32_t>& prompt) {
  EngineConfig config;
  config.model_dir = kModel;
  absl::StatusOr<std::unique_ptr<ModelExecutor>> model = LoadExecutor(config);
  EXPECT_TRUE(model.ok()) << model.status();
  constexpr int64_t kBlockSize = 16;
  const int64_t num_blocks = (int64_t(prompt.size()) + kBlockSize - 1) / kBlockSize;
  absl::StatusOr<std::unique_ptr<KvCache>> cache = (*model)->CreateKvCache(num_blocks, kBlockSize);
  EXPECT_TRUE(cache.ok()) << cache.status();
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::iota(table.begin(), table.end(), 0);
  SequenceChunk chunk;
  chunk.tokens = prompt;
  chunk.block_table = table;
  chunk.num_logits = int32_t(prompt.size());
  std::vector<float> logits;
  const absl::Status s = (*model)->Forward({&chunk, 1}, **cache, logits);
  EXPECT_TRUE(s.ok()) << s;
  const size_t vocab = size_t((*model)->config().vocab_size);
  std::vector<Expected> expected;
  for (size_t p = 0; p + 1 < prompt.size(); ++p) {
    const float* row = logits.data() + p * vocab;
    const double max = *std::max_element(row, row + vocab);
    double sum = 0;
    for (size_t t = 0; t < vocab; ++t) sum += std::exp(double(row[t]) - max);
    const double log_norm = max + std::log(sum);
    Expected e;
    const int32_t actual = prompt[p + 1];
    e.logprob = double(row[actual]) - log_norm;
    e.rank = 1 + int32_t(std::count_if(row, row + vocab, [&](float l) { return l > row[actual]; }));
    std::vector<int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    for (int32_t k = 0; k < kTopK; ++k) {
      e.top.push_back(order[size_t(k)]);
      e.top_logprobs.push_back(double(row[order[size_t(k)]]) - log_norm);
    }
    expected.push_back(std::move(e));
  }
  return expected;
}

void ExpectMatches(const std::vector<ScoredToken>& got, const std::vector<Expected>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i].logprob, want[i].logprob, 2e-4) << what << " prompt token " << i + 1;
    EXPECT_EQ(got[i].rank, want[i].rank) << what << " prompt token " << i + 1;
    ASSERT_EQ(got[i].top.size(), size_t(kTopK)) << what;
    for (int32_t k = 0; k < kTopK; ++k) {
      EXPECT_EQ(got[i].top[size_t(k)].token, want[i].top[size_t(k)]) << what << " prompt token " << i + 1 << " top " << k;
      EXPECT_NEAR(got[i].top[size_t(k)].logprob, want[i].top_logprobs[size_t(k)], 2e-4) << what;
    }
  }
}

std::unique_ptr<LlmEngine> NewEngine(int32_t max_num_batched_tokens, bool prefix_caching) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 128;
  config.scheduler.max_num_batched_tokens = max_num_batched_tokens;
  config.enable_prefix_caching = prefix_caching;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

SamplingParams WithPromptLogprobs(int32_t k) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 4;
  p.ignore_eos = true;
  p.prompt_logprobs = k;
  return p;
}

// Runs the engine dry; returns the prompt logprobs each request's outputs carried.
std::map<std::string, std::vector<ScoredToken>> RunDry(LlmEngine& e) {
  std::map<std::string, std::vector<ScoredToken>> carried;
  while (e.HasUnfinished()) {
    absl::StatusOr<std::vector<RequestOutput>> step = e.Step();
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) break;
    for (const RequestOutput& out : *step) {
      if (!out.prompt_logprobs.empty()) {
        EXPECT_EQ(carried.count(out.id), 0u) << out.id << ": prompt logprobs came twice";
        EXPECT_EQ(e.Find(out.id)->output.size(), 1u) << out.id << ": not with the first token";
        carried[out.id] = out.prompt_logprobs;
      }
    }
  }
  return carried;
}

TEST(PromptLogprobsTest, WholePromptEqualsFullForward) {
  std::unique_ptr<LlmEngine> e = NewEngine(2048, false);
  const std::vector<int32_t> prompt = LongPrompt(e->tokenizer());
  ASSERT_GT(prompt.size(), 40u);
  const std::vector<Expected> want = FullForward(prompt);
  ASSERT_TRUE(e->AddRequest("a", prompt, WithPromptLogprobs(kTopK)).ok());
  std::map<std::string, std::vector<ScoredToken>> carried = RunDry(*e);
  ExpectMatches(e->Find("a")->prompt_logprobs, want, "whole");
  ExpectMatches(carried["a"], want, "in the first output");
  // A request that does not ask gets none, and the output is unchanged by asking.
  SamplingParams plain = WithPromptLogprobs(-1);
  ASSERT_TRUE(e->AddRequest("b", prompt, plain).ok());
  EXPECT_TRUE(RunDry(*e).empty());
  EXPECT_TRUE(e->Find("b")->prompt_logprobs.empty());
  EXPECT_EQ(e->Find("b")->output, e->Find("a")->output);
}

TEST(PromptLogprobsTest, ChunkedPrefillCollectsEveryChunk) {
  // 13-token steps cut the prompt mid-block; a second request shares the steps.
  std::unique_ptr<LlmEngine> e = NewEngine(13, false);
  const std::vector<int32_t> prompt = LongPrompt(e->tokenizer());
  const std::vector<Expected> want = FullForward(prompt);
  ASSERT_TRUE(e->AddRequest("a", prompt, WithPromptLogprobs(kTopK)).ok());
  const std::vector<int32_t> other(prompt.begin(), prompt.begin() + 20);
  ASSERT_TRUE(e->AddRequest("b", other, WithPromptLogprobs(kTopK)).ok());
  ASSERT_TRUE(e->AddRequest("c", prompt, WithPromptLogprobs(-1)).ok());
  std::map<std::string, std::vector<ScoredToken>> carried = RunDry(*e);
  ExpectMatches(e->Find("a")->prompt_logprobs, want, "chunked");
  ExpectMatches(carried["a"], want, "chunked, in the first output");
  const std::vector<Expected> want_other(want.begin(), want.begin() + 19);
  ExpectMatches(e->Find("b")->prompt_logprobs, want_other, "chunked, shorter prompt");
  EXPECT_EQ(e->Find("c")->output, e->Find("a")->output);
}

TEST(PromptLogprobsTest, PrefixCacheHitsAreComputedAgain) {
  std::unique_ptr<LlmEngine> e = NewEngine(2048, true);
  const std::vector<int32_t> prompt = LongPrompt(e->tokenizer());
  const std::vector<Expected> want = FullForward(prompt);
  // A request without prompt logprobs caches the prompt's blocks; the next one finds them.
  ASSERT_TRUE(e->AddRequest("warm", prompt, WithPromptLogprobs(-1)).ok());
  RunDry(*e);
  ASSERT_TRUE(e->AddRequest("cached", prompt, WithPromptLogprobs(-1)).ok());
  RunDry(*e);
  ASSERT_GT(e->Find("cached")->num_cached_tokens, 0);
  // With prompt logprobs, nothing is taken from the cache, and two identical requests agree.
  for (const std::string id : {"first", "second"}) {
    ASSERT_TRUE(e->AddRequest(id, prompt, WithPromptLogprobs(kTopK)).ok());
    std::map<std::string, std::vector<ScoredToken>> carried = RunDry(*e);
    EXPECT_EQ(e->Find(id)->num_cached_tokens, 0) << id;
    ExpectMatches(e->Find(id)->prompt_logprobs, want, id);
    ExpectMatches(carried[id], want, id + ", in the first output");
    EXPECT_EQ(e->Find(id)->output, e->Find("warm")->output) << id;
  }
  const std::vector<ScoredToken>& first = e->Find("first")->prompt_logprobs;
  const std::vector<ScoredToken>& second = e->Find("second")->prompt_logprobs;
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].logprob, second[i].logprob) << i;
}

TEST(PromptLogprobsTest, ZeroTopKStillScoresEachToken) {
  std::unique_ptr<LlmEngine> e = NewEngine(2048, false);
  const std::vector<int32_t> prompt = LongPrompt(e->tokenizer());
  const std::vector<Expected> want = FullForward(prompt);
  ASSERT_TRUE(e->AddRequest("a", prompt, WithPromptLogprobs(0)).ok());
  RunDry(*e);
  const std::vector<ScoredToken>& got = e->Find("a")->prompt_logprobs;
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(got[i].logprob, want[i].logprob, 2e-4) << i;
    EXPECT_EQ(got[i].rank, want[i].rank) << i;
    EXPECT_TRUE(got[i].top.empty()) << i;
  }
  // A one-token prompt has nothing to score.
  ASSERT_TRUE(e->AddRequest("one", {prompt[0]}, WithPromptLogprobs(3)).ok());
  RunDry(*e);
  EXPECT_TRUE(e->Find("one")->prompt_logprobs.empty());
  EXPECT_EQ(e->Find("one")->output.size(), 4u);
}

TEST(PromptLogprobsTest, RejectsMoreThanTwenty) {
  std::unique_ptr<LlmEngine> e = NewEngine(2048, false);
  for (int32_t k : {21, -2}) {
    const absl::Status s = e->AddRequest("x", {1, 2, 3}, WithPromptLogprobs(k));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_NE(s.message().find("prompt_logprobs"), std::string::npos) << s;
  }
  EXPECT_TRUE(e->AddRequest("x", {1, 2, 3}, WithPromptLogprobs(20)).ok());
}

}  // namespace
}  // namespace duet
