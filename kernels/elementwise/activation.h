// SiLU-gated MLP activation (Llama's act_fn(gate) * up).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// out[r, i] = silu(gate[r, i]) * up[r, i] computed in fp32 (one bf16 rounding); in = [rows, 2*inter]:
// gate columns first, then up; out = [rows, inter]. inter must be a multiple of 8; pointers 16-byte aligned.
void SiluAndMul(const __nv_bfloat16* in, __nv_bfloat16* out, int rows, int inter, cudaStream_t);

}  // namespace duet::kernels
