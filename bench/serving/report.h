// The benchmark's results: vLLM bench serve's text table, and its result JSON (the run's
// settings, the metrics, and with `detailed` the per-request figures).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "bench/serving/metrics.h"
#include "nlohmann/json.hpp"

namespace duet::bench {

// What was run, for the report's header and the JSON.
struct RunInfo {
  std::string backend, base_url, model, dataset;
  std::string label;         // vLLM's --label; empty: none (the file name uses the backend)
  std::string model_id;      // --model (what the tokenizer and file name go by)
  std::string tokenizer_id;  // --tokenizer, else model_id
  int num_prompts = 0;
  double request_rate = 0;   // inf: all at once
  double burstiness = 1;
  int max_concurrency = 0;   // 0: no cap
  bool ignore_eos = false;
  uint64_t seed = 0;
  // The latency metrics reported ("ttft", "tpot", "itl", "e2el"), in that order.
  std::vector<std::string> percentile_metrics = {"ttft", "tpot", "itl", "e2el"};
  std::vector<std::pair<std::string, std::string>> metadata;  // --metadata KEY=VALUE, into the JSON
  std::string date;  // of the run, as vLLM writes it (%Y%m%d-%H%M%S, local time): RunDate()
};

// Now, as RunInfo::date.
std::string RunDate();

std::string FormatReport(const RunInfo& info, const BenchmarkMetrics& metrics);
// vLLM's keys: date, endpoint_type, backend, label, model_id, tokenizer_id, num_prompts, the
// metadata, request_rate, burstiness, max_concurrency, duration, completed, failed, token totals,
// throughputs, max_output_tokens_per_s, max_concurrent_requests, and per reported metric
// mean_/median_/std_/p<P>_<metric>_ms (and Duet's max_<metric>_ms). `detailed` (vLLM's
// --save-detailed) adds per request: input_lens, output_lens, ttfts, itls, latencies, start_times
// (seconds), generated_texts and errors.
nlohmann::ordered_json ReportJson(const RunInfo& info, const BenchmarkMetrics& metrics,
                                  const std::vector<RequestResult>& results, bool detailed);

// vLLM's result file name: <label or backend>-<rate>qps[-concurrency<N>]-<model id's last path
// part>-<date>.json.
std::string ResultFileName(const RunInfo& info);

}  // namespace duet::bench
