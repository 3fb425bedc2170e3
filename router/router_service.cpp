#include "router/router_service.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/finish_reason.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "engine/grammar/structured_output.h"
#include "grpcpp/generic/generic_stub.h"
#include "router/grpc_chat.h"
#include "router/request_id.h"
#include "router/request_limits.h"
#include "router/worker_replies.h"
#include "rpc/rpc_util.h"

namespace duet::router {

// What Abort and the client's cancellation need of a request: why it was interrupted, and the
// downstream calls it has running so they can be cancelled from another thread. Calls overlap: a
// Prefill runs beside the ReserveKv and SetKvTarget of its decode reservation, so each is kept
// until it ends, not only the latest (a cancelled request's Prefill would otherwise run on).
class RouterService::ActiveCall {
 public:
  // When the request reached the router (time to first token and e2e latency start here).
  const std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();

  // Adds `context` to the request's downstream calls. Called before the call starts, so a request
  // already interrupted cancels it at once (and nothing can run inline).
  void Attach(std::shared_ptr<grpc::ClientContext> context) {
    absl::MutexLock lock(&mu_);
    if (aborted_ || client_gone_) context->TryCancel();
    // A context no one else holds belongs to a call that has ended.
    std::erase_if(downstream_, [](const std::shared_ptr<grpc::ClientContext>& c) { return c.use_count() == 1; });
    downstream_.push_back(std::move(context));
  }
  // Runs on each interruption, on the interrupting thread (for a request waiting on no call).
  void SetOnInterrupt(std::function<void()> on_interrupt) {
    absl::MutexLock lock(&mu_);
    on_interrupt_ = std::move(on_interrupt);
  }
  void Abort() { Interrupt(&aborted_); }
  void ClientGone() { Interrupt(&client_gone_); }
  bool aborted() const {
    absl::MutexLock lock(&mu_);
    return aborted_;
  }
  bool client_gone() const {
    absl::MutexLock lock(&mu_);
    return client_gone_;
  }

 private:
  void Interrupt(bool* flag) {
    std::vector<std::shared_ptr<grpc::ClientContext>> downstream;
    std::function<void()> on_interrupt;
    {
      absl::MutexLock lock(&mu_);
      *flag = true;
      downstream = downstream_;
      on_interrupt = on_interrupt_;
    }
    // Outside the lock: the cancelled calls' callbacks may run on this thread.
    for (const std::shared_ptr<grpc::ClientContext>& context : downstream) context->TryCancel();
    if (on_interrupt) on_interrupt();
  }

  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<grpc::ClientContext>> downstream_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_interrupt_ ABSL_GUARDED_BY(mu_);
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;
};

namespace {

// Codes a call gets when the worker (or the connection to it) is gone or broken, as opposed to
// the worker rejecting the request.
bool IsWorkerFailure(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::DATA_LOSS:
      return true;
    default:
      return false;
  }
}

// A worker's error as its client is told it: the worker's label, never its address, and the
// worker's message only when it answered (a failed call's message is gRPC's and may name the
// address); the whole error goes to the log.
std::string WorkerError(const Worker& worker, const grpc::Status& status, const std::string& request_id) {
  if (!IsWorkerFailure(status.error_code())) return absl::StrCat(worker.label(), ": ", status.error_message());
  DUET_LOG(WARNING) << "request " << request_id << ": " << worker.name() << " failed: code "
                    << static_cast<int>(status.error_code()) << ", " << status.error_message();
  return absl::StrCat(worker.label(), " failed");
}

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Full method names for the generic stubs (they outlive every call).
const std::string& ReserveKvMethod() {
  static const std::string name = absl::StrCat("/", v1::DecodeWorker::service_full_name(), "/ReserveKv");
  return name;
}
const std::string& DecodeMethod() {
  static const std::string name = absl::StrCat("/", v1::DecodeWorker::service_full_name(), "/Decode");
  return name;
}
const std::string& MigrateKvMethod() {
  static const std::string name = absl::StrCat("/", v1::DecodeWorker::service_full_name(), "/MigrateKv");
  return name;
}
const std::string& PrefillMethod() {
  static const std::string name = absl::StrCat("/", v1::PrefillWorker::service_full_name(), "/Prefill");
  return name;
}

const std::string& SetKvTargetMethod() {
  static const std::string name = absl::StrCat("/", v1::PrefillWorker::service_full_name(), "/SetKvTarget");
  return name;
}

// Parses a worker's message here rather than in the stub: the generated stubs drop a parse
// failure (a unary call then answers OK with an empty reply; a stream read just ends, and the
// stream stays open).
template <typename Message>
bool Parse(grpc::ByteBuffer* bytes, Message* message) {
  return bytes->Valid() && grpc::SerializationTraits<Message>::Deserialize(bytes, message).ok();
}

// Calls a worker's unary `method`. `done` gets the call's status and, when it is OK, the reply
// (nullptr when the reply is not a valid Response).
//
// A completion callback drops its client context before what keeps the service alive: a context
// holds a reference to its channel, and if the service's teardown went first, the context would
// release the channel's last reference on a gRPC callback thread, whose shutdown joins that very
// thread (gRPC 1.51 then runs on a freed completion queue and aborts).
template <typename Response, typename Request>
void CallWorker(const Worker& worker, const std::string& method, std::shared_ptr<grpc::ClientContext> context,
                Request request, std::function<void(const grpc::Status&, const Response*)> done) {
  struct Pending {
    std::shared_ptr<grpc::ClientContext> context;
    Request request;
    grpc::ByteBuffer reply;
  };
  auto pending = std::make_shared<Pending>(Pending{std::move(context), std::move(request), {}});
  grpc::TemplatedGenericStub<Request, grpc::ByteBuffer> stub(worker.channel());
  stub.UnaryCall(pending->context.get(), method, grpc::StubOptions(), &pending->request, &pending->reply,
                 [pending, done = std::move(done)](grpc::Status status) mutable {
                   Response response;
                   const bool parsed = status.ok() && Parse(&pending->reply, &response);
                   done(status, parsed ? &response : nullptr);
                   pending.reset();  // the context before what `done` keeps alive
                 });
}

}  // namespace

// One Generate: the reactor the client's stream is bound to, and the chain of worker calls behind
// it (ReserveKv → Prefill → Decode, each started from the previous one's callback). The chain is
// sequential, so its state needs no lock; only Abort and OnCancel come from elsewhere, and they
// go through ActiveCall. The object lives while the server call or any worker call needs it.
// With a late target (RouterServiceOptions::overlap_kv_reservation) Prefill goes out beside
// ReserveKv; the two meet under join_mu_: whichever ends last goes on, so the chain stays one.
class RouterService::GenerateCall final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                                          public std::enable_shared_from_this<GenerateCall> {
 public:
  GenerateCall(RouterService* service, grpc::CallbackServerContext* context)
      : live_(service), service_(service), context_(context) {}

  // Validates, admits and starts the request, or finishes the call with why not.
  void Start(const v1::GenerateRequest& request);

  // The admission queue gave the request its slot: on to the prefill gate.
  void LeaveQueue();
  // The prefill gate let the request through: place it on workers.
  void PassGate();

  void OnWriteDone(bool ok) override;
  void OnCancel() override { active_->ClientGone(); }
  void OnDone() override {
    auto last_reference = std::move(self_);  // may destroy this at the end of the scope
  }

 private:
  class DecodeStream;

  // Counts the call as alive for ~RouterService (declared first: destroyed last).
  class Live {
   public:
    explicit Live(RouterService* service) : service_(service) { service_->CallCreated(); }
    ~Live() { service_->CallDestroyed(); }

   private:
    RouterService* const service_;
  };

  // kQueued: in the admission queue, without a slot. kWaiting: holds a slot, waits at the prefill
  // gate (both count in num_requests_waiting). kPlaced: on its workers.
  enum class Stage { kNotAdmitted, kQueued, kWaiting, kPlaced, kEnded };

  // At the prefill gate: through now, or in its line; or, by conditional disaggregation, on to a
  // decode worker that prefills the prompt itself.
  void EnterGate();
  // Whether the prompt may be prefilled on its decode worker (RouterServiceOptions), its length
  // aside: that depends on the worker (UncachedPromptTokens).
  bool WantsPrefillHere() const;
  // Places the request on a decode worker that prefills it and starts the Decode call; false
  // (nothing done) when no decode worker up takes prefill_here, or the one picked would have more
  // than local_prefill_max_tokens of the prompt to compute.
  bool PrefillOnDecodeWorker();
  // The prompt tokens `worker` would compute: those past the blocks the prefix index predicts it
  // holds (the last token always).
  int64_t UncachedPromptTokens(const Worker* worker);
  // The request leaves the router's waiting line for its first placement.
  void MarkPlaced();
  // The request's n and max_tokens, once per request (an OpenAI request's n choices are n calls
  // that say which choice they are in "duet-choice: <index>/<n>" metadata; the first counts).
  void RecordParams();

  // A context for a call to a worker: the client's deadline and cancellation propagate to it,
  // `timeout` (if finite) bounds it further, and Abort can cancel it.
  std::shared_ptr<grpc::ClientContext> Downstream(absl::Duration timeout);

