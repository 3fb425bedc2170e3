// Which network interfaces a worker's KV transport may use: those of its --host.
//
// UCX opens a listening socket on every network device it uses (tcp's connection
// establishment), whatever address the worker's gRPC server binds: a worker on loopback would
// still listen on every interface. UCX 1.13 takes the device list from its configuration only
// (UCX_NET_DEVICES, read by ucp_config_read when each transport starts), so the worker process
// sets that variable before starting its transport, unless the operator set it.
#pragma once

#include <string>

namespace duet {

// The interfaces that carry `host` (an address or a name): "lo" for loopback, the interface
// that has the address otherwise, "" for a wildcard (0.0.0.0, ::) or an address no interface
// has (then every device stays allowed).
std::string NetDevicesForHost(const std::string& host);

// Sets UCX_NET_DEVICES for `host` unless already set; logs what the transport may use.
void RestrictKvTransportToHost(const std::string& host);

}  // namespace duet
