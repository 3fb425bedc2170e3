// Who can reach a cluster's workers: the internal token on every worker RPC (only the router
// has it), and the addresses the workers' processes listen on.
#include <arpa/inet.h>
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using testing::LocalCluster;

constexpr char kToken[] = "cluster-security-test-token-0123456789";
constexpr char kTokenMetadata[] = "x-duet-internal-token";

// "host:port" of every TCP socket `pid` listens on (IPv4 and IPv6), from /proc.
std::vector<std::string> ListeningAddresses(pid_t pid) {
  std::vector<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  if (DIR* dir = opendir(fd_dir.c_str())) {
    while (dirent* e = readdir(dir)) {
      char target[256];
      const ssize_t n = readlink((fd_dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
      if (n <= 0) continue;
      const std::string link(target, size_t(n));
      if (link.rfind("socket:[", 0) == 0) inodes.push_back(link.substr(8, link.size() - 9));
    }
    closedir(dir);
  }
  std::vector<std::string> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/net/" + table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state != "0A" || std::find(inodes.begin(), inodes.end(), inode) == inodes.end()) continue;  // LISTEN
      const size_t colon = local.find(':');
      const std::string hex = local.substr(0, colon);
      const int port = std::stoi(local.substr(colon + 1), nullptr, 16);
      unsigned char bytes[16];
      for (size_t word = 0; word < hex.size() / 8; ++word) {  // 32-bit words in host (little-endian) order
        const uint32_t v = uint32_t(std::stoul(hex.substr(word * 8, 8), nullptr, 16));
        std::memcpy(bytes + 4 * word, &v, 4);
      }
      char text[INET6_ADDRSTRLEN];
      inet_ntop(hex.size() == 8 ? AF_INET : AF_INET6, bytes, text, sizeof(text));
      out.push_back(std::string(text) + ":" + std::to_string(port));
    }
  }
  return out;
}

bool IsLoopback(const std::string& host_port) {
  return host_port.rfind("127.", 0) == 0 || host_port.rfind("::1:", 0) == 0 || host_port.rfind("::ffff:127.", 0) == 0;
}

// The UCX transports of the KV path (tcp among them) listen too: on the worker's --host
// interface only (loopback here), like its gRPC and metrics ports.
TEST(ClusterSecurityTest, WorkersListenOnlyOnLoopback) {
  LocalCluster cluster({1, 1});
  ASSERT_TRUE(cluster.ok()) << cluster.error();
  for (Subprocess* p : {&cluster.decode_process(0), &cluster.prefill_process(0)}) {
    const std::vector<std::string> addresses = ListeningAddresses(p->pid());
    EXPECT_GE(addresses.size(), 1u) << "pid " << p->pid();
    for (const std::string& a : addresses) EXPECT_TRUE(IsLoopback(a)) << "pid " << p->pid() << " listens on " << a;
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
