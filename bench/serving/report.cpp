#include "bench/serving/report.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace duet::bench {
namespace {

using OrderedJson = nlohmann::ordered_json;

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

// The reported sections, in the table's order.
std::vector<const Section*> Reported(const RunInfo& info) {
  std::vector<const Section*> out;
  for (const Section& s : kSections) {
    for (const std::string& m : info.percentile_metrics) {
      if (m == s.key) out.push_back(&s);
    }
  }
  return out;
}

// multi-turn: TTFT of the first turns and of the later ones, reported under TTFT.
struct TurnStats {
  const char* key;    // in the JSON's keys: median_ttft_<key>_ms
  const char* title;  // in the table's rows
  const LatencyStats* stats;
};
std::vector<TurnStats> TurnSections(const BenchmarkMetrics& m) {
  if (!m.ttft_first_turn || !m.ttft_later_turns) return {};
  return {{"first_turn", "first turns", &*m.ttft_first_turn}, {"later_turns", "later turns", &*m.ttft_later_turns}};
}

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
                  Row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s),
                  Row("Peak concurrent requests:", absl::StrCat(m.max_concurrent_requests)),
                  Row("Steady output token throughput (tok/s):", m.steady_output_throughput),
                  Row("Steady window (s):", m.steady_window_s),
                  Row("Total token throughput (tok/s):", m.total_token_throughput));
  for (const Section* s : Reported(info)) {
    const LatencyStats& stats = m.*s->stats;
    absl::StrAppend(&out, Rule(s->title, '-'), Row(absl::StrCat("Mean ", s->short_name, " (ms):"), stats.mean),
                    Row(absl::StrCat("Median ", s->short_name, " (ms):"), stats.median));
    for (const auto& [p, value] : stats.percentiles) {
      absl::StrAppend(&out, Row(absl::StrCat("P", PercentileName(p), " ", s->short_name, " (ms):"), value));
    }
    if (s->stats == &BenchmarkMetrics::ttft) {
      for (const TurnStats& turns : TurnSections(m)) {
        absl::StrAppend(&out, Row(absl::StrCat("Median TTFT, ", turns.title, " (ms):"), turns.stats->median));
        for (const auto& [p, value] : turns.stats->percentiles) {
          absl::StrAppend(&out, Row(absl::StrCat("P", PercentileName(p), " TTFT, ", turns.title, " (ms):"), value));
        }
      }
    }
  }
  absl::StrAppend(&out, std::string(kWidth, '='), "\n");
  return out;
}

