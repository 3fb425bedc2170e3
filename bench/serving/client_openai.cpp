#include "bench/serving/client_openai.h"

#include <chrono>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "boost/asio/co_spawn.hpp"
#include "boost/asio/detached.hpp"
#include "boost/asio/io_context.hpp"
#include "boost/asio/redirect_error.hpp"
#include "boost/asio/use_awaitable.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "nlohmann/json.hpp"

namespace duet::bench {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

constexpr size_t kMaxErrorBodyBytes = 4096;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct Url {
  std::string host, port, path_prefix;
};

absl::StatusOr<Url> ParseBaseUrl(const std::string& base_url) {
  constexpr std::string_view kScheme = "http://";
  if (!base_url.starts_with(kScheme)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the OpenAI backends want --base-url http://host:port (plain HTTP), got '", base_url, "'"));
  }
  std::string rest = base_url.substr(kScheme.size());
  Url url;
  const size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    url.path_prefix = rest.substr(slash);
    while (url.path_prefix.ends_with('/')) url.path_prefix.pop_back();
    rest.resize(slash);
  }
  const size_t colon = rest.rfind(':');
  url.host = rest.substr(0, colon);
  url.port = colon == std::string::npos ? "80" : rest.substr(colon + 1);
  int port = 0;
  if (url.host.empty() || !absl::SimpleAtoi(url.port, &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--base-url '", base_url, "': bad host or port"));
  }
  return url;
}

}  // namespace

std::vector<std::string> SseParser::Feed(std::string_view bytes) {
  std::vector<std::string> events;
  for (char c : bytes) {
    if (c != '\n') {
      line_.push_back(c);
      continue;
    }
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    if (line_.empty()) {  // a blank line ends the event
      if (has_data_) events.push_back(std::move(data_));
      data_.clear();
      has_data_ = false;
    } else if (line_.starts_with("data:")) {
      std::string_view value = std::string_view(line_).substr(5);
      if (value.starts_with(' ')) value.remove_prefix(1);
      if (has_data_) data_.push_back('\n');
      data_.append(value);
      has_data_ = true;
    }
    line_.clear();
  }
  return events;
}

absl::Status CompletionStream::OnEvent(std::string_view data, double now) {
  if (done_) return absl::OkStatus();
  if (data == "[DONE]") {
    done_ = true;
    result_.latency = now;
    return absl::OkStatus();
  }
  const Json chunk = Json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (chunk.is_discarded() || !chunk.is_object()) {
    return absl::DataLossError(absl::StrCat("malformed event: ", std::string(data.substr(0, 200))));
  }
  if (auto error = chunk.find("error"); error != chunk.end()) {
    const bool has_message = error->is_object() && error->contains("message") && (*error)["message"].is_string();
    return absl::UnavailableError(
        absl::StrCat("error event: ", has_message ? (*error)["message"].get<std::string>() : error->dump()));
  }
  if (auto usage = chunk.find("usage"); usage != chunk.end() && usage->is_object()) {
    result_.prompt_tokens = usage->value("prompt_tokens", 0);
    result_.output_tokens = usage->value("completion_tokens", 0);
    has_usage_ = true;
  }
  auto choices = chunk.find("choices");
  if (choices == chunk.end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object()) {
    return absl::OkStatus();  // e.g. the usage chunk
  }
  const Json& choice = (*choices)[0];
  const Json* text = nullptr;
  if (!chat_ && choice.contains("text")) text = &choice["text"];
  if (chat_ && choice.contains("delta") && choice["delta"].is_object() && choice["delta"].contains("content")) {
    text = &choice["delta"]["content"];
  }
  if (text != nullptr && text->is_string() && !text->get_ref<const std::string&>().empty()) {
    result_.chunk_times.push_back(now);
    result_.chunk_tokens.push_back(1);  // the stream does not say how many
    result_.output_text += text->get_ref<const std::string&>();
  }
  return absl::OkStatus();
}

