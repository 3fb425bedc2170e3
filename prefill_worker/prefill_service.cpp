#include "prefill_worker/prefill_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/served_model_name.h"
#include "rpc/kv_target_auth.h"
#include "rpc/rpc_util.h"

namespace duet {
namespace {

grpc::Status Error(grpc::StatusCode code, std::string message) {
  return grpc::Status(code, std::move(message));
}

// A peer failure (as opposed to a bad request): the connection should be made again.
bool IsPeerFailure(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded ||
         s.code() == absl::StatusCode::kCancelled;
}

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillService>> PrefillService::Create(std::unique_ptr<LlmEngine> engine,
                                                                       PrefillServiceOptions options) {
  // Always staged: the sends read the staging, so the engine may reuse the cache blocks at once.
  WorkerKvPoolOptions pool_options = options.kv_pools;
  pool_options.force_staging = true;
  absl::StatusOr<WorkerKvPools> pools =
      MakeWorkerKvPools(engine->kv_cache(), engine->config().scheduler, pool_options);
  if (!pools.ok()) {
    return absl::Status(pools.status().code(),
                        absl::StrCat("cannot set up the KV staging: ", pools.status().message()));
  }
  const int64_t kv_token_bytes = KvTokenBytes(pools->memory.layout);
  kvtransfer::UcxSenderOptions sender_options = options.sender;
  sender_options.device = pools->device.get();
  absl::StatusOr<std::unique_ptr<kvtransfer::KvSender>> sender =
      kvtransfer::CreateUcxKvSender(pools->memory, sender_options);
  if (!sender.ok()) {
    return absl::Status(sender.status().code(),
                        absl::StrCat("cannot start the KV sender: ", sender.status().message()));
  }
  std::unique_ptr<PrefillService> service(new PrefillService(std::move(engine), std::move(*sender),
                                                             std::move(pools->staging), std::move(pools->device),
                                                             options));
  service->kv_token_bytes_ = kv_token_bytes;  // read on the loop thread, after a Prefill call posts
  return service;
}

PrefillService::PrefillService(std::unique_ptr<LlmEngine> engine,
                               std::unique_ptr<kvtransfer::KvSender> sender, std::unique_ptr<KvHostStaging> staging,
                               std::unique_ptr<kvtransfer::DeviceKvMemory> device_kv, PrefillServiceOptions options)
    : options_(std::move(options)),
      block_size_(engine->config().block_size),
      num_layers_(engine->model_config().num_layers),
      device_stream_(engine->kv_cache().device_stream()),
      sequence_parallel_(engine->config().sequence_parallel),
      metrics_(std::make_unique<metrics::PrefillMetrics>(metrics_registry_,
                                                         ServedModelName(options_.model_name, engine->config().model_dir))),
      device_kv_(std::move(device_kv)),
      staging_(std::move(staging)),
      sender_(std::move(sender)) {
  metrics_->SetCacheConfig(rpc::CacheConfigOf(*engine));
  // Every path's series from the start, at zero: a rate over a path's first transfers needs a
  // sample from before them.
  for (kvtransfer::TransferPath path : {kvtransfer::TransferPath::kUcxNetwork, kvtransfer::TransferPath::kUcxSharedMemory,
                                        kvtransfer::TransferPath::kCudaIpc}) {
    metrics_->kv_transfer_bytes_total(kvtransfer::TransferPathName(path));
    metrics_->kv_transfer_seconds(kvtransfer::TransferPathName(path));
  }
  for (const char* arrived : {"before_forward", "during_forward", "after_forward"}) metrics_->kv_late_targets_total(arrived);
  loop_ = std::make_unique<EngineLoop>(
      std::move(engine), [this](int64_t layer, absl::Span<const SequenceChunk> chunks) { OnLayerDone(layer, chunks); },
      [this](int64_t num_tokens) { metrics_->iteration_tokens_total.Observe(double(num_tokens)); });
}

PrefillService::~PrefillService() {
  // Stop shipping (no step runs while this closure does), then drop the sender (it ends the
  // shipments in flight) while the staging still exists, then the engine.
  loop_->Call([this](LlmEngine&) {
    stopping_ = true;
    transfers_.clear();
    kept_transfers_.clear();
  });
  sender_.reset();
  loop_.reset();
  staging_.reset();
}

// ---- One Prefill call ----

// The reactor of one Prefill: admission (staging for the prompt), the request in the engine, the
// shipment of its KV. It replies once both the engine's finishing output and the shipment's end
// are known; they come from the engine thread and the sender's thread, OnCancel from gRPC's, so
// the state they meet in is behind mu_.
class PrefillService::PrefillCall final : public grpc::ServerUnaryReactor,
                                          public std::enable_shared_from_this<PrefillCall> {
 public:
  PrefillCall(PrefillService* service, const v1::PrefillRequest* request, v1::PrefillResponse* response)
      : service_(service), request_(*request), response_(response) {}

  // Validates, connects to the decode worker, and asks for admission; a call whose target
  // follows goes into the engine at once.
  void Start();
  int64_t num_blocks() const { return num_blocks_; }  // the staging its prompt needs
  const std::string& id() const { return request_.request_id(); }
  // The staging is the call's now: into the engine, or (a late target's) the shipment can start.
  void Admitted(std::vector<int32_t> staging_blocks);
  // A late target (SetKvTarget): resolved, then the shipment starts once it has its staging. An
  // error fails the call too.
  grpc::Status AttachTarget(const v1::KvTarget& target);
  // Abort (the RPC) while it waited for admission, or with its blocks kept for a late target.
  void AbortWhileWaiting();
  bool ended() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  void AbortKept() { End(Error(grpc::StatusCode::ABORTED, absl::StrCat("request '", id(), "' was aborted"))); }
  // The shipment's end (any thread).
  void OnShipped(const absl::Status& status);

  void OnCancel() override;
  void OnDone() override {
    auto last_reference = std::move(self_);  // may destroy this at the end of the scope
  }

 private:
  enum class Stage { kAdmitting, kAdmitted, kInEngine };

  // Checks a decode worker's KV target against this call and connects to it. After connecting,
  // an error tells the decode worker that nothing will be written.
  grpc::Status ResolveTarget(const v1::KvTarget& target, Destination* to);
  // Host paths: the staging blocks (num_blocks_) the tokens `to` asks for; RESOURCE_EXHAUSTED
  // (the decode worker told) when the staging cannot ever hold them.
  grpc::Status SizeStaging(const Destination& to);
  int64_t prompt_len() const { return request_.prompt_token_ids_size() + request_.output_token_ids_size(); }
  bool late() const { return request_.target_follows(); }  // its target follows in SetKvTarget
  // A late call fails: its request leaves the engine, with any blocks kept for it.
  void FailLate(const grpc::Status& status);
  // Its target, taken out of the admission queue: the decode worker is told nothing comes.
  void AbortLateTarget();
  void OnOutput(const RequestOutput& out);
  void AddToEngine(LlmEngine& engine);
  // Engine thread: the request's finishing output (its first token, or why it has none).
  void OnFinished(LlmEngine& engine, SequenceId seq, const RequestOutput& out);
  void RecordPrefill(const Request& request);
  // Replies once the output and the shipment's end are both in.
  void MaybeReply() ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status Reply(const RequestOutput& out, const absl::Status& shipped, v1::PrefillResponse* reply);
  // Finishes the call once (the first status wins); `reply` is the response of an OK status.
  void End(const grpc::Status& status, const v1::PrefillResponse* reply = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  PrefillService* const service_;
  const v1::PrefillRequest request_;  // a copy: the engine thread reads it after a cancelled call is done
  v1::PrefillResponse* const response_;  // written only before Finish (see End)
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::shared_ptr<PrefillCall> self_;  // the server call's reference, dropped in OnDone
  SamplingParams params_;
  std::atomic<int64_t> num_blocks_{0};
  std::shared_ptr<Transfer> transfer_;

  absl::Mutex mu_;
  Stage stage_ ABSL_GUARDED_BY(mu_) = Stage::kAdmitting;
  std::optional<Destination> late_target_ ABSL_GUARDED_BY(mu_);  // resolved, waiting for staging
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<RequestOutput> output_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> shipped_ ABSL_GUARDED_BY(mu_);
  // When each arrived: the reply's wait on the transfer is their difference.
  std::chrono::steady_clock::time_point output_time_ ABSL_GUARDED_BY(mu_);
  std::chrono::steady_clock::time_point shipped_time_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerUnaryReactor* PrefillService::Prefill(grpc::CallbackServerContext*, const v1::PrefillRequest* request,
                                                  v1::PrefillResponse* response) {
  auto call = std::make_shared<PrefillCall>(this, request, response);
  call->Start();  // the call holds itself until OnDone
  return call.get();
}

void PrefillService::PrefillCall::Start() {
  self_ = shared_from_this();
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(request_.sampling());
  if (!params.ok()) return End(rpc::ToGrpc(params.status()));
  params_ = *std::move(params);
  transfer_ = std::make_shared<Transfer>();
  transfer_->request_id = id();
  transfer_->prompt_len = uint32_t(prompt_len());
  const v1::KvTarget* target = &request_.target();
  std::optional<v1::KvTarget> held;
  if (request_.target_follows()) {
    if (request_.has_target()) {
      return End(Error(grpc::StatusCode::INVALID_ARGUMENT, "a Prefill with target_follows carries no target"));
    }
    transfer_->late = true;
    // A target that came before the call goes in with it, as an early one does, so the forward
    // pass never starts without it.
    held = service_->TakeUnclaimedTarget(id());
    if (!held.has_value()) {
      transfer_->target_ready.store(false, std::memory_order_relaxed);
      Admitted({});
      service_->AwaitTarget(shared_from_this());
      return;
    }
    target = &*held;
  }
  grpc::Status resolved = ResolveTarget(*target, &transfer_->to);
  if (resolved.ok()) resolved = SizeStaging(transfer_->to);
  if (!resolved.ok()) return End(resolved);
  // Over CUDA IPC the copies read the cache, ordered on its stream before any later reuse: no
  // staging, no admission queue.
  if (transfer_->to.device()) return Admitted({});
  service_->Admit(shared_from_this());
}

grpc::Status PrefillService::PrefillCall::ResolveTarget(const v1::KvTarget& target, Destination* to) {
  if (target.receiver_descriptor().empty() || (target.block_ids().empty() && target.device_block_ids().empty())) {
    return Error(grpc::StatusCode::INVALID_ARGUMENT,
                 "the KV target (receiver_descriptor and block_ids from the decode worker's ReserveKv) is required");
  }
  // Before connecting or writing anything: only where a decode worker granted this transfer.
  if (absl::Status granted = rpc::VerifyKvTarget(service_->options_.kv_target_key, target); !granted.ok()) {
    return rpc::ToGrpc(granted);
  }
  // Blocks this thread only the first time a decode worker is seen (the UCX connection).
  absl::StatusOr<kvtransfer::PeerId> peer = service_->PeerFor(target.receiver_descriptor());
  if (!peer.ok()) {
    service_->metrics_->kv_transfer_failures.Inc();
    const grpc::StatusCode code = peer.status().code() == absl::StatusCode::kInvalidArgument
                                      ? grpc::StatusCode::INVALID_ARGUMENT
                                      : grpc::StatusCode::UNAVAILABLE;
    return Error(code, absl::StrCat("cannot connect to the decode worker's KV receiver: ", peer.status().message()));
  }
  to->receiver_descriptor = target.receiver_descriptor();
  to->transfer_id = target.transfer_id();
  to->peer = *peer;
  to->path = service_->sender_->path(*peer);
  const auto& dst = to->device() ? target.device_block_ids() : target.block_ids();
  if (dst.empty()) {
    (void)service_->sender_->Abort(to->peer, to->transfer_id);
    return Error(grpc::StatusCode::FAILED_PRECONDITION,
                 absl::StrCat("the KV target has no blocks for the ", std::string(kvtransfer::TransferPathName(to->path)),
                              " path this prefill worker uses to that decode worker"));
  }
  to->dst_block_ids.assign(dst.begin(), dst.end());
  // A migrated request's output so far is prefilled with its prompt, and their KV shipped together.
  if (target.first_token() >= prompt_len() || target.first_token() % uint32_t(service_->block_size_) != 0) {
    (void)service_->sender_->Abort(to->peer, to->transfer_id);
    return Error(grpc::StatusCode::FAILED_PRECONDITION,
                 absl::StrCat("the KV target starts at token ", target.first_token(), " of ", prompt_len(),
                              ": not before the prompt's end on a boundary of this worker's ", service_->block_size_,
                              "-token blocks"));
  }
  to->first_token = target.first_token();
  return grpc::Status::OK;
}

grpc::Status PrefillService::PrefillCall::SizeStaging(const Destination& to) {
  if (to.device()) return grpc::Status::OK;
  num_blocks_ = (prompt_len() + service_->block_size_ - 1) / service_->block_size_ -
                int64_t(to.first_token) / service_->block_size_;
  if (num_blocks_ <= service_->staging_->num_blocks()) return grpc::Status::OK;
  (void)service_->sender_->Abort(to.peer, to.transfer_id);
  return Error(grpc::StatusCode::RESOURCE_EXHAUSTED,
               absl::StrCat("the prompt's KV (", num_blocks_.load(), " blocks) is larger than the prefill worker's staging (",
                            service_->staging_->num_blocks(), " blocks; see --kv-staging-tokens)"));
}

grpc::Status PrefillService::PrefillCall::AttachTarget(const v1::KvTarget& target) {
  Destination to;
  grpc::Status status = ResolveTarget(target, &to);
  if (status.ok()) status = SizeStaging(to);
  if (!status.ok()) {
    FailLate(status);
    return status;
  }
  if (to.device()) {
    service_->PublishTarget(transfer_, to, {});
    return grpc::Status::OK;
  }
  {
    absl::MutexLock lock(&mu_);
    late_target_ = std::move(to);
  }
  service_->Admit(shared_from_this());  // Admitted publishes it with its staging
  return grpc::Status::OK;
}

void PrefillService::PrefillCall::FailLate(const grpc::Status& status) {
  service_->loop_->Abort(id());
  service_->loop_->Post([service = service_, id = id()](LlmEngine& engine) { service->DropKept(engine, id); });
  End(status);
}

void PrefillService::PrefillCall::Admitted(std::vector<int32_t> staging_blocks) {
  std::optional<Destination> late_target;
  {
    absl::MutexLock lock(&mu_);
    late_target.swap(late_target_);
  }
  if (late_target.has_value()) {  // the request is in the engine already
    service_->PublishTarget(transfer_, *late_target, std::move(staging_blocks));
    return;
  }
  transfer_->staging_block_ids = std::move(staging_blocks);
  transfer_->call = shared_from_this();  // until the shipment ends (EndShipment)
  {
    absl::MutexLock lock(&mu_);
    stage_ = Stage::kAdmitted;
  }
  service_->loop_->Post([self = shared_from_this()](LlmEngine& engine) { self->AddToEngine(engine); });
}

void PrefillService::PrefillCall::AddToEngine(LlmEngine& engine) {
  const std::string& request_id = id();
  bool cancelled;
  {
    absl::MutexLock lock(&mu_);
    cancelled = cancelled_;
  }
  // The first token (after a migrated request's output so far) is sampled here; the decode
  // worker continues the same seeded stream.
  ResumedOutput resumed;
  resumed.tokens.assign(request_.output_token_ids().begin(), request_.output_token_ids().end());
  SamplingParams first = params_;
  first.max_tokens = int32_t(resumed.tokens.size()) + 1;
  // Aborted before it arrived: the decode worker has been told its blocks are free.
  if (service_->aborted_unknown_.contains(request_id)) cancelled = true;
  absl::Status added = cancelled ? absl::CancelledError("the Prefill call was cancelled")
                       : int64_t(resumed.tokens.size()) >= params_.max_tokens
                           ? absl::InvalidArgumentError(absl::StrCat("the output so far has ", resumed.tokens.size(),
                                                                     " tokens, max_tokens ", params_.max_tokens))
                           : engine.AddRequest(request_id, {request_.prompt_token_ids().begin(),
                                                            request_.prompt_token_ids().end()}, first, resumed);
  if (!added.ok()) {
    // Nothing will be shipped: let the decode worker release the reserved blocks now.
    service_->DropShipment(transfer_);
    return End(rpc::ToGrpc(added));
  }
  const SequenceId seq = engine.Find(request_id)->seq_id;
  // Should the forward pass end before the target comes, its blocks wait for it.
  if (late()) (void)engine.KeepKvWhenFinished(request_id);
  service_->transfers_[seq] = transfer_;
  service_->loop_->Subscribe(request_id, [self = shared_from_this(), seq, &engine](const RequestOutput& out) {
    if (out.finished) self->OnFinished(engine, seq, out);  // max_tokens 1: the token comes with the finish
  });
  absl::MutexLock lock(&mu_);
  stage_ = Stage::kInEngine;
  if (cancelled_) service_->loop_->Abort(request_id);
}

void PrefillService::PrefillCall::OnFinished(LlmEngine& engine, SequenceId seq, const RequestOutput& out) {
  // The request is still readable here (the loop releases it after this callback).
  const Request* req = engine.Find(out.id);
  if (req != nullptr && !out.new_token_ids.empty() &&
      (out.finish_reason == FinishReason::kStop || out.finish_reason == FinishReason::kLength)) {
    RecordPrefill(*req);
  }
  std::optional<SequenceId> kept = req != nullptr ? req->kept_kv : std::nullopt;
  auto it = service_->transfers_.find(seq);
  if (it != service_->transfers_.end()) {
    std::shared_ptr<Transfer> t = std::move(it->second);
    service_->transfers_.erase(it);
    // Its forward pass is complete but its late target has not come: the blocks wait for it,
    // unless the call has ended or been aborted meanwhile. Otherwise never shipped (aborted or failed before its step): let the decode worker release
    // the lease. Started but not finished (a failed step): end it after the layers in flight.
    if (t->stage == Transfer::Stage::kUnsent && kept.has_value() && !t->abandoned && !ended()) {
      service_->KeepForLateTarget(engine, t, *std::exchange(kept, std::nullopt));
    } else if (t->stage == Transfer::Stage::kUnsent) {
      service_->DropShipment(t);
    } else if (t->stage == Transfer::Stage::kSending) {
      service_->FinishShipment(t, absl::AbortedError("the prompt's KV was not shipped"));
    }
  }
  // Shipped during the forward pass: the copies are behind it, on the cache's stream or staged.
  if (kept.has_value()) engine.ReleaseKv(*kept);
  OnOutput(out);
}

void PrefillService::PrefillCall::RecordPrefill(const Request& req) {
  // The request's lengths and its queue time are the router's; the prefill phase is ours.
  metrics::PrefillMetrics& m = *service_->metrics_;
  m.prompt_tokens.Inc(double(req.prompt.size()));
  m.request_prefill_time_seconds.Observe(Seconds(req.first_token_time - req.first_scheduled_time));
}

void PrefillService::PrefillCall::OnOutput(const RequestOutput& out) {
  {
    absl::MutexLock lock(&mu_);
    output_ = out;
    output_time_ = std::chrono::steady_clock::now();
  }
  MaybeReply();
}

void PrefillService::PrefillCall::OnShipped(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    shipped_ = status;
    shipped_time_ = std::chrono::steady_clock::now();
  }
  MaybeReply();
}

void PrefillService::PrefillCall::MaybeReply() {
  RequestOutput out;
  absl::Status shipped;
  double transfer_wait = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!output_.has_value() || !shipped_.has_value()) return;
    out = *output_;
    shipped = *shipped_;
    transfer_wait = std::max(0.0, Seconds(shipped_time_ - output_time_));
  }
  if (shipped.ok() && !out.new_token_ids.empty()) service_->metrics_->kv_transfer_wait_seconds.Observe(transfer_wait);
  v1::PrefillResponse reply;
  const grpc::Status status = Reply(out, shipped, &reply);
  End(status, &reply);
}

grpc::Status PrefillService::PrefillCall::Reply(const RequestOutput& out, const absl::Status& shipped,
                                                v1::PrefillResponse* reply) {
  const std::string& request_id = id();
  if (out.finish_reason == FinishReason::kAbort) {
    return Error(grpc::StatusCode::ABORTED, absl::StrCat("request '", request_id, "' was aborted"));
  }
  if (out.finish_reason == FinishReason::kError) {
    return Error(grpc::StatusCode::INTERNAL, absl::StrCat("prefill of request '", request_id, "' failed: ", out.error));
  }
  if (!shipped.ok()) {
    if (IsPeerFailure(shipped)) service_->ForgetPeer(transfer_->to.receiver_descriptor, transfer_->to.peer);
    const grpc::StatusCode code = shipped.code() == absl::StatusCode::kInvalidArgument
                                      ? grpc::StatusCode::INVALID_ARGUMENT
                                      : grpc::StatusCode::UNAVAILABLE;
    return Error(code, absl::StrCat("the KV transfer of request '", request_id, "' to the decode worker failed: ",
                                    shipped.ToString()));
  }
  if (out.new_token_ids.empty()) {
    return Error(grpc::StatusCode::INTERNAL, absl::StrCat("prefill of request '", request_id, "' produced no token"));
  }
  reply->set_first_token_id(out.new_token_ids[0]);
  reply->set_first_token_finish_reason(out.finish_reason == FinishReason::kLength ? v1::FINISH_REASON_LENGTH
                                                                                 : v1::FINISH_REASON_STOP);
  if (!out.new_logprobs.empty()) {
    SampledToken token{out.new_token_ids[0], out.new_logprobs[0],
                       out.new_top_logprobs.empty() ? std::vector<TokenLogprob>{} : out.new_top_logprobs[0]};
    rpc::ToProto(token, reply->mutable_first_token_logprobs());
  }
  reply->mutable_prompt_logprobs()->Reserve(int(out.prompt_logprobs.size()));
  for (const ScoredToken& scored : out.prompt_logprobs) rpc::ToProto(scored, reply->add_prompt_logprobs());
  reply->set_prefill_seconds(Seconds(std::chrono::steady_clock::now() - start_));
  return grpc::Status::OK;
}

void PrefillService::PrefillCall::End(const grpc::Status& status, const v1::PrefillResponse* reply) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
  }
  if (late()) service_->StopAwaitingTarget(id());
  if (status.ok() && reply != nullptr) *response_ = *reply;
  Finish(status);
}