  void BeginReserve();
  void ReserveNext();
  // The prefix-alignment a decode worker's reservation must honour: the LCM of the prefill
  // workers' block sizes (0 while one of them has not reported its own).
  int32_t PrefillBlockAlignment() const;
  void OnReserved(const grpc::Status& status, const v1::ReserveKvResponse* reply);
  void ReserveFailed();
  // The prefill worker for the request (null: none is up).
  Worker* PickPrefillWorker();
  bool PrefillWorkersTakeLateTargets() const;
  void StartPrefill();
  void EndWithoutPrefillWorker();
  // `late`: the target follows in SetKvTarget (DeliverTarget).
  void SendPrefill(Worker* prefill, bool late);
  // Late targets. The reservation is made: the target goes to the Prefill call in flight (or, if
  // that has ended, the reservation is released). The reservation chain ends without one: the
  // Prefill is aborted (unless it has ended).
  void DeliverTarget();
  void AbandonLatePrefill();
  bool TakeLatePrefillOutcome();
  void OnPrefilled(const grpc::Status& status, const v1::PrefillResponse* reply);
  void HandlePrefilled(const grpc::Status& status, const v1::PrefillResponse* reply);
  void OnPrefillUnavailable(const std::string& what);
  void StartDecode();
  // Writes the prefill worker's token to the client before the Decode call starts, when the
  // decode worker's first message is sure to repeat exactly it; false when it cannot be sure.
  bool WriteFirstTokenEarly();
  // The decode worker's first message without what WriteFirstTokenEarly sent; false when it does
  // not begin with that.
  bool DropEarlyFirstToken(v1::GenerateResponse* message) const;
  // From the decode stream: one message (the stream waits for ReadNext or StopReading), the end.
  void OnDecodeMessage(grpc::ByteBuffer* bytes);
  void OnDecodeDone(const grpc::Status& status);
  // The decode worker failed mid-stream (`what`, as the client is told): the request is placed
  // again with its output so far, or ends UNAVAILABLE once it has moved max_request_migrations times.
  void Migrate(const std::string& what);
  // Whether the placement continues an output the client has (part of): a migration's.
  bool resumed() const { return resumed_tokens_ > 0; }
  // Live KV migration (worker.proto, MigrateKvRequest). The stream ended with the decode worker's
  // parked trailer: the transfer id it names (nullopt: none, or nothing to continue).
  std::optional<uint64_t> ParkedTransferId(const grpc::Status& status) const;
  // Reserves on another decode worker for the prompt and the output but its last token, has the
  // draining worker ship the parked KV there, and continues the stream there; with no such worker
  // (or should a step fail) the stream resumes where it was parked.
  void MoveParkedKv(uint64_t parked_transfer_id);
  void OnParkedKvReserved(const grpc::Status& status, const v1::ReserveKvResponse* reply);
  void OnKvMigrated(const grpc::Status& status);
  void ResumeParked();

  // Whether the client (cancel, deadline) or Abort stopped the request, and ending it then.
  bool Interrupted() const;
  void EndInterrupted();
  // A worker call that ran out of time under the client's own deadline: that deadline has passed
  // (even if the clock Interrupted reads is a hair behind the timer that ended the call).
  void NoteDeadline(const grpc::Status& status) {
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && downstream_has_clients_deadline_) {
      client_deadline_passed_ = true;
    }
  }
  // Best effort, in the background: tells a worker to drop the request (its KV, its queue slot).
  // A decode worker releases a reservation whose target went to a prefill worker once that
  // sender has stopped writing into it, unless `sender_gone` (worker.proto, release_now). A
  // nonzero `transfer_id` limits a decode worker's abort to that transfer's reservation.
  void AbortOnWorker(Worker* worker, bool sender_gone = false, uint64_t transfer_id = 0);
  // The request AbortOnWorker sends.
  v1::WorkerAbortRequest AbortRequest(const Worker& worker, bool sender_gone, uint64_t transfer_id) const;
  // AbortOnWorker for this placement's reservation on decode_ (transfer_id_) only: the request
  // may be placed on that worker again before the Abort arrives, and the new reservation stays.
  void ReleaseReservation(bool sender_gone = false) { AbortOnWorker(decode_, sender_gone, transfer_id_); }
  // For a prefill worker that failed and then did not answer (maybe only stalled, with puts still
  // to make): releases this placement's reservation at once should a later poll find it gone.
  void ReleaseReservationWhenGone();
  // Gives the request's place in the prefill gate to the next one (its prefill is over).
  void LeaveGate();
  // Releases what the request holds in the router and finishes the client's call (a migration
  // in progress that fails says so in `status`).
  void End(const grpc::Status& status);
  void EndWithAbortMessage();
  void Release();
  // A request that ends with stop, length or abort: its outcome, lengths and latencies.
  void RecordFinished(FinishReason reason);
  // The prompt placed on `worker`: counted, and learnt by the prefix index.
  void RecordPlacement(Worker* worker);
  // The decode stream finished: the decode worker now holds the prompt and the output's KV.
  void RecordDecoded();
  void RecordWorkerCall(metrics::RouterMetrics::WorkerCall call, std::chrono::steady_clock::time_point started_at);

  Live live_;
  RouterService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<ActiveCall> active_ = std::make_shared<ActiveCall>();
  std::shared_ptr<GenerateCall> self_;  // the server call's reference, dropped in OnDone

  Prepared prepared_;
  Stage stage_ = Stage::kNotAdmitted;
  bool downstream_has_clients_deadline_ = false;  // the latest Downstream's deadline is the client's
  bool client_deadline_passed_ = false;
  std::pair<std::string, std::string> active_key_;  // (client, client's request id)
  bool registered_ = false;  // in service_->active_
  bool in_gate_ = false;     // holds a place in service_->prefill_gate_
  int64_t gate_tokens_ = 0;  // the tokens it entered the gate with

  // Placement. `info_` points into `prepared_` and `block_hashes_`.
  std::optional<BlockHashChain> block_hashes_;  // of the prompt
  RequestInfo info_;
  std::vector<const Worker*> excluded_prefill_;
  std::vector<const Worker*> failed_decode_;  // decode workers whose stream failed under the request
  int attempt_ = 0;
  std::string last_exhausted_;  // why decode workers refused the reservation
  std::string last_failure_;
  Worker* decode_ = nullptr;
  InFlightGuard decode_in_flight_;
  uint64_t transfer_id_ = 0;
  bool prefill_here_ = false;    // the decode worker prefills the prompt (no reservation, no prefill worker)
  bool target_shipped_ = false;  // the reservation's KvTarget went to a prefill worker (Prefill sent)
  v1::KvTarget target_;
  Worker* prefill_ = nullptr;
  InFlightGuard prefill_in_flight_;
  v1::PrefillResponse prefilled_;
  // A late target: the Prefill call went out beside the reservation chain, which is under way
  // while `reserving_`; a Prefill that ends meanwhile leaves its outcome for the chain's end.
  struct PrefillOutcome {
    grpc::Status status;
    std::optional<v1::PrefillResponse> reply;
  };
  bool late_target_ = false;
  absl::Mutex join_mu_;
  bool reserving_ ABSL_GUARDED_BY(join_mu_) = false;
  bool prefill_abandoned_ ABSL_GUARDED_BY(join_mu_) = false;  // aborted by the chain's end: ignore its reply
  std::optional<PrefillOutcome> prefill_outcome_ ABSL_GUARDED_BY(join_mu_);
  std::string target_failure_ ABSL_GUARDED_BY(join_mu_);  // why SetKvTarget failed
  int late_attempt_ ABSL_GUARDED_BY(join_mu_) = 0;        // placements with a late target so far

  // The relay. One server write at a time: the next stream read starts when it is done.
  DecodeStream* stream_ = nullptr;  // until OnDecodeDone
  std::shared_ptr<grpc::ClientContext> stream_context_;
  v1::GenerateResponse out_;  // the message being written
  grpc::Status stream_error_;  // the stream's message was unusable
  bool prompt_sent_ = false;
  bool early_write_in_flight_ = false;
  // WriteFirstTokenEarly sent the first token with this text; the decode worker's first message,
  // which repeats them, is still to come.
  std::optional<std::string> early_first_text_;
  bool finished_ = false;
  bool client_write_failed_ = false;
  int completion_tokens_ = 0;
  std::vector<int32_t> output_token_ids_;  // every output token relayed to the client
  int64_t output_text_bytes_ = 0;          // the bytes of their text
  // Migration: the output the placement continues (the first resumed_tokens_ of output_token_ids_
  // and their text's bytes), the prompt and that output (what info_ places then), how often the
  // request moved, and whether the latest move has yet to deliver a message (and the failure it
  // follows).
  size_t resumed_tokens_ = 0;
  int64_t resumed_text_bytes_ = 0;
  std::vector<int32_t> placed_token_ids_;
  int migrations_ = 0;
  bool migrating_ = false;
  std::string migration_cause_;
  // Live KV migration: the draining worker holding the parked KV and its transfer id; whether
  // the next Decode call continues parked KV (kv_attached), and whether that stream has yet to
  // deliver a message.
  Worker* parked_on_ = nullptr;
  uint64_t parked_transfer_id_ = 0;
  bool kv_attached_ = false;
  bool kv_attached_pending_ = false;
  std::unique_ptr<ResponseAnnotator> annotator_;  // every message to the client goes through it
  std::string finish_reason_;
  double queue_seconds_ = 0;  // arrival until the prefill gate let it through
  std::chrono::steady_clock::time_point first_token_at_{}, last_token_at_{};
  // When the worker calls in progress began (router_worker_call_seconds).
  std::chrono::steady_clock::time_point reserve_started_at_{}, prefill_started_at_{}, decode_started_at_{};
  v1::GenerateResponse last_;  // the closing "abort" message
};

// The Decode call, read as raw bytes (parsed by the GenerateCall). Reads are started from the
// server side's write callbacks, outside this reactor's own reactions, hence the hold.
class RouterService::GenerateCall::DecodeStream final
    : public grpc::ClientBidiReactor<v1::DecodeRequest, grpc::ByteBuffer> {
 public:
  DecodeStream(std::shared_ptr<GenerateCall> call, std::shared_ptr<grpc::ClientContext> context,
               v1::DecodeRequest request)
      : call_(std::move(call)), context_(std::move(context)), request_(std::move(request)) {}

  void Start(const Worker& worker) {
    grpc::TemplatedGenericStub<v1::DecodeRequest, grpc::ByteBuffer> stub(worker.channel());
    stub.PrepareBidiStreamingCall(context_.get(), DecodeMethod(), grpc::StubOptions(), this);
    StartWriteLast(&request_, grpc::WriteOptions());  // a server-streaming method: one request
    StartRead(&bytes_);
    AddHold();
    StartCall();
  }
  void ReadNext() { StartRead(&bytes_); }
  void StopReading() { RemoveHold(); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RemoveHold();  // the stream ended; OnDone brings its status
      return;
    }
    call_->OnDecodeMessage(&bytes_);
  }
  void OnDone(const grpc::Status& status) override {
    call_->OnDecodeDone(status);
    delete this;
  }

 private:
  const std::shared_ptr<GenerateCall> call_;
  const std::shared_ptr<grpc::ClientContext> context_;
  const v1::DecodeRequest request_;
  grpc::ByteBuffer bytes_;
};

