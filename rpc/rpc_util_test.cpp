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

}  // namespace
}  // namespace duet::rpc
