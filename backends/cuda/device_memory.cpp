#include "backends/cuda/device_memory.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace duet::cuda {

ScopedDevice::ScopedDevice(int device) {
  DUET_CHECK_CUDA(cudaGetDevice(&previous_));
  if (device != previous_) DUET_CHECK_CUDA(cudaSetDevice(device));
}

ScopedDevice::~ScopedDevice() {
  int current = 0;
  DUET_CHECK_CUDA(cudaGetDevice(&current));
  if (current != previous_) DUET_CHECK_CUDA(cudaSetDevice(previous_));
}

bool CudaDeviceAvailable() {
  int count = 0;
  const bool available = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();  // a missing driver leaves a sticky error otherwise
  return available;
}

absl::Status CudaStatus(int cuda_error, const char* what) {
  if (cuda_error == cudaSuccess) return absl::OkStatus();
  const auto e = static_cast<cudaError_t>(cuda_error);
  const absl::StatusCode code =
      e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

DeviceAllocation::~DeviceAllocation() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

std::string DeviceMemoryReport() {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return "device memory use unknown";
  }
  return absl::StrCat(free_bytes, " of ", total_bytes, " bytes free on the device");
}

absl::StatusOr<DeviceAllocation> DeviceArena::Allocate(size_t bytes, const char* what) {
  void* ptr = nullptr;
  const cudaError_t err = cudaMalloc(&ptr, bytes == 0 ? 1 : bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky, but leave no error behind for the next check
    return absl::ResourceExhaustedError(absl::StrCat("out of device memory: ", what, " needs ", bytes, " bytes, ",
                                                     DeviceMemoryReport(), " (this executor holds ",
                                                     allocated_bytes_, ")"));
  }
  if (absl::Status s = CudaStatus(err, what); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), " allocating ", bytes, " bytes"));
  }
  allocated_bytes_ += int64_t(bytes);
  return DeviceAllocation(ptr, bytes);
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
}

absl::Status PinnedBuffer::Resize(size_t bytes) {
  if (bytes <= bytes_) return absl::OkStatus();
  if (ptr_ != nullptr) cudaFreeHost(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  if (absl::Status s = CudaStatus(cudaMallocHost(&ptr_, bytes), "cudaMallocHost"); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), " pinning ", bytes, " host bytes"));
  }
  bytes_ = bytes;
  return absl::OkStatus();
}

}  // namespace duet::cuda
