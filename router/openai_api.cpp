#include "router/openai_api.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/client_callback.h"
#include "router/request_id.h"
#include "router/request_limits.h"
#include "rpc/internal_auth.h"

namespace duet::router {
namespace {

using openai::ApiError;
using openai::Json;

constexpr char kJson[] = "application/json";

void SendError(HttpResponder& responder, const ApiError& error) {
  // Overloaded (429) or not serving (503): when to try again.
  std::vector<std::pair<std::string, std::string>> headers;
  if (error.status == 429 || error.status == 503) headers.emplace_back("Retry-After", "1");
  responder.Respond(error.status, kJson, openai::ErrorBody(error), std::move(headers));
}

void SendError(HttpResponder& responder, const absl::Status& error) { SendError(responder, openai::ToApiError(error)); }

// The X-Request-Id a response carries: `id` when it can go out as it is, else a new one.
std::string EchoableRequestId(const std::string& id) {
  return !id.empty() && id.size() <= kMaxRequestIdBytes && IsPrintableAscii(id) ? id : RandomHex(16);
}

void SendJson(HttpResponder& responder, const Json& json) {
  responder.Respond(200, kJson, json.dump(-1, ' ', false, Json::error_handler_t::replace));
}

// One completion or chat request: its choices' gRPC calls and the response they make.
class Job : public std::enable_shared_from_this<Job> {
 public:
  Job(OpenAiApi* api, openai::ParsedRequest request, std::shared_ptr<HttpResponder> responder)
      : live_(api),
        api_(api),
        request_(std::move(request)),
        responder_(std::move(responder)),
        id_(request_.request_id ? absl::StrCat(request_.chat ? "chatcmpl-" : "cmpl-", *request_.request_id)
                                : openai::NewId(request_.chat ? "chatcmpl-" : "cmpl-")),
        call_id_(openai::NewId("cmpl-")) {}

  void Start();
  void OnMessage(int index, const v1::GenerateResponse& message);
  void OnDone(int index, const grpc::Status& status);
  // The client left: cancel every call.
  void Cancel() {
    std::vector<grpc::ClientContext*> contexts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      client_gone_ = true;
      for (auto& c : contexts_) contexts.push_back(c.get());
    }
    for (grpc::ClientContext* c : contexts) c->TryCancel();
  }

 private:
  struct Choice {
    openai::ChoiceResult result;
    std::unique_ptr<openai::ToolCallParser> tool_calls;  // streaming chat that parses tool calls
    bool role_sent = false;
    bool echo_sent = false;
    size_t text_offset = 0;  // completions logprobs
  };
  void Finish();  // under mu_
  void StartStreamLocked() {
    if (stream_started_) return;
    stream_started_ = true;
    responder_->StartStream(200, "text/event-stream; charset=utf-8");
  }

  // Counts the job as alive for OpenAiApi::WaitIdle (declared first: destroyed last, after the
  // client contexts). The last job may end on a gRPC callback thread; if a context there held the
  // channel's last reference, the channel's release would join that very thread.
  class Live {
   public:
    explicit Live(OpenAiApi* api) : api_(api) { api_->JobCreated(); }
    ~Live() { api_->JobDestroyed(); }

   private:
    OpenAiApi* const api_;
  };
  Live live_;
  OpenAiApi* const api_;
  const openai::ParsedRequest request_;
  const std::shared_ptr<HttpResponder> responder_;
  const std::string id_;       // the response's
  // Its choices' gRPC request ids are "<call_id_>-<index>": random, so HTTP clients' ids (all
  // sent through the one in-process channel) never collide.
  const std::string call_id_;
  std::mutex mu_;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<Choice> choices_;
  std::vector<std::string> echo_prefix_;
  int remaining_ = 0;
  bool stream_started_ = false;
  bool client_gone_ = false;
  std::optional<ApiError> error_;
};

class GenerateReactor final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateReactor(std::shared_ptr<Job> job, int index, v1::GenerateRequest request)
      : job_(std::move(job)), index_(index), request_(std::move(request)) {}

