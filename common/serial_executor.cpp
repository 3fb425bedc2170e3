#include "common/serial_executor.h"

namespace duet {

SerialExecutor::SerialExecutor() : thread_([this] { Run(); }) {}

SerialExecutor::~SerialExecutor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void SerialExecutor::Post(std::function<void()> fn) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(fn));
    wake = waiting_;
    waiting_ = false;
  }
  if (wake) cv_.notify_one();
}

void SerialExecutor::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    while (!pending_.empty()) {
      std::function<void()> fn = std::move(pending_.front());
      pending_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
    if (stopping_) return;
    waiting_ = true;
    cv_.wait(lock, [&] { return !waiting_ || stopping_; });
    waiting_ = false;
  }
}

}  // namespace duet
