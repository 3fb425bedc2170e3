#include "engine/cpu_gemv.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/check.h"

namespace duet {
namespace {

#if defined(__x86_64__)

// Sum of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// y[r, j0 + i] for i < kW weight rows and r < kX activation rows: kW × kX dot products sharing
// each weight and activation load. Every dot product runs 8 lanes over k in steps of 8, sums
// the lanes, then adds the tail in order: the same order whatever kW and kX are.
template <int kW, int kX>
__attribute__((target("avx2,fma"))) inline void DotBlock(const float* const* x, const float* w, float* const* y,
                                                         int64_t j0, int64_t k) {
  // The fixed-trip loops must unroll (at -O2 too) so the accumulators live in registers.
  __m256 acc[kW][kX];
#pragma GCC unroll 8
  for (int i = 0; i < kW; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < kX; ++r) acc[i][r] = _mm256_setzero_ps();
  }
  const int64_t k8 = k & ~int64_t{7};
  for (int64_t c = 0; c < k8; c += 8) {
    __m256 xv[kX];
#pragma GCC unroll 4
    for (int r = 0; r < kX; ++r) xv[r] = _mm256_loadu_ps(x[r] + c);
#pragma GCC unroll 8
    for (int i = 0; i < kW; ++i) {
      const __m256 wv = _mm256_loadu_ps(w + (j0 + i) * k + c);
#pragma GCC unroll 4
      for (int r = 0; r < kX; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < kW; ++i) {
    const float* wr = w + (j0 + i) * k;
    for (int r = 0; r < kX; ++r) {
      float sum = HorizontalSum(acc[i][r]);
      for (int64_t c = k8; c < k; ++c) sum += wr[c] * x[r][c];
      y[r][j0 + i] = sum;
    }
  }
}

// Weight rows in blocks of kW; for each block, the activation rows in pairs (then one left
// over). The block's kW weight rows (kW·k floats) come from memory once and stay in L1/L2 for
// the other activation rows.
template <int kW>
__attribute__((target("avx2,fma"))) void GemvRowsAvx2(const float* x, const float* w, float* y, int64_t rows,
                                                      int64_t j_begin, int64_t j_end, int64_t n, int64_t k) {
  int64_t j = j_begin;
  for (; j + kW <= j_end; j += kW) {
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2) {
      const float* xs[2] = {x + r * k, x + (r + 1) * k};
      float* ys[2] = {y + r * n, y + (r + 1) * n};
      DotBlock<kW, 2>(xs, w, ys, j, k);
    }
    if (r < rows) {
      const float* xs[1] = {x + r * k};
      float* ys[1] = {y + r * n};
      DotBlock<kW, 1>(xs, w, ys, j, k);
    }
  }
  for (; j < j_end; ++j) {  // fewer than kW weight rows left
    for (int64_t r = 0; r < rows; ++r) {
      const float* xs[1] = {x + r * k};
      float* ys[1] = {y + r * n};
      DotBlock<1, 1>(xs, w, ys, j, k);
    }
  }
}

__attribute__((target("avx2,fma"))) void BatchedGemvAvx2(const float* x, const float* w, float* y, int64_t rows,
                                                         int64_t n, int64_t k) {
  GemvRowsAvx2<4>(x, w, y, rows, 0, n, n, k);
}

bool CpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

#endif  // __x86_64__

}  // namespace

void BatchedGemvPortable(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k) {
  for (int64_t j = 0; j < n; ++j) {
    const float* wr = w + j * k;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * k;
      float sum = 0.0f;
      for (int64_t c = 0; c < k; ++c) sum += wr[c] * xr[c];
      y[r * n + j] = sum;
    }
  }
}

bool BatchedGemvUsesAvx2() {
#if defined(__x86_64__)
  return CpuHasAvx2Fma();
#else
  return false;
#endif
}

void BatchedGemv(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k) {
  DUET_CHECK(rows >= 0 && n >= 1 && k >= 1);
#if defined(__x86_64__)
  if (CpuHasAvx2Fma()) {
    BatchedGemvAvx2(x, w, y, rows, n, k);
    return;
  }
#endif
  BatchedGemvPortable(x, w, y, rows, n, k);
}

}  // namespace duet
