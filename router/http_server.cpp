#include "router/http_server.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/context.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/status.hpp>
#include <boost/beast/http/string_body.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/ssl.h"

namespace duet::router {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;
using TlsStream = net::ssl::stream<tcp::socket&>;

// How long a TLS connection the server closes waits for the client's close_notify.
constexpr auto kTlsCloseTimeout = std::chrono::seconds(1);
// Bytes asked of the socket for the first bytes of a request (one TLS record).
constexpr size_t kFirstReadBytes = 16 << 10;

std::string StatusLine(int status) {
  const beast::string_view reason = http::obsolete_reason(static_cast<http::status>(status));
  return absl::StrCat("HTTP/1.1 ", status, " ", std::string(reason.data(), reason.size()), "\r\n");
}

const char kErrorContentType[] = "application/json";

std::string ErrorJson(int status, const std::string& message, const std::string& code) {
  // Same shape as the OpenAI API's errors (the API layer builds its own; these are the server's).
  return absl::StrFormat(R"({"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"%s"}})",
                         message, code);
}

class ServerImpl;
class Session;

class Responder final : public HttpResponder {
 public:
  Responder(std::shared_ptr<Session> session, net::any_io_executor strand)
      : session_(std::move(session)), strand_(std::move(strand)) {}

  void Respond(int status, std::string content_type, std::string body,
               std::vector<std::pair<std::string, std::string>> extra_headers) override;
  void StartStream(int status, std::string content_type) override;
  void AddHeader(std::string name, std::string value) override {
    std::lock_guard<std::mutex> lock(mu_);
    headers_.emplace_back(std::move(name), std::move(value));
  }
  void Write(std::string data) override;
  void End() override;
  void SetCancelHandler(std::function<void()> on_cancel) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (cancelled_) {
      lock.unlock();
      if (on_cancel) on_cancel();
      return;
    }
    on_cancel_ = std::move(on_cancel);
  }
  bool cancelled() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

  // From the session (on its strand): the connection is gone before the response ended.
  void Cancel() {
    std::function<void()> on_cancel;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_ || ended_) return;
      cancelled_ = true;
      on_cancel = std::move(on_cancel_);
      on_cancel_ = nullptr;
    }
    if (on_cancel) on_cancel();
  }
  bool close_after = false;  // set by the session before the handler runs
  // An HTTP/1.0 client: it knows no chunked encoding, so a stream's body is sent as it is and
  // the connection closes after it (close_after is set too).
  bool http10 = false;

 private:
  void Post(std::string bytes, bool last);

  // Keeps the session alive while the handler holds the responder: a session with no read
  // pending (a request queued behind this one) has nothing else holding it, and would vanish
  // with its socket, the response never sent and nobody told.
  const std::shared_ptr<Session> session_;
  const net::any_io_executor strand_;
  mutable std::mutex mu_;
  bool started_ = false;  // a stream's header went out
  bool ended_ = false;
  bool cancelled_ = false;
  std::function<void()> on_cancel_;
  std::vector<std::pair<std::string, std::string>> headers_;  // AddHeader's
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  // `tls` null: plain HTTP.
  Session(tcp::socket socket, ServerImpl* server, net::ssl::context* tls);
  void Run();
  void Close();
  // On the strand: bytes of `responder`'s response; `last` ends it.
  void Send(Responder* responder, std::string bytes, bool last);
  net::any_io_executor executor() { return socket_.get_executor(); }

 private:
  // A request read and not answered yet, or (`canned`) the error response that ends the
  // connection in its turn.
  struct Queued {
    HttpRequest request;
    bool keep_alive = true;
    bool http10 = false;
    std::string canned;
  };

  // `fn(stream)` with the connection's stream: the TLS stream or the plain socket.
  template <typename Fn>
  void WithStream(Fn&& fn) {
    if (tls_ != nullptr) {
      fn(*tls_);
    } else {
      fn(socket_);
    }
  }
  void Handshake();
  void OnHandshake(error_code ec);
  // Ends the connection after its last response: TLS sends close_notify first.
  void CloseAfterResponse();
  void DoRead();
  void ReadRequest();
  void OnRead(error_code ec);
  // Queues the response to a request that cannot be read (413, 431, 400); reading stops.
  void QueueError(int status, const std::string& payload);
  // Starts the next queued request once the previous response is written.
  void DispatchNext();
  bool Idle() const { return active_ == nullptr && queue_.empty() && !writing_ && out_.empty(); }
  void DoWrite();
  void OnWrite(error_code ec);
  void ArmTimer(std::chrono::milliseconds after);

  tcp::socket socket_;
  std::unique_ptr<TlsStream> tls_;  // over socket_; null: plain HTTP
  ServerImpl* const server_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::chrono::steady_clock::time_point request_start_;  // the first byte of the request being read
  net::steady_timer timer_;
  struct Out {
    std::string bytes;
    bool last;
  };
  std::deque<Out> out_;
  bool writing_ = false;
  bool reading_ = false;
  bool closed_ = false;
  bool closing_ = false;      // TLS: close_notify sent or being sent; reads are over
  bool close_after_ = false;  // of the response being written
  std::shared_ptr<Responder> active_;
  // HTTP/1.1 pipelining: requests are answered one at a time, in order. The socket is read all
  // along (a read always pending), so a client that leaves is noticed and its request cancelled.
  std::deque<Queued> queue_;
  bool discard_ = false;       // a request said "Connection: close": later ones are read, not served
  bool stop_reading_ = false;  // the request stream cannot be parsed any further
};

