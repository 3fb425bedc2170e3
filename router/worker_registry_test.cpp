#include "router/worker_registry.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "router/fake_workers.h"

namespace duet::router {
namespace {

using testing::FakeDecodeWorker;
using testing::FakePrefillWorker;
using testing::FakeServer;

bool WaitFor(const std::function<bool()>& condition, int timeout_ms = 5000) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

RegistryOptions FastOptions() {
  RegistryOptions options;
  options.poll_interval = absl::Milliseconds(50);
  options.poll_timeout = absl::Milliseconds(300);
  options.max_reconnect_backoff = absl::Milliseconds(200);
  options.log_state_changes = false;
  return options;
}

TEST(WorkerRegistryTest, UpAfterStartWithStats) {
  FakePrefillWorker prefill;
  FakeDecodeWorker decode;
  decode.free_blocks = 42;
  FakeServer prefill_server(&prefill);
  FakeServer decode_server(&decode);
  WorkerRegistry registry({prefill_server.address()}, {decode_server.address()}, FastOptions());
  registry.Start();
  EXPECT_TRUE(registry.prefill_workers()[0]->up());
  EXPECT_TRUE(registry.decode_workers()[0]->up());
  EXPECT_EQ(registry.NumUp(WorkerRole::kPrefill), 1);
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 1);
  std::optional<v1::WorkerStats> stats = registry.decode_workers()[0]->stats();
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->num_free_kv_blocks(), 42);
  EXPECT_EQ(stats->role(), "decode");
  // Stats refresh on later polls.
  decode.free_blocks = 17;
  EXPECT_TRUE(WaitFor([&] { return registry.decode_workers()[0]->stats()->num_free_kv_blocks() == 17; }));
}

TEST(WorkerRegistryTest, NobodyListeningIsDown) {
  int port = 0;
  {
    FakeDecodeWorker decode;
    FakeServer server(&decode);
    port = server.port();
  }
  WorkerRegistry registry({}, {"127.0.0.1:" + std::to_string(port)}, FastOptions());
  registry.Start();
  EXPECT_FALSE(registry.decode_workers()[0]->up());
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 0);
}

TEST(WorkerRegistryTest, GoesDownWhenStoppedAndUpWhenBack) {
  auto decode = std::make_unique<FakeDecodeWorker>();
  auto server = std::make_unique<FakeServer>(decode.get());
  const int port = server->port();
  WorkerRegistry registry({}, {server->address()}, FastOptions());
  registry.Start();
  Worker* worker = registry.decode_workers()[0];
  ASSERT_TRUE(worker->up());

  server.reset();
  EXPECT_TRUE(WaitFor([&] { return !worker->up(); }, 3000));

  auto decode2 = std::make_unique<FakeDecodeWorker>();
  server = std::make_unique<FakeServer>(decode2.get(), port);
  EXPECT_TRUE(WaitFor([&] { return worker->up(); }, 5000));
}

TEST(WorkerRegistryTest, MarkDownUntilItAnswersAgain) {
  FakePrefillWorker prefill;
  FakeServer server(&prefill);
  WorkerRegistry registry({server.address()}, {}, FastOptions());
  registry.Start();
  Worker* worker = registry.prefill_workers()[0];
  ASSERT_TRUE(worker->up());
  registry.MarkDown(worker, "test");
  EXPECT_FALSE(worker->up());
  EXPECT_TRUE(WaitFor([&] { return worker->up(); }, 3000));  // it still answers GetStats
}

// WhenGone: run once by a poll that is refused, not by polls that time out (a stalled worker).
TEST(WorkerRegistryTest, WhenGoneRunsOnceAPollIsRefused) {
  FakePrefillWorker prefill;
  FakeServer server(&prefill);
  WorkerRegistry registry({server.address()}, {}, FastOptions());
  registry.Start();
  Worker* worker = registry.prefill_workers()[0];
  prefill.stats_delay_ms = 1000;  // past poll_timeout: stalled
  std::atomic<int> runs{0};
  registry.WhenGone(worker, absl::Now() + absl::Seconds(30), [&] { ++runs; });
  EXPECT_TRUE(WaitFor([&] { return !worker->up(); }, 3000));
  EXPECT_EQ(runs.load(), 0);
  prefill.gone = true;  // every call refused, GetStats too
  EXPECT_TRUE(WaitFor([&] { return runs.load() == 1; }, 3000));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // several polls more
  EXPECT_EQ(runs.load(), 1);
}

