// Gemv against a double-precision CPU reference over the same bf16-rounded inputs.
#include "kernels/gemv.h"

#include <gtest/gtest.h>

#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {

using testing::DeviceBuffer;

void CheckGemv(int rows, int in, int out, bool fp32_out, uint64_t seed) {
  const std::vector<float> x = testing::RoundToBf16(testing::RandomFloats(size_t(rows) * in, seed));
  const std::vector<float> w = testing::RoundToBf16(testing::RandomFloats(size_t(out) * in, seed + 1, -0.05f, 0.05f));
  std::vector<float> ref(size_t(rows) * out);
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      double acc = 0;
      for (int k = 0; k < in; ++k) acc += double(x[size_t(r) * in + k]) * double(w[size_t(o) * in + k]);
      ref[size_t(r) * out + o] = float(acc);
    }
  }
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(x)), dw(testing::ToBf16(w));
  std::vector<float> got;
  if (fp32_out) {
    DeviceBuffer<float> dy(size_t(rows) * out);
    dy.Poison();
    Gemv({dx.get(), dw.get(), dy.get(), rows, in, out, true}, nullptr);
    got = dy.Download();
    EXPECT_LT(testing::RelativeError(got, ref), 1e-5) << rows << "x" << in << "->" << out;
  } else {
    DeviceBuffer<__nv_bfloat16> dy(size_t(rows) * out);
    dy.Poison();
    Gemv({dx.get(), dw.get(), dy.get(), rows, in, out, false}, nullptr);
    got = testing::ToFloat(dy.Download());
    EXPECT_LT(testing::RelativeError(got, ref), 1e-2) << rows << "x" << in << "->" << out;
  }
}

TEST(Gemv, Bf16Llama8bShapes) {
  DUET_SKIP_WITHOUT_GPU();
  for (int rows : {1, 3, 8}) {
    CheckGemv(rows, 4096, 6144, false, 10 + rows);   // qkv
    CheckGemv(rows, 14336, 4096, false, 20 + rows);  // down
  }
}

TEST(Gemv, Bf16TinyModelShapesAndOddSizes) {
  DUET_SKIP_WITHOUT_GPU();
  for (int rows = 1; rows <= kGemvMaxRows; ++rows) CheckGemv(rows, 512, 2816, false, 30 + rows);
  CheckGemv(2, 8, 3, false, 41);        // one chunk, fewer features than a block
  CheckGemv(5, 1416, 77, false, 42);    // a tail of chunks past the unrolled loop
}

TEST(Gemv, Fp32OutputLmHeadShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckGemv(1, 4096, 128256, true, 50);
  CheckGemv(4, 512, 8192, true, 51);
}

}  // namespace
}  // namespace duet::kernels
