#include "bench/serving/metrics.h"

#include <cmath>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace duet::bench {
namespace {

RequestResult Ok(std::vector<double> chunk_times, int output_tokens, double latency, int prompt_tokens = 10) {
  RequestResult r;
  r.success = true;
  r.prompt_tokens = prompt_tokens;
  r.output_tokens = output_tokens;
  r.chunk_times = std::move(chunk_times);
  r.latency = latency;
  return r;
}

TEST(SummarizeLatencies, MeanMedianStdAndTails) {
  const LatencyStats s = SummarizeLatencies({3, 1, 2, 4});
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 2.5);
  EXPECT_DOUBLE_EQ(s.median, 2.5);
  EXPECT_DOUBLE_EQ(s.stddev, std::sqrt(1.25));  // population std, as numpy.std
  EXPECT_DOUBLE_EQ(s.Percentile(90), 3.7);
  EXPECT_DOUBLE_EQ(s.Percentile(99), 3.97);
  EXPECT_DOUBLE_EQ(s.max, 4);
  EXPECT_EQ(SummarizeLatencies({}).count, 0);
  EXPECT_EQ(SummarizeLatencies({}).Percentile(99), 0);
  // Asked-for percentiles, in the order asked.
  const LatencyStats t = SummarizeLatencies({3, 1, 2, 4}, {50, 99.9, 25});
  ASSERT_EQ(t.percentiles.size(), 3u);
  EXPECT_EQ(t.percentiles[1].first, 99.9);
  EXPECT_DOUBLE_EQ(t.percentiles[1].second, 3.997);
  EXPECT_DOUBLE_EQ(t.Percentile(25), 1.75);
  EXPECT_EQ(t.Percentile(90), 0);  // not asked
}

// vLLM's peaks: output tokens in the busiest whole second since the first send (a chunk's tokens
// at its arrival), and requests in flight at once.
TEST(ComputeMetrics, PeakTokensPerSecondAndConcurrency) {
  RequestResult a = Ok({0.5, 0.9, 1.2}, 6, 1.5);  // sent at 0: chunks at 0.5, 0.9 (second 0), 1.2 (second 1)
  a.chunk_tokens = {1, 3, 2};
  RequestResult b = Ok({0.4, 0.6}, 2, 0.8);  // sent at 0.5: chunks at 0.9, 1.1
  b.start_time = 0.5;
  RequestResult c = Ok({0.1}, 1, 0.2);  // sent at 1.5 (a ended then): [1.5, 1.7), chunk 1.6
  c.start_time = 1.5;
  RequestResult failed;  // not counted
  failed.start_time = 0.1;
  failed.latency = 5;
  const BenchmarkMetrics m = ComputeMetrics({a, b, c, failed}, 2.0, {});
  EXPECT_DOUBLE_EQ(m.max_output_tokens_per_s, 5);  // second 0: 1 + 3 (a) + 1 (b)
  EXPECT_EQ(m.max_concurrent_requests, 2);         // a and b; c starts as a ends
  EXPECT_EQ(ComputeMetrics({failed}, 1.0, {}).max_concurrent_requests, 0);
}

// A request sent at `start` that takes 1 s, a token at every 0.25 s.
RequestResult SentAt(double start) {
  RequestResult r = Ok({0.25, 0.5, 0.75, 1.0}, 4, 1.0);
  r.start_time = start;
  return r;
}

// The steady window runs from the first request's end to the last send: a closed loop of two
// streams, each request 1 s long with a token at every 0.25 s, the last one sent at 2.0.
TEST(ComputeMetrics, SteadyThroughputFromTheFirstEndToTheLastSend) {
  // Stream 1 sends at 0, 1, 2; stream 2 (its prompt later: the ramp) at 0.5, 1.5.
  const BenchmarkMetrics m = ComputeMetrics({SentAt(0), SentAt(1), SentAt(2), SentAt(0.5), SentAt(1.5)}, 3.0, {});
  EXPECT_DOUBLE_EQ(m.steady_window_s, 1.0);  // [1.0, 2.0]
  // Tokens in [1.0, 2.0]: stream 1's at 1.0 (its first request) and 1.25 to 2.0 (its second: 4);
  // stream 2's at 1.0, 1.25, 1.5 (its first) and 1.75, 2.0 (its second).
  EXPECT_DOUBLE_EQ(m.steady_output_throughput, 10);
  // A chunk's tokens count as one chunk's (gRPC streams carry several).
  RequestResult chunky = SentAt(0);
  chunky.chunk_tokens = {1, 1, 1, 5};  // 5 at 1.0
  EXPECT_DOUBLE_EQ(ComputeMetrics({chunky, SentAt(0.5), SentAt(2.0)}, 3.0, {}).steady_output_throughput,
                   5 + 3);  // [1.0, 2.0]: the 5 at 1.0, and the 0.5 request's at 1.0, 1.25, 1.5
  // Every request sent before the first one ended: no window.
  const BenchmarkMetrics burst = ComputeMetrics({SentAt(0), SentAt(0.5)}, 1.5, {});
  EXPECT_EQ(burst.steady_window_s, 0);
  EXPECT_EQ(burst.steady_output_throughput, 0);
}

