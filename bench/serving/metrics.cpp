#include "bench/serving/metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

LatencyStats SummarizeLatencies(std::vector<double> samples_ms) {
  LatencyStats s;
  if (samples_ms.empty()) return s;
  std::sort(samples_ms.begin(), samples_ms.end());
  s.count = int(samples_ms.size());
  s.mean = std::accumulate(samples_ms.begin(), samples_ms.end(), 0.0) / double(s.count);
  double squares = 0;
  for (double x : samples_ms) squares += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(squares / double(s.count));  // population std, as numpy.std
  s.median = Percentile(samples_ms, 50);
  s.p90 = Percentile(samples_ms, 90);
  s.p99 = Percentile(samples_ms, 99);
  s.max = samples_ms.back();
  return s;
}

double TimePerOutputToken(const RequestResult& result) {
  if (result.output_tokens <= 1 || result.chunk_times.empty()) return 0;
  return (result.latency - result.chunk_times.front()) / double(result.output_tokens - 1);
}

BenchmarkMetrics ComputeMetrics(const std::vector<RequestResult>& results, double duration_s,
                                const GoodputSlo& slo) {
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
  m.ttft = SummarizeLatencies(std::move(ttft));
  m.tpot = SummarizeLatencies(std::move(tpot));
  m.itl = SummarizeLatencies(std::move(itl));
  m.e2el = SummarizeLatencies(std::move(e2el));
  if (multi_turn) {
    m.ttft_first_turn = SummarizeLatencies(std::move(ttft_first_turn));
    m.ttft_later_turns = SummarizeLatencies(std::move(ttft_later_turns));
  }
  return m;
}

}  // namespace duet::bench
