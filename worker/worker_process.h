// The life of a worker process, for both roles: block SIGINT/SIGTERM (so every thread started
// afterwards inherits the mask), confine the KV transport to the --host interface
// (worker/kv_net_devices.h), build the engine and the role's service, serve /metrics when asked,
// serve gRPC behind the internal-token gate (rpc/internal_auth.h), announce readiness on stdout,
// and shut down cleanly on the first stop signal. `duet prefill-worker` and `duet decode-worker`
// run RunWorkerProcess.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backends/executor_factory.h"
#include "common/status_macros.h"
#include "engine/llm_engine.h"
#include "grpcpp/grpcpp.h"
#include "rpc/kv_target_auth.h"

namespace duet {

// The flags of a worker process; ServiceOptions: PrefillServiceOptions or DecodeServiceOptions.
template <typename ServiceOptions>
struct WorkerProcessOptions {
  // model_dir, block_size, num_kv_blocks / kv_cache_bytes, and scheduler.{max_num_seqs,
  // max_num_batched_tokens, max_model_len}.
  EngineConfig engine;
  std::string host = "127.0.0.1";
  int port = 0;  // 0: a free port
  // Prometheus /metrics on this port (same host): -1 off, 0 a free port. When on, the line
  // `DUET_METRICS_READY port=<port>` is printed before DUET_READY.
  int metrics_port = -1;
  // The cluster's internal token (rpc/internal_auth.h): every call but health checks must carry
  // it, and KV targets are signed (decode) or checked (prefill) with a key derived from it.
  // Empty: internal RPCs are unauthenticated (a WARNING at start-up).
  std::string internal_token;
  ServiceOptions service;
};

struct ServedService {
  grpc::Service* service = nullptr;           // owned by the caller's closure state
  std::function<std::string()> metrics_body;  // Prometheus text for /metrics
};

struct WorkerServeOptions {
  std::string role;  // "decode worker", for messages
  std::string host = "127.0.0.1";
  int port = 0;           // 0: a free port
  int metrics_port = -1;  // -1: no /metrics; 0: a free port
  std::string internal_token;
};

// `create` runs after the signals are blocked and must keep the service alive until this returns.
// Prints `DUET_METRICS_READY port=N` (when metrics are on), then `DUET_READY port=N`.
// Returns 0 after a stop signal, 1 when start-up fails (the reason on stderr).
int ServeUntilSignal(const WorkerServeOptions& options, const std::function<absl::StatusOr<ServedService>()>& create);

// Builds the engine and `Service` (its static Create(engine, options)), then serves it as above.
// Call it from the main thread before starting other threads.
template <typename Service>
int RunWorkerProcess(const std::string& role, const WorkerProcessOptions<typename Service::Options>& options) {
  std::unique_ptr<Service> service;  // lives until the process stops serving
  typename Service::Options service_options = options.service;
  service_options.kv_target_key = rpc::KvTargetKey(options.internal_token);
  return ServeUntilSignal({role, options.host, options.port, options.metrics_port, options.internal_token},
                          [&]() -> absl::StatusOr<ServedService> {
                            DUET_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine, CreateEngine(options.engine));
                            DUET_ASSIGN_OR_RETURN(service, Service::Create(std::move(engine), service_options));
                            Service* raw = service.get();
                            return ServedService{raw, [raw] { return raw->RenderMetrics(); }};
                          });
}

}  // namespace duet
