#include "bench/serving/report.h"

#include <limits>
#include <utility>

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
  const nlohmann::ordered_json j = ReportJson(info, m, results, /*detailed=*/true);
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

// vLLM bench serve's result JSON: its keys, the chosen metrics and percentiles, the per-request
// arrays only when detailed, and its file name.
TEST(Report, VllmResultKeysPercentilesAndFileName) {
  RequestResult r = Ok({0.1, 0.25, 0.3}, 3, 0.3);
  r.output_text = "abc";
  r.start_time = 0.5;
  const BenchmarkMetrics m = ComputeMetrics({r}, 1.0, {}, {50, 99.9});
  RunInfo info{.backend = "openai-chat", .model = "tiny", .label = "", .model_id = "models/tiny-code-llama",
               .tokenizer_id = "models/tiny-code-llama", .num_prompts = 1, .request_rate = 4, .max_concurrency = 2,
               .percentile_metrics = {"itl", "ttft"}, .metadata = {{"tp", "1"}}, .date = "20261201-120000"};
  nlohmann::ordered_json j = ReportJson(info, m, {r}, /*detailed=*/true);
  for (const char* key : {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                          "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
                          "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
                          "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                          "steady_output_throughput", "steady_window_s"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["date"], "20261201-120000");
  EXPECT_EQ(j["model_id"], "models/tiny-code-llama");
  EXPECT_EQ(j["tp"], "1");
  EXPECT_TRUE(j["label"].is_null());
  EXPECT_EQ(j["max_output_tokens_per_s"], 3.0);
  EXPECT_EQ(j["max_concurrent_requests"], 1);
  EXPECT_EQ(j["steady_window_s"], 0.0);  // one request: sent before it ended
  EXPECT_EQ(j["generated_texts"][0], "abc");
  ASSERT_EQ(j["itls"][0].size(), 2u);
  EXPECT_NEAR(j["itls"][0][0].get<double>(), 0.15, 1e-12);
  EXPECT_EQ(j["latencies"][0], 0.3);
  EXPECT_EQ(j["start_times"][0], 0.5);
  EXPECT_TRUE(j.contains("p99.9_itl_ms") && j.contains("p50_ttft_ms") && j.contains("std_itl_ms"));
  EXPECT_FALSE(j.contains("mean_tpot_ms") || j.contains("p99_itl_ms") || j.contains("mean_e2el_ms"));
  const std::string text = FormatReport(info, m);
  EXPECT_NE(text.find("P99.9 ITL (ms):"), std::string::npos) << text;
  EXPECT_NE(text.find("Peak output token throughput (tok/s):"), std::string::npos) << text;
  EXPECT_NE(text.find("Steady output token throughput (tok/s):"), std::string::npos) << text;
  EXPECT_EQ(text.find("TPOT"), std::string::npos) << text;
  // Not detailed: no per-request arrays (vLLM without --save-detailed).
  j = ReportJson(info, m, {r}, /*detailed=*/false);
  for (const char* key : {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts", "errors"}) {
    EXPECT_FALSE(j.contains(key)) << key;
  }
  EXPECT_EQ(ResultFileName(info), "openai-chat-4.0qps-concurrency2-tiny-code-llama-20261201-120000.json");
  info.label = "duet";
  info.request_rate = std::numeric_limits<double>::infinity();
  info.max_concurrency = 0;
  EXPECT_EQ(ResultFileName(info), "duet-infqps-tiny-code-llama-20261201-120000.json");
  info.request_rate = 0.5;
  EXPECT_EQ(ResultFileName(info), "duet-0.5qps-tiny-code-llama-20261201-120000.json");
}

// multi-turn: TTFT of first and later turns under TTFT, with the chosen percentiles; gone when
// TTFT is not reported.
TEST(Report, TurnTtftsFollowTheChosenPercentiles) {
  std::vector<RequestResult> results;
  for (auto [turn, ttft] : {std::pair{0, 0.4}, std::pair{1, 0.1}}) {
    results.push_back(Ok({ttft}, 1, ttft));
    results.back().turn = turn;
  }
  const BenchmarkMetrics m = ComputeMetrics(results, 1.0, {}, {50});
  RunInfo info{.backend = "openai-chat", .dataset = "multi-turn", .num_prompts = 2, .percentile_metrics = {"ttft"}};
  nlohmann::ordered_json j = ReportJson(info, m, results, /*detailed=*/false);
  EXPECT_DOUBLE_EQ(j["p50_ttft_first_turn_ms"].get<double>(), 400);
  EXPECT_DOUBLE_EQ(j["median_ttft_later_turns_ms"].get<double>(), 100);
  EXPECT_FALSE(j.contains("p99_ttft_later_turns_ms"));
  const std::string text = FormatReport(info, m);
  EXPECT_NE(text.find("P50 TTFT, later turns (ms):"), std::string::npos) << text;
  EXPECT_EQ(text.find("P99"), std::string::npos) << text;
  info.percentile_metrics = {"e2el"};
  j = ReportJson(info, m, results, /*detailed=*/false);
  EXPECT_FALSE(j.contains("median_ttft_first_turn_ms"));
  EXPECT_EQ(FormatReport(info, m).find("turns"), std::string::npos);
}

}  // namespace
}  // namespace duet::bench
