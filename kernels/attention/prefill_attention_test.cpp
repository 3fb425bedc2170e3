#include "kernels/attention/prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention/attention_reference.h"
#include "kernels/attention/attention_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

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

// ---- The attention state (state_out / state_lse) and kv_lens: what ring attention builds on ----

// One contiguous cache (identity block table, as a ring-attention rank's K/V buffer) holding
// positions [begin, end) of `whole`'s sequence 0, renumbered from 0.
struct SubCache {
  SubCache(const PagedCacheFixture& whole, int begin, int end) : num_tokens(end - begin) {
    const int bs = whole.block_size, d = whole.head_dim, heads = whole.num_kv_heads;
    const int blocks = std::max(1, (num_tokens + bs - 1) / bs);
    k.assign(size_t(blocks) * heads * bs * d, 0.f);
    v.assign(k.size(), 0.f);
    for (int b = 0; b < blocks; ++b) table.push_back(b);
    for (int j = 0; j < num_tokens; ++j) {
      const int pos = begin + j;
      const int32_t src_block = whole.block_tables[size_t(pos / bs)];
      for (int h = 0; h < heads; ++h) {
        const size_t src = ((size_t(src_block) * heads + h) * bs + pos % bs) * d;
        const size_t dst = ((size_t(j / bs) * heads + h) * bs + j % bs) * d;
        std::copy_n(whole.k.begin() + src, d, k.begin() + dst);
        std::copy_n(whole.v.begin() + src, d, v.begin() + dst);
      }
    }
  }
  int num_tokens;
  std::vector<float> k, v;
  std::vector<int32_t> table;
};

struct StateCall {
  const std::vector<float>* k;
  const std::vector<float>* v;
  const std::vector<int32_t>* table;  // one row, shared by every sequence
  std::vector<int> q_lens, context_lens, kv_lens;
  bool merge;
};

// Runs the calls in order into one state over `num_q_tokens` rows of q (each call's sequences
// take its rows from 0) and returns (state_out, state_lse).
std::pair<std::vector<float>, std::vector<float>> RunState(const std::vector<float>& q, int num_q_tokens,
                                                           int num_q_heads, int num_kv_heads, int head_dim,
                                                           int block_size, const std::vector<StateCall>& calls) {
  DeviceBuffer<__nv_bfloat16> d_q(testing::ToBf16(q));
  DeviceBuffer<float> d_state(size_t(num_q_tokens) * num_q_heads * head_dim);
  DeviceBuffer<float> d_lse(size_t(num_q_tokens) * num_q_heads);
  d_state.Poison();
  d_lse.Poison();
  const float scale = 1.f / std::sqrt(float(head_dim));
  for (const StateCall& call : calls) {
    const int num_seqs = int(call.q_lens.size());
    std::vector<int32_t> q_start(num_seqs + 1, 0), tables;
    for (int s = 0; s < num_seqs; ++s) {
      q_start[s + 1] = q_start[s] + call.q_lens[s];
      tables.insert(tables.end(), call.table->begin(), call.table->end());
    }
    DeviceBuffer<__nv_bfloat16> d_k(testing::ToBf16(*call.k));
    DeviceBuffer<__nv_bfloat16> d_v(testing::ToBf16(*call.v));
    DeviceBuffer<int32_t> d_tables(tables);
    DeviceBuffer<int32_t> d_q_start(q_start);
    DeviceBuffer<int32_t> d_ctx(std::vector<int32_t>(call.context_lens.begin(), call.context_lens.end()));
    DeviceBuffer<int32_t> d_kv(std::vector<int32_t>(call.kv_lens.begin(), call.kv_lens.end()));
    PrefillAttentionParams p{};
    p.q = d_q.get();
    p.kv = {d_k.get(), d_v.get(), num_kv_heads, block_size, head_dim};
    p.block_tables = d_tables.get();
    p.q_start = d_q_start.get();
    p.context_lens = d_ctx.get();
    p.kv_lens = d_kv.get();
    p.state_out = d_state.get();
    p.state_lse = d_lse.get();
    p.merge_state = call.merge;
    p.num_seqs = num_seqs;
    p.num_q_tokens = q_start[num_seqs];
    p.max_q_len = *std::max_element(call.q_lens.begin(), call.q_lens.end());
    p.num_q_heads = num_q_heads;
    p.max_blocks_per_seq = int(call.table->size());
    p.scale = scale;
    PrefillAttention(p, nullptr);
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
  }
  return {d_state.Download(), d_lse.Download()};
}

double MaxAbsDifference(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && std::isinf(b[i]) && (a[i] < 0) == (b[i] < 0)) continue;
    worst = std::max(worst, std::isfinite(a[i]) ? std::abs(double(a[i]) - double(b[i])) : INFINITY);
  }
  return worst;
}

