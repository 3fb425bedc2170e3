#include "rpc/rpc_util.h"

#include "gtest/gtest.h"

namespace duet::rpc {
namespace {

TEST(StartServerTest, ATakenPortIsAnError) {
  int port = 0;
  auto first = StartServer("127.0.0.1:0", {}, &port);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT(port, 0);
  int second_port = 0;
  auto second = StartServer("127.0.0.1:" + std::to_string(port), {}, &second_port);
  EXPECT_FALSE(second.ok()) << "a second server listened on taken port " << port;
  if (second.ok()) (*second)->Shutdown();
  (*first)->Shutdown();
}

// A worker's stats carry its process's instance id: 32 hex digits, the same on every call.
TEST(FillWorkerStatsTest, TheInstanceIdIsThisProcesssOwn) {
  v1::WorkerStats a, b;
  FillWorkerStats(EngineStats{}, "decode", 16, &a);
  FillWorkerStats(EngineStats{}, "decode", 16, &b);
  EXPECT_EQ(a.instance_id().size(), 32u);
  EXPECT_EQ(a.instance_id().find_first_not_of("0123456789abcdef"), std::string::npos) << a.instance_id();
  EXPECT_EQ(a.instance_id(), b.instance_id());
  EXPECT_EQ(a.instance_id(), ProcessInstanceId());
}

}  // namespace
}  // namespace duet::rpc
