// Tensor-core GEMM for decode batches: y[rows, out] = x[rows, in] · W[out, in]^T with
// 1 <= rows <= kSkinnyGemmMaxRows, bf16 inputs, fp32 accumulation, bf16 or fp32 output (HF's
// row-major nn.Linear layout). The engine (backends/cuda/cublas_linear) gives it 3 rows and more:
// 1-2 go to the warp-per-feature Gemv (kernels/gemv.h), whose epilogues fuse RoPE and SiLU·mul.
//
// At these row counts a projection is a stream over its weights: 64 rows do 64 FLOP per weight
// byte, under a third of what the H200's tensor cores sustain per byte of HBM bandwidth. So the
// kernel is built for the stream, not the arithmetic: each CTA (one warpgroup) owns a
// 128-feature slice of W (all rows of x at once, so W is read exactly once), pulls it through a
// cp.async pipeline of 64-wide K blocks, 3 to 8 stages deep (the deepest at which the whole grid
// is resident), and multiplies with wgmma (sm_90a): the slice's features are the instruction's
// M (2 x 64), x's rows its N (rounded up to 16, 32 or 64), both operands K-major in 128-byte
// swizzled shared memory. (mma.sync tiles ran into the tensor cores' issue rate from 32 rows on:
// the four Llama-3-8B projections at 64 rows took 1.29x their 4-row time, with wgmma 1.11x.)
// Projections with few 128-feature slices (o and down at Llama-3-8B's 4096 features: 32 slices
// for 132 SMs) split K over a thread-block cluster of 2, 4 or 8 CTAs so every SM streams: each CTA
// parks its partial tile in its shared memory and then sums one share of the tile over the
// cluster's CTAs (distributed shared memory), in split order — deterministic, with no workspace
// in device memory, and the same sums whatever the row count, so a row's result does not depend
// on its batch.
//
// Plan/run: PlanSkinnyGemm picks the split for a shape on a device (the same plan for every row
// count of a shape); SkinnyGemm runs it. Launched with programmatic dependent launch
// (kernels/launch.cuh): the first stages' weight loads are issued before the kernel waits for the
// one that produces x.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

constexpr int kSkinnyGemmMaxRows = 64;
// Up to this many rows it beats cuBLAS on the H200 (skinny_gemm_bench: the Llama-3-8B projections
// back to back at 4-32 rows in 0.89-0.94x cuBLAS's time; a decode step at batch 8 8.5% and at 32
// 4.8% shorter). At 48-64 rows the products are at parity and the step ~3% longer.
constexpr int kSkinnyGemmPreferredMaxRows = 32;

struct SkinnyGemmParams {
  const __nv_bfloat16* x;       // [rows, in], 16-byte aligned
  const __nv_bfloat16* weight;  // [out, in], 16-byte aligned
  void* y;                      // [rows, out]: bf16, or fp32 when y_fp32
  int rows, in, out;            // in a multiple of 8
  bool y_fp32 = false;
};

struct SkinnyGemmPlan {
  int splits = 1;          // K ranges per 128-feature slice: the cluster size, 1, 2, 4 or 8
  int k_blocks_per_split;  // 64-wide K blocks each split covers (the last may cover fewer, or none)
  int num_sms;             // of the device planned for
};

// Split K so that slices x splits gives every SM one or two CTAs (each then runs the deepest
// pipeline its shared memory holds), with at least 4 K blocks per split. Shapes with more than
// 3/4 as many slices as SMs are not split.
SkinnyGemmPlan PlanSkinnyGemm(int in, int out, int num_sms);

// Sets every kernel variant's shared-memory limit and asks the device how many of each it holds
// at once (what SkinnyGemm picks its pipeline depth by). Call once on the device before launches
// are captured into graphs; SkinnyGemm does it lazily otherwise.
void PrepareSkinnyGemm(int num_sms);

// Needs plan.num_sms to be the device's; x and weight 16-byte aligned.
void SkinnyGemm(const SkinnyGemmParams& params, const SkinnyGemmPlan& plan, cudaStream_t stream);

}  // namespace duet::kernels
