// UCX receiver: registered pools, completion notices (active messages) and leases.
#include <atomic>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kvtransfer/layer_copy_plan.h"
#include "kvtransfer/ucx_protocol.h"
#include "kvtransfer/ucx_transport.h"
#include "kvtransfer/ucx_worker.h"

namespace duet::kvtransfer {
namespace {

class UcxKvReceiver final : public KvReceiver {
 public:
  UcxKvReceiver(KvPoolMemory pools, ReceiverCallbacks callbacks, const UcxReceiverOptions& options)
      : pools_(std::move(pools)), device_(options.device), callbacks_(std::move(callbacks)),
        leases_(options.clock, [this](const ReleasedLease& lease) { OnLeaseReleased(lease); }) {}

  ~UcxKvReceiver() override {
    if (worker_ != nullptr) worker_->Stop([] {}, [] { return true; });
    std::vector<uint64_t> live;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, incoming] : incoming_) live.push_back(id);
    }
    for (uint64_t id : live) leases_.Release(id, LeaseEnd::kCancelled);
    regions_.clear();  // unmapped before the worker's context goes away
  }

  absl::Status Init(const UcxReceiverOptions& options) {
    UcxWorker::Options worker_options;
    worker_options.name = options.name;
    worker_options.tick_period = options.tick_period;
    DUET_ASSIGN_OR_RETURN(worker_, UcxWorker::Create(worker_options));

    ReceiverDescriptor descriptor;
    descriptor.layout = pools_.layout;
    descriptor.num_blocks = pools_.num_blocks;
    descriptor.host_id = options.host_id;
    if (device_ != nullptr) {
      DUET_ASSIGN_OR_RETURN(descriptor.device_export, device_->Export());
    }
    descriptor.worker_address = worker_->address();
    for (uint32_t layer = 0; layer < pools_.layout.num_layers; ++layer) {
      for (void* pool : {pools_.key_pools[layer], pools_.value_pools[layer]}) {
        DUET_ASSIGN_OR_RETURN(auto region, UcxMemoryRegion::Register(worker_->context(), pool,
                                                                   pools_.PoolBytes()));
        descriptor.regions.push_back({reinterpret_cast<uint64_t>(pool), pools_.PoolBytes(),
                                      region->packed_rkey()});
        regions_.push_back(std::move(region));
      }
    }
    descriptor_ = descriptor.Serialize();

    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                         UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = kNoticeAmId;
    handler.cb = &UcxKvReceiver::OnNoticeMessage;
    handler.arg = this;
    ucs_status_t status = ucp_worker_set_am_recv_handler(worker_->worker(), &handler);
    if (status != UCS_OK) return UcxError(status, "ucp_worker_set_am_recv_handler");

    // The receiver only reacts to incoming notices: it never needs to poll.
    worker_->Start([this] {
      leases_.ExpireDue();
      return false;
    });
    return absl::OkStatus();
  }

  const std::string& descriptor() const override { return descriptor_; }

  absl::Status Expect(ExpectedRequest request) override {
    // A request may land only in the device pools (no host blocks were free for it).
    if (!request.dst_block_ids.empty() || request.device_block_ids.empty()) {
      DUET_RETURN_IF_ERROR(ValidateBlockIds(pools_.layout, request.dst_block_ids, request.num_tokens,
                                          pools_.num_blocks, "destination"));
    }
    if (!request.device_block_ids.empty()) {
      if (device_ == nullptr) return absl::InvalidArgumentError("this KV receiver has no device pools");
      DUET_RETURN_IF_ERROR(ValidateBlockIds(device_->pools().layout, request.device_block_ids, request.num_tokens,
                                          device_->pools().num_blocks, "device destination"));
    }
    absl::MutexLock lock(&mu_);
    if (incoming_.contains(request.request_id)) {
      return absl::AlreadyExistsError(
          absl::StrFormat("request %u is already expected", request.request_id));
    }
    DUET_RETURN_IF_ERROR(
        leases_.Grant(request.request_id, request.dst_block_ids, request.lease_ttl));
    Incoming incoming;
    incoming.layer_received.assign(pools_.layout.num_layers, false);
    const uint64_t id = request.request_id;
    incoming.expected = std::move(request);
    incoming_.emplace(id, std::move(incoming));
    return absl::OkStatus();
  }

  bool Cancel(uint64_t request_id, CancelRelease release) override {
    if (release == CancelRelease::kAfterSender) {
      absl::MutexLock lock(&mu_);
      auto it = incoming_.find(request_id);
      if (it == incoming_.end()) return false;
      it->second.cancelled = true;
      // The sender's finish notice came (it has stopped writing); a complete request has ended.
      if (!it->second.finish_received) return true;
    }
    return leases_.Release(request_id, LeaseEnd::kCancelled);
  }

  size_t active_leases() const override { return leases_.size(); }

 private:
  struct Incoming {
    ExpectedRequest expected;
    std::vector<bool> layer_received;
    uint32_t layers_received = 0;
    bool finish_received = false;
    // Cancelled while the sender may still write (CancelRelease::kAfterSender): released, not
    // completed, once it has stopped.
    bool cancelled = false;
    std::optional<MemoryKind> landed;  // set by the first layer; every layer must agree
    absl::Status failure;  // why the lease ended with LeaseEnd::kFailed
  };

  static ucs_status_t OnNoticeMessage(void* arg, const void* header, size_t header_length,
                                      void* /*data*/, size_t /*length*/,
                                      const ucp_am_recv_param_t* /*param*/) {
    static_cast<UcxKvReceiver*>(arg)->HandleNotice(header, header_length);
    return UCS_OK;
  }

  void HandleNotice(const void* header, size_t header_length) {
    absl::StatusOr<Notice> notice = Notice::Parse(header, header_length);
    if (!notice.ok()) {
      // Not attributable to a request: nothing to fail. The lease deadline still bounds it.
      DUET_LOG(WARNING) << "dropping a malformed KV notice: " << notice.status();
      return;
    }
    switch (notice->type) {
      case NoticeType::kLayerDone:
        OnLayerDone(*notice);
        return;
      case NoticeType::kFinish: {
        bool complete = false, cancelled = false;
        {
          absl::MutexLock lock(&mu_);
          auto it = incoming_.find(notice->request_id);
          if (it == incoming_.end()) return;  // already ended (e.g. expired or cancelled)
          it->second.finish_received = true;
          complete = it->second.layers_received == pools_.layout.num_layers;
          cancelled = it->second.cancelled;
        }
        // The sender sends it after its last put has landed: a cancelled request's blocks are free.
        if (cancelled) {
          leases_.Release(notice->request_id, LeaseEnd::kCancelled);
        } else if (complete) {
          Complete(notice->request_id);
        }
        return;
      }
      case NoticeType::kAbort:
        leases_.Release(notice->request_id, LeaseEnd::kAborted);
        return;
    }
  }

  void OnLayerDone(const Notice& notice) {
    const uint64_t id = notice.request_id;
    absl::Status invalid;
    bool verify = false;
    std::vector<uint32_t> block_ids;
    absl::Duration ttl;
    const MemoryKind kind = (notice.flags & Notice::kDeviceData) ? MemoryKind::kDevice : MemoryKind::kHost;
    {
      absl::MutexLock lock(&mu_);
      auto it = incoming_.find(id);
      if (it == incoming_.end()) return;  // already ended: late notices are harmless
      const ExpectedRequest& expected = it->second.expected;
      if (notice.layer >= pools_.layout.num_layers) {
        invalid = absl::InvalidArgumentError(absl::StrFormat(
            "KV notice for request %u names layer %u of %u", id, notice.layer,
            pools_.layout.num_layers));
      } else if (notice.num_tokens != expected.num_tokens) {
        invalid = absl::InvalidArgumentError(absl::StrFormat(
            "KV notice for request %u layer %u carries %u tokens, %u were expected", id,
            notice.layer, notice.num_tokens, expected.num_tokens));
      } else if (expected.verify_checksums && !(notice.flags & Notice::kHasChecksums)) {
        invalid = absl::FailedPreconditionError(absl::StrFormat(
            "request %u asked for checksum verification but layer %u was sent without checksums",
            id, notice.layer));
      } else if (kind == MemoryKind::kDevice && expected.device_block_ids.empty()) {
        invalid = absl::InvalidArgumentError(absl::StrFormat(
            "KV notice for request %u says layer %u went to device pools, which the request has none of", id,
            notice.layer));
      } else if (kind == MemoryKind::kHost && expected.dst_block_ids.empty()) {
        invalid = absl::InvalidArgumentError(absl::StrFormat(
            "KV notice for request %u says layer %u went to host pools, which the request has none of", id,
            notice.layer));
      } else if (it->second.landed.has_value() && *it->second.landed != kind) {
        invalid = absl::InvalidArgumentError(
            absl::StrFormat("KV notices for request %u mix host and device pools", id));
      }
      if (invalid.ok()) it->second.landed = kind;
      verify = expected.verify_checksums;
      block_ids = kind == MemoryKind::kDevice ? expected.device_block_ids : expected.dst_block_ids;
      ttl = expected.lease_ttl;
    }
    if (!invalid.ok()) return Fail(id, invalid);

    if (verify) {
      // The sender flushed its puts (or saw its copies complete) before sending this notice, so
      // the bytes are in place.
      absl::StatusOr<std::pair<uint64_t, uint64_t>> hashes = LayerHashes(kind, notice, block_ids);
      if (!hashes.ok()) return Fail(id, hashes.status());
      const auto [key_hash, value_hash] = *hashes;
      if (key_hash != notice.key_checksum || value_hash != notice.value_checksum) {
        return Fail(id, absl::DataLossError(absl::StrFormat(
                            "KV checksum mismatch for request %u layer %u (%s)", id, notice.layer,
                            key_hash != notice.key_checksum ? "K" : "V")));
      }
    }

    bool complete = false;
    {
      absl::MutexLock lock(&mu_);
      auto it = incoming_.find(id);
      if (it == incoming_.end()) return;
      Incoming& incoming = it->second;
      if (!incoming.layer_received[notice.layer]) {
        incoming.layer_received[notice.layer] = true;
        ++incoming.layers_received;
      }
      complete = incoming.finish_received && !incoming.cancelled &&
                 incoming.layers_received == pools_.layout.num_layers;
    }
    (void)leases_.Renew(id, ttl);  // NotFound only if the lease ended meanwhile
    if (callbacks_.on_layer_received) callbacks_.on_layer_received(id, notice.layer);
    if (complete) Complete(id);
  }

  absl::StatusOr<std::pair<uint64_t, uint64_t>> LayerHashes(MemoryKind kind, const Notice& notice,
                                                             const std::vector<uint32_t>& block_ids) {
    if (kind == MemoryKind::kHost) {
      return std::pair{
          HashLayerTokens(pools_.layout, pools_.key_pools[notice.layer], block_ids, notice.num_tokens),
          HashLayerTokens(pools_.layout, pools_.value_pools[notice.layer], block_ids, notice.num_tokens)};
    }
    DUET_ASSIGN_OR_RETURN(uint64_t key, device_->HashLayer(true, notice.layer, block_ids, notice.num_tokens, nullptr));
    DUET_ASSIGN_OR_RETURN(uint64_t value,
                          device_->HashLayer(false, notice.layer, block_ids, notice.num_tokens, nullptr));
    return std::pair{key, value};
  }

  void Complete(uint64_t request_id) {
    if (!leases_.Commit(request_id).ok()) return;  // lost a race with expiry or cancel
    MemoryKind landed = MemoryKind::kHost;
    {
      absl::MutexLock lock(&mu_);
      auto it = incoming_.find(request_id);
      if (it != incoming_.end() && it->second.landed.has_value()) landed = *it->second.landed;
      incoming_.erase(request_id);
    }
    if (callbacks_.on_request_done) callbacks_.on_request_done(request_id, absl::OkStatus(), landed);
  }

  void Fail(uint64_t request_id, absl::Status failure) {
    {
      absl::MutexLock lock(&mu_);
      auto it = incoming_.find(request_id);
      if (it == incoming_.end()) return;
      it->second.failure = std::move(failure);
    }
    leases_.Release(request_id, LeaseEnd::kFailed);
  }

  // The lease table's release callback: runs exactly once per lease that ends unfinished.
  void OnLeaseReleased(const ReleasedLease& lease) {
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      auto it = incoming_.find(lease.request_id);
      DUET_CHECK(it != incoming_.end());
      status = EndStatus(lease, it->second);
      incoming_.erase(it);
    }
    callbacks_.on_blocks_released(lease);
    if (callbacks_.on_request_done) callbacks_.on_request_done(lease.request_id, status, MemoryKind::kHost);
  }

  // Why a request whose lease ended unfinished did not complete.
  absl::Status EndStatus(const ReleasedLease& lease, const Incoming& incoming) const {
    if (incoming.cancelled) {
      return absl::CancelledError(absl::StrFormat(
          "KV transfer of request %u was cancelled (its blocks released once the sender %s)", lease.request_id,
          lease.reason == LeaseEnd::kExpired ? "had timed out" : "had stopped"));
    }
    switch (lease.reason) {
      case LeaseEnd::kExpired:
        return absl::DeadlineExceededError(absl::StrFormat(
            "KV transfer of request %u did not finish before its lease expired (%u of %u "
            "layers received, finish %s)",
            lease.request_id, incoming.layers_received, pools_.layout.num_layers,
            incoming.finish_received ? "received" : "not received"));
      case LeaseEnd::kCancelled:
        return absl::CancelledError(absl::StrFormat("KV transfer of request %u was cancelled", lease.request_id));
      case LeaseEnd::kAborted:
        return absl::AbortedError(
            absl::StrFormat("KV transfer of request %u was aborted by the sender", lease.request_id));
      case LeaseEnd::kFailed:
        return incoming.failure;
    }
    return absl::InternalError("unknown lease end");
  }

  const KvPoolMemory pools_;
  DeviceKvMemory* const device_;  // null: host pools only
  const ReceiverCallbacks callbacks_;
  std::unique_ptr<UcxWorker> worker_;
  std::vector<std::unique_ptr<UcxMemoryRegion>> regions_;
  std::string descriptor_;
  LeaseTable leases_;

  absl::Mutex mu_;  // taken before the lease table's lock, never after
  absl::flat_hash_map<uint64_t, Incoming> incoming_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvReceiver>> CreateUcxKvReceiver(KvPoolMemory pools,
                                                                ReceiverCallbacks callbacks,
                                                                UcxReceiverOptions options) {
  DUET_RETURN_IF_ERROR(pools.Validate());
  if (options.device != nullptr) {
    DUET_RETURN_IF_ERROR(CheckCompatible(options.device->pools().layout, pools.layout).status());
  }
  if (!callbacks.on_blocks_released) {
    return absl::InvalidArgumentError("KV receiver needs an on_blocks_released callback");
  }
  auto receiver = std::make_unique<UcxKvReceiver>(std::move(pools), std::move(callbacks), options);
  DUET_RETURN_IF_ERROR(receiver->Init(options));
  return receiver;
}

}  // namespace duet::kvtransfer
