// Prometheus metrics of a real cluster (router, 1 prefill and 1 decode worker as processes, each
// serving /metrics on its own port): `promtool check metrics` accepts every process's exposition,
// and a real Prometheus server (/usr/bin/prometheus) scraping all three answers PromQL queries
// whose values equal what the test's requests generated.
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"

namespace duet {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;
using testing::RunGenerate;
using testing::StreamResult;

constexpr const char* kPromtool = "/usr/bin/promtool";
constexpr const char* kPrometheus = "/usr/bin/prometheus";

std::string Scrape(int port) {
  metrics::testing::HttpResponse r = metrics::testing::HttpGet(uint16_t(port), "/metrics", std::chrono::seconds(5));
  return r.status == 200 ? r.body : "";
}

// The value of the sample `series` (name and labels exactly as rendered), or -1 when absent.
double SampleValue(const std::string& text, const std::string& series) {
  const std::string prefix = series + " ";
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(prefix, 0) == 0) return std::stod(line.substr(prefix.size()));
  }
  return -1;
}

// `extra` labels (",finished_reason=\"length\"") come after model_name and role, as registered.
std::string Series(const std::string& name, const std::string& role, const std::string& extra = "") {
  return absl::StrCat(name, "{model_name=\"tiny-code-llama\",role=\"", role, "\"", extra, "}");
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
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

// promtool check metrics on one exposition: it exits 3 (lint problems) and every line it prints
// is the one lint every vLLM-style name draws ("metric names should not contain ':'", see
// metrics/README.md): no parse error (exit 1) and no other lint. With "duet:" spelled "duet_" the
// text must pass clean (exit 0, no output).
void ExpectPromtoolAccepts(const std::string& what, const std::string& text, const std::filesystem::path& dir) {
  ASSERT_FALSE(text.empty()) << what << ": empty /metrics";
  const std::filesystem::path real = dir / (what + ".prom");
  std::ofstream(real) << text;
  CommandResult r = RunShell(absl::StrCat(kPromtool, " check metrics < ", real.string()));
  std::printf("promtool check metrics (%s, %zu bytes): exit %d\n", what.c_str(), text.size(), r.exit_code);
  EXPECT_EQ(r.exit_code, 3) << what << ": " << r.output;
  std::istringstream lines(r.output);
  int complaints = 0;
  for (std::string line; std::getline(lines, line);) {
    ++complaints;
    const std::string expected = "metric names should not contain ':'";
    EXPECT_TRUE(line.size() >= expected.size() && line.compare(line.size() - expected.size(), expected.size(),
                                                               expected) == 0)
        << what << ": " << line;
  }
  EXPECT_GT(complaints, 0) << what;  // promtool really read the families

  std::string underscored = text;
  for (size_t pos = 0; (pos = underscored.find("duet:", pos)) != std::string::npos;) underscored.replace(pos, 5, "duet_");
  const std::filesystem::path clean_path = dir / (what + "_underscored.prom");
  std::ofstream(clean_path) << underscored;
  CommandResult clean = RunShell(absl::StrCat(kPromtool, " check metrics < ", clean_path.string()));
  std::printf("promtool check metrics (%s, duet_ names): exit %d '%s'\n", what.c_str(), clean.exit_code,
              clean.output.c_str());
  EXPECT_EQ(clean.exit_code, 0) << what << ": " << clean.output;
  EXPECT_EQ(clean.output, "") << what;
}

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

std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '_' || c == '-' || c == '.' || c == '~') {
      out += char(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

// The PromQL instant query's single value ("" when there is none, or several).
std::string Query(uint16_t port, const std::string& promql) {
  auto r = metrics::testing::HttpGet(port, "/api/v1/query?query=" + UrlEncode(promql), std::chrono::seconds(2));
  if (r.status != 200) return "";
  auto json = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded() || json.value("status", "") != "success") return "";
  const auto& result = json["data"]["result"];
  if (!result.is_array() || result.size() != 1) return "";
  return result[0]["value"][1].get<std::string>();
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(MetricsClusterTest, PromtoolAndARealPrometheusAgreeWithTheTokensGenerated) {
  ClusterOptions options;
  options.metrics = true;
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ASSERT_GT(cluster.router_metrics_port(), 0);
  ASSERT_EQ(cluster.decode_metrics_ports().size(), 1u);
  ASSERT_EQ(cluster.prefill_metrics_ports().size(), 1u);
  const int router_port = cluster.router_metrics_port();
  const int decode_port = cluster.decode_metrics_ports()[0];
  const int prefill_port = cluster.prefill_metrics_ports()[0];

  // A known load: kRequests greedy requests (4 at a time) on the model's reference prompts, with
  // varied lengths, all running to max_tokens. (Real prompts keep the streamed text valid UTF-8.)
  std::ifstream reference_file(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  const nlohmann::json cases = nlohmann::json::parse(reference_file)["cases"];
  ASSERT_FALSE(cases.empty());
  constexpr int kRequests = 12;
  std::vector<StreamResult> results(kRequests);
  std::vector<int> prompt_lengths(kRequests);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < kRequests; i += 4) {
        v1::GenerateRequest request;
        const std::vector<int32_t> ids = cases[size_t(i) % cases.size()]["prompt_ids"].get<std::vector<int32_t>>();
        prompt_lengths[i] = int(ids.size());
        for (int32_t id : ids) request.mutable_token_ids()->add_ids(id);
        request.mutable_sampling()->set_temperature(0.0f);
        request.mutable_sampling()->set_max_tokens(4 + i);
        request.mutable_sampling()->set_ignore_eos(true);
        results[i] = RunGenerate(cluster.router(), request);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  int64_t tokens = 0, prompt_tokens = 0;
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_EQ(int(results[i].token_ids.size()), 4 + i) << i;
    EXPECT_EQ(results[i].finish_reason, "length") << i;
    tokens += int64_t(results[i].token_ids.size());
    prompt_tokens += prompt_lengths[i];
  }
  std::printf("%d requests: %lld prompt tokens, %lld tokens received\n", kRequests, (long long)prompt_tokens,
              (long long)tokens);

  // Idle: the decode worker's KV usage gauge returns to 0 (refreshed at scrape time).
  std::string decode_text;
  for (int i = 0; i < 100; ++i) {
    decode_text = Scrape(decode_port);
    if (SampleValue(decode_text, Series("duet:kv_cache_usage_perc", "decode")) == 0 &&
        SampleValue(decode_text, Series("duet:num_requests_running", "decode")) == 0) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const std::string router_text = Scrape(router_port);
  const std::string prefill_text = Scrape(prefill_port);

  // The expositions themselves.
  EXPECT_EQ(SampleValue(decode_text, Series("duet:kv_cache_usage_perc", "decode")), 0) << decode_text;
  EXPECT_EQ(SampleValue(decode_text, Series("duet:num_requests_running", "decode")), 0);
  EXPECT_EQ(SampleValue(decode_text, Series("duet:generation_tokens_total", "decode")), double(tokens));
  EXPECT_EQ(SampleValue(decode_text, Series("duet:request_success_total", "decode", ",finished_reason=\"length\"")),
            kRequests);
  EXPECT_EQ(SampleValue(decode_text, Series("duet:kv_transfer_bytes_count", "decode")), kRequests);
  EXPECT_EQ(SampleValue(decode_text, Series("duet:kv_transfer_failures_total", "decode")), 0);
  EXPECT_EQ(SampleValue(decode_text, Series("duet:inter_token_latency_seconds_count", "decode")),
            double(tokens - kRequests));
  // Each gap counted once: the decode worker's gaps fit in the requests' lives at the router.
  EXPECT_LE(SampleValue(decode_text, Series("duet:inter_token_latency_seconds_sum", "decode")),
            SampleValue(router_text, Series("duet:e2e_request_latency_seconds_sum", "router")));
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:prompt_tokens_total", "prefill")), double(prompt_tokens))
      << prefill_text;
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_bytes_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_bytes_sum", "prefill")),
            SampleValue(decode_text, Series("duet:kv_transfer_bytes_sum", "decode")));
  // Both workers on this host, host caches: UCX shared memory carries the bytes.
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_bytes_total", "prefill", ",path=\"ucx_shm\"")),
            SampleValue(prefill_text, Series("duet:kv_transfer_bytes_sum", "prefill")));
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_seconds_count", "prefill", ",path=\"ucx_shm\"")),
            kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_wait_seconds_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:request_prefill_time_seconds_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_cache_usage_perc", "prefill")), 0);
  EXPECT_EQ(SampleValue(router_text, Series("duet:generation_tokens_total", "router")), double(tokens))
      << router_text;
  EXPECT_EQ(SampleValue(router_text, Series("duet:prompt_tokens_total", "router")), double(prompt_tokens));
  EXPECT_EQ(SampleValue(router_text, Series("duet:request_success_total", "router", ",finished_reason=\"length\"")),
            kRequests);
  EXPECT_EQ(SampleValue(router_text, Series("duet:time_to_first_token_seconds_count", "router")), kRequests);
  EXPECT_EQ(SampleValue(router_text, Series("duet:e2e_request_latency_seconds_count", "router")), kRequests);
  EXPECT_EQ(SampleValue(router_text, Series("duet:num_requests_running", "router")), 0);
  EXPECT_EQ(SampleValue(router_text, Series("duet:num_requests_waiting", "router")), 0);

  char dir_template[] = "/tmp/duet_metrics_cluster_XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::filesystem::path dir = dir_template;

  if (::access(kPromtool, X_OK) == 0) {
    ExpectPromtoolAccepts("router", router_text, dir);
    ExpectPromtoolAccepts("prefill", prefill_text, dir);
    ExpectPromtoolAccepts("decode", decode_text, dir);
  } else {
    std::printf("promtool not installed: skipping promtool checks\n");
  }

  if (::access(kPrometheus, X_OK) != 0) {
    std::filesystem::remove_all(dir);
    GTEST_SKIP() << "prometheus not installed";
  }
  std::ofstream(dir / "prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: duet\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
      << "    static_configs:\n      - targets: ['127.0.0.1:" << router_port << "', '127.0.0.1:" << prefill_port
      << "', '127.0.0.1:" << decode_port << "']\n";
  const uint16_t prom_port = FreePort();
  const std::string command = absl::StrCat("exec ", kPrometheus, " --config.file=", (dir / "prometheus.yml").string(),
                                           " --storage.tsdb.path=", (dir / "data").string(),
                                           " --web.listen-address=127.0.0.1:", prom_port, " > ",
                                           (dir / "prometheus.log").string(), " 2>&1");
  auto prometheus = Subprocess::Start({"/bin/sh", "-c", command});
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();

  const std::string want_tokens = std::to_string(tokens);
  const std::string want_prompt = std::to_string(prompt_tokens);
  std::string up, decode_sum, router_tokens, prefill_prompt, kv_usage, successes;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    up = Query(prom_port, "sum(up{job=\"duet\"})");
    decode_sum = Query(prom_port, "sum(duet:generation_tokens_total{role=\"decode\"})");
    router_tokens = Query(prom_port, "duet:generation_tokens_total{role=\"router\"}");
    prefill_prompt = Query(prom_port, "sum(duet:prompt_tokens_total{role=\"prefill\"})");
    kv_usage = Query(prom_port, "max(duet:kv_cache_usage_perc{role=\"decode\"})");
    successes = Query(prom_port, "sum(duet:request_success_total{role=\"router\",finished_reason=\"length\"})");
    if (up == "3" && decode_sum == want_tokens && router_tokens == want_tokens && prefill_prompt == want_prompt &&
        kv_usage == "0" && successes == std::to_string(kRequests)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  std::printf(
      "PromQL: sum(up)=%s sum(duet:generation_tokens_total{role=\"decode\"})=%s "
      "duet:generation_tokens_total{role=\"router\"}=%s sum(duet:prompt_tokens_total{role=\"prefill\"})=%s "
      "max(duet:kv_cache_usage_perc{role=\"decode\"})=%s router request_success_total{length}=%s "
      "(tokens received %s, prompt tokens %s)\n",
      up.c_str(), decode_sum.c_str(), router_tokens.c_str(), prefill_prompt.c_str(), kv_usage.c_str(),
      successes.c_str(), want_tokens.c_str(), want_prompt.c_str());

  (*prometheus)->Signal(SIGTERM);
  if ((*prometheus)->Wait(std::chrono::seconds(15)) == Subprocess::kStillRunning) {
    (*prometheus)->Stop(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(up, "3") << ReadFile(dir / "prometheus.log");
  EXPECT_EQ(decode_sum, want_tokens);
  EXPECT_EQ(router_tokens, want_tokens);
  EXPECT_EQ(prefill_prompt, want_prompt);
  EXPECT_EQ(kv_usage, "0");
  EXPECT_EQ(successes, std::to_string(kRequests));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace duet
