#include "engine/engine_loop.h"

#include <condition_variable>
#include <mutex>
#include <string>
#include <vector>

#include "backends/executor_factory.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";

// A request added through the loop streams its tokens to its subscriber in order, the last
// output finishing it; the loop's stats count the host time it spent between steps delivering
// them and running the posted work.
TEST(EngineLoopTest, DeliversOutputsAndCountsTheTimeBetweenSteps) {
  EngineConfig config;
  config.model_dir = kModel;
  config.num_kv_blocks = 64;
  absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(config);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EngineLoop loop(std::move(*engine));

  std::mutex mu;
  std::condition_variable done;
  std::vector<int32_t> tokens;
  bool finished = false;
  SamplingParams params;
  params.max_tokens = 8;
  params.ignore_eos = true;
  const absl::Status added = loop.Call([&](LlmEngine& e) {
    absl::Status s = e.AddRequest("r", e.tokenizer().Encode("def main():\n"), params);
    if (s.ok()) {
      loop.Subscribe("r", [&](const RequestOutput& out) {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_FALSE(finished);  // nothing after the finishing output
        tokens.insert(tokens.end(), out.new_token_ids.begin(), out.new_token_ids.end());
        finished = out.finished;
        done.notify_all();
      });
    }
    return s;
  });
  ASSERT_TRUE(added.ok()) << added;
  {
    std::unique_lock<std::mutex> lock(mu);
    done.wait(lock, [&] { return finished; });
  }
  EXPECT_EQ(tokens.size(), 8u);
  // The loop publishes its stats at the end of the iteration that delivered the last output,
  // before it runs the next posted closure.
  loop.Call([](LlmEngine&) {});
  const EngineStats stats = loop.Stats();
  EXPECT_GE(stats.num_steps, 8);
  EXPECT_GT(stats.delivery_seconds, 0);
  EXPECT_GT(stats.posted_seconds, 0);
  EXPECT_LT(stats.delivery_seconds + stats.posted_seconds, stats.step_seconds + 1.0);
}

}  // namespace
}  // namespace duet
