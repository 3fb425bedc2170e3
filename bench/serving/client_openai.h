// An OpenAI-compatible HTTP server (/v1/completions or /v1/chat/completions) as a benchmark
// backend: Boost.Beast HTTP/1.1 (TLS for https://) over a keep-alive connection pool, requests with `stream: true`
// and `stream_options.include_usage`, the Server-Sent Events parsed as they arrive. Output tokens
// are the server's usage.completion_tokens. Asynchronous: a few io threads serve every request.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/serving/client.h"
#include "nlohmann/json.hpp"
#include "rpc/tls.h"

namespace duet::bench {

// Server-Sent Events framing: feed bytes as they come, get each event's data (its `data:` lines
// joined by "\n") once the blank line that ends it arrives. Comments and other fields are skipped.
class SseParser {
 public:
  std::vector<std::string> Feed(std::string_view bytes);

 private:
  std::string line_;   // an unfinished line
  std::string data_;   // the current event's data so far
  bool has_data_ = false;
};

// The state of one streamed completion, fed event by event.
class CompletionStream {
 public:
  explicit CompletionStream(bool chat) : chat_(chat) {}
  // One event's data at `now` (seconds since the request was sent). An error event or malformed
  // JSON is an error; "[DONE]" ends the stream.
  absl::Status OnEvent(std::string_view data, double now);
  bool done() const { return done_; }
  // The result once the stream has ended (or broke off with `error`).
  RequestResult Finish(double now, absl::Status error);

 private:
  bool chat_;
  bool done_ = false;
  bool has_usage_ = false;
  RequestResult result_;
};

struct OpenAiClientOptions {
  std::string base_url;   // http://host:port or https://host:port, optionally with a path prefix
  bool chat = false;      // chat completions' request and stream instead of completions'
  // The path after base_url's (vLLM's --endpoint); empty: /v1/chat/completions or /v1/completions.
  std::string endpoint;
  std::string model;
  std::string api_key;    // sent as "Authorization: Bearer <key>" when not empty
  int num_io_threads = 2;
  SamplingFlags sampling;
  Headers headers;
  nlohmann::json extra_body;  // an object merged into every request body last (null: none)
  // https://: the server's certificate verified against tls.ca_pem (empty: the system's CAs) for
  // the URL's host; tls' certificate presented when it has one (mutual TLS).
  rpc::TlsMaterial tls;
};

class OpenAiClient final : public Client {
 public:
  static absl::StatusOr<std::unique_ptr<OpenAiClient>> Create(const OpenAiClientOptions& options);
  ~OpenAiClient() override;  // finishes the io threads; call after every request is done
  void Send(const ClientRequest& request, std::function<void(RequestResult)> done) override;

  // The JSON body of a request.
  static std::string RequestBody(const OpenAiClientOptions& options, const ClientRequest& request);

 private:
  struct Impl;
  explicit OpenAiClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace duet::bench
