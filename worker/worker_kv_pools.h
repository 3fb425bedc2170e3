// The KV pools a worker registers with the transport: its cache's own pools when the transport
// can reach them (host memory), else page-locked host staging blocks of the same layout
// (a device cache: Debian's UCX has no CUDA transport). With staging, the worker copies blocks
// between the cache and the staging pools around each transfer (engine/kv_host_staging.h).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/kv/kv_cache.h"
#include "engine/kv/kv_host_staging.h"
#include "engine/scheduler/scheduler.h"
#include "kvtransfer/kv_transport.h"

namespace duet {

struct WorkerKvPools {
  kvtransfer::KvPoolMemory memory;
  std::unique_ptr<KvHostStaging> staging;  // null: `memory` is the cache's own pools
};

struct WorkerKvPoolOptions {
  // Stage even a host cache (tests exercise the device path's staging this way).
  bool force_staging = false;
  // Staging capacity in tokens, rounded up to whole blocks and capped at the cache's size;
  // 0: twice the longest prompt one step can finish, max(max_model_len, max_num_batched_tokens).
  int64_t staging_tokens = 0;
};

absl::StatusOr<WorkerKvPools> MakeWorkerKvPools(KvCache& cache, const SchedulerConfig& scheduler,
                                                const WorkerKvPoolOptions& options);

// K and V bytes of one token over all layers.
int64_t KvTokenBytes(const kvtransfer::KvLayout& layout);

}  // namespace duet
