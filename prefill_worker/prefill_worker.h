// The prefill worker process: an engine, the PrefillWorker gRPC service (with health checking and
// reflection) and a UCX KV sender. `duet prefill-worker` runs this.
#pragma once

#include <string>

#include "engine/llm_engine.h"
#include "prefill_worker/prefill_service.h"

namespace duet {

struct PrefillWorkerOptions {
  // model_dir, block_size, num_kv_blocks / kv_cache_bytes, and scheduler.{max_num_seqs,
  // max_num_batched_tokens, max_model_len}.
  EngineConfig engine;
  std::string host = "127.0.0.1";
  int port = 0;  // 0: a free port
  // Prometheus /metrics on this port (same host): -1 off, 0 a free port. When on, the line
  // `DUET_METRICS_READY port=<port>` is printed before DUET_READY.
  int metrics_port = -1;
  PrefillServiceOptions service;
};

// Builds the engine, starts the service (and the metrics exporter when metrics_port >= 0,
// printing `DUET_METRICS_READY port=<port>` first), prints exactly one line
// `DUET_READY port=<port>` to stdout, then serves until SIGINT or SIGTERM and shuts down. Returns the process exit code
// (0 after a signal; 1 if start-up failed, with the reason on stderr).
// Blocks SIGINT/SIGTERM in the calling thread (and so in every thread it starts); call it from
// the main thread before starting other threads.
int RunPrefillWorker(const PrefillWorkerOptions& options);

}  // namespace duet
