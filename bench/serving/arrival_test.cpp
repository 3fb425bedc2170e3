#include "bench/serving/arrival.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace duet::bench {
namespace {

struct GapStats {
  double mean = 0, cv = 0;
};

GapStats Gaps(const std::vector<double>& schedule) {
  std::vector<double> gaps;
  for (size_t i = 1; i < schedule.size(); ++i) gaps.push_back(schedule[i] - schedule[i - 1]);
  double sum = 0, squares = 0;
  for (double g : gaps) sum += g;
  const double mean = sum / double(gaps.size());
  for (double g : gaps) squares += (g - mean) * (g - mean);
  return {mean, std::sqrt(squares / double(gaps.size())) / mean};
}

TEST(ArrivalSchedule, PoissonHasTheRateAndUnitVariation) {
  // 20,000 exponential gaps: the sample mean's standard error is 0.7%, the CV's about 1%.
  auto schedule = ArrivalSchedule(20001, {.request_rate = 20, .burstiness = 1, .seed = 7});
  ASSERT_TRUE(schedule.ok());
  EXPECT_EQ(schedule->front(), 0.0);
  EXPECT_TRUE(std::is_sorted(schedule->begin(), schedule->end()));
  const GapStats s = Gaps(*schedule);
  EXPECT_NEAR(s.mean, 1.0 / 20, 0.03 / 20);
  EXPECT_NEAR(s.cv, 1.0, 0.04);
  EXPECT_NEAR(20000 / schedule->back(), 20, 0.6);  // the empirical rate
}

TEST(ArrivalSchedule, GammaKeepsTheRateAndHasCvOfOneOverSqrtShape) {
  for (double burstiness : {0.25, 0.5, 4.0}) {
    auto schedule = ArrivalSchedule(50001, {.request_rate = 8, .burstiness = burstiness, .seed = 11});
    ASSERT_TRUE(schedule.ok());
    const GapStats s = Gaps(*schedule);
    // Gamma gaps: mean = shape·scale = 1/rate, CV = 1/sqrt(shape). Tolerances are several
    // standard errors at 50,000 samples (wider for small shapes, whose gaps are heavy-tailed).
    EXPECT_NEAR(s.mean, 1.0 / 8, 0.04 / 8) << burstiness;
    EXPECT_NEAR(s.cv, 1 / std::sqrt(burstiness), 0.06 / std::sqrt(burstiness)) << burstiness;
  }
}

TEST(ArrivalSchedule, InfiniteRateSendsEverythingAtOnce) {
  auto schedule = ArrivalSchedule(5, {});
  ASSERT_TRUE(schedule.ok());
  EXPECT_EQ(*schedule, std::vector<double>(5, 0.0));
}

TEST(ArrivalSchedule, SeededAndReproducible) {
  auto a = ArrivalSchedule(100, {.request_rate = 4, .burstiness = 1, .seed = 3});
  auto b = ArrivalSchedule(100, {.request_rate = 4, .burstiness = 1, .seed = 3});
  auto c = ArrivalSchedule(100, {.request_rate = 4, .burstiness = 1, .seed = 4});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
}

TEST(ArrivalSchedule, RejectsBadSettings) {
  EXPECT_FALSE(ArrivalSchedule(3, {.request_rate = 0}).ok());
  EXPECT_FALSE(ArrivalSchedule(3, {.request_rate = -1}).ok());
  EXPECT_FALSE(ArrivalSchedule(3, {.request_rate = NAN}).ok());
  EXPECT_FALSE(ArrivalSchedule(3, {.request_rate = 1, .burstiness = 0}).ok());
  EXPECT_FALSE(ArrivalSchedule(-1, {}).ok());
}

// A fake backend: each request finishes on its own thread after `work`.
class FakeSender {
 public:
  explicit FakeSender(std::chrono::milliseconds work) : work_(work), start_(std::chrono::steady_clock::now()) {}
  ~FakeSender() {
    for (std::thread& t : threads_) t.join();
  }
  void Send(int index, std::function<void()> done) {
    const int now = ++in_flight_;
    int seen = max_in_flight_.load();
    while (now > seen && !max_in_flight_.compare_exchange_weak(seen, now)) {}
    {
      std::lock_guard lock(mu_);
      send_times_.resize(std::max(send_times_.size(), size_t(index) + 1));
      send_times_[size_t(index)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      threads_.emplace_back([this, done = std::move(done)] {
        std::this_thread::sleep_for(work_);
        --in_flight_;
        done();
      });
    }
  }
  int max_in_flight() const { return max_in_flight_; }
  std::vector<double> send_times() {
    std::lock_guard lock(mu_);
    return send_times_;
  }

 private:
  std::chrono::milliseconds work_;
  std::chrono::steady_clock::time_point start_;
  std::atomic<int> in_flight_{0}, max_in_flight_{0};
  std::mutex mu_;
  std::vector<double> send_times_;
  std::vector<std::thread> threads_;
};

TEST(Dispatch, ClosedLoopKeepsTheCapInFlight) {
  FakeSender sender(std::chrono::milliseconds(20));
  Dispatch(std::vector<double>(12, 0.0), 3, [&](int i, std::function<void()> done) { sender.Send(i, std::move(done)); });
  EXPECT_EQ(sender.max_in_flight(), 3);
  EXPECT_EQ(sender.send_times().size(), 12u);
}

TEST(Dispatch, WithoutACapEverythingIsInFlightAtOnce) {
  FakeSender sender(std::chrono::milliseconds(100));
  Dispatch(std::vector<double>(8, 0.0), 0, [&](int i, std::function<void()> done) { sender.Send(i, std::move(done)); });
  EXPECT_EQ(sender.max_in_flight(), 8);
}

TEST(Dispatch, SendsNoEarlierThanTheSchedule) {
  const std::vector<double> schedule = {0, 0.02, 0.05, 0.06};
  FakeSender sender(std::chrono::milliseconds(1));
  Dispatch(schedule, 0, [&](int i, std::function<void()> done) { sender.Send(i, std::move(done)); });
  const std::vector<double> sent = sender.send_times();
  ASSERT_EQ(sent.size(), schedule.size());
  for (size_t i = 0; i < schedule.size(); ++i) EXPECT_GE(sent[i], schedule[i]) << i;
}

// Records each (session, turn) sent and checks that a session's turns never overlap and come in
// order; requests end on threads of their own after `work`, or inside Send when `work` is 0.
class FakeSessions {
 public:
  FakeSessions(int sessions, std::chrono::milliseconds work)
      : work_(work), next_turn_(size_t(sessions), 0), busy_(size_t(sessions), false),
        start_(std::chrono::steady_clock::now()) {}
  ~FakeSessions() {
    for (std::thread& t : threads_) t.join();
  }
  void Send(int session, int turn, std::function<void()> done) {
    {
      std::lock_guard lock(mu_);
      if (busy_[size_t(session)] || next_turn_[size_t(session)] != turn) ++violations_;
      busy_[size_t(session)] = true;
      first_send_.resize(std::max(first_send_.size(), size_t(session) + 1), -1);
      if (turn == 0) first_send_[size_t(session)] = Now();
      max_in_flight_ = std::max(max_in_flight_, ++in_flight_);
    }
    auto finish = [this, session, done = std::move(done)] {
      {
        std::lock_guard lock(mu_);
        busy_[size_t(session)] = false;
        ++next_turn_[size_t(session)];
        --in_flight_;
      }
      done();
    };
    if (work_.count() == 0) return finish();
    std::lock_guard lock(mu_);
    threads_.emplace_back([this, finish = std::move(finish)] {
      std::this_thread::sleep_for(work_);
      finish();
    });
  }
  double Now() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

