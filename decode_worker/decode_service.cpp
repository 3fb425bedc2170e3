#include "decode_worker/decode_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/logging.h"
#include "kvtransfer/ucx_transport.h"
#include "model/served_model_name.h"
#include "rpc/kv_target_auth.h"
#include "rpc/rpc_util.h"

namespace duet {
namespace {

grpc::Status Error(grpc::StatusCode code, std::string message) {
  return grpc::Status(code, std::move(message));
}

void ToResponse(const RequestOutput& out, const SamplingParams& params, v1::GenerateResponse* r) {
  r->set_request_id(out.id);
  for (int32_t id : out.new_token_ids) r->add_token_ids(id);
  r->set_text(out.new_text);
  if (params.logprobs >= 0) {
    for (size_t i = 0; i < out.new_token_ids.size() && i < out.new_logprobs.size(); ++i) {
      SampledToken token{out.new_token_ids[i], out.new_logprobs[i],
                         i < out.new_top_logprobs.size() ? out.new_top_logprobs[i]
                                                         : std::vector<TokenLogprob>{}};
      rpc::ToProto(token, r->add_logprobs());
    }
  }
  if (out.finished) {
    r->set_finished(true);
    r->set_finish_reason(FinishReasonName(out.finish_reason));
  }
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeService>> DecodeService::Create(std::unique_ptr<LlmEngine> engine,
                                                                     DecodeServiceOptions options) {
  absl::StatusOr<WorkerKvPools> pools =
      MakeWorkerKvPools(engine->kv_cache(), engine->config().scheduler, options.kv_pools);
  if (!pools.ok()) {
    return absl::Status(pools.status().code(),
                        absl::StrCat("cannot set up the KV staging: ", pools.status().message()));
  }
  std::unique_ptr<DecodeService> service(new DecodeService(std::move(engine), options));
  DecodeService* self = service.get();
  service->staging_ = std::move(pools->staging);
  service->device_kv_ = std::move(pools->device);
  kvtransfer::ReceiverCallbacks callbacks;
  callbacks.on_request_done = [self](uint64_t transfer_id, const absl::Status& status,
                                     kvtransfer::MemoryKind landed) {
    self->OnRequestDone(transfer_id, status, landed);
  };
  callbacks.on_blocks_released = [self](const kvtransfer::ReleasedLease& lease) {
    self->OnBlocksReleased(lease.request_id,
                           absl::StrCat("its KV lease ended (", std::string(kvtransfer::LeaseEndName(lease.reason)), ")"));
  };
  kvtransfer::UcxReceiverOptions receiver_options;
  receiver_options.device = service->device_kv_.get();
  absl::StatusOr<std::unique_ptr<kvtransfer::KvReceiver>> receiver =
      kvtransfer::CreateUcxKvReceiver(pools->memory, std::move(callbacks), receiver_options);
  if (!receiver.ok()) {
    return absl::Status(receiver.status().code(),
                        absl::StrCat("cannot start the KV receiver: ", receiver.status().message()));
  }
  service->receiver_ = std::move(*receiver);
  // MigrateKv reads the blocks it ships from the same pools transfers land in.
  absl::StatusOr<std::unique_ptr<kvtransfer::KvSender>> sender =
      kvtransfer::CreateUcxKvSender(pools->memory, options.sender);
  if (!sender.ok()) {
    return absl::Status(sender.status().code(),
                        absl::StrCat("cannot start the KV sender: ", sender.status().message()));
  }
  service->sender_ = std::move(*sender);
  return service;
}

DecodeService::DecodeService(std::unique_ptr<LlmEngine> engine, DecodeServiceOptions options)
    : options_(options),
      block_size_(engine->config().block_size),
      metrics_(std::make_unique<metrics::DecodeMetrics>(metrics_registry_,
                                                        ServedModelName(options.model_name, engine->config().model_dir))) {
  metrics_->SetCacheConfig(rpc::CacheConfigOf(*engine));
  loop_ = std::make_unique<EngineLoop>(std::move(engine), nullptr, [this](int64_t num_tokens) {
    metrics_->iteration_tokens_total.Observe(double(num_tokens));
  });
}

DecodeService::~DecodeService() {
  timer_.Stop();  // no claim expires and no Decode wait ends from here on
  // Releases the leases it still holds (through OnBlocksReleased) while the engine is alive.
  receiver_.reset();
  sender_.reset();  // its shipments in flight end first
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, r] : by_transfer_) r->owns_blocks = false;  // the engine goes with the loop
    by_transfer_.clear();
    transfer_by_request_.clear();
  }
  loop_.reset();
}

// ---- Reservations ----

void DecodeService::ForgetLocked(const Reservation& r) {
  by_transfer_.erase(r.transfer_id);
  auto it = transfer_by_request_.find(r.request_id);
  if (it != transfer_by_request_.end() && it->second == r.transfer_id) transfer_by_request_.erase(it);
}

