#include "kernels/elementwise/gather_rows.h"

#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/elementwise/elementwise_reference.h"
#include "kernels/graph_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::RandomFloats;
using testing::RelativeError;
using testing::RoundToBf16;
using testing::ToBf16;

// Random tokens (always including the first and the last id) gathered from a random table.
void CheckEmbedding(int rows, int vocab, int dim, uint64_t seed) {
  const std::vector<float> table = RoundToBf16(RandomFloats(size_t(vocab) * dim, seed, -1.f, 1.f));
  std::mt19937_64 rng(seed);
  std::vector<int32_t> tokens(rows);
  for (int32_t& t : tokens) t = int32_t(rng() % vocab);
  tokens[0] = vocab - 1;
  if (rows > 1) tokens[1] = 0;

  DeviceBuffer<__nv_bfloat16> d_table(ToBf16(table));
  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<float> d_residual(size_t(rows) * dim);
  d_residual.Poison();
  EmbeddingGather(d_tokens.get(), d_table.get(), d_residual.get(), rows, dim, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  // bf16 -> fp32 is exact: the rows must match bit for bit.
  EXPECT_EQ(RelativeError(d_residual.Download(), reference::EmbeddingGather(tokens, table, dim)), 0.0);
}

TEST(EmbeddingGather, Fp32Llama8bShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckEmbedding(/*rows=*/9, /*vocab=*/4096, /*dim=*/4096, 1);  // vocab cut to 4096 rows of the table
}

TEST(EmbeddingGather, Fp32TinyModelShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckEmbedding(/*rows=*/31, /*vocab=*/8192, /*dim=*/512, 2);
}

TEST(EmbeddingGather, Fp32SingleRow) {
  DUET_SKIP_WITHOUT_GPU();
  CheckEmbedding(1, 8192, 512, 3);
  CheckEmbedding(1, 1000, 4096, 4);
}

TEST(EmbeddingGather, Fp32ManyRowsPrefill) {
  DUET_SKIP_WITHOUT_GPU();
  CheckEmbedding(4099, 8192, 512, 5);
}

TEST(EmbeddingGather, Fp32GraphCaptureMatchesEager) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 3, vocab = 64, dim = 512;
  DeviceBuffer<__nv_bfloat16> d_table(ToBf16(RandomFloats(size_t(vocab) * dim, 6)));
  DeviceBuffer<int32_t> d_tokens(std::vector<int32_t>{63, 0, 17});
  DeviceBuffer<float> d_residual(size_t(rows) * dim);
  EmbeddingGather(d_tokens.get(), d_table.get(), d_residual.get(), rows, dim, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> eager = d_residual.Download();

  testing::CaptureAndReplay(
      [&](cudaStream_t stream) { EmbeddingGather(d_tokens.get(), d_table.get(), d_residual.get(), rows, dim, stream); },
      [&] { d_residual.Poison(); });
  EXPECT_EQ(d_residual.Download(), eager);
}

// Gathers `row_index` from a random [src_rows, width] matrix; a copy, so bit for bit.
void CheckGatherRows(const std::vector<int32_t>& row_index, int src_rows, int width, uint64_t seed) {
  const std::vector<__nv_bfloat16> src = ToBf16(RandomFloats(size_t(src_rows) * width, seed, -4.f, 4.f));
  DeviceBuffer<__nv_bfloat16> d_src(src);
  DeviceBuffer<int32_t> d_index(row_index);
  const int rows = int(row_index.size());
  DeviceBuffer<__nv_bfloat16> d_dst(size_t(rows) * width);
  d_dst.Poison();
  GatherRows(d_src.get(), d_index.get(), d_dst.get(), rows, width, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> got = d_dst.Download();
  for (int i = 0; i < rows; ++i) {
    EXPECT_EQ(std::memcmp(got.data() + size_t(i) * width, src.data() + size_t(row_index[size_t(i)]) * width,
                          size_t(width) * sizeof(__nv_bfloat16)),
              0)
        << "row " << i;
  }
}

TEST(GatherRows, Bf16Llama8bAttentionRows) {
  DUET_SKIP_WITHOUT_GPU();
  // A mixed step's logits rows: the decode rows, then each finished prompt's last row.
  std::vector<int32_t> rows;
  for (int i = 0; i < 64; ++i) rows.push_back(i);
  rows.push_back(383);
  CheckGatherRows(rows, /*src_rows=*/384, /*width=*/4096, 1);
}

TEST(GatherRows, Bf16UnorderedAndSingleRows) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGatherRows({16, 0, 9}, 17, 512, 2);
  CheckGatherRows({511}, 512, 4096, 3);
  CheckGatherRows({2}, 3, 8, 4);
}

TEST(GatherRows, Bf16NoRowsIsANoOp) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGatherRows({}, 4, 4096, 5);
}

}  // namespace
}  // namespace duet::kernels
