// Device allocations of the CUDA backend, counted so the KV cache can be sized from what is left
// (--gpu-memory-utilization), plus the pinned host staging buffer of a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

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

// Allocates device memory and keeps a running total of what it handed out.
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

// Whether a CUDA device is visible to this process (false without a driver or device).
bool CudaDeviceAvailable();

// absl::Status from a CUDA runtime error code (OK for cudaSuccess).
absl::Status CudaStatus(int cuda_error, const char* what);

}  // namespace duet::cuda
