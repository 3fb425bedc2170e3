// The CPU backend's matrix product: y[rows, n] = x[rows, k] · w[n, k]ᵀ (w in Hugging Face
// [out_features, in_features] layout), as a batched GEMV: each weight row is dotted against every
// activation row while it sits in L1, the activation rows taken in panels that stay in L2.
//
// Why not BLAS: every y[r, j] here is the same float32 sum in the same order whatever `rows` is
// and however the pool splits the work, so a token's logits depend neither on the other tokens
// of its step nor on the thread count. For a step of a few tokens (decode, verification) it is
// also faster than OpenBLAS, which packs the weight panel on every call; from ~16 rows up sgemm
// is faster (1.3–1.4× at 256–2048 rows on two Zen 3 cores, cpu_gemv_bench) but its sums change
// with the row count and the column split.
#pragma once

#include <cstdint>

#include "common/parallel_for.h"

namespace duet {

// y[rows, n] = x[rows, k] · w[n, k]ᵀ. AVX2/FMA when the CPU has them, portable code otherwise.
// With `pool`, a product big enough splits its weight rows across the pool's threads (the
// result is bitwise the same).
void BatchedGemv(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k,
                 ParallelFor* pool = nullptr);

// The portable kernel alone (the reference the AVX2 one is tested against, and the fallback).
void BatchedGemvPortable(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k);

// Whether BatchedGemv runs the AVX2/FMA kernel on this CPU.
bool BatchedGemvUsesAvx2();

}  // namespace duet