  std::chrono::milliseconds work_;
  std::mutex mu_;
  std::vector<int> next_turn_;
  std::vector<bool> busy_;
  std::vector<double> first_send_;
  int in_flight_ = 0, max_in_flight_ = 0, violations_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::vector<std::thread> threads_;
};

TEST(DispatchSessions, EachSessionRunsItsTurnsInOrderOneAtATime) {
  for (int work_ms : {0, 5}) {
    FakeSessions fake(5, std::chrono::milliseconds(work_ms));
    DispatchSessions(std::vector<double>(5, 0.0), 4, 0,
                     [&](int s, int t, std::function<void()> done) { fake.Send(s, t, std::move(done)); });
    EXPECT_EQ(fake.violations_, 0) << work_ms;
    EXPECT_EQ(fake.next_turn_, std::vector<int>(5, 4)) << work_ms;  // every turn of every session, once
    EXPECT_LE(fake.max_in_flight_, 5) << work_ms;                  // at most one turn per session
  }
}

TEST(DispatchSessions, KeepsTheCapAndTheSessionStarts) {
  const std::vector<double> starts = {0, 0, 0.02, 0.04};
  FakeSessions fake(4, std::chrono::milliseconds(2));
  DispatchSessions(starts, 3, 2, [&](int s, int t, std::function<void()> done) { fake.Send(s, t, std::move(done)); });
  EXPECT_EQ(fake.violations_, 0);
  EXPECT_EQ(fake.next_turn_, std::vector<int>(4, 3));
  EXPECT_LE(fake.max_in_flight_, 2);
  for (size_t s = 0; s < starts.size(); ++s) EXPECT_GE(fake.first_send_[s], starts[s]) << s;
}

}  // namespace
}  // namespace duet::bench
