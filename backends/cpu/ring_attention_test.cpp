#include "backends/cpu/ring_attention.h"

#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/host_communicator.h"
#include "parallel/zigzag.h"

namespace duet {
namespace {

constexpr AttentionShape kShape{4, 2, 16, 0.25f};

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// Plain causal attention over the whole sequence, in double: the oracle.
std::vector<float> Oracle(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                          int64_t n) {
  const int64_t nh = kShape.num_heads, nkv = kShape.num_kv_heads, hd = kShape.head_dim, group = nh / nkv;
  std::vector<float> out(size_t(n * nh * hd));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < nh; ++h) {
      std::vector<double> s(size_t(i + 1));
      double m = -1e300, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < hd; ++d) dot += double(q[(i * nh + h) * hd + d]) * k[(j * nkv + h / group) * hd + d];
        s[size_t(j)] = dot * kShape.scale;
        m = std::max(m, s[size_t(j)]);
      }
      for (double& x : s) sum += (x = std::exp(x - m));
      for (int64_t d = 0; d < hd; ++d) {
        double o = 0;
        for (int64_t j = 0; j <= i; ++j) o += s[size_t(j)] * v[(j * nkv + h / group) * hd + d];
        out[size_t((i * nh + h) * hd + d)] = float(o / sum);
      }
    }
  }
  return out;
}

void ExpectClose(const float* got, const float* want, int64_t count, const std::string& what) {
  for (int64_t i = 0; i < count; ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i]))) << what << " element " << i;
  }
}

TEST(RingAttentionTest, MergingTwoDisjointKeySetsEqualsAttendingToBoth) {
  const int64_t n = 40;
  const int64_t q_width = kShape.num_heads * kShape.head_dim, kv_width = kShape.num_kv_heads * kShape.head_dim;
  const std::vector<float> q = Random(size_t(n * q_width), 1), k = Random(size_t(n * kv_width), 2),
                           v = Random(size_t(n * kv_width), 3);
  std::vector<int64_t> positions(n);
  for (int64_t i = 0; i < n; ++i) positions[size_t(i)] = i;
  // Keys split by parity of position: every query sees some of each set (or none of one).
  std::vector<float> k_even, v_even, k_odd, v_odd;
  std::vector<int64_t> even, odd;
  for (int64_t j = 0; j < n; ++j) {
    auto& kk = j % 2 ? k_odd : k_even;
    auto& vv = j % 2 ? v_odd : v_even;
    kk.insert(kk.end(), k.begin() + j * kv_width, k.begin() + (j + 1) * kv_width);
    vv.insert(vv.end(), v.begin() + j * kv_width, v.begin() + (j + 1) * kv_width);
    (j % 2 ? odd : even).push_back(j);
  }
  PartialAttention acc = AttendCausalBlock(kShape, q, positions, k_odd, v_odd, odd);
  MergePartialAttention(kShape, AttendCausalBlock(kShape, q, positions, k_even, v_even, even), acc);
  const std::vector<float> want = Oracle(q, k, v, n);
  ExpectClose(acc.out.data(), want.data(), int64_t(want.size()), "merged");
  // Query 0 sees no odd key: its first partial was empty (lse -inf) and the merge took the other.
  const PartialAttention odd_only = AttendCausalBlock(kShape, q, positions, k_odd, v_odd, odd);
  EXPECT_TRUE(std::isinf(odd_only.lse[0]) && odd_only.lse[0] < 0);
}

// Every rank's ring attention over its zigzag shard equals the oracle's rows at its positions.
void ExpectRingMatchesOracle(int64_t n, int size) {
  const int64_t q_width = kShape.num_heads * kShape.head_dim, kv_width = kShape.num_kv_heads * kShape.head_dim;
  const std::vector<float> q = Random(size_t(n * q_width), 7), k = Random(size_t(n * kv_width), 8),
                           v = Random(size_t(n * kv_width), 9);
  const std::vector<float> want = Oracle(q, k, v, n);
  std::vector<std::unique_ptr<parallel::Communicator>> comms = parallel::CreateHostCommunicators(size);
  std::vector<std::vector<float>> outs(static_cast<size_t>(size));
  std::vector<std::vector<int64_t>> positions(static_cast<size_t>(size));
  std::vector<absl::Status> status(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      std::vector<int64_t>& pos = positions[size_t(rank)];
      pos = parallel::RankPositions(n, rank, size);
      std::vector<float> lq, lk, lv;
      for (int64_t p : pos) {
        lq.insert(lq.end(), q.begin() + p * q_width, q.begin() + (p + 1) * q_width);
        lk.insert(lk.end(), k.begin() + p * kv_width, k.begin() + (p + 1) * kv_width);
        lv.insert(lv.end(), v.begin() + p * kv_width, v.begin() + (p + 1) * kv_width);
      }
      outs[size_t(rank)].resize(lq.size());
      status[size_t(rank)] = RingAttention(kShape, lq, lk, lv, pos, *comms[size_t(rank)], outs[size_t(rank)]);
    });
  }
  for (std::thread& t : threads) t.join();
  int64_t covered = 0;
  for (int rank = 0; rank < size; ++rank) {
    ASSERT_TRUE(status[size_t(rank)].ok()) << status[size_t(rank)];
    for (size_t i = 0; i < positions[size_t(rank)].size(); ++i, ++covered) {
      const int64_t p = positions[size_t(rank)][i];
      ExpectClose(outs[size_t(rank)].data() + i * q_width, want.data() + p * q_width, q_width,
                  "rank " + std::to_string(rank) + " position " + std::to_string(p));
    }
  }
  EXPECT_EQ(covered, n);
}

TEST(RingAttentionTest, OneRankIsPlainCausalAttention) { ExpectRingMatchesOracle(33, 1); }
TEST(RingAttentionTest, TwoRanks) { ExpectRingMatchesOracle(64, 2); }
TEST(RingAttentionTest, ThreeRanksUnevenShards) { ExpectRingMatchesOracle(101, 3); }
TEST(RingAttentionTest, FourRanksUnevenShards) { ExpectRingMatchesOracle(77, 4); }
TEST(RingAttentionTest, FourRanksFewTokens) { ExpectRingMatchesOracle(9, 4); }

}  // namespace
}  // namespace duet
