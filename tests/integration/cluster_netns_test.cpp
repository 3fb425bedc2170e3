// A cluster across hosts on one machine: the router, the prefill worker and each decode worker in
// a network namespace of its own (veth pairs on one bridge, an address each, its own host name,
// so the KV transfer goes over the network, UCX tcp), every worker on the port the Helm chart
// gives its role, found the way the chart finds them: the router resolves a name that lists one
// address per worker (the namespace's /etc/hosts stands in for the headless Service's DNS). The
// reference cases come out exactly; a worker is added, one is drained and one is killed under load,
// and no client sees an error except the requests on the killed worker, which get a clear one.
//
// Needs root (ip netns, /etc/netns); without it the test says why and skips.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/subprocess.h"
#include "duet/v1/duet.grpc.pb.h"
#include "duet/v1/worker.grpc.pb.h"
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
constexpr char kToken[] = "netns-test-internal-token";
constexpr int kPrefillPort = 7001;  // the chart's ports
constexpr int kDecodePort = 7002;
constexpr int kRouterPort = 50051;
constexpr auto kStartTimeout = std::chrono::seconds(120);

int Sh(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

// Network namespaces on one bridge, torn down on destruction. Names carry this process's id.
class Lab {
 public:
  Lab() : prefix_(absl::StrCat("dt", getpid() % 100000)), subnet_(absl::StrCat("10.213.", 20 + getpid() % 200)) {}
  ~Lab() {
    for (const std::string& ns : namespaces_) Sh("ip netns del " + ns);
    for (const std::string& dir : etc_dirs_) std::filesystem::remove_all(dir);
  }

  // The bridge, and a veth from this process's namespace to it (the test's client side).
  std::string Create() {
    if (geteuid() != 0) return "not root";
    if (Sh("ip -4 route show " + subnet_ + ".0/24 | grep -q .") == 0) return subnet_ + ".0/24 is in use here";
    const std::string sw = Namespace("sw");
    if (sw.empty()) return "cannot create a network namespace (ip netns add)";
    if (Sh(absl::StrCat("ip -n ", sw, " link add br0 type bridge && ip -n ", sw, " link set br0 up")) != 0) {
      return "cannot create a bridge";
    }
    const std::string client = prefix_ + "c";
    if (Sh(absl::StrCat("ip link add ", client, " type veth peer name up0 netns ", sw, " && ip -n ", sw,
                        " link set up0 master br0 up && ip addr add ", subnet_, ".1/24 dev ", client, " && ip link set ",
                        client, " up")) != 0) {
      return "cannot connect this namespace to the bridge";
    }
    if (Sh("unshare --uts true") != 0) return "cannot create a UTS namespace (unshare --uts)";
    return "";
  }

  // A host: its namespace, a veth to the bridge with address subnet.`last`, and /etc/netns files.
  std::string AddHost(const std::string& name, int last) {
    const std::string ns = Namespace(name);
    const std::string sw = prefix_ + "sw";
    const std::string port = absl::StrCat("p", name);
    if (ns.empty() || Sh(absl::StrCat("ip -n ", sw, " link add ", port, " type veth peer name eth0 netns ", ns,
                                      " && ip -n ", sw, " link set ", port, " master br0 up && ip -n ", ns,
                                      " addr add ", Address(last), "/24 dev eth0 && ip -n ", ns,
                                      " link set eth0 up && ip -n ", ns, " link set lo up")) != 0) {
      return "";
    }
    const std::string etc = "/etc/netns/" + ns;
    std::filesystem::create_directories(etc);
    etc_dirs_.push_back(etc);
    std::ofstream(etc + "/resolv.conf") << "# no DNS server in the test's network\n";
    SetHosts(ns, {});
    return ns;
  }

  // The host's /etc/hosts: localhost and `entries` ("ADDRESS NAME"). Rewritten in place: the
  // namespace sees the file through a bind mount of this inode.
  void SetHosts(const std::string& ns, const std::vector<std::string>& entries) {
    std::ofstream out("/etc/netns/" + ns + "/hosts", std::ios::trunc);
    out << "127.0.0.1 localhost\n" << absl::StrJoin(entries, "\n") << "\n";
  }

  std::string Address(int last) const { return absl::StrCat(subnet_, ".", last); }

  // argv running `command` in `ns` under host name `host`.
  std::vector<std::string> In(const std::string& ns, const std::string& host, std::vector<std::string> command) const {
    std::vector<std::string> argv = {"/usr/sbin/ip", "netns", "exec", ns, "unshare", "--uts", "/bin/sh", "-c",
                                     absl::StrCat("hostname ", host, " && exec \"$@\""), "sh"};
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  }

 private:
  std::string Namespace(const std::string& name) {
    const std::string ns = prefix_ + name;
    if (Sh("ip netns add " + ns) != 0) return "";
    namespaces_.push_back(ns);
    return ns;
  }

  const std::string prefix_;
  const std::string subnet_;
  std::vector<std::string> namespaces_;
  std::vector<std::string> etc_dirs_;
};

struct Case {
  v1::GenerateRequest request;
  std::vector<int32_t> expected;
};

std::vector<Case> ReferenceCases(int tokens) {
  std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/reference_greedy.json");
  const json ref = json::parse(in);
  std::vector<Case> cases;
  for (const json& c : ref["cases"]) {
    Case out;
    for (int32_t id : c["prompt_ids"].get<std::vector<int32_t>>()) out.request.mutable_token_ids()->add_ids(id);
    out.request.mutable_sampling()->set_temperature(0.0f);
    out.request.mutable_sampling()->set_max_tokens(tokens);
    const std::vector<int32_t> greedy = c["greedy_ids"].get<std::vector<int32_t>>();
    out.expected.assign(greedy.begin(), greedy.begin() + tokens);
    cases.push_back(std::move(out));
  }
  return cases;
}

class NetnsClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string why = lab_.Create();
    if (!why.empty()) GTEST_SKIP() << "no network namespaces here (" << why << "): the cross-host cluster test skips";
  }

  // A worker process on its own host; its ready line read.
  std::unique_ptr<Subprocess> StartWorker(const std::string& role, const std::string& host, int last, int port) {
    const std::string ns = lab_.AddHost(host, last);
    EXPECT_FALSE(ns.empty()) << "host " << host;
    if (ns.empty()) return nullptr;
    absl::StatusOr<std::unique_ptr<Subprocess>> p = Subprocess::Start(
        lab_.In(ns, host, {testing::DuetBinary(), role, "--model", kModel, "--backend", "cpu", "--host", "0.0.0.0",
                           "--port", std::to_string(port)}),
        {{"DUET_INTERNAL_TOKEN", kToken}});
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return nullptr;
    absl::StatusOr<std::string> ready = (*p)->WaitForLine("DUET_READY port=", kStartTimeout);
    EXPECT_TRUE(ready.ok()) << host << ": " << ready.status();
    return ready.ok() ? *std::move(p) : nullptr;
  }

  // The router's /etc/hosts: one line per listed worker, under the name of its role's Service.
  void ListWorkers(const std::vector<int>& prefill, const std::vector<int>& decode) {
    std::vector<std::string> entries;
    for (int last : prefill) entries.push_back(lab_.Address(last) + " duet-prefill");
    for (int last : decode) entries.push_back(lab_.Address(last) + " duet-decode");
    lab_.SetHosts(router_ns_, entries);
  }

  bool WaitForWorkersUp(int prefill, int decode) {
    const absl::Status up = testing::WaitForWorkersUp(*router_, prefill, decode, std::chrono::seconds(60));
    if (!up.ok()) ADD_FAILURE() << up.message();
    return up.ok();
  }

  void ExpectReferenceOutput(const std::string& stage) {
    for (const Case& c : ReferenceCases(24)) {
      StreamResult got = RunGenerate(*router_, c.request);
      ASSERT_TRUE(got.status.ok()) << stage << ": " << got.status.error_message();
      EXPECT_EQ(got.token_ids, c.expected) << stage;
    }
  }

  Lab lab_;
  std::string router_ns_;
  std::unique_ptr<v1::Duet::Stub> router_;
};

