// duet-bench against a real local cluster (1 prefill + 1 decode worker, the tiny model): ~20
// prompts through the gRPC API and through the OpenAI HTTP API (completions and chat), each run
// completing every request with sane figures in --result-json.
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;

constexpr int kNumPrompts = 20;
constexpr int kOutputLen = 12;
constexpr int kInputLen = 32;

std::string Model() { return std::string(DUET_MODELS_DIR) + "/tiny-code-llama"; }

class DuetBenchClusterTest : public ::testing::Test {
 protected:
  // The cluster's router serves gRPC; a second router over the same workers serves the OpenAI
  // API on a free port (LocalCluster does not report an HTTP port).
  static void SetUpTestSuite() {
    cluster_ = new LocalCluster(ClusterOptions{.num_prefill = 1, .num_decode = 1});
    if (!cluster_->ok()) return;
    const std::vector<std::string>& workers = cluster_->worker_addresses();  // decode, then prefill
    absl::StatusOr<std::unique_ptr<Subprocess>> router =
        Subprocess::Start({testing::DuetBinary(), "router", "--model", Model(), "--port", "0", "--http-port", "0",
                           "--decode", workers[0], "--prefill", workers[1]});
    if (!router.ok()) return;
    http_router_ = router->release();
    absl::StatusOr<std::string> port = http_router_->WaitForLine("DUET_HTTP_READY port=", std::chrono::seconds(60));
    if (port.ok()) http_port_ = std::atoi(port->c_str());
  }
  static void TearDownTestSuite() {
    if (http_router_ != nullptr) http_router_->Stop();
    delete http_router_;
    delete cluster_;
  }
  void SetUp() override {
    ASSERT_TRUE(cluster_->ok()) << cluster_->error();
    ASSERT_GT(http_port_, 0) << "the HTTP router did not start";
    dir_ = testing::MakeTempDir("duet_bench");
  }

  // Runs duet-bench with `flags`; returns its exit code and leaves the JSON in json_.
  int Bench(const std::string& flags) {
    const std::string result = dir_ + "/result.json";
    const std::string command = absl::StrCat(DUET_BIN_DIR, "/duet-bench ", flags, " --result-json ", result, " > ",
                                             dir_, "/report.txt");
    const int code = testing::RunCommand(command, dir_ + "/stderr.txt");
    stderr_ = testing::ReadText(dir_ + "/stderr.txt");
    report_ = testing::ReadText(dir_ + "/report.txt");
    json_ = nlohmann::json::parse(testing::ReadText(result), nullptr, false);
    return code;
  }

  // Every request completed, with `output_len` tokens each and consistent latencies.
  void ExpectSane(int num_prompts, int output_len) {
    ASSERT_TRUE(json_.is_object()) << stderr_;
    EXPECT_EQ(json_["completed"], num_prompts) << json_["errors"].dump();
    EXPECT_EQ(json_["failed"], 0) << json_["errors"].dump();
    EXPECT_EQ(json_["total_output_tokens"], num_prompts * output_len);
    for (const auto& n : json_["output_lens"]) EXPECT_EQ(n, output_len);
    EXPECT_GE(json_["total_input_tokens"].get<int>(), num_prompts * 8);
    EXPECT_GT(json_["duration"].get<double>(), 0);
    EXPECT_GT(json_["request_throughput"].get<double>(), 0);
    EXPECT_GT(json_["output_throughput"].get<double>(), 0);
    EXPECT_GT(json_["total_token_throughput"].get<double>(), json_["output_throughput"].get<double>());
    for (const char* metric : {"ttft", "tpot", "itl", "e2el"}) {
      const double mean = json_[absl::StrCat("mean_", metric, "_ms")], median = json_[absl::StrCat("median_", metric, "_ms")],
                   p90 = json_[absl::StrCat("p90_", metric, "_ms")], p99 = json_[absl::StrCat("p99_", metric, "_ms")];
      EXPECT_GT(mean, 0) << metric;
      EXPECT_LE(median, p90) << metric;
      EXPECT_LE(p90, p99) << metric;
      EXPECT_LT(p99, 120000) << metric;
    }
    EXPECT_LT(json_["mean_ttft_ms"].get<double>(), json_["mean_e2el_ms"].get<double>());
    // The time after the first token spreads over the other tokens: TPOT ≤ E2EL − TTFT.
    EXPECT_LE(json_["mean_tpot_ms"].get<double>() * (output_len - 1),
              json_["mean_e2el_ms"].get<double>() - json_["mean_ttft_ms"].get<double>() + 1e-6);
    EXPECT_NE(report_.find("Serving Benchmark Result"), std::string::npos) << report_;
  }

