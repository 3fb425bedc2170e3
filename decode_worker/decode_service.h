// The decode worker's gRPC service (duet.v1.DecodeWorker): reserves KV blocks for a prompt that a
// prefill worker writes (over UCX into host pools, or with CUDA IPC straight into the device
// cache), then joins the request to the continuous batch with those
// blocks and the first token, and streams tokens back.
//
// A reservation's blocks always return to the engine exactly once: when Decode claims them (they
// become the request's, freed when it finishes or is aborted), or when the reservation ends
// unclaimed (transfer failed or aborted, lease expired, Abort, or a completed transfer that no
// Decode call claims within its lease).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "duet/v1/worker.grpc.pb.h"
#include "common/serial_executor.h"
#include "engine/engine_loop.h"
#include "engine/llm_engine.h"
#include "kvtransfer/kv_transport.h"
#include "kvtransfer/ucx_transport.h"
#include "metrics/registry.h"
#include "metrics/vllm_metrics.h"
#include "worker/deadline_timer.h"
#include "worker/worker_kv_pools.h"

namespace duet {

struct DecodeServiceOptions {
  // Lease for a ReserveKv call that gives none (lease_ms <= 0), and the longest one granted.
  absl::Duration default_lease = absl::Seconds(30);
  absl::Duration max_lease = absl::Minutes(5);
  // The model_name label of this worker's metrics; empty: the model directory's base name.
  std::string model_name;
  // Host staging of a device KV cache: transfers land there and are copied into the reserved
  // cache blocks when complete (worker_kv_pools.h).
  WorkerKvPoolOptions kv_pools;
  // Ask the prefill worker for K/V checksums with every layer and verify them.
  bool verify_kv_checksums = false;
  // Non-empty: every KV target ReserveKv grants is signed with this key (rpc/kv_target_auth.h).
  std::string kv_target_key;
  // Live KV migration on drain: StartDraining parks the decoding requests (worker.proto,
  // MigrateKv). Off: they finish here.
  bool park_on_drain = true;
  // The sender MigrateKv ships parked KV with (host paths).
  kvtransfer::UcxSenderOptions sender;
};


// On gRPC's callback API: no thread per call. Engine work runs on the engine thread, which
// answers ReserveKv and Abort and hands each Decode stream its outputs; a Decode call waiting
// for its transfer is woken by the receiver's callback (or its deadline, on the timer thread).
class DecodeService final : public v1::DecodeWorker::CallbackService {
 public:
  using Options = DecodeServiceOptions;

  // Takes the engine, registers its KV pools with a UCX receiver and starts the engine thread.
  static absl::StatusOr<std::unique_ptr<DecodeService>> Create(std::unique_ptr<LlmEngine> engine,
                                                               DecodeServiceOptions options = {});
  ~DecodeService() override;

  grpc::ServerUnaryReactor* ReserveKv(grpc::CallbackServerContext* context, const v1::ReserveKvRequest* request,
                                      v1::ReserveKvResponse* response) override;
  grpc::ServerWriteReactor<v1::GenerateResponse>* Decode(grpc::CallbackServerContext* context,
                                                         const v1::DecodeRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context, const v1::WorkerAbortRequest* request,
                                  v1::WorkerAbortResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context, const v1::GetStatsRequest* request,
                                     v1::WorkerStats* response) override;
  grpc::ServerUnaryReactor* MigrateKv(grpc::CallbackServerContext* context, const v1::MigrateKvRequest* request,
                                      v1::MigrateKvResponse* response) override;

  // The worker drains (new work is refused, prefill_here Decode calls included): with
  // park_on_drain, every decoding request leaves the batch with its KV as a parked reservation,
  // and its stream ends with kKvParkedTrailer so the router moves it (MigrateKv) or resumes it
  // here. Any thread.
  void StartDraining();

  const std::string& receiver_descriptor() const { return receiver_->descriptor(); }

