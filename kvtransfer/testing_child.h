// A child process of the running test or benchmark binary (re-executed through /proc/self/exe
// with extra environment variables that pick its role), its stdin and stdout piped to the
// parent for line-based talk. SIGKILLed and reaped on destruction.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

extern char** environ;

namespace duet::kvtransfer {

class ChildProcess {
 public:
  // `env`: "NAME=value" entries added to this process's environment.
  explicit ChildProcess(const std::vector<std::string>& env) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return;
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    char* argv[] = {const_cast<char*>("duet-kv-child"), nullptr};
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], STDIN_FILENO);
      dup2(from_child[1], STDOUT_FILENO);
      execve("/proc/self/exe", argv, envp.data());
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    to_child_ = fdopen(to_child[1], "w");
    from_child_ = fdopen(from_child[0], "r");
  }
  ~ChildProcess() {
    Kill();
    if (to_child_ != nullptr) fclose(to_child_);
    if (from_child_ != nullptr) fclose(from_child_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  void Send(const std::string& line) {
    if (to_child_ == nullptr) return;
    std::fprintf(to_child_, "%s\n", line.c_str());
    std::fflush(to_child_);
  }
  // The next line from the child without its newline; empty at end of file.
  std::string ReadLine() {
    std::string line;
    if (from_child_ == nullptr) return line;
    for (int c; (c = std::fgetc(from_child_)) != EOF && c != '\n';) line.push_back(char(c));
    return line;
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* to_child_ = nullptr;
  FILE* from_child_ = nullptr;
};

}  // namespace duet::kvtransfer