void PrefillService::PrefillCall::OnCancel() {
  Stage stage;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    stage = stage_;
  }
  if (stage == Stage::kAdmitting && service_->LeaveAdmission(id()) != nullptr) {
    (void)service_->sender_->Abort(transfer_->to.peer, transfer_->to.transfer_id);
  } else if (stage == Stage::kInEngine) {
    service_->loop_->Abort(id());  // the subscription then ends the shipment if it had not started
    if (late()) {
      // Its target may wait for staging; the forward pass may be over, its blocks kept.
      if (service_->LeaveAdmission(id()) != nullptr) AbortLateTarget();
      service_->loop_->Post([service = service_, id = id()](LlmEngine& engine) { service->DropKept(engine, id); });
    }
  }
  // Admitted but not yet in the engine: AddToEngine sees `cancelled_`.
  End(Error(grpc::StatusCode::CANCELLED, "the Prefill call was cancelled"));
}

void PrefillService::PrefillCall::AbortWhileWaiting() {
  const grpc::Status aborted = Error(grpc::StatusCode::ABORTED, absl::StrCat("request '", id(), "' was aborted"));
  // Waiting with its target (a late one for its staging, or one that came before the call).
  if (late()) AbortLateTarget();
  if (transfer_->target_ready.load(std::memory_order_acquire)) {
    (void)service_->sender_->Abort(transfer_->to.peer, transfer_->to.transfer_id);
  }
  if (late()) return FailLate(aborted);
  End(aborted);
}