  // Prometheus metrics (role "decode"): RenderMetrics refreshes the scheduler gauges
  // (running, waiting, KV usage) and the preemption counter from the engine, then renders the
  // text exposition; serve it with metrics::HttpExporter. Thread-safe.
  std::string RenderMetrics() ABSL_LOCKS_EXCLUDED(metrics_mu_);
  void RefreshMetrics() ABSL_LOCKS_EXCLUDED(metrics_mu_);
  EngineStats engine_stats() const { return loop_->Stats(); }  // the engine's counters, from any thread
  const metrics::DecodeMetrics& metrics() const { return *metrics_; }

 private:
  class DecodeCall;     // the reactor of one Decode stream
  class ReserveKvCall;  // the reactor of one ReserveKv

  enum class ReservationState {
    kTransferring,  // lease held by the receiver; the prefill worker is writing the blocks
    kReceived,      // every layer arrived; waiting for Decode to claim the blocks
    kShipping,      // parked; MigrateKv is sending the blocks to another decode worker
    kClaimed,       // Decode took the blocks (they now belong to its request)
    kEnded,         // ended unclaimed; `failure` says why; blocks released
  };
  struct Reservation {
    std::string request_id;
    uint64_t transfer_id = 0;
    SequenceId seq = 0;
    int32_t num_tokens = 0;
    // Prefix caching: tokens [0, first_token) were already cached here; only the rest move.
    int32_t first_token = 0;
    std::vector<int32_t> cached_prefix;  // those tokens' ids: the Decode call's prompt must begin with them
    absl::Duration lease;
    // Guarded by DecodeService::mu_.
    ReservationState state = ReservationState::kTransferring;
    absl::Status failure;
    DeadlineTimer::Id claim_timer = 0;  // once kReceived: ends it unclaimed at the lease's end
    // Cancelled while kTransferring: why. A transfer that completes meanwhile (the receiver had
    // committed the lease, and the copy out of staging was under way) ends instead of waiting.
    std::optional<absl::Status> cancelled;
    // The Decode call waiting for the transfer: told once the state leaves kTransferring.
    std::function<void()> on_settled;
    bool owns_blocks = true;  // the reservation (not a request) still holds its engine blocks
    std::vector<int32_t> cache_blocks;    // the engine blocks the transfer fills (from first_token on)
    std::vector<int32_t> staging_blocks;  // with staging: where the transfer lands
    // A request this worker parked (live KV migration): its blocks hold the KV of
    // `cached_prefix`, its prompt and its output but the last token.
    bool parked = false;
  };

  DecodeService(std::unique_ptr<LlmEngine> engine, DecodeServiceOptions options);

  // ReserveKv on the engine thread: the blocks, the staging, the receiver's lease. On OK, `made`
  // is the reservation.
  grpc::Status Reserve(LlmEngine& engine, const v1::ReserveKvRequest& request, v1::ReserveKvResponse* response,
                       std::shared_ptr<Reservation>* made) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<Reservation>> NewReservation(LlmEngine& engine, const v1::ReserveKvRequest& request);
  // Files `r` under its transfer and request ids; AlreadyExists for a transfer id in use.
  absl::Status Register(const std::shared_ptr<Reservation>& r) ABSL_LOCKS_EXCLUDED(mu_);

