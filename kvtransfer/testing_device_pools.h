// Device-memory KV pools for the CUDA IPC tests and benchmark: one cudaMalloc holding, per layer,
// a K and a V pool [num_blocks, num_kv_heads, block_size, head_dim] (the device cache's own
// arrangement), copied to and from HostKvPools to set and check bytes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "kvtransfer/device_kv_memory.h"
#include "kvtransfer/testing_pools.h"

namespace duet::kvtransfer {

class DeviceKvTestPools {
 public:
  DeviceKvTestPools(const KvLayout& layout, uint32_t num_blocks) : layout_(layout), num_blocks_(num_blocks) {
    DUET_CHECK(cudaMalloc(&base_, 2 * size_t{layout.num_layers} * PoolBytes()) == cudaSuccess);
    DUET_CHECK(cudaMemset(base_, 0, 2 * size_t{layout.num_layers} * PoolBytes()) == cudaSuccess);
  }
  ~DeviceKvTestPools() { cudaFree(base_); }
  DeviceKvTestPools(const DeviceKvTestPools&) = delete;
  DeviceKvTestPools& operator=(const DeviceKvTestPools&) = delete;

  size_t PoolBytes() const { return size_t{num_blocks_} * layout_.BlockBytes(); }
  char* key(uint32_t layer) const { return base_ + (2 * size_t{layer}) * PoolBytes(); }
  char* value(uint32_t layer) const { return base_ + (2 * size_t{layer} + 1) * PoolBytes(); }

  DeviceKvPools pools() const {
    DeviceKvPools pools{layout_, num_blocks_, {}, {}};
    for (uint32_t layer = 0; layer < layout_.num_layers; ++layer) {
      pools.key_pools.push_back(key(layer));
      pools.value_pools.push_back(value(layer));
    }
    return pools;
  }
  // `host` must have this layout and block count.
  void Upload(HostKvPools& host) const { Copy(host, /*to_device=*/true); }
  void Download(HostKvPools& host) const { Copy(host, /*to_device=*/false); }

 private:
  void Copy(HostKvPools& host, bool to_device) const {
    for (uint32_t layer = 0; layer < layout_.num_layers; ++layer) {
      for (auto [device, pool] : {std::pair{key(layer), host.key(layer)}, std::pair{value(layer), host.value(layer)}}) {
        const cudaError_t err = to_device ? cudaMemcpy(device, pool, PoolBytes(), cudaMemcpyHostToDevice)
                                          : cudaMemcpy(pool, device, PoolBytes(), cudaMemcpyDeviceToHost);
        DUET_CHECK(err == cudaSuccess);
      }
    }
  }

  KvLayout layout_;
  uint32_t num_blocks_;
  char* base_ = nullptr;
};

}  // namespace duet::kvtransfer
