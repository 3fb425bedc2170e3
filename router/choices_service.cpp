#include "router/choices_service.h"

#include <deque>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/client_callback.h"
#include "router/grpc_chat.h"
#include "router/request_id.h"
#include "router/rejected_stream.h"
#include "router/request_limits.h"

namespace duet::router {

// One Generate with n > 1: the client's stream and the n calls behind it. Each completion's next
// message is read once its previous one is taken for writing, so at most n messages wait here.
// Calls into gRPC (writes, reads, cancellations, Abort) are made outside mu_: a cancellation
// may run the cancelled call's callbacks on the cancelling thread.
class ChoicesDuetService::ChoicesCall final : public grpc::ServerWriteReactor<v1::GenerateResponse>,
                                              public std::enable_shared_from_this<ChoicesCall> {
 public:
  ChoicesCall(ChoicesDuetService* service, grpc::CallbackServerContext* context, v1::Duet::Stub* stub)
      : live_(service), service_(service), context_(context), stub_(stub) {}

  // Validates and registers the request and starts its completions, or finishes with why not.
  void Start(const v1::GenerateRequest& request);
  // Aborts every completion still running.
  void Abort();

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override {
    auto last_reference = std::move(self_);  // may destroy this at the end of the scope
  }

 private:
  class Choice;

  // Counts the call as alive for ~ChoicesDuetService (declared first: destroyed last).
  class Live {
   public:
    explicit Live(ChoicesDuetService* service) : service_(service) {
      absl::MutexLock lock(&service_->mu_);
      ++service_->live_calls_;
    }
    ~Live() {
      absl::MutexLock lock(&service_->mu_);
      --service_->live_calls_;
    }

   private:
    ChoicesDuetService* const service_;
  };

  // A message for the client; `from_stream`: its completion reads on once it is taken.
  struct Pending {
    int index = 0;
    v1::GenerateResponse message;
    bool from_stream = true;
  };
  // What to do once mu_ is released.
  struct Actions {
    bool write = false;  // out_
    std::vector<std::shared_ptr<Choice>> read_next;
    std::vector<std::shared_ptr<Choice>> cancel;
    bool finish = false;
  };

  // From the completions' callbacks.
  void OnMessage(int index, v1::GenerateResponse* message);
  void OnChoiceDone(int index, const grpc::Status& status);
  void OnAbortAnswered(int index, const grpc::Status& status, bool found);

  // The next write, if one can start now, or the end of the call once everything has ended.
  void TakeNextLocked(Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CancelAllLocked(Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(Actions actions) ABSL_LOCKS_EXCLUDED(mu_);
  // The closing message of completion `index`, stopped here by Abort.
  Pending AbortMessage(int index, const Choice& choice) const;

  Live live_;
  ChoicesDuetService* const service_;
  grpc::CallbackServerContext* const context_;
  v1::Duet::Stub* const stub_;
  std::shared_ptr<ChoicesCall> self_;  // the server call's reference, dropped in OnDone
  std::string client_request_id_;
  std::pair<std::string, std::string> active_key_;
  bool registered_ = false;
  std::vector<std::string> authorization_;  // the client's, sent on with each completion and Abort

  absl::Mutex mu_;
  std::vector<std::shared_ptr<Choice>> choices_ ABSL_GUARDED_BY(mu_);  // null once ended
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);
  v1::GenerateResponse out_;  // the message being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::Status error_ ABSL_GUARDED_BY(mu_);
};

// One completion's call to the service. Reads are started from the client stream's callbacks,
// outside this reactor's own reactions, hence the hold (released when a read fails: the end).
class ChoicesDuetService::ChoicesCall::Choice final : public grpc::ClientReadReactor<v1::GenerateResponse>,
                                                      public std::enable_shared_from_this<Choice> {
 public:
  Choice(std::shared_ptr<ChoicesCall> call, int index, std::unique_ptr<grpc::ClientContext> context,
         v1::GenerateRequest request)
      : call_(std::move(call)), index_(index), context_(std::move(context)), request_(std::move(request)) {}

  void Start(v1::Duet::Stub* stub) {
    self_ = shared_from_this();
    stub->async()->Generate(context_.get(), &request_, this);
    StartRead(&message_);
    AddHold();
    StartCall();
  }
  void ReadNext() { StartRead(&message_); }
  void Cancel() { context_->TryCancel(); }
  const std::string& request_id() const { return request_.request_id(); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RemoveHold();  // the stream ended; OnDone brings its status
      return;
    }
    call_->OnMessage(index_, &message_);
  }
  void OnDone(const grpc::Status& status) override {
    call_->OnChoiceDone(index_, status);
    auto last_reference = std::move(self_);
  }

  // The completion's progress (under the call's mu_).
  bool finished = false;
  bool aborted = false;  // Abort found no request of this id in flight and cancelled the call
  int prompt_tokens = 0;
  int completion_tokens = 0;

 private:
  const std::shared_ptr<ChoicesCall> call_;
  const int index_;
  const std::unique_ptr<grpc::ClientContext> context_;
  const v1::GenerateRequest request_;
  v1::GenerateResponse message_;
  std::shared_ptr<Choice> self_;  // until OnDone
};

void ChoicesDuetService::ChoicesCall::Start(const v1::GenerateRequest& request) {
  self_ = shared_from_this();
  if (request.n() > kMaxCompletionsPerRequest) {
    return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("n must be between 1 and ", kMaxCompletionsPerRequest, ", got ", request.n())));
  }
  if (absl::Status status = CheckRequestIdLength(request.request_id()); !status.ok()) {
    return Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(status.message())));
  }
  client_request_id_ = request.request_id().empty() ? absl::StrCat("cmpl-", RandomHex(16)) : request.request_id();
  active_key_ = {ClientOf(*context_), client_request_id_};
  {
    absl::MutexLock lock(&service_->mu_);
    registered_ = service_->active_.try_emplace(active_key_, shared_from_this()).second;
  }
  if (!registered_) {
    return Finish(grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                               absl::StrCat("request_id \"", client_request_id_,
                                            "\" is already in flight (from this client)")));
  }
  // The id goes out at once (a client may Abort before the first token).
  if (IsPrintableAscii(client_request_id_)) context_->AddInitialMetadata("x-request-id", client_request_id_);
  StartSendInitialMetadata();
  auto range = context_->client_metadata().equal_range("authorization");
  for (auto it = range.first; it != range.second; ++it) authorization_.emplace_back(it->second.data(), it->second.size());

  // The completions' own ids: random, so they never meet another client's (all come through the
  // one in-process channel).
  const std::string call_id = absl::StrCat("cmpl-", RandomHex(16));
  std::vector<std::shared_ptr<Choice>> choices;
  for (int i = 0; i < request.n(); ++i) {
    v1::GenerateRequest one = request;
    one.set_request_id(absl::StrCat(call_id, "-", i));
    one.clear_n();
    if (one.sampling().has_seed()) one.mutable_sampling()->set_seed(request.sampling().seed() + uint64_t(i));
    std::unique_ptr<grpc::ClientContext> context = grpc::ClientContext::FromCallbackServerContext(*context_);
    for (const std::string& credential : authorization_) context->AddMetadata("authorization", credential);
    // The request's n for the metrics, counted once (router_service.cpp's RecordParams).
    context->AddMetadata("duet-choice", absl::StrCat(i, "/", request.n()));
    choices.push_back(std::make_shared<Choice>(shared_from_this(), i, std::move(context), std::move(one)));
  }
  {
    absl::MutexLock lock(&mu_);
    choices_ = choices;
    remaining_ = request.n();
  }
  for (const std::shared_ptr<Choice>& choice : choices) choice->Start(stub_);
}

