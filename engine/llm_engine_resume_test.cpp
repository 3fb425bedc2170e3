// Request migration in the engine: a request given the first tokens of an output (ResumedOutput)
// goes on exactly as the request that produced them did, on the host sampler: the same tokens,
// the same streamed text after what was emitted, the same finish.
#include <string>
#include <vector>

#include "backends/executor_factory.h"
#include "engine/llm_engine.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";

std::unique_ptr<LlmEngine> NewEngine() {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 512;
  config.speculation.max_draft_tokens = 5;
  config.speculation.adaptive = false;  // drafts every step: the resumed request verifies drafts too
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

std::vector<int32_t> Prompt(const LlmEngine& e) {
  return e.tokenizer().Encode("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n");
}

// What a request streamed: each output's tokens and text, and how it ended.
struct Streamed {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::string> texts;
  std::vector<float> logprobs;
  FinishReason finish_reason = FinishReason::kNone;

  std::vector<int32_t> all_tokens() const {
    std::vector<int32_t> all;
    for (const auto& t : tokens) all.insert(all.end(), t.begin(), t.end());
    return all;
  }
  std::string all_text() const {
    std::string all;
    for (const auto& t : texts) all += t;
    return all;
  }
};

Streamed StreamAlone(LlmEngine& e, const std::string& id, const SamplingParams& params,
                     const ResumedOutput& resumed = {}) {
  EXPECT_TRUE(e.AddRequest(id, Prompt(e), params, resumed).ok());
  Streamed run;
  while (e.HasUnfinished()) {
    absl::StatusOr<std::vector<RequestOutput>> outs = e.Step();
    EXPECT_TRUE(outs.ok()) << outs.status();
    for (const RequestOutput& out : *outs) {
      run.tokens.push_back(out.new_token_ids);
      run.texts.push_back(out.new_text);
      run.logprobs.insert(run.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
      if (out.finished) run.finish_reason = out.finish_reason;
    }
  }
  EXPECT_EQ(run.all_text(), e.Find(id)->text.substr(resumed.emitted_text_bytes)) << id;  // nothing held back
  e.Release(id);
  return run;
}

struct Case {
  std::string name;
  SamplingParams params;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.max_tokens = 40;
  cases.push_back({"greedy", greedy});
  SamplingParams seeded;
  seeded.temperature = 0.8f;
  seeded.top_p = 0.95f;
  seeded.top_k = 50;
  seeded.seed = 7;
  seeded.max_tokens = 40;
  cases.push_back({"seeded", seeded});
  SamplingParams penalized = seeded;
  penalized.seed = 11;
  penalized.frequency_penalty = 0.6f;
  penalized.presence_penalty = 0.4f;
  penalized.repetition_penalty = 1.15f;
  penalized.logprobs = 2;
  penalized.logit_bias = {{13, 2.0f}};
  cases.push_back({"penalties and logprobs", penalized});
  SamplingParams speculating = seeded;
  speculating.seed = 23;
  speculating.speculation = SpeculationMode::kLookahead;
  cases.push_back({"seeded with lookahead drafts", speculating});
  SamplingParams constrained = seeded;
  constrained.seed = 5;
  constrained.max_tokens = 30;
  constrained.structured_output.kind = grammar::StructuredOutput::Kind::kRegex;
  constrained.structured_output.spec = "[a-z_]+ = [a-z_]+\\([a-z_, ]*\\)\n[a-z_ =.()\n]*";
  cases.push_back({"seeded regex", constrained});
  return cases;
}

// Resumed after each of several outputs, the request streams the rest of the uninterrupted run.
void ExpectResumedEqualsUninterrupted(LlmEngine& e, const Case& c, const Streamed& full) {
  const std::vector<int32_t> all = full.all_tokens();
  const std::string text = full.all_text();
  ASSERT_GE(full.tokens.size(), 8u) << c.name;
  for (size_t cut : {size_t(1), size_t(3), full.tokens.size() / 2, full.tokens.size() - 1}) {
    ResumedOutput resumed;
    for (size_t i = 0; i < cut; ++i) {
      resumed.tokens.insert(resumed.tokens.end(), full.tokens[i].begin(), full.tokens[i].end());
      resumed.emitted_text_bytes += full.texts[i].size();
    }
    const Streamed rest = StreamAlone(e, c.name + " resumed", c.params, resumed);
    std::vector<int32_t> joined = resumed.tokens;
    const std::vector<int32_t> more = rest.all_tokens();
    joined.insert(joined.end(), more.begin(), more.end());
    EXPECT_EQ(joined, all) << c.name << ", resumed after " << cut << " outputs";
    EXPECT_EQ(text.substr(0, resumed.emitted_text_bytes) + rest.all_text(), text) << c.name << ", " << cut;
    EXPECT_EQ(rest.finish_reason, full.finish_reason) << c.name << ", " << cut;
    if (c.params.logprobs >= 0) {
      ASSERT_EQ(rest.logprobs.size(), more.size());
      for (size_t i = 0; i < more.size(); ++i) {
        // The resumed tokens' KV came from a prefill, the uninterrupted one's from decode steps.
        EXPECT_NEAR(rest.logprobs[i], full.logprobs[resumed.tokens.size() + i], 1e-3) << c.name << ", " << cut;
      }
    }
  }
}

TEST(LlmEngineResumeTest, ResumedRequestsContinueTheUninterruptedOutput) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  for (const Case& c : Cases()) {
    const Streamed full = StreamAlone(*e, c.name, c.params);
    ExpectResumedEqualsUninterrupted(*e, c, full);
  }
}

// A stop string that ends the uninterrupted output, cut into the held-back text: the resumed
// request still stops there and streams none of it.
TEST(LlmEngineResumeTest, StopStringAcrossTheResumePoint) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 48;
  const std::string text = StreamAlone(*e, "free", p).all_text();
  ASSERT_GT(text.size(), 40u);
  p.stop = {text.substr(30, 8)};
  const Streamed full = StreamAlone(*e, "stopped", p);
  ASSERT_EQ(full.finish_reason, FinishReason::kStop);
  ASSERT_EQ(full.all_text(), text.substr(0, text.find(p.stop[0])));
  ExpectResumedEqualsUninterrupted(*e, {"stop string", p}, full);
}

