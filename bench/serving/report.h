// The benchmark's results: vLLM benchmark_serving's text table, and a JSON document (the run's
// settings, the metrics, and per-request figures) for --result-json.
#pragma once

#include <string>
#include <vector>

#include "bench/serving/metrics.h"
#include "nlohmann/json.hpp"

namespace duet::bench {

// What was run, for the report's header and the JSON.
struct RunInfo {
  std::string backend, base_url, model, dataset;
  int num_prompts = 0;
  double request_rate = 0;   // inf: all at once
  double burstiness = 1;
  int max_concurrency = 0;   // 0: no cap
  bool ignore_eos = false;
  uint64_t seed = 0;
};

std::string FormatReport(const RunInfo& info, const BenchmarkMetrics& metrics);
// Metrics in milliseconds under vLLM's key names (mean_ttft_ms, p99_itl_ms, ...), plus
// per-request input_lens, output_lens, ttfts, e2els (seconds) and errors.
nlohmann::ordered_json ReportJson(const RunInfo& info, const BenchmarkMetrics& metrics,
                                  const std::vector<RequestResult>& results);

}  // namespace duet::bench
