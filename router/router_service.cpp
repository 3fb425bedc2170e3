#include "router/router_service.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "proto/rpc_util.h"

namespace duet::router {

// The downstream call a request is waiting on, so Abort can cancel it from another thread.
class RouterService::ActiveCall {
 public:
  // When the request reached the router (time to first token and e2e latency start here).
  const std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();

  void Attach(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    downstream_ = context;
    if (aborted_) context->TryCancel();  // cancels the call as soon as it starts
  }
  void Detach() {
    absl::MutexLock lock(&mu_);
    downstream_ = nullptr;
  }
  void Abort() {
    absl::MutexLock lock(&mu_);
    aborted_ = true;
    if (downstream_ != nullptr) downstream_->TryCancel();
  }
  bool aborted() const {
    absl::MutexLock lock(&mu_);
    return aborted_;
  }

 private:
  mutable absl::Mutex mu_;
  grpc::ClientContext* downstream_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

struct RouterService::Reservation {
  Worker* decode = nullptr;
  InFlightGuard in_flight;
  v1::KvTarget target;
  uint64_t transfer_id = 0;
};

namespace {

// Attaches a downstream context to the request for the duration of one call.
class ScopedAttach {
 public:
  ScopedAttach(RouterService::ActiveCall* call, grpc::ClientContext* context);
  ~ScopedAttach();

 private:
  RouterService::ActiveCall* call_;
};

// A context for a call to a worker: the client's deadline and cancellation propagate to it, and
// `timeout` (if finite) bounds it further.
std::unique_ptr<grpc::ClientContext> Downstream(grpc::ServerContext* context, absl::Duration timeout) {
  std::unique_ptr<grpc::ClientContext> downstream = grpc::ClientContext::FromServerContext(*context);
  if (timeout != absl::InfiniteDuration()) {
    downstream->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  return downstream;
}

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

std::optional<metrics::FinishedReason> FinishedReasonOf(const std::string& reason) {
  if (reason == "stop") return metrics::FinishedReason::kStop;
  if (reason == "length") return metrics::FinishedReason::kLength;
  if (reason == "abort") return metrics::FinishedReason::kAbort;
  return std::nullopt;
}

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string RandomHex() {
  absl::BitGen gen;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
}

}  // namespace

ScopedAttach::ScopedAttach(RouterService::ActiveCall* call, grpc::ClientContext* context) : call_(call) {
  call_->Attach(context);
}
ScopedAttach::~ScopedAttach() { call_->Detach(); }

RouterService::RouterService(RouterServiceOptions options, const Tokenizer* tokenizer, WorkerRegistry* registry,
                             AssignmentPolicy* policy)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      registry_(registry),
      policy_(policy),
      request_id_prefix_(absl::StrCat("cmpl-", RandomHex().substr(0, 8), "-")) {
  if (options_.metrics_registry != nullptr) {
    metrics_registry_ = options_.metrics_registry;
  } else {
    own_metrics_registry_ = std::make_unique<metrics::Registry>();
    metrics_registry_ = own_metrics_registry_.get();
  }
  metrics_ = std::make_unique<metrics::DuetMetrics>(*metrics_registry_, options_.model_name, metrics::Role::kRouter,
                                                    std::max<int64_t>(1, options_.max_model_len));
  absl::BitGen gen;
  next_transfer_id_.store(absl::Uniform<uint64_t>(gen) | 1);
}

RouterService::~RouterService() = default;

std::string RouterService::NewRequestId() const {
  return absl::StrCat(request_id_prefix_, next_request_number_.fetch_add(1, std::memory_order_relaxed));
}

uint64_t RouterService::NewTransferId() {
  uint64_t id = next_transfer_id_.fetch_add(1, std::memory_order_relaxed);
  if (id == 0) id = next_transfer_id_.fetch_add(1, std::memory_order_relaxed);  // 0 means "none"
  return id;
}

absl::StatusOr<RouterService::Prepared> RouterService::Prepare(const v1::GenerateRequest& request) const {
  Prepared prepared;
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
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt is required: set text or token_ids");
  }
  if (prepared.prompt_token_ids.empty()) return absl::InvalidArgumentError("prompt is empty: no token ids");
  for (size_t i = 0; i < prepared.prompt_token_ids.size(); ++i) {
    const int32_t id = prepared.prompt_token_ids[i];
    if (id < 0 || id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "token id %d at prompt position %d is out of vocabulary (vocab size %d)", id, i, options_.vocab_size));
    }
  }
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(request.sampling());
  if (!params.ok()) return absl::InvalidArgumentError(params.status().message());
  prepared.params = *std::move(params);
  for (int32_t id : prepared.params.stop_token_ids) {
    if (id < 0 || id >= options_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "stop_token_ids: token id %d is out of vocabulary (vocab size %d)", id, options_.vocab_size));
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
  prepared.request_id = request.request_id().empty() ? NewRequestId()
                                                     : request.request_id();
  return prepared;
}

