#include "kernels/attention/mixed_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention/attention_reference.h"
#include "kernels/attention/attention_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::PagedCacheFixture;

constexpr double kBf16Tolerance = 1e-2;

// A mixed step as the engine lays it out: decode sequences first (one query row each, rows
// [0, num_decode)), then prompt chunks packed after them; one q and one output buffer.
struct MixedCase {
  int num_q_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> decode_context_lens;
  std::vector<int> chunk_lens, chunk_context_lens;  // per prompt chunk: its tokens, the cache after it
  int num_sms;                                      // for the decode plan (132: splits where few CTAs)
};

// MixedAttention against the decode and prefill kernels launched one after the other: the same
// bits in every row; and both against the CPU references.
void RunAndCompare(const MixedCase& c, uint64_t seed) {
  const int num_decode = int(c.decode_context_lens.size()), num_chunks = int(c.chunk_lens.size());
  std::vector<int> context_lens = c.decode_context_lens;
  context_lens.insert(context_lens.end(), c.chunk_context_lens.begin(), c.chunk_context_lens.end());
  PagedCacheFixture cache(context_lens, c.num_kv_heads, c.head_dim, c.block_size, seed);
  std::vector<int32_t> q_start = {num_decode};  // absolute rows, as the engine's metadata holds them
  for (int len : c.chunk_lens) q_start.push_back(q_start.back() + len);
  const int rows = q_start.back();
  const size_t row_elems = size_t(c.num_q_heads) * c.head_dim;
  const std::vector<float> q = testing::RoundToBf16(testing::RandomFloats(size_t(rows) * row_elems, seed + 10));
  const float scale = 1.f / std::sqrt(float(c.head_dim));

  DeviceBuffer<__nv_bfloat16> d_q(testing::ToBf16(q));
  DeviceBuffer<__nv_bfloat16> d_k(testing::ToBf16(cache.k));
  DeviceBuffer<__nv_bfloat16> d_v(testing::ToBf16(cache.v));
  DeviceBuffer<int32_t> d_tables(cache.block_tables);
  DeviceBuffer<int32_t> d_lens(std::vector<int32_t>(context_lens.begin(), context_lens.end()));
  DeviceBuffer<int32_t> d_q_start(q_start);
  DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * row_elems);
  const PagedKvView kv{d_k.get(), d_v.get(), c.num_kv_heads, c.block_size, c.head_dim};

  const PagedDecodeAttentionPlan plan =
      PlanPagedDecodeAttention(num_decode, c.num_q_heads, c.num_kv_heads, c.head_dim,
                               *std::max_element(c.decode_context_lens.begin(), c.decode_context_lens.end()), c.num_sms);
  DeviceBuffer<float> workspace(plan.workspace_bytes / sizeof(float) + 1);
  DeviceBuffer<int32_t> split_counters(std::vector<int32_t>(size_t(plan.num_split_counters) + 1, 0));
  PagedDecodeAttentionParams decode{};
  decode.q = d_q.get();
  decode.kv = kv;
  decode.block_tables = d_tables.get();
  decode.context_lens = d_lens.get();
  decode.out = d_out.get();
  decode.num_seqs = num_decode;
  decode.num_q_heads = c.num_q_heads;
  decode.max_blocks_per_seq = cache.max_blocks_per_seq;
  decode.scale = scale;
  decode.workspace = workspace.get();
  decode.split_counters = split_counters.get();

  PrefillAttentionParams prefill{};
  prefill.q = d_q.get();
  prefill.kv = kv;
  prefill.block_tables = d_tables.get() + size_t(num_decode) * cache.max_blocks_per_seq;
  prefill.q_start = d_q_start.get();
  prefill.context_lens = d_lens.get() + num_decode;
  prefill.out = d_out.get();
  prefill.num_seqs = num_chunks;
  prefill.num_q_tokens = rows;
  prefill.max_q_len = num_chunks > 0 ? *std::max_element(c.chunk_lens.begin(), c.chunk_lens.end()) : 0;
  prefill.num_q_heads = c.num_q_heads;
  prefill.max_blocks_per_seq = cache.max_blocks_per_seq;
  prefill.scale = scale;

  d_out.Poison();
  PagedDecodeAttention(decode, plan, nullptr);
  PrefillAttention(prefill, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> apart = d_out.Download();

  // The CPU references, row by row: decode rows, then the chunks' rows.
  const std::vector<float> q_decode(q.begin(), q.begin() + ptrdiff_t(num_decode * row_elems));
  std::vector<float> ref = reference::PagedDecodeAttention(
      q_decode, cache.View(), std::vector<int32_t>(c.decode_context_lens.begin(), c.decode_context_lens.end()),
      c.num_q_heads, scale);
  if (num_chunks > 0) {
    std::vector<int32_t> chunk_starts;
    for (int32_t s : q_start) chunk_starts.push_back(s - num_decode);
    const std::vector<float> q_chunks(q.begin() + ptrdiff_t(num_decode * row_elems), q.end());
    std::vector<int32_t> tables_after(cache.block_tables.begin() + ptrdiff_t(num_decode * cache.max_blocks_per_seq),
                                      cache.block_tables.end());
    const reference::PagedKv chunk_kv{cache.k, cache.v, tables_after, c.num_kv_heads, c.head_dim, c.block_size,
                                      cache.max_blocks_per_seq};
    const std::vector<float> chunk_ref =
        reference::PrefillAttention(q_chunks, chunk_kv, chunk_starts,
                                    std::vector<int32_t>(c.chunk_context_lens.begin(), c.chunk_context_lens.end()),
                                    c.num_q_heads, scale);
    ref.insert(ref.end(), chunk_ref.begin(), chunk_ref.end());
  }
  EXPECT_LE(testing::RelativeError(testing::ToFloat(apart), ref), kBf16Tolerance) << "separate launches";

  // Twice: the decode part's split counters must be back at zero for the second launch.
  for (int launch = 0; launch < 2; ++launch) {
    d_out.Poison();
    MixedAttention(decode, plan, prefill, nullptr);
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<__nv_bfloat16> mixed = d_out.Download();
    ASSERT_EQ(mixed.size(), apart.size());
    size_t differing = 0;
    for (size_t i = 0; i < mixed.size(); ++i) {
      differing += std::memcmp(&mixed[i], &apart[i], sizeof(__nv_bfloat16)) != 0;
    }
    EXPECT_EQ(differing, 0u) << "launch " << launch << ": elements unlike the separate launches' (splits "
                             << plan.num_splits << ")";
  }
  EXPECT_EQ(split_counters.Download(), std::vector<int32_t>(size_t(plan.num_split_counters) + 1, 0));
}

