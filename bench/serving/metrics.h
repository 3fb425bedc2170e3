// Serving metrics from per-request timelines, with vLLM benchmark_serving's definitions:
// TTFT = first streamed chunk with output − send; TPOT = (latency − TTFT) / (output tokens − 1)
// for requests with more than one output token; ITL = the gaps between consecutive streamed
// chunks (a chunk may carry several tokens); E2EL = latency. Token totals and throughput count
// completed requests only. Goodput: completed requests per second that meet every given SLO.
// Peaks (vLLM's): the most output tokens in one whole second since the first send (a chunk's
// tokens counted at its arrival) and the most requests in flight at once (successful ones).
// Steady output throughput (Duet's): output tokens per second from the first request's end to
// the last request's send. In a closed loop every stream is busy over that window: the ramp
// while the first requests' prompts fill the server and the drain after the last send are left
// out, as a decode benchmark that times only its steady batch leaves them out.
#pragma once

#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/sample_stats.h"

namespace duet::bench {

// One request as the client saw it. Times are seconds since the request was sent.
struct RequestResult {
  bool success = false;
  std::string error;                 // why it failed
  int prompt_tokens = 0;             // as counted by the server
  int output_tokens = 0;             // from the server's usage or streamed token ids
  std::vector<double> chunk_times;   // arrival of each streamed chunk that carried output
  // Tokens in each of those chunks (gRPC: its token ids; OpenAI streams say nothing: 1 each).
  std::vector<int> chunk_tokens;
  double latency = 0;                // end of the stream
  std::string output_text;           // the streamed text (a multi-turn session's next turn needs it)
  int turn = -1;                     // multi-turn: the turn of its session (0 first); else -1
  double start_time = 0;             // when it was sent, in seconds since the benchmark began
};

// Service-level objectives for goodput, in milliseconds; unset ones are not checked.
struct GoodputSlo {
  std::optional<double> ttft_ms, tpot_ms, e2el_ms;
  bool any() const { return ttft_ms || tpot_ms || e2el_ms; }
};
// "ttft:200", "tpot:50", "e2el:5000" (one per element) → SLOs; bad names or values are errors.
absl::StatusOr<GoodputSlo> ParseGoodput(const std::vector<std::string>& specs);

// The percentiles reported unless --metric-percentiles says otherwise.
inline const std::vector<double> kDefaultPercentiles = {90, 99};

// Milliseconds over a set of samples; all zero when there are none.
struct LatencyStats {
  int count = 0;
  double mean = 0, median = 0, stddev = 0, max = 0;
  std::vector<std::pair<double, double>> percentiles;  // (percentile, value), as asked
  double Percentile(double p) const;                   // the value of an asked percentile, else 0
};
LatencyStats SummarizeLatencies(std::vector<double> samples_ms,
                                const std::vector<double>& percentiles = kDefaultPercentiles);

struct BenchmarkMetrics {
  int completed = 0;
  int failed = 0;
  int64_t total_input_tokens = 0;
  int64_t total_output_tokens = 0;
  double duration_s = 0;
  double request_throughput = 0;       // completed requests / s
  std::optional<double> request_goodput;  // with SLOs: good requests / s
  double output_throughput = 0;        // output tokens / s
  double total_token_throughput = 0;   // (input + output) tokens / s
  double max_output_tokens_per_s = 0;  // the peaks, above
  int max_concurrent_requests = 0;
  // The steady window (above) and its output tokens per second; both 0 when there is none: the
  // last request was sent before the first one ended, or the window is shorter than the median
  // request (a fragment of the loop, as one stream's gap between a request's end and the next send).
  double steady_window_s = 0;
  double steady_output_throughput = 0;
  LatencyStats ttft, tpot, itl, e2el;  // ms
  // multi-turn: TTFT of the sessions' first turns and of the later ones (whose prompts begin with
  // an earlier turn's prompt and answer).
  std::optional<LatencyStats> ttft_first_turn, ttft_later_turns;
};

// `duration_s`: from the first send to the last request's end.
BenchmarkMetrics ComputeMetrics(const std::vector<RequestResult>& results, double duration_s, const GoodputSlo& slo,
                                const std::vector<double>& percentiles = kDefaultPercentiles);

// vLLM's --percentile-metrics ("ttft,tpot,itl,e2el", any of them) and --metric-percentiles
// ("90,99", numbers in [0, 100]); errors name what is wrong.
absl::StatusOr<std::vector<std::string>> ParsePercentileMetrics(const std::string& list);
absl::StatusOr<std::vector<double>> ParseMetricPercentiles(const std::string& list);
// A percentile as vLLM names it in keys and rows: 99 → "99", 99.9 → "99.9".
std::string PercentileName(double p);

// Per request (0 for one output token): (latency − TTFT) / (output tokens − 1), in seconds.
double TimePerOutputToken(const RequestResult& result);

}  // namespace duet::bench
