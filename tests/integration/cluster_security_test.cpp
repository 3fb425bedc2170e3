// Who can reach a cluster's workers: the internal token on every worker RPC (only the router
// has it), and the addresses the workers' processes listen on (every one announced).
#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "common/listening_sockets.h"

#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using testing::LocalCluster;

constexpr char kToken[] = "cluster-security-test-token-0123456789";
constexpr char kTokenMetadata[] = "x-duet-internal-token";

bool IsLoopback(const std::string& host_port) {
  return host_port.rfind("127.", 0) == 0 || host_port.rfind("::1:", 0) == 0 || host_port.rfind("::ffff:127.", 0) == 0;
}

// The UCX transports of the KV path (tcp among them) listen too: on the worker's --host
// interface only (loopback here), like its gRPC and metrics ports.
TEST(ClusterSecurityTest, WorkersListenOnlyOnLoopback) {
  LocalCluster cluster({1, 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  for (Subprocess* p : {&cluster.decode_process(0), &cluster.prefill_process(0)}) {
    const std::vector<std::string> addresses = ListeningTcpAddresses(p->pid());
    EXPECT_GE(addresses.size(), 1u) << "pid " << p->pid();
    for (const std::string& a : addresses) EXPECT_TRUE(IsLoopback(a)) << "pid " << p->pid() << " listens on " << a;
  }
}

int PortOf(const std::string& host_port) { return std::stoi(host_port.substr(host_port.rfind(':') + 1)); }

// Nothing listens unannounced: each worker's listening sockets are its gRPC port (DUET_READY),
// its metrics port (DUET_METRICS_READY) and the KV transport's (DUET_KV_READY: UCX's tcp
// listener, on loopback like the rest).
TEST(ClusterSecurityTest, WorkersAnnounceEverySocketTheyListenOn) {
  for (const char* role : {"decode-worker", "prefill-worker"}) {
    absl::StatusOr<std::unique_ptr<Subprocess>> worker =
        Subprocess::Start({testing::DuetBinary(), role, "--model", DUET_MODELS_DIR "/tiny-code-llama", "--backend",
                           "cpu", "--port", "0", "--metrics-port", "0", "--log-stats-interval", "0"},
                          {{"DUET_INTERNAL_TOKEN", kToken}});
    ASSERT_TRUE(worker.ok()) << worker.status();
    absl::StatusOr<std::string> kv = (*worker)->WaitForLine("DUET_KV_READY listen=", std::chrono::seconds(120));
    ASSERT_TRUE(kv.ok()) << role << ": " << kv.status();
    absl::StatusOr<std::string> metrics = (*worker)->WaitForLine("DUET_METRICS_READY port=", std::chrono::seconds(30));
    ASSERT_TRUE(metrics.ok()) << role << ": " << metrics.status();
    absl::StatusOr<std::string> grpc_port = (*worker)->WaitForLine("DUET_READY port=", std::chrono::seconds(30));
    ASSERT_TRUE(grpc_port.ok()) << role << ": " << grpc_port.status();
    std::set<int> announced = {std::stoi(*metrics), std::stoi(*grpc_port)};
    std::vector<std::string> kv_listeners = absl::StrSplit(*kv, ',', absl::SkipEmpty());
    EXPECT_FALSE(kv_listeners.empty()) << role << ": UCX's tcp transport listens";
    for (const std::string& a : kv_listeners) {
      EXPECT_TRUE(IsLoopback(a)) << role << " announced " << a;
      announced.insert(PortOf(a));
    }
    std::set<int> listening;
    for (const std::string& a : ListeningTcpAddresses((*worker)->pid())) listening.insert(PortOf(a));
    EXPECT_EQ(listening, announced) << role;
    (*worker)->Stop();
  }
}

template <typename Service>
std::unique_ptr<typename Service::Stub> StubFor(const std::string& address) {
  return Service::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
}

void WithDeadline(grpc::ClientContext* ctx, const char* token) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (token != nullptr) ctx->AddMetadata(kTokenMetadata, token);
}

// Every internal RPC of both roles, called directly with `token` (null: none); their codes.
std::vector<grpc::StatusCode> CallEveryInternalRpc(const std::string& decode_address,
                                                   const std::string& prefill_address, const char* token) {
  auto decode = StubFor<v1::DecodeWorker>(decode_address);
  auto prefill = StubFor<v1::PrefillWorker>(prefill_address);
  std::vector<grpc::StatusCode> codes;
  {
    grpc::ClientContext ctx;
    WithDeadline(&ctx, token);
    v1::ReserveKvRequest req;
    req.set_request_id("intruder");
    req.set_transfer_id(777);
    req.set_num_prompt_tokens(512);
    req.set_lease_ms(60000);
    v1::ReserveKvResponse resp;
    codes.push_back(decode->ReserveKv(&ctx, req, &resp).error_code());
  }
  {
    grpc::ClientContext ctx;
    WithDeadline(&ctx, token);
    v1::DecodeRequest req;
    req.set_transfer_id(777);
    auto reader = decode->Decode(&ctx, req);
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) {
    }
    codes.push_back(reader->Finish().error_code());
  }
  for (int role = 0; role < 2; ++role) {
    grpc::ClientContext abort_ctx, stats_ctx;
    WithDeadline(&abort_ctx, token);
    WithDeadline(&stats_ctx, token);
    v1::WorkerAbortRequest abort;
    abort.set_request_id("victim");
    v1::WorkerAbortResponse aborted;
    v1::WorkerStats stats;
    if (role == 0) {
      codes.push_back(decode->Abort(&abort_ctx, abort, &aborted).error_code());
      codes.push_back(decode->GetStats(&stats_ctx, v1::GetStatsRequest(), &stats).error_code());
    } else {
      codes.push_back(prefill->Abort(&abort_ctx, abort, &aborted).error_code());
      codes.push_back(prefill->GetStats(&stats_ctx, v1::GetStatsRequest(), &stats).error_code());
    }
  }
  {
    grpc::ClientContext ctx;
    WithDeadline(&ctx, token);
    v1::PrefillRequest req;
    req.add_prompt_token_ids(1);
    v1::PrefillResponse resp;
    codes.push_back(prefill->Prefill(&ctx, req, &resp).error_code());
  }
  {
    grpc::ClientContext ctx;
    WithDeadline(&ctx, token);
    v1::SetKvTargetRequest req;
    req.set_request_id("victim");
    req.mutable_target()->set_transfer_id(777);
    v1::SetKvTargetResponse resp;
    codes.push_back(prefill->SetKvTarget(&ctx, req, &resp).error_code());
  }
  return codes;
}

