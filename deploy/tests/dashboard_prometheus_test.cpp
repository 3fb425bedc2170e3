// The Grafana dashboard (deploy/grafana/duet.json) and the alert rules
// (deploy/prometheus/duet-rules.yml) against a real Prometheus (/usr/bin/prometheus) scraping a
// real cluster (router, prefill and decode worker as processes) after load: every panel's query
// returns a number, the dashboard's variables list the model, every alert expression evaluates,
// and those that watch for a broken cluster match nothing on this healthy one.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <future>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "metrics/test_prometheus_server.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"

namespace duet {
namespace {

using nlohmann::json;
using testing::ClusterOptions;
using testing::LocalCluster;
using testing::RunGenerate;
using testing::StreamResult;
using metrics::testing::PrometheusServer;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

double Number(const json& sample) { return std::stod(sample["value"][1].get<std::string>()); }

// Grafana's variables as the dashboard's defaults ("All") resolve them, and a rate window that
// covers the load.
std::string Substitute(const std::string& expr) {
  return absl::StrReplaceAll(expr, {{"$__rate_interval", "1m"}, {"$model_name", ".*"}, {"$job", ".*"}});
}

struct Panel {
  std::string title;
  std::vector<std::string> exprs;
};

std::vector<Panel> DashboardPanels() {
  const json dashboard = json::parse(ReadFile(DUET_SOURCE_DIR "/deploy/grafana/duet.json"));
  std::vector<Panel> panels;
  for (const json& panel : dashboard["panels"]) {
    if (!panel.contains("targets")) continue;
    Panel p{panel["title"].get<std::string>(), {}};
    for (const json& target : panel["targets"]) p.exprs.push_back(target["expr"].get<std::string>());
    panels.push_back(std::move(p));
  }
  return panels;
}

class DashboardPrometheusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!metrics::testing::PrometheusInstalled()) GTEST_SKIP() << "prometheus not installed (scripts/install_deps.sh)";
  }

  // Prometheus scraping `ports` every second as job "duet".
  void StartPrometheus(const std::vector<int>& ports) {
    std::vector<std::string> targets;
    for (int port : ports) targets.push_back(absl::StrCat("127.0.0.1:", port));
    absl::StatusOr<std::unique_ptr<PrometheusServer>> p = PrometheusServer::Start(targets);
    ASSERT_TRUE(p.ok()) << p.status();
    prometheus_ = *std::move(p);
  }

  // Waits (up to 60 s) until `promql` evaluates to exactly one sample equal to `want`.
  bool WaitForValue(const std::string& promql, double want) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < give_up) {
      json result = prometheus_->Query(promql);
      if (result.is_array() && result.size() == 1 && Number(result[0]) == want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    ADD_FAILURE() << promql << " never became " << want << "; prometheus log:\n" << prometheus_->Log();
    return false;
  }

  std::unique_ptr<PrometheusServer> prometheus_;
};

TEST_F(DashboardPrometheusTest, EveryPanelHasDataUnderLoadAndNoFailureAlertMatchesAHealthyCluster) {
  ClusterOptions options;
  options.metrics = true;
  // Lookahead speculation on the decode worker, so the speculation panels have drafts to show.
  options.worker_flags = {"--speculation", "lookahead"};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  StartPrometheus({cluster.router_metrics_port(), cluster.prefill_metrics_ports()[0], cluster.decode_metrics_ports()[0]});
  ASSERT_TRUE(WaitForValue("sum(up{job=\"duet\"})", 3));

  // Two waves of the reference prompts (code: lookahead finds drafts in them), some of them again
  // and again so the counters grow over several scrapes.
  const json ref = json::parse(ReadFile(DUET_MODELS_DIR "/tiny-code-llama/reference_greedy.json"));
  int64_t tokens = 0;
  for (int wave = 0; wave < 2; ++wave) {
    std::vector<std::future<StreamResult>> results;
    for (const json& c : ref["cases"]) {
      v1::GenerateRequest r;
      for (int32_t id : c["prompt_ids"].get<std::vector<int32_t>>()) r.mutable_token_ids()->add_ids(id);
      r.mutable_sampling()->set_temperature(0.0f);
      r.mutable_sampling()->set_max_tokens(64);
      results.push_back(std::async(std::launch::async, [&cluster, r] { return RunGenerate(cluster.router(), r); }));
    }
    for (auto& f : results) {
      StreamResult got = f.get();
      ASSERT_TRUE(got.status.ok()) << got.status.error_message();
      tokens += static_cast<int64_t>(got.token_ids.size());
    }
  }
  // Prometheus has scraped the end of the load.
  // Each token counted once over the whole cluster (metrics/README.md: the decode worker owns it).
  ASSERT_TRUE(WaitForValue("sum(duet:generation_tokens_total)", double(tokens)));

  for (const Panel& panel : DashboardPanels()) {
    int finite = 0;
    std::string seen;
    for (const std::string& expr : panel.exprs) {
      const json result = prometheus_->Query(Substitute(expr));
      ASSERT_TRUE(result.is_array()) << panel.title << ": Prometheus refused " << Substitute(expr);
      for (const json& sample : result) {
        const double v = Number(sample);
        if (std::isfinite(v)) ++finite;
        absl::StrAppend(&seen, " ", sample["metric"].dump(), "=", v);
      }
    }
    std::printf("panel %-45s%s\n", panel.title.c_str(), seen.substr(0, 160).c_str());
    EXPECT_GT(finite, 0) << "panel \"" << panel.title << "\" has no number:" << seen;
  }

  // The dashboard's variables: the model and the job.
  const json models = prometheus_->Api("/api/v1/label/model_name/values?match[]=" +
                                       metrics::testing::UrlEncode("duet:num_requests_running"));
  EXPECT_EQ(models, json::array({"tiny-code-llama"}));

  // Every alert expression evaluates; those that watch for a broken cluster match nothing on this
  // healthy, idle-again one. (The latency ones depend on how fast this machine is: a loaded
  // 2-core CPU cluster may well be over their production thresholds.)
  const std::set<std::string> quiet_when_healthy = {"DuetTargetDown",         "DuetNoDecodeWorkers",
                                                    "DuetNoPrefillWorkers",   "DuetRequestsQueueing",
                                                    "DuetKvCacheNearlyFull",  "DuetKvTransferFailures"};
  std::istringstream rules(ReadFile(DUET_SOURCE_DIR "/deploy/prometheus/duet-rules.yml"));
  static const std::regex alert_line(R"(^\s*- alert:\s*(\S+)\s*$)");
  static const std::regex expr_line(R"(^\s*expr:\s*(.+)$)");
  std::string alert;
  int checked = 0, quiet = 0;
  for (std::string line; std::getline(rules, line);) {
    std::smatch m;
    if (std::regex_match(line, m, alert_line)) alert = m[1].str();
    if (!std::regex_match(line, m, expr_line)) continue;
    const json result = prometheus_->Query(m[1].str());
    ASSERT_TRUE(result.is_array()) << alert << ": Prometheus refused " << m[1].str();
    if (quiet_when_healthy.count(alert)) {
      EXPECT_TRUE(result.empty()) << alert << " matches " << result.dump();
      ++quiet;
    }
    ++checked;
  }
  EXPECT_EQ(quiet, static_cast<int>(quiet_when_healthy.size()));
  EXPECT_EQ(checked, 10);
}

}  // namespace
}  // namespace duet
