// Prometheus metrics of a real cluster (router, 1 prefill and 1 decode worker as processes, each
// serving /metrics on its own port): `promtool check metrics` accepts every process's exposition,
// and a real Prometheus server (/usr/bin/prometheus) scraping all three answers PromQL queries
// whose values equal what the test's requests generated.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
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
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "tests/integration/process.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "metrics/test_prometheus_server.h"
#include "metrics/test_promtool.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"

namespace duet {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;
using testing::RunGenerate;
using testing::StreamResult;
using metrics::testing::ExpectPromtoolAccepts;
using metrics::testing::PrometheusServer;

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

// The PromQL instant query's single value ("" when there is none, or several), evaluated now or
// at `unix_seconds`.
std::string Query(const PrometheusServer& prometheus, const std::string& promql, double unix_seconds = 0) {
  const nlohmann::json result = prometheus.Query(promql, unix_seconds);
  if (!result.is_array() || result.size() != 1) return "";
  return result[0]["value"][1].get<std::string>();
}

double UnixSeconds(std::chrono::system_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

// The times of the first and the last sample of the range selector `selector` (one series) at
// `unix_seconds`: the span a rate() over it measures; (0, 0) when there is none.
std::pair<double, double> SampleSpan(const PrometheusServer& prometheus, const std::string& selector,
                                     double unix_seconds) {
  const nlohmann::json result = prometheus.Query(selector, unix_seconds);
  if (!result.is_array() || result.size() != 1 || result[0]["values"].size() < 2) return {0, 0};
  const auto& values = result[0]["values"];
  return {values.front()[0].get<double>(), values.back()[0].get<double>()};
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

  // The expositions themselves: each process exports what it measures (metrics/README.md).
  EXPECT_EQ(SampleValue(decode_text, Series("duet:kv_cache_usage_perc", "decode")), 0) << decode_text;
  EXPECT_EQ(SampleValue(decode_text, Series("duet:num_requests_running", "decode")), 0);
  EXPECT_EQ(SampleValue(decode_text, Series("duet:generation_tokens_total", "decode")), double(tokens));
  EXPECT_EQ(SampleValue(decode_text, Series("duet:request_decode_time_seconds_count", "decode")), kRequests);
  // One step of one token for each token after the prefill's first (no speculation).
  EXPECT_EQ(SampleValue(decode_text, Series("duet:iteration_tokens_total_sum", "decode")), double(tokens - kRequests));
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:prompt_tokens_total", "prefill")), double(prompt_tokens))
      << prefill_text;
  // The prefill computes what its prefix cache did not hold (the workload repeats prompts).
  const double prefill_hits = SampleValue(prefill_text, Series("duet:prefix_cache_hits_total", "prefill"));
  EXPECT_GT(prefill_hits, 0);
  EXPECT_GE(SampleValue(prefill_text, Series("duet:prefix_cache_queries_total", "prefill")), double(prompt_tokens));
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:iteration_tokens_total_sum", "prefill")),
            double(prompt_tokens) - prefill_hits);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_bytes_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_failures_total", "prefill")), 0);
  // Both workers on this host, host caches: UCX shared memory carries the bytes.
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_bytes_total", "prefill", ",path=\"ucx_shm\"")),
            SampleValue(prefill_text, Series("duet:kv_transfer_bytes_sum", "prefill")));
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_seconds_count", "prefill", ",path=\"ucx_shm\"")),
            kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:kv_transfer_wait_seconds_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(prefill_text, Series("duet:request_prefill_time_seconds_count", "prefill")), kRequests);
  EXPECT_EQ(SampleValue(router_text, Series("duet:request_success_total", "router", ",finished_reason=\"length\"")),
            kRequests)
      << router_text;
  EXPECT_EQ(SampleValue(router_text, Series("duet:request_prompt_tokens_sum", "router")), double(prompt_tokens));
  EXPECT_EQ(SampleValue(router_text, Series("duet:request_generation_tokens_sum", "router")), double(tokens));
  EXPECT_EQ(SampleValue(router_text, Series("duet:time_to_first_token_seconds_count", "router")), kRequests);
  EXPECT_EQ(SampleValue(router_text, Series("duet:e2e_request_latency_seconds_count", "router")), kRequests);
  EXPECT_EQ(SampleValue(router_text, Series("duet:inter_token_latency_seconds_count", "router")),
            double(tokens - kRequests));
  // Each gap counted once: the gaps fit in the requests' lives.
  EXPECT_LE(SampleValue(router_text, Series("duet:inter_token_latency_seconds_sum", "router")),
            SampleValue(router_text, Series("duet:e2e_request_latency_seconds_sum", "router")));
  EXPECT_EQ(SampleValue(router_text, Series("duet:num_requests_waiting", "router")), 0);
  // What a role does not measure, it does not export.
  for (const char* name : {"duet:generation_tokens_total", "duet:prompt_tokens_total", "duet:kv_cache_usage_perc",
                           "duet:num_requests_running"}) {
    EXPECT_EQ(router_text.find(name), std::string::npos) << name;
  }
  for (const char* name : {"duet:request_success_total", "duet:e2e_request_latency_seconds",
                           "duet:inter_token_latency_seconds", "duet:kv_transfer_bytes"}) {
    EXPECT_EQ(decode_text.find(name), std::string::npos) << name;
  }
  EXPECT_EQ(prefill_text.find("duet:kv_cache_usage_perc"), std::string::npos);
  EXPECT_EQ(prefill_text.find("duet:generation_tokens_total"), std::string::npos);

  char dir_template[] = "/tmp/duet_metrics_cluster_XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::filesystem::path dir = dir_template;

  if (metrics::testing::PromtoolInstalled()) {
    ExpectPromtoolAccepts("router", router_text, dir);
    ExpectPromtoolAccepts("prefill", prefill_text, dir);
    ExpectPromtoolAccepts("decode", decode_text, dir);
  } else {
    std::printf("promtool not installed: skipping promtool checks\n");
  }

  std::filesystem::remove_all(dir);
  if (!metrics::testing::PrometheusInstalled()) GTEST_SKIP() << "prometheus not installed";
  auto started = PrometheusServer::Start({absl::StrCat("127.0.0.1:", router_port),
                                          absl::StrCat("127.0.0.1:", prefill_port),
                                          absl::StrCat("127.0.0.1:", decode_port)});
  ASSERT_TRUE(started.ok()) << started.status();
  PrometheusServer& prometheus = **started;

  const std::string want_tokens = std::to_string(tokens);
  const std::string want_prompt = std::to_string(prompt_tokens);
  std::string up, generated, prompted, kv_usage, successes;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    // The sums over every process, without a role filter: each thing is counted once.
    up = Query(prometheus, "sum(up{job=\"duet\"})");
    generated = Query(prometheus, "sum(duet:generation_tokens_total)");
    prompted = Query(prometheus, "sum(duet:prompt_tokens_total)");
    kv_usage = Query(prometheus, "max(duet:kv_cache_usage_perc)");
    successes = Query(prometheus, "sum(duet:request_success_total{finished_reason=\"length\"})");
    if (up == "3" && generated == want_tokens && prompted == want_prompt && kv_usage == "0" &&
        successes == std::to_string(kRequests)) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  std::printf(
      "PromQL: sum(up)=%s sum(duet:generation_tokens_total)=%s sum(duet:prompt_tokens_total)=%s "
      "max(duet:kv_cache_usage_perc)=%s sum(duet:request_success_total{length})=%s "
      "(tokens received %s, prompt tokens %s)\n",
      up.c_str(), generated.c_str(), prompted.c_str(), kv_usage.c_str(), successes.c_str(), want_tokens.c_str(),
      want_prompt.c_str());

  EXPECT_EQ(prometheus.Stop(), 0) << "prometheus did not exit cleanly on SIGTERM";
  EXPECT_EQ(up, "3") << prometheus.Log();
  EXPECT_EQ(generated, want_tokens);
  EXPECT_EQ(prompted, want_prompt);
  EXPECT_EQ(kv_usage, "0");
  EXPECT_EQ(successes, std::to_string(kRequests));
}

