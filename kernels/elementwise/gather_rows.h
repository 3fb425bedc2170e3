// Row gather for bf16 activations (the last layer's rows that reach the LM head).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// dst[i, :] = src[row_index[i], :] for i in [0, rows); src and dst bf16 [*, width], distinct
// buffers. width must be a multiple of 8; src and dst 16-byte aligned.
void GatherRows(const __nv_bfloat16* src, const int32_t* row_index, __nv_bfloat16* dst, int rows, int width,
                cudaStream_t);

}  // namespace duet::kernels
