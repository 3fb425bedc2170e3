// The router's approximate map of the prefixes each worker holds in its KV cache, for
// prefix-aware assignment (prefix_aware_policy.h).
//
// It is fed by the router's own routing history, not by events from the workers: a worker is
// taken to hold the full blocks of every prompt the router sent it (a prefill worker), or of
// every prompt and the output it streamed back (a decode worker: the next chat turn's prompt
// extends the previous turn's prompt and answer), least recently used first out once the
// worker's KV blocks are full. We chose this over workers reporting stored and evicted blocks
// because it needs no new RPC or event stream, works with any worker (one without a prefix cache
// too: the prediction is then wrong, never harmful), and its error is bounded: a worker caches at
// most its KV capacity, and the index remembers at most that per worker. It is wrong where a
// worker evicted blocks early (running requests took the memory) or restarted (a worker that goes
// down is forgotten). Blocks are named by the chained content hashes of engine/kv/block_hash.h,
// so a hash names its whole prefix and the longest cached prefix is a walk along the prompt's
// hashes.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/kv/block_hash.h"

namespace duet::router {

class Worker;

// The chain hashes of one token sequence's full blocks, computed once per block size asked for
// (the workers of a cluster usually share one). The tokens are the caller's and must outlive it.
// Not thread-safe: one request's placement runs one step at a time.
class BlockHashChain {
 public:
  BlockHashChain(BlockHash seed, absl::Span<const int32_t> tokens) : seed_(seed), tokens_(tokens) {}
  absl::Span<const BlockHash> ForBlockSize(int64_t block_size);  // block_size > 0
  BlockHash seed() const { return seed_; }

 private:
  BlockHash seed_;
  absl::Span<const int32_t> tokens_;
  std::vector<std::pair<int64_t, std::vector<BlockHash>>> by_block_size_;
};

struct PrefixIndexOptions {
  // Blocks remembered per worker at most, whatever KV capacity it reports (about 70 bytes each).
  int64_t max_blocks_per_worker = int64_t{1} << 20;
};

class PrefixIndex {
 public:
  explicit PrefixIndex(PrefixIndexOptions options = {}) : options_(options) {}

  // How many leading blocks of `chain` (a sequence's block hashes, in order) `worker` holds.
  int64_t Match(const Worker* worker, absl::Span<const BlockHash> chain) const;
  // Records that `worker` now holds `chain`, as its most recently used blocks, the chain's first
  // block the most recent of all (so a block is never older than its parent and eviction takes a
  // chain from its end), then forgets the least recently used blocks beyond `capacity_blocks`
  // (the worker's KV blocks; clamped to [0, max_blocks_per_worker]). Returns what Match returned
  // just before.
  int64_t Insert(const Worker* worker, absl::Span<const BlockHash> chain, int64_t capacity_blocks);
  // Forgets every worker that is not in `workers` (gone, or down: a restarted worker's cache is
  // empty).
  void RetainOnly(absl::Span<Worker* const> workers);
  void Remove(const Worker* worker);
  int64_t NumBlocks(const Worker* worker) const;

 private:
  // One worker's blocks, most recently used first.
  struct WorkerBlocks {
    std::list<BlockHash> lru;
    absl::flat_hash_map<BlockHash, std::list<BlockHash>::iterator> where;
  };
  static int64_t MatchLocked(const WorkerBlocks& blocks, absl::Span<const BlockHash> chain);

  const PrefixIndexOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<const Worker*, std::unique_ptr<WorkerBlocks>> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace duet::router
