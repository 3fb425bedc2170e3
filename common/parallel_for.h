// A few worker threads that split one CPU kernel call across cores (the batched GEMV of a
// decode or verification step). A step makes dozens of such calls a few hundred microseconds
// apart, so the workers spin briefly between calls before they sleep, and a call costs a
// wake-up of a few microseconds, not a thread start.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace duet {

class ParallelFor {
 public:
  // `num_threads` parts run at once: the caller's and num_threads - 1 workers'.
  explicit ParallelFor(int num_threads);
  ~ParallelFor();
  ParallelFor(const ParallelFor&) = delete;
  ParallelFor& operator=(const ParallelFor&) = delete;

  // The process's pool: one thread per core, at most 8, or $DUET_CPU_THREADS (1-64) when set
  // (1: every call runs on its caller; test runs that fill every core with processes use it).
  static ParallelFor& Shared();

  // Calls fn(part) for every part in [0, num_threads()), the caller running part 0, and
  // returns when all are done. While another thread's call is running, this one runs every
  // part itself (callers never wait for each other).
  void Run(const std::function<void(int part)>& fn);
  int num_threads() const { return int(workers_.size()) + 1; }

 private:
  void Work(int part);

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one call at a time uses the workers
  std::mutex mu_;      // with cv_: sleeping workers
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};  // bumped per call; workers run the call they have not seen
  std::atomic<int> pending_{0};          // workers still running the current call
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* task_ = nullptr;  // the current call's (set before generation_)
};

}  // namespace duet
