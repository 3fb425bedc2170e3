// SkinnyGemm against a double-precision CPU reference over the same bf16-rounded inputs, with and
// without split K, at every row-tile size, ragged shapes, graph replay and batch invariance.
#include "kernels/gemm/skinny_gemm.h"

#include <cstring>

#include <gtest/gtest.h>

#include "kernels/graph_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {


struct Problem {
  int rows, in, out;
  std::vector<float> x, w, ref;  // x [rows, in], w [out, in] (bf16-exact), ref [rows, out]
};

Problem MakeProblem(int rows, int in, int out, uint64_t seed) {
  Problem p{rows, in, out};
  p.x = testing::RoundToBf16(testing::RandomFloats(size_t(rows) * in, seed));
  p.w = testing::RoundToBf16(testing::RandomFloats(size_t(out) * in, seed + 1, -0.05f, 0.05f));
  p.ref.resize(size_t(rows) * out);
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      double acc = 0;
      for (int k = 0; k < in; ++k) acc += double(p.x[size_t(r) * in + k]) * double(p.w[size_t(o) * in + k]);
      p.ref[size_t(r) * out + o] = float(acc);
    }
  }
  return p;
}

// Runs the kernel with `plan` and returns y as floats (poisoned beforehand).
std::vector<float> RunGemm(const Problem& p, const SkinnyGemmPlan& plan, bool fp32_out) {
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(p.x)), dw(testing::ToBf16(p.w));
  if (fp32_out) {
    DeviceBuffer<float> dy(size_t(p.rows) * p.out);
    dy.Poison();
    SkinnyGemm({dx.get(), dw.get(), dy.get(), p.rows, p.in, p.out, true}, plan, nullptr);
    return dy.Download();
  }
  DeviceBuffer<__nv_bfloat16> dy(size_t(p.rows) * p.out);
  dy.Poison();
  SkinnyGemm({dx.get(), dw.get(), dy.get(), p.rows, p.in, p.out, false}, plan, nullptr);
  return testing::ToFloat(dy.Download());
}

int NumSms() {
  int n = 0;
  DUET_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0));
  return n;
}

SkinnyGemmPlan Split(int splits, int in) {
  SkinnyGemmPlan plan;
  plan.num_sms = NumSms();
  plan.splits = splits;
  plan.k_blocks_per_split = ((in + 63) / 64 + splits - 1) / splits;
  return plan;
}

void Check(int rows, int in, int out, int splits, bool fp32_out, uint64_t seed) {
  const Problem p = MakeProblem(rows, in, out, seed);
  const std::vector<float> got = RunGemm(p, Split(splits, in), fp32_out);
  EXPECT_LT(testing::RelativeError(got, p.ref), fp32_out ? 1e-5 : 1e-2)
      << rows << "x" << in << "->" << out << ", " << splits << " splits, " << (fp32_out ? "fp32" : "bf16");
}

TEST(SkinnyGemm, Bf16EveryRowTile) {
  DUET_SKIP_WITHOUT_GPU();
  for (int rows : {3, 8, 16, 17, 31, 32, 33, 48, 64}) Check(rows, 512, 768, 1, false, 10 + rows);
}

TEST(SkinnyGemm, Bf16SplitK) {
  DUET_SKIP_WITHOUT_GPU();
  for (int splits : {2, 4, 8}) {
    for (int rows : {5, 24, 64}) Check(rows, 4096, 512, splits, false, 100 + 10 * splits + rows);
  }
}

TEST(SkinnyGemm, RaggedShapes) {
  DUET_SKIP_WITHOUT_GPU();
  Check(7, 200, 130, 1, false, 200);    // K tail inside a 64-wide block, a partial feature slice
  Check(40, 1416, 77, 4, false, 201);   // fewer features than a slice, split K with a ragged last split
  Check(64, 8, 1, 1, false, 202);       // one chunk, one feature
  Check(9, 520, 129, 2, false, 203);    // odd feature count (no paired stores at row ends)
  Check(33, 520, 129, 8, true, 204);    // 9 K blocks over 8 splits of 2: the last three splits empty
}

