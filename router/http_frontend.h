// The router's HTTP front end: the OpenAI-compatible API (router/openai_api.h) on an HTTP server
// (router/http_server.h), calling the router's gRPC service through an in-process channel.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "frontend/chat_template/chat_template.h"
#include "frontend/tokenizer/tokenizer.h"
#include "grpcpp/channel.h"
#include "router/http_server.h"
#include "router/openai_api.h"

namespace duet::router {

struct HttpFrontendOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  int num_threads = 2;   // io threads
  int work_threads = 4;  // parsing, tokenization, templating (OpenAiApiOptions::work_threads)
  // Chat completions render with it (outlives the front end); null: they answer 400.
  const LoadedChatTemplate* chat_template = nullptr;
  std::string model_name;
  std::vector<std::string> model_aliases;  // OpenAiApiOptions'
  int64_t max_model_len = 0;
  std::string api_key;
  bool api_key_on_health_and_metrics = false;  // OpenAiApiOptions'
  std::function<std::string()> metrics_body;  // none: /metrics is 404
  std::function<bool()> healthy;
  std::optional<openai::ToolCallFormat> auto_tool_call_format;  // OpenAiApiOptions'
  // Each response once it ended (its last byte queued, or the client gone after its head): the
  // request's path and method, the status and the seconds since the request arrived. Also the
  // server's own answers to requests it cannot read (400, 413, 431; path and method empty when
  // the header was not read).
  std::function<void(const std::string& path, const std::string& method, int status, double seconds)> on_response;
  std::optional<rpc::TlsMaterial> tls;  // HttpServerOptions'
};

class HttpFrontend {
 public:
  // `tokenizer` outlives the front end; `channel` reaches the router's duet.v1.Duet service.
  static absl::StatusOr<std::unique_ptr<HttpFrontend>> Start(const HttpFrontendOptions& options,
                                                             const Tokenizer* tokenizer,
                                                             std::shared_ptr<grpc::Channel> channel);
  ~HttpFrontend() { Stop(); }
  int port() const { return server_ != nullptr ? server_->port() : -1; }
  // Lets in-flight calls end (up to `grace_ms`), closes every connection (cancelling what is left)
  // and waits for the calls. Idempotent.
  void Stop(int grace_ms = 0);
  OpenAiApi* api() { return api_.get(); }

 private:
  HttpFrontend() = default;
  std::unique_ptr<OpenAiApi> api_;
  std::function<void(const std::string&, const std::string&, int, double)> on_response_;
  std::unique_ptr<HttpServer> server_;
  bool stopped_ = false;
};

}  // namespace duet::router
