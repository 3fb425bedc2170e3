// `duet serve`: the whole cluster on this machine — decode workers, prefill workers and the
// router as separate processes (this same binary, other subcommands), on loopback, sharing an
// internal token made here (or read from --internal-token-file; rpc/internal_auth.h), handed over
// in the environment so `ps` does not show it. Waits for each to report ready, then supervises them:
//   - a worker that dies is restarted on the port it had (the router's address list stays
//     valid), after 0.5 s, then twice as long after each quick death up to 30 s, back to 0.5 s
//     once it has been up for a minute; each restart is logged and printed on stdout as
//     `DUET_WORKER_RESTARTED role=<role> index=<i> pid=<pid> port=<port> restarts=<n>`;
//   - if the router dies, serve stops the workers and exits 1 (for an outer supervisor);
//   - SIGINT/SIGTERM drains: the router turns new requests away while the running ones finish
//     (up to --shutdown-grace-seconds; a second signal cuts it short), then the workers stop and
//     serve exits 0.
// With --internal-tls-* every worker serves TLS with that certificate and requires the router's
// (the same one, signed by the CA) on every call: internal RPCs then accept only the router.
// --ssl-* go to the router (TLS on its HTTP and gRPC ports). With --api-key-on-health-and-metrics
// the workers get the API key (in the environment) for their /metrics too.
// Each worker is announced once ready as `DUET_WORKER role=<role> index=<i> pid=<pid> port=<port>`
// (and ` metrics_port=<port>` with --metrics-port). The router's metrics are on its HTTP port only,
// so a Prometheus scraping that port and every worker's metrics port counts each thing once.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/api_key.h"
#include "cli/commands.h"
#include "cli/worker_placement.h"
#include "common/logging.h"
#include "common/subprocess.h"
#include "frontend/chat_template/chat_template.h"
#include "rpc/internal_auth.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kStartTimeout = std::chrono::seconds(180);
constexpr char kReady[] = "DUET_READY port=";
constexpr char kHttpReady[] = "DUET_HTTP_READY port=";
constexpr char kMetricsReady[] = "DUET_METRICS_READY port=";
constexpr auto kFirstBackoff = std::chrono::milliseconds(500);
constexpr auto kMaxBackoff = std::chrono::seconds(30);
constexpr auto kHealthyAfter = std::chrono::seconds(60);  // up this long: the backoff starts over
constexpr timespec kTick{0, 100 * 1000 * 1000};
constexpr char kMpsClientPriorityEnv[] = "CUDA_MPS_CLIENT_PRIORITY";
constexpr char kMpsActiveThreadPercentageEnv[] = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, size_t(n)) : "duet";
}

// `decode`: a decode worker's (its own token budget, when given); `gpu_memory_utilization`: its share
// (cli/worker_placement.h).
std::vector<std::string> WorkerEngineFlags(const ServeOptions& o, bool decode, double gpu_memory_utilization) {
  const int64_t budget = decode && o.decode_max_num_batched_tokens > 0 ? o.decode_max_num_batched_tokens
                                                                      : o.engine.scheduler.max_num_batched_tokens;
  std::vector<std::string> flags = {"--model", o.engine.model_dir, "--block-size", std::to_string(o.engine.block_size),
                                    "--max-num-seqs", std::to_string(o.engine.scheduler.max_num_seqs),
                                    "--max-num-batched-tokens", std::to_string(budget),
                                    "--kv-cache-gib", std::to_string(double(o.engine.kv_cache_bytes) / double(1ull << 30))};
  if (o.engine.backend != "cpu") {
    flags.insert(flags.end(),
                 {"--backend", o.engine.backend, "--gpu-memory-utilization", std::to_string(gpu_memory_utilization)});
  }
  if (o.engine.num_kv_blocks > 0) {
    flags.insert(flags.end(), {"--num-kv-blocks", std::to_string(o.engine.num_kv_blocks)});
  }
  if (o.engine.scheduler.max_num_mixed_tokens > 0) {
    flags.insert(flags.end(), {"--max-num-mixed-tokens", std::to_string(o.engine.scheduler.max_num_mixed_tokens)});
  }
  if (o.engine.scheduler.max_model_len > 0) {
    flags.insert(flags.end(), {"--max-model-len", std::to_string(o.engine.scheduler.max_model_len)});
  }
  const duet::SpeculationConfig& spec = o.engine.speculation;
  flags.insert(flags.end(), {"--speculation", duet::SpeculationModeName(spec.default_mode), "--max-draft-tokens",
                             std::to_string(spec.max_draft_tokens)});
  if (!spec.draft_model_dir.empty()) flags.insert(flags.end(), {"--draft-model", spec.draft_model_dir});
  if (spec.self_spec_layers > 0) flags.insert(flags.end(), {"--self-spec-layers", std::to_string(spec.self_spec_layers)});
  if (o.kv_checksums) flags.push_back("--kv-checksums");
  if (!o.engine.enable_prefix_caching) flags.push_back("--no-enable-prefix-caching");
  if (!o.engine.async_scheduling) flags.push_back("--no-async-scheduling");
  if (!o.engine.late_scheduling) flags.push_back("--no-late-scheduling");
  if (o.engine.host_kv_cache_bytes > 0) {
    flags.insert(flags.end(), {"--host-kv-cache-gib", std::to_string(double(o.engine.host_kv_cache_bytes) / double(1ull << 30))});
  }
  return flags;
}

