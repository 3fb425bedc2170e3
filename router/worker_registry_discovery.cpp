#include "router/worker_registry_discovery.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace duet::router {
namespace {

constexpr std::string_view kDnsPrefix = "dns:///";
constexpr std::string_view kFilePrefix = "file://";

// "host:port" (host may be "[v6]") into its parts; the reason in the error.
absl::Status SplitHostPort(std::string_view address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("\"", std::string(address), "\" is not HOST:PORT"));
  }
  std::string_view name = address.substr(0, colon);
  if (name.front() == '[') {
    if (name.size() < 3 || name.back() != ']') {
      return absl::InvalidArgumentError(absl::StrCat("\"", std::string(address), "\" has an unclosed [IPv6] host"));
    }
    name = name.substr(1, name.size() - 2);
  } else if (name.find(':') != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", std::string(address), "\": write an IPv6 host in brackets, [ADDRESS]:PORT"));
  }
  for (char c : name) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c)) || c == '/') {
      return absl::InvalidArgumentError(absl::StrCat("\"", std::string(address), "\" has an invalid host"));
    }
  }
  int value = 0;
  if (!absl::SimpleAtoi(std::string(address.substr(colon + 1)), &value) || value < 1 || value > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", std::string(address), "\" needs a port from 1 to 65535"));
  }
  *host = std::string(name);
  *port = value;
  return absl::OkStatus();
}

std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

class SystemResolver final : public AddressResolver {
 public:
  absl::StatusOr<std::vector<std::string>> Resolve(const DiscoveryTarget& target) override {
    return target.scheme == DiscoveryTarget::Scheme::kDns ? ResolveDns(target) : ReadFile(target);
  }

 private:
  static absl::StatusOr<std::vector<std::string>> ResolveDns(const DiscoveryTarget& target) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;  // one entry per address, not one per socket type
    addrinfo* found = nullptr;
    const int rc = getaddrinfo(target.host.c_str(), nullptr, &hints, &found);
    std::vector<std::string> addresses;
    if (rc == EAI_NONAME
#ifdef EAI_NODATA
        || rc == EAI_NODATA
#endif
    ) {
      return addresses;  // no record: a headless Service without ready pods
    }
    if (rc != 0) {
      return absl::UnavailableError(absl::StrCat("cannot resolve ", target.host, ": ", gai_strerror(rc)));
    }
    for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
      char text[INET6_ADDRSTRLEN] = {};
      const void* raw = a->ai_family == AF_INET6
                            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr)
                            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr);
      if ((a->ai_family != AF_INET && a->ai_family != AF_INET6) ||
          inet_ntop(a->ai_family, raw, text, sizeof(text)) == nullptr) {
        continue;
      }
      std::string address = JoinHostPort(text, target.port);
      if (std::find(addresses.begin(), addresses.end(), address) == addresses.end()) {
        addresses.push_back(std::move(address));
      }
    }
    freeaddrinfo(found);
    return addresses;
  }

  static absl::StatusOr<std::vector<std::string>> ReadFile(const DiscoveryTarget& target) {
    std::ifstream in(target.path);
    if (!in) return absl::UnavailableError(absl::StrCat("cannot read ", target.path));
    std::vector<std::string> addresses;
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      line.erase(std::min(line.size(), line.find('#')));
      const std::string entry(absl::StripAsciiWhitespace(line));
      if (entry.empty()) continue;
      std::string host;
      int port = 0;
      if (absl::Status status = SplitHostPort(entry, &host, &port); !status.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(target.path, " line ", number, ": ", status.message()));
      }
      std::string address = JoinHostPort(host, port);
      if (std::find(addresses.begin(), addresses.end(), address) == addresses.end()) {
        addresses.push_back(std::move(address));
      }
    }
    if (in.bad()) return absl::UnavailableError(absl::StrCat("error reading ", target.path));
    return addresses;
  }
};

}  // namespace

absl::StatusOr<DiscoveryTarget> ParseDiscoveryTarget(std::string_view spec) {
  DiscoveryTarget target;
  target.spec = std::string(spec);
  if (absl::StartsWith(target.spec, std::string(kDnsPrefix))) {
    target.scheme = DiscoveryTarget::Scheme::kDns;
    if (absl::Status status = SplitHostPort(spec.substr(kDnsPrefix.size()), &target.host, &target.port);
        !status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("discovery target ", target.spec, ": ", status.message(),
                                                     " (expected dns:///NAME:PORT)"));
    }
    return target;
  }
  if (absl::StartsWith(target.spec, "dns://")) {
    return absl::InvalidArgumentError(absl::StrCat("discovery target ", target.spec,
                                                   ": a DNS server authority is not supported; use dns:///NAME:PORT"));
  }
  if (absl::StartsWith(target.spec, std::string(kFilePrefix))) {
    target.scheme = DiscoveryTarget::Scheme::kFile;
    target.path = std::string(spec.substr(kFilePrefix.size()));
    if (target.path.empty() || target.path.front() != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("discovery target ", target.spec, ": expected file:///ABSOLUTE/PATH"));
    }
    return target;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("discovery target ", target.spec, ": expected dns:///NAME:PORT or file:///PATH"));
}

std::unique_ptr<AddressResolver> MakeSystemResolver() { return std::make_unique<SystemResolver>(); }

}  // namespace duet::router
