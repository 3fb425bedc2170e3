// Skinny GEMM for decode: y[rows, out] = x[rows, in] · W[out, in]^T with 1 <= rows <= 8, bf16
// inputs, fp32 accumulation, bf16 or fp32 output. Decode is a pure stream over the weights, so
// the kernel is built to keep as many 16-byte weight loads in flight as possible: one warp per
// output feature, each lane reading 16 bytes of W per iteration (x comes from L1/L2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

constexpr int kGemvMaxRows = 8;
// Up to this many rows the kernel beats cuBLAS on the H200 (kernels/gemv_bench.cu); from there
// on cuBLAS's tiling reuses each weight load across rows better.
constexpr int kGemvPreferredMaxRows = 2;

struct GemvParams {
  const __nv_bfloat16* x;       // [rows, in]
  const __nv_bfloat16* weight;  // [out, in]
  void* y;                      // [rows, out]: bf16, or fp32 when y_fp32
  int rows, in, out;            // in a multiple of 8
  bool y_fp32;
};

void Gemv(const GemvParams& params, cudaStream_t stream);

}  // namespace duet::kernels
