// The engine's host time per step: scheduling, batch building, block bookkeeping, the sampling
// rows, and the outputs (detokenization, stop checks), with an executor that does no model work
// and returns a token per sampled row at once. On a GPU whose steps run one at a time the device
// idles through this time between forward passes (docs/BENCHMARKS.md: 0.28-0.48 ms a step,
// 2.5-4%, for the cluster's workload on an H100); async scheduling runs it while the device
// computes the launched step, as long as it stays below a step's device time.
//
//   build/bin/engine_host_overhead [--model DIR] [--requests 1024] [--prompt-len 512] [--gen-len 128]
//       [--max-num-seqs 64] [--max-num-batched-tokens 1024] [--max-num-mixed-tokens 384] [--repeat 3]
//
// --model gives the config (vocabulary, layers) and the tokenizer; defaults to the bundled
// tiny-code-llama. Requests are random prompts with ignore_eos, as the cluster benchmark's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/sample_stats.h"
#include "common/status_macros.h"
#include "engine/llm_engine.h"
#include "model/model_config.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

// A KV cache with no memory: the executor below never reads or writes it.
class NoKvCache : public KvCache {
 public:
  explicit NoKvCache(const KvCacheShape& shape) : KvCache(shape) {}
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  void* key_pool(int64_t) override { return nullptr; }
  void* value_pool(int64_t) override { return nullptr; }
  void CopyBlocks(const std::vector<BlockCopy>&) override {}
  absl::Status CopyBlocksToHost(int64_t, int64_t, absl::Span<const BlockCopy>, const HostKvBlocks&) override {
    return absl::UnimplementedError("no KV memory");
  }
  absl::Status CopyBlocksFromHost(int64_t, int64_t, absl::Span<const BlockCopy>, const HostKvBlocks&) override {
    return absl::UnimplementedError("no KV memory");
  }
};

// Samples on "the device" instantly: a pseudo-random token per row, no logits.
class NoWorkExecutor : public ModelExecutor {
 public:
  explicit NoWorkExecutor(ModelConfig config) : config_(std::move(config)) {}
  const ModelConfig& config() const override { return config_; }
  KvDtype kv_dtype() const override { return KvDtype::kFloat32; }
  absl::StatusOr<std::unique_ptr<KvCache>> CreateKvCache(int64_t num_blocks, int64_t block_size) override {
    return std::unique_ptr<KvCache>(std::make_unique<NoKvCache>(KvCacheShape{
        config_.num_layers, num_blocks, config_.num_kv_heads, block_size, config_.head_dim, kv_dtype()}));
  }
  absl::Status Forward(absl::Span<const SequenceChunk> chunks, KvCache&, std::vector<float>& logits,
                       const LayerDoneCallback&) override {
    int64_t rows = 0;
    for (const SequenceChunk& c : chunks) rows += c.num_logits;
    logits.assign(size_t(rows) * size_t(config_.vocab_size), 0.0f);
    return absl::OkStatus();
  }
  bool CanSampleOnDevice() const override { return true; }
  absl::Status ForwardSample(absl::Span<const SequenceChunk>, KvCache&, absl::Span<const DeviceSamplingRow> rows,
                             std::vector<DeviceSample>& samples, const LayerDoneCallback&,
                             const FillMasksCallback&) override {
    samples.resize(rows.size());
    for (DeviceSample& s : samples) s = DeviceSample{int32_t(3 + rng_() % uint64_t(config_.vocab_size - 3)), -1.0f};
    return absl::OkStatus();
  }

 private:
  ModelConfig config_;
  std::mt19937_64 rng_{7};
};

struct Round {
  double host_ms_per_step = 0;
  int64_t steps = 0;
};