grpc::Status RouterService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                     grpc::ServerWriter<v1::GenerateResponse>* writer) {
  absl::StatusOr<Prepared> prepared = Prepare(*request);
  if (!prepared.ok()) return rpc::ToGrpc(prepared.status());

  const int in_flight = in_flight_.fetch_add(1, std::memory_order_acq_rel) + 1;
  absl::Cleanup release = [this] { in_flight_.fetch_sub(1, std::memory_order_acq_rel); };
  if (in_flight > options_.max_concurrent_requests) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("server is at capacity: ", options_.max_concurrent_requests,
                                     " requests in flight (max_concurrent_requests); retry later"));
  }

  metrics_->num_requests_running.Inc();
  absl::Cleanup running = [this] { metrics_->num_requests_running.Dec(); };
  const std::string& request_id = prepared->request_id;
  auto call = std::make_shared<ActiveCall>();
  {
    absl::MutexLock lock(&mu_);
    if (!active_.try_emplace(request_id, call).second) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("request_id \"", request_id, "\" is already in flight"));
    }
  }
  absl::Cleanup unregister = [this, &request_id] {
    absl::MutexLock lock(&mu_);
    active_.erase(request_id);
  };
  return Run(context, *prepared, call.get(), writer);
}

absl::StatusOr<RouterService::Reservation> RouterService::Reserve(grpc::ServerContext* context,
                                                                   const Prepared& prepared, ActiveCall* call) {
  RequestInfo info;
  info.request_id = prepared.request_id;
  info.prompt_token_ids = prepared.prompt_token_ids;
  info.max_tokens = prepared.params.max_tokens;
  std::string last_exhausted;
  std::string last_failure;
  while (Worker* decode = policy_->PickDecode(info)) {
    Reservation reservation;
    reservation.decode = decode;
    reservation.in_flight = InFlightGuard(decode);
    reservation.transfer_id = NewTransferId();
    v1::ReserveKvRequest request;
    request.set_request_id(prepared.request_id);
    request.set_transfer_id(reservation.transfer_id);
    request.set_num_prompt_tokens(static_cast<int32_t>(prepared.prompt_token_ids.size()));
    request.set_lease_ms(options_.kv_lease_ms);
    v1::ReserveKvResponse response;
    std::unique_ptr<grpc::ClientContext> downstream = Downstream(context, options_.reserve_timeout);
    grpc::Status status;
    {
      ScopedAttach attach(call, downstream.get());
      status = decode->decode()->ReserveKv(downstream.get(), request, &response);
    }
    if (status.ok()) {
      reservation.target = response.target();
      return reservation;
    }
    if (context->IsCancelled() || call->aborted()) return absl::CancelledError("request cancelled");
    info.excluded.push_back(decode);
    const std::string what = absl::StrCat(decode->name(), ": ", status.error_message());
    switch (status.error_code()) {
      case grpc::StatusCode::RESOURCE_EXHAUSTED:
        last_exhausted = what;
        break;
      case grpc::StatusCode::UNAVAILABLE:
        registry_->ConfirmDown(decode, absl::StrCat("ReserveKv failed: ", status.error_message()));
        last_failure = what;
        break;
      default:
        if (!IsWorkerFailure(status.error_code())) {
          return absl::Status(static_cast<absl::StatusCode>(status.error_code()), what);
        }
        last_failure = what;
        break;
    }
  }
  if (!last_exhausted.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no decode worker has room for the prompt's KV cache (",
                     prepared.prompt_token_ids.size(), " tokens); retry later. Last refusal: ", last_exhausted));
  }
  if (!last_failure.empty()) {
    return absl::UnavailableError(absl::StrCat("no decode worker could take the request: ", last_failure));
  }
  return absl::UnavailableError(registry_->decode_workers().empty() ? "no decode workers are configured"
                                                                    : "no decode worker is up");
}