// The same --internal-tls-* for every process: the workers serve the certificate and require it
// (signed by the CA) of their clients; the router verifies the workers against the CA and presents
// it.
std::vector<std::string> InternalTlsFlags(const rpc::TlsFiles& tls) {
  std::vector<std::string> flags;
  for (const auto& [flag, value] : {std::pair{"--internal-tls-certfile", &tls.certfile},
                                    std::pair{"--internal-tls-keyfile", &tls.keyfile},
                                    std::pair{"--internal-tls-ca-certs", &tls.ca_certs}}) {
    if (!value->empty()) flags.insert(flags.end(), {flag, *value});
  }
  return flags;
}

// "exited with status 1", "killed by signal 9".
std::string DescribeExit(int status) {
  return status < 0 ? absl::StrCat("killed by signal ", -status) : absl::StrCat("exited with status ", status);
}

std::string Seconds(Clock::duration d) {
  return absl::StrCat(std::chrono::duration<double>(d).count(), " s");
}

// One worker process of the cluster, kept running.
class WorkerSlot {
 public:
  // `metrics_port`: its /metrics port (0: a free one; -1: none).
  WorkerSlot(std::string role, int index, std::vector<std::string> argv, const Subprocess::Environment* env,
             int metrics_port)
      : role_(std::move(role)), index_(index), argv_(std::move(argv)), env_(env), metrics_port_(metrics_port) {}

  int port() const { return port_; }
  std::string name() const { return absl::StrCat(role_, " worker ", index_, " (port ", port_, ")"); }