  static LocalCluster* cluster_;
  static Subprocess* http_router_;
  static int http_port_;
  std::string dir_, stderr_, report_;
  nlohmann::json json_;
};
LocalCluster* DuetBenchClusterTest::cluster_ = nullptr;
Subprocess* DuetBenchClusterTest::http_router_ = nullptr;
int DuetBenchClusterTest::http_port_ = 0;

std::string RandomWorkload() {
  return absl::StrCat(" --tokenizer ", Model(), " --dataset random --input-len ", kInputLen, " --output-len ", kOutputLen,
                      " --num-prompts ", kNumPrompts, " --ignore-eos --seed 1");
}

TEST_F(DuetBenchClusterTest, GrpcPoissonArrivals) {
  ASSERT_EQ(Bench(absl::StrCat("--backend duet-grpc --base-url 127.0.0.1:", cluster_->router_port(), RandomWorkload(),
                               " --request-rate 40 --goodput e2el:120000")),
            0)
      << stderr_;
  ExpectSane(kNumPrompts, kOutputLen);
  EXPECT_EQ(json_["request_goodput"].get<double>(), json_["request_throughput"].get<double>());
}

TEST_F(DuetBenchClusterTest, OpenAiCompletionsClosedLoop) {
  // Four in flight at a time: connections are kept alive and reused.
  ASSERT_EQ(Bench(absl::StrCat("--backend openai-completions --model tiny-code-llama --base-url http://127.0.0.1:",
                               http_port_, RandomWorkload(), " --max-concurrency 4")),
            0)
      << stderr_;
  ExpectSane(kNumPrompts, kOutputLen);
  // A closed loop of more requests than streams has a steady window: the first end comes before
  // the last send, and the window lies inside the run.
  EXPECT_GT(json_["steady_window_s"].get<double>(), 0);
  EXPECT_LT(json_["steady_window_s"].get<double>(), json_["duration"].get<double>());
  EXPECT_GT(json_["steady_output_throughput"].get<double>(), 0);
}

TEST_F(DuetBenchClusterTest, OpenAiChatCodeWorkload) {
  ASSERT_EQ(Bench(absl::StrCat("--backend openai-chat --model tiny-code-llama --base-url http://127.0.0.1:", http_port_,
                               " --tokenizer ", Model(), " --dataset code --code-dir ", DUET_SOURCE_DIR,
                               "/bench --input-len 48 --output-len ", kOutputLen, " --num-prompts 10 --ignore-eos",
                               " --request-rate 20 --burstiness 0.5")),
            0)
      << stderr_;
  ExpectSane(10, kOutputLen);
}

