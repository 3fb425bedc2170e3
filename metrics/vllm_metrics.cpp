#include "metrics/vllm_metrics.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/check.h"

namespace duet::metrics {
namespace {

const std::vector<std::string> kLabels = {"model_name", "role"};
const std::vector<std::string> kHttpLabels = {"handler", "method", "status"};

std::vector<std::string> Values(std::string_view model_name, Role role) {
  return {std::string(model_name), std::string(RoleName(role))};
}

// Label values for an HTTP request. A path the API does not serve is "none" and an unusual
// method "other", so a scan of random paths cannot grow the registry without bound.
std::vector<std::string> HttpValues(std::string_view handler, std::string_view method, int status) {
  bool known_handler = false;
  for (std::string_view route : {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                 "/tokenize", "/detokenize", "/version"}) {
    known_handler = known_handler || handler == route;
  }
  bool known_method = false;
  for (std::string_view m : {"GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"}) {
    known_method = known_method || method == m;
  }
  return {known_handler ? std::string(handler) : "none", known_method ? std::string(method) : "other",
          std::to_string(status)};
}

}  // namespace

// The metric name in the macros below is the member name with "duet:" in front; counters get
// "_total" appended. The labels are (model_name, the class's kRole).
#define DUET_GAUGE(member, help) \
  member(registry.AddGauge("duet:" #member, help, kLabels).WithLabels(Values(model_name, kRole)))
#define DUET_COUNTER(member, help) \
  member(registry.AddCounter("duet:" #member "_total", help, kLabels).WithLabels(Values(model_name, kRole)))
#define DUET_HISTOGRAM(member, help, buckets) \
  member(registry.AddHistogram("duet:" #member, help, kLabels, buckets).WithLabels(Values(model_name, kRole)))

RouterMetrics::RouterMetrics(Registry& registry, std::string_view model_name, int64_t max_model_len)
    : DUET_GAUGE(num_requests_waiting, "Number of requests waiting to be processed."),
      DUET_HISTOGRAM(time_to_first_token_seconds, "Histogram of time to first token in seconds.", TtftBuckets()),
      DUET_HISTOGRAM(inter_token_latency_seconds, "Histogram of inter-token latency in seconds.",
                     InterTokenLatencyBuckets()),
      DUET_HISTOGRAM(time_per_output_token_seconds,
                     "Histogram of time per output token in seconds. DEPRECATED: use inter_token_latency_seconds.",
                     InterTokenLatencyBuckets()),
      DUET_HISTOGRAM(request_queue_time_seconds, "Histogram of time spent in WAITING phase for request.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(request_prompt_tokens, "Number of prefill tokens processed.", Build125Buckets(max_model_len)),
      DUET_HISTOGRAM(request_generation_tokens, "Number of generation tokens processed.",
                     Build125Buckets(max_model_len)),
      DUET_HISTOGRAM(request_max_num_generation_tokens, "Histogram of maximum number of requested generation tokens.",
                     Build125Buckets(max_model_len)),
      DUET_HISTOGRAM(request_params_n, "Histogram of the n request parameter.", RequestParamsNBuckets()),
      DUET_HISTOGRAM(request_params_max_tokens, "Histogram of the max_tokens request parameter.",
                     Build125Buckets(max_model_len)),
      DUET_HISTOGRAM(request_time_per_output_token_seconds,
                     "Histogram of time_per_output_token_seconds per request.", InterTokenLatencyBuckets()),
      DUET_HISTOGRAM(e2e_request_latency_seconds, "Histogram of e2e request latency in seconds.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(request_inference_time_seconds, "Histogram of time spent in RUNNING phase for request.",
                     RequestLatencyBuckets()),
      http_requests_(&registry.AddCounter("http_requests_total", "Total number of requests by method, status and handler.",
                                          kHttpLabels)),
      http_durations_(&registry.AddHistogram("http_request_duration_seconds",
                                             "Duration of HTTP requests in seconds, by handler, method and status.",
                                             kHttpLabels, HttpDurationBuckets())) {
  auto& success = registry.AddCounter("duet:request_success_total", "Count of successfully processed requests.",
                                      {"model_name", "role", "finished_reason"});
  for (FinishReason reason : {FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort}) {
    request_success_[static_cast<size_t>(reason)] = &success.WithLabels(
        {std::string(model_name), std::string(RoleName(kRole)), FinishReasonName(reason)});
  }
  auto& routed = registry.AddCounter("duet:routed_prompt_blocks_total",
                                     "Full prompt KV blocks the router placed on workers, by worker role.",
                                     {"model_name", "role", "worker_role"});
  auto& cached = registry.AddCounter(
      "duet:routed_prompt_blocks_cached_total",
      "Full prompt KV blocks the router placed on workers that its prefix index predicted cached there, by worker "
      "role.",
      {"model_name", "role", "worker_role"});
  auto& prefills = registry.AddCounter(
      "duet:router_prefills_total",
      "Requests placed for their prefill, by the role of the worker that prefills them: prefill, or decode "
      "(conditional disaggregation: no KV transfer).",
      {"model_name", "role", "worker_role"});
  for (int decode : {0, 1}) {
    const std::vector<std::string> labels = {std::string(model_name), std::string(RoleName(kRole)),
                                             decode ? "decode" : "prefill"};
    routed_prompt_blocks_[size_t(decode)] = &routed.WithLabels(labels);
    routed_prompt_blocks_cached_[size_t(decode)] = &cached.WithLabels(labels);
    prefills_[size_t(decode)] = &prefills.WithLabels(labels);
  }
  auto& calls = registry.AddHistogram(
      "duet:router_worker_call_seconds",
      "Histogram of the router's waits on worker calls, in seconds, by call: reserve_kv, prefill (forward pass and KV "
      "transfer), decode_first_message.",
      {"model_name", "role", "call"}, KvTransferSecondsBuckets());
  const char* const call_names[] = {"reserve_kv", "prefill", "decode_first_message"};
  for (size_t i = 0; i < worker_call_seconds_.size(); ++i) {
    worker_call_seconds_[i] =
        &calls.WithLabels({std::string(model_name), std::string(RoleName(kRole)), call_names[i]});
  }
  auto& migrations = registry.AddCounter(
      "duet:request_migrations_total",
      "Requests moved to another prefill/decode pair after their decode worker failed mid-stream, by outcome: "
      "success, failure (no pair could continue it), limit (not tried: --max-request-migrations reached).",
      {"model_name", "role", "outcome"});
  const char* const outcomes[] = {"success", "failure", "limit"};
  for (size_t i = 0; i < request_migrations_.size(); ++i) {
    request_migrations_[i] =
        &migrations.WithLabels({std::string(model_name), std::string(RoleName(kRole)), outcomes[i]});
  }
  auto& kv_migrations = registry.AddCounter(
      "duet:kv_migrations_total",
      "Requests a draining decode worker parked, by outcome: moved (their KV went to another decode worker, "
      "no re-prefill), resumed (no other decode worker took them: they went on where they were), failed "
      "(neither: migrated by re-prefill instead).",
      {"model_name", "role", "outcome"});
  const char* const kv_outcomes[] = {"moved", "resumed", "failed"};
  for (size_t i = 0; i < kv_migrations_.size(); ++i) {
    kv_migrations_[i] = &kv_migrations.WithLabels({std::string(model_name), std::string(RoleName(kRole)), kv_outcomes[i]});
  }
}

Counter& RouterMetrics::request_success(FinishReason reason) {
  DUET_CHECK_MSG(CountsAsSuccess(reason), FinishReasonName(reason));
  return *request_success_[static_cast<size_t>(reason)];
}

const Counter& RouterMetrics::request_success(FinishReason reason) const {
  return const_cast<RouterMetrics*>(this)->request_success(reason);
}

void RouterMetrics::RecordParams(int n, int64_t max_tokens) {
  request_params_n.Observe(n);
  request_params_max_tokens.Observe(double(max_tokens));
}

void RouterMetrics::RecordFinished(const FinishedRequest& r) {
  request_success(r.reason).Inc();
  request_prompt_tokens.Observe(double(r.prompt_tokens));
  request_generation_tokens.Observe(double(r.generation_tokens));
  // Each request is its own sequence group (n choices run as n requests).
  request_max_num_generation_tokens.Observe(double(r.generation_tokens));
  e2e_request_latency_seconds.Observe(r.e2e_seconds);
  request_inference_time_seconds.Observe(std::max(0.0, r.e2e_seconds - r.queue_seconds));
  // vLLM's mean time per output token: the decode phase over the tokens after the first.
  if (r.generation_tokens > 1) {
    request_time_per_output_token_seconds.Observe(r.decode_seconds / double(r.generation_tokens - 1));
  }
}

Counter& RouterMetrics::http_requests_total(std::string_view handler, std::string_view method, int status) {
  return http_requests_->WithLabels(HttpValues(handler, method, status));
}

Histogram& RouterMetrics::http_request_duration_seconds(std::string_view handler, std::string_view method,
                                                        int status) {
  return http_durations_->WithLabels(HttpValues(handler, method, status));
}

void RouterMetrics::RecordHttpRequest(std::string_view handler, std::string_view method, int status,
                                      double seconds) {
  http_requests_total(handler, method, status).Inc();
  http_request_duration_seconds(handler, method, status).Observe(seconds);
}

// As DUET_GAUGE / DUET_COUNTER, for the families both worker roles export (the role is the
// constructor's argument).
#define DUET_ENGINE_GAUGE(member, help) \
  member(registry.AddGauge("duet:" #member, help, kLabels).WithLabels(Values(model_name, role)))
#define DUET_ENGINE_COUNTER(member, help) \
  member(registry.AddCounter("duet:" #member "_total", help, kLabels).WithLabels(Values(model_name, role)))

EngineMetrics::EngineMetrics(Registry& registry, std::string_view model_name, Role role)
    : DUET_ENGINE_GAUGE(num_requests_running, "Number of requests in model execution batches."),
      DUET_ENGINE_GAUGE(num_requests_waiting, "Number of requests waiting to be processed."),
      DUET_ENGINE_COUNTER(num_preemptions, "Cumulative number of preemption from the engine."),
      DUET_ENGINE_COUNTER(prefix_cache_queries, "Prefix cache queries, in terms of number of queried tokens."),
      DUET_ENGINE_COUNTER(prefix_cache_hits, "Prefix cache hits, in terms of number of cached tokens."),
      DUET_ENGINE_COUNTER(kv_cache_evictions, "Cached KV blocks evicted from the device cache for reuse."),
      DUET_ENGINE_COUNTER(host_kv_cache_offloaded_blocks, "KV blocks copied into the host tier as the device evicted them."),
      DUET_ENGINE_COUNTER(host_kv_cache_hit_blocks, "KV blocks a prefix found in the host tier and copied back."),
      DUET_ENGINE_COUNTER(host_kv_cache_evictions, "KV blocks evicted from the host tier."),
      DUET_ENGINE_GAUGE(host_kv_cache_usage_perc, "Share of the host tier's KV blocks in use (1 means 100 percent)."),
      iteration_tokens_total(registry
                                 .AddHistogram("duet:iteration_tokens_total",
                                               "Histogram of number of tokens per engine_step.", kLabels,
                                               IterationTokensBuckets())
                                 .WithLabels(Values(model_name, role))),
      registry_(registry),
      labels_(Values(model_name, role)) {
  DUET_CHECK(role != Role::kRouter);
}

void EngineMetrics::SetCacheConfig(const CacheConfig& config) {
  registry_
      .AddGauge("duet:cache_config_info", "Information of the LLMEngine CacheConfig.",
                {"model_name", "role", "block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                 "num_gpu_blocks"})
      .WithLabels({labels_[0], labels_[1], std::to_string(config.block_size), config.cache_dtype,
                   config.enable_prefix_caching ? "True" : "False", absl::StrFormat("%g", config.gpu_memory_utilization),
                   std::to_string(config.num_gpu_blocks)})
      .Set(1);
}

PrefillMetrics::PrefillMetrics(Registry& registry, std::string_view model_name)
    : EngineMetrics(registry, model_name, kRole),
      DUET_COUNTER(prompt_tokens, "Number of prefill tokens processed."),
      DUET_HISTOGRAM(request_prefill_time_seconds, "Histogram of time spent in PREFILL phase for request.",
                     RequestLatencyBuckets()),
      DUET_COUNTER(kv_transfer_failures,
                   "Number of KV-cache transfers between prefill and decode workers that failed."),
      DUET_HISTOGRAM(kv_transfer_bytes,
                     "Histogram of KV-cache bytes transferred per request between prefill and decode workers.",
                     KvTransferBytesBuckets()),
      DUET_HISTOGRAM(kv_transfer_wait_seconds,
                     "Histogram of the time a prefill reply waited for its KV transfer after the prompt's last "
                     "layer, in seconds.",
                     KvTransferSecondsBuckets()),
      late_targets_by_arrival_(&registry.AddCounter(
          "duet:kv_late_targets_total",
          "KV targets that reached the prefill worker after its Prefill call, by when they came against the "
          "forward pass (before_forward, during_forward, after_forward).",
          {"model_name", "role", "arrived"})),
      transfer_bytes_by_path_(&registry.AddCounter("duet:kv_transfer_bytes_total",
                                                   "KV-cache bytes sent to decode workers, by transfer path.",
                                                   {"model_name", "role", "path"})),
      transfer_seconds_by_path_(&registry.AddHistogram(
          "duet:kv_transfer_seconds",
          "Histogram of KV-cache transfer time per request between prefill and decode workers, in seconds, by "
          "transfer path.",
          {"model_name", "role", "path"}, KvTransferSecondsBuckets())) {}

Counter& PrefillMetrics::kv_late_targets_total(std::string_view arrived) const {
  return late_targets_by_arrival_->WithLabels({labels_[0], labels_[1], std::string(arrived)});
}

Counter& PrefillMetrics::kv_transfer_bytes_total(std::string_view path) const {
  return transfer_bytes_by_path_->WithLabels({labels_[0], labels_[1], std::string(path)});
}

Histogram& PrefillMetrics::kv_transfer_seconds(std::string_view path) const {
  return transfer_seconds_by_path_->WithLabels({labels_[0], labels_[1], std::string(path)});
}

DecodeMetrics::DecodeMetrics(Registry& registry, std::string_view model_name)
    : EngineMetrics(registry, model_name, kRole),
      DUET_GAUGE(kv_cache_usage_perc, "KV-cache usage. 1 means 100 percent usage."),
      DUET_COUNTER(generation_tokens, "Number of generation tokens processed."),
      DUET_COUNTER(prompt_tokens, "Number of prefill tokens processed."),
      DUET_HISTOGRAM(request_decode_time_seconds, "Histogram of time spent in DECODE phase for request.",
                     RequestLatencyBuckets()),
      DUET_COUNTER(spec_decode_num_drafts, "Number of spec decoding drafts."),
      DUET_COUNTER(spec_decode_num_draft_tokens, "Number of draft tokens."),
      DUET_COUNTER(spec_decode_num_accepted_tokens, "Number of accepted tokens."),
      accepted_per_pos_(&registry.AddCounter("duet:spec_decode_num_accepted_tokens_per_pos_total",
                                             "Accepted tokens per draft position.",
                                             {"model_name", "role", "position"})) {}

Counter& DecodeMetrics::spec_decode_num_accepted_tokens_per_pos(int position) {
  return accepted_per_pos_->WithLabels({labels_[0], labels_[1], std::to_string(position)});
}

#undef DUET_GAUGE
#undef DUET_COUNTER
#undef DUET_HISTOGRAM

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kRouter:
      return "router";
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
  }
  return "unknown";
}

bool CountsAsSuccess(FinishReason reason) {
  return reason == FinishReason::kStop || reason == FinishReason::kLength || reason == FinishReason::kAbort;
}

std::vector<double> TtftBuckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> InterTokenLatencyBuckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
          0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> RequestLatencyBuckets() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> IterationTokensBuckets() {
  return {1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};
}

std::vector<double> RequestParamsNBuckets() { return {1, 2, 5, 10, 20}; }

std::vector<double> HttpDurationBuckets() {
  return {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600};
}

std::vector<double> KvTransferBytesBuckets() {
  std::vector<double> buckets;
  for (double b = 1024.0; b <= 4.0 * 1024 * 1024 * 1024; b *= 4) buckets.push_back(b);
  return buckets;
}

std::vector<double> KvTransferSecondsBuckets() {
  return {1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0};
}

std::vector<double> Build125Buckets(int64_t max_value) {
  std::vector<double> buckets;
  for (int64_t scale = 1; scale > 0 && scale <= max_value; scale *= 10) {
    for (int64_t m : {1, 2, 5}) {
      if (m * scale > max_value) return buckets;
      buckets.push_back(static_cast<double>(m * scale));
    }
  }
  return buckets;
}

}  // namespace duet::metrics