absl::StatusOr<Round> RunRound(const EngineConfig& config, int requests, int prompt_len, int gen_len, uint32_t seed) {
  DUET_ASSIGN_OR_RETURN(ModelConfig model, LoadModelConfig(config.model_dir));
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine,
                        LlmEngine::Create(config, [&model](const EngineConfig&) -> absl::StatusOr<std::unique_ptr<ModelExecutor>> {
                          return std::unique_ptr<ModelExecutor>(std::make_unique<NoWorkExecutor>(model));
                        }));
  std::mt19937 rng(seed);
  int next = 0;
  auto add = [&]() -> absl::Status {
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
    for (int32_t& t : prompt) t = int32_t(3 + rng() % uint32_t(model.vocab_size - 3));
    SamplingParams p;
    p.temperature = 0.0f;
    p.max_tokens = gen_len;
    p.ignore_eos = true;
    return engine->AddRequest("r" + std::to_string(next++), std::move(prompt), p);
  };
  // A closed loop of max_num_seqs clients, as the cluster benchmark's 64 streams.
  for (int i = 0; i < std::min(requests, config.scheduler.max_num_seqs); ++i) DUET_RETURN_IF_ERROR(add());
  const auto start = Clock::now();
  int64_t steps = 0;
  while (engine->HasUnfinished()) {
    DUET_ASSIGN_OR_RETURN(std::vector<RequestOutput> outputs, engine->Step());
    ++steps;
    for (const RequestOutput& out : outputs) {
      if (!out.finished) continue;
      engine->Release(out.id);  // as a worker's engine loop does
      if (next < requests) DUET_RETURN_IF_ERROR(add());
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return Round{1e3 * seconds / double(steps), steps};
}

int Run(int argc, char** argv) {
  CLI::App app{"the engine's host time per step, with an executor that does no model work"};
  EngineConfig config;
  config.model_dir = std::string(DUET_MODELS_DIR) + "/tiny-code-llama";
  config.scheduler.max_num_seqs = 64;
  config.scheduler.max_num_batched_tokens = 1024;
  config.scheduler.max_num_mixed_tokens = 384;
  config.scheduler.max_model_len = 4096;
  config.kv_cache_bytes = int64_t(64) << 30;  // blocks enough for every sequence (the cache holds no memory)
  config.enable_prefix_caching = true;        // as the CLI's default: full blocks are hashed as they fill
  int requests = 1024, prompt_len = 512, gen_len = 128, repeat = 3;
  app.add_option("--model", config.model_dir, "model directory: its config and tokenizer");
  app.add_option("--requests", requests, "requests in all")->check(CLI::PositiveNumber);
  app.add_option("--prompt-len", prompt_len, "prompt tokens per request")->check(CLI::PositiveNumber);
  app.add_option("--gen-len", gen_len, "generated tokens per request")->check(CLI::PositiveNumber);
  app.add_option("--max-num-seqs", config.scheduler.max_num_seqs, "requests running at once (the closed loop's clients)");
  app.add_option("--max-num-batched-tokens", config.scheduler.max_num_batched_tokens, "tokens per step");
  app.add_option("--max-num-mixed-tokens", config.scheduler.max_num_mixed_tokens, "tokens per step with decode rows");
  app.add_option("--repeat", repeat, "rounds")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  std::vector<double> ms;
  int64_t steps = 0;
  for (int r = 0; r < repeat; ++r) {
    absl::StatusOr<Round> round = RunRound(config, requests, prompt_len, gen_len, uint32_t(1 + r));
    if (!round.ok()) {
      std::fprintf(stderr, "%s\n", round.status().ToString().c_str());
      return 1;
    }
    ms.push_back(round->host_ms_per_step);
    steps = round->steps;
  }
  const bench::SampleStats s = bench::Summarize(ms);
  std::printf("%d requests of %d + %d tokens, %d at a time, budget %d / mixed %d: %lld steps, host time %.3f ms a step "
              "(median of %d rounds, %.3f-%.3f)\n",
              requests, prompt_len, gen_len, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
              config.scheduler.max_num_mixed_tokens, (long long)steps, s.median, repeat, s.min, s.max);
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) { return duet::Run(argc, argv); }
