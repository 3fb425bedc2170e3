#include "worker/worker_process.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/listening_sockets.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "grpcpp/health_check_service_interface.h"
#include "metrics/http_exporter.h"
#include "rpc/internal_auth.h"
#include "rpc/rpc_util.h"
#include "worker/kv_net_devices.h"

namespace duet {
namespace {

std::string HostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

// The /metrics exporter when asked for (null when not), announced on stdout.
absl::StatusOr<std::unique_ptr<metrics::HttpExporter>> StartMetrics(const WorkerServeOptions& options,
                                                                    const std::function<std::string()>& body) {
  if (options.metrics_port < 0) return nullptr;
  metrics::HttpExporter::Options exporter_options;
  exporter_options.host = options.host;
  exporter_options.port = uint16_t(options.metrics_port);
  exporter_options.bearer_token = options.metrics_api_key;
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<metrics::HttpExporter> exporter,
                        metrics::HttpExporter::Start(body, exporter_options));
  std::printf("DUET_METRICS_READY port=%d\n", int(exporter->port()));
  std::fflush(stdout);
  return exporter;
}

// The sockets the process listens on before it opens its own (metrics, gRPC): the KV
// transport's (UCX's tcp listener; its port: UCX_TCP_PORT_RANGE), announced so that nothing
// listens unannounced.
void AnnounceKvListeners(const char* role) {
  const std::vector<std::string> listeners = ListeningTcpAddresses(getpid());
  if (listeners.empty()) {
    DUET_LOG(INFO) << role << ": the KV transport listens on no TCP socket";
  } else {
    DUET_LOG(INFO) << role << ": the KV transport (UCX tcp, KV from other hosts) listens on "
                   << absl::StrJoin(listeners, ", ");
  }
  std::printf("DUET_KV_READY listen=%s\n", absl::StrJoin(listeners, ",").c_str());
  std::fflush(stdout);
}

// Until the worker holds no request (running, waiting, or a KV reservation awaiting its Decode
// call), `deadline`, or another stop signal.
void Drain(const char* role, const std::shared_ptr<grpc::Channel>& channel,
           const std::function<absl::StatusOr<v1::WorkerStats>(const std::shared_ptr<grpc::Channel>&)>& stats,
           absl::Time deadline, const sigset_t& signals) {
  for (;;) {
    absl::StatusOr<v1::WorkerStats> s = stats(channel);
    const int busy = s.ok() ? s->num_requests_running() + s->num_requests_waiting() + s->num_kv_leases() : 1;
    if (busy == 0) return;
    if (absl::Now() >= deadline) {
      DUET_LOG(WARNING) << role << ": the grace period is over with " << busy
                        << " requests or reservations left; cancelling them";
      return;
    }
    const timespec tick{0, 50 * 1000 * 1000};
    if (sigtimedwait(&signals, nullptr, &tick) > 0) {
      DUET_LOG(WARNING) << role << ": second stop signal; cancelling " << busy << " requests or reservations";
      return;
    }
  }
}

int Serve(const WorkerServeOptions& options, const std::function<absl::StatusOr<ServedService>()>& create,
          const sigset_t& signals) {
  const char* role = options.role.c_str();
  if (options.internal_token.empty()) {
    DUET_LOG(WARNING) << role << ": no internal token (--internal-token-file or " << rpc::kInternalTokenEnv
                      << "): internal RPCs are unauthenticated; anyone who reaches this worker's port can reserve "
                      << "KV, prefill into it and abort requests";
  }
  // Checked before the model loads. A worker given a CA accepts only clients it signed.
  rpc::TlsFiles tls_files = options.internal_tls;
  tls_files.client_certs = tls_files.ca_certs.empty() ? rpc::ClientCertMode::kNone : rpc::ClientCertMode::kRequired;
  absl::StatusOr<std::optional<rpc::TlsMaterial>> tls = rpc::LoadServerTls(tls_files, "--internal-tls-");
  if (!tls.ok()) {
    DUET_LOG(ERROR) << role << ": " << tls.status().message();
    return 1;
  }
  // Before the KV transport starts (inside create).
  RestrictKvTransportToHost(options.host);
  absl::StatusOr<ServedService> served = create();
  if (!served.ok()) {
    DUET_LOG(ERROR) << role << ": " << served.status();
    return 1;
  }
  AnnounceKvListeners(role);
  absl::StatusOr<std::unique_ptr<metrics::HttpExporter>> exporter = StartMetrics(options, served->metrics_body);
  if (!exporter.ok()) {
    DUET_LOG(ERROR) << role << ": cannot serve metrics: " << exporter.status();
    return 1;
  }
  int port = 0;
  rpc::WorkerCallGate gate(options.internal_token);  // outlives the server
  rpc::ReflectionV1Relay reflection_v1;              // too
  absl::StatusOr<std::unique_ptr<grpc::Server>> server =
      rpc::StartServer(HostPort(options.host, options.port), {served->service}, &port,
                       gate.Credentials(tls->has_value() ? &**tls : nullptr), 0, &reflection_v1);
  if (!server.ok()) {
    DUET_LOG(ERROR) << role << ": " << server.status();
    return 1;
  }
  std::printf("DUET_READY port=%d\n", port);
  std::fflush(stdout);
  std::unique_ptr<PeriodicStatsLogger> stats_logger;  // until the worker has drained
  if (options.log_stats_interval > absl::ZeroDuration() && served->log_stats) {
    stats_logger = std::make_unique<PeriodicStatsLogger>(options.role, absl::ToChronoMilliseconds(options.log_stats_interval),
                                                         served->log_stats);
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  DUET_LOG(INFO) << role << ": signal " << signal_number << ", draining (up to "
                 << absl::FormatDuration(options.shutdown_grace) << ")";
  const absl::Time deadline = absl::Now() + options.shutdown_grace;
  gate.StartDraining();
  (*server)->GetHealthCheckService()->SetServingStatus(false);
  if (served->start_draining) served->start_draining();
  Drain(role, (*server)->InProcessChannel(grpc::ChannelArguments()), served->stats, deadline, signals);
  stats_logger.reset();
  // Calls still open (the last writes of finished streams, prompts between admission and the
  // engine) end or are cancelled by then.
  (*server)->Shutdown(absl::ToChronoTime(std::max(deadline, absl::Now() + absl::Seconds(1))));
  (*server)->Wait();
  if (*exporter != nullptr) (*exporter)->Stop();
  DUET_LOG(INFO) << role << ": stopped";
  return 0;
}

}  // namespace

int ServeUntilSignal(const WorkerServeOptions& options, const std::function<absl::StatusOr<ServedService>()>& create) {
  sigset_t signals, previous;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, &previous);
  const int exit_code = Serve(options, create, signals);
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return exit_code;
}

}  // namespace duet