// A process restarted at the worker's address (another instance id) answers: the one the WhenGone
// was registered for is gone. A ConfirmDown probe answered by it says so too.
TEST(WorkerRegistryTest, WhenGoneRunsWhenAnotherProcessAnswers) {
  FakePrefillWorker prefill;
  FakeServer server(&prefill);
  RegistryOptions options = FastOptions();
  options.poll_interval = absl::Seconds(30);  // polls only where the test makes them
  WorkerRegistry registry({server.address()}, {}, options);
  registry.Start();
  Worker* worker = registry.prefill_workers()[0];
  std::atomic<int> runs{0};
  registry.WhenGone(worker, absl::Now() + absl::Seconds(30), [&] { ++runs; });
  registry.PollOnce();  // answered by the same process: forgotten
  EXPECT_EQ(runs.load(), 0);
  registry.WhenGone(worker, absl::Now() + absl::Seconds(30), [&] { ++runs; });
  prefill.instance = 2;
  registry.PollOnce();
  EXPECT_EQ(runs.load(), 1);
  EXPECT_TRUE(worker->up());
  // The probe: answered by the same process, then by another one.
  auto probe = [&] {
    std::promise<WorkerRegistry::Probe> result;
    registry.ConfirmDown(worker, "test", [&](WorkerRegistry::Probe p) { result.set_value(p); });
    return result.get_future().get();
  };
  EXPECT_EQ(probe(), WorkerRegistry::Probe::kAnswered);
  prefill.instance = 3;
  EXPECT_EQ(probe(), WorkerRegistry::Probe::kGone);
  EXPECT_EQ(probe(), WorkerRegistry::Probe::kAnswered);
}

// WhenGone is forgotten once the worker answers (it was not gone), or past its deadline, and when
// the registry stops; what it holds goes with it.
TEST(WorkerRegistryTest, WhenGoneIsForgottenOnAnAnswerPastItsDeadlineAndOnStop) {
  FakePrefillWorker prefill;
  FakeServer server(&prefill);
  WorkerRegistry registry({server.address()}, {}, FastOptions());
  registry.Start();
  Worker* worker = registry.prefill_workers()[0];
  std::atomic<int> runs{0};
  auto held = std::make_shared<int>(0);
  registry.WhenGone(worker, absl::Now() + absl::Seconds(30), [&, held] { ++runs; });
  EXPECT_TRUE(WaitFor([&] { return held.use_count() == 1; }, 3000));  // answered: forgotten
  prefill.stats_delay_ms = 1000;
  registry.WhenGone(worker, absl::Now() + absl::Milliseconds(100), [&, held] { ++runs; });
  EXPECT_TRUE(WaitFor([&] { return held.use_count() == 1; }, 3000));  // timed out past its deadline
  registry.WhenGone(worker, absl::Now() + absl::Seconds(30), [&, held] { ++runs; });
  registry.Stop();
  EXPECT_EQ(held.use_count(), 1);
  prefill.gone = true;
  registry.PollOnce();
  EXPECT_EQ(runs.load(), 0);
}

TEST(WorkerRegistryTest, InFlightGuard) {
  WorkerRegistry registry({"127.0.0.1:1"}, {}, FastOptions());
  Worker* worker = registry.prefill_workers()[0];
  {
    InFlightGuard a(worker);
    InFlightGuard b(worker);
    EXPECT_EQ(worker->in_flight(), 2);
    InFlightGuard c = std::move(a);
    EXPECT_EQ(worker->in_flight(), 2);
    b.Reset();
    EXPECT_EQ(worker->in_flight(), 1);
  }
  EXPECT_EQ(worker->in_flight(), 0);
  EXPECT_EQ(worker->name(), "prefill worker 0 (127.0.0.1:1)");
  EXPECT_EQ(worker->label(), "prefill worker 0");
}

}  // namespace
}  // namespace duet::router
