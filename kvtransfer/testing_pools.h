// Host-memory KV pools for tests and the benchmark: owns one K and one V buffer per layer,
// filled with pseudo-random bytes (or zeros), and exposes them as KvPoolMemory.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvtransfer/kv_transport.h"
#include "kvtransfer/layer_copy_plan.h"

namespace duet::kvtransfer {

class HostKvPools {
 public:
  // seed 0 leaves the pools zeroed.
  HostKvPools(const KvLayout& layout, uint32_t num_blocks, uint64_t seed)
      : layout_(layout), num_blocks_(num_blocks) {
    const size_t pool_bytes = size_t{num_blocks} * layout.BlockBytes();
    uint64_t state = seed;
    for (uint32_t layer = 0; layer < layout.num_layers; ++layer) {
      for (auto* pools : {&key_, &value_}) {
        std::vector<uint8_t>& pool = pools->emplace_back(pool_bytes, 0);
        if (seed == 0) continue;
        for (size_t i = 0; i + 8 <= pool.size(); i += 8) {
          const uint64_t word = SplitMix64(state);
          std::memcpy(pool.data() + i, &word, 8);
        }
      }
    }
  }

  KvPoolMemory memory() {
    KvPoolMemory memory;
    memory.layout = layout_;
    memory.num_blocks = num_blocks_;
    for (uint32_t layer = 0; layer < layout_.num_layers; ++layer) {
      memory.key_pools.push_back(key_[layer].data());
      memory.value_pools.push_back(value_[layer].data());
    }
    return memory;
  }

  uint8_t* key(uint32_t layer) { return key_[layer].data(); }
  uint8_t* value(uint32_t layer) { return value_[layer].data(); }

  // The logical [heads, num_tokens, head_dim] bytes of one pool, whatever the block size.
  std::string Gather(const uint8_t* pool, std::span<const uint32_t> block_ids,
                     uint32_t num_tokens) const {
    std::string out;
    ForEachTokenRun(layout_, block_ids, num_tokens, [&](uint64_t offset, uint64_t bytes) {
      out.append(reinterpret_cast<const char*>(pool + offset), bytes);
    });
    return out;
  }

 private:
  static uint64_t SplitMix64(uint64_t& state) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  KvLayout layout_;
  uint32_t num_blocks_;
  std::vector<std::vector<uint8_t>> key_;    // [layer]
  std::vector<std::vector<uint8_t>> value_;  // [layer]
};

}  // namespace duet::kvtransfer
