// WideGemm against a double-precision CPU reference over the same bf16-rounded inputs: every row
// tile, split K, ragged shapes, the fused SiLU·mul epilogue, graph replay, and the plan.
#include "kernels/gemm/wide_gemm.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "kernels/graph_test_util.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {


struct Problem {
  int rows, in, out;
  bool silu_mul;
  std::vector<float> x, w, ref;  // x [rows, in], w [out, in] (bf16-exact), ref [rows, out or out / 2]
};

Problem MakeProblem(int rows, int in, int out, bool silu_mul, uint64_t seed) {
  Problem p{rows, in, out, silu_mul};
  p.x = testing::RoundToBf16(testing::RandomFloats(size_t(rows) * in, seed));
  p.w = testing::RoundToBf16(testing::RandomFloats(size_t(out) * in, seed + 1, -0.05f, 0.05f));
  std::vector<double> full(size_t(rows) * out);
  for (int r = 0; r < rows; ++r) {
    for (int o = 0; o < out; ++o) {
      double acc = 0;
      for (int k = 0; k < in; ++k) acc += double(p.x[size_t(r) * in + k]) * double(p.w[size_t(o) * in + k]);
      full[size_t(r) * out + o] = acc;
    }
  }
  if (!silu_mul) {
    p.ref.assign(full.begin(), full.end());
    return p;
  }
  const int inter = out / 2;
  p.ref.resize(size_t(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    for (int f = 0; f < inter; ++f) {
      const double gate = full[size_t(r) * out + f], up = full[size_t(r) * out + inter + f];
      p.ref[size_t(r) * inter + f] = float(gate / (1 + std::exp(-gate)) * up);
    }
  }
  return p;
}

WideGemmPlan Plan(const Problem& p, int splits = 0) {
  WideGemmPlan plan = PlanWideGemm(p.rows, p.in, p.out, p.silu_mul, QueryWideGemmCapacity());
  if (splits > 0) {
    plan.splits = splits;
    plan.k_blocks_per_split = ((p.in + 63) / 64 + splits - 1) / splits;
  }
  return plan;
}

// Runs the kernel and returns y as floats (poisoned beforehand).
std::vector<float> Run(const Problem& p, const WideGemmPlan& plan) {
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(p.x)), dw(testing::ToBf16(p.w)), dy(p.ref.size());
  dy.Poison();
  WideGemm({dx.get(), dw.get(), dy.get(), p.rows, p.in, p.out, p.silu_mul}, plan, nullptr);
  return testing::ToFloat(dy.Download());
}

// Where a result is wrong: the first few outputs off by more than 5% of the output's RMS, so a
// failure names the rows and features (tile, box, warpgroup) it lies in.
std::string FirstMismatches(const std::vector<float>& got, const std::vector<float>& ref, int width) {
  double sum_squares = 0;
  for (float v : ref) sum_squares += double(v) * v;
  const double tolerance = 0.05 * std::sqrt(sum_squares / std::max<size_t>(ref.size(), 1));
  std::string out;
  int shown = 0;
  for (size_t i = 0; i < ref.size() && shown < 8; ++i) {
    if (std::fabs(double(got[i]) - ref[i]) > tolerance || std::isnan(got[i])) {
      out += " (row " + std::to_string(i / width) + ", feature " + std::to_string(i % width) + ": " +
             std::to_string(got[i]) + " vs " + std::to_string(ref[i]) + ")";
      ++shown;
    }
  }
  return out;
}

void Check(int rows, int in, int out, bool silu_mul, int splits, uint64_t seed) {
  const Problem p = MakeProblem(rows, in, out, silu_mul, seed);
  const WideGemmPlan plan = Plan(p, splits);
  const std::vector<float> got = Run(p, plan);
  const double error = testing::RelativeError(got, p.ref);
  EXPECT_LT(error, 1e-2) << rows << "x" << in << "->" << out << (silu_mul ? " silu_mul" : "") << ", row tile "
                         << plan.row_tile << ", " << plan.splits << " splits; first mismatches:"
                         << FirstMismatches(got, p.ref, silu_mul ? out / 2 : out);
}

// From the simplest launch up (one tile and one K block; then K blocks past the pipeline's depth,
// so stages are reused; then several tiles), so the first failure says which part is wrong.
TEST(WideGemm, Bf16OneTileOneKBlock) {
  DUET_SKIP_WITHOUT_GPU();
  Check(64, 64, 256, false, 1, 1);
}

TEST(WideGemm, Bf16OneTileManyKBlocks) {
  DUET_SKIP_WITHOUT_GPU();
  Check(64, 640, 256, false, 1, 2);  // 10 K blocks through 5 stages: each stage used twice
}

TEST(WideGemm, Bf16SeveralTiles) {
  DUET_SKIP_WITHOUT_GPU();
  Check(128, 512, 512, false, 1, 3);  // 2 feature tiles, one 128-row tile
  Check(256, 512, 256, false, 1, 4);  // 2 row tiles of 128
}

TEST(WideGemm, Bf16EveryRowTile) {
  DUET_SKIP_WITHOUT_GPU();
  // Row tiles 64, 96, 128, 160, 192, then several tiles of 128 and 160.
  for (int rows : {1, 64, 65, 100, 160, 192, 193, 320, 577}) Check(rows, 512, 768, false, 0, 10 + rows);
}

