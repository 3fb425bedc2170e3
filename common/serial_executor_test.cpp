#include "common/serial_executor.h"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(SerialExecutorTest, RunsClosuresInPostOrderOnItsOwnThread) {
  std::vector<int> order;  // touched by the executor's thread only, until it stops
  std::atomic<bool> on_caller_thread{false};
  const std::thread::id caller = std::this_thread::get_id();
  {
    SerialExecutor executor;
    // Two posting threads: each one's closures keep their order.
    std::thread other([&] {
      for (int i = 0; i < 500; ++i) executor.Post([&order, i] { order.push_back(1000 + i); });
    });
    for (int i = 0; i < 500; ++i) {
      executor.Post([&, i] {
        if (std::this_thread::get_id() == caller) on_caller_thread = true;
        order.push_back(i);
      });
    }
    other.join();
  }  // the destructor runs everything posted before it
  ASSERT_EQ(order.size(), 1000u);
  int next_mine = 0, next_other = 1000;
  for (int v : order) {
    if (v < 1000) {
      EXPECT_EQ(v, next_mine++);
    } else {
      EXPECT_EQ(v, next_other++);
    }
  }
  EXPECT_FALSE(on_caller_thread);
}

TEST(SerialExecutorTest, AClosureMayPostAndWaitersWakeAfterIdle) {
  SerialExecutor executor;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  auto finish = [&] {
    std::lock_guard<std::mutex> lock(mu);
    ++done;
    cv.notify_all();
  };
  for (int round = 1; round <= 3; ++round) {  // each round posts after the thread went idle
    executor.Post([&] { executor.Post(finish); });
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == round; });
  }
  EXPECT_EQ(done, 3);
}

}  // namespace
}  // namespace duet
