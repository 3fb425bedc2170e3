// UCX sender: endpoints to receivers, RMA puts of layer block ranges, flush, notices, timeouts.
//
// Everything after the public entry points runs on the progress thread, so the state below needs
// no lock (except the peers' paths and device mappings, which the callers' threads read). A layer
// send is a small state machine driven by UCX completions:
//   host paths: puts issued (fire and forget) -> ep flush (remote completion) -> notice sent;
//   kCudaIpc:   copies enqueued on the producer's stream by SendLayer -> the stream passes them
//               (reported once per request, after Finish) -> notice sent.
#include <algorithm>
#include <atomic>
#include <memory>
#include <span>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kvtransfer/layer_copy_plan.h"
#include "kvtransfer/ucx_protocol.h"
#include "kvtransfer/ucx_transport.h"
#include "kvtransfer/ucx_worker.h"

namespace duet::kvtransfer {
namespace {

class UcxKvSender final : public KvSender {
 public:
  UcxKvSender(KvPoolMemory pools, const UcxSenderOptions& options)
      : pools_(std::move(pools)), options_(options) {}

  ~UcxKvSender() override {
    if (worker_ == nullptr) return;
    {
      // Stream callbacks still to come post to the worker: wait for them first.
      absl::MutexLock lock(&device_mu_);
      device_mu_.Await(absl::Condition(
          +[](int* pending) { return *pending == 0; }, &device_callbacks_pending_));
    }
    worker_->Stop(
        [this] {
          std::vector<PeerId> ids;
          for (const auto& [id, peer] : peers_) ids.push_back(id);
          for (PeerId id : ids) FailPeer(id, absl::CancelledError("KV sender is shutting down"));
        },
        [this] { return ucx_calls_in_flight_ == 0; });
    regions_.clear();  // unmapped before the worker's context goes away
    absl::MutexLock lock(&device_mu_);
    device_peers_.clear();  // each waits for the copies it enqueued
  }

  absl::Status Init() {
    UcxWorker::Options worker_options;
    worker_options.name = options_.name;
    worker_options.tick_period = options_.tick_period;
    DUET_ASSIGN_OR_RETURN(worker_, UcxWorker::Create(worker_options));
    for (uint32_t layer = 0; layer < pools_.layout.num_layers; ++layer) {
      for (void* pool : {pools_.key_pools[layer], pools_.value_pools[layer]}) {
        DUET_ASSIGN_OR_RETURN(auto region, UcxMemoryRegion::Register(worker_->context(), pool,
                                                                   pools_.PoolBytes()));
        regions_.push_back(std::move(region));
      }
    }
    worker_->Start([this] {
      FailTimedOutPeers();
      return !ops_.empty() || ucx_calls_in_flight_ > 0;
    });
    return absl::OkStatus();
  }

  absl::StatusOr<PeerId> Connect(std::string_view receiver_descriptor) override {
    DUET_ASSIGN_OR_RETURN(ReceiverDescriptor remote, ReceiverDescriptor::Parse(receiver_descriptor));
    DUET_RETURN_IF_ERROR(CheckCompatible(pools_.layout, remote.layout).status());
    const PeerId id = next_peer_id_++;
    const TransferPath path = ChoosePath(id, remote);
    auto op = NewOp(OpKind::kConnect, id, /*request_id=*/0, NoticeType::kLayerDone);
    std::future<absl::Status> connected = op->done.get_future();
    // Only network endpoints can ask UCX to watch the peer (see HostTransport).
    const bool detect_peer_failure = path == TransferPath::kUcxNetwork ||
                                     options_.host_transport == HostTransport::kNetwork;
    worker_->Post([this, op = op.release(), remote = std::move(remote), detect_peer_failure]() mutable {
      StartConnect(std::unique_ptr<Op>(op), std::move(remote), detect_peer_failure);
    });
    if (absl::Status status = connected.get(); !status.ok()) {
      Disconnect(id);
      return status;
    }
    return id;
  }

