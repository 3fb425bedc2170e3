// How the ranks of a sequence-parallel group (backends/cuda/sequence_parallel_group.h) pass ring
// blocks: at every ring step each rank r receives the block rank (r - 1) mod N held at the step
// before into its receive buffer. A transport owns one communication stream per rank, on the
// rank's device; the group orders those streams against its compute streams with events (a
// step's sources written, its destinations no longer read) before it enqueues a step.
//
//   peer: cudaMemcpyPeerAsync on the receiving rank's stream (NVLink copy engines between GPUs
//         with peer access; a device-to-device copy when two ranks share a GPU).
//   nccl: one NCCL communicator per rank (ncclCommInitAll, NVLink multicast off), every rank's
//         ncclSend to the next and ncclRecv from the previous in one group call, on each rank's
//         stream. NCCL takes one rank per GPU: the devices must differ.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace duet::cuda {

class RingTransport {
 public:
  virtual ~RingTransport() = default;
  virtual std::string name() const = 0;
  // Rank r's communication stream.
  virtual cudaStream_t stream(int rank) const = 0;
  // Enqueues one step: for every rank r and both pools p (K and V), `bytes` from
  // held[(r - 1) mod N][p] (on devices[(r - 1) mod N]) into recv[r][p] (on devices[r]).
  virtual absl::Status EnqueueStep(absl::Span<const std::array<void*, 2>> held,
                                   absl::Span<const std::array<void*, 2>> recv, size_t bytes) = 0;
};

// "peer" or "nccl" (above) over `devices` (rank r's is devices[r]; at least two).
absl::StatusOr<std::unique_ptr<RingTransport>> CreateRingTransport(const std::string& kind,
                                                                   const std::vector<int>& devices);

// Lets `device` read and write `peer`'s memory (a no-op for the same device or access already
// enabled); FailedPrecondition when the two GPUs cannot reach each other directly.
absl::Status EnablePeerAccess(int device, int peer);

}  // namespace duet::cuda
