// The host tier of the prefix cache: blocks the device cache evicts are copied into host memory
// (page-locked for a device cache) and copied back when a later request's prefix finds them
// there (like SGLang's HiCache and vLLM's CPU offloading). The CPU backend has the same tier in
// plain memory, so both tiers are tested without a GPU.
//
// Slots have the cache's block layout and dtype: per layer a K and a V pool
// [num_slots, num_kv_heads, block_size, head_dim], least recently used evicted first. The block
// manager calls Offload / Hold / Load while it schedules; Flush runs the copies, tier-bound first
// (they read device blocks that loads may overwrite), in one batch before the step. Engine
// thread only.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv/block_manager.h"
#include "engine/kv/kv_cache.h"

namespace duet {

struct HostKvTierStats {
  int64_t offloaded_blocks = 0;  // copies into the tier
  int64_t loaded_blocks = 0;     // hits: copies back into the device cache
  int64_t evicted_blocks = 0;    // slots reused for other blocks
};

class HostKvTier : public KvBlockTier {
 public:
  // A tier of `bytes` (whole blocks of `cache`'s shape; at least one). `cache` must outlive it.
  static absl::StatusOr<std::unique_ptr<HostKvTier>> Create(KvCache& cache, int64_t bytes);

  void Offload(int32_t block, BlockHash hash, absl::Span<const int32_t> tokens) override;
  bool Hold(BlockHash hash, absl::Span<const int32_t> tokens) override;
  void Load(BlockHash hash, int32_t block) override;
  // Issues the copies asked for since the last Flush (evictions to the host first, then hits
  // back), ordered before the cache's later work (KvCache::EnqueueHostCopies); held slots
  // become evictable again. kOrdered returns at once: the next step's work on the cache runs
  // after the copies (on a device cache the GPU orders them, so the step's launch does not wait).
  // kWait returns once the bytes are in place, for a writer the cache's order does not cover (a
  // prefill worker writing into a reservation).
  enum class FlushMode { kOrdered, kWait };
  absl::Status Flush(FlushMode mode);
  bool HasPendingCopies() const { return !to_host_.empty() || !to_device_.empty(); }
  // Forgets every block the tier holds. No copy may be pending.
  void Clear();

  int64_t num_slots() const { return int64_t(slots_.size()); }
  int64_t num_used_slots() const { return int64_t(by_hash_.size()); }
  const HostKvTierStats& stats() const { return stats_; }

 private:
  struct Slot {
    bool used = false;
    bool held = false;  // a load from it is pending
    BlockHash hash = 0;
    std::list<int32_t>::iterator lru;
  };

  HostKvTier(KvCache& cache, int64_t num_slots, HostMemory memory);
  // The used slot of `hash` holding `tokens`, or -1.
  int32_t Find(BlockHash hash, absl::Span<const int32_t> tokens) const;
  // A slot for a new block: a free one, else the least recently used one not held; -1 if none.
  int32_t TakeSlot();
  void Touch(int32_t slot);

  KvCache& cache_;
  const int64_t block_size_;
  HostMemory memory_;
  HostKvBlocks pools_;
  std::vector<Slot> slots_;
  std::vector<int32_t> slot_tokens_;  // [num_slots * block_size]
  std::vector<int32_t> free_slots_;
  std::list<int32_t> lru_;            // used slots, least recently used first
  absl::flat_hash_map<BlockHash, int32_t> by_hash_;
  std::vector<BlockCopy> to_host_;    // device block -> slot
  std::vector<BlockCopy> to_device_;  // slot -> device block
  std::vector<int32_t> held_;
  HostKvTierStats stats_;
};

}  // namespace duet
