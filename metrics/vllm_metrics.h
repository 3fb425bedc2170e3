// Duet's metric set: vLLM's metric names, meanings and histogram buckets with the prefix "duet:"
// instead of "vllm:", plus KV-transfer metrics for disaggregated serving. Every duet:* series
// carries the labels model_name and role (router, prefill or decode).
//
// Each family has one owner, the role that measures it (metrics/README.md has the table): a
// request passes through a router, a prefill worker and a decode worker, and if all three counted
// it, sum(rate(...)) over a cluster would read it three times. So the router exports what the
// client sees of a request (latencies, outcome, lengths, parameters, its own queue, HTTP), the
// prefill worker the prompt tokens and KV transfers, the decode worker the generated tokens, its
// KV cache and speculation; both workers export their engine's scheduler state. A class per role
// holds exactly what that role exports.
//
// Bucket sources (vLLM vllm/v1/metrics/loggers.py, PrometheusStatLogger):
//   time_to_first_token_seconds        TtftBuckets()               (22 bounds, 0.001 .. 2560)
//   inter_token_latency_seconds, time_per_output_token_seconds,
//   request_time_per_output_token_seconds InterTokenLatencyBuckets() (19 bounds, 0.01 .. 80)
//   e2e_request_latency_seconds, request_{queue,inference,prefill,decode}_time_seconds
//                                      RequestLatencyBuckets()     (21 bounds, 0.3 .. 7680)
//   request_{prompt,generation}_tokens, request_params_max_tokens,
//   request_max_num_generation_tokens  Build125Buckets(max_model_len) (vLLM's build_1_2_5_buckets)
//   request_params_n                   {1, 2, 5, 10, 20}
//   iteration_tokens_total             IterationTokensBuckets()    (1, 8, 16, ... 16384)
// vLLM has no KV-transfer histograms of its own in this shape; Duet's are
//   kv_transfer_bytes   KvTransferBytesBuckets():   1 KiB * 4^k up to 4 GiB
//   kv_transfer_seconds, kv_transfer_wait_seconds, the router's worker_call_seconds
//                       KvTransferSecondsBuckets(): 1-2-5 steps from 100 us to 50 s
// The prefill worker (the sender, which chooses the path) labels its transfer bytes counter and
// seconds histogram with `path` (kvtransfer::TransferPathName: cuda_ipc, ucx_shm, ucx_net).
//
// The router's HTTP API also exports http_requests_total and http_request_duration_seconds (the
// names prometheus-fastapi-instrumentator gives vLLM's server; no prefix), by handler, method and
// status code.
#pragma once

#include <array>
#include <cstdint>
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
std::vector<double> IterationTokensBuckets();
std::vector<double> RequestParamsNBuckets();
std::vector<double> HttpDurationBuckets();
std::vector<double> KvTransferBytesBuckets();
std::vector<double> KvTransferSecondsBuckets();
// 1, 2, 5, 10, 20, 50, ... up to and including max_value (vLLM's build_1_2_5_buckets).
std::vector<double> Build125Buckets(int64_t max_value);

// One request as the router saw it end, for RouterMetrics::RecordFinished.
struct FinishedRequest {
  FinishReason reason = FinishReason::kNone;  // one CountsAsSuccess accepts
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  int64_t max_tokens = 0;  // the request's max_tokens parameter
  double e2e_seconds = 0;
  double queue_seconds = 0;  // arrival until the router placed it on workers
  // From the first token to the last; 0 when fewer than two tokens were relayed.
  double decode_seconds = 0;
};

// The router: the client's view of each request.
class RouterMetrics {
 public:
  static constexpr Role kRole = Role::kRouter;
  RouterMetrics(Registry& registry, std::string_view model_name, int64_t max_model_len = 4096);

  // Requests waiting in the router: queued beyond --max-concurrent-requests, or admitted and
  // waiting for their turn at the prefill workers. (Requests on a worker are that worker's.)
  Gauge& num_requests_waiting;

  Histogram& time_to_first_token_seconds;
  // Every gap between two token messages relayed to the client; time_per_output_token_seconds is
  // vLLM's older name for it and gets the same observations.
  Histogram& inter_token_latency_seconds;
  Histogram& time_per_output_token_seconds;
  Histogram& request_queue_time_seconds;

