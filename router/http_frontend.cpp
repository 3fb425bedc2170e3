#include "router/http_frontend.h"

#include <thread>

#include "common/logging.h"

namespace duet::router {

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(const HttpFrontendOptions& options,
                                                                  const Tokenizer* tokenizer,
                                                                  std::shared_ptr<grpc::Channel> channel) {
  std::unique_ptr<HttpFrontend> frontend(new HttpFrontend());
  absl::StatusOr<LoadedChatTemplate> chat = LoadChatTemplate(options.model_dir);
  if (chat.ok()) {
    frontend->chat_ = std::make_unique<LoadedChatTemplate>(*std::move(chat));
  } else {
    DUET_LOG(WARNING) << "no chat template (chat completions answer 400): " << chat.status().message();
  }
  OpenAiApiOptions api_options;
  api_options.model_name = options.model_name;
  api_options.max_model_len = options.max_model_len;
  api_options.api_key = options.api_key;
  api_options.api_key_on_health_and_metrics = options.api_key_on_health_and_metrics;
  api_options.metrics_body = options.metrics_body;
  api_options.healthy = options.healthy;
  api_options.work_threads = options.work_threads;
  frontend->api_ = std::make_unique<OpenAiApi>(api_options, tokenizer, frontend->chat_.get(), std::move(channel));
  HttpServerOptions server_options;
  server_options.host = options.host;
  server_options.port = options.port;
  server_options.num_threads = options.num_threads;
  OpenAiApi* api = frontend->api_.get();
  absl::StatusOr<std::unique_ptr<HttpServer>> server =
      HttpServer::Start(server_options, [api](HttpRequest request, std::shared_ptr<HttpResponder> responder) {
        api->Handle(std::move(request), std::move(responder));
      });
  if (!server.ok()) return server.status();
  frontend->server_ = *std::move(server);
  return frontend;
}

void HttpFrontend::Stop(int grace_ms) {
  if (stopped_) return;
  stopped_ = true;
  if (api_ != nullptr && grace_ms > 0) api_->WaitIdle(std::chrono::milliseconds(grace_ms));
  if (server_ != nullptr) server_->Stop();  // cancels the calls of connections still open
  if (api_ != nullptr && !api_->WaitIdle(std::chrono::seconds(10))) {
    DUET_LOG(WARNING) << api_->num_active_jobs() << " HTTP requests still in flight at shutdown";
  }
  api_.reset();
  server_.reset();
}

}  // namespace duet::router