TEST(SkinnyGemm, Fp32OutputLmHeadShape) {
  DUET_SKIP_WITHOUT_GPU();
  Check(12, 512, 8192, 1, true, 300);  // the tiny model's head
  Check(64, 512, 8192, 1, true, 301);
}

TEST(SkinnyGemm, TinyModelShapes) {
  DUET_SKIP_WITHOUT_GPU();
  const int num_sms = NumSms();
  for (const auto& [in, out] : {std::pair{512, 1024}, {512, 512}, {512, 2816}, {1408, 512}}) {
    const SkinnyGemmPlan plan = PlanSkinnyGemm(in, out, num_sms);
    for (int rows : {4, 64}) {
      const Problem p = MakeProblem(rows, in, out, 400 + rows + in + out);
      EXPECT_LT(testing::RelativeError(RunGemm(p, plan, false), p.ref), 1e-2) << in << "->" << out;
    }
  }
}

// The plan splits K the same way for every row count, and a row's sums do not involve other
// rows, so row r's output is bitwise the same in a batch of 3 and in a batch of 64.
TEST(SkinnyGemm, RowResultsDoNotDependOnTheBatch) {
  DUET_SKIP_WITHOUT_GPU();
  const Problem big = MakeProblem(64, 4096, 1024, 500);
  const SkinnyGemmPlan plan = PlanSkinnyGemm(4096, 1024, NumSms());
  ASSERT_GT(plan.splits, 1);
  const std::vector<float> all = RunGemm(big, plan, false);
  for (int rows : {3, 16, 40}) {
    Problem small = big;
    small.rows = rows;
    small.x.resize(size_t(rows) * big.in);
    const std::vector<float> part = RunGemm(small, plan, false);
    EXPECT_EQ(0, std::memcmp(part.data(), all.data(), part.size() * sizeof(float))) << rows << " rows";
  }
}

// A cluster launch captured in a graph and replayed recomputes (the poisoned output is rewritten).
TEST(SkinnyGemm, GraphReplay) {
  DUET_SKIP_WITHOUT_GPU();
  PrepareSkinnyGemm(NumSms());  // nothing but launches inside the capture
  const Problem p = MakeProblem(24, 4096, 640, 600);
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(p.x)), dw(testing::ToBf16(p.w)), dy(size_t(p.rows) * p.out);
  const SkinnyGemmPlan plan = Split(4, p.in);
  for (int round = 0; round < 2; ++round) {
    testing::CaptureAndReplay(
        [&](cudaStream_t s) {
          SkinnyGemm({dx.get(), dw.get(), dy.get(), p.rows, p.in, p.out, false}, plan, s);
        },
        [&] { dy.Poison(); });
    EXPECT_LT(testing::RelativeError(testing::ToFloat(dy.Download()), p.ref), 1e-2) << "round " << round;
  }
}

TEST(SkinnyGemm, PlanFillsTheDevice) {
  // Llama-3-8B on 132 SMs: few slices split, many do not.
  EXPECT_EQ(PlanSkinnyGemm(4096, 4096, 132).splits, 4);    // o
  EXPECT_EQ(PlanSkinnyGemm(14336, 4096, 132).splits, 4);   // down
  EXPECT_EQ(PlanSkinnyGemm(4096, 6144, 132).splits, 4);    // qkv
  EXPECT_EQ(PlanSkinnyGemm(4096, 28672, 132).splits, 1);   // gate_up
  EXPECT_EQ(PlanSkinnyGemm(4096, 128256, 132).splits, 1);  // lm_head
  EXPECT_EQ(PlanSkinnyGemm(256, 128, 132).splits, 1);      // short K is not split below 4 blocks a split
  for (int in : {8, 200, 520, 4096, 14336}) {
    for (int out : {1, 256, 4096}) {
      const SkinnyGemmPlan plan = PlanSkinnyGemm(in, out, 132);
      EXPECT_TRUE(plan.splits == 1 || plan.splits == 2 || plan.splits == 4 || plan.splits == 8);
      EXPECT_GE(plan.splits * plan.k_blocks_per_split * 64, in);
    }
  }
}

}  // namespace
}  // namespace duet::kernels