// One stream, two requests: the window from the first's end to the second's send is the gap
// between them, shorter than a request, and its tokens (the first's last chunk) over that gap
// are no rate. As short a window in a longer loop is none either; one as long as the median
// request is kept.
TEST(ComputeMetrics, SteadyWindowShorterThanTheMedianRequestIsNone) {
  const BenchmarkMetrics one_stream = ComputeMetrics({SentAt(0), SentAt(1.001)}, 2.001, {});
  EXPECT_EQ(one_stream.steady_window_s, 0);
  EXPECT_EQ(one_stream.steady_output_throughput, 0);
  EXPECT_EQ(ComputeMetrics({SentAt(0), SentAt(0.2), SentAt(1.9)}, 2.9, {}).steady_window_s, 0);  // 0.9 < 1.0
  EXPECT_DOUBLE_EQ(ComputeMetrics({SentAt(0), SentAt(0.2), SentAt(2.0)}, 3.0, {}).steady_window_s, 1.0);
}

TEST(ParsePercentiles, MetricsAndPercentiles) {
  EXPECT_EQ(*ParsePercentileMetrics("ttft,itl, e2el,ttft"), (std::vector<std::string>{"ttft", "itl", "e2el"}));
  EXPECT_FALSE(ParsePercentileMetrics("ttft,latency").ok());
  EXPECT_EQ(*ParseMetricPercentiles("50, 99.9,100"), (std::vector<double>{50, 99.9, 100}));
  for (const char* bad : {"", "101", "-1", "x", "50,,90"}) EXPECT_FALSE(ParseMetricPercentiles(bad).ok()) << bad;
  EXPECT_EQ(PercentileName(99), "99");
  EXPECT_EQ(PercentileName(99.9), "99.9");
}

TEST(ComputeMetrics, OneKnownTimeline) {
  // First chunk at 100 ms, then chunks at 150, 250, 300 ms; 4 tokens; the stream ends at 300 ms.
  const BenchmarkMetrics m = ComputeMetrics({Ok({0.1, 0.15, 0.25, 0.3}, 4, 0.3)}, 1.0, {});
  EXPECT_EQ(m.completed, 1);
  EXPECT_DOUBLE_EQ(m.ttft.mean, 100);
  EXPECT_NEAR(m.tpot.mean, 200.0 / 3, 1e-9);  // (300 − 100) / (4 − 1)
  ASSERT_EQ(m.itl.count, 3);
  EXPECT_NEAR(m.itl.mean, 200.0 / 3, 1e-9);
  EXPECT_NEAR(m.itl.median, 50, 1e-9);
  EXPECT_NEAR(m.itl.max, 100, 1e-9);
  EXPECT_DOUBLE_EQ(m.e2el.mean, 300);
}

TEST(ComputeMetrics, MultiTurnSplitsTtftIntoFirstAndLaterTurns) {
  EXPECT_FALSE(ComputeMetrics({Ok({0.1}, 1, 0.1)}, 1.0, {}).ttft_first_turn.has_value());
  std::vector<RequestResult> results;
  for (auto [turn, ttft] : {std::pair{0, 0.4}, std::pair{1, 0.1}, std::pair{0, 0.6}, std::pair{2, 0.2}}) {
    results.push_back(Ok({ttft}, 1, ttft));
    results.back().turn = turn;
  }
  const BenchmarkMetrics m = ComputeMetrics(results, 1.0, {});
  ASSERT_TRUE(m.ttft_first_turn.has_value() && m.ttft_later_turns.has_value());
  EXPECT_EQ(m.ttft_first_turn->count, 2);
  EXPECT_NEAR(m.ttft_first_turn->median, 500, 1e-9);
  EXPECT_EQ(m.ttft_later_turns->count, 2);
  EXPECT_NEAR(m.ttft_later_turns->median, 150, 1e-9);
  EXPECT_NEAR(m.ttft.median, 300, 1e-9);
}

