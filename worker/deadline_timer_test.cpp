#include "worker/deadline_timer.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(DeadlineTimerTest, RunsACallbackAtItsDeadlineNotBefore) {
  DeadlineTimer timer;
  absl::Notification ran;
  absl::Time ran_at;
  const absl::Time deadline = absl::Now() + absl::Milliseconds(80);
  timer.Schedule(deadline, [&] {
    ran_at = absl::Now();
    ran.Notify();
  });
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_GE(ran_at, deadline);
  EXPECT_EQ(timer.pending(), 0u);
}

// The thread sleeping towards a far deadline wakes for an earlier one scheduled later.
TEST(DeadlineTimerTest, AnEarlierDeadlineScheduledLaterRunsFirst) {
  DeadlineTimer timer;
  std::vector<int> order;
  absl::Mutex mu;
  absl::Notification near_ran;
  timer.Schedule(absl::Now() + absl::Hours(1), [&] {
    absl::MutexLock lock(&mu);
    order.push_back(2);
  });
  const absl::Time start = absl::Now();
  timer.Schedule(start + absl::Milliseconds(20), [&] {
    {
      absl::MutexLock lock(&mu);
      order.push_back(1);
    }
    near_ran.Notify();
  });
  ASSERT_TRUE(near_ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_LT(absl::Now() - start, absl::Minutes(1));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, std::vector<int>{1});
  EXPECT_EQ(timer.pending(), 1u);  // the far one is dropped with the timer
}

TEST(DeadlineTimerTest, ACancelledCallbackNeverRuns) {
  DeadlineTimer timer;
  std::atomic<bool> cancelled_ran{false};
  absl::Notification later_ran;
  const DeadlineTimer::Id id = timer.Schedule(absl::Now() + absl::Milliseconds(30), [&] { cancelled_ran = true; });
  EXPECT_TRUE(timer.Cancel(id));
  EXPECT_FALSE(timer.Cancel(id));
  timer.Schedule(absl::Now() + absl::Milliseconds(60), [&] { later_ran.Notify(); });
  ASSERT_TRUE(later_ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_FALSE(cancelled_ran);
}

TEST(DeadlineTimerTest, AfterStopNothingRuns) {
  DeadlineTimer timer;
  std::atomic<int> ran{0};
  timer.Schedule(absl::Now() + absl::Milliseconds(20), [&] { ++ran; });
  timer.Stop();
  timer.Schedule(absl::Now(), [&] { ++ran; });
  EXPECT_EQ(timer.pending(), 0u);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(ran, 0);
}

}  // namespace
}  // namespace duet