class ServerImpl final : public HttpServer {
 public:
  ServerImpl(HttpServerOptions options, HttpHandler handler)
      : options_(std::move(options)),
        handler_(std::move(handler)),
        ioc_(std::max(1, options_.num_threads)),
        acceptor_(net::make_strand(ioc_)),
        work_(net::make_work_guard(ioc_)) {}

  ~ServerImpl() override { Stop(); }

  absl::Status Listen() {
    if (options_.tls.has_value()) {
      if (absl::Status status = MakeTlsContext(*options_.tls); !status.ok()) return status;
    }
    error_code ec;
    const net::ip::address address = net::ip::make_address(options_.host, ec);
    if (ec) return absl::InvalidArgumentError(absl::StrCat("http: bad host \"", options_.host, "\": ", ec.message()));
    const tcp::endpoint endpoint(address, static_cast<uint16_t>(options_.port));
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    if (ec) {
      return absl::UnavailableError(
          absl::StrCat("http: cannot listen on ", options_.host, ":", options_.port, ": ", ec.message()));
    }
    port_ = acceptor_.local_endpoint(ec).port();
    DoAccept();
    for (int i = 0; i < std::max(1, options_.num_threads); ++i) {
      threads_.emplace_back([this] {
        for (;;) {
          try {
            ioc_.run();
            return;
          } catch (const std::exception& e) {
            DUET_LOG(ERROR) << "exception on an HTTP io thread: " << e.what();
          } catch (...) {
            DUET_LOG(ERROR) << "unknown exception on an HTTP io thread";
          }
        }
      });
    }
    return absl::OkStatus();
  }

  int port() const override { return port_; }
  int num_connections() const override { return num_connections_.load(); }

