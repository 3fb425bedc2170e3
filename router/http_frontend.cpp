#include "router/http_frontend.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "common/logging.h"

namespace duet::router {
namespace {

using OnResponse = std::function<void(const std::string&, const std::string&, int, double)>;

// Passes everything to the server's responder and reports the response once it has ended.
class ObservedResponder final : public HttpResponder, public std::enable_shared_from_this<ObservedResponder> {
 public:
  ObservedResponder(std::shared_ptr<HttpResponder> inner, const HttpRequest& request, const OnResponse* on_response)
      : inner_(std::move(inner)), path_(request.path), method_(request.method), on_response_(on_response) {}

  void Respond(int status, std::string content_type, std::string body,
               std::vector<std::pair<std::string, std::string>> extra_headers) override {
    status_.store(status, std::memory_order_release);
    inner_->Respond(status, std::move(content_type), std::move(body), std::move(extra_headers));
    Report();
  }
  void StartStream(int status, std::string content_type) override {
    status_.store(status, std::memory_order_release);
    inner_->StartStream(status, std::move(content_type));
  }
  void AddHeader(std::string name, std::string value) override { inner_->AddHeader(std::move(name), std::move(value)); }
  void Write(std::string data) override { inner_->Write(std::move(data)); }
  void End() override {
    inner_->End();
    Report();
  }
  void SetCancelHandler(std::function<void()> on_cancel) override {
    inner_->SetCancelHandler([self = shared_from_this(), on_cancel = std::move(on_cancel)] {
      self->Report();  // a stream cut short still counts, with the status it started with
      on_cancel();
    });
  }
  bool cancelled() const override { return inner_->cancelled(); }

 private:
  void Report() {
    const int status = status_.load(std::memory_order_acquire);
    if (status == 0 || reported_.exchange(true, std::memory_order_acq_rel)) return;
    (*on_response_)(path_, method_, status,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }

  const std::shared_ptr<HttpResponder> inner_;
  const std::string path_;
  const std::string method_;
  const OnResponse* const on_response_;  // the front end's, which outlives its responses' handlers
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<int> status_{0};
  std::atomic<bool> reported_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<HttpFrontend>> HttpFrontend::Start(const HttpFrontendOptions& options,
                                                                  const Tokenizer* tokenizer,
                                                                  std::shared_ptr<grpc::Channel> channel) {
  std::unique_ptr<HttpFrontend> frontend(new HttpFrontend());
  OpenAiApiOptions api_options;
  api_options.model_name = options.model_name;
  api_options.model_aliases = options.model_aliases;
  api_options.max_model_len = options.max_model_len;
  api_options.api_key = options.api_key;
  api_options.api_key_on_health_and_metrics = options.api_key_on_health_and_metrics;
  api_options.metrics_body = options.metrics_body;
  api_options.healthy = options.healthy;
  api_options.auto_tool_call_format = options.auto_tool_call_format;
  api_options.work_threads = options.work_threads;
  frontend->api_ = std::make_unique<OpenAiApi>(api_options, tokenizer, options.chat_template, std::move(channel));
  HttpServerOptions server_options;
  server_options.host = options.host;
  server_options.port = options.port;
  server_options.num_threads = options.num_threads;
  server_options.on_rejected = options.on_response;
  server_options.tls = options.tls;
  OpenAiApi* api = frontend->api_.get();
  frontend->on_response_ = options.on_response;
  const OnResponse* on_response = frontend->on_response_ ? &frontend->on_response_ : nullptr;
  absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(
      server_options, [api, on_response](HttpRequest request, std::shared_ptr<HttpResponder> responder) {
        if (on_response != nullptr) responder = std::make_shared<ObservedResponder>(std::move(responder), request, on_response);
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

