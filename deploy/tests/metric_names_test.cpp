// Every metric the Grafana dashboard (deploy/grafana/duet.json) and the alert rules
// (deploy/prometheus/duet-rules.yml) query is one Duet exports, with the labels they use: the
// metric set of each role (metrics/vllm_metrics.h, every labelled child touched) and the process
// metrics, rendered as a scrape would see them.
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "metrics/process_metrics.h"
#include "metrics/registry.h"
#include "metrics/vllm_metrics.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Sample name -> the label names its samples carry, from a text exposition.
using Exported = std::map<std::string, std::set<std::string>>;

void AddExposition(const std::string& text, Exported* out) {
  static const std::regex sample(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? )");
  static const std::regex label(R"(([a-zA-Z_][a-zA-Z0-9_]*)=")");
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (line.empty() || line[0] == '#' || !std::regex_search(line, m, sample)) continue;
    std::set<std::string>& labels = (*out)[m[1].str()];
    const std::string body = m[3].str();
    for (std::sregex_iterator it(body.begin(), body.end(), label), end; it != end; ++it) labels.insert((*it)[1].str());
  }
}

Exported WhatDuetExports() {
  Exported exported;
  metrics::Registry registry;
  metrics::RouterMetrics router(registry, "tiny");
  router.request_success(FinishReason::kStop).Inc();
  router.RecordHttpRequest("/v1/completions", "POST", 200, 0.1);
  metrics::PrefillMetrics prefill(registry, "tiny");
  prefill.SetCacheConfig({16, 64, "float32", 0.9, false});
  prefill.kv_transfer_bytes_total("ucx_shm").Inc(1);
  prefill.kv_transfer_seconds("ucx_shm").Observe(0.01);
  metrics::DecodeMetrics decode(registry, "tiny");
  decode.spec_decode_num_accepted_tokens_per_pos(0).Inc();
  AddExposition(registry.Render(), &exported);
  AddExposition(metrics::RenderProcessMetrics(), &exported);
  exported["up"] = {};  // Prometheus's own series for each target
  return exported;
}

// Labels Prometheus (and the Kubernetes service discovery of a ServiceMonitor) adds to every series.
const std::set<std::string> kTargetLabels = {"instance", "job", "namespace", "service", "pod", "container", "endpoint"};

// The PromQL expressions of the dashboard's panels and variables.
std::vector<std::string> DashboardQueries() {
  const nlohmann::json dashboard = nlohmann::json::parse(ReadFile(DUET_SOURCE_DIR "/deploy/grafana/duet.json"));
  std::vector<std::string> out;
  for (const auto& panel : dashboard["panels"]) {
    if (!panel.contains("targets")) continue;
    for (const auto& target : panel["targets"]) out.push_back(target["expr"].get<std::string>());
  }
  for (const auto& variable : dashboard["templating"]["list"]) {
    if (variable.contains("definition")) out.push_back(variable["definition"].get<std::string>());
  }
  return out;
}

std::vector<std::string> RuleQueries() {
  std::vector<std::string> out;
  std::istringstream lines(ReadFile(DUET_SOURCE_DIR "/deploy/prometheus/duet-rules.yml"));
  static const std::regex expr(R"(^\s*expr:\s*(.+)$)");
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, expr)) out.push_back(m[1].str());
  }
  return out;
}

// Each metric name in `query`, with the label names its selector matches on, and the labels of
// its `by (...)` clauses.
struct Use {
  std::string metric;
  std::set<std::string> labels;
};

std::vector<Use> MetricsIn(const std::string& query) {
  static const std::regex metric(R"((duet:[a-z0-9_]+|process_[a-z0-9_]+|\bup\b)(\{([^}]*)\})?)");
  static const std::regex matcher(R"(([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=))");
  std::vector<Use> uses;
  for (std::sregex_iterator it(query.begin(), query.end(), metric), end; it != end; ++it) {
    Use use{(*it)[1].str(), {}};
    const std::string body = (*it)[3].str();
    for (std::sregex_iterator m(body.begin(), body.end(), matcher); m != end; ++m) use.labels.insert((*m)[1].str());
    uses.push_back(std::move(use));
  }
  return uses;
}

std::set<std::string> GroupingLabels(const std::string& query) {
  static const std::regex by(R"(\b(?:by|ignoring|on)\s*\(([^)]*)\))");
  static const std::regex name(R"([a-zA-Z_][a-zA-Z0-9_]*)");
  std::set<std::string> out;
  for (std::sregex_iterator it(query.begin(), query.end(), by), end; it != end; ++it) {
    const std::string list = (*it)[1].str();
    for (std::sregex_iterator n(list.begin(), list.end(), name); n != end; ++n) out.insert((*n)[0].str());
  }
  return out;
}

void ExpectAllExported(const std::vector<std::string>& queries, const std::string& where) {
  const Exported exported = WhatDuetExports();
  std::set<std::string> every_label = kTargetLabels;
  for (const auto& [name, labels] : exported) every_label.insert(labels.begin(), labels.end());
  ASSERT_FALSE(queries.empty()) << where;
  for (const std::string& query : queries) {
    const std::vector<Use> uses = MetricsIn(query);
    EXPECT_FALSE(uses.empty()) << where << ": no Duet metric in " << query;
    for (const Use& use : uses) {
      auto found = exported.find(use.metric);
      if (found == exported.end()) {
        ADD_FAILURE() << where << ": Duet exports no " << use.metric << " (in " << query << ")";
        continue;
      }
      for (const std::string& label : use.labels) {
        EXPECT_TRUE(found->second.count(label) || kTargetLabels.count(label))
            << where << ": " << use.metric << " has no label " << label << " (in " << query << ")";
      }
    }
    for (const std::string& label : GroupingLabels(query)) {
      EXPECT_TRUE(every_label.count(label)) << where << ": no Duet series has the label " << label << " (in " << query << ")";
    }
  }
}

TEST(DashboardTest, EveryQueryNamesMetricsAndLabelsDuetExports) {
  ExpectAllExported(DashboardQueries(), "deploy/grafana/duet.json");
}

TEST(AlertRulesTest, EveryRuleNamesMetricsAndLabelsDuetExports) {
  ExpectAllExported(RuleQueries(), "deploy/prometheus/duet-rules.yml");
}

TEST(DashboardTest, TheCheckCatchesAMetricDuetDoesNotExport) {
  // The test above would pass vacuously if the parsing found nothing; a made-up name must fail it.
  const std::vector<Use> uses = MetricsIn("rate(duet:made_up_total{role=\"router\"}[5m])");
  ASSERT_EQ(uses.size(), 1u);
  EXPECT_EQ(WhatDuetExports().count(uses[0].metric), 0u);
  EXPECT_EQ(uses[0].labels, std::set<std::string>{"role"});
  EXPECT_GT(WhatDuetExports().count("duet:time_to_first_token_seconds_bucket"), 0u);
}

}  // namespace
}  // namespace duet