  void Disconnect(PeerId peer) override {
    worker_->Call([&] {
      FailPeer(peer, absl::CancelledError(absl::StrFormat("KV peer %u was disconnected", peer)));
      peers_.erase(peer);
      return true;
    });
    std::shared_ptr<DeviceKvPeer> mapping;
    {
      absl::MutexLock lock(&device_mu_);
      paths_.erase(peer);
      if (auto it = device_peers_.find(peer); it != device_peers_.end()) {
        mapping = std::move(it->second);
        device_peers_.erase(it);
      }
    }
    // `mapping` closes here, once the copies it enqueued are done.
  }

  TransferPath path(PeerId peer) const override {
    absl::MutexLock lock(&device_mu_);
    auto it = paths_.find(peer);
    return it == paths_.end() ? TransferPath::kUcxNetwork : it->second;
  }

  std::future<absl::Status> SendLayer(PeerId peer, LayerSend send) override {
    // Each layer an op with its own notice; the call's future hears from all of them.
    auto group = std::make_shared<LayerGroup>();
    std::future<absl::Status> future = group->done.get_future();
    // An op per layer, at most the model's count: a range past the model fails validation below.
    const uint32_t num_ops = std::clamp<uint32_t>(send.num_layers, 1, pools_.layout.num_layers);
    {
      absl::MutexLock lock(&group->mu);
      group->remaining = num_ops;
    }
    std::vector<std::unique_ptr<Op>> ops;
    for (uint32_t i = 0; i < num_ops; ++i) {
      ops.push_back(NewOp(OpKind::kLayer, peer, send.request_id, NoticeType::kLayerDone));
      ops.back()->notice.layer = send.layer + i;
      ops.back()->notice.num_tokens = send.num_tokens;
      ops.back()->on_done = [group](const absl::Status& status) { group->End(status); };
    }
    if (std::shared_ptr<DeviceKvPeer> device = DevicePeer(peer); device != nullptr) {
      // Enqueued here, on the caller's thread, so the copies sit right behind the layers' work.
      absl::Status local = EnqueueDeviceLayers(*device, peer, send, ops);
      worker_->Post([this, ops = Shared(std::move(ops)), local] {
        for (std::unique_ptr<Op>& op : *ops) StartDeviceLayer(std::move(op), local);
      });
      return future;
    }
    absl::Status local = ValidateSource(send);
    for (uint32_t i = 0; local.ok() && send.with_checksums && i < ops.size(); ++i) {
      // Hashing here keeps the progress thread free for other transfers.
      Notice& notice = ops[i]->notice;
      notice.flags |= Notice::kHasChecksums;
      notice.key_checksum =
          HashLayerTokens(pools_.layout, pools_.key_pools[notice.layer], send.src_block_ids, send.num_tokens);
      notice.value_checksum =
          HashLayerTokens(pools_.layout, pools_.value_pools[notice.layer], send.src_block_ids, send.num_tokens);
    }
    worker_->Post([this, peer, ops = Shared(std::move(ops)), send = std::move(send), local] {
      // One plan for the send's layers: they share the block ids.
      const absl::StatusOr<std::vector<CopyRange>> plan = local.ok() ? PlanPuts(peer, send) : local;
      for (std::unique_ptr<Op>& op : *ops) StartLayer(std::move(op), plan);
    });
    return future;
  }

  std::future<absl::Status> Finish(PeerId peer, uint64_t request_id) override {
    auto op = NewOp(OpKind::kFinish, peer, request_id, NoticeType::kFinish);
    std::future<absl::Status> future = op->done.get_future();
    WatchDeviceCopies(peer, request_id);
    worker_->Post([this, op = op.release()] { StartFinish(std::unique_ptr<Op>(op)); });
    return future;
  }

  void Finish(PeerId peer, uint64_t request_id, Completion done) override {
    auto op = NewOp(OpKind::kFinish, peer, request_id, NoticeType::kFinish);
    op->on_done = std::move(done);
    WatchDeviceCopies(peer, request_id);
    worker_->Post([this, op = op.release()] { StartFinish(std::unique_ptr<Op>(op)); });
  }

  std::future<absl::Status> Abort(PeerId peer, uint64_t request_id) override {
    auto op = NewOp(OpKind::kAbort, peer, request_id, NoticeType::kAbort);
    std::future<absl::Status> future = op->done.get_future();
    worker_->Post([this, op = op.release()] { StartAbort(std::unique_ptr<Op>(op)); });
    return future;
  }

