// Test helper: a minimal blocking HTTP/1.1 client over POSIX sockets (IPv4 loopback).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace duet::metrics::testing {

// Connects to 127.0.0.1:port; -1 on failure.
inline int ConnectLoopback(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Sends `raw` as is (then shuts down our sending side when `half_close`) and reads until the
// server closes (or `timeout`); returns all bytes read, or "" when the connection failed.
inline std::string RawExchange(uint16_t port, const std::string& raw,
                               std::chrono::milliseconds timeout = std::chrono::seconds(10),
                               bool half_close = false) {
  int fd = ConnectLoopback(port);
  if (fd < 0) return "";
  size_t sent = 0;
  while (sent < raw.size()) {
    ssize_t n = ::send(fd, raw.data() + sent, raw.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += n;
  }
  if (half_close) ::shutdown(fd, SHUT_WR);
  std::string response;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  char buffer[8192];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) break;
    ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    response.append(buffer, n);
  }
  ::close(fd);
  return response;
}

struct HttpResponse {
  int status = 0;  // 0: no valid response
  std::string headers;
  std::string body;
};

inline HttpResponse ParseResponse(const std::string& raw) {
  HttpResponse r;
  size_t end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.", 0) != 0 || end == std::string::npos || raw.size() < 12) return r;
  r.status = std::stoi(raw.substr(9, 3));
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  return r;
}

inline HttpResponse HttpGet(uint16_t port, const std::string& target,
                            std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return ParseResponse(RawExchange(
      port, "GET " + target + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
      timeout));
}

// POSTs `body` (JSON) to `target`.
inline HttpResponse HttpPost(uint16_t port, const std::string& target, const std::string& body,
                             std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  return ParseResponse(RawExchange(port,
                                   "POST " + target +
                                       " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                       "Content-Length: " + std::to_string(body.size()) +
                                       "\r\nConnection: close\r\n\r\n" + body,
                                   timeout));
}

}  // namespace duet::metrics::testing
