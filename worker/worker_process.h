// The life of a worker process: block SIGINT/SIGTERM (so every thread started afterwards
// inherits the mask), build the service, serve /metrics when asked, serve gRPC, announce
// readiness on stdout, and shut down cleanly on the first stop signal.
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace duet::rpc {

struct ServedService {
  grpc::Service* service = nullptr;             // owned by the caller's closure state
  std::function<std::string()> metrics_body;    // Prometheus text for /metrics
};

struct ServeOptions {
  std::string role;  // "decode worker", for messages
  std::string host = "127.0.0.1";
  int port = 0;           // 0: a free port
  int metrics_port = -1;  // -1: no /metrics; 0: a free port
};

// `create` runs after the signals are blocked and must keep the service alive until this returns.
// Prints `DUET_METRICS_READY port=N` (when metrics are on), then `DUET_READY port=N`.
// Returns 0 after a stop signal, 1 when start-up fails (the reason on stderr).
int ServeUntilSignal(const ServeOptions& options, const std::function<absl::StatusOr<ServedService>()>& create);

}  // namespace duet::rpc