  size_t pending_operations() const override {
    return worker_->Call([&] { return ops_.size() + requests_.size(); });
  }

 private:
  struct Peer {
    ReceiverDescriptor remote;
    ucp_ep_h ep = nullptr;          // null once closed
    std::vector<ucp_rkey_h> rkeys;  // [region], valid while ep is open
    absl::Status failure;           // set once the endpoint failed, timed out or was closed
  };
  enum class OpKind : uint8_t { kConnect, kLayer, kFinish, kAbort };
  struct Op {
    OpKind kind = OpKind::kLayer;
    PeerId peer = 0;
    uint64_t request_id = 0;
    absl::Time deadline;
    std::promise<absl::Status> done;
    Completion on_done;  // when set, reports instead of `done`
    Notice notice;  // sent once the op's data is remotely complete
    bool awaiting_device = false;  // kCudaIpc: copies enqueued, the stream not yet past them
  };
  // The layers of one SendLayer call: its future resolves, with the first failure, once every
  // layer's op has ended.
  struct LayerGroup {
    std::promise<absl::Status> done;
    absl::Mutex mu;
    uint32_t remaining ABSL_GUARDED_BY(mu) = 0;
    absl::Status first_error ABSL_GUARDED_BY(mu);
    void End(const absl::Status& status) {
      absl::MutexLock lock(&mu);
      if (!status.ok() && first_error.ok()) first_error = status;
      if (--remaining == 0) done.set_value(first_error);
    }
  };
  // Per (peer, request): what Finish has to wait for.
  struct OutgoingRequest {
    uint32_t layers_in_flight = 0;
    absl::Status first_error;
    std::vector<uint64_t> finish_ops;
    // Abort ops waiting for the layers in flight: the receiver frees the blocks at the abort
    // notice, which must not overtake their puts.
    std::vector<uint64_t> abort_ops;
  };
  using RequestKey = std::pair<PeerId, uint64_t>;
  enum class Step : uint8_t { kFlush, kNotice, kUnacknowledgedNotice };
  // The user_data of one in-flight ucp call. It owns the notice bytes, which UCX may read until
  // the send completes, so it outlives an op that timed out meanwhile.
  struct InFlight {
    UcxKvSender* sender;
    uint64_t op_id;
    Step step;
    Notice notice;
  };
  struct ClosingEndpoint {
    UcxKvSender* sender;
    std::vector<ucp_rkey_h> rkeys;
  };

  // The worker's tasks are copyable functions: ops travel to them shared.
  static std::shared_ptr<std::vector<std::unique_ptr<Op>>> Shared(std::vector<std::unique_ptr<Op>> ops) {
    return std::make_shared<std::vector<std::unique_ptr<Op>>>(std::move(ops));
  }

  std::unique_ptr<Op> NewOp(OpKind kind, PeerId peer, uint64_t request_id, NoticeType type) {
    auto op = std::make_unique<Op>();
    op->kind = kind;
    op->peer = peer;
    op->request_id = request_id;
    op->deadline = absl::Now() + options_.operation_timeout;
    op->notice.type = type;
    op->notice.request_id = request_id;
    return op;
  }

  // Caller's thread, once per peer: CUDA IPC when both sides have device pools on one host (and
  // the mapping opens), else the host pools over shared memory or the network.
  TransferPath ChoosePath(PeerId id, const ReceiverDescriptor& remote) {
    const bool same_host = remote.host_id == options_.host_id;
    TransferPath path = options_.host_transport == HostTransport::kSharedMemory ||
                                (options_.host_transport == HostTransport::kAuto && same_host)
                            ? TransferPath::kUcxSharedMemory
                            : TransferPath::kUcxNetwork;
    std::shared_ptr<DeviceKvPeer> device;
    if (same_host && options_.device != nullptr && !remote.device_export.empty()) {
      absl::StatusOr<std::unique_ptr<DeviceKvPeer>> opened = options_.device->Open(remote.device_export);
      if (opened.ok()) {
        device = std::move(*opened);
        path = TransferPath::kCudaIpc;
      } else {
        DUET_LOG(WARNING) << "KV peer " << id << ": no CUDA IPC (" << opened.status() << "); using host pools";
      }
    }
    DUET_LOG(INFO) << "KV peer " << id << " (receiver on " << remote.host_id << "): path " << TransferPathName(path);
    absl::MutexLock lock(&device_mu_);
    paths_[id] = path;
    if (device != nullptr) device_peers_[id] = std::move(device);
    return path;
  }