  void Stop() override {
    if (stopped_.exchange(true)) return;
    net::post(acceptor_.get_executor(), [this] {
      error_code ec;
      acceptor_.close(ec);
    });
    std::vector<std::shared_ptr<Session>> sessions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [ptr, weak] : sessions_) {
        if (auto s = weak.lock()) sessions.push_back(std::move(s));
      }
    }
    for (auto& s : sessions) net::post(s->executor(), [s] { s->Close(); });
    sessions.clear();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (num_connections_.load() > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    work_.reset();
    ioc_.stop();
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  const HttpServerOptions& options() const { return options_; }
  bool tls() const { return tls_context_.has_value(); }
  const HttpHandler& handler() const { return handler_; }

  void Add(Session* s, std::weak_ptr<Session> weak) {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.emplace(s, std::move(weak));
    num_connections_.fetch_add(1);
  }
  void Remove(Session* s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (sessions_.erase(s) > 0) num_connections_.fetch_sub(1);
  }

 private:
  void DoAccept() {
    acceptor_.async_accept(net::make_strand(ioc_), [this](error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor_.is_open()) return;
      if (!ec && !stopped_.load()) {
        error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        auto session =
            std::make_shared<Session>(std::move(socket), this, tls_context_.has_value() ? &*tls_context_ : nullptr);
        Add(session.get(), session);
        session->Run();
      } else if (ec) {
        // EMFILE and the like: pause briefly rather than spin.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      DoAccept();
    });
  }

  // The files were checked at start-up (rpc::LoadServerTls); this only hands them to OpenSSL.
  absl::Status MakeTlsContext(const rpc::TlsMaterial& tls) {
    net::ssl::context& ctx = tls_context_.emplace(net::ssl::context::tls_server);
    SSL_CTX* native = ctx.native_handle();
    SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
    ctx.set_options(net::ssl::context::default_workarounds | net::ssl::context::no_compression);
    error_code ec;
    ctx.use_certificate_chain(net::buffer(tls.cert_chain_pem), ec);
    if (!ec) ctx.use_private_key(net::buffer(tls.private_key_pem), net::ssl::context::pem, ec);
    if (!ec && !tls.ca_pem.empty()) ctx.add_certificate_authority(net::buffer(tls.ca_pem), ec);
    if (ec) return absl::InvalidArgumentError(absl::StrCat("http: TLS certificate or key: ", ec.message()));
    if (tls.client_certs != rpc::ClientCertMode::kNone) {
      ctx.set_verify_mode(tls.client_certs == rpc::ClientCertMode::kRequired
                              ? net::ssl::verify_peer | net::ssl::verify_fail_if_no_peer_cert
                              : net::ssl::verify_peer);
      // Tell clients which CAs their certificate should come from.
      BIO* bio = BIO_new_mem_buf(tls.ca_pem.data(), static_cast<int>(tls.ca_pem.size()));
      while (X509* ca = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
        SSL_CTX_add_client_CA(native, ca);
        X509_free(ca);
      }
      BIO_free(bio);
      ERR_clear_error();
      // Sessions resumed with a verified client certificate need an id context.
      static const unsigned char kSessionContext[] = "duet-http";
      SSL_CTX_set_session_id_context(native, kSessionContext, sizeof(kSessionContext) - 1);
    } else {
      ctx.set_verify_mode(net::ssl::verify_none);
    }
    return absl::OkStatus();
  }

  const HttpServerOptions options_;
  const HttpHandler handler_;
  std::optional<net::ssl::context> tls_context_;  // before the sessions, which use it
  net::io_context ioc_;
  tcp::acceptor acceptor_;
  net::executor_work_guard<net::io_context::executor_type> work_;
  std::vector<std::thread> threads_;
  int port_ = 0;
  std::atomic<bool> stopped_{false};
  std::atomic<int> num_connections_{0};
  std::mutex mu_;
  std::unordered_map<Session*, std::weak_ptr<Session>> sessions_;
};

// --- Responder ---

void Responder::Post(std::string bytes, bool last) {
  net::post(strand_, [session = session_, self = this, bytes = std::move(bytes), last]() mutable {
    session->Send(self, std::move(bytes), last);
  });
}

