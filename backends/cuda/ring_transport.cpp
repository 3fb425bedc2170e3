#include "backends/cuda/ring_transport.h"

#include "absl/strings/str_cat.h"
#include "backends/cuda/device_memory.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "parallel/nccl_communicator.h"

namespace duet::cuda {

absl::Status EnablePeerAccess(int device, int peer) {
  if (device == peer) return absl::OkStatus();
  int can = 0;
  DUET_RETURN_IF_ERROR(CudaStatus(cudaDeviceCanAccessPeer(&can, device, peer), "cudaDeviceCanAccessPeer"));
  if (!can) {
    return absl::FailedPreconditionError(absl::StrCat("GPU ", device, " cannot access GPU ", peer, "'s memory directly"));
  }
  ScopedDevice on(device);
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return absl::OkStatus();
  }
  return CudaStatus(e, "cudaDeviceEnablePeerAccess");
}

namespace {

// The devices and one non-blocking communication stream per rank, which both transports share.
class RankStreamsTransport : public RingTransport {
 public:
  explicit RankStreamsTransport(std::vector<int> devices) : devices_(std::move(devices)) {}
  ~RankStreamsTransport() override {
    for (size_t r = 0; r < streams_.size(); ++r) {
      ScopedDevice on(devices_[r]);
      cudaStreamDestroy(streams_[r]);
    }
  }

  cudaStream_t stream(int rank) const override { return streams_[size_t(rank)]; }

 protected:
  absl::Status CreateStreams() {
    for (int device : devices_) {
      ScopedDevice on(device);
      cudaStream_t s = nullptr;
      DUET_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "ring stream"));
      streams_.push_back(s);
    }
    return absl::OkStatus();
  }

  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
};

class PeerCopyTransport final : public RankStreamsTransport {
 public:
  using RankStreamsTransport::RankStreamsTransport;

  absl::Status Init() {
    const size_t n = devices_.size();
    for (size_t r = 0; r < n; ++r) DUET_RETURN_IF_ERROR(EnablePeerAccess(devices_[r], devices_[(r + n - 1) % n]));
    return CreateStreams();
  }

  std::string name() const override { return "peer"; }

  absl::Status EnqueueStep(absl::Span<const std::array<void*, 2>> held, absl::Span<const std::array<void*, 2>> recv,
                           size_t bytes) override {
    const size_t n = devices_.size();
    DUET_CHECK(held.size() == n && recv.size() == n);
    for (size_t r = 0; r < n; ++r) {
      const size_t from = (r + n - 1) % n;
      ScopedDevice on(devices_[r]);
      for (size_t p = 0; p < 2; ++p) {
        DUET_RETURN_IF_ERROR(CudaStatus(
            cudaMemcpyPeerAsync(recv[r][p], devices_[r], held[from][p], devices_[from], bytes, streams_[r]),
            "ring block copy"));
      }
    }
    return absl::OkStatus();
  }
};

class NcclTransport final : public RankStreamsTransport {
 public:
  using RankStreamsTransport::RankStreamsTransport;
  ~NcclTransport() override {
    for (ncclComm_t comm : comms_) ncclCommDestroy(comm);
  }

  absl::Status Init() {
    for (size_t i = 0; i < devices_.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (devices_[i] == devices_[j]) {
          return absl::InvalidArgumentError(absl::StrCat("the nccl ring transport takes one rank per GPU; GPU ",
                                                         devices_[i], " is named twice (use --sp-transport peer)"));
        }
      }
    }
    DUET_RETURN_IF_ERROR(parallel::DisableNcclMulticast());
    comms_.resize(devices_.size());
    DUET_RETURN_IF_ERROR(
        parallel::NcclStatus(ncclCommInitAll(comms_.data(), int(devices_.size()), devices_.data()), "ncclCommInitAll"));
    return CreateStreams();
  }

  std::string name() const override { return "nccl"; }

  absl::Status EnqueueStep(absl::Span<const std::array<void*, 2>> held, absl::Span<const std::array<void*, 2>> recv,
                           size_t bytes) override {
    const int n = int(devices_.size());
    DUET_CHECK(int(held.size()) == n && int(recv.size()) == n);
    DUET_RETURN_IF_ERROR(parallel::NcclStatus(ncclGroupStart(), "ncclGroupStart"));
    absl::Status status;
    for (int r = 0; r < n && status.ok(); ++r) {
      ncclComm_t comm = comms_[size_t(r)];
      for (size_t p = 0; p < 2 && status.ok(); ++p) {
        status = parallel::NcclStatus(
            ncclSend(held[size_t(r)][p], bytes, ncclUint8, (r + 1) % n, comm, streams_[size_t(r)]), "ncclSend", comm);
        if (status.ok()) {
          status = parallel::NcclStatus(
              ncclRecv(recv[size_t(r)][p], bytes, ncclUint8, (r + n - 1) % n, comm, streams_[size_t(r)]), "ncclRecv",
              comm);
        }
      }
    }
    const absl::Status end = parallel::NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    DUET_RETURN_IF_ERROR(status);
    return end;
  }

 private:
  std::vector<ncclComm_t> comms_;
};

template <typename Transport>
absl::StatusOr<std::unique_ptr<RingTransport>> Create(const std::vector<int>& devices) {
  auto transport = std::make_unique<Transport>(devices);
  DUET_RETURN_IF_ERROR(transport->Init());
  return std::unique_ptr<RingTransport>(std::move(transport));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RingTransport>> CreateRingTransport(const std::string& kind,
                                                                   const std::vector<int>& devices) {
  if (devices.size() < 2) return absl::InvalidArgumentError("a ring transport needs two or more ranks");
  if (kind == "peer") return Create<PeerCopyTransport>(devices);
  if (kind == "nccl") return Create<NcclTransport>(devices);
  return absl::InvalidArgumentError(absl::StrCat("unknown ring transport '", kind, "' (peer or nccl)"));
}

}  // namespace duet::cuda