  std::shared_ptr<DeviceKvPeer> DevicePeer(PeerId peer) const {
    absl::MutexLock lock(&device_mu_);
    auto it = device_peers_.find(peer);
    return it == device_peers_.end() ? nullptr : it->second;
  }

  // Caller's thread: validates kCudaIpc layers and enqueues their copies on the producer's stream
  // (one launch), filling in the layers' notices.
  absl::Status EnqueueDeviceLayers(DeviceKvPeer& device, PeerId peer, const LayerSend& send,
                                   std::span<const std::unique_ptr<Op>> ops) {
    DeviceKvMemory& local = *options_.device;
    const KvLayout& layout = local.pools().layout;
    if (send.device_stream == nullptr) {
      return absl::InvalidArgumentError("a KV layer sent over CUDA IPC needs the stream that produced it");
    }
    DUET_RETURN_IF_ERROR(ValidateLayers(send, layout));
    DUET_RETURN_IF_ERROR(
        ValidateBlockIds(layout, send.src_block_ids, send.num_tokens, local.pools().num_blocks, "source"));
    DUET_RETURN_IF_ERROR(
        ValidateBlockIds(device.layout(), send.dst_block_ids, send.num_tokens, device.num_blocks(), "destination"));
    DUET_ASSIGN_OR_RETURN(std::vector<CopyRange> plan, PlanLayerCopy(layout, send.src_block_ids, device.layout(),
                                                                     send.dst_block_ids, send.num_tokens));
    for (const std::unique_ptr<Op>& op : ops) {
      Notice& notice = op->notice;
      notice.flags |= Notice::kDeviceData;
      if (!send.with_checksums) continue;
      DUET_ASSIGN_OR_RETURN(notice.key_checksum, local.HashLayer(true, notice.layer, send.src_block_ids,
                                                                 send.num_tokens, send.device_stream));
      DUET_ASSIGN_OR_RETURN(notice.value_checksum, local.HashLayer(false, notice.layer, send.src_block_ids,
                                                                   send.num_tokens, send.device_stream));
      notice.flags |= Notice::kHasChecksums;
    }
    DUET_RETURN_IF_ERROR(device.EnqueueLayerCopies(send.layer, uint32_t(ops.size()), plan, send.device_stream));
    absl::MutexLock lock(&device_mu_);
    device_streams_[{peer, send.request_id}] = send.device_stream;
    return absl::OkStatus();
  }

  // Caller's thread, at Finish: once the stream has passed the request's copies, its layer
  // notices go out (OnDeviceCopiesDone).
  void WatchDeviceCopies(PeerId peer, uint64_t request_id) {
    void* stream = nullptr;
    {
      absl::MutexLock lock(&device_mu_);
      auto it = device_streams_.find({peer, request_id});
      if (it == device_streams_.end()) return;
      stream = it->second;
      device_streams_.erase(it);
      ++device_callbacks_pending_;
    }
    const RequestKey key{peer, request_id};
    absl::Status watched = options_.device->NotifyWhenDone(stream, [this, key](absl::Status copied) {
      worker_->Post([this, key, copied] { OnDeviceCopiesDone(key, copied); });
      absl::MutexLock lock(&device_mu_);
      --device_callbacks_pending_;
    });
    if (!watched.ok()) {
      worker_->Post([this, key, watched] { OnDeviceCopiesDone(key, watched); });
      absl::MutexLock lock(&device_mu_);
      --device_callbacks_pending_;
    }
  }

  // A kCudaIpc layer's copies are enqueued; the op waits for OnDeviceCopiesDone.
  void StartDeviceLayer(std::unique_ptr<Op> owned, const absl::Status& local) {
    const uint64_t op_id = Register(std::move(owned));
    Op& op = *ops_.at(op_id);
    ++requests_[{op.peer, op.request_id}].layers_in_flight;
    if (!local.ok()) return CompleteOp(op_id, local);
    absl::Status why;
    if (UsablePeer(op.peer, &why) == nullptr) return CompleteOp(op_id, why);
    op.awaiting_device = true;
  }