  void Start(v1::Duet::Stub* stub, grpc::ClientContext* context) {
    stub->async()->Generate(context, &request_, this);
    StartRead(&response_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    job_->OnMessage(index_, response_);
    response_.Clear();
    StartRead(&response_);
  }
  void OnDone(const grpc::Status& status) override {
    job_->OnDone(index_, status);
    delete this;
  }

 private:
  std::shared_ptr<Job> job_;
  const int index_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
};

void Job::Start() {
  const int num_prompts = static_cast<int>(request_.prompts.size());
  std::vector<v1::GenerateRequest> generates;
  for (int p = 0; p < num_prompts; ++p) {
    const openai::PromptInput& prompt = request_.prompts[p];
    if (request_.echo) {
      echo_prefix_.push_back(prompt.is_text
                                 ? prompt.text
                                 : (api_->tokenizer() != nullptr
                                        ? api_->tokenizer()->Decode(prompt.token_ids, /*skip_special_tokens=*/false)
                                        : std::string()));
    }
    for (int i = 0; i < request_.n; ++i) {
      const int index = p * request_.n + i;
      v1::GenerateRequest& generate = generates.emplace_back();
      generate.set_request_id(absl::StrCat(call_id_, "-", index));
      if (prompt.is_text) {
        generate.set_text(prompt.text);
      } else {
        generate.mutable_token_ids()->mutable_ids()->Assign(prompt.token_ids.begin(), prompt.token_ids.end());
      }
      *generate.mutable_sampling() = request_.sampling;
      if (request_.seed) generate.mutable_sampling()->set_seed(*request_.seed + static_cast<uint64_t>(i));
      if (generate.ByteSizeLong() > kMaxGenerateRequestBytes) {
        ApiError e;
        e.status = 413;
        e.message = absl::StrCat("the prompt is too large: its request is ", generate.ByteSizeLong(),
                                 " bytes, more than ", kMaxGenerateRequestBytes);
        e.param = "prompt";
        e.code = "request_too_large";
        return SendError(*responder_, e);
      }
    }
  }
  std::vector<std::pair<GenerateReactor*, grpc::ClientContext*>> calls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    choices_.resize(generates.size());
    remaining_ = static_cast<int>(generates.size());
    for (size_t index = 0; index < generates.size(); ++index) {
      choices_[index].result.index = static_cast<int>(index);
      if (request_.stream) choices_[index].tool_calls = openai::NewToolCallParser(request_.tools);
      auto context = std::make_unique<grpc::ClientContext>();
      if (!api_->options().api_key.empty()) {
        context->AddMetadata("authorization", absl::StrCat("Bearer ", api_->options().api_key));
      }
      // The choice within its prompt's n: the metrics count n once per prompt.
      context->AddMetadata("duet-choice", absl::StrCat(index % size_t(request_.n), "/", request_.n));
      auto* reactor = new GenerateReactor(shared_from_this(), static_cast<int>(index), std::move(generates[index]));
      calls.emplace_back(reactor, context.get());
      contexts_.push_back(std::move(context));
    }
  }
  std::weak_ptr<Job> weak = weak_from_this();
  responder_->SetCancelHandler([weak] {
    if (auto job = weak.lock()) job->Cancel();
  });
  for (auto& [reactor, context] : calls) reactor->Start(api_->stub(), context);
}

