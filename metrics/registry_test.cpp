#include "metrics/registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace duet::metrics {
namespace {

TEST(FormatTest, Values) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(-0.0), "0");
  EXPECT_EQ(FormatValue(42), "42");
  EXPECT_EQ(FormatValue(-3), "-3");
  EXPECT_EQ(FormatValue(9007199254740992.0), "9007199254740992");
  EXPECT_EQ(FormatValue(1e300), "1e+300");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(1e-05), "1e-05");
  EXPECT_EQ(FormatValue(2.5), "2.5");
  EXPECT_EQ(FormatValue(-0.0042), "-0.0042");
  EXPECT_EQ(FormatValue(1234.5678), "1234.5678");
  EXPECT_EQ(FormatValue(1.0 / 3), "0.3333333333333333");
  EXPECT_EQ(FormatValue(1.5e17), "1.5e+17");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
  EXPECT_EQ(FormatValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatValue(-std::numeric_limits<double>::infinity()), "-Inf");
}

TEST(FormatTest, BucketBounds) {
  EXPECT_EQ(FormatBucketBound(1), "1.0");
  EXPECT_EQ(FormatBucketBound(2560), "2560.0");
  EXPECT_EQ(FormatBucketBound(0.001), "0.001");
  EXPECT_EQ(FormatBucketBound(0.075), "0.075");
  EXPECT_EQ(FormatBucketBound(1e-4), "0.0001");
  EXPECT_EQ(FormatBucketBound(-2), "-2.0");
  EXPECT_EQ(FormatBucketBound(1e-5), "1e-05");
  EXPECT_EQ(FormatBucketBound(123.456), "123.456");
  EXPECT_EQ(FormatBucketBound(4294967296.0), "4294967296.0");
  EXPECT_EQ(FormatBucketBound(1e16), "1e+16");
  EXPECT_EQ(FormatBucketBound(1.5e300), "1.5e+300");
}

TEST(FormatTest, Escaping) {
  EXPECT_EQ(EscapeLabelValue("plain"), "plain");
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");  // quotes stay as they are in HELP
}

TEST(FormatTest, Names) {
  EXPECT_TRUE(IsValidMetricName("duet:prompt_tokens_total"));
  EXPECT_TRUE(IsValidMetricName("_x9"));
  EXPECT_FALSE(IsValidMetricName("9x"));
  EXPECT_FALSE(IsValidMetricName("a-b"));
  EXPECT_FALSE(IsValidMetricName(""));
  EXPECT_TRUE(IsValidLabelName("model_name"));
  EXPECT_FALSE(IsValidLabelName("__reserved"));
  EXPECT_FALSE(IsValidLabelName("a:b"));
  EXPECT_FALSE(IsValidLabelName("1a"));
}

TEST(RegistryTest, CounterAndGaugeExposition) {
  Registry registry;
  auto& requests = registry.AddCounter("http_requests_total", "Requests served.", {"code", "path"});
  requests.WithLabels({"200", "/metrics"}).Inc();
  requests.WithLabels({"200", "/metrics"}).Inc(2);
  requests.WithLabels({"404", "/x\"y\\z\nw"}).Inc(0.5);
  requests.WithLabels({"200", "/metrics"}).Inc(-5);  // ignored: counters never go down
  requests.WithLabels({"200", "/metrics"}).Inc(std::nan(""));  // ignored
  auto& temperature = registry.AddGauge("a_temperature_celsius", "Line one\nback\\slash.");
  temperature.WithLabels({}).Set(-12.5);
  registry.AddGauge("b_unset", "Never set.");
  auto& special = registry.AddGauge("c_special", "Special values.", {"kind"});
  special.WithLabels({"nan"}).Set(std::nan(""));
  special.WithLabels({"inf"}).Set(std::numeric_limits<double>::infinity());
  special.WithLabels({"minf"}).Set(-std::numeric_limits<double>::infinity());
  registry.AddCounter("d_labelled_unused_total", "No children yet.", {"x"});

  EXPECT_EQ(registry.Render(),
            "# HELP a_temperature_celsius Line one\\nback\\\\slash.\n"
            "# TYPE a_temperature_celsius gauge\n"
            "a_temperature_celsius -12.5\n"
            "# HELP b_unset Never set.\n"
            "# TYPE b_unset gauge\n"
            "b_unset 0\n"
            "# HELP c_special Special values.\n"
            "# TYPE c_special gauge\n"
            "c_special{kind=\"inf\"} +Inf\n"
            "c_special{kind=\"minf\"} -Inf\n"
            "c_special{kind=\"nan\"} NaN\n"
            "# HELP d_labelled_unused_total No children yet.\n"
            "# TYPE d_labelled_unused_total counter\n"
            "# HELP http_requests_total Requests served.\n"
            "# TYPE http_requests_total counter\n"
            "http_requests_total{code=\"200\",path=\"/metrics\"} 3\n"
            "http_requests_total{code=\"404\",path=\"/x\\\"y\\\\z\\nw\"} 0.5\n");
}

TEST(RegistryTest, GaugeIncDec) {
  Registry registry;
  Gauge& g = registry.AddGauge("g", "G.").WithLabels({});
  g.Inc(5);
  g.Dec(2);
  g.Dec();
  EXPECT_EQ(g.Value(), 2);
}