// Chat sessions: each turn's prompt holds the earlier turns and the answers received, so a
// session's prompts grow by at least the answer and the new message from turn to turn.
TEST_F(DuetBenchClusterTest, MultiTurnSessionsOverGrpcAndChat) {
  constexpr int kSessions = 3, kTurns = 3, kMessageLen = 16;
  const std::string workload =
      absl::StrCat(" --tokenizer ", Model(), " --dataset-name multi-turn --num-sessions ", kSessions, " --num-turns ", kTurns,
                   " --prefix-len 32 --num-prefix-groups 1 --input-len ", kMessageLen, " --output-len ", kOutputLen,
                   " --ignore-eos --request-rate 20 --seed 3 --metric-percentiles 50,90,99");
  ASSERT_EQ(Bench(absl::StrCat("--backend duet-grpc --base-url 127.0.0.1:", cluster_->router_port(), workload)), 0)
      << stderr_;
  ExpectSane(kSessions * kTurns, kOutputLen);
  ASSERT_EQ(json_["input_lens"].size(), size_t(kSessions * kTurns));
  for (int s = 0; s < kSessions; ++s) {
    for (int t = 1; t < kTurns; ++t) {
      const int before = json_["input_lens"][size_t(s * kTurns + t - 1)], now = json_["input_lens"][size_t(s * kTurns + t)];
      // The answer may re-tokenize a token or two shorter; the message and the turn markers add more.
      EXPECT_GE(now, before + kOutputLen + kMessageLen - 2) << "session " << s << " turn " << t;
    }
  }
  for (const char* key : {"median_ttft_first_turn_ms", "p50_ttft_first_turn_ms", "p99_ttft_first_turn_ms",
                          "median_ttft_later_turns_ms", "p50_ttft_later_turns_ms", "p99_ttft_later_turns_ms"}) {
    EXPECT_GT(json_[key].get<double>(), 0) << key;
  }
  EXPECT_NE(report_.find("Median TTFT, later turns (ms):"), std::string::npos) << report_;
  EXPECT_NE(report_.find("P50 TTFT, later turns (ms):"), std::string::npos) << report_;
  // A session's turns run one at a time, each answer fed into its next prompt.
  EXPECT_LE(json_["max_concurrent_requests"].get<int>(), kSessions);
  ASSERT_EQ(json_["generated_texts"].size(), size_t(kSessions * kTurns));
  for (const auto& text : json_["generated_texts"]) EXPECT_FALSE(text.get<std::string>().empty());

  ASSERT_EQ(Bench(absl::StrCat("--backend openai-chat --model tiny-code-llama --base-url http://127.0.0.1:", http_port_,
                               workload)),
            0)
      << stderr_;
  ExpectSane(kSessions * kTurns, kOutputLen);
  for (int s = 0; s < kSessions; ++s) {
    EXPECT_GT(json_["input_lens"][size_t(s * kTurns + kTurns - 1)].get<int>(),
              json_["input_lens"][size_t(s * kTurns)].get<int>() + kOutputLen);
  }
}

