// The `duet` subcommands. Each returns the process exit code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cli/generate_progress.h"
#include "engine/llm_engine.h"
#include "rpc/tls.h"

namespace duet {

struct GenerateOptions {
  EngineConfig engine;
  std::string input_path;
  std::string output_path;
  // The first `warmup` requests run once, untimed and unsaved, before the batch: one-time costs
  // (lazy kernel loading, library heuristics, first allocations) stay out of the timings.
  int warmup = 0;
  // The progress line on stderr (cli/generate_progress.h); auto: when stderr is a terminal.
  ProgressMode progress = ProgressMode::kAuto;
};
int RunGenerate(const GenerateOptions& options);

struct TokenizeOptions {
  std::string model_dir;
  std::string input_path;
  std::string output_path;
};
int RunTokenize(const TokenizeOptions& options);

struct ServeOptions {
  EngineConfig engine;  // passed to every worker
  int num_prefill_workers = 1;
  int num_decode_workers = 1;
  int grpc_port = 50051;
  int http_port = 8000;  // OpenAI-compatible API; -1: none
  std::string api_key;   // when set, required on /v1/*, /tokenize, /detokenize and gRPC duet.v1.Duet
  std::string api_key_file;  // else the key from this file, else DUET_API_KEY (cli/api_key.h)
  // The router's /health, /metrics and gRPC health need the key too; so do the workers' /metrics.
  bool api_key_on_health_and_metrics = false;
  rpc::TlsFiles tls;           // the router's --ssl-*: TLS on its HTTP and gRPC ports
  rpc::TlsFiles internal_tls;  // mutual TLS between router and workers (--internal-tls-*)
  // The cluster's internal token from this file (rpc/internal_auth.h); empty: a random one made by
  // serve. Lets a tool outside the cluster (bench/chaos) call the workers' GetStats.
  std::string internal_token_file;
  int max_concurrent_requests = 256;
  int max_queued_requests = 1024;
  // Workers' /metrics: decode worker i on metrics_port + i, prefill worker j on metrics_port + M + j;
  // 0: free ports; -1: none.
  int metrics_port = -1;
  bool kv_checksums = false;  // passed to every worker (--kv-checksums)
  int prefill_sp_ranks = 1;   // sequence-parallel ranks of each prefill worker (--sp-ranks there)
  // Under MPS: the share of the GPU's SMs each prefill worker may use (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE);
  // 0: no limit.
  int prefill_gpu_percent = 0;
  int decode_gpu_percent = 0;  // the same for each decode worker
  // cuda: the decode workers' GPUs (worker i on the (i mod n)-th, by its CUDA_VISIBLE_DEVICES);
  // empty: the first GPU serve sees (cli/worker_placement.h). The same for prefill workers that are
  // not sequence-parallel groups.
  std::vector<int> decode_devices;
  std::vector<int> prefill_devices;
  int shutdown_grace_seconds = 30;  // on SIGTERM/SIGINT: how long running requests may take to finish
  std::string routing_policy = "prefix-aware";  // the router's --routing-policy
  double prefix_affinity = 4.0;                 // the router's --prefix-affinity
  int max_request_migrations = 1;               // the router's --max-request-migrations
  bool sequential_kv_reservation = false;        // the router's --sequential-kv-reservation
  int64_t local_prefill_max_tokens = 0;          // the router's --local-prefill-max-tokens
  // The decode workers' --max-num-batched-tokens (the prompt tokens a step takes beside its decoding
  // requests, with conditional disaggregation); 0: --max-num-batched-tokens.
  int64_t decode_max_num_batched_tokens = 0;
  int64_t local_prefill_queue_tokens = 0;        // the router's --local-prefill-queue-tokens
  bool enable_auto_tool_choice = false;  // the router's (cli/api_flags.h)
  std::string tool_call_parser;
  std::string chat_template;                    // the router's --chat-template
  std::vector<std::string> served_model_names;  // the router's (all) and the workers' (the first)
  std::string host = "127.0.0.1";               // where the router listens (the workers stay on loopback)
  double log_stats_interval_s = 10;             // every process's stats lines (cli/log_stats_flags.h); 0: none
};
int RunServe(const ServeOptions& options);

struct CompleteOptions {
  std::string address = "127.0.0.1:50051";
  std::string prompt;
  int max_tokens = 64;
  float temperature = 0.0f;
  int timeout_s = 120;
  bool chat = false;   // the prompt as a chat's user message (the router applies the template)
  std::string system;  // chat: a system message first, when not empty
  bool ignore_eos = false;
  // TLS to the router: with ca_certs (or a client certificate) the server is verified against
  // that CA; with only `tls`, against the system's roots; neither: plaintext.
  bool tls = false;
  rpc::TlsFiles tls_files;
  std::string tls_server_name;  // the name the certificate must carry, when not the address's host
  std::string api_key, api_key_file;  // else $DUET_API_KEY
};
int RunComplete(const CompleteOptions& options);

}  // namespace duet
