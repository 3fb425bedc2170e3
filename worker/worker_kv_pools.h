// The KV pools a worker registers with the transport: its cache's own pools when the transport
// can reach them (host memory), else page-locked host staging blocks of the same layout
// (a device cache: UCX moves host memory only), plus, for a device cache, the cache's own pools
// for the CUDA IPC path to workers on the same host (kvtransfer/device_kv_memory.h). With
// staging, the worker copies blocks between the cache and the staging pools around each
// transfer that takes a host path (engine/kv_host_staging.h).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/kv/kv_cache.h"
#include "engine/kv/kv_host_staging.h"
#include "engine/scheduler/scheduler.h"
#include "kvtransfer/device_kv_memory.h"
#include "kvtransfer/kv_transport.h"

namespace duet {

struct WorkerKvPools {
  kvtransfer::KvPoolMemory memory;
  std::unique_ptr<KvHostStaging> staging;  // null: `memory` is the cache's own pools
  // A device cache's pools; null for a host cache, or when device transfers are off.
  std::unique_ptr<kvtransfer::DeviceKvMemory> device;
};

struct WorkerKvPoolOptions {
  // Stage even a host cache (tests exercise the device path's staging this way).
  bool force_staging = false;
  // Staging capacity in tokens, rounded up to whole blocks and capped at the cache's size;
  // 0: twice the longest prompt one step can finish, max(max_model_len, max_num_batched_tokens).
  int64_t staging_tokens = 0;
  // Offer a device cache's pools for CUDA IPC transfers (off: every transfer is staged).
  bool device_transfers = true;
};

absl::StatusOr<WorkerKvPools> MakeWorkerKvPools(KvCache& cache, const SchedulerConfig& scheduler,
                                                const WorkerKvPoolOptions& options);

// K and V bytes of one token over all layers.
int64_t KvTokenBytes(const kvtransfer::KvLayout& layout);

}  // namespace duet