// Bounds the prompt tokens of the requests that are reserving KV or prefilling to `per_worker` ×
// the prefill workers that are up (a request alone always fits). The others wait here, in arrival
// order, holding nothing on the workers.
class RouterService::PrefillGate {
 public:
  PrefillGate(int64_t per_worker, const WorkerRegistry* registry)
      : per_worker_(std::max<int64_t>(1, per_worker)), registry_(registry) {}

  // True: `call` (with `tokens` prompt tokens) is let through now. False: it waits, and gets
  // PassGate() when there is room.
  bool Enter(const std::shared_ptr<GenerateCall>& call, int64_t tokens) {
    absl::MutexLock lock(&mu_);
    if (waiting_.empty() && Fits(tokens)) {
      inside_tokens_ += tokens;
      ++inside_;
      return true;
    }
    waiting_.push_back({call, tokens});
    waiting_tokens_ += tokens;
    return false;
  }
  // A call let through with `tokens` is done prefilling (or ended): lets the next ones through.
  void Leave(int64_t tokens) {
    std::vector<std::shared_ptr<GenerateCall>> admitted;
    {
      absl::MutexLock lock(&mu_);
      inside_tokens_ -= tokens;
      --inside_;
      while (!waiting_.empty() && Fits(waiting_.front().tokens)) {
        inside_tokens_ += waiting_.front().tokens;
        waiting_tokens_ -= waiting_.front().tokens;
        ++inside_;
        admitted.push_back(std::move(waiting_.front().call));
        waiting_.pop_front();
      }
    }
    Admit(std::move(admitted));
  }
  // Takes a waiting call out of the line; false when it is not waiting (any more).
  bool Withdraw(const GenerateCall* call) {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(waiting_.begin(), waiting_.end(), [call](const Waiting& w) { return w.call.get() == call; });
    if (it == waiting_.end()) return false;
    waiting_tokens_ -= it->tokens;
    waiting_.erase(it);
    return true;
  }
  // The prompt tokens let through or waiting, per prefill worker up: the prefill workers' load.
  int64_t TokensPerWorker() const {
    absl::MutexLock lock(&mu_);
    return (inside_tokens_ + waiting_tokens_) / std::max(1, registry_->NumUp(WorkerRole::kPrefill));
  }

 private:
  struct Waiting {
    std::shared_ptr<GenerateCall> call;
    int64_t tokens;
  };

  bool Fits(int64_t tokens) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t budget = per_worker_ * std::max(1, registry_->NumUp(WorkerRole::kPrefill));
    return inside_ == 0 || inside_tokens_ + tokens <= budget;
  }

  // A call let through may end at once and leave, letting the next one through: that one joins
  // this thread's outer loop instead of nesting (a long line would otherwise nest as deep).
  static void Admit(std::vector<std::shared_ptr<GenerateCall>> calls) {
    thread_local std::vector<std::shared_ptr<GenerateCall>>* outer = nullptr;
    if (outer != nullptr) {
      for (auto& call : calls) outer->push_back(std::move(call));
      return;
    }
    outer = &calls;
    for (size_t i = 0; i < calls.size(); ++i) {
      const std::shared_ptr<GenerateCall> call = calls[i];  // `calls` may grow meanwhile
      call->PassGate();
    }
    outer = nullptr;
  }

  const int64_t per_worker_;
  const WorkerRegistry* const registry_;
  mutable absl::Mutex mu_;
  int64_t inside_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int inside_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<Waiting> waiting_ ABSL_GUARDED_BY(mu_);
  int64_t waiting_tokens_ ABSL_GUARDED_BY(mu_) = 0;
};

// max_concurrent_requests slots for requests at the prefill gate or on workers, and a bounded
// queue of requests waiting for a slot, in arrival order.
class RouterService::AdmissionQueue {
 public:
  AdmissionQueue(int slots, int max_queued) : slots_(slots), max_queued_(max_queued) {}

  enum class Result { kAdmitted, kQueued, kFull };
  // kAdmitted: `call` holds a slot now. kQueued: it gets LeaveQueue() when a slot frees. kFull:
  // neither (the queue is full).
  Result Enter(const std::shared_ptr<GenerateCall>& call) {
    absl::MutexLock lock(&mu_);
    if (used_ < slots_) {
      ++used_;
      return Result::kAdmitted;
    }
    if (int(queued_.size()) >= max_queued_) return Result::kFull;
    queued_.push_back(call);
    return Result::kQueued;
  }
  // A call holding a slot ended: the slot goes to the first queued call, if any.
  void Leave() {
    std::shared_ptr<GenerateCall> next;
    {
      absl::MutexLock lock(&mu_);
      if (queued_.empty()) {
        --used_;
        return;
      }
      next = std::move(queued_.front());
      queued_.pop_front();
    }
    RunFlat(std::move(next));
  }
  // Takes a queued call out of the queue; false when it is not queued (any more).
  bool Withdraw(const GenerateCall* call) {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(queued_.begin(), queued_.end(),
                           [call](const std::shared_ptr<GenerateCall>& c) { return c.get() == call; });
    if (it == queued_.end()) return false;
    queued_.erase(it);
    return true;
  }
  int slots() const { return slots_; }
  int max_queued() const { return max_queued_; }

 private:
  // A call taken out of the queue may end at once and free its slot for the next: that one runs
  // in this thread's outer loop instead of nesting (a long queue would otherwise nest as deep).
  static void RunFlat(std::shared_ptr<GenerateCall> call) {
    thread_local std::vector<std::shared_ptr<GenerateCall>>* outer = nullptr;
    if (outer != nullptr) {
      outer->push_back(std::move(call));
      return;
    }
    std::vector<std::shared_ptr<GenerateCall>> calls = {std::move(call)};
    outer = &calls;
    for (size_t i = 0; i < calls.size(); ++i) {
      const std::shared_ptr<GenerateCall> next = calls[i];  // `calls` may grow meanwhile
      next->LeaveQueue();
    }
    outer = nullptr;
  }

  const int slots_;
  const int max_queued_;
  absl::Mutex mu_;
  int used_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::shared_ptr<GenerateCall>> queued_ ABSL_GUARDED_BY(mu_);
};

std::shared_ptr<grpc::ClientContext> RouterService::GenerateCall::Downstream(absl::Duration timeout) {
  // Not FromCallbackServerContext: the client's cancellation it propagates can reach this call's
  // callback before OnCancel marks the client gone, which would then take it for the worker's
  // failure (and, say, not abort a Prefill the cancellation stopped before it went out, whose
  // decode reservation would wait for its lease). OnCancel cancels it through active_ instead.
  auto downstream = std::make_shared<grpc::ClientContext>();
  // The call ends at the earlier of the client's deadline and `timeout`.
  std::chrono::system_clock::time_point deadline = context_->deadline();
  downstream_has_clients_deadline_ = deadline != std::chrono::system_clock::time_point::max();
  if (timeout != absl::InfiniteDuration()) {
    const std::chrono::system_clock::time_point own = absl::ToChronoTime(absl::Now() + timeout);
    downstream_has_clients_deadline_ = downstream_has_clients_deadline_ && deadline <= own;
    deadline = std::min(deadline, own);
  }
  if (deadline != std::chrono::system_clock::time_point::max()) downstream->set_deadline(deadline);
  active_->Attach(downstream);
  return downstream;
}

void RouterService::GenerateCall::Start(const v1::GenerateRequest& request) {
  self_ = shared_from_this();
  absl::StatusOr<Prepared> prepared = service_->Prepare(request);
  if (!prepared.ok()) return Finish(rpc::ToGrpc(prepared.status()));
  prepared_ = *std::move(prepared);
  annotator_ = std::make_unique<ResponseAnnotator>(prepared_.tools);
  // The request id in the response's initial metadata too, as HTTP's X-Request-Id (when it can go
  // there as it is: printable ASCII).
  if (IsPrintableAscii(prepared_.client_request_id)) {
    context_->AddInitialMetadata("x-request-id", prepared_.client_request_id);
  }

  active_key_ = {ClientOf(*context_), prepared_.client_request_id};
  {
    absl::MutexLock lock(&service_->mu_);
    registered_ = service_->active_.try_emplace(active_key_, active_).second;
  }
  if (!registered_) {
    return Finish(grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                               absl::StrCat("request_id \"", prepared_.client_request_id,
                                            "\" is already in flight (from this client)")));
  }
  info_.request_id = prepared_.request_id;
  info_.prompt_token_ids = prepared_.prompt_token_ids;
  // The seed the engines use (one router, like one engine, serves one model), so the router's
  // hashes name the blocks the workers cache.
  block_hashes_.emplace(PrefixSeed("", prepared_.params.cache_salt), prepared_.prompt_token_ids);
  info_.block_hashes = &*block_hashes_;
  info_.max_tokens = prepared_.params.max_tokens;
  // Interrupted while waiting in the queue or at the gate (no call to cancel): leave and end here.
  active_->SetOnInterrupt([weak = weak_from_this(), admission = service_->admission_.get(),
                           gate = service_->prefill_gate_.get()] {
    std::shared_ptr<GenerateCall> self = weak.lock();
    if (self != nullptr && (admission->Withdraw(self.get()) || gate->Withdraw(self.get()))) self->EndInterrupted();
  });
  // Counted as queued before it can be seen in the queue: from there another thread takes it on.
  stage_ = Stage::kQueued;
  service_->in_flight_.fetch_add(1, std::memory_order_acq_rel);
  service_->metrics_->num_requests_waiting.Inc();
  switch (service_->admission_->Enter(shared_from_this())) {
    case AdmissionQueue::Result::kFull:
      service_->metrics_->num_requests_waiting.Dec();
      service_->in_flight_.fetch_sub(1, std::memory_order_acq_rel);
      stage_ = Stage::kNotAdmitted;
      End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                       absl::StrCat("server is at capacity: ", service_->admission_->slots(),
                                    " requests in flight (max_concurrent_requests) and ",
                                    service_->admission_->max_queued(),
                                    " waiting (max_queued_requests); retry later")));
      return;
    case AdmissionQueue::Result::kAdmitted:
      RecordParams();
      stage_ = Stage::kWaiting;
      return EnterGate();
    case AdmissionQueue::Result::kQueued:
      // From here the queue may hand the call to another thread: only thread-safe reads.
      // Interrupted before it joined the queue: the hook found nothing to withdraw.
      if (Interrupted() && service_->admission_->Withdraw(this)) EndInterrupted();
      return;
  }
}

