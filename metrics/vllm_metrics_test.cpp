#include "metrics/vllm_metrics.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace duet::metrics {
namespace {

using ::testing::HasSubstr;

// A registry holding every Duet metric for every role, with some of each kind of value.
void Populate(Registry& registry) {
  for (Role role : {Role::kRouter, Role::kPrefill, Role::kDecode}) {
    DuetMetrics m(registry, "tiny \"llama\"\\v1", role, 2048);
    m.num_requests_running.Set(3);
    m.num_requests_waiting.Set(1);
    m.kv_cache_usage_perc.Set(0.375);
    m.prefix_cache_queries.Inc(100);
    m.prefix_cache_hits.Inc(40);
    m.num_preemptions.Inc();
    m.prompt_tokens.Inc(1234);
    m.generation_tokens.Inc(567);
    m.kv_transfer_failures.Inc(0);
    m.request_success(FinishReason::kStop).Inc(7);
    m.request_success(FinishReason::kLength).Inc(2);
    m.request_prompt_tokens.Observe(17);
    m.request_generation_tokens.Observe(300);
    m.time_to_first_token_seconds.Observe(0.042);
    m.inter_token_latency_seconds.Observe(0.012);
    m.e2e_request_latency_seconds.Observe(3.2);
    m.request_queue_time_seconds.Observe(0.01);
    m.request_inference_time_seconds.Observe(3.1);
    m.request_prefill_time_seconds.Observe(0.03);
    m.request_decode_time_seconds.Observe(3.07);
    m.kv_transfer_bytes.Observe(3 << 20);
    m.kv_transfer_seconds("cuda_ipc").Observe(0.0042);
    m.kv_transfer_bytes_total("cuda_ipc").Inc(3 << 20);
    m.kv_transfer_wait_seconds.Observe(0.0001);
  }
}

TEST(VllmMetricsTest, BucketsMatchVllm) {
  EXPECT_EQ(TtftBuckets().size(), 22u);
  EXPECT_EQ(TtftBuckets().front(), 0.001);
  EXPECT_EQ(TtftBuckets().back(), 2560.0);
  EXPECT_EQ(InterTokenLatencyBuckets().size(), 19u);
  EXPECT_EQ(InterTokenLatencyBuckets().back(), 80.0);
  EXPECT_EQ(RequestLatencyBuckets().size(), 21u);
  EXPECT_EQ(RequestLatencyBuckets().front(), 0.3);
  EXPECT_EQ(RequestLatencyBuckets().back(), 7680.0);
  EXPECT_EQ(Build125Buckets(100), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
  EXPECT_EQ(Build125Buckets(4096).back(), 2000);
  EXPECT_EQ(KvTransferBytesBuckets().front(), 1024);
  EXPECT_EQ(KvTransferBytesBuckets().back(), 4.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(KvTransferSecondsBuckets().size(), 18u);
}

TEST(VllmMetricsTest, NamesLabelsAndValues) {
  Registry registry;
  DuetMetrics m(registry, "tiny", Role::kDecode);
  m.prompt_tokens.Inc(5);
  m.kv_cache_usage_perc.Set(0.5);
  m.request_success(FinishReason::kLength).Inc();
  m.time_to_first_token_seconds.Observe(0.042);
  std::string text = registry.Render();
  for (const char* name :
       {"duet:num_requests_running", "duet:num_requests_waiting", "duet:kv_cache_usage_perc",
        "duet:prompt_tokens_total", "duet:generation_tokens_total", "duet:request_success_total",
        "duet:time_to_first_token_seconds", "duet:inter_token_latency_seconds",
        "duet:e2e_request_latency_seconds", "duet:request_queue_time_seconds",
        "duet:request_prefill_time_seconds", "duet:request_decode_time_seconds",
        "duet:num_preemptions_total", "duet:kv_transfer_bytes", "duet:kv_transfer_seconds",
        "duet:kv_transfer_failures_total", "duet:prefix_cache_queries_total",
        "duet:prefix_cache_hits_total", "duet:request_inference_time_seconds",
        "duet:kv_transfer_bytes_total", "duet:kv_transfer_wait_seconds"}) {
    EXPECT_THAT(text, HasSubstr(std::string("\n# TYPE ") + name + " ")) << name;
  }
  EXPECT_THAT(text, HasSubstr("duet:prompt_tokens_total{model_name=\"tiny\",role=\"decode\"} 5\n"));
  EXPECT_THAT(text, HasSubstr("duet:kv_cache_usage_perc{model_name=\"tiny\",role=\"decode\"} 0.5\n"));
  EXPECT_THAT(text, HasSubstr("duet:request_success_total{model_name=\"tiny\",role=\"decode\","
                              "finished_reason=\"length\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:request_success_total{model_name=\"tiny\",role=\"decode\","
                              "finished_reason=\"stop\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("duet:time_to_first_token_seconds_bucket{model_name=\"tiny\","
                              "role=\"decode\",le=\"0.04\"} 0\n"));
  EXPECT_THAT(text, HasSubstr("duet:time_to_first_token_seconds_bucket{model_name=\"tiny\","
                              "role=\"decode\",le=\"0.06\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("duet:time_to_first_token_seconds_bucket{model_name=\"tiny\","
                              "role=\"decode\",le=\"2560.0\"} 1\n"));
  // Every sample line carries model_name and role.
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_THAT(line, HasSubstr("{model_name=\"tiny\",role=\"decode\"")) << line;
  }
}

TEST(VllmMetricsTest, RequestSuccessCountsVllmsFinishReasonsOnly) {
  EXPECT_TRUE(CountsAsSuccess(FinishReason::kStop));
  EXPECT_TRUE(CountsAsSuccess(FinishReason::kLength));
  EXPECT_TRUE(CountsAsSuccess(FinishReason::kAbort));
  EXPECT_FALSE(CountsAsSuccess(FinishReason::kNone));
  EXPECT_FALSE(CountsAsSuccess(FinishReason::kError));
  Registry registry;
  DuetMetrics m(registry, "tiny", Role::kRouter);
  m.request_success(FinishReason::kAbort).Inc();
  EXPECT_NE(registry.Render().find("finished_reason=\"abort\"} 1"), std::string::npos) << registry.Render();
}

TEST(VllmMetricsTest, RolesShareFamilies) {
  Registry registry;
  DuetMetrics router(registry, "m", Role::kRouter);
  DuetMetrics prefill(registry, "m", Role::kPrefill);
  router.prompt_tokens.Inc(1);
  prefill.prompt_tokens.Inc(2);
  std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("duet:prompt_tokens_total{model_name=\"m\",role=\"prefill\"} 2\n"
                              "duet:prompt_tokens_total{model_name=\"m\",role=\"router\"} 1\n"));
}

struct CommandResult {
  int exit_code = -1;
  std::string output;
};

CommandResult RunShell(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/duet_metrics_XXXXXX";
  int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  ::close(fd);
  std::ofstream(path) << text;
  return path;
}

constexpr const char* kPromtool = "/usr/bin/promtool";

// promtool check metrics parses the exposition (exit 1 on a parse error) and lints it (exit 3 on
// lint problems). Its lint rejects ':' in every metric name ("metric names should not contain
// ':'"), a rule vLLM's own vllm:* names break too, so: the real output must draw no complaint
// but that one, and the same text with "duet:" spelled "duet_" must pass clean (exit 0, no
// output), which proves every other rule (HELP, _total suffixes, units, histogram shape) holds.
TEST(VllmMetricsTest, PromtoolAcceptsEveryDuetMetric) {
  if (::access(kPromtool, X_OK) != 0) GTEST_SKIP() << "promtool not installed";
  Registry registry;
  Populate(registry);
  std::string text = registry.Render();

  std::string path = WriteTemp(text);
  CommandResult real = RunShell(std::string(kPromtool) + " check metrics < " + path);
  std::printf("promtool on duet:* names: exit %d\n%s", real.exit_code, real.output.c_str());
  EXPECT_TRUE(real.exit_code == 0 || real.exit_code == 3) << real.output;
  std::istringstream lines(real.output);
  std::string line;
  int complaints = 0;
  while (std::getline(lines, line)) {
    ++complaints;
    EXPECT_THAT(line, ::testing::EndsWith("metric names should not contain ':'")) << line;
  }
  EXPECT_GT(complaints, 0);  // promtool really read the text: one complaint per family

  std::string underscored = text;
  for (size_t pos = 0; (pos = underscored.find("duet:", pos)) != std::string::npos;) {
    underscored.replace(pos, 5, "duet_");
  }
  std::string path2 = WriteTemp(underscored);
  CommandResult clean = RunShell(std::string(kPromtool) + " check metrics < " + path2);
  std::printf("promtool on duet_* names: exit %d, output '%s'\n", clean.exit_code,
              clean.output.c_str());
  EXPECT_EQ(clean.exit_code, 0) << clean.output;
  EXPECT_EQ(clean.output, "");

  // Negative control: promtool does reject a broken exposition.
  std::string path3 = WriteTemp("# TYPE x counter\nx{a=\"unterminated} 1\n");
  CommandResult broken = RunShell(std::string(kPromtool) + " check metrics < " + path3);
  EXPECT_EQ(broken.exit_code, 1) << broken.output;
  std::remove(path.c_str());
  std::remove(path2.c_str());
  std::remove(path3.c_str());
}

}  // namespace
}  // namespace duet::metrics
