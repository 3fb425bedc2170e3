#include "backends/cpu/ring_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/parallel_for.h"

namespace duet {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The block that travels the ring: a count, then max_tokens positions, K and V slots (padded, so
// every rank's block has the same size).
class RingBlock {
 public:
  RingBlock(const AttentionShape& shape, int64_t max_tokens)
      : kv_width_(shape.num_kv_heads * shape.head_dim), max_tokens_(max_tokens),
        bytes_(size_t(1 + max_tokens) * sizeof(int64_t) + 2 * size_t(max_tokens * kv_width_) * sizeof(float)),
        storage_(bytes_ / sizeof(int64_t) + 1) {}

  std::span<std::byte> bytes() { return {reinterpret_cast<std::byte*>(storage_.data()), bytes_}; }
  int64_t count() const { return storage_[0]; }
  std::span<const int64_t> positions() const { return {storage_.data() + 1, size_t(count())}; }
  std::span<const float> keys() const { return {floats(), size_t(count() * kv_width_)}; }
  std::span<const float> values() const { return {floats() + max_tokens_ * kv_width_, size_t(count() * kv_width_)}; }

  void Fill(std::span<const float> k, std::span<const float> v, std::span<const int64_t> positions) {
    storage_[0] = int64_t(positions.size());
    std::copy(positions.begin(), positions.end(), storage_.begin() + 1);
    float* f = floats();
    std::copy(k.begin(), k.end(), f);
    std::copy(v.begin(), v.end(), f + max_tokens_ * kv_width_);
  }

 private:
  const float* floats() const { return reinterpret_cast<const float*>(storage_.data() + 1 + max_tokens_); }
  float* floats() { return reinterpret_cast<float*>(storage_.data() + 1 + max_tokens_); }

  int64_t kv_width_, max_tokens_;
  size_t bytes_;
  std::vector<int64_t> storage_;  // int64-aligned; floats follow the positions
};

}  // namespace

PartialAttention AttendCausalBlock(const AttentionShape& shape, std::span<const float> q,
                                   std::span<const int64_t> q_positions, std::span<const float> k,
                                   std::span<const float> v, std::span<const int64_t> k_positions) {
  const int64_t nh = shape.num_heads, hd = shape.head_dim, group = nh / shape.num_kv_heads;
  const int64_t nq = int64_t(q_positions.size()), nk = int64_t(k_positions.size());
  PartialAttention part;
  part.out.assign(size_t(nq * nh * hd), 0.0f);
  part.lse.assign(size_t(nq * nh), kNegInf);
  auto attend = [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / nh, h = item % nh, g = h / group;
      const float* qi = q.data() + (i * nh + h) * hd;
      scores.clear();
      float max_score = kNegInf;
      for (int64_t j = 0; j < nk; ++j) {
        if (k_positions[size_t(j)] > q_positions[size_t(i)]) {
          scores.push_back(kNegInf);
          continue;
        }
        const float* kj = k.data() + (j * shape.num_kv_heads + g) * hd;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < hd; ++d) dot += qi[d] * kj[d];
        scores.push_back(dot * shape.scale);
        max_score = std::max(max_score, scores.back());
      }
      if (max_score == kNegInf) continue;  // every key is in this query's future
      float sum = 0.0f;
      float* o = part.out.data() + (i * nh + h) * hd;
      for (int64_t j = 0; j < nk; ++j) {
        if (scores[size_t(j)] == kNegInf) continue;
        const float p = std::exp(scores[size_t(j)] - max_score);
        sum += p;
        const float* vj = v.data() + (j * shape.num_kv_heads + g) * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) o[d] += p * vj[d];
      }
      for (int64_t d = 0; d < hd; ++d) o[d] /= sum;
      part.lse[size_t(i * nh + h)] = max_score + std::log(sum);
    }
  };
  ParallelFor& pool = ParallelFor::Shared();
  const int64_t items = nq * nh, parts = pool.num_threads();
  if (items * nk * hd < (int64_t(1) << 16) || parts == 1) {
    attend(0, items);
  } else {
    pool.Run([&](int p) { attend(items * p / parts, items * (p + 1) / parts); });
  }
  return part;
}

void MergePartialAttention(const AttentionShape& shape, const PartialAttention& part, PartialAttention& acc) {
  const int64_t hd = shape.head_dim;
  DUET_CHECK(part.lse.size() == acc.lse.size());
  for (size_t r = 0; r < acc.lse.size(); ++r) {
    const float la = acc.lse[r], lb = part.lse[r];
    if (lb == kNegInf) continue;
    float* oa = acc.out.data() + r * size_t(hd);
    const float* ob = part.out.data() + r * size_t(hd);
    if (la == kNegInf) {
      std::copy_n(ob, hd, oa);
      acc.lse[r] = lb;
      continue;
    }
    const float m = std::max(la, lb);
    const float wa = std::exp(la - m), wb = std::exp(lb - m);
    const float sum = wa + wb;
    for (int64_t d = 0; d < hd; ++d) oa[d] = (wa * oa[d] + wb * ob[d]) / sum;
    acc.lse[r] = m + std::log(sum);
  }
}

absl::Status RingAttention(const AttentionShape& shape, std::span<const float> q, std::span<const float> k,
                           std::span<const float> v, std::span<const int64_t> positions,
                           parallel::Communicator& comm, std::span<float> out) {
  const int64_t n = int64_t(positions.size());
  const int64_t kv_width = shape.num_kv_heads * shape.head_dim;
  if (int64_t(k.size()) != n * kv_width || int64_t(v.size()) != n * kv_width ||
      int64_t(q.size()) != n * shape.num_heads * shape.head_dim || out.size() != q.size()) {
    return absl::InvalidArgumentError("ring attention: shard sizes do not match its positions");
  }
  // Every rank's block has room for the largest shard: the ranks agree on it first.
  int64_t max_tokens = n;
  for (int root = 0; root < comm.size(); ++root) {
    int64_t theirs = n;
    if (absl::Status s = comm.Broadcast({reinterpret_cast<std::byte*>(&theirs), sizeof(theirs)}, root); !s.ok()) {
      return s;
    }
    max_tokens = std::max(max_tokens, theirs);
  }
  RingBlock held(shape, max_tokens), next(shape, max_tokens);
  held.Fill(k, v, positions);
  PartialAttention acc;
  acc.out.assign(q.size(), 0.0f);
  acc.lse.assign(size_t(n * shape.num_heads), kNegInf);
  for (int step = 0; step < comm.size(); ++step) {
    // The next block travels while this one is attended to.
    std::unique_ptr<parallel::PendingExchange> exchange;
    if (step + 1 < comm.size()) exchange = comm.StartRingExchange(held.bytes(), next.bytes());
    MergePartialAttention(
        shape, AttendCausalBlock(shape, q, positions, held.keys(), held.values(), held.positions()), acc);
    if (exchange != nullptr) {
      if (absl::Status s = exchange->Wait(); !s.ok()) return s;
      std::swap(held, next);
    }
  }
  std::copy(acc.out.begin(), acc.out.end(), out.begin());
  return absl::OkStatus();
}

}  // namespace duet
