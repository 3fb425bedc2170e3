// A device buffer of T freed on scope exit, for the kernel tests and the GPU benchmarks (no gtest
// here, so a benchmark can use it too).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/cuda_check.h"

namespace duet::kernels {

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { DUET_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(1, n) * sizeof(T))); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  // Upload and Poison have landed when they return, so a kernel on any stream sees them. (Left
  // to themselves, cudaMemset and a pageable-memory cudaMemcpy may return before the device
  // memory changes, ordered only on the legacy default stream — which a cudaStreamNonBlocking
  // stream, like the one graphs replay on, does not wait for.)
  void Upload(const std::vector<T>& host) {
    DUET_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    DUET_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with 0xFF: NaN for float and bf16, so an unwritten output fails the test.
  void Poison() {
    DUET_CUDA_CHECK(cudaMemset(ptr_, 0xFF, n_ * sizeof(T)));
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace duet::kernels