  void OnDeviceCopiesDone(const RequestKey& key, const absl::Status& copied) {
    std::vector<uint64_t> waiting;
    for (const auto& [id, op] : ops_) {
      if (op->awaiting_device && op->peer == key.first && op->request_id == key.second) waiting.push_back(id);
    }
    for (uint64_t id : waiting) {
      auto it = ops_.find(id);
      if (it == ops_.end()) continue;  // ended meanwhile (its peer failed)
      it->second->awaiting_device = false;
      if (!copied.ok()) {
        CompleteOp(id, copied);
        continue;
      }
      absl::Status why;
      Peer* peer = UsablePeer(key.first, &why);
      if (peer == nullptr) {
        CompleteOp(id, why);
        continue;
      }
      Issue(peer->ep, id, Step::kNotice, it->second->notice);
    }
  }

  static absl::Status ValidateLayers(const LayerSend& send, const KvLayout& layout) {
    if (send.num_layers == 0 || send.layer >= layout.num_layers || send.num_layers > layout.num_layers - send.layer) {
      return absl::InvalidArgumentError(absl::StrFormat("layers %u..%u are outside the sender's %u layers", send.layer,
                                                        uint64_t(send.layer) + send.num_layers, layout.num_layers));
    }
    return absl::OkStatus();
  }

  absl::Status ValidateSource(const LayerSend& send) const {
    DUET_RETURN_IF_ERROR(ValidateLayers(send, pools_.layout));
    return ValidateBlockIds(pools_.layout, send.src_block_ids, send.num_tokens,
                            pools_.num_blocks, "source");
  }

  // Creates the endpoint, then flushes it: the flush completes once UCX's connection set-up
  // (wireup) with the receiver is done. Waiting for it keeps the set-up out of the data path and
  // avoids a UCX 1.13 tcp assertion in the receiver when a sender vanishes mid-wireup.
  void StartConnect(std::unique_ptr<Op> owned, ReceiverDescriptor remote, bool detect_peer_failure) {
    const PeerId id = owned->peer;
    Peer& peer = peers_[id];
    peer.remote = std::move(remote);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(peer.remote.worker_address.data());
    params.err_mode = detect_peer_failure ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = &UcxKvSender::OnEndpointError;
    params.err_handler.arg = this;
    const uint64_t op_id = Register(std::move(owned));
    ucs_status_t status = ucp_ep_create(worker_->worker(), &params, &peer.ep);
    if (status != UCS_OK) {
      peer.ep = nullptr;
      return FailPeer(id, UcxError(status, "ucp_ep_create to a KV receiver"));
    }
    for (const RemoteRegion& region : peer.remote.regions) {
      ucp_rkey_h rkey = nullptr;
      status = ucp_ep_rkey_unpack(peer.ep, region.packed_rkey.data(), &rkey);
      if (status != UCS_OK) {
        return FailPeer(id, UcxError(status, "ucp_ep_rkey_unpack of a KV receiver's pool key"));
      }
      peer.rkeys.push_back(rkey);
    }
    Issue(peer.ep, op_id, Step::kFlush, Notice{});
  }

  // The peer if it can take new operations; else null and `why`.
  Peer* UsablePeer(PeerId id, absl::Status* why) {
    auto it = peers_.find(id);
    if (it == peers_.end()) {
      *why = absl::NotFoundError(absl::StrFormat("unknown KV peer %u", id));
      return nullptr;
    }
    if (!it->second.failure.ok()) {
      *why = it->second.failure;
      return nullptr;
    }
    return &it->second;
  }

  uint64_t Register(std::unique_ptr<Op> op) {
    const uint64_t id = next_op_id_++;
    ops_.emplace(id, std::move(op));
    return id;
  }

