#include "parallel/ring_schedule.h"

#include <map>
#include <utility>

#include <gtest/gtest.h>

namespace duet::parallel {
namespace {

// Replays the schedule: every call's (query position, key position) pairs, by the kernel's rule
// (query i sees keys [0, min(context_len - q_len + i, kv_len - 1)] of the block its rank holds),
// mapped back to prompt positions through the rows of the block's owner.
std::map<std::pair<int64_t, int64_t>, int> AttendedPairs(const RingAttentionSchedule& s) {
  const std::vector<int64_t> positions = s.RowPositions();
  std::map<std::pair<int64_t, int64_t>, int> pairs;
  for (int step = 0; step < s.size; ++step) {
    for (const RingAttentionCall& call : s.steps[step]) {
      EXPECT_EQ(call.source, s.SourceOf(call.rank, step));
      const int64_t block_rows = s.rank_rows[call.source + 1] - s.rank_rows[call.source];
      EXPECT_LE(call.kv_len, block_rows);
      for (int64_t i = 0; i < call.q_len; ++i) {
        const int64_t last = std::min(call.context_len - call.q_len + i, call.kv_len - 1);
        for (int64_t j = 0; j <= last; ++j) {
          ++pairs[{positions[call.q_row + i], positions[s.rank_rows[call.source] + j]}];
        }
      }
    }
  }
  return pairs;
}

class RingScheduleTest : public ::testing::TestWithParam<std::pair<int64_t, int>> {};

TEST_P(RingScheduleTest, AttendsEveryCausalPairExactlyOnce) {
  const auto [num_tokens, size] = GetParam();
  const RingAttentionSchedule s = PlanRingAttention(num_tokens, size);
  ASSERT_EQ(s.rank_rows.back(), num_tokens);
  const std::map<std::pair<int64_t, int64_t>, int> pairs = AttendedPairs(s);
  EXPECT_EQ(int64_t(pairs.size()), num_tokens * (num_tokens + 1) / 2);
  for (const auto& [pair, count] : pairs) {
    EXPECT_LE(pair.second, pair.first) << "query " << pair.first << " saw a later key " << pair.second;
    EXPECT_EQ(count, 1) << "query " << pair.first << ", key " << pair.second;
  }
}

// Sizes that divide evenly, uneven chunks (the first chunks one longer) and the fewest tokens.
INSTANTIATE_TEST_SUITE_P(Sizes, RingScheduleTest,
                         ::testing::Values(std::pair<int64_t, int>{16, 1}, std::pair<int64_t, int>{16, 2},
                                           std::pair<int64_t, int>{37, 2}, std::pair<int64_t, int>{6, 3},
                                           std::pair<int64_t, int>{101, 3}, std::pair<int64_t, int>{64, 4},
                                           std::pair<int64_t, int>{131, 4}, std::pair<int64_t, int>{16, 8},
                                           std::pair<int64_t, int>{250, 8}));

TEST(RingScheduleTest, CallsOfAStepTouchDisjointRows) {
  const RingAttentionSchedule s = PlanRingAttention(203, 4);
  for (const std::vector<RingAttentionCall>& calls : s.steps) {
    std::vector<int> touched(203, 0);
    for (const RingAttentionCall& call : calls) {
      for (int64_t r = call.q_row; r < call.q_row + call.q_len; ++r) ++touched[r];
    }
    for (int count : touched) EXPECT_LE(count, 1);
  }
}

TEST(RingScheduleTest, RowsAreTheZigzagOrder) {
  const RingAttentionSchedule s = PlanRingAttention(8, 2);
  EXPECT_EQ(s.RowPositions(), (std::vector<int64_t>{0, 1, 6, 7, 2, 3, 4, 5}));
  EXPECT_EQ(s.rank_rows, (std::vector<int64_t>{0, 4, 8}));
}

}  // namespace
}  // namespace duet::parallel
