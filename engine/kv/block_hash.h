// Content hashes of full KV blocks, for prefix caching and prefix-aware routing.
//
// A block's hash chains its parent's: hash(block i) = H(hash(block i-1), tokens of block i), and
// block 0's parent is a seed that folds in everything else that changes the KV (the model, a
// per-request cache salt). Equal hashes therefore name equal prefixes with overwhelming
// probability; the block manager still compares token ids on a hit, so a collision can cost a
// cache miss but never hand out the wrong KV. The function is fixed (no per-process seed), so
// the router and every worker compute the same hashes for the same tokens.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/types/span.h"

namespace duet {

using BlockHash = uint64_t;

// The parent of a sequence's first block: `model` names the weights (two models never share
// KV), `cache_salt` is the request's (empty: shared with every unsalted request).
BlockHash PrefixSeed(std::string_view model, std::string_view cache_salt);

// The hash of a full block of `tokens` whose predecessor hashes to `parent`.
BlockHash HashBlock(BlockHash parent, absl::Span<const int32_t> tokens);

// Hashes of the full blocks of `tokens` (a trailing partial block has none), in order.
std::vector<BlockHash> FullBlockHashes(BlockHash seed, absl::Span<const int32_t> tokens, int64_t block_size);

}  // namespace duet