RequestResult CompletionStream::Finish(double now, absl::Status error) {
  RequestResult result = std::move(result_);
  if (error.ok() && !done_) error = absl::DataLossError("the stream ended before data: [DONE]");
  if (error.ok() && !has_usage_) {
    error = absl::FailedPreconditionError("no usage in the stream (the server ignored stream_options.include_usage)");
  }
  if (!error.ok()) {
    result.error = std::string(error.message());
    result.latency = now;
    return result;
  }
  result.success = true;
  return result;
}

std::string OpenAiClient::RequestBody(const OpenAiClientOptions& options, const ClientRequest& request) {
  const SamplingFlags& sampling = options.sampling;
  Json body = {{"model", options.model}, {"temperature", sampling.temperature.value_or(0.0)}, {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (sampling.top_p) body["top_p"] = *sampling.top_p;
  if (sampling.top_k) body["top_k"] = *sampling.top_k;
  if (sampling.min_p) body["min_p"] = *sampling.min_p;
  if (sampling.frequency_penalty) body["frequency_penalty"] = *sampling.frequency_penalty;
  if (sampling.presence_penalty) body["presence_penalty"] = *sampling.presence_penalty;
  if (sampling.repetition_penalty) body["repetition_penalty"] = *sampling.repetition_penalty;
  if (options.chat) {
    body["messages"] = Json::array();
    for (const ChatMessage& m : request.messages) body["messages"].push_back({{"role", m.role}, {"content", m.content}});
    if (request.messages.empty()) body["messages"].push_back({{"role", "user"}, {"content", request.prompt}});
    body["max_completion_tokens"] = request.max_tokens;
  } else {
    body["prompt"] = request.prompt;
    body["max_tokens"] = request.max_tokens;
  }
  if (request.ignore_eos) body["ignore_eos"] = true;  // a vLLM extension: only sent when asked
  if (options.extra_body.is_object()) {
    for (const auto& [key, value] : options.extra_body.items()) body[key] = value;
  }
  return body.dump(-1, ' ', false, Json::error_handler_t::replace);
}

struct OpenAiClient::Impl {
  OpenAiClientOptions options;
  Url url;
  std::string target;
  net::io_context io;
  net::executor_work_guard<net::io_context::executor_type> work{io.get_executor()};
  tcp::resolver::results_type endpoints;
  std::mutex pool_mu;
  std::vector<std::unique_ptr<beast::tcp_stream>> idle;  // keep-alive connections, guarded by pool_mu
  std::vector<std::thread> threads;

  std::unique_ptr<beast::tcp_stream> TakeIdle() {
    std::lock_guard lock(pool_mu);
    if (idle.empty()) return nullptr;
    std::unique_ptr<beast::tcp_stream> stream = std::move(idle.back());
    idle.pop_back();
    return stream;
  }
  void PutIdle(std::unique_ptr<beast::tcp_stream> stream) {
    std::lock_guard lock(pool_mu);
    idle.push_back(std::move(stream));
  }

  net::awaitable<void> Run(ClientRequest request, std::function<void(RequestResult)> done) {
    const Clock::time_point start = Clock::now();
    RequestResult result = co_await Exchange(request, start);
    done(std::move(result));
  }

  net::awaitable<RequestResult> Exchange(const ClientRequest& request, Clock::time_point start) {
    http::request<http::string_body> message{http::verb::post, target, 11};
    message.set(http::field::host, url.host);
    message.set(http::field::content_type, "application/json");
    message.set(http::field::accept, "text/event-stream");
    if (!options.api_key.empty()) message.set(http::field::authorization, absl::StrCat("Bearer ", options.api_key));
    for (const auto& [name, value] : options.headers) message.set(name, value);
    message.keep_alive(true);
    message.body() = RequestBody(options, request);
    message.prepare_payload();

    CompletionStream stream_state(options.chat);
    beast::error_code ec;
    std::unique_ptr<beast::tcp_stream> stream = TakeIdle();
    bool reused = stream != nullptr;
    beast::flat_buffer buffer;
    std::optional<http::response_parser<http::buffer_body>> parser;
    for (;;) {
      if (stream == nullptr) {
        stream = std::make_unique<beast::tcp_stream>(io);
        co_await stream->async_connect(endpoints, net::redirect_error(net::use_awaitable, ec));
        if (ec) co_return stream_state.Finish(SecondsSince(start), absl::UnavailableError(absl::StrCat("connect: ", ec.message())));
      }
      co_await http::async_write(*stream, message, net::redirect_error(net::use_awaitable, ec));
      if (!ec) {
        parser.emplace();
        parser->body_limit(boost::none);  // a stream is as long as it is
        co_await http::async_read_header(*stream, buffer, *parser, net::redirect_error(net::use_awaitable, ec));
      }
      if (!ec) break;
      if (!reused) co_return stream_state.Finish(SecondsSince(start), absl::UnavailableError(absl::StrCat("HTTP: ", ec.message())));
      // The server closed a kept-alive connection before our request: once more on a new one.
      stream.reset();
      buffer.clear();
      reused = false;
    }

    const unsigned status = parser->get().result_int();
    std::string error_body;
    absl::Status failure;
    char chunk[16384];
    SseParser sse;
    while (!parser->is_done() && failure.ok()) {
      parser->get().body().data = chunk;
      parser->get().body().size = sizeof(chunk);
      co_await http::async_read_some(*stream, buffer, *parser, net::redirect_error(net::use_awaitable, ec));
      if (ec == http::error::need_buffer) ec = {};
      if (ec) {
        failure = absl::UnavailableError(absl::StrCat("reading the response: ", ec.message()));
        break;
      }
      const size_t n = sizeof(chunk) - parser->get().body().size;
      const double now = SecondsSince(start);
      if (status != 200) {
        error_body.append(chunk, std::min(n, kMaxErrorBodyBytes - std::min(error_body.size(), kMaxErrorBodyBytes)));
        continue;
      }
      for (const std::string& event : sse.Feed(std::string_view(chunk, n))) {
        failure = stream_state.OnEvent(event, now);
        if (!failure.ok()) break;
      }
    }
    if (failure.ok() && status != 200) failure = absl::UnavailableError(absl::StrCat("HTTP ", status, ": ", error_body));
    if (failure.ok() && parser->is_done() && parser->keep_alive()) PutIdle(std::move(stream));
    co_return stream_state.Finish(SecondsSince(start), failure);
  }
};

OpenAiClient::OpenAiClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

absl::StatusOr<std::unique_ptr<OpenAiClient>> OpenAiClient::Create(const OpenAiClientOptions& options) {
  absl::StatusOr<Url> url = ParseBaseUrl(options.base_url);
  if (!url.ok()) return url.status();
  if (options.model.empty()) return absl::InvalidArgumentError("the OpenAI backends need --model (the served model's name)");
  if (options.num_io_threads < 1) return absl::InvalidArgumentError("at least one io thread");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->url = *url;
  if (!options.endpoint.empty() && !options.endpoint.starts_with('/')) {
    return absl::InvalidArgumentError(absl::StrCat("--endpoint must be a path starting with '/', got '", options.endpoint, "'"));
  }
  if (!options.extra_body.is_null() && !options.extra_body.is_object()) {
    return absl::InvalidArgumentError("--extra-body must be a JSON object");
  }
  impl->target = absl::StrCat(url->path_prefix, !options.endpoint.empty() ? options.endpoint
                                                 : options.chat           ? "/v1/chat/completions"
                                                                          : "/v1/completions");
  beast::error_code ec;
  tcp::resolver resolver(impl->io);
  impl->endpoints = resolver.resolve(url->host, url->port, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("resolving ", url->host, ": ", ec.message()));
  for (int i = 0; i < options.num_io_threads; ++i) impl->threads.emplace_back([io = &impl->io] { io->run(); });
  return std::unique_ptr<OpenAiClient>(new OpenAiClient(std::move(impl)));
}

OpenAiClient::~OpenAiClient() {
  impl_->work.reset();
  {
    std::lock_guard lock(impl_->pool_mu);
    impl_->idle.clear();  // closes the kept-alive connections; no operation is pending on them
  }
  for (std::thread& t : impl_->threads) t.join();
}

void OpenAiClient::Send(const ClientRequest& request, std::function<void(RequestResult)> done) {
  net::co_spawn(impl_->io, impl_->Run(request, std::move(done)), net::detached);
}

}  // namespace duet::bench