  // The puts of one layer of `send` to `id` (the same for every layer): its destination
  // block ids checked against the peer's pools.
  absl::StatusOr<std::vector<CopyRange>> PlanPuts(PeerId id, const LayerSend& send) {
    absl::Status why;
    const Peer* peer = UsablePeer(id, &why);
    if (peer == nullptr) return why;
    DUET_RETURN_IF_ERROR(ValidateBlockIds(peer->remote.layout, send.dst_block_ids, send.num_tokens,
                                          peer->remote.num_blocks, "destination"));
    return PlanLayerCopy(pools_.layout, send.src_block_ids, peer->remote.layout, send.dst_block_ids,
                         send.num_tokens);
  }

  void StartLayer(std::unique_ptr<Op> owned, const absl::StatusOr<std::vector<CopyRange>>& plan) {
    const uint64_t op_id = Register(std::move(owned));
    const Op& op = *ops_.at(op_id);
    ++requests_[{op.peer, op.request_id}].layers_in_flight;
    if (!plan.ok()) return CompleteOp(op_id, plan.status());

    absl::Status why;
    Peer* peer = UsablePeer(op.peer, &why);  // an earlier layer's put may have failed it
    if (peer == nullptr) return CompleteOp(op_id, why);
    for (size_t region : {KeyRegion(op.notice.layer), ValueRegion(op.notice.layer)}) {
      const auto* local_base = static_cast<const uint8_t*>(regions_[region]->address());
      const uint64_t remote_base = peer->remote.regions[region].base_address;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
      param.memh = regions_[region]->handle();
      for (const CopyRange& range : *plan) {
        ucs_status_ptr_t request =
            ucp_put_nbx(peer->ep, local_base + range.src_offset, range.bytes,
                        remote_base + range.dst_offset, peer->rkeys[region], &param);
        if (UCS_PTR_IS_ERR(request)) {
          return CompleteOp(op_id, UcxError(UCS_PTR_STATUS(request), "RMA put of KV blocks"));
        }
        // The flush below reports the puts' outcome; their requests need no tracking.
        if (request != nullptr) ucp_request_free(request);
      }
    }
    Issue(peer->ep, op_id, Step::kFlush, op.notice);
  }

  void StartFinish(std::unique_ptr<Op> owned) {
    const uint64_t op_id = Register(std::move(owned));
    const Op& op = *ops_.at(op_id);
    const RequestKey key{op.peer, op.request_id};
    requests_[key].finish_ops.push_back(op_id);
    MaybeFinish(key);
  }

  void StartAbort(std::unique_ptr<Op> owned) {
    const uint64_t op_id = Register(std::move(owned));
    const Op& op = *ops_.at(op_id);
    const RequestKey key{op.peer, op.request_id};
    if (auto it = requests_.find(key); it != requests_.end()) {
      const std::vector<uint64_t> finish_ops = std::exchange(it->second.finish_ops, {});
      for (uint64_t finish : finish_ops) {
        CompleteOp(finish, absl::AbortedError(absl::StrFormat(
                               "KV transfer of request %u was aborted", key.second)));
      }
    }
    if (auto it = requests_.find(key); it != requests_.end()) {
      if (it->second.layers_in_flight > 0) {
        it->second.abort_ops.push_back(op_id);  // sent by MaybeFinish once they have landed
        return;
      }
      requests_.erase(it);
    }
    SendAbortNotice(op_id);
  }

  void SendAbortNotice(uint64_t op_id) {
    auto op = ops_.find(op_id);
    if (op == ops_.end()) return;  // timed out meanwhile
    absl::Status why;
    Peer* peer = UsablePeer(op->second->peer, &why);
    if (peer == nullptr) return CompleteOp(op_id, why);
    Issue(peer->ep, op_id, Step::kNotice, op->second->notice);
  }

