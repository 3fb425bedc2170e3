#include "kernels/attention/attention_reference.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace duet::kernels::reference {
namespace {

// out[0, head_dim) = attention of one query row of `q_head` over cache positions [0, last_pos],
// except positions step_start + j (j < 64) whose bit j of `step_mask` is clear. Returns the
// natural log of the softmax denominator, sum(exp(scale * q.k)) (-inf, with zeros out, when
// last_pos < 0).
double AttendOne(const float* q, const PagedKv& kv, int seq, int kv_head, int last_pos, float scale, float* out,
                 int step_start = 0, uint64_t step_mask = ~uint64_t{0}) {
  if (last_pos < 0) {
    std::fill(out, out + kv.head_dim, 0.f);
    return -INFINITY;
  }
  auto visible = [&](int pos) {
    const int j = pos - step_start;
    return j < 0 || j >= 64 || ((step_mask >> j) & 1u) != 0;
  };
  const int d = kv.head_dim;
  auto row = [&](const std::vector<float>& cache, int pos) {
    const int64_t block = kv.block_tables[size_t(seq) * kv.max_blocks_per_seq + pos / kv.block_size];
    return cache.data() + ((block * kv.num_kv_heads + kv_head) * kv.block_size + pos % kv.block_size) * d;
  };
  std::vector<double> scores(size_t(last_pos) + 1);
  double max_score = -INFINITY;
  for (int pos = 0; pos <= last_pos; ++pos) {
    if (!visible(pos)) {
      scores[pos] = -INFINITY;
      continue;
    }
    const float* k = row(kv.k, pos);
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += double(q[i]) * double(k[i]);
    scores[pos] = dot * scale;
    max_score = std::max(max_score, scores[pos]);
  }
  std::vector<double> acc(d, 0.0);
  double sum = 0;
  for (int pos = 0; pos <= last_pos; ++pos) {
    if (!visible(pos)) continue;
    const double p = std::exp(scores[pos] - max_score);
    sum += p;
    const float* v = row(kv.v, pos);
    for (int i = 0; i < d; ++i) acc[i] += p * double(v[i]);
  }
  for (int i = 0; i < d; ++i) out[i] = float(acc[i] / sum);
  return max_score + std::log(sum);
}

}  // namespace

std::vector<float> PagedDecodeAttention(const std::vector<float>& q, const PagedKv& kv,
                                        const std::vector<int32_t>& context_lens, int num_q_heads, float scale) {
  const int num_seqs = int(context_lens.size());
  const int group = num_q_heads / kv.num_kv_heads;
  std::vector<float> out(size_t(num_seqs) * num_q_heads * kv.head_dim, 0.f);
  for (int s = 0; s < num_seqs; ++s) {
    if (context_lens[s] == 0) continue;
    for (int h = 0; h < num_q_heads; ++h) {
      const size_t offset = (size_t(s) * num_q_heads + h) * kv.head_dim;
      AttendOne(q.data() + offset, kv, s, h / group, context_lens[s] - 1, scale, out.data() + offset);
    }
  }
  return out;
}

std::vector<float> PrefillAttention(const std::vector<float>& q, const PagedKv& kv, const std::vector<int32_t>& q_start,
                                    const std::vector<int32_t>& context_lens, int num_q_heads, float scale,
                                    const std::vector<uint64_t>& tree_masks) {
  const int num_seqs = int(context_lens.size());
  const int group = num_q_heads / kv.num_kv_heads;
  std::vector<float> out(static_cast<size_t>(q_start[num_seqs]) * num_q_heads * kv.head_dim, 0.f);
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = q_start[s + 1] - q_start[s];
    for (int i = 0; i < q_len; ++i) {
      const int pos = context_lens[s] - q_len + i;
      for (int h = 0; h < num_q_heads; ++h) {
        const size_t offset = (size_t(q_start[s] + i) * num_q_heads + h) * kv.head_dim;
        const uint64_t mask = tree_masks.empty() ? ~uint64_t{0} : tree_masks[size_t(q_start[s] + i)];
        AttendOne(q.data() + offset, kv, s, h / group, pos, scale, out.data() + offset, context_lens[s] - q_len, mask);
      }
    }
  }
  return out;
}

std::vector<float> PrefillAttentionState(const std::vector<float>& q, const PagedKv& kv,
                                         const std::vector<int32_t>& q_start, const std::vector<int32_t>& context_lens,
                                         const std::vector<int32_t>& kv_lens, int num_q_heads, float scale,
                                         std::vector<float>& lse) {
  const int num_seqs = int(context_lens.size());
  const int group = num_q_heads / kv.num_kv_heads;
  std::vector<float> out(static_cast<size_t>(q_start[num_seqs]) * num_q_heads * kv.head_dim, 0.f);
  lse.assign(static_cast<size_t>(q_start[num_seqs]) * num_q_heads, 0.f);
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = q_start[s + 1] - q_start[s];
    for (int i = 0; i < q_len; ++i) {
      const int last = std::min(context_lens[s] - q_len + i, kv_lens[s] - 1);
      for (int h = 0; h < num_q_heads; ++h) {
        const size_t row_head = size_t(q_start[s] + i) * num_q_heads + h;
        lse[row_head] = float(AttendOne(q.data() + row_head * kv.head_dim, kv, s, h / group, last, scale,
                                        out.data() + row_head * kv.head_dim));
      }
    }
  }
  return out;
}

}  // namespace duet::kernels::reference
