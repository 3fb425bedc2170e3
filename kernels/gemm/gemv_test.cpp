// Gemv against a double-precision CPU reference over the same bf16-rounded inputs.
#include "kernels/gemm/gemv.h"

#include <gtest/gtest.h>

#include "kernels/elementwise/rope.h"
#include "kernels/kernel_test_util.h"

namespace duet::kernels {
namespace {


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

// The gate/up projection with the SiLU·mul epilogue: y = silu(bf16(gate)) * bf16(up).
void CheckGemvSiluMul(int rows, int in, int inter, uint64_t seed) {
  const int out = 2 * inter;
  const std::vector<float> x = testing::RoundToBf16(testing::RandomFloats(size_t(rows) * in, seed));
  const std::vector<float> w = testing::RoundToBf16(testing::RandomFloats(size_t(out) * in, seed + 1, -0.05f, 0.05f));
  auto projection = [&](int r, int o) {
    double acc = 0;
    for (int k = 0; k < in; ++k) acc += double(x[size_t(r) * in + k]) * double(w[size_t(o) * in + k]);
    return double(__bfloat162float(__float2bfloat16(float(acc))));
  };
  std::vector<float> ref(size_t(rows) * inter);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < inter; ++j) {
      const double gate = projection(r, j), up = projection(r, inter + j);
      ref[size_t(r) * inter + j] = float(gate / (1.0 + std::exp(-gate)) * up);
    }
  }
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(x)), dw(testing::ToBf16(w));
  DeviceBuffer<__nv_bfloat16> dy(size_t(rows) * inter);
  dy.Poison();
  Gemv({dx.get(), dw.get(), dy.get(), rows, in, out, false, GemvEpilogue::kSiluMul}, nullptr);
  EXPECT_LT(testing::RelativeError(testing::ToFloat(dy.Download()), ref), 1e-2) << rows << "x" << in << "->" << inter;
}

TEST(Gemv, SiluMulEpilogue) {
  DUET_SKIP_WITHOUT_GPU();
  for (int rows : {1, 2, 5}) CheckGemvSiluMul(rows, 4096, 14336, 60 + rows);  // Llama-3-8B gate_up
  CheckGemvSiluMul(1, 512, 1408, 70);                                          // tiny model
  CheckGemvSiluMul(2, 1416, 4, 71);                                            // one CTA, a chunk tail
}

// The QKV projection with the RoPE + KV-write epilogue against the unfused pair (Gemv, then
// RopeAndWriteKv) on the same inputs: q, and both whole caches (random beforehand, so rows
// that must stay untouched are checked too). Row 1 is a padding row (slot -1) when present.
void CheckGemvRope(int rows, int in, int num_q_heads, int num_kv_heads, int head_dim, uint64_t seed) {
  const int out = (num_q_heads + 2 * num_kv_heads) * head_dim, block_size = 16, num_blocks = 4, max_pos = 4096;
  const std::vector<float> x = testing::RoundToBf16(testing::RandomFloats(size_t(rows) * in, seed));
  const std::vector<float> w = testing::RoundToBf16(testing::RandomFloats(size_t(out) * in, seed + 1, -0.05f, 0.05f));
  std::vector<float> inv_freq(size_t(head_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(500000.f, -2.f * float(i) / float(head_dim));
  const std::vector<int32_t> positions = {3000, 17}, slots = {37, -1};
  const size_t cache_elems = size_t(num_blocks) * num_kv_heads * block_size * head_dim;
  const std::vector<__nv_bfloat16> cache_init = testing::ToBf16(testing::RandomFloats(cache_elems, seed + 2));
  DeviceBuffer<__nv_bfloat16> dx(testing::ToBf16(x)), dw(testing::ToBf16(w));
  DeviceBuffer<int32_t> d_pos(positions), d_slots(slots);
  DeviceBuffer<float2> d_table(BuildRopeTable(inv_freq, max_pos));
  DeviceBuffer<__nv_bfloat16> qkv(size_t(rows) * out);
  struct Outputs {
    std::vector<float> q, k, v;
  };
  auto run = [&](bool fused) {
    DeviceBuffer<__nv_bfloat16> q(size_t(rows) * num_q_heads * head_dim), k(cache_init), v(cache_init);
    q.Poison();
    if (fused) {
      GemvParams p{dx.get(), dw.get(), nullptr, rows, in, out, false, GemvEpilogue::kRopeKvWrite};
      p.rope = {d_pos.get(), d_slots.get(), d_table.get(), q.get(), {k.get(), v.get(), num_kv_heads, block_size, head_dim},
                num_q_heads};
      Gemv(p, nullptr);
    } else {
      Gemv({dx.get(), dw.get(), qkv.get(), rows, in, out, false}, nullptr);
      RopeAndWriteKv({qkv.get(), d_pos.get(), d_slots.get(), d_table.get(), q.get(),
                      {k.get(), v.get(), num_kv_heads, block_size, head_dim}, rows, num_q_heads},
                     nullptr);
    }
    DUET_CUDA_CHECK(cudaDeviceSynchronize());
    return Outputs{testing::ToFloat(q.Download()), testing::ToFloat(k.Download()), testing::ToFloat(v.Download())};
  };
  const Outputs fused = run(true), unfused = run(false);
  EXPECT_LT(testing::RelativeError(fused.q, unfused.q), 4e-3) << rows << " rows, head_dim " << head_dim;
  EXPECT_LT(testing::RelativeError(fused.k, unfused.k), 4e-3) << rows << " rows, head_dim " << head_dim;
  EXPECT_LT(testing::RelativeError(fused.v, unfused.v), 4e-3) << rows << " rows, head_dim " << head_dim;
}

TEST(Gemv, RopeKvWriteEpilogue) {
  DUET_SKIP_WITHOUT_GPU();
  for (int rows : {1, 2}) CheckGemvRope(rows, 4096, 32, 8, 128, 80 + rows);  // Llama-3-8B
  CheckGemvRope(2, 512, 8, 2, 64, 90);                                      // tiny model
}

TEST(Gemv, OneEarlyGroupMatchesTwo) {
  DUET_SKIP_WITHOUT_GPU();
  SetGemvEarlyGroups(1);
  for (int rows : {1, 2}) CheckGemv(rows, 4096, 6144, false, 130 + rows);
  CheckGemv(1, 1416, 77, false, 133);
  SetGemvEarlyGroups(2);
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