void Job::OnMessage(int index, const v1::GenerateResponse& message) {
  std::lock_guard<std::mutex> lock(mu_);
  Choice& choice = choices_[index];
  openai::ChoiceResult& r = choice.result;
  if (message.prompt_token_ids_size() > 0) r.prompt_tokens = message.prompt_token_ids_size();
  if (request_.sampling.has_prompt_logprobs() && message.prompt_token_ids_size() > 0) {
    r.prompt_token_ids.assign(message.prompt_token_ids().begin(), message.prompt_token_ids().end());
    r.prompt_logprobs.assign(message.prompt_logprobs().begin(), message.prompt_logprobs().end());
  }
  if (message.has_usage()) {
    if (message.usage().prompt_tokens() > 0) r.prompt_tokens = message.usage().prompt_tokens();
  }
  const size_t first_new = r.token_ids.size();
  r.token_ids.insert(r.token_ids.end(), message.token_ids().begin(), message.token_ids().end());
  for (const v1::TokenLogprobs& lp : message.logprobs()) r.logprobs.push_back(lp);
  std::string text = message.text();
  if (message.finished()) {
    r.finish_reason = message.finish_reason();
    if (r.finish_reason == "stop") {
      r.stop_reason = openai::StopReason(request_.sampling, api_->tokenizer(), r.token_ids);
      if (request_.include_stop_str_in_output && r.stop_reason.is_string()) text += r.stop_reason.get<std::string>();
    }
  }
  r.text += text;
  r.completion_tokens = static_cast<int>(r.token_ids.size());
  if (message.has_usage() && message.usage().completion_tokens() > 0) {
    r.completion_tokens = message.usage().completion_tokens();
  }
  if (!request_.stream || client_gone_) return;

  StartStreamLocked();
  const std::optional<std::string> finish =
      message.finished() ? std::optional<std::string>(message.finish_reason()) : std::nullopt;
  const std::vector<int32_t> new_ids(r.token_ids.begin() + first_new, r.token_ids.end());
  std::vector<v1::TokenLogprobs> new_logprobs;
  if (request_.logprobs && r.logprobs.size() >= r.token_ids.size()) {
    new_logprobs.assign(r.logprobs.begin() + first_new, r.logprobs.begin() + r.token_ids.size());
  }
  std::string out;
  if (request_.chat) {
    if (!choice.role_sent) {
      choice.role_sent = true;
      openai::ChunkChoice role;
      role.index = index;
      role.role = true;
      role.content = "";
      out += openai::SseEvent(openai::ChatChunk(id_, request_, role));
    }
    openai::ChunkChoice chunk;
    chunk.index = index;
    chunk.finish_reason = finish;
    if (choice.tool_calls != nullptr) {
      openai::OutputDelta delta;
      choice.tool_calls->Push(text, &delta);
      if (finish) {
        choice.tool_calls->Finish(&delta);
        chunk.finish_reason = openai::ChatFinishReason(*finish, choice.tool_calls->num_calls());
      }
      if (!delta.content.empty()) chunk.content = std::move(delta.content);
      chunk.tool_calls = std::move(delta.calls);
      // Tokens whose text is held back still bring their logprobs.
      if (!chunk.content && chunk.tool_calls.empty() && !finish && request_.logprobs && !new_ids.empty()) {
        chunk.content = "";
      }
    } else if (!text.empty() || (!finish && !new_ids.empty())) {
      chunk.content = text;
    }
    if (finish) chunk.stop_reason = r.stop_reason;
    if (chunk.content || !chunk.tool_calls.empty() || finish) {
      chunk.logprobs = request_.logprobs
                           ? openai::ChatLogprobs(api_->tokenizer(), new_ids, new_logprobs, *request_.logprobs)
                           : Json(nullptr);
      out += openai::SseEvent(openai::ChatChunk(id_, request_, chunk));
    }
  } else {
    std::string piece;
    std::vector<int32_t> ids = new_ids;
    size_t num_unscored = 0;
    if (request_.echo && !choice.echo_sent) {
      choice.echo_sent = true;
      const size_t p = static_cast<size_t>(index / request_.n);
      if (p < echo_prefix_.size()) piece = echo_prefix_[p];
      choice.text_offset = piece.size();
      if (request_.logprobs) {
        // The echoed prompt's tokens lead this chunk's logprobs, offsets counted from the first.
        ids.insert(ids.begin(), r.prompt_token_ids.begin(), r.prompt_token_ids.end());
        new_logprobs.insert(new_logprobs.begin(), r.prompt_logprobs.begin(), r.prompt_logprobs.end());
        num_unscored = r.prompt_token_ids.empty() ? 0 : 1;
        choice.text_offset = 0;
      }
    }
    piece += text;
    if (!piece.empty() || finish || !ids.empty()) {
      openai::ChunkChoice chunk;
      chunk.index = index;
      chunk.content = std::move(piece);
      if (finish) chunk.stop_reason = r.stop_reason;
      chunk.logprobs = request_.logprobs ? openai::CompletionLogprobs(api_->tokenizer(), ids, new_logprobs,
                                                                      &choice.text_offset, num_unscored)
                                         : Json(nullptr);
      chunk.finish_reason = finish;
      out += openai::SseEvent(openai::CompletionChunk(id_, request_, chunk));
    }
  }
  responder_->Write(std::move(out));
}

void Job::OnDone(int index, const grpc::Status& status) {
  std::vector<grpc::ClientContext*> to_cancel;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && !error_) {
      error_ = openai::FromGrpc(status);
      // One choice failed: the others are not needed.
      for (auto& c : contexts_) to_cancel.push_back(c.get());
    } else if (status.ok() && choices_[index].result.finish_reason.empty() && !error_) {
      error_ = openai::ToApiError(absl::InternalError("the generation stream ended without a finish reason"));
    }
    if (--remaining_ == 0) Finish();
  }
  for (grpc::ClientContext* c : to_cancel) c->TryCancel();
}

