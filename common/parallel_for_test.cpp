#include "common/parallel_for.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace duet {
namespace {

TEST(ParallelForTest, RunsEveryPartOnceEveryCall) {
  ParallelFor pool(4);
  ASSERT_EQ(pool.num_threads(), 4);
  std::vector<std::atomic<int>> runs(4);
  for (int call = 0; call < 1000; ++call) {
    pool.Run([&](int part) { runs[size_t(part)].fetch_add(1); });
  }
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1000);
}

TEST(ParallelForTest, WorkersWakeAfterSleeping) {
  ParallelFor pool(2);
  std::atomic<int> sum{0};
  for (int call = 0; call < 3; ++call) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past the workers' spin
    pool.Run([&](int part) { sum.fetch_add(part + 1); });
  }
  EXPECT_EQ(sum.load(), 3 * (1 + 2));
}

TEST(ParallelForTest, ConcurrentCallersEachRunEveryPart) {
  ParallelFor pool(3);
  std::atomic<int> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int call = 0; call < 200; ++call) pool.Run([&](int) { total.fetch_add(1); });
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 200 * 3);
}

TEST(ParallelForTest, OneThreadRunsInTheCaller) {
  ParallelFor pool(1);
  const std::thread::id caller = std::this_thread::get_id();
  bool ran = false;
  pool.Run([&](int part) {
    EXPECT_EQ(part, 0);
    EXPECT_EQ(std::this_thread::get_id(), caller);
    ran = true;
  });
  EXPECT_TRUE(ran);
}

}  // namespace
}  // namespace duet
