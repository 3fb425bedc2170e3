#include "bench/serving/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/check.h"

namespace duet::bench {

absl::StatusOr<GoodputSlo> ParseGoodput(const std::vector<std::string>& specs) {
  GoodputSlo slo;
  for (const std::string& spec : specs) {
    const size_t colon = spec.find(':');
    double ms = 0;
    if (colon == std::string::npos || !absl::SimpleAtod(spec.substr(colon + 1), &ms) || !(ms > 0) ||
        std::isinf(ms)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--goodput wants NAME:MILLISECONDS with a positive number, e.g. ttft:200; got '", spec, "'"));
    }
    const std::string name = spec.substr(0, colon);
    if (name == "ttft") {
      slo.ttft_ms = ms;
    } else if (name == "tpot") {
      slo.tpot_ms = ms;
    } else if (name == "e2el") {
      slo.e2el_ms = ms;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--goodput: unknown metric '", name, "' (ttft, tpot or e2el)"));
    }
  }
  return slo;
}

double LatencyStats::Percentile(double p) const {
  for (const auto& [q, value] : percentiles) {
    if (q == p) return value;
  }
  return 0;
}

LatencyStats SummarizeLatencies(std::vector<double> samples_ms, const std::vector<double>& percentiles) {
  LatencyStats s;
  for (double p : percentiles) s.percentiles.emplace_back(p, 0.0);
  if (samples_ms.empty()) return s;
  std::sort(samples_ms.begin(), samples_ms.end());
  s.count = int(samples_ms.size());
  s.mean = std::accumulate(samples_ms.begin(), samples_ms.end(), 0.0) / double(s.count);
  double squares = 0;
  for (double x : samples_ms) squares += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(squares / double(s.count));  // population std, as numpy.std
  s.median = bench::Percentile(samples_ms, 50);
  for (auto& [p, value] : s.percentiles) value = bench::Percentile(samples_ms, p);
  s.max = samples_ms.back();
  return s;
}

namespace {

// Output tokens per whole second since the first send, at the busiest second.
double PeakOutputTokensPerSecond(const std::vector<RequestResult>& results, double first_start) {
  std::map<int64_t, double> per_second;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    for (size_t i = 0; i < r.chunk_times.size(); ++i) {
      const int tokens = i < r.chunk_tokens.size() ? r.chunk_tokens[i] : 1;
      per_second[int64_t(std::floor(r.start_time + r.chunk_times[i] - first_start))] += tokens;
    }
  }
  double peak = 0;
  for (const auto& [second, tokens] : per_second) peak = std::max(peak, tokens);
  return peak;
}

struct SteadyWindow {
  double seconds = 0, output_tokens_per_s = 0;
};
// Output tokens (a chunk's at its arrival) from the first successful request's end to the last
// send of any request, over that window's length. A window shorter than the median request
// (`median_latency_s`) holds a fragment of the loop, not a steady state (one stream: the gap
// between a request's end and the next send), so it counts as none.
SteadyWindow SteadyOutputThroughput(const std::vector<RequestResult>& results, double median_latency_s) {
  double first_end = std::numeric_limits<double>::infinity();
  double last_send = -std::numeric_limits<double>::infinity();
  for (const RequestResult& r : results) {
    last_send = std::max(last_send, r.start_time);
    if (r.success) first_end = std::min(first_end, r.start_time + r.latency);
  }
  if (!(last_send > first_end) || last_send - first_end < median_latency_s) return {};
  double tokens = 0;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    for (size_t i = 0; i < r.chunk_times.size(); ++i) {
      const double at = r.start_time + r.chunk_times[i];
      if (at >= first_end && at <= last_send) tokens += i < r.chunk_tokens.size() ? r.chunk_tokens[i] : 1;
    }
  }
  const double seconds = last_send - first_end;
  return {seconds, tokens / seconds};
}

// The most requests in flight at once, over the half-open intervals [start, start + latency).
int PeakConcurrency(const std::vector<RequestResult>& results) {
  std::vector<std::pair<double, int>> events;
  for (const RequestResult& r : results) {
    if (!r.success) continue;
    events.emplace_back(r.start_time, 1);
    events.emplace_back(r.start_time + r.latency, -1);
  }
  std::sort(events.begin(), events.end());  // at one time, an end (-1) before a start (+1)
  int now = 0, peak = 0;
  for (const auto& [time, delta] : events) peak = std::max(peak, now += delta);
  return peak;
}

}  // namespace

