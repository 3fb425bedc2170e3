#include "cli/role_commands.h"

#include <tuple>

#include "cli/api_flags.h"
#include "cli/api_key.h"
#include "cli/tls_flags.h"
#include "common/logging.h"
#include "rpc/internal_auth.h"

namespace duet {
namespace {

constexpr char kTokenFileHelp[] =
    "File with the cluster's internal token (else the DUET_INTERNAL_TOKEN environment variable): the router "
    "sends it on every worker call, workers refuse calls without it";

constexpr char kServiceHelp[] =
    "Workers found by name and followed while they come and go, re-resolved every --discovery-interval-ms: "
    "dns:///NAME:PORT (every address NAME resolves to, e.g. a Kubernetes headless Service) or file:///PATH "
    "(host:port a line); with or instead of the static list";

constexpr char kGraceHelp[] =
    "On SIGTERM/SIGINT: how long running requests may take to finish while new ones are turned away";

// The worker's /metrics key into *metrics_api_key when --api-key-on-health-and-metrics (as on the
// router, none is no key); false (the reason logged) when it cannot be read.
bool LoadWorkerMetricsKey(const std::string& key, const std::string& file, bool on_metrics,
                          std::string* metrics_api_key) {
  if (!on_metrics) return true;
  absl::StatusOr<std::string> loaded = LoadApiKey(key, file);
  if (!loaded.ok()) {
    DUET_LOG(ERROR) << loaded.status().message();
    return false;
  }
  *metrics_api_key = *std::move(loaded);
  return true;
}

// The role's internal token into *token; false (the reason logged) when the file is unusable.
bool LoadToken(const std::string& file, std::string* token) {
  absl::StatusOr<std::string> loaded = rpc::LoadInternalToken(file);
  if (!loaded.ok()) {
    DUET_LOG(ERROR) << loaded.status().message();
    return false;
  }
  *token = *std::move(loaded);
  return true;
}

}  // namespace

RoleCommands::RoleCommands(CLI::App& app) {
  router_cmd_ = app.add_subcommand("router", "Run the router (public gRPC API) in front of its workers (listed or discovered)");
  router_cmd_->add_option("--model", router_.model_dir, "Model directory (tokenizer, config)")->required();
  AddServedModelNameFlag(router_cmd_, &router_.served_model_names);
  router_cmd_->add_option("--host", router_.host, "Address to listen on");
  router_cmd_->add_option("--port", router_.port, "gRPC port (0: any free port)")->check(CLI::Range(0, 65535));
  router_cmd_->add_option("--prefill", router_.prefill_addresses, "Prefill workers, host:port,...")
      ->delimiter(',')->default_str("");
  router_cmd_->add_option("--decode", router_.decode_addresses, "Decode workers, host:port,...")
      ->delimiter(',')->default_str("");
  router_cmd_->add_option("--prefill-service", router_.prefill_services, kServiceHelp)->delimiter(',')->default_str("");
  router_cmd_->add_option("--decode-service", router_.decode_services, kServiceHelp)->delimiter(',')->default_str("");
  router_cmd_->add_option("--discovery-interval-ms", router_.discovery_interval_ms,
                          "How often --prefill-service / --decode-service are resolved again")
      ->check(CLI::Range(100, 3600000));
  router_cmd_->add_option("--max-concurrent-requests", router_.max_concurrent_requests,
                          "Requests placed on workers at once; more wait in the router's queue")
      ->check(CLI::Range(1, 1 << 20));
  router_cmd_->add_option("--max-queued-requests", router_.max_queued_requests,
                          "Requests waiting beyond --max-concurrent-requests; more get RESOURCE_EXHAUSTED "
                          "(HTTP 429 with Retry-After)")
      ->check(CLI::Range(0, 1 << 20));
  router_cmd_->add_option("--max-model-len", router_.max_model_len, "Context limit (default: the model's)")
      ->default_str("");
  router_cmd_->add_option("--kv-lease-ms", router_.kv_lease_ms, "How long a KV reservation waits for its decode call")
      ->check(CLI::Range(100, 3600000));
  router_cmd_->add_option("--http-port", router_.http_port, "OpenAI-compatible HTTP port (-1: none, 0: any free port)")
      ->check(CLI::Range(-1, 65535));
  router_cmd_->add_option("--max-prefill-tokens-per-worker", router_.max_prefill_tokens_per_worker,
                          "Prompt tokens in prefill at once per prefill worker; more wait in the router "
                          "(before their decode KV is reserved)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  router_cmd_->add_flag("--sequential-kv-reservation", router_.sequential_kv_reservation,
                        "Send each Prefill after its decode KV reservation instead of beside it (the KV target following "
                        "in SetKvTarget): the reservation's round trip then adds to the time to first token");
  router_cmd_->add_option("--local-prefill-max-tokens", router_.local_prefill_max_tokens, kLocalPrefillMaxTokensHelp)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  router_cmd_->add_option("--local-prefill-queue-tokens", router_.local_prefill_queue_tokens,
                          kLocalPrefillQueueTokensHelp)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  router_cmd_->add_option("--max-request-migrations", router_.max_request_migrations,
                          "How often a request whose decode worker fails mid-stream moves to another prefill/decode "
                          "pair, its stream going on (0: it fails with UNAVAILABLE)")
      ->check(CLI::Range(0, 16));
  router_cmd_->add_option("--routing-policy", router_.routing_policy, kRoutingPolicyHelp)
      ->check(CLI::IsMember({"prefix-aware", "least-loaded"}));
  router_cmd_->add_option("--prefix-affinity", router_.prefix_affinity, kPrefixAffinityHelp)
      ->check(CLI::Range(0.0, 1e6));
  router_cmd_->add_option("--api-key", router_.api_key, kApiKeyHelp);
  router_cmd_->add_option("--api-key-file", router_api_key_file_, kApiKeyFileHelp);
  router_cmd_->add_flag("--api-key-on-health-and-metrics", router_.api_key_on_health_and_metrics,
                        kApiKeyOnHealthHelp);
  router_cmd_->add_option("--http-work-threads", router_.http_work_threads,
                          "Threads that parse, tokenize and template HTTP requests (off the io threads)")
      ->check(CLI::Range(1, 256));
  router_cmd_->add_option("--metrics-port", router_.metrics_port,
                          "Prometheus /metrics port (-1: off, 0: any free port)")->check(CLI::Range(-1, 65535));
  router_cmd_->add_option("--internal-token-file", router_token_file_, kTokenFileHelp);
  AddSslFlags(router_cmd_, &router_.tls);
  AddInternalTlsFlags(router_cmd_, &router_.internal_tls, InternalTlsRole::kRouter);
  router_cmd_->add_option("--internal-tls-server-name", router_.internal_tls_server_name,
                          "With --internal-tls-ca-certs: the name every worker's certificate must carry, instead of "
                          "the worker's address (e.g. when discovery yields pod IPs)");
  router_cmd_->add_option("--shutdown-grace-seconds", router_.shutdown_grace_seconds, kGraceHelp)
      ->check(CLI::Range(0, 86400));
  AddToolCallFlags(router_cmd_, &router_.enable_auto_tool_choice, &router_.tool_call_parser);
  AddChatTemplateFlag(router_cmd_, &router_.chat_template);
  router_log_stats_.Add(router_cmd_);

  prefill_cmd_ = AddWorkerCommand(app, "prefill-worker", "Run a prefill worker", prefill_, prefill_flags_,
                                  prefill_log_stats_, prefill_token_file_, prefill_api_key_,
                                  "Host staging for outgoing KV, in tokens (default: twice the longest prompt a "
                                  "step can finish)");
  decode_cmd_ = AddWorkerCommand(app, "decode-worker", "Run a decode worker", decode_, decode_flags_,
                                 decode_log_stats_, decode_token_file_, decode_api_key_,
                                 "cuda: pinned host staging for incoming KV, in tokens (default: twice "
                                 "max(max-model-len, max-num-batched-tokens))");
  decode_cmd_->add_flag("!--no-kv-migration-on-drain", decode_.service.park_on_drain,
                        "On SIGTERM let decoding requests finish here (default: park them with their KV "
                        "for the router to move to another decode worker)")
      ->default_str("");
}

template <typename ServiceOptions>
CLI::App* RoleCommands::AddWorkerCommand(CLI::App& app, const std::string& name, const std::string& description,
                                         WorkerProcessOptions<ServiceOptions>& options, EngineFlags& engine_flags,
                                         LogStatsFlags& log_stats, std::string& token_file,
                                         WorkerApiKey& api_key, const std::string& staging_help) {
  CLI::App* cmd = app.add_subcommand(name, description);
  engine_flags.Add(cmd);
  log_stats.Add(cmd);
  cmd->add_option_function<std::vector<std::string>>(
         "--served-model-name", [&options](const std::vector<std::string>& names) { options.service.model_name = names[0]; },
         "The model's names, the first as the model_name label of this worker's metrics (default: the model "
         "directory's base name)")
      ->expected(1, -1);
  cmd->add_option("--host", options.host, "Address to listen on");
  cmd->add_option("--port", options.port, "gRPC port (0: any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--metrics-port", options.metrics_port, "Prometheus /metrics port (-1: off, 0: any free port)")
      ->check(CLI::Range(-1, 65535));
  cmd->add_option("--internal-token-file", token_file, kTokenFileHelp);
  AddInternalTlsFlags(cmd, &options.internal_tls, InternalTlsRole::kWorker);
  cmd->add_option("--api-key", api_key.key, kWorkerApiKeyHelp);
  cmd->add_option("--api-key-file", api_key.file, kApiKeyFileHelp);
  cmd->add_flag("--api-key-on-health-and-metrics", api_key.on_metrics, kWorkerApiKeyOnMetricsHelp);
  cmd->add_option_function<int>(
         "--shutdown-grace-seconds", [&options](int seconds) { options.shutdown_grace = absl::Seconds(seconds); },
         kGraceHelp)
      ->check(CLI::Range(0, 86400))
      ->default_str(std::to_string(absl::ToInt64Seconds(options.shutdown_grace)));
  cmd->add_option("--kv-staging-tokens", options.service.kv_pools.staging_tokens, staging_help)
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 26))
      ->default_str("");
  cmd->add_flag("--kv-checksums", options.service.verify_kv_checksums,
                "Checksum every KV layer (prefill: send them; decode: ask for them and verify)");
  cmd->add_flag("!--no-kv-device-transfer", options.service.kv_pools.device_transfers,
                "cuda: stage every KV transfer through host memory, even to a worker on this host "
                "(default: CUDA IPC between device caches on one host)")
      ->default_str("");
  return cmd;
}

