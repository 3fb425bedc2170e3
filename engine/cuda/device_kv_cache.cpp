#include "engine/cuda/device_kv_cache.h"

#include "kernels/cuda_check.h"

namespace duet::cuda {

absl::StatusOr<std::unique_ptr<DeviceKvCache>> DeviceKvCache::Create(KvCacheShape shape, DeviceArena& arena,
                                                                     cudaStream_t stream) {
  shape.dtype = KvDtype::kBFloat16;
  const size_t bytes = size_t(shape.num_blocks) * size_t(shape.bytes_per_block());
  absl::StatusOr<DeviceAllocation> pool = arena.Allocate(bytes, "KV cache");
  if (!pool.ok()) return pool.status();
  // Zeroed so a block never read before being written holds finite values.
  if (absl::Status s = CudaStatus(cudaMemsetAsync(pool->get(), 0, bytes, stream), "KV cache memset"); !s.ok()) {
    return s;
  }
  return std::unique_ptr<DeviceKvCache>(new DeviceKvCache(shape, std::move(*pool), stream));
}

DeviceKvCache::DeviceKvCache(const KvCacheShape& shape, DeviceAllocation pool, cudaStream_t stream)
    : KvCache(shape), pool_(std::move(pool)), layer_elems_(shape.num_blocks * shape.block_elems()), stream_(stream) {}

void DeviceKvCache::CopyBlocks(const std::vector<BlockCopy>& copies) {
  const size_t block_bytes = size_t(shape().block_elems()) * sizeof(__nv_bfloat16);
  const int64_t n = shape().block_elems();
  for (int64_t layer = 0; layer < shape().num_layers; ++layer) {
    for (const BlockCopy& c : copies) {
      DUET_CUDA_CHECK(cudaMemcpyAsync(keys(layer) + c.dst * n, keys(layer) + c.src * n, block_bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
      DUET_CUDA_CHECK(cudaMemcpyAsync(values(layer) + c.dst * n, values(layer) + c.src * n, block_bytes,
                                      cudaMemcpyDeviceToDevice, stream_));
    }
  }
}

}  // namespace duet::cuda
