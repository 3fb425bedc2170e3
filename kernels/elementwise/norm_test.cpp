#include "kernels/elementwise/norm.h"

#include <cstring>
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
using testing::ToFloat;

constexpr float kEps = 1e-5f;

// Runs FusedAddRmsNorm on fresh random inputs and checks out and the residual against the reference.
// residual_rows > rows only with row_index (the final norm over the rows that need logits).
void CheckFusedAddRmsNorm(int rows, int dim, bool with_delta, const std::vector<int32_t>* row_index = nullptr,
                          int residual_rows = 0, uint64_t seed = 1) {
  if (residual_rows == 0) residual_rows = rows;
  std::vector<float> residual = RandomFloats(size_t(residual_rows) * dim, seed, -4.f, 4.f);
  const std::vector<float> delta = RoundToBf16(RandomFloats(size_t(rows) * dim, seed + 1, -2.f, 2.f));
  const std::vector<float> weight = RoundToBf16(RandomFloats(dim, seed + 2, 0.5f, 1.5f));

  DeviceBuffer<float> d_residual(residual);
  DeviceBuffer<__nv_bfloat16> d_delta(ToBf16(delta));
  DeviceBuffer<__nv_bfloat16> d_weight(ToBf16(weight));
  DeviceBuffer<int32_t> d_row_index(row_index != nullptr ? *row_index : std::vector<int32_t>{});
  DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * dim);
  d_out.Poison();

  RmsNormParams p{};
  p.residual = d_residual.get();
  p.delta = with_delta ? d_delta.get() : nullptr;
  p.weight = d_weight.get();
  p.row_index = row_index != nullptr ? d_row_index.get() : nullptr;
  p.out = d_out.get();
  p.rows = rows;
  p.dim = dim;
  p.eps = kEps;
  FusedAddRmsNorm(p, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<float> ref_residual = residual;
  const std::vector<float> ref_out =
      reference::FusedAddRmsNorm(ref_residual, with_delta ? &delta : nullptr, weight, row_index, rows, dim, kEps);
  EXPECT_LE(RelativeError(ToFloat(d_out.Download()), ref_out), 1e-2);
  const std::vector<float> got_residual = d_residual.Download();
  EXPECT_LE(RelativeError(got_residual, ref_residual), 1e-6);
  if (!with_delta) {  // read-only: bit-for-bit unchanged
    EXPECT_EQ(std::memcmp(got_residual.data(), residual.data(), residual.size() * sizeof(float)), 0);
  }
}

TEST(FusedAddRmsNorm, Bf16Llama8bShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckFusedAddRmsNorm(/*rows=*/7, /*dim=*/4096, /*with_delta=*/true);
}

TEST(FusedAddRmsNorm, Bf16TinyModelShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckFusedAddRmsNorm(/*rows=*/33, /*dim=*/512, /*with_delta=*/true, nullptr, 0, 2);
}

TEST(FusedAddRmsNorm, Bf16SingleRow) {
  DUET_SKIP_WITHOUT_GPU();
  CheckFusedAddRmsNorm(1, 4096, true, nullptr, 0, 3);
  CheckFusedAddRmsNorm(1, 512, true, nullptr, 0, 4);
}

TEST(FusedAddRmsNorm, Bf16ManyRowsPrefill) {
  DUET_SKIP_WITHOUT_GPU();
  CheckFusedAddRmsNorm(1027, 4096, true, nullptr, 0, 5);
}

TEST(FusedAddRmsNorm, Bf16WithoutDeltaLeavesResidual) {
  DUET_SKIP_WITHOUT_GPU();
  CheckFusedAddRmsNorm(5, 4096, /*with_delta=*/false, nullptr, 0, 6);
}

TEST(FusedAddRmsNorm, Bf16OtherDims) {
  DUET_SKIP_WITHOUT_GPU();
  for (int dim : {8, 24, 520, 5120, 8192, 16384, 32768}) {
    SCOPED_TRACE(dim);
    CheckFusedAddRmsNorm(3, dim, true, nullptr, 0, 7 + dim);
  }
}

TEST(FusedAddRmsNorm, Bf16RowIndexNormalizesPickedRows) {
  DUET_SKIP_WITHOUT_GPU();
  const std::vector<int32_t> rows_needing_logits = {16, 0, 9};
  CheckFusedAddRmsNorm(3, 4096, /*with_delta=*/false, &rows_needing_logits, /*residual_rows=*/17, 8);
  const std::vector<int32_t> one_row = {4};
  CheckFusedAddRmsNorm(1, 512, false, &one_row, 5, 9);
}

TEST(FusedAddRmsNorm, Bf16RowIndexWithDeltaAddsIntoPickedRows) {
  DUET_SKIP_WITHOUT_GPU();
  // The last layer of a step with 384 rows of which 3 give logits: delta row i joins residual
  // row row_index[i]; the other residual rows stay as they were.
  const std::vector<int32_t> rows_needing_logits = {0, 1, 383};
  CheckFusedAddRmsNorm(3, 4096, /*with_delta=*/true, &rows_needing_logits, /*residual_rows=*/384, 10);
}

TEST(FusedAddRmsNorm, Bf16GraphCaptureMatchesEager) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 4, dim = 4096;
  const std::vector<float> residual = RandomFloats(size_t(rows) * dim, 10, -4.f, 4.f);
  DeviceBuffer<float> d_residual(residual);
  DeviceBuffer<__nv_bfloat16> d_delta(ToBf16(RandomFloats(size_t(rows) * dim, 11)));
  DeviceBuffer<__nv_bfloat16> d_weight(ToBf16(RandomFloats(dim, 12, 0.5f, 1.5f)));
  DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * dim);
  RmsNormParams p{d_residual.get(), d_delta.get(), d_weight.get(), nullptr, d_out.get(), rows, dim, kEps};

  FusedAddRmsNorm(p, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<__nv_bfloat16> eager = d_out.Download();

  testing::CaptureAndReplay([&](cudaStream_t stream) { FusedAddRmsNorm(p, stream); },
                            [&] {
                              d_residual.Upload(residual);
                              d_out.Poison();
                            });
  const std::vector<__nv_bfloat16> replayed = d_out.Download();
  EXPECT_EQ(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(__nv_bfloat16)), 0);
}

}  // namespace
}  // namespace duet::kernels
