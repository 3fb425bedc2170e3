// Runs posted closures one at a time, in the order posted, on a thread of its own: for work that
// must leave a latency-critical thread (the engine loop's) without reordering.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace duet {

class SerialExecutor {
 public:
  SerialExecutor();
  ~SerialExecutor();  // runs what was posted before, then stops the thread
  SerialExecutor(const SerialExecutor&) = delete;
  SerialExecutor& operator=(const SerialExecutor&) = delete;

  // Safe from any thread, also from a closure running here. Wakes the thread only when it was
  // waiting, so a burst of posts costs one wake-up.
  void Post(std::function<void()> fn);

 private:
  void Run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> pending_;  // guarded by mu_
  bool waiting_ = false;                       // guarded by mu_: the thread sleeps on cv_
  bool stopping_ = false;                      // guarded by mu_
  std::thread thread_;
};

}  // namespace duet
