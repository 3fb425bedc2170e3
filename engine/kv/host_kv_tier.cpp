#include "engine/kv/host_kv_tier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace duet {

absl::StatusOr<std::unique_ptr<HostKvTier>> HostKvTier::Create(KvCache& cache, int64_t bytes) {
  const int64_t block_bytes = cache.shape().bytes_per_block();
  const int64_t num_slots = block_bytes > 0 ? bytes / block_bytes : 0;
  if (num_slots <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("a host KV tier of ", bytes, " bytes holds no block of ",
                                                   block_bytes, " bytes"));
  }
  absl::StatusOr<HostMemory> memory = cache.AllocateHostStaging(size_t(num_slots) * size_t(block_bytes));
  if (!memory.ok()) return memory.status();
  return std::unique_ptr<HostKvTier>(new HostKvTier(cache, num_slots, *std::move(memory)));
}

HostKvTier::HostKvTier(KvCache& cache, int64_t num_slots, HostMemory memory)
    : cache_(cache), block_size_(cache.shape().block_size), memory_(std::move(memory)) {
  pools_ = LayOutHostKvBlocks(cache.shape(), num_slots, memory_.get());
  slots_.resize(size_t(num_slots));
  slot_tokens_.assign(size_t(num_slots * block_size_), 0);
  for (int64_t s = num_slots - 1; s >= 0; --s) free_slots_.push_back(int32_t(s));
}

int32_t HostKvTier::Find(BlockHash hash, absl::Span<const int32_t> tokens) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return -1;
  const int32_t slot = it->second;
  return std::equal(tokens.begin(), tokens.end(), slot_tokens_.begin() + int64_t(slot) * block_size_) ? slot : -1;
}

void HostKvTier::Clear() {
  DUET_CHECK(!HasPendingCopies());
  for (int32_t slot : lru_) {
    slots_[size_t(slot)] = Slot{};
    free_slots_.push_back(slot);
  }
  lru_.clear();
  by_hash_.clear();
}

void HostKvTier::Touch(int32_t slot) { lru_.splice(lru_.end(), lru_, slots_[size_t(slot)].lru); }

int32_t HostKvTier::TakeSlot() {
  if (!free_slots_.empty()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    Slot& s = slots_[size_t(*it)];
    if (s.held) continue;
    const int32_t slot = *it;
    lru_.erase(it);
    by_hash_.erase(s.hash);
    s.used = false;
    ++stats_.evicted_blocks;
    return slot;
  }
  return -1;  // every slot is held by a pending load: this block is not kept
}

void HostKvTier::Offload(int32_t block, BlockHash hash, absl::Span<const int32_t> tokens) {
  DUET_CHECK(int64_t(tokens.size()) == block_size_);
  if (const int32_t have = Find(hash, tokens); have >= 0) {  // e.g. a block loaded from here
    Touch(have);
    return;
  }
  if (by_hash_.count(hash)) return;  // a colliding block holds the hash: keep that one
  const int32_t slot = TakeSlot();
  if (slot < 0) return;
  Slot& s = slots_[size_t(slot)];
  s.used = true;
  s.hash = hash;
  s.lru = lru_.insert(lru_.end(), slot);
  std::copy(tokens.begin(), tokens.end(), slot_tokens_.begin() + int64_t(slot) * block_size_);
  by_hash_.emplace(hash, slot);
  to_host_.push_back({block, slot});
  ++stats_.offloaded_blocks;
}

bool HostKvTier::Hold(BlockHash hash, absl::Span<const int32_t> tokens) {
  const int32_t slot = Find(hash, tokens);
  if (slot < 0) return false;
  if (!slots_[size_t(slot)].held) held_.push_back(slot);
  slots_[size_t(slot)].held = true;
  return true;
}

void HostKvTier::Load(BlockHash hash, int32_t block) {
  auto it = by_hash_.find(hash);
  DUET_CHECK(it != by_hash_.end() && slots_[size_t(it->second)].held);
  Touch(it->second);
  to_device_.push_back({it->second, block});
  ++stats_.loaded_blocks;
}

absl::Status HostKvTier::Flush(FlushMode mode) {
  absl::Status status = cache_.EnqueueHostCopies(to_host_, to_device_, pools_);
  if (status.ok() && mode == FlushMode::kWait) status = cache_.WaitForHostCopies();
  if (!status.ok()) {  // the slots being filled hold nothing usable
    for (const BlockCopy& c : to_host_) {
      Slot& s = slots_[size_t(c.dst)];
      if (!s.used || s.held) continue;
      lru_.erase(s.lru);
      by_hash_.erase(s.hash);
      s.used = false;
      free_slots_.push_back(c.dst);
    }
  }
  to_host_.clear();
  to_device_.clear();
  for (int32_t slot : held_) slots_[size_t(slot)].held = false;
  held_.clear();
  return status;
}

}  // namespace duet
