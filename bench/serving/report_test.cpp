#include "bench/serving/report.h"

#include <limits>

#include "gtest/gtest.h"

namespace duet::bench {
namespace {

RequestResult Ok(std::vector<double> chunk_times, int output_tokens, double latency) {
  RequestResult r;
  r.success = true;
  r.prompt_tokens = 10;
  r.output_tokens = output_tokens;
  r.chunk_times = std::move(chunk_times);
  r.latency = latency;
  return r;
}

TEST(Report, TextTableHasVllmRows) {
  const std::vector<RequestResult> results = {Ok({0.1, 0.2}, 2, 0.2), Ok({0.3, 0.4, 0.5}, 3, 0.5)};
  const BenchmarkMetrics m = ComputeMetrics(results, 1.0, *ParseGoodput({"ttft:200"}));
  const RunInfo info{.backend = "duet-grpc", .dataset = "random", .num_prompts = 2,
                     .request_rate = std::numeric_limits<double>::infinity()};
  const std::string text = FormatReport(info, m);
  for (const char* row : {"Successful requests:", "Benchmark duration (s):", "Total input tokens:",
                          "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
                          "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):",
                          "P90 E2EL (ms):", "Request rate (req/s):                          inf"}) {
    EXPECT_NE(text.find(row), std::string::npos) << row << "\n" << text;
  }
  EXPECT_NE(text.find("Mean TTFT (ms):                             200.00"), std::string::npos) << text;
}

TEST(Report, JsonHasMetricsAndPerRequestFigures) {
  RequestResult failed;
  failed.error = "HTTP 503: busy";
  const std::vector<RequestResult> results = {Ok({0.1, 0.2}, 2, 0.2), failed};
  const BenchmarkMetrics m = ComputeMetrics(results, 2.0, {});
  const RunInfo info{.backend = "openai-chat", .model = "tiny", .num_prompts = 2, .request_rate = 4, .max_concurrency = 8};
  const nlohmann::ordered_json j = ReportJson(info, m, results);
  EXPECT_EQ(j["completed"], 1);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_EQ(j["request_rate"], 4.0);
  EXPECT_EQ(j["max_concurrency"], 8);
  EXPECT_TRUE(j["request_goodput"].is_null());
  EXPECT_DOUBLE_EQ(j["mean_ttft_ms"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(j["median_tpot_ms"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(j["p99_e2el_ms"].get<double>(), 200);
  EXPECT_TRUE(j.contains("p90_itl_ms"));
  EXPECT_EQ(j["output_lens"], nlohmann::ordered_json::parse("[2, 0]"));
  EXPECT_EQ(j["errors"][1], "HTTP 503: busy");
  EXPECT_DOUBLE_EQ(j["ttfts"][0].get<double>(), 0.1);
}

}  // namespace
}  // namespace duet::bench
