// Paged KV-cache bookkeeping: which physical blocks each sequence owns.
//
// Blocks are reference counted so sequences can share a prefix (Fork); appending into a shared
// last block copies it first (copy-on-write) and reports the copy for the executor to perform.
// The manager owns no KV memory itself — see kv_cache.h for the storage.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace duet {

using SequenceId = uint64_t;

// A block to copy before the step runs: dst becomes a private copy of src.
struct BlockCopy {
  int32_t src = -1;
  int32_t dst = -1;
};

class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_blocks_.size()); }
  int32_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  double usage() const { return num_blocks() == 0 ? 0.0 : double(num_used_blocks()) / num_blocks(); }
  int32_t BlocksForTokens(int64_t num_tokens) const {
    return static_cast<int32_t>((num_tokens + block_size_ - 1) / block_size_);
  }

  bool HasSequence(SequenceId seq) const { return tables_.count(seq) != 0; }
  // Capacity of `seq` in tokens (its blocks × block size); 0 for an unknown sequence.
  int64_t Capacity(SequenceId seq) const;
  // Free blocks needed before `seq` can hold `num_tokens` tokens when its first
  // `num_filled_tokens` are already written, counting a copy-on-write of a shared block.
  int32_t BlocksNeeded(SequenceId seq, int64_t num_tokens, int64_t num_filled_tokens) const;

  // Grows (or creates) `seq` so it can hold `num_tokens` tokens, of which the first
  // `num_filled_tokens` are already written. If the partially filled block about to be written
  // is shared, it is copied first and the copy is appended to `copies`. ResourceExhausted (and
  // no change) when there are not enough free blocks.
  absl::Status Reserve(SequenceId seq, int64_t num_tokens, int64_t num_filled_tokens,
                       std::vector<BlockCopy>* copies);

  // `child` shares all of `parent`'s blocks (reference counts go up).
  absl::Status Fork(SequenceId parent, SequenceId child);
  // Drops `seq`'s references; blocks reaching zero return to the free list.
  void Free(SequenceId seq);
  // Drops the blocks of `seq` beyond those `num_tokens` tokens need (speculative slots that the
  // accepted tokens did not fill).
  void Truncate(SequenceId seq, int64_t num_tokens);

  // Physical block ids of `seq`, in logical order. Empty for an unknown sequence.
  const std::vector<int32_t>& BlockTable(SequenceId seq) const;
  int32_t RefCount(int32_t block) const { return ref_counts_[block]; }

 private:
  int32_t AllocateBlock();
  void ReleaseBlock(int32_t block);

  int32_t block_size_;
  std::vector<int32_t> ref_counts_;
  std::vector<int32_t> free_blocks_;  // used as a stack: recently freed blocks are reused first
  std::unordered_map<SequenceId, std::vector<int32_t>> tables_;
};

}  // namespace duet
