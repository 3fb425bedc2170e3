#include "backends/cpu/cpu_gemv.h"

#include <algorithm>

#include "backends/cpu/cpu_simd.h"
#include "common/check.h"

namespace duet {
namespace {

#if defined(__x86_64__)

// y[r, i] for i < kW weight rows w[i·k ..] and r < kX activation rows x[r·k ..] (y rows n
// apart): kW × kX dot products sharing each weight and activation load. Every dot product runs
// 8 lanes over k in steps of 8, sums the lanes, then adds the tail in order: the same order
// whatever kW and kX are.
//
// `prefetch` (may be null) is kW rows of k floats to bring towards L2 meanwhile: the next block of
// weight rows, so its DRAM reads overlap this block's arithmetic (a block of few weight rows
// and many activation rows is otherwise read, then computed on with the memory idle).
template <int kW, int kX>
__attribute__((target("avx2,fma"), always_inline)) inline void DotBlock(const float* x, const float* w, float* y,
                                                                        int64_t n, int64_t k,
                                                                        const float* prefetch) {
  // The fixed-trip loops must unroll (at -O2 too) so the accumulators live in registers.
  __m256 acc[kW][kX];
#pragma GCC unroll 8
  for (int i = 0; i < kW; ++i) {
#pragma GCC unroll 4
    for (int r = 0; r < kX; ++r) acc[i][r] = _mm256_setzero_ps();
  }
  const int64_t k8 = k & ~int64_t{7};
  for (int64_t c = 0; c < k8; c += 8) {
    if (prefetch != nullptr && (c & 15) == 0) {  // one cache line of each row per 16 floats
#pragma GCC unroll 8
      for (int i = 0; i < kW; ++i) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * k + c), _MM_HINT_T1);
    }
    __m256 xv[kX];
#pragma GCC unroll 4
    for (int r = 0; r < kX; ++r) xv[r] = _mm256_loadu_ps(x + r * k + c);
#pragma GCC unroll 8
    for (int i = 0; i < kW; ++i) {
      const __m256 wv = _mm256_loadu_ps(w + i * k + c);
#pragma GCC unroll 4
      for (int r = 0; r < kX; ++r) acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < kW; ++i) {
    for (int r = 0; r < kX; ++r) {
      float sum = HorizontalSum(acc[i][r]);
      for (int64_t c = k8; c < k; ++c) sum += w[i * k + c] * x[r * k + c];
      y[r * n + i] = sum;
    }
  }
}

// Weight rows in blocks of kW; for each block, the activation rows kX at a time (then the
// rest). The block's kW weight rows (kW·k floats) come from memory once and stay in L1/L2 for
// the other activation rows. y's rows are `ldy` apart.
template <int kW, int kX>
__attribute__((target("avx2,fma"))) void RowPanel(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                                                  int64_t k, int64_t ldy) {
  int64_t j = 0;
  for (; j + kW <= n; j += kW) {
    const float* wj = w + j * k;
    // With several passes over this block (more activation rows than one pass takes), the next
    // block's rows are fetched during the first pass; the later passes read this block from
    // cache. A single pass streams like a GEMV, which the hardware prefetcher follows alone.
    const float* next = rows > kX && j + 2 * kW <= n ? wj + kW * k : nullptr;
    int64_t r = 0;
    for (; r + kX <= rows; r += kX, next = nullptr) DotBlock<kW, kX>(x + r * k, wj, y + r * ldy + j, ldy, k, next);
    if constexpr (kX > 2) {
      if (r + 2 <= rows) {
        DotBlock<kW, 2>(x + r * k, wj, y + r * ldy + j, ldy, k, next);
        r += 2;
        next = nullptr;
      }
    }
    if (r < rows) DotBlock<kW, 1>(x + r * k, wj, y + r * ldy + j, ldy, k, next);
  }
  for (; j < n; ++j) {  // fewer than kW weight rows left
    for (int64_t r = 0; r < rows; ++r) DotBlock<1, 1>(x + r * k, w + j * k, y + r * ldy + j, ldy, k, nullptr);
  }
}

// The activation rows in panels of ~kPanelBytes, which stay in L2 while every weight row streams
// past them once: a prefill-sized x would otherwise be read from L3 or memory for every block of
// weight rows.
template <int kW, int kX>
__attribute__((target("avx2,fma"))) void BatchedGemvAvx2(const float* x, const float* w, float* y, int64_t rows,
                                                         int64_t n, int64_t k, int64_t ldy) {
  constexpr int64_t kPanelBytes = 128 << 10;
  const int64_t panel_rows = std::max<int64_t>(kX, kPanelBytes / (k * int64_t(sizeof(float))) / kX * kX);
  for (int64_t r = 0; r < rows; r += panel_rows) {
    RowPanel<kW, kX>(x + r * k, w, y + r * ldy, std::min(panel_rows, rows - r), n, k, ldy);
  }
}

#endif  // __x86_64__

// Output columns [begin, end) of y[rows, n], portable code.
void PortableColumns(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k, int64_t begin,
                     int64_t end) {
  for (int64_t j = begin; j < end; ++j) {
    const float* wr = w + j * k;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * k;
      float sum = 0.0f;
      for (int64_t c = 0; c < k; ++c) sum += wr[c] * xr[c];
      y[r * n + j] = sum;
    }
  }
}

// Output columns [begin, end) of y[rows, n].
void BatchedGemvColumns(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k, int64_t begin,
                        int64_t end) {
#if defined(__x86_64__)
  if (CpuHasAvx2Fma()) {
    BatchedGemvAvx2<4, 3>(x, w + begin * k, y + begin, rows, end - begin, k, n);
    return;
  }
#endif
  PortableColumns(x, w, y, rows, n, k, begin, end);
}

}  // namespace

void BatchedGemvPortable(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k) {
  PortableColumns(x, w, y, rows, n, k, 0, n);
}

bool BatchedGemvUsesAvx2() {
#if defined(__x86_64__)
  return CpuHasAvx2Fma();
#else
  return false;
#endif
}

void BatchedGemv(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k, ParallelFor* pool) {
  DUET_CHECK(rows >= 0 && n >= 1 && k >= 1);
  // Below this many multiply-adds a call is over before workers could help.
  constexpr int64_t kMinParallelWork = int64_t(1) << 18;
  if (pool == nullptr || pool->num_threads() == 1 || rows * n * k < kMinParallelWork) {
    BatchedGemvColumns(x, w, y, rows, n, k, 0, n);
    return;
  }
  // Each thread streams its own slice of the weight rows (whole register blocks of 4); every
  // y[r, j] is still one thread's sum in the same order.
  const int64_t parts = pool->num_threads();
  const int64_t per_part = (n / parts + 3) / 4 * 4;
  pool->Run([&](int part) {
    const int64_t begin = std::min(n, int64_t(part) * per_part);
    const int64_t end = part + 1 == parts ? n : std::min(n, begin + per_part);
    if (begin < end) BatchedGemvColumns(x, w, y, rows, n, k, begin, end);
  });
}

}  // namespace duet
