// Duet's metric set: vLLM's metric names, meanings and histogram buckets with the prefix "duet:"
// instead of "vllm:", plus KV-transfer metrics for disaggregated serving. Every series carries
// the labels model_name and role (router, prefill or decode).
//
// Bucket sources (vLLM vllm/v1/metrics/loggers.py, PrometheusStatLogger):
//   time_to_first_token_seconds        TtftBuckets()               (22 bounds, 0.001 .. 2560)
//   inter_token_latency_seconds        InterTokenLatencyBuckets()  (19 bounds, 0.01 .. 80; the
//                                      buckets of the former time_per_output_token_seconds)
//   e2e_request_latency_seconds, request_{queue,inference,prefill,decode}_time_seconds
//                                      RequestLatencyBuckets()     (21 bounds, 0.3 .. 7680)
//   request_{prompt,generation}_tokens Build125Buckets(max_model_len) (vLLM's build_1_2_5_buckets)
// vLLM has no KV-transfer histograms of its own in this shape; Duet's are
//   kv_transfer_bytes   KvTransferBytesBuckets():   1 KiB * 4^k up to 4 GiB
//   kv_transfer_seconds, kv_transfer_wait_seconds KvTransferSecondsBuckets(): 1-2-5 steps from
//                       100 us to 50 s
// The prefill worker (the sender, which chooses the path) labels its transfer bytes counter and
// seconds histogram with `path` (kvtransfer::TransferPathName: cuda_ipc, ucx_shm, ucx_net).
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

#include "common/finish_reason.h"
#include "metrics/registry.h"

namespace duet::metrics {

enum class Role { kRouter, kPrefill, kDecode };
std::string_view RoleName(Role role);  // "router", "prefill", "decode"

// request_success counts vLLM's finish reasons stop, length and abort (the finished_reason
// label spells them as FinishReasonName does); running and failed requests have no series.
bool CountsAsSuccess(FinishReason reason);

std::vector<double> TtftBuckets();
std::vector<double> InterTokenLatencyBuckets();
std::vector<double> RequestLatencyBuckets();
std::vector<double> KvTransferBytesBuckets();
std::vector<double> KvTransferSecondsBuckets();
// 1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's build_1_2_5_buckets).
std::vector<double> Build125Buckets(int64_t max_value);

// Registers (or finds) every Duet metric in `registry` and holds the children for one
// (model_name, role). Several DuetMetrics may share a registry (say, two roles in one test
// process); they share the families. The registry must outlive this object.
class DuetMetrics {
 public:
  DuetMetrics(Registry& registry, std::string_view model_name, Role role,
              int64_t max_model_len = 4096);

  // Scheduler state.
  Gauge& num_requests_running;  // requests in model execution batches
  Gauge& num_requests_waiting;  // requests waiting to be scheduled
  Gauge& kv_cache_usage_perc;   // KV-cache usage, 0..1 (1 means 100 percent)

  // Counters.
  Counter& prefix_cache_queries;  // prefix-cache queries, in queried tokens
  Counter& prefix_cache_hits;     // prefix-cache hits, in cached tokens
  Counter& num_preemptions;
  Counter& prompt_tokens;       // prefill tokens processed
  Counter& generation_tokens;   // generation tokens processed
  Counter& kv_transfer_failures;
  // Speculative decoding (vLLM's spec_decode_* counters).
  Counter& spec_decode_num_drafts;            // verified proposals, one per request and step
  Counter& spec_decode_num_draft_tokens;
  Counter& spec_decode_num_accepted_tokens;
  // Accepted draft tokens at draft position `position` (0 = the first draft token).
  Counter& spec_decode_num_accepted_tokens_per_pos(int position);
  // `reason`: one CountsAsSuccess accepts.
  Counter& request_success(FinishReason reason);
  const Counter& request_success(FinishReason reason) const;

  // Request histograms.
  Histogram& request_prompt_tokens;
  Histogram& request_generation_tokens;
  Histogram& time_to_first_token_seconds;
  Histogram& inter_token_latency_seconds;
  Histogram& e2e_request_latency_seconds;
  Histogram& request_queue_time_seconds;
  Histogram& request_inference_time_seconds;
  Histogram& request_prefill_time_seconds;
  Histogram& request_decode_time_seconds;

  // KV transfer between prefill and decode workers (one observation per transferred request).
  Histogram& kv_transfer_bytes;
  // Sender side, by path: bytes moved, and the time from the first layer sent to the receiver's
  // acknowledgement of the whole request.
  Counter& kv_transfer_bytes_total(std::string_view path) const;
  Histogram& kv_transfer_seconds(std::string_view path) const;
  // Prefill: how long the reply waited for the transfer after the prompt's output was ready
  // (0 when the layer-wise transfer had fully overlapped the forward pass).
  Histogram& kv_transfer_wait_seconds;

 private:
  std::array<Counter*, 5> request_success_{};  // by FinishReason; null where it counts none
  Family<Counter>* accepted_per_pos_;
  Family<Counter>* transfer_bytes_by_path_;
  Family<Histogram>* transfer_seconds_by_path_;
  std::vector<std::string> labels_;  // model_name, role
};

}  // namespace duet::metrics