  // One request submitted: its n (the OpenAI API's choices run as n requests; the group counts
  // once) and max_tokens.
  void RecordParams(int n, int64_t max_tokens);
  // One request finished (stop, length or abort): success, lengths and latencies.
  void RecordFinished(const FinishedRequest& request);

  Counter& request_success(FinishReason reason);
  const Counter& request_success(FinishReason reason) const;
  Histogram& request_prompt_tokens;
  Histogram& request_generation_tokens;
  Histogram& request_max_num_generation_tokens;
  Histogram& request_params_n;
  Histogram& request_params_max_tokens;
  Histogram& request_time_per_output_token_seconds;
  Histogram& e2e_request_latency_seconds;
  Histogram& request_inference_time_seconds;

  // HTTP API requests: one per response, by route (`handler`: the path when it is one of the
  // API's, else "none"), method and status code; the duration runs until the response's last byte.
  void RecordHttpRequest(std::string_view handler, std::string_view method, int status, double seconds);
  Counter& http_requests_total(std::string_view handler, std::string_view method, int status);
  Histogram& http_request_duration_seconds(std::string_view handler, std::string_view method, int status);

  // Prefix-aware routing, by the role of the worker a request was placed on (`worker_role`
  // "prefill" or "decode"): the prompt's full KV blocks placed (routed_prompt_blocks_total) and
  // those of them the router's prefix index predicted that worker had cached
  // (routed_prompt_blocks_cached_total). Their ratio is the router's predicted hit rate.
  Counter& routed_prompt_blocks(bool decode) { return *routed_prompt_blocks_[decode ? 1 : 0]; }
  // Disaggregation's share of the time to first token, per worker call the router waits on
  // (`call`): reserve_kv (the decode worker's ReserveKv round trip), prefill (the Prefill round
  // trip: the prompt's forward pass and its KV transfer) and decode_first_message (the Decode
  // call's start to its first message). Successful calls only.
  enum class WorkerCall { kReserveKv, kPrefill, kDecodeFirstMessage };
  Histogram& worker_call_seconds(WorkerCall call) { return *worker_call_seconds_[size_t(call)]; }
  Counter& routed_prompt_blocks_cached(bool decode) { return *routed_prompt_blocks_cached_[decode ? 1 : 0]; }

  // Request migration (router/router_service.h), by `outcome`: success (the stream continued on
  // another pair), failure (no pair could continue it), limit (a decode worker failed under a
  // request that had already moved --max-request-migrations times; not tried).
  enum class Migration { kSuccess, kFailure, kLimit };
  Counter& request_migrations(Migration outcome) { return *request_migrations_[size_t(outcome)]; }
  // Live KV migration of a request a draining decode worker parked, by `outcome`: moved (its KV
  // went to another decode worker, which continues the stream), resumed (no other decode worker
  // took it: it went on where it was parked), failed (neither: a re-prefill migration follows).
  enum class KvMigration { kMoved, kResumed, kFailed };
  Counter& kv_migrations(KvMigration outcome) { return *kv_migrations_[size_t(outcome)]; }
  // Where requests were prefilled, by `worker_role`: "prefill" (a prefill worker, the KV moving
  // to the decode worker) or "decode" (conditional disaggregation: the decode worker itself,
  // DecodeRequest.prefill_here). A request placed again after a worker failed counts again.
  Counter& prefills(bool on_decode_worker) { return *prefills_[on_decode_worker ? 1 : 0]; }

 private:
  std::array<Counter*, 5> request_success_{};  // by FinishReason; null where it counts none
  std::array<Counter*, 2> routed_prompt_blocks_{};         // prefill, decode
  std::array<Counter*, 2> routed_prompt_blocks_cached_{};  // prefill, decode
  std::array<Histogram*, 3> worker_call_seconds_{};        // by WorkerCall
  std::array<Counter*, 3> request_migrations_{};           // by Migration
  std::array<Counter*, 3> kv_migrations_{};                // by KvMigration
  std::array<Counter*, 2> prefills_{};                     // prefill, decode
  Family<Counter>* http_requests_;
  Family<Histogram>* http_durations_;
};

