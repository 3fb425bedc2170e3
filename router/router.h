// The router process: public duet.v1.Duet gRPC service in front of prefill and decode workers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/stats_log.h"
#include "rpc/tls.h"

namespace duet::router {

struct RouterOptions {
  std::string model_dir;
  // The model's names (vLLM's --served-model-name): the first in responses and metrics, all of
  // them accepted as a request's `model` and listed by /v1/models; none: the model directory's
  // base name.
  std::vector<std::string> served_model_names;
  std::string host = "127.0.0.1";
  int port = 0;                   // 0: any free port (printed in DUET_READY)
  std::vector<std::string> prefill_addresses;  // host:port each
  std::vector<std::string> decode_addresses;
  // Discovery targets, dns:///NAME:PORT or file:///PATH (router/worker_registry_discovery.h),
  // resolved again every discovery_interval_ms; workers they list join those above.
  std::vector<std::string> prefill_services;
  std::vector<std::string> decode_services;
  int discovery_interval_ms = 2000;
  int max_concurrent_requests = 256;  // see RouterServiceOptions
  int max_queued_requests = 1024;     // waiting beyond max_concurrent_requests; more: 429
  int64_t max_model_len = 0;      // 0: the model's max_position_embeddings
  int kv_lease_ms = 30000;        // how long a decode worker holds a KV reservation for Decode
  int64_t max_prefill_tokens_per_worker = 8192;  // see RouterServiceOptions
  // Moves of a request to another prefill/decode pair when its decode worker fails mid-stream
  // (request migration, router/router_service.h); 0: none, the stream fails.
  int max_request_migrations = 1;
  // ReserveKv, then Prefill, one after the other, instead of side by side (RouterServiceOptions::
  // overlap_kv_reservation).
  bool sequential_kv_reservation = false;
  // Conditional disaggregation (RouterServiceOptions::local_prefill_max_tokens); 0: off.
  int64_t local_prefill_max_tokens = 0;
  int64_t local_prefill_queue_tokens = 0;
  // "prefix-aware" (router/prefix_aware_policy.h) or "least-loaded" (router/assignment_policy.h).
  std::string routing_policy = "prefix-aware";
  double prefix_affinity = 4.0;  // prefix-aware: requests in flight a whole cached prompt is worth
  // Prometheus /metrics on its own port (same host): -1 off, 0 a free port. When on, RunRouter
  // prints `DUET_METRICS_READY port=<port>` before DUET_READY.
  int metrics_port = -1;
  // The OpenAI-compatible HTTP API (router/openai_api.h): -1 none, 0 any free port. When on,
  // RunRouter prints `DUET_HTTP_READY port=<port>` before DUET_READY.
  int http_port = -1;
  int http_threads = 2;  // io threads of the HTTP server (not one per connection)
  // Threads that parse, tokenize and template HTTP requests (off the io threads).
  int http_work_threads = 4;
  // Non-empty: HTTP /v1/*, /tokenize, /detokenize and every call on the gRPC port (duet.v1.Duet,
  // server reflection) need "Authorization: Bearer <api_key>" (router/api_key_gate.h); HTTP
  // /health and /metrics, gRPC health and the metrics_port exporter too when
  // api_key_on_health_and_metrics (public by default, as in vLLM).
  std::string api_key;
  bool api_key_on_health_and_metrics = false;
  // TLS of the HTTP and gRPC ports (vLLM's --ssl-certfile, --ssl-keyfile, --ssl-ca-certs,
  // --ssl-cert-reqs; rpc/tls.h), checked in Start; no files: plaintext.
  rpc::TlsFiles tls;
  // The cluster's internal token, sent on every call to a worker (rpc/internal_auth.h).
  std::string internal_token;
  // TLS to the workers (--internal-tls-ca-certs verifies their certificates; --internal-tls-certfile
  // and --internal-tls-keyfile are the router's client certificate, for workers that require
  // one); no files: plaintext. internal_tls_server_name: the name every worker's certificate
  // must carry instead of its address (RegistryOptions::worker_tls_server_name).
  rpc::TlsFiles internal_tls;
  std::string internal_tls_server_name;
  // On a stop signal, how long RunRouter lets running requests finish (see StartDraining).
  int shutdown_grace_seconds = 30;
  // Chat tool calling (vLLM's flags): tool_choice "auto" needs enable_auto_tool_choice and a
  // tool_call_parser ("llama3_json" or "hermes", router/openai_tool_calls.h).
  bool enable_auto_tool_choice = false;
  std::string tool_call_parser;
  // vLLM's --chat-template: a template file or the template itself (LoadChatTemplate), replacing
  // the model's; empty: the model's. One that cannot be read or parsed fails start-up.
  std::string chat_template;
  // GET /metrics on the HTTP port returns this; none: the router's own RenderMetrics().
  std::function<std::string()> metrics_body;
  // RunRouter logs vLLM's stats line (common/stats_log.h) this often, in seconds; 0: never.
  double log_stats_interval_s = 10;
};

// The router's side of the stats line: its requests, and the tokens of those that finished (the
// router sees a request's token counts when it ends; the workers' lines count tokens as computed).
struct RouterTotals {
  int64_t prompt_tokens = 0;      // of the requests finished so far
  int64_t generation_tokens = 0;  // of the requests finished so far
  int64_t in_flight = 0;          // admitted and not yet ended
  int64_t waiting = 0;            // of those, waiting in the router (its queue, their prefill turn)
};
// The interval from `before` to `now`, `seconds` long (running: in flight and not waiting).
IntervalStats RouterIntervalStats(const RouterTotals& before, const RouterTotals& now, double seconds);

// A running router (server, registry poller). Tests can run one in-process.
class Router {
 public:
  static absl::StatusOr<std::unique_ptr<Router>> Start(const RouterOptions& options);
  virtual ~Router() = default;
  virtual int port() const = 0;
  virtual int http_port() const { return -1; }  // -1: no HTTP server
  // The metrics exporter's port, -1 when metrics_port was -1.
  virtual int metrics_port() const = 0;
  // The router's metrics (role "router") in Prometheus text exposition format 0.0.4
  // (Content-Type metrics::kExpositionContentType), e.g. for GET /metrics on the HTTP API.
  virtual std::string RenderMetrics() const = 0;
  // Health: gRPC grpc.health.v1 (service "" and "duet.v1.Duet") answers SERVING and HTTP /health
  // 200 only while at least one prefill and one decode worker are up and the router is not
  // draining; else NOT_SERVING and 503 (updated as workers come and go).
  // The drain: from now on Generate answers UNAVAILABLE (HTTP 503), gRPC health NOT_SERVING and
  // HTTP /health 503, while the requests already admitted (queued ones too) go on.
  virtual void StartDraining() = 0;
  // Requests admitted and not yet ended.
  virtual int num_in_flight() const = 0;
  virtual RouterTotals totals() const = 0;
  // Stops accepting calls, cancels the ones still running after `grace_ms`, stops the poller.
  virtual void Shutdown(int grace_ms = 2000) = 0;
};

// Starts the router, prints `DUET_HTTP_READY port=<http port>` (with an HTTP server) and then
// `DUET_READY port=<port>` to stdout, serves until SIGINT or SIGTERM, then drains: new requests
// are turned away while the running ones finish, for up to shutdown_grace_seconds (a second
// signal cuts it short), shuts down and returns 0 (1 when it cannot start; the error is on
// stderr).
// Blocks SIGINT/SIGTERM in the calling thread (and so in the threads it starts) to sigwait them.
int RunRouter(const RouterOptions& options);

}  // namespace duet::router
