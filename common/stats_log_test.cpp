#include "common/stats_log.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>

#include "common/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

using ::testing::HasSubstr;

TEST(FormatStatsLine, VllmsFieldsAndRatesOverTheInterval) {
  IntervalStats s{.seconds = 10, .prompt_tokens = 1234, .generation_tokens = 4567, .running = 12, .waiting = 3};
  EXPECT_EQ(FormatStatsLine(s),
            "Avg prompt throughput: 123.4 tokens/s, Avg generation throughput: 456.7 tokens/s, Running: 12 reqs, "
            "Waiting: 3 reqs");
  s.kv_cache_usage = 0.375;
  s.kv_cache_device = "GPU";
  s.prefix_cache_hit_rate = 0.612;
  EXPECT_THAT(FormatStatsLine(s), ::testing::EndsWith(", Waiting: 3 reqs, GPU KV cache usage: 37.5%, Prefix cache hit "
                                                     "rate: 61.2%"));
  EXPECT_FALSE(s.idle());
  // An engine's steps: their rate, mean wall time and mean forward time over the interval.
  s.steps = 1042;
  s.step_seconds = 10.003;
  s.forward_seconds = 9.27;
  EXPECT_THAT(FormatStatsLine(s), ::testing::EndsWith("rate: 61.2%, Steps: 104.2/s, 9.60 ms each, forward 8.90 ms"));
  // An engine loop's host time between them, per step.
  s.delivery_seconds = 0.521;
  s.posted_seconds = 0.0521;
  EXPECT_THAT(FormatStatsLine(s),
              ::testing::EndsWith("forward 8.90 ms, between steps: delivery 0.50 ms, posted work 0.05 ms"));
  // Late scheduling's steps, and those launched late.
  s.late_scheduled_steps = 1000;
  s.late_launches = 3;
  EXPECT_THAT(FormatStatsLine(s), ::testing::EndsWith("posted work 0.05 ms, planned late: 1000 steps, 3 launched late"));
  // No time has passed: no rates (rather than infinities).
  EXPECT_THAT(FormatStatsLine({.seconds = 0, .prompt_tokens = 5}), HasSubstr("Avg prompt throughput: 0.0 tokens/s"));
  EXPECT_TRUE(IntervalStats{.running = 2}.idle());
}

class PeriodicStatsLoggerTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = MinLogLevel(); }
  void TearDown() override { SetMinLogLevel(saved_); }

  // Runs a logger until it has sampled `samples` times, each sample `busy` or idle; returns
  // what it logged at INFO and the number of samples it took (at least `samples`).
  std::pair<std::string, int> Run(int samples, bool busy) {
    SetMinLogLevel(LogLevel::kInfo);
    std::mutex mu;
    std::condition_variable sampled;
    int taken = 0;
    testing::internal::CaptureStderr();
    {
      PeriodicStatsLogger logger("test role", std::chrono::milliseconds(1), [&](double seconds) {
        EXPECT_GE(seconds, 0.001);
        std::lock_guard lock(mu);
        ++taken;
        sampled.notify_all();
        return IntervalStats{.seconds = seconds, .generation_tokens = busy ? 7 : 0, .running = 1};
      });
      std::unique_lock lock(mu);
      sampled.wait(lock, [&] { return taken >= samples; });
    }  // every sample taken has been logged when the logger is gone
    return {testing::internal::GetCapturedStderr(), taken};
  }

  LogLevel saved_ = LogLevel::kInfo;
};

TEST_F(PeriodicStatsLoggerTest, ALineEveryIntervalWithTheLabel) {
  const auto [log, taken] = Run(3, /*busy=*/true);
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), taken) << log;
  EXPECT_THAT(log, HasSubstr("] test role: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "));
  EXPECT_THAT(log, HasSubstr(" tokens/s, Running: 1 reqs, Waiting: 0 reqs\n"));
}

// As vLLM: idle after idle goes to DEBUG, so only the first idle interval shows at INFO.
TEST_F(PeriodicStatsLoggerTest, AnIdleServerLogsOnce) {
  const auto [log, taken] = Run(3, /*busy=*/false);
  EXPECT_GE(taken, 3);
  EXPECT_EQ(std::count(log.begin(), log.end(), '\n'), 1) << log;
}

// The thread waits on a condition, not a sleep: it stops at once, however long the interval.
TEST_F(PeriodicStatsLoggerTest, StopsWithoutWaitingForTheInterval) {
  bool sampled = false;
  { PeriodicStatsLogger logger("idle", std::chrono::hours(1), [&](double) { sampled = true; return IntervalStats(); }); }
  EXPECT_FALSE(sampled);
}

}  // namespace
}  // namespace duet
