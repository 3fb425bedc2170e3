#include "router/router.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "grpcpp/health_check_service_interface.h"
#include "frontend/tokenizer/tokenizer.h"
#include "metrics/http_exporter.h"
#include "metrics/registry.h"
#include "model/model_config.h"
#include "model/served_model_name.h"
#include "router/api_key_gate.h"
#include "router/assignment_policy.h"
#include "router/choices_service.h"
#include "router/http_frontend.h"
#include "router/prefix_aware_policy.h"
#include "router/prefix_index.h"
#include "router/rejected_stream.h"
#include "router/request_limits.h"
#include "router/router_service.h"
#include "router/worker_registry.h"
#include "rpc/rpc_util.h"

namespace duet::router {
namespace {

// The public service while the router drains: Generate is refused with UNAVAILABLE (so clients
// and load balancers go elsewhere); Abort and GetModelInfo still pass.
class DrainingDuetService final : public v1::Duet::CallbackService {
 public:
  DrainingDuetService(v1::Duet::CallbackService* inner, const std::atomic<bool>* draining)
      : inner_(inner), draining_(draining) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(grpc::CallbackServerContext* context,
                                                           const v1::GenerateRequest* request) override {
    if (draining_->load(std::memory_order_acquire)) {
      return new RejectedStream(
          grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is shutting down and takes no new requests"));
    }
    return inner_->Generate(context, request);
  }
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override {
    return inner_->Abort(context, request, response);
  }
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request, v1::ModelInfo* response) override {
    return inner_->GetModelInfo(context, request, response);
  }