void DecodeService::EndLocked(Reservation& r, absl::Status why) {
  if (r.state == ReservationState::kClaimed || r.state == ReservationState::kEnded) return;
  r.state = ReservationState::kEnded;
  r.failure = std::move(why);
  if (r.claim_timer != 0) timer_.Cancel(r.claim_timer);
  if (!r.staging_blocks.empty()) {
    staging_->Free(r.staging_blocks);
    r.staging_blocks.clear();
  }
  if (r.owns_blocks) {
    r.owns_blocks = false;
    const SequenceId seq = r.seq;
    loop_->Post([seq](LlmEngine& engine) { engine.ReleaseKv(seq); });
  }
  ForgetLocked(r);
  if (r.on_settled) std::exchange(r.on_settled, nullptr)();
}

void DecodeService::MarkReceivedLocked(const std::shared_ptr<Reservation>& held) {
  Reservation& r = *held;
  // The receiver committed the lease: the blocks are ours until Decode claims them.
  r.state = ReservationState::kReceived;
  r.claim_timer = timer_.Schedule(absl::Now() + r.lease, [this, held] { ExpireClaim(held); });
  if (r.on_settled) std::exchange(r.on_settled, nullptr)();
}

void DecodeService::ExpireClaim(const std::shared_ptr<Reservation>& r) {
  absl::MutexLock lock(&mu_);
  if (r->state != ReservationState::kReceived) return;
  r->claim_timer = 0;  // running now
  EndLocked(*r, absl::FailedPreconditionError(
                    absl::StrCat("the KV blocks of request '", r->request_id,
                                 "' were not claimed by a Decode call within the lease and were released")));
}

bool DecodeService::Unstage(uint64_t transfer_id, kvtransfer::MemoryKind landed, absl::Status* unstaged) {
  // Nothing else ends a reservation whose lease the receiver has committed while it is still
  // kTransferring, so the blocks stay put while they are copied outside the lock.
  std::vector<int32_t> staged, cache_blocks;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_transfer_.find(transfer_id);
    if (it == by_transfer_.end() || it->second->state != ReservationState::kTransferring) return false;
    staged = std::exchange(it->second->staging_blocks, {});
    cache_blocks = it->second->cache_blocks;
  }
  // Over CUDA IPC the bytes are in the cache blocks already; the staging was not used.
  if (landed == kvtransfer::MemoryKind::kHost) *unstaged = staging_->Unstage(staged, cache_blocks);
  staging_->Free(staged);
  return true;
}

void DecodeService::OnRequestDone(uint64_t transfer_id, const absl::Status& status, kvtransfer::MemoryKind landed) {
  absl::Status unstaged = absl::OkStatus();
  if (status.ok() && staging_ != nullptr && !Unstage(transfer_id, landed, &unstaged)) return;
  absl::MutexLock lock(&mu_);
  auto it = by_transfer_.find(transfer_id);
  if (it == by_transfer_.end()) return;
  Reservation& r = *it->second;
  if (r.state != ReservationState::kTransferring) return;
  if (!unstaged.ok()) {
    EndLocked(r, absl::InternalError(absl::StrCat("copying the KV of request '", r.request_id,
                                                  "' from staging into the cache failed: ", unstaged.message())));
  } else if (status.ok() && r.cancelled.has_value()) {
    EndLocked(r, *r.cancelled);  // the receiver had committed the lease when Cancel came
  } else if (status.ok()) {
    MarkReceivedLocked(it->second);
  } else {
    EndLocked(r, absl::UnavailableError(absl::StrCat("the KV transfer for request '", r.request_id,
                                                     "' failed: ", status.ToString())));
  }
}

void DecodeService::OnBlocksReleased(uint64_t transfer_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = by_transfer_.find(transfer_id);
  if (it == by_transfer_.end()) return;
  Reservation& r = *it->second;
  EndLocked(r, absl::UnavailableError(
                   absl::StrCat("the KV transfer for request '", r.request_id, "' did not complete: ", why)));
}

bool DecodeService::CancelReservation(const std::shared_ptr<Reservation>& r, absl::Status why,
                                      kvtransfer::KvReceiver::CancelRelease release) {
  {
    absl::MutexLock lock(&mu_);
    if (r->state == ReservationState::kClaimed || r->state == ReservationState::kEnded) return false;
    if (r->state == ReservationState::kReceived) {
      EndLocked(*r, std::move(why));
      return true;
    }
    r->cancelled = why;
    // Shipping (MigrateKv): its end releases it, or, should the shipment fail, sees `cancelled`.
    if (r->state == ReservationState::kShipping) return true;
  }
  // Transferring: the receiver holds the lease. Cancel ends it, now or once the sender has
  // stopped (OnBlocksReleased may run on this thread, so mu_ must not be held). If it ended
  // meanwhile, make sure it is gone anyway.
  receiver_->Cancel(r->transfer_id, release);
  absl::MutexLock lock(&mu_);
  if (r->state == ReservationState::kReceived) EndLocked(*r, why);
  if (r->state == ReservationState::kEnded) r->failure = std::move(why);
  return true;
}