void PrefillService::PrefillCall::AbortLateTarget() {
  std::optional<Destination> to;
  {
    absl::MutexLock lock(&mu_);
    to.swap(late_target_);
  }
  if (to.has_value()) (void)service_->sender_->Abort(to->peer, to->transfer_id);
}

// ---- Admission ----

void PrefillService::Admit(const std::shared_ptr<PrefillCall>& call) {
  std::vector<int32_t> staged;
  {
    absl::MutexLock lock(&admission_mu_);
    absl::StatusOr<std::vector<int32_t>> allocated =
        waiting_.empty() ? staging_->Allocate(call->num_blocks()) : absl::ResourceExhaustedError("queued");
    if (!allocated.ok()) {
      waiting_.push_back(call);
      return;
    }
    staged = *std::move(allocated);
  }
  call->Admitted(std::move(staged));
}

void PrefillService::AdmitWaiting() {
  std::vector<std::pair<std::shared_ptr<PrefillCall>, std::vector<int32_t>>> admitted;
  {
    absl::MutexLock lock(&admission_mu_);
    while (!waiting_.empty()) {
      absl::StatusOr<std::vector<int32_t>> staged = staging_->Allocate(waiting_.front()->num_blocks());
      if (!staged.ok()) break;
      admitted.emplace_back(std::move(waiting_.front()), *std::move(staged));
      waiting_.pop_front();
    }
  }
  for (auto& [call, staged] : admitted) call->Admitted(std::move(staged));
}