double TimePerOutputToken(const RequestResult& result) {
  if (result.output_tokens <= 1 || result.chunk_times.empty()) return 0;
  return (result.latency - result.chunk_times.front()) / double(result.output_tokens - 1);
}

BenchmarkMetrics ComputeMetrics(const std::vector<RequestResult>& results, double duration_s, const GoodputSlo& slo,
                                const std::vector<double>& percentiles) {
  BenchmarkMetrics m;
  m.duration_s = duration_s;
  std::vector<double> ttft, tpot, itl, e2el, ttft_first_turn, ttft_later_turns;
  bool multi_turn = false;
  int good = 0;
  for (const RequestResult& r : results) {
    multi_turn = multi_turn || r.turn >= 0;
    if (!r.success) {
      ++m.failed;
      continue;
    }
    ++m.completed;
    m.total_input_tokens += r.prompt_tokens;
    m.total_output_tokens += r.output_tokens;
    const double first = r.chunk_times.empty() ? r.latency : r.chunk_times.front();
    const double per_token = TimePerOutputToken(r);
    ttft.push_back(first * 1e3);
    if (r.turn >= 0) (r.turn == 0 ? ttft_first_turn : ttft_later_turns).push_back(first * 1e3);
    e2el.push_back(r.latency * 1e3);
    if (r.output_tokens > 1) tpot.push_back(per_token * 1e3);
    for (size_t i = 1; i < r.chunk_times.size(); ++i) itl.push_back((r.chunk_times[i] - r.chunk_times[i - 1]) * 1e3);
    const bool meets = (!slo.ttft_ms || first * 1e3 <= *slo.ttft_ms) &&
                       (!slo.tpot_ms || per_token * 1e3 <= *slo.tpot_ms) &&
                       (!slo.e2el_ms || r.latency * 1e3 <= *slo.e2el_ms);
    if (meets) ++good;
  }
  if (duration_s > 0) {
    m.request_throughput = m.completed / duration_s;
    m.output_throughput = double(m.total_output_tokens) / duration_s;
    m.total_token_throughput = double(m.total_input_tokens + m.total_output_tokens) / duration_s;
    if (slo.any()) m.request_goodput = good / duration_s;
  } else if (slo.any()) {
    m.request_goodput = 0.0;
  }
  m.ttft = SummarizeLatencies(std::move(ttft), percentiles);
  m.tpot = SummarizeLatencies(std::move(tpot), percentiles);
  m.itl = SummarizeLatencies(std::move(itl), percentiles);
  m.e2el = SummarizeLatencies(std::move(e2el), percentiles);
  if (multi_turn) {
    m.ttft_first_turn = SummarizeLatencies(std::move(ttft_first_turn), percentiles);
    m.ttft_later_turns = SummarizeLatencies(std::move(ttft_later_turns), percentiles);
  }
  double first_start = std::numeric_limits<double>::infinity();
  for (const RequestResult& r : results) {
    if (r.success) first_start = std::min(first_start, r.start_time);
  }
  if (m.completed > 0) {
    m.max_output_tokens_per_s = PeakOutputTokensPerSecond(results, first_start);
    m.max_concurrent_requests = PeakConcurrency(results);
    const SteadyWindow steady = SteadyOutputThroughput(results, m.e2el.median / 1e3);
    m.steady_window_s = steady.seconds;
    m.steady_output_throughput = steady.output_tokens_per_s;
  }
  return m;
}

absl::StatusOr<std::vector<std::string>> ParsePercentileMetrics(const std::string& list) {
  std::vector<std::string> metrics;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    const std::string name(absl::StripAsciiWhitespace(part));
    if (name != "ttft" && name != "tpot" && name != "itl" && name != "e2el") {
      return absl::InvalidArgumentError(
          absl::StrCat("--percentile-metrics: unknown metric '", name, "' (ttft, tpot, itl, e2el)"));
    }
    if (std::find(metrics.begin(), metrics.end(), name) == metrics.end()) metrics.push_back(name);
  }
  return metrics;
}

absl::StatusOr<std::vector<double>> ParseMetricPercentiles(const std::string& list) {
  std::vector<double> percentiles;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    double p = 0;
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(part), &p) || !(p >= 0 && p <= 100)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metric-percentiles wants numbers in [0, 100] separated by commas, got '", list, "'"));
    }
    percentiles.push_back(p);
  }
  return percentiles;
}

std::string PercentileName(double p) { return absl::StrFormat("%g", p); }

}  // namespace duet::bench