 private:
  v1::Duet::CallbackService* const inner_;
  const std::atomic<bool>* const draining_;
};

class RouterImpl : public Router {
 public:
  absl::Status Init(const RouterOptions& options) {
    if (options.max_concurrent_requests < 1) {
      return absl::InvalidArgumentError("max_concurrent_requests must be >= 1");
    }
    if (options.max_queued_requests < 0) return absl::InvalidArgumentError("max_queued_requests must be >= 0");
    std::optional<openai::ToolCallFormat> tool_call_format;
    if (!options.tool_call_parser.empty()) {
      absl::StatusOr<openai::ToolCallFormat> format = openai::ParseToolCallFormat(options.tool_call_parser);
      if (!format.ok()) return format.status();
      tool_call_format = *format;
    }
    if (options.enable_auto_tool_choice && !tool_call_format) {
      return absl::InvalidArgumentError("--enable-auto-tool-choice requires --tool-call-parser");
    }
    absl::StatusOr<std::optional<rpc::TlsMaterial>> tls = rpc::LoadServerTls(options.tls, "--ssl-");
    if (!tls.ok()) return tls.status();
    tls_ = *std::move(tls);
    absl::StatusOr<std::optional<rpc::TlsMaterial>> internal_tls =
        rpc::LoadClientTls(options.internal_tls, "--internal-tls-");
    if (!internal_tls.ok()) return internal_tls.status();
    absl::StatusOr<ModelConfig> config = LoadModelConfig(options.model_dir);
    if (!config.ok()) return config.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(options.model_dir);
    if (!tokenizer.ok()) return tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    if (absl::StatusOr<LoadedChatTemplate> chat = LoadChatTemplate(options.model_dir, options.chat_template);
        chat.ok()) {
      chat_template_ = std::make_unique<LoadedChatTemplate>(*std::move(chat));
    } else if (!options.chat_template.empty()) {
      return chat.status();
    } else {
      DUET_LOG(WARNING) << "no chat template (chat requests are refused): " << chat.status().message();
    }

    RouterServiceOptions service_options;
    service_options.model_name =
        ServedModelName(options.served_model_names.empty() ? "" : options.served_model_names[0], options.model_dir);
    service_options.vocab_size = config->vocab_size;
    service_options.max_model_len = config->max_position_embeddings;
    if (options.max_model_len > 0) {
      if (options.max_model_len > config->max_position_embeddings) {
        return absl::InvalidArgumentError(absl::StrCat(
            "max_model_len ", options.max_model_len, " is larger than the model's max_position_embeddings ",
            config->max_position_embeddings));
      }
      service_options.max_model_len = options.max_model_len;
    }
    service_options.max_concurrent_requests = options.max_concurrent_requests;
    service_options.max_queued_requests = options.max_queued_requests;
    service_options.kv_lease_ms = options.kv_lease_ms;
    service_options.max_prefill_tokens_per_worker = options.max_prefill_tokens_per_worker;
    if (options.max_request_migrations < 0) {
      return absl::InvalidArgumentError("max_request_migrations must not be negative");
    }
    service_options.max_request_migrations = options.max_request_migrations;
    service_options.overlap_kv_reservation = !options.sequential_kv_reservation;
    if (options.local_prefill_max_tokens < 0 || options.local_prefill_queue_tokens < 0) {
      return absl::InvalidArgumentError("local_prefill_max_tokens and local_prefill_queue_tokens must not be negative");
    }
    service_options.local_prefill_max_tokens = options.local_prefill_max_tokens;
    service_options.local_prefill_queue_tokens = options.local_prefill_queue_tokens;
    service_options.metrics_registry = &metrics_registry_;
    service_options.chat_template = chat_template_.get();
    if (options.enable_auto_tool_choice) service_options.auto_tool_call_format = tool_call_format;
    if (options.routing_policy != "prefix-aware" && options.routing_policy != "least-loaded") {
      return absl::InvalidArgumentError(absl::StrCat("routing_policy must be prefix-aware or least-loaded, not \"",
                                                     options.routing_policy, "\""));
    }
    if (!(options.prefix_affinity >= 0) || std::isinf(options.prefix_affinity)) {
      return absl::InvalidArgumentError("prefix_affinity must be a finite number >= 0");
    }
    // Both policies feed the index (so the predicted hit rate can be compared); only
    // prefix-aware reads it.
    prefix_index_ = std::make_unique<PrefixIndex>();
    service_options.prefix_index = prefix_index_.get();

    if ((options.prefill_addresses.empty() && options.prefill_services.empty()) ||
        (options.decode_addresses.empty() && options.decode_services.empty())) {
      DUET_LOG(WARNING) << options.prefill_addresses.size() << " prefill and " << options.decode_addresses.size()
                        << " decode workers configured and no discovery for the missing role; requests will fail";
    }
    if (options.discovery_interval_ms < 100) {
      return absl::InvalidArgumentError("discovery_interval_ms must be >= 100");
    }
    RegistryOptions registry_options;
    registry_options.internal_token = options.internal_token;
    if (internal_tls->has_value()) registry_options.worker_credentials = rpc::ChannelCredentials(**internal_tls);
    registry_options.worker_tls_server_name = options.internal_tls_server_name;
    registry_options.discovery_interval = absl::Milliseconds(options.discovery_interval_ms);
    registry_options.on_state_change = [this] {
      UpdateHealth();
      ForgetWorkersNotUp();
    };
    registry_ = std::make_unique<WorkerRegistry>(options.prefill_addresses, options.decode_addresses, registry_options);
    for (const auto& [role, specs] : {std::pair{WorkerRole::kPrefill, &options.prefill_services},
                                      std::pair{WorkerRole::kDecode, &options.decode_services}}) {
      for (const std::string& spec : *specs) {
        absl::StatusOr<DiscoveryTarget> target = ParseDiscoveryTarget(spec);
        if (!target.ok()) return target.status();
        registry_->AddDiscoveryTarget(role, *std::move(target));
      }
    }
    registry_->Start();
    if (options.routing_policy == "least-loaded") {
      policy_ = MakeLeastLoadedPolicy(registry_.get());
    } else {
      policy_ = std::make_unique<PrefixAwarePolicy>(registry_.get(), prefix_index_.get(),
                                                    PrefixAwareOptions{.prefix_affinity = options.prefix_affinity});
    }
    service_ = std::make_unique<RouterService>(service_options, tokenizer_.get(), registry_.get(), policy_.get());
    choices_service_ = std::make_unique<ChoicesDuetService>(service_.get());
    draining_service_ = std::make_unique<DrainingDuetService>(choices_service_.get(), &draining_);
    if (!options.api_key.empty()) {  // --api-key: every call on the port needs "authorization: Bearer <key>"
      api_key_gate_ = std::make_unique<ApiKeyGate>(options.api_key, options.api_key_on_health_and_metrics);
    }
    std::shared_ptr<grpc::ServerCredentials> credentials;  // null: plaintext, no gate
    if (api_key_gate_ != nullptr || tls_.has_value()) {
      credentials = rpc::GatedServerCredentials(api_key_gate_.get(), tls_.has_value() ? &*tls_ : nullptr);
    }
    grpc::Service* grpc_service = draining_service_.get();

    const std::string host = options.host.find(':') != std::string::npos && options.host.front() != '['
                                 ? absl::StrCat("[", options.host, "]")
                                 : options.host;
    absl::StatusOr<std::unique_ptr<grpc::Server>> server =
        rpc::StartServer(absl::StrCat(host, ":", options.port), {grpc_service}, &port_, credentials,
                         kMaxGrpcReceiveBytes, &reflection_v1_);
    if (!server.ok()) {
      registry_->Stop();
      return server.status();
    }
    server_ = *std::move(server);
    choices_service_->SetChannel(server_->InProcessChannel(grpc::ChannelArguments()));
    {
      absl::MutexLock lock(&health_mu_);
      health_ = server_->GetHealthCheckService();
    }
    UpdateHealth();  // the workers' states were known before the server existed
    if (options.metrics_port >= 0) {
      metrics::HttpExporter::Options exporter_options;
      exporter_options.host = options.host;
      exporter_options.port = uint16_t(options.metrics_port);
      if (options.api_key_on_health_and_metrics) exporter_options.bearer_token = options.api_key;
      absl::StatusOr<std::unique_ptr<metrics::HttpExporter>> exporter =
          metrics::HttpExporter::Start(metrics_registry_, exporter_options);
      if (!exporter.ok()) {
        Shutdown(0);
        return absl::Status(exporter.status().code(),
                            absl::StrCat("cannot serve metrics: ", exporter.status().message()));
      }
      exporter_ = *std::move(exporter);
    }
    if (options.http_port >= 0) {  // the OpenAI-compatible HTTP API, through an in-process channel
      HttpFrontendOptions http_options;
      http_options.host = options.host;
      http_options.port = options.http_port;
      http_options.num_threads = options.http_threads;
      http_options.work_threads = options.http_work_threads;
      http_options.chat_template = chat_template_.get();
      http_options.model_name = service_options.model_name;
      if (options.served_model_names.size() > 1) {
        http_options.model_aliases.assign(options.served_model_names.begin() + 1, options.served_model_names.end());
      }
      http_options.max_model_len = service_options.max_model_len;
      http_options.api_key = options.api_key;
      http_options.api_key_on_health_and_metrics = options.api_key_on_health_and_metrics;
      http_options.tls = tls_;
      http_options.metrics_body = options.metrics_body;
      if (!http_options.metrics_body) http_options.metrics_body = [this] { return RenderMetrics(); };
      http_options.healthy = [this] { return Serving(); };
      if (options.enable_auto_tool_choice) http_options.auto_tool_call_format = tool_call_format;
      http_options.on_response = [metrics = &service_->metrics()](const std::string& path, const std::string& method,
                                                                  int status, double seconds) {
        metrics->RecordHttpRequest(path, method, status, seconds);
      };
      absl::StatusOr<std::unique_ptr<HttpFrontend>> http =
          HttpFrontend::Start(http_options, tokenizer_.get(), server_->InProcessChannel(grpc::ChannelArguments()));
      if (!http.ok()) {
        Shutdown(0);
        return http.status();
      }
      http_ = *std::move(http);
    }
    return absl::OkStatus();
  }