void Job::Finish() {
  if (client_gone_) return;
  if (error_) {
    if (stream_started_) {
      Json error;
      error["error"] = Json::parse(openai::ErrorBody(*error_))["error"];
      responder_->Write(openai::SseEvent(error) + openai::kSseDone);
      responder_->End();
    } else {
      SendError(*responder_, *error_);
    }
    return;
  }
  std::vector<openai::ChoiceResult> results;
  results.reserve(choices_.size());
  for (const Choice& c : choices_) results.push_back(c.result);
  if (request_.stream) {
    StartStreamLocked();
    std::string out;
    if (request_.include_usage) {
      int prompt = 0, completion = 0;
      for (const openai::ChoiceResult& r : results) {
        if (r.index % request_.n == 0) prompt += r.prompt_tokens;
        completion += r.completion_tokens;
      }
      out += openai::SseEvent(openai::UsageChunk(id_, request_, prompt, completion));
    }
    out += openai::kSseDone;
    responder_->Write(std::move(out));
    responder_->End();
    return;
  }
  const Json response = request_.chat ? openai::ChatResponse(id_, request_, api_->tokenizer(), results)
                                      : openai::CompletionResponse(id_, request_, api_->tokenizer(), results,
                                                                   echo_prefix_);
  SendJson(*responder_, response);
}

}  // namespace

OpenAiApi::OpenAiApi(OpenAiApiOptions options, const Tokenizer* tokenizer, const LoadedChatTemplate* chat,
                     std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      started_at_(openai::UnixSecondsNow()),
      tokenizer_(tokenizer),
      chat_(chat),
      channel_(std::move(channel)) {
  context_.model_name = options_.model_name;
  context_.tokenizer = tokenizer_;
  context_.chat = chat_;
  context_.max_model_len = options_.max_model_len;
  context_.auto_tool_call_format = options_.auto_tool_call_format;
  context_.model_aliases = options_.model_aliases;
  stub_ = v1::Duet::NewStub(channel_);
  work_ = std::make_unique<WorkPool>(options_.work_threads, options_.max_queued_work);
}

OpenAiApi::~OpenAiApi() {
  WaitIdle(std::chrono::seconds(5));
  work_->Stop();
}

void OpenAiApi::Offload(const std::shared_ptr<HttpResponder>& responder, std::function<void()> work) {
  JobCreated();
  const bool queued = work_->TrySubmit([this, responder, work = std::move(work)] {
    if (!responder->cancelled()) work();
    JobDestroyed();
  });
  if (!queued) {
    JobDestroyed();
    SendError(*responder, absl::UnavailableError("the server is busy: too many requests wait to be parsed"));
  }
}

void OpenAiApi::JobDestroyed() {
  // Under the lock: WaitIdle cannot see zero (and the API be destroyed) before this has notified.
  std::lock_guard<std::mutex> lock(idle_mu_);
  if (active_jobs_.fetch_sub(1) == 1) idle_cv_.notify_all();
}

bool OpenAiApi::WaitIdle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_cv_.wait_for(lock, timeout, [this] { return active_jobs_.load() == 0; });
}

std::vector<std::string> OpenAiApi::ModelNames() const {
  std::vector<std::string> names = {options_.model_name};
  names.insert(names.end(), options_.model_aliases.begin(), options_.model_aliases.end());
  return names;
}

Json OpenAiApi::ModelCard(const std::string& name) const {
  Json model;
  model["id"] = name;
  model["object"] = "model";
  model["created"] = started_at_;
  model["owned_by"] = "duet";
  model["root"] = options_.model_name;
  model["parent"] = nullptr;
  model["max_model_len"] = options_.max_model_len;
  return model;
}

