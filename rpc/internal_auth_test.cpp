#include "rpc/internal_auth.h"

#include <stdlib.h>

#include <chrono>
#include <fstream>
#include <set>

#include "duet/v1/worker.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "rpc/rpc_util.h"

namespace duet::rpc {
namespace {

constexpr char kToken[] = "0123456789abcdef0123456789abcdef";

grpc::StatusCode Verdict(const WorkerCallGate& gate, std::string_view method, const char* token) {
  std::string_view t = token != nullptr ? token : "";
  return gate.Admit(method, token != nullptr ? &t : nullptr).error_code();
}

TEST(WorkerCallGateTest, InternalCallsNeedTheTokenAndHealthStaysOpen) {
  WorkerCallGate gate(kToken);
  EXPECT_TRUE(gate.authenticates());
  for (const char* method : {"/duet.v1.DecodeWorker/ReserveKv", "/duet.v1.DecodeWorker/Decode",
                             "/duet.v1.DecodeWorker/Abort", "/duet.v1.DecodeWorker/GetStats",
                             "/duet.v1.PrefillWorker/Prefill", "/duet.v1.PrefillWorker/Abort",
                             "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "/anything/Else"}) {
    EXPECT_EQ(Verdict(gate, method, nullptr), grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_EQ(Verdict(gate, method, ""), grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_EQ(Verdict(gate, method, "0123456789abcdef0123456789abcdeF"), grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_EQ(Verdict(gate, method, "0123456789abcdef"), grpc::StatusCode::UNAUTHENTICATED) << method;
    EXPECT_EQ(Verdict(gate, method, kToken), grpc::StatusCode::OK) << method;
  }
  EXPECT_EQ(Verdict(gate, "/grpc.health.v1.Health/Check", nullptr), grpc::StatusCode::OK);
  EXPECT_EQ(Verdict(gate, "/grpc.health.v1.Health/Watch", nullptr), grpc::StatusCode::OK);
}

TEST(WorkerCallGateTest, WithoutATokenEveryCallIsAdmitted) {
  WorkerCallGate gate("");
  EXPECT_FALSE(gate.authenticates());
  EXPECT_EQ(Verdict(gate, "/duet.v1.DecodeWorker/ReserveKv", nullptr), grpc::StatusCode::OK);
  EXPECT_EQ(Verdict(gate, "/duet.v1.PrefillWorker/Prefill", "whatever"), grpc::StatusCode::OK);
}

TEST(WorkerCallGateTest, DrainingRefusesNewWorkAndStats) {
  for (const char* token : {"", kToken}) {
    WorkerCallGate gate(token);
    gate.StartDraining();
    EXPECT_EQ(Verdict(gate, "/duet.v1.DecodeWorker/ReserveKv", kToken), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(Verdict(gate, "/duet.v1.PrefillWorker/Prefill", kToken), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(Verdict(gate, "/duet.v1.DecodeWorker/Decode", kToken), grpc::StatusCode::OK);
    EXPECT_EQ(Verdict(gate, "/duet.v1.DecodeWorker/Abort", kToken), grpc::StatusCode::OK);
    EXPECT_EQ(Verdict(gate, "/duet.v1.PrefillWorker/Abort", kToken), grpc::StatusCode::OK);
    EXPECT_EQ(Verdict(gate, "/duet.v1.PrefillWorker/GetStats", kToken), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(Verdict(gate, "/duet.v1.DecodeWorker/GetStats", kToken), grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(Verdict(gate, "/grpc.health.v1.Health/Check", nullptr), grpc::StatusCode::OK);
  }
  // An unauthenticated caller learns nothing about the drain.
  WorkerCallGate gate(kToken);
  gate.StartDraining();
  EXPECT_EQ(Verdict(gate, "/duet.v1.DecodeWorker/ReserveKv", nullptr), grpc::StatusCode::UNAUTHENTICATED);
}

// Over a real server: the gate runs before the handlers (the services here answer UNIMPLEMENTED
// to whatever reaches them), and the client interceptors attach the token.
TEST(WorkerCallGateTest, GatesARealServer) {
  WorkerCallGate gate(kToken);
  v1::PrefillWorker::CallbackService service;  // every method UNIMPLEMENTED
  int port = 0;
  auto server = StartServer("127.0.0.1:0", {&service}, &port, gate.Credentials());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  auto plain = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto with_token = grpc::experimental::CreateCustomChannelWithInterceptors(
      address, grpc::InsecureChannelCredentials(), grpc::ChannelArguments(), InternalTokenInterceptors(kToken));
  auto with_wrong_token = grpc::experimental::CreateCustomChannelWithInterceptors(
      address, grpc::InsecureChannelCredentials(), grpc::ChannelArguments(), InternalTokenInterceptors("nope"));
  auto call = [](const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::WorkerStats stats;
    return v1::PrefillWorker::NewStub(channel)->GetStats(&ctx, v1::GetStatsRequest(), &stats).error_code();
  };
  auto prefill = [](const std::shared_ptr<grpc::Channel>& channel) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::PrefillResponse response;
    return v1::PrefillWorker::NewStub(channel)->Prefill(&ctx, v1::PrefillRequest(), &response).error_code();
  };
  EXPECT_EQ(call(plain), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call(with_wrong_token), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(call(with_token), grpc::StatusCode::UNIMPLEMENTED);  // admitted
  EXPECT_EQ(prefill(with_token), grpc::StatusCode::UNIMPLEMENTED);
  gate.StartDraining();
  EXPECT_EQ(prefill(with_token), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(call(with_token), grpc::StatusCode::UNAVAILABLE);
  // In-process calls (the worker's own) do not pass the port's gate.
  {
    grpc::ClientContext ctx;
    v1::WorkerStats stats;
    EXPECT_EQ(v1::PrefillWorker::NewStub((*server)->InProcessChannel(grpc::ChannelArguments()))
                  ->GetStats(&ctx, v1::GetStatsRequest(), &stats)
                  .error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }

  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckResponse health;
  EXPECT_TRUE(grpc::health::v1::Health::NewStub(plain)->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &health).ok());
  EXPECT_EQ(health.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  (*server)->Shutdown(std::chrono::system_clock::now());
}

TEST(InternalTokenTest, FromAFileOrTheEnvironment) {
  const std::string path = ::testing::TempDir() + "/internal_token";
  {
    std::ofstream(path) << "  s3cret-token\n";
  }
  setenv(kInternalTokenEnv, "from-env", 1);
  EXPECT_EQ(*LoadInternalToken(path), "s3cret-token");  // the file wins
  EXPECT_EQ(*LoadInternalToken(""), "from-env");
  unsetenv(kInternalTokenEnv);
  EXPECT_EQ(*LoadInternalToken(""), "");
  {
    std::ofstream(path) << "\n";
  }
  EXPECT_EQ(LoadInternalToken(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadInternalToken(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(InternalTokenTest, GeneratedTokensAreLongAndDistinct) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<std::string> token = GenerateInternalToken();
    ASSERT_TRUE(token.ok()) << token.status();
    EXPECT_EQ(token->size(), 64u);
    EXPECT_EQ(token->find_first_not_of("0123456789abcdef"), std::string::npos);
    seen.insert(*token);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(InternalTokenTest, ConstantTimeEquals) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
}

}  // namespace
}  // namespace duet::rpc
