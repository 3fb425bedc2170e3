#include "worker/kv_net_devices.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>

#include "gtest/gtest.h"

namespace duet {
namespace {

std::string LoopbackName() {
  ifaddrs* all = nullptr;
  std::string name;
  if (getifaddrs(&all) != 0) return name;
  for (ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if ((i->ifa_flags & IFF_LOOPBACK) && i->ifa_addr != nullptr) name = i->ifa_name;
  }
  freeifaddrs(all);
  return name;
}

TEST(NetDevicesForHostTest, LoopbackAddressesMapToTheLoopbackInterface) {
  const std::string lo = LoopbackName();
  ASSERT_FALSE(lo.empty());
  EXPECT_EQ(NetDevicesForHost("127.0.0.1"), lo);
  EXPECT_EQ(NetDevicesForHost("127.0.0.2"), lo);
  EXPECT_EQ(NetDevicesForHost("localhost"), lo);
}

TEST(NetDevicesForHostTest, WildcardsAndUnknownAddressesLeaveEveryDevice) {
  EXPECT_EQ(NetDevicesForHost("0.0.0.0"), "");
  EXPECT_EQ(NetDevicesForHost("::"), "");
  EXPECT_EQ(NetDevicesForHost("[::]"), "");
  EXPECT_EQ(NetDevicesForHost("203.0.113.77"), "");  // TEST-NET-3: on no interface here
  EXPECT_EQ(NetDevicesForHost("no-such-host.invalid"), "");
}

TEST(NetDevicesForHostTest, AnInterfaceAddressMapsToThatInterface) {
  ifaddrs* all = nullptr;
  ASSERT_EQ(getifaddrs(&all), 0);
  int checked = 0;
  for (ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof(text));
    EXPECT_EQ(NetDevicesForHost(text), i->ifa_name) << text;
    ++checked;
  }
  freeifaddrs(all);
  if (checked == 0) GTEST_SKIP() << "no non-loopback IPv4 interface here";
}

}  // namespace
}  // namespace duet
