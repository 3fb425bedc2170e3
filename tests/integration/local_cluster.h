// A Duet cluster of real processes on loopback for integration tests: decode workers, prefill
// workers and a router started from build/bin/duet on ephemeral ports, stopped on destruction.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/subprocess.h"
#include "duet/v1/duet.grpc.pb.h"
#include "duet/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace duet::testing {

struct ClusterOptions {
  int num_prefill = 1;
  int num_decode = 1;
  std::vector<std::string> worker_flags;  // extra flags for every worker
  std::vector<std::string> router_flags;
  // Every process serves Prometheus /metrics on a free port (--metrics-port 0); the ports are
  // read from their DUET_METRICS_READY lines.
  bool metrics = false;
  // The cluster's internal token, handed to every process in DUET_INTERNAL_TOKEN; the stats
  // calls below send it. Empty: none.
  std::string internal_token;
  // The router serves the OpenAI HTTP API on a free port (--http-port 0).
  bool http = false;
  // The workers' --backend. The CPU's by default: these tests compare float32 output exactly, also
  // on a machine with a GPU.
  std::string backend = "cpu";
};

// Waits (up to `timeout`) until the router behind `router` counts exactly `prefill` prefill and
// `decode` decode workers up (GetModelInfo); otherwise DEADLINE_EXCEEDED naming what it counted.
absl::Status WaitForWorkersUp(v1::Duet::Stub& router, int prefill, int decode, std::chrono::seconds timeout);

class LocalCluster {
 public:
  explicit LocalCluster(const ClusterOptions& options);
  ~LocalCluster();
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }

  v1::Duet::Stub& router() { return *router_stub_; }
  std::shared_ptr<grpc::Channel> router_channel() { return router_channel_; }
  int router_port() const { return router_port_; }
  // Waits (up to 60 s) until the router counts every worker of the cluster up. The router polls
  // its workers once before it is ready, but a poll that times out on a loaded machine leaves that
  // worker out until a later round: a test that needs streams spread over every worker waits.
  bool WaitForAllWorkersUp();
  std::vector<v1::WorkerStats> DecodeStats();   // one per decode worker still answering
  std::vector<v1::WorkerStats> PrefillStats();
  Subprocess& decode_process(int i) { return *decode_[size_t(i)]; }
  Subprocess& prefill_process(int i) { return *prefill_[size_t(i)]; }
  Subprocess& router_process() { return *router_[0]; }
  int http_port() const { return http_port_; }  // with ClusterOptions::http
  // With ClusterOptions::metrics: each process's /metrics port.
  int router_metrics_port() const { return router_metrics_port_; }
  // host:port of every worker, decode then prefill.
  const std::vector<std::string>& worker_addresses() const { return worker_addresses_; }
  const std::vector<int>& decode_metrics_ports() const { return decode_metrics_ports_; }
  const std::vector<int>& prefill_metrics_ports() const { return prefill_metrics_ports_; }

 private:
  bool ok_ = false;
  std::string error_;
  std::vector<std::unique_ptr<Subprocess>> decode_, prefill_, router_;
  std::vector<std::unique_ptr<v1::DecodeWorker::Stub>> decode_stubs_;
  std::vector<std::unique_ptr<v1::PrefillWorker::Stub>> prefill_stubs_;
  std::shared_ptr<grpc::Channel> router_channel_;
  std::unique_ptr<v1::Duet::Stub> router_stub_;
  int router_port_ = 0;
  int http_port_ = -1;
  int router_metrics_port_ = -1;
  std::string internal_token_;
  std::vector<int> decode_metrics_ports_, prefill_metrics_ports_;
  std::vector<std::string> worker_addresses_;
};

// Everything one Generate stream returned.
struct StreamResult {
  grpc::Status status;
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;
  int messages = 0;
};

// Runs Generate to the end. With cancel_after_tokens > 0 the client cancels once it has that
// many tokens; with deadline_ms > 0 the call has that deadline.
StreamResult RunGenerate(v1::Duet::Stub& stub, const v1::GenerateRequest& request,
                         int cancel_after_tokens = 0, int deadline_ms = 0);
// Runs Generate to the end on the caller's context (its deadline, and TryCancel from any thread).
StreamResult RunGenerate(v1::Duet::Stub& stub, const v1::GenerateRequest& request, grpc::ClientContext& ctx);

}  // namespace duet::testing