std::shared_ptr<PrefillService::PrefillCall> PrefillService::LeaveAdmission(const std::string& request_id) {
  absl::MutexLock lock(&admission_mu_);
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->id() != request_id) continue;
    std::shared_ptr<PrefillCall> call = std::move(*it);
    waiting_.erase(it);
    return call;
  }
  return nullptr;
}

// ---- Shipping the KV ----

void PrefillService::OnLayerDone(int64_t layer, absl::Span<const SequenceChunk> chunks) {
  if (stopping_ || transfers_.empty()) return;
  for (const SequenceChunk& chunk : chunks) {
    auto it = transfers_.find(chunk.sequence_id);
    if (it == transfers_.end()) continue;
    const std::shared_ptr<Transfer>& t = it->second;
    // Only the chunk that completes the prompt ships (chunked prefill: all blocks at once).
    if (chunk.start_position + int64_t(chunk.tokens.size()) != int64_t(t->prompt_len)) continue;
    if (t->stage == Transfer::Stage::kUnsent) {
      // A late target ships from the layer during which it came, with the layers before in one send.
      if (!t->target_ready.load(std::memory_order_acquire)) continue;
      if (t->late) metrics_->kv_late_targets_total(layer == 0 ? "before_forward" : "during_forward").Inc();
      if (!BeginShipment(t, chunk.block_table)) continue;
      ShipLayers(t, 0, layer + 1);
    } else if (t->stage == Transfer::Stage::kSending) {
      ShipLayers(t, layer, 1);
    }
  }
}