absl::Status DecodeService::Claim(Reservation& r) {
  absl::MutexLock lock(&mu_);
  if (r.state == ReservationState::kReceived) {
    r.state = ReservationState::kClaimed;
    if (r.claim_timer != 0) timer_.Cancel(r.claim_timer);
    ForgetLocked(r);
    return absl::OkStatus();
  }
  // Ended: blocks already released. Transfer failures are UNAVAILABLE, the rest say why.
  return r.failure.ok() ? absl::UnavailableError("the KV reservation ended") : r.failure;
}

std::shared_ptr<DecodeService::Reservation> DecodeService::FindByTransfer(uint64_t transfer_id) {
  absl::MutexLock lock(&mu_);
  auto it = by_transfer_.find(transfer_id);
  return it == by_transfer_.end() ? nullptr : it->second;
}

std::shared_ptr<DecodeService::Reservation> DecodeService::FindByRequest(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  auto it = transfer_by_request_.find(request_id);
  if (it == transfer_by_request_.end()) return nullptr;
  auto r = by_transfer_.find(it->second);
  return r == by_transfer_.end() ? nullptr : r->second;
}

// A Decode call comes after the router's Prefill call has returned, which the prefill worker
// answers once its last put has landed (or with the transfer never started): when a Decode call
// ends a reservation, nothing writes into its blocks any more.
constexpr kvtransfer::KvReceiver::CancelRelease kDecodeCallRelease = kvtransfer::KvReceiver::CancelRelease::kNow;

// ---- ReserveKv ----