std::optional<int> RoleCommands::RunParsed() {
  if (router_cmd_->parsed()) {
    for (const auto& [role, addresses, services] :
         {std::tuple{"prefill", &router_.prefill_addresses, &router_.prefill_services},
          std::tuple{"decode", &router_.decode_addresses, &router_.decode_services}}) {
      if (addresses->empty() && services->empty()) {
        DUET_LOG(ERROR) << "router: give --" << role << " (addresses) or --" << role << "-service (discovery)";
        return 1;
      }
    }
    if (!LoadToken(router_token_file_, &router_.internal_token)) return 1;
    absl::StatusOr<std::string> api_key = LoadApiKey(router_.api_key, router_api_key_file_);
    if (!api_key.ok()) {
      DUET_LOG(ERROR) << api_key.status().message();
      return 1;
    }
    router_.api_key = *std::move(api_key);
    router_.log_stats_interval_s = router_log_stats_.seconds();
    return router::RunRouter(router_);
  }
  if (prefill_cmd_->parsed()) {
    prefill_flags_.Finish();
    prefill_.log_stats_interval = absl::Seconds(prefill_log_stats_.seconds());
    if (!LoadToken(prefill_token_file_, &prefill_.internal_token)) return 1;
    if (!LoadWorkerMetricsKey(prefill_api_key_.key, prefill_api_key_.file, prefill_api_key_.on_metrics,
                              &prefill_.metrics_api_key)) {
      return 1;
    }
    return RunWorkerProcess<PrefillService>("prefill worker", prefill_);
  }
  if (decode_cmd_->parsed()) {
    decode_flags_.Finish();
    decode_.log_stats_interval = absl::Seconds(decode_log_stats_.seconds());
    if (!LoadToken(decode_token_file_, &decode_.internal_token)) return 1;
    if (!LoadWorkerMetricsKey(decode_api_key_.key, decode_api_key_.file, decode_api_key_.on_metrics,
                              &decode_.metrics_api_key)) {
      return 1;
    }
    return RunWorkerProcess<DecodeService>("decode worker", decode_);
  }
  return std::nullopt;
}

}  // namespace duet
