#include "metrics/http_exporter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "metrics/test_http_client.h"

namespace duet::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::ConnectLoopback;
using testing::HttpGet;
using testing::ParseResponse;
using testing::RawExchange;

class HttpExporterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_.AddCounter("duet:prompt_tokens_total", "Prompt tokens.", {"model_name"})
        .WithLabels({"tiny"})
        .Inc(42);
    HttpExporter::Options options;
    options.host = "127.0.0.1";
    options.io_timeout = std::chrono::milliseconds(500);
    options.process_metrics = false;  // the bodies below are compared exactly
    auto exporter = HttpExporter::Start(registry_, options);
    ASSERT_TRUE(exporter.ok()) << exporter.status();
    exporter_ = std::move(*exporter);
    ASSERT_NE(exporter_->port(), 0);
  }

  uint16_t port() const { return exporter_->port(); }

  Registry registry_;
  std::unique_ptr<HttpExporter> exporter_;
};

TEST_F(HttpExporterTest, ServesMetrics) {
  auto r = HttpGet(port(), "/metrics");
  EXPECT_EQ(r.status, 200);
  EXPECT_THAT(r.headers, HasSubstr("\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8"));
  EXPECT_THAT(r.headers, HasSubstr("\r\nContent-Length: " + std::to_string(r.body.size())));
  EXPECT_EQ(r.body, registry_.Render());
  EXPECT_THAT(r.body, HasSubstr("duet:prompt_tokens_total{model_name=\"tiny\"} 42\n"));

  // Query strings are ignored, HTTP/1.0 works, HEAD gets headers only.
  EXPECT_EQ(HttpGet(port(), "/metrics?format=x").status, 200);
  auto r10 = ParseResponse(RawExchange(port(), "GET /metrics HTTP/1.0\r\n\r\n"));
  EXPECT_EQ(r10.status, 200);
  auto head = ParseResponse(RawExchange(port(), "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");
}

TEST_F(HttpExporterTest, ReflectsUpdates) {
  registry_.AddCounter("duet:prompt_tokens_total", "Prompt tokens.", {"model_name"})
      .WithLabels({"tiny"})
      .Inc(8);
  EXPECT_THAT(HttpGet(port(), "/metrics").body,
              HasSubstr("duet:prompt_tokens_total{model_name=\"tiny\"} 50\n"));
}

TEST_F(HttpExporterTest, ErrorStatuses) {
  EXPECT_EQ(HttpGet(port(), "/").status, 404);
  EXPECT_EQ(HttpGet(port(), "/metricsx").status, 404);
  EXPECT_EQ(HttpGet(port(), "/v1/models").status, 404);
  auto post = ParseResponse(
      RawExchange(port(), "POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc"));
  EXPECT_EQ(post.status, 405);
  EXPECT_THAT(post.headers, HasSubstr("\r\nAllow: GET, HEAD"));
  for (const char* bad :
       {"GARBAGE\r\n\r\n", "GET\r\n\r\n", "GET /metrics\r\n\r\n", "GET /metrics HTTP/2.0\r\n\r\n",
        "GET metrics HTTP/1.1\r\n\r\n", "GET  /metrics HTTP/1.1\r\n\r\n",
        "GET /metrics HTTP/1.1 extra\r\n\r\n", "\r\n\r\n", "\x01\x02\xff\xfe\r\n\r\n"}) {
    auto r = ParseResponse(RawExchange(port(), bad));
    EXPECT_EQ(r.status, 400) << bad;
  }
  // Headers past the limit: 431, and the server stays up.
  std::string huge = "GET /metrics HTTP/1.1\r\nX-Filler: " + std::string(64 * 1024, 'a') + "\r\n\r\n";
  EXPECT_EQ(ParseResponse(RawExchange(port(), huge)).status, 431);
  // A client that connects and leaves at once.
  for (int i = 0; i < 20; ++i) {
    int fd = ConnectLoopback(port());
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  EXPECT_EQ(HttpGet(port(), "/metrics").status, 200);
}

TEST_F(HttpExporterTest, SurvivesRandomInput) {
  std::mt19937 rng(4);
  for (int i = 0; i < 200; ++i) {
    std::string junk(rng() % 300, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    if (i % 2 == 0) junk += "\r\n\r\n";
    if (i % 3 == 0) junk = "GET /metrics HTTP/1.1\r\n" + junk;
    std::string raw = RawExchange(port(), junk, std::chrono::seconds(2), /*half_close=*/true);
    if (!raw.empty()) {
      int status = ParseResponse(raw).status;
      EXPECT_TRUE(status == 200 || (status >= 400 && status < 500)) << status;
    }
  }
  // Clients that send a request and vanish without reading the answer.
  for (int i = 0; i < 20; ++i) {
    int fd = ConnectLoopback(port());
    ASSERT_GE(fd, 0);
    const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    linger hard{1, 0};  // close with RST
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
    ::close(fd);
  }
  EXPECT_EQ(HttpGet(port(), "/metrics").status, 200);
}

TEST_F(HttpExporterTest, SlowClientsDoNotBlockScrapes) {
  // Half-open clients: one sends part of a request and stalls, one sends nothing.
  int partial = ConnectLoopback(port());
  ASSERT_GE(partial, 0);
  ASSERT_GT(::send(partial, "GET /met", 8, MSG_NOSIGNAL), 0);
  int silent = ConnectLoopback(port());
  ASSERT_GE(silent, 0);

  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(HttpGet(port(), "/metrics").status, 200);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(400));

  // After io_timeout (500 ms) the server drops them: they read EOF.
  for (int fd : {partial, silent}) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 3000), 1);
    char c;
    EXPECT_EQ(::recv(fd, &c, 1, 0), 0);
    ::close(fd);
  }
}

