#include "backends/cpu/cpu_gemv.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <new>
#include <type_traits>

#include "backends/cpu/cpu_simd.h"
#include "common/check.h"

namespace duet {
namespace {

constexpr int64_t kPanel = PackedWeights::kPanel;
constexpr std::align_val_t kAlignment{64};

// The blocking of a product. None of it changes a sum: a tile that does not start a chain
// continues the one it reloads from y (exactly: y holds the float the registers held).
constexpr int64_t kTileRows = 6;     // 6 × 16 outputs: 12 of the 16 ymm registers
constexpr int64_t kBlockK = 256;     // a panel's 256 × 16 slice (16 KiB) stays in L1 for a row block's tiles
constexpr int64_t kBlockRows = 192;  // those 256 columns of the block's x rows (192 KiB) stay in L2

// y[r, 0..16) for the tile's kRows rows (y's rows ldy apart), each chain taken over the next kc
// columns: x's rows ldx apart from the first of them, `panel` the packed rows from there on (W:
// float; uint16_t, bfloat16 bits; or _Float16). `from_zero`: the chains start here (else they
// continue from y).
template <typename W>
using TileFn = void (*)(const float* x, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy,
                        bool from_zero);

// The float32 a packed weight stands for (a bfloat16 is the upper half of its float32).
inline float Widen(float w) { return w; }
inline float Widen(uint16_t w) { return std::bit_cast<float>(uint32_t{w} << 16); }
inline float Widen(_Float16 w) { return float(w); }

// std::fma is one instruction where the CPU has FMA (aarch64, x86 with FMA); on an x86 CPU
// without it, it is emulated: slow, but the same bits as the AVX2 kernel.
template <typename W, int kRows>
void PortableTile(const float* x, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy,
                  bool from_zero) {
  float acc[kRows][kPanel];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t l = 0; l < kPanel; ++l) acc[r][l] = from_zero ? 0.0f : y[r * ldy + l];
  }
  for (int64_t c = 0; c < kc; ++c) {
    for (int r = 0; r < kRows; ++r) {
      for (int64_t l = 0; l < kPanel; ++l) {
        acc[r][l] = std::fma(x[r * ldx + c], Widen(panel[c * kPanel + l]), acc[r][l]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) std::copy_n(acc[r], kPanel, y + r * ldy);
}

template <typename W>
constexpr TileFn<W> kPortableTiles[kTileRows + 1] = {nullptr,           PortableTile<W, 1>, PortableTile<W, 2>,
                                                     PortableTile<W, 3>, PortableTile<W, 4>, PortableTile<W, 5>,
                                                     PortableTile<W, 6>};

#if defined(__x86_64__)

// Eight weights as floats (a bfloat16 zero-extended to 32 bits and shifted into the upper half is
// the float32 it stands for; a float16 is converted by F16C).
__attribute__((target("avx2,fma"))) inline __m256 LoadEight(const float* p) { return _mm256_load_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 LoadEight(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 LoadEight(const _Float16* p) {
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
}

template <typename W, int kRows>
__attribute__((target("avx2,fma,f16c"))) void Avx2Tile(const float* x, int64_t ldx, const W* panel, int64_t kc,
                                                  float* y, int64_t ldy, bool from_zero) {
  // The fixed-trip loops must unroll (at -O2 too) so the accumulators live in registers.
  __m256 acc[kRows][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = from_zero ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy);
    acc[r][1] = from_zero ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8);
  }
  for (int64_t c = 0; c < kc; ++c) {
    const __m256 w0 = LoadEight(panel + c * kPanel), w1 = LoadEight(panel + c * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + c);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}

// A step of one to three rows: a tile's 2 to 6 chains cannot hide the FMA latency (4 cycles, 2
// units: 8 chains in flight), so this tile takes kPanels whole panels at once, each chain still
// running through every column in order from zero. Eight weights at a time keep the live vectors
// at 16 for 3 rows × 2 panels (12 accumulators, 3 rows of x, 1 of w). `panel` is the first panel,
// the others `panel_stride` values apart; y's 16 · kPanels columns are contiguous.
template <typename W, int kRows, int kPanels>
__attribute__((target("avx2,fma,f16c"))) void Avx2WideTile(const float* x, int64_t ldx, const W* panel,
                                                      int64_t panel_stride, int64_t k, float* y, int64_t ldy) {
  __m256 acc[kRows][kPanels][2];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int q = 0; q < kPanels; ++q) acc[r][q][0] = acc[r][q][1] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < k; ++c) {
    __m256 xr[kRows];
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) xr[r] = _mm256_broadcast_ss(x + r * ldx + c);
#pragma GCC unroll 8
    for (int q = 0; q < kPanels; ++q) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 wh = LoadEight(panel + q * panel_stride + c * kPanel + 8 * h);
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) acc[r][q][h] = _mm256_fmadd_ps(xr[r], wh, acc[r][q][h]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 8
    for (int q = 0; q < kPanels; ++q) {
      _mm256_storeu_ps(y + r * ldy + q * kPanel, acc[r][q][0]);
      _mm256_storeu_ps(y + r * ldy + q * kPanel + 8, acc[r][q][1]);
    }
  }
}

template <typename W>
constexpr TileFn<W> kAvx2Tiles[kTileRows + 1] = {nullptr,        Avx2Tile<W, 1>, Avx2Tile<W, 2>, Avx2Tile<W, 3>,
                                                 Avx2Tile<W, 4>, Avx2Tile<W, 5>, Avx2Tile<W, 6>};

#endif  // __x86_64__

// A tile of `rows` (≤ kTileRows) rows whose panel has `cols` of its 16 features in y: the last
// panel's tile goes through a 16-wide copy.
template <typename W>
void RunTile(const TileFn<W>* tiles, const float* x, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy,
             int64_t rows, int64_t cols, bool from_zero) {
  if (cols == kPanel) {
    tiles[rows](x, ldx, panel, kc, y, ldy, from_zero);
    return;
  }
  float tile[kTileRows][kPanel] = {};
  for (int64_t r = 0; !from_zero && r < rows; ++r) std::copy_n(y + r * ldy, cols, tile[r]);
  tiles[rows](x, ldx, panel, kc, tile[0], kPanel, from_zero);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(tile[r], cols, y + r * ldy);
}

bool UseAvx2() {
#if defined(__x86_64__)
  static const bool f16c = __builtin_cpu_supports("f16c");  // every AVX2 CPU made has it
  return CpuHasAvx2Fma() && f16c;
#else
  return false;
#endif
}

template <typename W>
const TileFn<W>* Tiles(bool avx2) {
#if defined(__x86_64__)
  if (avx2) return kAvx2Tiles<W>;
#endif
  return kPortableTiles<W>;
}

#if defined(__x86_64__)
// A product of one to three rows over whole panels from `begin`, several panels a tile
// (Avx2WideTile): 4 at one row, 3 at two, 2 at three (8, 12 and 12 chains). Returns the first
// panel not done.
template <typename W>
int64_t WidePanels(const float* x, const PackedWeights& w, float* y, int64_t rows, int64_t begin, int64_t end) {
  const int64_t n = w.n(), k = w.k(), stride = k * kPanel;
  const int64_t whole_end = std::min(end, n / kPanel);  // panels with all 16 features
  const int64_t width = 5 - rows;
  int64_t p = begin;
  for (; p + width <= whole_end; p += width) {
    if (rows == 1) {
      Avx2WideTile<W, 1, 4>(x, k, w.panel<W>(p), stride, k, y + p * kPanel, n);
    } else if (rows == 2) {
      Avx2WideTile<W, 2, 3>(x, k, w.panel<W>(p), stride, k, y + p * kPanel, n);
    } else {
      Avx2WideTile<W, 3, 2>(x, k, w.panel<W>(p), stride, k, y + p * kPanel, n);
    }
  }
  return p;
}
#endif

// Panels [begin, end) of y[rows, n]: the rows in blocks of kBlockRows, each block's columns in
// slices of kBlockK, each slice swept over the panels tile by tile (at one to three rows, on
// AVX2, several panels a tile).
template <typename W>
void Panels(bool avx2, const float* x, const PackedWeights& w, float* y, int64_t rows, int64_t begin, int64_t end) {
  const TileFn<W>* tiles = Tiles<W>(avx2);
  const int64_t n = w.n(), k = w.k();
#if defined(__x86_64__)
  if (avx2 && rows >= 1 && rows <= 3) begin = WidePanels<W>(x, w, y, rows, begin, end);
  // The last one to three rows past whole tiles as a product of their own, through the wide tiles:
  // streaming the weights once more costs less than their latency-bound tile (7 and 8 rows: -33%).
  if (const int64_t rest = rows % kTileRows; avx2 && rows > kTileRows && rest <= 3 && rest > 0) {
    rows -= rest;
    Panels<W>(avx2, x + rows * k, w, y + rows * n, rest, begin, end);
  }
#endif
  // One tile of rows reuses no slice of a panel: its chains run through k in one go.
  const int64_t block_k = rows <= kTileRows ? k : kBlockK;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
    const int64_t r1 = std::min(rows, r0 + kBlockRows);
    for (int64_t c0 = 0; c0 < k; c0 += block_k) {
      const int64_t kc = std::min(block_k, k - c0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        for (int64_t r = r0; r < r1; r += kTileRows) {
          RunTile(tiles, x + r * k + c0, k, w.panel<W>(p) + c0 * kPanel, kc, y + r * n + p * kPanel, n,
                  std::min(kTileRows, r1 - r), cols, c0 == 0);
        }
      }
    }
  }
}

