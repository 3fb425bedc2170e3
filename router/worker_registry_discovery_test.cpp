#include "router/worker_registry_discovery.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "router/assignment_policy.h"
#include "router/fake_workers.h"
#include "router/worker_registry.h"

namespace duet::router {
namespace {

using testing::FakeDecodeWorker;
using testing::FakePrefillWorker;
using testing::FakeServer;

// Answers each target spec with what the test set last; unknown specs resolve to nothing.
class FakeResolver final : public AddressResolver {
 public:
  void Set(const std::string& spec, absl::StatusOr<std::vector<std::string>> answer) {
    absl::MutexLock lock(&mu_);
    answers_.insert_or_assign(spec, std::move(answer));
  }
  absl::StatusOr<std::vector<std::string>> Resolve(const DiscoveryTarget& target) override {
    absl::MutexLock lock(&mu_);
    auto it = answers_.find(target.spec);
    return it == answers_.end() ? std::vector<std::string>{} : it->second;
  }

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, absl::StatusOr<std::vector<std::string>>> answers_ ABSL_GUARDED_BY(mu_);
};

constexpr char kDecodeService[] = "dns:///duet-decode.duet.svc:7002";
constexpr char kPrefillService[] = "dns:///duet-prefill.duet.svc:7001";

DiscoveryTarget Target(const std::string& spec) {
  absl::StatusOr<DiscoveryTarget> target = ParseDiscoveryTarget(spec);
  EXPECT_TRUE(target.ok()) << target.status();
  return *target;
}

// The registry's threads stay out of the way (an hour between rounds): tests drive discovery and
// polls with RefreshDiscovery and PollOnce, except the one that tests the thread.
RegistryOptions ManualOptions(std::shared_ptr<FakeResolver> resolver) {
  RegistryOptions options;
  options.poll_interval = absl::Hours(1);
  options.discovery_interval = absl::Hours(1);
  options.poll_timeout = absl::Milliseconds(500);
  options.max_reconnect_backoff = absl::Milliseconds(200);
  options.log_state_changes = false;
  options.resolver = std::move(resolver);
  return options;
}

std::vector<std::string> Addresses(const std::vector<Worker*>& workers) {
  std::vector<std::string> out;
  for (const Worker* w : workers) out.push_back(w->address());
  return out;
}

TEST(ParseDiscoveryTargetTest, AcceptsDnsNamesAndAbsoluteFiles) {
  DiscoveryTarget dns = Target("dns:///duet-decode.ns.svc.cluster.local:7002");
  EXPECT_EQ(dns.scheme, DiscoveryTarget::Scheme::kDns);
  EXPECT_EQ(dns.host, "duet-decode.ns.svc.cluster.local");
  EXPECT_EQ(dns.port, 7002);
  DiscoveryTarget v6 = Target("dns:///[::1]:7002");
  EXPECT_EQ(v6.host, "::1");
  DiscoveryTarget file = Target("file:///etc/duet/decode.list");
  EXPECT_EQ(file.scheme, DiscoveryTarget::Scheme::kFile);
  EXPECT_EQ(file.path, "/etc/duet/decode.list");
}

TEST(ParseDiscoveryTargetTest, RejectsWhatItCannotFollow) {
  for (const char* spec : {"duet-decode:7002", "dns:///duet-decode", "dns:///duet-decode:0", "dns:///duet-decode:65536",
                           "dns:///:7002", "dns:///a b:7002", "dns:///::1:7002", "dns://8.8.8.8/duet-decode:7002",
                           "file://relative/list", "file://", "http://duet-decode:7002"}) {
    absl::StatusOr<DiscoveryTarget> target = ParseDiscoveryTarget(spec);
    EXPECT_FALSE(target.ok()) << spec;
    EXPECT_EQ(target.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(target.status().message().find(spec), std::string_view::npos) << target.status();
  }
}

class DiscoveryRegistryTest : public ::testing::Test {
 protected:
  std::shared_ptr<FakeResolver> resolver_ = std::make_shared<FakeResolver>();
};

TEST_F(DiscoveryRegistryTest, WorkersAppearWhenTheNameResolvesToThem) {
  FakeDecodeWorker a, b;
  FakeServer server_a(&a), server_b(&b);
  resolver_->Set(kDecodeService, std::vector<std::string>{});
  WorkerRegistry registry({}, {}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.Start();
  EXPECT_TRUE(registry.decode_workers().empty());
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 0);

  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address(), server_b.address()});
  registry.RefreshDiscovery();
  EXPECT_EQ(Addresses(registry.decode_workers()), (std::vector<std::string>{server_a.address(), server_b.address()}));
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 0);  // down until they answer a poll
  registry.PollOnce();
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 2);
  EXPECT_TRUE(registry.prefill_workers().empty());
}