void RouterService::AbortOnWorker(Worker* worker, const std::string& request_id) {
  if (worker == nullptr || !worker->up()) return;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.abort_timeout));
  v1::WorkerAbortRequest request;
  request.set_request_id(request_id);
  v1::WorkerAbortResponse response;
  if (worker->prefill() != nullptr) {
    (void)worker->prefill()->Abort(&context, request, &response);
  } else {
    (void)worker->decode()->Abort(&context, request, &response);
  }
}

std::optional<grpc::Status> RouterService::EndedByClient(grpc::ServerContext* context, ActiveCall* call,
                                                         const Prepared& prepared, int completion_tokens,
                                                         bool prompt_sent,
                                                         grpc::ServerWriter<v1::GenerateResponse>* writer) {
  if (call->aborted()) {
    v1::GenerateResponse last;
    last.set_request_id(prepared.request_id);
    last.set_finished(true);
    last.set_finish_reason("abort");
    last.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(prepared.prompt_token_ids.size()));
    last.mutable_usage()->set_completion_tokens(completion_tokens);
    if (!prompt_sent) {
      last.mutable_prompt_token_ids()->Assign(prepared.prompt_token_ids.begin(), prepared.prompt_token_ids.end());
    }
    (void)writer->Write(last);
    metrics_->request_success(metrics::FinishedReason::kAbort).Inc();
    metrics_->e2e_request_latency_seconds.Observe(Seconds(std::chrono::steady_clock::now() - call->arrival));
    return grpc::Status::OK;
  }
  if (context->deadline() <= std::chrono::system_clock::now()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded");
  }
  if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
  return std::nullopt;
}

