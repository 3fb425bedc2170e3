// The KV-cache layout descriptor that travels with every transfer, and the check that decides
// whether a sender's blocks can be written into a receiver's pools.
//
// Engine layout (fixed): per layer, separate K and V pools, each a contiguous array
// [num_blocks, num_kv_heads, block_size, head_dim] of `dtype`. Block b of a pool is the byte range
// base + b * BlockBytes(); inside a block, token t of head h starts at
// (h * block_size + t) * head_dim * element_size.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace duet::kvtransfer {

enum class KvDtype : uint8_t { kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

size_t DtypeSize(KvDtype dtype);
std::string_view DtypeName(KvDtype dtype);

struct KvLayout {
  uint32_t num_layers = 0;
  uint32_t block_size = 0;  // tokens per block
  uint32_t num_kv_heads = 0;
  uint32_t head_dim = 0;
  KvDtype dtype = KvDtype::kFloat32;

  size_t ElementSize() const { return DtypeSize(dtype); }
  // Bytes of one token of one head: head_dim elements.
  size_t TokenHeadBytes() const { return size_t{head_dim} * ElementSize(); }
  // Bytes of one block of one pool (K or V) of one layer.
  size_t BlockBytes() const { return size_t{num_kv_heads} * block_size * TokenHeadBytes(); }

  absl::Status Validate() const;
  std::string DebugString() const;

  // Fixed 24-byte wire form: version, dims, dtype and element size (so a peer with an unknown
  // dtype enum still fails cleanly instead of misreading sizes).
  std::string Serialize() const;
  static absl::StatusOr<KvLayout> Deserialize(std::string_view bytes);

  bool operator==(const KvLayout&) const = default;
};

// How a sender's layer is copied into a receiver's layer.
enum class LayoutMatch {
  kSameShape,    // identical layouts: whole blocks are copied (and coalesced)
  kReblock,      // only the block size differs: copied per (head, token run)
};

// Decides whether `sender`'s KV can be written into `receiver`'s pools. Layer count, head count,
// head_dim and dtype must be equal (a different head count means a tensor-parallel re-shard,
// which is not implemented); block sizes may differ.
absl::StatusOr<LayoutMatch> CheckCompatible(const KvLayout& sender, const KvLayout& receiver);

}  // namespace duet::kvtransfer