void Responder::Respond(int status, std::string content_type, std::string body,
                        std::vector<std::pair<std::string, std::string>> extra_headers) {
  std::vector<std::pair<std::string, std::string>> headers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_ || cancelled_ || started_) return;
    ended_ = true;
    headers = headers_;
  }
  std::string out = StatusLine(status);
  absl::StrAppend(&out, "Content-Type: ", content_type, "\r\nContent-Length: ", body.size(),
                  "\r\nConnection: ", close_after ? "close" : "keep-alive", "\r\n");
  for (const auto& [name, value] : headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  for (const auto& [name, value] : extra_headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  out += "\r\n";
  out += body;
  Post(std::move(out), /*last=*/true);
}

void Responder::StartStream(int status, std::string content_type) {
  std::vector<std::pair<std::string, std::string>> headers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_ || cancelled_ || started_) return;
    started_ = true;
    headers = headers_;
  }
  std::string out = StatusLine(status);
  absl::StrAppend(&out, "Content-Type: ", content_type, http10 ? "" : "\r\nTransfer-Encoding: chunked",
                  "\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\nConnection: ",
                  close_after ? "close" : "keep-alive", "\r\n");
  for (const auto& [name, value] : headers) absl::StrAppend(&out, name, ": ", value, "\r\n");
  out += "\r\n";
  Post(std::move(out), false);
}

void Responder::Write(std::string data) {
  if (data.empty()) return;  // an empty chunk would end the body
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_ || ended_ || cancelled_) return;
  }
  if (http10) return Post(std::move(data), false);
  std::string out = absl::StrFormat("%x\r\n", data.size());
  out += data;
  out += "\r\n";
  Post(std::move(out), false);
}

void Responder::End() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_ || ended_ || cancelled_) return;
    ended_ = true;
  }
  Post(http10 ? "" : "0\r\n\r\n", true);  // HTTP/1.0: the connection's close ends the body
}

// --- Session ---

Session::Session(tcp::socket socket, ServerImpl* server, net::ssl::context* tls)
    : socket_(std::move(socket)), server_(server), timer_(socket_.get_executor()) {
  if (tls != nullptr) tls_ = std::make_unique<TlsStream>(socket_, *tls);
}

void Session::Run() {
  net::dispatch(socket_.get_executor(), [self = shared_from_this()] {
    if (self->tls_ != nullptr) return self->Handshake();
    self->DoRead();
  });
}

void Session::Handshake() {
  ArmTimer(server_->options().read_timeout);
  tls_->async_handshake(net::ssl::stream_base::server,
                        [self = shared_from_this()](error_code ec) { self->OnHandshake(ec); });
}

void Session::OnHandshake(error_code ec) {
  if (closed_) return;
  if (!ec) return DoRead();
  DUET_LOG(DEBUG) << "http: TLS handshake failed: " << ec.message();
  if (ec.category() != net::error::get_ssl_category() || ERR_GET_REASON(ec.value()) != SSL_R_HTTP_REQUEST) {
    return Close();
  }
  // Plain HTTP on the TLS port: a plaintext answer that says so, then the connection closes.
  const std::string payload =
      ErrorJson(400, "this port speaks HTTPS: the plain HTTP request was sent to a TLS port", "bad_request");
  auto response = std::make_shared<std::string>(
      absl::StrCat(StatusLine(400), "Content-Type: ", kErrorContentType, "\r\nContent-Length: ", payload.size(),
                   "\r\nConnection: close\r\n\r\n", payload));
  if (const auto& on_rejected = server_->options().on_rejected) on_rejected("", "", 400, 0.0);
  writing_ = true;
  net::async_write(socket_, net::buffer(*response), [self = shared_from_this(), response](error_code, size_t) {
    self->writing_ = false;
    error_code ignored;
    self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
    self->Close();
  });
}

void Session::CloseAfterResponse() {
  if (tls_ == nullptr) {
    error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_send, ignored);
    return Close();
  }
  // The pending read goes (a TLS shutdown reads the client's close_notify itself), then
  // close_notify out, and the connection closes when the client's arrives, it leaves, or the
  // timeout passes.
  closing_ = true;
  error_code ignored;
  socket_.cancel(ignored);
  timer_.expires_after(kTlsCloseTimeout);
  timer_.async_wait([self = shared_from_this()](error_code ec) {
    if (!ec) self->Close();
  });
  tls_->async_shutdown([self = shared_from_this()](error_code) { self->Close(); });
}

