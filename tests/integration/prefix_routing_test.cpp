// Prefix-aware routing over real processes: a router in front of 2 prefill workers and 1 decode
// worker (CPU, the bundled model, 16-token KV blocks) places the requests of each shared-prefix
// group on one prefill worker, where least-loaded routing spreads them. Requests run one at a
// time and where each went is read from the prefill workers' own counts of KV transfers shipped,
// so nothing depends on timing.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "tests/integration/local_cluster.h"

namespace duet {
namespace {

using testing::ClusterOptions;
using testing::LocalCluster;
using testing::RunGenerate;

constexpr int kPrefixTokens = 64;  // 4 blocks of 16

// The two groups' prompts: a group's 64-token prefix, then a token of the request's own.
std::vector<int32_t> Prompt(int group, int request) {
  std::vector<int32_t> ids;
  for (int i = 0; i < kPrefixTokens; ++i) ids.push_back(int32_t(100 + 1000 * group + 7 * i));
  ids.push_back(int32_t(5000 + request));
  return ids;
}

// Group of each request, in order: runs of one group and alternations.
const std::vector<int> kGroups = {0, 0, 0, 1, 1, 1, 0, 1, 0, 1};

int64_t Shipped(const v1::WorkerStats& stats) {
  int64_t n = 0;
  for (const auto& [path, count] : stats.kv_transfers_by_path()) n += count;
  return n;
}

// Sends kGroups' requests one after the other; returns the prefill worker (0 or 1) of each, -1
// where it cannot tell.
std::vector<int> RouteSequentially(LocalCluster& cluster) {
  std::vector<int> placed;
  std::vector<v1::WorkerStats> before = cluster.PrefillStats();
  for (size_t i = 0; i < kGroups.size(); ++i) {
    v1::GenerateRequest request;
    for (int32_t id : Prompt(kGroups[i], int(i))) request.mutable_token_ids()->add_ids(id);
    request.mutable_sampling()->set_temperature(0);
    request.mutable_sampling()->set_max_tokens(2);
    const testing::StreamResult result = RunGenerate(cluster.router(), request);
    EXPECT_TRUE(result.status.ok()) << result.status.error_message();
    std::vector<v1::WorkerStats> after = cluster.PrefillStats();
    int where = -1;
    if (before.size() == 2 && after.size() == 2) {
      for (int w = 0; w < 2; ++w) {
        if (Shipped(after[size_t(w)]) == Shipped(before[size_t(w)]) + 1) where = where == -1 ? w : -2;
      }
    }
    placed.push_back(where < 0 ? -1 : where);
    before = std::move(after);
  }
  return placed;
}

// The router's duet:routed_prompt_blocks_cached_total{worker_role="prefill"}; -1 when absent.
double PredictedCachedPrefillBlocks(LocalCluster& cluster) {
  const metrics::testing::HttpResponse r =
      metrics::testing::HttpGet(uint16_t(cluster.router_metrics_port()), "/metrics", std::chrono::seconds(5));
  std::istringstream lines(r.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("duet:routed_prompt_blocks_cached_total{", 0) == 0 &&
        line.find("worker_role=\"prefill\"") != std::string::npos) {
      return std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return -1;
}

ClusterOptions Options(const std::string& policy) {
  ClusterOptions options;
  options.num_prefill = 2;
  options.num_decode = 1;
  options.metrics = true;
  options.worker_flags = {"--block-size", "16"};
  options.router_flags = {"--routing-policy", policy};
  return options;
}

TEST(PrefixRoutingTest, PrefixAwareRoutingKeepsEachPrefixGroupOnOneWorker) {
  LocalCluster cluster(Options("prefix-aware"));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::vector<int> placed = RouteSequentially(cluster);
  ASSERT_EQ(placed.size(), kGroups.size());
  int worker_of[2] = {-1, -1};
  for (size_t i = 0; i < placed.size(); ++i) {
    ASSERT_GE(placed[i], 0) << "request " << i;
    if (worker_of[kGroups[i]] == -1) worker_of[kGroups[i]] = placed[i];
    EXPECT_EQ(placed[i], worker_of[kGroups[i]]) << "request " << i << " of group " << kGroups[i];
  }
  // Every request after its group's first was predicted cached: 8 requests × 4 prefix blocks.
  EXPECT_EQ(PredictedCachedPrefillBlocks(cluster), 8 * 4);
}

// The same requests under least-loaded routing: idle workers take turns, so a group's requests
// land on both (the comparison that shows the test above needs the feature).
TEST(PrefixRoutingTest, LeastLoadedRoutingSpreadsEachPrefixGroup) {
  LocalCluster cluster(Options("least-loaded"));
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::vector<int> placed = RouteSequentially(cluster);
  ASSERT_EQ(placed.size(), kGroups.size());
  int count[2][2] = {{0, 0}, {0, 0}};  // [group][worker]
  for (size_t i = 0; i < placed.size(); ++i) {
    ASSERT_GE(placed[i], 0) << "request " << i;
    ++count[kGroups[i]][placed[i]];
  }
  for (int group : {0, 1}) {
    EXPECT_GT(count[group][0], 0) << "group " << group;
    EXPECT_GT(count[group][1], 0) << "group " << group;
  }
  EXPECT_LT(PredictedCachedPrefillBlocks(cluster), 8 * 4);
}

}  // namespace
}  // namespace duet
