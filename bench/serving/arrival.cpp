#include "bench/serving/arrival.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"

namespace duet::bench {

absl::StatusOr<std::vector<double>> ArrivalSchedule(int count, const ArrivalOptions& options) {
  if (count < 0) return absl::InvalidArgumentError("the number of requests must not be negative");
  if (!(options.request_rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("request rate must be > 0 (inf: all at once), got ", options.request_rate));
  }
  if (!(options.burstiness > 0) || std::isinf(options.burstiness)) {
    return absl::InvalidArgumentError(absl::StrCat("burstiness must be a positive number, got ", options.burstiness));
  }
  std::vector<double> schedule(size_t(count), 0.0);
  if (std::isinf(options.request_rate)) return schedule;
  std::mt19937_64 rng(options.seed);
  std::gamma_distribution<double> gap(options.burstiness, 1.0 / (options.request_rate * options.burstiness));
  for (size_t i = 1; i < schedule.size(); ++i) schedule[i] = schedule[i - 1] + gap(rng);
  return schedule;
}

void Dispatch(const std::vector<double>& schedule, int max_concurrency, const SendFn& send) {
  std::mutex mu;
  std::condition_variable changed;
  int in_flight = 0;
  size_t finished = 0;
  auto done = [&] {
    std::lock_guard lock(mu);
    --in_flight;
    ++finished;
    changed.notify_all();
  };
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < schedule.size(); ++i) {
    std::this_thread::sleep_until(start + std::chrono::duration<double>(schedule[i]));
    {
      std::unique_lock lock(mu);
      changed.wait(lock, [&] { return max_concurrency <= 0 || in_flight < max_concurrency; });
      ++in_flight;
    }
    send(int(i), done);
  }
  std::unique_lock lock(mu);
  changed.wait(lock, [&] { return finished == schedule.size(); });
}

void DispatchSessions(const std::vector<double>& session_starts, int turns, int max_concurrency,
                      const SessionSendFn& send) {
  struct Turn {
    int session, turn;
  };
  std::mutex mu;
  std::condition_variable changed;
  std::deque<Turn> ready;  // guarded by mu
  int in_flight = 0;
  size_t finished = 0;
  const size_t total = session_starts.size() * size_t(std::max(turns, 0));
  size_t started_sessions = 0;
  const auto start = std::chrono::steady_clock::now();
  auto start_of = [&](size_t session) { return start + std::chrono::duration<double>(session_starts[session]); };
  std::unique_lock lock(mu);
  while (finished < total) {
    while (started_sessions < session_starts.size() && start_of(started_sessions) <= std::chrono::steady_clock::now()) {
      ready.push_back({int(started_sessions++), 0});
    }
    if (!ready.empty() && (max_concurrency <= 0 || in_flight < max_concurrency)) {
      const Turn next = ready.front();
      ready.pop_front();
      ++in_flight;
      lock.unlock();  // `done` may run inside `send`
      send(next.session, next.turn, [&, next] {
        std::lock_guard done_lock(mu);
        --in_flight;
        ++finished;
        if (next.turn + 1 < turns) ready.push_back({next.session, next.turn + 1});
        changed.notify_all();
      });
      lock.lock();
      continue;
    }
    // Wait for a turn to end or the next session's start.
    if (started_sessions < session_starts.size()) {
      changed.wait_until(lock, start_of(started_sessions));
    } else {
      changed.wait(lock);
    }
  }
}

}  // namespace duet::bench