TEST(WideGemm, Bf16SplitK) {
  DUET_SKIP_WITHOUT_GPU();
  for (int splits : {1, 2, 4}) {
    for (int rows : {70, 320}) Check(rows, 4096, 512, false, splits, 100 + 10 * splits + rows);
  }
}

TEST(WideGemm, RaggedShapes) {
  DUET_SKIP_WITHOUT_GPU();
  Check(7, 200, 130, false, 0, 200);     // K tail inside a 64-wide block, a partial feature tile
  Check(150, 1416, 77, false, 4, 201);   // fewer features than a box, split K with a ragged last split
  Check(64, 8, 1, false, 0, 202);        // one 16-byte chunk of K, one feature
  Check(200, 520, 129, false, 2, 203);   // odd feature count: rows of y not 8-byte aligned
  Check(33, 520, 300, false, 4, 204);    // 9 K blocks over 4 splits of 3: the last split empty
}

TEST(WideGemm, Bf16SiluMul) {
  DUET_SKIP_WITHOUT_GPU();
  Check(50, 512, 2 * 512, true, 0, 300);
  Check(320, 1024, 2 * 384, true, 0, 301);   // a tile of 128 gate + 128 up rows, three of them
  Check(100, 1024, 2 * 200, true, 2, 302);   // inter not a multiple of 128, split K
  Check(193, 520, 2 * 130, true, 4, 303);
}

// A cluster launch captured in a graph and replayed recomputes (the poisoned output is rewritten).
TEST(WideGemm, GraphReplay) {
  DUET_SKIP_WITHOUT_GPU();
  PrepareWideGemm();  // nothing but launches inside the capture
  const Problem p = MakeProblem(160, 4096, 640, false, 600);
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(p.x)), dw(testing::ToBf16(p.w)), dy(p.ref.size());
  const WideGemmPlan plan = Plan(p, 4);
  for (int round = 0; round < 2; ++round) {
    testing::CaptureAndReplay(
        [&](cudaStream_t s) { WideGemm({dx.get(), dw.get(), dy.get(), p.rows, p.in, p.out, false}, plan, s); },
        [&] { dy.Poison(); });
    EXPECT_LT(testing::RelativeError(testing::ToFloat(dy.Download()), p.ref), 1e-2) << "round " << round;
  }
}

TEST(WideGemm, PlanTilesRowsEvenlyAndFillsTheDevice) {
  // Llama-3-8B at 320 rows (a 256-token chunk beside 64 decode rows) on 132 SMs: two 160-row
  // tiles; the narrow projections split K.
  const WideGemmCapacity h200 = WideGemmCapacityOfSms(132);
  const WideGemmPlan o = PlanWideGemm(320, 4096, 4096, false, h200);
  EXPECT_EQ(o.row_tile, 160);
  EXPECT_EQ(o.row_tiles, 2);
  EXPECT_EQ(o.feature_tiles, 16);
  EXPECT_EQ(o.splits, 4);
  EXPECT_EQ(PlanWideGemm(320, 14336, 4096, false, h200).splits, 4);  // down
  EXPECT_EQ(PlanWideGemm(320, 4096, 6144, false, h200).splits, 2);   // qkv: 48 tiles
  const WideGemmPlan gate_up = PlanWideGemm(320, 4096, 28672, true, h200);  // with SiLU·mul
  EXPECT_EQ(gate_up.feature_tiles, 112);
  EXPECT_EQ(gate_up.splits, 1);  // 224 tiles: splitting would gain under a tenth
  // Where clusters of 4 fit on fewer SMs (a GPC's leftover SMs hold none), o's 128 CTAs at split 4
  // would take two waves: split 2 (64 CTAs) is cheaper.
  EXPECT_EQ(PlanWideGemm(320, 4096, 4096, false, WideGemmCapacity{{132, 132, 120}}).splits, 2);
  EXPECT_EQ(PlanWideGemm(576, 4096, 4096, false, h200).row_tile, 192);
  EXPECT_EQ(PlanWideGemm(1024, 4096, 4096, false, h200).row_tiles, 6);
  for (int rows : {1, 63, 64, 65, 191, 192, 193, 320, 1000, 4096}) {
    for (int in : {8, 520, 4096, 14336}) {
      for (int out : {2, 300, 4096, 28672}) {
        for (bool silu_mul : {false, true}) {
          const WideGemmPlan plan = PlanWideGemm(rows, in, out, silu_mul, h200);
          EXPECT_TRUE(plan.row_tile >= 64 && plan.row_tile <= kWideGemmMaxRowTile && plan.row_tile % 32 == 0);
          EXPECT_GE(plan.row_tile * plan.row_tiles, rows);
          EXPECT_LT(plan.row_tile * (plan.row_tiles - 1), rows);
          EXPECT_TRUE(plan.splits == 1 || plan.splits == 2 || plan.splits == 4);
          EXPECT_GE(plan.splits * plan.k_blocks_per_split * 64, in);
        }
      }
    }
  }
}

}  // namespace
}  // namespace duet::kernels