// kv_lens limits the keys: causal rows past the limit see only the first kv_lens keys, and with
// context_len = kv_len + q_len every row sees all of them (a ring step over a whole block).
TEST(PrefillAttention, Bf16StateWithKeyLimit) {
  DUET_SKIP_WITHOUT_GPU();
  const int heads = 8, kv_heads = 2, d = 128, bs = 16;
  const std::vector<int> q_lens = {70, 129, 1, 200};
  const std::vector<int> kv_lens = {45, 300, 17, 130};
  const std::vector<int> context_lens = {45 + 70, 300 + 129, 90, 230};  // full, full, causal past the limit, both
  PagedCacheFixture cache(kv_lens, kv_heads, d, bs, 21);
  std::vector<int32_t> q_start = {0};
  for (int n : q_lens) q_start.push_back(q_start.back() + n);
  const std::vector<float> q = testing::RoundToBf16(testing::RandomFloats(size_t(q_start.back()) * heads * d, 22));
  std::vector<float> ref_lse;
  const std::vector<float> ref = reference::PrefillAttentionState(
      q, cache.View(), q_start, std::vector<int32_t>(context_lens.begin(), context_lens.end()),
      std::vector<int32_t>(kv_lens.begin(), kv_lens.end()), heads, 1.f / std::sqrt(float(d)), ref_lse);

  DeviceBuffer<__nv_bfloat16> d_q(testing::ToBf16(q));
  DeviceBuffer<__nv_bfloat16> d_k(testing::ToBf16(cache.k));
  DeviceBuffer<__nv_bfloat16> d_v(testing::ToBf16(cache.v));
  DeviceBuffer<int32_t> d_tables(cache.block_tables);
  DeviceBuffer<int32_t> d_q_start(q_start);
  DeviceBuffer<int32_t> d_ctx(std::vector<int32_t>(context_lens.begin(), context_lens.end()));
  DeviceBuffer<int32_t> d_kv(std::vector<int32_t>(kv_lens.begin(), kv_lens.end()));
  DeviceBuffer<float> d_state(q.size());
  DeviceBuffer<float> d_lse(size_t(q_start.back()) * heads);
  d_state.Poison();
  d_lse.Poison();
  PrefillAttentionParams p{};
  p.q = d_q.get();
  p.kv = {d_k.get(), d_v.get(), kv_heads, bs, d};
  p.block_tables = d_tables.get();
  p.q_start = d_q_start.get();
  p.context_lens = d_ctx.get();
  p.kv_lens = d_kv.get();
  p.state_out = d_state.get();
  p.state_lse = d_lse.get();
  p.num_seqs = int(q_lens.size());
  p.num_q_tokens = q_start.back();
  p.max_q_len = 200;
  p.num_q_heads = heads;
  p.max_blocks_per_seq = cache.max_blocks_per_seq;
  p.scale = 1.f / std::sqrt(float(d));
  for (int key_tile : {32, 64}) {
    internal::PrefillAttentionWithKeyTile(p, key_tile, nullptr);
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LE(testing::RelativeError(d_state.Download(), ref), kBf16Tolerance) << "key tile " << key_tile;
    EXPECT_LE(MaxAbsDifference(d_lse.Download(), ref_lse), 2e-3) << "key tile " << key_tile;
  }
}

// Attention over one sequence's keys split at positions inside blocks into three contiguous
// buffers (two seen in full, the last causally), merged by the log-sum-exp rule in any order of
// the full ones, equals attention over the whole sequence.
TEST(PrefillAttention, Bf16StateMergeEqualsWholeSequence) {
  DUET_SKIP_WITHOUT_GPU();
  const int heads = 8, kv_heads = 2, d = 128, bs = 16;
  const int total = 700, cut1 = 203, cut2 = 437, q_len = total - cut2;  // queries: positions [cut2, total)
  PagedCacheFixture whole({total}, kv_heads, d, bs, 31);
  const SubCache first(whole, 0, cut1), second(whole, cut1, cut2), own(whole, cut2, total);
  const std::vector<float> q = testing::RoundToBf16(testing::RandomFloats(size_t(q_len) * heads * d, 32));
  std::vector<float> ref_lse;
  const std::vector<float> ref = reference::PrefillAttentionState(q, whole.View(), {0, q_len}, {total}, {total},
                                                                  heads, 1.f / std::sqrt(float(d)), ref_lse);
  const StateCall own_call{&own.k, &own.v, &own.table, {q_len}, {q_len}, {q_len}, false};
  const StateCall first_call{&first.k, &first.v, &first.table, {q_len}, {cut1 + q_len}, {cut1}, true};
  const StateCall second_call{&second.k, &second.v, &second.table, {q_len}, {cut2 - cut1 + q_len}, {cut2 - cut1}, true};
  for (const std::vector<StateCall>& order : {std::vector<StateCall>{own_call, first_call, second_call},
                                              std::vector<StateCall>{own_call, second_call, first_call}}) {
    const auto [state, lse] = RunState(q, q_len, heads, kv_heads, d, bs, order);
    EXPECT_LE(testing::RelativeError(state, ref), kBf16Tolerance);
    EXPECT_LE(MaxAbsDifference(lse, ref_lse), 2e-3);
  }
}

}  // namespace
}  // namespace duet::kernels