TEST(ComputeMetrics, ChunksOfSeveralTokensGiveOneItlEach) {
  // 6 tokens in 3 chunks (e.g. speculative decoding): ITL per chunk, TPOT per token.
  const BenchmarkMetrics m = ComputeMetrics({Ok({0.2, 0.3, 0.45}, 6, 0.45)}, 1.0, {});
  EXPECT_EQ(m.itl.count, 2);
  EXPECT_NEAR(m.itl.mean, 125, 1e-9);
  EXPECT_NEAR(m.tpot.mean, 50, 1e-9);  // (450 − 200) / 5
}

TEST(ComputeMetrics, TotalsThroughputAndFailures) {
  RequestResult failed;
  failed.error = "boom";
  failed.latency = 0.5;
  failed.prompt_tokens = 1000;  // not counted
  const std::vector<RequestResult> results = {Ok({0.1, 0.2}, 2, 0.2, 10), Ok({0.3}, 1, 0.3, 30), failed,
                                              Ok({0.2, 0.4, 0.6}, 3, 0.6, 20)};
  const BenchmarkMetrics m = ComputeMetrics(results, 2.0, {});
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_EQ(m.total_input_tokens, 60);
  EXPECT_EQ(m.total_output_tokens, 6);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.5);
  EXPECT_DOUBLE_EQ(m.output_throughput, 3);
  EXPECT_DOUBLE_EQ(m.total_token_throughput, 33);
  EXPECT_FALSE(m.request_goodput.has_value());
  EXPECT_EQ(m.ttft.count, 3);
  EXPECT_NEAR(m.ttft.median, 200, 1e-9);
  EXPECT_EQ(m.tpot.count, 2);  // the one-token request has no TPOT
  EXPECT_NEAR(m.tpot.mean, (100 + 200) / 2.0, 1e-9);
  EXPECT_EQ(m.itl.count, 3);
  EXPECT_NEAR(m.e2el.mean, (200 + 300 + 600) / 3.0, 1e-9);
}

TEST(ComputeMetrics, GoodputCountsRequestsMeetingEverySlo) {
  const std::vector<RequestResult> results = {
      Ok({0.1, 0.2}, 2, 0.2),          // ttft 100, tpot 100, e2el 200
      Ok({0.3, 0.35}, 2, 0.35),        // ttft 300: misses ttft
      Ok({0.1, 0.5}, 2, 0.5),          // tpot 400: misses tpot
      Ok({0.05, 0.1, 0.15}, 3, 0.15),  // good
  };
  absl::StatusOr<GoodputSlo> slo = ParseGoodput({"ttft:200", "tpot:150"});
  ASSERT_TRUE(slo.ok());
  BenchmarkMetrics m = ComputeMetrics(results, 2.0, *slo);
  ASSERT_TRUE(m.request_goodput.has_value());
  EXPECT_DOUBLE_EQ(*m.request_goodput, 1.0);  // 2 good requests in 2 s
  slo = ParseGoodput({"e2el:160"});
  ASSERT_TRUE(slo.ok());
  m = ComputeMetrics(results, 2.0, *slo);
  EXPECT_DOUBLE_EQ(*m.request_goodput, 0.5);
}

TEST(ParseGoodput, NamesAndValues) {
  absl::StatusOr<GoodputSlo> slo = ParseGoodput({"ttft:200", "tpot:50.5", "e2el:3000"});
  ASSERT_TRUE(slo.ok());
  EXPECT_EQ(*slo->ttft_ms, 200);
  EXPECT_EQ(*slo->tpot_ms, 50.5);
  EXPECT_EQ(*slo->e2el_ms, 3000);
  EXPECT_FALSE(ParseGoodput({}).value().any());
  for (const char* bad : {"ttft", "ttft:", "ttft:-1", "ttft:0", "ttft:abc", "latency:100", "ttft:inf"}) {
    EXPECT_FALSE(ParseGoodput({bad}).ok()) << bad;
  }
}

}  // namespace
}  // namespace duet::bench
