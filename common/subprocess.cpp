#include "common/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <thread>

#include "absl/strings/str_cat.h"

namespace duet {

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const std::vector<std::string>& argv,
                                                              const Environment& env) {
  if (argv.empty()) return absl::InvalidArgumentError("empty command");
  // The child's environment is built here: between fork and exec only async-signal-safe calls.
  std::vector<std::string> env_entries;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const auto& kv) {
      return entry.size() > kv.first.size() && entry.substr(0, kv.first.size()) == kv.first &&
             entry[kv.first.size()] == '=';
    });
    if (!replaced) env_entries.emplace_back(entry);
  }
  for (const auto& [name, value] : env) env_entries.push_back(absl::StrCat(name, "=", value));
  std::vector<char*> envp;
  for (std::string& e : env_entries) envp.push_back(e.data());
  envp.push_back(nullptr);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  return std::unique_ptr<Subprocess>(new Subprocess(pid, pipe_fds[0]));
}

Subprocess::~Subprocess() {
  Stop(std::chrono::milliseconds(3000));
  ::close(stdout_fd_);
}

absl::StatusOr<std::string> Subprocess::WaitForLine(const std::string& prefix,
                                                    std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    for (size_t nl; (nl = buffer_.find('\n')) != std::string::npos;) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    // Polled at least once, so a zero timeout still reads what has arrived.
    pollfd pfd{stdout_fd_, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::clamp<int64_t>(left.count(), 0, 200)));
    if (ready > 0) {
      char chunk[4096];
      const ssize_t n = ::read(stdout_fd_, chunk, sizeof(chunk));
      if (n > 0) {
        buffer_.append(chunk, size_t(n));
        continue;
      }
      if (n == 0) return absl::UnavailableError(absl::StrCat("pid ", pid_, " closed its output (exited?)"));
    }
    if (!Running()) return absl::UnavailableError(absl::StrCat("pid ", pid_, " exited with status ", exit_status_));
    if (left.count() <= 0) return absl::DeadlineExceededError(absl::StrCat("no '", prefix, "' line from pid ", pid_));
  }
}

void Subprocess::Signal(int signal) {
  if (exit_status_ == kStillRunning) ::kill(pid_, signal);
}

bool Subprocess::Running() { return Wait(std::chrono::milliseconds(0)) == kStillRunning; }

int Subprocess::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (exit_status_ == kStillRunning) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      break;
    }
    if (r < 0 && errno != EINTR) {
      exit_status_ = -1;
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return exit_status_;
}

void Subprocess::Stop(std::chrono::milliseconds grace) {
  if (!Running()) return;
  Signal(SIGTERM);
  if (Wait(grace) == kStillRunning) {
    Signal(SIGKILL);
    Wait(std::chrono::milliseconds(5000));
  }
}

}  // namespace duet
