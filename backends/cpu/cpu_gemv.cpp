#include "backends/cpu/cpu_gemv.h"

#include <algorithm>
#include <cmath>
#include <new>

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
// columns: x's rows ldx apart from the first of them, `panel` the packed rows from there on.
// `from_zero`: the chains start here (else they continue from y).
using TileFn = void (*)(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                        bool from_zero);

// std::fma is one instruction where the CPU has FMA (aarch64, x86 with FMA); on an x86 CPU
// without it, it is emulated: slow, but the same bits as the AVX2 kernel.
template <int kRows>
void PortableTile(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
                  bool from_zero) {
  float acc[kRows][kPanel];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t l = 0; l < kPanel; ++l) acc[r][l] = from_zero ? 0.0f : y[r * ldy + l];
  }
  for (int64_t c = 0; c < kc; ++c) {
    for (int r = 0; r < kRows; ++r) {
      for (int64_t l = 0; l < kPanel; ++l) acc[r][l] = std::fma(x[r * ldx + c], panel[c * kPanel + l], acc[r][l]);
    }
  }
  for (int r = 0; r < kRows; ++r) std::copy_n(acc[r], kPanel, y + r * ldy);
}

constexpr TileFn kPortableTiles[kTileRows + 1] = {nullptr,         PortableTile<1>, PortableTile<2>, PortableTile<3>,
                                                  PortableTile<4>, PortableTile<5>, PortableTile<6>};

#if defined(__x86_64__)

template <int kRows>
__attribute__((target("avx2,fma"))) void Avx2Tile(const float* x, int64_t ldx, const float* panel, int64_t kc,
                                                  float* y, int64_t ldy, bool from_zero) {
  // The fixed-trip loops must unroll (at -O2 too) so the accumulators live in registers.
  __m256 acc[kRows][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = from_zero ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy);
    acc[r][1] = from_zero ? _mm256_setzero_ps() : _mm256_loadu_ps(y + r * ldy + 8);
  }
  for (int64_t c = 0; c < kc; ++c) {
    const __m256 w0 = _mm256_load_ps(panel + c * kPanel), w1 = _mm256_load_ps(panel + c * kPanel + 8);
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

constexpr TileFn kAvx2Tiles[kTileRows + 1] = {nullptr,     Avx2Tile<1>, Avx2Tile<2>, Avx2Tile<3>,
                                              Avx2Tile<4>, Avx2Tile<5>, Avx2Tile<6>};

#endif  // __x86_64__

// A tile of `rows` (≤ kTileRows) rows whose panel has `cols` of its 16 features in y: the last
// panel's tile goes through a 16-wide copy.
void RunTile(const TileFn* tiles, const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy,
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

// Panels [begin, end) of y[rows, n]: the rows in blocks of kBlockRows, each block's columns in
// slices of kBlockK, each slice swept over the panels tile by tile.
void Panels(const TileFn* tiles, const float* x, const PackedWeights& w, float* y, int64_t rows, int64_t begin,
            int64_t end) {
  const int64_t n = w.n(), k = w.k();
  // One tile of rows reuses no slice of a panel: its chains run through k in one go.
  const int64_t block_k = rows <= kTileRows ? k : kBlockK;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
    const int64_t r1 = std::min(rows, r0 + kBlockRows);
    for (int64_t c0 = 0; c0 < k; c0 += block_k) {
      const int64_t kc = std::min(block_k, k - c0);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        for (int64_t r = r0; r < r1; r += kTileRows) {
          RunTile(tiles, x + r * k + c0, k, w.panel(p) + c0 * kPanel, kc, y + r * n + p * kPanel, n,
                  std::min(kTileRows, r1 - r), cols, c0 == 0);
        }
      }
    }
  }
}

const TileFn* Tiles() {
#if defined(__x86_64__)
  if (CpuHasAvx2Fma()) return kAvx2Tiles;
#endif
  return kPortableTiles;
}

}  // namespace

PackedWeights::PackedWeights(const float* w, int64_t n, int64_t k) : n_(n), k_(k) {
  DUET_CHECK(n >= 1 && k >= 1);
  const int64_t size = num_panels() * k * kPanel;  // a multiple of 16 floats: whole cache lines
  data_.reset(static_cast<float*>(::operator new[](size_t(size) * sizeof(float), kAlignment)));
  float* out = data_.get();
  for (int64_t p = 0; p < num_panels(); ++p) {
    for (int64_t c = 0; c < k; ++c) {
      for (int64_t l = 0; l < kPanel; ++l) {
        const int64_t j = p * kPanel + l;
        *out++ = j < n ? w[j * k + c] : 0.0f;
      }
    }
  }
}

void PackedWeights::Free::operator()(float* p) const { ::operator delete[](p, kAlignment); }

void PackedWeights::CopyRow(int64_t j, float* out) const {
  DUET_CHECK(j >= 0 && j < n_);
  const float* from = panel(j / kPanel) + j % kPanel;
  for (int64_t c = 0; c < k_; ++c) out[c] = from[c * kPanel];
}

void BatchedGemvPortable(const float* x, const PackedWeights& w, float* y, int64_t rows) {
  DUET_CHECK(rows >= 0 && w.n() >= 1);
  Panels(kPortableTiles, x, w, y, rows, 0, w.num_panels());
}

bool BatchedGemvUsesAvx2() { return Tiles() != kPortableTiles; }

void BatchedGemv(const float* x, const PackedWeights& w, float* y, int64_t rows, ParallelFor* pool) {
  DUET_CHECK(rows >= 0 && w.n() >= 1);
  const TileFn* tiles = Tiles();
  const int64_t panels = w.num_panels();
  // Below this many multiply-adds a call is over before workers could help.
  constexpr int64_t kMinParallelWork = int64_t(1) << 18;
  if (pool == nullptr || pool->num_threads() == 1 || rows * w.n() * w.k() < kMinParallelWork) {
    Panels(tiles, x, w, y, rows, 0, panels);
    return;
  }
  // Each thread streams its own panels; every y[r, j] is still one thread's chain.
  const int64_t parts = pool->num_threads();
  pool->Run([&](int part) { Panels(tiles, x, w, y, rows, panels * part / parts, panels * (part + 1) / parts); });
}

}  // namespace duet
