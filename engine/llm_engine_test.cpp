#include "engine/llm_engine.h"

#include <cstring>

#include "backends/executor_factory.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";

std::unique_ptr<LlmEngine> NewEngine(int32_t num_blocks = 256, int32_t max_num_seqs = 64) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = num_blocks;
  config.scheduler.max_num_seqs = max_num_seqs;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

void RunToCompletion(LlmEngine& e) {
  while (e.HasUnfinished()) ASSERT_TRUE(e.Step().ok());
}

std::vector<int32_t> Prompt(const LlmEngine& e) {
  return e.tokenizer().Encode("import os\n\ndef read_config(path):\n    with open(path) as f:\n");
}

TEST(LlmEngineTest, SeededSamplingIsTheSameBatchedOrAlone) {
  std::unique_ptr<LlmEngine> batched = NewEngine();
  std::vector<SamplingParams> params(6);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].temperature = 0.8f;
    params[i].top_p = 0.95f;
    params[i].top_k = 50;
    params[i].seed = 1000 + i;
    params[i].max_tokens = 24;
    params[i].ignore_eos = true;
    ASSERT_TRUE(batched->AddRequest("r" + std::to_string(i), Prompt(*batched), params[i]).ok());
  }
  RunToCompletion(*batched);
  for (size_t i = 0; i < params.size(); ++i) {
    std::unique_ptr<LlmEngine> alone = NewEngine();
    ASSERT_TRUE(alone->AddRequest("x", Prompt(*alone), params[i]).ok());
    RunToCompletion(*alone);
    EXPECT_EQ(alone->Find("x")->output, batched->Find("r" + std::to_string(i))->output) << i;
  }
  // Different seeds give different samples.
  EXPECT_NE(batched->Find("r0")->output, batched->Find("r1")->output);
}

TEST(LlmEngineTest, StopStringsTruncateTextAndFinish) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 64;
  ASSERT_TRUE(e->AddRequest("free", Prompt(*e), p).ok());
  RunToCompletion(*e);
  const std::string full = e->Find("free")->text;
  ASSERT_GT(full.size(), 10u);
  // Stop on a piece of the greedy continuation: the text ends right before it.
  const std::string stop = full.substr(6, 3);
  p.stop = {stop};
  std::string streamed;
  ASSERT_TRUE(e->AddRequest("stopped", Prompt(*e), p).ok());
  while (e->HasUnfinished()) {
    const absl::StatusOr<std::vector<RequestOutput>> outs = e->Step();  // outlives the loop over it
    ASSERT_TRUE(outs.ok()) << outs.status();
    for (const RequestOutput& out : *outs) streamed += out.new_text;
  }
  const Request* r = e->Find("stopped");
  EXPECT_EQ(r->finish_reason, FinishReason::kStop);
  EXPECT_EQ(r->text, full.substr(0, full.find(stop)));
  EXPECT_EQ(streamed, r->text);  // the held-back stop prefix never streamed out
}

// A step that accepts several drafted tokens streams the text of all of them.
TEST(LlmEngineTest, SpeculatingRequestsStreamTheWholeText) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 256;
  config.speculation.adaptive = false;  // drafts every step
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  ASSERT_TRUE(e.ok()) << e.status();
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 64;
  p.speculation = SpeculationMode::kLookahead;
  const std::vector<int32_t> prompt =
      (*e)->tokenizer().Encode("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n");
  ASSERT_TRUE((*e)->AddRequest("spec", prompt, p).ok());
  std::string streamed;
  size_t most_tokens = 0;
  while ((*e)->HasUnfinished()) {
    const absl::StatusOr<std::vector<RequestOutput>> outs = (*e)->Step();
    ASSERT_TRUE(outs.ok()) << outs.status();
    for (const RequestOutput& out : *outs) {
      streamed += out.new_text;
      most_tokens = std::max(most_tokens, out.new_token_ids.size());
    }
  }
  EXPECT_GT(most_tokens, 1u);  // drafts were accepted
  EXPECT_EQ(streamed, (*e)->Find("spec")->text);
}

TEST(LlmEngineTest, StopTokenIdsAndMaxTokens) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 10;
  ASSERT_TRUE(e->AddRequest("len", Prompt(*e), p).ok());
  RunToCompletion(*e);
  const Request* len = e->Find("len");
  EXPECT_EQ(len->finish_reason, FinishReason::kLength);
  ASSERT_EQ(len->output.size(), 10u);
  p.stop_token_ids = {len->output[3]};
  ASSERT_TRUE(e->AddRequest("stop", Prompt(*e), p).ok());
  RunToCompletion(*e);
  const Request* stop = e->Find("stop");
  EXPECT_EQ(stop->finish_reason, FinishReason::kStop);
  size_t first = 0;
  while (len->output[first] != len->output[3]) ++first;
  EXPECT_EQ(stop->output, std::vector<int32_t>(len->output.begin(), len->output.begin() + first + 1));
}

