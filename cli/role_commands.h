// The cluster's roles as `duet` subcommands — router, prefill-worker, decode-worker — so each
// can run as its own process (as `duet serve` starts them, or as Kubernetes Deployments).
#pragma once

#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "cli/engine_flags.h"
#include "cli/log_stats_flags.h"
#include "decode_worker/decode_service.h"
#include "prefill_worker/prefill_service.h"
#include "router/router.h"
#include "worker/worker_process.h"

namespace duet {

// The router's assignment flags, shared by `duet router` and `duet serve`.
inline constexpr char kRoutingPolicyHelp[] =
    "How the router places requests on workers: prefix-aware (default: the worker whose KV cache the router "
    "predicts holds most of the prompt, unless it is busier by more than --prefix-affinity requests) or "
    "least-loaded (fewest requests in flight)";
inline constexpr char kPrefixAffinityHelp[] =
    "prefix-aware: how many more requests in flight a worker holding the whole prompt may have and still be "
    "chosen (0: least-loaded; default 4)";
inline constexpr char kLocalPrefillMaxTokensHelp[] =
    "Conditional disaggregation: a prompt with at most this many tokens to compute on its decode worker (past "
    "what the router predicts cached there) is prefilled by that worker itself, in its batch (no prefill "
    "worker, no KV transfer), while the prefill workers are busy (--local-prefill-queue-tokens) or none is "
    "up. 0 (default): every prompt goes to a prefill worker";
inline constexpr char kLocalPrefillQueueTokensHelp[] =
    "Conditional disaggregation: the prefill workers count as busy from this many prompt tokens per prefill "
    "worker up reserving, prefilling or waiting for their turn (0: always)";

class RoleCommands {
 public:
  explicit RoleCommands(CLI::App& app);
  // The exit code of the role that was parsed, if any.
  std::optional<int> RunParsed();

 private:
  // The flags both worker roles take; `staging_help` says which way the staged KV goes.
  // A worker's metrics key, when it asked for one (--api-key-on-health-and-metrics).
  struct WorkerApiKey {
    std::string key, file;
    bool on_metrics = false;
  };

  template <typename ServiceOptions>
  static CLI::App* AddWorkerCommand(CLI::App& app, const std::string& name, const std::string& description,
                                    WorkerProcessOptions<ServiceOptions>& options, EngineFlags& engine_flags,
                                    LogStatsFlags& log_stats, std::string& token_file, WorkerApiKey& api_key,
                                    const std::string& staging_help);

  // --internal-token-file of each role (else DUET_INTERNAL_TOKEN; rpc/internal_auth.h).
  std::string router_token_file_, prefill_token_file_, decode_token_file_;
  std::string router_api_key_file_;  // --api-key-file (else --api-key, else DUET_API_KEY; cli/api_key.h)
  WorkerApiKey prefill_api_key_, decode_api_key_;
  router::RouterOptions router_;
  WorkerProcessOptions<PrefillServiceOptions> prefill_;
  WorkerProcessOptions<DecodeServiceOptions> decode_;
  LogStatsFlags router_log_stats_, prefill_log_stats_, decode_log_stats_;
  EngineFlags prefill_flags_{&prefill_.engine};
  EngineFlags decode_flags_{&decode_.engine};
  CLI::App* router_cmd_ = nullptr;
  CLI::App* prefill_cmd_ = nullptr;
  CLI::App* decode_cmd_ = nullptr;
};

}  // namespace duet