  // Receiver callbacks (receiver progress thread, or the caller of receiver_->Cancel).
  void OnRequestDone(uint64_t transfer_id, const absl::Status& status, kvtransfer::MemoryKind landed)
      ABSL_LOCKS_EXCLUDED(mu_);
  void OnBlocksReleased(uint64_t transfer_id, const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Copies a transfer that landed in staging into its cache blocks; false if it is no longer
  // awaited. Receiver progress thread.
  bool Unstage(uint64_t transfer_id, kvtransfer::MemoryKind landed, absl::Status* unstaged) ABSL_LOCKS_EXCLUDED(mu_);
  // The transfer is complete: the blocks wait for their Decode call until the lease ends.
  void MarkReceivedLocked(const std::shared_ptr<Reservation>& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpireClaim(const std::shared_ptr<Reservation>& r) ABSL_LOCKS_EXCLUDED(mu_);

  // Ends `r` unclaimed: returns its blocks to the engine (once), forgets it, tells its waiter.
  void EndLocked(Reservation& r, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `r` whatever its state: cancels its lease at the receiver, or releases its blocks.
  // While its transfer may be under way the blocks go back only once the sender has stopped
  // writing into them (kAfterSender), unless nothing can write into them any more (kNow: the
  // router never handed its target on, or its sender is gone). Returns false if it had already
  // ended or been claimed.
  bool CancelReservation(const std::shared_ptr<Reservation>& r, absl::Status why,
                         kvtransfer::KvReceiver::CancelRelease release =
                             kvtransfer::KvReceiver::CancelRelease::kAfterSender) ABSL_LOCKS_EXCLUDED(mu_);
  // For a Decode call: kReceived becomes kClaimed (the blocks are the call's now); otherwise why
  // the reservation ended.
  absl::Status Claim(Reservation& r) ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetLocked(const Reservation& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<Reservation> FindByTransfer(uint64_t transfer_id) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<Reservation> FindByRequest(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Engine thread: the transfer the streaming request `request_id` decodes from (0: none, or
  // it prefilled here).
  uint64_t StreamTransfer(const std::string& request_id) const;

  // ---- Live KV migration (decode_service_migration.cpp) ----
  // Engine thread: the request leaves the batch as a parked reservation, whose transfer id this
  // returns; FailedPrecondition if it is not decoding (it finishes here).
  absl::StatusOr<uint64_t> Park(LlmEngine& engine, const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t NewParkedTransferId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Engine thread: copies (when staged) and sends the parked blocks of `r` from `first_token` on
  // to `target` over `peer`; `done` runs when the sender has finished (its thread).
  void Ship(LlmEngine& engine, const std::shared_ptr<Reservation>& r, const v1::KvTarget& target,
            kvtransfer::PeerId peer, std::function<void(absl::Status)> done);
  // After a failed shipment: parked again, for a resume here or another MigrateKv.
  void Unship(const std::shared_ptr<Reservation>& r) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<kvtransfer::PeerId> PeerFor(const std::string& descriptor) ABSL_LOCKS_EXCLUDED(peers_mu_);

  const DecodeServiceOptions options_;
  const int32_t block_size_;

  // Before loop_: the engine thread's callbacks use them until the loop stops.
  metrics::Registry metrics_registry_;
  std::unique_ptr<metrics::DecodeMetrics> metrics_;
  absl::Mutex metrics_mu_;
  EngineStats recorded_stats_ ABSL_GUARDED_BY(metrics_mu_);
  SpecDecodeStats spec_seen_ ABSL_GUARDED_BY(metrics_mu_);  // spec-decode counters already exported

  // Starts the streams' writes that the engine thread's outputs queue (gRPC may write to the
  // socket inline in StartWrite: ~10 µs an output, which the GPU would wait through between
  // steps). Before loop_, whose callbacks post to it.
  SerialExecutor stream_writer_;

  std::unique_ptr<EngineLoop> loop_;

  absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<Reservation>> by_transfer_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> transfer_by_request_ ABSL_GUARDED_BY(mu_);
  // The streams whose requests are in the batch (engine thread only): what StartDraining parks.
  std::map<std::string, std::shared_ptr<DecodeCall>> streaming_;
  bool parking_ = false;  // engine thread only: draining with park_on_drain; calls that join now park
  std::atomic<bool> draining_{false};  // prefill_here calls are refused (new work, as ReserveKv is)
  absl::Mutex peers_mu_;
  std::map<std::string, kvtransfer::PeerId> peers_ ABSL_GUARDED_BY(peers_mu_);  // MigrateKv's destinations

  std::unique_ptr<KvHostStaging> staging_;  // null when transfers land in the cache's own pools
  // A device cache's pools, offered to prefill workers on this host (CUDA IPC); null otherwise.
  std::unique_ptr<kvtransfer::DeviceKvMemory> device_kv_;
  // Claim and transfer-wait deadlines; stopped first in the destructor.
  DeadlineTimer timer_;
  // Last: destroyed first, while the engine (its pools), the staging and the maps above exist.
  std::unique_ptr<kvtransfer::KvSender> sender_;
  std::unique_ptr<kvtransfer::KvReceiver> receiver_;
};

}  // namespace duet