TEST_F(HttpExporterTest, ManySequentialAndConcurrentScrapes) {
  std::string expected = registry_.Render();
  for (int i = 0; i < 300; ++i) {
    auto r = HttpGet(port(), "/metrics");
    ASSERT_EQ(r.status, 200) << i;
    ASSERT_EQ(r.body, expected);
  }
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        if (HttpGet(port(), "/metrics").body == expected) ++ok;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(ok.load(), 400);
}

TEST_F(HttpExporterTest, LargeBody) {
  auto& family = registry_.AddGauge("big", "Many series.", {"i"});
  for (int i = 0; i < 20000; ++i) family.WithLabels({std::to_string(i)}).Set(i);
  auto r = HttpGet(port(), "/metrics");
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, registry_.Render());
  EXPECT_GT(r.body.size(), 300000u);
}

TEST_F(HttpExporterTest, StopClosesTheListener) {
  uint16_t p = port();
  int lingering = ConnectLoopback(p);  // open connection during Stop
  exporter_->Stop();
  exporter_->Stop();  // idempotent
  EXPECT_EQ(ConnectLoopback(p), -1);
  if (lingering >= 0) ::close(lingering);
}

TEST(HttpExporterStartTest, Errors) {
  Registry registry;
  HttpExporter::Options options;
  options.host = "no-such-host.invalid";
  EXPECT_FALSE(HttpExporter::Start(registry, options).ok());

  options.host = "127.0.0.1";
  auto first = HttpExporter::Start(registry, options);
  ASSERT_TRUE(first.ok()) << first.status();
  options.port = (*first)->port();
  auto second = HttpExporter::Start(registry, options);
  EXPECT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("cannot listen"));
}

// With a bearer token a scrape needs "Authorization: Bearer <token>" (any case of the header
// name); without it, or with another, 401.
TEST(HttpExporterStartTest, ABearerTokenGuardsTheScrape) {
  Registry registry;
  HttpExporter::Options options;
  options.host = "127.0.0.1";
  options.process_metrics = false;
  options.bearer_token = "s3cret";
  auto exporter = HttpExporter::Start(registry, options);
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  auto scrape = [&](const std::string& header) {
    return ParseResponse(RawExchange((*exporter)->port(),
                                     "GET /metrics HTTP/1.1\r\nHost: x\r\n" + header + "Connection: close\r\n\r\n"));
  };
  const auto refused = scrape("");
  EXPECT_EQ(refused.status, 401);
  EXPECT_THAT(refused.headers, HasSubstr("\r\nWWW-Authenticate: Bearer"));
  EXPECT_EQ(scrape("Authorization: Bearer wrong\r\n").status, 401);
  EXPECT_EQ(scrape("Authorization: Bearer s3cret-and-more\r\n").status, 401);
  EXPECT_EQ(scrape("Authorization: s3cret\r\n").status, 401);
  EXPECT_EQ(scrape("Authorization: Bearer s3cret\r\n").status, 200);
  EXPECT_EQ(scrape("authorization:Bearer s3cret \r\n").status, 200);
  EXPECT_EQ(HttpGet((*exporter)->port(), "/other").status, 404);  // the path is judged first
}

TEST(HttpExporterStartTest, ConnectionLimitOnlyDelays) {
  Registry registry;
  HttpExporter::Options options;
  options.host = "127.0.0.1";
  options.max_connections = 2;
  options.process_metrics = false;
  options.io_timeout = std::chrono::milliseconds(300);
  auto exporter = HttpExporter::Start(registry, options);
  ASSERT_TRUE(exporter.ok());
  uint16_t port = (*exporter)->port();
  int a = ConnectLoopback(port);
  int b = ConnectLoopback(port);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(HttpGet(port, "/metrics").status, 200);  // served once a silent client times out
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  ::close(a);
  ::close(b);
}

TEST(HttpExporterStartTest, CustomBody) {
  HttpExporter::Options options;
  options.host = "127.0.0.1";
  options.process_metrics = false;
  auto exporter = HttpExporter::Start([] { return std::string("x 1\n"); }, options);
  ASSERT_TRUE(exporter.ok());
  EXPECT_EQ(HttpGet((*exporter)->port(), "/metrics").body, "x 1\n");
}

TEST(HttpExporterStartTest, EveryScrapeCarriesTheProcessMetrics) {
  HttpExporter::Options options;
  options.host = "127.0.0.1";
  auto exporter = HttpExporter::Start([] { return std::string("x 1\n"); }, options);
  ASSERT_TRUE(exporter.ok());
  const std::string body = HttpGet((*exporter)->port(), "/metrics").body;
  EXPECT_EQ(body.rfind("x 1\n", 0), 0u);
  EXPECT_NE(body.find("\nprocess_resident_memory_bytes "), std::string::npos) << body;
}

}  // namespace
}  // namespace duet::metrics
