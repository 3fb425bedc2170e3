#include "backends/cpu/cpu_attention.h"

#include <algorithm>
#include <cmath>

#include "backends/cpu/cpu_simd.h"
#include "common/check.h"

namespace duet {
namespace {

// Softmax of scores[0, n) in place, as probabilities (the same scalar code on every path).
void Softmax(float* scores, int64_t n) {
  float max_score = -INFINITY;
  for (int64_t i = 0; i < n; ++i) max_score = std::max(max_score, scores[i]);
  float denom = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    scores[i] = std::exp(scores[i] - max_score);
    denom += scores[i];
  }
  const float inv_denom = 1.0f / denom;
  for (int64_t i = 0; i < n; ++i) scores[i] *= inv_denom;
}

#if defined(__x86_64__)

// scores[j] = scale · q·k_j for kKeys keys head_dim floats apart: each key's 8 lanes accumulate
// over head_dim in order, then sum. A key's score is the same in a group of 4 or alone.
template <int kKeys>
__attribute__((target("avx2,fma"), always_inline)) inline void DotKeys(const float* q, const float* k,
                                                                       int64_t head_dim, float scale,
                                                                       float* scores) {
  __m256 acc[kKeys];
#pragma GCC unroll 4
  for (int j = 0; j < kKeys; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 4
    for (int j = 0; j < kKeys; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * head_dim + d), acc[j]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < kKeys; ++j) scores[j] = HorizontalSum(acc[j]) * scale;
}

// out[c0, c0 + 8·kVecs) = sum_i p_i · v_i over the context in order (each element one FMA
// chain over the slots).
template <int kVecs>
__attribute__((target("avx2,fma"), always_inline)) inline void WeightedValues(absl::Span<const KvRun> context,
                                                                              const float* p, int64_t head_dim,
                                                                              int64_t c0, float* out) {
  __m256 acc[kVecs];
#pragma GCC unroll 8
  for (int v = 0; v < kVecs; ++v) acc[v] = _mm256_setzero_ps();
  for (const KvRun& run : context) {
    const float* values = run.values + c0;
    for (int64_t i = 0; i < run.count; ++i, values += head_dim) {
      const __m256 pi = _mm256_set1_ps(*p++);
#pragma GCC unroll 8
      for (int v = 0; v < kVecs; ++v) acc[v] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(values + 8 * v), acc[v]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(out + c0 + 8 * v, acc[v]);
}

__attribute__((target("avx2,fma"))) void AttendHeadAvx2(const float* q, absl::Span<const KvRun> context,
                                                        int64_t head_dim, float scale, float* scores, float* out) {
  int64_t n = 0;
  for (const KvRun& run : context) {
    const float* k = run.keys;
    int64_t i = 0;
    for (; i + 4 <= run.count; i += 4) DotKeys<4>(q, k + i * head_dim, head_dim, scale, scores + n + i);
    for (; i < run.count; ++i) DotKeys<1>(q, k + i * head_dim, head_dim, scale, scores + n + i);
    n += run.count;
  }
  Softmax(scores, n);
  int64_t c0 = 0;
  for (; c0 + 64 <= head_dim; c0 += 64) WeightedValues<8>(context, scores, head_dim, c0, out);
  for (; c0 < head_dim; c0 += 8) WeightedValues<1>(context, scores, head_dim, c0, out);
}

#endif  // __x86_64__

}  // namespace

void AttendHeadPortable(const float* q, absl::Span<const KvRun> context, int64_t head_dim, float scale,
                        float* scores, float* out) {
  int64_t n = 0;
  for (const KvRun& run : context) {
    for (int64_t i = 0; i < run.count; ++i, ++n) {
      const float* k = run.keys + i * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += q[d] * k[d];
      scores[n] = dot * scale;
    }
  }
  Softmax(scores, n);
  std::fill_n(out, head_dim, 0.0f);
  const float* p = scores;
  for (const KvRun& run : context) {
    for (int64_t i = 0; i < run.count; ++i, ++p) {
      const float* v = run.values + i * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) out[d] += *p * v[d];
    }
  }
}

bool AttendHeadUsesAvx2(int64_t head_dim) {
#if defined(__x86_64__)
  return head_dim % 8 == 0 && CpuHasAvx2Fma();
#else
  (void)head_dim;
  return false;
#endif
}

void AttendHead(const float* q, absl::Span<const KvRun> context, int64_t head_dim, float scale, float* scores,
                float* out) {
  DUET_CHECK(head_dim >= 1 && !context.empty());
#if defined(__x86_64__)
  if (AttendHeadUsesAvx2(head_dim)) {
    AttendHeadAvx2(q, context, head_dim, scale, scores, out);
    return;
  }
#endif
  AttendHeadPortable(q, context, head_dim, scale, scores, out);
}

}  // namespace duet
