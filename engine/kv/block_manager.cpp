#include "engine/kv/block_manager.h"

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
  return it == tables_.end() ? 0 : int64_t(it->second.size()) * block_size_;
}

int32_t BlockManager::BlocksNeeded(SequenceId seq, int64_t num_tokens,
                                   int64_t num_filled_tokens) const {
  auto it = tables_.find(seq);
  const int32_t have = it == tables_.end() ? 0 : static_cast<int32_t>(it->second.size());
  const int32_t want = BlocksForTokens(num_tokens);
  int32_t needed = want > have ? want - have : 0;
  // The block holding position num_filled_tokens gets written; if it is an existing shared
  // block, it must be copied first.
  const int32_t first_written = static_cast<int32_t>(num_filled_tokens / block_size_);
  if (first_written < have && num_tokens > num_filled_tokens &&
      ref_counts_[it->second[first_written]] > 1) {
    ++needed;
  }
  return needed;
}

absl::Status BlockManager::Reserve(SequenceId seq, int64_t num_tokens, int64_t num_filled_tokens,
                                   std::vector<BlockCopy>* copies) {
  std::vector<int32_t>& table = tables_[seq];
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
  std::vector<int32_t> blocks = it->second;
  for (int32_t b : blocks) ++ref_counts_[b];
  tables_.emplace(child, std::move(blocks));
  return absl::OkStatus();
}

void BlockManager::Free(SequenceId seq) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  for (int32_t b : it->second) ReleaseBlock(b);
  tables_.erase(it);
}

void BlockManager::Truncate(SequenceId seq, int64_t num_tokens) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  std::vector<int32_t>& table = it->second;
  const size_t keep = size_t(BlocksForTokens(num_tokens));
  while (table.size() > keep) {
    ReleaseBlock(table.back());
    table.pop_back();
  }
}

const std::vector<int32_t>& BlockManager::BlockTable(SequenceId seq) const {
  static const std::vector<int32_t> kEmpty;
  auto it = tables_.find(seq);
  return it == tables_.end() ? kEmpty : it->second;
}

int32_t BlockManager::AllocateBlock() {
  DUET_CHECK(!free_blocks_.empty());
  int32_t b = free_blocks_.back();
  free_blocks_.pop_back();
  DUET_CHECK(ref_counts_[b] == 0);
  ref_counts_[b] = 1;
  return b;
}

void BlockManager::ReleaseBlock(int32_t block) {
  DUET_CHECK(ref_counts_[block] > 0);
  if (--ref_counts_[block] == 0) free_blocks_.push_back(block);
}

}  // namespace duet