// Steps the engine until request `id` finishes, collecting what it streams.
Streamed StreamRest(LlmEngine& e, const std::string& id, Streamed run = {}) {
  while (e.HasUnfinished()) {
    absl::StatusOr<std::vector<RequestOutput>> outs = e.Step();
    EXPECT_TRUE(outs.ok()) << outs.status();
    if (!outs.ok()) break;
    for (const RequestOutput& out : *outs) {
      run.tokens.push_back(out.new_token_ids);
      run.texts.push_back(out.new_text);
      if (out.finished) run.finish_reason = out.finish_reason;
    }
  }
  e.Release(id);
  return run;
}

// Live KV migration in the engine: a request detached after some outputs and attached again on
// its own blocks (as a decode worker that received them does) streams the rest of the
// uninterrupted run: tokens, text, finish, seeded draws, grammar and drafts included.
TEST(LlmEngineResumeTest, DetachedRequestsAttachAndContinueTheUninterruptedOutput) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  for (const Case& c : Cases()) {
    const Streamed full = StreamAlone(*e, c.name, c.params);
    ASSERT_GE(full.tokens.size(), 8u) << c.name;
    // Cut by tokens: with lookahead an output carries several, more as the cache learns.
    for (size_t cut : {size_t(1), size_t(3), full.all_tokens().size() / 2}) {
      const std::string id = c.name + " detached";
      ASSERT_TRUE(e->AddRequest(id, Prompt(*e), c.params).ok());
      Streamed before;
      while (before.all_tokens().size() < cut) {
        ASSERT_TRUE(e->HasUnfinished()) << c.name << " finished before " << cut << " tokens";
        absl::StatusOr<std::vector<RequestOutput>> outs = e->Step();
        ASSERT_TRUE(outs.ok()) << outs.status();
        for (const RequestOutput& out : *outs) {
          before.tokens.push_back(out.new_token_ids);
          before.texts.push_back(out.new_text);
        }
      }
      const int32_t free_before = e->Stats().num_free_kv_blocks;
      absl::StatusOr<LlmEngine::DetachedRequest> d = e->Detach(id);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(d->output, before.all_tokens()) << c.name << ", " << cut;
      EXPECT_EQ(d->prompt, Prompt(*e));
      EXPECT_FALSE(e->HasUnfinished());
      EXPECT_EQ(e->Find(id), nullptr);
      EXPECT_EQ(e->Stats().num_free_kv_blocks, free_before) << "the blocks stay with the detached sequence";
      const std::string emitted = before.all_text();
      ASSERT_TRUE(e->AttachRequest(id, d->prompt, c.params, d->seq, ResumedOutput{d->output, emitted.size()}).ok());
      // Attached and not yet stepped (a drain right after a migrated request joined): it detaches
      // again, the same tokens on the same blocks, and attaches once more.
      absl::StatusOr<LlmEngine::DetachedRequest> again = e->Detach(id);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(again->seq, d->seq);
      EXPECT_EQ(again->output, d->output);
      EXPECT_FALSE(e->HasUnfinished());
      ASSERT_TRUE(
          e->AttachRequest(id, again->prompt, c.params, again->seq, ResumedOutput{again->output, emitted.size()}).ok());
      const Streamed rest = StreamRest(*e, id);
      std::vector<int32_t> joined = d->output;
      const std::vector<int32_t> more = rest.all_tokens();
      joined.insert(joined.end(), more.begin(), more.end());
      EXPECT_EQ(joined, full.all_tokens()) << c.name << ", detached after " << cut << " tokens";
      EXPECT_EQ(emitted + rest.all_text(), full.all_text()) << c.name << ", " << cut;
      EXPECT_EQ(rest.finish_reason, full.finish_reason) << c.name << ", " << cut;
    }
  }
  EXPECT_EQ(e->Stats().num_free_kv_blocks, e->Stats().num_kv_blocks);  // the attached requests freed them
}

