// KV-cache storage for the CPU backend.
//
// Per layer, separate K and V pools, each laid out [num_blocks, num_kv_heads, block_size, head_dim]
// (float32), so one head's keys in a block are contiguous. Token t of a sequence lives in
// block table[t / block_size] at slot t % block_size. BlockManager decides which blocks a
// sequence owns; this class only holds the bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/block_manager.h"

namespace duet {

struct KvCacheShape {
  int64_t num_layers = 0;
  int64_t num_blocks = 0;
  int64_t num_kv_heads = 0;
  int64_t block_size = 0;
  int64_t head_dim = 0;

  int64_t block_elems() const { return num_kv_heads * block_size * head_dim; }
  // Bytes of K plus V for one block across all layers.
  int64_t bytes_per_block() const { return 2 * num_layers * block_elems() * int64_t(sizeof(float)); }
};

class KvCache {
 public:
  explicit KvCache(const KvCacheShape& shape);

  const KvCacheShape& shape() const { return shape_; }
  float* keys(int64_t layer) { return keys_[layer].data(); }
  float* values(int64_t layer) { return values_[layer].data(); }
  const float* keys(int64_t layer) const { return keys_[layer].data(); }
  const float* values(int64_t layer) const { return values_[layer].data(); }

  // Address of (block, head, slot) within a layer's K or V pool.
  int64_t Offset(int64_t block, int64_t head, int64_t slot) const {
    return ((block * shape_.num_kv_heads + head) * shape_.block_size + slot) * shape_.head_dim;
  }
  // Copies whole blocks in every layer (copy-on-write).
  void CopyBlocks(const std::vector<BlockCopy>& copies);

 private:
  KvCacheShape shape_;
  std::vector<std::vector<float>> keys_;    // [num_layers][num_blocks * block_elems]
  std::vector<std::vector<float>> values_;  // same
};

}  // namespace duet