void Session::ArmTimer(std::chrono::milliseconds after) {
  timer_.expires_after(after);
  timer_.async_wait([self = shared_from_this()](error_code ec) {
    if (ec || self->closed_ || self->closing_) return;
    if (self->timer_.expiry() > std::chrono::steady_clock::now()) return;  // re-armed meanwhile
    if (!self->Idle()) return;                                             // busy: not idle
    self->Close();
  });
}

void Session::DoRead() {
  if (closed_ || closing_ || reading_ || stop_reading_) return;
  parser_.emplace();
  parser_->body_limit(server_->options().max_body_bytes);
  parser_->header_limit(static_cast<std::uint32_t>(server_->options().max_header_bytes));
  reading_ = true;
  if (buffer_.size() > 0) return ReadRequest();
  // The idle timeout until the request's first byte; from there the read timeout (a header that
  // trickles in is cut off at the read timeout, not the idle one).
  // The first bytes are read as they come (over TLS the socket's readiness says nothing: a record
  // may already wait, decrypted, inside the stream).
  if (Idle()) ArmTimer(server_->options().idle_timeout);
  WithStream([this](auto& stream) {
    stream.async_read_some(buffer_.prepare(kFirstReadBytes), [self = shared_from_this()](error_code ec, size_t n) {
      self->buffer_.commit(n);
      if (ec || self->closed_ || self->closing_) return self->OnRead(ec);
      self->ReadRequest();
    });
  });
}

void Session::ReadRequest() {
  request_start_ = std::chrono::steady_clock::now();
  if (Idle()) ArmTimer(server_->options().read_timeout);
  WithStream([this](auto& stream) {
    http::async_read_header(stream, buffer_, *parser_, [self = shared_from_this(), &stream](error_code ec, size_t) {
      if (ec || self->closed_ || self->closing_) return self->OnRead(ec);
      http::async_read(stream, self->buffer_, *self->parser_, [self](error_code ec2, size_t) { self->OnRead(ec2); });
    });
  });
}

void Session::QueueError(int status, const std::string& payload) {
  if (const auto& on_rejected = server_->options().on_rejected) {
    std::string path, method;
    if (parser_) {  // the request line, when it was read (a body too large is known after the header)
      const auto& header = parser_->get();
      method = std::string(header.method_string());
      const std::string target(header.target());
      path = target.substr(0, target.find('?'));
    }
    on_rejected(path, method, status,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - request_start_).count());
  }
  std::string out = StatusLine(status);
  absl::StrAppend(&out, "Content-Type: ", kErrorContentType, "\r\nContent-Length: ", payload.size(),
                  "\r\nConnection: close\r\n\r\n", payload);
  stop_reading_ = true;
  if (!discard_) {
    Queued error;
    error.canned = std::move(out);
    queue_.push_back(std::move(error));
  }
  DispatchNext();
}

void Session::OnRead(error_code ec) {
  reading_ = false;
  if (closed_ || closing_) return;
  if (ec == http::error::body_limit || ec == http::error::header_limit) {
    const bool body = ec == http::error::body_limit;
    QueueError(body ? 413 : 431,
               body ? ErrorJson(413, absl::StrCat("request body is larger than ", server_->options().max_body_bytes,
                                                  " bytes"),
                                "request_too_large")
                    : ErrorJson(431, "request headers are too large", "request_header_fields_too_large"));
    return;
  }
  if (ec) {
    if (ec != http::error::end_of_stream && ec != net::error::eof && ec != net::error::operation_aborted &&
        ec != net::error::connection_reset && ec != net::error::bad_descriptor &&
        ec.category() == http::make_error_code(http::error::bad_method).category()) {
      // A malformed request: answered 400 in its turn, then the connection closes.
      QueueError(400, ErrorJson(400, absl::StrCat("malformed HTTP request: ", ec.message()), "bad_request"));
      return;
    }
    Close();  // the client left (or the socket failed): what it asked for is cancelled
    return;
  }
  http::request<http::string_body> message = parser_->release();
  if (!discard_) {
    Queued queued;
    HttpRequest& request = queued.request;
    request.method = std::string(message.method_string());
    request.target = std::string(message.target());
    request.path = request.target.substr(0, request.target.find('?'));
    for (const auto& field : message) {
      request.headers.emplace_back(
          absl::AsciiStrToLower(std::string(field.name_string().data(), field.name_string().size())),
          std::string(field.value()));
    }
    request.body = std::move(message.body());
    queued.keep_alive = message.keep_alive();
    queued.http10 = message.version() < 11;
    if (queued.http10) queued.keep_alive = false;  // one response per HTTP/1.0 connection
    // Waiting behind the one being answered: at most max_pipelined_requests, the last of which
    // closes the connection (the client sends the rest again, on a new one).
    const bool busy = active_ != nullptr || writing_ || !out_.empty() || !queue_.empty();
    if (busy && int(queue_.size()) + 1 >= std::max(1, server_->options().max_pipelined_requests)) {
      queued.keep_alive = false;
    }
    if (!queued.keep_alive) discard_ = true;
    queue_.push_back(std::move(queued));
  }
  DispatchNext();
  // Keep a read pending while requests are answered: it notices the client leaving.
  DoRead();
}

