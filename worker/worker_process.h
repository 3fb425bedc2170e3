// The life of a worker process, for both roles: block SIGINT/SIGTERM (so every thread started
// afterwards inherits the mask), build the engine and the role's service, serve /metrics when
// asked, serve gRPC, announce readiness on stdout, and shut down cleanly on the first stop
// signal. `duet prefill-worker` and `duet decode-worker` run RunWorkerProcess.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "backends/executor_factory.h"
#include "common/status_macros.h"
#include "engine/llm_engine.h"
#include "grpcpp/grpcpp.h"

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
  return ServeUntilSignal({role, options.host, options.port, options.metrics_port},
                          [&]() -> absl::StatusOr<ServedService> {
                            DUET_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine, CreateEngine(options.engine));
                            DUET_ASSIGN_OR_RETURN(service, Service::Create(std::move(engine), options.service));
                            Service* raw = service.get();
                            return ServedService{raw, [raw] { return raw->RenderMetrics(); }};
                          });
}

}  // namespace duet
