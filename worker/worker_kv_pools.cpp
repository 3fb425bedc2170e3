#include "worker/worker_kv_pools.h"

#include <algorithm>

#include "common/logging.h"

namespace duet {

absl::StatusOr<WorkerKvPools> MakeWorkerKvPools(KvCache& cache, const SchedulerConfig& scheduler,
                                                const WorkerKvPoolOptions& options) {
  const KvCacheShape& shape = cache.shape();
  WorkerKvPools pools;
  kvtransfer::KvPoolMemory& memory = pools.memory;
  memory.layout.num_layers = uint32_t(shape.num_layers);
  memory.layout.block_size = uint32_t(shape.block_size);
  memory.layout.num_kv_heads = uint32_t(shape.num_kv_heads);
  memory.layout.head_dim = uint32_t(shape.head_dim);
  memory.layout.dtype =
      shape.dtype == KvDtype::kFloat32 ? kvtransfer::KvDtype::kFloat32 : kvtransfer::KvDtype::kBFloat16;
  if (cache.memory_space() == MemorySpace::kDevice && options.device_transfers) {
    kvtransfer::DeviceKvPools device{memory.layout, uint32_t(shape.num_blocks), {}, {}};
    for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
      device.key_pools.push_back(cache.key_pool(layer));
      device.value_pools.push_back(cache.value_pool(layer));
    }
    absl::StatusOr<std::unique_ptr<kvtransfer::DeviceKvMemory>> exported =
        kvtransfer::CreateDeviceKvMemory(std::move(device));
    if (exported.ok()) {
      pools.device = *std::move(exported);
    } else {
      DUET_LOG(WARNING) << "KV transfers stay on host staging: " << exported.status();
    }
  }
  if (cache.memory_space() == MemorySpace::kHost && !options.force_staging) {
    memory.num_blocks = uint32_t(shape.num_blocks);
    for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
      memory.key_pools.push_back(cache.key_pool(layer));
      memory.value_pools.push_back(cache.value_pool(layer));
    }
    return pools;
  }
  const int64_t tokens = options.staging_tokens > 0
                             ? options.staging_tokens
                             : 2 * std::max<int64_t>(scheduler.max_model_len, scheduler.max_num_batched_tokens);
  const int64_t wanted = (tokens + shape.block_size - 1) / shape.block_size;
  absl::StatusOr<std::unique_ptr<KvHostStaging>> staging =
      KvHostStaging::Create(cache, std::min(wanted, shape.num_blocks));
  if (!staging.ok()) return staging.status();
  pools.staging = *std::move(staging);
  memory.num_blocks = uint32_t(pools.staging->num_blocks());
  memory.key_pools = pools.staging->pools().keys;
  memory.value_pools = pools.staging->pools().values;
  return pools;
}

int64_t KvTokenBytes(const kvtransfer::KvLayout& layout) {
  return int64_t(layout.num_kv_heads) * int64_t(layout.TokenHeadBytes()) * 2 * int64_t(layout.num_layers);
}

}  // namespace duet
