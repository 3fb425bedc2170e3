#include "tests/integration/local_cluster.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/integration/process.h"

namespace duet::testing {
namespace {

constexpr char kReady[] = "DUET_READY port=";
constexpr char kMetricsReady[] = "DUET_METRICS_READY port=";
constexpr char kHttpReady[] = "DUET_HTTP_READY port=";
constexpr auto kStartTimeout = std::chrono::seconds(120);

std::string Duet() { return DuetBinary(); }
std::string Model() { return ModelsDir() + "/tiny-code-llama"; }

}  // namespace

LocalCluster::LocalCluster(const ClusterOptions& options) : internal_token_(options.internal_token) {
  std::vector<std::string> decode_addrs, prefill_addrs;
  Subprocess::Environment env;
  if (!options.internal_token.empty()) env.emplace_back("DUET_INTERNAL_TOKEN", options.internal_token);
  // With metrics on, reads the DUET_METRICS_READY line (printed before DUET_READY) into *port.
  auto metrics_port = [&](const char* role, Subprocess& p, int* port) -> bool {
    if (!options.metrics) return true;
    absl::StatusOr<std::string> line = p.WaitForLine(kMetricsReady, kStartTimeout);
    if (!line.ok()) { error_ = absl::StrCat(role, " metrics: ", line.status().message()); return false; }
    *port = std::atoi(line->c_str());
    return true;
  };
  auto start = [&](const char* role, std::vector<std::unique_ptr<Subprocess>>& procs,
                   std::vector<std::string>& addrs, std::vector<int>& metrics_ports) -> bool {
    std::vector<std::string> argv = {Duet(), role, "--model", Model(), "--backend", options.backend, "--port", "0"};
    if (options.metrics) argv.insert(argv.end(), {"--metrics-port", "0"});
    argv.insert(argv.end(), options.worker_flags.begin(), options.worker_flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(argv, env);
    if (!p.ok()) { error_ = std::string(p.status().message()); return false; }
    int mport = -1;
    if (!metrics_port(role, **p, &mport)) { procs.push_back(std::move(*p)); return false; }
    metrics_ports.push_back(mport);
    absl::StatusOr<std::string> port = (*p)->WaitForLine(kReady, kStartTimeout);
    procs.push_back(std::move(*p));
    if (!port.ok()) { error_ = absl::StrCat(role, ": ", port.status().message()); return false; }
    addrs.push_back(absl::StrCat("127.0.0.1:", *port));
    return true;
  };
  for (int i = 0; i < options.num_decode; ++i) {
    if (!start("decode-worker", decode_, decode_addrs, decode_metrics_ports_)) return;
  }
  for (int i = 0; i < options.num_prefill; ++i) {
    if (!start("prefill-worker", prefill_, prefill_addrs, prefill_metrics_ports_)) return;
  }
  std::vector<std::string> argv = {Duet(), "router", "--model", Model(), "--port", "0",
                                   "--prefill", absl::StrJoin(prefill_addrs, ","),
                                   "--decode", absl::StrJoin(decode_addrs, ",")};
  if (options.metrics) argv.insert(argv.end(), {"--metrics-port", "0"});
  if (options.http) argv.insert(argv.end(), {"--http-port", "0"});
  argv.insert(argv.end(), options.router_flags.begin(), options.router_flags.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> r = Subprocess::Start(argv, env);
  if (!r.ok()) { error_ = std::string(r.status().message()); return; }
  if (!metrics_port("router", **r, &router_metrics_port_)) { router_.push_back(std::move(*r)); return; }
  if (options.http) {  // printed after the metrics line, before DUET_READY
    absl::StatusOr<std::string> line = (*r)->WaitForLine(kHttpReady, kStartTimeout);
    if (!line.ok()) { router_.push_back(std::move(*r)); error_ = absl::StrCat("router http: ", line.status().message()); return; }
    http_port_ = std::atoi(line->c_str());
  }
  absl::StatusOr<std::string> port = (*r)->WaitForLine(kReady, kStartTimeout);
  router_.push_back(std::move(*r));
  if (!port.ok()) { error_ = absl::StrCat("router: ", port.status().message()); return; }
  router_port_ = std::atoi(port->c_str());
  router_channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_port_), grpc::InsecureChannelCredentials());
  router_stub_ = v1::Duet::NewStub(router_channel_);
  worker_addresses_ = decode_addrs;
  worker_addresses_.insert(worker_addresses_.end(), prefill_addrs.begin(), prefill_addrs.end());
  for (const std::string& a : decode_addrs) {
    decode_stubs_.push_back(v1::DecodeWorker::NewStub(grpc::CreateChannel(a, grpc::InsecureChannelCredentials())));
  }
  for (const std::string& a : prefill_addrs) {
    prefill_stubs_.push_back(v1::PrefillWorker::NewStub(grpc::CreateChannel(a, grpc::InsecureChannelCredentials())));
  }
  ok_ = true;
}

LocalCluster::~LocalCluster() {
  for (auto& p : router_) p->Stop();
  for (auto& p : prefill_) p->Stop();
  for (auto& p : decode_) p->Stop();
}

namespace {
template <typename Stub>
std::vector<v1::WorkerStats> Stats(std::vector<std::unique_ptr<Stub>>& stubs, const std::string& token) {
  std::vector<v1::WorkerStats> out;
  for (auto& stub : stubs) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("x-duet-internal-token", token);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::WorkerStats stats;
    if (stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok()) out.push_back(stats);
  }
  return out;
}
}  // namespace

