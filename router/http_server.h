// A small asynchronous HTTP/1.1 server on Boost.Beast/Asio for the router's OpenAI API.
//
// A fixed pool of io threads serves every connection (no thread per connection), so thousands
// of idle or streaming connections cost only their buffers. Keep-alive, a body size limit (413),
// a header/body read timeout and an idle timeout. A handler answers with one full response or a
// chunked stream (SSE) through an HttpResponder, from any thread; when the client goes away
// before the response ends, the responder's cancel callback runs once (so the work behind it can
// be aborted).
//
// With HttpServerOptions::tls every connection is TLS (1.2 or later; OpenSSL through
// boost::asio::ssl), with the same behaviour as plain HTTP over it. A handshake must finish
// within the read timeout; one that fails closes its connection and nothing else (a plain HTTP
// request on the TLS port gets a plaintext 400 saying so). A connection the server closes ends
// with a TLS close_notify.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "rpc/tls.h"

namespace duet::router {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query, as sent
  std::string path;    // target without the query
  std::vector<std::pair<std::string, std::string>> headers;  // names in lower case
  std::string body;

  // The first header of that (lower-case) name, or empty.
  std::string Header(const std::string& lower_name) const;
};

// One response. Thread-safe; every call after the response ended (or the client left) is a no-op.
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  // A whole response with Content-Length.
  virtual void Respond(int status, std::string content_type, std::string body,
                       std::vector<std::pair<std::string, std::string>> extra_headers = {}) = 0;
  // Starts a chunked response (e.g. text/event-stream); then Write() chunks and End().
  virtual void StartStream(int status, std::string content_type) = 0;
  // A header for the response, whichever way it goes (before Respond or StartStream). `value`
  // must be printable ASCII.
  virtual void AddHeader(std::string name, std::string value) = 0;
  virtual void Write(std::string data) = 0;
  virtual void End() = 0;
  // `on_cancel` runs once (on an io thread) if the connection closes before the response ends.
  // When it already has, it runs right away, on the calling thread.
  virtual void SetCancelHandler(std::function<void()> on_cancel) = 0;
  virtual bool cancelled() const = 0;
};

using HttpHandler = std::function<void(HttpRequest request, std::shared_ptr<HttpResponder> responder)>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;              // 0: any free port
  int num_threads = 2;       // io threads
  size_t max_body_bytes = 8u << 20;  // larger bodies: 413
  size_t max_header_bytes = 64u << 10;
  // Pipelined requests read while one is being answered, at most (the last of them is answered
  // with "Connection: close").
  int max_pipelined_requests = 16;
  std::chrono::milliseconds read_timeout{30000};   // from the first byte of a request to its end
  std::chrono::milliseconds idle_timeout{120000};  // keep-alive connection without a request
  // The server's own answers to requests it cannot read (413, 431, 400), which no handler sees:
  // the request's path and method (empty when its header was not read), the status and the
  // seconds since its first byte.
  // A plain HTTP request on a TLS port, answered 400, is reported too (path and method empty).
  std::function<void(const std::string& path, const std::string& method, int status, double seconds)> on_rejected;
  // Set: HTTPS, with this certificate, and client certificates as tls->client_certs says.
  std::optional<rpc::TlsMaterial> tls;
};

class HttpServer {
 public:
  // Listens and starts the io threads. `handler` runs on an io thread and must not block;
  // exceptions it throws become a 500.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpServerOptions& options, HttpHandler handler);
  virtual ~HttpServer() = default;
  virtual int port() const = 0;
  virtual int num_connections() const = 0;
  // Stops accepting, closes every connection (their responders' cancel callbacks run), joins the
  // io threads. Idempotent.
  virtual void Stop() = 0;
};

}  // namespace duet::router