bool Serving(const std::string& address) {
  auto stub = grpc::health::v1::Health::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

v1::GenerateRequest SmallRequest() {
  v1::GenerateRequest r;
  r.set_text("def fib(n):\n");
  r.mutable_sampling()->set_temperature(0.0f);
  r.mutable_sampling()->set_max_tokens(8);
  return r;
}

void ExpectOnlyTheTokenOpensWorkers(LocalCluster& cluster) {
  const std::string& decode = cluster.worker_addresses()[0];
  const std::string& prefill = cluster.worker_addresses()[1];
  for (const char* token : {static_cast<const char*>(nullptr), "", "wrong-token", "cluster-security-test-token"}) {
    for (grpc::StatusCode code : CallEveryInternalRpc(decode, prefill, token)) {
      EXPECT_EQ(code, grpc::StatusCode::UNAUTHENTICATED) << "token " << (token ? token : "(none)");
    }
  }
  // Nothing was reserved nor aborted by those calls; probes still see the workers.
  const std::vector<v1::WorkerStats> stats = cluster.DecodeStats();
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_EQ(stats[0].num_kv_leases(), 0);
  EXPECT_EQ(stats[0].num_free_kv_blocks(), stats[0].num_kv_blocks());
  EXPECT_TRUE(Serving(decode));
  EXPECT_TRUE(Serving(prefill));
  // The router has the token.
  testing::StreamResult got = testing::RunGenerate(cluster.router(), SmallRequest());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.token_ids.size(), 8u);
}

TEST(ClusterSecurityTest, InternalRpcsNeedTheClusterToken) {
  testing::ClusterOptions options{1, 1};
  options.internal_token = kToken;  // in DUET_INTERNAL_TOKEN
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  ExpectOnlyTheTokenOpensWorkers(cluster);
  // With the token, the calls reach the services (which then judge the requests themselves).
  std::vector<grpc::StatusCode> codes =
      CallEveryInternalRpc(cluster.worker_addresses()[0], cluster.worker_addresses()[1], kToken);
  EXPECT_EQ(codes[0], grpc::StatusCode::OK);  // ReserveKv: a real reservation
  for (size_t i = 1; i < codes.size(); ++i) EXPECT_NE(codes[i], grpc::StatusCode::UNAUTHENTICATED) << i;
}

TEST(ClusterSecurityTest, TheTokenCanComeFromAFile) {
  const std::string dir = testing::MakeTempDir("internal-token");
  {
    std::ofstream(dir + "/token") << kToken << "\n";
  }
  const std::vector<std::string> flag = {"--internal-token-file", dir + "/token"};
  testing::ClusterOptions options{1, 1, flag, flag};
  LocalCluster cluster(options);
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  const std::string& decode = cluster.worker_addresses()[0];
  const std::string& prefill = cluster.worker_addresses()[1];
  for (grpc::StatusCode code : CallEveryInternalRpc(decode, prefill, nullptr)) {
    EXPECT_EQ(code, grpc::StatusCode::UNAUTHENTICATED);
  }
  testing::StreamResult got = testing::RunGenerate(cluster.router(), SmallRequest());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
}

TEST(ClusterSecurityTest, AWorkerWithoutATokenWarnsThatItsRpcsAreOpen) {
  const std::string dir = testing::MakeTempDir("no-token");
  // Fails to start (no such model) after the warning.
  const std::string command = "env -u DUET_INTERNAL_TOKEN " + testing::DuetBinary() +
                              " decode-worker --backend cpu --model " + dir + "/no-model --port 0";
  EXPECT_NE(testing::RunCommand(command, dir + "/log.txt"), 0);
  const std::string log = testing::ReadText(dir + "/log.txt");
  EXPECT_NE(log.find(" W "), std::string::npos) << log;
  EXPECT_NE(log.find("internal RPCs are unauthenticated"), std::string::npos) << log;
}

}  // namespace
}  // namespace duet