TEST_F(DiscoveryRegistryTest, AWorkerThatLeavesIsRetiredAndNeverAssignedWhileItsCallsStayValid) {
  FakeDecodeWorker a, b;
  FakeServer server_a(&a), server_b(&b);
  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address(), server_b.address()});
  WorkerRegistry registry({}, {}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.Start();
  ASSERT_EQ(registry.NumUp(WorkerRole::kDecode), 2);
  Worker* leaving = registry.decode_workers()[0];
  InFlightGuard running_call(leaving);  // a request still on it

  resolver_->Set(kDecodeService, std::vector<std::string>{server_b.address()});
  registry.RefreshDiscovery();
  EXPECT_EQ(Addresses(registry.decode_workers()), std::vector<std::string>{server_b.address()});
  EXPECT_FALSE(leaving->up());
  EXPECT_EQ(leaving->in_flight(), 1);  // the object lives on for the call that holds it
  registry.PollOnce();  // it still answers GetStats, but it is not polled back up
  EXPECT_FALSE(leaving->up());
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 1);
  LeastLoadedPolicy policy(&registry);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(policy.PickDecode(RequestInfo()), registry.decode_workers()[0]);
  registry.MarkDown(leaving, "a failed call after it left");  // harmless
  EXPECT_FALSE(leaving->up());
}

TEST_F(DiscoveryRegistryTest, APodRestartedUnderANewAddressIsANewWorkerAndTheOldOneGoes) {
  FakePrefillWorker old_pod, new_pod;
  FakeServer old_server(&old_pod), new_server(&new_pod);
  resolver_->Set(kPrefillService, std::vector<std::string>{old_server.address()});
  WorkerRegistry registry({}, {}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kPrefill, Target(kPrefillService));
  registry.Start();
  ASSERT_EQ(registry.NumUp(WorkerRole::kPrefill), 1);
  Worker* old_worker = registry.prefill_workers()[0];

  old_server.Stop();
  resolver_->Set(kPrefillService, std::vector<std::string>{new_server.address()});
  registry.RefreshDiscovery();
  registry.PollOnce();
  ASSERT_EQ(registry.prefill_workers().size(), 1u);
  Worker* new_worker = registry.prefill_workers()[0];
  EXPECT_NE(new_worker, old_worker);
  EXPECT_EQ(new_worker->address(), new_server.address());
  EXPECT_EQ(new_worker->index(), 1);  // numbered in the order they came
  EXPECT_TRUE(new_worker->up());
  EXPECT_FALSE(old_worker->up());
}

TEST_F(DiscoveryRegistryTest, AnAddressThatComesBackGetsItsWorkerBack) {
  FakeDecodeWorker a;
  FakeServer server_a(&a);
  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address()});
  WorkerRegistry registry({}, {}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.Start();
  Worker* first = registry.decode_workers()[0];
  resolver_->Set(kDecodeService, std::vector<std::string>{});
  registry.RefreshDiscovery();
  EXPECT_TRUE(registry.decode_workers().empty());
  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address()});
  registry.RefreshDiscovery();
  ASSERT_EQ(registry.decode_workers().size(), 1u);
  EXPECT_EQ(registry.decode_workers()[0], first);
  EXPECT_FALSE(first->up());  // until a poll hears it
  registry.PollOnce();
  EXPECT_TRUE(first->up());
}

TEST_F(DiscoveryRegistryTest, AFailedResolutionKeepsTheWorkersItHad) {
  FakeDecodeWorker a;
  FakeServer server_a(&a);
  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address()});
  WorkerRegistry registry({}, {}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.Start();
  resolver_->Set(kDecodeService, absl::UnavailableError("Temporary failure in name resolution"));
  registry.RefreshDiscovery();
  EXPECT_EQ(Addresses(registry.decode_workers()), std::vector<std::string>{server_a.address()});
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 1);
}

