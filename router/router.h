// The router process: public duet.v1.Duet gRPC service in front of prefill and decode workers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace duet::router {

struct RouterOptions {
  std::string model_dir;
  std::string served_model_name;  // empty: the model directory's base name
  std::string host = "127.0.0.1";
  int port = 0;                   // 0: any free port (printed in DUET_READY)
  std::vector<std::string> prefill_addresses;  // host:port each
  std::vector<std::string> decode_addresses;
  int max_concurrent_requests = 256;
  int64_t max_model_len = 0;      // 0: the model's max_position_embeddings
  int kv_lease_ms = 30000;        // how long a decode worker holds a KV reservation for Decode
};

// A running router (server, registry poller). Tests can run one in-process.
class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Start(const RouterOptions& options);
  virtual ~Router() = default;
  virtual int port() const = 0;
  // Stops accepting calls, cancels the ones still running after `grace_ms`, stops the poller.
  virtual void Shutdown(int grace_ms = 2000) = 0;
};

// Starts the router, prints exactly one line `DUET_READY port=<port>` to stdout, serves until
// SIGINT or SIGTERM, shuts down and returns 0 (1 when it cannot start; the error is on stderr).
// Blocks SIGINT/SIGTERM in the calling thread (and so in the threads it starts) to sigwait them.
int RunRouter(const RouterOptions& options);

}  // namespace duet::router
