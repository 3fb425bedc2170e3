#include "kernels/elementwise/activation.h"

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

void CheckSiluAndMul(int rows, int inter, uint64_t seed, float range = 4.f) {
  const std::vector<float> in = RoundToBf16(RandomFloats(size_t(rows) * 2 * inter, seed, -range, range));
  DeviceBuffer<__nv_bfloat16> d_in(ToBf16(in));
  DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * inter);
  d_out.Poison();
  SiluAndMul(d_in.get(), d_out.get(), rows, inter, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_LE(RelativeError(ToFloat(d_out.Download()), reference::SiluAndMul(in, rows, inter)), 1e-2);
}

TEST(SiluAndMul, Bf16Llama8bShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckSiluAndMul(/*rows=*/5, /*inter=*/14336, 1);
}

TEST(SiluAndMul, Bf16TinyModelShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckSiluAndMul(/*rows=*/33, /*inter=*/1408, 2);
}

TEST(SiluAndMul, Bf16SingleRow) {
  DUET_SKIP_WITHOUT_GPU();
  CheckSiluAndMul(1, 14336, 3);
  CheckSiluAndMul(1, 8, 4);
}

TEST(SiluAndMul, Bf16ManyRowsPrefill) {
  DUET_SKIP_WITHOUT_GPU();
  CheckSiluAndMul(2049, 1408, 5);
}

TEST(SiluAndMul, Bf16SaturatedGates) {
  DUET_SKIP_WITHOUT_GPU();
  CheckSiluAndMul(3, 1408, 6, /*range=*/60.f);  // silu(-60) = -0, silu(60) = 60
}

TEST(SiluAndMul, Bf16GraphCaptureMatchesEager) {
  DUET_SKIP_WITHOUT_GPU();
  const int rows = 3, inter = 1408;
  DeviceBuffer<__nv_bfloat16> d_in(ToBf16(RandomFloats(size_t(rows) * 2 * inter, 7)));
  DeviceBuffer<__nv_bfloat16> d_out(size_t(rows) * inter);
  SiluAndMul(d_in.get(), d_out.get(), rows, inter, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> eager = ToFloat(d_out.Download());

  testing::CaptureAndReplay([&](cudaStream_t stream) { SiluAndMul(d_in.get(), d_out.get(), rows, inter, stream); },
                            [&] { d_out.Poison(); });
  EXPECT_EQ(ToFloat(d_out.Download()), eager);
}

}  // namespace
}  // namespace duet::kernels