// Panels [begin, end) of w's product, by the kernel for its storage.
void PanelsOf(bool avx2, const float* x, const PackedWeights& w, float* y, int64_t rows, int64_t begin, int64_t end) {
  switch (w.storage()) {
    case PackedWeights::Storage::kFloat32:
      return Panels<float>(avx2, x, w, y, rows, begin, end);
    case PackedWeights::Storage::kBFloat16:
      return Panels<uint16_t>(avx2, x, w, y, rows, begin, end);
    case PackedWeights::Storage::kFloat16:
      return Panels<_Float16>(avx2, x, w, y, rows, begin, end);
  }
}

// Whether v is a float16 value (by its bits: a checkpoint's billions of weights are checked at load,
// and without F16C a conversion is a library call).
bool IsFloat16(float v) {
  const uint32_t magnitude = std::bit_cast<uint32_t>(v) & 0x7fffffffu;
  if (magnitude == 0 || magnitude == 0x7f800000u) return true;  // ±0, ±inf
  const int exponent = int(magnitude >> 23) - 127;
  if (exponent > 15 || exponent < -24) return false;  // NaN too
  // float16 keeps 10 fraction bits down to 2^-14, then one fewer per halving (subnormals).
  const int dropped = exponent >= -14 ? 13 : 13 + (-14 - exponent);
  return (magnitude & ((1u << dropped) - 1)) == 0;
}

