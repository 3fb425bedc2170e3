// The prefill worker's gRPC service (duet.v1.PrefillWorker): runs a prompt through the engine
// (batched with other prompts by the continuous-batching scheduler), samples the first token,
// and ships the prompt's KV blocks into the decode worker's reserved blocks over UCX layer by
// layer, as each layer is computed, so the transfer overlaps the rest of the forward pass.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "duet/v1/worker.grpc.pb.h"
#include "engine/engine_loop.h"
#include "engine/llm_engine.h"
#include "kvtransfer/kv_transport.h"
#include "kvtransfer/ucx_transport.h"
#include "metrics/registry.h"
#include "metrics/vllm_metrics.h"
#include "worker/worker_kv_pools.h"

namespace duet {

struct PrefillServiceOptions {
  // UCX sender options; keep operation_timeout below the decode worker's lease.
  kvtransfer::UcxSenderOptions sender;
  absl::Duration poll_period = absl::Milliseconds(50);
  // The model_name label of this worker's metrics; empty: the model directory's base name.
  std::string model_name;
  // Host staging of a device KV cache (worker_kv_pools.h).
  WorkerKvPoolOptions kv_pools;
};

class PrefillService final : public v1::PrefillWorker::Service {
 public:
  // Takes the engine, registers its KV pools with a UCX sender and starts the engine thread.
  static absl::StatusOr<std::unique_ptr<PrefillService>> Create(std::unique_ptr<LlmEngine> engine,
                                                                PrefillServiceOptions options = {});
  ~PrefillService() override;

  grpc::Status Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::WorkerAbortRequest* request,
                     v1::WorkerAbortResponse* response) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest* request,
                        v1::WorkerStats* response) override;

  // Prometheus metrics (role "prefill"): RenderMetrics refreshes the scheduler gauges (running,
  // waiting, KV usage) and the preemption counter from the engine, then renders the text
  // exposition; serve it with metrics::HttpExporter. Thread-safe.
  std::string RenderMetrics() ABSL_LOCKS_EXCLUDED(metrics_mu_);
  void RefreshMetrics() ABSL_LOCKS_EXCLUDED(metrics_mu_);
  const metrics::DuetMetrics& metrics() const { return *metrics_; }

 private:
  // One Prefill call's KV shipment. Fields below `peer` are touched on the loop thread only.
  struct Transfer {
    uint64_t transfer_id = 0;
    kvtransfer::PeerId peer = 0;
    std::vector<uint32_t> dst_block_ids;
    // Loop thread only.
    bool sending = false;   // the prompt's final chunk is being computed and shipped
    bool done = false;      // Finish resolved: `status` is the outcome
    uint32_t num_tokens = 0;
    std::vector<uint32_t> src_block_ids;   // what SendLayer reads: cache blocks, or staging blocks
    std::vector<int32_t> cache_block_ids;  // with staging: the cache blocks staged each layer
    std::vector<int32_t> staging_block_ids;
    absl::Status status = absl::OkStatus();
    std::chrono::steady_clock::time_point send_start{};  // the first SendLayer
  };

  PrefillService(std::unique_ptr<LlmEngine> engine, std::unique_ptr<kvtransfer::KvSender> sender,
                 std::unique_ptr<KvHostStaging> staging, PrefillServiceOptions options);

  // Ends a transfer whose Finish will not be called: tells the decode worker to drop it.
  void FailTransfer(Transfer& t, absl::Status why);
  void FreeStaging(Transfer& t);

  // The engine's per-layer hook (loop thread, inside the forward pass).
  void OnLayerDone(int64_t layer, absl::Span<const SequenceChunk> chunks);
  absl::StatusOr<kvtransfer::PeerId> PeerFor(const std::string& descriptor) ABSL_LOCKS_EXCLUDED(peers_mu_);
  // Drops a failed peer so the next Prefill to that decode worker connects again.
  void ForgetPeer(const std::string& descriptor, kvtransfer::PeerId peer) ABSL_LOCKS_EXCLUDED(peers_mu_);

  const PrefillServiceOptions options_;
  const int32_t block_size_;
  const int64_t num_layers_;
  int64_t kv_token_bytes_ = 0;  // K and V of one token over all layers

  // Before loop_: the engine thread's callbacks use them until the loop stops.
  metrics::Registry metrics_registry_;
  std::unique_ptr<metrics::DuetMetrics> metrics_;
  absl::Mutex metrics_mu_;
  int64_t preemptions_seen_ ABSL_GUARDED_BY(metrics_mu_) = 0;

  absl::Mutex peers_mu_;
  std::map<std::string, kvtransfer::PeerId> peers_ ABSL_GUARDED_BY(peers_mu_);

  // Loop thread only: transfers keyed by the engine's sequence id.
  std::map<SequenceId, std::shared_ptr<Transfer>> transfers_;
  bool stopping_ = false;  // loop thread only

  // The sender reads the engine's pools (or the staging): created before and destroyed after the
  // loop's thread has stopped using it (see the destructor); the engine itself lives in loop_.
  std::unique_ptr<KvHostStaging> staging_;  // null when the cache's own pools are sent
  std::unique_ptr<kvtransfer::KvSender> sender_;
  std::unique_ptr<EngineLoop> loop_;
};

}  // namespace duet
