// duet: the command-line entry point. Offline commands (generate, tokenize), the cluster on one
// machine (serve), its roles as separate processes (router, prefill-worker, decode-worker, for
// Kubernetes), and a small client (complete).
#include <cstdlib>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "cli/api_flags.h"
#include "cli/api_key.h"
#include "cli/tls_flags.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "cli/log_stats_flags.h"
#include "cli/role_commands.h"
#include "common/logging.h"
#include "common/version.h"

int main(int argc, char** argv) {
  // Debian's Abseil is built without NDEBUG, so every absl::Mutex lock (gRPC's included) would
  // update a global lock-order graph: a cost on every call that the tests keep and servers drop.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"Duet: disaggregated LLM serving"};
  app.set_version_flag("--version", std::string("duet ") + duet::DuetVersion());
  // Every option's default in --help (subcommands inherit this).
  app.option_defaults()->always_capture_default();
  app.require_subcommand(1);
  app.fallthrough();  // --log-level also after the subcommand
  std::string log_level;
  app.add_option("--log-level", log_level, "debug, info (default), warning or error; also DUET_LOG_LEVEL")
      ->check([](const std::string& name) {
        absl::StatusOr<duet::LogLevel> level = duet::ParseLogLevel(name);
        return level.ok() ? std::string() : std::string(level.status().message());
      });

  duet::GenerateOptions gen;
  duet::EngineFlags gen_flags{&gen.engine};
  CLI::App* generate = app.add_subcommand("generate", "Offline batch generation (JSONL in, JSONL out)");
  gen_flags.Add(generate);
  generate->add_option("--input", gen.input_path, "Input JSONL, one request per line")->required();
  generate->add_option("--output", gen.output_path, "Output JSONL")->required();
  generate->add_option("--warmup", gen.warmup, "Run the first N requests once, untimed, before the batch")
      ->check(CLI::Range(0, 1 << 20));
  bool gen_progress = false;
  CLI::Option* gen_progress_flag =
      generate->add_flag("--progress,!--no-progress", gen_progress,
                         "A progress line on stderr (requests done, tok/s, elapsed and ETA), like vLLM's; "
                         "default: when stderr is a terminal")
          ->default_str("auto");

  duet::TokenizeOptions tok;
  CLI::App* tokenize = app.add_subcommand("tokenize", "Tokenize texts (JSONL {\"text\"} → {\"ids\"})");
  tokenize->add_option("--model", tok.model_dir, "Model directory with tokenizer.json")->required();
  tokenize->add_option("--input", tok.input_path, "Input JSONL")->required();
  tokenize->add_option("--output", tok.output_path, "Output JSONL")->required();

  duet::ServeOptions serve;
  duet::EngineFlags serve_flags{&serve.engine};
  CLI::App* serve_cmd = app.add_subcommand("serve", "Run router, prefill and decode workers on this machine");
  serve_flags.Add(serve_cmd);
  serve_cmd->add_option("--prefill-workers", serve.num_prefill_workers, "Prefill worker processes")->check(CLI::Range(1, 64));
  serve_cmd->add_option("--decode-workers", serve.num_decode_workers, "Decode worker processes")->check(CLI::Range(1, 64));
  serve_cmd->add_option("--prefill-sp-ranks", serve.prefill_sp_ranks,
                        "Sequence-parallel ranks per prefill worker: prompts of at least --sp-min-tokens "
                        "prefill with ring attention over them")
      ->check(CLI::Range(1, 64));
  serve_cmd->add_option("--prefill-gpu-percent", serve.prefill_gpu_percent,
                        "With workers sharing a GPU under MPS: the percentage of its SMs each prefill worker "
                        "may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so decode steps keep the rest; 0: no limit")
      ->check(CLI::Range(0, 100));
  serve_cmd->add_option("--decode-gpu-percent", serve.decode_gpu_percent,
                        "With workers sharing a GPU under MPS: the percentage of its SMs each decode worker "
                        "may use, so prefill kernels run beside decode steps on the rest; 0: no limit")
      ->check(CLI::Range(0, 100));
  serve_cmd->add_option("--decode-devices", serve.decode_devices,
                        "cuda: the decode workers' GPUs, e.g. 4,5,6,7 (worker i on the i-th, cycling, named first in "
                        "its CUDA_VISIBLE_DEVICES); default: the first GPU, shared with the prefill workers")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
  serve_cmd->add_option("--prefill-devices", serve.prefill_devices,
                        "cuda: the prefill workers' GPUs, e.g. 0,1 (worker i on the i-th, cycling, named first in its "
                        "CUDA_VISIBLE_DEVICES); a sequence-parallel group's GPUs are --devices instead")
      ->delimiter(',')
      ->check(CLI::Range(0, 1023));
  serve_cmd->add_flag("--kv-checksums", serve.kv_checksums,
                      "Checksum every KV layer moved between workers and verify it at the decode worker");
  serve_cmd->add_option("--grpc-port", serve.grpc_port, "Router gRPC port (0: any free port)")->check(CLI::Range(0, 65535));
  serve_cmd->add_option("--http-port", serve.http_port, "OpenAI-compatible HTTP port (-1: none)")->check(CLI::Range(-1, 65535));
  serve_cmd->add_option("--api-key", serve.api_key, duet::kApiKeyHelp);
  serve_cmd->add_option("--api-key-file", serve.api_key_file, duet::kApiKeyFileHelp);
  serve_cmd->add_flag("--api-key-on-health-and-metrics", serve.api_key_on_health_and_metrics,
                      duet::kApiKeyOnHealthHelp);
  serve_cmd->add_option("--max-concurrent-requests", serve.max_concurrent_requests,
                        "Requests placed on workers at once; more wait in the router's queue")
      ->check(CLI::Range(1, 1 << 20));
  serve_cmd->add_option("--max-queued-requests", serve.max_queued_requests,
                        "Requests waiting beyond --max-concurrent-requests; more get HTTP 429 with Retry-After")
      ->check(CLI::Range(0, 1 << 20));
  serve_cmd->add_option("--metrics-port", serve.metrics_port,
                        "Prometheus /metrics of the workers: decode worker i on P+i, prefill worker j on P+M+j "
                        "(M decode workers; 0: free ports, announced; -1: off). The router's are on --http-port")
      ->check(CLI::Range(-1, 65535));
  serve_cmd->add_option("--routing-policy", serve.routing_policy, duet::kRoutingPolicyHelp)
      ->check(CLI::IsMember({"prefix-aware", "least-loaded"}));
  serve_cmd->add_option("--prefix-affinity", serve.prefix_affinity, duet::kPrefixAffinityHelp)
      ->check(CLI::Range(0.0, 1e6));
  serve_cmd->add_flag("--sequential-kv-reservation", serve.sequential_kv_reservation,
                      "Send each Prefill after its decode KV reservation instead of beside it (the KV target following "
                        "in SetKvTarget): the reservation's round trip then adds to the time to first token");
  serve_cmd->add_option("--local-prefill-max-tokens", serve.local_prefill_max_tokens, duet::kLocalPrefillMaxTokensHelp)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  serve_cmd->add_option("--local-prefill-queue-tokens", serve.local_prefill_queue_tokens,
                        duet::kLocalPrefillQueueTokensHelp)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  serve_cmd->add_option("--decode-max-num-batched-tokens", serve.decode_max_num_batched_tokens,
                        "The decode workers' token budget per step (with --local-prefill-max-tokens: how much of a "
                        "prompt a step takes beside its decoding requests); default --max-num-batched-tokens")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  serve_cmd->add_option("--max-request-migrations", serve.max_request_migrations,
                        "How often a request whose decode worker fails mid-stream moves to another prefill/decode "
                        "pair, its stream going on (0: it fails with UNAVAILABLE)")
      ->check(CLI::Range(0, 16));
  serve_cmd->add_option("--shutdown-grace-seconds", serve.shutdown_grace_seconds,
                        "On SIGTERM/SIGINT: how long running requests may take to finish while new ones get "
                        "UNAVAILABLE / HTTP 503")
      ->check(CLI::Range(0, 86400));
  duet::AddToolCallFlags(serve_cmd, &serve.enable_auto_tool_choice, &serve.tool_call_parser);
  duet::AddChatTemplateFlag(serve_cmd, &serve.chat_template);
  duet::AddServedModelNameFlag(serve_cmd, &serve.served_model_names);
  duet::AddSslFlags(serve_cmd, &serve.tls);
  duet::AddInternalTlsFlags(serve_cmd, &serve.internal_tls, duet::InternalTlsRole::kServe);
  serve_cmd->add_option("--internal-token-file", serve.internal_token_file,
                        "File with the cluster's internal token, for tools that call the workers (default: a random "
                        "token made at start, known only to serve's processes)");
  serve_cmd->add_option("--host", serve.host,
                        "Address the router's HTTP and gRPC ports listen on (the workers stay on 127.0.0.1)");
  duet::LogStatsFlags serve_log_stats;
  serve_log_stats.Add(serve_cmd);

  duet::CompleteOptions complete;
  CLI::App* complete_cmd = app.add_subcommand("complete", "Send one prompt to a running router and stream the text");
  complete_cmd->add_option("--address", complete.address, "Router host:port");
  complete_cmd->add_option("--prompt", complete.prompt, "Prompt text")->required();
  complete_cmd->add_option("--max-tokens", complete.max_tokens)->check(CLI::Range(1, 1 << 20));
  complete_cmd->add_option("--temperature", complete.temperature)->check(CLI::Range(0.0, 100.0));
  CLI::Option* chat_flag = complete_cmd->add_flag(
      "--chat", complete.chat, "Send the prompt as a user message, through the model's chat template");
  complete_cmd->add_option("--system", complete.system, "With --chat: a system message before the prompt")
      ->needs(chat_flag);
  complete_cmd->add_flag("--ignore-eos", complete.ignore_eos, "Generate max-tokens tokens even past end-of-sequence");
  complete_cmd->add_flag("--tls", complete.tls, "Connect with TLS, verifying the router against the system's CAs");
  complete_cmd->add_option("--ssl-ca-certs", complete.tls_files.ca_certs,
                           "Connect with TLS, verifying the router's certificate against these PEM CAs");
  complete_cmd->add_option("--ssl-certfile", complete.tls_files.certfile,
                           "PEM client certificate, for a router that asks for one (--ssl-cert-reqs)");
  complete_cmd->add_option("--ssl-keyfile", complete.tls_files.keyfile, "PEM private key of --ssl-certfile");
  complete_cmd->add_option("--ssl-server-name", complete.tls_server_name,
                           "The name the router's certificate must carry, when not --address's host");
  complete_cmd->add_option("--api-key", complete.api_key, "Bearer token for a router with --api-key (visible in ps)");
  complete_cmd->add_option("--api-key-file", complete.api_key_file, duet::kApiKeyFileHelp);

  duet::RoleCommands roles(app);

  CLI11_PARSE(app, argc, argv);
  if (!log_level.empty()) {
    duet::SetMinLogLevel(*duet::ParseLogLevel(log_level));
    setenv("DUET_LOG_LEVEL", log_level.c_str(), 1);  // the processes `duet serve` starts log alike
  }
  if (generate->parsed()) {
    gen_flags.Finish();
    if (gen_progress_flag->count() > 0) gen.progress = gen_progress ? duet::ProgressMode::kOn : duet::ProgressMode::kOff;
    return duet::RunGenerate(gen);
  }
  if (tokenize->parsed()) return duet::RunTokenize(tok);
  if (serve_cmd->parsed()) {
    serve_flags.Finish();
    serve.log_stats_interval_s = serve_log_stats.seconds();
    return duet::RunServe(serve);
  }
  if (complete_cmd->parsed()) return duet::RunComplete(complete);
  if (std::optional<int> code = roles.RunParsed()) return *code;
  return 1;
}