absl::Status WaitForWorkersUp(v1::Duet::Stub& router, int prefill, int decode, std::chrono::seconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  v1::ModelInfo info;
  while (std::chrono::steady_clock::now() < give_up) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (router.GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok() &&
        info.num_prefill_workers() == prefill && info.num_decode_workers() == decode) {
      return absl::OkStatus();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("the router counts ", info.num_prefill_workers(), " prefill and ",
                                                  info.num_decode_workers(), " decode workers up, not ", prefill,
                                                  " and ", decode));
}

bool LocalCluster::WaitForAllWorkersUp() {
  return WaitForWorkersUp(*router_stub_, int(prefill_.size()), int(decode_.size()), std::chrono::seconds(60)).ok();
}

std::vector<v1::WorkerStats> LocalCluster::DecodeStats() { return Stats(decode_stubs_, internal_token_); }
std::vector<v1::WorkerStats> LocalCluster::PrefillStats() { return Stats(prefill_stubs_, internal_token_); }

namespace {

StreamResult ReadGenerate(v1::Duet::Stub& stub, const v1::GenerateRequest& request, grpc::ClientContext& ctx,
                          int cancel_after_tokens) {
  StreamResult result;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader = stub.Generate(&ctx, request);
  v1::GenerateResponse msg;
  bool cancelled = false;
  while (reader->Read(&msg)) {
    ++result.messages;
    result.token_ids.insert(result.token_ids.end(), msg.token_ids().begin(), msg.token_ids().end());
    result.text += msg.text();
    if (msg.finished()) result.finish_reason = msg.finish_reason();
    if (!cancelled && cancel_after_tokens > 0 && int(result.token_ids.size()) >= cancel_after_tokens) {
      ctx.TryCancel();
      cancelled = true;
    }
  }
  result.status = reader->Finish();
  return result;
}

}  // namespace

StreamResult RunGenerate(v1::Duet::Stub& stub, const v1::GenerateRequest& request,
                         int cancel_after_tokens, int deadline_ms) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(deadline_ms > 0 ? deadline_ms : 300000));
  return ReadGenerate(stub, request, ctx, cancel_after_tokens);
}

StreamResult RunGenerate(v1::Duet::Stub& stub, const v1::GenerateRequest& request, grpc::ClientContext& ctx) {
  return ReadGenerate(stub, request, ctx, /*cancel_after_tokens=*/0);
}

}  // namespace duet::testing
