#include "worker/engine_stats_log.h"

#include "backends/executor_factory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

using ::testing::HasSubstr;

TEST(EngineIntervalStats, TokensAndLookupsInTheIntervalStateAtItsEnd) {
  EngineStats before, now;
  before.num_prompt_tokens = 1000;
  before.num_generation_tokens = 50;
  before.prefix_cache_queries = 400;
  before.prefix_cache_hits = 100;
  now.num_prompt_tokens = 3000;
  now.num_generation_tokens = 550;
  now.prefix_cache_queries = 1200;
  now.prefix_cache_hits = 700;
  now.num_running = 5;
  now.num_waiting = 2;
  now.num_kv_blocks = 200;
  now.num_free_kv_blocks = 150;
  const IntervalStats s = EngineIntervalStats(before, now, 4.0, {.kv_cache_device = "GPU", .prefix_caching = true});
  EXPECT_EQ(s.prompt_tokens, 2000);
  EXPECT_EQ(s.generation_tokens, 500);
  EXPECT_EQ(s.running, 5);
  EXPECT_EQ(s.waiting, 2);
  EXPECT_DOUBLE_EQ(*s.kv_cache_usage, 0.25);
  EXPECT_DOUBLE_EQ(*s.prefix_cache_hit_rate, 0.75);  // 600 of 800 looked up in the interval
  EXPECT_EQ(FormatStatsLine(s),
            "Avg prompt throughput: 500.0 tokens/s, Avg generation throughput: 125.0 tokens/s, Running: 5 reqs, "
            "Waiting: 2 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 75.0%");
  // Steps in the interval: their count and times, from the counters' differences.
  before.num_steps = 100;
  before.step_seconds = 1.0;
  before.forward_seconds = 0.9;
  now.num_steps = 500;
  now.step_seconds = 5.0;
  now.forward_seconds = 4.1;
  const IntervalStats steps = EngineIntervalStats(before, now, 4.0, {});
  EXPECT_EQ(steps.steps, 400);
  EXPECT_DOUBLE_EQ(steps.step_seconds, 4.0);
  EXPECT_NEAR(steps.forward_seconds, 3.2, 1e-9);
  EXPECT_THAT(FormatStatsLine(steps), ::testing::EndsWith(", Steps: 100.0/s, 10.00 ms each, forward 8.00 ms"));
  // An engine loop's time between the steps, from its counters' differences too.
  now.delivery_seconds = 0.5;
  now.posted_seconds = 0.02;
  before.delivery_seconds = 0.1;
  EXPECT_THAT(FormatStatsLine(EngineIntervalStats(before, now, 4.0, {})),
              ::testing::EndsWith("forward 8.00 ms, between steps: delivery 1.00 ms, posted work 0.05 ms"));
  // Late scheduling's counts in the interval.
  before.num_late_scheduled_steps = 10;
  now.num_late_scheduled_steps = 410;
  now.num_late_launches = 2;
  const IntervalStats late = EngineIntervalStats(before, now, 4.0, {});
  EXPECT_EQ(late.late_scheduled_steps, 400);
  EXPECT_EQ(late.late_launches, 2);
  // No lookups in the interval: 0%; prefix caching off: no hit rate at all.
  EXPECT_EQ(*EngineIntervalStats(now, now, 1.0, {.prefix_caching = true}).prefix_cache_hit_rate, 0.0);
  EXPECT_FALSE(EngineIntervalStats(before, now, 1.0, {}).prefix_cache_hit_rate.has_value());
}

TEST(EngineStatsSample, EachCallTheIntervalSinceThePreviousOne) {
  EngineStats stats;
  PeriodicStatsLogger::Sample sample = EngineStatsSample([&] { return stats; }, {});
  stats.num_generation_tokens = 30;
  EXPECT_EQ(sample(1.0).generation_tokens, 30);
  stats.num_generation_tokens = 45;
  EXPECT_EQ(sample(1.0).generation_tokens, 15);
  EXPECT_EQ(sample(1.0).generation_tokens, 0);
}

// The bundled model with 64 blocks of 16 tokens and a 256-token context: 16 blocks a request,
// so the cache holds 4 such requests at once.
TEST(EngineConfigSummary, ModelKvCapacityAndConcurrency) {
  EngineConfig config;
  config.model_dir = DUET_MODELS_DIR "/tiny-code-llama";
  config.num_kv_blocks = 64;
  config.scheduler.max_model_len = 256;
  absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::string summary = EngineConfigSummary(**engine);
  EXPECT_THAT(summary, HasSubstr("model tiny-code-llama (LlamaForCausalLM), backend cpu, dtype float32, block size 16, "
                                 "64 KV blocks (1024 tokens, "));
  EXPECT_THAT(summary, HasSubstr(" MiB), max model len 256: max concurrency 4.00x, prefix caching off"));
  EXPECT_EQ(EngineStatsLabelsOf(**engine).kv_cache_device, "CPU");
}

}  // namespace
}  // namespace duet
