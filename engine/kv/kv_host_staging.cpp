#include "engine/kv/kv_host_staging.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace duet {

absl::StatusOr<std::unique_ptr<KvHostStaging>> KvHostStaging::Create(KvCache& cache, int64_t num_blocks) {
  if (num_blocks <= 0) return absl::InvalidArgumentError("KV staging needs at least one block");
  const KvCacheShape& shape = cache.shape();
  const size_t bytes = size_t(num_blocks) * size_t(shape.bytes_per_block());
  absl::StatusOr<HostMemory> memory = cache.AllocateHostStaging(bytes);
  if (!memory.ok()) return memory.status();
  return std::unique_ptr<KvHostStaging>(new KvHostStaging(cache, num_blocks, *std::move(memory)));
}

KvHostStaging::KvHostStaging(KvCache& cache, int64_t num_blocks, HostMemory memory)
    : cache_(cache), num_blocks_(num_blocks), memory_(std::move(memory)) {
  pools_ = LayOutHostKvBlocks(cache.shape(), num_blocks, memory_.get());
  absl::MutexLock lock(&mu_);
  in_use_.assign(size_t(num_blocks), false);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));
}

int64_t KvHostStaging::num_free_blocks() const {
  absl::MutexLock lock(&mu_);
  return int64_t(free_.size());
}

absl::StatusOr<std::vector<int32_t>> KvHostStaging::Allocate(int64_t count) {
  absl::MutexLock lock(&mu_);
  if (count < 0 || count > int64_t(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("KV staging has ", free_.size(), " of ", num_blocks_,
                                                     " host blocks free; ", count, " are needed"));
  }
  std::vector<int32_t> blocks(free_.end() - count, free_.end());
  free_.resize(free_.size() - size_t(count));
  // Popped from the top: ascending ids, so consecutive blocks coalesce into one copy.
  std::reverse(blocks.begin(), blocks.end());
  for (int32_t b : blocks) in_use_[size_t(b)] = true;
  return blocks;
}

void KvHostStaging::Free(absl::Span<const int32_t> blocks) {
  absl::MutexLock lock(&mu_);
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    DUET_CHECK(*it >= 0 && *it < num_blocks_ && in_use_[size_t(*it)]);
    in_use_[size_t(*it)] = false;
    free_.push_back(*it);
  }
}

absl::StatusOr<std::vector<BlockCopy>> KvHostStaging::Pairs(absl::Span<const int32_t> src,
                                                            absl::Span<const int32_t> dst,
                                                            bool src_is_staging) const {
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat("staging copy of ", src.size(), " blocks into ", dst.size()));
  }
  std::vector<BlockCopy> copies;
  copies.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    const int32_t staging = src_is_staging ? src[i] : dst[i];
    if (staging < 0 || staging >= num_blocks_) {
      return absl::OutOfRangeError(absl::StrCat("staging block ", staging, " is outside [0, ", num_blocks_, ")"));
    }
    copies.push_back({src[i], dst[i]});
  }
  return copies;
}

absl::Status KvHostStaging::StageLayer(int64_t layer, absl::Span<const int32_t> cache_blocks,
                                       absl::Span<const int32_t> staging_blocks) {
  absl::StatusOr<std::vector<BlockCopy>> copies = Pairs(cache_blocks, staging_blocks, /*src_is_staging=*/false);
  if (!copies.ok()) return copies.status();
  return cache_.CopyBlocksToHost(layer, 1, *copies, pools_);
}

absl::Status KvHostStaging::Unstage(absl::Span<const int32_t> staging_blocks, absl::Span<const int32_t> cache_blocks) {
  absl::StatusOr<std::vector<BlockCopy>> copies = Pairs(staging_blocks, cache_blocks, /*src_is_staging=*/true);
  if (!copies.ok()) return copies.status();
  return cache_.CopyBlocksFromHost(0, cache_.shape().num_layers, *copies, pools_);
}

}  // namespace duet