TEST_F(DiscoveryRegistryTest, StaticWorkersStayAndAreNotDuplicatedByDiscovery) {
  FakeDecodeWorker fixed, found;
  FakeServer fixed_server(&fixed), found_server(&found);
  resolver_->Set(kDecodeService, std::vector<std::string>{fixed_server.address(), found_server.address()});
  WorkerRegistry registry({}, {fixed_server.address()}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.Start();
  EXPECT_EQ(Addresses(registry.decode_workers()),
            (std::vector<std::string>{fixed_server.address(), found_server.address()}));
  resolver_->Set(kDecodeService, std::vector<std::string>{});
  registry.RefreshDiscovery();
  EXPECT_EQ(Addresses(registry.decode_workers()), std::vector<std::string>{fixed_server.address()});
  EXPECT_EQ(registry.NumUp(WorkerRole::kDecode), 1);
}

TEST_F(DiscoveryRegistryTest, TwoTargetsOfARoleAddUp) {
  FakeDecodeWorker a, b;
  FakeServer server_a(&a), server_b(&b);
  const std::string other = "dns:///duet-decode.other-zone.svc:7002";
  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address()});
  resolver_->Set(other, std::vector<std::string>{server_b.address(), server_a.address()});
  WorkerRegistry registry({}, {}, ManualOptions(resolver_));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(other));
  registry.Start();
  EXPECT_EQ(Addresses(registry.decode_workers()), (std::vector<std::string>{server_a.address(), server_b.address()}));
}

TEST_F(DiscoveryRegistryTest, TheDiscoveryThreadFollowsChangesWithoutBeingAsked) {
  FakeDecodeWorker a, b;
  FakeServer server_a(&a), server_b(&b);
  resolver_->Set(kDecodeService, std::vector<std::string>{server_a.address()});
  RegistryOptions options = ManualOptions(resolver_);
  options.discovery_interval = absl::Milliseconds(20);
  options.poll_interval = absl::Milliseconds(20);
  WorkerRegistry registry({}, {}, options);
  registry.AddDiscoveryTarget(WorkerRole::kDecode, Target(kDecodeService));
  registry.Start();
  resolver_->Set(kDecodeService, std::vector<std::string>{server_b.address()});
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  auto followed = [&] {
    std::vector<Worker*> now = registry.decode_workers();
    return now.size() == 1 && now[0]->address() == server_b.address() && now[0]->up();
  };
  while (!followed() && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(followed());
}

TEST(SystemResolverTest, ANumericAddressResolvesToItself) {
  absl::StatusOr<std::vector<std::string>> v4 = MakeSystemResolver()->Resolve(Target("dns:///127.0.0.1:7002"));
  ASSERT_TRUE(v4.ok()) << v4.status();
  EXPECT_EQ(*v4, std::vector<std::string>{"127.0.0.1:7002"});
  absl::StatusOr<std::vector<std::string>> v6 = MakeSystemResolver()->Resolve(Target("dns:///[::1]:7002"));
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(*v6, std::vector<std::string>{"[::1]:7002"});
}

TEST(SystemResolverTest, LocalhostResolvesToALoopbackAddress) {
  absl::StatusOr<std::vector<std::string>> found = MakeSystemResolver()->Resolve(Target("dns:///localhost:7002"));
  ASSERT_TRUE(found.ok()) << found.status();
  ASSERT_FALSE(found->empty());
  for (const std::string& a : *found) EXPECT_TRUE(a == "127.0.0.1:7002" || a == "[::1]:7002") << a;
}

class FileResolverTest : public ::testing::Test {
 protected:
  void Write(const std::string& text) { std::ofstream(path_) << text; }
  ~FileResolverTest() override { std::remove(path_.c_str()); }
  const std::string path_ = ::testing::TempDir() + "duet_workers_" + std::to_string(getpid()) + ".list";
};

TEST_F(FileResolverTest, ReadsOneAddressALineAndSkipsComments) {
  Write("# decode workers\n10.0.0.5:7002\n\n  10.0.0.6:7002  # rack 2\n[fd00::7]:7002\n10.0.0.5:7002\n");
  absl::StatusOr<std::vector<std::string>> found = MakeSystemResolver()->Resolve(Target("file://" + path_));
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, (std::vector<std::string>{"10.0.0.5:7002", "10.0.0.6:7002", "[fd00::7]:7002"}));
  Write("");
  found = MakeSystemResolver()->Resolve(Target("file://" + path_));
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_TRUE(found->empty());
}

TEST_F(FileResolverTest, ABadLineOrAMissingFileIsAnErrorNotAnEmptyList) {
  Write("10.0.0.5:7002\n10.0.0.6\n");
  absl::StatusOr<std::vector<std::string>> found = MakeSystemResolver()->Resolve(Target("file://" + path_));
  ASSERT_FALSE(found.ok());
  EXPECT_NE(found.status().message().find("line 2"), std::string_view::npos) << found.status();
  std::remove(path_.c_str());
  EXPECT_FALSE(MakeSystemResolver()->Resolve(Target("file://" + path_)).ok());
}

}  // namespace
}  // namespace duet::router
