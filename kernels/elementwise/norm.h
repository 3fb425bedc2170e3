// Fused residual add + RMSNorm (Llama's input/post-attention/final norms) on the fp32 residual stream.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// residual (fp32, [rows, dim]) += delta (bf16 [rows, dim], may be null); then
// out (bf16 [rows, dim]) = bf16(residual * rsqrt(mean(residual^2) + eps)) * weight, like HF LlamaRMSNorm
// (normalize in fp32, round to bf16, multiply by the bf16 weight). `row_index` (may be null) picks
// which residual rows row i works on: residual[row_index[i]] += delta[i], out row i =
// norm(residual[row_index[i]]) (the last layer and the final norm on only the rows that need
// logits); its entries must be distinct when delta is set.
// dim must be a multiple of 8 and at most 32768; pointers 16-byte aligned.
struct RmsNormParams {
  float* residual;
  const __nv_bfloat16* delta;
  const __nv_bfloat16* weight;
  const int32_t* row_index;
  __nv_bfloat16* out;
  int rows;
  int dim;
  float eps;
};
void FusedAddRmsNorm(const RmsNormParams&, cudaStream_t);

}  // namespace duet::kernels