bool PrefillService::BeginShipment(const std::shared_ptr<Transfer>& t, absl::Span<const int32_t> block_table) {
  t->stage = Transfer::Stage::kSending;
  const size_t end_block = (t->prompt_len + uint32_t(block_size_) - 1) / uint32_t(block_size_);
  const size_t first_block = t->to.first_token / uint32_t(block_size_);
  t->num_tokens = t->prompt_len - t->to.first_token;
  if (block_table.size() < end_block ||
      (!t->to.device() && t->staging_block_ids.size() != end_block - first_block)) {
    FinishShipment(t, absl::InternalError("the prefill sequence's block table does not cover its prompt"));
    return false;
  }
  t->cache_block_ids.assign(block_table.begin() + int64_t(first_block), block_table.begin() + int64_t(end_block));
  t->send_start = std::chrono::steady_clock::now();
  return true;
}

void PrefillService::ShipLayers(const std::shared_ptr<Transfer>& t, int64_t first_layer, int64_t num_layers) {
  kvtransfer::LayerSend send;
  send.request_id = t->to.transfer_id;
  send.layer = uint32_t(first_layer);
  send.num_layers = uint32_t(num_layers);
  send.num_tokens = t->num_tokens;
  send.dst_block_ids = t->to.dst_block_ids;
  send.with_checksums = options_.verify_kv_checksums;
  if (t->to.device()) {
    // Copied from the cache blocks on the executor's stream, right behind the layers.
    send.src_block_ids.assign(t->cache_block_ids.begin(), t->cache_block_ids.end());
    send.device_stream = device_stream_;
  } else {
    // Copied out of the cache once the layers are complete, so the sends never read blocks the
    // engine may reuse after this step.
    for (int64_t layer = first_layer; layer < first_layer + num_layers; ++layer) {
      if (absl::Status s = staging_->StageLayer(layer, t->cache_block_ids, t->staging_block_ids); !s.ok()) {
        return FinishShipment(t, s);
      }
    }
    send.src_block_ids.assign(t->staging_block_ids.begin(), t->staging_block_ids.end());
  }
  // Its outcome is reported by Finish, which resolves after every SendLayer of the request.
  (void)sender_->SendLayer(t->to.peer, std::move(send));
  if (first_layer + num_layers == num_layers_) FinishShipment(t, absl::OkStatus());
}

