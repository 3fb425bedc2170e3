// Test helper: a real Prometheus server (/usr/bin/prometheus) in a temporary folder, on a free
// loopback port, scraping the given targets every second as job "duet", and its HTTP API read as
// JSON. The tests that check Duet's metrics, dashboard and alert rules against Prometheus itself
// share it.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/subprocess.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"

namespace duet::metrics::testing {

inline constexpr const char* kPrometheusBinary = "/usr/bin/prometheus";

inline bool PrometheusInstalled() { return ::access(kPrometheusBinary, X_OK) == 0; }

// A loopback port nothing listened on a moment ago.
inline uint16_t FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Percent-encoding of a query parameter's value (RFC 3986 unreserved characters kept).
inline std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += char(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

class PrometheusServer {
 public:
  // Starts the server in a new folder under /tmp, scraping `targets` ("host:port").
  static absl::StatusOr<std::unique_ptr<PrometheusServer>> Start(const std::vector<std::string>& targets) {
    char dir_template[] = "/tmp/duet_prometheus_XXXXXX";
    if (::mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
    std::unique_ptr<PrometheusServer> server(new PrometheusServer(dir_template, FreeLoopbackPort()));
    std::vector<std::string> quoted;
    for (const std::string& t : targets) quoted.push_back(absl::StrCat("'", t, "'"));
    std::ofstream(server->dir_ / "prometheus.yml")
        << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        << "scrape_configs:\n  - job_name: duet\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
        << "    static_configs:\n      - targets: [" << absl::StrJoin(quoted, ", ") << "]\n";
    absl::StatusOr<std::unique_ptr<Subprocess>> process = Subprocess::Start(
        {"/bin/sh", "-c",
         absl::StrCat("exec ", kPrometheusBinary, " --config.file=", (server->dir_ / "prometheus.yml").string(),
                      " --storage.tsdb.path=", (server->dir_ / "data").string(), " --web.listen-address=127.0.0.1:",
                      server->port_, " > ", (server->dir_ / "prometheus.log").string(), " 2>&1")});
    if (!process.ok()) return process.status();
    server->process_ = *std::move(process);
    return server;
  }
  ~PrometheusServer() {
    Stop();
    std::filesystem::remove_all(dir_);
  }
  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;

  // GET on the API: the answer's "data", or null json unless it answered success.
  nlohmann::json Api(const std::string& path_and_query) const {
    const HttpResponse r = HttpGet(port_, path_and_query, std::chrono::seconds(5));
    if (r.status != 200) return nlohmann::json();
    nlohmann::json body = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
    if (body.is_discarded() || body.value("status", "") != "success") return nlohmann::json();
    return body["data"];
  }

  // The result of the query `promql` evaluated now (or at `unix_seconds` when > 0); null json
  // when it failed.
  nlohmann::json Query(const std::string& promql, double unix_seconds = 0) const {
    std::string target = "/api/v1/query?query=" + UrlEncode(promql);
    if (unix_seconds > 0) target += absl::StrFormat("&time=%.3f", unix_seconds);
    nlohmann::json data = Api(target);
    return data.is_null() ? data : data["result"];
  }

  std::string Log() const {
    std::ifstream in(dir_ / "prometheus.log");
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  // SIGTERM, then up to 15 s for a clean exit (killed after that): the exit status, or
  // Subprocess::kStillRunning when it had to be killed. Once; later calls return the first's.
  int Stop() {
    if (process_ == nullptr) return exit_status_;
    process_->Signal(SIGTERM);
    exit_status_ = process_->Wait(std::chrono::seconds(15));
    if (exit_status_ == Subprocess::kStillRunning) process_->Stop(std::chrono::milliseconds(100));
    process_.reset();
    return exit_status_;
  }

 private:
  PrometheusServer(std::filesystem::path dir, uint16_t port) : dir_(std::move(dir)), port_(port) {}

  std::filesystem::path dir_;
  uint16_t port_;
  std::unique_ptr<Subprocess> process_;
  int exit_status_ = 0;
};

}  // namespace duet::metrics::testing