  // Starts it on a free port and waits until it is ready; the port is its own from now on.
  absl::Status StartFirst() {
    absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Argv(0), *env_);
    if (!proc.ok()) return proc.status();
    proc_ = *std::move(proc);
    // A worker announces its metrics port (when it has one) before its gRPC port.
    absl::StatusOr<std::string> metrics_port =
        metrics_port_ >= 0 ? proc_->WaitForLine(kMetricsReady, kStartTimeout) : absl::StatusOr<std::string>("");
    absl::StatusOr<std::string> port = metrics_port.ok() ? proc_->WaitForLine(kReady, kStartTimeout) : metrics_port;
    if (!port.ok()) {
      return absl::UnavailableError(absl::StrCat(role_, " worker ", index_, " did not start: ", port.status().message()));
    }
    port_ = std::atoi(port->c_str());
    state_ = State::kRunning;
    since_ = Clock::now();
    if (metrics_port_ >= 0) metrics_port_ = std::atoi(metrics_port->c_str());  // restarts keep it
    const std::string metrics = metrics_port_ >= 0 ? absl::StrCat(" metrics_port=", metrics_port_) : "";
    std::printf("DUET_WORKER role=%s index=%d pid=%d port=%d%s\n", role_.c_str(), index_, int(proc_->pid()), port_,
                metrics.c_str());
    std::fflush(stdout);
    return absl::OkStatus();
  }

  // One supervision step: notices a death, restarts after the backoff, sees the restart through.
  void Supervise() {
    const Clock::time_point now = Clock::now();
    switch (state_) {
      case State::kRunning:
        if (proc_->Running()) return;
        if (now - since_ >= kHealthyAfter) backoff_ = kFirstBackoff;
        DUET_LOG(ERROR) << name() << ", pid " << proc_->pid() << ", " << DescribeExit(proc_->Wait(std::chrono::milliseconds(0)))
                        << " unexpectedly; restarting it in " << Seconds(backoff_);
        return Backoff(now);
      case State::kWaiting: {
        if (now < since_) return;
        ++restarts_;
        absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(Argv(port_), *env_);
        if (!proc.ok()) {
          DUET_LOG(ERROR) << "cannot restart " << name() << ": " << proc.status().message();
          return Backoff(now);
        }
        proc_ = *std::move(proc);
        state_ = State::kStarting;
        since_ = now;
        return;
      }
      case State::kStarting: {
        absl::StatusOr<std::string> ready = proc_->WaitForLine(kReady, std::chrono::milliseconds(0));
        if (ready.ok()) {
          state_ = State::kRunning;
          since_ = now;
          DUET_LOG(INFO) << "restarted " << name() << ", pid " << proc_->pid() << " (restart " << restarts_ << ")";
          std::printf("DUET_WORKER_RESTARTED role=%s index=%d pid=%d port=%d restarts=%d\n", role_.c_str(), index_,
                      int(proc_->pid()), port_, restarts_);
          std::fflush(stdout);
          return;
        }
        if (ready.status().code() == absl::StatusCode::kDeadlineExceeded && now - since_ < kStartTimeout) return;
        proc_->Stop();
        DUET_LOG(ERROR) << "restarting " << name() << " failed (" << ready.status().message() << "); next try in "
                        << Seconds(backoff_);
        return Backoff(now);
      }
    }
  }

  void Signal(int signal) {
    if (proc_ != nullptr) proc_->Signal(signal);
  }
  void Stop(std::chrono::milliseconds grace) {
    if (proc_ != nullptr) proc_->Stop(grace);
  }

 private:
  enum class State { kRunning, kWaiting, kStarting };

  std::vector<std::string> Argv(int port) const {
    std::vector<std::string> argv = argv_;
    argv.insert(argv.begin() + 2, {"--port", std::to_string(port)});
    if (metrics_port_ >= 0) argv.insert(argv.begin() + 2, {"--metrics-port", std::to_string(metrics_port_)});
    return argv;
  }
  void Backoff(Clock::time_point now) {
    state_ = State::kWaiting;
    since_ = now + backoff_;
    backoff_ = std::min<Clock::duration>(2 * backoff_, kMaxBackoff);
  }

  const std::string role_;
  const int index_;
  const std::vector<std::string> argv_;  // {self, subcommand, flags...}: --port goes after the subcommand
  const Subprocess::Environment* const env_;
  int metrics_port_;
  std::unique_ptr<Subprocess> proc_;
  int port_ = 0;
  State state_ = State::kWaiting;
  Clock::time_point since_;  // kRunning: ready since; kWaiting: start at; kStarting: started at
  Clock::duration backoff_ = kFirstBackoff;
  int restarts_ = 0;
};

}  // namespace

