// A small, bounded thread pool for the HTTP API's CPU-heavy work (request parsing, tokenization,
// chat templating, detokenization), so the HTTP io threads only move bytes: /health and small
// requests are answered while big /tokenize calls run.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace duet::router {

class WorkPool {
 public:
  // `num_threads` workers (at least 1) and at most `max_queued` tasks waiting for one.
  WorkPool(int num_threads, size_t max_queued);
  // Stop().
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // Queues `task`; false (and `task` dropped) when the queue is full or the pool stopped.
  bool TrySubmit(std::function<void()> task);
  // Tasks waiting for a thread.
  size_t num_queued();
  // Runs the tasks already queued, then joins the threads; later TrySubmit calls fail. Idempotent.
  void Stop();

 private:
  void Run();

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace duet::router