TEST(LlmEngineTest, RejectsBadRequestsClearly) {
  std::unique_ptr<LlmEngine> e = NewEngine(/*num_blocks=*/8);
  SamplingParams p;
  EXPECT_EQ(e->AddRequest("a", {1, 99999}, p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e->AddRequest("b", {}, p).code(), absl::StatusCode::kInvalidArgument);
  p.max_tokens = 1000;  // 8 blocks of 16 tokens cannot hold it
  EXPECT_EQ(e->AddRequest("c", {5, 6}, p).code(), absl::StatusCode::kInvalidArgument);
  p.max_tokens = 5;
  ASSERT_TRUE(e->AddRequest("d", {5, 6}, p).ok());
  EXPECT_EQ(e->AddRequest("d", {5, 6}, p).code(), absl::StatusCode::kAlreadyExists);
}

TEST(LlmEngineTest, AbortFreesBlocks) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  const int32_t idle = e->Stats().num_free_kv_blocks;
  SamplingParams p;
  p.max_tokens = 100;
  ASSERT_TRUE(e->AddRequest("a", Prompt(*e), p).ok());
  ASSERT_TRUE(e->AddRequest("b", Prompt(*e), p).ok());
  ASSERT_TRUE(e->Step().ok());
  EXPECT_LT(e->Stats().num_free_kv_blocks, idle);
  EXPECT_TRUE(e->Abort("a"));
  EXPECT_FALSE(e->Abort("a"));
  e->Release("b");
  EXPECT_EQ(e->Find("a")->finish_reason, FinishReason::kAbort);
  EXPECT_FALSE(e->HasUnfinished());
  EXPECT_EQ(e->Stats().num_free_kv_blocks, idle);
}

// Disaggregation in one process: engine P prefills (one token), its KV blocks are copied into
// blocks engine D reserved, and D continues. The result equals one engine doing it all.
TEST(LlmEngineTest, PrefilledHandoffMatchesLocalGeneration) {
  for (const bool greedy : {true, false}) {
    SamplingParams p;
    p.temperature = greedy ? 0.0f : 0.9f;
    p.seed = 77;
    p.max_tokens = 20;
    p.ignore_eos = true;

    std::unique_ptr<LlmEngine> local = NewEngine();
    ASSERT_TRUE(local->AddRequest("x", Prompt(*local), p).ok());
    RunToCompletion(*local);

    std::unique_ptr<LlmEngine> prefill = NewEngine();
    std::unique_ptr<LlmEngine> decode = NewEngine();
    const std::vector<int32_t> prompt = Prompt(*prefill);
    absl::StatusOr<LlmEngine::KvReservation> reservation = decode->ReserveKv(prompt, "", 0);
    ASSERT_TRUE(reservation.ok());
    SamplingParams first = p;
    first.max_tokens = 1;
    ASSERT_TRUE(prefill->AddRequest("x", prompt, first).ok());
    // Copy each layer's blocks as soon as the prefill step has written them.
    const KvCacheShape shape = prefill->kv_cache().shape();
    const std::vector<int32_t> dst = decode->BlockTable(reservation->seq);
    auto ship = [&](int64_t layer, absl::Span<const SequenceChunk> chunks) {
      for (const SequenceChunk& c : chunks) {
        for (size_t b = 0; b < c.block_table.size(); ++b) {
          const int64_t n = shape.block_elems();
          std::memcpy(static_cast<float*>(decode->kv_cache().key_pool(layer)) + dst[b] * n, static_cast<float*>(prefill->kv_cache().key_pool(layer)) + c.block_table[b] * n, n * sizeof(float));
          std::memcpy(static_cast<float*>(decode->kv_cache().value_pool(layer)) + dst[b] * n, static_cast<float*>(prefill->kv_cache().value_pool(layer)) + c.block_table[b] * n, n * sizeof(float));
        }
      }
    };
    absl::StatusOr<std::vector<RequestOutput>> step = prefill->Step(ship);
    ASSERT_TRUE(step.ok());
    ASSERT_EQ(step->size(), 1u);
    const Request* pre = prefill->Find("x");
    SampledToken token{pre->output[0]};
    absl::StatusOr<RequestOutput> joined = decode->AddPrefilledRequest("x", prompt, p, reservation->seq, token);
    ASSERT_TRUE(joined.ok()) << joined.status();
    RunToCompletion(*decode);
    EXPECT_EQ(decode->Find("x")->output, local->Find("x")->output) << (greedy ? "greedy" : "sampled");
    EXPECT_EQ(decode->Find("x")->text, local->Find("x")->text);
    EXPECT_EQ(decode->Stats().num_free_kv_blocks, decode->Stats().num_kv_blocks);
    // The prompt was computed where it was prefilled; each engine counts the tokens it sampled.
    const int64_t prompt_len = int64_t(prompt.size());
    EXPECT_EQ(local->Stats().num_prompt_tokens, prompt_len);
    EXPECT_EQ(local->Stats().num_generation_tokens, 20);
    EXPECT_EQ(prefill->Stats().num_prompt_tokens, prompt_len);
    EXPECT_EQ(prefill->Stats().num_generation_tokens, 1);
    EXPECT_EQ(decode->Stats().num_prompt_tokens, 0);
    EXPECT_EQ(decode->Stats().num_generation_tokens, 19);
  }
}

