// A batched GEMV for the few-row matrix products of a decode or verification step on the CPU:
// y[rows, n] = x[rows, k] · w[n, k]ᵀ (w in Hugging Face [out_features, in_features] layout).
//
// Why: a step of a few tokens is bound by reading the weights, not by arithmetic. OpenBLAS
// sgemm packs the weight panel on every call, so a 9-row product costs several one-row GEMVs;
// this kernel streams each weight row once from memory and dots it against every activation
// row while it sits in L1, so the cost of a step grows slowly with its row count.
//
// Every y[r, j] is the same float32 sum in the same order whatever `rows` is, so a token's
// logits do not depend on how many other tokens share its step.
#pragma once

#include <cstdint>

#include "common/parallel_for.h"

namespace duet {

// Up to this many rows the batched GEMV beats sgemm on the CPUs we measured (see cpu_gemv_bench).
inline constexpr int64_t kBatchedGemvMaxRows = 16;

// y[rows, n] = x[rows, k] · w[n, k]ᵀ. AVX2/FMA when the CPU has them, portable code otherwise.
// With `pool`, a product big enough splits its weight rows across the pool's threads (the
// result is bitwise the same). Any rows >= 0 is correct; rows <= kBatchedGemvMaxRows is where it
// pays.
void BatchedGemv(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k,
                 ParallelFor* pool = nullptr);

// The portable kernel alone (the reference the AVX2 one is tested against, and the fallback).
void BatchedGemvPortable(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k);

// Whether BatchedGemv runs the AVX2/FMA kernel on this CPU.
bool BatchedGemvUsesAvx2();

}  // namespace duet
