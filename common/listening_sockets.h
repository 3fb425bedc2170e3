// The TCP sockets a process listens on, read from /proc (its fds' socket inodes matched against
// /proc/PID/net/tcp and tcp6), as "address:port" (IPv6 without brackets, e.g. "::1:8000"). A
// worker announces with them the listeners it did not open itself (the KV transport's); tests
// check with them that nothing else listens.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace duet {

// Empty when /proc cannot be read.
std::vector<std::string> ListeningTcpAddresses(pid_t pid);

}  // namespace duet