int RunServe(const ServeOptions& options) {
  const size_t sp_devices = options.engine.sequence_parallel.devices.size();
  const int sp_ranks = std::max(options.prefill_sp_ranks, options.engine.sequence_parallel.ranks);
  if (sp_devices > 0 && int(sp_devices) != sp_ranks) {
    DUET_LOG(ERROR) << "--devices names " << sp_devices << " GPUs for " << sp_ranks
                    << " sequence-parallel prefill ranks (--prefill-sp-ranks): give one per rank";
    return 2;
  }
  if ((!options.decode_devices.empty() || !options.prefill_devices.empty()) && options.engine.backend == "cpu") {
    DUET_LOG(ERROR) << "--decode-devices and --prefill-devices are for the cuda backend";
    return 2;
  }
  const char* serve_visible = getenv("CUDA_VISIBLE_DEVICES");
  absl::StatusOr<Placement> placement = PlaceWorkers(
      {.num_prefill_workers = options.num_prefill_workers,
       .num_decode_workers = options.num_decode_workers,
       .prefill_group_devices = sp_ranks > 1 ? options.engine.sequence_parallel.devices : std::vector<int>{},
       .prefill_devices = options.prefill_devices,
       .decode_devices = options.decode_devices,
       .gpu_memory_utilization = options.engine.gpu_memory_utilization,
       .visible_devices = serve_visible ? std::optional<std::string>(serve_visible) : std::nullopt});
  if (!placement.ok()) {
    DUET_LOG(ERROR) << placement.status().message();
    return 2;
  }
  // Block the stop signals before starting children; they are awaited with sigtimedwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  absl::StatusOr<std::string> token = options.internal_token_file.empty()
                                          ? rpc::GenerateInternalToken()
                                          : rpc::LoadInternalToken(options.internal_token_file);
  if (!token.ok()) {
    DUET_LOG(ERROR) << "the cluster's internal token: " << token.status().message();
    return 1;
  }
  absl::StatusOr<std::string> api_key = LoadApiKey(options.api_key, options.api_key_file);
  if (!api_key.ok()) {
    DUET_LOG(ERROR) << api_key.status().message();
    return 1;
  }
  // The processes check these too, but only once started (and the workers before the router).
  for (const absl::Status& checked : {rpc::LoadServerTls(options.tls, "--ssl-").status(),
                                      rpc::LoadServerTls(options.internal_tls, "--internal-tls-").status(),
                                      rpc::LoadClientTls(options.internal_tls, "--internal-tls-").status()}) {
    if (!checked.ok()) {
      DUET_LOG(ERROR) << checked.message();
      return 1;
    }
  }
  if (!options.chat_template.empty()) {  // the router checks it too, but only after the workers start
    if (absl::StatusOr<LoadedChatTemplate> chat = LoadChatTemplate(options.engine.model_dir, options.chat_template);
        !chat.ok()) {
      DUET_LOG(ERROR) << chat.status().message();
      return 1;
    }
  }
  // The router gets the public API key in its environment, not argv; the workers only to guard
  // their /metrics.
  const Subprocess::Environment env = {
      {rpc::kInternalTokenEnv, *token}, {kApiKeyEnv, options.api_key_on_health_and_metrics ? *api_key : ""}};
  Subprocess::Environment decode_env = env;
  if (options.decode_gpu_percent > 0) {
    decode_env.emplace_back(kMpsActiveThreadPercentageEnv, std::to_string(options.decode_gpu_percent));
  }
  // Workers sharing a GPU under MPS run their kernels side by side; a decode step is the latency
  // every stream waits on, so prefill workers' kernels yield to it (MPS client priority 1, "below
  // normal"; without MPS the variable is ignored). A value in serve's own environment is kept.
  Subprocess::Environment prefill_env = env;
  if (getenv(kMpsClientPriorityEnv) == nullptr) prefill_env.emplace_back(kMpsClientPriorityEnv, "1");
  if (options.prefill_gpu_percent > 0) {
    prefill_env.emplace_back(kMpsActiveThreadPercentageEnv, std::to_string(options.prefill_gpu_percent));
  }
  // Each worker's own environment: its role's, and its GPU where placed on one.
  auto worker_envs = [](const Subprocess::Environment& role_env, const std::vector<WorkerPlacement>& placed,
                        const char* role) {
    std::vector<Subprocess::Environment> envs(placed.size(), role_env);
    for (size_t i = 0; i < envs.size(); ++i) {
      if (const auto& visible = placed[i].cuda_visible_devices) {
        envs[i].emplace_back("CUDA_VISIBLE_DEVICES", *visible);
        DUET_LOG(INFO) << role << " worker " << i << ": CUDA_VISIBLE_DEVICES=" << *visible;
      }
    }
    return envs;
  };
  const std::vector<Subprocess::Environment> decode_envs = worker_envs(decode_env, placement->decode, "decode");
  const std::vector<Subprocess::Environment> prefill_envs = worker_envs(prefill_env, placement->prefill, "prefill");
  const Subprocess::Environment router_env = {{rpc::kInternalTokenEnv, *token}, {kApiKeyEnv, *api_key}};
  const std::string grace = std::to_string(options.shutdown_grace_seconds);
  const std::string log_stats_interval = absl::StrCat(options.log_stats_interval_s);

  const std::string self = SelfPath();
  std::vector<std::unique_ptr<WorkerSlot>> workers;
  std::unique_ptr<Subprocess> router;
  const auto worker_grace = std::chrono::seconds(options.shutdown_grace_seconds + 5);
  auto stop_workers = [&] {
    for (auto& w : workers) w->Signal(SIGTERM);
    for (auto& w : workers) w->Stop(worker_grace);
  };
  std::vector<std::string> prefill_addresses, decode_addresses;
  for (const auto& [role, count, addresses] :
       {std::tuple{"decode", options.num_decode_workers, &decode_addresses},
        std::tuple{"prefill", options.num_prefill_workers, &prefill_addresses}}) {
    for (int i = 0; i < count; ++i) {
      std::vector<std::string> argv = {self, absl::StrCat(role, "-worker"), "--shutdown-grace-seconds", grace,
                                       "--log-stats-interval", log_stats_interval};
      if (!options.served_model_names.empty()) argv.insert(argv.end(), {"--served-model-name", options.served_model_names[0]});
      if (options.api_key_on_health_and_metrics) argv.push_back("--api-key-on-health-and-metrics");
      for (std::string& f : InternalTlsFlags(options.internal_tls)) argv.push_back(std::move(f));
      const bool decode = std::string_view(role) == "decode";
      const WorkerPlacement& place = decode ? placement->decode[size_t(i)] : placement->prefill[size_t(i)];
      for (std::string& f : WorkerEngineFlags(options, decode, place.gpu_memory_utilization)) argv.push_back(std::move(f));
      // Only prefill workers prefill: --sp-ranks (or --prefill-sp-ranks) is theirs.
      if (!decode && sp_ranks > 1) {
        argv.insert(argv.end(), {"--sp-ranks", std::to_string(sp_ranks), "--sp-min-tokens",
                                 std::to_string(options.engine.sequence_parallel.min_tokens)});
        // --devices: each prefill worker's group spans them (one executor per rank).
        const std::vector<int>& devices = options.engine.sequence_parallel.devices;
        if (!devices.empty()) {
          argv.insert(argv.end(), {"--devices", absl::StrJoin(devices, ","), "--sp-transport",
                                   options.engine.sequence_parallel.transport});
        }
      }
      // Decode workers first, then prefill workers, on consecutive metrics ports.
      const int metrics_port = options.metrics_port <= 0 ? options.metrics_port
                                                         : options.metrics_port + int(workers.size());
      workers.push_back(std::make_unique<WorkerSlot>(role, i, std::move(argv),
                                                     decode ? &decode_envs[size_t(i)] : &prefill_envs[size_t(i)],
                                                     metrics_port));
      if (absl::Status started = workers.back()->StartFirst(); !started.ok()) {
        DUET_LOG(ERROR) << started.message();
        stop_workers();
        return 1;
      }
      addresses->push_back(absl::StrCat("127.0.0.1:", workers.back()->port()));
    }
  }
  std::vector<std::string> router_argv = {self, "router", "--model", options.engine.model_dir,
                                          "--port", std::to_string(options.grpc_port),
                                          "--prefill", absl::StrJoin(prefill_addresses, ","),
                                          "--decode", absl::StrJoin(decode_addresses, ","),
                                          "--max-concurrent-requests", std::to_string(options.max_concurrent_requests),
                                          "--max-queued-requests", std::to_string(options.max_queued_requests),
                                          "--http-port", std::to_string(options.http_port),
                                          "--shutdown-grace-seconds", grace,
                                          "--log-stats-interval", log_stats_interval,
                                          "--routing-policy", options.routing_policy,
                                          "--prefix-affinity", absl::StrCat(options.prefix_affinity),
                                          "--max-request-migrations", std::to_string(options.max_request_migrations),
                                          "--local-prefill-max-tokens", std::to_string(options.local_prefill_max_tokens),
                                          "--local-prefill-queue-tokens",
                                          std::to_string(options.local_prefill_queue_tokens)};
  if (options.api_key_on_health_and_metrics) router_argv.push_back("--api-key-on-health-and-metrics");
  if (options.sequential_kv_reservation) router_argv.push_back("--sequential-kv-reservation");
  for (std::string& f : InternalTlsFlags(options.internal_tls)) router_argv.push_back(std::move(f));
  for (const auto& [flag, value] : {std::pair{"--ssl-certfile", &options.tls.certfile},
                                    std::pair{"--ssl-keyfile", &options.tls.keyfile},
                                    std::pair{"--ssl-ca-certs", &options.tls.ca_certs}}) {
    if (!value->empty()) router_argv.insert(router_argv.end(), {flag, *value});
  }
  router_argv.insert(router_argv.end(),
                     {"--ssl-cert-reqs", std::to_string(static_cast<int>(options.tls.client_certs))});
  if (options.enable_auto_tool_choice) router_argv.push_back("--enable-auto-tool-choice");
  router_argv.insert(router_argv.end(), {"--host", options.host});
  if (!options.served_model_names.empty()) {
    router_argv.push_back("--served-model-name");
    router_argv.insert(router_argv.end(), options.served_model_names.begin(), options.served_model_names.end());
  }
  if (!options.tool_call_parser.empty()) router_argv.insert(router_argv.end(), {"--tool-call-parser", options.tool_call_parser});
  if (!options.chat_template.empty()) router_argv.insert(router_argv.end(), {"--chat-template", options.chat_template});
  if (options.engine.scheduler.max_model_len > 0) {
    router_argv.insert(router_argv.end(), {"--max-model-len", std::to_string(options.engine.scheduler.max_model_len)});
  }
  absl::StatusOr<std::unique_ptr<Subprocess>> started = Subprocess::Start(router_argv, router_env);
  // The router announces its HTTP port (the real one for --http-port 0) before its gRPC port.
  absl::StatusOr<std::string> http_port = std::to_string(options.http_port);
  if (started.ok() && options.http_port >= 0) http_port = (*started)->WaitForLine(kHttpReady, kStartTimeout);
  absl::StatusOr<std::string> grpc_port =
      !started.ok()     ? absl::StatusOr<std::string>(started.status())
      : !http_port.ok() ? http_port
                        : (*started)->WaitForLine(kReady, kStartTimeout);
  if (started.ok()) router = *std::move(started);
  if (!grpc_port.ok()) {
    DUET_LOG(ERROR) << "the router did not start: " << grpc_port.status().message();
    if (router != nullptr) router->Stop();
    stop_workers();
    return 1;
  }
  DUET_LOG(INFO) << "router on " << options.host << ":" << *grpc_port << " (gRPC duet.v1.Duet)"
                 << (options.http_port >= 0 ? absl::StrCat(", OpenAI HTTP API on ", options.tls.certfile.empty() ? "http" : "https",
                                                           "://", options.host, ":", *http_port)
                                            : "")
                 << "; prefill " << absl::StrJoin(prefill_addresses, ",") << "; decode "
                 << absl::StrJoin(decode_addresses, ",");
  if (options.http_port >= 0) std::printf("DUET_HTTP_READY port=%s\n", http_port->c_str());
  std::printf("DUET_READY grpc_port=%s\n", grpc_port->c_str());
  std::fflush(stdout);

  for (;;) {
    const int sig = sigtimedwait(&stop_signals, nullptr, &kTick);
    if (sig == SIGINT || sig == SIGTERM) {
      DUET_LOG(INFO) << "signal " << sig << ": draining the router (up to " << options.shutdown_grace_seconds
                     << " s), then stopping the workers";
      break;
    }
    if (!router->Running()) {
      DUET_LOG(ERROR) << "the router " << DescribeExit(router->Wait(std::chrono::milliseconds(0)))
                      << "; stopping the cluster";
      stop_workers();
      return 1;
    }
    for (auto& w : workers) w->Supervise();
  }
  // The workers serve the router's running requests until it has drained; a second signal is
  // passed on (the router then cuts its drain short).
  router->Signal(SIGTERM);
  const auto router_deadline = Clock::now() + std::chrono::seconds(options.shutdown_grace_seconds + 10);
  while (router->Running() && Clock::now() < router_deadline) {
    if (sigtimedwait(&stop_signals, nullptr, &kTick) > 0) router->Signal(SIGTERM);
  }
  router->Stop(std::chrono::milliseconds(0));  // SIGKILL if it is still there
  const int router_status = router->Wait(std::chrono::milliseconds(0));
  stop_workers();
  DUET_LOG(INFO) << "stopped (the router " << DescribeExit(router_status) << ")";
  return router_status == 0 ? 0 : 1;
}

}  // namespace duet