void PrefillService::FinishShipment(const std::shared_ptr<Transfer>& t, absl::Status why) {
  t->stage = Transfer::Stage::kEnded;
  // Layers already sent may still be reading the staging: Finish reports after them.
  sender_->Finish(t->to.peer, t->to.transfer_id, [this, t, why = std::move(why)](const absl::Status& finished) {
    if (why.ok()) return EndShipment(t, finished, /*count_failure=*/true);
    (void)sender_->Abort(t->to.peer, t->to.transfer_id);
    EndShipment(t, why, /*count_failure=*/true);
  });
}

void PrefillService::DropShipment(const std::shared_ptr<Transfer>& t) {
  t->stage = Transfer::Stage::kEnded;
  bool has_target;
  {
    absl::MutexLock lock(&t->target_mu);
    t->dropped = true;
    has_target = t->target_ready.load(std::memory_order_relaxed);
  }
  if (has_target && !stopping_) (void)sender_->Abort(t->to.peer, t->to.transfer_id);
  EndShipment(t, absl::AbortedError("the prompt's KV was not shipped"), /*count_failure=*/false);
}

void PrefillService::EndShipment(const std::shared_ptr<Transfer>& t, const absl::Status& status, bool count_failure) {
  staging_->Free(t->staging_block_ids);
  t->staging_block_ids.clear();
  AdmitWaiting();
  if (status.ok()) {
    const double bytes = double(t->num_tokens) * double(kv_token_bytes_);
    const std::string_view path = kvtransfer::TransferPathName(t->to.path);
    metrics_->kv_transfer_bytes.Observe(bytes);
    metrics_->kv_transfer_bytes_total(path).Inc(bytes);
    metrics_->kv_transfer_seconds(path).Observe(Seconds(std::chrono::steady_clock::now() - t->send_start));
    transfers_by_path_[size_t(t->to.path)].fetch_add(1, std::memory_order_relaxed);
  } else if (count_failure) {
    metrics_->kv_transfer_failures.Inc();
  }
  std::shared_ptr<PrefillCall> call = std::move(t->call);
  if (call != nullptr) call->OnShipped(status);
}

// ---- Late targets ----