// v's float16 bits, v a float16 value (IsFloat16).
uint16_t Float16Bits(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v), magnitude = bits & 0x7fffffffu;
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  if (magnitude == 0) return sign;
  if (magnitude == 0x7f800000u) return sign | 0x7c00u;
  const int exponent = int(magnitude >> 23) - 127;
  const uint32_t fraction = magnitude & 0x7fffffu;
  if (exponent >= -14) return uint16_t(sign | uint32_t(exponent + 15) << 10 | fraction >> 13);
  return uint16_t(sign | (fraction | 0x800000u) >> (13 + (-14 - exponent)));  // subnormal
}

// The narrowest storage that holds every value exactly: bfloat16 when each float32's lower 16 bits
// are zero, else float16 when each is a float16 value.
PackedWeights::Storage StorageFor(const float* w, int64_t size) {
  const auto all = [&](auto&& is) {
    for (int64_t i = 0; i < size; ++i) {
      if (!is(w[i])) return false;
    }
    return true;
  };
  if (all([](float v) { return (std::bit_cast<uint32_t>(v) & 0xffffu) == 0; })) {
    return PackedWeights::Storage::kBFloat16;
  }
  return all(IsFloat16) ? PackedWeights::Storage::kFloat16 : PackedWeights::Storage::kFloat32;
}

