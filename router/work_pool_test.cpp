#include "router/work_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>

namespace duet::router {
namespace {

TEST(WorkPoolTest, RunsTasksAndRefusesBeyondItsQueue) {
  WorkPool pool(/*num_threads=*/1, /*max_queued=*/2);
  std::promise<void> started, release;
  std::shared_future<void> released = release.get_future().share();
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.set_value();
    released.wait();
  }));
  started.get_future().wait();  // the only thread is busy: what follows waits in the queue
  std::atomic<int> ran{0};
  EXPECT_TRUE(pool.TrySubmit([&] { ran++; }));
  EXPECT_TRUE(pool.TrySubmit([&] { ran++; }));
  EXPECT_EQ(pool.num_queued(), 2u);
  EXPECT_FALSE(pool.TrySubmit([&] { ran += 100; }));  // full
  release.set_value();
  pool.Stop();  // runs what was queued
  EXPECT_EQ(ran.load(), 2);
  EXPECT_FALSE(pool.TrySubmit([] {}));
}

}  // namespace
}  // namespace duet::router
