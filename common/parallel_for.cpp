#include "common/parallel_for.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/check.h"
#include "common/logging.h"

namespace duet {
namespace {

void CpuRelax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// DUET_CPU_THREADS (1-64) if set and valid, else one thread per core, at most 8.
int SharedPoolThreads() {
  const char* env = std::getenv("DUET_CPU_THREADS");
  if (env != nullptr) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 64) return int(n);
    DUET_LOG(WARNING) << "DUET_CPU_THREADS=" << env << " is not a thread count in [1, 64]; using the default";
  }
  return int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
}

}  // namespace

ParallelFor::ParallelFor(int num_threads) {
  DUET_CHECK(num_threads >= 1);
  for (int part = 1; part < num_threads; ++part) workers_.emplace_back([this, part] { Work(part); });
}

ParallelFor::~ParallelFor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ParallelFor& ParallelFor::Shared() {
  static ParallelFor* pool = new ParallelFor(SharedPoolThreads());
  return *pool;
}

void ParallelFor::Run(const std::function<void(int part)>& fn) {
  std::unique_lock<std::mutex> run(run_mu_, std::try_to_lock);
  if (!run.owns_lock() || workers_.empty()) {
    for (int part = 0; part < num_threads(); ++part) fn(part);
    return;
  }
  task_ = &fn;
  pending_.store(int(workers_.size()), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0);
  // Workers finish about when the caller does; one that lost its core (a loaded machine) gets it
  // back sooner when the caller yields.
  for (int i = 0; pending_.load(std::memory_order_acquire) > 0; ++i) {
    if (i < 4096) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
  task_ = nullptr;
}

void ParallelFor::Work(int part) {
  // Between the calls of one step: spin; past this, sleep until the next call.
  constexpr auto kSpin = std::chrono::microseconds(1000);
  uint64_t seen = 0;
  for (;;) {
    const auto idle_since = std::chrono::steady_clock::now();
    for (int i = 0; generation_.load(std::memory_order_acquire) == seen && !stop_.load(); ++i) {
      CpuRelax();
      if (i % 256 == 255 && std::chrono::steady_clock::now() - idle_since > kSpin) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen || stop_.load(); });
      }
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    (*task_)(part);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace duet
