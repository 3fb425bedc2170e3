#include "kernels/attention/paged_attention.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/attention/attention_reference.h"
#include "kernels/attention/attention_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::PagedCacheFixture;

constexpr double kBf16Tolerance = 1e-2;

struct DecodeCase {
  int num_q_heads, num_kv_heads, head_dim, block_size;
  std::vector<int> context_lens;
  int planned_max_context;  // the plan may cover more than this batch uses (CUDA graph reuse)
  int num_sms;              // 1 forces a single split for any batch of >= 2 CTAs
};

// Runs the kernel on fresh random inputs with a poisoned output and compares with the CPU
// reference; returns the plan it used.
PagedDecodeAttentionPlan RunAndCompare(const DecodeCase& c, uint64_t seed) {
  const int num_seqs = int(c.context_lens.size());
  PagedCacheFixture cache(c.context_lens, c.num_kv_heads, c.head_dim, c.block_size, seed);
  const std::vector<float> q =
      testing::RoundToBf16(testing::RandomFloats(size_t(num_seqs) * c.num_q_heads * c.head_dim, seed + 10));
  const float scale = 1.f / std::sqrt(float(c.head_dim));

  DeviceBuffer<__nv_bfloat16> d_q(testing::ToBf16(q));
  DeviceBuffer<__nv_bfloat16> d_k(testing::ToBf16(cache.k));
  DeviceBuffer<__nv_bfloat16> d_v(testing::ToBf16(cache.v));
  DeviceBuffer<int32_t> d_tables(cache.block_tables);
  DeviceBuffer<int32_t> d_lens(std::vector<int32_t>(c.context_lens.begin(), c.context_lens.end()));
  DeviceBuffer<__nv_bfloat16> d_out(q.size());
  d_out.Poison();

  const PagedDecodeAttentionPlan plan = PlanPagedDecodeAttention(num_seqs, c.num_q_heads, c.num_kv_heads, c.head_dim,
                                                                 c.planned_max_context, c.num_sms);
  DeviceBuffer<float> workspace(plan.workspace_bytes / sizeof(float) + 1);
  workspace.Poison();
  DeviceBuffer<int32_t> split_counters(std::vector<int32_t>(size_t(plan.num_split_counters) + 1, 0));

  PagedDecodeAttentionParams params{};
  params.q = d_q.get();
  params.kv = {d_k.get(), d_v.get(), c.num_kv_heads, c.block_size, c.head_dim};
  params.block_tables = d_tables.get();
  params.context_lens = d_lens.get();
  params.out = d_out.get();
  params.num_seqs = num_seqs;
  params.num_q_heads = c.num_q_heads;
  params.max_blocks_per_seq = cache.max_blocks_per_seq;
  params.scale = scale;
  params.workspace = plan.num_splits > 1 ? workspace.get() : nullptr;
  params.split_counters = plan.num_splits > 1 ? split_counters.get() : nullptr;
  const std::vector<float> ref = reference::PagedDecodeAttention(
      q, cache.View(), std::vector<int32_t>(c.context_lens.begin(), c.context_lens.end()), c.num_q_heads, scale);
  // Twice: the split merge's counters must be back at zero for the second launch.
  for (int launch = 0; launch < 2; ++launch) {
    d_out.Poison();
    PagedDecodeAttention(params, plan, nullptr);
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = testing::ToFloat(d_out.Download());
    EXPECT_LE(testing::RelativeError(out, ref), kBf16Tolerance)
        << "launch " << launch << " splits " << plan.num_splits << " tokens/split " << plan.tokens_per_split;
    for (size_t i = 0; i < out.size(); ++i) {
      if (!std::isfinite(out[i])) {
        ADD_FAILURE() << "launch " << launch << ": non-finite output at " << i;
        break;
      }
    }
  }
  EXPECT_EQ(split_counters.Download(), std::vector<int32_t>(size_t(plan.num_split_counters) + 1, 0));
  return plan;
}

TEST(PagedDecodeAttention, Bf16Gqa4NoSplit) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 8, 128, 16, {1, 15, 16, 17, 31, 32, 33, 200, 1000, 3000}, 3000, 1};
  EXPECT_EQ(RunAndCompare(c, 1).num_splits, 1);
}

TEST(PagedDecodeAttention, Bf16Gqa4Split) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 8, 128, 16, {1, 15, 16, 17, 63, 64, 65, 1000, 3000}, 3000, 132};
  EXPECT_GT(RunAndCompare(c, 2).num_splits, 1);
}

TEST(PagedDecodeAttention, Bf16Gqa1HeadDim64Split) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{8, 8, 64, 32, {1, 31, 32, 33, 2500}, 2500, 132};
  EXPECT_GT(RunAndCompare(c, 3).num_splits, 1);
}

TEST(PagedDecodeAttention, Bf16Gqa8BlockSize32NoSplit) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 4, 128, 32, {5, 31, 32, 33, 777, 2049}, 2049, 1};
  EXPECT_EQ(RunAndCompare(c, 4).num_splits, 1);
}

TEST(PagedDecodeAttention, Bf16Gqa8HeadDim64Split) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{16, 2, 64, 16, {2, 17, 4000}, 4000, 132};
  EXPECT_GT(RunAndCompare(c, 5).num_splits, 1);
}

TEST(PagedDecodeAttention, Bf16Gqa32SpansTwoHeadTiles) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 1, 128, 16, {1, 100, 1500}, 1500, 132};
  RunAndCompare(c, 6);
}

TEST(PagedDecodeAttention, Bf16BlockSize8) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 8, 128, 8, {1, 7, 8, 9, 1234}, 1234, 132};
  RunAndCompare(c, 7);
}

TEST(PagedDecodeAttention, Bf16BlockSize128) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 8, 128, 128, {1, 127, 128, 129, 1500}, 1500, 1};
  RunAndCompare(c, 8);
}

// A plan made for a longer maximum context (as for a captured CUDA graph) serves shorter
// contexts, including an empty padding sequence, with and without splits.
TEST(PagedDecodeAttention, Bf16PlanCoversShorterContexts) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase split{32, 8, 128, 16, {0, 1, 65, 700, 4096}, 8192, 132};
  EXPECT_GT(RunAndCompare(split, 9).num_splits, 2);
  const DecodeCase single{32, 8, 128, 16, {0, 1, 65, 700, 4096}, 8192, 1};
  EXPECT_EQ(RunAndCompare(single, 10).num_splits, 1);
}

TEST(PagedDecodeAttention, Bf16LongContextSplit) {
  DUET_SKIP_WITHOUT_GPU();
  const DecodeCase c{32, 8, 128, 16, {20000}, 32768, 132};
  EXPECT_GT(RunAndCompare(c, 11).num_splits, 8);
}

}  // namespace
}  // namespace duet::kernels
