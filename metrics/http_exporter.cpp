#include "metrics/http_exporter.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "metrics/process_metrics.h"

namespace duet::metrics {
namespace {

using Clock = std::chrono::steady_clock;

struct Connection {
  int fd = -1;
  Clock::time_point deadline;
  std::string in;
  std::string out;
  size_t sent = 0;
  // kReading: collecting the request head. kWriting: `out` is complete, sending it.
  // kDraining: sent and shut down for writing; discarding input until the client closes (closing
  // with unread input would reset the connection and could cut the response short).
  enum State { kReading, kWriting, kDraining } state = kReading;
};

std::string Response(int code, std::string_view reason, std::string_view content_type,
                     const std::string& body, bool head, std::string_view extra_headers = {}) {
  std::string out = "HTTP/1.1 " + std::to_string(code) + " ";
  out += reason;
  out += "\r\nContent-Type: ";
  out += content_type;
  out += "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n";
  out += extra_headers;
  out += "\r\n";
  if (!head) out += body;
  return out;
}

std::string TextError(int code, std::string_view reason, bool head = false,
                      std::string_view extra_headers = {}) {
  return Response(code, reason, "text/plain; charset=utf-8", std::string(reason) + "\n", head,
                  extra_headers);
}

bool IsToken(std::string_view s) {
  if (s.empty()) return false;
  for (unsigned char c : s) {
    if (c <= 32 || c >= 127) return false;
  }
  return true;
}

// a == b in time that depends on the lengths only.
bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// Whether the head's Authorization header is "Bearer <token>".
bool Authorized(std::string_view head_text, std::string_view token) {
  const std::string expected = absl::StrCat("Bearer ", std::string(token));
  for (size_t start = head_text.find("\r\n"); start != std::string_view::npos;) {
    start += 2;
    const size_t end = head_text.find("\r\n", start);
    const std::string_view field = head_text.substr(start, end == std::string_view::npos ? end : end - start);
    const size_t colon = field.find(':');
    if (colon != std::string_view::npos && absl::EqualsIgnoreCase(absl::string_view(field.data(), colon), "authorization")) {
      const absl::string_view value =
          absl::StripAsciiWhitespace(absl::string_view(field.data() + colon + 1, field.size() - colon - 1));
      return ConstantTimeEquals(std::string_view(value.data(), value.size()), expected);
    }
    start = end;
  }
  return false;
}

// Builds the response for one complete request head (everything before the blank line).
std::string Handle(std::string_view head_text, const std::function<std::string()>& body,
                   const std::string& bearer_token) {
  size_t eol = head_text.find("\r\n");
  std::string_view line = head_text.substr(0, eol);
  size_t sp1 = line.find(' ');
  size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos) {
    return TextError(400, "Bad Request");
  }
  std::string_view method = line.substr(0, sp1);
  std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  std::string_view version = line.substr(sp2 + 1);
  if (!IsToken(method) || !IsToken(target) || target[0] != '/' ||
      (version != "HTTP/1.1" && version != "HTTP/1.0")) {
    return TextError(400, "Bad Request");
  }
  std::string_view path = target.substr(0, target.find('?'));
  if (path != "/metrics") return TextError(404, "Not Found", method == "HEAD");
  bool head = method == "HEAD";
  if (method != "GET" && !head) return TextError(405, "Method Not Allowed", false, "Allow: GET, HEAD\r\n");
  if (!bearer_token.empty() && !Authorized(head_text, bearer_token)) {
    return TextError(401, "Unauthorized", head, "WWW-Authenticate: Bearer\r\n");
  }
  return Response(200, "OK", kExpositionContentType, body(), head);
}

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const Registry& registry,
                                                                   const Options& options) {
  return Start([&registry] { return registry.Render(); }, options);
}

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(
    std::function<std::string()> body, const Options& options) {
  if (options.process_metrics) {
    body = [role = std::move(body)] { return role() + RenderProcessMetrics(); };
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(options.port);
  int rc = ::getaddrinfo(options.host.empty() ? nullptr : options.host.c_str(), port_text.c_str(),
                         &hints, &result);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics exporter: cannot resolve ", options.host, ": ", gai_strerror(rc)));
  }
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) break;
    last_error = std::strerror(errno);
    CloseFd(fd);
  }
  ::freeaddrinfo(result);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("metrics exporter: cannot listen on ", options.host,
                                               ":", options.port, ": ", last_error));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  uint16_t port = addr.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  int wake = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) {
    CloseFd(fd);
    return absl::InternalError(absl::StrCat("metrics exporter: eventfd: ", std::strerror(errno)));
  }
  std::unique_ptr<HttpExporter> exporter(
      new HttpExporter(std::move(body), options, fd, wake, port));
  exporter->thread_ = std::thread([raw = exporter.get()] { raw->Run(); });
  return exporter;
}

