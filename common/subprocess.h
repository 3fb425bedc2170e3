// Child processes with a readable stdout: used by `duet serve` to run the cluster's roles and by
// integration tests to start (and kill) real processes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace duet {

class Subprocess {
 public:
  // Environment variables set (or replaced) for the child on top of this process's environment:
  // a way to hand it a secret that `ps` does not show, unlike its arguments.
  using Environment = std::vector<std::pair<std::string, std::string>>;

  // Starts argv[0] (a path) with the given arguments; its stdout is a pipe to us, stderr is
  // inherited. The child gets SIGTERM if this process dies (PR_SET_PDEATHSIG).
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const std::vector<std::string>& argv,
                                                           const Environment& env = {});
  ~Subprocess();  // terminates the child if still running

  pid_t pid() const { return pid_; }
  // Reads stdout until a line starting with `prefix` arrives; returns the rest of that line.
  // DeadlineExceeded on timeout (0: only what has already arrived), Unavailable if the child
  // exits first.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix, std::chrono::milliseconds timeout);
  // Sends `signal`; then Wait.
  void Signal(int signal);
  // Waits up to `timeout` for exit; returns the exit status (or -signal), or nullopt-like -1000
  // when still running.
  int Wait(std::chrono::milliseconds timeout);
  bool Running();
  // SIGTERM, wait up to `grace`, then SIGKILL.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));

  static constexpr int kStillRunning = -1000;

 private:
  Subprocess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}
  pid_t pid_;
  int stdout_fd_;
  std::string buffer_;
  int exit_status_ = kStillRunning;
};

}  // namespace duet
