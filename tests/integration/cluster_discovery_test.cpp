// The router finding its workers by name (--prefill-service / --decode-service) and following
// them while they come, go and move, with no router restart: real processes on loopback.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/subprocess.h"
#include "duet/v1/duet.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"

namespace duet {
namespace {

using nlohmann::json;
using testing::RunGenerate;
using testing::StreamResult;

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";
constexpr auto kStartTimeout = std::chrono::seconds(120);
constexpr int kTokens = 24;

// A worker process and its address.
struct Worker {
  std::unique_ptr<Subprocess> process;
  int port = 0;
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
};

Worker StartWorker(const std::string& role) {
  Worker w;
  absl::StatusOr<std::unique_ptr<Subprocess>> p =
      Subprocess::Start({testing::DuetBinary(), role, "--model", kModel, "--backend", "cpu", "--port", "0"});
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return w;
  absl::StatusOr<std::string> port = (*p)->WaitForLine("DUET_READY port=", kStartTimeout);
  EXPECT_TRUE(port.ok()) << role << ": " << port.status();
  w.process = *std::move(p);
  if (port.ok()) w.port = std::atoi(port->c_str());
  return w;
}

// Replaces the list atomically (the router never reads half a file).
void WriteList(const std::string& path, const std::vector<std::string>& addresses) {
  const std::string temp = path + ".new";
  std::ofstream(temp) << "# written by the test\n" << absl::StrJoin(addresses, "\n") << "\n";
  ASSERT_EQ(std::rename(temp.c_str(), path.c_str()), 0);
}

class Router {
 public:
  explicit Router(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {testing::DuetBinary(), "router", "--model", kModel, "--port", "0",
                                     "--discovery-interval-ms", "100"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(argv);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return;
    process_ = *std::move(p);
    absl::StatusOr<std::string> port = process_->WaitForLine("DUET_READY port=", kStartTimeout);
    EXPECT_TRUE(port.ok()) << port.status();
    if (!port.ok()) return;
    stub_ = v1::Duet::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", *port), grpc::InsecureChannelCredentials()));
  }
  bool ok() const { return stub_ != nullptr; }
  v1::Duet::Stub& stub() { return *stub_; }

  // Waits (up to 30 s) until the router counts exactly this many workers up.
  bool WaitForWorkersUp(int prefill, int decode) {
    const absl::Status up = testing::WaitForWorkersUp(*stub_, prefill, decode, std::chrono::seconds(30));
    if (!up.ok()) ADD_FAILURE() << up.message();
    return up.ok();
  }

 private:
  std::unique_ptr<Subprocess> process_;
  std::unique_ptr<v1::Duet::Stub> stub_;
};

// The bundled model's reference greedy cases, as requests and their first kTokens tokens.
struct Case {
  v1::GenerateRequest request;
  std::vector<int32_t> expected;
};

std::vector<Case> ReferenceCases() {
  std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  const json ref = json::parse(in);
  std::vector<Case> cases;
  for (const json& c : ref["cases"]) {
    Case out;
    for (int32_t id : c["prompt_ids"].get<std::vector<int32_t>>()) out.request.mutable_token_ids()->add_ids(id);
    out.request.mutable_sampling()->set_temperature(0.0f);
    out.request.mutable_sampling()->set_max_tokens(kTokens);
    const std::vector<int32_t> greedy = c["greedy_ids"].get<std::vector<int32_t>>();
    out.expected.assign(greedy.begin(), greedy.begin() + kTokens);
    cases.push_back(std::move(out));
  }
  return cases;
}

// Every reference case through the router, one after another: each must match exactly.
void ExpectReferenceOutput(Router& router, const std::string& stage) {
  for (const Case& c : ReferenceCases()) {
    StreamResult got = RunGenerate(router.stub(), c.request);
    ASSERT_TRUE(got.status.ok()) << stage << ": " << got.status.error_message();
    EXPECT_EQ(got.token_ids, c.expected) << stage;
  }
}

class DiscoveryTest : public ::testing::Test {
 protected:
  void TearDown() override {
    std::remove(prefill_list_.c_str());
    std::remove(decode_list_.c_str());
  }
  const std::string dir_ = testing::MakeTempDir("discovery");
  const std::string prefill_list_ = dir_ + "/prefill.list";
  const std::string decode_list_ = dir_ + "/decode.list";
};

TEST_F(DiscoveryTest, WorkersAddedRemovedAndMovedAreFollowedWithoutARouterRestart) {
  Worker prefill = StartWorker("prefill-worker");
  Worker decode0 = StartWorker("decode-worker");
  Worker decode1 = StartWorker("decode-worker");
  ASSERT_TRUE(prefill.process && decode0.process && decode1.process);
  WriteList(prefill_list_, {prefill.address()});
  WriteList(decode_list_, {decode0.address()});
  Router router({"--prefill-service", "file://" + prefill_list_, "--decode-service", "file://" + decode_list_});
  ASSERT_TRUE(router.ok());
  ASSERT_TRUE(router.WaitForWorkersUp(1, 1));
  ExpectReferenceOutput(router, "one decode worker");

  WriteList(decode_list_, {decode0.address(), decode1.address()});  // scaled up
  ASSERT_TRUE(router.WaitForWorkersUp(1, 2));
  ExpectReferenceOutput(router, "two decode workers");

  WriteList(decode_list_, {decode1.address()});  // scaled down: decode worker 0 leaves, then stops
  ASSERT_TRUE(router.WaitForWorkersUp(1, 1));
  decode0.process->Stop();
  ExpectReferenceOutput(router, "decode worker 0 gone");  // so decode worker 1 served them

  // The prefill pod restarts under a new address: the old one dies, the new one is listed.
  prefill.process->Stop();
  ASSERT_TRUE(router.WaitForWorkersUp(0, 1));
  Worker moved = StartWorker("prefill-worker");
  ASSERT_TRUE(moved.process);
  WriteList(prefill_list_, {moved.address()});
  ASSERT_TRUE(router.WaitForWorkersUp(1, 1));
  ExpectReferenceOutput(router, "prefill worker moved");
}

TEST_F(DiscoveryTest, DnsNamesResolveThroughTheSystemResolver) {
  Worker prefill = StartWorker("prefill-worker");
  Worker decode = StartWorker("decode-worker");
  ASSERT_TRUE(prefill.process && decode.process);
  // localhost may also resolve to [::1], where nothing listens: that worker is simply down.
  Router router({"--prefill-service", absl::StrCat("dns:///localhost:", prefill.port), "--decode-service",
                 absl::StrCat("dns:///localhost:", decode.port)});
  ASSERT_TRUE(router.ok());
  ASSERT_TRUE(router.WaitForWorkersUp(1, 1));
  ExpectReferenceOutput(router, "workers found through localhost");
}

TEST_F(DiscoveryTest, TheRouterRefusesABadTargetOrARoleWithNoWorkers) {
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--prefill", "127.0.0.1:1", "--decode-service", "http://duet-decode:7002"},
        std::vector<std::string>{"--prefill", "127.0.0.1:1"}}) {
    std::vector<std::string> argv = {testing::DuetBinary(), "router", "--model", kModel, "--port", "0"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(argv);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ((*p)->Wait(std::chrono::seconds(60)), 1) << absl::StrJoin(flags, " ");
  }
}

}  // namespace
}  // namespace duet
