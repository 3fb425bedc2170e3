// Bias add for projections with a bias (Qwen2's q/k/v, Llama's optional attention_bias).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// x[r, c] += bias[c] for x bf16 [rows, cols] (cols a multiple of 8), computed in fp32.
void AddBias(__nv_bfloat16* x, const __nv_bfloat16* bias, int rows, int cols, cudaStream_t stream);

}  // namespace duet::kernels
