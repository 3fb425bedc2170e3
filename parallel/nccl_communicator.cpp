#include "parallel/nccl_communicator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/check.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace duet::parallel {
namespace {

absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrFormat("%s: %s", what, cudaGetErrorString(error)));
}

}  // namespace

// Adds NCCL's last error message, which says more than the result code.
absl::Status NcclStatus(ncclResult_t result, const char* what, ncclComm_t comm) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrFormat("%s: %s", what, ncclGetErrorString(result));
  if (const char* last = ncclGetLastError(comm); last != nullptr && last[0] != '\0') {
    absl::StrAppend(&message, " (", last, ")");
  }
  if (result == ncclInvalidArgument || result == ncclInvalidUsage) {
    return absl::InvalidArgumentError(message);
  }
  return absl::InternalError(message);
}

absl::Status DisableNcclMulticast() {
  // setenv races with getenv on other threads; once, before any NCCL call of ours, avoids that.
  static std::once_flag once;
  std::call_once(once, [] { setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1); });
  const char* value = std::getenv("NCCL_NVLS_ENABLE");
  if (value == nullptr || std::strcmp(value, "0") != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "NCCL_NVLS_ENABLE is '%s' after being set to 0: NVLink multicast must stay off",
        value == nullptr ? "" : value));
  }
  return absl::OkStatus();
}

absl::StatusOr<ncclUniqueId> CreateNcclUniqueId() {
  DUET_RETURN_IF_ERROR(DisableNcclMulticast());
  ncclUniqueId id;
  DUET_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  return id;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(int rank, int size,
                                                                     const ncclUniqueId& id,
                                                                     int device) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("NCCL rank %d outside a group of %d", rank, size));
  }
  if (device < 0) return absl::InvalidArgumentError(absl::StrFormat("CUDA device %d", device));
  DUET_RETURN_IF_ERROR(DisableNcclMulticast());
  DUET_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  ncclComm_t comm = nullptr;
  DUET_RETURN_IF_ERROR(NcclStatus(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank"));
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> communicator,
                        NcclCommunicator::Create(comm, rank, size, device));
  return std::unique_ptr<Communicator>(std::move(communicator));
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    std::span<const int> devices) {
  if (devices.empty()) return absl::InvalidArgumentError("an NCCL group needs a device");
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat("CUDA device %d", devices[i]));
    }
    for (size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        return absl::InvalidArgumentError(
            absl::StrFormat("CUDA device %d named twice: NCCL takes one rank per GPU", devices[i]));
      }
    }
  }
  DUET_RETURN_IF_ERROR(DisableNcclMulticast());
  const int size = static_cast<int>(devices.size());
  std::vector<ncclComm_t> comms(size, nullptr);
  DUET_RETURN_IF_ERROR(
      NcclStatus(ncclCommInitAll(comms.data(), size, devices.data()), "ncclCommInitAll"));
  std::vector<std::unique_ptr<Communicator>> ranks;
  ranks.reserve(size);
  for (int rank = 0; rank < size; ++rank) {
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> communicator =
        NcclCommunicator::Create(comms[rank], rank, size, devices[rank]);
    if (!communicator.ok()) {
      for (int rest = rank + 1; rest < size; ++rest) ncclCommDestroy(comms[rest]);
      return communicator.status();
    }
    ranks.push_back(std::move(*communicator));
  }
  return ranks;
}

// The exchange in flight; a start that failed reports its error from Wait.
class NcclPendingExchange final : public PendingExchange {
 public:
  NcclPendingExchange(NcclCommunicator* communicator, absl::Status started)
      : communicator_(communicator), status_(std::move(started)) {}
  ~NcclPendingExchange() override { (void)Wait(); }

  absl::Status Wait() override {
    if (!done_) {
      absl::Status finished = communicator_->FinishExchange();
      if (status_.ok()) status_ = std::move(finished);
      done_ = true;
    }
    return status_;
  }

 private:
  NcclCommunicator* const communicator_;
  absl::Status status_;
  bool done_ = false;
};

