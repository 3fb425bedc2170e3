#include "kernels/attention/prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention/attention_reference.h"
#include "kernels/attention/attention_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::DeviceBuffer;
using testing::PagedCacheFixture;

constexpr double kBf16Tolerance = 1e-2;

struct PrefillCase {
  int num_q_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> q_lens;        // this step's query tokens per sequence
  std::vector<int> context_lens;  // cache tokens incl. this step's (>= q_lens)
  // Per sequence, empty or a draft tree: parents[j] < j (-1 for the root), one per query.
  std::vector<std::vector<int>> tree_parents = {};
};

// Tree masks from parents: a query sees itself and its ancestors; causal sequences get ~0.
std::vector<uint64_t> TreeMasks(const PrefillCase& c) {
  std::vector<uint64_t> masks;
  for (size_t s = 0; s < c.q_lens.size(); ++s) {
    const std::vector<int>* parents = s < c.tree_parents.size() && !c.tree_parents[s].empty() ? &c.tree_parents[s] : nullptr;
    const size_t first = masks.size();
    for (int j = 0; j < c.q_lens[s]; ++j) {
      if (parents == nullptr) {
        masks.push_back(~uint64_t{0});
      } else {
        const int parent = (*parents)[size_t(j)];
        masks.push_back((uint64_t{1} << j) | (parent < 0 ? 0 : masks[first + size_t(parent)]));
      }
    }
  }
  return masks;
}

// Runs every K/V tile variant on fresh random inputs with a poisoned output and compares each
// with the CPU reference.
void RunAndCompare(const PrefillCase& c, uint64_t seed) {
  const int num_seqs = int(c.q_lens.size());
  std::vector<int32_t> q_start(num_seqs + 1, 0);
  for (int s = 0; s < num_seqs; ++s) q_start[s + 1] = q_start[s] + c.q_lens[s];
  const int num_q_tokens = q_start[num_seqs];
  const std::vector<int32_t> context_lens(c.context_lens.begin(), c.context_lens.end());

  PagedCacheFixture cache(c.context_lens, c.num_kv_heads, c.head_dim, c.block_size, seed);
  const std::vector<float> q =
      testing::RoundToBf16(testing::RandomFloats(size_t(num_q_tokens) * c.num_q_heads * c.head_dim, seed + 10));
  const float scale = 1.f / std::sqrt(float(c.head_dim));
  const std::vector<uint64_t> masks = c.tree_parents.empty() ? std::vector<uint64_t>{} : TreeMasks(c);
  const std::vector<float> ref =
      reference::PrefillAttention(q, cache.View(), q_start, context_lens, c.num_q_heads, scale, masks);

  DeviceBuffer<__nv_bfloat16> d_q(testing::ToBf16(q));
  DeviceBuffer<__nv_bfloat16> d_k(testing::ToBf16(cache.k));
  DeviceBuffer<__nv_bfloat16> d_v(testing::ToBf16(cache.v));
  DeviceBuffer<int32_t> d_tables(cache.block_tables);
  DeviceBuffer<int32_t> d_q_start(q_start);
  DeviceBuffer<int32_t> d_lens(context_lens);
  DeviceBuffer<__nv_bfloat16> d_out(q.size());
  DeviceBuffer<uint64_t> d_masks(masks.empty() ? std::vector<uint64_t>{0} : masks);

  PrefillAttentionParams params{};
  params.q = d_q.get();
  params.kv = {d_k.get(), d_v.get(), c.num_kv_heads, c.block_size, c.head_dim};
  params.block_tables = d_tables.get();
  params.q_start = d_q_start.get();
  params.context_lens = d_lens.get();
  params.tree_masks = masks.empty() ? nullptr : d_masks.get();
  params.out = d_out.get();
  params.num_seqs = num_seqs;
  params.num_q_tokens = num_q_tokens;
  params.max_q_len = *std::max_element(c.q_lens.begin(), c.q_lens.end());
  params.num_q_heads = c.num_q_heads;
  params.max_blocks_per_seq = cache.max_blocks_per_seq;
  params.scale = scale;

  for (int key_tile : {0, 32, 64}) {  // 0: the public entry point's default
    d_out.Poison();
    if (key_tile == 0) {
      PrefillAttention(params, nullptr);
    } else {
      internal::PrefillAttentionWithKeyTile(params, key_tile, nullptr);
    }
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = testing::ToFloat(d_out.Download());
    EXPECT_LE(testing::RelativeError(out, ref), kBf16Tolerance) << "key tile " << key_tile;
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) {
        ADD_FAILURE() << "key tile " << key_tile << ": non-finite output at " << i;
        break;
      }
    }
  }
}

TEST(PrefillAttention, Bf16Gqa4SingleSequence) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({8, 2, 128, 16, {300}, {300}}, 1);
}

TEST(PrefillAttention, Bf16Gqa4VarlenBatch) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({8, 2, 128, 16, {1, 129, 64, 257, 16}, {1, 129, 64, 257, 16}}, 2);
}

// Chunked prefill: each sequence already holds a prefix; the last two are 1-token steps.
TEST(PrefillAttention, Bf16Gqa4ChunkedPrefill) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({8, 2, 128, 16, {200, 77, 1, 1, 130}, {1000, 77, 513, 2049, 161}}, 3);
}

TEST(PrefillAttention, Bf16Gqa1HeadDim64BlockSize32) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({4, 4, 64, 32, {100, 300, 33}, {100, 450, 64}}, 4);
}

TEST(PrefillAttention, Bf16Gqa8BlockSize32) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({16, 2, 128, 32, {130, 1, 31}, {130, 17, 95}}, 5);
}

TEST(PrefillAttention, Bf16Gqa8HeadDim64Chunked) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({16, 2, 64, 16, {64, 65}, {640, 129}}, 6);
}

TEST(PrefillAttention, Bf16Gqa4LongSequence) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({4, 1, 128, 16, {1100}, {1100}}, 7);
}

TEST(PrefillAttention, Bf16SingleTokenSteps) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({8, 2, 128, 16, {1, 1, 1}, {1, 16, 17}}, 8);
}

// Speculative verification: draft trees (a branching 9-token tree, a chain, a 64-token tree
// whose last nodes hang off the root) beside a causal chunk of 70 and a decode token.
TEST(PrefillAttention, Bf16TreeMasks) {
  DUET_SKIP_WITHOUT_GPU();
  std::vector<int> wide(64);
  for (int j = 0; j < 64; ++j) wide[size_t(j)] = j == 0 ? -1 : (j < 40 ? j - 1 : (j % 3 == 0 ? 0 : j - 1));
  RunAndCompare({8, 2, 128, 16,
                 {9, 5, 70, 64, 1},
                 {500, 37, 300, 1000, 77},
                 {{-1, 0, 0, 1, 1, 2, 3, 6, 0}, {-1, 0, 1, 2, 3}, {}, wide, {}}},
                9);
}

TEST(PrefillAttention, Bf16TreeMasksHeadDim64) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({8, 4, 64, 16, {9, 3}, {140, 20}, {{-1, 0, 1, 2, 0, 4, 5, 0, 7}, {-1, 0, 0}}}, 10);
}

}  // namespace
}  // namespace duet::kernels
