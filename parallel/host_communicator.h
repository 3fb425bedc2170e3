// HostCommunicator: a Communicator whose ranks are threads of one process and whose buffers are
// host memory (the CPU backend's sequence-parallel group, and the tests).
//
// The `size` communicators of one group share a mailbox: each rank posts its send buffer, and
// the receiving rank copies from it straight into its own receive buffer in Wait, then tells the
// sender its buffer is free. So an exchange costs one memcpy per rank, done by the receiver's
// thread, with no staging copy and no helper thread; waiting blocks on an absl::Mutex condition
// (no polling). The copy runs inside Wait, on the receiving thread: computing on the block in
// hand before Wait hides the wait for slower peers, not the memcpy itself (small next to the
// attention over a block). A size-1 group exchanges with itself (recv = send).
//
// Each communicator is used by one thread at a time (its rank's); different ranks' communicators
// run concurrently. Every rank calls the operations in the same order with the same sizes, as the
// Communicator contract says. Where they disagree, a Broadcast (sizes or root) returns
// InvalidArgument on every rank, and a ring exchange (sizes) on both ends of the mismatched link;
// the group stays usable. Dropping a PendingExchange without Wait waits for it.
#pragma once

#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace duet::parallel {

// The `size` ranks of one group, rank i at index i. size >= 1. The communicators may be destroyed
// in any order once no operation is in flight; a PendingExchange keeps the group alive.
std::vector<std::unique_ptr<Communicator>> CreateHostCommunicators(int size);

}  // namespace duet::parallel