bool PrefillService::PublishTarget(const std::shared_ptr<Transfer>& t, const Destination& to,
                                   std::vector<int32_t> staging) {
  bool published = false;
  {
    absl::MutexLock lock(&t->target_mu);
    if (!t->dropped) {
      t->to = to;
      t->staging_block_ids = std::move(staging);
      t->target_ready.store(true, std::memory_order_release);
      published = true;
    }
  }
  if (!published) {  // the shipment ended before the target came
    (void)sender_->Abort(to.peer, to.transfer_id);
    staging_->Free(staging);
    AdmitWaiting();
    return false;
  }
  // A forward pass under way ships from its next layer; one that is over, from the kept blocks.
  loop_->Post([this, t](LlmEngine& engine) { ShipKept(engine, t); });
  return true;
}

void PrefillService::KeepForLateTarget(LlmEngine& engine, const std::shared_ptr<Transfer>& t, SequenceId kept) {
  t->kept_kv = kept;
  kept_transfers_[t->request_id] = t;
  ShipKept(engine, t);  // the target may have come after the last layer
}

void PrefillService::ShipKept(LlmEngine& engine, const std::shared_ptr<Transfer>& t) {
  if (t->stage != Transfer::Stage::kUnsent || !t->kept_kv.has_value() ||
      !t->target_ready.load(std::memory_order_acquire)) {
    return;
  }
  metrics_->kv_late_targets_total("after_forward").Inc();
  if (BeginShipment(t, engine.BlockTable(*t->kept_kv))) ShipLayers(t, 0, num_layers_);
  // The copies are on the cache's stream (or staged) ahead of any reuse of the blocks.
  ReleaseKept(engine, t);
}

void PrefillService::DropKept(LlmEngine& engine, const std::string& request_id) {
  auto it = kept_transfers_.find(request_id);
  if (it == kept_transfers_.end()) return;
  std::shared_ptr<Transfer> t = it->second;
  if (t->stage == Transfer::Stage::kUnsent) DropShipment(t);
  ReleaseKept(engine, t);
}

void PrefillService::ReleaseKept(LlmEngine& engine, const std::shared_ptr<Transfer>& t) {
  if (t->kept_kv.has_value()) engine.ReleaseKv(*std::exchange(t->kept_kv, std::nullopt));
  kept_transfers_.erase(t->request_id);
}

void PrefillService::AwaitTarget(const std::shared_ptr<PrefillCall>& call) {
  std::optional<v1::KvTarget> unclaimed;
  {
    absl::MutexLock lock(&late_mu_);
    auto it = unclaimed_targets_.find(call->id());
    if (it != unclaimed_targets_.end()) {
      unclaimed = std::move(it->second);
      unclaimed_targets_.erase(it);
    } else {
      awaiting_target_[call->id()] = call;
    }
  }
  if (unclaimed.has_value()) {
    (void)call->AttachTarget(*unclaimed);  // its error, if any, ends the call
  } else if (call->ended()) {
    StopAwaitingTarget(call->id());  // it ended (on the engine thread) before it was registered
  }
}

std::shared_ptr<PrefillService::PrefillCall> PrefillService::TakeWaitingCall(const std::string& request_id,
                                                                             const v1::KvTarget* unclaimed) {
  absl::MutexLock lock(&late_mu_);
  auto it = awaiting_target_.find(request_id);
  if (it != awaiting_target_.end()) {
    std::shared_ptr<PrefillCall> call = std::move(it->second);
    awaiting_target_.erase(it);
    return call;
  }
  // Ahead of its Prefill call (or after it ended; then the router's Abort, carrying the target,
  // tells the decode worker).
  if (unclaimed != nullptr && unclaimed_targets_.emplace(request_id, *unclaimed).second) {
    unclaimed_order_.push_back(request_id);
    if (unclaimed_order_.size() > kMaxUnclaimedTargets) {
      unclaimed_targets_.erase(unclaimed_order_.front());
      unclaimed_order_.pop_front();
    }
  }
  return nullptr;
}

std::optional<v1::KvTarget> PrefillService::TakeUnclaimedTarget(const std::string& request_id) {
  absl::MutexLock lock(&late_mu_);
  auto it = unclaimed_targets_.find(request_id);
  if (it == unclaimed_targets_.end()) return std::nullopt;
  v1::KvTarget target = std::move(it->second);
  unclaimed_targets_.erase(it);
  return target;
}

void PrefillService::StopAwaitingTarget(const std::string& request_id) {
  absl::MutexLock lock(&late_mu_);
  awaiting_target_.erase(request_id);
  unclaimed_targets_.erase(request_id);
}

grpc::ServerUnaryReactor* PrefillService::SetKvTarget(grpc::CallbackServerContext* context,
                                                      const v1::SetKvTargetRequest* request,
                                                      v1::SetKvTargetResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::shared_ptr<PrefillCall> call = TakeWaitingCall(request->request_id(), &request->target());
  reactor->Finish(call != nullptr ? call->AttachTarget(request->target()) : grpc::Status::OK);
  return reactor;
}

absl::StatusOr<kvtransfer::PeerId> PrefillService::PeerFor(const std::string& descriptor) {
  std::vector<kvtransfer::PeerId> forgotten;
  {
    absl::MutexLock lock(&peers_mu_);
    forgotten.swap(forgotten_peers_);
  }
  for (kvtransfer::PeerId peer : forgotten) sender_->Disconnect(peer);
  {
    absl::MutexLock lock(&peers_mu_);
    auto it = peers_.find(descriptor);
    if (it != peers_.end()) return it->second;
  }
  absl::StatusOr<kvtransfer::PeerId> peer = sender_->Connect(descriptor);
  if (!peer.ok()) return peer.status();
  absl::MutexLock lock(&peers_mu_);
  auto [it, inserted] = peers_.emplace(descriptor, *peer);
  if (!inserted) forgotten_peers_.push_back(*peer);  // another call connected first
  return it->second;
}

