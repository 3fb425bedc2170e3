#include "metrics/vllm_metrics.h"

#include "common/check.h"

namespace duet::metrics {
namespace {

const std::vector<std::string> kLabels = {"model_name", "role"};

std::vector<std::string> Values(std::string_view model_name, Role role) {
  return {std::string(model_name), std::string(RoleName(role))};
}

}  // namespace

// The metric name in the macros below is the member name with "duet:" in front; counters get
// "_total" appended.
#define DUET_GAUGE(member, help) \
  member(registry.AddGauge("duet:" #member, help, kLabels).WithLabels(Values(model_name, role)))
#define DUET_COUNTER(member, help)                                        \
  member(registry.AddCounter("duet:" #member "_total", help, kLabels)     \
             .WithLabels(Values(model_name, role)))
#define DUET_HISTOGRAM(member, help, buckets)                             \
  member(registry.AddHistogram("duet:" #member, help, kLabels, buckets)   \
             .WithLabels(Values(model_name, role)))

DuetMetrics::DuetMetrics(Registry& registry, std::string_view model_name, Role role,
                         int64_t max_model_len)
    : DUET_GAUGE(num_requests_running, "Number of requests in model execution batches."),
      DUET_GAUGE(num_requests_waiting, "Number of requests waiting to be processed."),
      DUET_GAUGE(kv_cache_usage_perc, "KV-cache usage. 1 means 100 percent usage."),
      DUET_COUNTER(prefix_cache_queries,
                   "Prefix cache queries, in terms of number of queried tokens."),
      DUET_COUNTER(prefix_cache_hits, "Prefix cache hits, in terms of number of cached tokens."),
      DUET_COUNTER(num_preemptions, "Cumulative number of preemption from the engine."),
      DUET_COUNTER(prompt_tokens, "Number of prefill tokens processed."),
      DUET_COUNTER(generation_tokens, "Number of generation tokens processed."),
      DUET_COUNTER(kv_transfer_failures,
                   "Number of KV-cache transfers between prefill and decode workers that failed."),
      DUET_COUNTER(spec_decode_num_drafts, "Number of spec decoding drafts."),
      DUET_COUNTER(spec_decode_num_draft_tokens, "Number of draft tokens."),
      DUET_COUNTER(spec_decode_num_accepted_tokens, "Number of accepted tokens."),
      DUET_HISTOGRAM(request_prompt_tokens, "Number of prefill tokens processed.",
                     Build125Buckets(max_model_len)),
      DUET_HISTOGRAM(request_generation_tokens, "Number of generation tokens processed.",
                     Build125Buckets(max_model_len)),
      DUET_HISTOGRAM(time_to_first_token_seconds, "Histogram of time to first token in seconds.",
                     TtftBuckets()),
      DUET_HISTOGRAM(inter_token_latency_seconds, "Histogram of inter-token latency in seconds.",
                     InterTokenLatencyBuckets()),
      DUET_HISTOGRAM(e2e_request_latency_seconds, "Histogram of e2e request latency in seconds.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(request_queue_time_seconds,
                     "Histogram of time spent in WAITING phase for request.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(request_inference_time_seconds,
                     "Histogram of time spent in RUNNING phase for request.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(request_prefill_time_seconds,
                     "Histogram of time spent in PREFILL phase for request.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(request_decode_time_seconds,
                     "Histogram of time spent in DECODE phase for request.",
                     RequestLatencyBuckets()),
      DUET_HISTOGRAM(kv_transfer_bytes,
                     "Histogram of KV-cache bytes transferred per request between prefill and "
                     "decode workers.",
                     KvTransferBytesBuckets()),
      DUET_HISTOGRAM(kv_transfer_wait_seconds,
                     "Histogram of the time a prefill reply waited for its KV transfer after the "
                     "prompt's last layer, in seconds.",
                     KvTransferSecondsBuckets()),
      accepted_per_pos_(&registry.AddCounter("duet:spec_decode_num_accepted_tokens_per_pos_total",
                                             "Accepted tokens per draft position.",
                                             {"model_name", "role", "position"})),
      transfer_bytes_by_path_(&registry.AddCounter(
          "duet:kv_transfer_bytes_total", "KV-cache bytes sent to decode workers, by transfer path.",
          {"model_name", "role", "path"})),
      transfer_seconds_by_path_(&registry.AddHistogram(
          "duet:kv_transfer_seconds",
          "Histogram of KV-cache transfer time per request between prefill and decode workers, in "
          "seconds, by transfer path.",
          {"model_name", "role", "path"}, KvTransferSecondsBuckets())),
      labels_(Values(model_name, role)) {
  auto& success = registry.AddCounter("duet:request_success_total",
                                      "Count of successfully processed requests.",
                                      {"model_name", "role", "finished_reason"});
  for (FinishReason reason : {FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort}) {
    request_success_[static_cast<size_t>(reason)] = &success.WithLabels(
        {std::string(model_name), std::string(RoleName(role)), FinishReasonName(reason)});
  }
}

Counter& DuetMetrics::request_success(FinishReason reason) {
  DUET_CHECK_MSG(CountsAsSuccess(reason), FinishReasonName(reason));
  return *request_success_[static_cast<size_t>(reason)];
}

const Counter& DuetMetrics::request_success(FinishReason reason) const {
  return const_cast<DuetMetrics*>(this)->request_success(reason);
}

Counter& DuetMetrics::kv_transfer_bytes_total(std::string_view path) const {
  return transfer_bytes_by_path_->WithLabels({labels_[0], labels_[1], std::string(path)});
}

Histogram& DuetMetrics::kv_transfer_seconds(std::string_view path) const {
  return transfer_seconds_by_path_->WithLabels({labels_[0], labels_[1], std::string(path)});
}

Counter& DuetMetrics::spec_decode_num_accepted_tokens_per_pos(int position) {
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

std::vector<double> KvTransferBytesBuckets() {
  std::vector<double> buckets;
  for (double b = 1024.0; b <= 4.0 * 1024 * 1024 * 1024; b *= 4) buckets.push_back(b);
  return buckets;
}

std::vector<double> KvTransferSecondsBuckets() {
  std::vector<double> buckets;
  const double steps[] = {1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2,
                          0.1,  0.2,  0.5,  1.0,  2.0,  5.0,  10.0, 20.0, 50.0};
  for (double s : steps) buckets.push_back(s);
  return buckets;
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
