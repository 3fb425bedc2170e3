// The CPU backend's matrix product: y[rows, n] = x[rows, k] · w[n, k]ᵀ (w in Hugging Face
// [out_features, in_features] layout), over weights packed once at load time (PackedWeights): a
// register-blocked GEMM whose tiles of 6 activation rows × 16 output features accumulate in
// registers, broadcasting x against the packed 16-feature rows of w (a step of one or two rows
// takes several panels a tile, so enough chains are in flight to hide the FMA latency).
//
// Why not BLAS: every y[r, j] here is one chain of fused multiply-adds over c = 0, 1, …, k - 1,
// y = fma(x[r, c], w[j, c], y) from 0, whatever `rows` is, whichever tile or thread computes it
// and however the product is blocked, so a token's logits depend neither on the other tokens of
// its step nor on the thread count. OpenBLAS's sums change with the row count and the column
// split; it also packs the weight panel on every call, which a step of a few tokens (decode,
// verification) feels. On two Zen 4 cores (cpu_gemv_bench, bf16 weights) this runs at 0.98–1.07×
// sgemm's speed at 256 rows and faster below (1.4× at 32 rows, 2.4–2.6× at one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/check.h"
#include "common/parallel_for.h"

namespace duet {

// w[n, k] packed for BatchedGemv: panels of kPanel output features, each k-major, i.e.
// [ceil(n / 16), k, 16]; w[j, c] is at ((j / 16) · k + c) · 16 + j % 16, and the last panel's
// features past n are zeros. 64-byte aligned.
//
// Stored as bfloat16 or as float16 when every value is one (a bf16 or fp16 checkpoint's are): the
// kernel widens each to the float32 it stands for (exactly), so the products are the same bits as
// from float32 panels, with half the bytes to stream (and to hold), which is what a step of a few
// rows waits for.
class PackedWeights {
 public:
  static constexpr int64_t kPanel = 16;
  enum class Storage : uint8_t { kFloat32, kBFloat16, kFloat16 };

  PackedWeights() = default;
  // Packs w[n, k] (row-major): as bfloat16 when every value of w is one, else as float16 when
  // every value is one, else as float32.
  PackedWeights(const float* w, int64_t n, int64_t k);

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  Storage storage() const { return storage_; }
  int64_t num_panels() const { return (n_ + kPanel - 1) / kPanel; }
  // Panel p: [k, kPanel] values of the storage's type (T of its size: float, or the 16-bit
  // patterns of bfloat16 or float16).
  template <typename T>
  const T* panel(int64_t p) const {
    DUET_CHECK(sizeof(T) == (storage_ == Storage::kFloat32 ? 4 : 2));
    return reinterpret_cast<const T*>(data_.get()) + p * k_ * kPanel;
  }
  // w[j, 0..k) into out (k floats): the embedding lookup of an LM head tied to the embeddings.
  void CopyRow(int64_t j, float* out) const;

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  int64_t n_ = 0, k_ = 0;
  Storage storage_ = Storage::kFloat32;
  std::unique_ptr<std::byte[], Free> data_;
};

// y[rows, n] = x[rows, k] · w[n, k]ᵀ. AVX2/FMA when the CPU has them, portable code otherwise
// (the same bits: both are the fma chain above). With `pool`, a product big enough splits its
// panels across the pool's threads (the result is bitwise the same).
void BatchedGemv(const float* x, const PackedWeights& w, float* y, int64_t rows, ParallelFor* pool = nullptr);

// The portable kernel alone (the reference the AVX2 one is tested against, and the fallback).
void BatchedGemvPortable(const float* x, const PackedWeights& w, float* y, int64_t rows);

// Whether BatchedGemv runs the AVX2/FMA kernel on this CPU.
bool BatchedGemvUsesAvx2();

}  // namespace duet