// Only a decoding request detaches; one still waiting for its prefill stays queued, an unknown one
// is not found.
TEST(LlmEngineResumeTest, OnlyDecodingRequestsDetach) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 8;
  EXPECT_EQ(e->Detach("nobody").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(e->AddRequest("r", Prompt(*e), p).ok());
  EXPECT_EQ(e->Detach("r").status().code(), absl::StatusCode::kFailedPrecondition);  // not scheduled yet
  EXPECT_TRUE(e->HasUnfinished());
  EXPECT_EQ(e->AttachRequest("s", Prompt(*e), p, 12345, ResumedOutput{}).code(), absl::StatusCode::kInvalidArgument);
  const Streamed run = StreamRest(*e, "r");
  EXPECT_EQ(run.all_tokens().size(), 8u);
}

TEST(LlmEngineResumeTest, ImpossibleResumedOutputsAreInvalid) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 3;
  auto add = [&](std::vector<int32_t> tokens, size_t emitted) {
    return e->AddRequest("r", Prompt(*e), p, ResumedOutput{std::move(tokens), emitted}).code();
  };
  EXPECT_EQ(add({10, 11, 12}, 0), absl::StatusCode::kInvalidArgument);  // max_tokens reached
  EXPECT_EQ(add({10, 1 << 20}, 0), absl::StatusCode::kInvalidArgument);  // out of vocabulary
  EXPECT_EQ(add({*e->tokenizer().eos_token_id()}, 0), absl::StatusCode::kInvalidArgument);  // it would have stopped
  EXPECT_EQ(add({10}, 1000), absl::StatusCode::kInvalidArgument);      // more text than the tokens make
  EXPECT_EQ(add({}, 1), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(e->HasUnfinished());
  EXPECT_EQ(add({10, 11}, 0), absl::StatusCode::kOk);
}

}  // namespace
}  // namespace duet