  // Sends the finish notices of a request whose layers have all completed.
  void MaybeFinish(const RequestKey& key) {
    auto it = requests_.find(key);
    if (it == requests_.end()) return;
    if (it->second.layers_in_flight > 0) return;
    if (!it->second.abort_ops.empty()) {  // aborted while layers were in flight: they have landed now
      const std::vector<uint64_t> aborts = std::move(it->second.abort_ops);
      requests_.erase(it);
      for (uint64_t abort : aborts) SendAbortNotice(abort);
      return;
    }
    if (it->second.finish_ops.empty()) return;
    const std::vector<uint64_t> finish_ops = std::move(it->second.finish_ops);
    const absl::Status error = it->second.first_error;
    requests_.erase(it);

    absl::Status why;
    Peer* peer = UsablePeer(key.first, &why);
    if (peer != nullptr && !error.ok()) {
      // Let the receiver release its blocks now rather than at lease expiry.
      Notice abort;
      abort.type = NoticeType::kAbort;
      abort.request_id = key.second;
      Issue(peer->ep, /*op_id=*/0, Step::kUnacknowledgedNotice, abort);
    }
    for (uint64_t finish : finish_ops) {
      if (!error.ok()) {
        CompleteOp(finish, error);
      } else if (peer == nullptr) {
        CompleteOp(finish, why);
      } else {
        Issue(peer->ep, finish, Step::kNotice, ops_.at(finish)->notice);
      }
    }
  }

  void Issue(ucp_ep_h ep, uint64_t op_id, Step step, const Notice& notice) {
    auto* in_flight = new InFlight{this, op_id, step, notice};
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxKvSender::OnUcxRequestDone;
    param.user_data = in_flight;
    ++ucx_calls_in_flight_;
    ucs_status_ptr_t request =
        step == Step::kFlush
            ? ucp_ep_flush_nbx(ep, &param)
            : ucp_am_send_nbx(ep, kNoticeAmId, &in_flight->notice, sizeof(Notice), nullptr, 0,
                              &param);
    if (request == nullptr) return OnStepDone(in_flight, UCS_OK);
    if (UCS_PTR_IS_ERR(request)) return OnStepDone(in_flight, UCS_PTR_STATUS(request));
    // Otherwise OnUcxRequestDone runs when it completes.
  }

  static void OnUcxRequestDone(void* request, ucs_status_t status, void* user_data) {
    ucp_request_free(request);
    auto* in_flight = static_cast<InFlight*>(user_data);
    in_flight->sender->OnStepDone(in_flight, status);
  }

  void OnStepDone(InFlight* in_flight, ucs_status_t status) {
    const uint64_t op_id = in_flight->op_id;
    const Step step = in_flight->step;
    delete in_flight;
    --ucx_calls_in_flight_;
    auto it = ops_.find(op_id);
    if (step == Step::kUnacknowledgedNotice || it == ops_.end()) return;  // op already ended
    const Op& op = *it->second;
    if (status != UCS_OK) {
      return CompleteOp(op_id, UcxError(status, absl::StrFormat(
                                                    "KV transfer of request %u to peer %u (%s)",
                                                    op.request_id, op.peer,
                                                    step == Step::kFlush ? "flush" : "notice")));
    }
    if (step == Step::kNotice || op.kind == OpKind::kConnect) {
      return CompleteOp(op_id, absl::OkStatus());
    }
    absl::Status why;
    Peer* peer = UsablePeer(op.peer, &why);
    if (peer == nullptr) return CompleteOp(op_id, why);
    Issue(peer->ep, op_id, Step::kNotice, op.notice);
  }

  void CompleteOp(uint64_t op_id, absl::Status status) {
    auto it = ops_.find(op_id);
    if (it == ops_.end()) return;
    std::unique_ptr<Op> op = std::move(it->second);
    ops_.erase(it);
    if (op->on_done) {
      op->on_done(status);
    } else {
      op->done.set_value(status);
    }
    if (op->kind != OpKind::kLayer) return;
    const RequestKey key{op->peer, op->request_id};
    auto request = requests_.find(key);
    if (request == requests_.end()) return;  // aborted meanwhile
    DUET_CHECK(request->second.layers_in_flight > 0);
    --request->second.layers_in_flight;
    if (!status.ok() && request->second.first_error.ok()) {
      request->second.first_error = absl::Status(
          status.code(), absl::StrFormat("layer %u: %s", op->notice.layer, status.message()));
    }
    MaybeFinish(key);
  }

  // Marks the peer failed, closes its endpoint and fails everything pending on it.
  void FailPeer(PeerId peer_id, const absl::Status& status) {
    auto it = peers_.find(peer_id);
    if (it == peers_.end() || !it->second.failure.ok()) return;
    it->second.failure = status;
    CloseEndpoint(it->second);
    std::vector<uint64_t> op_ids;
    for (const auto& [id, op] : ops_) {
      if (op->peer == peer_id) op_ids.push_back(id);
    }
    for (uint64_t id : op_ids) CompleteOp(id, status);
    absl::erase_if(requests_, [&](const auto& entry) { return entry.first.first == peer_id; });
  }

