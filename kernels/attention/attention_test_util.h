// Test fixtures shared by the attention kernel tests: a random paged KV cache whose sequences own
// shuffled, non-contiguous blocks, with decoys wherever a kernel must not look.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "kernels/attention/attention_reference.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels::testing {

// One layer's paged cache (k, v: [num_blocks, num_kv_heads, block_size, head_dim], bf16-rounded
// floats) and block tables for sequences of the given context lengths. Slots past a sequence's
// end, and a decoy block that unused table entries point to, hold large K and V values, so a
// kernel that reads past the context shows a large error instead of passing by luck.
struct PagedCacheFixture {
  PagedCacheFixture(const std::vector<int>& context_lens, int num_kv_heads_in, int head_dim_in, int block_size_in,
                    uint64_t seed)
      : num_kv_heads(num_kv_heads_in), head_dim(head_dim_in), block_size(block_size_in) {
    int max_blocks = 1;
    int used_blocks = 0;
    for (int len : context_lens) {
      max_blocks = std::max(max_blocks, (len + block_size - 1) / block_size);
      used_blocks += (len + block_size - 1) / block_size;
    }
    max_blocks_per_seq = max_blocks + 1;  // one spare entry per row, pointing at the decoy
    num_blocks = used_blocks + 3;         // a little slack, then shuffled
    const size_t block_elems = size_t(num_kv_heads) * block_size * head_dim;
    k = RoundToBf16(RandomFloats(num_blocks * block_elems, seed));
    v = RoundToBf16(RandomFloats(num_blocks * block_elems, seed + 1));

    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed + 2));
    const int32_t decoy = ids.back();
    Fill(decoy, 0, block_size);
    block_tables.assign(context_lens.size() * max_blocks_per_seq, decoy);
    size_t next = 0;
    for (size_t s = 0; s < context_lens.size(); ++s) {
      const int blocks = (context_lens[s] + block_size - 1) / block_size;
      for (int b = 0; b < blocks; ++b) block_tables[s * max_blocks_per_seq + b] = ids[next++];
      if (context_lens[s] % block_size != 0) {
        Fill(block_tables[s * max_blocks_per_seq + blocks - 1], context_lens[s] % block_size, block_size);
      }
    }
  }

  reference::PagedKv View() const {
    return reference::PagedKv{k, v, block_tables, num_kv_heads, head_dim, block_size, max_blocks_per_seq};
  }

  int num_kv_heads, head_dim, block_size, max_blocks_per_seq = 0, num_blocks = 0;
  std::vector<float> k, v;
  std::vector<int32_t> block_tables;

 private:
  // Decoy values in slots [first, last) of `block` for every KV head.
  void Fill(int32_t block, int first, int last) {
    for (int h = 0; h < num_kv_heads; ++h) {
      for (int slot = first; slot < last; ++slot) {
        const size_t base = ((size_t(block) * num_kv_heads + h) * block_size + slot) * head_dim;
        std::fill(k.begin() + base, k.begin() + base + head_dim, 8.f);
        std::fill(v.begin() + base, v.begin() + base + head_dim, 100.f);
      }
    }
  }
};

}  // namespace duet::kernels::testing
