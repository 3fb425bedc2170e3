#include "bench/serving/arrival.h"

#include <chrono>
#include <cmath>
#include <condition_variable>
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

}  // namespace duet::bench
