#include "kernels/elementwise/rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
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

constexpr int kMaxPositions = 8192;

// Llama-style inverse frequencies base^(-2i/head_dim).
std::vector<float> InvFreq(int head_dim, double base = 500000.0) {
  std::vector<float> inv_freq(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) inv_freq[i] = float(1.0 / std::pow(base, 2.0 * i / head_dim));
  return inv_freq;
}

struct RopeShape {
  int num_tokens, num_q_heads, num_kv_heads, head_dim, block_size;
};

// Random qkv, positions below 8192 (including 0 and 8191), distinct random cache slots with
// every `skip_every`-th token unmapped (-1); checks q_out, the written k/v slots, and that every
// other cache entry keeps its poison.
void CheckRope(const RopeShape& s, uint64_t seed, int skip_every = 4) {
  std::mt19937_64 rng(seed);
  const int stride = (s.num_q_heads + 2 * s.num_kv_heads) * s.head_dim;
  const std::vector<float> qkv = RoundToBf16(RandomFloats(size_t(s.num_tokens) * stride, seed, -2.f, 2.f));
  std::vector<int32_t> positions(s.num_tokens);
  for (int32_t& p : positions) p = int32_t(rng() % kMaxPositions);
  positions[0] = kMaxPositions - 1;
  if (s.num_tokens > 1) positions[1] = 0;
  const int num_blocks = s.num_tokens / s.block_size + 3;
  std::vector<int32_t> all_slots(size_t(num_blocks) * s.block_size);
  std::iota(all_slots.begin(), all_slots.end(), 0);
  std::shuffle(all_slots.begin(), all_slots.end(), rng);
  std::vector<int32_t> slot_mapping(s.num_tokens);
  for (int t = 0; t < s.num_tokens; ++t) slot_mapping[t] = (skip_every > 0 && t % skip_every == skip_every - 1) ? -1 : all_slots[t];

  const std::vector<float> inv_freq = InvFreq(s.head_dim);
  const std::vector<float2> table = BuildRopeTable(inv_freq, kMaxPositions);
  const size_t cache_elems = size_t(num_blocks) * s.num_kv_heads * s.block_size * s.head_dim;

  DeviceBuffer<__nv_bfloat16> d_qkv(ToBf16(qkv));
  DeviceBuffer<int32_t> d_positions(positions);
  DeviceBuffer<int32_t> d_slots(slot_mapping);
  DeviceBuffer<float2> d_table(table);
  DeviceBuffer<__nv_bfloat16> d_q(size_t(s.num_tokens) * s.num_q_heads * s.head_dim);
  DeviceBuffer<__nv_bfloat16> d_k(cache_elems), d_v(cache_elems);
  d_q.Poison();
  d_k.Poison();
  d_v.Poison();

  RopeKvWriteParams p{};
  p.qkv = d_qkv.get();
  p.positions = d_positions.get();
  p.slot_mapping = d_slots.get();
  p.rope_table = d_table.get();
  p.q_out = d_q.get();
  p.kv = {d_k.get(), d_v.get(), s.num_kv_heads, s.block_size, s.head_dim};
  p.num_tokens = s.num_tokens;
  p.num_q_heads = s.num_q_heads;
  RopeAndWriteKv(p, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());

  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> ref_k(cache_elems, nan), ref_v(cache_elems, nan);
  const std::vector<float> ref_q = reference::RopeAndWriteKv(qkv, positions, slot_mapping, inv_freq, s.num_q_heads,
                                                             s.num_kv_heads, s.head_dim, s.block_size, ref_k, ref_v);
  EXPECT_LE(RelativeError(ToFloat(d_q.Download()), ref_q), 1e-2);

  for (auto [device, ref, name] : {std::make_tuple(&d_k, &ref_k, "k"), std::make_tuple(&d_v, &ref_v, "v")}) {
    SCOPED_TRACE(name);
    const std::vector<__nv_bfloat16> got = device->Download();
    std::vector<float> got_written, ref_written;
    size_t poison_lost = 0;
    for (size_t i = 0; i < cache_elems; ++i) {
      if (std::isnan((*ref)[i])) {
        uint16_t bits;
        std::memcpy(&bits, &got[i], sizeof(bits));
        poison_lost += bits != 0xFFFF;
      } else {
        got_written.push_back(__bfloat162float(got[i]));
        ref_written.push_back((*ref)[i]);
      }
    }
    EXPECT_EQ(poison_lost, 0u) << "cache entries outside slot_mapping were written";
    if (!ref_written.empty()) {
      EXPECT_LE(RelativeError(got_written, ref_written), 1e-2);
    }
  }
}

