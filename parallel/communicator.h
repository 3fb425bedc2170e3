// The communicator seam of sequence-parallel prefill: a group of `size` ranks, each holding the
// whole model and a shard of one long prompt, that pass K/V blocks around a ring (ring
// attention) and share small results.
//
// Implementations: HostCommunicator (ranks are threads of one process, buffers in host memory:
// the CPU backend and the tests) and NcclCommunicator (one rank per GPU, buffers in device
// memory; NVLink multicast kept off). Every rank calls the collective operations in the same
// order with the same sizes.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "absl/status/status.h"

namespace duet::parallel {

// A ring exchange in flight (see Communicator::StartRingExchange).
class PendingExchange {
 public:
  virtual ~PendingExchange() = default;
  // Returns once this rank's send buffer may be reused and its receive buffer is filled.
  virtual absl::Status Wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Starts sending `send` to rank (rank + 1) % size and receiving rank (rank - 1) % size's into
  // `recv` (the same byte count on every rank); returns at once, so the caller computes on the
  // block in hand while the next one travels. Both buffers stay untouched until Wait returns.
  // One exchange in flight per communicator at a time.
  virtual std::unique_ptr<PendingExchange> StartRingExchange(std::span<const std::byte> send,
                                                             std::span<std::byte> recv) = 0;
  // Copies `root`'s `data` into every other rank's `data` (same size everywhere).
  virtual absl::Status Broadcast(std::span<std::byte> data, int root) = 0;
  // Returns once every rank has called it.
  virtual absl::Status Barrier() = 0;
};

}  // namespace duet::parallel
