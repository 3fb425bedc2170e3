#include "bench/serving/report.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace duet::bench {
namespace {

constexpr int kWidth = 50;

std::string Rule(const std::string& title, char fill) {
  const int pad = kWidth - int(title.size());
  return absl::StrCat(std::string(size_t(pad / 2), fill), title, std::string(size_t(pad - pad / 2), fill), "\n");
}

std::string Row(const std::string& name, const std::string& value) { return absl::StrFormat("%-40s%10s\n", name, value); }
std::string Row(const std::string& name, double value) { return Row(name, absl::StrFormat("%.2f", value)); }

struct Section {
  const char* key;
  const char* short_name;
  const char* title;
  LatencyStats BenchmarkMetrics::*stats;
};
constexpr Section kSections[] = {
    {"ttft", "TTFT", "Time to First Token", &BenchmarkMetrics::ttft},
    {"tpot", "TPOT", "Time per Output Token (excl. 1st token)", &BenchmarkMetrics::tpot},
    {"itl", "ITL", "Inter-token Latency", &BenchmarkMetrics::itl},
    {"e2el", "E2EL", "End-to-end Latency", &BenchmarkMetrics::e2el},
};

std::string Rate(double rate) { return std::isinf(rate) ? "inf" : absl::StrFormat("%g", rate); }

}  // namespace

std::string FormatReport(const RunInfo& info, const BenchmarkMetrics& m) {
  std::string out = Rule(" Serving Benchmark Result ", '=');
  absl::StrAppend(&out, Row("Backend:", info.backend), Row("Dataset:", info.dataset),
                  Row("Request rate (req/s):", Rate(info.request_rate)),
                  Row("Burstiness:", absl::StrFormat("%g", info.burstiness)),
                  Row("Max concurrency:", info.max_concurrency > 0 ? absl::StrCat(info.max_concurrency) : "none"),
                  Row("Successful requests:", absl::StrCat(m.completed)),
                  Row("Failed requests:", absl::StrCat(m.failed)), Row("Benchmark duration (s):", m.duration_s),
                  Row("Total input tokens:", absl::StrCat(m.total_input_tokens)),
                  Row("Total generated tokens:", absl::StrCat(m.total_output_tokens)),
                  Row("Request throughput (req/s):", m.request_throughput));
  if (m.request_goodput) absl::StrAppend(&out, Row("Request goodput (req/s):", *m.request_goodput));
  absl::StrAppend(&out, Row("Output token throughput (tok/s):", m.output_throughput),
                  Row("Total token throughput (tok/s):", m.total_token_throughput));
  for (const Section& s : kSections) {
    const LatencyStats& stats = m.*s.stats;
    absl::StrAppend(&out, Rule(s.title, '-'), Row(absl::StrCat("Mean ", s.short_name, " (ms):"), stats.mean),
                    Row(absl::StrCat("Median ", s.short_name, " (ms):"), stats.median),
                    Row(absl::StrCat("P90 ", s.short_name, " (ms):"), stats.p90),
                    Row(absl::StrCat("P99 ", s.short_name, " (ms):"), stats.p99));
    if (s.stats == &BenchmarkMetrics::ttft && m.ttft_first_turn && m.ttft_later_turns) {
      absl::StrAppend(&out, Row("Median TTFT, first turns (ms):", m.ttft_first_turn->median),
                      Row("P99 TTFT, first turns (ms):", m.ttft_first_turn->p99),
                      Row("Median TTFT, later turns (ms):", m.ttft_later_turns->median),
                      Row("P99 TTFT, later turns (ms):", m.ttft_later_turns->p99));
    }
  }
  absl::StrAppend(&out, std::string(kWidth, '='), "\n");
  return out;
}

nlohmann::ordered_json ReportJson(const RunInfo& info, const BenchmarkMetrics& m,
                                  const std::vector<RequestResult>& results) {
  nlohmann::ordered_json j;
  j["date"] = absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
  j["backend"] = info.backend;
  j["base_url"] = info.base_url;
  j["model"] = info.model;
  j["dataset"] = info.dataset;
  j["num_prompts"] = info.num_prompts;
  j["request_rate"] = std::isinf(info.request_rate) ? nlohmann::ordered_json("inf") : nlohmann::ordered_json(info.request_rate);
  j["burstiness"] = info.burstiness;
  j["max_concurrency"] = info.max_concurrency > 0 ? nlohmann::ordered_json(info.max_concurrency) : nlohmann::ordered_json();
  j["ignore_eos"] = info.ignore_eos;
  j["seed"] = info.seed;
  j["duration"] = m.duration_s;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input_tokens;
  j["total_output_tokens"] = m.total_output_tokens;
  j["request_throughput"] = m.request_throughput;
  j["request_goodput"] = m.request_goodput ? nlohmann::ordered_json(*m.request_goodput) : nlohmann::ordered_json();
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  for (const Section& s : kSections) {
    const LatencyStats& stats = m.*s.stats;
    j[absl::StrCat("mean_", s.key, "_ms")] = stats.mean;
    j[absl::StrCat("median_", s.key, "_ms")] = stats.median;
    j[absl::StrCat("std_", s.key, "_ms")] = stats.stddev;
    j[absl::StrCat("p90_", s.key, "_ms")] = stats.p90;
    j[absl::StrCat("p99_", s.key, "_ms")] = stats.p99;
    j[absl::StrCat("max_", s.key, "_ms")] = stats.max;
  }
  for (const auto& [name, stats] : {std::pair{"first_turn", &m.ttft_first_turn}, std::pair{"later_turns", &m.ttft_later_turns}}) {
    if (!stats->has_value()) continue;
    j[absl::StrCat("mean_ttft_", name, "_ms")] = (*stats)->mean;
    j[absl::StrCat("median_ttft_", name, "_ms")] = (*stats)->median;
    j[absl::StrCat("p99_ttft_", name, "_ms")] = (*stats)->p99;
  }
  nlohmann::ordered_json input_lens = nlohmann::ordered_json::array(), output_lens = input_lens, ttfts = input_lens,
                         e2els = input_lens, errors = input_lens;
  for (const RequestResult& r : results) {
    input_lens.push_back(r.prompt_tokens);
    output_lens.push_back(r.output_tokens);
    ttfts.push_back(r.success && !r.chunk_times.empty() ? r.chunk_times.front() : 0.0);
    e2els.push_back(r.latency);
    errors.push_back(r.error);
  }
  j["input_lens"] = std::move(input_lens);
  j["output_lens"] = std::move(output_lens);
  j["ttfts"] = std::move(ttfts);
  j["e2els"] = std::move(e2els);
  j["errors"] = std::move(errors);
  return j;
}

}  // namespace duet::bench
