// Which bytes of a sender's layer pool go where in a receiver's layer pool, and a checksum of
// a layer's tokens that does not depend on how they are blocked.
//
// A request's tokens 0..num_tokens-1 live in a list of block ids (token t in block
// ids[t / block_size], slot t % block_size). The same plan serves the K and the V pool of a
// layer; offsets are relative to that pool's base address.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtransfer/kv_layout.h"

namespace duet::kvtransfer {

struct CopyRange {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
  bool operator==(const CopyRange&) const = default;
};

// Checks that `block_ids` holds exactly the blocks `num_tokens` tokens need, each id distinct
// and below `pool_num_blocks`. `side` names the side in the error ("source", "destination").
absl::Status ValidateBlockIds(const KvLayout& layout, std::span<const uint32_t> block_ids,
                              uint32_t num_tokens, uint32_t pool_num_blocks, const char* side);

// The copies that move `num_tokens` tokens of one layer. Same-shape layouts copy whole blocks,
// merging runs of consecutive block ids into one range; layouts that differ only in block size
// copy one range per (head, token run that crosses no block boundary on either side), merged
// where both sides happen to be contiguous. Block ids must already be validated.
absl::StatusOr<std::vector<CopyRange>> PlanLayerCopy(const KvLayout& src_layout,
                                                     std::span<const uint32_t> src_block_ids,
                                                     const KvLayout& dst_layout,
                                                     std::span<const uint32_t> dst_block_ids,
                                                     uint32_t num_tokens);

// Calls `visit(offset, bytes)` for every maximal (head, token run within one block) of the first
// `num_tokens` tokens, head-major then token order: the canonical order of the logical
// [num_kv_heads, num_tokens, head_dim] tensor, whatever the block size.
void ForEachTokenRun(const KvLayout& layout, std::span<const uint32_t> block_ids,
                     uint32_t num_tokens, absl::FunctionRef<void(uint64_t, uint64_t)> visit);

// 64-bit xxHash (XXH3) of a layer pool's first `num_tokens` tokens in canonical order. Equal on
// both sides of a transfer iff the logical tensors are equal, even across block sizes.
uint64_t HashLayerTokens(const KvLayout& layout, const void* pool_base,
                         std::span<const uint32_t> block_ids, uint32_t num_tokens);

}  // namespace duet::kvtransfer
