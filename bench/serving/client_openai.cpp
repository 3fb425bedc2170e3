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
#include "boost/asio/ssl.hpp"
#include "boost/asio/use_awaitable.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "boost/beast/ssl.hpp"
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


struct Url {
  bool tls = false;  // https://
  std::string host, port, path_prefix;
};

absl::StatusOr<Url> ParseBaseUrl(const std::string& base_url) {
  Url url;
  std::string rest;
  if (base_url.starts_with("http://")) {
    rest = base_url.substr(7);
  } else if (base_url.starts_with("https://")) {
    rest = base_url.substr(8);
    url.tls = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("the OpenAI backends want --base-url http://host:port or https://host:port, got '", base_url, "'"));
  }
  const size_t slash = rest.find('/');
  if (slash != std::string::npos) {
    url.path_prefix = rest.substr(slash);
    while (url.path_prefix.ends_with('/')) url.path_prefix.pop_back();
    rest.resize(slash);
  }
  const size_t colon = rest.rfind(':');
  url.host = rest.substr(0, colon);
  url.port = colon == std::string::npos ? (url.tls ? "443" : "80") : rest.substr(colon + 1);
  int port = 0;
  if (url.host.empty() || !absl::SimpleAtoi(url.port, &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--base-url '", base_url, "': bad host or port"));
  }
  return url;
}

// One kept-alive connection: TCP, or TLS over it for https://.
struct Connection {
  std::optional<beast::tcp_stream> tcp;
  std::optional<beast::ssl_stream<beast::tcp_stream>> tls;

  beast::tcp_stream& socket() { return tls ? beast::get_lowest_layer(*tls) : *tcp; }
  // f(stream) for whichever stream this is; both calls return the same type.
  template <typename F>
  auto Visit(F&& f) {
    return tls ? f(*tls) : f(*tcp);
  }
};

// The client's OpenSSL context for https://: the server verified against tls.ca_pem or the
// system's CAs, tls' certificate presented when it has one.
absl::StatusOr<std::unique_ptr<net::ssl::context>> ClientTlsContext(const rpc::TlsMaterial& tls) {
  auto ctx = std::make_unique<net::ssl::context>(net::ssl::context::tls_client);
  beast::error_code ec;
  if (tls.ca_pem.empty()) {
    ctx->set_default_verify_paths(ec);
  } else {
    ctx->add_certificate_authority(net::buffer(tls.ca_pem), ec);
  }
  if (!ec && !tls.cert_chain_pem.empty()) {
    ctx->use_certificate_chain(net::buffer(tls.cert_chain_pem), ec);
    if (!ec) ctx->use_private_key(net::buffer(tls.private_key_pem), net::ssl::context::pem, ec);
  }
  if (ec) return absl::InvalidArgumentError(absl::StrCat("TLS set-up: ", ec.message()));
  ctx->set_verify_mode(net::ssl::verify_peer);
  return ctx;
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
  std::unique_ptr<net::ssl::context> tls;  // https:// only
  tcp::resolver::results_type endpoints;
  std::mutex pool_mu;
  std::vector<std::unique_ptr<Connection>> idle;  // keep-alive connections, guarded by pool_mu
  std::vector<std::thread> threads;

  std::unique_ptr<Connection> TakeIdle() {
    std::lock_guard lock(pool_mu);
    if (idle.empty()) return nullptr;
    std::unique_ptr<Connection> connection = std::move(idle.back());
    idle.pop_back();
    return connection;
  }
  void PutIdle(std::unique_ptr<Connection> connection) {
    std::lock_guard lock(pool_mu);
    idle.push_back(std::move(connection));
  }

  // A new connection, with its TLS handshake done for https:// (the server's name checked).
  net::awaitable<absl::StatusOr<std::unique_ptr<Connection>>> Connect() {
    auto connection = std::make_unique<Connection>();
    if (tls == nullptr) {
      connection->tcp.emplace(io);
    } else {
      connection->tls.emplace(io, *tls);
      boost::system::error_code not_ip;
      net::ip::make_address(url.host, not_ip);
      // SNI takes host names only.
      if (not_ip) SSL_set_tlsext_host_name(connection->tls->native_handle(), url.host.c_str());
      connection->tls->set_verify_callback(net::ssl::host_name_verification(url.host));
    }
    beast::error_code ec;
    co_await connection->socket().async_connect(endpoints, net::redirect_error(net::use_awaitable, ec));
    if (ec) co_return absl::UnavailableError(absl::StrCat("connect: ", ec.message()));
    if (connection->tls) {
      co_await connection->tls->async_handshake(net::ssl::stream_base::client,
                                                net::redirect_error(net::use_awaitable, ec));
      if (ec) co_return absl::UnavailableError(absl::StrCat("TLS handshake: ", ec.message()));
    }
    co_return connection;
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
    std::unique_ptr<Connection> stream = TakeIdle();
    bool reused = stream != nullptr;
    beast::flat_buffer buffer;
    std::optional<http::response_parser<http::buffer_body>> parser;
    for (;;) {
      if (stream == nullptr) {
        absl::StatusOr<std::unique_ptr<Connection>> connected = co_await Connect();
        if (!connected.ok()) co_return stream_state.Finish(SecondsSince(start), connected.status());
        stream = std::move(*connected);
      }
      co_await stream->Visit([&](auto& s) {
        return http::async_write(s, message, net::redirect_error(net::use_awaitable, ec));
      });
      if (!ec) {
        parser.emplace();
        parser->body_limit(boost::none);  // a stream is as long as it is
        co_await stream->Visit([&](auto& s) {
          return http::async_read_header(s, buffer, *parser, net::redirect_error(net::use_awaitable, ec));
        });
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
      co_await stream->Visit([&](auto& s) {
        return http::async_read_some(s, buffer, *parser, net::redirect_error(net::use_awaitable, ec));
      });
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
  if (url->tls) {
    absl::StatusOr<std::unique_ptr<net::ssl::context>> tls = ClientTlsContext(options.tls);
    if (!tls.ok()) return tls.status();
    impl->tls = std::move(*tls);
  } else if (!options.tls.ca_pem.empty() || !options.tls.cert_chain_pem.empty()) {
    return absl::InvalidArgumentError("TLS files were given for a plain http:// --base-url (use https://)");
  }
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