// One ReserveKv. No reservation outlives a call whose client is gone: a call cancelled (by the
// router, its deadline, a lost connection) before the engine gets to it reserves nothing, and one
// whose answer never reached the router releases what it reserved when the call ends. The
// router's Abort, which may overtake the reservation, covers the rest.
class DecodeService::ReserveKvCall final : public grpc::ServerUnaryReactor {
 public:
  ReserveKvCall(DecodeService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {}

  void Start(const v1::ReserveKvRequest* request, v1::ReserveKvResponse* response) {
    if (request->num_prompt_tokens() <= 0) {
      Finish(Error(grpc::StatusCode::INVALID_ARGUMENT, "num_prompt_tokens must be positive"));
      return;
    }
    // The engine sets the blocks aside between steps; the answer goes out from there.
    service_->loop_->Post([this, request, response](LlmEngine& engine) {
      if (context_->IsCancelled()) {
        Finish(Error(grpc::StatusCode::CANCELLED, "the ReserveKv call was cancelled"));
        return;
      }
      const grpc::Status status = service_->Reserve(engine, *request, response, &reservation_);
      Finish(status);
    });
  }

  void OnCancel() override {}  // the engine thread or OnDone sees it
  void OnDone() override {
    // IsCancelled now says whether the answer failed to reach the client.
    if (reservation_ != nullptr && context_->IsCancelled()) {
      // The router never got the target, so no prefill worker can write into the blocks.
      service_->CancelReservation(
          reservation_,
          absl::CancelledError(absl::StrCat("the ReserveKv call for request '", reservation_->request_id,
                                            "' was cancelled")),
          kvtransfer::KvReceiver::CancelRelease::kNow);
    }
    delete this;
  }

 private:
  DecodeService* const service_;
  grpc::CallbackServerContext* const context_;
  std::shared_ptr<Reservation> reservation_;  // set on the engine thread before Finish
};

grpc::ServerUnaryReactor* DecodeService::ReserveKv(grpc::CallbackServerContext* context,
                                                   const v1::ReserveKvRequest* request,
                                                   v1::ReserveKvResponse* response) {
  auto* call = new ReserveKvCall(this, context);
  call->Start(request, response);
  return call;
}

grpc::Status DecodeService::Reserve(LlmEngine& engine, const v1::ReserveKvRequest& request,
                                    v1::ReserveKvResponse* response, std::shared_ptr<Reservation>* made) {
  absl::StatusOr<std::shared_ptr<Reservation>> reserved = NewReservation(engine, request);
  if (!reserved.ok()) {
    if (reserved.status().code() == absl::StatusCode::kResourceExhausted) {
      return Error(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(reserved.status().message()));
    }
    return rpc::ToGrpc(reserved.status());
  }
  std::shared_ptr<Reservation> r = *std::move(reserved);
  if (absl::Status s = Register(r); !s.ok()) {
    engine.ReleaseKv(r->seq);
    if (!r->staging_blocks.empty()) staging_->Free(r->staging_blocks);
    return rpc::ToGrpc(s);
  }
  const std::vector<int32_t>& landing = staging_ != nullptr ? r->staging_blocks : r->cache_blocks;
  kvtransfer::ExpectedRequest expected;
  expected.request_id = r->transfer_id;
  expected.num_tokens = uint32_t(r->num_tokens - r->first_token);
  expected.dst_block_ids.assign(landing.begin(), landing.end());
  if (device_kv_ != nullptr) expected.device_block_ids.assign(r->cache_blocks.begin(), r->cache_blocks.end());
  expected.lease_ttl = r->lease;
  expected.verify_checksums = options_.verify_kv_checksums;
  v1::KvTarget* target = response->mutable_target();
  // Before Expect: it may end `r`.
  for (int32_t b : landing) target->add_block_ids(uint32_t(b));
  for (uint32_t b : expected.device_block_ids) target->add_device_block_ids(b);
  if (absl::Status s = receiver_->Expect(std::move(expected)); !s.ok()) {
    absl::MutexLock lock(&mu_);
    EndLocked(*r, s);
    return Error(grpc::StatusCode::INTERNAL, absl::StrCat("cannot expect the KV transfer: ", s.message()));
  }
  target->set_receiver_descriptor(receiver_->descriptor());
  target->set_transfer_id(r->transfer_id);
  target->set_first_token(uint32_t(r->first_token));
  rpc::SignKvTarget(options_.kv_target_key, target);  // the prefill worker writes only into this
  *made = std::move(r);
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<DecodeService::Reservation>> DecodeService::NewReservation(
    LlmEngine& engine, const v1::ReserveKvRequest& request) {
  const int32_t num_tokens = request.num_prompt_tokens();
  const bool with_ids = request.prompt_token_ids_size() > 0;
  if (with_ids && request.prompt_token_ids_size() != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("ReserveKv has ", request.prompt_token_ids_size(),
                                                   " prompt token ids for num_prompt_tokens ", num_tokens));
  }
  if (request.prefix_alignment_tokens() < 0) {
    return absl::InvalidArgumentError("prefix_alignment_tokens must not be negative");
  }
  // Without the ids, a reservation of that many tokens that reuses nothing.
  const std::vector<int32_t> ids = with_ids ? std::vector<int32_t>(request.prompt_token_ids().begin(),
                                                                   request.prompt_token_ids().end())
                                            : std::vector<int32_t>(size_t(std::max(num_tokens, 0)), 0);
  absl::StatusOr<LlmEngine::KvReservation> reserved =
      engine.ReserveKv(ids, request.cache_salt(), with_ids ? request.prefix_alignment_tokens() : 0);
  if (!reserved.ok()) {
    if (reserved.status().code() != absl::StatusCode::kResourceExhausted) return reserved.status();
    return absl::ResourceExhaustedError(absl::StrCat("decode worker has no free KV blocks for ", num_tokens,
                                                     " prompt tokens: ", reserved.status().message()));
  }
  const SequenceId seq = reserved->seq;
  const std::vector<int32_t>& table = engine.BlockTable(seq);
  const size_t num_blocks = (size_t(num_tokens) + size_t(block_size_) - 1) / size_t(block_size_);
  const size_t first_block = size_t(reserved->num_cached_tokens) / size_t(block_size_);
  DUET_CHECK(table.size() >= num_blocks && first_block < num_blocks);
  auto r = std::make_shared<Reservation>();
  r->request_id = request.request_id();
  r->transfer_id = request.transfer_id();
  r->seq = seq;
  r->num_tokens = num_tokens;
  r->first_token = int32_t(reserved->num_cached_tokens);
  r->cached_prefix.assign(ids.begin(), ids.begin() + r->first_token);
  r->lease = std::min(request.lease_ms() > 0 ? absl::Milliseconds(request.lease_ms()) : options_.default_lease,
                      options_.max_lease);
  r->cache_blocks.assign(table.begin() + int64_t(first_block), table.begin() + int64_t(num_blocks));
  if (staging_ != nullptr) {
    absl::StatusOr<std::vector<int32_t>> staged = staging_->Allocate(int64_t(r->cache_blocks.size()));
    if (!staged.ok() && device_kv_ != nullptr) {
      return r;  // a prefill worker on this host can still write the cache blocks directly
    }
    if (!staged.ok()) {
      engine.ReleaseKv(seq);
      return absl::ResourceExhaustedError(absl::StrCat("decode worker has no free KV staging blocks for ",
                                                       num_tokens, " prompt tokens: ", staged.status().message()));
    }
    r->staging_blocks = *std::move(staged);
  }
  return r;
}

absl::Status DecodeService::Register(const std::shared_ptr<Reservation>& r) {
  absl::MutexLock lock(&mu_);
  if (by_transfer_.count(r->transfer_id)) {
    return absl::AlreadyExistsError(absl::StrCat("transfer id ", r->transfer_id, " already has a KV reservation"));
  }
  by_transfer_[r->transfer_id] = r;
  transfer_by_request_[r->request_id] = r->transfer_id;
  return absl::OkStatus();
}

// ---- Decode ----

// One Decode stream: wait for the reservation's transfer, claim its blocks, join the batch, and
// write the request's outputs one message at a time (the next write starts when the previous one
// is done; outputs that arrive meanwhile queue in order). Its events come from several threads
// (gRPC's OnCancel and OnWriteDone, the engine thread's outputs, the receiver's or the timer's end
// of the wait), so its state is behind mu_, and gRPC operations start outside the lock.
class DecodeService::DecodeCall final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                                        public std::enable_shared_from_this<DecodeCall> {
 public:
  DecodeCall(DecodeService* service, grpc::CallbackServerContext* context, const v1::DecodeRequest* request)
      : service_(service), context_(context), request_(*request),
        prompt_(request->prompt_token_ids().begin(), request->prompt_token_ids().end()) {
    resumed_.tokens.assign(request->output_token_ids().begin(), request->output_token_ids().end());
    num_output_tokens_ = int32_t(resumed_.tokens.size());
  }

