// `duet serve`: the whole cluster on this machine — decode workers, prefill workers and the
// router as separate processes (this same binary, other subcommands), on loopback. Waits for
// each to report ready, then for SIGINT/SIGTERM, and stops them all.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "common/logging.h"
#include "common/subprocess.h"

namespace duet {
namespace {

constexpr auto kStartTimeout = std::chrono::seconds(180);
constexpr char kReady[] = "DUET_READY port=";

std::string SelfPath() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, size_t(n)) : "duet";
}

std::vector<std::string> EngineFlags(const ServeOptions& o) {
  std::vector<std::string> flags = {"--model", o.engine.model_dir, "--block-size", std::to_string(o.engine.block_size),
                                    "--max-num-seqs", std::to_string(o.engine.scheduler.max_num_seqs),
                                    "--max-num-batched-tokens", std::to_string(o.engine.scheduler.max_num_batched_tokens),
                                    "--kv-cache-gib", std::to_string(double(o.engine.kv_cache_bytes) / double(1ull << 30))};
  if (o.engine.backend != "cpu") {
    // One GPU shared by every worker process: each gets an equal part of the fraction.
    const double share = o.engine.gpu_memory_utilization / double(std::max(1, o.num_prefill_workers + o.num_decode_workers));
    flags.insert(flags.end(), {"--backend", o.engine.backend, "--gpu-memory-utilization", std::to_string(share)});
  }
  if (o.engine.num_kv_blocks > 0) {
    flags.insert(flags.end(), {"--num-kv-blocks", std::to_string(o.engine.num_kv_blocks)});
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
  return flags;
}

// Starts one role and waits for its ready line; returns its port.
absl::StatusOr<int> StartRole(std::vector<std::string> argv, std::vector<std::unique_ptr<Subprocess>>& procs) {
  absl::StatusOr<std::unique_ptr<Subprocess>> proc = Subprocess::Start(argv);
  if (!proc.ok()) return proc.status();
  absl::StatusOr<std::string> port = (*proc)->WaitForLine(kReady, kStartTimeout);
  procs.push_back(std::move(*proc));
  if (!port.ok()) return absl::UnavailableError(absl::StrCat(argv[1], " did not start: ", port.status().message()));
  return std::atoi(port->c_str());
}

}  // namespace

int RunServe(const ServeOptions& options) {
  // Block the stop signals before starting children; they are awaited with sigtimedwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  const std::string self = SelfPath();
  std::vector<std::unique_ptr<Subprocess>> workers;
  std::vector<std::unique_ptr<Subprocess>> router;
  auto stop_all = [&] {
    for (auto& p : router) p->Stop();
    for (auto& p : workers) p->Signal(SIGTERM);
    for (auto& p : workers) p->Stop();
  };
  std::vector<std::string> prefill_addresses, decode_addresses;
  for (const auto& [role, count, addresses] :
       {std::tuple{"decode-worker", options.num_decode_workers, &decode_addresses},
        std::tuple{"prefill-worker", options.num_prefill_workers, &prefill_addresses}}) {
    for (int i = 0; i < count; ++i) {
      std::vector<std::string> argv = {self, role, "--port", "0"};
      for (std::string& f : EngineFlags(options)) argv.push_back(std::move(f));
      // Only prefill workers prefill: --sp-ranks (or --prefill-sp-ranks) is theirs.
      const int sp_ranks = std::max(options.prefill_sp_ranks, options.engine.sequence_parallel.ranks);
      if (std::string_view(role) == "prefill-worker" && sp_ranks > 1) {
        argv.insert(argv.end(), {"--sp-ranks", std::to_string(sp_ranks), "--sp-min-tokens",
                                 std::to_string(options.engine.sequence_parallel.min_tokens)});
      }
      absl::StatusOr<int> port = StartRole(argv, workers);
      if (!port.ok()) {
        DUET_LOG(ERROR) << port.status().message();
        stop_all();
        return 1;
      }
      addresses->push_back(absl::StrCat("127.0.0.1:", *port));
    }
  }
  std::vector<std::string> router_argv = {self, "router", "--model", options.engine.model_dir,
                                          "--port", std::to_string(options.grpc_port),
                                          "--prefill", absl::StrJoin(prefill_addresses, ","),
                                          "--decode", absl::StrJoin(decode_addresses, ","),
                                          "--max-concurrent-requests", std::to_string(options.max_concurrent_requests),
                                          "--http-port", std::to_string(options.http_port)};
  if (!options.api_key.empty()) router_argv.insert(router_argv.end(), {"--api-key", options.api_key});
  if (options.engine.scheduler.max_model_len > 0) {
    router_argv.insert(router_argv.end(), {"--max-model-len", std::to_string(options.engine.scheduler.max_model_len)});
  }
  absl::StatusOr<int> grpc_port = StartRole(router_argv, router);
  if (!grpc_port.ok()) {
    DUET_LOG(ERROR) << grpc_port.status().message();
    stop_all();
    return 1;
  }
  DUET_LOG(INFO) << "router on 127.0.0.1:" << *grpc_port << " (gRPC duet.v1.Duet)"
                 << (options.http_port >= 0 ? absl::StrCat(", OpenAI HTTP API on 127.0.0.1:", options.http_port) : "")
                 << "; prefill " << absl::StrJoin(prefill_addresses, ",") << "; decode "
                 << absl::StrJoin(decode_addresses, ",");
  std::printf("DUET_READY grpc_port=%d\n", *grpc_port);
  std::fflush(stdout);

  int exit_code = 0;
  std::vector<bool> reported_dead(workers.size(), false);
  for (;;) {
    timespec tick{0, 200 * 1000 * 1000};
    const int sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig == SIGINT || sig == SIGTERM) break;
    if (!router[0]->Running()) {
      DUET_LOG(ERROR) << "the router exited; stopping";
      exit_code = 1;
      break;
    }
    // A dead worker is reported; the router marks it down and routes around it.
    for (size_t i = 0; i < workers.size(); ++i) {
      if (!reported_dead[i] && !workers[i]->Running()) {
        DUET_LOG(ERROR) << "worker pid " << workers[i]->pid() << " exited with status "
                        << workers[i]->Wait(std::chrono::milliseconds(0));
        reported_dead[i] = true;
      }
    }
  }
  stop_all();
  DUET_LOG(INFO) << "stopped";
  return exit_code;
}

}  // namespace duet