void ChoicesDuetService::ChoicesCall::OnMessage(int index, v1::GenerateResponse* message) {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    const std::shared_ptr<Choice>& choice = choices_[size_t(index)];
    if (message->prompt_token_ids_size() > 0) choice->prompt_tokens = message->prompt_token_ids_size();
    choice->completion_tokens += message->token_ids_size();
    if (message->finished()) choice->finished = true;
    if (client_gone_) {
      actions.read_next.push_back(choice);  // nobody to write to: on to the stream's end
    } else {
      message->set_request_id(client_request_id_);
      message->set_index(index);
      pending_.push_back({index, std::move(*message), true});
      TakeNextLocked(&actions);
    }
  }
  Run(std::move(actions));
}

ChoicesDuetService::ChoicesCall::Pending ChoicesDuetService::ChoicesCall::AbortMessage(int index,
                                                                                     const Choice& choice) const {
  Pending abort{index, {}, false};
  v1::GenerateResponse& m = abort.message;
  m.set_request_id(client_request_id_);
  m.set_index(index);
  m.set_finished(true);
  m.set_finish_reason("abort");
  m.set_finish_reason_code(FinishReasonCode("abort"));
  m.mutable_usage()->set_prompt_tokens(choice.prompt_tokens);
  m.mutable_usage()->set_completion_tokens(choice.completion_tokens);
  return abort;
}

void ChoicesDuetService::ChoicesCall::OnChoiceDone(int index, const grpc::Status& status) {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    const std::shared_ptr<Choice> choice = std::move(choices_[size_t(index)]);
    --remaining_;
    if (choice->aborted && !choice->finished) {
      if (!client_gone_) pending_.push_back(AbortMessage(index, *choice));
    } else if (error_.ok()) {
      if (!status.ok()) {
        error_ = status;
      } else if (!choice->finished) {
        error_ = grpc::Status(grpc::StatusCode::INTERNAL,
                              absl::StrCat("completion ", index, " ended without a finish reason"));
      }
      if (!error_.ok()) CancelAllLocked(&actions);  // the others are of no use now
    }
    TakeNextLocked(&actions);
  }
  Run(std::move(actions));
}