TEST(RegistryTest, HistogramExposition) {
  Registry registry;
  auto& latency = registry.AddHistogram("rpc_seconds", "RPC latency.", {"method"}, {0.1, 1, 2.5});
  Histogram& get = latency.WithLabels({"get"});
  get.Observe(0.05);
  get.Observe(0.1);  // bounds are inclusive
  get.Observe(0.7);
  get.Observe(3);
  get.Observe(std::nan(""));  // ignored
  latency.WithLabels({"put"});
  registry.AddHistogram("unlabelled_bytes", "No labels.", {}, {1024}).WithLabels({}).Observe(1024);

  EXPECT_EQ(registry.Render(),
            "# HELP rpc_seconds RPC latency.\n"
            "# TYPE rpc_seconds histogram\n"
            "rpc_seconds_bucket{method=\"get\",le=\"0.1\"} 2\n"
            "rpc_seconds_bucket{method=\"get\",le=\"1.0\"} 3\n"
            "rpc_seconds_bucket{method=\"get\",le=\"2.5\"} 3\n"
            "rpc_seconds_bucket{method=\"get\",le=\"+Inf\"} 4\n"
            "rpc_seconds_sum{method=\"get\"} 3.85\n"
            "rpc_seconds_count{method=\"get\"} 4\n"
            "rpc_seconds_bucket{method=\"put\",le=\"0.1\"} 0\n"
            "rpc_seconds_bucket{method=\"put\",le=\"1.0\"} 0\n"
            "rpc_seconds_bucket{method=\"put\",le=\"2.5\"} 0\n"
            "rpc_seconds_bucket{method=\"put\",le=\"+Inf\"} 0\n"
            "rpc_seconds_sum{method=\"put\"} 0\n"
            "rpc_seconds_count{method=\"put\"} 0\n"
            "# HELP unlabelled_bytes No labels.\n"
            "# TYPE unlabelled_bytes histogram\n"
            "unlabelled_bytes_bucket{le=\"1024.0\"} 1\n"
            "unlabelled_bytes_bucket{le=\"+Inf\"} 1\n"
            "unlabelled_bytes_sum 1024\n"
            "unlabelled_bytes_count 1\n");
}

TEST(RegistryTest, SameDefinitionReturnsSameFamily) {
  Registry registry;
  auto& a = registry.AddCounter("x_total", "X.", {"l"});
  auto& b = registry.AddCounter("x_total", "X.", {"l"});
  EXPECT_EQ(&a, &b);
  EXPECT_EQ(&a.WithLabels({"v"}), &b.WithLabels({"v"}));
  auto& h1 = registry.AddHistogram("h", "H.", {}, {1, 2});
  auto& h2 = registry.AddHistogram("h", "H.", {}, {1, 2});
  EXPECT_EQ(&h1, &h2);
}

TEST(RegistryDeathTest, ConflictingDefinitionsAbort) {
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("x_total", "X.", {"l"});
        registry.AddGauge("x_total", "X.", {"l"});
      },
      "registered twice");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("bad-name", "X.");
      },
      "DUET_CHECK");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddHistogram("h", "H.", {"le"}, {1});
      },
      "DUET_CHECK");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddHistogram("h", "H.", {}, {2, 1});
      },
      "DUET_CHECK");
  EXPECT_DEATH(
      {
        Registry registry;
        registry.AddCounter("c_total", "C.", {"a", "b"}).WithLabels({"only-one"});
      },
      "DUET_CHECK");
}

TEST(RegistryTest, ConcurrentUpdatesSumCorrectly) {
  Registry registry;
  auto& counter = registry.AddCounter("c_total", "C.", {"worker"});
  auto& gauge = registry.AddGauge("g", "G.");
  auto& histogram = registry.AddHistogram("h", "H.", {}, {0.5, 1.5});
  constexpr int kThreads = 16;
  constexpr int kIterations = 20000;
  std::vector<std::thread> threads;
  std::atomic<bool> done{false};
  // A scraper runs concurrently: every snapshot must be internally consistent.
  std::thread scraper([&] {
    while (!done.load()) {
      Histogram::Snapshot s = histogram.WithLabels({}).Collect();
      ASSERT_EQ(s.cumulative.back(), s.count);
      ASSERT_FALSE(registry.Render().empty());
    }
  });
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIterations; ++i) {
        counter.WithLabels({"shared"}).Inc();
        counter.WithLabels({std::to_string(t % 4)}).Inc(0.5);
        gauge.WithLabels({}).Inc();
        gauge.WithLabels({}).Dec(0.5);
        histogram.WithLabels({}).Observe(i % 2);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  done = true;
  scraper.join();
  EXPECT_EQ(counter.WithLabels({"shared"}).Value(), kThreads * kIterations);
  for (int w = 0; w < 4; ++w) {
    EXPECT_EQ(counter.WithLabels({std::to_string(w)}).Value(), kThreads / 4 * kIterations * 0.5);
  }
  EXPECT_EQ(gauge.WithLabels({}).Value(), kThreads * kIterations * 0.5);
  Histogram::Snapshot s = histogram.WithLabels({}).Collect();
  EXPECT_EQ(s.count, uint64_t{kThreads} * kIterations);
  EXPECT_EQ(s.cumulative[0], uint64_t{kThreads} * kIterations / 2);  // the zeros
  EXPECT_EQ(s.cumulative[1], s.count);
  EXPECT_EQ(s.sum, kThreads * kIterations / 2);
  EXPECT_THAT(registry.Render(), ::testing::HasSubstr("c_total{worker=\"shared\"} 320000\n"));
}

}  // namespace
}  // namespace duet::metrics
