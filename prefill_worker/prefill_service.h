// The prefill worker's gRPC service (duet.v1.PrefillWorker): runs a prompt through the engine
// (batched with other prompts by the continuous-batching scheduler), samples the first token,
// and ships the prompt's KV blocks into the decode worker's reserved blocks layer by layer, as
// each layer is computed, so the transfer overlaps the rest of the forward pass. The path is the
// sender's choice per decode worker (kvtransfer::TransferPath): CUDA IPC from the device cache
// straight into the decode worker's, or host staging over UCX shared memory or the network.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
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
  // The model_name label of this worker's metrics; empty: the model directory's base name.
  std::string model_name;
  // Host staging the prompts' KV is copied into, layer by layer, and sent from on the host paths
  // (worker_kv_pools.h; always on here: force_staging is implied).
  WorkerKvPoolOptions kv_pools;
  // Send K/V checksums with every layer (the decode worker verifies them when it asks to).
  bool verify_kv_checksums = false;
  // Non-empty: a Prefill's KV target must carry a decode worker's authenticator under this key
  // (rpc/kv_target_auth.h), or the call is refused before anything is written.
  std::string kv_target_key;
};

// On gRPC's callback API: no thread per call, and the engine thread never waits on the network.
// Each layer's K/V is copied into host staging as the forward pass produces it and handed to the
// sender, so the engine can free and reuse the cache blocks right after the step; the Prefill
// reply goes out from the sender's completion callback. A prompt takes its staging when admitted:
// prompts wait, in order, while the staging is full.
class PrefillService final : public v1::PrefillWorker::CallbackService {
 public:
  using Options = PrefillServiceOptions;

