#include "common/listening_sockets.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet {
namespace {

// A socket listening on 127.0.0.1 (an ephemeral port); its "127.0.0.1:port".
std::string Listen(int* fd) {
  *fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(*fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(*fd, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(*fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
}

TEST(ListeningSocketsTest, ListsThisProcesssListenersOnly) {
  int fd = -1;
  const std::string address = Listen(&fd);
  EXPECT_THAT(ListeningTcpAddresses(getpid()), ::testing::Contains(address));
  // A connected socket is not a listener.
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  to.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1))));
  ASSERT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&to), sizeof(to)), 0);
  EXPECT_EQ(ListeningTcpAddresses(getpid()).size(), 1u);
  ::close(client);
  ::close(fd);
  EXPECT_THAT(ListeningTcpAddresses(getpid()), ::testing::Not(::testing::Contains(address)));
}

}  // namespace
}  // namespace duet
