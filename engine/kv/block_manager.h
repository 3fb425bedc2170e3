// Paged KV-cache bookkeeping: which physical blocks each sequence owns.
//
// Blocks are reference counted so sequences can share a prefix (Fork); appending into a shared
// last block copies it first (copy-on-write) and reports the copy for the executor to perform.
// The manager owns no KV memory itself — see kv_cache.h for the storage.
//
// Prefix caching (EnablePrefixCaching): a full block whose tokens a sequence has computed is
// registered under its chain hash (block_hash.h, CommitFullBlocks). When its last sequence
// leaves it stays cached, evictable least recently used first, and a new sequence that begins
// with the same tokens shares it (AttachCachedPrefix) instead of computing it again. Token ids
// are compared on every hit, so a hash collision costs a miss, never wrong KV. A cached block is
// never written again: only full blocks are cached, and a sequence writes only at or after its
// first partially filled block. With a lower tier (host memory, host_kv_tier.h), evicted blocks
// are kept there and brought back on a hit.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/kv/block_hash.h"

namespace duet {

using SequenceId = uint64_t;

// A block to copy before the step runs: dst becomes a private copy of src.
struct BlockCopy {
  int32_t src = -1;
  int32_t dst = -1;
};

// A cache tier below the device blocks (host memory). Calls come from the block manager as it
// evicts and matches; the copies they ask for happen later, in one batch before the next step
// (HostKvTier::Flush), device-to-tier copies first.
class KvBlockTier {
 public:
  virtual ~KvBlockTier() = default;
  // Device block `block`, cached under `hash` with `tokens`, is about to be reused: keep a copy.
  virtual void Offload(int32_t block, BlockHash hash, absl::Span<const int32_t> tokens) = 0;
  // Whether the tier holds `hash` with these tokens. If so it keeps it until the copies run, and
  // Load may follow.
  virtual bool Hold(BlockHash hash, absl::Span<const int32_t> tokens) = 0;
  // Copies held `hash` into device block `block`.
  virtual void Load(BlockHash hash, int32_t block) = 0;
};

class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size);

  int32_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  // Blocks a reservation may take: never used, or cached with no sequence (evicted on demand).
  int32_t num_free_blocks() const { return static_cast<int32_t>(free_blocks_.size() + evictable_.size()); }
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
  // Drops `seq`'s references; blocks reaching zero return to the free list (or, cached, to the
  // evictable ones).
  void Free(SequenceId seq);
  // Drops the blocks of `seq` beyond those `num_tokens` tokens need (speculative slots that the
  // accepted tokens did not fill); never below its cached blocks.
  void Truncate(SequenceId seq, int64_t num_tokens);

  // Physical block ids of `seq`, in logical order. Empty for an unknown sequence.
  const std::vector<int32_t>& BlockTable(SequenceId seq) const;
  int32_t RefCount(int32_t block) const { return ref_counts_[block]; }

  // ---- Prefix caching ----
  // Turns caching on; `lower_tier` (optional, must outlive the manager) keeps evicted blocks.
  void EnablePrefixCaching(KvBlockTier* lower_tier = nullptr);
  bool prefix_caching() const { return prefix_caching_; }
  // Starts `seq`, which must hold no blocks, with the cached blocks that begin `tokens` (at most
  // `max_blocks` of them), chained from `seed`; returns the tokens they hold (0 with caching
  // off). Blocks found only in the lower tier are taken as fresh device blocks and loaded.
  int64_t AttachCachedPrefix(SequenceId seq, BlockHash seed, absl::Span<const int32_t> tokens, int32_t max_blocks);
  // Registers the full blocks among the first `num_tokens` of `seq`, whose K/V are written and
  // whose ids `token_at(position)` gives, as cached under the chain from `seed`. Blocks already
  // registered are skipped. A no-op with caching off.
  void CommitFullBlocks(SequenceId seq, BlockHash seed, int64_t num_tokens,
                        const std::function<int32_t(int64_t)>& token_at);
  // Forgets every cached block no sequence holds (vLLM's reset_prefix_cache): they become plain
  // free blocks. Blocks sequences hold stay registered.
  void ResetPrefixCache();
  // Blocks registered in the cache (held by sequences or evictable), and evictions so far.
  int32_t num_cached_blocks() const { return static_cast<int32_t>(cached_.size()); }
  int64_t num_evictions() const { return num_evictions_; }

 private:
  struct SequenceBlocks {
    std::vector<int32_t> blocks;
    int32_t num_committed = 0;  // leading blocks registered (or found) in the cache
    BlockHash last_hash = 0;    // the chain hash of block num_committed - 1
  };
  // Per physical block with caching on: its hash and tokens while it is registered.
  struct CachedBlock {
    bool registered = false;
    BlockHash hash = 0;
    std::list<int32_t>::iterator lru;  // in evictable_, while unreferenced
  };

  int32_t AllocateBlock();
  void ReleaseBlock(int32_t block);
  // Unregisters a cached block (it is about to hold other tokens), offloading it to the tier.
  void Evict(int32_t block);
  void Register(int32_t block, BlockHash hash, absl::Span<const int32_t> tokens);
  absl::Span<const int32_t> BlockTokens(int32_t block) const;
  // The registered block of `hash` whose tokens equal `tokens`, or -1.
  int32_t FindCached(BlockHash hash, absl::Span<const int32_t> tokens) const;

  int32_t block_size_;
  std::vector<int32_t> ref_counts_;
  std::vector<int32_t> free_blocks_;  // used as a stack: recently freed blocks are reused first
  std::unordered_map<SequenceId, SequenceBlocks> tables_;

  bool prefix_caching_ = false;
  KvBlockTier* lower_tier_ = nullptr;
  std::vector<CachedBlock> cache_entries_;     // [num_blocks] with caching on
  std::vector<int32_t> block_tokens_;          // [num_blocks * block_size] with caching on
  absl::flat_hash_map<BlockHash, int32_t> cached_;
  std::list<int32_t> evictable_;               // unreferenced cached blocks, least recently used first
  int64_t num_evictions_ = 0;
};

}  // namespace duet