// A worker's KV-cache configuration, exported as cache_config_info (value 1, the configuration
// in the labels, as vLLM does).
struct CacheConfig {
  int64_t block_size = 0;
  int64_t num_gpu_blocks = 0;  // KV blocks of the cache (on the CPU backend too)
  std::string cache_dtype;     // "float32", "bfloat16", ...
  double gpu_memory_utilization = 0;
  bool enable_prefix_caching = false;
};

// What both workers export about their engine.
class EngineMetrics {
 public:
  EngineMetrics(Registry& registry, std::string_view model_name, Role role);

  Gauge& num_requests_running;  // requests in the engine's execution batches
  Gauge& num_requests_waiting;  // requests waiting in the worker to be scheduled
  Counter& num_preemptions;
  // Prefix caching: prompt tokens looked up at admission and those found cached (vLLM's
  // prefix_cache_queries / hits), cached blocks evicted from the device cache; the host tier's
  // blocks offloaded into it, served back (hits), evicted, and its share in use.
  Counter& prefix_cache_queries;
  Counter& prefix_cache_hits;
  Counter& kv_cache_evictions;
  Counter& host_kv_cache_offloaded_blocks;
  Counter& host_kv_cache_hit_blocks;
  Counter& host_kv_cache_evictions;
  Gauge& host_kv_cache_usage_perc;
  // Tokens in each engine step's forward pass (prompt chunks, decode tokens, verified drafts).
  Histogram& iteration_tokens_total;

  void SetCacheConfig(const CacheConfig& config);

 protected:
  Registry& registry_;
  std::vector<std::string> labels_;  // model_name, role
};

// The prefill worker: prompts and the KV transfers it sends.
class PrefillMetrics : public EngineMetrics {
 public:
  static constexpr Role kRole = Role::kPrefill;
  PrefillMetrics(Registry& registry, std::string_view model_name);

  Counter& prompt_tokens;  // prefill tokens processed
  Histogram& request_prefill_time_seconds;
  Counter& kv_transfer_failures;
  // One observation per transferred request.
  Histogram& kv_transfer_bytes;
  // By path: bytes moved, and the time from the first layer sent to the receiver's
  // acknowledgement of the whole request.
  Counter& kv_transfer_bytes_total(std::string_view path) const;
  Histogram& kv_transfer_seconds(std::string_view path) const;
  // How long the reply waited for the transfer after the prompt's output was ready (0 when the
  // layer-wise transfer had fully overlapped the forward pass).
  Histogram& kv_transfer_wait_seconds;
  // Late KV targets (PrefillRequest.target_follows) by when they came against the forward pass
  // of the step that completes the prompt: "before_forward", "during_forward" (the layers before
  // sent at once) or "after_forward" (sent from the blocks kept for it).
  Counter& kv_late_targets_total(std::string_view arrived) const;

 private:
  Family<Counter>* late_targets_by_arrival_;
  Family<Counter>* transfer_bytes_by_path_;
  Family<Histogram>* transfer_seconds_by_path_;
};

// The decode worker: generated tokens, its KV cache, speculation.
class DecodeMetrics : public EngineMetrics {
 public:
  static constexpr Role kRole = Role::kDecode;
  DecodeMetrics(Registry& registry, std::string_view model_name);

  Gauge& kv_cache_usage_perc;  // 0..1 (1 means 100 percent)
  Counter& generation_tokens;  // every token the worker streams, the prefill's first one included
  Counter& prompt_tokens;      // prompt tokens of the requests prefilled here (DecodeRequest.prefill_here)
  Histogram& request_decode_time_seconds;
  // Speculative decoding (vLLM's spec_decode_* counters).
  Counter& spec_decode_num_drafts;  // verified proposals, one per request and step
  Counter& spec_decode_num_draft_tokens;
  Counter& spec_decode_num_accepted_tokens;
  // Accepted draft tokens at draft position `position` (0 = the first draft token).
  Counter& spec_decode_num_accepted_tokens_per_pos(int position);

 private:
  Family<Counter>* accepted_per_pos_;
};

}  // namespace duet::metrics