TEST_F(NetnsClusterTest, WorkersOnTheirOwnHostsAreAddedDrainedAndKilledUnderLoad) {
  // Hosts: router .2, prefill .11, decode .21 .22 (.23 joins later).
  std::unique_ptr<Subprocess> prefill = StartWorker("prefill-worker", "prefill0", 11, kPrefillPort);
  std::unique_ptr<Subprocess> decode0 = StartWorker("decode-worker", "decode0", 21, kDecodePort);
  std::unique_ptr<Subprocess> decode1 = StartWorker("decode-worker", "decode1", 22, kDecodePort);
  ASSERT_TRUE(prefill && decode0 && decode1);
  router_ns_ = lab_.AddHost("router", 2);
  ASSERT_FALSE(router_ns_.empty());
  ListWorkers({11}, {21, 22});
  absl::StatusOr<std::unique_ptr<Subprocess>> router_process = Subprocess::Start(
      lab_.In(router_ns_, "router",
              {testing::DuetBinary(), "router", "--model", kModel, "--host", "0.0.0.0", "--port",
               std::to_string(kRouterPort), "--prefill-service", absl::StrCat("dns:///duet-prefill:", kPrefillPort),
               "--decode-service", absl::StrCat("dns:///duet-decode:", kDecodePort), "--discovery-interval-ms", "200"}),
      {{"DUET_INTERNAL_TOKEN", kToken}});
  ASSERT_TRUE(router_process.ok()) << router_process.status();
  ASSERT_TRUE((*router_process)->WaitForLine("DUET_READY port=", kStartTimeout).ok());
  router_ = v1::Duet::NewStub(grpc::CreateChannel(absl::StrCat(lab_.Address(2), ":", kRouterPort),
                                                  grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(WaitForWorkersUp(1, 2));
  ExpectReferenceOutput("two decode hosts");

  // The KV went over the network: the prefill worker's peers are on other hosts.
  auto prefill_stub = v1::PrefillWorker::NewStub(grpc::CreateChannel(
      absl::StrCat(lab_.Address(11), ":", kPrefillPort), grpc::InsecureChannelCredentials()));
  grpc::ClientContext stats_context;
  stats_context.AddMetadata("x-duet-internal-token", kToken);
  v1::WorkerStats stats;
  ASSERT_TRUE(prefill_stub->GetStats(&stats_context, v1::GetStatsRequest(), &stats).ok());
  EXPECT_GT(stats.kv_transfers_by_path().count("ucx_net") ? stats.kv_transfers_by_path().at("ucx_net") : 0, 0)
      << stats.DebugString();
  EXPECT_EQ(stats.kv_transfers_by_path().count("ucx_shm"), 0u) << stats.DebugString();

  // A third decode host joins.
  std::unique_ptr<Subprocess> decode2 = StartWorker("decode-worker", "decode2", 23, kDecodePort);
  ASSERT_TRUE(decode2);
  ListWorkers({11}, {21, 22, 23});
  ASSERT_TRUE(WaitForWorkersUp(1, 3));
  ExpectReferenceOutput("three decode hosts");

  // Load: clients send the reference cases over and over until told to stop.
  const std::vector<Case> cases = ReferenceCases(48);
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<std::string> failures;
  int succeeded = 0;
  std::vector<std::thread> clients;
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&, i] {
      for (size_t n = i; !stop.load(); ++n) {
        const Case& c = cases[n % cases.size()];
        StreamResult got = RunGenerate(*router_, c.request);
        std::lock_guard<std::mutex> lock(mu);
        if (!got.status.ok()) {
          failures.push_back(absl::StrCat(got.status.error_code(), ": ", got.status.error_message()));
        } else if (got.token_ids != c.expected) {
          failures.push_back("wrong tokens");
        } else {
          ++succeeded;
        }
      }
    });
  }
  auto wait_for_successes = [&](int n) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (std::chrono::steady_clock::now() < give_up) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (succeeded >= n) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  };
  ASSERT_TRUE(wait_for_successes(6));

  // Drain decode0: it leaves the name, then gets SIGTERM (what Kubernetes does to a pod).
  ListWorkers({11}, {22, 23});
  ASSERT_TRUE(WaitForWorkersUp(1, 2));
  decode0->Signal(SIGTERM);
  EXPECT_EQ(decode0->Wait(std::chrono::seconds(60)), 0) << "a drained decode worker exits 0";
  int before_kill = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(failures.empty()) << "while draining decode0: " << absl::StrJoin(failures, "; ");
    before_kill = succeeded;
  }
  ASSERT_TRUE(wait_for_successes(before_kill + 6));

  // Kill decode1 under load, still listed (a crash Kubernetes has not noticed yet).
  decode1->Signal(SIGKILL);
  ASSERT_TRUE(WaitForWorkersUp(1, 1));
  int after_kill = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    after_kill = succeeded;
  }
  ASSERT_TRUE(wait_for_successes(after_kill + 6));  // decode2 carries on
  stop.store(true);
  for (std::thread& t : clients) t.join();

  // Only requests on the killed worker failed, each with an error that names it by its label
  // (decode1 was discovered second: decode worker 1); its address stays in the router's log.
  const std::string killed = "decode worker 1";
  const std::string address = absl::StrCat(lab_.Address(22), ":", kDecodePort);
  EXPECT_LE(failures.size(), 6u) << "at most the requests in flight on it";
  for (const std::string& f : failures) {
    EXPECT_EQ(f.rfind("14: ", 0), 0u) << "UNAVAILABLE expected: " << f;
    EXPECT_NE(f.find(killed), std::string::npos) << "the error should name " << killed << ": " << f;
    EXPECT_EQ(f.find(address), std::string::npos) << "a client error must not carry a worker address: " << f;
  }
  std::printf("netns cluster: %d requests succeeded under load, %zu failed on the killed worker: %s\n", succeeded,
              failures.size(), absl::StrJoin(failures, "; ").c_str());

  ListWorkers({11}, {23});
  ASSERT_TRUE(WaitForWorkersUp(1, 1));
  ExpectReferenceOutput("one decode host left");
}

}  // namespace
}  // namespace duet
