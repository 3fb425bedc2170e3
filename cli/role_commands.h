// The cluster's roles as `duet` subcommands — router, prefill-worker, decode-worker — so each
// can run as its own process (as `duet serve` starts them, or as Kubernetes Deployments).
#pragma once

#include <optional>

#include "CLI/CLI.hpp"
#include "cli/engine_flags.h"
#include "decode_worker/decode_worker.h"
#include "prefill_worker/prefill_worker.h"
#include "router/router.h"

namespace duet {

class RoleCommands {
 public:
  explicit RoleCommands(CLI::App& app);
  // The exit code of the role that was parsed, if any.
  std::optional<int> RunParsed();

 private:
  router::RouterOptions router_;
  PrefillWorkerOptions prefill_;
  DecodeWorkerOptions decode_;
  EngineFlags prefill_flags_{&prefill_.engine};
  EngineFlags decode_flags_{&decode_.engine};
  CLI::App* router_cmd_ = nullptr;
  CLI::App* prefill_cmd_ = nullptr;
  CLI::App* decode_cmd_ = nullptr;
};

}  // namespace duet