void Session::DispatchNext() {
  if (closed_ || active_ != nullptr || writing_ || !out_.empty() || queue_.empty()) return;
  Queued next = std::move(queue_.front());
  queue_.pop_front();
  timer_.cancel();
  if (!next.canned.empty()) {
    close_after_ = true;
    out_.push_back({std::move(next.canned), true});
    DoWrite();
    return;
  }
  active_ = std::make_shared<Responder>(shared_from_this(), socket_.get_executor());
  active_->close_after = !next.keep_alive;
  active_->http10 = next.http10;
  close_after_ = !next.keep_alive;
  std::shared_ptr<Responder> responder = active_;
  try {
    server_->handler()(std::move(next.request), responder);
  } catch (const std::exception& e) {
    responder->Respond(500, kErrorContentType,
                       R"({"error":{"message":"internal error","type":"server_error","param":null,"code":null}})", {});
    DUET_LOG(ERROR) << "HTTP handler threw: " << e.what();
  } catch (...) {
    responder->Respond(500, kErrorContentType,
                       R"({"error":{"message":"internal error","type":"server_error","param":null,"code":null}})", {});
  }
}

void Session::Send(Responder* responder, std::string bytes, bool last) {
  if (closed_ || responder != active_.get()) return;
  out_.push_back({std::move(bytes), last});
  if (last) active_ = nullptr;
  DoWrite();
}

void Session::DoWrite() {
  if (writing_ || out_.empty() || closed_) return;
  writing_ = true;
  WithStream([this](auto& stream) {
    net::async_write(stream, net::buffer(out_.front().bytes),
                     [self = shared_from_this()](error_code ec, size_t) { self->OnWrite(ec); });
  });
}

void Session::OnWrite(error_code ec) {
  writing_ = false;
  if (closed_) {
    out_.clear();
    return;
  }
  if (ec) {
    Close();
    return;
  }
  const bool last = out_.front().last;
  out_.pop_front();
  if (last) {
    if (close_after_) return CloseAfterResponse();
    DispatchNext();
    if (!reading_) {
      DoRead();
    } else if (Idle()) {
      ArmTimer(server_->options().idle_timeout);
    }
  }
  DoWrite();
}

void Session::Close() {
  if (closed_) return;
  closed_ = true;
  queue_.clear();
  if (active_ != nullptr) {
    std::shared_ptr<Responder> active = std::move(active_);
    active_ = nullptr;
    active->Cancel();
  }
  error_code ignored;
  timer_.cancel();
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  // A write in flight still reads out_.front(); OnWrite clears the queue when it completes.
  if (!writing_) out_.clear();
  server_->Remove(this);
}

}  // namespace

std::string HttpRequest::Header(const std::string& lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return value;
  }
  return "";
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpServerOptions& options, HttpHandler handler) {
  auto server = std::make_unique<ServerImpl>(options, std::move(handler));
  if (absl::Status status = server->Listen(); !status.ok()) return status;
  return server;
}

}  // namespace duet::router
