// The OpenAI-compatible HTTP API of the router (served by router/http_server.h):
//   POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
//   GET /health, GET /metrics, GET /version, POST /tokenize, POST /detokenize.
// Every response carries X-Request-Id: the client's, or one made for it.
// Generation goes through the router's own duet.v1.Duet gRPC service over an in-process channel
// with the callback API, so no thread waits per request and the HTTP and gRPC paths are the
// same code. A client that disconnects cancels its calls (the router then aborts the request on
// its workers and their KV blocks are freed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "duet/v1/duet.grpc.pb.h"
#include "frontend/chat_template/chat_template.h"
#include "frontend/tokenizer/tokenizer.h"
#include "router/http_server.h"
#include "router/openai_protocol.h"
#include "router/work_pool.h"

namespace duet::router {

struct OpenAiApiOptions {
  std::string model_name;                  // in responses
  std::vector<std::string> model_aliases;  // also served (--served-model-name's other names)
  int64_t max_model_len = 0;
  // Non-empty: /v1/*, /tokenize and /detokenize need "Authorization: Bearer <key>" (sent on to
  // gRPC too); /health and /metrics as well when api_key_on_health_and_metrics.
  std::string api_key;
  bool api_key_on_health_and_metrics = false;
  std::function<std::string()> metrics_body;  // GET /metrics; none: 404
  std::string metrics_content_type = "text/plain; version=0.0.4; charset=utf-8";
  std::function<bool()> healthy;  // GET /health: 200 when true (no function: always 200)
  // tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser): the calls' format; unset:
  // "auto" is a 400.
  std::optional<openai::ToolCallFormat> auto_tool_call_format;
  // The pool that parses, tokenizes, templates and detokenizes (never the HTTP io threads), and
  // how many requests may wait for it before new ones get 503.
  int work_threads = 4;
  size_t max_queued_work = 1024;
};

class OpenAiApi {
 public:
  // `tokenizer` and `chat` outlive the API; `chat` may be null (chat completions then 400).
  OpenAiApi(OpenAiApiOptions options, const Tokenizer* tokenizer, const LoadedChatTemplate* chat,
            std::shared_ptr<grpc::Channel> channel);
  ~OpenAiApi();

  // The HttpHandler.
  void Handle(HttpRequest request, std::shared_ptr<HttpResponder> responder);

  int num_active_jobs() const { return active_jobs_.load(); }
  // Waits until no generation job is left: their gRPC calls have ended and their client contexts
  // (each holds a reference to the channel) are destroyed, so the channel can go.
  bool WaitIdle(std::chrono::milliseconds timeout);

  // For the generation jobs: from a job's construction to the end of its destruction.
  void JobCreated() { active_jobs_.fetch_add(1); }
  void JobDestroyed();
  const OpenAiApiOptions& options() const { return options_; }
  const Tokenizer* tokenizer() const { return tokenizer_; }
  v1::Duet::Stub* stub() { return stub_.get(); }
  // The pool the heavy work runs on (tests hold it busy).
  WorkPool* work_pool() { return work_.get(); }

 private:
  // `request_id`: the response's X-Request-Id, which names a completion without an id of its own.
  void Generate(bool chat, const HttpRequest& request, const std::string& request_id,
                const std::shared_ptr<HttpResponder>& responder);
  std::vector<std::string> ModelNames() const;  // model_name, then the aliases
  openai::Json ModelCard(const std::string& name) const;  // an entry of /v1/models
  // Runs `work` on the pool (counted as a job for WaitIdle; skipped when the client has left by
  // then); 503 when the pool's queue is full.
  void Offload(const std::shared_ptr<HttpResponder>& responder, std::function<void()> work);

  const OpenAiApiOptions options_;
  const int64_t started_at_;  // Unix seconds: the model cards' `created`
  const Tokenizer* const tokenizer_;
  const LoadedChatTemplate* const chat_;
  openai::ProtocolContext context_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Duet::Stub> stub_;
  std::atomic<int> active_jobs_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  // Last: its threads are joined before the members their tasks use go.
  std::unique_ptr<WorkPool> work_;
};

}  // namespace duet::router
