// The CUDA backend's KV cache: per layer a K and a V pool of bf16 in device memory, laid out
// [num_blocks, num_kv_heads, block_size, head_dim] like every KV cache in Duet.
#pragma once

#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "engine/cuda/device_memory.h"
#include "engine/kv_cache.h"

namespace duet::cuda {

class DeviceKvCache : public KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceKvCache>> Create(KvCacheShape shape, DeviceArena& arena,
                                                               cudaStream_t stream);

  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  void* key_pool(int64_t layer) override { return keys(layer); }
  void* value_pool(int64_t layer) override { return values(layer); }
  // Stream-ordered on the executor's stream, so it lands before the next step's kernels.
  void CopyBlocks(const std::vector<BlockCopy>& copies) override;

  __nv_bfloat16* keys(int64_t layer) { return pool_.as<__nv_bfloat16>() + (2 * layer) * layer_elems_; }
  __nv_bfloat16* values(int64_t layer) { return pool_.as<__nv_bfloat16>() + (2 * layer + 1) * layer_elems_; }

 private:
  DeviceKvCache(const KvCacheShape& shape, DeviceAllocation pool, cudaStream_t stream);

  DeviceAllocation pool_;  // [num_layers][K, V][num_blocks * block_elems] bf16
  int64_t layer_elems_;
  cudaStream_t stream_;
};

}  // namespace duet::cuda
