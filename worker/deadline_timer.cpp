#include "worker/deadline_timer.h"

#include <vector>

namespace duet {

DeadlineTimer::DeadlineTimer() : thread_([this] { Run(); }) {}

void DeadlineTimer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    due_.clear();
    deadline_of_.clear();
  }
  cv_.Signal();
  thread_.join();
}

DeadlineTimer::Id DeadlineTimer::Schedule(absl::Time deadline, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  const Id id = next_id_++;
  if (stopping_) return id;
  auto [it, inserted] = due_.emplace(Key{deadline, id}, std::move(fn));
  deadline_of_.emplace(id, deadline);
  if (it == due_.begin()) cv_.Signal();  // the thread sleeps until a later deadline
  return id;
}

bool DeadlineTimer::Cancel(Id id) {
  absl::MutexLock lock(&mu_);
  auto it = deadline_of_.find(id);
  if (it == deadline_of_.end()) return false;
  due_.erase(Key{it->second, id});
  deadline_of_.erase(it);
  return true;
}

size_t DeadlineTimer::pending() const {
  absl::MutexLock lock(&mu_);
  return due_.size();
}

void DeadlineTimer::Run() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    if (due_.empty()) {
      cv_.Wait(&mu_);
      continue;
    }
    const absl::Time now = absl::Now();
    if (due_.begin()->first.first > now) {
      cv_.WaitWithDeadline(&mu_, due_.begin()->first.first);
      continue;
    }
    std::vector<std::function<void()>> ready;
    while (!due_.empty() && due_.begin()->first.first <= now) {
      deadline_of_.erase(due_.begin()->first.second);
      ready.push_back(std::move(due_.begin()->second));
      due_.erase(due_.begin());
    }
    mu_.Unlock();
    for (std::function<void()>& fn : ready) fn();
    mu_.Lock();
  }
}

}  // namespace duet
