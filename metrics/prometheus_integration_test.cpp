// A real Prometheus server (/usr/bin/prometheus) scrapes the exporter; the test reads the value
// back through Prometheus's HTTP API.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "metrics/http_exporter.h"
#include "metrics/test_prometheus_server.h"
#include "metrics/vllm_metrics.h"

namespace duet::metrics {
namespace {

using testing::PrometheusServer;

// The value of the single sample `query` returns for the given role, or "" when absent.
std::string QueryValue(const PrometheusServer& prometheus, const std::string& query, const std::string& role) {
  const nlohmann::json result = prometheus.Query(query);
  if (!result.is_array()) return "";
  for (const auto& sample : result) {
    if (sample["metric"].value("role", "") == role) return sample["value"][1].get<std::string>();
  }
  return "";
}

TEST(PrometheusIntegrationTest, RealPrometheusScrapesTheExporter) {
  if (!testing::PrometheusInstalled()) GTEST_SKIP() << "prometheus not installed";

  Registry registry;
  RouterMetrics router(registry, "tiny");
  PrefillMetrics prefill(registry, "tiny");
  DecodeMetrics decode(registry, "tiny");
  prefill.prompt_tokens.Inc(1234);
  prefill.num_requests_waiting.Set(7);
  decode.generation_tokens.Inc(99);
  router.time_to_first_token_seconds.Observe(0.05);
  router.time_to_first_token_seconds.Observe(0.3);
  HttpExporter::Options options;
  options.host = "127.0.0.1";
  auto exporter = HttpExporter::Start(registry, options);
  ASSERT_TRUE(exporter.ok()) << exporter.status();

  auto prometheus = PrometheusServer::Start({absl::StrCat("127.0.0.1:", (*exporter)->port())});
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();
  const PrometheusServer& p = **prometheus;

  std::string router_value, decode_value, ttft_count, gen;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    router_value = QueryValue(p, "duet:prompt_tokens_total", "prefill");
    decode_value = QueryValue(p, "duet:num_requests_waiting", "prefill");
    if (router_value == "1234" && decode_value == "7") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  ttft_count = QueryValue(p, "duet:time_to_first_token_seconds_count", "router");
  gen = QueryValue(p, "duet:generation_tokens_total", "decode");
  // A histogram query over the scraped buckets: both observations are <= 0.5 s.
  std::string le = QueryValue(p, "duet:time_to_first_token_seconds_bucket{le=\"0.5\"}", "router");
  std::string up = p.Query("up").dump();
  std::printf("prometheus: duet:prompt_tokens_total prefill=%s, num_requests_waiting prefill=%s, "
              "generation_tokens_total=%s, ttft count=%s, ttft le=0.5 bucket=%s\nup: %s\n",
              router_value.c_str(), decode_value.c_str(), gen.c_str(), ttft_count.c_str(), le.c_str(), up.c_str());

  const std::string log = p.Log();
  const int status = (*prometheus)->Stop();
  EXPECT_EQ(router_value, "1234") << log;
  EXPECT_EQ(decode_value, "7");
  EXPECT_EQ(gen, "99");
  EXPECT_EQ(ttft_count, "2");
  EXPECT_EQ(le, "2");
  EXPECT_EQ(status, 0) << "prometheus did not exit cleanly on SIGTERM";
}

}  // namespace
}  // namespace duet::metrics