  int port() const override { return port_; }
  int http_port() const override { return http_ != nullptr ? http_->port() : -1; }
  int metrics_port() const override { return exporter_ != nullptr ? int(exporter_->port()) : -1; }
  std::string RenderMetrics() const override { return metrics_registry_.Render(); }

  void StartDraining() override {
    draining_.store(true, std::memory_order_release);
    UpdateHealth();
  }
  int num_in_flight() const override { return service_ != nullptr ? service_->num_in_flight() : 0; }
  RouterTotals totals() const override {
    const metrics::RouterMetrics& m = service_->metrics();
    return {.prompt_tokens = static_cast<int64_t>(m.request_prompt_tokens.Collect().sum),
            .generation_tokens = static_cast<int64_t>(m.request_generation_tokens.Collect().sum),
            .in_flight = num_in_flight(),
            .waiting = static_cast<int64_t>(m.num_requests_waiting.Value())};
  }

  void Shutdown(int grace_ms) override {
    {
      absl::MutexLock lock(&health_mu_);
      health_ = nullptr;  // goes with the server
    }
    if (exporter_ != nullptr) exporter_->Stop();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(grace_ms));
      server_->Wait();
    }
    if (http_ != nullptr) http_->Stop();  // after the gRPC server: its calls have ended
    http_.reset();
    // Its calls have ended; its in-process channel goes before the server, on this thread.
    choices_service_.reset();
    server_.reset();
    if (registry_ != nullptr) registry_->Stop();
  }

  ~RouterImpl() override { Shutdown(0); }

