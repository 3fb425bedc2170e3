// What the CPU kernels (cpu_gemv, cpu_attention) share: whether this CPU runs their AVX2/FMA
// paths, and the 8-lane sum they end a dot product with (the same order everywhere).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace duet {

inline bool CpuHasAvx2Fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// Sum of the 8 lanes.
__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

}  // namespace duet

#endif  // __x86_64__
