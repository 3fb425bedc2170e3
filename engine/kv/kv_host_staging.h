// Host staging for a KV cache whose blocks a host-memory transport cannot reach directly.
//
// The CUDA backend's KV cache lives in device memory and Debian's UCX has no CUDA transport, so
// KV blocks travel between workers through page-locked host blocks of the same layout:
//   prefill worker: a finished layer's blocks are copied into staging blocks, sent from there;
//   decode worker: the sender writes into staging blocks, which are copied into the reserved
//   cache blocks once the whole request has arrived.
// The staging pools have the cache's block layout and dtype: per layer a K and a V pool
// [num_blocks, num_kv_heads, block_size, head_dim], all in one host allocation laid out
// [num_layers][K, V][num_blocks * block bytes].
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/kv/kv_cache.h"

namespace duet {

class KvHostStaging {
 public:
  // `cache` must outlive the staging.
  static absl::StatusOr<std::unique_ptr<KvHostStaging>> Create(KvCache& cache, int64_t num_blocks);

  const HostKvBlocks& pools() const { return pools_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_free_blocks() const ABSL_LOCKS_EXCLUDED(mu_);

  // Takes `count` staging blocks; RESOURCE_EXHAUSTED when fewer are free.
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t count) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives blocks from Allocate back (each exactly once).
  void Free(absl::Span<const int32_t> blocks) ABSL_LOCKS_EXCLUDED(mu_);

  // Copies one layer of cache blocks `cache_blocks[i]` into staging blocks `staging_blocks[i]`.
  absl::Status StageLayer(int64_t layer, absl::Span<const int32_t> cache_blocks,
                          absl::Span<const int32_t> staging_blocks);
  // Copies every layer of staging blocks `staging_blocks[i]` into cache blocks `cache_blocks[i]`.
  absl::Status Unstage(absl::Span<const int32_t> staging_blocks, absl::Span<const int32_t> cache_blocks);

 private:
  KvHostStaging(KvCache& cache, int64_t num_blocks, HostMemory memory);
  absl::StatusOr<std::vector<BlockCopy>> Pairs(absl::Span<const int32_t> src, absl::Span<const int32_t> dst,
                                               bool src_is_staging) const;

  KvCache& cache_;
  const int64_t num_blocks_;
  HostMemory memory_;
  HostKvBlocks pools_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // a stack; lowest ids on top
  std::vector<bool> in_use_ ABSL_GUARDED_BY(mu_);
};

}  // namespace duet