void RouterService::GenerateCall::RecordParams() {
  int index = 0, n = 1;
  auto choice = context_->client_metadata().find("duet-choice");
  if (choice != context_->client_metadata().end()) {
    const std::string value(choice->second.data(), choice->second.size());
    if (std::sscanf(value.c_str(), "%d/%d", &index, &n) != 2 || n < 1 || index < 0 || index >= n) index = 0, n = 1;
  }
  if (index == 0) service_->metrics_->RecordParams(n, prepared_.params.max_tokens);
}

void RouterService::GenerateCall::LeaveQueue() {
  if (stage_ != Stage::kQueued) return;
  RecordParams();
  stage_ = Stage::kWaiting;
  EnterGate();
}

void RouterService::GenerateCall::EnterGate() {
  if (WantsPrefillHere() && PrefillOnDecodeWorker()) return;
  gate_tokens_ = int64_t(info_.prompt_token_ids.size());
  if (service_->prefill_gate_->Enter(shared_from_this(), gate_tokens_)) {
    return PassGate();
  }
  // Interrupted before it joined the line: the hook found nothing to withdraw.
  if (Interrupted() && service_->prefill_gate_->Withdraw(this)) EndInterrupted();
}

void RouterService::GenerateCall::PassGate() {
  in_gate_ = true;
  MarkPlaced();
  BeginReserve();
}

void RouterService::GenerateCall::MarkPlaced() {
  if (stage_ != Stage::kWaiting) return;  // a migrating request is placed already
  stage_ = Stage::kPlaced;
  service_->metrics_->num_requests_waiting.Dec();
  queue_seconds_ = Seconds(std::chrono::steady_clock::now() - active_->arrival);
  service_->metrics_->request_queue_time_seconds.Observe(queue_seconds_);
}

bool RouterService::GenerateCall::WantsPrefillHere() const {
  const RouterServiceOptions& options = service_->options_;
  if (options.local_prefill_max_tokens <= 0 || resumed() || prepared_.params.prompt_logprobs >= 0) return false;
  return service_->registry_->NumUp(WorkerRole::kPrefill) == 0 ||
         service_->prefill_gate_->TokensPerWorker() >= options.local_prefill_queue_tokens;
}

bool RouterService::GenerateCall::PrefillOnDecodeWorker() {
  info_.excluded = failed_decode_;
  for (const Worker* w : service_->registry_->decode_workers()) {
    const std::optional<v1::WorkerStats> stats = w->stats();
    if (!stats.has_value() || !stats->prefill_here()) info_.excluded.push_back(w);
  }
  Worker* decode = service_->policy_->PickDecode(info_);
  if (decode == nullptr || UncachedPromptTokens(decode) > service_->options_.local_prefill_max_tokens) return false;
  MarkPlaced();
  decode_ = decode;
  decode_in_flight_ = InFlightGuard(decode);
  prefill_here_ = true;
  RecordPlacement(decode);
  service_->metrics_->prefills(/*on_decode_worker=*/true).Inc();
  StartDecode();
  return true;
}

int64_t RouterService::GenerateCall::UncachedPromptTokens(const Worker* worker) {
  const int64_t prompt = int64_t(info_.prompt_token_ids.size());
  const PrefixIndex* index = service_->options_.prefix_index;
  const std::optional<v1::WorkerStats> stats = worker->stats();
  if (index == nullptr || !stats.has_value() || stats->block_size() <= 0) return prompt;
  const int64_t cached = index->Match(worker, block_hashes_->ForBlockSize(stats->block_size())) * stats->block_size();
  return prompt - std::min(cached, prompt - 1);
}

void RouterService::GenerateCall::LeaveGate() {
  if (!in_gate_) return;
  in_gate_ = false;
  service_->prefill_gate_->Leave(gate_tokens_);
}

void RouterService::GenerateCall::BeginReserve() {
  last_exhausted_.clear();
  last_failure_.clear();
  late_target_ = false;
  // Only where every prefill worker up takes one (a rolling upgrade mixes them): the policy picks
  // the worker once, here or after the reservation.
  if (service_->options_.overlap_kv_reservation && PrefillWorkersTakeLateTargets()) {
    if (Worker* prefill = PickPrefillWorker(); prefill != nullptr) {
      {
        absl::MutexLock lock(&join_mu_);
        ++late_attempt_;
        reserving_ = true;
        prefill_abandoned_ = false;
        prefill_outcome_.reset();
        target_failure_.clear();
      }
      late_target_ = true;
      SendPrefill(prefill, /*late=*/true);
    }
  }
  info_.excluded = failed_decode_;
  ReserveNext();
}

void RouterService::GenerateCall::ReserveNext() {
  Worker* decode = service_->policy_->PickDecode(info_);
  if (decode == nullptr) return ReserveFailed();
  decode_ = decode;
  decode_in_flight_ = InFlightGuard(decode);
  transfer_id_ = service_->NewTransferId();
  target_shipped_ = false;
  reserve_started_at_ = std::chrono::steady_clock::now();
  v1::ReserveKvRequest request;
  request.set_request_id(prepared_.request_id);
  request.set_transfer_id(transfer_id_);
  request.set_num_prompt_tokens(static_cast<int32_t>(info_.prompt_token_ids.size()));
  request.set_lease_ms(service_->options_.kv_lease_ms);
  // Prefix caching on the decode worker: it may already hold the start of this prompt (the
  // previous turn of a chat); then only the rest of the KV moves.
  if (const int32_t alignment = PrefillBlockAlignment(); alignment > 0) {
    request.mutable_prompt_token_ids()->Assign(info_.prompt_token_ids.begin(), info_.prompt_token_ids.end());
    if (prepared_.sampling.has_cache_salt()) request.set_cache_salt(prepared_.sampling.cache_salt());
    request.set_prefix_alignment_tokens(alignment);
  }
  CallWorker<v1::ReserveKvResponse>(
      *decode, ReserveKvMethod(), Downstream(service_->options_.reserve_timeout), std::move(request),
      [self = shared_from_this()](const grpc::Status& status, const v1::ReserveKvResponse* reply) {
        self->OnReserved(status, reply);
      });
}

int32_t RouterService::GenerateCall::PrefillBlockAlignment() const {
  // The reused prefix must end on a block boundary of whichever prefill worker sends the rest.
  int64_t alignment = 1;
  for (const Worker* w : service_->registry_->prefill_workers()) {
    const std::optional<v1::WorkerStats> stats = w->stats();
    if (!stats || stats->block_size() <= 0) return 0;  // not known yet: reuse nothing
    alignment = std::lcm(alignment, int64_t(stats->block_size()));
    if (alignment > (int64_t(1) << 20)) return 0;
  }
  return int32_t(alignment);
}

void RouterService::GenerateCall::OnReserved(const grpc::Status& status, const v1::ReserveKvResponse* reply) {
  NoteDeadline(status);
  if (status.ok()) {
    if (reply != nullptr && reply->target().transfer_id() == transfer_id_) {
      RecordWorkerCall(metrics::RouterMetrics::WorkerCall::kReserveKv, reserve_started_at_);
      target_ = reply->target();
      RecordPlacement(decode_);
      return late_target_ ? DeliverTarget() : StartPrefill();
    }
    AbortOnWorker(decode_);  // whatever it reserved
    AbandonLatePrefill();
    return End(grpc::Status(
        grpc::StatusCode::INTERNAL,
        reply == nullptr ? absl::StrCat(decode_->label(), " answered ReserveKv with a reply that is not a valid ",
                                        v1::ReserveKvResponse::descriptor()->full_name())
                         : absl::StrCat(decode_->label(), " answered ReserveKv for transfer id ",
                                        reply->target().transfer_id(), " instead of ", transfer_id_)));
  }
  Worker* decode = decode_;
  if (Interrupted() || IsWorkerFailure(status.error_code())) {
    // Cancelled, timed out or cut off: the worker may have reserved before it heard (its answer
    // crossing the cancellation). Release that now, not at the lease's end.
    ReleaseReservation();
  }
  decode_ = nullptr;
  decode_in_flight_.Reset();
  if (Interrupted()) {
    AbandonLatePrefill();
    return EndInterrupted();
  }
  info_.excluded.push_back(decode);
  const std::string what = WorkerError(*decode, status, prepared_.request_id);
  switch (status.error_code()) {
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      last_exhausted_ = what;
      break;
    case grpc::StatusCode::UNAVAILABLE:
      last_failure_ = what;
      service_->registry_->ConfirmDown(decode, absl::StrCat("ReserveKv failed: ", status.error_message()),
                                       [self = shared_from_this()](WorkerRegistry::Probe) { self->ReserveNext(); });
      return;
    default:
      if (!IsWorkerFailure(status.error_code())) {
        AbandonLatePrefill();
        return End(grpc::Status(status.error_code(), what));
      }
      last_failure_ = what;
      break;
  }
  ReserveNext();
}

void RouterService::GenerateCall::ReserveFailed() {
  AbandonLatePrefill();
  if (Interrupted()) return EndInterrupted();
  if (!last_exhausted_.empty()) {
    return End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("no decode worker has room for the prompt's KV cache (",
                                         info_.prompt_token_ids.size(),
                                         " tokens); retry later. Last refusal: ", last_exhausted_)));
  }
  if (!last_failure_.empty()) {
    return End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("no decode worker could take the request: ", last_failure_)));
  }
  const char* why = service_->registry_->decode_workers().empty() ? "no decode workers are configured"
                    : failed_decode_.empty()                      ? "no decode worker is up"
                                                                  : "no other decode worker is up";
  End(grpc::Status(grpc::StatusCode::UNAVAILABLE, why));
}

bool RouterService::GenerateCall::PrefillWorkersTakeLateTargets() const {
  bool any = false;
  for (const Worker* w : service_->registry_->prefill_workers()) {
    if (!w->up()) continue;
    const std::optional<v1::WorkerStats> stats = w->stats();
    if (!stats.has_value() || !stats->late_kv_target()) return false;
    any = true;
  }
  return any;
}

