// Prefix caching through the whole engine: with the cache on (and with its host tier) every
// output equals the output with it off, token for token, while the cache serves hits.
#include <cstring>
#include <fstream>
#include <map>

#include "backends/executor_factory.h"
#include "engine/llm_engine.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";

enum class Cache { kOff, kOn, kOnWithHostTier };

std::unique_ptr<LlmEngine> NewEngine(Cache cache, int32_t num_blocks = 256, int32_t max_num_seqs = 64) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = num_blocks;
  config.scheduler.max_num_seqs = max_num_seqs;
  config.enable_prefix_caching = cache != Cache::kOff;
  if (cache == Cache::kOnWithHostTier) config.host_kv_cache_bytes = int64_t(64) << 20;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

void RunToCompletion(LlmEngine& e) {
  while (e.HasUnfinished()) ASSERT_TRUE(e.Step().ok());
}

SamplingParams Params(int32_t max_tokens, bool greedy, uint64_t seed = 1) {
  SamplingParams p;
  p.temperature = greedy ? 0.0f : 0.9f;
  p.seed = seed;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

struct Job {
  std::vector<int32_t> prompt;
  SamplingParams params;
};

// Runs `waves` one after another (each wave's jobs at once) on one engine; outputs by job.
std::vector<std::vector<int32_t>> RunWaves(LlmEngine& e, const std::vector<std::vector<Job>>& waves) {
  std::vector<std::vector<int32_t>> outputs;
  for (const std::vector<Job>& wave : waves) {
    const size_t first = outputs.size();
    for (size_t i = 0; i < wave.size(); ++i) {
      const absl::Status added = e.AddRequest("j" + std::to_string(first + i), wave[i].prompt, wave[i].params);
      EXPECT_TRUE(added.ok()) << added;
    }
    RunToCompletion(e);
    for (size_t i = 0; i < wave.size(); ++i) {
      const std::string id = "j" + std::to_string(first + i);
      outputs.push_back(e.Find(id)->output);
      e.Release(id);
    }
  }
  EXPECT_EQ(e.Stats().num_free_kv_blocks, e.Stats().num_kv_blocks);
  return outputs;
}

std::vector<int32_t> Tokens(const LlmEngine& e, const std::string& text) { return e.tokenizer().Encode(text); }

TEST(LlmEnginePrefixCacheTest, ReferenceCasesHitAndMatch) {
  std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  std::vector<Job> wave;
  std::vector<std::vector<int32_t>> expected;
  for (const auto& c : ref["cases"]) {
    wave.push_back({c["prompt_ids"].get<std::vector<int32_t>>(), Params(int32_t(c["greedy_ids"].size()), true)});
    expected.push_back(c["greedy_ids"].get<std::vector<int32_t>>());
  }
  {
    std::unique_ptr<LlmEngine> e = NewEngine(Cache::kOn);
    // Twice: the second pass finds every prompt's full blocks cached.
    const std::vector<std::vector<int32_t>> out = RunWaves(*e, {wave, wave});
    for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], expected[i % expected.size()]) << "case " << i;
    int64_t cacheable = 0;
    for (const Job& j : wave) cacheable += int64_t((j.prompt.size() - 1) / 16) * 16;
    EXPECT_EQ(e->Stats().prefix_cache_hits, cacheable);
  }
}

