#include "engine/kv/block_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/check.h"

namespace duet {

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size)
    : block_size_(block_size), ref_counts_(num_blocks, 0) {
  DUET_CHECK(num_blocks >= 0 && block_size > 0);
  free_blocks_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_blocks_.push_back(b);
}

int64_t BlockManager::Capacity(SequenceId seq) const {
  auto it = tables_.find(seq);
  return it == tables_.end() ? 0 : int64_t(it->second.blocks.size()) * block_size_;
}

int32_t BlockManager::BlocksNeeded(SequenceId seq, int64_t num_tokens,
                                   int64_t num_filled_tokens) const {
  auto it = tables_.find(seq);
  const int32_t have = it == tables_.end() ? 0 : static_cast<int32_t>(it->second.blocks.size());
  const int32_t want = BlocksForTokens(num_tokens);
  int32_t needed = want > have ? want - have : 0;
  // The block holding position num_filled_tokens gets written; if it is an existing shared
  // block, it must be copied first.
  const int32_t first_written = static_cast<int32_t>(num_filled_tokens / block_size_);
  if (first_written < have && num_tokens > num_filled_tokens &&
      ref_counts_[it->second.blocks[first_written]] > 1) {
    ++needed;
  }
  return needed;
}

absl::Status BlockManager::Reserve(SequenceId seq, int64_t num_tokens, int64_t num_filled_tokens,
                                   std::vector<BlockCopy>* copies) {
  std::vector<int32_t>& table = tables_[seq].blocks;
  const int32_t have = static_cast<int32_t>(table.size());
  const int32_t want = BlocksForTokens(num_tokens);
  const int32_t grow = want > have ? want - have : 0;
  const int32_t first_written = static_cast<int32_t>(num_filled_tokens / block_size_);
  const int32_t needed = BlocksNeeded(seq, num_tokens, num_filled_tokens);
  const bool copy_on_write = needed > grow;
  if (needed > num_free_blocks()) {
    if (table.empty()) tables_.erase(seq);
    return absl::ResourceExhaustedError(absl::StrCat("need ", needed, " KV blocks, ",
                                                     num_free_blocks(), " free"));
  }
  if (copy_on_write) {
    int32_t shared = table[first_written];
    int32_t fresh = AllocateBlock();
    ReleaseBlock(shared);
    table[first_written] = fresh;
    if (copies != nullptr) copies->push_back({shared, fresh});
  }
  for (int32_t i = 0; i < grow; ++i) table.push_back(AllocateBlock());
  return absl::OkStatus();
}

absl::Status BlockManager::Fork(SequenceId parent, SequenceId child) {
  auto it = tables_.find(parent);
  if (it == tables_.end()) return absl::NotFoundError(absl::StrCat("no sequence ", parent));
  if (tables_.count(child)) return absl::AlreadyExistsError(absl::StrCat("sequence ", child));
  SequenceBlocks blocks = it->second;
  for (int32_t b : blocks.blocks) ++ref_counts_[b];
  tables_.emplace(child, std::move(blocks));
  return absl::OkStatus();
}

void BlockManager::Free(SequenceId seq) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  // Last block first: a sequence's tail is the least likely to be asked for again, so it is
  // evicted before its prefix.
  const std::vector<int32_t>& blocks = it->second.blocks;
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) ReleaseBlock(*b);
  tables_.erase(it);
}

void BlockManager::Truncate(SequenceId seq, int64_t num_tokens) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  SequenceBlocks& s = it->second;
  // Only slots past the computed tokens are given back; a cached block is never cut.
  DUET_CHECK(num_tokens >= int64_t(s.num_committed) * block_size_);
  const size_t keep = size_t(BlocksForTokens(num_tokens));
  while (s.blocks.size() > keep) {
    ReleaseBlock(s.blocks.back());
    s.blocks.pop_back();
  }
}

const std::vector<int32_t>& BlockManager::BlockTable(SequenceId seq) const {
  static const std::vector<int32_t> kEmpty;
  auto it = tables_.find(seq);
  return it == tables_.end() ? kEmpty : it->second.blocks;
}

int32_t BlockManager::AllocateBlock() {
  int32_t b;
  if (!free_blocks_.empty()) {
    b = free_blocks_.back();
    free_blocks_.pop_back();
  } else {
    DUET_CHECK(!evictable_.empty());
    b = evictable_.front();
    Evict(b);
  }
  DUET_CHECK(ref_counts_[b] == 0);
  ref_counts_[b] = 1;
  return b;
}

void BlockManager::ReleaseBlock(int32_t block) {
  DUET_CHECK(ref_counts_[block] > 0);
  if (--ref_counts_[block] > 0) return;
  if (prefix_caching_ && cache_entries_[size_t(block)].registered) {
    cache_entries_[size_t(block)].lru = evictable_.insert(evictable_.end(), block);
  } else {
    free_blocks_.push_back(block);
  }
}