void ChoicesDuetService::ChoicesCall::OnWriteDone(bool ok) {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && !client_gone_) {
      client_gone_ = true;
      CancelAllLocked(&actions);
    }
    TakeNextLocked(&actions);
  }
  Run(std::move(actions));
}

void ChoicesDuetService::ChoicesCall::OnCancel() {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    CancelAllLocked(&actions);
  }
  Run(std::move(actions));
}

void ChoicesDuetService::ChoicesCall::CancelAllLocked(Actions* actions) {
  for (const std::shared_ptr<Choice>& c : choices_) {
    if (c != nullptr) actions->cancel.push_back(c);
  }
}

void ChoicesDuetService::ChoicesCall::TakeNextLocked(Actions* actions) {
  if (writing_ || finished_) return;
  if (client_gone_) {
    // What waits to be written never will be: its completions read on to their ends.
    for (const Pending& p : pending_) {
      if (p.from_stream && choices_[size_t(p.index)] != nullptr) actions->read_next.push_back(choices_[size_t(p.index)]);
    }
    pending_.clear();
  } else if (!pending_.empty()) {
    Pending& next = pending_.front();
    out_ = std::move(next.message);
    if (next.from_stream) actions->read_next.push_back(choices_[size_t(next.index)]);
    pending_.pop_front();
    writing_ = true;
    actions->write = true;
    return;
  }
  if (remaining_ == 0) {
    finished_ = true;
    actions->finish = true;
  }
}

void ChoicesDuetService::ChoicesCall::Run(Actions actions) {
  if (actions.write) StartWrite(&out_);
  // A completion waiting for its read is held open (its hold): it has not ended.
  for (const std::shared_ptr<Choice>& c : actions.read_next) c->ReadNext();
  for (const std::shared_ptr<Choice>& c : actions.cancel) c->Cancel();
  if (actions.finish) {
    if (registered_) {
      absl::MutexLock lock(&service_->mu_);
      service_->active_.erase(active_key_);
    }
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      status = error_;
    }
    Finish(status);
  }
}

void ChoicesDuetService::ChoicesCall::Abort() {
  std::vector<std::pair<int, std::string>> running;  // index, request id
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < choices_.size(); ++i) {
      if (choices_[i] != nullptr && !choices_[i]->finished) running.emplace_back(int(i), choices_[i]->request_id());
    }
  }
  struct Call {
    grpc::ClientContext context;
    v1::AbortRequest request;
    v1::AbortResponse response;
  };
  for (const auto& [index, request_id] : running) {
    auto call = std::make_shared<Call>();
    for (const std::string& credential : authorization_) call->context.AddMetadata("authorization", credential);
    call->request.set_request_id(request_id);
    // Holds this call until the answer; the context goes first (it holds the channel).
    stub_->async()->Abort(&call->context, &call->request, &call->response,
                          [call, self = shared_from_this(), index = index](grpc::Status status) mutable {
                            const bool found = call->response.found();
                            call.reset();
                            self->OnAbortAnswered(index, status, found);
                          });
  }
}

void ChoicesDuetService::ChoicesCall::OnAbortAnswered(int index, const grpc::Status& status, bool found) {
  if (status.ok() && found) return;  // it ends with its own "abort" message
  // Not (yet) in flight at the service: stopped here instead.
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    const std::shared_ptr<Choice>& choice = choices_[size_t(index)];
    if (choice == nullptr || choice->finished) return;
    choice->aborted = true;
    actions.cancel.push_back(choice);
  }
  Run(std::move(actions));
}

ChoicesDuetService::~ChoicesDuetService() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* live_calls) { return *live_calls == 0; }, &live_calls_));
}

void ChoicesDuetService::SetChannel(std::shared_ptr<grpc::Channel> channel) {
  absl::MutexLock lock(&mu_);
  stub_ = v1::Duet::NewStub(std::move(channel));
}

grpc::ServerWriteReactor<v1::GenerateResponse>* ChoicesDuetService::Generate(grpc::CallbackServerContext* context,
                                                                              const v1::GenerateRequest* request) {
  if (request->n() <= 1) return inner_->Generate(context, request);
  v1::Duet::Stub* stub = nullptr;
  {
    absl::MutexLock lock(&mu_);
    stub = stub_.get();
  }
  if (stub == nullptr) return new RejectedStream(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the router is starting"));
  auto call = std::make_shared<ChoicesCall>(this, context, stub);
  call->Start(*request);  // the call holds itself until OnDone
  return call.get();
}

grpc::ServerUnaryReactor* ChoicesDuetService::Abort(grpc::CallbackServerContext* context,
                                                    const v1::AbortRequest* request, v1::AbortResponse* response) {
  std::shared_ptr<ChoicesCall> call;
  {
    absl::MutexLock lock(&mu_);
    auto it = active_.find(std::make_pair(ClientOf(*context), request->request_id()));
    if (it != active_.end()) call = it->second;
  }
  if (call == nullptr) return inner_->Abort(context, request, response);
  call->Abort();
  response->set_found(true);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace duet::router