void PrefillService::ForgetPeer(const std::string& descriptor, kvtransfer::PeerId peer) {
  absl::MutexLock lock(&peers_mu_);
  auto it = peers_.find(descriptor);
  if (it == peers_.end() || it->second != peer) return;  // already replaced
  peers_.erase(it);
  forgotten_peers_.push_back(peer);
}

// ---- Abort, stats, metrics ----

grpc::ServerUnaryReactor* PrefillService::Abort(grpc::CallbackServerContext* context,
                                                const v1::WorkerAbortRequest* request,
                                                v1::WorkerAbortResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const std::string& id = request->request_id();
  std::shared_ptr<PrefillCall> waiting = LeaveAdmission(id);
  if (waiting != nullptr) waiting->AbortWhileWaiting();
  StopAwaitingTarget(id);
  std::optional<v1::KvTarget> target;
  if (request->has_kv_target()) target = request->kv_target();
  // A request in the engine is aborted between steps (its shipment, if under way, ends with a
  // notice to the decode worker); the answer goes out from there.
  loop_->Post([this, id, found = waiting != nullptr, target = std::move(target), reactor, response](LlmEngine& engine) {
    const Request* req = engine.Find(id);
    const bool running = req != nullptr && !req->finished();
    bool without_its_target = false;  // a late target that has not come: the decode worker must hear it here
    if (running) {
      loop_->Abort(id);  // after the next step, whose forward pass may complete the prompt: keep nothing then
      if (auto it = transfers_.find(req->seq_id); it != transfers_.end()) {
        it->second->abandoned = true;
        without_its_target = !it->second->target_ready.load(std::memory_order_acquire);
      }
    }
    auto kept_it = kept_transfers_.find(id);
    const bool kept = kept_it != kept_transfers_.end();
    if (kept) {  // its forward pass is over, its blocks wait for a late target
      without_its_target = !kept_it->second->target_ready.load(std::memory_order_acquire);
      if (kept_it->second->call != nullptr) kept_it->second->call->AbortKept();
      DropKept(engine, id);
    }
    if ((!found && !running && !kept) || without_its_target) AbortUnknown(id, target ? &*target : nullptr);
    response->set_found(found || running || kept);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

void PrefillService::AbortUnknown(const std::string& id, const v1::KvTarget* target) {
  if (aborted_unknown_.insert(id).second) {
    aborted_unknown_order_.push_back(id);
    if (aborted_unknown_order_.size() > kMaxAbortedUnknown) {
      aborted_unknown_.erase(aborted_unknown_order_.front());
      aborted_unknown_order_.pop_front();
    }
  }
  // Its Prefill call never started here (or is over, its shipment ended with a notice of its own,
  // and one more is harmless): nothing from here writes into the target's blocks.
  if (target == nullptr || target->receiver_descriptor().empty() || stopping_) return;
  if (!rpc::VerifyKvTarget(options_.kv_target_key, *target).ok()) return;
  absl::StatusOr<kvtransfer::PeerId> peer = PeerFor(target->receiver_descriptor());
  if (peer.ok()) (void)sender_->Abort(*peer, target->transfer_id());
}

void PrefillService::RefreshMetrics() {
  const EngineStats stats = loop_->Stats();
  absl::MutexLock lock(&metrics_mu_);
  rpc::RecordEngineStats(stats, *metrics_, &recorded_stats_);
  // Waiting in the worker: in the engine's queue, or for staging blocks before it.
  absl::MutexLock admission(&admission_mu_);
  metrics_->num_requests_waiting.Set(double(stats.num_waiting) + double(waiting_.size()));
}

std::string PrefillService::RenderMetrics() {
  RefreshMetrics();
  return metrics_registry_.Render();
}

grpc::ServerUnaryReactor* PrefillService::GetStats(grpc::CallbackServerContext* context, const v1::GetStatsRequest*,
                                                   v1::WorkerStats* response) {
  rpc::FillWorkerStats(loop_->Stats(), "prefill", block_size_, response);
  response->set_num_kv_leases(0);
  response->set_late_kv_target(true);
  response->set_sp_ranks(sequence_parallel_.ranks);
  response->set_sp_min_tokens(sequence_parallel_.min_tokens);
  {
    absl::MutexLock lock(&peers_mu_);
    for (const auto& [descriptor, peer] : peers_) {
      ++(*response->mutable_kv_peers_by_path())[std::string(kvtransfer::TransferPathName(sender_->path(peer)))];
    }
  }
  for (kvtransfer::TransferPath path : {kvtransfer::TransferPath::kUcxNetwork, kvtransfer::TransferPath::kUcxSharedMemory,
                                        kvtransfer::TransferPath::kCudaIpc}) {
    const int64_t shipped = transfers_by_path_[size_t(path)].load(std::memory_order_relaxed);
    if (shipped > 0) (*response->mutable_kv_transfers_by_path())[std::string(kvtransfer::TransferPathName(path))] = shipped;
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace duet
