// A real Prometheus server (/usr/bin/prometheus) scrapes the exporter; the test reads the value
// back through Prometheus's HTTP API.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/subprocess.h"
#include "metrics/http_exporter.h"
#include "metrics/test_http_client.h"
#include "metrics/vllm_metrics.h"

namespace duet::metrics {
namespace {

constexpr const char* kPrometheus = "/usr/bin/prometheus";

uint16_t FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The value of the single sample `query` returns for the given role, or "" when absent.
std::string QueryValue(uint16_t port, const std::string& query, const std::string& role) {
  auto r = testing::HttpGet(port, "/api/v1/query?query=" + query, std::chrono::seconds(2));
  if (r.status != 200) return "";
  auto json = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || json.value("status", "") != "success") return "";
  for (const auto& sample : json["data"]["result"]) {
    if (sample["metric"].value("role", "") == role) return sample["value"][1].get<std::string>();
  }
  return "";
}

TEST(PrometheusIntegrationTest, RealPrometheusScrapesTheExporter) {
  if (::access(kPrometheus, X_OK) != 0) GTEST_SKIP() << "prometheus not installed";

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

  char dir_template[] = "/tmp/duet_prometheus_XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  std::filesystem::path dir = dir_template;
  std::ofstream(dir / "prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: duet\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
      << "    static_configs:\n      - targets: ['127.0.0.1:" << (*exporter)->port() << "']\n";
  uint16_t prom_port = FreePort();
  std::string command = std::string("exec ") + kPrometheus + " --config.file=" +
                        (dir / "prometheus.yml").string() + " --storage.tsdb.path=" +
                        (dir / "data").string() + " --web.listen-address=127.0.0.1:" +
                        std::to_string(prom_port) + " > " + (dir / "prometheus.log").string() +
                        " 2>&1";
  auto prometheus = Subprocess::Start({"/bin/sh", "-c", command});
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();

  std::string router_value, decode_value, ttft_count, gen;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    router_value = QueryValue(prom_port, "duet:prompt_tokens_total", "prefill");
    decode_value = QueryValue(prom_port, "duet:num_requests_waiting", "prefill");
    if (router_value == "1234" && decode_value == "7") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  ttft_count = QueryValue(prom_port, "duet:time_to_first_token_seconds_count", "router");
  gen = QueryValue(prom_port, "duet:generation_tokens_total", "decode");
  // A histogram query over the scraped buckets: both observations are <= 0.5 s.
  std::string le = QueryValue(
      prom_port, "duet:time_to_first_token_seconds_bucket%7Ble%3D%220.5%22%7D", "router");
  std::string up = testing::HttpGet(prom_port, "/api/v1/query?query=up").body;
  std::printf("prometheus: duet:prompt_tokens_total prefill=%s, num_requests_waiting prefill=%s, "
              "generation_tokens_total=%s, ttft count=%s, ttft le=0.5 bucket=%s\nup: %s\n",
              router_value.c_str(), decode_value.c_str(), gen.c_str(), ttft_count.c_str(),
              le.c_str(), up.c_str());

  (*prometheus)->Signal(SIGTERM);
  int status = (*prometheus)->Wait(std::chrono::seconds(15));
  if (status == Subprocess::kStillRunning) (*prometheus)->Stop(std::chrono::milliseconds(100));

  EXPECT_EQ(router_value, "1234") << ReadFile(dir / "prometheus.log");
  EXPECT_EQ(decode_value, "7");
  EXPECT_EQ(gen, "99");
  EXPECT_EQ(ttft_count, "2");
  EXPECT_EQ(le, "2");
  EXPECT_EQ(status, 0) << "prometheus did not exit cleanly on SIGTERM";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace duet::metrics