Worker* RouterService::GenerateCall::PickPrefillWorker() {
  info_.excluded = excluded_prefill_;
  Worker* prefill = service_->policy_->PickPrefill(info_);
  if (prefill == nullptr && !excluded_prefill_.empty()) {
    info_.excluded.clear();  // the retry: the failed worker answers its stats and is the only one
    prefill = service_->policy_->PickPrefill(info_);
  }
  return prefill;
}

void RouterService::GenerateCall::StartPrefill() {
  Worker* prefill = PickPrefillWorker();
  if (prefill == nullptr) {
    ReleaseReservation();
    return EndWithoutPrefillWorker();
  }
  SendPrefill(prefill, /*late=*/false);
}

void RouterService::GenerateCall::EndWithoutPrefillWorker() {
  if (!excluded_prefill_.empty()) {
    return End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat(excluded_prefill_.back()->label(), " failed and no prefill worker is up")));
  }
  End(grpc::Status(grpc::StatusCode::UNAVAILABLE, service_->registry_->prefill_workers().empty()
                                                      ? "no prefill workers are configured"
                                                      : "no prefill worker is up"));
}

void RouterService::GenerateCall::SendPrefill(Worker* prefill, bool late) {
  prefill_ = prefill;
  prefill_in_flight_ = InFlightGuard(prefill);
  RecordPlacement(prefill);
  service_->metrics_->prefills(/*on_decode_worker=*/false).Inc();
  v1::PrefillRequest request;
  request.set_request_id(prepared_.request_id);
  request.mutable_prompt_token_ids()->Assign(prepared_.prompt_token_ids.begin(), prepared_.prompt_token_ids.end());
  request.mutable_output_token_ids()->Assign(output_token_ids_.begin(), output_token_ids_.begin() + resumed_tokens_);
  *request.mutable_sampling() = prepared_.sampling;
  if (late) {
    request.set_target_follows(true);
  } else {
    *request.mutable_target() = target_;
    target_shipped_ = true;
  }
  prefill_started_at_ = std::chrono::steady_clock::now();
  CallWorker<v1::PrefillResponse>(
      *prefill, PrefillMethod(), Downstream(service_->options_.prefill_timeout), std::move(request),
      [self = shared_from_this()](const grpc::Status& status, const v1::PrefillResponse* reply) {
        self->OnPrefilled(status, reply);
      });
}

void RouterService::GenerateCall::DeliverTarget() {
  // A Prefill that already ended (it failed) never got the target: the reservation goes at once.
  if (TakeLatePrefillOutcome()) return;
  v1::SetKvTargetRequest request;
  request.set_request_id(prepared_.request_id);
  *request.mutable_target() = target_;
  target_shipped_ = true;
  Worker* const prefill = prefill_;
  int attempt;
  {
    absl::MutexLock lock(&join_mu_);
    attempt = late_attempt_;
  }
  CallWorker<v1::SetKvTargetResponse>(
      *prefill, SetKvTargetMethod(), Downstream(service_->options_.reserve_timeout), std::move(request),
      [self = shared_from_this(), prefill, target = target_, attempt](const grpc::Status& status,
                                                                                     const v1::SetKvTargetResponse*) {
        if (status.ok()) return;
        // The Prefill waits for a target that is not coming: abort it (its reply ends the
        // request), telling the decode worker through the prefill worker should it have the call.
        {
          absl::MutexLock lock(&self->join_mu_);
          if (self->late_attempt_ != attempt) return;  // that placement has failed and been retried
          self->target_failure_ = WorkerError(*prefill, status, self->prepared_.request_id);
        }
        v1::WorkerAbortRequest abort;
        abort.set_request_id(self->prepared_.request_id);
        *abort.mutable_kv_target() = target;
        self->service_->aborts_->Send(prefill, std::move(abort));
      });
  // The Prefill's reply may have come while the target went out: it goes on from here.
  std::optional<PrefillOutcome> outcome;
  {
    absl::MutexLock lock(&join_mu_);
    reserving_ = false;
    outcome.swap(prefill_outcome_);
  }
  if (outcome.has_value()) HandlePrefilled(outcome->status, outcome->reply ? &*outcome->reply : nullptr);
}

bool RouterService::GenerateCall::TakeLatePrefillOutcome() {
  std::optional<PrefillOutcome> outcome;
  {
    absl::MutexLock lock(&join_mu_);
    if (!prefill_outcome_.has_value()) return false;
    reserving_ = false;
    outcome.swap(prefill_outcome_);
  }
  // Its failure releases the reservation at once (the target never left); a success without a
  // target is a broken worker's.
  if (outcome->status.ok()) {
    outcome->status = grpc::Status(grpc::StatusCode::INTERNAL,
                                   absl::StrCat(prefill_->label(), " answered Prefill before it had its KV target"));
  }
  HandlePrefilled(outcome->status, nullptr);
  return true;
}

void RouterService::GenerateCall::AbandonLatePrefill() {
  if (!late_target_) return;
  {
    absl::MutexLock lock(&join_mu_);
    reserving_ = false;
    prefill_outcome_.reset();  // it ended by itself (a failure): nothing to add
    prefill_abandoned_ = true;
  }
  AbortOnWorker(prefill_);  // also when it ended here: a call cut off may still run there
}

void RouterService::GenerateCall::OnPrefilled(const grpc::Status& status, const v1::PrefillResponse* reply) {
  if (late_target_) {
    absl::MutexLock lock(&join_mu_);
    if (prefill_abandoned_) return;
    if (reserving_) {  // the reservation chain takes it from here
      prefill_outcome_ = PrefillOutcome{status, reply != nullptr ? std::optional(*reply) : std::nullopt};
      return;
    }
  }
  HandlePrefilled(status, reply);
}

void RouterService::GenerateCall::HandlePrefilled(const grpc::Status& status, const v1::PrefillResponse* reply) {
  prefill_in_flight_.Reset();
  NoteDeadline(status);
  std::string invalid;  // why an OK reply cannot be used
  if (status.ok()) {
    invalid = reply == nullptr
                  ? absl::StrCat("a reply that is not a valid ", v1::PrefillResponse::descriptor()->full_name())
                  : InvalidPrefillReply(*reply, int64_t(prepared_.prompt_token_ids.size()),
                                        resumed() ? -1 : prepared_.params.prompt_logprobs,
                                        service_->options_.vocab_size);
    if (invalid.empty()) {
      RecordWorkerCall(metrics::RouterMetrics::WorkerCall::kPrefill, prefill_started_at_);
      prefilled_ = *reply;
      if (WriteFirstTokenEarly()) return;  // the Decode call starts once the token is out
      return StartDecode();
    }
  }
  ReleaseReservation();  // now, not at lease end
  if (!invalid.empty()) {
    return End(grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat(prefill_->label(), " sent ", invalid)));
  }
  if (Interrupted()) {
    AbortOnWorker(prefill_);
    return EndInterrupted();
  }
  const std::string what = WorkerError(*prefill_, status, prepared_.request_id);
  // Before a target that could not be sent: a worker that died has failed both calls, in either
  // order, and only the probe below lets its reservation go before the lease ends.
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // The prefill worker died, or its KV transfer to the decode worker failed (then the decode
    // worker may be the dead one). Whichever does not answer is marked down; retry once.
    const std::string reason = absl::StrCat("Prefill failed: ", status.error_message());
    service_->registry_->ConfirmDown(prefill_, reason, [self = shared_from_this(), reason,
                                                        what](WorkerRegistry::Probe prefill) {
      // A prefill worker that is gone writes no more: the reservation may go at once. One that
      // only does not answer may be stalled with puts still to make: its blocks wait (above), for
      // the lease or until a poll finds it gone.
      if (prefill == WorkerRegistry::Probe::kGone) self->ReleaseReservation(/*sender_gone=*/true);
      if (prefill == WorkerRegistry::Probe::kUnresponsive) self->ReleaseReservationWhenGone();
      self->service_->registry_->ConfirmDown(
          self->decode_, reason, [self, what](WorkerRegistry::Probe) { self->OnPrefillUnavailable(what); });
    });
    return;
  }
  std::string target_failure;
  if (late_target_) {
    absl::MutexLock lock(&join_mu_);
    target_failure = target_failure_;
  }
  if (!target_failure.empty()) {  // aborted for want of its target
    return End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("the KV target could not be sent to the prefill worker: ", target_failure)));
  }
  // Given up on (its timeout, a failure): should the call not have reached the prefill worker, the
  // Abort's target lets it tell the decode worker that nothing will be written.
  AbortOnWorker(prefill_);
  if (IsWorkerFailure(status.error_code())) return End(grpc::Status(grpc::StatusCode::UNAVAILABLE, what));
  End(grpc::Status(status.error_code(), what));
}

void RouterService::GenerateCall::ReleaseReservationWhenGone() {
  // What ReleaseReservation(true) sends now, kept by the registry: the call may have moved on to
  // another placement (or ended) by then.
  if (decode_ == nullptr) return;
  v1::WorkerAbortRequest release = AbortRequest(*decode_, /*sender_gone=*/true, transfer_id_);
  service_->registry_->WhenGone(prefill_, absl::Now() + absl::Milliseconds(service_->options_.kv_lease_ms),
                                [aborts = service_->aborts_, decode = decode_, release] { aborts->Send(decode, release); });
}

void RouterService::GenerateCall::OnPrefillUnavailable(const std::string& what) {
  if (attempt_ > 0) return End(grpc::Status(grpc::StatusCode::UNAVAILABLE, what));
  ++attempt_;
  excluded_prefill_.push_back(prefill_);
  prefill_ = nullptr;
  decode_ = nullptr;
  decode_in_flight_.Reset();
  BeginReserve();
}