  // Checks the request against its reservation and waits for the transfer.
  void Start();

  void OnCancel() override;
  void OnWriteDone(bool ok) override;
  // Engine thread, draining: parks the request (if it is decoding) and ends the stream, after
  // the messages queued, with kKvParkedTrailer.
  void Park(LlmEngine& engine);
  void OnDone() override {
    auto last_reference = std::move(self_);  // may destroy this at the end of the scope
  }
  // The transfer whose reservation the request decodes from (0: it prefilled here).
  uint64_t transfer_id() const { return reservation_ != nullptr ? reservation_->transfer_id : 0; }

 private:
  enum class Stage { kWaiting, kJoining, kStreaming };

  // DecodeRequest.prefill_here: checks the request and joins the batch with its prompt to compute.
  void StartPrefillHere();
  // Until the reservation leaves kTransferring (at once if it has), bounded by a timer.
  void WaitForTransfer();
  // The transfer settled (the reservation left kTransferring): claim and join, on the engine thread.
  void Settled();
  void OnWaitTimedOut();
  // Engine thread: adds the request to the batch (with the reservation's blocks, claimed here, or
  // with its prompt to prefill) and subscribes the stream to its outputs.
  void Join(LlmEngine& engine);
  // Engine thread: the request with the claimed reservation's blocks (released on failure).
  absl::StatusOr<RequestOutput> JoinReservation(LlmEngine& engine);
  // Engine thread: one output of the request becomes the next queued message.
  void OnOutput(const RequestOutput& out);
  v1::GenerateResponse ToMessage(const RequestOutput& out);
  // Why the wait for the transfer failed, as the Decode call's status.
  grpc::Status WaitFailure(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts the next write, or the Finish once no write is in flight.
  void Pump() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the call with `status` (the first one wins) once the write in flight is done.
  void End(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_);
  void RecordFinished();

  DecodeService* const service_;
  grpc::CallbackServerContext* const context_;
  const v1::DecodeRequest request_;
  const std::vector<int32_t> prompt_;
  ResumedOutput resumed_;  // a migrated request's output so far (its text's emitted bytes once checked)
  std::shared_ptr<DecodeCall> self_;  // the server call's reference, dropped in OnDone
  SamplingParams params_;
  std::shared_ptr<Reservation> reservation_;
  DeadlineTimer::Id wait_timer_ = 0;

  // Engine thread only.
  int32_t num_output_tokens_ = 0;  // the request's, a migrated one's output so far included
  bool prompt_echoed_ = false;
  std::chrono::steady_clock::time_point joined_at_{};

  absl::Mutex mu_;
  Stage stage_ ABSL_GUARDED_BY(mu_) = Stage::kWaiting;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool timed_out_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::GenerateResponse> queued_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a StartWrite of `writing_message_` is in flight
  std::optional<grpc::Status> end_status_ ABSL_GUARDED_BY(mu_);
  // Parked: the queued messages go out before the Finish, whose trailer names the reservation.
  std::optional<uint64_t> parked_transfer_id_ ABSL_GUARDED_BY(mu_);
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  v1::GenerateResponse writing_message_;  // owned by the write in flight
};

grpc::ServerWriteReactor<v1::GenerateResponse>* DecodeService::Decode(grpc::CallbackServerContext* context,
                                                                      const v1::DecodeRequest* request) {
  auto call = std::make_shared<DecodeCall>(this, context, request);
  call->Start();  // the call holds itself until OnDone
  return call.get();
}

void DecodeService::DecodeCall::Start() {
  self_ = shared_from_this();
  if (request_.prefill_here()) return StartPrefillHere();
  reservation_ = service_->FindByTransfer(request_.transfer_id());
  if (reservation_ == nullptr) {
    return End(Error(grpc::StatusCode::FAILED_PRECONDITION,
                     absl::StrCat("no KV reservation for transfer id ", request_.transfer_id(), " (request '",
                                  request_.request_id(),
                                  "'): unknown, or it ended (lease expired, transfer failed or aborted)")));
  }
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(request_.sampling());
  absl::Status invalid = params.status();
  // The reservation holds the KV of the prompt and of a migrated request's output so far.
  std::vector<int32_t> prefilled = prompt_;
  prefilled.insert(prefilled.end(), resumed_.tokens.begin(), resumed_.tokens.end());
  // kv_attached: the last output token's KV is not computed yet.
  if (request_.kv_attached() && !prefilled.empty()) prefilled.pop_back();
  if (invalid.ok() && request_.kv_attached() && resumed_.tokens.empty()) {
    invalid = absl::InvalidArgumentError("a kv_attached Decode call needs output_token_ids");
  }
  if (invalid.ok() && int32_t(prefilled.size()) != reservation_->num_tokens) {
    invalid = absl::InvalidArgumentError(absl::StrCat("the prompt (and output so far) has ", prefilled.size(),
                                                      " tokens but the KV reservation was for ",
                                                      reservation_->num_tokens));
  }
  if (invalid.ok() && reservation_->parked && !request_.kv_attached()) {
    invalid = absl::InvalidArgumentError("a parked reservation is resumed only by a kv_attached Decode call");
  }
  if (invalid.ok() && request_.output_text_bytes() < 0) {
    invalid = absl::InvalidArgumentError("output_text_bytes must not be negative");
  }
  if (invalid.ok() &&
      !std::equal(reservation_->cached_prefix.begin(), reservation_->cached_prefix.end(), prefilled.begin())) {
    invalid = absl::InvalidArgumentError("the prompt differs from the one the KV reservation reused a cached prefix for");
  }
  if (!invalid.ok()) {
    service_->CancelReservation(reservation_, invalid, kDecodeCallRelease);
    return End(rpc::ToGrpc(invalid));
  }
  params_ = *std::move(params);
  resumed_.emitted_text_bytes = size_t(request_.output_text_bytes());
  WaitForTransfer();
}

void DecodeService::DecodeCall::StartPrefillHere() {
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(request_.sampling());
  absl::Status invalid = params.status();
  if (invalid.ok() && (request_.transfer_id() != 0 || request_.kv_attached() || !resumed_.tokens.empty() ||
                       request_.output_text_bytes() != 0)) {
    invalid = absl::InvalidArgumentError(
        "a prefill_here Decode call takes no transfer_id, kv_attached, output_token_ids or output_text_bytes");
  }
  if (invalid.ok() && params->prompt_logprobs >= 0) {
    invalid = absl::InvalidArgumentError("prompt logprobs come from a prefill worker, not from a prefill_here Decode call");
  }
  if (!invalid.ok()) return End(rpc::ToGrpc(invalid));
  if (service_->draining_.load(std::memory_order_acquire)) {
    return End(Error(grpc::StatusCode::UNAVAILABLE, "the decode worker is draining: it takes no new prompts"));
  }
  params_ = *std::move(params);
  Settled();
}

void DecodeService::DecodeCall::WaitForTransfer() {
  // The receiver ends the lease if the sender stalls, so the wait is bounded; the timer covers a
  // lost notice.
  wait_timer_ = service_->timer_.Schedule(absl::Now() + reservation_->lease + absl::Seconds(5),
                                           [self = shared_from_this()] { self->OnWaitTimedOut(); });
  bool waiting = false, taken = false;
  {
    absl::MutexLock lock(&service_->mu_);
    if (reservation_->on_settled) {
      taken = true;
    } else if (reservation_->state == ReservationState::kTransferring) {
      reservation_->on_settled = [self = shared_from_this()] { self->Settled(); };
      waiting = true;
    }
  }
  if (waiting) return;
  service_->timer_.Cancel(wait_timer_);
  if (taken) {
    return End(Error(grpc::StatusCode::ALREADY_EXISTS,
                     absl::StrCat("request '", request_.request_id(), "' already has a Decode call")));
  }
  Settled();
}

void DecodeService::DecodeCall::Settled() {
  {
    absl::MutexLock lock(&mu_);
    stage_ = Stage::kJoining;
  }
  service_->loop_->Post([self = shared_from_this()](LlmEngine& engine) { self->Join(engine); });
}

void DecodeService::DecodeCall::OnWaitTimedOut() {
  {
    absl::MutexLock lock(&mu_);
    if (stage_ != Stage::kWaiting) return;
    timed_out_ = true;
  }
  service_->CancelReservation(reservation_,
                              absl::CancelledError("the Decode call ended before the KV transfer completed"),
                              kDecodeCallRelease);
}

void DecodeService::DecodeCall::OnCancel() {
  Stage stage;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    stage = stage_;
  }
  // While joining, Join sees `cancelled_` and aborts the request it adds.
  if (stage == Stage::kWaiting && reservation_ != nullptr) {
    service_->CancelReservation(reservation_,
                                absl::CancelledError("the Decode call ended before the KV transfer completed"),
                                kDecodeCallRelease);
  } else if (stage == Stage::kStreaming) {
    service_->loop_->Abort(request_.request_id());
  }
  End(Error(grpc::StatusCode::CANCELLED, "the Decode call was cancelled"));
}

void DecodeService::DecodeCall::Join(LlmEngine& engine) {
  const std::string& id = request_.request_id();
  absl::StatusOr<RequestOutput> out;
  if (request_.prefill_here()) {
    // Queued as any request: its prompt runs in the batch's next steps, chunked within the token
    // budget beside the decoding requests. Nothing to emit until its first token.
    if (absl::Status added = engine.AddRequest(id, prompt_, params_); !added.ok()) return End(rpc::ToGrpc(added));
    service_->metrics_->prompt_tokens.Inc(double(prompt_.size()));
    out = RequestOutput{id};
  } else {
    service_->timer_.Cancel(wait_timer_);
    if (absl::Status claimed = service_->Claim(*reservation_); !claimed.ok()) return End(WaitFailure(claimed));
    out = JoinReservation(engine);
  }
  if (!out.ok()) return End(rpc::ToGrpc(out.status()));
  joined_at_ = std::chrono::steady_clock::now();
  if (!request_.kv_attached() && !request_.prefill_here()) OnOutput(*out);
  if (out->finished) {
    engine.Release(id);
  } else {
    service_->loop_->Subscribe(id, [self = shared_from_this()](const RequestOutput& o) { self->OnOutput(o); });
    service_->streaming_[id] = shared_from_this();
  }
  {
    absl::MutexLock lock(&mu_);
    stage_ = Stage::kStreaming;
    if (cancelled_ && !out->finished) {
      service_->loop_->Abort(id);
      return;
    }
  }
  // Joined while the worker drains (reserved before it began): it leaves with its KV as the others
  // did. Not a parked request resumed here (kv_attached: no other worker took it), which would
  // only be parked again.
  if (service_->parking_ && !out->finished && !request_.kv_attached()) Park(engine);
}

absl::StatusOr<RequestOutput> DecodeService::DecodeCall::JoinReservation(LlmEngine& engine) {
  // The blocks are this call's now: join the batch, or give them back.
  const std::string& id = request_.request_id();
  absl::StatusOr<RequestOutput> out;
  if (request_.kv_attached()) {
    // Nothing to emit until its next token.
    absl::Status attached = engine.AttachRequest(id, prompt_, params_, reservation_->seq, resumed_);
    out = attached.ok() ? absl::StatusOr<RequestOutput>(RequestOutput{id}) : attached;
  } else {
    const SampledToken first = rpc::FromProto(request_.first_token_id(), request_.first_token_logprobs());
    out = engine.AddPrefilledRequest(id, prompt_, params_, reservation_->seq, first, resumed_);
  }
  if (!out.ok()) engine.ReleaseKv(reservation_->seq);  // not taken by a request
  return out;
}

void DecodeService::DecodeCall::Park(LlmEngine& engine) {
  absl::StatusOr<uint64_t> parked = service_->Park(engine, request_.request_id());
  if (!parked.ok()) return;  // not decoding now: it finishes here
  service_->loop_->Unsubscribe(request_.request_id());
  service_->streaming_.erase(request_.request_id());
  {
    absl::MutexLock lock(&mu_);
    if (end_status_.has_value()) return;  // cancelled meanwhile: the router's Abort ends the reservation
    parked_transfer_id_ = *parked;
    end_status_ = Error(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("the decode worker is draining; request '", request_.request_id(),
                                     "' is parked with its KV for migration (trailer ", rpc::kKvParkedTrailer, ")"));
  }
  Pump();
}

// Live KV migration's parking (the rest is in decode_service_migration.cpp).
void DecodeService::StartDraining() {
  draining_.store(true, std::memory_order_release);
  if (!options_.park_on_drain) return;
  loop_->Post([this](LlmEngine& engine) {
    parking_ = true;
    std::vector<std::shared_ptr<DecodeCall>> calls;
    for (const auto& [id, call] : streaming_) calls.push_back(call);
    for (const std::shared_ptr<DecodeCall>& call : calls) call->Park(engine);
    DUET_LOG(INFO) << "decode worker: draining; parked " << calls.size() - streaming_.size() << " of " << calls.size()
                   << " decoding requests with their KV for migration";
  });
}

grpc::Status DecodeService::DecodeCall::WaitFailure(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (!timed_out_) return rpc::ToGrpc(why);
  return Error(grpc::StatusCode::UNAVAILABLE,
               absl::StrCat("the KV transfer for request '", request_.request_id(), "' did not complete in time"));
}

void DecodeService::DecodeCall::OnOutput(const RequestOutput& out) {
  if (out.finished) service_->streaming_.erase(request_.request_id());
  if (out.finish_reason == FinishReason::kError) {
    return End(Error(grpc::StatusCode::INTERNAL,
                     absl::StrCat("request '", request_.request_id(), "' failed: ", out.error)));
  }
  v1::GenerateResponse message = ToMessage(out);
  {
    absl::MutexLock lock(&mu_);
    queued_.push_back(std::move(message));
  }
  // Queued in order here; the write starts off the engine thread.
  service_->stream_writer_.Post([self = shared_from_this()] { self->Pump(); });
}

v1::GenerateResponse DecodeService::DecodeCall::ToMessage(const RequestOutput& out) {
  v1::GenerateResponse message;
  ToResponse(out, params_, &message);
  num_output_tokens_ += int32_t(out.new_token_ids.size());
  if (!prompt_echoed_) {  // a migrated request's client has it already
    if (resumed_.tokens.empty()) {
      for (int32_t t : prompt_) message.add_prompt_token_ids(t);
    }
    prompt_echoed_ = true;
  }
  if (out.finished) {
    message.mutable_usage()->set_prompt_tokens(int32_t(prompt_.size()));
    message.mutable_usage()->set_completion_tokens(num_output_tokens_);
  }
  return message;
}

void DecodeService::DecodeCall::Pump() {
  std::optional<grpc::Status> finish_with;
  {
    absl::MutexLock lock(&mu_);
    if (writing_ || finish_called_) return;
    if (end_status_.has_value() && (!parked_transfer_id_.has_value() || queued_.empty())) {
      finish_called_ = true;
      finish_with = *end_status_;
      if (parked_transfer_id_.has_value()) {
        context_->AddTrailingMetadata(rpc::kKvParkedTrailer, std::to_string(*parked_transfer_id_));
      }
    } else {
      if (queued_.empty()) return;
      writing_message_ = std::move(queued_.front());
      queued_.pop_front();
      writing_ = true;
    }
  }
  if (finish_with.has_value()) {
    Finish(*finish_with);
  } else {
    StartWrite(&writing_message_);
  }
}

void DecodeService::DecodeCall::End(grpc::Status status) {
  {
    absl::MutexLock lock(&mu_);
    if (end_status_.has_value()) return;
    end_status_ = std::move(status);
  }
  Pump();
}

void DecodeService::DecodeCall::OnWriteDone(bool ok) {
  if (!ok) {
    if (!writing_message_.finished()) service_->loop_->Abort(request_.request_id());
    End(Error(grpc::StatusCode::CANCELLED, "the Decode stream's client is gone"));
  } else {
    // Every token this stream delivers, the prefill worker's first token included.
    service_->metrics_->generation_tokens.Inc(double(writing_message_.token_ids_size()));
    if (writing_message_.finished()) {
      RecordFinished();
      End(grpc::Status::OK);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
  }
  Pump();
}

void DecodeService::DecodeCall::RecordFinished() {
  // The request's outcome, lengths and latencies are the router's; the decode phase is ours.
  service_->metrics_->request_decode_time_seconds.Observe(SecondsSince(joined_at_));
}

// ---- Abort, stats, metrics ----

grpc::ServerUnaryReactor* DecodeService::Abort(grpc::CallbackServerContext* context,
                                               const v1::WorkerAbortRequest* request,
                                               v1::WorkerAbortResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const std::string& id = request->request_id();
  const kvtransfer::KvReceiver::CancelRelease release = request->release_now()
                                                            ? kvtransfer::KvReceiver::CancelRelease::kNow
                                                            : kvtransfer::KvReceiver::CancelRelease::kAfterSender;
  const uint64_t transfer = request->transfer_id();
  // Cancels the request's reservation: the one of `transfer` when the Abort names it, else the
  // latest. False: none to cancel.
  auto cancel_reservation = [this, id, transfer, release] {
    std::shared_ptr<Reservation> r = transfer == 0 ? FindByRequest(id) : FindByTransfer(transfer);
    if (r == nullptr || r->request_id != id) return false;
    return CancelReservation(r, absl::CancelledError(absl::StrCat("request '", id, "' was aborted")), release);
  };
  bool found = cancel_reservation();
  // A running request is aborted between steps; the answer goes out from there.
  loop_->Post([this, id, transfer, cancel_reservation, found, reactor, response](LlmEngine& engine) mutable {
    // A ReserveKv queued on the engine before this Abort reserved meanwhile: release it too.
    if (!found) found = cancel_reservation();
    const Request* req = engine.Find(id);
    const bool running = req != nullptr && !req->finished() && (transfer == 0 || StreamTransfer(id) == transfer);
    if (running) loop_->Abort(id);
    response->set_found(found || running);
    reactor->Finish(grpc::Status::OK);
  });
  return reactor;
}

uint64_t DecodeService::StreamTransfer(const std::string& request_id) const {
  auto it = streaming_.find(request_id);
  return it != streaming_.end() ? it->second->transfer_id() : 0;
}

void DecodeService::RefreshMetrics() {
  const EngineStats stats = loop_->Stats();
  absl::MutexLock lock(&metrics_mu_);
  rpc::RecordEngineStats(stats, *metrics_, &recorded_stats_);
  // Speculative decoding: the engine's cumulative counters, exported as increments.
  const SpecDecodeStats& spec = stats.spec_decode;
  metrics_->kv_cache_usage_perc.Set(rpc::KvCacheUsage(stats));
  metrics_->spec_decode_num_drafts.Inc(double(spec.num_drafts - spec_seen_.num_drafts));
  metrics_->spec_decode_num_draft_tokens.Inc(double(spec.num_draft_tokens - spec_seen_.num_draft_tokens));
  metrics_->spec_decode_num_accepted_tokens.Inc(double(spec.num_accepted_tokens - spec_seen_.num_accepted_tokens));
  for (size_t pos = 0; pos < spec.accepted_per_pos.size(); ++pos) {
    const int64_t seen = pos < spec_seen_.accepted_per_pos.size() ? spec_seen_.accepted_per_pos[pos] : 0;
    metrics_->spec_decode_num_accepted_tokens_per_pos(int(pos)).Inc(double(spec.accepted_per_pos[pos] - seen));
  }
  spec_seen_ = spec;
}

std::string DecodeService::RenderMetrics() {
  RefreshMetrics();
  return metrics_registry_.Render();
}

grpc::ServerUnaryReactor* DecodeService::GetStats(grpc::CallbackServerContext* context, const v1::GetStatsRequest*,
                                                  v1::WorkerStats* response) {
  rpc::FillWorkerStats(loop_->Stats(), "decode", block_size_, response);
  response->set_prefill_here(true);
  {
    absl::MutexLock lock(&mu_);
    response->set_num_kv_leases(int32_t(by_transfer_.size()));
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace duet