TEST(RopeAndWriteKv, Bf16Llama8bShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckRope({/*num_tokens=*/37, /*num_q_heads=*/32, /*num_kv_heads=*/8, /*head_dim=*/128, /*block_size=*/16}, 1);
}

TEST(RopeAndWriteKv, Bf16TinyModelShape) {
  DUET_SKIP_WITHOUT_GPU();
  CheckRope({29, 8, 4, 64, 16}, 2);
}

TEST(RopeAndWriteKv, Bf16SingleToken) {
  DUET_SKIP_WITHOUT_GPU();
  CheckRope({1, 32, 8, 128, 16}, 3);
  CheckRope({1, 8, 4, 64, 32}, 4);
}

TEST(RopeAndWriteKv, Bf16PrefillManyTokens) {
  DUET_SKIP_WITHOUT_GPU();
  CheckRope({1031, 32, 8, 128, 16}, 5, /*skip_every=*/0);
}

TEST(RopeAndWriteKv, Bf16OtherHeadDims) {
  DUET_SKIP_WITHOUT_GPU();
  for (int head_dim : {8, 40, 80, 96, 256}) {  // 8, 40: pairs of 4-element vectors
    SCOPED_TRACE(head_dim);
    CheckRope({11, 6, 2, head_dim, 8}, 6 + head_dim);
  }
}

TEST(RopeAndWriteKv, Bf16UnmappedTokensWriteNoCache) {
  DUET_SKIP_WITHOUT_GPU();
  CheckRope({9, 8, 4, 64, 16}, 7, /*skip_every=*/1);  // every slot -1
}

TEST(BuildRopeTable, Fp32AngleIsFloatProduct) {
  const std::vector<float> inv_freq = InvFreq(128);
  const std::vector<float2> table = BuildRopeTable(inv_freq, kMaxPositions);
  ASSERT_EQ(table.size(), size_t(kMaxPositions) * 64);
  EXPECT_EQ(table[0].x, 1.f);
  EXPECT_EQ(table[0].y, 0.f);
  for (int pos : {1, 77, 4095, 8191}) {
    for (int i : {0, 1, 17, 63}) {
      const float angle = float(pos) * inv_freq[i];
      const float2 cs = table[size_t(pos) * 64 + i];
      EXPECT_NEAR(cs.x, std::cos(double(angle)), 1e-7);
      EXPECT_NEAR(cs.y, std::sin(double(angle)), 1e-7);
    }
  }
}

TEST(RopeAndWriteKv, Bf16GraphCaptureMatchesEager) {
  DUET_SKIP_WITHOUT_GPU();
  const int tokens = 4, hq = 8, hkv = 4, d = 64, bs = 16;
  DeviceBuffer<__nv_bfloat16> d_qkv(ToBf16(RandomFloats(size_t(tokens) * (hq + 2 * hkv) * d, 20)));
  DeviceBuffer<int32_t> d_positions(std::vector<int32_t>{5, 6, 7, 8});
  DeviceBuffer<int32_t> d_slots(std::vector<int32_t>{3, 4, -1, 17});
  DeviceBuffer<float2> d_table(BuildRopeTable(InvFreq(d), 64));
  DeviceBuffer<__nv_bfloat16> d_q(size_t(tokens) * hq * d), d_k(size_t(2) * hkv * bs * d), d_v(size_t(2) * hkv * bs * d);
  RopeKvWriteParams p{d_qkv.get(), d_positions.get(), d_slots.get(), d_table.get(), d_q.get(),
                      {d_k.get(), d_v.get(), hkv, bs, d}, tokens, hq};
  auto poison = [&] {
    d_q.Poison();
    d_k.Poison();
    d_v.Poison();
  };
  auto append_outputs = [&](std::vector<__nv_bfloat16>& all) {
    for (const auto* b : {&d_q, &d_k, &d_v}) {
      const std::vector<__nv_bfloat16> part = b->Download();
      all.insert(all.end(), part.begin(), part.end());
    }
  };
  poison();
  RopeAndWriteKv(p, nullptr);
  DUET_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> eager;
  append_outputs(eager);
  std::vector<__nv_bfloat16> replayed;
  testing::CaptureAndReplay([&](cudaStream_t stream) { RopeAndWriteKv(p, stream); }, [&] { poison(); });
  append_outputs(replayed);
  ASSERT_EQ(eager.size(), replayed.size());
  EXPECT_EQ(std::memcmp(eager.data(), replayed.data(), eager.size() * sizeof(__nv_bfloat16)), 0);
}

}  // namespace
}  // namespace duet::kernels
