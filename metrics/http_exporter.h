// A tiny HTTP/1.1 server for Prometheus scrapes: GET (or HEAD) /metrics answers with the text
// exposition of a Registry (or of any body callback), everything else gets 400/404/405.
//
// One background thread runs a poll() loop over non-blocking sockets, so a slow or half-open
// client cannot hold up other scrapes: each connection has a deadline (Options::io_timeout) for
// the whole exchange and is closed when it passes. Each response closes its connection
// ("Connection: close"), which Prometheus handles fine. Request heads are limited to
// max_request_bytes (431 beyond; bodies are never parsed). At most max_connections are served at
// once; further clients wait in the listen backlog until a slot frees (at worst io_timeout).
//
// This exporter only serves scrapes; the OpenAI HTTP API is a separate server.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "metrics/registry.h"

namespace duet::metrics {

class HttpExporter {
 public:
  struct Options {
    std::string host = "0.0.0.0";  // numeric address or a name; "::" for IPv6
    uint16_t port = 0;             // 0: an ephemeral port, see port()
    std::chrono::milliseconds io_timeout{5000};
    size_t max_request_bytes = 16 * 1024;
    int max_connections = 64;
    // Append this process's process_* metrics (process_metrics.h) to every scrape.
    bool process_metrics = true;
    // Non-empty: a scrape needs "Authorization: Bearer <bearer_token>" (else 401), e.g. the
    // public API key under --api-key-on-health-and-metrics (Prometheus: `authorization` in the
    // scrape config).
    std::string bearer_token;
  };

  // Serves registry.Render(); the registry must outlive the exporter.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const Registry& registry,
                                                             const Options& options);
  // Serves body() (exposition text) at /metrics; body is called on the exporter's thread.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(std::function<std::string()> body,
                                                             const Options& options);
  ~HttpExporter();  // Stop()

  uint16_t port() const { return port_; }
  // Stops serving, closes every socket and joins the thread. Idempotent.
  void Stop();

 private:
  HttpExporter(std::function<std::string()> body, Options options, int listen_fd, int wake_fd,
               uint16_t port);
  void Run();

  const std::function<std::string()> body_;
  const Options options_;
  int listen_fd_;
  int wake_fd_;  // eventfd: Stop() writes to it to end the poll loop
  uint16_t port_;
  std::thread thread_;
  bool stopped_ = false;
};

}  // namespace duet::metrics
