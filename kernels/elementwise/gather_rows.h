// Row gathers from bf16 matrices: the token embedding lookup into the fp32 residual stream, and
// activation rows (the last layer's rows that reach the LM head).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// residual[r, :] = float(table[tokens[r], :]); table bf16 [vocab, dim], residual fp32 [rows, dim].
// Every token must be in [0, vocab) (the caller validates ids). dim must be a multiple of 8;
// table and residual 16-byte aligned.
void EmbeddingGather(const int32_t* tokens, const __nv_bfloat16* table, float* residual, int rows, int dim,
                     cudaStream_t);

// dst[i, :] = src[row_index[i], :] for i in [0, rows); src and dst bf16 [*, width], distinct
// buffers. width must be a multiple of 8; src and dst 16-byte aligned.
void GatherRows(const __nv_bfloat16* src, const int32_t* row_index, __nv_bfloat16* dst, int rows, int width,
                cudaStream_t);

}  // namespace duet::kernels