OrderedJson ReportJson(const RunInfo& info, const BenchmarkMetrics& m, const std::vector<RequestResult>& results,
                bool detailed) {
  OrderedJson j;
  j["date"] = info.date;
  j["endpoint_type"] = info.backend;
  j["backend"] = info.backend;
  j["label"] = info.label.empty() ? OrderedJson() : OrderedJson(info.label);
  j["model_id"] = info.model_id.empty() ? OrderedJson() : OrderedJson(info.model_id);
  j["tokenizer_id"] = info.tokenizer_id.empty() ? OrderedJson() : OrderedJson(info.tokenizer_id);
  j["num_prompts"] = info.num_prompts;
  for (const auto& [key, value] : info.metadata) j[key] = value;
  j["request_rate"] = std::isinf(info.request_rate) ? OrderedJson("inf") : OrderedJson(info.request_rate);
  j["burstiness"] = info.burstiness;
  j["max_concurrency"] = info.max_concurrency > 0 ? OrderedJson(info.max_concurrency) : OrderedJson();
  j["base_url"] = info.base_url;
  j["model"] = info.model;
  j["dataset"] = info.dataset;
  j["ignore_eos"] = info.ignore_eos;
  j["seed"] = info.seed;
  j["duration"] = m.duration_s;
  j["completed"] = m.completed;
  j["failed"] = m.failed;
  j["total_input_tokens"] = m.total_input_tokens;
  j["total_output_tokens"] = m.total_output_tokens;
  j["request_throughput"] = m.request_throughput;
  j["request_goodput"] = m.request_goodput ? OrderedJson(*m.request_goodput) : OrderedJson();
  j["output_throughput"] = m.output_throughput;
  j["total_token_throughput"] = m.total_token_throughput;
  if (detailed) {
    OrderedJson input_lens = OrderedJson::array(), output_lens = input_lens, ttfts = input_lens, itls = input_lens,
         latencies = input_lens, start_times = input_lens, texts = input_lens, errors = input_lens;
    for (const RequestResult& r : results) {
      input_lens.push_back(r.prompt_tokens);
      output_lens.push_back(r.success ? r.output_tokens : 0);
      ttfts.push_back(r.success && !r.chunk_times.empty() ? r.chunk_times.front() : 0.0);
      OrderedJson gaps = OrderedJson::array();
      for (size_t i = 1; i < r.chunk_times.size(); ++i) gaps.push_back(r.chunk_times[i] - r.chunk_times[i - 1]);
      itls.push_back(std::move(gaps));
      latencies.push_back(r.latency);
      start_times.push_back(r.start_time);
      texts.push_back(r.output_text);
      errors.push_back(r.error);
    }
    j["input_lens"] = std::move(input_lens);
    j["output_lens"] = std::move(output_lens);
    j["ttfts"] = std::move(ttfts);
    j["itls"] = std::move(itls);
    j["latencies"] = std::move(latencies);
    j["start_times"] = std::move(start_times);
    j["generated_texts"] = std::move(texts);
    j["errors"] = std::move(errors);
  }
  j["max_output_tokens_per_s"] = m.max_output_tokens_per_s;
  j["max_concurrent_requests"] = m.max_concurrent_requests;
  j["steady_output_throughput"] = m.steady_output_throughput;
  j["steady_window_s"] = m.steady_window_s;
  for (const Section* s : Reported(info)) {
    const LatencyStats& stats = m.*s->stats;
    j[absl::StrCat("mean_", s->key, "_ms")] = stats.mean;
    j[absl::StrCat("median_", s->key, "_ms")] = stats.median;
    j[absl::StrCat("std_", s->key, "_ms")] = stats.stddev;
    for (const auto& [p, value] : stats.percentiles) j[absl::StrCat("p", PercentileName(p), "_", s->key, "_ms")] = value;
    j[absl::StrCat("max_", s->key, "_ms")] = stats.max;
    if (s->stats != &BenchmarkMetrics::ttft) continue;
    for (const TurnStats& turns : TurnSections(m)) {
      j[absl::StrCat("mean_ttft_", turns.key, "_ms")] = turns.stats->mean;
      j[absl::StrCat("median_ttft_", turns.key, "_ms")] = turns.stats->median;
      for (const auto& [p, value] : turns.stats->percentiles) {
        j[absl::StrCat("p", PercentileName(p), "_ttft_", turns.key, "_ms")] = value;
      }
    }
  }
  return j;
}

std::string RunDate() { return absl::FormatTime("%Y%m%d-%H%M%S", absl::Now(), absl::LocalTimeZone()); }

std::string ResultFileName(const RunInfo& info) {
  // Python's repr of the float rate, as vLLM writes it: inf, 4.0, 0.5.
  const std::string rate = std::isinf(info.request_rate)                       ? "inf"
                           : info.request_rate == std::floor(info.request_rate) ? absl::StrFormat("%.1f", info.request_rate)
                                                                                : absl::StrFormat("%g", info.request_rate);
  const std::string concurrency = info.max_concurrency > 0 ? absl::StrCat("-concurrency", info.max_concurrency) : "";
  std::string model = info.model_id.empty() ? info.model : info.model_id;
  while (model.ends_with('/')) model.pop_back();
  model = model.substr(model.find_last_of('/') + 1);
  return absl::StrCat(info.label.empty() ? info.backend : info.label, "-", rate, "qps", concurrency, "-", model, "-",
                      info.date, ".json");
}

}  // namespace duet::bench