void OpenAiApi::Handle(HttpRequest request, std::shared_ptr<HttpResponder> responder) {
  const std::string& path = request.path;
  const std::string& method = request.method;
  // X-Request-Id on every response: the client's (when it can be echoed as it is), else a new one,
  // which also names a completion that has no id of its own.
  const std::string request_id = EchoableRequestId(request.Header("x-request-id"));
  responder->AddHeader("X-Request-Id", request_id);
  auto method_not_allowed = [&] {
    ApiError e;
    e.status = 405;
    e.message = absl::StrCat("method ", method, " is not allowed on ", path);
    SendError(*responder, e);
  };
  // With --api-key: /v1/*, /tokenize and /detokenize need it; /health and /metrics only when
  // configured (public by default, as in vLLM, for load balancers and Prometheus).
  const bool needs_key = absl::StartsWith(path, "/v1/") || path == "/tokenize" || path == "/detokenize" ||
                         (options_.api_key_on_health_and_metrics && (path == "/health" || path == "/metrics"));
  if (needs_key && !options_.api_key.empty()) {
    if (!rpc::ConstantTimeEquals(request.Header("authorization"), absl::StrCat("Bearer ", options_.api_key))) {
      ApiError e;
      e.status = 401;
      e.message = "Incorrect API key provided. Send it as \"Authorization: Bearer <key>\".";
      e.code = "invalid_api_key";
      SendError(*responder, e);
      return;
    }
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (method != "POST") return method_not_allowed();
    const bool chat = path == "/v1/chat/completions";
    Offload(responder, [this, chat, request = std::move(request), responder, request_id] {
      Generate(chat, request, request_id, responder);
    });
    return;
  }
  if (path == "/v1/models") {
    if (method != "GET") return method_not_allowed();
    Json data = Json::array();
    for (const std::string& name : ModelNames()) data.push_back(ModelCard(name));
    Json list;
    list["object"] = "list";
    list["data"] = std::move(data);
    SendJson(*responder, list);
    return;
  }
  if (path.rfind("/v1/models/", 0) == 0) {
    if (method != "GET") return method_not_allowed();
    const std::string name = path.substr(std::string("/v1/models/").size());
    const std::vector<std::string> names = ModelNames();
    if (std::find(names.begin(), names.end(), name) == names.end()) {
      SendError(*responder, openai::NotFound(absl::StrCat("The model `", name, "` does not exist."), "model_not_found"));
      return;
    }
    SendJson(*responder, ModelCard(name));
    return;
  }
  if (path == "/version") {
    if (method != "GET") return method_not_allowed();
    Json version;
    version["version"] = DuetVersion();
    SendJson(*responder, version);
    return;
  }
  if (path == "/health") {
    if (method != "GET" && method != "HEAD") return method_not_allowed();
    if (!options_.healthy || options_.healthy()) {
      responder->Respond(200, kJson, "{}");
    } else {
      SendError(*responder, absl::UnavailableError("no prefill or no decode worker is up"));
    }
    return;
  }
  if (path == "/metrics" && options_.metrics_body) {
    if (method != "GET") return method_not_allowed();
    responder->Respond(200, options_.metrics_content_type, options_.metrics_body());
    return;
  }
  if (path == "/tokenize" || path == "/detokenize") {
    if (method != "POST") return method_not_allowed();
    Offload(responder, [this, request = std::move(request), responder] {
      absl::StatusOr<Json> result = request.path == "/tokenize" ? openai::Tokenize(request.body, context_)
                                                                : openai::Detokenize(request.body, context_);
      if (result.ok()) {
        SendJson(*responder, *result);
      } else {
        SendError(*responder, result.status());
      }
    });
    return;
  }
  SendError(*responder, openai::NotFound(absl::StrCat("Not found: ", method, " ", path)));
}

void OpenAiApi::Generate(bool chat, const HttpRequest& request, const std::string& request_id,
                         const std::shared_ptr<HttpResponder>& responder) {
  absl::StatusOr<openai::ParsedRequest> parsed = chat ? openai::ParseChatRequest(request.body, context_)
                                                     : openai::ParseCompletionRequest(request.body, context_);
  if (!parsed.ok()) {
    SendError(*responder, parsed.status());
    return;
  }
  // X-Request-Id names the response, ahead of a request_id in the body (as in vLLM).
  if (const std::string header = request.Header("x-request-id"); !header.empty()) {
    if (absl::Status status = CheckRequestIdLength(header, "X-Request-Id"); !status.ok()) {
      SendError(*responder, openai::BadRequest(status.message(), "request_id"));
      return;
    }
    parsed->request_id = header;
  } else if (!parsed->request_id) {
    parsed->request_id = request_id;
  }
  auto job = std::make_shared<Job>(this, *std::move(parsed), responder);
  job->Start();
}

}  // namespace duet::router
