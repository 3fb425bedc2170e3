// Where the router finds workers besides its static address lists: discovery targets it
// re-resolves every few seconds (WorkerRegistry follows the changes; see worker_registry.h).
//
//   dns:///NAME:PORT  every address NAME resolves to (getaddrinfo: A and AAAA records, deduplicated),
//                     each with PORT. A Kubernetes headless Service resolves to its ready pods.
//   file:///PATH      one host:port a line (blank lines and `#` comments skipped), read afresh each
//                     time: for hosts outside Kubernetes, or a file a configuration manager rewrites.
//
// A worker's identity is its address: a pod restarted under a new IP is a new worker, and the old
// address leaves the list.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace duet::router {

struct DiscoveryTarget {
  enum class Scheme { kDns, kFile };
  Scheme scheme = Scheme::kDns;
  std::string host;  // kDns: the name (or a literal address) to resolve
  int port = 0;      // kDns: the workers' port
  std::string path;  // kFile: the absolute path of the list
  std::string spec;  // as given, for messages
};

// "dns:///NAME:PORT" or "file:///PATH"; anything else is InvalidArgument with the reason.
absl::StatusOr<DiscoveryTarget> ParseDiscoveryTarget(std::string_view spec);

// The seam between the registry and name resolution (tests substitute a fake).
class AddressResolver {
 public:
  virtual ~AddressResolver() = default;
  // The worker addresses (host:port, IPv6 as [addr]:port) the target names now. An empty list is
  // an answer (a headless Service with no ready pod has no DNS record); an error (no DNS server,
  // an unreadable file) means "unknown", and the registry keeps what it had.
  virtual absl::StatusOr<std::vector<std::string>> Resolve(const DiscoveryTarget& target) = 0;
};

// getaddrinfo for dns:///, a file read for file:///. getaddrinfo blocks: call it off the request
// path (the registry has a thread for it).
std::unique_ptr<AddressResolver> MakeSystemResolver();

}  // namespace duet::router
