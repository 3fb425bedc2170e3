// A progress bar on stderr, drawn only when stderr is a terminal (and `enabled`). Thread-safe.
#pragma once

#include <chrono>
#include <mutex>

namespace duet::bench {

class ProgressBar {
 public:
  explicit ProgressBar(int total, bool enabled = true);
  ~ProgressBar();  // ends the bar's line
  void Finished(bool success);  // one request more is done

 private:
  void Draw();  // with mu_ held
  const int total_;
  const bool enabled_;
  std::mutex mu_;
  int done_ = 0;
  int failed_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace duet::bench