// Completions the router has answered 200, from its /metrics, read again until there are at
// least `want` (for at most 10 s): a response is counted right after its last byte went out, so
// its client may have seen it, and exited, a moment before.
int CompletionsServed(int http_port, int want = 0) {
  const std::string series = R"(http_requests_total{handler="/v1/completions",method="POST",status="200"} )";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    const std::string body = metrics::testing::HttpGet(static_cast<uint16_t>(http_port), "/metrics").body;
    const size_t at = body.find(series);
    const int served = at == std::string::npos ? 0 : std::atoi(body.c_str() + at + series.size());
    if (served >= want || std::chrono::steady_clock::now() >= deadline) return served;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// vLLM bench serve's flags and result file: --host/--port/--endpoint, --dataset-name and
// --random-*-len, --num-warmups, --header, --extra-body, --percentile-metrics and
// --metric-percentiles, --save-result with --result-dir/--result-filename (and vLLM's own file
// name), --save-detailed, --label, --metadata; and its result keys.
TEST_F(DuetBenchClusterTest, VllmBenchServeFlagsAndResultKeys) {
  const std::string results = dir_ + "/results";
  const int served_before = CompletionsServed(http_port_);
  const std::string command = absl::StrCat(
      DUET_BIN_DIR, "/duet-bench --backend openai --host 127.0.0.1 --port ", http_port_,
      " --endpoint /v1/completions --model tiny-code-llama --tokenizer ", Model(),
      " --dataset-name random --random-input-len 16 --random-output-len 8 --num-prompts 6 --ignore-eos --seed 1",
      " --num-warmups 2 --header X-Bench=1 --extra-body '{\"max_tokens\": 3}' --percentile-metrics ttft,itl",
      " --metric-percentiles 50,99.9 --save-result --save-detailed --result-dir ", results,
      " --result-filename r.json --label ci --metadata run=ci --disable-tqdm > ", dir_, "/report.txt");
  ASSERT_EQ(testing::RunCommand(command, dir_ + "/stderr.txt"), 0) << testing::ReadText(dir_ + "/stderr.txt");
  constexpr int kSent = 1 + 2 + 6;  // the first request, 2 warm-ups, the run
  EXPECT_EQ(CompletionsServed(http_port_, served_before + kSent) - served_before, kSent);
  const nlohmann::json j = nlohmann::json::parse(testing::ReadText(results + "/r.json"), nullptr, false);
  ASSERT_TRUE(j.is_object()) << testing::ReadText(dir_ + "/stderr.txt");
  EXPECT_EQ(j["completed"], 6);
  EXPECT_EQ(j["label"], "ci");
  EXPECT_EQ(j["run"], "ci");
  EXPECT_EQ(j["model_id"], "tiny-code-llama");
  EXPECT_EQ(j["tokenizer_id"], Model());
  EXPECT_EQ(j["endpoint_type"], "openai");
  EXPECT_EQ(j["total_output_tokens"], 6 * 3);  // --extra-body's max_tokens won
  ASSERT_EQ(j["itls"].size(), 6u);
  ASSERT_EQ(j["generated_texts"].size(), 6u);
  for (const auto& text : j["generated_texts"]) EXPECT_FALSE(text.get<std::string>().empty());
  EXPECT_GT(j["max_output_tokens_per_s"].get<double>(), 0);
  EXPECT_GE(j["max_concurrent_requests"].get<int>(), 1);
  EXPECT_LE(j["p50_itl_ms"].get<double>(), j["p99.9_itl_ms"].get<double>());
  EXPECT_TRUE(j.contains("median_ttft_ms"));
  EXPECT_FALSE(j.contains("mean_tpot_ms") || j.contains("p99_ttft_ms"));
  const std::string report = testing::ReadText(dir_ + "/report.txt");
  EXPECT_NE(report.find("P99.9 ITL (ms):"), std::string::npos) << report;

  // gRPC from --host/--port, vLLM's file name, not detailed; a bad --header is refused.
  const std::string grpc = absl::StrCat(DUET_BIN_DIR, "/duet-bench --backend duet-grpc --port ", cluster_->router_port(),
                                        " --model tiny-code-llama --tokenizer ", Model(),
                                        " --dataset-name random --random-input-len 16 --random-output-len 4 --num-prompts 3",
                                        " --temperature 0.5 --top-k 3 --header x-bench=1 --save-result --result-dir ",
                                        results, "/grpc > /dev/null");
  ASSERT_EQ(testing::RunCommand(grpc, dir_ + "/stderr.txt"), 0) << testing::ReadText(dir_ + "/stderr.txt");
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(results + "/grpc")) files.push_back(entry.path());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_TRUE(files[0].filename().string().starts_with("duet-grpc-infqps-tiny-code-llama-")) << files[0];
  const nlohmann::json g = nlohmann::json::parse(testing::ReadText(files[0].string()), nullptr, false);
  EXPECT_EQ(g["completed"], 3);
  EXPECT_FALSE(g.contains("itls") || g.contains("generated_texts"));
  EXPECT_NE(testing::RunCommand(absl::StrCat(DUET_BIN_DIR, "/duet-bench --port 1 --header novalue --num-prompts 1"),
                                dir_ + "/stderr.txt"),
            0);
  EXPECT_NE(testing::ReadText(dir_ + "/stderr.txt").find("--header wants KEY=VALUE"), std::string::npos);
}

TEST_F(DuetBenchClusterTest, UnknownModelFailsTheWarmUpClearly) {
  EXPECT_NE(Bench(absl::StrCat("--backend openai-completions --model no-such-model --base-url http://127.0.0.1:",
                               http_port_, RandomWorkload())),
            0);
  EXPECT_NE(stderr_.find("warm-up request failed: HTTP 404"), std::string::npos) << stderr_;
}

TEST_F(DuetBenchClusterTest, NothingListeningFailsTheWarmUpClearly) {
  EXPECT_NE(Bench(absl::StrCat("--backend duet-grpc --base-url 127.0.0.1:1", RandomWorkload())), 0);
  EXPECT_NE(stderr_.find("warm-up request failed"), std::string::npos) << stderr_;
}

}  // namespace
}  // namespace duet