bool RouterService::GenerateCall::WriteFirstTokenEarly() {
  // The decode worker's first message carries the token and its text as its engine streams them:
  // the same as here when the token did not end the request at the prefill worker, the request
  // goes on past it, and no stop string or partial UTF-8 character holds its text back. Not after a
  // migration: the token's text then depends on the output before it.
  const SamplingParams& params = prepared_.params;
  const int64_t prompt_len = int64_t(prepared_.prompt_token_ids.size());
  if (resumed() || service_->tokenizer_ == nullptr ||
      prefilled_.first_token_finish_reason() != v1::FINISH_REASON_LENGTH ||
      params.max_tokens <= 1 || !params.stop.empty() || prompt_len + 1 >= service_->options_.max_model_len) {
    return false;
  }
  StreamingDecoder decoder(*service_->tokenizer_, prepared_.prompt_token_ids);
  std::string text = decoder.Push(prefilled_.first_token_id());
  if (text.empty() || !decoder.Flush().empty()) return false;

  out_.Clear();
  out_.set_request_id(prepared_.client_request_id);
  out_.add_token_ids(prefilled_.first_token_id());
  out_.set_text(text);
  if (params.logprobs >= 0) *out_.add_logprobs() = prefilled_.first_token_logprobs();
  out_.mutable_prompt_token_ids()->Assign(prepared_.prompt_token_ids.begin(), prepared_.prompt_token_ids.end());
  out_.mutable_prompt_logprobs()->Swap(prefilled_.mutable_prompt_logprobs());
  prompt_sent_ = true;
  completion_tokens_ += 1;
  output_token_ids_.push_back(prefilled_.first_token_id());
  output_text_bytes_ += int64_t(text.size());
  early_first_text_ = std::move(text);
  annotator_->Annotate(&out_);
  early_write_in_flight_ = true;
  StartWrite(&out_);
  return true;
}

bool RouterService::GenerateCall::DropEarlyFirstToken(v1::GenerateResponse* message) const {
  if (message->token_ids_size() == 0 || message->token_ids(0) != prefilled_.first_token_id() ||
      !absl::StartsWith(message->text(), *early_first_text_)) {
    return false;
  }
  message->mutable_token_ids()->erase(message->mutable_token_ids()->begin());
  if (message->logprobs_size() > 0) message->mutable_logprobs()->erase(message->mutable_logprobs()->begin());
  message->mutable_text()->erase(0, early_first_text_->size());
  message->clear_prompt_token_ids();  // sent with the token
  return true;
}

void RouterService::GenerateCall::StartDecode() {
  LeaveGate();
  v1::DecodeRequest request;
  request.set_request_id(prepared_.request_id);
  request.set_transfer_id(transfer_id_);
  request.mutable_prompt_token_ids()->Assign(prepared_.prompt_token_ids.begin(), prepared_.prompt_token_ids.end());
  *request.mutable_sampling() = prepared_.sampling;
  if (prefill_here_) {
    request.clear_transfer_id();
    request.set_prefill_here(true);
  } else if (kv_attached_) {  // the stream continues after everything the client has
    request.mutable_output_token_ids()->Assign(output_token_ids_.begin(), output_token_ids_.end());
    request.set_output_text_bytes(output_text_bytes_);
    request.set_kv_attached(true);
    kv_attached_pending_ = true;
  } else {
    request.set_first_token_id(prefilled_.first_token_id());
    *request.mutable_first_token_logprobs() = prefilled_.first_token_logprobs();
    request.mutable_output_token_ids()->Assign(output_token_ids_.begin(), output_token_ids_.begin() + resumed_tokens_);
    request.set_output_text_bytes(resumed_text_bytes_);
  }
  stream_context_ = Downstream(absl::InfiniteDuration());
  decode_started_at_ = std::chrono::steady_clock::now();
  stream_ = new DecodeStream(shared_from_this(), stream_context_, std::move(request));
  stream_->Start(*decode_);  // its callbacks may already be running: nothing after this
}

void RouterService::GenerateCall::OnDecodeMessage(grpc::ByteBuffer* bytes) {
  out_.Clear();
  std::string invalid;
  if (!Parse(bytes, &out_)) {
    invalid = absl::StrCat("a stream message that is not a valid ", v1::GenerateResponse::descriptor()->full_name());
  } else {
    invalid = InvalidDecodeMessage(out_, service_->options_.vocab_size, finished_);
  }
  if (!invalid.empty()) {
    stream_error_ = grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat(decode_->label(), " sent ", invalid));
    stream_context_->TryCancel();
    stream_->StopReading();
    return;
  }
  out_.set_request_id(prepared_.client_request_id);
  if (early_first_text_.has_value()) {  // the decode worker's first message
    RecordWorkerCall(metrics::RouterMetrics::WorkerCall::kDecodeFirstMessage, decode_started_at_);
    const bool repeated = DropEarlyFirstToken(&out_);
    early_first_text_.reset();
    if (!repeated) {
      stream_error_ = grpc::Status(grpc::StatusCode::INTERNAL,
                                   absl::StrCat(decode_->label(), " did not begin with the prefill worker's token"));
      stream_context_->TryCancel();
      stream_->StopReading();
      return;
    }
    if (out_.token_ids_size() == 0 && out_.text().empty() && !out_.finished()) return stream_->ReadNext();
  }
  if (!prompt_sent_) {
    RecordWorkerCall(metrics::RouterMetrics::WorkerCall::kDecodeFirstMessage, decode_started_at_);
    if (out_.prompt_token_ids().empty()) {
      out_.mutable_prompt_token_ids()->Assign(prepared_.prompt_token_ids.begin(), prepared_.prompt_token_ids.end());
    }
    // The prefill worker scored the prompt: its logprobs go out with the prompt's ids.
    out_.mutable_prompt_logprobs()->Swap(prefilled_.mutable_prompt_logprobs());
    prompt_sent_ = true;
  } else {
    out_.clear_prompt_token_ids();  // on the first message only, also when a migration's stream echoes them
  }
  kv_attached_pending_ = false;
  if (migrating_) {  // the stream goes on where the failed one stopped
    migrating_ = false;
    service_->metrics_->request_migrations(metrics::RouterMetrics::Migration::kSuccess).Inc();
  }
  completion_tokens_ += out_.token_ids_size();
  output_token_ids_.insert(output_token_ids_.end(), out_.token_ids().begin(), out_.token_ids().end());
  output_text_bytes_ += int64_t(out_.text().size());
  if (out_.finished()) {
    finished_ = true;
    finish_reason_ = out_.finish_reason();
  }
  annotator_->Annotate(&out_);
  StartWrite(&out_);
}

void RouterService::GenerateCall::OnWriteDone(bool ok) {
  if (early_write_in_flight_) {  // WriteFirstTokenEarly's message
    early_write_in_flight_ = false;
    if (!ok) {
      AbortOnWorker(decode_);
      return End(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    }
    first_token_at_ = last_token_at_ = std::chrono::steady_clock::now();
    service_->metrics_->time_to_first_token_seconds.Observe(Seconds(first_token_at_ - active_->arrival));
    if (Interrupted()) {
      AbortOnWorker(decode_);
      return EndInterrupted();
    }
    return StartDecode();
  }
  if (!ok) {  // the client is gone
    client_write_failed_ = true;
    stream_context_->TryCancel();
    stream_->StopReading();
    return;
  }
  if (out_.token_ids_size() > 0) {
    // Tokens relayed to the client: the first ends the time to first token, the rest are spaced
    // by the inter-token latency.
    const auto now = std::chrono::steady_clock::now();
    if (first_token_at_ == std::chrono::steady_clock::time_point{}) {
      first_token_at_ = now;
      service_->metrics_->time_to_first_token_seconds.Observe(Seconds(now - active_->arrival));
    } else {
      const double gap = Seconds(now - last_token_at_);
      service_->metrics_->inter_token_latency_seconds.Observe(gap);
      service_->metrics_->time_per_output_token_seconds.Observe(gap);
    }
    last_token_at_ = now;
  }
  stream_->ReadNext();
}

void RouterService::GenerateCall::OnDecodeDone(const grpc::Status& status) {
  stream_ = nullptr;
  NoteDeadline(status);
  if (!stream_error_.ok()) {
    AbortOnWorker(decode_);
    return End(stream_error_);
  }
  if (finished_ && !client_write_failed_) {
    if (std::optional<FinishReason> reason = StreamFinishReason(finish_reason_)) RecordFinished(*reason);
    RecordDecoded();
    return End(grpc::Status::OK);
  }
  if (client_write_failed_) {
    AbortOnWorker(decode_);
    return End(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
  }
  if (Interrupted()) {
    AbortOnWorker(decode_);
    return EndInterrupted();
  }
  if (std::optional<uint64_t> parked = ParkedTransferId(status)) return MoveParkedKv(*parked);
  if (kv_attached_pending_) {  // the parked KV could not be continued: re-prefill, if anything
    kv_attached_pending_ = false;
    service_->metrics_->kv_migrations(metrics::RouterMetrics::KvMigration::kFailed).Inc();
  }
  if (status.ok()) {
    return End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat(decode_->label(), " ended the stream before the request finished")));
  }
  if (IsWorkerFailure(status.error_code())) {
    const std::string what = WorkerError(*decode_, status, prepared_.request_id);
    // A worker that is gone, or whose stream broke, leaves the request to another pair; a live
    // one that failed the request itself (INTERNAL, ...) would only fail it again.
    const bool unavailable = status.error_code() == grpc::StatusCode::UNAVAILABLE;
    service_->registry_->ConfirmDown(decode_, absl::StrCat("Decode stream failed: ", status.error_message()),
                                     [self = shared_from_this(), what, unavailable](WorkerRegistry::Probe probe) {
                                       if (probe != WorkerRegistry::Probe::kAnswered || unavailable) {
                                         return self->Migrate(what);
                                       }
                                       // Its reservation, should the call not have reached it.
                                       self->AbortOnWorker(self->decode_);
                                       self->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, what));
                                     });
    return;
  }
  End(grpc::Status(status.error_code(), WorkerError(*decode_, status, prepared_.request_id)));
}

