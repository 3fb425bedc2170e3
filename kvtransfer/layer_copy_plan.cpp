#include "kvtransfer/layer_copy_plan.h"

#include <xxhash.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "common/check.h"
#include "common/status_macros.h"

namespace duet::kvtransfer {
namespace {

uint64_t BlocksFor(uint32_t num_tokens, uint32_t block_size) {
  return (uint64_t{num_tokens} + block_size - 1) / block_size;
}

// Byte offset, within a pool, of token `token` of head `head`.
uint64_t TokenOffset(const KvLayout& layout, std::span<const uint32_t> block_ids, uint32_t head,
                     uint32_t token) {
  const uint64_t block = block_ids[token / layout.block_size];
  const uint64_t slot = token % layout.block_size;
  return block * layout.BlockBytes() +
         (uint64_t{head} * layout.block_size + slot) * layout.TokenHeadBytes();
}

void AppendMerged(std::vector<CopyRange>& ranges, CopyRange next) {
  if (!ranges.empty()) {
    CopyRange& last = ranges.back();
    if (last.src_offset + last.bytes == next.src_offset &&
        last.dst_offset + last.bytes == next.dst_offset) {
      last.bytes += next.bytes;
      return;
    }
  }
  ranges.push_back(next);
}

}  // namespace

absl::Status ValidateBlockIds(const KvLayout& layout, std::span<const uint32_t> block_ids,
                              uint32_t num_tokens, uint32_t pool_num_blocks, const char* side) {
  if (num_tokens == 0) return absl::InvalidArgumentError("a layer transfer needs num_tokens > 0");
  const uint64_t needed = BlocksFor(num_tokens, layout.block_size);
  if (block_ids.size() != needed) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s block list has %d ids but %u tokens at block size %u need %d", side, block_ids.size(),
        num_tokens, layout.block_size, needed));
  }
  for (uint32_t id : block_ids) {
    if (id >= pool_num_blocks) {
      return absl::OutOfRangeError(absl::StrFormat("%s block id %u is outside the pool of %u blocks",
                                                   side, id, pool_num_blocks));
    }
  }
  // Two token ranges written into one block would silently overwrite each other.
  std::vector<uint32_t> sorted(block_ids.begin(), block_ids.end());
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s block id %u appears more than once", side, *dup));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CopyRange>> PlanLayerCopy(const KvLayout& src_layout,
                                                     std::span<const uint32_t> src_block_ids,
                                                     const KvLayout& dst_layout,
                                                     std::span<const uint32_t> dst_block_ids,
                                                     uint32_t num_tokens) {
  DUET_ASSIGN_OR_RETURN(LayoutMatch match, CheckCompatible(src_layout, dst_layout));
  DUET_CHECK(src_block_ids.size() == BlocksFor(num_tokens, src_layout.block_size));
  DUET_CHECK(dst_block_ids.size() == BlocksFor(num_tokens, dst_layout.block_size));

  std::vector<CopyRange> ranges;
  if (match == LayoutMatch::kSameShape) {
    const uint64_t block_bytes = src_layout.BlockBytes();
    for (size_t i = 0; i < src_block_ids.size(); ++i) {
      AppendMerged(ranges, {src_block_ids[i] * block_bytes, dst_block_ids[i] * block_bytes,
                            block_bytes});
    }
    return ranges;
  }

  // Re-blocking: walk each head's tokens, cutting a run wherever either side changes block.
  const uint64_t token_bytes = src_layout.TokenHeadBytes();
  for (uint32_t head = 0; head < src_layout.num_kv_heads; ++head) {
    uint32_t token = 0;
    while (token < num_tokens) {
      const uint32_t src_left = src_layout.block_size - token % src_layout.block_size;
      const uint32_t dst_left = dst_layout.block_size - token % dst_layout.block_size;
      const uint32_t run = std::min({src_left, dst_left, num_tokens - token});
      AppendMerged(ranges, {TokenOffset(src_layout, src_block_ids, head, token),
                            TokenOffset(dst_layout, dst_block_ids, head, token),
                            run * token_bytes});
      token += run;
    }
  }
  return ranges;
}

void ForEachTokenRun(const KvLayout& layout, std::span<const uint32_t> block_ids,
                     uint32_t num_tokens, absl::FunctionRef<void(uint64_t, uint64_t)> visit) {
  DUET_CHECK(block_ids.size() >= BlocksFor(num_tokens, layout.block_size));
  for (uint32_t head = 0; head < layout.num_kv_heads; ++head) {
    for (uint32_t token = 0; token < num_tokens; token += layout.block_size) {
      const uint32_t run = std::min(layout.block_size, num_tokens - token);
      visit(TokenOffset(layout, block_ids, head, token), run * layout.TokenHeadBytes());
    }
  }
}

uint64_t HashLayerTokens(const KvLayout& layout, const void* pool_base,
                         std::span<const uint32_t> block_ids, uint32_t num_tokens) {
  XXH3_state_t* state = XXH3_createState();
  DUET_CHECK(state != nullptr);
  XXH3_64bits_reset(state);
  const auto* base = static_cast<const uint8_t*>(pool_base);
  ForEachTokenRun(layout, block_ids, num_tokens, [&](uint64_t offset, uint64_t bytes) {
    XXH3_64bits_update(state, base + offset, bytes);
  });
  const uint64_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return hash;
}

}  // namespace duet::kvtransfer