 private:
  // Serving: not draining, and at least one prefill and one decode worker up (else every
  // Generate would fail). HTTP /health and gRPC health both say this.
  bool Serving() const {
    return !draining_.load(std::memory_order_acquire) && registry_->NumUp(WorkerRole::kPrefill) > 0 &&
           registry_->NumUp(WorkerRole::kDecode) > 0;
  }
  // A worker that went down (or left discovery) may come back with an empty cache: the prefix
  // index forgets it. Runs on registry threads; the registry exists by then.
  void ForgetWorkersNotUp() {
    std::vector<Worker*> up;
    for (WorkerRole role : {WorkerRole::kPrefill, WorkerRole::kDecode}) {
      for (Worker* worker : registry_->workers(role)) {
        if (worker->up()) up.push_back(worker);
      }
    }
    prefix_index_->RetainOnly(up);
  }
  // grpc.health.v1 for the whole server ("") and for duet.v1.Duet.
  void UpdateHealth() {
    absl::MutexLock lock(&health_mu_);
    if (health_ == nullptr) return;
    const bool serving = Serving();
    health_->SetServingStatus(v1::Duet::service_full_name(), serving);
    health_->SetServingStatus(serving);
  }

  metrics::Registry metrics_registry_;  // first: outlives everything that updates it
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LoadedChatTemplate> chat_template_;  // null: the model has none
  std::unique_ptr<PrefixIndex> prefix_index_;  // before the registry, whose threads use it
  std::unique_ptr<WorkerRegistry> registry_;
  std::unique_ptr<AssignmentPolicy> policy_;
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<ChoicesDuetService> choices_service_;  // until Shutdown
  rpc::ReflectionV1Relay reflection_v1_;  // before the server: outlives it
  // The gRPC port's TLS and API key: before the server, whose credentials use them.
  std::optional<rpc::TlsMaterial> tls_;
  std::unique_ptr<ApiKeyGate> api_key_gate_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<metrics::HttpExporter> exporter_;

  std::atomic<bool> draining_{false};
  absl::Mutex health_mu_;
  grpc::HealthCheckServiceInterface* health_ ABSL_GUARDED_BY(health_mu_) = nullptr;
  std::unique_ptr<DrainingDuetService> draining_service_;
  std::unique_ptr<HttpFrontend> http_;
  int port_ = 0;
};

}  // namespace

IntervalStats RouterIntervalStats(const RouterTotals& before, const RouterTotals& now, double seconds) {
  return {.seconds = seconds,
          .prompt_tokens = now.prompt_tokens - before.prompt_tokens,
          .generation_tokens = now.generation_tokens - before.generation_tokens,
          .running = std::max<int64_t>(now.in_flight - now.waiting, 0),  // two reads, not one snapshot
          .waiting = now.waiting};
}

absl::StatusOr<std::unique_ptr<Router>> Router::Start(const RouterOptions& options) {
  auto router = std::make_unique<RouterImpl>();
  if (absl::Status status = router->Init(options); !status.ok()) return status;
  return router;
}

int RunRouter(const RouterOptions& options) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(options);
  if (!router.ok()) {
    DUET_LOG(ERROR) << "router: " << router.status().message();
    return 1;
  }
  if ((*router)->metrics_port() >= 0) std::printf("DUET_METRICS_READY port=%d\n", (*router)->metrics_port());
  if ((*router)->http_port() >= 0) std::printf("DUET_HTTP_READY port=%d\n", (*router)->http_port());
  std::printf("DUET_READY port=%d\n", (*router)->port());
  std::fflush(stdout);
  std::unique_ptr<PeriodicStatsLogger> stats_logger;  // until the router has drained
  if (options.log_stats_interval_s > 0) {
    stats_logger = std::make_unique<PeriodicStatsLogger>(
        "router", std::chrono::milliseconds(std::llround(options.log_stats_interval_s * 1e3)),
        [router = router->get(), before = RouterTotals()](double seconds) mutable {
          const RouterTotals now = router->totals();
          const IntervalStats interval = RouterIntervalStats(before, now, seconds);
          before = now;
          return interval;
        });
  }

  int signal = 0;
  while (sigwait(&signals, &signal) != 0) {
  }
  DUET_LOG(INFO) << "router: signal " << signal << ", draining " << (*router)->num_in_flight()
                 << " requests (up to " << options.shutdown_grace_seconds << " s)";
  (*router)->StartDraining();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(options.shutdown_grace_seconds);
  while ((*router)->num_in_flight() > 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      DUET_LOG(WARNING) << "router: the grace period is over; cancelling " << (*router)->num_in_flight()
                        << " requests";
      break;
    }
    const timespec tick{0, 50 * 1000 * 1000};
    if (sigtimedwait(&signals, nullptr, &tick) > 0) {
      DUET_LOG(WARNING) << "router: second stop signal; cancelling " << (*router)->num_in_flight() << " requests";
      break;
    }
  }
  stats_logger.reset();
  // The last messages of requests that just ended are still being written.
  (*router)->Shutdown(1000);
  DUET_LOG(INFO) << "router: stopped";
  return 0;
}

}  // namespace duet::router
