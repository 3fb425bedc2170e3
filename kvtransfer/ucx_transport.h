// The UCX (ucp) implementation of KvSender / KvReceiver: registered pools, RMA put of block
// ranges, endpoint flush for remote completion, then an active-message notice (see
// kv_transport.h for the protocol and ucx_protocol.h for the wire formats).
//
// UCX moves host pools and carries every notice; a sender and receiver that both have device
// pools on one host (DeviceKvMemory in their options) move the bytes with CUDA IPC instead (the
// path is chosen per peer at Connect: kv_transport.h TransferPath). Within a host path the
// transports are UCX's choice (UCX_TLS and the other UCX_* environment variables apply), within
// what the peer's error-handling mode allows (see HostTransport).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/device_kv_memory.h"
#include "kvtransfer/host_identity.h"
#include "kvtransfer/kv_transport.h"
#include "kvtransfer/lease_table.h"

namespace duet::kvtransfer {

struct UcxReceiverOptions {
  std::string name = "duet-kv-receiver";
  Clock* clock = Clock::Real();
  // How often leases are checked for expiry.
  absl::Duration tick_period = absl::Milliseconds(5);
  // Published in the descriptor; senders with the same identity may use shared memory.
  std::string host_id = LocalHostIdentity();
  // The device pools a kCudaIpc sender writes into (exported in the descriptor); null: host
  // pools only. Not owned; must outlive the receiver.
  DeviceKvMemory* device = nullptr;
};

// How host pools reach a receiver.
enum class HostTransport : uint8_t {
  // Shared memory to a receiver with this sender's host identity, the network otherwise.
  kAuto,
  // UCP_ERR_HANDLING_MODE_PEER: a dead receiver is reported as soon as UCX notices. UCX 1.13
  // then only offers tcp (its shared-memory transports have no peer failure handler).
  kNetwork,
  // Error mode NONE: shared memory (posix/sysv + cma) may carry the data, and a dead receiver
  // shows only as an operation timeout (a put into its shared memory may even succeed).
  kSharedMemory,
};

// Registers `pools` and starts the receiver's progress thread. Leases still held when the
// receiver is destroyed are released (reason kCancelled) after its thread has stopped.
absl::StatusOr<std::unique_ptr<KvReceiver>> CreateUcxKvReceiver(KvPoolMemory pools,
                                                                ReceiverCallbacks callbacks,
                                                                UcxReceiverOptions options = {});

struct UcxSenderOptions {
  std::string name = "duet-kv-sender";
  // Each SendLayer / Finish / Abort must complete within this, or its peer is marked failed.
  absl::Duration operation_timeout = absl::Seconds(10);
  absl::Duration tick_period = absl::Milliseconds(5);
  HostTransport host_transport = HostTransport::kAuto;
  std::string host_id = LocalHostIdentity();
  // The device pools kCudaIpc copies read (to receivers on this host that export theirs); null:
  // host paths only. Not owned; must outlive the sender.
  DeviceKvMemory* device = nullptr;
};

// Registers `pools` (the source of every put) and starts the sender's progress thread.
absl::StatusOr<std::unique_ptr<KvSender>> CreateUcxKvSender(KvPoolMemory pools,
                                                            UcxSenderOptions options = {});

}  // namespace duet::kvtransfer
