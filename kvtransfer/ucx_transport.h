// The UCX (ucp) implementation of KvSender / KvReceiver: registered pools, RMA put of block
// ranges, endpoint flush for remote completion, then an active-message notice (see
// kv_transport.h for the protocol and ucx_protocol.h for the wire formats).
//
// Transports are UCX's choice (UCX_TLS and the other UCX_* environment variables apply), within
// what the sender's peer_failure_detection option allows (see UcxSenderOptions).
// Host memory only: Debian's UCX has no CUDA support, so pools with MemoryKind::kDevice are
// refused with UNIMPLEMENTED. That is where device pools would be staged, layer by layer,
// through registered pinned host buffers.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/kv_transport.h"
#include "kvtransfer/lease_table.h"

namespace duet::kvtransfer {

struct UcxReceiverOptions {
  std::string name = "duet-kv-receiver";
  Clock* clock = Clock::Real();
  // How often leases are checked for expiry.
  absl::Duration tick_period = absl::Milliseconds(5);
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
  // true: endpoints use UCP_ERR_HANDLING_MODE_PEER, so a dead receiver is reported as soon as
  // UCX notices. UCX 1.13 then only offers tcp (its shared-memory transports have no peer
  // failure handler). false: shared memory (posix/sysv + cma) may carry the data, and a dead
  // receiver shows only as an operation timeout (a put into its shared memory may even succeed).
  bool peer_failure_detection = true;
};

// Registers `pools` (the source of every put) and starts the sender's progress thread.
absl::StatusOr<std::unique_ptr<KvSender>> CreateUcxKvSender(KvPoolMemory pools,
                                                            UcxSenderOptions options = {});

}  // namespace duet::kvtransfer