// The engine's mixed step: many decode rows beside a fresh chunk and a continuing one.
TEST(MixedAttention, Bf16Gqa4DecodeRowsBesidePromptChunks) {
  DUET_SKIP_WITHOUT_GPU();
  std::vector<int> decode_lens;
  for (int s = 0; s < 40; ++s) decode_lens.push_back(1 + (s * 97) % 700);
  RunAndCompare({32, 8, 128, 16, decode_lens, {256, 100, 1}, {256, 400, 33}, 132}, 1);
}

// Few decode rows with long contexts: the decode part splits, and its merge runs in the grid.
TEST(MixedAttention, Bf16Gqa4SplitDecodeBesideChunk) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({32, 8, 128, 16, {3000, 65, 1}, {192}, {1200}, 132}, 2);
}

TEST(MixedAttention, Bf16Gqa2HeadDim64BlockSize32) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({8, 4, 64, 32, {5, 31, 2500, 777}, {70, 129}, {70, 300}, 132}, 3);
}

// No prompt chunk: the decode kernel alone.
TEST(MixedAttention, Bf16OnlyDecodeRows) {
  DUET_SKIP_WITHOUT_GPU();
  RunAndCompare({32, 8, 128, 16, {17, 600}, {}, {}, 132}, 4);
}

}  // namespace
}  // namespace duet::kernels