HttpExporter::HttpExporter(std::function<std::string()> body, Options options, int listen_fd,
                           int wake_fd, uint16_t port)
    : body_(std::move(body)),
      options_(std::move(options)),
      listen_fd_(listen_fd),
      wake_fd_(wake_fd),
      port_(port) {}

HttpExporter::~HttpExporter() { Stop(); }

void HttpExporter::Stop() {
  if (stopped_) return;
  stopped_ = true;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  CloseFd(listen_fd_);
  CloseFd(wake_fd_);
}

void HttpExporter::Run() {
  std::vector<Connection> conns;
  std::vector<pollfd> fds;
  char buffer[4096];
  // After accept() fails for lack of descriptors the listener stays readable; stop polling it for
  // a moment rather than spin.
  Clock::time_point accept_paused_until;
  for (;;) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    Clock::time_point now = Clock::now();
    bool accepting = static_cast<int>(conns.size()) < options_.max_connections &&
                     now >= accept_paused_until;
    fds.push_back({listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0});
    Clock::time_point next_deadline = now + std::chrono::seconds(3600);
    if (!accepting && now < accept_paused_until) next_deadline = accept_paused_until;
    for (const Connection& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.state == Connection::kWriting ? POLLOUT : POLLIN), 0});
      next_deadline = std::min(next_deadline, c.deadline);
    }
    auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now).count();
    int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, wait) + 1));
    if (ready < 0 && errno != EINTR) break;
    if (fds[0].revents != 0) break;  // Stop()

    now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      short revents = fds[i + 2].revents;
      bool close_it = false;
      if (c.state == Connection::kDraining && (revents & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), 0);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          close_it = true;
        }
      } else if (c.state == Connection::kReading && (revents & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), 0);
        if (n > 0) {
          c.in.append(buffer, n);
          size_t end = c.in.find("\r\n\r\n");
          if (end != std::string::npos && end <= options_.max_request_bytes) {
            c.out = Handle(std::string_view(c.in).substr(0, end), body_, options_.bearer_token);
            c.state = Connection::kWriting;
          } else if (c.in.size() > options_.max_request_bytes) {
            c.out = TextError(431, "Request Header Fields Too Large");
            c.state = Connection::kWriting;
          }
        } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          close_it = true;  // the client went away before a full request
        }
      } else if (c.state == Connection::kWriting && (revents & (POLLOUT | POLLHUP | POLLERR))) {
        ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
        if (n > 0) {
          c.sent += n;
          if (c.sent == c.out.size()) {
            ::shutdown(c.fd, SHUT_WR);
            c.state = Connection::kDraining;
            c.deadline = std::min(c.deadline, now + std::chrono::seconds(1));
          }
        } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          close_it = true;
        }
      }
      if (close_it || now >= c.deadline) CloseFd(c.fd);
    }
    std::erase_if(conns, [](const Connection& c) { return c.fd < 0; });

    if (fds[1].revents & POLLIN) {
      for (;;) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
          }
          break;  // EAGAIN, or a transient error such as ECONNABORTED: poll again
        }
        if (static_cast<int>(conns.size()) >= options_.max_connections) {
          ::close(fd);
          continue;
        }
        Connection c;
        c.fd = fd;
        c.deadline = Clock::now() + options_.io_timeout;
        conns.push_back(std::move(c));
      }
    }
  }
  for (Connection& c : conns) CloseFd(c.fd);
}

}  // namespace duet::metrics