// ---- Prefix caching ----

void BlockManager::EnablePrefixCaching(KvBlockTier* lower_tier) {
  DUET_CHECK(tables_.empty());
  prefix_caching_ = true;
  lower_tier_ = lower_tier;
  cache_entries_.assign(ref_counts_.size(), CachedBlock{});
  block_tokens_.assign(ref_counts_.size() * size_t(block_size_), 0);
}

absl::Span<const int32_t> BlockManager::BlockTokens(int32_t block) const {
  return absl::MakeConstSpan(block_tokens_).subspan(size_t(block) * size_t(block_size_), size_t(block_size_));
}

void BlockManager::Register(int32_t block, BlockHash hash, absl::Span<const int32_t> tokens) {
  CachedBlock& e = cache_entries_[size_t(block)];
  DUET_CHECK(!e.registered && int64_t(tokens.size()) == block_size_);
  e.registered = true;
  e.hash = hash;
  std::copy(tokens.begin(), tokens.end(), block_tokens_.begin() + int64_t(block) * block_size_);
  cached_.emplace(hash, block);
}

void BlockManager::ResetPrefixCache() {
  for (int32_t block : evictable_) {
    CachedBlock& e = cache_entries_[size_t(block)];
    cached_.erase(e.hash);
    e.registered = false;
    free_blocks_.push_back(block);
  }
  evictable_.clear();
}

void BlockManager::Evict(int32_t block) {
  CachedBlock& e = cache_entries_[size_t(block)];
  DUET_CHECK(e.registered && ref_counts_[block] == 0);
  evictable_.erase(e.lru);
  cached_.erase(e.hash);
  if (lower_tier_ != nullptr) lower_tier_->Offload(block, e.hash, BlockTokens(block));
  e.registered = false;
  ++num_evictions_;
}

int32_t BlockManager::FindCached(BlockHash hash, absl::Span<const int32_t> tokens) const {
  auto it = cached_.find(hash);
  if (it == cached_.end()) return -1;
  return std::equal(tokens.begin(), tokens.end(), BlockTokens(it->second).begin()) ? it->second : -1;
}

int64_t BlockManager::AttachCachedPrefix(SequenceId seq, BlockHash seed, absl::Span<const int32_t> tokens,
                                         int32_t max_blocks) {
  DUET_CHECK(!HasSequence(seq));
  if (!prefix_caching_) return 0;
  SequenceBlocks s;
  s.last_hash = seed;
  const int32_t candidates = std::min<int32_t>(max_blocks, int32_t(tokens.size() / size_t(block_size_)));
  for (int32_t i = 0; i < candidates; ++i) {
    const absl::Span<const int32_t> block_tokens = tokens.subspan(size_t(i) * size_t(block_size_), size_t(block_size_));
    const BlockHash hash = HashBlock(s.last_hash, block_tokens);
    int32_t block = FindCached(hash, block_tokens);
    if (block >= 0) {
      if (ref_counts_[block]++ == 0) evictable_.erase(cache_entries_[size_t(block)].lru);
    } else if (lower_tier_ != nullptr && num_free_blocks() > 0 && lower_tier_->Hold(hash, block_tokens)) {
      block = AllocateBlock();
      Register(block, hash, block_tokens);
      lower_tier_->Load(hash, block);
    } else {
      break;
    }
    s.blocks.push_back(block);
    s.num_committed = i + 1;
    s.last_hash = hash;
  }
  const int64_t num_tokens = int64_t(s.blocks.size()) * block_size_;
  if (!s.blocks.empty()) tables_.emplace(seq, std::move(s));
  return num_tokens;
}

void BlockManager::CommitFullBlocks(SequenceId seq, BlockHash seed, int64_t num_tokens,
                                    const std::function<int32_t(int64_t)>& token_at) {
  if (!prefix_caching_) return;
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  SequenceBlocks& s = it->second;
  if (s.num_committed == 0) s.last_hash = seed;
  const int32_t full = std::min<int32_t>(int32_t(num_tokens / block_size_), int32_t(s.blocks.size()));
  std::vector<int32_t> block_tokens(static_cast<size_t>(block_size_));
  for (int32_t i = s.num_committed; i < full; ++i) {
    for (int32_t j = 0; j < block_size_; ++j) block_tokens[size_t(j)] = token_at(int64_t(i) * block_size_ + j);
    const BlockHash hash = HashBlock(s.last_hash, block_tokens);
    const int32_t block = s.blocks[size_t(i)];
    // Another sequence may have computed and registered the same tokens first: that copy stays
    // the cached one, and this block is freed as usual when released.
    if (!cache_entries_[size_t(block)].registered && cached_.count(hash) == 0) Register(block, hash, block_tokens);
    s.last_hash = hash;
    s.num_committed = i + 1;
  }
}

}  // namespace duet