  void CloseEndpoint(Peer& peer) {
    if (peer.ep == nullptr) return;
    auto* closing = new ClosingEndpoint{this, std::move(peer.rkeys)};
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // Force: a failed or unresponsive peer will not answer a graceful close. Outstanding
    // requests on the endpoint complete with UCS_ERR_CANCELED.
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    param.cb.send = &UcxKvSender::OnEndpointClosed;
    param.user_data = closing;
    ++ucx_calls_in_flight_;
    ucs_status_ptr_t request = ucp_ep_close_nbx(peer.ep, &param);
    peer.ep = nullptr;
    if (!UCS_PTR_IS_PTR(request)) FinishClose(closing);
  }

  static void OnEndpointClosed(void* request, ucs_status_t /*status*/, void* user_data) {
    ucp_request_free(request);
    auto* closing = static_cast<ClosingEndpoint*>(user_data);
    closing->sender->FinishClose(closing);
  }

  void FinishClose(ClosingEndpoint* closing) {
    for (ucp_rkey_h rkey : closing->rkeys) ucp_rkey_destroy(rkey);
    delete closing;
    --ucx_calls_in_flight_;
  }

  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* sender = static_cast<UcxKvSender*>(arg);
    for (const auto& [id, peer] : sender->peers_) {
      if (peer.ep == ep) {
        sender->FailPeer(id, UcxError(status, absl::StrFormat("KV endpoint to peer %u failed", id)));
        return;
      }
    }
  }

  // Tick: a peer with an operation past its deadline is considered dead or stuck.
  void FailTimedOutPeers() {
    const absl::Time now = absl::Now();
    std::vector<std::pair<PeerId, uint64_t>> late;  // peer, request
    for (const auto& [id, op] : ops_) {
      if (op->deadline <= now) late.emplace_back(op->peer, op->request_id);
    }
    for (const auto& [peer, request] : late) {
      FailPeer(peer, absl::DeadlineExceededError(absl::StrFormat(
                         "KV transfer of request %u to peer %u timed out after %s; the peer is "
                         "marked failed",
                         request, peer, absl::FormatDuration(options_.operation_timeout))));
    }
  }

  const KvPoolMemory pools_;
  const UcxSenderOptions options_;
  std::unique_ptr<UcxWorker> worker_;

  // Read by the callers' threads (SendLayer, Finish, path) as well.
  mutable absl::Mutex device_mu_;
  absl::flat_hash_map<PeerId, TransferPath> paths_ ABSL_GUARDED_BY(device_mu_);
  absl::flat_hash_map<PeerId, std::shared_ptr<DeviceKvPeer>> device_peers_ ABSL_GUARDED_BY(device_mu_);
  // kCudaIpc requests with copies enqueued and no Finish yet: the stream their notices wait for.
  absl::flat_hash_map<std::pair<PeerId, uint64_t>, void*> device_streams_ ABSL_GUARDED_BY(device_mu_);
  int device_callbacks_pending_ ABSL_GUARDED_BY(device_mu_) = 0;
  std::vector<std::unique_ptr<UcxMemoryRegion>> regions_;  // [KeyRegion/ValueRegion(layer)]

  // Progress thread only.
  absl::flat_hash_map<PeerId, Peer> peers_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Op>> ops_;
  absl::flat_hash_map<RequestKey, OutgoingRequest> requests_;
  size_t ucx_calls_in_flight_ = 0;  // InFlight and ClosingEndpoint objects UCX still holds
  std::atomic<PeerId> next_peer_id_{1};
  uint64_t next_op_id_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvSender>> CreateUcxKvSender(KvPoolMemory pools,
                                                            UcxSenderOptions options) {
  DUET_RETURN_IF_ERROR(pools.Validate());
  auto sender = std::make_unique<UcxKvSender>(std::move(pools), options);
  DUET_RETURN_IF_ERROR(sender->Init());
  return sender;
}

}  // namespace duet::kvtransfer
