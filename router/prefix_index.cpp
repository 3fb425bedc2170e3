#include "router/prefix_index.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "common/check.h"

namespace duet::router {

absl::Span<const BlockHash> BlockHashChain::ForBlockSize(int64_t block_size) {
  DUET_CHECK(block_size > 0);
  for (const auto& [size, hashes] : by_block_size_) {
    if (size == block_size) return hashes;
  }
  by_block_size_.emplace_back(block_size, FullBlockHashes(seed_, tokens_, block_size));
  return by_block_size_.back().second;
}

int64_t PrefixIndex::MatchLocked(const WorkerBlocks& blocks, absl::Span<const BlockHash> chain) {
  int64_t matched = 0;
  while (matched < int64_t(chain.size()) && blocks.where.contains(chain[size_t(matched)])) ++matched;
  return matched;
}

int64_t PrefixIndex::Match(const Worker* worker, absl::Span<const BlockHash> chain) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : MatchLocked(*it->second, chain);
}

int64_t PrefixIndex::Insert(const Worker* worker, absl::Span<const BlockHash> chain, int64_t capacity_blocks) {
  const size_t capacity = size_t(std::clamp<int64_t>(capacity_blocks, 0, options_.max_blocks_per_worker));
  absl::MutexLock lock(&mu_);
  std::unique_ptr<WorkerBlocks>& slot = workers_[worker];
  if (slot == nullptr) slot = std::make_unique<WorkerBlocks>();
  WorkerBlocks& blocks = *slot;
  const int64_t matched = MatchLocked(blocks, chain);
  // From the chain's end to its start, each to the front: the first block ends up most recent.
  for (auto hash = chain.rbegin(); hash != chain.rend(); ++hash) {
    auto [it, inserted] = blocks.where.try_emplace(*hash);
    if (inserted) {
      blocks.lru.push_front(*hash);
    } else {
      blocks.lru.splice(blocks.lru.begin(), blocks.lru, it->second);
    }
    it->second = blocks.lru.begin();
  }
  while (blocks.lru.size() > capacity) {
    blocks.where.erase(blocks.lru.back());
    blocks.lru.pop_back();
  }
  return matched;
}

void PrefixIndex::RetainOnly(absl::Span<Worker* const> workers) {
  const absl::flat_hash_set<const Worker*> keep(workers.begin(), workers.end());
  absl::MutexLock lock(&mu_);
  absl::erase_if(workers_, [&keep](const auto& entry) { return !keep.contains(entry.first); });
}

void PrefixIndex::Remove(const Worker* worker) {
  absl::MutexLock lock(&mu_);
  workers_.erase(worker);
}

int64_t PrefixIndex::NumBlocks(const Worker* worker) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : int64_t(it->second->lru.size());
}

}  // namespace duet::router