  // Takes the engine, registers its KV staging with a UCX sender and starts the engine thread.
  static absl::StatusOr<std::unique_ptr<PrefillService>> Create(std::unique_ptr<LlmEngine> engine,
                                                                PrefillServiceOptions options = {});
  ~PrefillService() override;

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context, const v1::PrefillRequest* request,
                                    v1::PrefillResponse* response) override;
  grpc::ServerUnaryReactor* SetKvTarget(grpc::CallbackServerContext* context, const v1::SetKvTargetRequest* request,
                                        v1::SetKvTargetResponse* response) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::WorkerAbortRequest* request,
                                  v1::WorkerAbortResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context, const v1::GetStatsRequest* request,
                                     v1::WorkerStats* response) override;

  // Prometheus metrics (role "prefill"): RenderMetrics refreshes the scheduler gauges (running,
  // waiting, KV usage) and the preemption counter from the engine, then renders the text
  // exposition; serve it with metrics::HttpExporter. Thread-safe.
  std::string RenderMetrics() ABSL_LOCKS_EXCLUDED(metrics_mu_);
  void RefreshMetrics() ABSL_LOCKS_EXCLUDED(metrics_mu_);
  EngineStats engine_stats() const { return loop_->Stats(); }  // the engine's counters, from any thread
  const metrics::PrefillMetrics& metrics() const { return *metrics_; }

 private:
  class PrefillCall;  // the reactor of one Prefill call

  // One Prefill call's KV shipment: started by the engine thread at the first layer of the step
  // that completes the prompt, ended by the sender's completion (or a local failure). A late
  // target (PrefillRequest.target_follows) starts it at the layer during which the target arrives
  // (the layers before are sent at once), or after the forward pass from the blocks the engine
  // kept for it.
  // Where a shipment goes: a decode worker's KV target, checked and connected to.
  struct Destination {
    std::string receiver_descriptor;
    uint64_t transfer_id = 0;
    kvtransfer::PeerId peer = 0;
    kvtransfer::TransferPath path = kvtransfer::TransferPath::kUcxNetwork;
    bool device() const { return path == kvtransfer::TransferPath::kCudaIpc; }
    std::vector<uint32_t> dst_block_ids;
    // Prefix caching: the decode worker holds tokens [0, first_token); only the rest are sent.
    uint32_t first_token = 0;
  };
  struct Transfer {
    enum class Stage { kUnsent, kSending, kEnded };
    std::string request_id;
    bool late = false;        // PrefillRequest.target_follows
    uint32_t prompt_len = 0;  // the step whose chunk ends here completes the prompt and ships it
    // Set before the engine thread sees the transfer, or (a late target) before `target_ready`.
    Destination to;
    std::vector<int32_t> staging_block_ids;  // taken at admission, freed when the shipment ends
    std::shared_ptr<PrefillCall> call;       // told how the shipment ended
    // A late target: `target_ready` once `to` and the staging are set (true from the start
    // otherwise); `dropped` once the shipment ended before it came, which its thread then tells
    // the decode worker. Both change under target_mu.
    absl::Mutex target_mu;
    std::atomic<bool> target_ready{true};
    bool dropped ABSL_GUARDED_BY(target_mu) = false;
    // Engine thread only, until the stage is kEnded.
    Stage stage = Stage::kUnsent;
    bool abandoned = false;  // aborted while its forward pass ran: nothing is kept for a late target
    uint32_t num_tokens = 0;               // tokens sent: [to.first_token, prompt length)
    std::vector<int32_t> cache_block_ids;  // their blocks, staged into staging_block_ids layer by layer
    std::chrono::steady_clock::time_point send_start{};  // the first SendLayer
    std::optional<SequenceId> kept_kv;     // the prompt's blocks, kept after the forward pass
  };

  PrefillService(std::unique_ptr<LlmEngine> engine, std::unique_ptr<kvtransfer::KvSender> sender,
                 std::unique_ptr<KvHostStaging> staging, std::unique_ptr<kvtransfer::DeviceKvMemory> device_kv,
                 PrefillServiceOptions options);

  // Admission: a prompt's staging now, or a place in the queue until a shipment frees some.
  void Admit(const std::shared_ptr<PrefillCall>& call) ABSL_LOCKS_EXCLUDED(admission_mu_);
  void AdmitWaiting() ABSL_LOCKS_EXCLUDED(admission_mu_);
  // Takes a call out of the queue; null if no waiting call has that request id.
  std::shared_ptr<PrefillCall> LeaveAdmission(const std::string& request_id) ABSL_LOCKS_EXCLUDED(admission_mu_);

  // The engine's per-layer hook (engine thread, inside the forward pass).
  void OnLayerDone(int64_t layer, absl::Span<const SequenceChunk> chunks);
  // `block_table`: the prompt's blocks in the cache.
  bool BeginShipment(const std::shared_ptr<Transfer>& t, absl::Span<const int32_t> block_table);
  // Layers [first_layer, first_layer + num_layers), complete on the engine's stream: one send.
  void ShipLayers(const std::shared_ptr<Transfer>& t, int64_t first_layer, int64_t num_layers);
  // Engine thread. The forward pass ended before a late target came: the engine keeps the prompt's
  // blocks (`kept`) until ShipKept has sent them or DropKept gives up on them.
  void KeepForLateTarget(LlmEngine& engine, const std::shared_ptr<Transfer>& t, SequenceId kept);
  void ShipKept(LlmEngine& engine, const std::shared_ptr<Transfer>& t);
  void DropKept(LlmEngine& engine, const std::string& request_id);
  void ReleaseKept(LlmEngine& engine, const std::shared_ptr<Transfer>& t);
  // A late target for `t`, resolved (peer, path, blocks) and with its staging: the engine thread
  // ships from the next layer or from the kept blocks. False when the shipment already ended.
  bool PublishTarget(const std::shared_ptr<Transfer>& t, const Destination& to, std::vector<int32_t> staging);
  // Late targets: calls waiting for theirs, and targets that came before their call (the latest
  // kMaxUnclaimedTargets; the router aborts with the target should the call never come).
  void AwaitTarget(const std::shared_ptr<PrefillCall>& call) ABSL_LOCKS_EXCLUDED(late_mu_);
  std::shared_ptr<PrefillCall> TakeWaitingCall(const std::string& request_id, const v1::KvTarget* unclaimed)
      ABSL_LOCKS_EXCLUDED(late_mu_);
  // The target that came before the call `request_id`, if one did (taken: no longer held).
  std::optional<v1::KvTarget> TakeUnclaimedTarget(const std::string& request_id) ABSL_LOCKS_EXCLUDED(late_mu_);
  void StopAwaitingTarget(const std::string& request_id) ABSL_LOCKS_EXCLUDED(late_mu_);
  // Ends a shipment: after the layers in flight when some were sent, telling the decode worker to
  // drop the blocks unless it succeeded. `why` OK: it should have succeeded.
  void FinishShipment(const std::shared_ptr<Transfer>& t, absl::Status why);
  // The request finished without shipping (aborted, failed before its step).
  void DropShipment(const std::shared_ptr<Transfer>& t);
  // Any thread, once per shipment: frees its staging, counts it, tells its call.
  void EndShipment(const std::shared_ptr<Transfer>& t, const absl::Status& status, bool count_failure);

  absl::StatusOr<kvtransfer::PeerId> PeerFor(const std::string& descriptor) ABSL_LOCKS_EXCLUDED(peers_mu_);
  // Drops a failed peer so the next Prefill to that decode worker connects again. Any thread: the
  // endpoint is closed by the next PeerFor (Disconnect must not run on the sender's thread).
  void ForgetPeer(const std::string& descriptor, kvtransfer::PeerId peer) ABSL_LOCKS_EXCLUDED(peers_mu_);

  const PrefillServiceOptions options_;
  const int32_t block_size_;
  const int64_t num_layers_;
  void* const device_stream_;   // the engine's cache stream (device caches), where IPC copies go
  const EngineConfig::SequenceParallel sequence_parallel_;  // reported in GetStats for routing
  int64_t kv_token_bytes_ = 0;  // K and V of one token over all layers
  std::array<std::atomic<int64_t>, 4> transfers_by_path_{};  // shipped requests, by TransferPath

  // Before loop_: the engine thread's callbacks use them until the loop stops.
  metrics::Registry metrics_registry_;
  std::unique_ptr<metrics::PrefillMetrics> metrics_;
  absl::Mutex metrics_mu_;
  EngineStats recorded_stats_ ABSL_GUARDED_BY(metrics_mu_);

  absl::Mutex peers_mu_;
  std::map<std::string, kvtransfer::PeerId> peers_ ABSL_GUARDED_BY(peers_mu_);
  std::vector<kvtransfer::PeerId> forgotten_peers_ ABSL_GUARDED_BY(peers_mu_);  // to disconnect

  absl::Mutex admission_mu_;
  std::deque<std::shared_ptr<PrefillCall>> waiting_ ABSL_GUARDED_BY(admission_mu_);

  // Engine thread only: transfers keyed by the engine's sequence id; those whose forward pass
  // ended before their late target came, keyed by request id.
  std::map<SequenceId, std::shared_ptr<Transfer>> transfers_;
  std::map<std::string, std::shared_ptr<Transfer>> kept_transfers_;

  static constexpr size_t kMaxUnclaimedTargets = 1024;
  absl::Mutex late_mu_;
  std::map<std::string, std::shared_ptr<PrefillCall>> awaiting_target_ ABSL_GUARDED_BY(late_mu_);
  std::map<std::string, v1::KvTarget> unclaimed_targets_ ABSL_GUARDED_BY(late_mu_);
  std::deque<std::string> unclaimed_order_ ABSL_GUARDED_BY(late_mu_);
  // Engine thread only: requests aborted here while unknown (their Prefill call not arrived, or
  // over), the latest kMaxAbortedUnknown: a Prefill for one that arrives after its Abort ships
  // nothing, since the decode worker has been told its blocks are free.
  static constexpr size_t kMaxAbortedUnknown = 4096;
  std::deque<std::string> aborted_unknown_order_;
  absl::flat_hash_set<std::string> aborted_unknown_;
  // Engine thread: `id` aborted while unknown here; tells the decode worker holding `target` (when
  // it is one a decode worker granted) that no Prefill from here will write into it.
  void AbortUnknown(const std::string& id, const v1::KvTarget* target);
  bool stopping_ = false;  // engine thread only

  // The sender reads the staging and the device pools: created before and destroyed after the
  // engine thread has stopped using them (see the destructor); the engine itself lives in loop_.
  std::unique_ptr<kvtransfer::DeviceKvMemory> device_kv_;
  std::unique_ptr<KvHostStaging> staging_;
  std::unique_ptr<kvtransfer::KvSender> sender_;
  std::unique_ptr<EngineLoop> loop_;
};

}  // namespace duet