void RouterService::GenerateCall::Migrate(const std::string& what) {
  AbortOnWorker(decode_);  // a worker still up drops what it holds (none when it is down)
  if (Interrupted()) return EndInterrupted();
  if (migrating_) {  // the previous move failed before its stream delivered anything
    migrating_ = false;
    service_->metrics_->request_migrations(metrics::RouterMetrics::Migration::kFailure).Inc();
  }
  const int limit = service_->options_.max_request_migrations;
  if (migrations_ >= limit) {
    if (limit == 0) return End(grpc::Status(grpc::StatusCode::UNAVAILABLE, what));
    service_->metrics_->request_migrations(metrics::RouterMetrics::Migration::kLimit).Inc();
    return End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat(what, "; the request was not migrated again: it moved ", migrations_,
                                         migrations_ == 1 ? " time" : " times", " already (max_request_migrations ",
                                         limit, ")")));
  }
  ++migrations_;
  migrating_ = true;
  kv_attached_ = false;
  migration_cause_ = what;
  DUET_LOG(INFO) << "request " << prepared_.request_id << ": " << what << " after " << output_token_ids_.size()
                 << " tokens; migrating it (" << migrations_ << " of at most " << limit << ")";
  failed_decode_.push_back(decode_);
  prefill_here_ = false;
  early_first_text_.reset();  // if the failed stream had yet to repeat it, the next pair goes on after it
  decode_ = nullptr;
  decode_in_flight_.Reset();
  prefill_ = nullptr;
  excluded_prefill_.clear();
  attempt_ = 0;
  // Placed as a prompt of the prompt and the output so far, through the prefill gate again.
  resumed_tokens_ = output_token_ids_.size();
  resumed_text_bytes_ = output_text_bytes_;
  placed_token_ids_ = prepared_.prompt_token_ids;
  placed_token_ids_.insert(placed_token_ids_.end(), output_token_ids_.begin(), output_token_ids_.end());
  info_.prompt_token_ids = placed_token_ids_;
  EnterGate();
}

// ---- Live KV migration ----

std::optional<uint64_t> RouterService::GenerateCall::ParkedTransferId(const grpc::Status& status) const {
  if (status.error_code() != grpc::StatusCode::UNAVAILABLE || output_token_ids_.empty() || finished_) {
    return std::nullopt;
  }
  const auto& trailers = stream_context_->GetServerTrailingMetadata();
  auto it = trailers.find(rpc::kKvParkedTrailer);
  if (it == trailers.end()) return std::nullopt;
  uint64_t id = 0;
  const char* end = it->second.data() + it->second.size();
  const auto [ptr, error] = std::from_chars(it->second.data(), end, id);
  if (error != std::errc() || ptr != end) return std::nullopt;
  return id;
}

void RouterService::GenerateCall::MoveParkedKv(uint64_t parked_transfer_id) {
  prefill_here_ = false;  // prefilled or not, the stream now goes on from the parked KV
  parked_on_ = decode_;
  parked_transfer_id_ = parked_transfer_id;
  early_first_text_.reset();  // the parked output holds the first token: the stream goes on after it
  decode_ = nullptr;
  decode_in_flight_.Reset();
  DUET_LOG(INFO) << "request " << prepared_.request_id << ": " << parked_on_->label()
                 << " is draining and parked it after " << output_token_ids_.size() << " tokens; moving its KV";
  // The destination holds the KV of the prompt and the output but its last token (not computed).
  placed_token_ids_ = prepared_.prompt_token_ids;
  placed_token_ids_.insert(placed_token_ids_.end(), output_token_ids_.begin(), output_token_ids_.end() - 1);
  info_.prompt_token_ids = placed_token_ids_;
  info_.excluded = failed_decode_;
  info_.excluded.push_back(parked_on_);
  Worker* destination = service_->policy_->PickDecode(info_);
  if (destination == nullptr) return ResumeParked();
  decode_ = destination;
  decode_in_flight_ = InFlightGuard(destination);
  transfer_id_ = service_->NewTransferId();
  target_shipped_ = false;
  v1::ReserveKvRequest request;
  request.set_request_id(prepared_.request_id);
  request.set_transfer_id(transfer_id_);
  request.set_num_prompt_tokens(static_cast<int32_t>(placed_token_ids_.size()));
  request.set_lease_ms(service_->options_.kv_lease_ms);
  // A reused prefix must end on a block boundary of the draining worker, which sends the rest.
  if (const std::optional<v1::WorkerStats> stats = parked_on_->stats(); stats && stats->block_size() > 0) {
    request.mutable_prompt_token_ids()->Assign(placed_token_ids_.begin(), placed_token_ids_.end());
    if (prepared_.sampling.has_cache_salt()) request.set_cache_salt(prepared_.sampling.cache_salt());
    request.set_prefix_alignment_tokens(stats->block_size());
  }
  CallWorker<v1::ReserveKvResponse>(
      *destination, ReserveKvMethod(), Downstream(service_->options_.reserve_timeout), std::move(request),
      [self = shared_from_this()](const grpc::Status& status, const v1::ReserveKvResponse* reply) {
        self->OnParkedKvReserved(status, reply);
      });
}

void RouterService::GenerateCall::OnParkedKvReserved(const grpc::Status& status, const v1::ReserveKvResponse* reply) {
  NoteDeadline(status);
  const bool reserved = status.ok() && reply != nullptr && reply->target().transfer_id() == transfer_id_;
  if (!reserved || Interrupted()) {
    AbortOnWorker(decode_);  // whatever it may have reserved; no sender has the target
    decode_ = nullptr;
    decode_in_flight_.Reset();
    return ResumeParked();  // or ends an interrupted request
  }
  target_ = reply->target();
  target_shipped_ = true;
  v1::MigrateKvRequest request;
  request.set_request_id(prepared_.request_id);
  request.set_parked_transfer_id(parked_transfer_id_);
  *request.mutable_target() = target_;
  CallWorker<v1::MigrateKvResponse>(
      *parked_on_, MigrateKvMethod(), Downstream(service_->options_.prefill_timeout), std::move(request),
      [self = shared_from_this()](const grpc::Status& status, const v1::MigrateKvResponse*) {
        self->OnKvMigrated(status);
      });
}

void RouterService::GenerateCall::OnKvMigrated(const grpc::Status& status) {
  NoteDeadline(status);
  if (!status.ok()) {
    DUET_LOG(WARNING) << "request " << prepared_.request_id << ": moving its parked KV failed: "
                      << status.error_message();
    // Refused before anything was sent: the blocks may go at once; otherwise once the draining
    // worker's sender has stopped.
    const grpc::StatusCode code = status.error_code();
    AbortOnWorker(decode_, /*sender_gone=*/code == grpc::StatusCode::FAILED_PRECONDITION ||
                               code == grpc::StatusCode::INVALID_ARGUMENT ||
                               code == grpc::StatusCode::PERMISSION_DENIED ||
                               code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::UNIMPLEMENTED);
    decode_ = nullptr;
    decode_in_flight_.Reset();
    return ResumeParked();
  }
  service_->metrics_->kv_migrations(metrics::RouterMetrics::KvMigration::kMoved).Inc();
  parked_on_ = nullptr;  // the parked reservation ended with the shipment
  if (Interrupted()) {
    AbortOnWorker(decode_);
    return EndInterrupted();
  }
  kv_attached_ = true;
  StartDecode();
}

void RouterService::GenerateCall::ResumeParked() {
  if (Interrupted()) {
    AbortOnWorker(parked_on_);
    return EndInterrupted();
  }
  service_->metrics_->kv_migrations(metrics::RouterMetrics::KvMigration::kResumed).Inc();
  decode_ = std::exchange(parked_on_, nullptr);
  decode_in_flight_ = InFlightGuard(decode_);
  transfer_id_ = parked_transfer_id_;
  kv_attached_ = true;
  StartDecode();
}

bool RouterService::GenerateCall::Interrupted() const {
  return active_->aborted() || active_->client_gone() || context_->IsCancelled() || client_deadline_passed_ ||
         context_->deadline() <= std::chrono::system_clock::now();
}

void RouterService::GenerateCall::EndInterrupted() {
  if (active_->aborted()) return EndWithAbortMessage();
  if (client_deadline_passed_ || context_->deadline() <= std::chrono::system_clock::now()) {
    return End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded"));
  }
  End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client"));
}

v1::WorkerAbortRequest RouterService::GenerateCall::AbortRequest(const Worker& worker, bool sender_gone,
                                                                uint64_t transfer_id) const {
  v1::WorkerAbortRequest request;
  request.set_request_id(prepared_.request_id);
  if (worker.decode() != nullptr) {
    request.set_release_now(sender_gone || !target_shipped_);
    request.set_transfer_id(transfer_id);
  } else if (target_shipped_) {
    // Should the Prefill call not have reached it, the prefill worker tells the decode worker.
    *request.mutable_kv_target() = target_;
  }
  return request;
}

void RouterService::GenerateCall::AbortOnWorker(Worker* worker, bool sender_gone, uint64_t transfer_id) {
  // Also to a worker marked down: a stalled one that comes back still holds the request's blocks.
  if (worker == nullptr) return;
  service_->aborts_->Send(worker, AbortRequest(*worker, sender_gone, transfer_id));
}

void RouterService::GenerateCall::EndWithAbortMessage() {
  last_.set_request_id(prepared_.client_request_id);
  last_.set_finished(true);
  last_.set_finish_reason(FinishReasonName(FinishReason::kAbort));
  last_.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(prepared_.prompt_token_ids.size()));
  last_.mutable_usage()->set_completion_tokens(completion_tokens_);
  if (!prompt_sent_) {
    last_.mutable_prompt_token_ids()->Assign(prepared_.prompt_token_ids.begin(), prepared_.prompt_token_ids.end());
  }
  RecordFinished(FinishReason::kAbort);
  Release();
  annotator_->Annotate(&last_);
  StartWriteAndFinish(&last_, grpc::WriteOptions(), grpc::Status::OK);
}

void RouterService::GenerateCall::End(const grpc::Status& status) {
  Release();
  if (migrating_ && !status.ok() && !Interrupted()) {  // the move found no pair to go on with
    service_->metrics_->request_migrations(metrics::RouterMetrics::Migration::kFailure).Inc();
    return Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat(migration_cause_,
                                                                           "; the request could not be migrated: ",
                                                                           status.error_message())));
  }
  Finish(status);
}