grpc::Status RouterService::Run(grpc::ServerContext* context, const Prepared& prepared, ActiveCall* call,
                                grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const std::string& request_id = prepared.request_id;
  std::vector<const Worker*> excluded_prefill;
  Reservation reservation;
  v1::PrefillResponse prefilled;
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<Reservation> reserved = Reserve(context, prepared, call);
    if (!reserved.ok()) {
      if (std::optional<grpc::Status> ended = EndedByClient(context, call, prepared, 0, false, writer)) {
        return *ended;
      }
      return rpc::ToGrpc(reserved.status());
    }
    RequestInfo info;
    info.request_id = request_id;
    info.prompt_token_ids = prepared.prompt_token_ids;
    info.max_tokens = prepared.params.max_tokens;
    info.excluded = excluded_prefill;
    Worker* prefill = policy_->PickPrefill(info);
    if (prefill == nullptr && !excluded_prefill.empty()) {
      info.excluded.clear();  // the retry: the failed worker answers its stats and is the only one
      prefill = policy_->PickPrefill(info);
    }
    if (prefill == nullptr) {
      AbortOnWorker(reserved->decode, request_id);
      if (!excluded_prefill.empty()) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat(excluded_prefill.back()->name(), " failed and no prefill worker is up"));
      }
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, registry_->prefill_workers().empty()
                                                             ? "no prefill workers are configured"
                                                             : "no prefill worker is up");
    }
    InFlightGuard prefill_in_flight(prefill);
    v1::PrefillRequest request;
    request.set_request_id(request_id);
    request.mutable_prompt_token_ids()->Assign(prepared.prompt_token_ids.begin(), prepared.prompt_token_ids.end());
    *request.mutable_sampling() = prepared.sampling;
    *request.mutable_target() = reserved->target;
    std::unique_ptr<grpc::ClientContext> downstream = Downstream(context, options_.prefill_timeout);
    grpc::Status status;
    {
      ScopedAttach attach(call, downstream.get());
      status = prefill->prefill()->Prefill(downstream.get(), request, &prefilled);
    }
    if (status.ok()) {
      reservation = *std::move(reserved);
      metrics_->prompt_tokens.Inc(double(prepared.prompt_token_ids.size()));
      metrics_->request_prompt_tokens.Observe(double(prepared.prompt_token_ids.size()));
      break;
    }
    AbortOnWorker(reserved->decode, request_id);  // release the KV reservation now, not at lease end
    if (std::optional<grpc::Status> ended = EndedByClient(context, call, prepared, 0, false, writer)) {
      AbortOnWorker(prefill, request_id);
      return *ended;
    }
    const std::string what = absl::StrCat(prefill->name(), " failed: ", status.error_message());
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      // The prefill worker died, or its KV transfer to the decode worker failed (then the decode
      // worker may be the dead one). Whichever does not answer is marked down; retry once.
      const std::string reason = absl::StrCat("Prefill failed: ", status.error_message());
      registry_->ConfirmDown(prefill, reason);
      registry_->ConfirmDown(reserved->decode, reason);
      if (attempt == 0) {
        excluded_prefill.push_back(prefill);
        continue;
      }
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, what);
    }
    if (IsWorkerFailure(status.error_code())) return grpc::Status(grpc::StatusCode::UNAVAILABLE, what);
    return grpc::Status(status.error_code(), absl::StrCat(prefill->name(), ": ", status.error_message()));
  }

  // Decode: relay the stream.
  Worker* decode = reservation.decode;
  v1::DecodeRequest request;
  request.set_request_id(request_id);
  request.set_transfer_id(reservation.transfer_id);
  request.mutable_prompt_token_ids()->Assign(prepared.prompt_token_ids.begin(), prepared.prompt_token_ids.end());
  *request.mutable_sampling() = prepared.sampling;
  request.set_first_token_id(prefilled.first_token_id());
  *request.mutable_first_token_logprobs() = prefilled.first_token_logprobs();

  std::unique_ptr<grpc::ClientContext> downstream = Downstream(context, absl::InfiniteDuration());
  bool prompt_sent = false;
  bool finished = false;
  bool client_gone = false;
  int completion_tokens = 0;
  std::string finish_reason;
  std::chrono::steady_clock::time_point last_token_at{};
  grpc::Status status;
  {
    ScopedAttach attach(call, downstream.get());
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
        decode->decode()->Decode(downstream.get(), request);
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
      if (client_gone) continue;  // drain until the cancellation lands
      message.set_request_id(request_id);
      if (!prompt_sent) {
        if (message.prompt_token_ids().empty()) {
          message.mutable_prompt_token_ids()->Assign(prepared.prompt_token_ids.begin(),
                                                     prepared.prompt_token_ids.end());
        }
        prompt_sent = true;
      }
      completion_tokens += message.token_ids_size();
      finished = finished || message.finished();
      if (message.finished()) finish_reason = message.finish_reason();
      if (!writer->Write(message)) {
        client_gone = true;
        downstream->TryCancel();
      } else if (message.token_ids_size() > 0) {
        // Tokens relayed to the client: the first ends the time to first token, the rest are
        // spaced by the inter-token latency.
        const auto now = std::chrono::steady_clock::now();
        metrics_->generation_tokens.Inc(message.token_ids_size());
        if (last_token_at == std::chrono::steady_clock::time_point{}) {
          metrics_->time_to_first_token_seconds.Observe(Seconds(now - call->arrival));
        } else {
          metrics_->inter_token_latency_seconds.Observe(Seconds(now - last_token_at));
        }
        last_token_at = now;
      }
    }
    status = reader->Finish();
  }
  if (finished && !client_gone) {
    if (std::optional<metrics::FinishedReason> reason = FinishedReasonOf(finish_reason)) {
      metrics_->request_success(*reason).Inc();
    }
    metrics_->request_generation_tokens.Observe(completion_tokens);
    metrics_->e2e_request_latency_seconds.Observe(Seconds(std::chrono::steady_clock::now() - call->arrival));
    return grpc::Status::OK;
  }
  if (client_gone) {
    AbortOnWorker(decode, request_id);
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
  }
  if (std::optional<grpc::Status> ended =
          EndedByClient(context, call, prepared, completion_tokens, prompt_sent, writer)) {
    AbortOnWorker(decode, request_id);
    return *ended;
  }
  if (status.ok()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat(decode->name(), " ended the stream before the request finished"));
  }
  if (IsWorkerFailure(status.error_code())) {
    registry_->ConfirmDown(decode, absl::StrCat("Decode stream failed: ", status.error_message()));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat(decode->name(), " failed: ", status.error_message()));
  }
  return grpc::Status(status.error_code(), absl::StrCat(decode->name(), ": ", status.error_message()));
}

grpc::Status RouterService::Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                                  v1::AbortResponse* response) {
  if (request->request_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request_id is required");
  }
  std::shared_ptr<ActiveCall> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = active_.find(request->request_id());
    if (it != active_.end()) call = it->second;
  }
  if (call != nullptr) call->Abort();
  response->set_found(call != nullptr);
  return grpc::Status::OK;
}

grpc::Status RouterService::GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) {
  response->set_model_name(options_.model_name);
  response->set_vocab_size(static_cast<int32_t>(options_.vocab_size));
  response->set_max_model_len(options_.max_model_len);
  response->set_num_prefill_workers(registry_->NumUp(WorkerRole::kPrefill));
  response->set_num_decode_workers(registry_->NumUp(WorkerRole::kDecode));
  return grpc::Status::OK;
}

}  // namespace duet::router
