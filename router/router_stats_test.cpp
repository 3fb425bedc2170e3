#include "router/router.h"

#include "gtest/gtest.h"

namespace duet::router {
namespace {

TEST(RouterIntervalStats, FinishedTokensOverTheIntervalRequestsAtItsEnd) {
  const RouterTotals before{.prompt_tokens = 100, .generation_tokens = 40, .in_flight = 3, .waiting = 1};
  const RouterTotals now{.prompt_tokens = 600, .generation_tokens = 1040, .in_flight = 10, .waiting = 4};
  const IntervalStats s = RouterIntervalStats(before, now, 5.0);
  EXPECT_EQ(s.prompt_tokens, 500);
  EXPECT_EQ(s.generation_tokens, 1000);
  EXPECT_EQ(s.running, 6);
  EXPECT_EQ(s.waiting, 4);
  EXPECT_FALSE(s.kv_cache_usage.has_value());  // the router holds no KV
  EXPECT_EQ(FormatStatsLine(s),
            "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 200.0 tokens/s, Running: 6 reqs, "
            "Waiting: 4 reqs");
  // The gauge and the count are read one after the other: never a negative number running.
  EXPECT_EQ(RouterIntervalStats(now, {.in_flight = 1, .waiting = 2}, 1.0).running, 0);
}

}  // namespace
}  // namespace duet::router
