// Runs callbacks at their deadlines on one thread that sleeps until the earliest deadline (or
// until an earlier one is scheduled), never on a fixed period: the decode worker ends unclaimed
// KV reservations and bounds a Decode call's wait for its transfer with it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace duet {

class DeadlineTimer {
 public:
  using Id = uint64_t;

  DeadlineTimer();
  ~DeadlineTimer() { Stop(); }
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `fn` on the timer's thread once `deadline` has passed. `fn` must not destroy the timer.
  Id Schedule(absl::Time deadline, std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops a callback that has not run; false if it ran, is running or is unknown.
  bool Cancel(Id id) ABSL_LOCKS_EXCLUDED(mu_);
  size_t pending() const ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the thread (after the callback running now, if any) and drops the callbacks not yet run;
  // later Schedule calls are dropped too. Not from a callback.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Key = std::pair<absl::Time, Id>;

  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // a new earliest deadline, or stopping
  std::map<Key, std::function<void()>> due_ ABSL_GUARDED_BY(mu_);
  std::map<Id, absl::Time> deadline_of_ ABSL_GUARDED_BY(mu_);
  Id next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the state above exists
};

}  // namespace duet
