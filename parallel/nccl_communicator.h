// NcclCommunicator: a Communicator over NCCL, one rank per GPU, buffers in device memory.
//
// Each communicator owns a CUDA stream on its device. StartRingExchange enqueues
// ncclGroupStart / ncclSend(next) / ncclRecv(previous) / ncclGroupEnd on that stream and records
// an event; Wait blocks the host on the event. Broadcast is ncclBroadcast in place; Barrier is a
// one-int all-reduce; both return once their stream work is done. The send buffer must already
// hold its data when StartRingExchange is called (the stream that wrote it has been synchronized),
// since the exchange runs on the communicator's own stream. A PendingExchange must not outlive
// its communicator; dropping it unwaited waits.
//
// NVLink multicast (NVLS) stays off: every function here that reaches NCCL first sets
// NCCL_NVLS_ENABLE=0 in the process environment (overwriting any value, once per process, before
// NCCL reads it), and fails if something changed it back. A program using these must not set up
// NCCL through another path before calling them.
//
// Two ways to build a group:
//   - one rank per process (or per thread): rank 0 calls CreateNcclUniqueId, hands the id to the
//     others, and every rank calls CreateNcclCommunicator with its own device;
//   - one process driving N GPUs: CreateNcclCommunicators(devices) (ncclCommInitAll). Drive each
//     rank of such a group from a thread of its own, as with the host communicator: NCCL
//     operations of one rank may wait on its peers.
//
// libnccl.so is linked directly: it needs no libcuda.so.1 at load time (NCCL loads the driver
// itself), so the binaries start on machines without a GPU driver, where the tests skip.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace duet::parallel {

// Sets NCCL_NVLS_ENABLE=0 (once per process, overwriting), then checks it still reads "0";
// FailedPrecondition if it does not. The functions below call it; call it yourself before any
// other NCCL use.
absl::Status DisableNcclMulticast();

// absl::Status of an NCCL result, with NCCL's last error message (of `comm`, if given); bad
// arguments or usage: InvalidArgument; anything else: Internal.
absl::Status NcclStatus(ncclResult_t result, const char* what, ncclComm_t comm = nullptr);

// A new group id (ncclGetUniqueId), after DisableNcclMulticast.
absl::StatusOr<ncclUniqueId> CreateNcclUniqueId();

// Rank `rank` of a group of `size` on CUDA device `device` (ncclCommInitRank; blocks until every
// rank of the group has called it).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int rank, int size,
                                                                     const ncclUniqueId& id,
                                                                     int device);

// A group with rank i on devices[i], all in this process (ncclCommInitAll). Devices must differ:
// NCCL refuses two ranks on one GPU.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    std::span<const int> devices);

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (rank `rank` of `size` on `device`) and creates the stream, event
  // and scratch word it needs.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(ncclComm_t comm, int rank,
                                                                  int size, int device);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  // The stream every operation of this communicator runs on.
  cudaStream_t stream() const { return stream_; }

  std::unique_ptr<PendingExchange> StartRingExchange(std::span<const std::byte> send,
                                                     std::span<std::byte> recv) override;
  absl::Status Broadcast(std::span<std::byte> data, int root) override;
  absl::Status Barrier() override;

 private:
  friend class NcclPendingExchange;
  NcclCommunicator(ncclComm_t comm, int rank, int size, int device);
  absl::Status EnqueueExchange(std::span<const std::byte> send, std::span<std::byte> recv);
  // Waits for the exchange in flight and checks NCCL's asynchronous error.
  absl::Status FinishExchange();
  absl::Status SyncStream(const char* what);

  ncclComm_t comm_;
  const int rank_;
  const int size_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t exchanged_ = nullptr;  // recorded after the exchange in flight
  int* scratch_ = nullptr;           // the barrier's all-reduce word, on the device
  bool in_flight_ = false;
};

}  // namespace duet::parallel
