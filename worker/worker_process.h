// The life of a worker process, for both roles: block SIGINT/SIGTERM (so every thread started
// afterwards inherits the mask), confine the KV transport to the --host interface
// (worker/kv_net_devices.h), build the engine and the role's service, announce the KV
// transport's listening sockets, serve /metrics when asked, serve gRPC behind the internal-token
// gate (rpc/internal_auth.h; TLS with --internal-tls-*), announce readiness on stdout,
// and drain on the first stop signal: health says NOT_SERVING, new work (ReserveKv, Prefill) and
// the router's GetStats polls are refused with UNAVAILABLE (so the router places requests
// elsewhere), the requests already here — running, waiting, or reserved and awaiting their
// Decode call — finish within the grace period, then the process exits 0. A second signal, or
// the end of the grace, cuts what is left. `duet prefill-worker` and `duet decode-worker` run
// RunWorkerProcess.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/executor_factory.h"
#include "common/logging.h"
#include "common/stats_log.h"
#include "common/status_macros.h"
#include "duet/v1/worker.grpc.pb.h"
#include "engine/llm_engine.h"
#include "grpcpp/grpcpp.h"
#include "rpc/kv_target_auth.h"
#include "rpc/tls.h"
#include "worker/engine_stats_log.h"

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
  // TLS of the gRPC port (--internal-tls-certfile, --internal-tls-keyfile); with
  // --internal-tls-ca-certs every client needs a certificate that CA signed (the router's).
  // client_certs is ignored (the CA decides). No files: plaintext.
  rpc::TlsFiles internal_tls;
  // Non-empty: /metrics needs "Authorization: Bearer <metrics_api_key>" (the public API key
  // under --api-key-on-health-and-metrics).
  std::string metrics_api_key;
  // How long a stop signal waits for the worker's requests to finish.
  absl::Duration shutdown_grace = absl::Seconds(30);
  // vLLM's periodic stats line in the log (worker/engine_stats_log.h) this often; 0: none.
  absl::Duration log_stats_interval = absl::Seconds(10);
  ServiceOptions service;
};

struct ServedService {
  grpc::Service* service = nullptr;           // owned by the caller's closure state
  std::function<std::string()> metrics_body;  // Prometheus text for /metrics
  // The service's GetStats over `channel` (the server's in-process channel), for the drain.
  std::function<absl::StatusOr<v1::WorkerStats>(const std::shared_ptr<grpc::Channel>& channel)> stats;
  // The periodic stats line's figures (PeriodicStatsLogger, on its thread); none: no line.
  PeriodicStatsLogger::Sample log_stats;
  // When the drain begins, once new work is refused (none: nothing to do).
  std::function<void()> start_draining;
};

struct WorkerServeOptions {
  std::string role;  // "decode worker", for messages
  std::string host = "127.0.0.1";
  int port = 0;           // 0: a free port
  int metrics_port = -1;  // -1: no /metrics; 0: a free port
  std::string internal_token;
  rpc::TlsFiles internal_tls;
  std::string metrics_api_key;
  absl::Duration shutdown_grace = absl::Seconds(30);
  absl::Duration log_stats_interval = absl::ZeroDuration();  // 0: no periodic stats line
};

// `create` runs after the signals are blocked and must keep the service alive until this returns.
// Prints `DUET_KV_READY listen=HOST:PORT,...` (the TCP sockets the process listens on once the
// service exists: UCX's tcp transport, for KV from other hosts; none: empty), then
// `DUET_METRICS_READY port=N` (when metrics are on), then `DUET_READY port=N`.
// Returns 0 after a stop signal, 1 when start-up fails (the reason on stderr).
int ServeUntilSignal(const WorkerServeOptions& options, const std::function<absl::StatusOr<ServedService>()>& create);

// GetStats of the role whose service is `Service` (a PrefillWorker or DecodeWorker service).
template <typename Service>
absl::StatusOr<v1::WorkerStats> WorkerStatsOver(const std::shared_ptr<grpc::Channel>& channel) {
  using Rpc = std::conditional_t<std::is_base_of_v<v1::PrefillWorker::CallbackService, Service>, v1::PrefillWorker,
                                 v1::DecodeWorker>;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::WorkerStats stats;
  grpc::Status status = Rpc::NewStub(channel)->GetStats(&context, v1::GetStatsRequest(), &stats);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return stats;
}

// Builds the engine (its configuration summary logged) and `Service` (its static
// Create(engine, options); engine_stats() feeds the stats line), then serves it as above. Call it
// from the main thread before starting other threads.
template <typename Service>
int RunWorkerProcess(const std::string& role, const WorkerProcessOptions<typename Service::Options>& options) {
  std::unique_ptr<Service> service;  // lives until the process stops serving
  typename Service::Options service_options = options.service;
  service_options.kv_target_key = rpc::KvTargetKey(options.internal_token);
  return ServeUntilSignal({role, options.host, options.port, options.metrics_port, options.internal_token,
                           options.internal_tls, options.metrics_api_key, options.shutdown_grace,
                           options.log_stats_interval},
                          [&]() -> absl::StatusOr<ServedService> {
                            DUET_ASSIGN_OR_RETURN(std::unique_ptr<LlmEngine> engine, CreateEngine(options.engine));
                            DUET_LOG(INFO) << role << ": " << EngineConfigSummary(*engine);
                            const EngineStatsLabels labels = EngineStatsLabelsOf(*engine);
                            DUET_ASSIGN_OR_RETURN(service, Service::Create(std::move(engine), service_options));
                            Service* raw = service.get();
                            ServedService served{raw, [raw] { return raw->RenderMetrics(); },
                                                 &WorkerStatsOver<Service>,
                                                 EngineStatsSample([raw] { return raw->engine_stats(); }, labels)};
                            if constexpr (requires { raw->StartDraining(); }) {
                              served.start_draining = [raw] { raw->StartDraining(); };
                            }
                            return served;
                          });
}

}  // namespace duet