// A prefill whose KV target comes after its forward pass: the finished request's blocks stay,
// unchanged, until ReleaseKv; an aborted request keeps nothing.
TEST(LlmEngineTest, KeepsTheKvOfAFinishedRequestUntilReleased) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  const int32_t idle = e->Stats().num_free_kv_blocks;
  SamplingParams p;
  p.max_tokens = 1;
  const std::vector<int32_t> prompt = Prompt(*e);
  ASSERT_TRUE(e->AddRequest("kept", prompt, p).ok());
  ASSERT_TRUE(e->AddRequest("aborted", prompt, p).ok());
  ASSERT_TRUE(e->KeepKvWhenFinished("kept").ok());
  ASSERT_TRUE(e->KeepKvWhenFinished("aborted").ok());
  EXPECT_EQ(e->KeepKvWhenFinished("unknown").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(e->Abort("aborted"));
  EXPECT_FALSE(e->Find("aborted")->kept_kv.has_value());

  std::vector<int32_t> computed_blocks;
  const KvCacheShape shape = e->kv_cache().shape();
  std::vector<float> layer0_keys;
  auto note = [&](int64_t layer, absl::Span<const SequenceChunk> chunks) {
    if (layer != 0) return;
    computed_blocks.assign(chunks[0].block_table.begin(), chunks[0].block_table.end());
    for (int32_t b : computed_blocks) {
      const float* k = static_cast<const float*>(e->kv_cache().key_pool(0)) + b * shape.block_elems();
      layer0_keys.insert(layer0_keys.end(), k, k + shape.block_elems());
    }
  };
  ASSERT_TRUE(e->Step(note).ok());
  const Request* kept = e->Find("kept");
  ASSERT_TRUE(kept->finished());
  ASSERT_TRUE(kept->kept_kv.has_value());
  const SequenceId seq = *kept->kept_kv;
  EXPECT_EQ(e->BlockTable(seq), computed_blocks);
  EXPECT_EQ(e->KeepKvWhenFinished("kept").code(), absl::StatusCode::kNotFound);  // finished
  e->Release("kept");
  e->Release("aborted");
  EXPECT_EQ(e->Stats().num_free_kv_blocks, idle - int32_t(computed_blocks.size()));

  // Another request runs meanwhile: the kept blocks are not reused.
  ASSERT_TRUE(e->AddRequest("next", std::vector<int32_t>(prompt.rbegin(), prompt.rend()), p).ok());
  RunToCompletion(*e);
  std::vector<float> now;
  for (int32_t b : e->BlockTable(seq)) {
    const float* k = static_cast<const float*>(e->kv_cache().key_pool(0)) + b * shape.block_elems();
    now.insert(now.end(), k, k + shape.block_elems());
  }
  EXPECT_EQ(now, layer0_keys);
  e->ReleaseKv(seq);
  EXPECT_EQ(e->Stats().num_free_kv_blocks, idle);
}

// Prompt tokens count as computed once per forward pass that ran them: a prefix the cache
// already holds is not computed again.
TEST(LlmEngineTest, CountsComputedPromptTokensNotCachedOnes) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 64;
  config.enable_prefix_caching = true;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  ASSERT_TRUE(e.ok()) << e.status();
  SamplingParams p;
  p.max_tokens = 3;
  p.ignore_eos = true;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 4; ++i) {  // long enough to fill blocks of 16 tokens
    const std::vector<int32_t> part = Prompt(**e);
    prompt.insert(prompt.end(), part.begin(), part.end());
  }
  ASSERT_TRUE((*e)->AddRequest("first", prompt, p).ok());
  RunToCompletion(**e);
  EXPECT_EQ((*e)->Stats().num_prompt_tokens, int64_t(prompt.size()));
  ASSERT_TRUE((*e)->AddRequest("again", prompt, p).ok());
  RunToCompletion(**e);
  const EngineStats stats = (*e)->Stats();
  ASSERT_GT(stats.prefix_cache_hits, 0);
  EXPECT_EQ(stats.num_prompt_tokens, 2 * int64_t(prompt.size()) - stats.prefix_cache_hits);
  EXPECT_EQ(stats.num_generation_tokens, 6);
}

// Every step that ran a forward pass is counted with its wall time, of which the forward is a
// part; a step with nothing scheduled is not.
TEST(LlmEngineTest, CountsStepsAndTheirTimes) {
  std::unique_ptr<LlmEngine> e = NewEngine();
  ASSERT_TRUE(e->Step().ok());  // nothing to run
  EXPECT_EQ(e->Stats().num_steps, 0);
  SamplingParams p;
  p.max_tokens = 4;
  p.ignore_eos = true;
  ASSERT_TRUE(e->AddRequest("a", Prompt(*e), p).ok());
  RunToCompletion(*e);
  const EngineStats stats = e->Stats();
  EXPECT_EQ(stats.num_steps, 4);  // the prompt (with the first token), then three decode steps
  EXPECT_GT(stats.forward_seconds, 0);
  EXPECT_GE(stats.step_seconds, stats.forward_seconds);
}

}  // namespace
}  // namespace duet