void RouterService::GenerateCall::Release() {
  LeaveGate();
  decode_in_flight_.Reset();
  prefill_in_flight_.Reset();
  if (registered_) {
    absl::MutexLock lock(&service_->mu_);
    service_->active_.erase(active_key_);
  }
  const bool held_slot = stage_ == Stage::kWaiting || stage_ == Stage::kPlaced;
  if (stage_ == Stage::kQueued || stage_ == Stage::kWaiting) service_->metrics_->num_requests_waiting.Dec();
  if (stage_ != Stage::kNotAdmitted && stage_ != Stage::kEnded) {
    service_->in_flight_.fetch_sub(1, std::memory_order_acq_rel);
  }
  stage_ = Stage::kEnded;
  if (held_slot) service_->admission_->Leave();  // the next queued request may start on this thread
}

void RouterService::GenerateCall::RecordFinished(FinishReason reason) {
  metrics::FinishedRequest finished;
  finished.reason = reason;
  finished.prompt_tokens = int64_t(prepared_.prompt_token_ids.size());
  finished.generation_tokens = completion_tokens_;
  finished.max_tokens = prepared_.params.max_tokens;
  finished.e2e_seconds = Seconds(std::chrono::steady_clock::now() - active_->arrival);
  finished.queue_seconds = stage_ == Stage::kPlaced ? queue_seconds_ : finished.e2e_seconds;
  finished.decode_seconds = Seconds(last_token_at_ - first_token_at_);
  service_->metrics_->RecordFinished(finished);
}

void RouterService::GenerateCall::RecordPlacement(Worker* worker) {
  std::optional<v1::WorkerStats> stats = worker->stats();
  if (!stats.has_value() || stats->block_size() <= 0) return;  // not polled yet: no block size
  const absl::Span<const BlockHash> chain = block_hashes_->ForBlockSize(stats->block_size());
  const bool decode = worker->role() == WorkerRole::kDecode;
  int64_t cached = 0;
  if (service_->options_.prefix_index != nullptr) {
    cached = service_->options_.prefix_index->Insert(worker, chain, stats->num_kv_blocks());
  }
  service_->metrics_->routed_prompt_blocks(decode).Inc(double(chain.size()));
  service_->metrics_->routed_prompt_blocks_cached(decode).Inc(double(cached));
}

void RouterService::GenerateCall::RecordWorkerCall(metrics::RouterMetrics::WorkerCall call,
                                                   std::chrono::steady_clock::time_point started_at) {
  service_->metrics_->worker_call_seconds(call).Observe(Seconds(std::chrono::steady_clock::now() - started_at));
}

void RouterService::GenerateCall::RecordDecoded() {
  PrefixIndex* index = service_->options_.prefix_index;
  if (index == nullptr || output_token_ids_.empty()) return;
  std::optional<v1::WorkerStats> stats = decode_->stats();
  if (!stats.has_value() || stats->block_size() <= 0) return;
  // The decode worker's cache holds the prompt and every output token but the last (whose K/V a
  // next step would have written).
  std::vector<int32_t> tokens = prepared_.prompt_token_ids;
  tokens.insert(tokens.end(), output_token_ids_.begin(), output_token_ids_.end() - 1);
  index->Insert(decode_, FullBlockHashes(block_hashes_->seed(), tokens, stats->block_size()), stats->num_kv_blocks());
}

RouterService::RouterService(RouterServiceOptions options, const Tokenizer* tokenizer, WorkerRegistry* registry,
                             AssignmentPolicy* policy)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      registry_(registry),
      policy_(policy) {
  if (options_.metrics_registry != nullptr) {
    metrics_registry_ = options_.metrics_registry;
  } else {
    own_metrics_registry_ = std::make_unique<metrics::Registry>();
    metrics_registry_ = own_metrics_registry_.get();
  }
  metrics_ = std::make_unique<metrics::RouterMetrics>(*metrics_registry_, options_.model_name,
                                                      std::max<int64_t>(1, options_.max_model_len));
  admission_ = std::make_unique<AdmissionQueue>(options_.max_concurrent_requests, options_.max_queued_requests);
  prefill_gate_ = std::make_unique<PrefillGate>(options_.max_prefill_tokens_per_worker, registry_);
  aborts_ = std::make_shared<WorkerAborts>(std::max(options_.abort_timeout, absl::Milliseconds(options_.kv_lease_ms)));
  absl::BitGen gen;
  next_transfer_id_.store(absl::Uniform<uint64_t>(gen) | 1);
  chat_context_.model_name = options_.model_name;
  chat_context_.tokenizer = tokenizer_;
  chat_context_.chat = options_.chat_template;
  chat_context_.max_model_len = options_.max_model_len;
  chat_context_.auto_tool_call_format = options_.auto_tool_call_format;
}

RouterService::~RouterService() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* live_calls) { return *live_calls == 0; }, &live_calls_));
}

void RouterService::CallCreated() {
  absl::MutexLock lock(&mu_);
  ++live_calls_;
}

void RouterService::CallDestroyed() {
  absl::MutexLock lock(&mu_);
  --live_calls_;
}

uint64_t RouterService::NewTransferId() {
  uint64_t id = next_transfer_id_.fetch_add(1, std::memory_order_relaxed);
  if (id == 0) id = next_transfer_id_.fetch_add(1, std::memory_order_relaxed);  // 0 means "none"
  return id;
}

absl::StatusOr<RouterService::Prepared> RouterService::Prepare(const v1::GenerateRequest& request) const {
  DUET_RETURN_IF_ERROR(CheckRequestIdLength(request.request_id()));
  if (const size_t bytes = request.ByteSizeLong(); bytes > kMaxGenerateRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the request is too large: ", bytes, " bytes, more than ",
                                                   kMaxGenerateRequestBytes));
  }
  if (request.n() < 0 || request.n() > 1) {
    return absl::InvalidArgumentError(
        request.n() < 0 ? absl::StrCat("n must be between 1 and ", kMaxCompletionsPerRequest, ", got ", request.n())
                        : "n > 1 is served in front of this service (ChoicesDuetService), not by it");
  }
  Prepared prepared;
  v1::SamplingOptions sampling = request.sampling();
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText:
      if (request.text().empty()) return absl::InvalidArgumentError("prompt is empty: text has no characters");
      if (tokenizer_ == nullptr) {
        return absl::InvalidArgumentError("text prompts are not supported (no tokenizer); send token_ids");
      }
      prepared.prompt_token_ids = tokenizer_->Encode(request.text(), /*add_special_tokens=*/true);
      break;
    case v1::GenerateRequest::kTokenIds:
      prepared.prompt_token_ids.assign(request.token_ids().ids().begin(), request.token_ids().ids().end());
      break;
    case v1::GenerateRequest::kChat: {
      DUET_ASSIGN_OR_RETURN(openai::ChatInput chat, PrepareChat(request.chat(), chat_context_, &sampling));
      prepared.prompt_token_ids = std::move(chat.prompt_token_ids);
      prepared.tools = std::move(chat.tools);
      break;
    }
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt is required: set text, token_ids or chat");
  }
  if (prepared.prompt_token_ids.empty()) return absl::InvalidArgumentError("prompt is empty: no token ids");
  for (size_t i = 0; i < prepared.prompt_token_ids.size(); ++i) {
    const int32_t id = prepared.prompt_token_ids[i];
    if (id < 0 || id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token id %d at prompt position %d is out of vocabulary (vocab size %d)", id, i, options_.vocab_size));
    }
  }
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(sampling);
  if (!params.ok()) return absl::InvalidArgumentError(params.status().message());
  if (params->structured_output.active()) {  // a bad constraint fails here, before any worker runs
    absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::BuildGrammar(params->structured_output);
    if (!g.ok()) return absl::InvalidArgumentError(absl::StrCat("structured_output: ", g.status().message()));
  }
  prepared.params = *std::move(params);
  for (int32_t id : prepared.params.stop_token_ids) {
    if (id < 0 || id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stop_token_ids: token id %d is out of vocabulary (vocab size %d)", id, options_.vocab_size));
    }
  }
  for (const auto& [id, bias] : prepared.params.logit_bias) {
    if (id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "logit_bias: token id %d is out of vocabulary (vocab size %d)", id, options_.vocab_size));
    }
  }
  const int64_t prompt_len = static_cast<int64_t>(prepared.prompt_token_ids.size());
  const int64_t max_tokens = prepared.params.max_tokens;
  if (prompt_len + max_tokens > options_.max_model_len) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the "
        "messages, %d in the completion). Please reduce the length of the messages or completion.",
        options_.max_model_len, prompt_len + max_tokens, prompt_len, max_tokens));
  }
  prepared.sampling = rpc::ToSamplingOptions(prepared.params);
  if (request.request_id().empty()) {
    prepared.client_request_id = prepared.request_id = absl::StrCat("cmpl-", RandomHex(16));
  } else {
    prepared.client_request_id = request.request_id();
    prepared.request_id = absl::StrCat(request.request_id(), "@", RandomHex(8));
  }
  return prepared;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(grpc::CallbackServerContext* context,
                                                                        const v1::GenerateRequest* request) {
  auto call = std::make_shared<GenerateCall>(this, context);
  call->Start(*request);  // the call holds itself until OnDone
  return call.get();
}

grpc::ServerUnaryReactor* RouterService::Abort(grpc::CallbackServerContext* context, const v1::AbortRequest* request,
                                               v1::AbortResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (request->request_id().empty()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request_id is required"));
    return reactor;
  }
  if (absl::Status status = CheckRequestIdLength(request->request_id()); !status.ok()) {
    reactor->Finish(rpc::ToGrpc(status));
    return reactor;
  }
  // Only the caller's own requests: another client's with this id is not found.
  std::shared_ptr<ActiveCall> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = active_.find(std::make_pair(ClientOf(*context), request->request_id()));
    if (it != active_.end()) call = it->second;
  }
  if (call != nullptr) call->Abort();
  response->set_found(call != nullptr);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* RouterService::GetModelInfo(grpc::CallbackServerContext* context,
                                                      const v1::GetModelInfoRequest*, v1::ModelInfo* response) {
  response->set_model_name(options_.model_name);
  response->set_vocab_size(static_cast<int32_t>(options_.vocab_size));
  response->set_max_model_len(options_.max_model_len);
  response->set_num_prefill_workers(registry_->NumUp(WorkerRole::kPrefill));
  response->set_num_decode_workers(registry_->NumUp(WorkerRole::kDecode));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace duet::router