// The rest of a "key=value ..." line after "key=", up to the next space.
std::string Field(const std::string& line, const std::string& key) {
  const size_t at = line.find(key + "=");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 1;
  return line.substr(begin, line.find(' ', begin) - begin);
}

// What the client saw of one stream: when each token message arrived.
struct ClientStream {
  std::vector<std::chrono::system_clock::time_point> arrivals;  // one per message with tokens
  int prompt_tokens = 0;
  int tokens = 0;
};

// A whole `duet serve` cluster (a prefill and a decode worker) scraped the way its docs say: the
// router on its HTTP port, every worker on its metrics port. Under a steady load the standard
// vLLM dashboard queries, summed over every target without a role filter, give what the client
// measured: the token rate and the mean inter-token latency within 5% (the client's over the span
// of the scrapes the rate() covers: one decode worker, so one series and one span), and the totals
// exactly.
TEST(MetricsClusterTest, VllmDashboardQueriesOverADuetServeClusterMatchTheClient) {
  if (!metrics::testing::PrometheusInstalled()) GTEST_SKIP() << "prometheus not installed";
  auto serve = Subprocess::Start({testing::DuetBinary(), "serve", "--model", std::string(DUET_MODELS_DIR) + "/tiny-code-llama",
                                  "--backend", "cpu", "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                                  "--prefill-workers", "1", "--decode-workers", "1"});
  ASSERT_TRUE(serve.ok()) << serve.status();
  std::vector<std::string> targets;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::string> worker = (*serve)->WaitForLine("DUET_WORKER ", std::chrono::seconds(120));
    ASSERT_TRUE(worker.ok()) << worker.status();
    ASSERT_NE(Field(*worker, "metrics_port"), "") << *worker;
    targets.push_back("127.0.0.1:" + Field(*worker, "metrics_port"));
  }
  absl::StatusOr<std::string> http = (*serve)->WaitForLine("DUET_HTTP_READY port=", std::chrono::seconds(120));
  ASSERT_TRUE(http.ok()) << http.status();
  const int http_port = std::atoi(http->c_str());
  targets.push_back(absl::StrCat("127.0.0.1:", http_port));
  absl::StatusOr<std::string> grpc_port = (*serve)->WaitForLine("DUET_READY grpc_port=", std::chrono::seconds(120));
  ASSERT_TRUE(grpc_port.ok()) << grpc_port.status();
  auto stub = v1::Duet::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", *grpc_port), grpc::InsecureChannelCredentials()));

  auto started = PrometheusServer::Start(targets);
  ASSERT_TRUE(started.ok()) << started.status();
  PrometheusServer& prometheus = **started;
  for (int i = 0; i < 120 && Query(prometheus, "sum(up{job=\"duet\"})") != "3"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  ASSERT_EQ(Query(prometheus, "sum(up{job=\"duet\"})"), "3") << prometheus.Log();

  // The HTTP API counts responses by status: a 404, a 400, a /health 200.
  EXPECT_EQ(metrics::testing::HttpGet(uint16_t(http_port), "/no/such/path", std::chrono::seconds(5)).status, 404);
  EXPECT_EQ(metrics::testing::HttpGet(uint16_t(http_port), "/health", std::chrono::seconds(5)).status, 200);

  // A steady load: 4 streams, each one request after another, for kLoad.
  std::ifstream reference_file(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  const nlohmann::json cases = nlohmann::json::parse(reference_file)["cases"];
  constexpr auto kLoad = std::chrono::seconds(14);
  const auto load_start = std::chrono::system_clock::now();
  const auto load_end = load_start + kLoad;
  absl::Mutex mu;
  std::vector<ClientStream> streams;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; std::chrono::system_clock::now() < load_end; i += 4) {
        v1::GenerateRequest request;
        request.set_text(cases[size_t(i) % cases.size()]["prompt"].get<std::string>());
        request.mutable_sampling()->set_temperature(0.0f);
        request.mutable_sampling()->set_max_tokens(40);
        request.mutable_sampling()->set_ignore_eos(true);
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
        auto reader = stub->Generate(&context, request);
        ClientStream stream;
        v1::GenerateResponse message;
        while (reader->Read(&message)) {
          if (message.prompt_token_ids_size() > 0) stream.prompt_tokens = message.prompt_token_ids_size();
          if (message.token_ids_size() == 0) continue;
          stream.arrivals.push_back(std::chrono::system_clock::now());
          stream.tokens += message.token_ids_size();
        }
        const grpc::Status status = reader->Finish();
        EXPECT_TRUE(status.ok()) << status.error_message();
        absl::MutexLock lock(&mu);
        streams.push_back(std::move(stream));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  int64_t tokens = 0, prompt_tokens = 0;
  for (const ClientStream& s : streams) {
    tokens += s.tokens;
    prompt_tokens += s.prompt_tokens;
  }

  // The dashboard's window: (eval - kWindow, eval], inside the load.
  constexpr int kWindow = 10;
  const double eval = UnixSeconds(load_end - std::chrono::seconds(1));

  // Totals, once Prometheus has scraped the end of the load.
  const std::string want_tokens = std::to_string(tokens), want_prompt = std::to_string(prompt_tokens),
                    want_requests = std::to_string(streams.size());
  std::string generated, prompted, successes, e2e_count, running, waiting;
  for (int i = 0; i < 120; ++i) {
    generated = Query(prometheus, "sum(duet:generation_tokens_total)");
    prompted = Query(prometheus, "sum(duet:prompt_tokens_total)");
    successes = Query(prometheus, "sum(duet:request_success_total)");
    e2e_count = Query(prometheus, "sum(duet:e2e_request_latency_seconds_count)");
    running = Query(prometheus, "sum(duet:num_requests_running)");
    waiting = Query(prometheus, "sum(duet:num_requests_waiting)");
    if (generated == want_tokens && prompted == want_prompt && successes == want_requests && running == "0" &&
        waiting == "0") {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  // The dashboard's panels (vLLM's grafana.json), summed over the cluster.
  const std::string window = absl::StrCat("[", kWindow, "s]");
  const std::string rate = Query(prometheus, "sum(rate(duet:generation_tokens_total" + window + "))", eval);
  const std::string itl = Query(prometheus,
                                "sum(rate(duet:inter_token_latency_seconds_sum" + window +
                                    ")) / sum(rate(duet:inter_token_latency_seconds_count" + window + "))",
                                eval);
  const std::string tpot = Query(prometheus,
                                 "sum(rate(duet:time_per_output_token_seconds_sum" + window +
                                     ")) / sum(rate(duet:time_per_output_token_seconds_count" + window + "))",
                                 eval);
  // The client's truth over what rate() measures: the span of the scrapes inside the window.
  const auto [rate_from, rate_to] = SampleSpan(prometheus, "duet:generation_tokens_total" + window, eval);
  const auto [itl_from, itl_to] = SampleSpan(prometheus, "duet:inter_token_latency_seconds_count" + window, eval);
  int64_t span_tokens = 0, gaps = 0;
  double gap_seconds = 0;
  for (const ClientStream& s : streams) {
    for (size_t i = 0; i < s.arrivals.size(); ++i) {
      const double at = UnixSeconds(s.arrivals[i]);
      if (at > rate_from && at <= rate_to) ++span_tokens;  // one token per message (no speculation)
      if (i > 0 && at > itl_from && at <= itl_to) {
        ++gaps;
        gap_seconds += std::chrono::duration<double>(s.arrivals[i] - s.arrivals[i - 1]).count();
      }
    }
  }
  const double client_rate = double(span_tokens) / (rate_to - rate_from);
  const double client_itl = gap_seconds / double(gaps);
  const std::string not_found = Query(prometheus, "sum(http_requests_total{handler=\"none\",status=\"404\"})");
  const std::string health_ok = Query(prometheus, "sum(http_requests_total{handler=\"/health\",status=\"200\"})");
  std::printf(
      "%zu requests, %lld tokens, %lld prompt tokens; window of %d s (scrapes over %.2f s): client %.1f tok/s, "
      "ITL %.2f ms (%lld gaps)\n"
      "PromQL: sum(rate(generation_tokens_total))=%s, ITL=%s s, TPOT=%s s; sum(generation_tokens_total)=%s "
      "sum(prompt_tokens_total)=%s sum(request_success_total)=%s sum(e2e count)=%s running=%s waiting=%s "
      "http 404=%s /health 200=%s\n",
      streams.size(), (long long)tokens, (long long)prompt_tokens, kWindow, rate_to - rate_from, client_rate,
      client_itl * 1e3,
      (long long)gaps, rate.c_str(), itl.c_str(), tpot.c_str(), generated.c_str(), prompted.c_str(),
      successes.c_str(), e2e_count.c_str(), running.c_str(), waiting.c_str(), not_found.c_str(), health_ok.c_str());
  const std::string prometheus_log = prometheus.Log();
  EXPECT_EQ(prometheus.Stop(), 0) << "prometheus did not exit cleanly on SIGTERM";
  (*serve)->Signal(SIGTERM);
  EXPECT_EQ((*serve)->Wait(std::chrono::seconds(60)), 0);

  EXPECT_EQ(generated, want_tokens) << prometheus_log;
  EXPECT_EQ(prompted, want_prompt);
  EXPECT_EQ(successes, want_requests);
  EXPECT_EQ(e2e_count, want_requests);
  EXPECT_EQ(running, "0");
  EXPECT_EQ(waiting, "0");
  EXPECT_EQ(not_found, "1");
  EXPECT_EQ(health_ok, "1");
  ASSERT_FALSE(rate.empty());
  ASSERT_FALSE(itl.empty());
  ASSERT_FALSE(tpot.empty());
  ASSERT_GT(rate_to - rate_from, kWindow / 2);
  ASSERT_GT(gaps, 0);
  EXPECT_NEAR(std::stod(rate) / client_rate, 1.0, 0.05) << rate << " vs " << client_rate;
  EXPECT_NEAR(std::stod(itl) / client_itl, 1.0, 0.05) << itl << " vs " << client_itl;
  // The router observes each gap into both histograms, one after the other: a scrape that lands between the two
  // sees one more gap in ITL than in TPOT, so the two means agree up to a gap per running stream.
  EXPECT_NEAR(std::stod(tpot) / std::stod(itl), 1.0, 0.01) << tpot << " vs " << itl;
}

}  // namespace
}  // namespace duet