// A value as stored in T: its float32, its upper 16 bits (bfloat16) or its float16.
template <typename T>
T Narrow(float v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return uint16_t(std::bit_cast<uint32_t>(v) >> 16);
  } else if constexpr (std::is_same_v<T, _Float16>) {
    return std::bit_cast<_Float16>(Float16Bits(v));
  } else {
    return v;
  }
}

// w[n, k] into panels of T, zeros past n.
template <typename T>
void Pack(const float* w, int64_t n, int64_t k, int64_t num_panels, T* out) {
  for (int64_t p = 0; p < num_panels; ++p) {
    for (int64_t c = 0; c < k; ++c) {
      for (int64_t l = 0; l < kPanel; ++l) {
        const int64_t j = p * kPanel + l;
        *out++ = Narrow<T>(j < n ? w[j * k + c] : 0.0f);
      }
    }
  }
}

}  // namespace

PackedWeights::PackedWeights(const float* w, int64_t n, int64_t k) : n_(n), k_(k), storage_(StorageFor(w, n * k)) {
  DUET_CHECK(n >= 1 && k >= 1);
  const int64_t values = num_panels() * k * kPanel;  // a multiple of 16: whole 32- or 64-byte columns
  const size_t value_bytes = storage_ == Storage::kFloat32 ? sizeof(float) : sizeof(uint16_t);
  data_.reset(static_cast<std::byte*>(::operator new[](size_t(values) * value_bytes, kAlignment)));
  switch (storage_) {
    case Storage::kFloat32:
      Pack(w, n, k, num_panels(), reinterpret_cast<float*>(data_.get()));
      break;
    case Storage::kBFloat16:
      Pack(w, n, k, num_panels(), reinterpret_cast<uint16_t*>(data_.get()));
      break;
    case Storage::kFloat16:
      Pack(w, n, k, num_panels(), reinterpret_cast<_Float16*>(data_.get()));
      break;
  }
}

void PackedWeights::Free::operator()(std::byte* p) const { ::operator delete[](p, kAlignment); }

void PackedWeights::CopyRow(int64_t j, float* out) const {
  DUET_CHECK(j >= 0 && j < n_);
  auto copy = [&](const auto* panel_start) {
    const auto* from = panel_start + j % kPanel;
    for (int64_t c = 0; c < k_; ++c) out[c] = Widen(from[c * kPanel]);
  };
  switch (storage_) {
    case Storage::kFloat32:
      return copy(panel<float>(j / kPanel));
    case Storage::kBFloat16:
      return copy(panel<uint16_t>(j / kPanel));
    case Storage::kFloat16:
      return copy(panel<_Float16>(j / kPanel));
  }
}

void BatchedGemvPortable(const float* x, const PackedWeights& w, float* y, int64_t rows) {
  DUET_CHECK(rows >= 0 && w.n() >= 1);
  PanelsOf(/*avx2=*/false, x, w, y, rows, 0, w.num_panels());
}

bool BatchedGemvUsesAvx2() { return UseAvx2(); }

void BatchedGemv(const float* x, const PackedWeights& w, float* y, int64_t rows, ParallelFor* pool) {
  DUET_CHECK(rows >= 0 && w.n() >= 1);
  const bool avx2 = UseAvx2();
  const int64_t panels = w.num_panels();
  // Below this many multiply-adds a call is over before workers could help.
  constexpr int64_t kMinParallelWork = int64_t(1) << 18;
  if (pool == nullptr || pool->num_threads() == 1 || rows * w.n() * w.k() < kMinParallelWork) {
    PanelsOf(avx2, x, w, y, rows, 0, panels);
    return;
  }
  // Each thread streams its own panels; every y[r, j] is still one thread's chain.
  const int64_t parts = pool->num_threads();
  pool->Run([&](int part) { PanelsOf(avx2, x, w, y, rows, panels * part / parts, panels * (part + 1) / parts); });
}

}  // namespace duet
