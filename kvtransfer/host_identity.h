// Which host a process runs on, as the KV transport compares it: two processes with the same
// identity can share memory (UCX shared-memory transports, CUDA IPC). The host name and the
// kernel's boot id: containers on one node that do not share their host name (Kubernetes pods)
// count as different hosts, which is what their separate IPC namespaces require.
#pragma once

#include <string>

namespace duet::kvtransfer {

std::string LocalHostIdentity();

}  // namespace duet::kvtransfer