// Chats of four turns, each turn's prompt the last prompt, its output and a new message;
// sessions interleave, greedy and seeded sampling.
TEST(LlmEnginePrefixCacheTest, MultiTurnChatsMatchCacheOff) {
  std::unique_ptr<LlmEngine> off = NewEngine(Cache::kOff);
  std::unique_ptr<LlmEngine> on = NewEngine(Cache::kOn);
  const std::vector<std::string> messages = {"def parse(line):\n", "class Config:\n    def __init__(self):\n",
                                             "# now the tests\nimport pytest\n", "for item in items:\n"};
  std::vector<std::vector<int32_t>> history(3);
  for (size_t s = 0; s < history.size(); ++s) {
    history[s] = Tokens(*off, "# session " + std::to_string(s) + ": a shared system prompt that spans blocks\n");
  }
  for (size_t turn = 0; turn < messages.size(); ++turn) {
    std::vector<Job> wave;
    for (size_t s = 0; s < history.size(); ++s) {
      std::vector<int32_t> prompt = history[s];
      const std::vector<int32_t> message = Tokens(*off, messages[(turn + s) % messages.size()]);
      prompt.insert(prompt.end(), message.begin(), message.end());
      wave.push_back({prompt, Params(12 + int32_t(s), s != 1, 100 + turn)});
    }
    const std::vector<std::vector<int32_t>> a = RunWaves(*off, {wave}), b = RunWaves(*on, {wave});
    ASSERT_EQ(a, b) << "turn " << turn;
    for (size_t s = 0; s < history.size(); ++s) {
      history[s] = wave[s].prompt;
      history[s].insert(history[s].end(), a[s].begin(), a[s].end());
    }
  }
  EXPECT_GT(on->Stats().prefix_cache_hits, on->Stats().prefix_cache_queries / 2);
}

TEST(LlmEnginePrefixCacheTest, PromptsDivergingMidBlockMatchCacheOff) {
  std::unique_ptr<LlmEngine> off = NewEngine(Cache::kOff);
  std::unique_ptr<LlmEngine> on = NewEngine(Cache::kOn);
  const std::vector<int32_t> base = Tokens(*off, "import numpy as np\nimport torch\n\ndef train(model, data, epochs):\n");
  std::vector<Job> wave;
  for (size_t cut : {size_t(8), size_t(20), size_t(31), base.size() - 1}) {
    std::vector<int32_t> p(base.begin(), base.begin() + int64_t(cut));
    p.push_back(13);  // a different token right after the shared part
    p.push_back(871);
    wave.push_back({p, Params(10, true)});
  }
  std::vector<Job> first = {{base, Params(10, true)}};
  EXPECT_EQ(RunWaves(*off, {first, wave}), RunWaves(*on, {first, wave}));
  EXPECT_GT(on->Stats().prefix_cache_hits, 0);
}

// A cache far smaller than the workload: blocks are evicted (and, with the host tier, come back
// from host memory), and running requests are preempted and recomputed from cached blocks.
TEST(LlmEnginePrefixCacheTest, EvictionAndPreemptionMatchCacheOff) {
  std::vector<Job> wave;
  std::unique_ptr<LlmEngine> off = NewEngine(Cache::kOff, /*num_blocks=*/24, /*max_num_seqs=*/8);
  ASSERT_GT(Tokens(*off, "# file 0: helpers for the command line\nimport os\nimport sys\nimport argparse\n\n").size(), 17u);
  for (int i = 0; i < 10; ++i) {
    std::vector<int32_t> p = Tokens(*off, "# file " + std::to_string(i % 4) +
                                              ": helpers for the command line\nimport os\nimport sys\nimport argparse\n\n");
    wave.push_back({p, Params(40, i % 3 != 0, 7 + uint64_t(i))});
  }
  const std::vector<std::vector<int32_t>> expected = RunWaves(*off, {wave, wave});
  EXPECT_GT(off->Stats().num_preemptions, 0) << "the workload must preempt";
  for (Cache cache : {Cache::kOn, Cache::kOnWithHostTier}) {
    std::unique_ptr<LlmEngine> on = NewEngine(cache, /*num_blocks=*/24, /*max_num_seqs=*/8);
    EXPECT_EQ(RunWaves(*on, {wave, wave}), expected);
    const EngineStats stats = on->Stats();
    EXPECT_GT(stats.num_preemptions, 0);
    EXPECT_GT(stats.num_kv_evictions, 0);
    EXPECT_GT(stats.prefix_cache_hits, 0);
    if (cache == Cache::kOnWithHostTier) {
      EXPECT_GT(stats.host_tier.offloaded_blocks, 0);
      EXPECT_GT(stats.host_tier.loaded_blocks, 0);
    }
  }
}

