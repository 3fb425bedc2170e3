#include "worker/kv_net_devices.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace duet {
namespace {

bool IsLoopback(const sockaddr* a) {
  if (a->sa_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr) >> 24) == 127;
  }
  if (a->sa_family == AF_INET6) {
    const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&v6)) return v6.s6_addr[12] == 127;
    return IN6_IS_ADDR_LOOPBACK(&v6);
  }
  return false;
}

bool IsWildcard(const sockaddr* a) {
  if (a->sa_family == AF_INET) return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (a->sa_family == AF_INET6) return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr);
  return false;
}

bool SameAddress(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

}  // namespace

std::string NetDevicesForHost(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* resolved = nullptr;
  const std::string name = host.size() > 2 && host.front() == '[' && host.back() == ']' ? host.substr(1, host.size() - 2)
                                                                                        : host;
  if (name.empty() || getaddrinfo(name.c_str(), nullptr, &hints, &resolved) != 0) return "";
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) {
    freeaddrinfo(resolved);
    return "";
  }
  std::set<std::string> devices;
  bool wildcard = false;
  for (const addrinfo* r = resolved; r != nullptr; r = r->ai_next) {
    if (IsWildcard(r->ai_addr)) wildcard = true;
    for (const ifaddrs* i = interfaces; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr) continue;
      // Any loopback address is on the loopback interface (127.0.0.0/8, not only 127.0.0.1).
      const bool match = IsLoopback(r->ai_addr) ? (i->ifa_flags & IFF_LOOPBACK) != 0 : SameAddress(r->ai_addr, i->ifa_addr);
      if (match) devices.insert(i->ifa_name);
    }
  }
  freeifaddrs(interfaces);
  freeaddrinfo(resolved);
  return wildcard ? "" : absl::StrJoin(devices, ",");
}

void RestrictKvTransportToHost(const std::string& host) {
  if (const char* set = std::getenv("UCX_NET_DEVICES"); set != nullptr) {
    DUET_LOG(INFO) << "KV transport network devices: " << set << " (UCX_NET_DEVICES)";
    return;
  }
  const std::string devices = NetDevicesForHost(host);
  if (devices.empty()) {
    DUET_LOG(INFO) << "KV transport network devices: all (--host " << host << ")";
    return;
  }
  setenv("UCX_NET_DEVICES", devices.c_str(), /*overwrite=*/0);
  DUET_LOG(INFO) << "KV transport network devices: " << devices << " (the interface of --host " << host << ")";
}

}  // namespace duet