NcclCommunicator::NcclCommunicator(ncclComm_t comm, int rank, int size, int device)
    : comm_(comm), rank_(rank), size_(size), device_(device) {}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(ncclComm_t comm,
                                                                           int rank, int size,
                                                                           int device) {
  // Owned from here on: the destructor releases what was made if a step below fails.
  std::unique_ptr<NcclCommunicator> communicator(new NcclCommunicator(comm, rank, size, device));
  DUET_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  DUET_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&communicator->stream_, cudaStreamNonBlocking),
                 "cudaStreamCreate"));
  DUET_RETURN_IF_ERROR(CudaStatus(
      cudaEventCreateWithFlags(&communicator->exchanged_, cudaEventDisableTiming),
      "cudaEventCreate"));
  DUET_RETURN_IF_ERROR(CudaStatus(
      cudaMalloc(reinterpret_cast<void**>(&communicator->scratch_), sizeof(int)), "cudaMalloc"));
  // Zero, so the barrier's sum stays zero.
  DUET_RETURN_IF_ERROR(
      CudaStatus(cudaMemset(communicator->scratch_, 0, sizeof(int)), "cudaMemset"));
  return communicator;
}

NcclCommunicator::~NcclCommunicator() {
  if (cudaSetDevice(device_) != cudaSuccess) {
    DUET_LOG(WARNING) << "NCCL rank " << rank_ << ": cannot select device " << device_;
  }
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (comm_ != nullptr) {
    if (absl::Status s = NcclStatus(ncclCommDestroy(comm_), "ncclCommDestroy"); !s.ok()) {
      DUET_LOG(WARNING) << "NCCL rank " << rank_ << ": " << s;
    }
  }
  if (scratch_ != nullptr) (void)cudaFree(scratch_);
  if (exchanged_ != nullptr) (void)cudaEventDestroy(exchanged_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

std::unique_ptr<PendingExchange> NcclCommunicator::StartRingExchange(
    std::span<const std::byte> send, std::span<std::byte> recv) {
  DUET_CHECK_MSG(!in_flight_, "one ring exchange in flight per communicator");
  in_flight_ = true;
  return std::make_unique<NcclPendingExchange>(this, EnqueueExchange(send, recv));
}

absl::Status NcclCommunicator::EnqueueExchange(std::span<const std::byte> send,
                                               std::span<std::byte> recv) {
  if (send.size() != recv.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ring exchange: %d bytes to send, %d to receive", send.size(), recv.size()));
  }
  DUET_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  if (!send.empty()) {
    const int next = (rank_ + 1) % size_;
    const int prev = (rank_ + size_ - 1) % size_;
    DUET_RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), "ncclGroupStart", comm_));
    // Both calls go in before ncclGroupEnd returns an error, so the group is always closed.
    const ncclResult_t sent =
        ncclSend(send.data(), send.size(), ncclUint8, next, comm_, stream_);
    const ncclResult_t received =
        ncclRecv(recv.data(), recv.size(), ncclUint8, prev, comm_, stream_);
    const ncclResult_t ended = ncclGroupEnd();
    DUET_RETURN_IF_ERROR(NcclStatus(sent, "ncclSend", comm_));
    DUET_RETURN_IF_ERROR(NcclStatus(received, "ncclRecv", comm_));
    DUET_RETURN_IF_ERROR(NcclStatus(ended, "ncclGroupEnd", comm_));
  }
  return CudaStatus(cudaEventRecord(exchanged_, stream_), "cudaEventRecord");
}

absl::Status NcclCommunicator::FinishExchange() {
  in_flight_ = false;
  // After a failed start the event holds an earlier exchange (or none), so this returns at once.
  DUET_RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(exchanged_), "ring exchange"));
  ncclResult_t async = ncclSuccess;
  DUET_RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError"));
  return NcclStatus(async, "ring exchange", comm_);
}

absl::Status NcclCommunicator::SyncStream(const char* what) {
  DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), what));
  ncclResult_t async = ncclSuccess;
  DUET_RETURN_IF_ERROR(NcclStatus(ncclCommGetAsyncError(comm_, &async), "ncclCommGetAsyncError"));
  return NcclStatus(async, what, comm_);
}

absl::Status NcclCommunicator::Broadcast(std::span<std::byte> data, int root) {
  if (root < 0 || root >= size_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("broadcast root %d outside a group of %d ranks", root, size_));
  }
  if (data.empty()) return absl::OkStatus();
  DUET_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  DUET_RETURN_IF_ERROR(NcclStatus(
      ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, root, comm_, stream_),
      "ncclBroadcast", comm_));
  return SyncStream("broadcast");
}

absl::Status NcclCommunicator::Barrier() {
  DUET_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  DUET_RETURN_IF_ERROR(NcclStatus(
      ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_), "ncclAllReduce",
      comm_));
  return SyncStream("barrier");
}

}  // namespace duet::parallel