TEST(LlmEnginePrefixCacheTest, AbortingARequestWhoseBlocksOthersShare) {
  std::unique_ptr<LlmEngine> off = NewEngine(Cache::kOff);
  std::unique_ptr<LlmEngine> on = NewEngine(Cache::kOn);
  const std::vector<int32_t> prompt = Tokens(*off, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n");
  const std::vector<std::vector<int32_t>> expected = RunWaves(*off, {{{prompt, Params(24, true)}}});
  // Three requests share the prompt's blocks; one is aborted mid-generation.
  ASSERT_TRUE(on->AddRequest("warm", prompt, Params(1, true)).ok());
  RunToCompletion(*on);
  for (const std::string id : {"a", "victim", "b"}) ASSERT_TRUE(on->AddRequest(id, prompt, Params(24, true)).ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(on->Step().ok());
  ASSERT_TRUE(on->Abort("victim"));
  RunToCompletion(*on);
  EXPECT_EQ(on->Find("a")->output, expected[0]);
  EXPECT_EQ(on->Find("b")->output, expected[0]);
  EXPECT_EQ(on->Find("a")->num_cached_tokens, int64_t((prompt.size() - 1) / 16) * 16);
  for (const std::string id : {"warm", "a", "victim", "b"}) on->Release(id);
  EXPECT_EQ(on->Stats().num_free_kv_blocks, on->Stats().num_kv_blocks);
}

TEST(LlmEnginePrefixCacheTest, CacheSaltSeparatesRequests) {
  std::unique_ptr<LlmEngine> on = NewEngine(Cache::kOn);
  const std::vector<int32_t> prompt =
      Tokens(*on, "def main():\n    args = parse_args()\n    config = load_config(args.config)\n    run(args, config)\n\n");
  ASSERT_GT(prompt.size(), 17u);
  SamplingParams salted = Params(4, true);
  salted.cache_salt = "tenant-a";
  ASSERT_FALSE(RunWaves(*on, {{{prompt, Params(4, true)}}}).empty());
  const int64_t hits = on->Stats().prefix_cache_hits;
  RunWaves(*on, {{{prompt, salted}}});
  EXPECT_EQ(on->Stats().prefix_cache_hits, hits) << "another salt must not hit";
  RunWaves(*on, {{{prompt, salted}}});
  EXPECT_GT(on->Stats().prefix_cache_hits, hits) << "the same salt hits";
  salted.cache_salt = std::string(300, 'x');
  EXPECT_EQ(on->AddRequest("long", prompt, salted).code(), absl::StatusCode::kInvalidArgument);
}

// Disaggregation: decode engine D already holds the previous turn; its reservation for the next
// turn starts with those blocks, and only the blocks after them are copied from prefill engine P.
TEST(LlmEnginePrefixCacheTest, DecodeReservationReusesThePreviousTurn) {
  std::unique_ptr<LlmEngine> local = NewEngine(Cache::kOff);
  std::unique_ptr<LlmEngine> prefill = NewEngine(Cache::kOn);
  std::unique_ptr<LlmEngine> decode = NewEngine(Cache::kOn);
  std::vector<int32_t> prompt = Tokens(*local, "# utilities for parsing configuration files\nimport json\n");
  const KvCacheShape shape = prefill->kv_cache().shape();
  for (int turn = 0; turn < 3; ++turn) {
    const SamplingParams p = Params(20, turn != 1, 5 + uint64_t(turn));
    const std::string id = "t" + std::to_string(turn);
    ASSERT_TRUE(local->AddRequest(id, prompt, p).ok());
    RunToCompletion(*local);
    absl::StatusOr<LlmEngine::KvReservation> reservation = decode->ReserveKv(prompt, "", 16);
    ASSERT_TRUE(reservation.ok()) << reservation.status();
    if (turn > 0) {
      EXPECT_GT(reservation->num_cached_tokens, 0) << "turn " << turn;
    }
    SamplingParams first = p;
    first.max_tokens = 1;
    ASSERT_TRUE(prefill->AddRequest(id, prompt, first).ok());
    const std::vector<int32_t> dst = decode->BlockTable(reservation->seq);
    const size_t skip = size_t(reservation->num_cached_tokens / shape.block_size);
    auto ship = [&](int64_t layer, absl::Span<const SequenceChunk> chunks) {
      for (const SequenceChunk& c : chunks) {
        if (c.num_logits == 0) continue;
        for (size_t b = skip; b < dst.size(); ++b) {
          const int64_t n = shape.block_elems();
          for (bool keys : {true, false}) {
            float* to = static_cast<float*>(keys ? decode->kv_cache().key_pool(layer) : decode->kv_cache().value_pool(layer));
            float* from = static_cast<float*>(keys ? prefill->kv_cache().key_pool(layer) : prefill->kv_cache().value_pool(layer));
            std::memcpy(to + dst[b] * n, from + c.block_table[b] * n, size_t(n) * sizeof(float));
          }
        }
      }
    };
    while (prefill->HasUnfinished()) ASSERT_TRUE(prefill->Step(ship).ok());
    SampledToken token{prefill->Find(id)->output[0]};
    ASSERT_TRUE(decode->AddPrefilledRequest(id, prompt, p, reservation->seq, token).ok());
    RunToCompletion(*decode);
    ASSERT_EQ(decode->Find(id)->output, local->Find(id)->output) << "turn " << turn;
    prompt.insert(prompt.end(), local->Find(id)->output.begin(), local->Find(id)->output.end());
    const std::vector<int32_t> next = Tokens(*local, "\ndef load(path):\n");
    prompt.insert(prompt.end(), next.begin(), next.end());
  }
  EXPECT_GT(prefill->Stats().prefix_cache_hits, 0);
}

// A reset forgets every cached block on the device and in the host tier: the same prompt then
// finds nothing (without the reset it would), and its output is unchanged.
TEST(LlmEnginePrefixCacheTest, ResetForgetsCachedBlocks) {
  std::vector<int32_t> prompt(20), other(20);  // each a full 16-token block and a partial one
  for (int32_t i = 0; i < 20; ++i) prompt[size_t(i)] = 100 + i, other[size_t(i)] = 300 + i;
  for (Cache cache : {Cache::kOn, Cache::kOnWithHostTier}) {
    for (bool reset : {false, true}) {
      // 2 blocks with the host tier: the second prompt evicts the first one's full block there.
      std::unique_ptr<LlmEngine> e = NewEngine(cache, /*num_blocks=*/cache == Cache::kOn ? 4 : 2);
      const auto first = RunWaves(*e, {{{prompt, Params(4, true)}}, {{other, Params(4, true)}}});
      if (cache == Cache::kOnWithHostTier) {
        ASSERT_EQ(e->Stats().host_tier_used_slots, 1);
      }
      if (reset) {
        ASSERT_TRUE(e->ResetPrefixCache().ok());
        EXPECT_EQ(e->Stats().host_tier_used_slots, 0);
      }
      const int64_t hits_before = e->Stats().prefix_cache_hits;
      const auto again = RunWaves(*e, {{{prompt, Params(4, true)}}});
      EXPECT_EQ(e->Stats().prefix_cache_hits - hits_before, reset ? 0 : 16) << "reset " << reset;
      EXPECT_EQ(again[0], first[0]);
    }
  }
}

TEST(LlmEnginePrefixCacheTest, ResetRefusedWhileRequestsRun) {
  std::unique_ptr<LlmEngine> e = NewEngine(Cache::kOn);
  ASSERT_TRUE(e->AddRequest("r", Tokens(*e, "import os"), Params(4, true)).ok());
  EXPECT_EQ(e->ResetPrefixCache().code(), absl::StatusCode::kFailedPrecondition);
  RunToCompletion(*e);
  EXPECT_TRUE(e->ResetPrefixCache().ok());
}

}  // namespace
}  // namespace duet
