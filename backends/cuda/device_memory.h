// Device allocations of the CUDA backend, counted so the KV cache can be sized from what is left
// (--gpu-memory-utilization), plus the pinned host staging buffer of a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/logging.h"

namespace duet::cuda {

// Owns device memory; frees on destruction.
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  DeviceAllocation(void* ptr, size_t bytes) : ptr_(ptr), bytes_(bytes) {}
  ~DeviceAllocation();
  DeviceAllocation(DeviceAllocation&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DeviceAllocation& operator=(DeviceAllocation&& o) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;

  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Allocates device memory and keeps a running total of what it handed out. Out of device
// memory: ResourceExhausted saying what was asked for, what is free and what the arena holds.
class DeviceArena {
 public:
  absl::StatusOr<DeviceAllocation> Allocate(size_t bytes, const char* what);
  int64_t allocated_bytes() const { return allocated_bytes_; }

 private:
  int64_t allocated_bytes_ = 0;
};

// Pinned (page-locked) host memory for asynchronous copies.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  absl::Status Resize(size_t bytes);
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Makes `device` the calling thread's current CUDA device for the scope, then restores the one
// before (kernels, cuBLAS calls and events belong to the current device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
};

// "F of T bytes free on the device", for out-of-memory messages.
std::string DeviceMemoryReport();

// Whether a CUDA device is visible to this process (false without a driver or device).
bool CudaDeviceAvailable();

// absl::Status from a CUDA runtime error code (OK for cudaSuccess); an allocation failure is
// ResourceExhausted.
absl::Status CudaStatus(int cuda_error, const char* what);

}  // namespace duet::cuda

// A CUDA runtime call that cannot fail on valid arguments and a healthy device (a stream-ordered
// copy, a synchronization whose step errors surface elsewhere): a failure is a bug or a dead
// device, logged FATAL with where it happened. The backend's counterpart of the kernels' own
// std-only DUET_CUDA_CHECK.
#define DUET_CHECK_CUDA(expr)                                                                        \
  do {                                                                                               \
    if (const ::absl::Status duet_cuda_status_ = ::duet::cuda::CudaStatus((expr), #expr);           \
        !duet_cuda_status_.ok()) {                                                                   \
      ::duet::LogMessage(::duet::LogLevel::kFatal, __FILE__, __LINE__).stream() << duet_cuda_status_; \
    }                                                                                                \
  } while (0)
